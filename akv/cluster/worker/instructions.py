"""What a worker's state machine tells its I/O side to do: the instructions that
:meth:`WorkerState.handle <akv.cluster.worker.state.WorkerState.handle>` returns, carried
out in order.

======================  ===============================================================
instruction             what the I/O side does
======================  ===============================================================
:class:`Send`           encodes a request frame and writes it to a server's stream
:class:`CopyOut`        copies a pull's values into its other outputs
:class:`Finish`         ends a call: completes the engine task (or future) waiting on
                        it, or fails it
:class:`Unstage`        gives a push's staging buffers back (every request that carried
                        them was answered)
:class:`GiveBuffer`     gives a buffer back to its key for reuse
:class:`GiveBack`       gives a region of a server's shared arena back (a value it lent)
:class:`SendHeldSoon`   feeds :class:`~akv.cluster.worker.events.TurnEnded` at the end of
                        this loop turn
:class:`Reconnect`      after a delay, asks the scheduler where a server is and opens a
                        stream to it; feeds ``StreamOpened`` or ``ConnectFailed``
:class:`Blame`          asks the scheduler who failed first, then feeds ``JobFailed``
======================  ===============================================================

Plain records with ``__slots__`` (created per request and per call). A ``call`` is the I/O
side's token for a store call (and ``stream`` its handle of a stream), which the state
never looks inside: the I/O side knows what it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from akv.cluster.protocol import op_label
from akv.cluster.worker.events import Record
from akv.cluster.worker.requests import WireArray
from akv.errors import AKVError
from akv.keys import Entry

__all__ = [
    "Blame",
    "CopyOut",
    "Finish",
    "GiveBack",
    "GiveBuffer",
    "Instruction",
    "Reconnect",
    "Send",
    "SendHeldSoon",
    "Unstage",
]


class Instruction(Record):
    """The base of the instructions."""

    __slots__ = ()


class Send(Instruction):
    """Write request ``seq`` to server ``server``: a frame of ``op``, ``arrays`` (not
    copied: they stay unchanged until the answer), ``text`` and ``flags``."""

    __slots__ = ("arrays", "flags", "op", "seq", "server", "text")

    def __init__(
        self, server: int, op: int, seq: int, arrays: Sequence[WireArray], text: str, flags: int
    ):
        self.server = server
        self.op = op
        self.seq = seq
        self.arrays = arrays
        self.text = text
        self.flags = flags

    def __repr__(self) -> str:
        return f"Send(server={self.server}, {op_label(self.op)}, seq={self.seq})"


class CopyOut(Instruction):
    """Copy each ``(output, source)`` pair of a pull's ``call``: a key's value, landed in
    one place (or asked ahead), into every other output of the key."""

    __slots__ = ("call", "copies")

    def __init__(self, call: Any, copies: list[tuple[Any, Any]]):
        self.call = call
        self.copies = copies


class Finish(Instruction):
    """End ``call``: fail it with ``error``, or complete it (a control request with its
    ``reply``)."""

    __slots__ = ("call", "error", "reply")

    def __init__(self, call: Any, error: AKVError | None, reply: Any = None):
        self.call = call
        self.error = error
        self.reply = reply


class Unstage(Instruction):
    """``call``'s staging buffers are free: every request that carried them was answered
    (or failed), so none is sent again."""

    __slots__ = ("call",)

    def __init__(self, call: Any):
        self.call = call


class GiveBuffer(Instruction):
    """Give ``buffer`` (taken with ``entry.take_buffer()``) back to its key."""

    __slots__ = ("buffer", "entry")

    def __init__(self, entry: Entry, buffer: Any):
        self.entry = entry
        self.buffer = buffer


class GiveBack(Instruction):
    """Give the regions at ``offsets`` of ``stream``'s peer arena (values the server lent)
    back to the server (nothing, when that stream has ended: the arena went with it)."""

    __slots__ = ("offsets", "stream")

    def __init__(self, stream: Any, offsets: list[int]):
        self.stream = stream
        self.offsets = offsets


class SendHeldSoon(Instruction):
    """Feed ``TurnEnded(server)`` at the end of this loop turn: a push to ``server`` is held
    until then (a pull of its keys made meanwhile rides on it)."""

    __slots__ = ("server",)

    def __init__(self, server: int):
        self.server = server


class Reconnect(Instruction):
    """In ``delay_s`` seconds, ask the scheduler where server ``server`` is and open a
    stream to it; then feed ``StreamOpened``, or ``ConnectFailed`` with the error."""

    __slots__ = ("delay_s", "server")

    def __init__(self, server: int, delay_s: float):
        self.server = server
        self.delay_s = delay_s


class Blame(Instruction):
    """Server ``server`` cut its stream (``cut``) or refused a request with ``error``: ask
    the scheduler who failed first (the server may only pass the news on), then feed
    ``JobFailed`` naming that process, or ``error`` when the scheduler knows nothing."""

    __slots__ = ("cut", "error", "server")

    def __init__(self, server: int, error: AKVError, cut: bool):
        self.server = server
        self.error = error
        self.cut = cut
