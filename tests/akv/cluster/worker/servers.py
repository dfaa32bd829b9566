"""A test helper that plays one or several servers against one :class:`WorkerState`, no
sockets.

The worker's calls are fed to the state as its backend would (a push's values staged in
buffers of the keys; a pull's outputs), and the instructions it returns are carried out at
once, synchronously: each request it sends is encoded with the real frame code and decoded
again into a :class:`Request` the test answers (:meth:`Servers.answer`,
:meth:`Servers.counted`, :meth:`Servers.durable`), whose reply frame is encoded, decoded and
landed where the state says (:meth:`WorkerState.destinations`), as the stream's reader
would. With ``shares_memory``, an answer that may stay in place is lent: a read-only view
of a server's arena, given back exactly once. Calls end once (:attr:`Servers.finished`),
staging is given back once (:attr:`Servers.unstaged`). After every event the state's
invariants are checked.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from akv.cluster.protocol import COUNTED, OK, Op, status_of
from akv.cluster.worker.events import (
    AcksWanted,
    Closing,
    ConnectFailed,
    Event,
    FrameArrived,
    JobFailed,
    PullIssued,
    PushIssued,
    RequestIssued,
    StreamCut,
    StreamOpened,
    Tick,
    TurnEnded,
    ValueRead,
)
from akv.cluster.worker.instructions import (
    Blame,
    CopyOut,
    Finish,
    GiveBack,
    GiveBuffer,
    Instruction,
    Reconnect,
    Send,
    SendHeldSoon,
    Unstage,
)
from akv.cluster.worker.state import WorkerState
from akv.errors import AKVError
from akv.keys import Entry, Part
from akv_engine import Var
from akv_transport import DISCARD, InPlace, Message, decode_frame, encode_frame, frame_bytes

WAITING = object()


@dataclass
class Request:
    """A request frame a server received: decoded, with its arrays as NumPy arrays."""

    server: int
    op: int
    seq: int
    flags: int
    keys: list[Any]
    arrays: list[np.ndarray]
    tags: list[int]
    text: str

    @property
    def counted(self) -> bool:
        """Whether it asks to hear that its push was counted."""
        return bool(self.flags & COUNTED)


@dataclass
class Stream:
    """The I/O side's handle of one stream, as the state sees it: what its peer lent, and
    what was given back (each region once)."""

    server: int
    number: int
    lent: set[int] = field(default_factory=set)
    given_back: list[int] = field(default_factory=list)

    def give_back(self, offsets: list[int]) -> None:
        for offset in offsets:
            assert offset in self.lent, f"region {offset} given back twice, or never lent"
            self.lent.discard(offset)
            self.given_back.append(offset)


class Call:
    """A store call's token: what ended it, once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ended: tuple[AKVError | None, Any] | Any = WAITING
        self.unstaged = 0
        self.copied = 0

    @property
    def done(self) -> bool:
        return self.ended is not WAITING

    @property
    def error(self) -> AKVError | None:
        assert self.done, f"{self.name} still waits"
        return self.ended[0]

    @property
    def reply(self) -> Any:
        assert self.done, f"{self.name} still waits"
        return self.ended[1]

    def __repr__(self) -> str:
        return f"<Call {self.name}>"


def f32(*values: float) -> np.ndarray:
    """A float32 array of ``values``."""
    return np.array(values, np.float32)


def zeros(size: int = 4) -> np.ndarray:
    """A float32 array of ``size`` zeros (a pull's output)."""
    return np.zeros(size, np.float32)


def key_entry(key: Any, shape: tuple[int, ...] = (4,), servers: tuple[int, ...] = (0,)) -> Entry:
    """A float32 key of ``shape`` held by ``servers`` (split in equal parts over several)."""
    size = int(np.prod(shape))
    step = size // len(servers)
    parts = tuple(
        Part(server, i * step, size if i == len(servers) - 1 else (i + 1) * step)
        for i, server in enumerate(servers)
    )
    return Entry(key, shape, np.dtype(np.float32), Var(None, 0, str(key)), parts)


class Servers:
    """``num_servers`` servers answering one worker's state (``restartable``: they write
    checkpoints; ``shares_memory``: the streams share memory). Other keyword arguments go
    to :class:`WorkerState`."""

    def __init__(
        self,
        num_servers: int = 1,
        *,
        restartable: bool = False,
        shares_memory: bool = False,
        request_s: float = 10.0,
        round_s: float = 5.0,
        **options: Any,
    ) -> None:
        names = [(f"server {i}", restartable) for i in range(num_servers)]
        self.state = WorkerState(names, request_s=request_s, round_s=round_s, **options)
        self.shares_memory = shares_memory
        self.now = 0.0
        #: Requests each server received, in order, not yet answered by the test.
        self.inbox: list[list[Request]] = [[] for _ in range(num_servers)]
        #: Every instruction carried out, in order.
        self.log: list[Instruction] = []
        self.turn_ends: list[int] = []
        self.reconnects: list[tuple[int, float]] = []
        self.blamed: list[Blame] = []
        self.given_buffers: list[tuple[Entry, Any]] = []
        self.streams: list[Stream] = []
        self._numbers = itertools.count()
        self._offsets = itertools.count(64, 64)
        self._arena: dict[int, bytes] = {}
        for server in range(num_servers):
            self.open(server)

    # ---------------------------------------------------------------- the worker's calls

    def feed(self, *events: Event) -> list[Instruction]:
        """Feed ``events`` to the state and carry out what it says; its invariants hold."""
        instructions = self.state.handle(*events)
        for instruction in instructions:
            self._carry_out(instruction)
        self.state.validate()
        return instructions

    def push(self, values: dict[Entry, np.ndarray], name: str = "push") -> Call:
        """The worker pushes ``values`` (staged in copies, as the backend does)."""
        call = Call(name)
        staged = [(entry, np.array(value, np.float32)) for entry, value in values.items()]
        self.feed(PushIssued(call, staged, self.now))
        return call

    def pull(self, outs: dict[Entry, Any], name: str = "pull") -> Call:
        """The worker pulls each key into its output (an array, or a list of arrays)."""
        call = Call(name)
        targets = [(entry, out if isinstance(out, list) else [out]) for entry, out in outs.items()]
        self.feed(PullIssued(call, targets, None, self.now))
        return call

    def pushpull(self, values: dict[Entry, np.ndarray], name: str = "pushpull") -> Call:
        """The worker pushes ``values`` and pulls them back into the same arrays."""
        call = Call(name)
        staged = [(entry, value.copy()) for entry, value in values.items()]
        targets = [(entry, [value]) for entry, value in values.items()]
        self.feed(PullIssued(call, targets, staged, self.now))
        return call

    def request(self, server: int, op: Op, text: str = "", name: str = "request") -> Call:
        call = Call(name)
        self.feed(RequestIssued(call, server, op, (), text, 10.0, self.now))
        return call

    def acks(self) -> Call:
        """Barrier or close waits for every pipelined push to be acknowledged."""
        call = Call("acks")
        self.feed(AcksWanted(call))
        return call

    def end_turn(self) -> None:
        """The loop turn ends: held pushes go."""
        ends, self.turn_ends = self.turn_ends, []
        for server in ends:
            self.feed(TurnEnded(server, self.now))

    def tick(self, now: float) -> None:
        self.now = now
        self.feed(Tick(now))

    def fail(self, error: AKVError) -> None:
        self.feed(JobFailed(error))

    def close(self) -> None:
        self.feed(Closing())

    def read_on_callers_thread(self, entry: Entry, out: np.ndarray) -> bool:
        """A blocking pull copies the value asked ahead out during the call (as the
        backend's ``_copy_arrived``); False when it is not there."""
        if not self.state.ahead.readable(entry):
            return False
        value = self.state.ahead.take(entry)
        assert value is not None
        np.copyto(out, value.value())
        if value.stale:
            self.feed(ValueRead(value))
        return True

    # ---------------------------------------------------------------- the streams

    def open(self, server: int) -> None:
        """A stream to ``server`` is open (again)."""
        stream = Stream(server, next(self._numbers))
        self.streams.append(stream)
        self.feed(StreamOpened(server, stream, self.shares_memory, self.now))

    def cut(self, server: int, error: BaseException | None = None) -> None:
        """The stream to ``server`` ends; what it had received unanswered is gone."""
        self.inbox[server].clear()
        self.feed(StreamCut(server, error, self.now))

    def connect_fails(self, server: int, error: BaseException, now: float | None = None) -> None:
        if now is not None:
            self.now = now
        self.feed(ConnectFailed(server, error, self.now))

    # ---------------------------------------------------------------- the servers' side

    def take(self, server: int = 0) -> Request:
        """The oldest request ``server`` received and nobody answered yet."""
        assert self.inbox[server], f"server {server} received nothing"
        return self.inbox[server].pop(0)

    def sent(self, server: int = 0) -> list[Request]:
        """What ``server`` received and nobody answered yet (still there)."""
        return list(self.inbox[server])

    def answer(
        self,
        request: Request,
        values: list[np.ndarray] | None = None,
        error: AKVError | None = None,
        lend: bool | None = None,
    ) -> None:
        """``request``'s server answers it: done, with ``values`` (a pull's), or ``error``.
        With ``lend`` (default: the streams share memory), values the state let stay in
        place are lent where they lie in the server's arena."""
        if error is not None:
            data = frame_bytes(Op.REPLY, request.seq, aux=status_of(error), text=str(error))
        else:
            pairs = zip(request.keys, values, strict=True) if values is not None else ()
            wire = [(key, np.ascontiguousarray(value), 0) for key, value in pairs]
            data = frame_bytes(Op.REPLY, request.seq, wire, aux=OK)
        self._arrive(request.server, data, self.shares_memory if lend is None else lend)

    def counted(self, request: Request) -> None:
        """``request``'s server says that it counted its push (the interim answer)."""
        self._arrive(request.server, frame_bytes(Op.REPLY, request.seq, flags=COUNTED), False)

    def durable(self, server: int, below: int, note: str = "") -> None:
        """``server``'s checkpoint holds every request numbered below ``below`` (``note``:
        the :class:`~akv.cluster.protocol.Note` it names that checkpoint by)."""
        self._arrive(server, frame_bytes(Op.DURABLE, 0, aux=below, text=note), False)

    def _arrive(self, server: int, data: bytes, lend: bool) -> None:
        header, payloads = decode_frame(data)
        destinations = self.state.destinations(server, header)
        assert len(destinations) == len(payloads)
        buffers: list[memoryview] = []
        borrowed: list[int] = []
        for payload, destination in zip(payloads, destinations, strict=True):
            if destination is DISCARD:
                buffers.append(memoryview(b""))
            elif destination is None:
                buffers.append(memoryview(bytearray(payload)))
            elif isinstance(destination, InPlace) and lend:
                offset = next(self._offsets)
                self._arena[offset] = bytes(payload)
                self._stream(server).lent.add(offset)
                buffers.append(memoryview(self._arena[offset]))  # read-only, where it lies
                borrowed.append(offset)
            else:
                target = destination.buffer if isinstance(destination, InPlace) else destination
                target[:] = payload
                buffers.append(target)
        self.feed(FrameArrived(server, Message(header, tuple(buffers), tuple(borrowed)), self.now))

    def _stream(self, server: int) -> Stream:
        return [s for s in self.streams if s.server == server][-1]

    # ---------------------------------------------------------------- carrying out

    def _carry_out(self, instruction: Instruction) -> None:
        self.log.append(instruction)
        if isinstance(instruction, Send):
            data = b"".join(
                encode_frame(
                    instruction.op,
                    instruction.seq,
                    instruction.arrays,
                    text=instruction.text,
                    flags=instruction.flags,
                )
            )
            header, payloads = decode_frame(data)
            arrays = [
                np.frombuffer(bytes(p), info.dtype).reshape(info.shape)
                for p, info in zip(payloads, header.arrays, strict=True)
            ]
            self.inbox[instruction.server].append(
                Request(
                    instruction.server,
                    header.op,
                    header.seq,
                    header.flags,
                    [info.key for info in header.arrays],
                    arrays,
                    [info.tag for info in header.arrays],
                    header.text,
                )
            )
        elif isinstance(instruction, Finish):
            call = instruction.call
            assert not call.done, f"{call} ended twice"
            call.ended = (instruction.error, instruction.reply)
        elif isinstance(instruction, Unstage):
            instruction.call.unstaged += 1
            assert instruction.call.unstaged == 1, f"{instruction.call} unstaged twice"
        elif isinstance(instruction, CopyOut):
            assert not instruction.call.done, "copied after it ended"
            instruction.call.copied += 1
            for out, source in instruction.copies:
                np.copyto(out, source)
        elif isinstance(instruction, GiveBuffer):
            spares = instruction.entry._spares
            assert not any(spare is instruction.buffer for spare in spares), "given back twice"
            self.given_buffers.append((instruction.entry, instruction.buffer))
            instruction.entry.give_buffer(instruction.buffer)
        elif isinstance(instruction, GiveBack):
            instruction.stream.give_back(instruction.offsets)
        elif isinstance(instruction, SendHeldSoon):
            self.turn_ends.append(instruction.server)
        elif isinstance(instruction, Reconnect):
            self.reconnects.append((instruction.server, instruction.delay_s))
        elif isinstance(instruction, Blame):
            self.blamed.append(instruction)
        else:  # pragma: no cover - a new instruction nobody taught this helper
            raise AssertionError(f"unknown instruction {instruction!r}")
