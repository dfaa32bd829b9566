"""A parameter server's decisions, as a state machine without I/O.

:class:`ServerState` takes events and returns instructions
(:mod:`akv.cluster.server.instructions`), as h11's ``Connection`` and Dask's
``WorkerState.handle_stimulus`` do. The service (:mod:`akv.cluster.server.service`) feeds
it what happened on the wire and on the clock, and carries out what it returns:

=========================================  ==============================================
event (method)                             when
=========================================  ==============================================
:meth:`~ServerState.admit`                 a worker opens a stream or sends one frame
:meth:`~ServerState.header_arrived`        a frame's header arrived: where its payloads
                                           land (:class:`~akv.cluster.server.buffers.Landing`)
:meth:`~ServerState.message_completed`     the whole frame arrived
:meth:`~ServerState.rounds_applied`,       array work finished
:meth:`~ServerState.push_applied`,
:meth:`~ServerState.update_failed`
:meth:`~ServerState.peer_lost`             a stream ended
:meth:`~ServerState.job_failed`            the scheduler said the job failed
:meth:`~ServerState.checkpointed`          a checkpoint was written
:meth:`~ServerState.tick`                  the clock
=========================================  ==============================================

It owns the keys and their rounds (:class:`~akv.cluster.server.rounds.KeyRounds`), pull
tickets, init waits, the job's store type, optimizer installation and deduplication, and
the overdue checks; which frames it takes at all is :mod:`akv.cluster.server.checks`'s,
what a dense push, pull and init decide :mod:`akv.cluster.server.dense_keys`'s, what a
checkpoint holds and a restore :mod:`akv.cluster.server.snapshots`'s.
:meth:`~ServerState.validate` checks its invariants. Array work (merging, applying,
copying out) is the service's, through the engine, so that per key a merge, the apply of
its round and the pulls that read the result keep their order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.cluster.protocol import Note, Op, decode_meta, op_label, parse_replay_barrier
from akv.cluster.server import snapshots
from akv.cluster.server.buffers import Landing, ValueRegions
from akv.cluster.server.checks import (
    CHANGING_OPS,
    check_admission,
    check_frame,
    entry_of,
)
from akv.cluster.server.dense_keys import count_push, init_keys, land, pull_ticket
from akv.cluster.server.durability import Lineage, ReplayBarrier
from akv.cluster.server.inits import InitWaits
from akv.cluster.server.instructions import (
    Checkpoint,
    CheckpointPlan,
    CloseStream,
    FailJob,
    Instruction,
    Peer,
    PullTicket,
    Reply,
    ReplyError,
    RowEntry,
    RowPullTicket,
    SendRows,
    SendValues,
    ServerEntry,
    StaleCheckpointError,
    StatesTicket,
)
from akv.cluster.server.optimizer_requests import OptimizerRequests
from akv.cluster.server.rounds import update_error
from akv.cluster.server.row_keys import ROW_OPS, RowKeys, shaped
from akv.cluster.server.staleness import Parked, Waiting
from akv.cluster.server.views import check_invariants, status
from akv.errors import (
    AKVError,
    InvalidArgumentError,
    MembershipError,
    PeerLostError,
    RoundTimeoutError,
)
from akv.keys import VarFactory
from akv.limits import RECONNECT_GRACE_S, SMALL_REPLY_BYTES
from akv_transport import FrameHeader, StreamSilentError

__all__ = ["ServerState"]

#: The requests that wait behind a worker's held-back pushes under bounded staleness.
_BOUNDED_OPS = frozenset({Op.PUSH, Op.PUSHPULL, Op.PULL, Op.ROW_PUSH, Op.ROW_PULL})
#: Changes that a stream's resend must not make twice, and whose requests are not numbered
#: per key as pushes are (inits are known by the worker that made the key).
_TAKEN_ONCE = frozenset({Op.SET_OPTIMIZER, Op.LOAD_STATES})


class ServerState(OptimizerRequests):
    """Everything one server decides (see the module docstring).

    Parameters
    ----------
    name:
        How the server is named in messages (``"server 0"``); may change once the
        scheduler gave it a rank (set :attr:`name`).
    num_workers:
        The job's workers, ranks ``0 .. num_workers - 1``.
    init_timeout_s:
        How long a worker's init waits for rank 0's values.
    new_var:
        Makes the engine var of a new key (named for it).
    reconnect_s:
        How long a worker whose stream was cut may take to open a new one before it counts
        as lost (``AKV_RECONNECT_GRACE_S``).
    checkpoints:
        Whether this server writes checkpoints (then a worker may ask for one).
    silent_reconnect_s:
        How long a worker whose stream this server cut as silent may take to come back
        (None: ``reconnect_s``). A silent stream is no sign that the worker died: the
        path to it may be broken, and the live worker names this server when it cannot
        reach it again, so this is the worker's own window to reconnect and more.
    server_id:
        This process's id: the ``DURABLE`` notes it sends carry it
        (:class:`~akv.cluster.server.durability.Lineage`).
    """

    def __init__(
        self,
        name: str,
        num_workers: int,
        init_timeout_s: float,
        new_var: VarFactory,
        reconnect_s: float = RECONNECT_GRACE_S,
        checkpoints: bool = False,
        silent_reconnect_s: float | None = None,
        server_id: str = "",
    ) -> None:
        self.num_workers = num_workers
        #: The row-sparse keys (:mod:`akv.cluster.server.row_keys`).
        self.rows = RowKeys(name, num_workers, new_var)
        self.name = name
        self.init_timeout_s = init_timeout_s
        self.reconnect_s = reconnect_s
        self.silent_reconnect_s = reconnect_s if silent_reconnect_s is None else silent_reconnect_s
        self.checkpoints = checkpoints
        self._new_var = new_var
        self.entries: dict[Key, ServerEntry] = {}
        self.store_type: str | None = None
        self.updater: _optimizer.Updater | None = None
        self.optimizer_config: dict[str, Any] | None = None
        #: The configuration in force once every new optimizer asked for so far is
        #: installed (some may wait for rounds).
        self.requested_config: dict[str, Any] | None = None
        #: Where the keys keep their sums (:attr:`ServerEntry.regions`); None: in buffers
        #: of their own.
        self.value_regions: ValueRegions | None = None
        self.failure: str | None = None
        self.stopping = False
        self.peers: dict[int, Peer] = {}
        #: Changes to keys, rounds or the optimizer so far (a checkpoint notes the count
        #: it holds, so that an idle server writes none).
        self.changes = 0
        #: Resent pushes answered without being counted again (for statistics and tests).
        self.duplicates = 0
        #: Streams a worker opened again (a reconnect of its session), for statistics.
        self.reconnects = 0
        #: Each worker's session (its process), from its first stream on.
        self._sessions: dict[int, str] = {}
        #: The sessions of the checkpoint this process was restored from
        #: (:func:`~akv.cluster.server.snapshots.restore`).
        self._restored_sessions: dict[int, str] = {}
        self._renumbered: list[int] = []
        #: Workers whose stream was cut: when they count as lost, how they were cut, and
        #: the seconds they were given to come back.
        self._absent: dict[int, tuple[float, str, float]] = {}
        #: Each worker's highest number of a request that may change the server so far.
        self._received: dict[int, int] = {}
        self._goodbyes: set[int] = set()
        #: Workers whose stream ended after their goodbye (they told the scheduler first):
        #: once every worker is here, the scheduler says stop at this server's next heartbeat.
        self.left: set[int] = set()
        self._init_waits = InitWaits(init_timeout_s)
        self._next_peer = 0
        #: What this process holds of the checkpoints its rank declared durable.
        self.lineage = Lineage(server_id, num_workers)
        #: dist_async's bounded staleness (the first worker's bound; None: no bound), and
        #: the frames that wait for slower workers (:mod:`akv.cluster.server.staleness`).
        self.staleness: int | None = None
        #: A worker's stream fixed :attr:`staleness` (a restored server's first one does).
        self._bound_set = False
        self.waiting: Waiting | None = None
        #: Pulls ready to be answered while the lineage holds answers (a restored server
        #: has not checked every worker yet).
        self._held_answers: list[PullTicket | RowPullTicket] = []

    @property
    def name(self) -> str:
        """How the server is named in messages."""
        return self.rows.name

    @name.setter
    def name(self, name: str) -> None:
        self.rows.name = name

    def _all_keys(self) -> tuple[ServerEntry | RowEntry, ...]:
        return (*self.entries.values(), *self.rows.entries.values())

    def _held(self) -> dict[Key, ServerEntry | RowEntry]:
        """Every key held, dense and row-sparse (for the init checks)."""
        return {**self.entries, **self.rows.entries}

    @property
    def sync(self) -> bool:
        """Whether rounds collect one push per worker (``dist_sync``)."""
        return self.store_type != "dist_async"

    def workers_connected(self) -> list[int]:
        """The ranks of the workers with an open stream."""
        return sorted(peer.worker for peer in self.peers.values())

    # ------------------------------------------------------------ events: connections

    def admit(
        self,
        worker: int,
        store_type: str,
        stream: bool,
        session: str = "",
        note: Note | None = None,
        staleness: int | None = None,
        replay: int | None = None,
    ) -> tuple[Peer, list[Instruction]]:
        """A worker opens its stream (``stream``) or sends a single frame; ``session``
        names its process, ``note`` is the last ``DURABLE`` note it acted on, ``replay``
        the barriers it had passed before the requests it sends again (``dist_async``;
        see :mod:`~akv.cluster.server.durability`). Returns the
        new peer, and what to do first: a :class:`CloseStream` for each stream it replaces,
        and the pulls it lets be answered (the last worker a restored server waited for).

        A server restarted from a checkpoint older than what it declared durable to this
        worker (or without the checkpoint) fails the job (:class:`StaleCheckpointError`):
        the worker dropped the pushes it lacks (:class:`~akv.cluster.server.durability.Lineage`).

        The first worker fixes the job's store type and staleness bound (dist_async);
        every later one must match. A new
        stream of a worker that has one already (or had one cut) replaces it when it comes
        from the same session: the worker reconnected. The old stream is closed, and its
        end (:meth:`peer_lost`) is no loss.

        Raises
        ------
        InvalidArgumentError
            An unknown store type.
        MembershipError
            A rank out of range, a store type other than the job's, a second stream from
            the same worker that is not its reconnection, or any stream after the job
            failed. Nothing changes.
        PeerLostError
            A stream while the server stops (its restart, if any, takes it).
        StaleCheckpointError
            This server lost requests it had declared durable to the worker: the job
            failed (the error carries what to do about it).
        """
        check_admission(
            worker,
            store_type,
            stream,
            staleness,
            num_workers=self.num_workers,
            job=(self.store_type, self.staleness),
            failure=self.failure,
            stopping=self.stopping,
            name=self.name,
            restored=self.lineage.restored_from,
            bound_set=self._bound_set,
        )
        current = [p for p in self.peers.values() if p.worker == worker]
        known = self._sessions.get(worker)
        if stream and (current or known is not None) and not (session and session == known):
            raise MembershipError(f"worker {worker} is already connected to {self.name}")
        if stream:  # checked once the stream is known to be the worker's own
            lost = self.lineage.check(worker, note, replay)
            if lost is not None:
                self.failure = f"{self.name} {lost}"
                failing = [FailJob(self.failure, detail=lost, blames_itself=True)]
                raise StaleCheckpointError(self.failure, [*failing, *self._fail_waiters()])
        replaced: list[Instruction] = []
        if stream:
            self.reconnects += known is not None
            for old in current:
                self.peers.pop(old.id)  # its end, whenever it comes, is no loss
                replaced.append(CloseStream(old))
        self.store_type = store_type
        if stream and staleness is not None and self.waiting is None:
            self.staleness, self.waiting = staleness, Waiting(staleness)
        self._bound_set = self._bound_set or stream
        self._next_peer += 1
        peer = Peer(worker, self._next_peer, stream, session)
        if stream:
            self.peers[peer.id] = peer
            self._absent.pop(worker, None)
            if session:
                restored = self._restored_sessions.pop(worker, None)
                if restored is not None and restored != session:
                    self._new_job(worker)
                self._sessions[worker] = session
        return peer, [*replaced, *self._answers_let_go()]

    def workers_finished(self, workers: list[int]) -> list[Instruction]:
        """These workers closed their stores (the scheduler says, when a restarted server
        joins): a restored server waits for none of them; returns the pulls it lets be
        answered."""
        passed = self.lineage.finished(workers)
        return [*(Reply(b.peer, b.seq) for b in passed), *self._answers_let_go()]

    def _answers_let_go(self) -> list[Instruction]:
        """The held pulls, once the lineage holds answers no more."""
        if self.lineage.answers_held or not self._held_answers:
            return []
        held, self._held_answers = self._held_answers, []
        return [self._answer(ticket) for ticket in held]

    def peer_lost(self, peer: Peer, exc: BaseException | None, now: float) -> list[Instruction]:
        """``peer``'s stream ended (``exc``: why, if known; ``now``: the clock). Without a
        goodbye first, the worker has :attr:`reconnect_s` to come back (:meth:`tick` fails
        the job when it does not), or :attr:`silent_reconnect_s` when the stream was cut
        for silence (``exc`` a :class:`~akv_transport.StreamSilentError`); a worker without a
        session cannot, and fails it now. Only the end of the worker's newest stream counts:
        the end of one that a newer stream replaced (whenever it comes, made or not), or of
        one whose end was reported before, is no loss."""
        if self.waiting is not None:  # the worker resends them on its next stream
            for parked in self.waiting.take(keep=lambda p: p.peer.id != peer.id):
                self._drop_parked(parked, PeerLostError("the stream ended"))
        newest = self.peers.pop(peer.id, None) is not None
        said_goodbye = peer.id in self._goodbyes
        self._goodbyes.discard(peer.id)
        if said_goodbye and newest:
            self.left.add(peer.worker)
        if not newest or said_goodbye or self.stopping:
            return []
        detail = (
            f"its stream to {self.name} ended ({exc!r})"
            if exc
            else f"its stream to {self.name} ended without a goodbye"
        )
        if self.failure is not None:
            return self._fail_waiters()
        if peer.session:
            silent = isinstance(exc, StreamSilentError)
            grace = self.silent_reconnect_s if silent else self.reconnect_s
            self._absent[peer.worker] = (now + grace, detail, grace)
            return []
        return self._worker_lost(peer.worker, detail)

    def _worker_lost(self, worker: int, detail: str) -> list[Instruction]:
        reason = (
            f"worker {worker} disconnected from {self.name} without closing its store: {detail}"
        )
        self.failure = reason
        return [FailJob(reason, lost_worker=worker, detail=detail), *self._fail_waiters()]

    def job_failed(self, reason: str) -> list[Instruction]:
        """The job failed (the scheduler said so): answer every waiting pull and init with
        the reason. Only the first reason is kept."""
        out: list[Instruction] = []
        if self.failure is None:
            self.failure = reason
            out.append(FailJob(reason))
        out.extend(self._fail_waiters())
        return out

    def _fail_waiters(self) -> list[Instruction]:
        error = PeerLostError(self.failure or "the job failed")
        out: list[Instruction] = []
        for entry in self.entries.values():
            out.extend(self._fail_tickets(entry.rounds.take_waiting(), error))
        for row_entry in self.rows.entries.values():
            out.extend(self._fail_tickets(row_entry.rounds.take_waiting(), error))
        held, self._held_answers = self._held_answers, []
        out.extend(self._fail_tickets(held, error))
        out.extend(ReplyError(b.peer, b.seq, error) for b in self.lineage.take_barriers())
        if self.waiting is not None:
            for parked in self.waiting.take():
                out.extend(self._drop_parked(parked, error))
        out.extend(self._init_waits.fail_all(error))
        return out

    # ------------------------------------------------------------ events: frames

    def header_arrived(self, peer: Peer, header: FrameHeader) -> Landing:
        """Where each payload of the frame that ``header`` starts is received.

        The whole frame is checked first, before anything is allocated or counted
        (:func:`~akv.cluster.server.checks.check_frame`): a known op; arrays that fit it
        (keys present, of one kind, none named twice; a pull, and a request without
        arrays, declare no payload); each pushed key initialized, with its shape and dtype,
        so that no declared size exceeds the key's. Only then do payloads get buffers:
        push payloads buffers of their keys (never the stored values), init payloads fresh
        arrays of their declared size (the stream's payload limit bounds it), a
        load_states payload a fresh byte array.

        A refused frame gets a landing with ``error`` set and no buffer at all (None: the
        service reads its payloads and drops them), and :meth:`message_completed` answers
        it with the error.
        """
        arrays = header.arrays
        landing = Landing([None] * len(arrays), [None] * len(arrays))
        try:
            if header.op in ROW_OPS:
                landing.buffers = list(
                    self.rows.landing(peer, header, self.entries, self.checkpoints)
                )
                # A push's rows are only read (summed into a round's own arrays), so they
                # may be read where they lie in the sender's shared memory.
                # Not a push that may wait (bounded staleness): the sender frees it once
                # answered, and a parked frame is answered before it is read.
                landing.read_in_place = header.op == Op.ROW_PUSH and self.waiting is None
                return landing
            check_frame(peer, header, self.entries, self.updater, self.name, self.rows.entries)
        except AKVError as exc:
            landing.error = exc
            return landing
        land(header, self.entries, landing, parks=self.waiting is not None)
        return landing

    def message_completed(
        self,
        peer: Peer,
        header: FrameHeader,
        buffers: Sequence[memoryview | bytes],
        landing: Landing,
        now: float,
    ) -> list[Instruction]:
        """A whole request arrived (its payloads in the buffers that ``landing``, made by
        :meth:`header_arrived` for this frame, chose); decide what it does.

        A refused request changes nothing and is answered with its error; one that failed
        unexpectedly is answered with a :class:`~akv.errors.ServerError`.
        """
        try:
            if landing.error is not None:
                raise landing.error
            changing = header.op in CHANGING_OPS
            received = self._received.get(peer.worker, 0)
            if changing and peer.stream:
                # Changes only: a replay sends a pull (numbered after every request it
                # resends) ahead of the changes still to come, which no checkpoint holds.
                self._received[peer.worker] = max(received, header.seq)
            if header.op in _TAKEN_ONCE and peer.stream and header.seq <= received:
                return self._resent(peer, header.seq)  # a cut stream's resend: taken already
            out = self._dispatch(peer, header, buffers, landing, now)
            if changing:
                self.changes += 1
            return out
        except Exception as exc:
            landing.give_back_buffers()
            what = f"{op_label(header.op)} request failed on {self.name}"
            return [ReplyError.of(peer, header.seq, what, exc, self.name)]

    def _dispatch(
        self,
        peer: Peer,
        header: FrameHeader,
        buffers: Sequence[memoryview | bytes],
        landing: Landing,
        now: float,
    ) -> list[Instruction]:
        op, seq = header.op, header.seq
        if self.waiting is not None and op in _BOUNDED_OPS:
            return self._bounded(peer, header, landing, now)
        if op in (Op.PUSH, Op.PUSHPULL):
            return self._push(peer, header, landing, now)
        if op in ROW_OPS:
            return self._rows(peer, header, landing, now)
        if op == Op.PULL:
            return self._pull(peer, seq, [self._entry(i.key, "pull from") for i in header.arrays])
        if op == Op.INIT:
            return self._init(peer, header, landing)
        if op == Op.INIT_CHECK:
            items = decode_meta(header.text)
            return self._init_waits.add(peer, seq, items, now, self._held())
        if op == Op.SET_OPTIMIZER:
            return self._set_optimizer(peer, seq, header.text)
        if op == Op.SAVE_STATES:
            return self._save_states(peer, seq, header.text)
        if op == Op.LOAD_STATES:
            if len(buffers) != 1:
                raise InvalidArgumentError(f"load_states carries one array, got {len(buffers)}")
            return self._load_states(peer, seq, bytes(buffers[0]))
        if op == Op.CLOSE:
            self._goodbyes.add(peer.id)
            untold = [e.rounds.take_untold(peer.worker) for e in self._all_keys()]
            failed = next((error for error in untold if error is not None), None)
            if failed is not None:  # a failed update it never pulled after: its close raises
                return [ReplyError(peer, seq, failed)]
            if self.checkpoints:
                # A worker that left resends nothing to a restart: its goodbye is answered
                # once a checkpoint holds what it changed (all but pushes of rounds still
                # open), else a restart before the final checkpoint would lose it.
                return [Checkpoint(peer, seq, if_changed=True)]
            return [Reply(peer, seq)]
        if op == Op.REPLAY_BARRIER:
            barriers, last = parse_replay_barrier(header.text)
            passed = self.lineage.replay_barrier(ReplayBarrier(peer, seq, barriers), last)
            return [*(Reply(b.peer, b.seq) for b in passed), *self._answers_let_go()]
        if op == Op.CHECKPOINT:
            if not self.checkpoints:
                raise InvalidArgumentError(
                    f"{self.name} writes no checkpoints (start it with --checkpoint-dir)"
                )
            return [Checkpoint(peer, seq)]
        raise InvalidArgumentError(f"unknown op {op}")

    def _bounded(
        self, peer: Peer, header: FrameHeader, landing: Landing, now: float
    ) -> list[Instruction]:
        """A push, pushpull or pull (of dense or row-sparse keys) with bounded staleness: it
        waits, or is taken and lets the frames go that it no longer holds back
        (:mod:`~akv.cluster.server.staleness`)."""
        waiting = cast("Waiting", self.waiting)
        if waiting.must_wait(peer, header, self._ahead):
            waiting.park(Parked(peer, header, landing, now))
            return []
        out = self._data(peer, header, landing, now)

        def blocked(parked: Parked) -> bool:
            return waiting.blocked(parked.peer, parked.header, self._ahead)

        while (parked := waiting.pop_ready(blocked)) is not None:
            try:
                out.extend(self._data(parked.peer, parked.header, parked.landing, now))
            except AKVError as exc:
                out.extend(self._drop_parked(parked, exc))
        return out

    def _data(
        self, peer: Peer, header: FrameHeader, landing: Landing, now: float
    ) -> list[Instruction]:
        if header.op == Op.PULL:
            return self._pull(
                peer, header.seq, [self._entry(i.key, "pull from") for i in header.arrays]
            )
        if header.op in ROW_OPS:
            return self._rows(peer, header, landing, now)
        return self._push(peer, header, landing, now)

    def _ahead(self, worker: int, key: object, tag: int) -> int:
        # No merged dict of the keys: this runs for every array of every bounded frame.
        dense = self.entries.get(cast("Key", key))
        rounds = dense.rounds if dense is not None else self.rows.entries[cast("Key", key)].rounds
        return -1 if rounds.is_duplicate(worker, tag) else rounds.lead(worker)[0]

    def _drop_parked(self, parked: Parked, error: AKVError) -> list[Instruction]:
        """Answer a frame that waited with ``error``, its payloads given back."""
        parked.landing.give_back_buffers()
        return [ReplyError(parked.peer, parked.header.seq, error)]

    def _rows(
        self, peer: Peer, header: FrameHeader, landing: Landing, now: float
    ) -> list[Instruction]:
        """A request on row-sparse keys (:class:`~akv.cluster.server.row_keys.RowKeys`)."""
        buffers = shaped(header, cast("list[np.ndarray]", landing.buffers))
        if header.op == Op.ROW_INIT:
            made = self.rows.init(peer, header, buffers, self.sync)
            if self.checkpoints:  # answered once a checkpoint holds the keys (as INIT)
                for entry in made:
                    entry.durable = False
                return [Checkpoint(peer, header.seq)]
            return [Reply(peer, header.seq), *self._init_waits.release(self._held())]
        if header.op == Op.ROW_PUSH:
            out, duplicates = self.rows.push(peer, header, buffers, now, landing.lent)
            self.duplicates += duplicates
            return out
        ticket = self.rows.pull(peer, header, buffers)
        return self._answer_pull(ticket, [entry for entry, _ in ticket.pulls])

    def _entry(self, key: Key | None, what: str) -> ServerEntry:
        return entry_of(self.entries, key, what)

    def _push(
        self, peer: Peer, header: FrameHeader, landing: Landing, now: float
    ) -> list[Instruction]:
        """Count a frame's pushes (:func:`~akv.cluster.server.dense_keys.count_push`);
        a pushpull's pull follows."""
        out, entries, duplicates = count_push(peer, header, landing, now, self.entries, self.sync)
        self.duplicates += duplicates
        if header.op == Op.PUSHPULL:
            out.extend(self._pull(peer, header.seq, entries))
        return out

    def _pull(self, peer: Peer, seq: int, entries: list[ServerEntry]) -> list[Instruction]:
        return self._answer_pull(pull_ticket(peer, seq, entries), entries)

    def _answer_pull(
        self, ticket: PullTicket | RowPullTicket, entries: Sequence[ServerEntry | RowEntry]
    ) -> list[Instruction]:
        """A pull's ticket answered now, or left to wait (``remaining``); answered with the
        error of a failed round of one of its keys that its worker was not told of yet."""
        for entry in entries:
            untold = entry.rounds.take_untold(ticket.peer.worker)
            if untold is not None:
                return self._fail_tickets([ticket], untold)
        return [] if ticket.remaining else self._ready(ticket)

    def _ready(self, ticket: PullTicket | RowPullTicket | StatesTicket) -> list[Instruction]:
        """``ticket``'s values may be sent (or its states saved or loaded); unless this
        restored ``dist_async`` server has not checked every worker yet (then a pull waits:
        in ``dist_async`` no round needs the others' pushes, so a value could lack pushes a
        restore lost; in ``dist_sync`` a round closes only with a push of every worker, each
        made after its check)."""
        if isinstance(ticket, StatesTicket):
            ticket.answered = True
            return [ticket.work]
        if not self.sync and self.lineage.answers_held:
            self._held_answers.append(ticket)
            return []
        return [self._answer(ticket)]

    def _answer(self, ticket: PullTicket | RowPullTicket) -> SendValues | SendRows:
        ticket.answered = True
        if isinstance(ticket, RowPullTicket):
            return SendRows(ticket)
        return SendValues(ticket, sum(e.nbytes for e in ticket.entries) <= SMALL_REPLY_BYTES)

    def _init(self, peer: Peer, header: FrameHeader, landing: Landing) -> list[Instruction]:
        make = (self._new_var, self.sync, self.num_workers)
        out = init_keys(
            peer,
            header,
            landing,
            self.entries,
            self.name,
            make,
            self.checkpoints,
            self.value_regions,
        )
        if not self.checkpoints:
            out.extend(self._init_waits.release(self._held()))
        return out

    # ------------------------------------------------------------ checkpoints

    def checkpoint_plan(self) -> CheckpointPlan:
        """What a checkpoint asked for now holds (:func:`~akv.cluster.server.snapshots.plan`)."""
        return snapshots.plan(self)

    def checkpointed(self, plan: CheckpointPlan) -> list[Instruction]:
        """The checkpoint of ``plan`` is written: its keys are durable; answer the init
        checks that waited for them."""
        for entry, _, _, _ in plan.entries:
            entry.durable = True
        for row_entry, _, _, _ in plan.row_entries:
            row_entry.durable = True
        return self._init_waits.release(self._held())

    def session_of(self, worker: int, default: str | None = None) -> str | None:
        """The session of ``worker``'s streams to this process (``default``: none seen yet)."""
        return self._sessions.get(worker, default)

    def take_renumbered(self) -> list[int]:
        """The workers found to be of a new job since the last call (their requests of the
        restored checkpoint's job are no longer theirs: no note may say they are durable)."""
        renumbered, self._renumbered = self._renumbered, []
        return renumbered

    def _new_job(self, worker: int) -> None:
        """``worker`` is of a new job started from the restored checkpoint: its pushes and
        requests are counted from the start again, on top of the restored values (else its
        first pushes would be taken for resends of the old job's, and dropped)."""
        for entry in self._all_keys():
            entry.rounds.forget_worker(worker)
        self._received.pop(worker, None)
        self._renumbered.append(worker)

    # ------------------------------------------------------------ events: array work done

    def rounds_applied(
        self, done: Sequence[tuple[ServerEntry, int]] | Sequence[tuple[RowEntry, int]]
    ) -> list[Instruction]:
        """Each (key, round) in ``done`` was applied: answer the pulls that waited for it."""
        out: list[Instruction] = []
        for entry, round_no in done:
            for ticket in entry.rounds.applied(round_no):
                out.extend(self._round_over(ticket))
        return out

    def _round_over(self, ticket: PullTicket | RowPullTicket | StatesTicket) -> list[Instruction]:
        """One of the rounds ``ticket`` waits for is over: its work, if it was the last."""
        ticket.remaining -= 1
        return self._ready(ticket) if ticket.remaining == 0 and not ticket.answered else []

    def push_applied(
        self,
        reply: Reply,
        failed: Sequence[tuple[ServerEntry, int, BaseException]]
        | Sequence[tuple[RowEntry, int, BaseException]],
    ) -> Reply | ReplyError:
        """A push's task ran: its answer. In dist_async, where the push is applied when
        answered, the error of its first key whose update raised (naming the key and the
        server) instead; in dist_sync the pulls of a failed round get that error."""
        if not failed or self.sync:
            return reply
        entry, round_no, exc = failed[0]
        return ReplyError(reply.peer, reply.seq, update_error(entry.key, round_no, exc, self.name))

    def update_failed(
        self, entry: ServerEntry | RowEntry, round_no: int, exc: BaseException
    ) -> list[Instruction]:
        """Applying round ``round_no`` of ``entry`` raised ``exc``: the pulls waiting for it
        get a :class:`~akv.errors.ServerError` naming the key, the round and the server. A
        new optimizer waiting for it goes on (the round is over: the optimizer may be what
        its caller changes because of it), and its caller is told by its next pull."""
        error = update_error(entry.key, round_no, exc, self.name)
        waiting = entry.rounds.applied(round_no)
        tickets = [t for t in waiting if not (isinstance(t, StatesTicket) and t.installs)]
        told = {ticket.peer.worker for ticket in tickets if not ticket.answered}
        entry.rounds.failed(round_no, error, told)
        out = self._fail_tickets(tickets, error)
        for ticket in waiting:
            if ticket not in tickets:
                out.extend(self._round_over(ticket))
        return out

    def _fail_tickets(
        self, tickets: Sequence[PullTicket | RowPullTicket | StatesTicket], error: AKVError
    ) -> list[Instruction]:
        out: list[Instruction] = []
        for ticket in tickets:
            if not ticket.answered:
                ticket.answered = True
                out.append(ReplyError(ticket.peer, ticket.seq, error))
        return out

    # ------------------------------------------------------------ events: the clock

    def tick(self, now: float, round_timeout_s: float) -> list[Instruction]:
        """Fail the pulls of rounds that waited longer than ``round_timeout_s`` for their
        last pushes, and the inits that waited too long for rank 0's values; fail the job
        when a cut worker did not come back within :attr:`reconnect_s`."""
        out: list[Instruction] = []
        for worker, (deadline, detail, grace) in sorted(self._absent.items()):
            if now > deadline and self.failure is None:
                self._absent.clear()
                late = f"{detail}, and it did not reconnect within {grace:g} s"
                return self._worker_lost(worker, late)
        for entry in self._all_keys():
            rounds = entry.rounds
            if rounds.waiting_tickets() and rounds.overdue(now, round_timeout_s):
                error = RoundTimeoutError(
                    f"round {rounds.open_round} of key {entry.key!r} waited "
                    f"{round_timeout_s:g} s for pushes from workers {rounds.missing()}"
                )  # the worker adds which server answered (error_from_status)
                out.extend(self._fail_tickets(rounds.take_waiting(), error))
        out.extend(self._init_waits.overdue(now, self._held()))
        while self.waiting is not None:
            overdue = self.waiting.pop_overdue(now, round_timeout_s)
            if overdue is None:
                break
            keys = list(dict.fromkeys(info.key for info in overdue.header.arrays))
            held = self._held()
            slow = sorted(
                {w for k in keys for w in held[cast("Key", k)].rounds.lead(overdue.peer.worker)[1]}
            )
            error = RoundTimeoutError(
                f"a push of keys {keys} by worker {overdue.peer.worker} waited {round_timeout_s:g} "
                f"s for workers {slow}: it is more than {self.staleness} pushes ahead "
                "(AKV_STALENESS)"
            )
            out.extend(self._drop_parked(overdue, error))
        return out

    # ------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests; see
        :func:`~akv.cluster.server.views.check_invariants`)."""
        check_invariants(self)

    def status(self) -> dict[str, Any]:
        """What the status page shows (JSON-ready; :func:`~akv.cluster.server.views.status`)."""
        return status(self)
