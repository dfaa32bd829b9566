"""A worker's requests to one server: what each sent and who hears its answers, numbered
and matched to replies; batching by server; the rules for riding and resending.

Pure: no sockets and no clock of its own. :class:`RequestTable` numbers requests, decides
where a reply's arrays land, matches replies to requests, and fails the requests whose
deadline passed when :meth:`RequestTable.sweep` is given the time; each of its methods
returns the :class:`Outcome` list for the worker's state
(:class:`~akv.cluster.worker.state.WorkerState`) to deliver. :func:`by_server` groups a
call's keys (or key parts) into one request per server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from akv.args import Key
from akv.cluster.protocol import COUNTED, OK, Op, error_from_status, op_label
from akv.compression import Compression, Residuals, compressed_nbytes
from akv.errors import AKVError, InvalidArgumentError, ServerError, UnsupportedDTypeError
from akv.keys import Entry, Part, Staged
from akv_transport import DISCARD, DTYPE_CODES, Destination, FrameHeader, InPlace, Message
from akv_transport.frame import (
    HEADER_FIXED_BYTES,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_KEY_BYTES,
    descriptor_bytes,
)

if TYPE_CHECKING:
    from akv.cluster.worker.pipeline import Ahead, Gather, Pipelined

__all__ = [
    "Landing",
    "Outcome",
    "Pushed",
    "Request",
    "RequestTable",
    "WireArray",
    "by_server",
    "check_wire_key",
    "compress_parts",
    "frame_problem",
    "pull_rides_on_push",
    "push_batches",
    "push_view",
    "settle_before_resend",
    "settle_op",
    "settle_unsettled",
]

#: One array of a request: (key, the array or its part, tag).
WireArray = tuple[Any, np.ndarray, int]
#: Where one array of a request's reply lands: a buffer of its size, or one wrapped in
#: ``InPlace`` (the answer may stay where it lies in the server's shared memory).
Landing = memoryview | InPlace
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Looked up once: an enum member lookup is not free, and every reply asks.
_SAVE_STATES, _PUSH, _PUSHPULL, _ROW_PUSH = Op.SAVE_STATES, Op.PUSH, Op.PUSHPULL, Op.ROW_PUSH

T = TypeVar("T")
U = TypeVar("U")


def by_server(
    items: Iterable[tuple[Entry, T]], piece: Callable[[Entry, Part, T], U]
) -> dict[int, list[U]]:
    """``piece(entry, part, value)`` for every part of every entry, grouped by the server
    that holds the part (one request per server), in the order of ``items``."""
    batches: dict[int, list[U]] = {}
    for entry, value in items:
        for part in entry.parts:
            batches.setdefault(part.server, []).append(piece(entry, part, value))
    return batches


def push_batches(
    staged: Sequence[tuple[Entry, Staged]], compression: Compression | None = None
) -> dict[int, list[WireArray]]:
    """A push's arrays (each key's part, numbered with the key's pushes so far), grouped
    by the server that holds the part (one request per server), in call order."""
    batches: dict[int, list[WireArray]] = {}
    for entry, array in staged:
        pushes = entry.pushes
        for part in entry.parts:
            batch = batches.get(part.server)
            if batch is None:
                batch = batches[part.server] = []
            batch.append((entry.key, push_view(entry, array, part, compression), pushes))
    return batches


def push_view(
    entry: Entry, array: Staged, part: Part, compression: Compression | None
) -> np.ndarray:
    """What a push sends of ``entry``'s part ``part``: that piece of the staged value, or
    of its compressed bytes (:func:`compress_parts`: each part's bytes, in part order)."""
    if compression is None:
        return entry.wire_view(array, part)
    assert type(array) is np.ndarray  # compressed bytes: never staged part by part
    if len(entry.parts) == 1:
        return array
    start = 0
    for other in entry.parts:
        nbytes = compressed_nbytes(compression, other.size)
        if other == part:
            return array[start : start + nbytes]
        start += nbytes
    raise ValueError(f"part {part} is not a part of key {entry.key!r}")


def compress_parts(residuals: Residuals, entry: Entry, dense: np.ndarray) -> np.ndarray:
    """``dense`` (the key's summed push) compressed part by part, each part with its own
    residual, the parts' bytes back to back (what :func:`push_view` cuts)."""
    packed = [
        residuals.encode(entry.key, index, entry.wire_view(dense, part))
        for index, part in enumerate(entry.parts)
    ]
    return packed[0] if len(packed) == 1 else np.concatenate(packed)


def pull_rides_on_push(push: Sequence[WireArray], pull: Sequence[WireArray]) -> bool:
    """Whether a pull sent right after a push (nothing between them on the stream) can go
    with it as one pushpull request: it names the same keys in the same order. The server
    handles a pushpull as that push followed by that pull, and answers once."""
    return len(push) == len(pull) and all(
        pushed[0] == pulled[0] for pushed, pulled in zip(push, pull, strict=True)
    )


#: Keys pushed, each with the dtype a pull of it carries (int64 for a row-sparse key,
#: whose pull names its row ids).
Pushed = dict[Any, np.dtype]


def settle_before_resend(op: int, arrays: Sequence[WireArray], pushed: Pushed) -> list[WireArray]:
    """When a worker resends its requests on a new stream (a replay), the pull to send and
    wait for before this one: a pull of the keys this push names that the replay pushed
    already, or nothing. ``pushed`` (the keys pushed so far in the replay) is updated.

    A dist_sync round takes one push per worker. Resent in a burst, a worker's pushes of
    two rounds of one key would meet a round still open (the other workers resend too); a
    pull in between is answered once the earlier push's round is applied, as in the run
    that was cut, where a pull (or the round's end) came between them.
    """
    keys = _pushed_keys(op, arrays)
    again = [key for key in keys if key in pushed]
    pushed.update(keys)
    return [(key, np.empty(0, keys[key]), 0) for key in again]


def settle_unsettled(op: int, arrays: Sequence[WireArray], unsettled: Pushed) -> list[WireArray]:
    """After a replay, the pull to send and wait for before a new push (``op``,
    ``arrays``): of the keys it names whose push the replay sent again, and whose round may
    still wait for the other workers' (``unsettled``, from which they are taken), or
    nothing. (The program's own pull between them was answered before the server's
    restart, by the server that died.)"""
    keys = [key for key in _pushed_keys(op, arrays) if key in unsettled]
    return [(key, np.empty(0, unsettled.pop(key)), 0) for key in keys]


def _pushed_keys(op: int, arrays: Sequence[WireArray]) -> Pushed:
    """The keys a request of ``op`` pushes, with what a pull of each carries (none for a
    request that pushes nothing)."""
    if op == _ROW_PUSH:  # each key's ids and rows: the pull asks for no row
        return {key: np.dtype(np.int64) for key, _, _ in arrays[::2]}
    if op in (_PUSH, _PUSHPULL):
        return {key: array.dtype for key, array, _ in arrays}
    return {}


def settle_op(op: int) -> Op:
    """The op of the pull :func:`settle_before_resend` asks for before a resent ``op``."""
    return Op.ROW_PULL if op == _ROW_PUSH else Op.PULL


class Request:
    """One request to a server: what it sends (``op``, ``arrays``, ``text``, ``flags``;
    kept to send it again after a reconnect, so the arrays stay unchanged until the answer)
    and who hears its answers.

    ``call`` hears the answer (the message, or the error). ``push`` is the pipelined push
    the request carries: acknowledged (``acked``) by the server's interim ``COUNTED`` answer
    or else by the answer, and told when the answer came. ``lend``: per array, the value
    asked ahead that may stay where it lies in the server's shared memory (see
    :class:`~akv.cluster.worker.pipeline.Ahead`). ``seq`` is 0 until the request is
    numbered; ``written``: it went out on the current stream; ``cuts``: how many streams
    it went out on were cut before its answer came; ``sent_at``: when its frame was last
    written, for the worker's metrics (0.0: not timed).
    """

    __slots__ = (
        "acked",
        "arrays",
        "call",
        "cuts",
        "deadline",
        "destinations",
        "flags",
        "lend",
        "op",
        "push",
        "sent_at",
        "seq",
        "sizes",
        "text",
        "written",
    )

    def __init__(
        self,
        op: int,
        arrays: Sequence[WireArray],
        deadline: float,
        call: Gather | None = None,
        destinations: Sequence[Landing] = (),
        text: str = "",
        push: Pipelined | None = None,
        lend: Sequence[Ahead | None] | None = None,
    ) -> None:
        self.op = op
        self.arrays = arrays
        self.deadline = deadline
        self.call = call
        self.destinations = destinations
        self.sizes = [(d.buffer if isinstance(d, InPlace) else d).nbytes for d in destinations]
        self.text = text
        self.push = push
        # A pushpull that carries a pipelined push asks to hear when its push is counted.
        self.flags = COUNTED if push is not None and op == _PUSHPULL else 0
        self.lend = lend
        self.acked = False
        self.seq = 0
        self.written = False
        self.cuts = 0
        self.sent_at = 0.0

    def ride(self, op: int, destinations: Sequence[Landing], call: Gather | None) -> None:
        """A pull rides on this held push: it goes as one ``op`` (a pushpull) whose answer
        lands in ``destinations`` and goes to ``call``; its push is acknowledged once
        counted."""
        self.op = op
        self.destinations = destinations
        self.sizes = [(d.buffer if isinstance(d, InPlace) else d).nbytes for d in destinations]
        self.call = call
        self.flags = COUNTED

    def __repr__(self) -> str:
        return f"<Request {op_label(self.op)} seq={self.seq} arrays={len(self.arrays)}>"


# A NamedTuple made from all its fields without the Python-level ``__new__`` that
# NamedTuple adds (a reply makes one).
_new_tuple = tuple.__new__


class Outcome(NamedTuple):
    """What request ``request`` got: ``message``, or ``error``."""

    request: Request
    message: Message | None
    error: AKVError | None


class RequestTable:
    """The outstanding requests on one server's stream (``server``: its name)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._pending: dict[int, Request] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def sent(self) -> int:
        """How many requests were numbered so far."""
        return self._seq

    def add(self, request: Request) -> int:
        """Number ``request`` (about to be sent, or kept to be) and remember it until its
        answer; return its sequence number."""
        self._seq = seq = self._seq + 1
        request.seq = seq
        self._pending[seq] = request
        return seq

    @property
    def next_seq(self) -> int:
        """The number the next request gets."""
        return self._seq + 1

    def first_seq(self) -> int | None:
        """The number of the oldest request waiting for its reply (None: none)."""
        return min(self._pending, default=None)  # (a replay puts old numbers back: see put)

    def unanswered(self) -> list[Request]:
        """Every request still waiting for its reply, by sequence number (to send again
        on a new stream)."""
        return list(self._pending.values())  # numbered in order, and never added twice

    def put(self, seq: int, request: Request) -> None:
        """Wait for the answer to ``request`` sent again under its own number ``seq`` (a
        request answered before, resent by a replay)."""
        assert seq <= self._seq and seq not in self._pending, seq
        request.seq = seq
        self._pending[seq] = request

    def get(self, seq: int) -> Request | None:
        """Request ``seq`` while it waits for its reply (None otherwise)."""
        return self._pending.get(seq)

    def pop(self, seq: int) -> Request | None:
        """Take request ``seq`` out of the table (its answer is held elsewhere)."""
        return self._pending.pop(seq, None)

    def destinations(self, header: FrameHeader) -> Sequence[Destination]:
        """Where the arrays of the reply that ``header`` starts land: the request's
        destinations when the reply is a success of the expected sizes; fresh buffers for
        ``save_states``, whose answer has sizes the worker cannot know; else
        they are discarded as they arrive (an unknown request, an error, sizes other than
        asked for), so that a reply never makes this worker allocate what it declares."""
        request = self._pending.get(header.seq)
        arrays = header.arrays
        if request is not None and header.aux == OK:
            if request.op == _SAVE_STATES:
                return [None] * len(arrays)
            if request.sizes == [info.nbytes for info in arrays]:
                return request.destinations
        discard: list[Destination] = [DISCARD] * len(arrays)
        return discard

    def reply(self, message: Message) -> Outcome | None:
        """A reply arrived: the outcome of its request (None for an unknown ``seq``).

        A non-zero status becomes the error class the server raised; a success with arrays
        of other sizes than the request expects is a :class:`~akv.errors.ServerError`.
        """
        header = message.header
        request = self._pending.pop(header.seq, None)
        if request is None:
            return None
        if header.aux != OK:
            return Outcome(request, None, error_from_status(header.aux, header.text, self.server))
        if request.sizes:
            got = [info.nbytes for info in header.arrays]
            if got != request.sizes:
                error = ServerError(
                    f"{self.server} answered with arrays of {got} bytes, expected {request.sizes}",
                    server=self.server,
                )
                return Outcome(request, None, error)
        return _new_tuple(Outcome, (request, message, None))

    def sweep(self, now: float, cut_cause: BaseException | None = None) -> list[Outcome]:
        """Fail the requests whose deadline is before ``now`` (one timer for all). The error
        of one whose streams were cut before its answer came says how often, and
        ``cut_cause``: why the stream was cut last."""
        late = [seq for seq, request in self._pending.items() if request.deadline < now]
        outcomes = []
        for seq in late:
            request = self._pending.pop(seq)
            cuts = ""
            if request.cuts:
                times = "once" if request.cuts == 1 else f"{request.cuts} times"
                last = f", the last time by {cut_cause!r}" if cut_cause is not None else ""
                cuts = f": its stream was cut {times} before the answer came{last}"
            error = ServerError(
                f"{self.server} did not answer a {op_label(request.op)} request in time "
                f"(AKV_REQUEST_TIMEOUT_S){cuts}",
                server=self.server,
            )
            outcomes.append(Outcome(request, None, error))
        return outcomes

    def fail_all(self, error: AKVError) -> list[Outcome]:
        """Fail every outstanding request with ``error``."""
        pending, self._pending = self._pending, {}
        return [Outcome(request, None, error) for request in pending.values()]


def check_wire_key(key: Key, dtype: np.dtype) -> None:
    """Raise unless ``key`` and ``dtype`` can travel in a frame."""
    if isinstance(key, int) and not INT64_MIN <= key <= INT64_MAX:
        raise InvalidArgumentError(
            f"init key {key}: int keys of a distributed store must fit in 64 bits"
        )
    if isinstance(key, str) and len(key) > MAX_KEY_BYTES // 4:
        size = len(key.encode("utf-8", "surrogatepass"))
        if size > MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"init key {key[:40]!r}... ({size} bytes of UTF-8): a distributed store's "
                f"str keys travel in every request and may have at most {MAX_KEY_BYTES} bytes"
            )
    if dtype not in DTYPE_CODES:
        known = ", ".join(str(code) for code in DTYPE_CODES)
        raise UnsupportedDTypeError(
            f"init key {key!r}: dtype {dtype} cannot travel to the servers (the "
            f"wire carries {known}); convert the value first (bfloat16: to float32)"
        )


#: Up to this many arrays and characters of text, a request's header is below the wire's
#: bound whatever its keys (each at most MAX_KEY_BYTES: :func:`check_wire_key`): 128 x
#: (64 KiB + a descriptor) + 4 MiB of UTF-8 < 16 MiB. :func:`frame_problem` counts nothing.
_SMALL_ARRAYS, _SMALL_TEXT_CHARS = 128, 1 << 20
#: Up to this many arrays of keys up to this many characters, it is below it too.
_FEW_ARRAYS, _SHORT_KEY_CHARS = 1024, 1024


def frame_problem(arrays: Sequence[WireArray], text: str) -> str | None:
    """Why a request of ``arrays`` and ``text`` cannot be one frame (more arrays, or a
    larger header, than the wire carries), else None: such a request is refused at once,
    saying so, not sent (its encoding would fail on every stream, which is no lost stream).
    """
    if len(text) <= _SMALL_TEXT_CHARS and (
        len(arrays) <= _SMALL_ARRAYS
        or (
            len(arrays) <= _FEW_ARRAYS
            and all(type(key) is not str or len(key) <= _SHORT_KEY_CHARS for key, _, _ in arrays)
        )
    ):
        return None  # (the common request: nothing counted)
    if len(arrays) > MAX_ARRAYS:
        return f"{len(arrays)} arrays in one request, above the wire's {MAX_ARRAYS}"
    size = HEADER_FIXED_BYTES + len(text.encode("utf-8", "surrogatepass"))
    size += sum(descriptor_bytes(key, array.ndim) for key, array, _ in arrays)
    if size <= MAX_HEADER_BYTES:
        return None
    return (
        f"a request of {len(arrays)} arrays has a header of {size} bytes, above the wire's "
        f"{MAX_HEADER_BYTES}: split the call (fewer keys a call, or shorter str keys)"
    )
