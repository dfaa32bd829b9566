"""What happens to a worker, as its state machine hears it: the events that
:meth:`WorkerState.handle <akv.cluster.worker.state.WorkerState.handle>` takes.

======================  ===============================================================
event                   when
======================  ===============================================================
:class:`PushIssued`     a push's turn came (after the earlier work on its keys)
:class:`PullIssued`     a pull's (or a pushpull's) turn came
:class:`RequestIssued`  a control request to one server (init, init check, optimizer,
                        states, goodbye, checkpoint)
:class:`AcksWanted`     barrier or close waits for every pipelined push to be
                        acknowledged
:class:`FrameArrived`   a reply, an interim ``COUNTED`` answer or a ``DURABLE`` note
                        arrived on a server's stream
:class:`TurnEnded`      the loop turn in which a push was held ended
:class:`StreamOpened`   a stream to a server is open (again)
:class:`StreamCut`      a stream to a server ended
:class:`ConnectFailed`  an attempt to open a cut stream again failed
:class:`ValueRead`      a pull copied out a value lent by the server's shared memory, on
                        the caller's thread
:class:`JobFailed`      the job failed (the scheduler's verdict, the worker's own code,
                        a lost scheduler)
:class:`Closing`        the store leaves: the streams' ends are no loss from now on
:class:`BarrierPassed`  the worker passed a barrier
:class:`Tick`           the clock, for the requests' deadlines
======================  ===============================================================

Plain records with ``__slots__`` (one per call or frame: they are on the hot path). A
``call`` is the I/O side's token for a store call, named again in the
:class:`~akv.cluster.worker.instructions.Finish` that ends it; ``now`` is the loop's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from akv.cluster.worker.requests import Landing, WireArray
from akv.errors import AKVError
from akv.keys import Entry, Staged
from akv_transport import Message

if TYPE_CHECKING:
    from akv.cluster.worker.pipeline import Ahead

__all__ = [
    "AcksWanted",
    "BarrierPassed",
    "Closing",
    "ConnectFailed",
    "Event",
    "FrameArrived",
    "JobFailed",
    "PullIssued",
    "PushIssued",
    "Record",
    "RequestIssued",
    "StreamCut",
    "StreamOpened",
    "Tick",
    "TurnEnded",
    "ValueRead",
]


class Record:
    """A plain record whose ``__repr__`` names its fields (events and instructions)."""

    __slots__ = ()

    def __repr__(self) -> str:
        names: tuple[str, ...] = getattr(type(self), "__slots__", ())
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({fields})"


class Event(Record):
    """The base of the events."""

    __slots__ = ()


class PushIssued(Event):
    """Push ``staged`` (each key's entry with the values to send, summed and staged) for
    ``call``: pipelined, or strictly (``AKV_STRICT_PUSH``)."""

    __slots__ = ("call", "now", "staged")

    def __init__(self, call: object, staged: Sequence[tuple[Entry, Staged]], now: float):
        self.call = call
        self.staged = staged
        self.now = now


class PullIssued(Event):
    """Pull each target key into its outputs (``targets``: the entry and its host arrays)
    for ``call``; with ``pushed``, a pushpull that pushes those values first."""

    __slots__ = ("call", "now", "pushed", "targets")

    def __init__(
        self,
        call: object,
        targets: Sequence[tuple[Entry, Sequence[Any]]],
        pushed: Sequence[tuple[Entry, Staged]] | None,
        now: float,
    ):
        self.call = call
        self.targets = targets
        self.pushed = pushed
        self.now = now


class RequestIssued(Event):
    """Send server ``server`` one request (``op``, ``arrays``, ``text``) for ``call``,
    answered within ``timeout_s``; the reply's arrays land in ``destinations`` (buffers of
    the sizes expected; none: a reply without arrays, or fresh buffers for ``save_states``)."""

    __slots__ = ("arrays", "call", "destinations", "now", "op", "server", "text", "timeout_s")

    def __init__(
        self,
        call: object,
        server: int,
        op: int,
        arrays: Sequence[WireArray],
        text: str,
        timeout_s: float,
        now: float,
        destinations: Sequence[Landing] = (),
    ):
        self.call = call
        self.server = server
        self.op = op
        self.arrays = arrays
        self.text = text
        self.timeout_s = timeout_s
        self.now = now
        self.destinations = destinations


class AcksWanted(Event):
    """``call`` ends once every pipelined push so far was acknowledged."""

    __slots__ = ("call",)

    def __init__(self, call: object):
        self.call = call


class FrameArrived(Event):
    """``message`` arrived on server ``server``'s stream."""

    __slots__ = ("message", "now", "server")

    def __init__(self, server: int, message: Message, now: float):
        self.server = server
        self.message = message
        self.now = now


class TurnEnded(Event):
    """The loop turn in which a push to ``server`` was held ended: send it."""

    __slots__ = ("now", "server")

    def __init__(self, server: int, now: float):
        self.server = server
        self.now = now


class StreamOpened(Event):
    """A stream to ``server`` is open (``stream``: the I/O side's handle, named again when
    a region of its peer's arena is given back; ``shares_memory``: it carries payloads
    through shared memory)."""

    __slots__ = ("now", "server", "shares_memory", "stream")

    def __init__(self, server: int, stream: object, shares_memory: bool, now: float):
        self.server = server
        self.stream = stream
        self.shares_memory = shares_memory
        self.now = now


class StreamCut(Event):
    """The stream to ``server`` ended (``error``: why, when known)."""

    __slots__ = ("error", "now", "server")

    def __init__(self, server: int, error: BaseException | None, now: float):
        self.server = server
        self.error = error
        self.now = now


class ConnectFailed(Event):
    """An attempt to open the stream to ``server`` again failed with ``error`` (asking the
    scheduler where it is, or connecting)."""

    __slots__ = ("error", "now", "server")

    def __init__(self, server: int, error: BaseException, now: float):
        self.server = server
        self.error = error
        self.now = now


class ValueRead(Event):
    """A pull copied ``ahead``'s value, lent by the server's shared memory, out on the
    caller's thread (see :meth:`~akv.cluster.worker.state.WorkerState.take_arrived`)."""

    __slots__ = ("ahead",)

    def __init__(self, ahead: Ahead):
        self.ahead = ahead


class JobFailed(Event):
    """The job failed with ``error``: every waiting call and every later one fails."""

    __slots__ = ("error",)

    def __init__(self, error: AKVError):
        self.error = error


class Closing(Event):
    """The store leaves: held pushes go now, and a stream's end is no loss any more."""

    __slots__ = ()


class BarrierPassed(Event):
    """The worker passed a barrier (a ``dist_async`` replay keeps it: see
    :class:`~akv.cluster.worker.reconnect.Barriers`)."""

    __slots__ = ()


class Tick(Event):
    """The clock: fail the requests whose deadline passed."""

    __slots__ = ("now",)

    def __init__(self, now: float):
        self.now = now
