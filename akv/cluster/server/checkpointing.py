"""When a server writes its checkpoint, and how it starts from one (the I/O around
:mod:`akv.cluster.server.checkpoint`'s file and :meth:`ServerState.checkpoint_plan`).

A server started with ``--checkpoint-dir`` (``AKV_CHECKPOINT_DIR``):

* locks ``server-<rank>.lock`` in the directory for as long as it runs, so that two
  processes never write one rank's checkpoint, and a restarted server that holds the lock
  knows the one before it is gone (the scheduler lets it take over its rank);
* restores ``server-<rank>.akvckpt`` when there is one, before it registers;
* writes a checkpoint every ``AKV_CHECKPOINT_INTERVAL_S`` when anything changed, when a
  worker asks (``CHECKPOINT``: the pushes it keeps for this server grew past
  ``AKV_RETAIN_BYTES``), and when it stops (at the job's end, or on SIGTERM/Ctrl-C);
* after each one, tells every connected worker which of its requests the checkpoint holds
  (``DURABLE``), so that the worker drops the pushes it kept for a restart.

A checkpoint's values are copied by an engine task that reads every key (so it follows
every write issued before it and holds the keys only while it copies); the file is written
on a thread while the server goes on serving.

:class:`Checkpoints` reads the server's pure state (:class:`ServerState`: what changed,
the plan of what a checkpoint holds, the connected workers) and asks the server for two
things only, through :class:`CheckpointedServer`: copy a plan's values after every earlier
write, and carry out instructions (answers, ``DURABLE`` notes, what the state says once a
checkpoint is written). The configuration comes as plain values.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from akv.cluster.placement import row_parts
from akv.cluster.server import snapshots
from akv.cluster.server.checkpoint import (
    KeyRecord,
    RowRecord,
    Snapshot,
    Spill,
    SpilledArray,
    SpilledStates,
    checkpoint_path,
    in_memory,
    open_spill,
    read_snapshot,
    remove_leftovers,
    write_snapshot,
)
from akv.cluster.server.durability import Restored
from akv.cluster.server.instructions import (
    Checkpoint,
    CheckpointPlan,
    Durable,
    Instruction,
    Peer,
    Reply,
    ReplyError,
)
from akv.cluster.server.state import ServerState
from akv.errors import AKVError, CheckpointError
from akv.limits import FINAL_CHECKPOINT_S
from akv.optimizer._states import StoredRows

__all__ = ["CheckpointedServer", "Checkpoints", "Copied", "UnusableCheckpointError", "copy_plan"]

log = logging.getLogger("akv.cluster.server")

#: The end of the file that marks a directory whose checkpoints a job found lost.
LOST_SUFFIX = ".lost"

#: What a checkpoint copies of the keys: their records (dense, row-sparse) and the
#: optimizer's states, all in the spill (a temporary file of the checkpoint directory).
Copied = tuple[list[KeyRecord], list[RowRecord], SpilledStates | None, Spill]


class CheckpointedServer(Protocol):
    """What :class:`Checkpoints` asks of its server
    (:class:`~akv.cluster.server.service.ParameterServer` implements it)."""

    def copy_values(self, plan: CheckpointPlan, directory: Path) -> Awaitable[Copied]:
        """``copy_plan(plan, directory)``, run once every write issued so far to the plan's keys
        finished, with no update of them running meanwhile."""
        ...

    def execute(self, instructions: Sequence[Instruction]) -> None:
        """Carry out ``instructions``, in order."""
        ...


class UnusableCheckpointError(CheckpointError):
    """The checkpoint is there and cannot be used (damaged, or of another job's shape): a
    restart reads the same file, so none mends it (the server exits ``JOB_FAILED_EXIT``)."""


class Checkpoints:
    """One server's checkpoints (see the module docstring).

    Parameters
    ----------
    state:
        The server's state: what a checkpoint holds, and what a restore feeds.
    server:
        What the checkpoints ask of the server.
    directory:
        Where the checkpoint, its lock and its temporary files lie (``--checkpoint-dir``).
    rank:
        The server's rank (its files are ``server-<rank>.*``).
    num_workers:
        The job's workers (a checkpoint of a job with another number is refused).
    interval_s:
        How often :meth:`every_interval` writes one when anything changed
        (``AKV_CHECKPOINT_INTERVAL_S``).
    """

    def __init__(
        self,
        state: ServerState,
        server: CheckpointedServer,
        *,
        directory: Path,
        rank: int,
        num_workers: int,
        interval_s: float,
        num_servers: int | None = None,
        accept_mixed_restore: bool = False,
    ) -> None:
        """``num_servers``: the job's, to check a restored row-sparse key's range against
        (None: not checked). ``accept_mixed_restore``: the job goes on from files of
        different moments (see :meth:`joined`)."""
        self.accept_mixed_restore = accept_mixed_restore
        self.state = state
        self.num_servers = num_servers
        self.server = server
        self.directory = directory
        self.rank = rank
        self.num_workers = num_workers
        self.interval_s = interval_s
        #: The last checkpoint's number (0: none yet), and what it holds of each worker's
        #: requests (every one numbered below).
        self.generation = 0
        self.durable_seqs: dict[int, int] = {}
        #: What the restore read of the keys other servers hold parts of: ``{"path": the
        #: file, "rounds": [[key, rounds applied since its base], ...]}`` (None: nothing
        #: restored).
        self.restored: dict[str, Any] | None = None
        #: The spread keys' rounds that count as none (see Snapshot.round_bases).
        self.round_bases: dict[Any, int] = {}
        self._spread_rounds: dict[Any, int] = {}
        self._written_changes = -1
        self._lock: asyncio.Lock | None = None
        self._requests: list[Checkpoint] = []
        self._serving_requests = False
        self._lock_fd: int | None = None
        #: Told of each checkpoint: the seconds it took and its size in bytes, or None
        #: when it failed (the server's metrics).
        self.on_written: Callable[[float, int | None], None] | None = None

    # ------------------------------------------------------------ starting

    def restore(self) -> Snapshot | None:
        """Lock this rank's checkpoint and restore the server's state from it (if any).

        Raises
        ------
        CheckpointError
            Another process holds the lock (this rank's server still runs), the directory
            cannot be made, or the checkpoint cannot be read or does not fit this job.
        """
        lock_path = self.directory / f"server-{self.rank}.lock"
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CheckpointError(
                f"cannot use checkpoint directory {self.directory}: {exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(
                f"{lock_path} is locked by another process: server {self.rank} of this "
                "checkpoint directory is still running (another job on the same "
                "--checkpoint-dir?)"
            ) from exc
        self._lock_fd = fd
        remove_leftovers(self.directory, self.rank)  # of a writer that died: none runs now
        self._refuse_if_marked_lost()
        try:
            snapshot = read_snapshot(self.directory, self.rank, lean=True)
        except CheckpointError as exc:
            raise UnusableCheckpointError(str(exc)) from exc
        path = str(checkpoint_path(self.directory, self.rank))
        if snapshot is None:
            self._refuse_other_servers_files()
            # Workers told of a checkpoint of this rank say so when they reconnect.
            self.state.lineage.restore(Restored(path, 0, 0, {}))
            # Nothing to write until something changes (one that saw no change, say of a
            # job that failed as it started, leaves the directory as it was).
            self._written_changes = 0
            log.info(
                "server %d: no checkpoint at %s: starting empty (a worker told of an earlier "
                "one fails the job when it connects)",
                self.rank,
                path,
            )
            return None
        try:
            self._restore(snapshot, path)
        finally:
            states = snapshot.optimizer_states
            if states is not None and not isinstance(states, bytes | SpilledStates):
                states.close()  # read from the checkpoint's file, as it restored them
        return snapshot

    def joined(self, restart: bool) -> None:
        """The server joined its job (``restart``: as a restart within it). A new job that
        goes on from files of different moments (``accept_mixed_restore``) takes the
        rounds its split and row-sparse keys restored as their bases, and writes them in its
        next checkpoint (one is written at its end, changed or not), so that the next job
        on the directory finds its files of one moment again."""
        if self.accept_mixed_restore and not restart and self._spread_rounds:
            self.round_bases = dict(self._spread_rounds)
            self._written_changes = -1  # (the bases are a change to write)

    def _refuse_other_servers_files(self) -> None:
        """Raise :class:`UnusableCheckpointError` when the directory holds a checkpoint of
        a server rank this job does not have (this rank has none: a server that held no
        key writes none, so a job with fewer servers would start empty beside it)."""
        if self.num_servers is None:
            return
        for path in sorted(self.directory.glob("server-*.akvckpt")):
            rank = path.name[len("server-") : -len(".akvckpt")]
            if rank.isdigit() and int(rank) >= self.num_servers:
                raise UnusableCheckpointError(
                    f"{self.directory} holds {path.name}, the checkpoint of server {rank} "
                    f"of a job with more servers; this job has {self.num_servers}: start "
                    "it with as many servers, or with another --checkpoint-dir"
                )

    def _restore(self, snapshot: Snapshot, path: str) -> None:
        """:meth:`restore` of the snapshot read (optimizer states still in the file)."""
        for what, theirs, ours in (
            ("workers", snapshot.num_workers, self.num_workers),
            ("servers", snapshot.num_servers, self.num_servers),
        ):
            if theirs is not None and ours is not None and theirs != ours:
                raise UnusableCheckpointError(
                    f"the checkpoint of server {self.rank} in {self.directory} is of a job "
                    f"with {theirs} {what}, this job has {ours}: start it with another "
                    "--checkpoint-dir"
                )
        self._check_row_ranges(snapshot)
        assert not isinstance(snapshot.optimizer_states, SpilledStates)  # read, not written
        try:
            snapshots.restore(
                self.state,
                snapshot.store_type,
                [
                    (r.key, in_memory(r.value), r.closed_round, r.tags, r.last_round, r.untold)
                    for r in snapshot.keys
                ],
                snapshot.optimizer_config,
                snapshot.optimizer_states,
                snapshot.durable_seqs,
                snapshot.row_keys,
                snapshot.sessions,
                {r.key: r.declared for r in snapshot.keys if r.declared is not None},
            )
        except OSError as exc:  # its optimizer states, decoded from the file, were unreadable
            raise UnusableCheckpointError(f"cannot read checkpoint {path!r}: {exc}") from exc
        self.generation = snapshot.generation
        self.durable_seqs = dict(snapshot.durable_seqs)
        self._written_changes = self.state.changes
        # The keys whose parts other servers restore too (split, row-sparse), with the
        # rounds applied (past their bases): a new job's scheduler compares them (see
        # akv.cluster.scheduler.roster.mixed_restores).
        spread = [(r.key, r.closed_round) for r in snapshot.keys if r.declared is not None]
        spread += [(r.key, r.closed_round) for r in snapshot.row_keys]
        self._spread_rounds = dict(spread)
        self.round_bases = dict(snapshot.round_bases)
        base = self.round_bases
        self.restored = {
            "path": path,
            "rounds": [[key, applied - base.get(key, 0)] for key, applied in spread],
        }
        closed = [r.closed_round for r in snapshot.keys] + [
            r.closed_round for r in snapshot.row_keys
        ]
        rounds = max(closed, default=0)
        self.state.lineage.restore(
            Restored(path, snapshot.generation, rounds, dict(snapshot.durable_seqs))
        )
        log.warning(
            "server %d restored checkpoint %d from %s: %d keys, rounds up to %d (the workers "
            "of a restarted job resend what it does not hold; a new job's pushes add to it)",
            self.rank,
            snapshot.generation,
            self.directory,
            len(snapshot.keys) + len(snapshot.row_keys),
            rounds,
        )

    def mark_lost(self, reason: str) -> None:
        """This server's restore lost pushes it had declared durable (``reason``, the job's
        failure): mark the directory (``server-<rank>.lost``) so that no later job starts
        from its checkpoints, which are no longer of one point in time (best effort: a
        failure to write it is logged)."""
        marker = self.directory / f"server-{self.rank}{LOST_SUFFIX}"
        try:
            descriptor = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(reason + "\n")
        except OSError as exc:
            log.error("server %d: could not mark %s: %s", self.rank, marker, exc)

    def _refuse_if_marked_lost(self) -> None:
        """Refuse a directory that a server of an earlier job marked (:meth:`mark_lost`)."""
        try:
            markers = sorted(self.directory.glob(f"server-*{LOST_SUFFIX}"))
        except OSError:
            return
        if markers:
            try:
                said = markers[0].read_text(encoding="utf-8", errors="replace").strip()[:2000]
            except OSError as exc:
                said = f"(unreadable: {exc})"
            raise UnusableCheckpointError(
                f"{markers[0]} says that a job on this directory lost acknowledged pushes "
                f"({said}): its checkpoints are not of one point in time. Start the job with "
                f"another --checkpoint-dir, or remove {markers[0].name} once they are"
            )

    def close(self) -> None:
        """Release the directory's lock (at the server's stop)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ writing

    async def write(self) -> int:
        """Write a checkpoint of everything issued so far; return its number.

        Raises
        ------
        CheckpointError
            The file could not be written (the previous checkpoint stays).
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            started = time.monotonic()
            lost = self.state.lineage.lost
            if lost is not None:
                raise CheckpointError(
                    f"server {self.rank} writes no checkpoint: it {lost}; the file in "
                    f"{self.directory} stays as it was"
                )
            try:
                generation, nbytes = await self._write()
            except CheckpointError:
                self._tell_written(started, None)
                raise
            self._tell_written(started, nbytes)
            return generation

    def _tell_written(self, started: float, nbytes: int | None) -> None:
        if self.on_written is not None:
            self.on_written(time.monotonic() - started, nbytes)

    async def _write(self) -> tuple[int, int]:
        """:meth:`write`, holding the lock; returns the number and the file's size."""
        state = self.state
        changes = state.changes
        plan = state.checkpoint_plan()
        records, row_records, states, spill = await self.server.copy_values(plan, self.directory)
        snapshot = Snapshot(
            rank=self.rank,
            num_workers=self.num_workers,
            store_type=plan.store_type or "dist_sync",
            generation=self.generation + 1,
            keys=records,
            optimizer_config=plan.optimizer_config,
            optimizer_states=states,
            durable_seqs=plan.durable_seqs,
            row_keys=row_records,
            sessions=plan.sessions,
            num_servers=self.num_servers,
            round_bases=self.round_bases,
            spill=spill,
        )
        nbytes = await asyncio.to_thread(_write_sized, self.directory, snapshot)
        self.generation = snapshot.generation
        # A worker found to be of a new job while this checkpoint was written (its first
        # stream came after the plan) has in the plan its old job's number, restored: its
        # notes must not say it (its new requests below it would count as durable, and it
        # would keep no copy of them for a restart). The file keeps it with the old session.
        self.durable_seqs = {
            worker: seq
            for worker, seq in plan.durable_seqs.items()
            if state.session_of(worker, plan.sessions.get(worker)) == plan.sessions.get(worker)
        }
        rounds = max((closed for _, closed, _, _ in (*plan.entries, *plan.row_entries)), default=0)
        state.lineage.written(snapshot.generation, rounds)
        self._written_changes = changes
        durable = [self._durable(peer) for peer in state.peers.values()]
        told: list[Instruction] = [d for d in durable if d is not None]
        self.server.execute(told + state.checkpointed(plan))
        return self.generation, nbytes

    def _check_row_ranges(self, snapshot: Snapshot) -> None:
        """Refuse a checkpoint whose row-sparse keys hold other rows than this server holds
        in this job (written by a job with another number of servers)."""
        if self.num_servers is None:
            return
        for record in snapshot.row_keys:
            part = row_parts(record.shape[0], self.num_servers)[self.rank]
            if (record.first, record.end) != (part.start, part.stop):
                raise UnusableCheckpointError(
                    f"the checkpoint of server {self.rank} in {self.directory} holds rows "
                    f"[{record.first}, {record.end}) of key {record.key!r}; with "
                    f"{self.num_servers} servers this server holds [{part.start}, "
                    f"{part.stop}): it was written by a job with another number of servers"
                )

    def tell(self, peer: Peer) -> None:
        """Tell ``peer``'s worker which of its requests the last checkpoint holds (a
        :class:`~akv.cluster.server.instructions.Durable`; nothing before the first)."""
        durable = self._durable(peer)
        if durable is not None:
            self.server.execute([durable])

    def _durable(self, peer: Peer) -> Durable | None:
        for worker in self.state.take_renumbered():  # of a new job: none is durable yet
            self.durable_seqs.pop(worker, None)
            log.warning(
                "server %d: worker %d is of a new job (another process than the "
                "checkpoint's): its pushes are counted from its first, on top of the "
                "restored values (its inits of restored keys keep the restored values)",
                self.rank,
                worker,
            )
        seq = self.durable_seqs.get(peer.worker)
        return None if seq is None else Durable(peer, self.state.lineage.note(seq))

    async def on_request(self, instruction: Checkpoint) -> None:
        """A worker asked for a checkpoint (or sent an init or its goodbye, answered once a
        checkpoint holds them): write one, then answer. Requests that come while one is
        written are answered together by the next one; goodbyes alone, when nothing changed
        since the last one, without writing."""
        self._requests.append(instruction)
        if self._serving_requests:
            return
        self._serving_requests = True
        try:
            while self._requests:
                batch, self._requests = self._requests, []
                error: AKVError | None = None
                unchanged = self.state.changes == self._written_changes
                try:
                    if not (unchanged and all(r.if_changed for r in batch)):
                        await self.write()
                except AKVError as exc:
                    log.error("server %d: %s", self.rank, exc)
                    error = exc
                answers: list[Instruction] = [
                    Reply(r.peer, r.seq) if error is None else ReplyError(r.peer, r.seq, error)
                    for r in batch
                ]
                self.server.execute(answers)
        finally:
            self._serving_requests = False

    async def every_interval(self) -> None:
        """Write a checkpoint every interval in which anything changed (a failed one is
        logged; the next interval tries again)."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self.state.changes == self._written_changes:
                continue
            try:
                await self.write()
            except AKVError as exc:
                log.error("server %d: %s", self.rank, exc)

    async def final(self) -> None:
        """The checkpoint at a stop: everything applied so far, within
        :data:`FINAL_CHECKPOINT_S` (a failure or a timeout is logged); none from a state
        whose restore lost acknowledged pushes (see :meth:`write`)."""
        if self.state.changes == self._written_changes or self.state.lineage.lost:
            return
        try:
            generation = await asyncio.wait_for(self.write(), FINAL_CHECKPOINT_S)
            log.info("server %d wrote its final checkpoint %d", self.rank, generation)
        except (AKVError, asyncio.TimeoutError) as exc:
            log.error("server %d: the final checkpoint failed: %r", self.rank, exc)


def _write_sized(directory: Path, snapshot: Snapshot) -> int:
    """:func:`write_snapshot`, then the file's size in bytes (0 when it cannot be read).
    Closes the snapshot's spill, whatever happens: the thread that writes from it owns it
    (a caller cancelled meanwhile leaves the write to finish)."""
    try:
        path = write_snapshot(directory, snapshot)
    finally:
        if snapshot.spill is not None:
            snapshot.spill.close()  # the temporary file goes
    try:
        return path.stat().st_size
    except OSError:
        return 0


def copy_plan(plan: CheckpointPlan, directory: Path) -> Copied:
    """The keys' values, rows and optimizer states that ``plan`` names, copied (run it where
    no update of them runs meanwhile: :meth:`CheckpointedServer.copy_values`) into a
    :class:`Spill` of ``directory``, not memory: a big table is then never held twice. The
    rows are gathered a slice at a time. A failure to write there (a full disk) is a
    :class:`CheckpointError`, tried again at the next checkpoint."""
    try:
        spill = open_spill(directory)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write a checkpoint in {str(directory)!r}: no temporary file for the "
            f"copy of the keys there: {exc}"
        ) from exc
    try:
        return _copy_into(plan, spill)
    except BaseException as exc:
        spill.close()
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"cannot write a checkpoint in {str(directory)!r}: writing the copy of the "
                f"keys to a temporary file failed: {exc}"
            ) from exc
        raise


def _copy_into(plan: CheckpointPlan, spill: Spill) -> Copied:
    states = None
    if plan.updater is not None:  # first: a zip archive's offsets count from the file's start
        updater = plan.updater
        states = SpilledStates(spill, *spill.append(lambda f: updater.dump_states(False, file=f)))
    records = [
        KeyRecord(
            entry.key,
            spill.array(entry.value),
            closed_round,
            tags,
            last,
            entry.rounds.untold(),
            entry.declared,
        )
        for entry, closed_round, tags, last in plan.entries
    ]
    row_records = []
    for entry, closed_round, tags, last in plan.row_entries:
        ids = entry.rows.ids()
        stored = StoredRows(entry.rows, ids)
        offset, _ = spill.append(stored.write_rows)
        rows = SpilledArray(spill, offset, stored.dtype, stored.shape)
        shape, span = entry.shape, (entry.first, entry.end)
        untold = entry.rounds.untold()
        row_records.append(
            RowRecord(entry.key, shape, *span, ids, rows, closed_round, tags, last, untold)
        )
    return records, row_records, states, spill
