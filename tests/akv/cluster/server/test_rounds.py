"""A key's rounds on one server: counting pushes, completing rounds, parking pulls."""

from __future__ import annotations

import pytest

from akv.cluster.server.rounds import KeyRounds, PushDecision, longest_wait
from akv.errors import DoublePushError, ServerError


def test_a_round_completes_once_every_worker_pushed():
    rounds = KeyRounds(3, num_workers=2, sync=True)
    first = rounds.accept_push(1, now=0.0)
    assert (first.first, first.closes, first.round) == (True, False, 1)
    assert rounds.missing() == [0]
    second = rounds.accept_push(0, now=0.1)
    assert (second.first, second.closes, second.round) == (False, True, 1)
    assert rounds.missing() == []


def test_a_worker_pushing_twice_in_a_round_is_an_error_and_the_round_is_untouched():
    rounds = KeyRounds(3, num_workers=2, sync=True)
    rounds.accept_push(0, now=0.0)
    with pytest.raises(DoublePushError, match=r"worker 0 pushed key 3 twice in round 1.*\[1\]"):
        rounds.accept_push(0, now=0.1)
    assert rounds.missing() == [1]
    assert rounds.accept_push(1, now=0.2).closes


def test_a_pull_waits_for_the_round_of_the_pullers_last_push():
    rounds = KeyRounds("w", num_workers=2, sync=True)
    assert rounds.pull(rounds.last_push_round(0), "before any push")
    rounds.accept_push(0, now=0.0)
    assert not rounds.pull(rounds.last_push_round(0), "ticket-0")
    assert rounds.pull(rounds.last_push_round(1), "worker 1 has not pushed: answer now")
    decision = rounds.accept_push(1, now=0.0)
    assert decision.closes
    assert rounds.applied(decision.round) == ["ticket-0"]
    assert rounds.waiting_tickets() == []


def test_a_pull_for_a_round_never_pushed_is_refused():
    rounds = KeyRounds(1, num_workers=2, sync=True)
    with pytest.raises(ServerError, match="asks for round 2"):
        rounds.pull(2, "t")


def test_overdue_rounds_name_the_missing_workers():
    rounds = KeyRounds(1, num_workers=3, sync=True)
    rounds.accept_push(2, now=10.0)
    assert not rounds.overdue(now=15.0, timeout_s=10.0)
    assert rounds.overdue(now=21.0, timeout_s=10.0)
    assert rounds.missing() == [0, 1]
    rounds.pull(1, "t1")
    assert rounds.take_waiting() == ["t1"]


def test_async_pushes_are_rounds_of_their_own_and_pulls_never_wait():
    rounds = KeyRounds(1, num_workers=2, sync=False)
    assert rounds.accept_push(0, 0.0).closes
    again = rounds.accept_push(0, 0.0)
    assert (again.closes, again.round) == (True, 2)
    assert rounds.pull(rounds.last_push_round(0), "t")


def test_an_unknown_worker_rank_cannot_push():
    with pytest.raises(ServerError, match="unknown worker rank 5"):
        KeyRounds(1, num_workers=2, sync=True).accept_push(5, 0.0)


def test_the_push_that_closes_a_sync_round_says_how_long_the_round_waited_for_it():
    rounds = KeyRounds("w", num_workers=3, sync=True)
    assert rounds.accept_push(2, now=1.0).waited_s is None
    assert rounds.accept_push(0, now=1.5).waited_s is None
    assert rounds.accept_push(1, now=3.5).waited_s == 2.5  # since the round's first push
    assert rounds.accept_push(1, now=10.0).waited_s is None  # the next round opens at 10
    assert rounds.accept_push(0, now=10.5).waited_s is None
    assert rounds.accept_push(2, now=11.0).waited_s == 1.0


def test_an_async_push_waits_for_nobody():
    rounds = KeyRounds("w", num_workers=2, sync=False)
    decision = rounds.accept_push(0, now=1.0)
    assert decision.closes and decision.waited_s is None


def test_a_frames_rounds_report_their_longest_wait():
    closing = PushDecision(first=False, closes=True, round=1, waited_s=2.0)
    assert longest_wait(None, closing) == 2.0
    assert longest_wait(3.0, closing) == 3.0
    assert longest_wait(1.0, closing) == 2.0
    assert longest_wait(1.0, PushDecision(first=True, closes=False, round=1)) == 1.0
    assert longest_wait(None, PushDecision(first=True, closes=True, round=1)) is None


def test_a_failed_round_is_told_once_to_each_worker_that_pushed_into_it_and_was_not_told():
    rounds = KeyRounds("w", num_workers=3, sync=True)
    for worker in range(3):
        rounds.accept_push(worker, now=0.0)
    error = ServerError("the update of key 'w' in round 1 failed")
    rounds.failed(1, error, told={1})
    assert rounds.take_untold(0) is error
    assert rounds.take_untold(0) is None  # told once
    assert rounds.take_untold(1) is None  # its waiting pull got the error
    assert rounds.take_untold(2) is error


def test_a_failed_round_in_dist_async_leaves_nothing_untold():
    rounds = KeyRounds("w", num_workers=2, sync=False)
    decision = rounds.accept_push(0, now=0.0)
    rounds.failed(decision.round, ServerError("failed"), told=set())
    assert rounds.take_untold(0) is None  # the push's own answer carries the error
