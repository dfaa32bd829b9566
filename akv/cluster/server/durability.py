"""Whether a restarted server still holds what it declared durable (pure, no I/O).

A server that writes checkpoints tells each worker, after each one, which of its requests
the checkpoint holds (a ``DURABLE`` note: every request numbered below ``seq``), and the
worker drops the copies it kept of those. Should the server then be restarted from an
*older* checkpoint (a backup put back, a stale network file system, a wrong directory), or
from none at all (the file deleted), the requests between are gone from both sides: the
workers cannot resend them. Answering a pull from that state would hand out wrong values
silently.

So every note names the checkpoint it comes from (its number, the rounds it holds, and the
server process that wrote it: :class:`Note`), the worker sends back the last note it acted
on whenever it opens a stream (``X-AKV-Durable``), and :class:`Lineage` decides, per worker,
whether this server holds every request that worker was told is durable:

* a note of this server process: yes (it wrote that checkpoint and holds everything since);
* a note of an earlier process (the server was restarted): yes when the restored
  checkpoint holds every request below the note's ``seq`` of that worker, else no: the
  restore lost acknowledged pushes, and the job must fail naming the server, the file, the
  rounds it restored and the rounds it should have had.

Until every worker that may still talk to a restored server has been checked, no pull is
answered (:meth:`Lineage.answers_held`): a worker that lost nothing could otherwise read a
value that lacks another worker's lost pushes (in ``dist_async``, where no round waits).

The workers then send their unsaved requests again, each on its own stream. In
``dist_async`` no round orders them, but the barriers did: what every worker pushed
before a barrier was applied before anything pushed after it (a learning rate set
between two barriers applied to the pushes between them). A ``dist_async`` worker
that sends requests again says how many barriers it had passed before the first of them
(``X-AKV-Replay``), and sends a ``REPLAY_BARRIER`` first, one where each later barrier
was, and one (``last``) at its replay's end. A replay barrier is answered, and its worker
goes on, once every worker that may still send requests again has sent those from before
that barrier (:meth:`Lineage.replay_barrier`). So a request sent again, and every request
after a replay, sees what every worker sent before the barriers its sender had passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from akv.cluster.protocol import Note

__all__ = ["Lineage", "ReplayBarrier", "Restored"]


@dataclass(frozen=True, slots=True)
class ReplayBarrier:
    """Request ``seq`` of ``peer``: a replay barrier at ``barriers`` (see the module
    docstring)."""

    peer: Any
    seq: int
    barriers: int


@dataclass(frozen=True, slots=True)
class Restored:
    """What a server started from: checkpoint ``checkpoint`` (rounds up to ``rounds``) of
    ``path``, holding each worker's requests numbered below ``durable_seqs[worker]``; or,
    with ``checkpoint`` 0, nothing (no file at ``path``)."""

    path: str
    checkpoint: int
    rounds: int
    durable_seqs: dict[int, int]


class Lineage:
    """What one server process holds of the checkpoints its rank declared durable.

    ``server`` is this process's id (its notes carry it); before :meth:`restore` (a server
    without checkpoints, or one not started yet) every worker passes the check.
    """

    def __init__(self, server: str, num_workers: int) -> None:
        self.server = server
        self.num_workers = num_workers
        self.restored: Restored | None = None
        #: Workers that may still talk to this server and were not checked yet: every
        #: worker once a checkpoint directory was read, less those checked or finished.
        self.unchecked: set[int] = set()
        self.checkpoint = 0
        self.rounds = 0
        #: What the restore lost, once a worker's note showed it (the job failed): no
        #: checkpoint may be written from this state (it would replace the evidence with
        #: a state that lacks acknowledged pushes).
        self.lost: str | None = None
        #: Checked workers sending requests again, and how many barriers each had passed
        #: before the requests it is sending now.
        self.replaying: dict[int, int] = {}
        #: Replay barriers not answered yet.
        self.barriers: list[ReplayBarrier] = []

    def restore(self, restored: Restored) -> None:
        """The process started from ``restored`` (checkpoint 0: no file was there)."""
        self.restored = restored
        self.checkpoint, self.rounds = restored.checkpoint, restored.rounds
        self.unchecked = set(range(self.num_workers))

    @property
    def restored_from(self) -> str:
        """The checkpoint this process started from, in words ("": none)."""
        restored = self.restored
        if restored is None or not restored.checkpoint:
            return ""
        return f"checkpoint {restored.checkpoint} of {restored.path}"

    def written(self, checkpoint: int, rounds: int) -> None:
        """This process wrote checkpoint ``checkpoint`` (rounds up to ``rounds``)."""
        self.checkpoint, self.rounds = checkpoint, rounds

    def note(self, seq: int) -> Note:
        """The note telling a worker that the last checkpoint holds its requests below
        ``seq``."""
        return Note(self.server, self.checkpoint, self.rounds, seq)

    @property
    def answers_held(self) -> bool:
        """Whether pulls wait: a server that read its checkpoint directory has not checked
        every worker yet."""
        return bool(self.unchecked)

    def finished(self, workers: list[int]) -> list[ReplayBarrier]:
        """These workers closed their stores (the scheduler says): none will come back.
        Returns the replay barriers that waited for them only."""
        self.unchecked.difference_update(workers)
        for worker in workers:
            self.replaying.pop(worker, None)
        return self._passed()

    def check(self, worker: int, note: Note | None, replay: int | None = None) -> str | None:
        """Worker ``worker`` opens a stream, having last been told ``note`` (None: no note
        yet), and sends requests again on it, the first after ``replay`` barriers (None:
        none). Returns what this server lost of what it told that worker is durable (a
        phrase that follows the server's name), or None: the worker is checked."""
        lost = self._lost(worker, note)
        if lost is not None:
            self.lost = lost
            return lost
        awaited = worker in self.unchecked or worker in self.replaying
        self.unchecked.discard(worker)
        if replay is None or not awaited:
            self.replaying.pop(worker, None)  # (a worker a restored server never waits for)
        else:
            self.replaying[worker] = replay
        return None

    def replay_barrier(self, barrier: ReplayBarrier, last: bool) -> list[ReplayBarrier]:
        """``barrier`` arrived (``last``: its worker's replay ends with it). Returns the
        replay barriers to answer now: it, once every worker that may still send requests
        again sent those from before it (at once when none is awaited), and those that
        waited for it."""
        worker = barrier.peer.worker
        if worker in self.replaying:
            if last:
                del self.replaying[worker]  # everything it sends again has arrived
            else:
                self.replaying[worker] = max(self.replaying[worker], barrier.barriers)
        self.barriers.append(barrier)
        return self._passed()

    def take_barriers(self) -> list[ReplayBarrier]:
        """The replay barriers still waiting (the job failed: each gets its error)."""
        waiting, self.barriers = self.barriers, []
        return waiting

    def _passed(self) -> list[ReplayBarrier]:
        if self.unchecked:
            return []
        reached = min(self.replaying.values(), default=None)
        passed: list[ReplayBarrier] = []
        waiting: list[ReplayBarrier] = []
        for barrier in self.barriers:
            (passed if reached is None or barrier.barriers <= reached else waiting).append(barrier)
        self.barriers = waiting
        return passed

    def _lost(self, worker: int, note: Note | None) -> str | None:
        restored = self.restored
        if restored is None or note is None or note.server == self.server or note.seq <= 1:
            return None  # no checkpoints, nothing declared, or declared by this process
        held = restored.durable_seqs.get(worker, 1)
        if note.seq <= held:
            return None  # the restored checkpoint holds all that the worker dropped
        declared = (
            f"before its restart it had declared checkpoint {note.checkpoint} (rounds up to "
            f"{note.rounds}) durable to worker {worker}, which dropped its copies of its "
            f"requests numbered below {note.seq}: the acknowledged pushes between are lost. "
            "Put the newest checkpoint back, or start the job again with another "
            "--checkpoint-dir (this one's checkpoints are no longer of one point in time)"
        )
        if restored.checkpoint == 0:
            return f"started without a checkpoint ({restored.path} is missing), but {declared}"
        return (
            f"restored checkpoint {restored.checkpoint} from {restored.path} (rounds up to "
            f"{restored.rounds}; worker {worker}'s requests below {held}), but {declared}"
        )
