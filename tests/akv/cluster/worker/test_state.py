"""The worker's state machine, played against one or several servers without sockets."""

from __future__ import annotations

import numpy as np

from akv.cluster.protocol import Note, Op, format_note, parse_note
from akv.cluster.worker.events import PullIssued
from akv.cluster.worker.instructions import GiveBack, GiveBuffer, Reconnect, Send
from akv.cluster.worker.state import WorkerState
from akv.errors import (
    DoublePushError,
    InvalidArgumentError,
    PeerLostError,
    ServerError,
    ShapeMismatchError,
)
from akv.limits import AHEAD_COPY_MAX_BYTES, MAX_UNACKED_PUSHES
from akv_transport import RemoteError
from tests.akv.cluster.worker.servers import Servers, f32, key_entry, zeros

# ---------------------------------------------------------------- pipelined pushes


def test_a_pipelined_push_is_done_at_once_and_written_at_the_end_of_the_turn():
    servers = Servers()
    w = key_entry("w")
    push = servers.push({w: f32(1, 2, 3, 4)})
    assert push.done and push.error is None
    assert servers.sent() == []  # held: a pull of the key may still ride on it
    servers.end_turn()
    (request,) = servers.sent()
    assert request.op == Op.PUSH and request.tags == [1] and not request.counted
    np.testing.assert_array_equal(request.arrays[0], f32(1, 2, 3, 4))
    assert servers.state.unacked == 1
    acks = servers.acks()
    assert not acks.done and push.unstaged == 0  # the request may still be resent
    servers.answer(servers.take())
    assert acks.done and servers.state.unacked == 0 and push.unstaged == 1


def test_pushes_of_a_key_are_numbered_in_call_order():
    servers = Servers()
    w = key_entry("w")
    for _ in range(3):
        servers.push({w: f32(1, 1, 1, 1)})
        servers.end_turn()
    assert [r.tags for r in servers.sent()] == [[1], [2], [3]]
    assert [r.seq for r in servers.sent()] == [1, 2, 3]


def test_a_pull_made_in_the_same_turn_rides_on_the_held_push_as_one_pushpull():
    servers = Servers()
    w = key_entry("w")
    push = servers.push({w: f32(1, 1, 1, 1)})
    out = zeros()
    pull = servers.pull({w: out})
    (request,) = servers.sent()
    assert request.op == Op.PUSHPULL and request.counted and request.tags == [1]
    servers.counted(request)  # the push is acknowledged: barrier need not wait for the round
    assert servers.state.unacked == 0 and not pull.done
    servers.answer(servers.take(), [f32(5, 6, 7, 8)])
    assert pull.done and pull.error is None and push.unstaged == 1
    np.testing.assert_array_equal(out, f32(5, 6, 7, 8))  # landed straight in the output
    servers.end_turn()
    assert servers.sent() == []


def test_the_error_of_a_push_a_pull_rode_on_goes_to_that_pull_alone():
    servers = Servers()
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    pull = servers.pull({w: zeros()})
    error = DoublePushError("worker 0 pushed key 'w' twice in round 1")
    servers.answer(servers.take(), error=error)
    assert isinstance(pull.error, DoublePushError) and "twice" in str(pull.error)
    assert servers.state.take_late(["w"]) is None  # raised once, by the pull
    assert servers.state.unacked == 0


def test_a_request_of_other_keys_sends_the_held_push_first():
    servers = Servers()
    w, v = key_entry("w"), key_entry("v")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.pull({v: zeros()})
    assert [(r.op, r.keys) for r in servers.sent()] == [(Op.PUSH, ["w"]), (Op.PULL, ["v"])]


def test_a_failed_pipelined_push_is_raised_once_by_the_next_call_on_its_keys():
    servers = Servers()
    w, v = key_entry("w"), key_entry("v")
    servers.push({w: f32(1, 1, 1, 1), v: f32(1, 1, 1, 1)})
    servers.end_turn()
    error = ShapeMismatchError("push key 'w': shape (4,) does not match")
    servers.answer(servers.take(), error=error)
    assert servers.state.take_late(["x"]) is None
    late = servers.state.take_late(["v"])
    assert isinstance(late, ShapeMismatchError) and late.__cause__ is not None
    assert str(late).startswith("an earlier push of key 'w', 'v' failed: push key 'w'")
    assert servers.state.take_late(["w"]) is None  # kept for both keys, raised once
    assert servers.state.take_any_late() is None


def test_barrier_and_close_take_a_late_error_of_any_key():
    servers = Servers()
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    acks = servers.acks()
    servers.answer(servers.take(), error=DoublePushError("twice"))
    assert acks.done and acks.error is None  # acknowledged, failed: nothing to wait for
    assert isinstance(servers.state.take_any_late(), DoublePushError)
    assert servers.state.take_any_late() is None


def test_past_max_unacked_pushes_a_push_waits_for_its_own_acknowledgement():
    servers = Servers()
    w = key_entry("w", (1,))
    pushes = []
    for _ in range(MAX_UNACKED_PUSHES + 1):
        pushes.append(servers.push({w: f32(1)}))
        servers.end_turn()
    assert all(push.done for push in pushes[:-1]) and not pushes[-1].done
    for _ in range(MAX_UNACKED_PUSHES):
        servers.answer(servers.take())
    assert not pushes[-1].done  # its own acknowledgement, not any
    servers.answer(servers.take(), error=DoublePushError("twice"))
    assert isinstance(pushes[-1].error, DoublePushError)
    assert servers.state.take_late(["w"]) is None  # raised by the push that waited


def test_closing_sends_the_held_push():
    servers = Servers()
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.close()
    (request,) = servers.sent()
    assert request.op == Op.PUSH


# ---------------------------------------------------------------- strict pushes


def test_a_strict_push_is_done_once_every_server_answered_its_part():
    servers = Servers(2, strict_push=True)
    w = key_entry("w", (4,), servers=(0, 1))
    push = servers.push({w: f32(1, 2, 3, 4)})
    assert servers.turn_ends == []  # not held
    first, second = servers.take(0), servers.take(1)
    np.testing.assert_array_equal(first.arrays[0], f32(1, 2))
    np.testing.assert_array_equal(second.arrays[0], f32(3, 4))
    servers.answer(first)
    assert not push.done
    servers.answer(second, error=DoublePushError("twice"))
    assert isinstance(push.error, DoublePushError) and push.unstaged == 1
    assert servers.state.unacked == 0 and servers.state.take_late(["w"]) is None


# ---------------------------------------------------------------- pulls


def test_a_pull_of_a_split_key_lands_each_part_in_its_place():
    servers = Servers(2)
    w = key_entry("w", (4,), servers=(0, 1))
    out = zeros()
    pull = servers.pull({w: out})
    servers.answer(servers.take(1), [f32(3, 4)])
    assert not pull.done
    servers.answer(servers.take(0), [f32(1, 2)])
    assert pull.done and pull.error is None
    np.testing.assert_array_equal(out, f32(1, 2, 3, 4))


def test_a_pull_into_a_strided_output_lands_in_a_key_buffer_then_is_copied():
    servers = Servers()
    w = key_entry("w")
    strided = np.zeros(8, np.float32)[::2]
    other = zeros()
    pull = servers.pull({w: [strided, other]})
    servers.answer(servers.take(), [f32(1, 2, 3, 4)])
    assert pull.done and pull.copied == 1
    np.testing.assert_array_equal(strided, f32(1, 2, 3, 4))
    np.testing.assert_array_equal(other, f32(1, 2, 3, 4))
    ((entry, buffer),) = servers.given_buffers  # the landing buffer went back
    assert entry is w and not np.shares_memory(buffer, strided)


def test_an_answer_of_other_sizes_fails_the_pull_and_lands_nowhere():
    servers = Servers()
    w = key_entry("w")
    out = zeros()
    pull = servers.pull({w: out})
    servers.answer(servers.take(), [f32(1, 2, 3)])
    assert isinstance(pull.error, ServerError) and "expected [16]" in str(pull.error)
    np.testing.assert_array_equal(out, zeros())


def test_a_control_request_gets_its_reply_or_the_servers_error():
    servers = Servers()
    ok = servers.request(0, Op.SET_OPTIMIZER, '{"name": "sgd"}')
    (request,) = servers.sent()
    assert request.op == Op.SET_OPTIMIZER and request.text == '{"name": "sgd"}'
    servers.answer(servers.take())
    assert ok.error is None and ok.reply.header.seq == request.seq
    refused = servers.request(0, Op.CHECKPOINT)
    servers.answer(servers.take(), error=InvalidArgumentError("server 0 writes no checkpoints"))
    assert isinstance(refused.error, InvalidArgumentError)


# ---------------------------------------------------------------- values asked ahead


def test_a_push_asks_ahead_and_a_pull_reads_the_value_without_a_request():
    servers = Servers(pull_ahead=True)
    w = key_entry("w")
    push = servers.push({w: f32(1, 1, 1, 1)})
    assert push.done and servers.turn_ends == []
    (request,) = servers.sent()
    assert request.op == Op.PUSHPULL and request.counted and request.tags == [1]
    servers.counted(request)
    assert servers.state.unacked == 0
    out = zeros()
    pull = servers.pull({w: out})  # before the value arrived: it waits for it
    assert not pull.done and len(servers.sent()) == 1
    servers.answer(servers.take(), [f32(3, 3, 3, 3)])
    assert pull.done and pull.error is None and push.unstaged == 1
    np.testing.assert_array_equal(out, f32(3, 3, 3, 3))
    again = zeros()
    second = servers.pull({w: again})  # the value stays for every pull until the next push
    assert second.done and servers.sent() == []
    np.testing.assert_array_equal(again, f32(3, 3, 3, 3))
    assert servers.read_on_callers_thread(w, again)


def test_a_later_push_invalidates_the_value_asked_ahead_and_its_buffer_goes_back():
    servers = Servers(pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.answer(servers.take(), [f32(2, 2, 2, 2)])
    value = servers.state.ahead.get("w")
    servers.push({w: f32(5, 5, 5, 5)})
    assert [buffer is value.buffer for _, buffer in servers.given_buffers] == [True]
    assert not servers.read_on_callers_thread(w, zeros())  # the new one has not arrived
    out = zeros()
    pull = servers.pull({w: out})
    assert not pull.done
    servers.answer(servers.take(), [f32(7, 7, 7, 7)])
    np.testing.assert_array_equal(out, f32(7, 7, 7, 7))


def test_a_pushpull_drops_the_value_asked_ahead_with_an_earlier_push():
    servers = Servers(pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.answer(servers.take(), [f32(2, 2, 2, 2)])
    value = f32(4, 4, 4, 4)
    pushpull = servers.pushpull({w: value})
    (request,) = servers.sent()
    assert request.op == Op.PUSHPULL and request.tags == [2] and not request.counted
    assert "w" not in servers.state.ahead
    servers.answer(servers.take(), [f32(9, 9, 9, 9)])
    assert pushpull.done and pushpull.unstaged == 1
    np.testing.assert_array_equal(value, f32(9, 9, 9, 9))


def test_a_lent_value_is_read_once_and_given_back_exactly_once():
    servers = Servers(pull_ahead=True, shares_memory=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.answer(servers.take(), [f32(6, 6, 6, 6)])
    stream = servers.streams[-1]
    (offset,) = stream.lent
    out = zeros()
    pull = servers.pull({w: out})
    assert pull.done and servers.sent() == []
    np.testing.assert_array_equal(out, f32(6, 6, 6, 6))
    assert stream.given_back == [offset] and not stream.lent
    servers.pull({w: zeros()})  # read once: the next pull asks the server
    assert [r.op for r in servers.sent()] == [Op.PULL]


def test_a_lent_value_copied_out_on_the_callers_thread_goes_back_once_copied():
    servers = Servers(pull_ahead=True, shares_memory=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.answer(servers.take(), [f32(6, 6, 6, 6)])
    out = zeros()
    assert servers.read_on_callers_thread(w, out)
    np.testing.assert_array_equal(out, f32(6, 6, 6, 6))
    assert servers.streams[-1].given_back and not servers.streams[-1].lent
    assert not servers.read_on_callers_thread(w, out)


def test_a_lent_value_nobody_read_goes_back_when_the_next_push_comes():
    servers = Servers(pull_ahead=True, shares_memory=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.push({w: f32(2, 2, 2, 2)})  # before the first one's value arrived
    first, second = servers.take(), servers.take()
    servers.answer(first, [f32(3, 3, 3, 3)])  # arrives stale: it goes back at once
    assert len(servers.streams[-1].given_back) == 1 and not servers.streams[-1].lent
    servers.answer(second, [f32(4, 4, 4, 4)])
    assert len(servers.streams[-1].lent) == 1
    servers.push({w: f32(5, 5, 5, 5)})
    assert len(servers.streams[-1].given_back) == 2 and not servers.streams[-1].lent
    assert sum(isinstance(i, GiveBack) for i in servers.log) == 2


def test_an_error_asked_ahead_goes_to_the_waiting_pull_and_is_not_kept():
    servers = Servers(pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    pull = servers.pull({w: zeros()})
    servers.answer(servers.take(), error=ServerError("the update of key 'w' failed"))
    assert isinstance(pull.error, ServerError)
    assert str(pull.error).startswith("an earlier push of key 'w' failed")
    assert servers.state.take_late(["w"]) is None and servers.state.unacked == 0
    assert "w" not in servers.state.ahead


def test_an_error_asked_ahead_that_no_pull_waits_for_is_kept_for_the_next_call():
    servers = Servers(pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    request = servers.take()
    servers.counted(request)
    servers.answer(request, error=ServerError("the update of key 'w' failed"))
    late = servers.state.take_late(["w"])
    assert isinstance(late, ServerError) and "earlier push of key 'w'" in str(late)


def test_on_tcp_a_large_value_is_not_asked_ahead_but_on_shared_memory_it_is():
    large = AHEAD_COPY_MAX_BYTES // 4 + 1
    for shares_memory, op in ((False, Op.PUSH), (True, Op.PUSHPULL)):
        servers = Servers(pull_ahead=True, shares_memory=shares_memory)
        w = key_entry("w", (large,))
        servers.push({w: np.ones(large, np.float32)})
        servers.end_turn()
        assert [r.op for r in servers.sent()] == [op]


# ---------------------------------------------------------------- deadlines


def test_a_request_past_its_deadline_fails_naming_its_op_and_server():
    servers = Servers(request_s=10.0)
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    servers.tick(9.0)
    assert not pull.done
    servers.tick(10.5)
    assert isinstance(pull.error, ServerError)
    assert "server 0 did not answer a pull request in time" in str(pull.error)


def test_a_push_asked_ahead_may_wait_for_its_round_past_the_request_deadline():
    servers = Servers(request_s=10.0, round_s=5.0, pull_ahead=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.counted(servers.sent()[0])
    servers.tick(14.0)
    pull = servers.pull({w: zeros()})
    assert not pull.done
    servers.tick(15.5)
    assert isinstance(pull.error, ServerError) and "pushpull request in time" in str(pull.error)


# ---------------------------------------------------------------- kept until durable


def test_durable_drops_the_copies_a_checkpoint_holds():
    servers = Servers(restartable=True)
    w = key_entry("w")
    for _ in range(3):
        servers.push({w: f32(1, 1, 1, 1)})
        servers.end_turn()
        servers.answer(servers.take())
    link = servers.state.links[0]
    assert link.retained_bytes == 48 and sorted(link.retained.requests) == [1, 2, 3]
    servers.durable(0, 3)
    assert link.retained_bytes == 16 and sorted(link.retained.requests) == [3]
    servers.cut(0)
    servers.open(0)
    assert [(r.op, r.seq) for r in servers.sent()] == [(Op.PUSH, 3)]


def test_the_last_durable_note_is_kept_to_be_sent_back():
    servers = Servers(restartable=True)
    link = servers.state.links[0]
    assert link.durable_note == ""  # nothing declared durable: a new stream sends no note
    first = format_note(Note("s1", 4, 10, 3))
    servers.durable(0, 3, first)
    assert link.durable_note == first
    servers.cut(0)
    assert link.durable_note == first  # a cut keeps it: the reopened stream sends it
    servers.open(0)
    later = format_note(Note("s1", 5, 12, 7))
    servers.durable(0, 7, later)
    assert link.durable_note == later and parse_note(link.durable_note).checkpoint == 5


def test_a_kept_push_is_a_copy_of_what_was_sent():
    servers = Servers(restartable=True)
    w = key_entry("w")
    servers.push({w: f32(1, 2, 3, 4)})
    servers.end_turn()
    request = servers.state.links[0].table.get(1)
    servers.answer(servers.take())
    request.arrays[0][1][:] = -1  # the staging buffer is reused once the push is answered
    ((_, arrays, _),) = servers.state.links[0].retained.requests.values()
    np.testing.assert_array_equal(arrays[0][1], f32(1, 2, 3, 4))


def test_past_retain_bytes_the_worker_asks_for_one_checkpoint():
    servers = Servers(restartable=True, retain_bytes=20)
    w = key_entry("w")
    for _ in range(3):
        servers.push({w: f32(1, 1, 1, 1)})
        servers.end_turn()
        (push,) = [r for r in servers.sent() if r.op == Op.PUSH]
        servers.inbox[0].remove(push)
        servers.answer(push)
    (checkpoint,) = servers.sent()  # asked once, past 20 bytes kept
    assert (checkpoint.op, checkpoint.seq) == (Op.CHECKPOINT, 3)
    assert servers.state.links[0].asked_checkpoint
    servers.answer(servers.take())
    assert not servers.state.links[0].asked_checkpoint
    servers.durable(0, checkpoint.seq)  # holds the first two pushes; the third came after
    assert servers.state.links[0].retained_bytes == 16


def test_a_refused_checkpoint_asks_the_scheduler_who_failed():
    servers = Servers(restartable=True, retain_bytes=0)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    servers.end_turn()
    servers.answer(servers.take())
    servers.answer(servers.take(), error=ServerError("the disk is full"))
    (blame,) = servers.blamed
    assert not blame.cut and "the disk is full" in str(blame.error)


# ---------------------------------------------------------------- failures


def test_a_server_saying_the_job_failed_holds_the_request_for_the_verdict():
    servers = Servers()
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    servers.answer(servers.take(), error=PeerLostError("the job failed"))
    (blame,) = servers.blamed
    assert not blame.cut and not pull.done
    verdict = PeerLostError("the job failed: worker 1 (pid 7) vanished")
    servers.fail(verdict)
    assert pull.error is verdict


def test_after_the_job_failed_every_waiting_and_later_request_fails_with_its_reason():
    servers = Servers(2)
    w, v = key_entry("w", servers=(1,)), key_entry("v")
    waiting = servers.pull({w: zeros()})
    push = servers.push({v: f32(1, 1, 1, 1)})  # held
    acks = servers.acks()
    failure = PeerLostError("the job failed: server 1 vanished")
    servers.fail(failure)
    servers.fail(PeerLostError("a second reason"))  # only the first is kept
    assert waiting.error is failure and acks.done and push.unstaged == 1
    later = servers.pull({v: zeros()})
    assert later.error is failure and servers.sent(0) == [] and servers.state.unacked == 0
    servers.cut(1)
    assert servers.reconnects == []


def test_a_cut_while_the_store_leaves_fails_that_streams_requests():
    servers = Servers()
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    servers.close()
    servers.cut(0)
    assert isinstance(pull.error, PeerLostError) and "closed the connection" in str(pull.error)
    assert servers.reconnects == []
    later = servers.pull({w: zeros()})
    assert later.error is pull.error


def test_a_stream_given_up_keeps_its_requests_for_the_verdict():
    servers = Servers()
    w = key_entry("w")
    pull = servers.pull({w: zeros()})
    servers.cut(0)
    refused = RemoteError(409, "the job failed")
    servers.connect_fails(0, refused)
    assert not pull.done and servers.blamed
    servers.fail(servers.blamed[0].error)
    assert isinstance(pull.error, PeerLostError) and "refused to take the stream" in str(pull.error)


def test_every_instruction_names_a_call_the_state_knew():
    servers = Servers(2, pull_ahead=True)
    w = key_entry("w", (4,), servers=(0, 1))
    servers.push({w: f32(1, 2, 3, 4)})
    for server in (0, 1):
        request = servers.take(server)
        servers.counted(request)
        servers.answer(request, [f32(5, 5)])
    out = zeros()
    pull = servers.pull({w: out})
    assert pull.done
    np.testing.assert_array_equal(out, f32(5, 5, 5, 5))
    sends = [i for i in servers.log if isinstance(i, Send)]
    assert [s.server for s in sends] == [0, 1]
    assert not any(isinstance(i, (Reconnect, GiveBuffer)) for i in servers.log)


# ---------------------------------------------------------------- more of the same rules


def test_a_held_push_of_a_split_key_rides_with_the_pull_to_each_server():
    servers = Servers(2)
    w = key_entry("w", (4,), servers=(0, 1))
    servers.push({w: f32(1, 2, 3, 4)})
    out = zeros()
    pull = servers.pull({w: out})
    first, second = servers.take(0), servers.take(1)
    assert (first.op, second.op) == (Op.PUSHPULL, Op.PUSHPULL) and first.counted
    servers.counted(first)
    assert servers.state.unacked == 1  # server 1 has not counted it yet
    servers.answer(second, [f32(7, 8)])
    assert servers.state.unacked == 0 and not pull.done
    servers.answer(first, [f32(5, 6)])
    np.testing.assert_array_equal(out, f32(5, 6, 7, 8))


def test_a_request_to_a_stream_never_opened_fails_at_once():
    state = WorkerState([("server 9", False)], request_s=1.0)
    assert state.handle() == []  # no events: nothing to do
    call = object()
    (finish,) = state.handle(PullIssued(call, [(key_entry("w"), [zeros()])], None, 0.0))
    assert finish.call is call and "server 9: the stream was never opened" in str(finish.error)
    state.validate()


def test_waiting_for_acknowledgements_with_none_left_ends_at_once():
    servers = Servers()
    assert servers.acks().done


def test_the_verdict_fails_the_requests_held_for_it_on_every_server():
    servers = Servers(2)
    w, v = key_entry("w"), key_entry("v", servers=(1,))
    first = servers.pull({w: zeros()})
    second = servers.pull({v: zeros()})
    for server in (0, 1):
        servers.answer(servers.take(server), error=PeerLostError("the job failed"))
    assert len(servers.blamed) == 2 and not first.done and not second.done
    verdict = PeerLostError("the job failed: worker 1 (pid 9) vanished")
    servers.fail(verdict)
    assert first.error is verdict and second.error is verdict


def test_a_value_asked_ahead_for_a_split_key_is_never_lent():
    servers = Servers(2, pull_ahead=True, shares_memory=True)
    w = key_entry("w", (4,), servers=(0, 1))
    servers.push({w: f32(1, 2, 3, 4)})
    servers.answer(servers.take(0), [f32(5, 6)])
    servers.answer(servers.take(1), [f32(7, 8)])
    assert all(not stream.lent for stream in servers.streams)
    out = zeros()
    assert servers.pull({w: out}).done
    np.testing.assert_array_equal(out, f32(5, 6, 7, 8))


def test_a_pull_waiting_for_a_value_asked_ahead_fails_with_the_job_and_nothing_is_kept():
    servers = Servers(pull_ahead=True, shares_memory=True)
    w = key_entry("w")
    servers.push({w: f32(1, 1, 1, 1)})
    pull = servers.pull({w: zeros()})
    failure = PeerLostError("the job failed: worker 1 (pid 3) vanished")
    servers.fail(failure)
    assert pull.error is failure  # as it is: every call raises the job's failure
    assert servers.state.take_late(["w"]) is None and "w" not in servers.state.ahead
    assert servers.state.unacked == 0 and not any(s.lent for s in servers.streams)
