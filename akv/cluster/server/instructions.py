"""What a server's state and its service say to each other: who asks (:class:`Peer`), about
which keys (:class:`ServerEntry`, :class:`PullTicket`, :class:`InitWait`), and what the
service is to do (the instructions).

:class:`~akv.cluster.server.state.ServerState` takes events (its methods) and returns
instructions; the service (:mod:`akv.cluster.server.service`) carries them out:

==========================  ==========================================================
instruction                 what the service does
==========================  ==========================================================
:class:`Reply`              answer a request "done"
:class:`ReplyError`         answer a request with an error
:class:`Land`               merge pushes into their rounds and apply the rounds they
                            close (array work, in one engine task)
:class:`SendValues`         answer a pull with values
:class:`LandRows`           sum the row-sparse pushes of closed rounds and apply them
:class:`SendRows`           answer a row pull with the rows asked for
:class:`InstallOptimizer`,  optimizer work on the keys, after their earlier writes
:class:`SaveStates`,
:class:`LoadStates`
:class:`Checkpoint`         write a checkpoint, then answer the request
:class:`CloseStream`        close a stream that a newer one of its worker replaced
:class:`Durable`            tell a worker what the last checkpoint holds (from
                            :class:`~akv.cluster.server.checkpointing.Checkpoints`)
:class:`FailJob`            the job failed: log it, tell the scheduler who vanished
==========================  ==========================================================

Plain data, no I/O. A :class:`ServerEntry` is the key as the server holds it: its rounds
(:class:`~akv.cluster.server.rounds.KeyRounds`) and what made it, on top of its buffers
(:class:`~akv.cluster.server.buffers.RegionEntry`). A :class:`RowEntry` is a row-sparse key:
this server's range of its rows, in a :class:`~akv.rows.RowTable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

import numpy as np

from akv import jit
from akv import optimizer as _optimizer
from akv.args import Key
from akv.cluster.protocol import Note, split_dtype
from akv.cluster.server.buffers import Lent, RegionEntry
from akv.cluster.server.rounds import KeyRounds
from akv.compression import Compression
from akv.errors import AKVError, MembershipError, ServerError
from akv.keys import Entry, VarFactory
from akv.limits import INLINE_MAX_BYTES
from akv.rows import RowTable

__all__ = [
    "Checkpoint",
    "CheckpointPlan",
    "CloseStream",
    "Durable",
    "FailJob",
    "InitWait",
    "InstallOptimizer",
    "Instruction",
    "Land",
    "LandRows",
    "LoadStates",
    "Peer",
    "PullTicket",
    "Reply",
    "ReplyError",
    "RowEntry",
    "RowPullTicket",
    "RowPushed",
    "SaveStates",
    "SendRows",
    "SendValues",
    "ServerEntry",
    "StaleCheckpointError",
    "StatesTicket",
]

#: One row push as a round holds it: its ids and rows, and the share of its frame's
#: payloads read in place (in the sender's shared memory) that keeps them, or None.
RowPushed: TypeAlias = tuple[np.ndarray, np.ndarray, Lent | None]


@dataclass(frozen=True, slots=True)
class Peer:
    """One way a worker sends requests: its stream, or a single HTTP request.
    ``session``: the worker process's id (its node id; empty for a sender without one)."""

    worker: int
    id: int
    stream: bool = True
    session: str = ""


class ServerEntry(RegionEntry):
    """A key (or this server's part of a split key) as the server holds it: its buffers
    (:class:`~akv.cluster.server.buffers.RegionEntry`), its rounds, and the init that
    made it."""

    __slots__ = ("declared", "durable", "made_by", "rounds")

    def __init__(
        self,
        key: Key,
        value: np.ndarray,
        new_var: VarFactory,
        sync: bool,
        num_workers: int,
        made_by: tuple[str, int] | None = None,
        declared: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(key, value, new_var)
        self.rounds: KeyRounds[PullTicket | StatesTicket] = KeyRounds(key, num_workers, sync)
        #: The (session, request number) of the init that made the key; None when it was
        #: restored from a checkpoint (then any init of it is a resent one).
        self.made_by = made_by
        #: A checkpoint holds the key (always True without checkpoints).
        self.durable = True
        #: The shape a key split over the servers was declared with (its value here is
        #: this server's part, a flat slice); None for a key not split, or one restored
        #: from a checkpoint written before shapes were kept.
        self.declared = declared

    @property
    def init_dtype(self) -> str:
        """The dtype as init checks compare it (a split key's names its declared shape:
        :func:`~akv.cluster.protocol.split_dtype`)."""
        if self.declared is None:
            return str(self.dtype)
        return split_dtype(self.dtype, self.declared)


class RowEntry(Entry):
    """A row-sparse key as a server holds it: the declared ``shape`` (rows first), the
    rows ``[first, end)`` that are this server's (:func:`~akv.cluster.placement.row_parts`),
    those of them stored (:attr:`rows`, a table of the declared shape that only ever holds
    ids of the range), its rounds, the pushes of the open round (``pending``: ids and rows
    as they arrived, with the share of their frame's payloads read in place that keeps
    them, or None), and the init that made it."""

    __slots__ = ("durable", "end", "first", "made_by", "pending", "rounds")

    def __init__(
        self,
        key: Key,
        shape: tuple[int, ...],
        dtype: np.dtype,
        rows: tuple[int, int],
        new_var: VarFactory,
        sync: bool,
        num_workers: int,
        made_by: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(key, shape, dtype, new_var(f"key {key!r}"))
        self.first, self.end = rows
        self.rows: RowTable = RowTable(shape, dtype)
        # Made (once a process) on a thread from now: a server's loop never waits for them
        # (the service answers the key's init once they are made; see ParameterServer).
        jit.load_soon()
        self.rounds: KeyRounds[RowPullTicket | StatesTicket] = KeyRounds(key, num_workers, sync)
        self.pending: list[RowPushed] = []
        self.made_by = made_by
        self.durable = True

    @property
    def init_dtype(self) -> str:
        """The dtype as init checks compare it (a dense init of the key differs)."""
        return f"{self.dtype} row_sparse"


@dataclass(eq=False)
class RowPullTicket:
    """A row pull waiting for rounds to be applied: per key, the ids asked for."""

    peer: Peer
    seq: int
    pulls: list[tuple[RowEntry, np.ndarray]]
    remaining: int = 0
    answered: bool = False


@dataclass(frozen=True, slots=True)
class LandRows:
    """Sum each closed round's row-sparse pushes (``closing``: entry, round, the pushes'
    ids and rows) and apply the sum (the rows replaced, or updated by the optimizer), in
    one task that writes every key in ``entries``; then report as :class:`Land` does and
    send ``reply`` (dist_async). The task gives back the shares of :attr:`lent` once the
    sums are made."""

    entries: tuple[RowEntry, ...]
    closing: tuple[tuple[RowEntry, int, tuple[RowPushed, ...]], ...]
    reply: Reply | None = None
    #: How long the longest-open dist_sync round it closes waited for its last push.
    waited_s: float | None = None

    @property
    def inline(self) -> bool:
        """Small enough to run on the server's loop (:data:`~akv.limits.INLINE_MAX_BYTES` of
        pushed rows at most): a hop to a thread costs more than such a round."""
        nbytes = sum(rows.nbytes for _, _, pushes in self.closing for _, rows, _ in pushes)
        return nbytes <= INLINE_MAX_BYTES

    @property
    def lent(self) -> list[Lent]:
        """The shares of payloads read in place that the closed rounds' pushes hold, one
        per push read so."""
        return [lent for _, _, pushes in self.closing for _, _, lent in pushes if lent]


@dataclass(frozen=True, slots=True)
class SendRows:
    """Answer ``ticket`` with the rows it asks for, read after earlier writes."""

    ticket: RowPullTicket

    @property
    def inline(self) -> bool:
        """Small enough to gather on the server's loop, as :attr:`LandRows.inline`."""
        pulls = self.ticket.pulls
        return (
            sum(ids.size * e.nbytes // max(e.shape[0], 1) for e, ids in pulls) <= INLINE_MAX_BYTES
        )


@dataclass(eq=False)
class PullTicket:
    """A pull (or the pull half of a pushpull) waiting for rounds to be applied."""

    peer: Peer
    seq: int
    entries: list[ServerEntry]
    remaining: int = 0
    answered: bool = False


@dataclass(eq=False)
class InitWait:
    """Another worker's init, waiting for rank 0's values of its keys."""

    peer: Peer
    seq: int
    items: list[tuple[Key, tuple[int, ...], str]]
    deadline: float


# ---------------------------------------------------------------------- instructions


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer request ``seq`` of ``peer``: done, with no arrays. ``counted``: an interim
    answer that its push was counted (the request's own answer follows)."""

    peer: Peer
    seq: int
    counted: bool = False


@dataclass(frozen=True, slots=True)
class ReplyError:
    """Answer request ``seq`` of ``peer`` with ``error``. ``cause`` is an unexpected
    exception behind it (the service logs it with its traceback)."""

    peer: Peer
    seq: int
    error: AKVError
    cause: BaseException | None = None

    @classmethod
    def of(cls, peer: Peer, seq: int, what: str, exc: Exception, server: str = "") -> ReplyError:
        """The answer to a request whose work raised ``exc``: an :class:`AKVError` as it
        is, anything else as a :class:`ServerError` of ``what`` (``server``: the server's
        name), its cause kept."""
        if isinstance(exc, AKVError):
            return cls(peer, seq, exc)
        error = ServerError(f"{what}: {type(exc).__name__}: {exc}", server=server)
        return cls(peer, seq, error, exc)


@dataclass(frozen=True, slots=True)
class Land:
    """One frame's pushes: add ``merges`` (entry, buffer, first of its round, and what
    lent the buffer when the round's sum is to be that buffer as it lies) to their rounds'
    sums, then apply ``closing`` (entry, buffer or None for the merge buffer, round), in
    one task that writes every key in ``entries``. Report the outcome with
    :meth:`ServerState.rounds_applied` and :meth:`ServerState.update_failed`, let go of
    ``lent`` (the payloads read in place) and of what the task says its sums no longer
    hold, and send ``reply`` (see :meth:`ServerState.push_applied`) afterwards."""

    entries: tuple[ServerEntry, ...]
    merges: tuple[tuple[ServerEntry, np.ndarray, bool, Lent | None], ...]
    closing: tuple[tuple[ServerEntry, np.ndarray | None, int], ...]
    inline: bool
    reply: Reply | None = None
    lent: Lent | None = None
    #: A compressed push's bytes, each with the key buffer it is first decoded into (the
    #: buffer ``merges`` and ``closing`` name), and the compression.
    decodes: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    compression: Compression | None = None
    #: How long the longest-open dist_sync round it closes waited for its last push
    #: (:attr:`~akv.cluster.server.rounds.PushDecision.waited_s`; None: it closes none).
    waited_s: float | None = None


@dataclass(frozen=True, slots=True)
class SendValues:
    """Answer ``ticket`` with its keys' values, read in order after earlier writes.
    ``copy``: small enough to copy and send at once (else send the stored arrays and
    hold them for reading until the bytes left)."""

    ticket: PullTicket
    copy: bool


@dataclass(frozen=True, slots=True)
class InstallOptimizer:
    """After every earlier write to ``entries``, call
    :meth:`ServerState.install_optimizer` with these, then reply."""

    #: The call it serves (its engine task's name, and its errors').
    call: ClassVar[str] = "set_optimizer"

    peer: Peer
    seq: int
    optimizer: _optimizer.Optimizer
    config: dict[str, Any]
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class SaveStates:
    """After earlier writes to ``entries``, answer with ``updater``'s states as one uint8
    array (``dump``: with the optimizer's configuration)."""

    #: The call it serves (its engine task's name, and its errors').
    call: ClassVar[str] = "save_optimizer_states"

    peer: Peer
    seq: int
    updater: _optimizer.Updater
    dump: bool
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class LoadStates:
    """After earlier writes to ``entries``, load ``data`` into ``updater``, then reply."""

    #: The call it serves (its engine task's name, and its errors').
    call: ClassVar[str] = "load_optimizer_states"

    peer: Peer
    seq: int
    updater: _optimizer.Updater
    data: bytes
    entries: tuple[Entry, ...]


@dataclass(eq=False)
class StatesTicket:
    """A save or load of optimizer states, or a new optimizer (``work``), waiting, as a pull
    does, for the rounds its sender's last pushes went into to be applied (dist_sync: a
    push answered once counted may wait for the other workers; the states saved must hold
    its update, states loaded must not be overwritten by it, and a new optimizer must not
    apply it)."""

    peer: Peer
    seq: int
    work: InstallOptimizer | SaveStates | LoadStates
    remaining: int = 0
    answered: bool = False

    @property
    def installs(self) -> bool:
        """Whether the work is a new optimizer (it goes on after a failed round: the
        optimizer may be what its caller changes because of it)."""
        return isinstance(self.work, InstallOptimizer)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write a checkpoint now, and answer request ``seq`` of ``peer`` (a checkpoint request,
    an init, or a goodbye) once it holds everything so far. ``if_changed``: none is written
    when nothing changed since the last one (a goodbye: that one holds it all already)."""

    peer: Peer
    seq: int
    if_changed: bool = False


@dataclass(frozen=True, slots=True)
class FailJob:
    """The job failed for ``reason``: log it, and tell the scheduler that ``lost_worker``
    vanished (``detail`` says how) when that is the cause, or that this server itself
    failed (``blames_itself``: ``detail`` is what it did, after its name)."""

    reason: str
    lost_worker: int | None = None
    detail: str = ""
    blames_itself: bool = False


class StaleCheckpointError(MembershipError):
    """A worker's stream was refused because this server, restarted, lacks requests it had
    declared durable to that worker (:mod:`akv.cluster.server.durability`): the job failed.
    ``instructions`` carry that out (fail the job, answer what waited)."""

    def __init__(self, message: str, instructions: list[Instruction]) -> None:
        super().__init__(message)
        self.instructions = instructions


@dataclass(frozen=True, slots=True)
class CloseStream:
    """Close ``peer``'s stream: the same worker opened a newer one (it reconnected before
    the server saw the old one end). Its end is no loss: the state expects it."""

    peer: Peer


@dataclass(frozen=True, slots=True)
class Durable:
    """Tell ``peer``'s worker that the last checkpoint holds each of its requests numbered
    below ``note.seq`` (a ``DURABLE`` frame carrying ``note``): it drops the pushes it kept
    for a restart, and sends the note back when it opens a stream again."""

    peer: Peer
    note: Note


Instruction: TypeAlias = (
    "Reply | ReplyError | Land | SendValues | LandRows | SendRows | InstallOptimizer "
    "| SaveStates | LoadStates | Checkpoint | FailJob | CloseStream | Durable"
)


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """What a checkpoint holds, decided on the loop when it is asked for: each key with its
    durable rounds (:meth:`KeyRounds.durable`), read once every earlier write finished; and
    per worker, the request number below which each of its requests is in it."""

    entries: tuple[tuple[ServerEntry, int, dict[int, int], dict[int, int]], ...]
    durable_seqs: dict[int, int]
    store_type: str | None
    optimizer_config: dict[str, Any] | None
    updater: _optimizer.Updater | None
    #: The row-sparse keys, as ``entries``.
    row_entries: tuple[tuple[RowEntry, int, dict[int, int], dict[int, int]], ...] = ()
    #: Each connected worker's session (what a restored server compares a worker with).
    sessions: dict[int, str] = field(default_factory=dict)
