"""A parameter server's decisions, as a state machine without I/O.

:class:`ServerState` takes events and returns instructions, as h11's ``Connection`` and
Dask's ``WorkerState.handle_stimulus`` do. The service (:mod:`akv.cluster.server.service`)
feeds it what happened on the wire and on the clock, and carries out what it returns:

events (methods)                          instructions (returned)
----------------------------------------  ----------------------------------------------
:meth:`~ServerState.admit`: a worker      :class:`Reply`: answer a request "done"
opens a stream or sends one frame         :class:`ReplyError`: answer it with an error
:meth:`~ServerState.header_arrived`:      :class:`Land`: merge pushes into their rounds
where a frame's payloads land             and apply the rounds they close (array work)
:meth:`~ServerState.message_completed`    :class:`SendValues`: answer a pull with values
:meth:`~ServerState.rounds_applied`,      :class:`InstallOptimizer`, :class:`SaveStates`,
:meth:`~ServerState.update_failed`        :class:`LoadStates`: optimizer work on the keys
:meth:`~ServerState.peer_lost`            :class:`FailJob`: the job failed; tell the
:meth:`~ServerState.job_failed`           scheduler (and who vanished, if a worker did)
:meth:`~ServerState.tick`: the clock

It owns the keys and their rounds (:class:`~akv.cluster.server.rounds.KeyRounds`), pull
tickets, init waits, the job's store type, optimizer installation and deduplication, and
the overdue checks. :meth:`~ServerState.validate` checks its invariants. Array work
(merging, applying, copying out) is the service's, through the engine, so that per key a
merge, the apply of its round and the pulls that read the result keep their order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, cast

import numpy as np

from akv import optimizer as _optimizer
from akv.cluster.protocol import COUNTED, DIST_STORE_TYPES, Op, decode_meta, op_label
from akv.cluster.server.rounds import KeyRounds
from akv.errors import (
    AKVError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    MembershipError,
    OptimizerNotSetError,
    PeerLostError,
    RoundTimeoutError,
    ServerError,
    ShapeMismatchError,
    WaitTimeoutError,
)
from akv.keys import Entry, VarFactory
from akv.limits import INLINE_MAX_BYTES, RECONNECT_GRACE_S, SMALL_REPLY_BYTES
from transport import ArrayInfo, FrameHeader

__all__ = [
    "Checkpoint",
    "CheckpointPlan",
    "FailJob",
    "InitWait",
    "InstallOptimizer",
    "Instruction",
    "Land",
    "Landing",
    "LoadStates",
    "Peer",
    "PullTicket",
    "Reply",
    "ReplyError",
    "SaveStates",
    "SendValues",
    "ServerEntry",
    "ServerState",
    "ValueRegions",
]

Key: TypeAlias = "int | str"

#: The ops a worker may send a server.
_REQUEST_OPS = frozenset(op for op in Op if op not in (Op.REPLY, Op.DURABLE))
#: The requests that may change keys, rounds or the optimizer (for the checkpoint timer).
_CHANGING_OPS = frozenset({Op.INIT, Op.PUSH, Op.PUSHPULL, Op.SET_OPTIMIZER, Op.LOAD_STATES})
#: The requests that carry no arrays (their meaning is in ``text``).
_NO_ARRAY_OPS = frozenset(
    {Op.INIT_CHECK, Op.SET_OPTIMIZER, Op.SAVE_STATES, Op.CLOSE, Op.CHECKPOINT}
)


@dataclass(frozen=True, slots=True)
class Peer:
    """One way a worker sends requests: its stream, or a single HTTP request.
    ``session``: the worker process's id (its node id; empty for a sender without one)."""

    worker: int
    id: int
    stream: bool = True
    session: str = ""


#: Stored values leave this fraction (1/N) of the regions' memory free.
VALUES_KEEP_FREE = 4


class ValueRegions(Protocol):
    """Memory that answers can be sent from without a copy (regions of the arena a
    server's local streams share, :class:`transport.ArenaBook`): thread-safe."""

    @property
    def nbytes(self) -> int:
        """The size of the memory the regions are taken from."""
        ...

    def reserve(self, nbytes: int, keep_free: int = 0) -> memoryview | None:
        """A writable region of ``nbytes``, the caller's until :meth:`unreserve`; None
        when there is no room, or it would leave less than ``keep_free`` bytes free (or
        ``nbytes`` is too small to be worth it)."""
        ...

    def unreserve(self, view: np.ndarray) -> None:
        """Give a reserved region back (peers still reading it keep it until they are
        done)."""
        ...


class ServerEntry(Entry):
    """A key (or this server's part of a split key) as the server holds it.

    With :attr:`regions`, the sums that become the stored value without an updater live in
    them, so that answers to local workers are sent without a copy. Peers may read a
    stored value there until they release it, after a newer value replaced it: such a
    value is never changed in place (:meth:`private_value` moves it out first).
    """

    __slots__ = ("_in_regions", "borrowed", "durable", "made_by", "merged", "regions", "rounds")

    def __init__(
        self,
        key: Key,
        value: np.ndarray,
        new_var: VarFactory,
        sync: bool,
        num_workers: int,
        made_by: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(key, tuple(value.shape), value.dtype, new_var(f"key {key!r}"))
        self.value: np.ndarray = value
        self.merged: np.ndarray | None = None
        #: When the open round's sum is still its first push, read in place where it lies
        #: in the sender's shared memory (``merged`` is then read-only): what lent it.
        self.borrowed: Lent | None = None
        self.rounds: KeyRounds[PullTicket] = KeyRounds(key, num_workers, sync)
        #: The (session, request number) of the init that made the key; None when it was
        #: restored from a checkpoint (then any init of it is a resent one).
        self.made_by = made_by
        #: A checkpoint holds the key (always True without checkpoints).
        self.durable = True
        self.regions: ValueRegions | None = None
        #: The buffers this key took from :attr:`regions` and has not given back (the
        #: stored value and the open round's sum, at most).
        self._in_regions: list[np.ndarray] = []

    def take_sum_buffer(self) -> np.ndarray:
        """A buffer for a round's sum that will become the stored value: in
        :attr:`regions` where there is room (leaving a quarter of them free), else as
        :meth:`take_buffer`."""
        regions = self.regions
        if regions is not None:
            # Stored values never take the last quarter: answers not kept there (keys
            # past it, values an updater changes) are copied into regions of their own.
            view = regions.reserve(self.nbytes, keep_free=regions.nbytes // VALUES_KEEP_FREE)
            if view is not None:
                buffer: np.ndarray = np.frombuffer(view, self.dtype).reshape(self.shape)
                self._in_regions.append(buffer)
                return buffer
        return cast(np.ndarray, self.take_buffer())

    def give_buffer(self, buffer: Any) -> None:
        """As :meth:`Entry.give_buffer`; a buffer taken from :attr:`regions` is given back
        to them instead (freed once no peer reads it)."""
        if self._in_regions and self._out_of_regions(buffer):
            assert self.regions is not None  # it came from them
            self.regions.unreserve(buffer)
        else:
            super().give_buffer(buffer)

    def private_value(self) -> np.ndarray:
        """The stored value, moved into a buffer of the key's own first if it lies in
        :attr:`regions` (peers may be reading it there): call before changing it in
        place."""
        value = self.value
        if self._in_regions and self._out_of_regions(value):
            assert self.regions is not None  # it came from them
            private = cast(np.ndarray, self.take_buffer())
            np.copyto(private, value)
            self.regions.unreserve(value)
            self.value = private
        return self.value

    def _out_of_regions(self, buffer: object) -> bool:
        """Forget ``buffer`` as taken from :attr:`regions`; False when it was not."""
        taken = self._in_regions
        for index, array in enumerate(taken):
            if array is buffer:
                del taken[index]
                return True
        return False


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


@dataclass
class Landing:
    """What to do with a frame's arrays, decided when its header arrived: the key each
    payload belongs to and the buffer it is received into (None: not received, its bytes
    are read and dropped), or the error that refuses the whole frame (then every buffer is
    None: a refused frame is given no memory)."""

    entries: list[ServerEntry | None] = field(default_factory=list)
    buffers: list[np.ndarray | None] = field(default_factory=list)
    error: AKVError | None = None
    #: The payloads are only read (merged, or applied by the updater), so they may be read
    #: in place where they lie in the sender's shared memory (push and pushpull).
    read_in_place: bool = False
    #: The payloads read in place (see :meth:`lend`); None when none are. The
    #: :class:`Land` that reads them takes it over.
    lent: Lent | None = None

    def lend(self, payloads: Sequence[memoryview], hand_back: Callable[[], None]) -> None:
        """Read the read-only ``payloads`` (those that lie in the sender's shared memory)
        in place of their buffers, which go back to their keys; ``hand_back`` returns that
        memory to the sender once nothing reads it any more.

        A payload read in place is a read-only array: :func:`own` copies it into a buffer
        of its key where it has to be kept.
        """
        for index, payload in enumerate(payloads):
            entry, buffer = self.entries[index], self.buffers[index]
            if payload.readonly and entry is not None and buffer is not None:
                entry.give_buffer(buffer)
                self.buffers[index] = np.frombuffer(payload, entry.dtype).reshape(entry.shape)
        self.lent = Lent(hand_back)


class Lent:
    """One frame's payloads read in place in the sender's shared memory, handed back once
    the last holder is done with them (calls it). The first holder is whoever received
    the frame; a round's sum that starts as one of the payloads holds it too (:meth:`hold`),
    until a later push makes the sum a buffer of the key's own. Called on the server's
    loop only."""

    __slots__ = ("_hand_back", "_holders")

    def __init__(self, hand_back: Callable[[], None]) -> None:
        self._hand_back = hand_back
        self._holders = 1

    def hold(self) -> None:
        """One more holder (call while holding it already)."""
        self._holders += 1

    def __call__(self) -> None:
        """A holder is done; the last one hands the payloads back."""
        self._holders -= 1
        if self._holders == 0:
            self._hand_back()


def own(entry: ServerEntry, array: np.ndarray, stored: bool = False) -> np.ndarray:
    """``array`` where the key may keep it: a buffer of its own already, or a copy of a
    payload read in place (read-only: it lies in a sender's shared memory); ``stored``:
    the copy becomes the stored value (:meth:`ServerEntry.take_sum_buffer`)."""
    if array.flags.writeable:
        return array
    copy: np.ndarray = entry.take_sum_buffer() if stored else entry.take_buffer()
    np.copyto(copy, array)
    return copy


def give_back(entry: ServerEntry, array: np.ndarray) -> None:
    """Return a buffer to its key, unless it is a payload read in place (not the key's)."""
    if array.flags.writeable:
        entry.give_buffer(array)


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

    peer: Peer
    seq: int
    optimizer: _optimizer.Optimizer
    config: dict[str, Any]
    entries: tuple[ServerEntry, ...]


@dataclass(frozen=True, slots=True)
class SaveStates:
    """After earlier writes to ``entries``, answer with ``updater``'s states as one uint8
    array (``dump``: with the optimizer's configuration)."""

    peer: Peer
    seq: int
    updater: _optimizer.Updater
    dump: bool
    entries: tuple[ServerEntry, ...]


@dataclass(frozen=True, slots=True)
class LoadStates:
    """After earlier writes to ``entries``, load ``data`` into ``updater``, then reply."""

    peer: Peer
    seq: int
    updater: _optimizer.Updater
    data: bytes
    entries: tuple[ServerEntry, ...]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write a checkpoint now, and answer request ``seq`` of ``peer`` (a checkpoint request,
    or an init) once it holds everything so far."""

    peer: Peer
    seq: int


@dataclass(frozen=True, slots=True)
class FailJob:
    """The job failed for ``reason``: log it, and tell the scheduler that ``lost_worker``
    vanished (``detail`` says how) when that is the cause."""

    reason: str
    lost_worker: int | None = None
    detail: str = ""


Instruction: TypeAlias = (
    "Reply | ReplyError | Land | SendValues | InstallOptimizer | SaveStates | LoadStates "
    "| Checkpoint | FailJob"
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


# ---------------------------------------------------------------------- the state


class ServerState:
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
    """

    def __init__(
        self,
        name: str,
        num_workers: int,
        init_timeout_s: float,
        new_var: VarFactory,
        reconnect_s: float = RECONNECT_GRACE_S,
        checkpoints: bool = False,
    ) -> None:
        self.name = name
        self.num_workers = num_workers
        self.init_timeout_s = init_timeout_s
        self.reconnect_s = reconnect_s
        self.checkpoints = checkpoints
        self._new_var = new_var
        self.entries: dict[Key, ServerEntry] = {}
        self.store_type: str | None = None
        self.updater: _optimizer.Updater | None = None
        self.optimizer_config: dict[str, Any] | None = None
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
        #: Each worker's session (its process), from its first stream on.
        self._sessions: dict[int, str] = {}
        #: Workers whose stream was cut: when they count as lost, and how they were cut.
        self._absent: dict[int, tuple[float, str]] = {}
        #: Streams that a newer stream of the same worker replaced (their end is no loss).
        self._replaced: set[int] = set()
        #: Each worker's highest request number so far.
        self._received: dict[int, int] = {}
        self._goodbyes: set[int] = set()
        self._init_waits: list[InitWait] = []
        self._next_peer = 0

    @property
    def sync(self) -> bool:
        """Whether rounds collect one push per worker (``dist_sync``)."""
        return self.store_type != "dist_async"

    def workers_connected(self) -> list[int]:
        """The ranks of the workers with an open stream."""
        return sorted(peer.worker for peer in self.peers.values())

    # ------------------------------------------------------------ events: connections

    def admit(self, worker: int, store_type: str, stream: bool, session: str = "") -> Peer:
        """A worker opens its stream (``stream``) or sends a single frame; ``session``
        names its process.

        The first worker fixes the job's store type; every later one must match. A new
        stream of a worker that has one already (or had one cut) replaces it when it comes
        from the same session: the worker reconnected. The old stream's end is then no loss.

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
        """
        if store_type not in DIST_STORE_TYPES:
            raise InvalidArgumentError(f"unknown store type {store_type!r}")
        if not 0 <= worker < self.num_workers:
            raise MembershipError(
                f"worker rank {worker} is out of range for {self.num_workers} workers"
            )
        if self.store_type is not None and store_type != self.store_type:
            raise MembershipError(
                f"worker {worker} opened a {store_type} store, but this job's workers use "
                f"{self.store_type}: every worker must create the same store type"
            )
        if stream and self.failure is not None:
            raise MembershipError(f"{self.name} takes no stream: the job failed: {self.failure}")
        if stream and self.stopping:
            raise PeerLostError(f"{self.name} takes no stream: it is stopping")
        current = [p for p in self.peers.values() if p.worker == worker]
        known = self._sessions.get(worker)
        if stream and (current or known is not None):
            same = bool(session) and session == known
            if not same:
                raise MembershipError(f"worker {worker} is already connected to {self.name}")
            for old in current:
                self.peers.pop(old.id)
                self._replaced.add(old.id)
        self.store_type = store_type
        self._next_peer += 1
        peer = Peer(worker, self._next_peer, stream, session)
        if stream:
            self.peers[peer.id] = peer
            self._absent.pop(worker, None)
            if session:
                self._sessions[worker] = session
        return peer

    def peer_lost(self, peer: Peer, exc: BaseException | None, now: float) -> list[Instruction]:
        """``peer``'s stream ended (``exc``: why, if known; ``now``: the clock). Without a
        goodbye first, the worker has :attr:`reconnect_s` to come back (:meth:`tick` fails
        the job when it does not); a worker without a session cannot, and fails it now."""
        self.peers.pop(peer.id, None)
        said_goodbye = peer.id in self._goodbyes
        self._goodbyes.discard(peer.id)
        if peer.id in self._replaced:
            self._replaced.discard(peer.id)
            return []
        if said_goodbye or self.stopping or not peer.stream:
            return []
        detail = (
            f"its stream to {self.name} ended ({exc!r})"
            if exc
            else f"its stream to {self.name} ended without a goodbye"
        )
        if self.failure is not None:
            return self._fail_waiters()
        if peer.session:
            self._absent[peer.worker] = (now + self.reconnect_s, detail)
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
        out.extend(ReplyError(w.peer, w.seq, error) for w in self._init_waits)
        self._init_waits.clear()
        return out

    # ------------------------------------------------------------ events: frames

    def header_arrived(self, peer: Peer, header: FrameHeader) -> Landing:
        """Where each payload of the frame that ``header`` starts is received.

        The whole frame is checked first, before anything is allocated or counted (see
        :meth:`_check_frame`): a known op; arrays that fit it (keys present, of one kind,
        none named twice; a pull, and a request without arrays, declare no payload); each
        pushed key initialized, with its shape and dtype, so that no declared size exceeds
        the key's. Only then do payloads get buffers: push payloads buffers of their keys
        (never the stored values), init payloads fresh arrays of their declared size (the
        stream's payload limit bounds it), a load_states payload a fresh byte array.

        A refused frame gets a landing with ``error`` set and no buffer at all (None: the
        service reads its payloads and drops them), and :meth:`message_completed` answers
        it with the error.
        """
        arrays = header.arrays
        landing = Landing([None] * len(arrays), [None] * len(arrays))
        try:
            self._check_frame(peer, header)
        except AKVError as exc:
            landing.error = exc
            return landing
        op = header.op
        if op == Op.INIT:  # a resent init's keys are held already: its payloads are dropped
            landing.buffers = [
                None if info.key in self.entries else np.empty(info.shape, info.dtype)
                for info in arrays
            ]
        elif op in (Op.PUSH, Op.PUSHPULL):
            landing.read_in_place = True
            for index, info in enumerate(arrays):
                entry = self.entries[cast("Key", info.key)]  # checked: initialized
                landing.entries[index] = entry
                landing.buffers[index] = entry.take_buffer()
        elif op == Op.LOAD_STATES:
            landing.buffers = [np.empty(info.nbytes, np.uint8) for info in arrays]
        return landing

    def _check_frame(self, peer: Peer, header: FrameHeader) -> None:
        """Raise the error that refuses a frame whose header does not fit its op.

        Nothing here changes the state or allocates: it runs before any payload has a
        buffer, so a refused frame costs its header and nothing proportional to the
        payload it declares.
        """
        op, arrays = header.op, header.arrays
        label = op_label(op)
        if op not in _REQUEST_OPS:
            raise InvalidArgumentError(
                f"unknown op {op} from worker {peer.worker} ({len(arrays)} arrays, "
                f"{header.payload_len} payload bytes): {self.name} refuses it"
            )
        if op in _NO_ARRAY_OPS:
            if arrays:
                raise InvalidArgumentError(
                    f"{label} carries no arrays, but worker {peer.worker} sent {len(arrays)} "
                    f"({header.payload_len} payload bytes)"
                )
            return
        if op == Op.LOAD_STATES:
            if len(arrays) != 1 or arrays[0].key is not None or arrays[0].dtype != np.uint8:
                raise InvalidArgumentError(
                    f"load_states carries one uint8 array without a key, got {len(arrays)} "
                    f"arrays ({', '.join(f'{a.key!r} {a.dtype}' for a in arrays[:3])})"
                )
            self._require_updater("load_optimizer_states")
            return
        kinds = set()
        seen: set[Key] = set()
        for index, info in enumerate(arrays):
            key = info.key
            if key is None:
                raise InvalidArgumentError(
                    f"{label} from worker {peer.worker}: array {index} carries no key"
                )
            if key in seen:
                raise InvalidArgumentError(
                    f"{label} names key {key!r} twice in one request (worker {peer.worker})"
                )
            seen.add(key)
            kinds.add(type(key))
            if len(kinds) > 1:
                raise InvalidArgumentError(
                    f"{label} from worker {peer.worker} mixes int and str keys (key {key!r}): "
                    "a job's keys are all int or all str"
                )
            if op == Op.INIT:
                held = self.entries.get(key)
                if held is not None and not self._resent_init(peer, header.seq, held, info):
                    raise DuplicateInitError(
                        f"init key {key!r}: {self.name} already holds it", key=key
                    )
            elif op == Op.PULL:
                self._entry(key, "pull from")
                if info.nbytes:
                    raise InvalidArgumentError(
                        f"pull of key {key!r} from worker {peer.worker} declares "
                        f"{info.nbytes} payload bytes: a pull carries none"
                    )
            else:
                self._entry(key, "push to").check(info, "push to")

    def _resent_init(self, peer: Peer, seq: int, entry: ServerEntry, info: ArrayInfo) -> bool:
        """Whether an init of ``entry``'s key is the one that made it, sent again after a
        reconnect (or to a server restored from a checkpoint), with the same shape and dtype."""
        resent = entry.made_by is None or (
            bool(peer.session) and entry.made_by == (peer.session, seq)
        )
        return resent and entry.shape == tuple(info.shape) and entry.dtype == info.dtype

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
            if peer.stream:
                self._received[peer.worker] = max(self._received.get(peer.worker, 0), header.seq)
            out = self._dispatch(peer, header, buffers, landing, now)
            if header.op in _CHANGING_OPS:
                self.changes += 1
            return out
        except Exception as exc:
            for entry, buffer in zip(landing.entries, landing.buffers, strict=True):
                if entry is not None and buffer is not None:
                    give_back(entry, buffer)
            if isinstance(exc, AKVError):
                return [ReplyError(peer, header.seq, exc)]
            error = ServerError(
                f"{op_label(header.op)} request failed on {self.name}: {type(exc).__name__}: {exc}",
                server=self.name,
            )
            return [ReplyError(peer, header.seq, error, cause=exc)]

    def _dispatch(
        self,
        peer: Peer,
        header: FrameHeader,
        buffers: Sequence[memoryview | bytes],
        landing: Landing,
        now: float,
    ) -> list[Instruction]:
        op, seq = header.op, header.seq
        if op in (Op.PUSH, Op.PUSHPULL):
            return self._push(peer, header, landing, now)
        if op == Op.PULL:
            return self._pull(peer, seq, [self._entry(i.key, "pull from") for i in header.arrays])
        if op == Op.INIT:
            return self._init(peer, header, landing)
        if op == Op.INIT_CHECK:
            return self._init_check(peer, seq, decode_meta(header.text), now)
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
            return [Reply(peer, seq)]
        if op == Op.CHECKPOINT:
            if not self.checkpoints:
                raise InvalidArgumentError(
                    f"{self.name} writes no checkpoints (start it with --checkpoint-dir)"
                )
            return [Checkpoint(peer, seq)]
        raise InvalidArgumentError(f"unknown op {op}")

    def _entry(self, key: Key | None, what: str) -> ServerEntry:
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            raise KeyNotInitializedError(
                f"{what} key {key!r}: the key was never initialized (on {self.name})", key=key
            )
        return entry

    def _push(
        self, peer: Peer, header: FrameHeader, landing: Landing, now: float
    ) -> list[Instruction]:
        """Count a frame's pushes (all or nothing), then merge and apply them in one task.

        A push whose number was counted already (a resent request) is answered without
        being counted or merged again.
        """
        # A landing without an error has an entry and a buffer for every array.
        entries = cast("list[ServerEntry]", landing.entries)
        buffers = cast("list[np.ndarray]", landing.buffers)
        tags = [info.tag for info in header.arrays]
        worker = peer.worker
        seq = header.seq if peer.stream else 0
        seen: set[Key] = set()
        fresh: list[bool] = []
        for entry, tag in zip(entries, tags, strict=True):
            if entry.key in seen:
                raise InvalidArgumentError(
                    f"push names key {entry.key!r} twice in one request (worker {worker})"
                )
            seen.add(entry.key)
            fresh.append(not entry.rounds.is_duplicate(worker, tag))
            self.duplicates += not fresh[-1]
            if fresh[-1]:
                entry.rounds.check_push(worker)
        merges = []
        closing: list[tuple[ServerEntry, np.ndarray | None, int]] = []
        counted = []
        nbytes = 0
        sync = self.sync
        for entry, buffer, tag, new in zip(entries, buffers, tags, fresh, strict=True):
            if not new:
                give_back(entry, buffer)
                continue
            decision = entry.rounds.accept_push(worker, now, tag, seq)
            counted.append(entry)
            nbytes += entry.nbytes
            if sync:
                # A first push read in place that leaves its round open is the sum as it
                # lies: the next push adds both into a buffer of the key's own in one pass.
                keeps = landing.lent if decision.first and not decision.closes else None
                if keeps is not None and buffer.flags.writeable:
                    keeps = None  # not read in place: copied to start the sum as usual
                if keeps is not None:
                    keeps.hold()
                merges.append((entry, buffer, decision.first, keeps))
                if decision.closes:
                    closing.append((entry, None, decision.round))
            else:
                closing.append((entry, buffer, decision.round))
        out: list[Instruction] = []
        reply = Reply(peer, header.seq) if header.op == Op.PUSH else None
        # dist_async: a push is answered once applied, so that whoever hears of the answer
        # (a barrier) sees it; dist_sync: once counted (its round may wait for others).
        # Payloads read in place stay the server's until it hands them back, answered or
        # not (the sender frees that memory on the hand-back).
        lent = landing.lent if counted else None
        after_land = reply if counted and not sync else None
        if counted:
            landing.lent = None  # the task lets go of them
            inline = nbytes <= INLINE_MAX_BYTES
            out.append(
                Land(tuple(counted), tuple(merges), tuple(closing), inline, after_land, lent)
            )
        if header.op == Op.PUSHPULL:
            if header.flags & COUNTED and peer.stream:  # resent too: a second is ignored
                out.append(Reply(peer, header.seq, counted=True))
            out.extend(self._pull(peer, header.seq, entries))
        elif after_land is None:
            out.append(cast("Reply", reply))
        return out

    def _pull(self, peer: Peer, seq: int, entries: list[ServerEntry]) -> list[Instruction]:
        worker = peer.worker
        after = [entry.rounds.last_push_round(worker) for entry in entries]
        for entry, after_round in zip(entries, after, strict=True):
            entry.rounds.check_pull(after_round)  # refuse before parking anywhere
        ticket = PullTicket(peer, seq, entries)
        for entry, after_round in zip(entries, after, strict=True):
            if not entry.rounds.pull(after_round, ticket):
                ticket.remaining += 1
        if ticket.remaining:
            return []
        return [self._send(ticket)]

    def _send(self, ticket: PullTicket) -> SendValues:
        ticket.answered = True
        return SendValues(ticket, sum(e.nbytes for e in ticket.entries) <= SMALL_REPLY_BYTES)

    def _init(self, peer: Peer, header: FrameHeader, landing: Landing) -> list[Instruction]:
        keys = [info.key for info in header.arrays]
        if any(key is None for key in keys) or len(set(keys)) != len(keys):
            raise InvalidArgumentError(
                f"init from worker {peer.worker} names a key twice or carries no key"
            )
        # Keys given a buffer were free when the header arrived; one held now was made by
        # another init since. (Keys without a buffer are this init's own, resent.)
        held = [
            info.key
            for info, buffer in zip(header.arrays, landing.buffers, strict=True)
            if buffer is not None and info.key in self.entries
        ]
        if held:
            raise DuplicateInitError(
                f"init key {held[0]!r}: {self.name} already holds it", key=held[0]
            )
        made_by = (peer.session, header.seq) if peer.session else ("", -1)
        for info, buffer in zip(header.arrays, landing.buffers, strict=True):
            assert info.key is not None  # checked above
            if buffer is None:
                continue
            entry = ServerEntry(
                info.key, buffer, self._new_var, self.sync, self.num_workers, made_by
            )
            # With checkpoints, a new key is answered for (to its init, and to the other
            # workers' init checks) once a checkpoint holds it: a worker never pushes to a
            # key that a restarted server would not have.
            entry.durable = not self.checkpoints
            entry.regions = self.value_regions
            self.entries[info.key] = entry
        if self.checkpoints:
            return [Checkpoint(peer, header.seq)]
        out: list[Instruction] = [Reply(peer, header.seq)]
        out.extend(self._release_init_waits())
        return out

    def _init_check(
        self, peer: Peer, seq: int, items: list[tuple[Key, tuple[int, ...], str]], now: float
    ) -> list[Instruction]:
        for key, shape, dtype in items:
            entry = self.entries.get(key)
            if entry is not None:
                self._check_init_agrees(peer, key, shape, dtype, entry)
        self._init_waits.append(InitWait(peer, seq, items, now + self.init_timeout_s))
        return self._release_init_waits()

    def _check_init_agrees(
        self, peer: Peer, key: Key, shape: tuple[int, ...], dtype: str, entry: ServerEntry
    ) -> None:
        if entry.shape != shape or str(entry.dtype) != dtype:
            raise ShapeMismatchError(
                f"init key {key!r} on worker {peer.worker}: shape {shape} and dtype {dtype} "
                f"differ from worker 0's {entry.shape} {entry.dtype}",
                key=key,
            )

    def _release_init_waits(self) -> list[Instruction]:
        out: list[Instruction] = []
        still = []
        for wait in self._init_waits:
            if not all(
                key in self.entries and self.entries[key].durable for key, _, _ in wait.items
            ):
                still.append(wait)
                continue
            try:
                for key, shape, dtype in wait.items:
                    self._check_init_agrees(wait.peer, key, shape, dtype, self.entries[key])
            except AKVError as exc:
                out.append(ReplyError(wait.peer, wait.seq, exc))
            else:
                out.append(Reply(wait.peer, wait.seq))
        self._init_waits = still
        return out

    # ------------------------------------------------------------ the optimizer

    def _set_optimizer(self, peer: Peer, seq: int, text: str) -> list[Instruction]:
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"optimizer configuration is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise InvalidArgumentError("optimizer configuration must be a JSON object")
        optimizer = _optimizer.from_config(config)
        if self.optimizer_config == config:
            return [Reply(peer, seq)]  # every worker sends it; the same again changes nothing
        return [InstallOptimizer(peer, seq, optimizer, config, tuple(self.entries.values()))]

    def install_optimizer(self, optimizer: _optimizer.Optimizer, config: dict[str, Any]) -> None:
        """Use ``optimizer`` from now on (the service calls this once every earlier write
        finished). The same optimizer with new hyper-parameters keeps states and counts."""
        previous = self.updater
        if previous is not None and previous.optimizer.get_config()["name"] == config.get("name"):
            current = previous.optimizer
            optimizer.restore_update_counts(current.index_update_counts, current.num_update)
            previous.optimizer = optimizer
        else:
            self.updater = _optimizer.get_updater(optimizer)
        self.optimizer_config = config

    def _require_updater(self, what: str) -> _optimizer.Updater:
        if self.updater is None:
            raise OptimizerNotSetError(
                f"{what}: no optimizer is set on {self.name} (call set_optimizer first)"
            )
        return self.updater

    def _save_states(self, peer: Peer, seq: int, text: str) -> list[Instruction]:
        try:
            request = json.loads(text or "{}")
            dump = bool(request.get("dump_optimizer", False))
        except (ValueError, AttributeError) as exc:
            raise InvalidArgumentError(f"malformed save_states request: {exc}") from None
        updater = self._require_updater("save_optimizer_states")
        return [SaveStates(peer, seq, updater, dump, tuple(self.entries.values()))]

    def _load_states(self, peer: Peer, seq: int, data: bytes) -> list[Instruction]:
        updater = self._require_updater("load_optimizer_states")
        return [LoadStates(peer, seq, updater, data, tuple(self.entries.values()))]

    # ------------------------------------------------------------ checkpoints

    def checkpoint_plan(self) -> CheckpointPlan:
        """What a checkpoint asked for now holds (see :class:`CheckpointPlan`): every key's
        value after its closed rounds (read by a task that follows every write issued so
        far), and per worker the number below which its requests are all in it: the first
        of its pushes still in an open round, else the one after its latest request."""
        entries = []
        open_seqs: dict[int, int] = {}
        for entry in self.entries.values():
            closed_round, tags, last = entry.rounds.durable()
            entries.append((entry, closed_round, tags, last))
            for worker, seq in entry.rounds.open_seqs().items():
                if seq:
                    open_seqs[worker] = min(open_seqs.get(worker, seq), seq)
        durable = {
            worker: open_seqs.get(worker, received + 1)
            for worker, received in self._received.items()
        }
        return CheckpointPlan(
            tuple(entries), durable, self.store_type, self.optimizer_config, self.updater
        )

    def checkpointed(self, plan: CheckpointPlan) -> list[Instruction]:
        """The checkpoint of ``plan`` is written: its keys are durable; answer the init
        checks that waited for them."""
        for entry, _, _, _ in plan.entries:
            entry.durable = True
        return self._release_init_waits()

    def restore(
        self,
        store_type: str,
        keys: Sequence[tuple[Key, np.ndarray, int, dict[int, int], dict[int, int]]],
        optimizer_config: dict[str, Any] | None,
        optimizer_states: bytes | None,
        durable_seqs: dict[int, int],
    ) -> None:
        """Start from a checkpoint: the keys (key, value, closed round, each worker's last
        push number and last push round), the optimizer and its states, and the request
        numbers the checkpoint holds. Workers resend what it does not hold.

        Raises
        ------
        OptimizerError, StateFormatError
            The optimizer configuration or states cannot be loaded.
        """
        self.store_type = store_type
        for key, value, closed_round, tags, last in keys:
            entry = ServerEntry(key, value, self._new_var, self.sync, self.num_workers, None)
            entry.rounds.restore(closed_round, tags, last)
            entry.regions = self.value_regions
            self.entries[key] = entry
        if optimizer_config is not None:
            self.updater = _optimizer.get_updater(_optimizer.from_config(optimizer_config))
            self.optimizer_config = optimizer_config
            if optimizer_states:
                self.updater.load_states(optimizer_states)
        self._received = {worker: seq - 1 for worker, seq in durable_seqs.items()}

    # ------------------------------------------------------------ events: array work done

    def rounds_applied(self, done: Sequence[tuple[ServerEntry, int]]) -> list[Instruction]:
        """Each (key, round) in ``done`` was applied: answer the pulls that waited for it."""
        out: list[Instruction] = []
        for entry, round_no in done:
            for ticket in entry.rounds.applied(round_no):
                ticket.remaining -= 1
                if ticket.remaining == 0 and not ticket.answered:
                    out.append(self._send(ticket))
        return out

    def push_applied(
        self, reply: Reply, failed: Sequence[tuple[ServerEntry, int, BaseException]]
    ) -> Reply | ReplyError:
        """A push's task ran: its answer. In dist_async, where the push is applied when
        answered, the error of its first key whose update raised (naming the key and the
        server) instead; in dist_sync the pulls of a failed round get that error."""
        if not failed or self.sync:
            return reply
        entry, round_no, exc = failed[0]
        error = ServerError(
            f"the update of key {entry.key!r} in round {round_no} failed on "
            f"{self.name}: {type(exc).__name__}: {exc}",
            server=self.name,
        )
        return ReplyError(reply.peer, reply.seq, error)

    def update_failed(
        self, entry: ServerEntry, round_no: int, exc: BaseException
    ) -> list[Instruction]:
        """Applying round ``round_no`` of ``entry`` raised ``exc``: the pulls waiting for it
        get a :class:`~akv.errors.ServerError` naming the key, the round and the server."""
        error = ServerError(
            f"the update of key {entry.key!r} in round {round_no} failed on "
            f"{self.name}: {type(exc).__name__}: {exc}",
            server=self.name,
        )
        return self._fail_tickets(entry.rounds.applied(round_no), error)

    def _fail_tickets(self, tickets: list[PullTicket], error: AKVError) -> list[Instruction]:
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
        for worker, (deadline, detail) in sorted(self._absent.items()):
            if now > deadline and self.failure is None:
                self._absent.clear()
                late = f"{detail}, and it did not reconnect within {self.reconnect_s:g} s"
                return self._worker_lost(worker, late)
        for entry in self.entries.values():
            rounds = entry.rounds
            if rounds.waiting_tickets() and rounds.overdue(now, round_timeout_s):
                error = RoundTimeoutError(
                    f"round {rounds.open_round} of key {entry.key!r} waited "
                    f"{round_timeout_s:g} s for pushes from workers {rounds.missing()} "
                    f"(on {self.name})"
                )
                out.extend(self._fail_tickets(rounds.take_waiting(), error))
        still = []
        for wait in self._init_waits:
            if now <= wait.deadline:
                still.append(wait)
                continue
            missing = [k for k, _, _ in wait.items if k not in self.entries]
            out.append(
                ReplyError(
                    wait.peer,
                    wait.seq,
                    WaitTimeoutError(
                        f"keys {missing} were not initialized by worker 0 within "
                        f"{self.init_timeout_s:g} s"
                    ),
                )
            )
        self._init_waits = still
        return out

    # ------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests)."""
        assert self.store_type in (None, *DIST_STORE_TYPES), self.store_type
        assert not self.entries or self.store_type is not None, "keys before any worker"
        workers = [peer.worker for peer in self.peers.values()]
        assert len(workers) == len(set(workers)), f"two streams of one worker: {workers}"
        parked: dict[int, int] = {}
        tickets: dict[int, PullTicket] = {}
        for key, entry in self.entries.items():
            rounds = entry.rounds
            assert entry.key == key and rounds.key == key, key
            assert rounds.sync == self.sync, f"key {key!r} has the wrong round kind"
            assert 0 <= rounds.applied_round <= rounds.closed_round, (key, rounds.applied_round)
            assert entry.value.shape == entry.shape and entry.value.dtype == entry.dtype, key
            for round_no, ticket in rounds.waiting_rounds():
                assert rounds.applied_round < round_no <= rounds.open_round, (key, round_no)
                assert not ticket.answered, f"answered ticket still parked on {key!r}"
                parked[id(ticket)] = parked.get(id(ticket), 0) + 1
                tickets[id(ticket)] = ticket
            if not rounds.sync:
                assert not rounds.waiting_tickets(), f"async key {key!r} parks pulls"
        for ticket_id, count in parked.items():
            assert tickets[ticket_id].remaining == count, "ticket count differs from parking"
        for wait in self._init_waits:
            assert not all(
                k in self.entries and self.entries[k].durable for k, _, _ in wait.items
            ), "init wait not released"
        if self.failure is not None:
            assert not parked and not self._init_waits, "waits left after the job failed"

    def status(self) -> dict[str, Any]:
        """What the status page shows (JSON-ready)."""
        return {
            "keys": len(self.entries),
            "store_type": self.store_type,
            "workers_connected": self.workers_connected(),
            "failure": self.failure,
            "optimizer": None if self.optimizer_config is None else self.optimizer_config["name"],
            "checkpoints": self.checkpoints,
            "workers_reconnecting": sorted(self._absent),
            "duplicate_pushes": self.duplicates,
        }
