"""dist_async with bounded staleness, decided without sockets: a push more than ``k``
pushes ahead of the slowest worker waits, with every later frame of its worker; a counted
push of the slow worker lets it go; a wait past the round deadline fails naming the slow
worker (tests/akv/cluster/server/players.py)."""

from __future__ import annotations

import numpy as np
import pytest

from akv.errors import MembershipError, PeerLostError, RoundTimeoutError
from tests.akv.cluster.server.players import OK, Players


def started(bound: int, workers: int = 2) -> Players:
    players = Players(workers, "dist_async", staleness=bound)
    players.init(0, {"w": np.zeros(2, np.float32)})
    return players


def one(value: float) -> dict:
    return {"w": np.full(2, value, np.float32)}


def test_a_push_past_the_bound_waits_with_the_pull_behind_it_until_the_slow_worker_pushes():
    players = started(1)  # no optimizer: each dist_async push replaces the value
    assert players.reply(0, players.push(0, one(1), tag=1)) == OK
    assert players.reply(0, players.push(0, one(2), tag=2)) == OK  # 1 ahead before it
    third = players.push(0, one(3), tag=3)  # 2 ahead before it: waits
    pull = players.pull(0, ["w"])  # waits behind it, so that it sees it
    assert players.waiting(0, third) and players.waiting(0, pull)
    assert len(players.state.waiting) == 2
    assert players.reply(1, players.push(1, one(10), tag=1)) == OK
    assert players.reply(0, third) == OK
    # Answered after the third push was applied (before it, the value was 2, then 10).
    np.testing.assert_array_equal(players.reply(0, pull)["w"], [3, 3])
    assert len(players.state.waiting) == 0


def test_a_checkpoint_plan_holds_no_push_that_waits():
    players = started(0)
    first = players.push(0, one(1), tag=1)
    second = players.push(0, one(2), tag=2)  # waits for worker 1's first push
    assert players.waiting(0, second)
    assert players.state.checkpoint_plan().durable_seqs[0] == second
    players.push(1, one(1), tag=1)
    assert players.reply(0, second) == OK
    assert players.state.checkpoint_plan().durable_seqs[0] == second + 1 > first + 1


def test_a_bound_of_zero_is_lock_step():
    """With k = 0 no worker starts step s + 1 of a key before every worker pushed step s."""
    players = started(0, workers=3)
    mine = [players.push(0, one(step), tag=step) for step in (1, 2, 3)]  # sent at once
    assert players.reply(0, mine[0]) == OK
    assert players.waiting(0, mine[1]) and players.waiting(0, mine[2])
    players.push(1, one(1), tag=1)
    assert players.waiting(0, mine[1])  # worker 2 has not pushed step 1
    players.push(2, one(1), tag=1)
    assert players.reply(0, mine[1]) == OK and players.waiting(0, mine[2])
    players.push(1, one(2), tag=2)
    players.push(2, one(2), tag=2)
    assert players.reply(0, mine[2]) == OK
    assert players.state.entries["w"].rounds.lead(0) == (1, [1, 2])


def test_a_resent_push_counted_already_never_waits():
    players = started(0)
    seq = players.push(0, one(1), tag=1)
    players.push(0, one(1), tag=1, seq=seq)  # resent after a cut: a duplicate
    assert players.reply(0, seq) == OK
    assert len(players.state.waiting) == 0 and players.state.duplicates == 1


def test_a_wait_past_the_round_deadline_fails_naming_the_slow_worker():
    players = started(0)
    players.push(0, one(1), tag=1)
    late = players.push(0, one(1), tag=2)
    players.tick(5.0, round_timeout_s=10.0)
    assert players.waiting(0, late)
    players.tick(11.0, round_timeout_s=10.0)
    error = players.reply(0, late)
    assert isinstance(error, RoundTimeoutError)
    assert "waited 10 s for workers [1]" in str(error) and "more than 0 pushes" in str(error)
    np.testing.assert_array_equal(players.state.entries["w"].value, [1, 1])  # not applied


def test_the_job_failing_answers_every_waiting_frame():
    players = started(0)
    players.push(0, one(1), tag=1)
    late = players.push(0, one(1), tag=2)
    players.run(players.state.job_failed("worker 1 died"))
    assert isinstance(players.reply(0, late), PeerLostError)


def test_every_worker_must_give_the_same_bound():
    players = Players(2, "dist_async", staleness=1)
    players.staleness = 2
    with pytest.raises(MembershipError, match="staleness 2, but this job's workers use 1"):
        players.reconnect(1)
    sync = Players(2, "dist_sync")
    sync.staleness = 1
    with pytest.raises(MembershipError, match="dist_async only"):
        sync.reconnect(0)


def rows_started(bound: int) -> Players:
    players = Players(2, "dist_async", staleness=bound)
    players.row_init(0, "emb", (10, 2), (0, 10))
    players.lend = True  # pushes that may wait must not be read in place
    return players


def test_row_pushes_past_the_bound_wait_with_the_row_pull_behind_them():
    """Row-sparse keys are bounded as dense ones are: with k = 0 the fast worker's second
    push waits for the slow worker's first, and its pull behind it sees it."""
    players = rows_started(0)
    rows = np.ones((1, 2), np.float32)
    assert players.reply(0, players.row_push(0, "emb", [1], rows, tag=1)) == OK
    second = players.row_push(0, "emb", [1], 2 * rows, tag=2)
    pull = players.row_pull(0, "emb", [1])
    assert players.waiting(0, second) and players.waiting(0, pull)
    assert players.state.rows.entries["emb"].rounds.closed_round == 1
    # Under a bound no push is read in place: a parked one's shared memory would be
    # given back to its sender, and overwritten, before the push is read.
    assert players.given_back == []
    assert players.reply(1, players.row_push(1, "emb", [3], rows, tag=1)) == OK
    assert players.reply(0, second) == OK
    # No optimizer: each dist_async push replaces the rows; the pull follows the second.
    np.testing.assert_array_equal(players.reply(0, pull)["emb"], 2 * rows)
    assert len(players.state.waiting) == 0


def test_a_row_push_that_waits_past_the_round_deadline_names_the_slow_worker():
    players = rows_started(0)
    rows = np.ones((1, 2), np.float32)
    players.row_push(0, "emb", [1], rows, tag=1)
    late = players.row_push(0, "emb", [1], rows, tag=2)
    players.tick(100.0, round_timeout_s=10.0)
    error = players.reply(0, late)
    assert isinstance(error, RoundTimeoutError)
    assert "keys ['emb'] by worker 0" in str(error) and "for workers [1]" in str(error)
