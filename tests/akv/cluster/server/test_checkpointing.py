"""When a server writes its checkpoints and what it tells whom (``checkpointing.Checkpoints``),
driven through its narrow interface: a real server state (played by ``Players``), a fake
of the two things it asks of the server, and real files in ``tmp_path``."""

from __future__ import annotations

import asyncio
import errno
import io
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from akv import optimizer
from akv.cluster.protocol import Note, Op, encode_meta
from akv.cluster.server import checkpoint as checkpoint_module
from akv.cluster.server import checkpointing
from akv.cluster.server.checkpoint import KeyRecord, Snapshot, read_snapshot, write_snapshot
from akv.cluster.server.checkpointing import Checkpoints, Copied, UnusableCheckpointError, copy_plan
from akv.cluster.server.instructions import (
    Checkpoint,
    CheckpointPlan,
    Durable,
    Instruction,
    Reply,
    ReplyError,
    StaleCheckpointError,
)
from akv.cluster.server.state import ServerState
from akv.errors import CheckpointError, MembershipError, ServerError, ShapeMismatchError
from akv.optimizer._states import StoredRows
from akv.rows import RowTable
from akv_engine import Var
from akv_transport import decode_frame, frame_bytes
from tests.akv.cluster.cluster import wait_until
from tests.akv.cluster.server.players import Players

pytestmark = pytest.mark.timeout(30)

RANK = 3


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


class FakeServer:
    """What ``Checkpoints`` asks of a server, done at once: a plan's values are copied
    (after ``gate``, when set), and each instruction is noted with the generation of the
    checkpoint on disk when it came."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.executed: list[Instruction] = []
        self.on_disk: list[int | None] = []
        self.copies = 0
        self.gate: asyncio.Event | None = None

    async def copy_values(self, plan: CheckpointPlan, directory: Path) -> Copied:
        self.copies += 1
        if self.gate is not None:
            await self.gate.wait()
        return copy_plan(plan, directory)

    def execute(self, instructions: Sequence[Instruction]) -> None:
        for instruction in instructions:
            snapshot = read_snapshot(self.directory, RANK)
            self.executed.append(instruction)
            self.on_disk.append(None if snapshot is None else snapshot.generation)

    def told(self, kind: type) -> list[Any]:
        """The instructions of ``kind`` executed so far, in order."""
        return [i for i in self.executed if isinstance(i, kind)]

    def disk_when(self, instruction: Instruction) -> int | None:
        """The checkpoint on disk when ``instruction`` was executed."""
        return self.on_disk[self.executed.index(instruction)]


Opener = Callable[..., tuple[Checkpoints, FakeServer]]


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Opener]:
    """Makes the checkpoints of a state, in ``tmp_path``; unlocks them all at the end."""
    made: list[Checkpoints] = []

    def open_(
        state: ServerState,
        num_workers: int = 2,
        interval_s: float = 3600.0,
        num_servers: int | None = None,
    ) -> tuple[Checkpoints, FakeServer]:
        server = FakeServer(tmp_path)
        checkpoints = Checkpoints(
            state,
            server,
            directory=tmp_path,
            rank=RANK,
            num_workers=num_workers,
            interval_s=interval_s,
            num_servers=num_servers,
        )
        made.append(checkpoints)
        return checkpoints, server

    yield open_
    for checkpoints in made:
        checkpoints.close()


def started() -> Players:
    players = Players(2)
    players.init(0, {"w": f32(0, 0)})
    return players


def on_disk(directory: Path) -> Snapshot:
    snapshot = read_snapshot(directory, RANK)
    assert snapshot is not None, "no checkpoint on disk"
    return snapshot


# ---------------------------------------------------------------------- when one is written


async def test_a_checkpoint_is_written_only_when_something_changed_since_the_last(opened, tmp_path):
    players = started()
    checkpoints, server = opened(players.state)
    assert checkpoints.restore() is None  # none yet: the first write is the first one
    await checkpoints.final()
    assert checkpoints.generation == on_disk(tmp_path).generation == 1
    await checkpoints.final()  # nothing changed since
    players.pull(0, ["w"])  # reading changes nothing either
    await checkpoints.final()
    assert server.copies == 1 and on_disk(tmp_path).generation == 1
    players.push(0, {"w": f32(1, 1)}, tag=1)
    await checkpoints.final()
    assert checkpoints.generation == on_disk(tmp_path).generation == 2
    assert server.copies == 2


async def test_the_interval_writes_a_checkpoint_only_after_a_change(opened):
    players = started()
    checkpoints, server = opened(players.state, interval_s=0.01)
    checkpoints.restore()
    timer = asyncio.create_task(checkpoints.every_interval())
    try:
        await wait_until(lambda: checkpoints.generation == 1, "the first checkpoint")
        await asyncio.sleep(0.2)  # about twenty intervals, idle
        assert checkpoints.generation == 1 and server.copies == 1
        players.push(0, {"w": f32(1, 1)}, tag=1)
        await wait_until(lambda: checkpoints.generation == 2, "a checkpoint after the push")
    finally:
        timer.cancel()


# ---------------------------------------------------------------------- answers


async def test_a_checkpoint_request_is_answered_once_the_file_holds_what_it_asked_for(
    opened, tmp_path
):
    players = Players(2, checkpoints=True)
    init = players.init(0, {"w": f32(1, 2)})
    assert players.waiting(0, init)  # a new key is answered once a checkpoint holds it
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    (asked,) = players.checkpoints
    assert asked == Checkpoint(players.peers[0], init)
    await checkpoints.on_request(asked)
    answer = Reply(players.peers[0], init)
    assert server.told(Reply) == [answer] and server.disk_when(answer) == 1
    (record,) = on_disk(tmp_path).keys
    assert record.key == "w"
    np.testing.assert_array_equal(record.value, f32(1, 2))

    request = players.send(1, Op.CHECKPOINT)  # a worker whose kept pushes grew too large
    await checkpoints.on_request(players.checkpoints[-1])
    answer = Reply(players.peers[1], request)
    assert server.told(Reply)[-1] == answer and server.disk_when(answer) == 2


async def test_other_workers_init_checks_are_answered_once_a_checkpoint_holds_the_key(opened):
    players = Players(2, checkpoints=True)
    init = players.init(0, {"w": f32(1, 2)})
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32")]))
    assert players.waiting(1, check)  # the key exists, but a restart would not have it
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    await checkpoints.on_request(players.checkpoints[0])
    answers = server.told(Reply)
    assert set(answers) == {Reply(players.peers[1], check), Reply(players.peers[0], init)}
    assert {server.disk_when(answer) for answer in answers} == {1}


async def test_requests_that_come_during_a_write_are_answered_by_the_next_one(opened):
    players = Players(2, checkpoints=True)
    init = players.init(0, {"w": f32(1, 2)})
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    server.gate = asyncio.Event()
    first = asyncio.create_task(checkpoints.on_request(players.checkpoints[0]))
    await wait_until(lambda: server.copies == 1, "the first write copying")
    request = players.send(1, Op.CHECKPOINT)
    await checkpoints.on_request(players.checkpoints[-1])  # returns: the first one serves it
    assert server.told(Reply) == []
    server.gate.set()
    await first
    early, late = Reply(players.peers[0], init), Reply(players.peers[1], request)
    assert server.told(Reply) == [early, late]
    assert server.disk_when(early) == 1 and server.disk_when(late) == 2
    assert server.copies == 2


async def test_a_goodbye_is_answered_once_a_checkpoint_holds_what_its_worker_changed(
    opened, tmp_path
):
    """A worker that left resends nothing to a restarted server: its goodbye waits for a
    checkpoint of its pushes (answered at once, before, and a restart before the final
    checkpoint lost them without a word). With nothing changed since, none is written."""
    players = Players(2, checkpoints=True)
    players.init(0, {"w": f32(0, 0)})
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    await checkpoints.on_request(players.checkpoints.pop())  # the init's
    for worker in (0, 1):
        players.push(worker, {"w": f32(1, 2)}, tag=1)
    goodbye = players.send(0, Op.CLOSE)
    assert players.waiting(0, goodbye)
    (asked,) = players.checkpoints
    assert asked == Checkpoint(players.peers[0], goodbye, if_changed=True)
    await checkpoints.on_request(asked)
    answer = Reply(players.peers[0], goodbye)
    assert server.told(Reply)[-1] == answer and server.disk_when(answer) == 2
    (record,) = on_disk(tmp_path).keys
    np.testing.assert_array_equal(record.value, f32(2, 4))
    # The other worker's goodbye: nothing changed since, so none is written for it.
    other = players.send(1, Op.CLOSE)
    await checkpoints.on_request(players.checkpoints[-1])
    assert server.told(Reply)[-1] == Reply(players.peers[1], other)
    assert server.copies == 2 and checkpoints.generation == 2
    await checkpoints.final()  # and the final one has nothing to add
    assert server.copies == 2


def test_a_goodbye_to_a_server_without_checkpoints_is_answered_at_once():
    players = Players(2)
    players.init(0, {"w": f32(0, 0)})
    goodbye = players.send(0, Op.CLOSE)
    assert players.reply(0, goodbye) == "ok" and players.checkpoints == []


async def test_a_failed_write_answers_each_request_with_its_error_and_keeps_the_last(
    opened, tmp_path, monkeypatch
):
    players = Players(2, checkpoints=True)
    init = players.init(0, {"w": f32(1, 2)})
    checkpoints, server = opened(players.state)
    checkpoints.restore()

    def full(directory: Path, snapshot: Snapshot) -> Path:
        raise CheckpointError(f"cannot write {directory}: no space left")

    monkeypatch.setattr(checkpointing, "write_snapshot", full)
    await checkpoints.on_request(players.checkpoints[0])
    (answer,) = server.executed
    assert isinstance(answer, ReplyError) and (answer.peer, answer.seq) == (players.peers[0], init)
    assert "no space left" in str(answer.error)
    assert checkpoints.generation == 0 and read_snapshot(tmp_path, RANK) is None
    assert not players.state.entries["w"].durable  # still not answered for


async def test_a_restore_that_lost_declared_pushes_writes_no_checkpoint(opened, tmp_path):
    """Once a worker's note shows that the restored file lacks pushes it was told are
    durable (the job fails), no checkpoint replaces the file: a new job on the directory
    would start from that state without a word. Nor does a server that started without a
    file and changed nothing write one at its stop (a worker's stream is no change)."""
    stored = stored_snapshot(tmp_path)
    state = fresh_state()
    checkpoints, server = opened(state)
    checkpoints.restore()
    newer = Note("an earlier process", stored.generation + 3, 9, stored.durable_seqs[0] + 5)
    with pytest.raises(StaleCheckpointError):
        state.admit(0, "dist_sync", stream=True, session="session0", note=newer)
    with pytest.raises(CheckpointError, match="writes no checkpoint: it restored checkpoint 7"):
        await checkpoints.write()
    await checkpoints.final()
    assert on_disk(tmp_path).generation == stored.generation and server.copies == 0
    (tmp_path / f"server-{RANK}.akvckpt").unlink()
    checkpoints.close()
    fresh = fresh_state()
    empty, other = opened(fresh)
    empty.restore()  # no file: it starts empty
    await empty.final()
    admit(fresh, 0, "session0")
    await empty.final()
    assert read_snapshot(tmp_path, RANK) is None and other.copies == 0


async def test_a_checkpoint_keeps_the_restored_session_of_a_worker_not_seen_since(opened, tmp_path):
    """A job of new workers in which worker 1 never reached this server (it failed while
    connecting): its checkpoint keeps worker 1's session of the job that wrote the restored
    values, with its push numbers, so that worker 1 of a later job is taken as new (its
    pushes, numbered from 1, were dropped as resends: wrong values, exit 0)."""
    stored_snapshot(tmp_path)  # sessions {0: session0, 1: session1}, worker 1 at push 4
    state = fresh_state()
    checkpoints, _ = opened(state)
    checkpoints.restore()
    admit(state, 0, "job-b-0")  # worker 0 of a new job; worker 1 never came
    await checkpoints.write()
    assert on_disk(tmp_path).sessions == {0: "job-b-0", 1: "session1"}
    checkpoints.close()
    later = fresh_state()
    again, _ = opened(later)
    again.restore()
    admit(later, 1, "job-c-1")  # a later job's worker 1: new, its numbers forgotten
    assert not later.entries["w"].rounds.is_duplicate(1, 1)


async def test_a_directory_marked_lost_is_refused_by_every_later_restore(opened, tmp_path):
    stored_snapshot(tmp_path)
    checkpoints, _ = opened(fresh_state())
    checkpoints.restore()
    checkpoints.mark_lost("server 3 restored checkpoint 7 ..., but ... declared checkpoint 9")
    checkpoints.close()
    marker = tmp_path / f"server-{RANK}.lost"
    assert marker.stat().st_mode & 0o777 == 0o600
    later, _ = opened(fresh_state())
    with pytest.raises(checkpointing.UnusableCheckpointError, match=r"server-3\.lost says") as got:
        later.restore()
    assert "declared checkpoint 9" in str(got.value) and "another --checkpoint-dir" in str(
        got.value
    )
    later.close()
    marker.unlink()  # the user put things right
    fixed, _ = opened(fresh_state())
    assert fixed.restore() is not None


# ---------------------------------------------------------------------- DURABLE


async def test_durable_tells_each_connected_worker_which_of_its_requests_the_file_holds(
    opened, tmp_path
):
    players = started()
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    checkpoints.tell(players.peers[0])
    assert server.executed == []  # no checkpoint yet: nothing to say
    players.push(0, {"w": f32(1, 1)}, tag=1)
    closing = players.push(1, {"w": f32(2, 2)}, tag=1)  # round 1 is complete
    still_open = players.push(0, {"w": f32(3, 3)}, tag=2)  # round 2 waits for worker 1
    await checkpoints.final()
    first, second = players.peers
    lineage = players.state.lineage

    def note(seq: int) -> Note:  # each names this process, the checkpoint and its rounds
        return Note(lineage.server, 1, 1, seq)

    # Worker 0's open push is not in the values: it is to keep it (resend it on a restart).
    expected = [Durable(first, note(still_open)), Durable(second, note(closing + 1))]
    assert server.told(Durable) == expected
    assert on_disk(tmp_path).durable_seqs == {0: still_open, 1: closing + 1}

    players.reconnect(1)  # a new stream hears it at once
    checkpoints.tell(players.peers[1])
    assert server.executed[-1] == Durable(players.peers[1], note(closing + 1))


# ---------------------------------------------------------------------- restoring


def stored_snapshot(
    directory: Path,
    num_workers: int = 2,
    sessions: dict[int, str] | None = None,
    num_servers: int | None = None,
) -> Snapshot:
    snapshot = Snapshot(
        rank=RANK,
        num_workers=num_workers,
        store_type="dist_sync",
        generation=7,
        keys=[KeyRecord("w", f32(3, 4), 5, {0: 5, 1: 4}, {0: 5, 1: 4})],
        optimizer_config=optimizer.SGD(learning_rate=0.5).get_config(),
        optimizer_states=None,
        durable_seqs={0: 12, 1: 9},
        sessions={0: "session0", 1: "session1"} if sessions is None else sessions,
        num_servers=num_servers,
    )
    write_snapshot(directory, snapshot)
    return snapshot


def fresh_state() -> ServerState:
    ids = itertools.count()
    return ServerState(
        "server 3", 2, 5.0, lambda name: Var(None, next(ids), name), checkpoints=True
    )


async def test_a_restore_feeds_the_state_what_the_checkpoint_holds(opened, tmp_path):
    stored = stored_snapshot(tmp_path)
    state = fresh_state()
    checkpoints, server = opened(state)
    restored = checkpoints.restore()
    assert restored is not None and restored.generation == 7
    assert state.store_type == "dist_sync"
    entry = state.entries["w"]
    np.testing.assert_array_equal(entry.value, f32(3, 4))
    assert entry.rounds.closed_round == 5 and entry.made_by is None  # any init is a resend
    assert state.optimizer_config == stored.optimizer_config and state.updater is not None
    assert state.checkpoint_plan().durable_seqs == {0: 12, 1: 9}
    assert checkpoints.durable_seqs == {0: 12, 1: 9}
    state.validate()
    await checkpoints.final()  # nothing changed since the restore: nothing to write
    assert server.copies == 0
    assert await checkpoints.write() == 8  # the numbering goes on


def admit(state: ServerState, worker: int, session: str) -> Any:
    peer, _ = state.admit(worker, "dist_sync", stream=True, session=session, note=None)
    return peer


def push(state: ServerState, peer: Any, seq: int, tag: int) -> list[Instruction]:
    """Worker ``peer``'s push number ``tag`` of ``w`` (ones), request ``seq``, counted (its
    instructions returned, not carried out)."""
    header, buffers = decode_frame(frame_bytes(Op.PUSH, seq, [("w", f32(1, 1), tag)]))
    landing = state.header_arrived(peer, header)
    for buffer, target in zip(buffers, landing.buffers, strict=True):
        memoryview(target).cast("B")[:] = buffer
    return state.message_completed(peer, header, buffers, landing, 0.0)


async def test_a_new_job_from_a_checkpoint_counts_its_pushes_from_the_first(opened, tmp_path):
    """Workers are never restarted within a job: a worker of another session than the
    checkpoint's is of a new job started from it. Its pushes, numbered from 1 again, are
    counted on top of the restored values (not taken for resends of the old job's, which
    would drop the first of them), and no note says its requests are durable yet; a worker
    of the checkpoint's own session (a restarted server of the same job) resends."""
    stored_snapshot(tmp_path)
    state = fresh_state()
    checkpoints, server = opened(state)
    checkpoints.restore()
    same = admit(state, 0, "session0")  # the job goes on: its push 1 was counted
    new = admit(state, 1, "another-process")
    checkpoints.tell(same)
    checkpoints.tell(new)
    assert [d.peer.worker for d in server.told(Durable)] == [0]  # 12 for worker 0, none for 1
    assert checkpoints.durable_seqs == {0: 12}
    rounds = state.entries["w"].rounds
    assert rounds.is_duplicate(0, 5) and not rounds.is_duplicate(1, 1)
    assert rounds.last_push_round(1) == 0
    push(state, same, 12, tag=6)
    push(state, new, 1, tag=1)
    assert rounds.closed_round == 6  # both counted: one round on top of the restored 5
    assert state.checkpoint_plan().sessions == {0: "session0", 1: "another-process"}
    state.validate()


async def test_a_worker_of_a_new_job_that_comes_during_a_write_is_not_told_its_old_number(
    opened, tmp_path
):
    """A new job on a directory: worker 0's first request starts a write whose plan still
    holds worker 1's number of the old job (9), restored; worker 1's stream comes while the
    file is written. Before, the write's end brought that number back, and worker 1 was
    told its requests below 9 were durable: it kept no copy of its new job's first eight,
    and a restart of this server lost them (a review: 2 of 21 pairs of jobs hung or failed
    with DoublePushError)."""
    stored_snapshot(tmp_path)
    state = fresh_state()
    checkpoints, server = opened(state)
    checkpoints.restore()
    first = admit(state, 0, "new-job-0")
    checkpoints.tell(first)
    push(state, first, 1, tag=1)
    server.gate = asyncio.Event()
    writing = asyncio.ensure_future(checkpoints.write())
    await wait_until(lambda: server.copies == 1, "the plan taken, its copy held")
    second = admit(state, 1, "new-job-1")
    checkpoints.tell(second)
    server.gate.set()
    await writing
    told = {d.peer.worker: d.note.seq for d in server.told(Durable)}
    assert told.get(1) != 9 and 1 not in checkpoints.durable_seqs, told
    assert on_disk(tmp_path).durable_seqs[1] == 9  # with the old job's session, as restored
    assert on_disk(tmp_path).sessions[1] == "session1"


async def test_a_checkpoint_without_sessions_renumbers_nobody(opened, tmp_path):
    """Checkpoints written before sessions were kept: every worker is taken as the job's."""
    stored_snapshot(tmp_path, sessions={})
    state = fresh_state()
    checkpoints, _ = opened(state)
    checkpoints.restore()
    admit(state, 1, "another-process")
    assert state.entries["w"].rounds.is_duplicate(1, 1)
    assert state.take_renumbered() == []


async def test_a_checkpoint_of_a_job_with_another_number_of_workers_is_refused(opened, tmp_path):
    stored_snapshot(tmp_path, num_workers=3)
    state = fresh_state()
    checkpoints, _ = opened(state)
    with pytest.raises(CheckpointError, match="3 workers, this job has 2"):
        checkpoints.restore()
    assert state.entries == {}


async def test_a_checkpoint_keeps_the_jobs_servers_and_one_of_another_count_is_refused(
    opened, tmp_path
):
    """Keys are placed by the number of servers: a job with another number would read
    other keys' parts (a split key's part as the whole, a key another server holds)."""
    players = Players(2)
    players.init(0, {"w": f32(0, 0)})
    checkpoints, _ = opened(players.state, num_servers=4)
    await checkpoints.write()
    assert read_snapshot(tmp_path, RANK).num_servers == 4
    checkpoints.close()
    state = fresh_state()
    again, _ = opened(state, num_servers=3)
    with pytest.raises(CheckpointError, match="a job with 4 servers, this job has 3"):
        again.restore()
    assert state.entries == {}
    again.close()
    same, _ = opened(fresh_state(), num_servers=4)
    assert same.restore() is not None


async def test_a_rank_without_a_checkpoint_beside_one_of_a_rank_beyond_the_job_is_refused(
    opened, tmp_path
):
    """A server that held no key wrote no file: a job with fewer servers on the directory
    would start this rank empty and leave the other rank's file unread."""
    (tmp_path / "server-5.akvckpt").write_bytes(b"of a job with 6 or more servers")
    state = fresh_state()
    checkpoints, _ = opened(state, num_servers=4)
    with pytest.raises(UnusableCheckpointError, match=r"holds server-5\.akvckpt.*this job has 4"):
        checkpoints.restore()
    checkpoints.close()
    as_many, _ = opened(fresh_state(), num_servers=6)
    assert as_many.restore() is None  # the directory's other ranks are theirs to read


async def test_a_restore_tells_the_rounds_past_their_bases_and_an_accepted_job_rebases(
    opened, tmp_path
):
    """What the scheduler compares: the rounds each split or row-sparse key applied past
    its base. A new job that goes on from files of different moments takes the restored
    rounds as the bases; a restart within it does not."""
    split = KeyRecord("w", f32(3, 4), 5, {0: 5, 1: 4}, {0: 5, 1: 4}, declared=(1, 2))
    whole = KeyRecord("d", f32(1, 1), 9, {0: 9, 1: 9}, {0: 9, 1: 9})
    snapshot = stored_snapshot(tmp_path)
    snapshot.keys, snapshot.round_bases = [split, whole], {"w": 2}
    write_snapshot(tmp_path, snapshot)
    checkpoints, _ = opened(fresh_state())
    checkpoints.restore()
    assert checkpoints.restored is not None and checkpoints.restored["rounds"] == [["w", 3]]
    checkpoints.joined(restart=False)  # not accepting: the bases stay
    assert checkpoints.round_bases == {"w": 2}
    checkpoints.accept_mixed_restore = True
    checkpoints.joined(restart=True)
    assert checkpoints.round_bases == {"w": 2}
    checkpoints.joined(restart=False)
    assert checkpoints.round_bases == {"w": 5}
    await checkpoints.write()  # (also with nothing else changed)
    assert on_disk(tmp_path).round_bases == {"w": 5}


async def test_a_checkpoint_without_a_server_count_is_restored(opened, tmp_path):
    """Files written before the count was kept (``num_servers`` None) are taken."""
    stored_snapshot(tmp_path, num_servers=None)
    checkpoints, _ = opened(fresh_state(), num_servers=2)
    assert checkpoints.restore() is not None


async def test_a_worker_of_another_store_type_is_told_of_the_restored_checkpoint(opened, tmp_path):
    stored_snapshot(tmp_path)  # of a dist_sync job
    state = fresh_state()
    checkpoints, _ = opened(state)
    checkpoints.restore()
    with pytest.raises(
        MembershipError,
        match=r"restored from checkpoint 7 of .*server-3\.akvckpt, written by a dist_sync job",
    ):
        state.admit(0, "dist_async", stream=True, session="session0")
    assert state.peers == {}


def test_a_rank_is_restored_by_one_process_at_a_time(opened):
    first, _ = opened(fresh_state())
    second, _ = opened(fresh_state())
    first.restore()
    with pytest.raises(CheckpointError, match="locked by another process"):
        second.restore()
    first.close()  # as when the first server stopped
    assert second.restore() is None


async def test_a_new_job_that_declares_a_restored_key_otherwise_is_told_so(opened, tmp_path):
    """A new job on an old job's directory with another model: each worker's init names
    the restored shape and the declared one (rank 0 got 'already holds it', the others a
    mismatch with 'worker 0's' shape, which was the checkpoint's)."""
    stored_snapshot(tmp_path)  # holds "w": (2,) float32
    players = Players(2, checkpoints=True)
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    told = "the server restored it from its checkpoint as (2,) float32, and {} declares (5,)"
    init = players.init(0, {"w": np.zeros(5, np.float32)})
    assert isinstance(players.reply(0, init), ShapeMismatchError)
    assert told.format("this job") in str(players.reply(0, init))
    check = players.send(1, Op.INIT_CHECK, text=encode_meta([("w", (5,), "float32")]))
    assert told.format("worker 1") in str(players.reply(1, check))
    np.testing.assert_array_equal(players.state.entries["w"].value, f32(3, 4))  # kept


async def test_a_split_part_restored_without_its_declared_shape_is_checked_by_dtype(
    opened, tmp_path
):
    """A checkpoint written before declared shapes were kept: a worker's check of a split
    part (its declared shape in the dtype) compares the dtype alone until rank 0's init
    tells the shape, which is kept from then on."""
    stored_snapshot(tmp_path)  # holds "w": (2,) float32, no declared shape
    players = Players(2, checkpoints=True)
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    check = players.send(
        1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32 split of (1, 4)")])
    )
    assert players.reply(1, check) == "ok"
    wrong = players.send(
        1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float64 split of (1, 4)")])
    )
    assert isinstance(players.reply(1, wrong), ShapeMismatchError)
    players.send(0, Op.INIT, [("w", f32(0, 0))], text=encode_meta([("w", (1, 4), "float32")]))
    assert players.state.entries["w"].declared == (1, 4)
    other = players.send(
        1, Op.INIT_CHECK, text=encode_meta([("w", (2,), "float32 split of (4, 1)")])
    )
    assert "split of (1, 4)" in str(players.reply(1, other))


async def test_a_new_job_that_declares_a_restored_dense_key_row_sparse_is_told_so(opened, tmp_path):
    stored_snapshot(tmp_path)  # holds "w": (2,) float32, dense
    players = Players(2, checkpoints=True)
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    init = players.row_init(0, "w", (10, 2), (0, 10))
    error = players.reply(0, init)
    assert isinstance(error, ShapeMismatchError), error
    assert "restored it from its checkpoint as a dense (2,) float32 key" in str(error)
    assert "declares a row-sparse (10, 2) float32 key" in str(error)


def players_with_states() -> Players:
    """Two workers of a job whose server has an optimizer with a state (momentum), a dense
    key "w" and a row-sparse key "emb" (rows [500, 1000) of 10**9 x 2), both pushed."""
    players = Players(2, checkpoints=True)
    players.init(0, {"w": f32(1, 2)})
    players.row_init(0, "emb", (10**9, 2), (500, 1000))  # answered once a checkpoint holds it
    text = json.dumps(optimizer.SGD(learning_rate=0.5, momentum=0.9).get_config())
    for worker in range(2):
        players.send(worker, Op.SET_OPTIMIZER, text=text)
    for worker in range(2):
        players.push(worker, {"w": f32(1, 1)}, tag=1)
        rows = np.arange(6, dtype=np.float32).reshape(3, 2) + worker
        players.row_push(worker, "emb", [500 + worker, 700, 999], rows, tag=1)
    return players


async def test_a_checkpoints_copy_goes_through_a_temporary_file(opened, tmp_path, monkeypatch):
    """The keys' values, the tables' rows and the optimizer states are copied into one
    unnamed temporary file of the checkpoint directory, not memory (a big table is not held
    twice), and written from there: the checkpoint holds what the server holds; the file is
    closed (gone) after the write, also when the write fails."""
    players = players_with_states()
    copies: list[Copied] = []
    closed: list[checkpoint_module.Spill] = []
    copy, close = checkpointing.copy_plan, checkpoint_module.Spill.close

    async def noted_copy(plan, directory):
        copies.append(copy(plan, directory))
        return copies[-1]

    def noted_close(self):
        closed.append(self)
        close(self)

    monkeypatch.setattr(checkpoint_module.Spill, "close", noted_close)
    checkpoints, server = opened(players.state)
    monkeypatch.setattr(server, "copy_values", noted_copy)
    checkpoints.restore()
    await checkpoints.write()
    ((records, row_records, states, spill),) = copies
    spilled = [records[0].value, row_records[0].rows, states]
    assert [type(part).__name__ for part in spilled] == [
        "SpilledArray",
        "SpilledArray",
        "SpilledStates",
    ]
    assert {part.spill for part in spilled} == {spill} and closed == [spill]
    snapshot = read_snapshot(tmp_path, RANK)
    np.testing.assert_array_equal(snapshot.keys[0].value, players.state.entries["w"].value)
    table = players.state.rows.entries["emb"].rows
    (row_record,) = snapshot.row_keys
    np.testing.assert_array_equal(row_record.ids, [500, 501, 700, 999])
    np.testing.assert_array_equal(row_record.rows, table.gather(row_record.ids))
    assert row_record.rows[:, 0].tolist() == [0.0, -0.5, -2.5, -4.5]  # -0.5 x the sums
    assert snapshot.optimizer_states == players.state.updater.dump_states(False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server-3.akvckpt", "server-3.lock"]

    def failing(directory, snapshot):
        raise CheckpointError("the disk is full")

    monkeypatch.setattr(checkpointing, "write_snapshot", failing)
    players.push(0, {"w": f32(1, 1)}, tag=2)
    with pytest.raises(CheckpointError, match="the disk is full"):
        await checkpoints.write()
    assert len(closed) == 2 and closed[1] is copies[1][3]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
async def test_a_restore_reads_rows_and_row_states_into_tables_and_closes_the_file(
    opened, tmp_path
):
    """A server restored from a checkpoint of row-sparse keys and their optimizer states
    holds what the written one held (rows read into the key's table, the states decoded
    from the checkpoint's file into theirs), and leaves no descriptor open but its lock."""
    players = players_with_states()
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    await checkpoints.write()
    written_states = players.state.updater.dump_states(False)
    written_rows = players.state.rows.entries["emb"].rows
    checkpoints.close()
    state = fresh_state()
    again, _ = opened(state)
    before = len(os.listdir("/proc/self/fd"))
    restored = again.restore()  # held: its states' file is closed all the same
    assert restored is not None
    assert len(os.listdir("/proc/self/fd")) == before + 1  # the lock's
    table = state.rows.entries["emb"].rows
    np.testing.assert_array_equal(table.ids(), written_rows.ids())
    np.testing.assert_array_equal(table.gather(table.ids()), written_rows.gather(table.ids()))
    assert state.updater.dump_states(False) == written_states
    assert all(isinstance(t, RowTable) for t in state.updater.row_states["emb"])


async def test_a_failed_rounds_error_not_told_yet_survives_a_restart(opened, tmp_path):
    """A round the optimizer refused, which no worker has pulled since: a server restored
    from a checkpoint written after it tells each worker at its next pull of the key, as
    the one that failed would have (it read as if the round had never been pushed)."""
    players = Players(2, checkpoints=True)
    players.row_init(0, "emb", (10**9, 2), (500, 1000))
    text = json.dumps(optimizer.AdaGrad(learning_rate=0.5, wd=0.1).get_config())
    for worker in range(2):
        players.send(worker, Op.SET_OPTIMIZER, text=text)
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    for worker in range(2):
        players.row_push(worker, "emb", [700], np.ones((1, 2), np.float32), tag=1)
    told = players.reply(1, players.row_pull(1, "emb", [700]))  # worker 1 hears of it
    assert isinstance(told, ServerError) and "round 1" in str(told)
    await checkpoints.write()
    checkpoints.close()
    restarted = Players(2, checkpoints=True)
    again, _ = opened(restarted.state)
    again.restore()
    error = restarted.reply(0, restarted.row_pull(0, "emb", [700]))
    assert isinstance(error, ServerError) and str(error) == str(told)
    assert error.server == "server 0"
    assert restarted.reply(1, restarted.row_pull(1, "emb", [700]))["emb"].tolist() == [[0, 0]]
    assert restarted.reply(0, restarted.row_pull(0, "emb", [700]))["emb"].tolist() == [[0, 0]]


async def test_a_restore_whose_states_cannot_be_read_names_the_checkpoint(
    opened, tmp_path, monkeypatch
):
    """The optimizer states are decoded from the checkpoint's file after its checksum: a
    read that fails then is an unusable checkpoint naming the file, not a damaged archive."""
    from akv.optimizer import _files

    players = players_with_states()
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    await checkpoints.write()
    checkpoints.close()

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files.os, "pread", failing)
    again, _ = opened(fresh_state())
    with pytest.raises(
        checkpointing.UnusableCheckpointError,
        match=r"cannot read checkpoint .*server-3\.akvckpt.*Input/output error",
    ):
        again.restore()


class FullDisk(io.FileIO):
    """A file on a disk with ``FREE`` bytes left."""

    FREE = 200

    def write(self, data: Any) -> int:
        if self.tell() + memoryview(data).nbytes > self.FREE:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def on_a_full_disk(dir: Any = None) -> io.BufferedRandom:
    """``tempfile.TemporaryFile`` on a nearly full disk: writes are buffered first, so one
    fails when the buffer goes to the disk (at a seek, a flush, or the close)."""
    fd, name = tempfile.mkstemp(dir=dir)
    os.unlink(name)
    return io.BufferedRandom(FullDisk(fd, "r+b"))


@pytest.mark.parametrize("part", ["states", "rows", "buffered"])
async def test_a_checkpoint_whose_copy_cannot_be_spilled_fails_as_a_checkpoint(
    opened, tmp_path, monkeypatch, part
):
    """A full disk while the copy is written aside is a CheckpointError (answered to the
    asking worker, retried at the next interval), not a raw OSError that ended the timer and
    failed the job, and the temporary file is closed; a removed directory is made again."""
    players = players_with_states()
    checkpoints, server = opened(players.state)
    checkpoints.restore()
    checkpoints.close()  # the lock's file goes with the directory below
    shutil.rmtree(tmp_path)
    await checkpoints.on_request(players.checkpoints[0])
    assert read_snapshot(tmp_path, RANK).optimizer_states is not None
    assert server.told(Reply)  # answered once it holds the key

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    closed: list[checkpoint_module.Spill] = []
    close = checkpoint_module.Spill.close
    monkeypatch.setattr(
        checkpoint_module.Spill, "close", lambda self: closed.append(self) or close(self)
    )
    if part == "states":
        monkeypatch.setattr(optimizer.Updater, "dump_states", full)
    elif part == "rows":
        monkeypatch.setattr(StoredRows, "write_rows", full)
    else:  # the close, flushing what the failed write left buffered, fails again
        monkeypatch.setattr(checkpoint_module.tempfile, "TemporaryFile", on_a_full_disk)
    with pytest.raises(CheckpointError, match="writing the copy of the keys to a temporary"):
        await checkpoints.write()
    assert len(closed) == 1 and closed[0].file.closed
    monkeypatch.setattr(checkpoint_module.tempfile, "TemporaryFile", full)
    with pytest.raises(CheckpointError, match="no temporary file for the copy of the keys"):
        await checkpoints.write()


async def test_a_write_whose_caller_gave_up_still_finishes(opened, tmp_path, monkeypatch):
    """A cancelled write (the final checkpoint's deadline) leaves its thread to finish with
    the states it spilled: the checkpoint is written."""
    players = players_with_states()
    checkpoints, _ = opened(players.state)
    checkpoints.restore()
    write = checkpointing.write_snapshot
    started = threading.Event()

    def slow(directory, snapshot):
        started.set()
        time.sleep(0.3)
        return write(directory, snapshot)

    monkeypatch.setattr(checkpointing, "write_snapshot", slow)
    task = asyncio.ensure_future(checkpoints.write())
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: read_snapshot(tmp_path, RANK) is not None, 5)
    assert read_snapshot(tmp_path, RANK).optimizer_states is not None
