"""A restarted server never answers from a state older than what it declared durable.

The pure parts: the ``DURABLE`` note and its header form, the :class:`Lineage` check of a
worker's last note against what the server restored, and what :class:`ServerState` does
with it (refuses the stream and fails the job naming the server, the file, the rounds it
restored and the rounds it should have had; in ``dist_async`` answers no pull until every
worker was checked). The whole-job checks are in ``tests/akv/cluster/test_restart.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from akv.cluster.protocol import Note, Op, format_note, parse_note, replay_barrier_text
from akv.cluster.server.durability import Lineage, ReplayBarrier, Restored
from akv.cluster.server.instructions import FailJob, StaleCheckpointError
from akv.cluster.server.state import ServerState
from akv.errors import InvalidArgumentError, MembershipError, PeerLostError
from akv_engine import Var
from tests.akv.cluster.server.players import OK, Players

PATH = "/ck/server-0.akvckpt"
#: A note of the process before the restart: checkpoint 27 (rounds up to 300) holds
#: every request of the worker numbered below 520.
BEFORE = Note("before", 27, 300, 520)


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


# ---------------------------------------------------------------- the note


def test_a_note_goes_through_its_text_form_unchanged():
    assert parse_note(format_note(BEFORE)) == BEFORE
    assert format_note(BEFORE) == "before 27 300 520"


@pytest.mark.parametrize(
    "text", ["", "a 1 2", "a 1 2 3 4", "a -1 2 3", "a x 2 3", "a/b 1 2 3", "x" * 65 + " 1 2 3"]
)
def test_a_malformed_note_is_an_invalid_argument(text):
    with pytest.raises(InvalidArgumentError, match="X-AKV-Durable must be"):
        parse_note(text)


# ---------------------------------------------------------------- the lineage


def restored(checkpoint: int = 9, rounds: int = 92, seqs: dict[int, int] | None = None) -> Lineage:
    lineage = Lineage("now", num_workers=2)
    lineage.restore(Restored(PATH, checkpoint, rounds, {0: 180, 1: 175} if seqs is None else seqs))
    return lineage


def test_without_a_restore_every_worker_passes():
    lineage = Lineage("now", num_workers=2)
    assert lineage.check(0, BEFORE) is None
    assert not lineage.answers_held


def test_a_note_of_this_process_or_no_note_passes():
    lineage = restored()
    assert lineage.check(0, Note("now", 12, 140, 700)) is None  # written since the restore
    assert lineage.check(1, None) is None  # never told of a checkpoint
    assert not lineage.answers_held  # both checked


def test_a_restored_checkpoint_that_holds_all_the_worker_dropped_recovers_exactly():
    lineage = restored(seqs={0: 520, 1: 175})
    assert lineage.check(0, BEFORE) is None  # its resent requests are all it lacks
    assert lineage.answers_held  # worker 1 not checked yet


def test_an_older_checkpoint_names_the_file_its_rounds_and_the_rounds_declared():
    lost = restored().check(0, BEFORE)
    assert lost == (
        f"restored checkpoint 9 from {PATH} (rounds up to 92; worker 0's requests below 180), "
        "but before its restart it had declared checkpoint 27 (rounds up to 300) durable to "
        "worker 0, which dropped its copies of its requests numbered below 520: the "
        "acknowledged pushes between are lost. Put the newest checkpoint back, or start the "
        "job again with another --checkpoint-dir (this one's checkpoints are no longer of one "
        "point in time)"
    )


def test_a_missing_checkpoint_names_the_missing_file():
    lineage = Lineage("now", num_workers=2)
    lineage.restore(Restored(PATH, 0, 0, {}))
    lost = lineage.check(1, BEFORE)
    assert lost is not None
    assert lost.startswith(f"started without a checkpoint ({PATH} is missing), but before")
    assert "declared checkpoint 27 (rounds up to 300) durable to worker 1" in lost


def test_finished_workers_are_not_waited_for():
    lineage = restored()
    lineage.check(0, None)
    assert lineage.answers_held
    lineage.finished([1])
    assert not lineage.answers_held


# ---------------------------------------------------------------- the state


def players_restored(store_type: str, seqs: dict[int, int] | None = None) -> Players:
    """Two workers with key ``w`` on a server that then restored checkpoint 9."""
    players = Players(2, store_type)
    assert players.reply(0, players.init(0, {"w": f32(0, 0)})) == OK
    players.state.name = "server 0"
    players.state.lineage.restore(Restored(PATH, 9, 92, {0: 180, 1: 175} if seqs is None else seqs))
    return players


def test_a_stale_restore_refuses_the_stream_and_fails_the_job_naming_itself():
    players = players_restored("dist_sync")
    players.push(1, {"w": f32(1, 1)}, tag=1)
    waiting = players.pull(1, ["w"])  # for worker 0's push: answered with the failure
    with pytest.raises(StaleCheckpointError, match=r"^server 0 restored checkpoint 9 from") as info:
        players.state.admit(0, "dist_sync", True, "session0", BEFORE)
    failing = info.value.instructions
    assert isinstance(failing[0], FailJob) and failing[0].blames_itself
    assert failing[0].detail.startswith("restored checkpoint 9")
    players.run(failing[1:])
    assert isinstance(players.reply(1, waiting), PeerLostError)
    assert players.state.failure == failing[0].reason
    with pytest.raises(Exception, match="the job failed"):
        players.reconnect(1)  # nothing more is taken


def test_a_stream_of_another_session_is_refused_before_its_note_is_judged():
    players = players_restored("dist_async")
    players.state.admit(0, "dist_async", True, "session0", None)  # worker 0's own stream
    with pytest.raises(MembershipError, match="already connected"):
        players.state.admit(0, "dist_async", True, "stranger", BEFORE)
    assert players.state.failure is None  # a stale note of a stranger fails nothing
    players.reconnect(1, Note("before", 27, 300, 175))
    assert not players.state.lineage.answers_held


def test_a_restored_dist_async_server_answers_no_pull_until_every_worker_was_checked():
    players = players_restored("dist_async")
    players.reconnect(0, None)
    players.push(0, {"w": f32(1, 1)}, tag=1)
    pull = players.pull(0, ["w"])
    assert players.waiting(0, pull)  # worker 1 may yet say that the restore lost its pushes
    players.reconnect(1, Note("before", 27, 300, 175))  # the restore holds all it dropped
    np.testing.assert_array_equal(players.reply(0, pull)["w"], f32(1, 1))


def test_a_restored_dist_async_server_lets_pulls_go_once_the_rest_finished():
    players = players_restored("dist_async")
    players.reconnect(0, None)
    pull = players.pull(0, ["w"])
    assert players.waiting(0, pull)
    players.run(players.state.workers_finished([1]))
    assert players.reply(0, pull) == {"w": pytest.approx(f32(0, 0))}


def test_a_restored_dist_sync_server_holds_nothing_back():
    players = players_restored("dist_sync")
    players.reconnect(0, None)
    players.push(0, {"w": f32(1, 1)}, tag=1)
    players.push(1, {"w": f32(2, 2)}, tag=1)  # worker 1 not checked: its round still closes
    np.testing.assert_array_equal(players.reply(0, players.pull(0, ["w"]))["w"], f32(3, 3))


# ---------------------------------------------------------------- dist_async replays


def barrier(worker: int, seq: int, barriers: int) -> ReplayBarrier:
    return ReplayBarrier(SimpleNamespace(worker=worker), seq, barriers)


def test_a_replay_barrier_waits_until_every_worker_sent_what_it_had_before_that_barrier():
    """Worker 0 sends again from after barrier 1, worker 1 from before it: worker 0's
    replay barrier 1 waits for worker 1's; its barrier 0 and its last pass it."""
    lineage = restored()
    lineage.check(0, None, replay=1)
    first = barrier(0, 1, 1)
    assert lineage.replay_barrier(first, last=False) == []  # worker 1 not even back
    lineage.check(1, None, replay=0)
    assert lineage.replay_barrier(barrier(1, 1, 0), last=False) == [barrier(1, 1, 0)]
    assert lineage.barriers == [first]
    lineage.replay_barrier(barrier(1, 2, 1), last=False)  # worker 1 reached barrier 1 ...
    assert first not in lineage.barriers  # ... which let worker 0's go
    passed = lineage.replay_barrier(barrier(0, 2, 3), last=True)  # worker 0's replay ends
    assert passed == []  # at barrier 3: worker 1 is still at 1
    both = [barrier(0, 2, 3), barrier(1, 3, 3)]
    assert lineage.replay_barrier(barrier(1, 3, 3), last=True) == both
    assert lineage.replaying == {} and lineage.barriers == []
    # After the replays (a later cut of the same process): answered at once.
    assert lineage.replay_barrier(barrier(0, 9, 5), last=True) == [barrier(0, 9, 5)]


def test_a_replay_barrier_waits_for_no_finished_worker():
    lineage = restored()
    lineage.check(0, None, replay=2)
    assert lineage.replay_barrier(barrier(0, 1, 2), last=True) == []
    assert lineage.finished([1]) == [barrier(0, 1, 2)]


def test_a_worker_a_restored_server_does_not_wait_for_is_not_waited_for_by_its_replay():
    """A cut after the restore's replays: the worker's replay barriers pass at once, and
    the others' do not wait for it; without a restore, nobody waits."""
    lineage = restored()
    lineage.check(0, None, replay=0)
    lineage.check(1, None)  # nothing to send again
    lineage.replay_barrier(barrier(0, 1, 0), last=True)
    lineage.check(0, None, replay=4)  # cut again later
    assert lineage.replaying == {}
    assert lineage.replay_barrier(barrier(0, 2, 4), last=False) == [barrier(0, 2, 4)]
    fresh = Lineage("now", num_workers=2)
    fresh.check(1, None, replay=3)
    assert fresh.replay_barrier(barrier(1, 1, 3), last=False) == [barrier(1, 1, 3)]


def test_replays_of_a_restored_dist_async_server_keep_the_order_of_the_barriers():
    """Without an optimizer a push replaces the value: the order the replays apply pushes
    in is what the value says. Worker 1 pushed 1 before the barrier, worker 0 pushed 2
    after it: whatever order their replays come in, 2 is applied last."""
    players = players_restored("dist_async")
    players.reconnect(0, None, replay=1)
    players.reconnect(1, None, replay=0)
    text = replay_barrier_text
    zero = players.send(0, Op.REPLAY_BARRIER, text=text(1, False))
    assert players.waiting(0, zero)  # worker 1 has not sent what it pushed before barrier 1
    assert players.reply(1, players.send(1, Op.REPLAY_BARRIER, text=text(0, False))) == OK
    players.push(1, {"w": f32(1, 1)}, tag=1)
    assert players.waiting(0, zero)
    last = players.send(1, Op.REPLAY_BARRIER, text=text(1, True))
    assert players.reply(0, zero) == OK and players.reply(1, last) == OK
    players.push(0, {"w": f32(2, 2)}, tag=1)
    assert players.reply(0, players.send(0, Op.REPLAY_BARRIER, text=text(1, True))) == OK
    np.testing.assert_array_equal(players.reply(1, players.pull(1, ["w"]))["w"], f32(2, 2))


def test_a_replay_barrier_waiting_when_the_job_fails_gets_the_failure():
    players = players_restored("dist_async")
    players.reconnect(0, None, replay=2)
    waiting = players.send(0, Op.REPLAY_BARRIER, text=replay_barrier_text(2, True))
    assert players.waiting(0, waiting)
    players.run(players.state.job_failed("worker 1 died"))
    assert isinstance(players.reply(0, waiting), PeerLostError)


@pytest.mark.parametrize("text", ["", "x", "1 first", "1 last 2", "-1", "1.5"])
def test_a_malformed_replay_barrier_is_refused(text):
    players = players_restored("dist_async")
    answer = players.reply(0, players.send(0, Op.REPLAY_BARRIER, text=text))
    assert isinstance(answer, InvalidArgumentError) and "replay barrier" in str(answer)


def test_a_restored_dist_async_server_takes_the_staleness_bound_of_its_first_worker():
    """A checkpoint keeps the store type, not the staleness bound: the first worker to
    open a stream fixes it, as in a new server (before, every worker of a job with
    AKV_STALENESS was refused by a restarted server: the job failed)."""
    state = ServerState("server 0", 2, 5.0, lambda name: Var(None, 0, name), checkpoints=True)
    state.store_type = "dist_async"  # as a restore from a dist_async checkpoint sets it
    state.lineage.restore(Restored(PATH, 9, 92, {}))
    state.admit(0, "dist_async", True, "session0", None, staleness=0)
    assert state.staleness == 0 and state.waiting is not None
    with pytest.raises(MembershipError, match="staleness 1, but this job's workers use 0"):
        state.admit(1, "dist_async", True, "session1", None, staleness=1)
    with pytest.raises(MembershipError, match="opened a dist_sync store, but server 0 was"):
        state.admit(1, "dist_sync", True, "session1", None)
