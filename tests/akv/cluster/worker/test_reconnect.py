"""A worker's link to one server over cuts (:mod:`akv.cluster.worker.reconnect`): when a cut
stream is opened again, what is sent again on it, and when the worker gives the server up;
played against the worker's state without sockets (:class:`Servers`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from akv.cluster.protocol import Op
from akv.cluster.worker.events import BarrierPassed
from akv.cluster.worker.reconnect import Backoff, Refusal, classify
from akv.errors import PeerLostError, ServerError
from akv.limits import RECONNECT_FIRST_S, RECONNECT_MAX_S, RECONNECT_SILENT_ATTEMPTS
from akv_transport import (
    AuthError,
    FrameError,
    RemoteError,
    StreamEndedError,
    StreamSilentError,
    TransportError,
)
from tests.akv.cluster.worker.servers import Request, Servers, f32, key_entry, zeros

# ---------------------------------------------------------------- opening a cut stream again


def test_a_cut_stream_is_opened_again_at_once_then_after_doubling_waits():
    servers = Servers(request_s=10.0)
    servers.cut(0, ConnectionResetError("reset"))
    assert servers.reconnects == [(0, 0.0)]
    now = 0.0
    while not servers.blamed:
        now += servers.reconnects[-1][1]
        servers.connect_fails(0, TransportError("cannot open a stream"), now)
    delays = [delay for _, delay in servers.reconnects]
    assert delays[:3] == [0.0, RECONNECT_FIRST_S, 2 * RECONNECT_FIRST_S]
    assert max(delays) == RECONNECT_MAX_S and delays[-2:] == [RECONNECT_MAX_S] * 2
    assert now <= 10.0 and now + RECONNECT_MAX_S > 10.0 - RECONNECT_MAX_S
    (blame,) = servers.blamed
    assert blame.cut and "could not be reached again within AKV_REQUEST_TIMEOUT_S (10 s)" in str(
        blame.error
    )
    assert servers.state.links[0].lost is blame.error


@pytest.mark.parametrize(
    ("error", "restartable", "kind", "gives_up"),
    [
        (AuthError("HTTP 401"), False, Refusal.AUTH, "refused to take the stream back"),
        (RemoteError(409, "taken"), False, Refusal.REFUSED, "refused to take the stream back"),
        (RemoteError(503, "stopping"), False, Refusal.STOPPING, "refused to take the stream"),
        (RemoteError(503, "stopping"), True, Refusal.STOPPING, None),
        (PeerLostError("the scheduler refused: job failed"), False, Refusal.JOB_FAILED, "job"),
        (TransportError("no route"), False, Refusal.TRANSPORT, None),
        ("refused", False, Refusal.GONE, "nothing listens at its address any more"),
        ("refused", True, Refusal.GONE, None),
        ("timeout", False, Refusal.SILENT, None),  # once: tried again
        (StreamSilentError("no answer"), True, Refusal.SILENT, None),
    ],
)
def test_a_failed_reconnect_is_classified_and_retried_or_given_up(
    error, restartable, kind, gives_up
):
    if error in ("refused", "timeout"):
        cause = ConnectionRefusedError() if error == "refused" else TimeoutError()
        error = TransportError("cannot open a stream")
        error.__cause__ = cause
    assert classify(error) is kind
    servers = Servers(restartable=restartable)
    servers.cut(0)
    servers.connect_fails(0, error)
    if gives_up is None:
        assert servers.reconnects[-1] == (0, RECONNECT_FIRST_S) and not servers.blamed
        return
    (blame,) = servers.blamed
    assert blame.cut and gives_up in str(blame.error)
    assert servers.reconnects == [(0, 0.0)]


def test_a_reconnect_sends_exactly_the_unanswered_requests_again_in_order():
    servers = Servers()
    w, v = key_entry("w"), key_entry("v")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # answered: not sent again (no checkpoints)
    servers.push({w: f32(2, 2, 2, 2)})
    servers.end_turn()
    out = zeros()
    pull = servers.pull({v: out})
    before = [(r.op, r.seq, r.tags) for r in servers.sent()]
    servers.cut(0)
    servers.open(0)
    assert [(r.op, r.seq, r.tags) for r in servers.sent()] == before
    assert before == [(Op.PUSH, 2, [2]), (Op.PULL, 3, [0])]
    assert servers.state.links[0].reconnects == 1
    servers.answer(servers.take())
    servers.answer(servers.take(), [f32(8, 8, 8, 8)])
    assert pull.done and pull.error is None and servers.state.unacked == 0


def test_a_request_made_while_the_stream_is_cut_goes_once_it_is_open_again():
    servers = Servers()
    w = key_entry("w")
    servers.cut(0)
    pull = servers.pull({w: zeros()})
    assert servers.sent() == [] and not pull.done
    servers.open(0)
    (request,) = servers.sent()
    assert request.op == Op.PULL


def test_a_replay_pulls_a_key_before_pushing_it_again():
    servers = Servers(restartable=True)
    w, v = key_entry("w"), key_entry("v")
    for value in (1.0, 2.0):
        servers.push({w: np.full(4, value, np.float32)})
        servers.end_turn()
        servers.answer(servers.take())  # kept: the server may be restored from before it
    servers.cut(0)
    servers.open(0)
    first, settle = servers.take(), servers.take()
    assert (first.op, first.seq, first.tags) == (Op.PUSH, 1, [1])
    assert settle.op == Op.PULL and settle.keys == ["w"] and settle.seq == 3
    assert servers.sent() == []  # the second push waits for that pull's answer
    pull = servers.pull({v: zeros()})  # made during the replay: waits for it
    assert servers.sent() == []
    servers.answer(settle, [f32(1, 1, 1, 1)])
    second, deferred = servers.take(), servers.take()
    assert (second.op, second.seq, second.tags) == (Op.PUSH, 2, [2])
    assert (deferred.op, deferred.keys) == (Op.PULL, ["v"])
    servers.answer(deferred, [f32(5, 5, 5, 5)])
    assert pull.done and not servers.state.links[0].replaying


@pytest.mark.parametrize("op", [Op.SET_OPTIMIZER, Op.LOAD_STATES])
def test_a_replay_waits_for_the_answer_to_a_new_optimizer_or_states_load(op):
    """Their calls returned once the server applied them (a new optimizer waits there for
    its sender's rounds) before the program sent more: resent, the requests after them wait
    for their answers too (a push of another key went ahead and its round took the old
    optimizer)."""
    servers = Servers(restartable=True)
    w, v = key_entry("w"), key_entry("v")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # seq 1, kept
    changed = servers.request(0, op, text='{"name": "sgd"}')
    servers.answer(servers.take())  # seq 2, kept
    servers.push({v: f32(2, 2, 2, 2)})
    servers.end_turn()
    servers.answer(servers.take())  # seq 3, kept
    assert changed.done
    servers.cut(0)
    servers.open(0)
    push, again = servers.take(), servers.take()
    assert [(r.op, r.seq) for r in (push, again)] == [(Op.PUSH, 1), (op, 2)]
    assert servers.sent() == []  # push 3 waits for that answer
    servers.answer(again)
    (last,) = servers.sent()
    assert (last.op, last.seq, last.keys) == (Op.PUSH, 3, ["v"])


def test_a_dist_async_replay_keeps_the_barriers_between_its_requests():
    """A restarted dist_async server must apply what every worker pushed before a barrier
    before anything pushed after it (a learning rate set between barriers took other
    pushes, and a pull after a barrier missed pushes still to be resent). The replay says
    how many barriers came before its first request (the header), then waits at a replay
    barrier before it, one where each later barrier was, and one (last) at its end."""
    servers = Servers(restartable=True, ordered_replays=True)
    link = servers.state.links[0]
    for value in (1, 2, 3):  # a key each: no pull before a push of it again
        servers.push({key_entry(f"w{value}"): f32(value, value, value, value)})
        servers.end_turn()
        servers.answer(servers.take())  # seqs 1 to 3: kept
        servers.feed(BarrierPassed())  # barriers 1 to 3
        servers.durable(0, below=2)  # push 1 is in a checkpoint: replays start at push 2
    assert list(link.barriers.bounds) == [(2, 3), (3, 4)]  # barrier 1 came before push 2
    assert link.replay_barriers() == 1
    servers.cut(0)
    servers.open(0)
    first = servers.take()
    assert (first.op, first.text) == (Op.REPLAY_BARRIER, "1")
    assert servers.sent() == []  # push 2 waits for every worker to reach barrier 1
    servers.answer(first)
    push, middle = servers.take(), servers.take()
    assert (push.op, push.seq, middle.op, middle.text) == (Op.PUSH, 2, Op.REPLAY_BARRIER, "2")
    servers.answer(push)
    assert servers.sent() == []  # push 3 waits for every worker to reach barrier 2
    servers.answer(middle)
    push, last = servers.take(), servers.take()
    assert (push.op, push.seq, last.op, last.text) == (Op.PUSH, 3, Op.REPLAY_BARRIER, "3 last")
    servers.answer(push)
    servers.answer(last)
    assert not link.replaying
    servers.durable(0, below=last.seq + 1)
    assert link.replay_barriers() == 3  # nothing to send again: from after barrier 3
    servers.cut(0)
    servers.open(0)
    (only,) = servers.sent()
    assert (only.op, only.text) == (Op.REPLAY_BARRIER, "3 last")


def replaying_a_push_after_a_barrier(**options: Any) -> tuple[Servers, Request]:
    """A dist_async worker that pushed (kept), passed a barrier, and whose stream was cut
    and opened again: its servers, and the first request of its replay."""
    servers = Servers(restartable=True, ordered_replays=True, **options)
    servers.push({key_entry("w"): f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # kept
    servers.feed(BarrierPassed())
    servers.cut(0)
    servers.open(0)
    return servers, servers.take()


def test_a_replay_barrier_not_answered_in_time_stops_the_replay_and_fails_the_job():
    """Another worker did not send its requests again within AKV_REQUEST_TIMEOUT_S: the
    replay must not go on (its pushes would be applied out of order: a review's job ended
    well with a push taken at the old learning rate); the job fails naming why."""
    servers, first = replaying_a_push_after_a_barrier(request_s=10.0)
    assert first.op == Op.REPLAY_BARRIER
    servers.tick(11.0)  # its deadline passed
    assert servers.sent() == []  # the push is not sent
    (blame,) = servers.blamed
    assert "a replay after a cut stopped" in str(blame.error) and "in time" in str(blame.error)
    assert servers.state.links[0].replaying  # the requests after it wait for the verdict
    servers.fail(blame.error)
    assert not servers.state.links[0].replaying and servers.sent() == []


def test_a_dist_sync_replay_has_no_replay_barriers():
    servers = Servers(restartable=True)
    servers.push({key_entry("w"): f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())
    servers.feed(BarrierPassed())
    assert servers.state.links[0].replay_barriers() is None
    servers.cut(0)
    servers.open(0)
    assert [r.op for r in servers.sent()] == [Op.PUSH]


def test_a_new_push_of_a_key_the_replay_pushed_again_waits_for_a_pull_of_it_first():
    """The program pulled w after its push, from the server that then died; the replay
    sends that push again, and on the restarted server its round may wait for the other
    workers' resends. The program's next push of w waits for a pull of w (else: a spurious
    DoublePushError, 2 of 3 runs of a review's script); other keys go at once, and only
    the first push of w after the replay waits."""
    servers = Servers(restartable=True)
    w, v = key_entry("w"), key_entry("v")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # kept
    servers.cut(0)
    servers.open(0)
    servers.answer(servers.take())  # the push sent again: the replay is over
    link = servers.state.links[0]
    assert not link.replaying and list(link.unsettled) == ["w"]
    servers.push({v: f32(3, 3, 3, 3)})
    servers.end_turn()
    other = servers.take()
    assert (other.op, other.keys) == (Op.PUSH, ["v"])
    servers.push({w: f32(2, 2, 2, 2)})
    servers.end_turn()
    settle = servers.take()
    assert (settle.op, settle.keys) == (Op.PULL, ["w"]) and servers.sent() == []
    servers.answer(settle, [f32(9, 9, 9, 9)])  # the resent push's round is applied
    push = servers.take()
    assert (push.op, push.keys, push.tags) == (Op.PUSH, ["w"], [2])
    assert not link.replaying and not link.unsettled and servers.sent() == []
    servers.push({w: f32(3, 3, 3, 3)})
    servers.end_turn()
    assert [r.op for r in servers.sent()] == [Op.PUSH]


def test_an_error_of_a_pull_a_replay_waits_for_is_the_programs_next_call_on_the_key():
    """A replay's pull of a key answered with the error of a failed round (the round of a
    push sent again): the program's next call on the key raises it (it was dropped)."""
    servers = Servers(restartable=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # kept
    servers.cut(0)
    servers.open(0)
    servers.answer(servers.take())
    servers.push({w: f32(2, 2, 2, 2)})
    servers.end_turn()
    failed = ServerError("server 0: the update of round 1 of key 'w' failed")
    servers.answer(servers.take(), error=failed)
    late = servers.state.take_late(["w"])
    assert isinstance(late, ServerError) and "the update of round 1" in str(late)
    assert [r.op for r in servers.sent()] == [Op.PUSH]  # the push still goes


def test_a_pushpull_asked_ahead_and_counted_is_resent_once_as_itself():
    servers = Servers(restartable=True, pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    request = servers.take()
    servers.counted(request)  # kept from now on, and still waiting for its round
    assert servers.state.links[0].retained_bytes == 16
    servers.cut(0)
    servers.open(0)
    (again,) = servers.sent()
    assert (again.op, again.seq, again.counted) == (Op.PUSHPULL, request.seq, True)


def test_a_reconnect_resends_the_kept_and_the_unanswered_requests_by_number():
    servers = Servers(restartable=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # seq 1: answered, kept
    servers.pull({w: zeros()})  # seq 2: unanswered
    servers.push({w: f32(2, 2, 2, 2)})
    servers.end_turn()  # seq 3: unanswered
    servers.cut(0)
    servers.open(0)
    # The resent pull is not waited for: push 3 waits for a pull of its own (seq 4).
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 1), (Op.PULL, 2), (Op.PULL, 4)]
    servers.answer(servers.take())  # the kept push's answer again: nobody waits for it
    servers.answer(servers.take(), [f32(1, 1, 1, 1)])
    servers.answer(servers.take(), [f32(1, 1, 1, 1)])
    (push,) = servers.sent()
    assert (push.op, push.seq, push.tags) == (Op.PUSH, 3, [2])


def test_an_answer_to_a_request_resent_after_a_cut_is_taken_once():
    servers = Servers()
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    request = servers.take()
    servers.cut(0)
    servers.open(0)
    servers.answer(servers.take(), [f32(1, 1, 1, 1)])
    servers.answer(request, [f32(2, 2, 2, 2)])  # a late answer to the first copy: ignored
    assert pull.done and pull.error is None


def test_a_cut_during_a_replay_starts_it_again_on_the_next_stream():
    servers = Servers(restartable=True)
    w = key_entry("w")
    for value in (1.0, 2.0):
        servers.push({w: np.full(4, value, np.float32)})
        servers.end_turn()
        servers.answer(servers.take())
    servers.cut(0)
    servers.open(0)  # sends push 1, then waits for the settle pull
    servers.cut(0)
    assert not servers.state.links[0].replaying
    servers.open(0)
    # Kept and unanswered, by number: push 1, push 2 (after a new pull), the first pull.
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 1), (Op.PULL, 4)]
    servers.answer(servers.take())
    servers.answer(servers.take(), [f32(1, 1, 1, 1)])
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 2), (Op.PULL, 3)]
    assert not servers.state.links[0].replaying


def test_a_cut_during_a_dist_async_replay_sends_its_replay_barriers_anew():
    """The replay barriers of a replay cut short are not sent again as they were (the
    last one would tell the server that the replay ended before the requests after it)."""
    servers, first = replaying_a_push_after_a_barrier()
    servers.answer(first)
    push, last = servers.take(), servers.take()
    assert (push.op, last.op, last.text) == (Op.PUSH, Op.REPLAY_BARRIER, "1 last")
    servers.cut(0)  # before the last replay barrier's answer
    servers.open(0)
    again = servers.take()
    assert (again.op, again.text) == (Op.REPLAY_BARRIER, "0")
    servers.answer(again)
    assert [(r.op, r.text) for r in servers.sent()] == [
        (Op.PUSH, ""),
        (Op.REPLAY_BARRIER, "1 last"),
    ]
    assert len(servers.state.links[0].table) == 1  # the new last one only


def test_a_request_deferred_by_a_replay_and_swept_meanwhile_is_not_sent():
    servers = Servers(restartable=True, request_s=10.0)
    w, v = key_entry("w"), key_entry("v")
    for value in (1.0, 2.0):
        servers.push({w: np.full(4, value, np.float32)})
        servers.end_turn()
        servers.answer(servers.take())
    servers.cut(0)
    servers.open(0)
    servers.take()  # push 1
    settle = servers.take()
    servers.now = 5.0
    pull = servers.pull({v: zeros()})  # deferred: the replay waits for the settle pull
    servers.tick(15.5)  # the settle pull (deadline 10) and the deferred pull both time out
    assert isinstance(pull.error, ServerError)
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 2)]
    servers.answer(settle, [f32(1, 1, 1, 1)])  # late: the replay went on without it
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 2)]
    assert not servers.state.links[0].replaying


def test_closing_while_a_stream_is_cut_fails_its_requests_and_stops_reconnecting():
    servers = Servers()
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    servers.cut(0)
    servers.close()
    assert isinstance(pull.error, PeerLostError) and "closed the connection" in str(pull.error)
    servers.connect_fails(0, TransportError("no"))
    assert servers.reconnects == [(0, 0.0)]  # the attempt in flight is the last


@pytest.mark.parametrize("restartable", [False, True])
def test_a_server_that_answers_no_attempt_is_given_up_on_after_a_few(restartable):
    servers = Servers(restartable=restartable, request_s=300.0)
    servers.cut(0, StreamSilentError("no answer for 20 s: the stream is silent"))
    silent = TransportError("cannot open a stream")
    silent.__cause__ = TimeoutError()
    now = 0.0
    while not servers.blamed and now < 300.0:
        now += servers.reconnects[-1][1] + 20.0  # each attempt waits out its deadline
        servers.connect_fails(0, silent, now)
    if restartable:  # its restart is awaited for the whole window
        assert len(servers.reconnects) > RECONNECT_SILENT_ATTEMPTS and now > 250.0
        return
    assert len(servers.reconnects) == RECONNECT_SILENT_ATTEMPTS  # the first, then 2 more
    (blame,) = servers.blamed
    assert str(blame.error).startswith(
        "server 0 went silent (no answer for 20 s: the stream is silent) "
        "and answered none of 3 attempts to open it again"
    ), blame.error


def test_an_attempt_that_is_answered_starts_the_count_of_silent_ones_again():
    servers = Servers(request_s=300.0)
    servers.cut(0)
    silent = TransportError("cannot open a stream")
    silent.__cause__ = TimeoutError()
    for error in (silent, silent, TransportError("reset"), silent, silent):
        servers.connect_fails(0, error, 1.0)
    assert not servers.blamed and servers.state.links[0].silent_attempts == 2


def test_a_stopping_server_that_writes_checkpoints_is_waited_for_until_the_window_ends():
    servers = Servers(restartable=True, request_s=3.0)
    servers.cut(0)
    now = 0.0
    stopping = RemoteError(503, "server 0 takes no stream: it is stopping")
    while not servers.blamed:
        now += servers.reconnects[-1][1]
        servers.connect_fails(0, stopping, now)
    assert len(servers.reconnects) > 4 and now <= 3.0
    assert "could not be reached again" in str(servers.blamed[0].error)
    servers.fail(servers.blamed[0].error)
    servers.open(0)  # an attempt in flight that opened after the job failed
    assert servers.sent() == []


# ---------------------------------------------------------------- cut again and again


def doubling(count: int) -> list[float]:
    """The first ``count`` waits of a series of cuts: at once, then doubling to the longest."""
    waits = [0.0]
    while len(waits) < count:
        waits.append(min(RECONNECT_FIRST_S * 2 ** (len(waits) - 1), RECONNECT_MAX_S))
    return waits[:count]


def cut_again_and_again(servers: Servers, error: BaseException, until: Callable[[], bool]) -> None:
    """Cut the stream, open it again after the wait the state says (and 1 ms more, as the
    resent requests go out), and cut it again before anything is answered, until
    ``until()`` (at most 100 times)."""
    for _ in range(100):
        servers.cut(0, error)
        if until():
            return
        servers.now += servers.reconnects[-1][1] + 0.001
        servers.open(0)
    raise AssertionError(f"not done after 100 cuts: {servers.reconnects}")


def test_backoff_again_takes_the_series_next_wait_and_ends_with_the_window():
    backoff = Backoff(first_s=0.1, max_s=0.4)
    backoff.start(10.0, 1.0)
    assert backoff.again(10.0) == 0.1
    assert backoff.next_delay(10.1) == 0.2  # a failed attempt takes the same doubling
    assert backoff.again(10.3) == 0.4
    assert backoff.again(10.7) == pytest.approx(0.3)  # no later than the window's end
    assert backoff.again(11.0) is None


def test_a_stream_cut_again_before_its_resent_request_is_answered_waits_longer_each_time():
    servers = Servers(request_s=100.0)
    pull = servers.pull({key_entry("w"): zeros()})
    cut_again_and_again(servers, FrameError("unreadable"), lambda: len(servers.reconnects) == 9)
    assert [delay for _, delay in servers.reconnects] == doubling(9)
    assert servers.state.links[0].cuts == 9 and not servers.blamed
    servers.now += RECONNECT_MAX_S
    servers.open(0)
    (resent,) = servers.sent()  # sent again every time, once
    servers.answer(resent, [f32(1, 2, 3, 4)])
    assert pull.done and pull.error is None
    servers.cut(0, ConnectionResetError("reset"))  # it carried its answer: a new series
    assert servers.reconnects[-1] == (0, 0.0) and servers.state.links[0].cuts == 1


@pytest.mark.parametrize(
    "cause",
    [ConnectionResetError("reset by peer"), StreamEndedError("stream ended inside a frame")],
)
def test_a_stream_cut_by_the_path_before_its_resent_request_is_answered_starts_a_series(cause):
    """Only a frame this worker's reader refused is evidence that the answer cuts every
    stream: a reset or a truncation is the path's doing, and a flaky path is tried again at
    once (with waits, a job whose every stream is cut now and then took 4.5 times as long)."""
    servers = Servers(request_s=100.0)
    servers.pull({key_entry("w"): zeros()})
    servers.cut(0, cause)
    servers.now += 0.001
    servers.open(0)
    servers.cut(0, cause)  # before the resent pull's answer
    assert [delay for _, delay in servers.reconnects] == [0.0, 0.0]
    assert servers.state.links[0].cuts == 1


def test_an_answer_to_another_resent_request_does_not_end_the_series():
    servers = Servers(request_s=100.0)
    w, v = key_entry("w"), key_entry("v")
    servers.pull({w: zeros()})
    later = servers.pull({v: zeros()})
    servers.cut(0)
    servers.open(0)
    servers.take()  # the first pull: its answer will cut the stream
    servers.answer(servers.take(), [f32(1, 1, 1, 1)])
    assert later.done
    servers.cut(0, FrameError("unreadable"))  # the first one's answer, say
    assert [delay for _, delay in servers.reconnects] == [0.0, RECONNECT_FIRST_S]
    servers.open(0)
    servers.answer(servers.take(), [f32(2, 2, 2, 2)])
    servers.cut(0)
    assert servers.reconnects[-1] == (0, 0.0)  # every resent request was answered


def test_a_cut_of_a_stream_with_nothing_resent_that_carried_a_frame_or_lasted_starts_a_series():
    servers = Servers()
    servers.cut(0)
    servers.open(0)
    servers.durable(0, 1)  # a frame came on it: it works
    servers.cut(0)
    servers.open(0)
    servers.now += RECONNECT_MAX_S  # none came, but it lasted
    servers.cut(0)
    assert [delay for _, delay in servers.reconnects] == [0.0, 0.0, 0.0]


def test_a_peer_that_drops_each_stream_at_once_is_reconnected_to_with_growing_waits():
    """Nothing to send again, and each stream opened again is cut before any frame comes
    (a peer that takes connections and drops them): the waits double, and the server is
    given up once the window from the first cut passed, instead of a reconnect every few
    milliseconds for ever."""
    servers = Servers(request_s=5.0)
    for _ in range(100):
        servers.cut(0, ConnectionResetError("reset by peer"))
        if servers.blamed:
            break
        servers.now += servers.reconnects[-1][1] + 0.001
        servers.open(0)
    else:
        raise AssertionError(f"not given up after 100 cuts: {servers.reconnects}")
    delays = [delay for _, delay in servers.reconnects]
    assert delays[:4] == doubling(4)
    assert 5.0 <= servers.now < 5.0 + RECONNECT_MAX_S and len(delays) < 15
    (blame,) = servers.blamed
    assert blame.cut and "cut" in str(blame.error) and "server 0" in str(blame.error)


def test_a_request_whose_answer_cuts_its_stream_each_time_fails_alone_at_its_deadline():
    servers = Servers(request_s=3.0)
    pull = servers.pull({key_entry("w"): zeros()})
    cause = FrameError("destination of array 0 (key 'w') is read-only")
    cut_again_and_again(servers, cause, lambda: pull.done)
    assert servers.now > 3.0 and not servers.blamed  # the job goes on
    error = pull.error
    assert isinstance(error, ServerError) and error.server == "server 0", error
    cuts = len(servers.reconnects)  # the stream was cut before the answer each time
    assert str(error) == (
        "server 0 did not answer a pull request in time (AKV_REQUEST_TIMEOUT_S): its stream "
        f"was cut {cuts} times before the answer came, the last time by {cause!r}"
    )
    # At once, then doubling, the last wait ending with the window (so their number is
    # bounded); the cut at which it failed started a new series, at once.
    *series, fresh = [delay for _, delay in servers.reconnects]
    assert series[:-1] == doubling(len(series) - 1) and 0.0 < series[-1] < RECONNECT_MAX_S
    assert len(series) < 2 + np.log2(RECONNECT_MAX_S / RECONNECT_FIRST_S) + 3.0
    assert fresh == 0.0
    # It is not sent again on the next stream.
    servers.open(0)
    assert servers.sent() == [] and servers.state.links[0].cuts == 1


def test_the_window_of_a_series_of_cuts_runs_from_its_first_cut():
    servers = Servers(request_s=10.0)
    servers.pull({key_entry("w"): zeros()})
    cut_again_and_again(servers, FrameError("unreadable"), lambda: servers.now > 2.0)
    refused = TransportError("cannot open a stream")
    while not servers.blamed:
        servers.connect_fails(0, refused, servers.now + servers.reconnects[-1][1])
    assert servers.now <= 10.0  # not 10 s from the latest cut
    (blame,) = servers.blamed
    assert "could not be reached again within AKV_REQUEST_TIMEOUT_S (10 s)" in str(blame.error)


def test_a_kept_request_that_cuts_the_stream_each_time_gives_the_server_up_with_the_window():
    servers = Servers(restartable=True, request_s=3.0)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())  # kept until a checkpoint holds it: no deadline
    cause = FrameError("an array at offset 9 is outside the peer's arena")
    cut_again_and_again(servers, cause, lambda: bool(servers.blamed))
    assert 3.0 <= servers.now < 3.0 + RECONNECT_MAX_S
    cuts = len(servers.reconnects) + 1  # the last one gave up
    (blame,) = servers.blamed
    assert blame.cut and str(blame.error) == (
        f"server 0 closed the connection ({cause!r}): its stream was cut {cuts} times in a "
        "row, each time before the requests sent again on it were answered, for "
        "AKV_REQUEST_TIMEOUT_S (3 s) (did it die?)"
    )
    assert servers.state.links[0].lost is blame.error
