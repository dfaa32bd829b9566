"""The server's state machine, driven by several workers at once without sockets."""

from __future__ import annotations

import json
import re
import tracemalloc

import numpy as np
import pytest

from akv import optimizer
from akv.cluster.protocol import COUNTED, Op, encode_meta
from akv.cluster.server import snapshots
from akv.cluster.server.instructions import CloseStream, ServerEntry
from akv.errors import (
    DoublePushError,
    DTypeMismatchError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    MembershipError,
    OptimizerError,
    OptimizerNotSetError,
    PeerLostError,
    RoundTimeoutError,
    ServerError,
    ShapeMismatchError,
    WaitTimeoutError,
)
from akv_transport import (
    ArenaBook,
    ArrayInfo,
    FrameHeader,
    StreamSilentError,
    decode_frame,
    frame_bytes,
)
from akv_transport.shm import Arena
from tests.akv.cluster.server.players import OK, Players


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def started(num_workers: int = 2, store_type: str = "dist_sync", **keys: np.ndarray) -> Players:
    players = Players(num_workers, store_type)
    values = keys or {"w": f32(0, 0)}
    assert players.reply(0, players.init(0, dict(values))) == OK
    return players


# ---------------------------------------------------------------- sync rounds


def test_a_sync_round_applies_once_every_worker_pushed():
    players = started(3)
    players.push(0, {"w": f32(1, 2)})
    players.push(1, {"w": f32(10, 20)})
    entry = players.state.entries["w"]
    assert entry.rounds.applied_round == 0 and entry.rounds.missing() == [2]
    np.testing.assert_array_equal(entry.value, f32(0, 0))
    players.push(2, {"w": f32(100, 200)})
    assert entry.rounds.applied_round == 1
    np.testing.assert_array_equal(entry.value, f32(111, 222))  # assignment: the sum


def test_a_pull_after_a_push_waits_for_that_round():
    players = started(2)
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    assert players.waiting(0, pull)
    players.push(1, {"w": f32(2, 2)})
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(3, 3))


def test_a_pull_waits_for_the_apply_not_only_the_last_push():
    players = started(2)
    players.hold_updates = True
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    players.push(1, {"w": f32(2, 2)})
    assert players.waiting(0, pull)  # the round is closed but not yet applied
    players.finish_updates()
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(3, 3))


def test_a_pull_of_several_keys_is_answered_once_all_are_ready():
    players = started(2, a=f32(0), b=f32(0))
    players.push(0, {"a": f32(1)})
    players.push(1, {"a": f32(1)})
    players.push(0, {"b": f32(5)})
    pull = players.pull(0, ["a", "b"])
    assert players.waiting(0, pull)
    players.push(1, {"b": f32(5)})
    reply = players.reply(0, pull)
    assert float(reply["a"][0]) == 2.0 and float(reply["b"][0]) == 10.0


def test_a_pull_without_a_push_is_answered_at_once():
    players = started(2)
    np.testing.assert_array_equal(players.reply(1, players.pull(1, ["w"]))["w"], f32(0, 0))


def test_pushpull_answers_with_the_round_it_pushed_into():
    players = started(2)
    first = players.send(0, Op.PUSHPULL, [("w", f32(1, 1))])
    assert players.waiting(0, first)
    second = players.send(1, Op.PUSHPULL, [("w", f32(3, 3))])
    for worker, seq in ((0, first), (1, second)):
        np.testing.assert_array_equal(players.reply(worker, seq)["w"], f32(4, 4))


def test_a_double_push_is_refused_and_the_round_keeps_its_count():
    players = started(2)
    players.push(0, {"w": f32(1, 1)})
    again = players.push(0, {"w": f32(7, 7)})
    error = players.reply(0, again)
    assert isinstance(error, DoublePushError) and "waits for workers [1]" in str(error)
    players.push(1, {"w": f32(2, 2)})
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(3, 3))


def test_rounds_follow_each_other():
    players = started(2)
    for round_no in range(1, 4):
        players.push(0, {"w": f32(round_no, 0)})
        players.push(1, {"w": f32(round_no, 0)})
        assert players.state.entries["w"].rounds.applied_round == round_no
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(6, 0))


# ---------------------------------------------------------------- refused frames


@pytest.mark.parametrize(
    ("values", "error", "words"),
    [
        ({"w": f32(1, 1), "nope": f32(1)}, KeyNotInitializedError, "never initialized"),
        ({"w": f32(1, 1), "v": f32(1, 2, 3)}, ShapeMismatchError, "shape (3,)"),
        ({"w": f32(1, 1), "v": np.ones(2, np.float64)}, DTypeMismatchError, "float64"),
    ],
)
def test_a_frame_with_one_bad_key_is_refused_whole(values, error, words):
    players = started(2, w=f32(0, 0), v=f32(0, 0))
    reply = players.reply(0, players.push(0, values))
    assert isinstance(reply, error) and words in str(reply)
    assert players.state.entries["w"].rounds.missing() == []  # the good key was not counted
    assert players.state.entries["w"].rounds.last_push_round(0) == 0


def test_a_push_frame_naming_a_key_twice_is_refused_and_counts_nothing():
    players = started(2)
    reply = players.reply(0, players.send(0, Op.PUSH, [("w", f32(1, 1)), ("w", f32(1, 1))]))
    assert isinstance(reply, InvalidArgumentError) and "twice" in str(reply)
    players.push(0, {"w": f32(1, 1)})  # not a double push: the refused frame counted nothing
    players.push(1, {"w": f32(2, 2)})
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(3, 3))


def test_an_unknown_op_is_an_error_reply():
    players = started(2)
    reply = players.reply(0, players.send(0, 42))
    assert isinstance(reply, InvalidArgumentError) and "unknown op 42" in str(reply)


def test_a_pull_of_a_key_nobody_initialized_names_it():
    players = started(2)
    reply = players.reply(1, players.pull(1, ["ghost"]))
    assert isinstance(reply, KeyNotInitializedError) and "'ghost'" in str(reply)


# ---------------------------------------------------------------- init


def test_a_second_init_of_a_key_is_refused():
    players = started(2)
    reply = players.reply(0, players.init(0, {"w": f32(5, 5)}))
    assert isinstance(reply, DuplicateInitError)
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(0, 0))


def test_another_workers_init_waits_for_rank_0s_values():
    players = Players(2)
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32")]))
    assert players.waiting(1, check)
    players.init(0, {"w": f32(0, 0)})
    assert players.reply(1, check) == OK


def test_an_init_that_disagrees_with_rank_0_names_both_shapes():
    players = started(2)
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (3,), "float32")]))
    error = players.reply(1, check)
    assert isinstance(error, ShapeMismatchError) and "(3,)" in str(error) and "(2,)" in str(error)


def test_a_split_part_check_of_a_key_rank_0_made_whole_is_refused():
    """Rank 0 declared "w" (2,), not split; worker 1 declares it split (its part here the
    same size): the dtype alone is compared only for keys restored without their shapes."""
    players = started(2)
    split = encode_meta([("w", (2,), "float32 split of (1, 4)")])
    error = players.reply(1, players.send(1, Op.INIT_CHECK, text=split))
    assert isinstance(error, ShapeMismatchError) and "split of (1, 4)" in str(error)


def test_an_init_declaring_a_negative_size_is_refused():
    players = Players(2)
    text = encode_meta([("w", (-1, 4), "float32")])
    error = players.reply(0, players.send(0, Op.INIT, [("w", f32(0, 0))], text))
    assert isinstance(error, InvalidArgumentError) and "(-1, 4)" in str(error)
    assert "w" not in players.state.entries


def test_an_init_wait_that_outlives_its_deadline_names_the_missing_keys():
    players = Players(2)
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32")]))
    players.tick(4.0)
    assert players.waiting(1, check)
    players.tick(6.0)
    error = players.reply(1, check)
    assert isinstance(error, WaitTimeoutError) and "['w']" in str(error)


def test_a_malformed_init_check_is_refused():
    players = Players(2)
    error = players.reply(1, players.send(1, Op.INIT_CHECK, text="[[1, 2]"))
    assert isinstance(error, InvalidArgumentError) and "init_check" in str(error)


#: Texts a hostile or broken client may put in a frame: numbers JSON cannot hold as a
#: float, NaN, nesting deep enough to exhaust Python's recursion, not JSON at all.
HOSTILE_TEXTS = {
    "overflow": '{"name": "sgd", "learning_rate": 1e999}',
    "nan": '{"name": "sgd", "learning_rate": NaN}',
    "deep": "[" * 100_000 + "]" * 100_000,
    "truncated": '{"name": "sgd"',
}


@pytest.mark.parametrize("text", list(HOSTILE_TEXTS.values()), ids=list(HOSTILE_TEXTS))
@pytest.mark.parametrize("op", [Op.INIT_CHECK, Op.SET_OPTIMIZER, Op.SAVE_STATES])
def test_a_hostile_text_in_a_frame_is_a_typed_refusal_without_a_traceback(op, text):
    players = Players(2)
    players.init(0, {"w": np.zeros(2, np.float32)})
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1))
    error = players.reply(1, players.send(1, op, text=text))
    assert isinstance(error, InvalidArgumentError), error
    assert players.unexpected == []  # a client's mistake: nothing for the log's traceback
    assert players.reply(0, players.push(0, {"w": np.ones(2, np.float32)}, tag=1)) == OK


# ---------------------------------------------------------------- deadlines and failures


def test_a_round_that_waits_too_long_fails_its_pulls_naming_the_missing_workers():
    players = started(3)
    players.now = 1.0
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    players.tick(5.0, round_timeout_s=10.0)
    assert players.waiting(0, pull)
    players.tick(11.5, round_timeout_s=10.0)
    error = players.reply(0, pull)
    assert isinstance(error, RoundTimeoutError) and "workers [1, 2]" in str(error)


def test_a_worker_lost_without_goodbye_fails_the_job_and_its_waiters_after_the_grace():
    players = started(2)
    grace = players.state.reconnect_s
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    players.lose(1, ConnectionResetError("reset"))
    players.tick(grace - 0.1)
    assert players.failures == [] and players.waiting(0, pull)  # it may come back
    players.tick(grace + 0.1)
    (failure,) = players.failures
    assert failure.lost_worker == 1 and "worker 1 disconnected" in failure.reason
    assert f"did not reconnect within {grace:g} s" in failure.reason
    error = players.reply(0, pull)
    assert isinstance(error, PeerLostError) and "worker 1" in str(error)
    assert players.state.failure is not None


def test_a_worker_that_reconnects_within_the_grace_is_not_lost():
    players = started(2)
    players.lose(1, ConnectionResetError("cut"))
    assert players.state.status()["workers_reconnecting"] == [1]
    players.reconnect(1)
    players.tick(players.state.reconnect_s + 1)
    assert players.failures == [] and players.state.workers_connected() == [0, 1]


def test_a_new_stream_of_the_same_session_replaces_the_old_one_silently():
    players = started(2)
    old = players.peers[1]
    players.reconnect(1)  # the server has not seen the old stream end yet
    assert players.state.workers_connected() == [0, 1]
    players.run(players.state.peer_lost(old, ConnectionResetError("late"), players.now))
    players.tick(players.state.reconnect_s + 1)
    assert players.failures == [] and players.state.workers_connected() == [0, 1]


def test_admitting_a_reconnect_of_the_same_session_says_to_close_the_old_stream():
    players = started(2)
    old = players.peers[1]
    new, todo = players.state.admit(1, "dist_sync", stream=True, session="session1")
    assert todo == [CloseStream(old)]  # the service closes it; the state expects its end
    assert new.id != old.id and new.worker == 1 and new.stream
    assert players.state.peers == {players.peers[0].id: players.peers[0], new.id: new}
    assert players.state.peer_lost(old, None, players.now) == []  # no goodbye, no loss
    assert players.state.status()["workers_reconnecting"] == []
    players.peers[1] = new
    pull = players.pull(1, ["w"])  # the new stream serves the worker
    np.testing.assert_array_equal(players.reply(1, pull)["w"], f32(0, 0))
    players.lose(1)  # the new stream's own end is a cut like any other
    assert players.state.status()["workers_reconnecting"] == [1]


def test_a_reconnect_after_the_old_stream_ended_closes_nothing():
    players = started(2)
    players.lose(1, ConnectionResetError("cut"))
    _, todo = players.state.admit(1, "dist_sync", stream=True, session="session1")
    assert todo == [] and players.state.status()["workers_reconnecting"] == []


def test_only_the_newest_streams_end_starts_the_grace_whatever_order_the_ends_come_in():
    players = started(2)
    first = players.peers[1]
    players.reconnect(1)  # two reconnects, each replacing the one before
    second = players.peers[1]
    players.reconnect(1)
    newest = players.peers[1]
    assert players.closed == [first, second]  # the service closes them, made or not
    players.lose(1, ConnectionResetError("newest cut"))  # the newest ends first...
    assert players.state.status()["workers_reconnecting"] == [1]
    for old in (second, first):  # ...and the replaced ones after it: no loss, no reprieve
        assert players.state.peer_lost(old, None, players.now) == []
    players.tick(players.state.reconnect_s + 1)
    (failure,) = players.failures
    assert "newest cut" in failure.reason and newest.worker == 1


def test_an_old_streams_end_reported_again_does_not_undo_a_reconnect():
    players = started(2)
    old = players.peers[1]
    players.lose(1, ConnectionResetError("cut"))
    players.reconnect(1)  # back within the grace
    players.run(players.state.peer_lost(old, None, players.now))  # its end, reported again
    players.tick(players.state.reconnect_s + 1)
    assert players.failures == [] and players.state.workers_connected() == [0, 1]


def test_a_stream_cut_as_silent_gives_the_worker_its_own_window_to_come_back():
    # A silent stream is no sign that the worker died (its heartbeats say that): the live
    # worker keeps reconnecting for its window, and names this server if it cannot.
    players = started(2)
    players.state.silent_reconnect_s = 50.0
    players.lose(1, StreamSilentError("no answer for 20.1 s: the stream is silent"))
    players.tick(players.state.reconnect_s + 1)
    assert players.failures == [] and players.state.status()["workers_reconnecting"] == [1]
    players.tick(50.5)
    (failure,) = players.failures
    assert "the stream is silent" in failure.reason
    assert "did not reconnect within 50 s" in failure.reason


def test_a_worker_whose_silent_stream_was_cut_may_come_back():
    players = started(2)
    players.state.silent_reconnect_s = 50.0
    players.lose(1, StreamSilentError("no answer for 20.1 s: the stream is silent"))
    players.tick(30.0)
    players.reconnect(1)
    players.tick(100.0)
    assert players.failures == [] and players.state.workers_connected() == [0, 1]


def test_a_stream_of_another_session_for_a_connected_rank_is_refused():
    players = started(2)
    peers = dict(players.state.peers)
    with pytest.raises(MembershipError, match="already connected"):
        players.state.admit(1, "dist_sync", stream=True, session="intruder")
    with pytest.raises(MembershipError, match="already connected"):
        players.state.admit(1, "dist_sync", stream=True)  # no session: never a reconnect
    assert players.state.peers == peers and players.closed == []  # nothing changed
    players.lose(1)
    with pytest.raises(MembershipError, match="already connected"):
        players.state.admit(1, "dist_sync", stream=True, session="intruder")
    assert players.state.status()["workers_reconnecting"] == [1]  # still its own to retake


def test_no_stream_is_taken_after_the_job_failed():
    players = started(2)
    players.run(players.state.job_failed("worker 0 died"))
    peers = dict(players.state.peers)
    with pytest.raises(MembershipError, match="the job failed"):
        players.reconnect(1)
    assert players.state.peers == peers and players.closed == []  # the old stream stays
    one_shot, todo = players.state.admit(1, "dist_sync", stream=False)  # still taken
    assert not one_shot.stream and todo == []


# ---------------------------------------------------------------- exactly once


def test_a_resent_push_is_answered_without_being_counted_again():
    players = started(2)
    first = players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(0, {"w": f32(1, 1)}, tag=1, seq=first)  # the reply was lost: sent again
    assert players.reply(0, first) == OK
    players.push(1, {"w": f32(10, 10)}, tag=1)
    pull = players.pull(0, ["w"])
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(11, 11))
    assert players.state.entries["w"].rounds.closed_round == 1


def test_a_resent_push_after_its_round_closed_changes_nothing():
    players = started(2)
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(1, {"w": f32(2, 2)}, tag=1)
    again = players.push(1, {"w": f32(2, 2)}, tag=1)  # resent after the round closed
    assert players.reply(1, again) == OK
    players.push(0, {"w": f32(5, 5)}, tag=2)
    players.push(1, {"w": f32(6, 6)}, tag=2)
    pull = players.pull(0, ["w"])
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(11, 11))


def test_a_resent_frame_counts_only_its_keys_that_were_not_counted():
    players = started(2, a=f32(0, 0), b=f32(0, 0))
    players.push(0, {"a": f32(1, 1)}, tag=1)
    # After a restore from an older checkpoint, "a" was counted and "b" was not.
    players.send(0, Op.PUSH, [("a", f32(1, 1)), ("b", f32(3, 3))], tags=[1, 1])
    players.push(1, {"a": f32(2, 2), "b": f32(4, 4)}, tag=1)
    pull = players.pull(0, ["a", "b"])
    values = players.reply(0, pull)
    np.testing.assert_array_equal(values["a"], f32(3, 3))
    np.testing.assert_array_equal(values["b"], f32(7, 7))


def test_an_async_push_is_answered_once_applied_and_a_sync_one_once_counted():
    players = started(2, store_type="dist_async")
    players.hold_updates = True
    push = players.push(0, {"w": f32(1, 1)}, tag=1)
    assert players.waiting(0, push)  # counted, not yet applied
    players.finish_updates()
    assert players.reply(0, push) == OK
    sync = started(2)
    sync.hold_updates = True
    assert sync.reply(0, sync.push(0, {"w": f32(1, 1)}, tag=1)) == OK  # its round waits


def test_async_pushes_are_counted_once_each():
    players = started(2, store_type="dist_async")
    first = players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(0, {"w": f32(1, 1)}, tag=1, seq=first)
    players.push(0, {"w": f32(1, 1)}, tag=2)
    pull = players.pull(0, ["w"])
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(1, 1))
    assert players.state.entries["w"].rounds.closed_round == 2


def test_a_resent_init_is_answered_and_a_new_init_of_a_held_key_is_refused():
    players = Players(2)
    first = players.init(0, {"w": f32(0, 0)})
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.send(0, Op.INIT, [("w", f32(9, 9))], seq=first)  # resent: the value stays
    assert players.reply(0, first) == OK
    players.push(1, {"w": f32(2, 2)}, tag=1)
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(3, 3))
    other = players.init(0, {"w": f32(9, 9)})
    assert isinstance(players.reply(0, other), DuplicateInitError)


# ---------------------------------------------------------------- checkpoints


def test_a_checkpoint_plan_holds_closed_rounds_and_leaves_open_pushes_to_be_resent():
    players = started(2, a=f32(0, 0), b=f32(0, 0))
    players.push(0, {"a": f32(1, 1), "b": f32(1, 1)}, tag=1)  # seq s1
    players.push(1, {"a": f32(2, 2)}, tag=1)  # closes round 1 of "a" only
    plan = players.state.checkpoint_plan()
    rounds = {entry.key: (closed, tags, last) for entry, closed, tags, last in plan.entries}
    assert rounds["a"] == (1, {0: 1, 1: 1}, {0: 1, 1: 1})
    assert rounds["b"] == (0, {}, {})  # worker 0's push to "b" is in an open round
    first_of_worker_0 = min(seq for (worker, seq) in players.replies if worker == 0)
    assert plan.durable_seqs[0] <= first_of_worker_0 + 1
    assert plan.durable_seqs[1] == max(seq for (w, seq) in players.replies if w == 1) + 1


def test_a_checkpoint_plan_holds_no_push_numbered_below_a_pull_that_came_ahead_of_it():
    """A worker's replay after a cut sends a pull (numbered after every request it resends)
    ahead of the pushes it resends after that pull's answer: a checkpoint written between
    holds none of them, so its plan must not tell the worker they are durable (the worker
    would then drop their copies, and a second restart would lose them)."""
    players = started(2)
    players.push(0, {"w": f32(1, 1)}, tag=1, seq=20)
    players.push(1, {"w": f32(2, 2)}, tag=1, seq=21)  # round 1 closes
    pull = players.send(0, Op.PULL, [("w", np.empty(0, np.float32))], seq=40)
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(3, 3))
    assert players.state.checkpoint_plan().durable_seqs[0] == 21
    players.push(0, {"w": f32(5, 5)}, tag=2, seq=30)  # the resend the pull came ahead of
    assert players.state.checkpoint_plan().durable_seqs[0] == 30  # in the open round


def test_a_checkpoint_plan_holds_no_states_load_waiting_for_a_round_to_be_applied():
    players = started(2)
    players.hold_updates = True
    for worker in range(2):
        players.send(worker, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    save = players.send(0, Op.SAVE_STATES, text='{"dump_optimizer": false}')
    players.push(0, {"w": f32(1, 1)})
    players.push(1, {"w": f32(1, 1)})  # round 1 closes; its update is not applied yet
    states = np.frombuffer(players.reply(0, save), np.uint8)
    load = players.send(0, Op.LOAD_STATES, [(None, states)])
    assert players.waiting(0, load)
    assert players.state.checkpoint_plan().durable_seqs[0] == load  # not loaded yet
    players.finish_updates()
    assert players.reply(0, load) == OK
    assert players.state.checkpoint_plan().durable_seqs[0] == load + 1


def test_a_restored_state_takes_resent_pushes_once_and_finishes_the_round():
    players = started(2)
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(1, {"w": f32(2, 2)}, tag=1)
    plan = players.state.checkpoint_plan()
    keys = [(e.key, e.value.copy(), c, t, last, {}) for e, c, t, last in plan.entries]
    players.push(0, {"w": f32(5, 5)}, tag=2)  # lost with the server

    restored = Players(2)
    snapshots.restore(restored.state, "dist_sync", keys, None, None, plan.durable_seqs)
    restored.state.validate()
    restored.push(0, {"w": f32(1, 1)}, tag=1)  # held by the checkpoint: not counted
    restored.push(0, {"w": f32(5, 5)}, tag=2)
    restored.push(1, {"w": f32(6, 6)}, tag=2)
    pull = restored.pull(1, ["w"])
    np.testing.assert_array_equal(restored.reply(1, pull)["w"], f32(11, 11))
    again = restored.send(0, Op.INIT, [("w", f32(0, 0))])  # a resent init of a restored key
    assert restored.reply(0, again) == OK


def test_with_checkpoints_a_new_key_is_answered_for_once_a_checkpoint_holds_it():
    players = Players(2)
    players.state.checkpoints = True
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32")]))
    init = players.init(0, {"w": f32(0, 0)})
    assert players.waiting(0, init) and players.waiting(1, check)  # not durable yet
    assert [c.seq for c in players.checkpoints] == [init]
    players.checkpoint_written()
    assert players.reply(0, init) == OK and players.reply(1, check) == OK


def test_a_checkpoint_request_to_a_server_without_checkpoints_is_refused():
    players = started(2)
    reply = players.reply(0, players.send(0, Op.CHECKPOINT))
    assert isinstance(reply, InvalidArgumentError) and "--checkpoint-dir" in str(reply)


def test_a_worker_that_said_goodbye_may_leave():
    players = started(2)
    assert players.reply(1, players.send(1, Op.CLOSE)) == OK
    players.lose(1)
    assert players.failures == [] and players.state.failure is None
    assert players.state.workers_connected() == [0]
    assert players.state.left == {1}  # said goodbye, then its stream ended


def test_only_a_stream_ended_after_a_goodbye_counts_as_a_worker_that_left():
    players = started(2)
    players.send(0, Op.CLOSE)
    assert players.state.left == set()  # (its stream is still open)
    players.lose(1)  # no goodbye: it may come back
    assert players.state.left == set()
    players.lose(0)
    assert players.state.left == {0}


def test_a_job_failure_answers_every_waiter_once_and_keeps_the_first_reason():
    players = started(2)
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("v", (1,), "float32")]))
    players.run(players.state.job_failed("server 1 died"))
    players.run(players.state.job_failed("something later"))
    assert [f.reason for f in players.failures] == ["server 1 died"]
    for worker, seq in ((0, pull), (1, check)):
        error = players.reply(worker, seq)
        assert isinstance(error, PeerLostError) and "server 1 died" in str(error)


def test_a_failing_update_fails_the_pulls_of_its_round_naming_key_and_round():
    players = started(2)

    def explode(key, received, stored):
        raise FloatingPointError("nan in the gradient")

    players.state.updater = explode  # an updater object is only ever called
    players.push(0, {"w": f32(1, 1)})
    pull = players.pull(0, ["w"])
    players.push(1, {"w": f32(1, 1)})
    error = players.reply(0, pull)
    assert isinstance(error, ServerError)
    assert "key 'w' in round 1" in str(error) and "nan in the gradient" in str(error)


# ---------------------------------------------------------------- async


def test_async_pushes_apply_as_they_arrive_and_pulls_never_wait():
    players = started(2, "dist_async")
    players.push(0, {"w": f32(1, 1)})
    np.testing.assert_array_equal(players.reply(0, players.pull(0, ["w"]))["w"], f32(1, 1))
    players.push(0, {"w": f32(2, 2)})  # no double push in async
    players.push(1, {"w": f32(5, 5)})
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(5, 5))
    assert players.state.entries["w"].rounds.applied_round == 3


# ---------------------------------------------------------------- admission


def test_admission_names_what_does_not_fit():
    players = Players(2, "dist_sync")
    with pytest.raises(MembershipError, match="already connected"):
        players.state.admit(0, "dist_sync", stream=True)
    with pytest.raises(MembershipError, match="every worker must create the same store type"):
        players.state.admit(1, "dist_async", stream=False)
    with pytest.raises(MembershipError, match="out of range for 2 workers"):
        players.state.admit(2, "dist_sync", stream=True)
    with pytest.raises(InvalidArgumentError, match="unknown store type"):
        players.state.admit(1, "local", stream=False)
    one_shot, todo = players.state.admit(0, "dist_sync", stream=False)  # one frame may come
    assert not one_shot.stream and todo == [] and players.state.workers_connected() == [0, 1]


# ---------------------------------------------------------------- the optimizer


def sgd_text(**params: float) -> str:
    return json.dumps(optimizer.SGD(**params).get_config())


def test_every_worker_sends_the_optimizer_and_it_is_installed_once():
    players = started(2)
    text = sgd_text(learning_rate=0.1)
    assert players.reply(0, players.send(0, Op.SET_OPTIMIZER, text=text)) == OK
    updater = players.state.updater
    assert players.reply(1, players.send(1, Op.SET_OPTIMIZER, text=text)) == OK
    assert players.state.updater is updater
    players.push(0, {"w": f32(1, 1)})
    players.push(1, {"w": f32(1, 1)})
    np.testing.assert_allclose(players.state.entries["w"].value, f32(-0.2, -0.2))


def test_new_hyper_parameters_keep_the_optimizers_states():
    players = started(2)
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    players.push(0, {"w": f32(1, 1)})
    players.push(1, {"w": f32(1, 1)})
    updater = players.state.updater
    states = updater.states.copy()
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.01, momentum=0.9))
    assert players.state.updater is updater and updater.states.keys() == states.keys()
    assert updater.optimizer.learning_rate == pytest.approx(0.01)


def test_a_new_optimizer_waits_for_the_rounds_its_sender_pushed_into():
    """A worker's push counted, then its new optimizer (as a restarted server gets them,
    resent back to back, before the other worker's push of that round): the round is
    applied with the optimizer it was pushed under, and the new one answered after it; a
    checkpoint written meanwhile does not hold the waiting request."""
    players = started(2)
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1))
    players.push(0, {"w": f32(1, 1)}, tag=1)
    change = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=1.0))
    assert players.waiting(0, change)
    players.hold_updates = True
    players.push(1, {"w": f32(1, 1)}, tag=1)  # the round closes; its update is held
    assert players.waiting(0, change)
    assert players.state.checkpoint_plan().durable_seqs[0] == change  # the push is in
    players.hold_updates = False
    players.finish_updates()
    np.testing.assert_allclose(players.state.entries["w"].value, f32(-0.2, -0.2))
    assert players.reply(0, change) == OK
    assert players.state.updater.optimizer.learning_rate == pytest.approx(1.0)
    players.push(0, {"w": f32(1, 1)}, tag=2)
    players.push(1, {"w": f32(1, 1)}, tag=2)
    np.testing.assert_allclose(players.state.entries["w"].value, f32(-2.2, -2.2))


def test_a_new_optimizer_waiting_for_a_round_that_fails_is_installed_all_the_same():
    """The round fails (AdaGrad refuses weight decay for this key's rows): the new
    optimizer its sender sent behind its push (a fix, say) is installed and answered, and
    the sender hears of the failure at its next pull of the key; the next round uses the
    new optimizer."""
    players = Players(2)
    assert players.reply(0, players.row_init(0, "emb", (10, 2), (0, 10))) == OK
    adagrad = json.dumps(optimizer.AdaGrad(learning_rate=0.5, wd=0.1).get_config())
    players.send(0, Op.SET_OPTIMIZER, text=adagrad)
    rows = np.ones((1, 2), np.float32)
    players.row_push(0, "emb", [3], rows, tag=1)
    change = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=1.0))
    assert players.waiting(0, change)
    players.row_push(1, "emb", [3], rows, tag=1)  # the round closes, and fails
    assert players.reply(0, change) == OK
    assert players.state.optimizer_config["name"] == "sgd"
    failed = players.reply(0, players.row_pull(0, "emb", [3]))
    assert isinstance(failed, ServerError) and "round 1" in str(failed)
    players.row_push(0, "emb", [3], rows, tag=2)
    players.row_push(1, "emb", [3], rows, tag=2)
    assert isinstance(players.reply(1, players.row_pull(1, "emb", [3])), ServerError)  # once
    pulled = players.reply(1, players.row_pull(1, "emb", [3]))["emb"]
    assert pulled.tolist() == [[-2.0, -2.0]]  # round 2 alone, by SGD


def test_an_optimizer_or_states_load_resent_after_a_cut_is_not_applied_again():
    """A cut stream's resend of a new optimizer (or a states load) the server took already
    is answered and changes nothing: an optimizer set since stays, and loaded states are
    not put back (a cut alone re-applied them, silently)."""
    players = started(2)
    first = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(1, {"w": f32(1, 1)}, tag=1)
    saved = players.reply(0, players.send(0, Op.SAVE_STATES, text="{}"))
    load = players.send(0, Op.LOAD_STATES, [(None, np.frombuffer(saved, np.uint8))])
    players.push(0, {"w": f32(1, 1)}, tag=2)
    players.push(1, {"w": f32(1, 1)}, tag=2)
    players.send(1, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.01, momentum=0.9))
    states = players.state.updater.dump_states(False)
    players.lose(0, ConnectionResetError("cut"))
    players.reconnect(0)
    text = sgd_text(learning_rate=0.1, momentum=0.9)
    assert players.reply(0, players.send(0, Op.SET_OPTIMIZER, text=text, seq=first)) == OK
    resent = [(None, np.frombuffer(saved, np.uint8))]
    assert players.reply(0, players.send(0, Op.LOAD_STATES, resent, seq=load)) == OK
    assert players.state.updater.optimizer.learning_rate == pytest.approx(0.01)
    assert players.state.updater.dump_states(False) == states


def test_a_waiting_optimizer_resent_after_a_cut_is_answered_on_the_new_stream():
    players = started(2)
    players.push(0, {"w": f32(1, 1)}, tag=1)
    change = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=1.0))
    players.lose(0, ConnectionResetError("cut"))
    players.reconnect(0)
    assert players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=1.0), seq=change)
    assert players.waiting(0, change)
    players.push(1, {"w": f32(1, 1)}, tag=1)
    assert players.reply(0, change) == OK
    assert players.state.updater.optimizer.learning_rate == pytest.approx(1.0)


def test_optimizers_asked_for_back_to_back_are_installed_in_turn():
    """A second new optimizer, sent while the first waits for its rounds, is compared with
    the first, not with the one in force (it was taken for no change, and the first then
    installed)."""
    players = started(2)
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1))
    players.push(0, {"w": f32(1, 1)}, tag=1)
    faster = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=1.0))
    back = players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1))
    assert players.waiting(0, faster) and players.waiting(0, back)
    players.push(1, {"w": f32(1, 1)}, tag=1)
    assert (players.reply(0, faster), players.reply(0, back)) == (OK, OK)
    assert players.state.updater.optimizer.learning_rate == pytest.approx(0.1)


def test_a_bad_optimizer_configuration_is_refused_and_changes_nothing():
    players = started(2)
    not_json = players.reply(0, players.send(0, Op.SET_OPTIMIZER, text="{"))
    assert isinstance(not_json, InvalidArgumentError)
    unknown = players.reply(0, players.send(0, Op.SET_OPTIMIZER, text='{"name": "nope"}'))
    assert isinstance(unknown, OptimizerError)
    assert players.state.updater is None and players.state.optimizer_config is None


def test_saving_or_loading_states_without_an_optimizer_says_so():
    players = started(2)
    save = players.reply(0, players.send(0, Op.SAVE_STATES, text="{}"))
    assert isinstance(save, OptimizerNotSetError) and "server 0" in str(save)
    load = players.reply(0, players.send(0, Op.LOAD_STATES, [(None, np.zeros(4, np.uint8))]))
    assert isinstance(load, OptimizerNotSetError)


def test_states_saved_by_one_state_load_into_another():
    players = started(2)
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    players.push(0, {"w": f32(1, 1)})
    players.push(1, {"w": f32(1, 1)})
    data = players.reply(0, players.send(0, Op.SAVE_STATES, text='{"dump_optimizer": false}'))
    other = started(2)
    other.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    array = np.frombuffer(data, np.uint8)
    assert other.reply(0, other.send(0, Op.LOAD_STATES, [(None, array)])) == OK
    np.testing.assert_array_equal(
        other.state.updater.states["w"], players.state.updater.states["w"]
    )


def test_states_are_saved_and_loaded_after_the_round_of_the_senders_last_push():
    """dist_sync answers a push once counted; a save sent after it waits for its round (the
    other worker's push) to be applied, so that the states hold its update, and a load
    waits likewise, so that the round does not update the states it loads."""
    players = started(2)
    for worker in range(2):
        players.send(worker, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1, momentum=0.9))
    players.push(0, {"w": f32(1, 1)})
    save = players.send(0, Op.SAVE_STATES, text='{"dump_optimizer": false}')
    assert players.waiting(0, save)
    assert players.reply(1, players.send(1, Op.SAVE_STATES, text="{}")) is not None  # no push
    players.push(1, {"w": f32(1, 1)})
    saved = optimizer.decode_states(players.reply(0, save)).states["w"]
    np.testing.assert_allclose(saved, f32(-0.2, -0.2))  # the momentum after round 1
    players.push(0, {"w": f32(1, 1)})
    load = players.send(
        0, Op.LOAD_STATES, [(None, np.frombuffer(players.reply(0, save), np.uint8))]
    )
    assert players.waiting(0, load)
    players.push(1, {"w": f32(1, 1)})  # round 2 applied, then the states loaded
    assert players.reply(0, load) == OK
    np.testing.assert_allclose(players.state.updater.states["w"], f32(-0.2, -0.2))
    players.state.validate()


# ---------------------------------------------------------------- invariants


def test_validate_catches_a_ticket_whose_count_is_wrong():
    players = started(2)
    players.push(0, {"w": f32(1, 1)})
    players.pull(0, ["w"])
    players.state.validate()
    (ticket,) = players.state.entries["w"].rounds.waiting_tickets()
    ticket.remaining = 2
    with pytest.raises(AssertionError, match="ticket count"):
        players.state.validate()


# ---------------------------------------------------------------- frames checked whole (issue #9)

GIB = 1 << 30


def assert_nothing_counted(players: Players) -> None:
    """No round touched, no pull parked, no init waiting, on any key."""
    for entry in players.state.entries.values():
        rounds = entry.rounds
        assert rounds.waiting_tickets() == [] and rounds.missing() == [], entry.key
        assert all(rounds.last_push_round(w) == 0 for w in range(players.state.num_workers))
        assert rounds.applied_round == 0 and rounds.closed_round == 0, entry.key


def assert_a_round_still_works(players: Players) -> None:
    players.push(0, {"w": f32(1, 2)})
    players.push(1, {"w": f32(10, 20)})
    np.testing.assert_array_equal(players.reply(0, players.pull(0, ["w"]))["w"], f32(11, 22))


def declared(op: int, nbytes: int, key: object = "w", dtype: str = "u1") -> FrameHeader:
    """A header declaring one array of ``nbytes`` (its payload never sent)."""
    dt = np.dtype(dtype)
    info = ArrayInfo(key, dt, (nbytes // dt.itemsize,), nbytes)
    return FrameHeader(op, 0, 99, 0, (info,), "", nbytes)


@pytest.mark.parametrize(
    ("op", "key", "dtype", "error", "words"),
    [
        (Op.PUSH, "ghost", "u1", KeyNotInitializedError, "never initialized"),
        (Op.PUSH, "w", "f4", ShapeMismatchError, "shape (268435456,)"),
        (Op.PUSHPULL, "w", "u1", ShapeMismatchError, "does not match"),
        (Op.PUSH, None, "u1", InvalidArgumentError, "carries no key"),
        (Op.PULL, "w", "f4", InvalidArgumentError, "a pull carries none"),
        (Op.INIT, "w", "u1", DuplicateInitError, "already holds it"),
        (42, "w", "u1", InvalidArgumentError, "unknown op 42"),
        (Op.REPLY, "w", "u1", InvalidArgumentError, "unknown op 100"),
        (Op.SET_OPTIMIZER, None, "u1", InvalidArgumentError, "set_optimizer carries no arrays"),
        (Op.CLOSE, None, "u1", InvalidArgumentError, "close carries no arrays"),
        (Op.LOAD_STATES, None, "u1", OptimizerNotSetError, "no optimizer is set"),
    ],
)
def test_a_refused_header_declaring_a_gib_gets_no_memory_and_counts_nothing(
    op, key, dtype, error, words
):
    players = started(2)
    peer = players.peers[0]
    tracemalloc.start()
    try:
        landing = players.state.header_arrived(peer, declared(op, GIB, key, dtype))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert isinstance(landing.error, error) and words in str(landing.error), landing.error
    assert landing.buffers == [None]  # the service reads the payload and drops it
    header = declared(op, GIB, key, dtype)
    players.run(players.state.message_completed(peer, header, [memoryview(b"")], landing, 0.0))
    reply = players.reply(0, 99)
    assert isinstance(reply, error) and words in str(reply)
    assert_nothing_counted(players)
    assert players.state.entries.keys() == {"w"} and players.state.updater is None
    assert_a_round_still_works(players)


def test_a_pull_frame_with_a_payload_is_refused_and_parks_nothing():
    players = started(2)
    players.push(0, {"w": f32(1, 1)})  # a pull now would park until worker 1 pushes
    reply = players.reply(0, players.send(0, Op.PULL, [("w", f32(5, 5))]))
    assert isinstance(reply, InvalidArgumentError) and "a pull carries none" in str(reply)
    assert players.state.entries["w"].rounds.waiting_tickets() == []
    players.push(1, {"w": f32(2, 2)})
    np.testing.assert_array_equal(players.reply(0, players.pull(0, ["w"]))["w"], f32(3, 3))


EMPTY = np.empty(0, np.float32)


@pytest.mark.parametrize(
    ("op", "arrays"),
    [
        (Op.PUSH, [("w", f32(1, 1)), ("v", f32(1, 1)), ("w", f32(1, 1))]),
        (Op.PUSHPULL, [("w", f32(1, 1)), ("w", f32(1, 1))]),
        (Op.PULL, [("v", EMPTY), ("w", EMPTY), ("v", EMPTY)]),
        (Op.INIT, [("a", f32(1)), ("a", f32(2))]),
    ],
)
def test_a_frame_naming_a_key_twice_is_refused_for_every_op(op, arrays):
    players = started(2, w=f32(0, 0), v=f32(0, 0))
    reply = players.reply(0, players.send(0, op, arrays))
    assert isinstance(reply, InvalidArgumentError) and "twice in one request" in str(reply)
    assert_nothing_counted(players)
    assert players.state.entries.keys() == {"w", "v"}
    assert_a_round_still_works(players)


@pytest.mark.parametrize(
    ("op", "arrays"),
    [
        (Op.PUSH, [("w", f32(1, 1)), (3, f32(1, 1))]),
        (Op.PUSHPULL, [("w", f32(1, 1)), (3, f32(1, 1))]),
        (Op.PULL, [("w", EMPTY), (3, EMPTY)]),
        (Op.INIT, [(3, f32(1)), ("a", f32(2))]),
    ],
)
def test_a_frame_mixing_int_and_str_keys_is_refused_for_every_op(op, arrays):
    players = started(2)
    reply = players.reply(0, players.send(0, op, arrays))
    assert isinstance(reply, InvalidArgumentError) and "mixes int and str keys" in str(reply)
    assert_nothing_counted(players)
    assert players.state.entries.keys() == {"w"}
    assert_a_round_still_works(players)


def test_a_refused_push_takes_no_staging_buffer(monkeypatch):
    players = started(2, w=f32(0, 0), v=f32(0, 0))
    taken = []
    real = ServerEntry.take_buffer
    monkeypatch.setattr(ServerEntry, "take_buffer", lambda self: taken.append(self) or real(self))
    for arrays in (
        [("w", f32(1, 1)), ("v", f32(1, 2, 3))],  # the second key's shape is wrong
        [("w", f32(1, 1)), ("nope", f32(1))],
        [("w", f32(1, 1)), ("w", f32(1, 1))],
    ):
        reply = players.reply(0, players.send(0, Op.PUSH, arrays))
        assert isinstance(reply, (ShapeMismatchError, KeyNotInitializedError, InvalidArgumentError))
    assert taken == []
    assert_nothing_counted(players)


def test_control_requests_carrying_arrays_are_refused_and_do_nothing():
    players = started(2)
    close = players.reply(0, players.send(0, Op.CLOSE, [(None, f32(1))]))
    assert isinstance(close, InvalidArgumentError) and "close carries no arrays" in str(close)
    sgd = sgd_text(learning_rate=0.1)
    optimizer_reply = players.reply(0, players.send(0, Op.SET_OPTIMIZER, [(None, f32(1))], sgd))
    assert isinstance(optimizer_reply, InvalidArgumentError)
    assert players.state.updater is None
    players.lose(0)  # the refused close was no goodbye: losing the worker fails the job
    players.tick(players.state.reconnect_s + 1)
    assert players.failures and "worker 0" in players.failures[0].reason


@pytest.mark.parametrize(
    "arrays",
    [
        [("w", np.zeros(4, np.uint8))],
        [(None, np.zeros(4, np.uint8)), (None, np.zeros(4, np.uint8))],
        [(None, np.zeros(4, np.float32))],
    ],
)
def test_load_states_carries_exactly_one_keyless_byte_array(arrays):
    players = started(2)
    players.send(0, Op.SET_OPTIMIZER, text=sgd_text(learning_rate=0.1))
    reply = players.reply(0, players.send(0, Op.LOAD_STATES, arrays))
    assert isinstance(reply, InvalidArgumentError) and "one uint8 array" in str(reply)


def test_an_init_gets_fresh_arrays_of_the_declared_shape_only_once_checked():
    players = Players(2)
    header, _ = decode_frame(frame_bytes(Op.INIT, 5, [("a", np.ones((2, 3), np.float64), 0)]))
    landing = players.state.header_arrived(players.peers[0], header)
    (buffer,) = landing.buffers
    assert buffer is not None and buffer.shape == (2, 3) and buffer.dtype == np.float64


def test_two_inits_of_one_key_in_flight_keep_the_first():
    players = Players(2)
    state, peer = players.state, players.peers[0]
    first = FrameHeader(Op.INIT, 0, 1, 0, (ArrayInfo("a", np.dtype("<f4"), (1,), 4),), "", 4)
    second = first._replace(seq=2)
    landings = [state.header_arrived(peer, header) for header in (first, second)]
    for header, landing, value in zip((first, second), landings, (1.0, 2.0), strict=True):
        landing.buffers[0][...] = value
        players.run(state.message_completed(peer, header, landing.buffers, landing, 0.0))
    assert players.reply(0, 1) == OK
    assert isinstance(players.reply(0, 2), DuplicateInitError)
    np.testing.assert_array_equal(state.entries["a"].value, f32(1))


# ---------------------------------------------------------------- payloads read in place


def pooled(entry: ServerEntry) -> list[np.ndarray]:
    return list(entry._spares)


def test_sync_pushes_read_in_place_are_answered_at_once_and_summed_out_of_the_senders_memory():
    players = started(3)
    players.lend = True
    players.hold_updates = True
    first = players.push(0, {"w": f32(1, 2)}, tag=1)
    # Answered once counted: what it lent stays the server's until handed back.
    assert players.reply(0, first) == OK and players.given_back == []
    players.finish_updates()
    entry = players.state.entries["w"]
    # The round's sum is the first push as it lies in worker 0's memory: not copied, and
    # held for the round.
    assert entry.merged is not None and not entry.merged.flags.writeable
    assert players.given_back == []
    second = players.push(1, {"w": f32(10, 20)}, tag=1)
    assert players.reply(1, second) == OK
    players.finish_updates()  # the sum of both, in one pass, into a buffer of the key's own
    assert sorted(players.given_back) == [(0, first), (1, second)]
    assert entry.merged is not None and entry.merged.flags.writeable
    np.testing.assert_array_equal(entry.merged, f32(11, 22))
    players.hold_updates = False
    players.push(2, {"w": f32(100, 200)}, tag=1)
    np.testing.assert_array_equal(entry.value, f32(111, 222))
    assert entry.value.flags.writeable and entry.borrowed is None
    assert all(buffer.flags.writeable for buffer in pooled(entry))


def test_a_push_read_in_place_that_closes_its_round_is_copied_and_given_back_at_once():
    players = started(1)
    players.lend = True
    first = players.push(0, {"w": f32(1, 2)}, tag=1)
    entry = players.state.entries["w"]
    assert players.given_back == [(0, first)]
    np.testing.assert_array_equal(entry.value, f32(1, 2))
    assert entry.value.flags.writeable and entry.merged is None and entry.borrowed is None


def test_a_frame_read_in_place_is_given_back_once_every_round_it_started_moved_on():
    players = started(2, a=f32(0, 0), w=f32(0, 0))
    players.lend = True
    both = players.push(0, {"a": f32(1, 1), "w": f32(2, 2)}, tag=1)
    a = players.push(1, {"a": f32(10, 10)}, tag=1)
    assert players.given_back == [(1, a)]  # "w"'s round still reads worker 0's frame
    w = players.push(1, {"w": f32(20, 20)}, tag=1)
    assert sorted(players.given_back) == sorted([(1, a), (0, both), (1, w)])
    np.testing.assert_array_equal(players.state.entries["a"].value, f32(11, 11))
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(22, 22))


def test_a_resent_push_read_in_place_is_given_back_at_once():
    players = started(2)
    players.lend = True
    first = players.push(0, {"w": f32(1, 1)}, tag=1)
    players.given_back.clear()
    players.push(0, {"w": f32(1, 1)}, tag=1, seq=first)
    assert players.given_back == [(0, first)]  # counted before: nothing reads it
    assert players.reply(0, first) == OK
    assert all(buffer.flags.writeable for buffer in pooled(players.state.entries["w"]))


def test_a_refused_push_read_in_place_is_given_back_at_once():
    players = started(2)
    players.lend = True
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.given_back.clear()
    seq = players.push(0, {"w": f32(1, 1)}, tag=2)  # the same round again
    assert isinstance(players.reply(0, seq), DoublePushError)
    assert players.given_back == [(0, seq)]
    assert all(buffer.flags.writeable for buffer in pooled(players.state.entries["w"]))


@pytest.mark.parametrize("with_updater", [False, True])
def test_async_pushes_read_in_place_become_values_of_their_own(with_updater):
    players = started(2, store_type="dist_async", w=f32(5, 5))
    players.lend = True
    if with_updater:
        text = sgd_text(learning_rate=1.0)
        assert players.reply(0, players.send(0, Op.SET_OPTIMIZER, text=text)) == OK
    push = players.push(0, {"w": f32(1, 2)}, tag=1)
    assert players.reply(0, push) == OK
    assert players.given_back == [(0, push)]
    entry = players.state.entries["w"]
    np.testing.assert_array_equal(entry.value, f32(4, 3) if with_updater else f32(1, 2))
    assert entry.value.flags.writeable
    assert all(buffer.flags.writeable for buffer in pooled(entry))


def with_regions(
    num_workers: int, nbytes: int = 1 << 16, keys: tuple[str, ...] = ("w",)
) -> tuple[Players, ArenaBook]:
    """Players whose server keeps its sums in the regions of an arena's book (as a server
    with local workers does)."""
    book = ArenaBook(Arena(nbytes), min_bytes=1)
    book.join()
    players = Players(num_workers)
    players.state.value_regions = book
    assert players.reply(0, players.init(0, {key: f32(0, 0) for key in keys})) == OK
    players.lend = True
    return players, book


def test_stored_values_leave_a_quarter_of_the_shared_regions_free():
    keys = tuple(f"k{i}" for i in range(60))
    players, book = with_regions(2, nbytes=4096, keys=keys)  # 64 regions of 64 bytes
    players.push(0, {key: f32(1, 2) for key in keys}, tag=1)
    players.push(1, {key: f32(10, 20) for key in keys}, tag=1)
    entries = [players.state.entries[key] for key in keys]
    for entry in entries:
        np.testing.assert_array_equal(entry.value, f32(11, 22))
    in_regions = [entry for entry in entries if book.holds(entry.value)]
    assert len(in_regions) == 48 and book.regions.regions == 48  # 3/4 of 64
    assert book.take(8) is not None  # the last quarter is still there for answers
    book.arena.close()


def test_a_rounds_sum_is_made_in_a_shared_region_and_the_old_value_given_back_to_it():
    players, book = with_regions(2)
    entry = players.state.entries["w"]
    assert not book.holds(entry.value)  # the init value is a buffer of the key's own
    for step in (1, 2, 3):
        players.push(0, {"w": f32(step, 1)}, tag=step)
        players.push(1, {"w": f32(10 * step, 2)}, tag=step)
        np.testing.assert_array_equal(entry.value, f32(11 * step, 3))
        # The sum was made where answers are sent from; the one it replaced is free again
        # (no stream sent it), and no region ever enters the key's spare buffers.
        assert book.holds(entry.value) and book.regions.regions == 1
        assert not any(book.holds(buffer) for buffer in pooled(entry))
    book.arena.close()


def test_a_lone_workers_push_is_copied_once_into_a_shared_region_and_stored_there():
    players, book = with_regions(1)
    entry = players.state.entries["w"]
    for step in (1, 2):
        players.push(0, {"w": f32(step, 2 * step)}, tag=step)
        np.testing.assert_array_equal(entry.value, f32(step, 2 * step))
        assert book.holds(entry.value) and book.regions.regions == 1
    assert players.given_back == [(0, 2), (0, 3)]  # the pushes, read in place, went back
    book.arena.close()


def test_an_updater_moves_a_stored_value_out_of_the_shared_regions_before_changing_it():
    players, book = with_regions(2)
    entry = players.state.entries["w"]
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(1, {"w": f32(2, 2)}, tag=1)
    shared = entry.value
    assert book.holds(shared)
    text = sgd_text(learning_rate=1.0)
    assert players.reply(0, players.send(0, Op.SET_OPTIMIZER, text=text)) == OK
    players.push(0, {"w": f32(1, 1)}, tag=2)
    players.push(1, {"w": f32(1, 2)}, tag=2)
    np.testing.assert_array_equal(entry.value, f32(1, 0))  # 3 - 1 * (1 + 1), 3 - 1 * (1 + 2)
    np.testing.assert_array_equal(shared, f32(3, 3))  # what a peer may still read: unchanged
    assert not book.holds(entry.value) and book.regions.regions == 0
    book.arena.close()


def test_a_pushpull_that_asks_hears_once_its_push_is_counted_then_gets_the_round():
    players = started(2)
    seq = players.send(0, Op.PUSHPULL, [("w", f32(1, 2))], tags=[1], flags=COUNTED)
    assert players.counted == [(0, seq)]  # at once: the round still waits for worker 1
    assert players.waiting(0, seq)
    players.push(1, {"w": f32(10, 20)}, tag=1)
    np.testing.assert_array_equal(players.reply(0, seq)["w"], f32(11, 22))
    plain = players.send(1, Op.PUSHPULL, [("w", f32(1, 1))], tags=[2])
    assert players.counted == [(0, seq)]  # not asked: no interim answer
    assert players.waiting(1, plain)


def refused_update_optimizer(players: Players) -> None:
    """An optimizer whose update of every key raises (GroupAdaGrad refuses weight decay)."""
    text = json.dumps(optimizer.GroupAdaGrad(learning_rate=0.1, wd=0.1).get_config())
    for worker in range(len(players.peers)):
        assert players.reply(worker, players.send(worker, Op.SET_OPTIMIZER, text=text)) == OK


@pytest.mark.parametrize("waiting", [False, True])
def test_a_failed_update_is_told_to_every_worker_by_its_next_pull(waiting):
    """dist_sync answers a push once counted: a worker whose pull did not wait for the failed
    round hears of it from its next pull of the key, once; the value is unchanged."""
    players = started(2, w=f32(1, 1))
    refused_update_optimizer(players)
    early = players.pull(0, ["w"]) if waiting else None
    players.push(0, {"w": f32(1, 1)})
    parked = players.pull(0, ["w"]) if waiting else None
    players.push(1, {"w": f32(1, 1)})
    assert players.unexpected == []
    if waiting:
        assert players.reply(0, early)["w"].tolist() == [1, 1]  # asked before the push
        assert "round 1 failed on server 0" in str(players.reply(0, parked))
    for worker in range(2) if not waiting else [1]:
        failed = players.reply(worker, players.pull(worker, ["w"]))
        assert isinstance(failed, ServerError), failed
        assert re.search(r"key 'w' in round 1 failed on server 0: OptimizerError", str(failed))
    for worker in range(2):  # told once: the next pull reads the value, unchanged
        np.testing.assert_array_equal(
            players.reply(worker, players.pull(worker, ["w"]))["w"], [1, 1]
        )


def test_a_failed_update_no_pull_told_is_the_answer_to_the_workers_goodbye():
    """A worker that never pulls after a failed round hears of it when it closes; one that
    was told already says goodbye as usual."""
    players = started(2, w=f32(1, 1))
    refused_update_optimizer(players)
    players.push(0, {"w": f32(1, 1)})
    players.push(1, {"w": f32(1, 1)})
    assert isinstance(players.reply(1, players.pull(1, ["w"])), ServerError)  # told
    goodbye = players.reply(0, players.send(0, Op.CLOSE))
    assert isinstance(goodbye, ServerError)
    assert "key 'w' in round 1 failed on server 0" in str(goodbye)
    assert players.reply(1, players.send(1, Op.CLOSE)) == OK
