"""A worker's request table and batching by server, without sockets."""

from __future__ import annotations

import numpy as np

from akv.cluster.protocol import OK, Op, status_of
from akv.cluster.worker.requests import (
    Request,
    RequestTable,
    by_server,
    pull_rides_on_push,
    push_batches,
    settle_before_resend,
    settle_op,
)
from akv.errors import DoublePushError, ServerError
from akv.keys import Entry, Part
from akv_engine import Var
from akv_transport import DISCARD, Message, decode_frame, frame_bytes


def reply(seq: int, arrays=(), aux: int = OK, text: str = "") -> Message:
    header, buffers = decode_frame(frame_bytes(Op.REPLY, seq, arrays, aux=aux, text=text))
    return Message(header, buffers)


def add(table, op, destinations=(), deadline=10.0, arrays=(), text=""):
    return table.add(Request(op, arrays, deadline, None, destinations, text))


def test_a_reply_lands_in_the_requests_destinations_and_completes_it_once():
    table = RequestTable("server 0")
    out = np.zeros(3, np.float32)
    seq = add(table, Op.PULL, [memoryview(out).cast("B")])
    message = reply(seq, [("w", np.ones(3, np.float32), 0)])
    assert table.destinations(message.header)[0].nbytes == 12
    outcome = table.reply(message)
    assert outcome.message is message and outcome.error is None and outcome.request.seq == seq
    assert len(table) == 0
    assert table.reply(message) is None  # a second reply for the same seq is ignored


def test_a_reply_of_other_sizes_lands_nowhere_and_is_an_error():
    table = RequestTable("server 0")
    out = np.zeros(3, np.float32)
    seq = add(table, Op.PULL, [memoryview(out).cast("B")])
    message = reply(seq, [("w", np.ones(4, np.float32), 0)])
    assert table.destinations(message.header) == [DISCARD]  # read through, never allocated
    outcome = table.reply(message)
    assert isinstance(outcome.error, ServerError) and "[16] bytes, expected [12]" in str(
        outcome.error
    )


def test_a_reply_never_makes_the_worker_allocate_what_it_declares():
    """A reply nobody asked for, arrays on a push's reply, arrays on an error: discarded.
    Only save_states, whose answer has sizes the worker cannot know, gets fresh buffers."""
    table = RequestTable("server 0")
    huge = reply(999, [("w", np.ones(2, np.float32), 0)])
    assert table.destinations(huge.header) == [DISCARD]
    push = add(table, Op.PUSH)
    assert table.destinations(reply(push, [("w", np.ones(2, np.float32), 0)]).header) == [DISCARD]
    error = DoublePushError("no")
    failed = reply(push, [("w", np.ones(2, np.float32), 0)], aux=status_of(error), text="no")
    assert table.destinations(failed.header) == [DISCARD]
    save = add(table, Op.SAVE_STATES)
    states = reply(save, [(None, np.ones(5, np.uint8), 0)])
    assert table.destinations(states.header) == [None]


def test_an_error_reply_becomes_the_servers_error_class():
    table = RequestTable("server 2 at h:1")
    seq = add(table, Op.PUSH)
    error = DoublePushError("pushed twice")
    message = reply(seq, aux=status_of(error), text=str(error))
    assert table.destinations(message.header) == []
    outcome = table.reply(message)
    assert isinstance(outcome.error, DoublePushError) and "server 2 at h:1" in str(outcome.error)


def test_sweep_fails_only_the_requests_past_their_deadline_naming_op_and_server():
    table = RequestTable("server 1")
    early = add(table, Op.PUSH, deadline=1.0)
    late = add(table, Op.PULL, deadline=5.0)
    (outcome,) = table.sweep(2.0)
    assert "did not answer a push request" in str(outcome.error)
    assert table.sweep(2.0) == [] and len(table) == 1
    assert [o.request.op for o in table.fail_all(ServerError("gone"))] == [Op.PULL]
    assert early != late and table.sent == 2


def test_by_server_makes_one_batch_per_server_in_call_order():
    split = Entry(
        "big", (6,), np.dtype(np.float32), Var(None, 0, "big"), (Part(0, 0, 3), Part(1, 3, 6))
    )
    whole = Entry("small", (2,), np.dtype(np.float32), Var(None, 1, "small"), (Part(1, 0, 2),))
    big, small = np.arange(6, dtype=np.float32), np.ones(2, np.float32)
    batches = by_server(
        [(split, big), (whole, small)], lambda e, p, a: (e.key, e.wire_view(a, p).tolist())
    )
    assert batches == {0: [("big", [0, 1, 2])], 1: [("big", [3, 4, 5]), ("small", [1, 1])]}


def test_unanswered_requests_keep_what_they_sent_in_their_order():
    table = RequestTable("server 0")
    sent = np.ones(3, np.float32)
    first = add(table, Op.PUSH, arrays=[("w", sent, 1)])
    second = add(table, Op.SET_OPTIMIZER, text='{"name": "sgd"}')
    table.reply(Message(decode_frame(frame_bytes(Op.REPLY, first, [], aux=OK))[0], ()))
    (request,) = table.unanswered()
    assert request.seq == second and request.op == Op.SET_OPTIMIZER
    assert request.text == '{"name": "sgd"}' and table.get(first) is None


def test_a_replay_pulls_a_key_before_pushing_it_again():
    pushed: set = set()
    a, b = np.ones(2, np.float32), np.ones(3, np.float64)
    assert settle_before_resend(Op.PUSH, [("a", a, 1), ("b", b, 1)], pushed) == []
    assert settle_before_resend(Op.PULL, [("a", a[:0], 0)], pushed) == []  # pulls: no wait
    (pull,) = settle_before_resend(Op.PUSHPULL, [("b", b, 2)], pushed)
    assert pull[0] == "b" and pull[1].dtype == np.float64 and pull[1].size == 0
    (pull,) = settle_before_resend(Op.PUSH, [("a", a, 2), ("c", a, 1)], pushed)
    assert pull[0] == "a"
    assert pushed == {"a", "b", "c"}
    assert settle_before_resend(Op.INIT, [("a", a, 0)], pushed) == []


def test_a_pull_rides_on_the_push_before_it_only_when_it_names_the_same_keys_in_order():
    values = np.ones(4, np.float32)
    none = np.empty(0, np.float32)
    push = [("a", values, 3), ("b", values, 3)]
    assert pull_rides_on_push(push, [("a", none, 0), ("b", none, 0)])
    assert not pull_rides_on_push(push, [("b", none, 0), ("a", none, 0)])  # order
    assert not pull_rides_on_push(push, [("a", none, 0)])  # fewer keys
    assert not pull_rides_on_push(push, [("a", none, 0), ("c", none, 0)])


def test_a_push_batch_numbers_each_part_with_its_keys_pushes():
    split = Entry(
        "big", (6,), np.dtype(np.float32), Var(None, 0, "big"), (Part(0, 0, 3), Part(1, 3, 6))
    )
    whole = Entry("small", (2,), np.dtype(np.float32), Var(None, 1, "small"), (Part(1, 0, 2),))
    split.pushes, whole.pushes = 4, 1
    batches = push_batches([(split, np.arange(6, dtype=np.float32)), (whole, np.ones(2))])
    assert {s: [(k, a.tolist(), t) for k, a, t in b] for s, b in batches.items()} == {
        0: [("big", [0, 1, 2], 4)],
        1: [("big", [3, 4, 5], 4), ("small", [1, 1], 1)],
    }


def test_a_resent_row_push_of_a_key_pushed_in_the_replay_waits_for_a_row_pull():
    ids, rows = np.array([1, 2], np.int64), np.ones((2, 3), np.float32)
    pushed: set = set()
    assert settle_before_resend(Op.ROW_PUSH, [("e", ids, 1), ("e", rows, 1)], pushed) == []
    (pull,) = settle_before_resend(Op.ROW_PUSH, [("e", ids, 2), ("e", rows, 2)], pushed)
    assert pull[0] == "e" and pull[1].dtype == np.int64 and pull[1].size == 0
    assert settle_op(Op.ROW_PUSH) == Op.ROW_PULL and settle_op(Op.PUSH) == Op.PULL
