"""A worker's bookkeeping of its requests to one server, and batching by server.

Pure: no sockets and no clock of its own. :class:`RequestTable` numbers requests, decides
where a reply's arrays land, matches replies to requests, and fails the requests whose
deadline passed when :meth:`RequestTable.sweep` is given the time. Each of its methods
returns the :class:`Outcome` list to deliver; the link (:mod:`akv.cluster.worker.link`)
delivers them. :func:`by_server` groups a call's keys (or key parts) into one request per
server; every store call uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from akv.cluster.protocol import OK, Op, error_from_status, op_label
from akv.errors import AKVError, ServerError
from akv.keys import Entry, Part
from transport import DISCARD, Destination, FrameHeader, InPlace, Message

__all__ = [
    "Landing",
    "OnReply",
    "Outcome",
    "Request",
    "RequestTable",
    "WireArray",
    "by_server",
    "pull_rides_on_push",
    "push_then_pull",
    "settle_before_resend",
]

#: What a request's sender is told: ``on_reply(message, None)`` or ``on_reply(None, error)``.
OnReply = Callable[["Message | None", "AKVError | None"], None]
#: One array of a request: (key, the array or its part, tag).
WireArray = tuple[Any, np.ndarray, int]
#: Where one array of a request's reply lands: a buffer of its size, or one wrapped in
#: ``InPlace`` (the answer may stay where it lies in the server's shared memory).
Landing = memoryview | InPlace

# Looked up once: an enum member lookup is not free, and every reply asks.
_SAVE_STATES = Op.SAVE_STATES

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


def pull_rides_on_push(push: Sequence[WireArray], pull: Sequence[WireArray]) -> bool:
    """Whether a pull sent right after a push (nothing between them on the stream) can go
    with it as one pushpull request: it names the same keys in the same order. The server
    handles a pushpull as that push followed by that pull, and answers once."""
    return len(push) == len(pull) and all(
        pushed[0] == pulled[0] for pushed, pulled in zip(push, pull, strict=True)
    )


def push_then_pull(push: OnReply, pull: OnReply) -> OnReply:
    """The ``on_reply`` of a push and the pull that rides on it (:func:`pull_rides_on_push`).

    The pull is told the answer or the error. The push is told it was taken: an error goes
    to the pull alone, the next call on the keys, so that it is raised once, not again by
    the call after it.
    """

    def on_reply(message: Message | None, error: AKVError | None) -> None:
        push(message, None)
        pull(message, error)

    return on_reply


def settle_before_resend(op: int, arrays: Sequence[WireArray], pushed: set[Any]) -> list[WireArray]:
    """When a worker resends its requests on a new stream (a replay), the pull to send and
    wait for before this one: a pull of the keys this push names that the replay pushed
    already, or nothing. ``pushed`` (the keys pushed so far in the replay) is updated.

    A dist_sync round takes one push per worker. Resent in a burst, a worker's pushes of
    two rounds of one key would meet a round still open (the other workers resend too); a
    pull in between is answered once the earlier push's round is applied, as in the run
    that was cut, where a pull (or the round's end) came between them.
    """
    if op not in (Op.PUSH, Op.PUSHPULL):
        return []
    keys = [key for key, _, _ in arrays]
    again = [key for key in keys if key in pushed]
    pushed.difference_update(again)
    pushed.update(keys)
    dtypes = {key: array.dtype for key, array, _ in arrays}
    return [(key, np.empty(0, dtypes[key]), 0) for key in again]


class Request:
    """One request waiting for its reply, with what it sent (``arrays``, ``text``: to send
    it again after a reconnect; the arrays stay unchanged until the reply)."""

    __slots__ = (
        "arrays",
        "deadline",
        "destinations",
        "on_counted",
        "on_reply",
        "op",
        "sizes",
        "text",
    )

    def __init__(
        self,
        on_reply: OnReply,
        destinations: Sequence[Landing],
        op: int,
        deadline: float,
        arrays: Sequence[WireArray] = (),
        text: str = "",
        on_counted: Callable[[], None] | None = None,
    ) -> None:
        self.on_reply = on_reply
        #: Told of the interim answer that the request's push was counted (``COUNTED``).
        self.on_counted = on_counted
        self.destinations = destinations
        self.sizes = [(d.buffer if isinstance(d, InPlace) else d).nbytes for d in destinations]
        self.op = op
        self.deadline = deadline
        self.arrays = arrays
        self.text = text


class Outcome(NamedTuple):
    """Deliver ``message`` or ``error`` to ``request.on_reply``."""

    request: Request
    message: Message | None
    error: AKVError | None

    def deliver(self) -> None:
        """Tell the request's sender (exactly once per request)."""
        self.request.on_reply(self.message, self.error)


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

    def add(
        self,
        op: int,
        on_reply: OnReply,
        destinations: Sequence[Landing] | None,
        deadline: float,
        arrays: Sequence[WireArray] = (),
        text: str = "",
        on_counted: Callable[[], None] | None = None,
    ) -> int:
        """Remember a request about to be sent; return its sequence number.

        With ``destinations``, the reply's arrays must have exactly their sizes and are
        received straight into them. ``arrays`` and ``text`` are what it sends.
        ``on_counted``: the request asks to hear once its push is counted (see
        :meth:`counted`).
        """
        self._seq += 1
        self._pending[self._seq] = Request(
            on_reply, destinations or [], op, deadline, arrays, text, on_counted
        )
        return self._seq

    def counted(self, seq: int) -> None:
        """The interim answer that request ``seq``'s push was counted (it stays pending
        for its own answer); told to its ``on_counted``, if it waits for one."""
        request = self._pending.get(seq)
        if request is not None and request.on_counted is not None:
            request.on_counted()

    def unanswered(self) -> list[tuple[int, Request]]:
        """Every request still waiting for its reply, by sequence number (to send again
        on a new stream)."""
        return sorted(self._pending.items(), key=lambda item: item[0])

    def get(self, seq: int) -> Request | None:
        """Request ``seq`` while it waits for its reply (None otherwise)."""
        return self._pending.get(seq)

    def forget(self, seq: int) -> Request | None:
        """Drop request ``seq`` (it could not be sent)."""
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
        return Outcome(request, message, None)

    def sweep(self, now: float) -> list[Outcome]:
        """Fail the requests whose deadline is before ``now`` (one timer for all)."""
        late = [seq for seq, request in self._pending.items() if request.deadline < now]
        outcomes = []
        for seq in late:
            request = self._pending.pop(seq)
            error = ServerError(
                f"{self.server} did not answer a {op_label(request.op)} request in time "
                "(AKV_REQUEST_TIMEOUT_S)",
                server=self.server,
            )
            outcomes.append(Outcome(request, None, error))
        return outcomes

    def fail_all(self, error: AKVError) -> list[Outcome]:
        """Fail every outstanding request with ``error``."""
        pending, self._pending = self._pending, {}
        return [Outcome(request, None, error) for request in pending.values()]
