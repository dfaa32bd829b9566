"""A worker's decisions about its requests to the servers, as a state machine without I/O.

:class:`WorkerState` takes events (:mod:`akv.cluster.worker.events`) and returns
instructions (:mod:`akv.cluster.worker.instructions`), as the server's
:class:`~akv.cluster.server.state.ServerState` and Dask's ``WorkerState.handle_stimulus``
do. The worker's backend (:mod:`akv.cluster.worker.backend`) feeds it the store's calls as
their turn comes, what arrives on the streams and the clock, and carries out what it
returns: writing frames, completing engine tasks, giving buffers back, opening streams.

It owns, per server (:class:`~akv.cluster.worker.reconnect.Link`), the request table,
the push held until the end of the loop turn (a pull of its keys rides on it as one
pushpull), the copies kept until the server's checkpoint holds them, and the stream's life
(cut, opened again with backoff, its requests resent in order); and across servers the
pipelined pushes until acknowledged and the errors they leave for later calls
(:mod:`akv.cluster.worker.pipeline`), the values asked for ahead with pushes, and the
job's failure. :meth:`WorkerState.validate` checks its invariants.

Everything runs on the loop's thread, but for the reads a blocking store makes on the
calling thread, before it schedules anything: :meth:`WorkerState.take_late` (the error of
an earlier push, raised by the call), and :attr:`WorkerState.ahead`'s ``readable`` and
``take`` (a value asked ahead, copied out during the call while the key's var is held).
Each is a dict operation on one key, atomic under the GIL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from akv.args import Key
from akv.arrays import is_gpu
from akv.cluster.protocol import COUNTED, Op, op_label
from akv.cluster.worker import invariants
from akv.cluster.worker.events import (
    AcksWanted,
    BarrierPassed,
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
    GiveBuffer,
    Instruction,
    Reconnect,
    Send,
    SendHeldSoon,
    Unstage,
)
from akv.cluster.worker.pipeline import (
    CHECKPOINT,
    CONTROL,
    PULL,
    PUSH,
    SETTLE,
    Ahead,
    AheadCache,
    Gather,
    LateErrors,
    Pipelined,
    late_error,
)
from akv.cluster.worker.reconnect import Link
from akv.cluster.worker.requests import (
    Landing,
    Request,
    WireArray,
    frame_problem,
    pull_rides_on_push,
    push_batches,
    push_view,
)
from akv.compression import Compression
from akv.errors import AKVError, InvalidArgumentError, PeerLostError, ServerError
from akv.keys import Entry, Staged
from akv.limits import AHEAD_COPY_MAX_BYTES, MAX_UNACKED_PUSHES, RETAIN_BYTES
from akv_transport import DTYPE_CODES, Destination, FrameHeader, InPlace, Message, byte_view

__all__ = ["WorkerState"]

#: What a pull sends of a key: no values (one empty array per dtype, shared: it has no bytes
#: to change).
_NO_VALUES = {dtype: np.empty(0, dtype) for dtype in DTYPE_CODES}
# Looked up once: an enum member lookup is not free, and every call and frame asks.
_PUSH, _PULL, _PUSHPULL = Op.PUSH, Op.PULL, Op.PUSHPULL
_DURABLE, _CHECKPOINT = Op.DURABLE, Op.CHECKPOINT


class WorkerState:
    """Everything a worker decides about its requests (see the module docstring).

    Parameters
    ----------
    servers:
        Each server's name as messages give it (``"server 0 at host:port"``) and whether
        it writes checkpoints (then acknowledged changes are kept until it says a
        checkpoint holds them, and a restart of it may take its stream over).
    strict_push:
        A push is done only once every server answered it (``AKV_STRICT_PUSH``); by
        default pushes are pipelined.
    pull_ahead:
        A pipelined push asks for the value after its round too, for the key's next pulls
        (dist_sync, ``AKV_PULL_AHEAD``).
    request_s, round_s:
        A request's deadline, and how much longer one waiting for a round may take.
    retain_bytes:
        Past this many bytes kept for one server, ask it for a checkpoint.
    ordered_replays:
        Replays to a restarted server keep the barriers between the requests
        (``dist_async``: :class:`~akv.cluster.worker.reconnect.Barriers`).
    """

    def __init__(
        self,
        servers: Sequence[tuple[str, bool]],
        *,
        strict_push: bool = False,
        pull_ahead: bool = False,
        request_s: float,
        round_s: float = 0.0,
        retain_bytes: int = RETAIN_BYTES,
        ordered_replays: bool = False,
    ) -> None:
        self.links = [Link(name, r, ordered_replays and r) for name, r in servers]
        self.strict_push = strict_push
        self.pull_ahead = pull_ahead
        self.request_s = request_s
        self.round_s = round_s
        self.retain_bytes = retain_bytes
        #: The job's failure: every waiting call and every later one fails with it.
        self.failure: AKVError | None = None
        #: Pipelined pushes not acknowledged yet, and the calls waiting for none to be left.
        self.unacked = 0
        self._acks_waiters: list[object] = []
        #: The errors of failed pipelined pushes, until a call on their keys raises them.
        self.late = LateErrors()
        #: Each key's value asked ahead with its latest push (when that push asked).
        self.ahead = AheadCache()
        #: Gradient compression of pushes (staged values are then compressed bytes, see
        #: :func:`~akv.cluster.worker.requests.compress_parts`), and a push frame's text.
        self.compression: Compression | None = None
        self._push_text = ""
        #: The clock at the latest event that told it (deadlines of the state's own
        #: requests).
        self._now = 0.0
        self._handlers: dict[type[Event], Callable[[Any], list[Instruction]]] = {
            PushIssued: self._push,
            PullIssued: self._pull,
            FrameArrived: self._frame,
            TurnEnded: self._turn_ended,
            RequestIssued: self._request,
            AcksWanted: self._acks_wanted,
            ValueRead: self._value_read,
            Tick: self._tick,
            StreamOpened: self._opened,
            StreamCut: self._cut,
            ConnectFailed: self._connect_failed,
            JobFailed: self._job_failed,
            Closing: self._closing,
            BarrierPassed: self._barrier_passed,
        }

    def compress(self, compression: Compression) -> None:
        """Send every later push compressed (its staged values are compressed bytes)."""
        self.compression = compression
        self._push_text = compression.wire

    def handle(self, *events: Event) -> list[Instruction]:
        """Take ``events`` in order; return what to do, in order."""
        if len(events) == 1:
            event = events[0]
            return self._handlers[type(event)](event)
        out: list[Instruction] = []
        for event in events:
            out.extend(self._handlers[type(event)](event))
        return out

    # ------------------------------------------------------------ queries

    def destinations(self, server: int, header: FrameHeader) -> Sequence[Destination]:
        """Where the arrays of a reply from ``server`` land (see
        :meth:`~akv.cluster.worker.requests.RequestTable.destinations`)."""
        return self.links[server].table.destinations(header)

    def take_late(self, keys: Sequence[Key]) -> AKVError | None:
        """The error of an earlier pipelined push of one of ``keys``, which the call about
        to be made raises instead (once); any thread."""
        return self.late.take(keys)

    def take_any_late(self) -> AKVError | None:
        """The first error of a pipelined push nobody was told yet (barrier, close)."""
        return self.late.take_any()

    # ------------------------------------------------------------ events: calls

    def _push(self, event: PushIssued) -> list[Instruction]:
        """A push: numbered per key, then sent strictly, pipelined and held until the end
        of the loop turn, or pipelined asking for the value after its round."""
        self._now = now = event.now
        staged = event.staged
        out: list[Instruction] = []
        asked = self.ahead.values
        for entry, _ in staged:
            entry.pushes += 1  # in call order: pushes of a key run one after another
            if asked and entry.key in asked:
                self.ahead.drop(entry.key, None, out)
        if self.strict_push:
            call = Gather(event.call, PUSH)
            call.staged = True
            batches = push_batches(staged, self.compression)
            call.remaining = len(batches)
            deadline = now + self.request_s
            for server, arrays in batches.items():
                request = Request(_PUSH, arrays, deadline, call, text=self._push_text)
                self._send(server, request, out)
            if not batches:
                self._finish(call, out)
            return out
        waits = self.unacked >= MAX_UNACKED_PUSHES  # then it waits: memory stays bounded
        self.unacked += 1
        keys = [entry.key for entry, _ in staged]
        worth = self.pull_ahead
        for entry, _ in staged:
            worth = worth and self._worth_asking_ahead(entry)
        if worth:
            push = self._push_ahead(event.call, staged, keys, waits, now, out)
        else:
            batches = push_batches(staged, self.compression)
            push = Pipelined(event.call, keys, len(batches), waits)
            deadline = now + self.request_s
            text = self._push_text
            for server, arrays in batches.items():
                request = Request(_PUSH, arrays, deadline, text=text, push=push)
                self._send(server, request, out, hold=True)
        if not push.unanswered and not push.unacked:  # a push of no key
            self._push_answered(push, out)
            self._acknowledged(push, out)
        if not waits:
            out.append(Finish(event.call, None))
        return out

    def _push_ahead(
        self,
        token: object,
        staged: Sequence[tuple[Entry, Staged]],
        keys: list[Key],
        waits: bool,
        now: float,
        out: list[Instruction],
    ) -> Pipelined:
        """Send a pipelined dist_sync push as a pushpull whose answer (the value after the
        round) is kept for the pulls of each key until its next push: in a buffer of the
        key, or where it lies in the server's shared memory (a single-part key on a stream
        that shares memory: read from there once, then given back).

        Each server says at once that it counted the push (``COUNTED``): that is the push's
        acknowledgement. The answer waits for the round (the other workers' pushes), which
        a server fails after ``AKV_ROUND_TIMEOUT_S``: the request's deadline is that much
        longer than ``AKV_REQUEST_TIMEOUT_S``.
        """
        aheads = []
        batches: dict[int, tuple[list[WireArray], list[memoryview], list[Ahead | None]]] = {}
        for entry, array in staged:
            value = self.ahead.ask(entry)
            aheads.append(value)
            single = len(entry.parts) == 1
            for part in entry.parts:
                batch = batches.get(part.server)
                if batch is None:
                    batch = batches[part.server] = ([], [], [])
                sent = push_view(entry, array, part, self.compression)
                batch[0].append((entry.key, sent, entry.pushes))
                batch[1].append(byte_view(entry.wire_view(value.buffer, part)))
                batch[2].append(value if single else None)
        push = Pipelined(token, keys, len(batches), waits)
        push.aheads = aheads
        deadline = now + self.request_s + self.round_s
        for server, (arrays, views, lendable) in batches.items():
            destinations: list[Landing] = list(views)
            lend: list[Ahead | None] | None = None
            if self.links[server].shares_memory:
                destinations = [
                    InPlace(view) if value is not None else view
                    for view, value in zip(views, lendable, strict=True)
                ]
                lend = lendable
            request = Request(
                _PUSHPULL, arrays, deadline, None, destinations, self._push_text, push, lend
            )
            self._send(server, request, out)
        return push

    def _worth_asking_ahead(self, entry: Entry) -> bool:
        """Whether a push of ``entry`` asks for the value after its round (see
        :data:`~akv.limits.AHEAD_COPY_MAX_BYTES`)."""
        return entry.nbytes <= AHEAD_COPY_MAX_BYTES or (
            len(entry.parts) == 1 and self.links[entry.parts[0].server].shares_memory
        )

    def _pull(self, event: PullIssued) -> list[Instruction]:
        """A pull (or a pushpull, with ``pushed``): each key's value after the round of
        this worker's last push, from the value asked ahead with that push when there is
        one, else asked of its servers, received straight into the first output when that
        can take it (else a buffer of the key)."""
        self._now = now = event.now
        out: list[Instruction] = []
        call = Gather(event.call, PULL)
        pushed = event.pushed
        asked = self.ahead.values
        values: dict[int, Staged] = {}
        if pushed is not None:
            call.staged = True
            for entry, array in pushed:
                entry.pushes += 1
                values[id(entry)] = array
                if asked and entry.key in asked:
                    self.ahead.drop(entry.key, None, out)
        batches: dict[int, tuple[list[WireArray], list[Landing]]] = {}
        waiting = 0
        for entry, outs in event.targets:
            if asked and pushed is None:
                value = asked.get(entry.key)
                if value is not None:  # asked with the key's latest push: no request
                    value.readers += 1
                    call.aheads.append((outs, value))
                    if not value.arrived:
                        value.waiters.append(call)
                        waiting += 1
                    continue
            first = outs[0]
            if (type(first) is np.ndarray or not is_gpu(first)) and first.flags.c_contiguous:
                receive = first
            else:
                receive = entry.take_buffer()
                call.buffers.append((entry, receive))
            for output in outs:
                if output is not receive:
                    call.copies.append((output, receive))
            for part in entry.parts:
                batch = batches.get(part.server)
                if batch is None:
                    batch = batches[part.server] = ([], [])
                if pushed is None:
                    batch[0].append((entry.key, _NO_VALUES[entry.dtype], 0))
                else:
                    sent = push_view(entry, values[id(entry)], part, self.compression)
                    batch[0].append((entry.key, sent, entry.pushes))
                batch[1].append(byte_view(entry.wire_view(receive, part)))
        call.remaining = waiting + len(batches)
        if not call.remaining:
            self._finish(call, out)
            return out
        op = _PULL if pushed is None else _PUSHPULL
        text = "" if pushed is None else self._push_text
        deadline = now + self.request_s
        for server, (arrays, views) in batches.items():
            self._send(server, Request(op, arrays, deadline, call, views, text), out)
        return out

    def _request(self, event: RequestIssued) -> list[Instruction]:
        """A control request to one server; its call gets the reply."""
        self._now = event.now
        call = Gather(event.call, CONTROL)
        call.remaining = 1
        deadline = event.now + event.timeout_s
        out: list[Instruction] = []
        request = Request(
            event.op, event.arrays, deadline, call, event.destinations, text=event.text
        )
        self._send(event.server, request, out)
        return out

    def _acks_wanted(self, event: AcksWanted) -> list[Instruction]:
        if not self.unacked:
            return [Finish(event.call, None)]
        self._acks_waiters.append(event.call)
        return []

    def _send(
        self, server: int, request: Request, out: list[Instruction], hold: bool = False
    ) -> None:
        """Send ``request`` to ``server`` now, or keep it: ``hold`` (a pipelined push)
        until the end of the turn or the next request, whichever comes first (a pull of
        the same keys then goes with it as one pushpull, whose answer tells both: an error
        only the pull); while the stream is cut, until it is open again and the requests
        before it were resent."""
        if self.failure is not None:  # the job failed: nothing is sent any more
            self._deliver(server, request, None, None, self.failure, out)
            return
        link = self.links[server]
        problem = frame_problem(request.arrays, request.text)
        if problem is not None:
            what = f"{link.name}: {op_label(request.op)}: {problem}"
            self._deliver(server, request, None, None, InvalidArgumentError(what), out)
            return
        held = link.held_push
        if held is not None:
            link.held_push = None
            if request.op == _PULL and pull_rides_on_push(held.arrays, request.arrays):
                held.ride(_PUSHPULL, request.destinations, request.call)
                request = held
            else:
                self._send(server, held, out)
        if hold:
            link.held_push = request
            out.append(SendHeldSoon(server))
            return
        if (link.lost is not None or link.replay is not None) and not link.closing:
            # Cut: kept, and sent once the stream is open again and the requests before it
            # were resent (or failed by the verdict, or when the deadline passes).
            link.table.add(request)
            if link.replay is not None and link.lost is None:
                link.replay.deferred.append(request.seq)
            return
        if link.lost is not None:
            self._deliver(server, request, None, None, link.lost, out)
            return
        if not link.open:
            error = PeerLostError(f"{link.name}: the stream was never opened")
            self._deliver(server, request, None, None, error, out)
            return
        if link.unsettled and link.settle_first(server, request, self._now + self.request_s, out):
            return
        seq = link.table.add(request)
        request.written = True
        out.append(Send(server, request.op, seq, request.arrays, request.text, request.flags))

    # ------------------------------------------------------------ events: the streams

    def _frame(self, event: FrameArrived) -> list[Instruction]:
        """A reply, an interim ``COUNTED`` answer, or a ``DURABLE`` note."""
        self._now = event.now
        server = event.server
        message = event.message
        header = message.header
        link = self.links[server]
        link.silent_since = None  # (see Link.cut)
        out: list[Instruction] = []
        if header.op == _DURABLE:
            link.retained.durable(header.aux)
            link.durable_note = header.text
            return out
        if header.flags & COUNTED:  # its push is counted: kept as an answered push is
            request = link.table.get(header.seq)
            if request is not None:
                if link.restartable:
                    self._retain(server, request, out)
                if request.push is not None and not request.acked:
                    self._ack(request, None, out)
            return out
        if link.resent:  # the stream opened again carried this answer (see Link.cut)
            link.answered(header.seq)
        outcome = link.table.reply(message)
        if outcome is None:
            return out
        request, answer, error = outcome
        if isinstance(error, PeerLostError) and not link.closing:
            link.verdict_held.append(outcome)  # the job failed: nothing will work
            self._trouble(server, error, False, out)
            return out
        if error is None and link.restartable:
            self._retain(server, request, out)
        self._deliver(server, request, answer, message.borrowed, error, out)
        return out

    def _deliver(
        self,
        server: int,
        request: Request,
        message: Message | None,
        borrowed: Sequence[int] | None,
        error: AKVError | None,
        out: list[Instruction],
    ) -> None:
        """Tell who waits on ``request`` of its answer: its call (the message, or the
        error), and the pipelined push it carries (answered: an error only when no call
        rides on it; then acknowledged, if it was not counted already)."""
        push = request.push
        call = request.call
        if push is not None:
            if call is None and error is not None and push.answer_error is None:
                push.answer_error = error
            if borrowed and request.lend is not None and message is not None:
                self.ahead.lend(request.lend, message.buffers, borrowed, self.links[server].stream)
            push.unanswered -= 1
            if not push.unanswered:
                self._push_answered(push, out)
            if not request.acked:  # refused, lost, or resent without asking: the answer says
                self._ack(request, error if call is None else None, out)
        if call is not None:
            if error is not None and call.error is None:
                call.error = error
            if message is not None and call.kind == CONTROL:
                call.reply = message
            call.remaining -= 1
            if not call.remaining:
                self._finish(call, out)

    def _ack(self, request: Request, error: AKVError | None, out: list[Instruction]) -> None:
        """``request``'s server acknowledged its push (counted it, or answered)."""
        request.acked = True
        push = request.push
        assert push is not None
        if error is not None and push.ack_error is None:
            push.ack_error = error
        push.unacked -= 1
        if not push.unacked:
            self._acknowledged(push, out)

    def _acknowledged(self, push: Pipelined, out: list[Instruction]) -> None:
        """Every server acknowledged ``push`` (or failed it): its error is kept for the
        next call on its keys, unless its own call waited for it and raises it."""
        error = push.ack_error
        if push.waits:
            out.append(Finish(push.token, error))
        elif error is not None and not push.told and push.late is None:
            push.late = late_error(error, push.keys)
            self.late.keep(push.keys, push.late)
        self.unacked -= 1
        if not self.unacked and self._acks_waiters:
            waiters, self._acks_waiters = self._acks_waiters, []
            out.extend(Finish(waiter, None) for waiter in waiters)

    def _push_answered(self, push: Pipelined, out: list[Instruction]) -> None:
        """Every server answered ``push``: its staging buffers go back, and the values asked
        with it arrived. An error in the answer goes to a pull waiting for a value, or else
        is kept for the next call on the keys (a lost stream or a failed job as it is)."""
        out.append(Unstage(push.token))
        aheads = push.aheads
        if aheads is None:
            return
        error = push.answer_error
        late: AKVError | None = None
        if isinstance(error, PeerLostError):
            late = error
        elif error is not None:
            late = late_error(error, push.keys)
        taken = False
        for value in aheads:
            taken |= self._arrive(value, late, out)
            if late is not None or value.stale:
                self.ahead.drop(value.entry.key, value, out)
        if taken:
            push.told = True
            if push.late is not None:
                self.late.forget(push.late)
        elif late is not None and push.late is None:
            push.late = late
            self.late.keep(push.keys, late)

    def _arrive(self, value: Ahead, error: AKVError | None, out: list[Instruction]) -> bool:
        """``value`` arrived (or failed with ``error``); True when a waiting pull was told
        of the error."""
        value.arrived = True
        value.error = error
        waiters = value.waiters
        if not waiters:
            return False
        value.waiters = []
        for call in waiters:
            if error is not None and call.error is None:
                call.error = error
            call.remaining -= 1
            if not call.remaining:
                self._finish(call, out)
        return error is not None

    def _finish(self, call: Gather, out: list[Instruction]) -> None:
        """Every answer ``call`` waited for is in: end it."""
        kind = call.kind
        if kind != PULL:
            self._finish_other(call, out)
            return
        if call.staged:
            out.append(Unstage(call.token))
        copies = call.copies
        aheads = call.aheads
        if call.error is None:
            for outs, value in aheads:
                source = value.buffer if value.lent is None else value.lent
                for output in outs:
                    copies.append((output, source))
            if copies:
                out.append(CopyOut(call.token, copies))
        for entry, buffer in call.buffers:
            out.append(GiveBuffer(entry, buffer))
        for _, value in aheads:
            if value.error is None and value.lent is not None:  # read once: its memory goes back
                self.ahead.drop(value.entry.key, value, out)
            value.readers -= 1
            if value.stale:
                self.ahead.release_when_unread(value, out)
        out.append(Finish(call.token, call.error))

    def _finish_other(self, call: Gather, out: list[Instruction]) -> None:
        """End a call that is not a pull: a strict push, a control request, or the worker's
        own checkpoint request or replay's pull."""
        kind = call.kind
        if kind == CHECKPOINT:
            link = self.links[call.server]
            link.asked_checkpoint = False
            if call.error is not None and not link.closing and self.failure is None:
                self._trouble(call.server, call.error, False, out)
        elif kind == SETTLE:
            link = self.links[call.server]
            error = call.error
            if error is not None and not link.closing and self.failure is None:
                if call.keys:  # the round of a push sent again failed: the program's to hear
                    self.late.keep(call.keys, error)
                elif link.replay is call.replay:
                    # Going on would apply requests out of order: the replay stays where it
                    # is (the requests after it wait) until the job fails.
                    stop = ServerError(f"{link.name}: a replay after a cut stopped: {error}")
                    self._trouble(call.server, stop, False, out)
                    return
            if link.replay is call.replay:
                link.advance_replay(call.server, self._now + self.request_s, out)
        else:
            if call.staged:
                out.append(Unstage(call.token))
            out.append(Finish(call.token, call.error, call.reply if kind == CONTROL else None))

    def _value_read(self, event: ValueRead) -> list[Instruction]:
        out: list[Instruction] = []
        self.ahead.release_when_unread(event.ahead, out)
        return out

    def _turn_ended(self, event: TurnEnded) -> list[Instruction]:
        self._now = event.now
        link = self.links[event.server]
        held = link.held_push
        out: list[Instruction] = []
        if held is not None:
            link.held_push = None
            self._send(event.server, held, out)
        return out

    def _retain(self, server: int, request: Request, out: list[Instruction]) -> None:
        """Keep a copy of an acknowledged change until a checkpoint holds it; past
        ``retain_bytes`` kept, ask the server for a checkpoint."""
        if self.links[server].retain(request, self.retain_bytes):
            call = Gather(None, CHECKPOINT, server)
            call.remaining = 1
            self._send(server, Request(_CHECKPOINT, (), self._now + self.request_s, call), out)

    def _trouble(self, server: int, error: AKVError, cut: bool, out: list[Instruction]) -> None:
        """Server ``server`` cut its stream for good (``cut``), or answered that the job
        failed: ask the scheduler who failed first (the requests concerned stay pending
        until the verdict, or their deadline)."""
        if self.failure is not None:
            self._fail_all(out)
        else:
            out.append(Blame(server, error, cut))

    def _opened(self, event: StreamOpened) -> list[Instruction]:
        """A stream to the server is open: the first one, or a new one after a cut (then
        the unanswered and the kept requests are sent again, in their order)."""
        self._now = event.now
        link = self.links[event.server]
        out: list[Instruction] = []
        again = link.opened(event.stream, event.shares_memory, event.now)
        if again and self.failure is None and not link.closing:
            link.resend(event.server, self._now + self.request_s, out)
        return out

    def _cut(self, event: StreamCut) -> list[Instruction]:
        """The stream ended: open it again (within the request deadline window, with the
        waits of its series of cuts: see :meth:`Link.cut`), unless the store leaves (then
        its requests fail) or the job failed. The requests whose deadline passed fail now
        rather than being sent again."""
        self._now = now = event.now
        server = event.server
        link = self.links[server]
        out: list[Instruction] = []
        if not link.open:
            return out  # (told twice)
        lost = link.cut(event.error, now)
        if link.closing:
            self._fail_link(server, lost, out)
        elif self.failure is not None:
            self._trouble(server, lost, True, out)
        else:
            self._sweep(server, now, out)
            outcome = link.start_reconnecting(now, self.request_s)
            if isinstance(outcome, AKVError):
                self._trouble(server, outcome, True, out)
            else:
                out.append(Reconnect(server, outcome))
        return out

    def _connect_failed(self, event: ConnectFailed) -> list[Instruction]:
        """An attempt to open the stream again failed: try again after the backoff's wait,
        or give up and ask the scheduler who failed (see :meth:`Link.attempt_failed`)."""
        self._now = event.now
        link = self.links[event.server]
        out: list[Instruction] = []
        if not link.reconnecting:
            return out
        if link.closing or self.failure is not None:
            link.reconnecting = False
            return out
        outcome = link.attempt_failed(event.error, event.now)
        if isinstance(outcome, AKVError):
            self._trouble(event.server, outcome, True, out)
        else:
            out.append(Reconnect(event.server, outcome))
        return out

    # ------------------------------------------------------------ events: the job, the clock

    def _job_failed(self, event: JobFailed) -> list[Instruction]:
        """The job failed: every waiting request, and every later one, fails with the first
        reason."""
        if self.failure is None:
            self.failure = event.error
        out: list[Instruction] = []
        self._fail_all(out)
        return out

    def _fail_all(self, out: list[Instruction]) -> None:
        error = self.failure
        assert error is not None
        for server, link in enumerate(self.links):
            link.reconnecting = False
            link.replay = None
            held = link.held_push
            if held is not None:
                link.held_push = None
                self._deliver(server, held, None, None, error, out)
            self._fail_link(server, error, out)

    def _fail_link(self, server: int, error: AKVError, out: list[Instruction]) -> None:
        link = self.links[server]
        verdict, link.verdict_held = link.verdict_held, []
        for outcome in verdict:
            self._deliver(server, outcome.request, None, None, error, out)
        for outcome in link.table.fail_all(error):
            self._deliver(server, outcome.request, None, None, error, out)

    def _closing(self, event: Closing) -> list[Instruction]:
        """The store leaves: held pushes go now; the requests of a stream that is cut fail
        (it is not opened again), and a stream's end from now on fails its own."""
        out: list[Instruction] = []
        for server, link in enumerate(self.links):
            held = link.held_push
            if held is not None:
                link.held_push = None
                self._send(server, held, out)
            link.closing = True
            link.reconnecting = False
            link.replay = None
            if link.lost is not None:
                self._fail_link(server, link.lost, out)
        return out

    def _barrier_passed(self, _: BarrierPassed) -> list[Instruction]:
        for link in self.links:
            link.barrier_passed()
        return []

    def _tick(self, event: Tick) -> list[Instruction]:
        """Fail the requests whose deadline passed."""
        self._now = now = event.now
        out: list[Instruction] = []
        for server in range(len(self.links)):
            self._sweep(server, now, out)
        return out

    def _sweep(self, server: int, now: float, out: list[Instruction]) -> None:
        """Fail the requests to ``server`` whose deadline is before ``now``."""
        link = self.links[server]
        if link.table:
            for outcome in link.table.sweep(now, link.cut_cause):
                self._deliver(server, outcome.request, None, None, outcome.error, out)

    # ------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests)."""
        invariants.check(self)
