"""What a worker's state keeps of its calls in flight: the answers a call waits for, its
pipelined pushes until acknowledged and the errors they leave for later calls, and the
values asked for ahead with a push.

Plain records, no I/O: :class:`~akv.cluster.worker.state.WorkerState` changes them as the
events come and reads them to decide. A *call* is a store call of the worker's program (a
push, a pull, an init, ...); the state never looks inside its ``token``, which the I/O side
gave it to be named in the :class:`~akv.cluster.worker.instructions.Finish` that ends it.

- :class:`Gather`: a call that waits for every answer to its requests (a strict push, a
  pull, a pushpull, a control request), and what it copies out once they are in.
- :class:`Pipelined`: a pipelined push. It is *acknowledged* on a server when the server
  says that it counted it (the interim ``COUNTED`` answer) or answers it; ``barrier`` and
  ``close`` wait for every push to be acknowledged. Its staging buffers go back once every
  server *answered* (a request may be resent until then).
- :class:`LateErrors`: the error of a pipelined push that failed, kept for the next call on
  one of its keys (and barrier and close), which raises it once.
- :class:`Ahead`: in dist_sync, a key's value after the round of the worker's latest push,
  asked for with the push (a pushpull flagged ``COUNTED``): the pulls of the key until its
  next push read it without a request. :class:`AheadCache` holds them by key, and says
  when each is valid and when its memory goes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from akv.args import Key
from akv.cluster.worker.instructions import GiveBack, GiveBuffer, Instruction
from akv.errors import AKVError, ServerError
from akv.keys import Entry
from akv_transport import Message

__all__ = [
    "CHECKPOINT",
    "CONTROL",
    "PULL",
    "PUSH",
    "SETTLE",
    "Ahead",
    "AheadCache",
    "Gather",
    "LateErrors",
    "Pipelined",
    "late_error",
]

#: What a :class:`Gather` is for: a store's pull (or pushpull), strict push or control
#: request; the checkpoint the worker asks for past ``AKV_RETAIN_BYTES``; the pull that a
#: replay waits for between two pushes of a key.
PULL, PUSH, CONTROL, CHECKPOINT, SETTLE = range(5)


class Gather:
    """A call waiting for the answers of its requests (``remaining``: those not in yet,
    values asked ahead included), and what it reports: the first ``error``, else a
    control request's ``reply``.

    ``staged``: it sent staging buffers (a strict push, a pushpull), which go back once
    every answer is in. A pull's ``copies`` are the ``(output, source)`` pairs to copy once
    its answers landed (a key's answer lands in one place: its first output when that can
    take it, else one of the key's ``buffers``, given back afterwards); ``aheads``: the
    ``(outputs, value)`` pairs read from values asked ahead, which count this call among
    their ``readers`` until it is done. ``kind`` is :data:`PULL`, :data:`PUSH` or
    :data:`CONTROL` for a store call (``token``), or the worker's own request
    (:data:`CHECKPOINT` to ``server``, :data:`SETTLE` of ``replay``).
    """

    __slots__ = (
        "aheads",
        "buffers",
        "copies",
        "error",
        "keys",
        "kind",
        "remaining",
        "replay",
        "reply",
        "server",
        "staged",
        "token",
    )

    def __init__(self, token: object, kind: int, server: int = -1) -> None:
        self.token = token
        self.kind = kind
        self.server = server
        self.remaining = 0
        self.error: AKVError | None = None
        self.staged = False
        self.reply: Message | None = None
        self.copies: list[tuple[Any, Any]] = []
        self.buffers: list[tuple[Entry, Any]] = []
        self.aheads: list[tuple[Sequence[Any], Ahead]] = []
        self.replay: object = None
        #: The keys a :data:`SETTLE` pull asks for.
        self.keys: Sequence[Any] = ()

    def __repr__(self) -> str:
        return f"<Gather {self.token!r} remaining={self.remaining} error={self.error!r}>"


class Pipelined:
    """A pipelined push of ``keys`` (its call: ``token``): ``unacked`` servers have not
    acknowledged it yet, ``unanswered`` have not answered; ``waits``: its call is done only
    once it is acknowledged (past :data:`~akv.limits.MAX_UNACKED_PUSHES`).

    ``ack_error`` and ``answer_error`` are the first error of each kind; ``late`` is the
    error kept for the keys (see :class:`LateErrors`), ``told`` when a pull raised it
    instead. ``aheads``: the values asked for with it (one per key), or None.
    """

    __slots__ = (
        "ack_error",
        "aheads",
        "answer_error",
        "keys",
        "late",
        "token",
        "told",
        "unacked",
        "unanswered",
        "waits",
    )

    def __init__(self, token: object, keys: list[Key], servers: int, waits: bool) -> None:
        self.token = token
        self.keys = keys
        self.unacked = servers
        self.unanswered = servers
        self.waits = waits
        self.ack_error: AKVError | None = None
        self.answer_error: AKVError | None = None
        self.late: AKVError | None = None
        self.told = False
        self.aheads: list[Ahead] | None = None

    def __repr__(self) -> str:
        return f"<Pipelined {self.keys!r} unacked={self.unacked} unanswered={self.unanswered}>"


class Ahead:
    """A key's value after the round of one of this worker's pushes (the key's
    ``pushes``-th), asked for with it.

    Once ``arrived``, ``error`` is what the request failed with, else :meth:`value` is the
    value: in ``buffer`` (a buffer of the key), or ``lent`` where it lies in the server's
    shared memory (region ``offset`` of that ``stream``'s peer arena) until given back.
    ``stale``: forgotten by the key (a later push, a failure, a read of lent memory);
    ``readers``: pulls reading it now; ``waiters``: pulls waiting for it to arrive. Its
    memory goes back (``released``) once it is stale, arrived and unread.
    """

    __slots__ = (
        "arrived",
        "buffer",
        "entry",
        "error",
        "lent",
        "offset",
        "pushes",
        "readers",
        "released",
        "stale",
        "stream",
        "waiters",
    )

    def __init__(self, entry: Entry, buffer: np.ndarray) -> None:
        self.entry = entry
        self.buffer = buffer
        self.pushes = entry.pushes
        self.arrived = False
        self.error: AKVError | None = None
        self.lent: np.ndarray | None = None
        self.stream: object = None
        self.offset = -1
        self.stale = False
        self.readers = 0
        self.released = False
        self.waiters: list[Gather] = []

    def lend(self, view: memoryview, stream: object, offset: int) -> None:
        """The value arrived where it lies in the server's shared memory (read-only
        ``view``, region ``offset`` of ``stream``'s peer arena)."""
        entry = self.entry
        self.lent = np.frombuffer(view, entry.dtype).reshape(entry.shape)
        self.stream = stream
        self.offset = offset

    def value(self) -> np.ndarray:
        """The value (once arrived without an error)."""
        return self.buffer if self.lent is None else self.lent

    def readable(self, entry: Entry) -> bool:
        """Whether it is ``entry``'s value after its latest push, arrived without an error,
        and nobody else reads it now (so a pull may copy it out at once)."""
        return (
            self.arrived
            and self.error is None
            and self.pushes == entry.pushes
            and not self.stale
            and not self.readers
        )

    def __repr__(self) -> str:
        state = "arrived" if self.arrived else "waiting"
        return f"<Ahead {self.entry.key!r} push {self.pushes} {state} readers={self.readers}>"


class AheadCache:
    """Each key's value asked ahead with its latest push (when that push asked), and when
    each value's memory goes back (:class:`~akv.cluster.worker.instructions.GiveBuffer`,
    and :class:`~akv.cluster.worker.instructions.GiveBack` for memory the server lent):
    once it is stale (forgotten by its key), arrived and unread.

    A blocking store's pull copies an arrived value out on the caller's thread
    (:meth:`readable`, then :meth:`take` while it holds the key's var: nothing on the loop
    touches that key's value meanwhile); both are one dict operation on one key.
    """

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[Key, Ahead] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self.values

    def get(self, key: Key) -> Ahead | None:
        """The key's value asked ahead with its latest push, or None."""
        return self.values.get(key)

    def ask(self, entry: Entry) -> Ahead:
        """A value of ``entry`` asked for with its latest push (the key's earlier one was
        dropped), landing in a buffer of the key."""
        value = Ahead(entry, entry.take_buffer())
        self.values[entry.key] = value
        return value

    def drop(self, key: Key, value: Ahead | None, out: list[Instruction]) -> None:
        """Forget the key's value (``value``: that one, whether it is still the key's or
        not); what holds it goes back once it arrived and no pull reads it."""
        values = self.values
        current = values.get(key)
        if value is None:
            value = current
        if value is None:
            return
        if current is value:
            del values[key]
        value.stale = True
        self.release_when_unread(value, out)

    def release_when_unread(self, value: Ahead, out: list[Instruction]) -> None:
        """Give ``value``'s memory back if it is stale, arrived and unread (once)."""
        if value.released or not (value.stale and value.arrived) or value.readers:
            return
        value.released = True
        out.append(GiveBuffer(value.entry, value.buffer))
        if value.stream is not None:
            out.append(GiveBack(value.stream, [value.offset]))
        value.lent = None

    def readable(self, entry: Entry) -> bool:
        """Whether ``entry``'s value arrived and may be copied out now (any thread)."""
        value = self.values.get(entry.key)
        return value is not None and value.readable(entry)

    def take(self, entry: Entry) -> Ahead | None:
        """``entry``'s value for a pull to copy out on the calling thread while it holds the
        key's var; None when it is not there after all. A value lent by the server's shared
        memory is read once: it is forgotten now, and the caller feeds
        :class:`~akv.cluster.worker.events.ValueRead` once it copied it (its memory goes
        back then)."""
        value = self.values.get(entry.key)
        if value is None or not value.readable(entry):
            return None
        if value.lent is not None:
            self.values.pop(entry.key, None)
            value.stale = True
        return value

    @staticmethod
    def lend(
        lendable: Sequence[Ahead | None],
        views: Sequence[memoryview],
        borrowed: Sequence[int],
        stream: object,
    ) -> None:
        """A pushpull's answer asked for ahead: the values that lie in the server's shared
        memory (read-only views, at the ``borrowed`` regions of ``stream``'s peer arena, in
        order) stay there for their pulls, each given back on its own."""
        offsets = iter(borrowed)
        for value, view in zip(lendable, views, strict=True):
            if view.readonly and value is not None:
                value.lend(view, stream, next(offsets))


class LateErrors:
    """The errors of failed pipelined pushes, by key, until a call reports them.

    The caller's thread reads and forgets them (a call raises before anything is
    scheduled) while the loop's thread keeps new ones: every operation is one dict
    operation, or works on a snapshot (atomic under the GIL).
    """

    def __init__(self) -> None:
        #: The errors kept, by key (empty: nothing to raise; a caller may look first).
        self.by_key: dict[Key, AKVError] = {}

    def keep(self, keys: Sequence[Key], error: AKVError) -> None:
        """Keep ``error`` for each of ``keys`` that has none kept yet."""
        for key in keys:
            self.by_key.setdefault(key, error)

    def take(self, keys: Sequence[Key]) -> AKVError | None:
        """The error kept for one of ``keys`` (the first found), forgotten for every key it
        was kept for: it is raised once."""
        if not self.by_key:
            return None
        for key in keys:
            error = self.by_key.get(key)
            if error is not None:
                self.forget(error)
                return error
        return None

    def take_any(self) -> AKVError | None:
        """The first error kept for any key (then forgotten), or None."""
        errors = list(self.by_key.values())
        if not errors:
            return None
        self.forget(errors[0])
        return errors[0]

    def forget(self, error: AKVError) -> None:
        """Forget ``error`` for every key it was kept for."""
        for key, kept in list(self.by_key.items()):
            if kept is error:
                self.by_key.pop(key, None)


def late_error(error: AKVError, keys: Sequence[Key]) -> AKVError:
    """The error a later call raises for a pipelined push of ``keys`` that failed: the
    same class, naming the push (the server's error is its cause)."""
    named = ", ".join(repr(key) for key in keys[:8]) + (", ..." if len(keys) > 8 else "")
    text = f"an earlier push of key {named} failed: {error}"
    cls: Any = type(error)
    late: AKVError
    try:
        late = cls(text)
    except TypeError:
        late = ServerError(text)
    late.__cause__ = error
    return late
