"""A worker's link to one server over its life: open, cut, opened again with backoff, its
requests resent in order, and what it keeps until the server's checkpoint holds it.

Plain records and rules, no I/O (the worker's state,
:class:`~akv.cluster.worker.state.WorkerState`, drives them):

- :func:`classify`: what a failed attempt to open the stream again means (the token
  refused, the stream refused, the server stopping, the job failed, nothing listening, or
  a transport failure worth another try).
- :class:`Backoff`: when to try again: at once, then after :data:`~akv.limits.RECONNECT_FIRST_S`,
  doubling up to :data:`~akv.limits.RECONNECT_MAX_S`, within the request deadline window,
  over a series of cuts (a stream opened again and cut before the requests resent on it
  were answered does not start the waits from zero: see :meth:`Link.cut`).
- :class:`Retained`: each acknowledged request that changed a server that writes
  checkpoints, copied and kept until the server's ``DURABLE`` note says a checkpoint holds
  it; a restored server gets them again.
- :class:`Replay`: the requests to send again on a new stream, by number: the kept ones and
  the unanswered ones; those made meanwhile wait (``deferred``) and follow.
- :class:`Link`: all of that for one server, with its request table.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from akv.cluster.protocol import STOPPING_STATUS, Op, replay_barrier_text
from akv.cluster.worker.instructions import Instruction, Send
from akv.cluster.worker.pipeline import CHECKPOINT, SETTLE, Gather
from akv.cluster.worker.requests import (
    Outcome,
    Pushed,
    Request,
    RequestTable,
    WireArray,
    settle_before_resend,
    settle_op,
    settle_unsettled,
)
from akv.errors import AKVError, MembershipError, PeerLostError
from akv.limits import RECONNECT_FIRST_S, RECONNECT_MAX_S, RECONNECT_SILENT_ATTEMPTS
from akv_transport import (
    AuthError,
    FrameError,
    RemoteError,
    StreamEndedError,
    StreamSilentError,
    TransportError,
)

__all__ = ["Backoff", "Barriers", "Link", "Refusal", "Replay", "Resend", "Retained", "classify"]


class Refusal(enum.Enum):
    """What a failed attempt to open a stream again means (see :func:`classify`)."""

    #: The server refused the job's token.
    AUTH = "auth"
    #: The server (or the scheduler, asked where the server is) refused the stream.
    REFUSED = "refused"
    #: The server stops; a restart (of a server that writes checkpoints) takes the stream.
    STOPPING = "stopping"
    #: The scheduler says the job failed.
    JOB_FAILED = "job failed"
    #: Nothing listens at the address, and nothing will unless the server is restarted.
    GONE = "gone"
    #: The connection was made and nothing answered it before the deadline (a server that
    #: hangs, or a path that black-holes what it carries).
    SILENT = "silent"
    #: Anything else on the way (a timeout, a reset): worth another try.
    TRANSPORT = "transport"


def classify(error: BaseException) -> Refusal:
    """What ``error``, raised by an attempt to open a stream again (asking the scheduler
    where the server is, then connecting), means."""
    if isinstance(error, AuthError):
        return Refusal.AUTH
    if isinstance(error, RemoteError):
        return Refusal.STOPPING if error.status == STOPPING_STATUS else Refusal.REFUSED
    if isinstance(error, PeerLostError):
        return Refusal.JOB_FAILED
    if isinstance(error, MembershipError):
        return Refusal.REFUSED
    if isinstance(error, StreamSilentError):
        return Refusal.SILENT
    cause = error.__cause__ if isinstance(error, TransportError) else error
    if isinstance(cause, ConnectionRefusedError):
        return Refusal.GONE
    if isinstance(cause, TimeoutError):
        return Refusal.SILENT
    return Refusal.TRANSPORT


class Backoff:
    """The waits between attempts to open a cut stream, over one series of cuts (see
    :meth:`Link.cut`): the first attempt at once, then ``first_s``, doubling up to ``max_s``
    with each failed attempt and each cut that repeats the series; no attempt past the
    window given to :meth:`start` at the series' first cut."""

    __slots__ = ("deadline", "delay", "first_s", "max_s", "window_s")

    def __init__(self, first_s: float = RECONNECT_FIRST_S, max_s: float = RECONNECT_MAX_S) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.window_s = 0.0
        self.deadline = 0.0
        self.delay = first_s

    def start(self, now: float, window_s: float) -> None:
        """The stream was cut at ``now``: attempts may go on for ``window_s``."""
        self.window_s = window_s
        self.deadline = now + window_s
        self.delay = self.first_s

    def next_delay(self, now: float) -> float | None:
        """An attempt failed at ``now``: how long to wait before the next one, or None when
        it would start past the window (give up)."""
        delay = self.delay
        if now + delay > self.deadline:
            return None
        self.delay = min(2 * delay, self.max_s)
        return delay

    def again(self, now: float) -> float | None:
        """A stream opened again in this series was cut again at ``now``, before it proved
        itself: how long to wait before the next attempt (the series' next wait, no later
        than the window's end), or None once the window has passed (give up).

        A wait that would end past the window is cut short rather than given up on: the
        requests the series' first cut caught have their deadlines within the window, and
        such a request, failed at its deadline, ends the series (see :meth:`Link.cut`).
        So a request whose answer cuts the stream each time fails alone, by its deadline,
        instead of the series giving the server up before that deadline.
        """
        if now >= self.deadline:
            return None
        delay = self.delay
        self.delay = min(2 * delay, self.max_s)
        return min(delay, self.deadline - now)


#: The requests kept for a restart (those that change a server), and the op each is
#: resent as (a pushpull's pull was answered: its push is what the server must get again).
RETAINED_OPS: dict[int, Op] = {
    Op.PUSH: Op.PUSH,
    Op.PUSHPULL: Op.PUSH,
    Op.INIT: Op.INIT,
    Op.SET_OPTIMIZER: Op.SET_OPTIMIZER,
    Op.LOAD_STATES: Op.LOAD_STATES,
    Op.ROW_INIT: Op.ROW_INIT,
    Op.ROW_PUSH: Op.ROW_PUSH,
}


class Retained:
    """Acknowledged requests that changed a server, kept until a checkpoint holds them:
    ``seq -> (op to resend as, arrays, text)``, ``nbytes`` in all. Requests numbered below
    ``durable_below`` are in a checkpoint already."""

    __slots__ = ("durable_below", "nbytes", "requests")

    def __init__(self) -> None:
        self.requests: dict[int, tuple[int, list[WireArray], str]] = {}
        self.nbytes = 0
        self.durable_below = 0

    def keep(self, request: Request) -> bool:
        """Keep a copy of ``request`` (answered, or counted) if it changed the server and
        is neither kept nor durable already (a pushpull asked ahead is kept once counted,
        not again when answered). True when kept."""
        op = RETAINED_OPS.get(request.op)
        seq = request.seq
        if op is None or seq < self.durable_below or seq in self.requests:
            return False
        arrays = [(key, array.copy(), tag) for key, array, tag in request.arrays]
        self.requests[seq] = (op, arrays, request.text)
        self.nbytes += sum(array.nbytes for _, array, _ in arrays)
        return True

    def durable(self, below: int) -> None:
        """A checkpoint holds every request numbered below ``below``: drop their copies."""
        self.durable_below = max(self.durable_below, below)
        for seq in [seq for seq in self.requests if seq < below]:
            _, arrays, _ = self.requests.pop(seq)
            self.nbytes -= sum(array.nbytes for _, array, _ in arrays)


class Resend(NamedTuple):
    """One request a replay sends again: kept (``request`` None: answered, retained) or
    unanswered. ``settled``: the pull it waited for was answered (see
    :func:`~akv.cluster.worker.requests.settle_before_resend`)."""

    seq: int
    op: int
    arrays: Sequence[WireArray]
    text: str
    flags: int
    request: Request | None
    settled: bool = False


#: Requests a replay sends again and waits for, before it goes on (as their calls did).
_WAIT_AFTER = frozenset({Op.SET_OPTIMIZER, Op.LOAD_STATES})


class Barriers:
    """The barriers a ``dist_async`` worker passed, as one link numbers its requests:
    ``passed`` in all, and for the later ones, the number of the first request after each
    (``bounds``: ``(barrier, seq)``; those before every request a replay could send again
    are dropped). A replay puts a ``REPLAY_BARRIER`` where each was (see
    :mod:`akv.cluster.server.durability`)."""

    __slots__ = ("bounds", "passed")

    def __init__(self) -> None:
        self.passed = 0
        self.bounds: deque[tuple[int, int]] = deque()

    def passed_one(self, next_seq: int, oldest: int) -> None:
        """A barrier was passed: the link's next request is numbered ``next_seq``, and no
        replay sends again a request numbered below ``oldest``."""
        self.passed += 1
        self.bounds.append((self.passed, next_seq))
        while self.bounds and self.bounds[0][1] <= oldest:
            self.bounds.popleft()

    def before(self, seq: int | None) -> int:
        """How many barriers were passed before request ``seq`` (None: from now on)."""
        return self.passed - sum(1 for _, bound in self.bounds if seq is not None and bound > seq)


def _with_barriers(resends: list[Resend], barriers: Barriers) -> list[Resend]:
    """``resends`` (by number) after a replay barrier, with one before the first request
    after each barrier passed since the first of them, and one (``last``) at the end."""
    if not resends:
        return [_replay_barrier(barriers.passed, True)]
    first = resends[0].seq
    bounds = deque(b for b in barriers.bounds if b[1] > first)
    out = [_replay_barrier(barriers.before(first), False)]
    for resend in resends:
        while bounds and bounds[0][1] <= resend.seq:
            out.append(_replay_barrier(bounds.popleft()[0], False))
        out.append(resend)
    out.append(_replay_barrier(barriers.passed, True))  # (those after the last request too)
    return out


def _replay_barrier(passed: int, last: bool) -> Resend:
    return Resend(0, Op.REPLAY_BARRIER, (), replay_barrier_text(passed, last), 0, None)


class Replay:
    """Sending a link's requests again on a new stream: ``queue`` in their order (the kept
    ones and the unanswered ones, by number; with ``barriers``, the replay barriers of
    ``dist_async`` between them), then the requests made meanwhile (``deferred``, numbers
    of requests in the table), in theirs. ``pushed``: the keys pushed so far (a second push
    of a key waits for a pull of it first); ``resent``: once the queue is sent, those of
    its keys not pulled since (see :attr:`Link.unsettled`)."""

    __slots__ = ("deferred", "pushed", "queue", "resent")

    def __init__(
        self, retained: Retained, unanswered: list[Request], barriers: Barriers | None = None
    ) -> None:
        by_seq: dict[int, Resend] = {
            seq: Resend(seq, op, arrays, text, 0, None)
            for seq, (op, arrays, text) in retained.requests.items()
        }
        # A pushpull asked ahead is kept once counted and may still wait for its answer:
        # then it is resent once, as the request it is.
        for request in unanswered:
            by_seq[request.seq] = Resend(
                request.seq, request.op, request.arrays, request.text, request.flags, request
            )
        resends = [by_seq[seq] for seq in sorted(by_seq)]
        if barriers is not None:
            resends = _with_barriers(resends, barriers)
        self.queue: deque[Resend] = deque(resends)
        self.deferred: deque[int] = deque()
        self.pushed: Pushed = {}
        self.resent: Pushed | None = None

    def next(self, table: RequestTable) -> Resend | None:
        """The next request to send again (None: the replay is done)."""
        if self.queue:
            return self.queue.popleft()
        if self.resent is None:
            self.resent = dict(self.pushed)
        while self.deferred:
            request = table.get(self.deferred.popleft())
            if request is not None:  # (one failed meanwhile is not sent)
                return Resend(
                    request.seq, request.op, request.arrays, request.text, request.flags, request
                )
        return None

    def put_back(self, resend: Resend) -> None:
        """Send ``resend`` next, once the pull it waits for was answered."""
        self.queue.appendleft(resend._replace(settled=True))


class Link:
    """What this worker's state knows of its stream to one server (``name``; ``restartable``:
    the server writes checkpoints, and a restart of it may take the stream over).

    ``table``: the requests waiting for their answers. ``open``: a stream is up (``stream``,
    the I/O side's handle of it; ``shares_memory``: through shared memory). ``lost``: why
    the stream is down (cut, being opened again, or given up). ``held_push``: a pipelined
    push held until the end of the loop turn (a pull of its keys may ride on it).
    ``verdict_held``: requests the server refused because the job failed, held for the
    scheduler's verdict.

    Cuts come in series (:meth:`cut`): a stream opened again must carry the answers to the
    requests sent again on it (``resent``) before a cut of it starts the waits from zero.
    """

    __slots__ = (
        "asked_checkpoint",
        "backoff",
        "barriers",
        "closing",
        "cut_cause",
        "cuts",
        "durable_note",
        "held_push",
        "lost",
        "name",
        "open",
        "reconnecting",
        "reconnects",
        "replay",
        "resent",
        "restartable",
        "retained",
        "shares_memory",
        "silent_attempts",
        "silent_since",
        "stream",
        "table",
        "unsettled",
        "verdict_held",
    )

    def __init__(self, name: str, restartable: bool, ordered: bool = False) -> None:
        """``ordered``: a ``dist_async`` worker's replays keep its barriers (:class:`Barriers`)."""
        self.name = name
        self.restartable = restartable
        self.barriers = Barriers() if ordered else None
        #: dist_sync: keys whose push the last replay sent again with no pull since; its
        #: round may wait for the other workers' on the server, while the program pulled
        #: it before the server's restart and may push the key again
        #: (:meth:`settle_first`).
        self.unsettled: Pushed = {}
        self.table = RequestTable(name)
        self.open = False
        self.stream: object = None
        self.shares_memory = False
        self.lost: AKVError | None = None
        self.closing = False
        #: How many times the stream was cut and opened again.
        self.reconnects = 0
        self.reconnecting = False
        self.backoff = Backoff()
        self.cut_cause: BaseException | None = None
        #: Cuts in the current series (see :meth:`cut`; 0 before the first).
        self.cuts = 0
        #: When the stream was opened again with nothing to send again, until a frame
        #: comes on it (else None).
        self.silent_since: float | None = None
        #: The requests sent again on the stream opened again, by number, whose answers
        #: have not come on it yet.
        self.resent: set[int] = set()
        #: Attempts in a row to open the stream again that connected and heard nothing.
        self.silent_attempts = 0
        self.held_push: Request | None = None
        self.verdict_held: list[Outcome] = []
        self.retained = Retained()
        #: The server's last ``DURABLE`` note (:func:`~akv.cluster.protocol.format_note`),
        #: sent back when the stream is opened again: a server restored from an older
        #: checkpoint than the one it declared durable refuses it ("" before any note).
        self.durable_note = ""
        self.asked_checkpoint = False
        self.replay: Replay | None = None

    def rename(self, name: str) -> None:
        """The server is now named ``name`` (restarted elsewhere: its address changed)."""
        self.name = self.table.server = name

    def cut(self, error: BaseException | None, now: float) -> PeerLostError:
        """The stream ended at ``now`` (``error``: why, when known): down until a new one
        opens; its requests wait for that (none of them is on a stream any more).

        The cut repeats the current series of cuts (``cuts`` counts them) when this
        worker's reader refused a frame on the stream opened again (a ``FrameError``, not
        a truncation: ``StreamEndedError``) while one of the requests sent again on it still
        waits for its answer there: that answer may be what cut the stream, and would cut
        the next one too, so the stream has not proved that it works again. (A reset or an
        end from the path is no evidence: reconnecting at once there is what a flaky network
        needs; tests/akv/cluster/test_heavy_cuts.py took 4.5 times as long with waits.) Any
        other cut (the first; one of a stream that carried the answers to what was sent
        again on it, or that had nothing to send again) starts a series, but for a stream
        opened again with nothing to send again that carried no frame and was cut within
        :data:`~akv.limits.RECONNECT_MAX_S`: a peer that takes streams and drops them at
        once would otherwise be reconnected to in a tight loop. A request whose deadline is
        before ``now`` does not count: it fails now, and is not sent again.

        Why not "before any answer came on it": the request whose answer cuts the stream
        may be one of several sent again, and come after the others were answered. Why not
        "within so many seconds": how soon such an answer comes depends on the server (a
        pull waits for its round), so no span tells that cut from one by chance.
        """
        silent = self.silent_since
        refused = isinstance(error, FrameError) and not isinstance(error, StreamEndedError)
        repeated = (refused and self._resent_waiting(now)) or (
            silent is not None and now - silent < RECONNECT_MAX_S
        )
        self.resent = set()
        self.silent_since = None
        self.cuts = self.cuts + 1 if repeated else 1
        self.cut_cause = error
        self.open = False
        self.stream = None
        self.shares_memory = False
        self.replay = None
        for request in self.table.unanswered():
            if request.written:
                request.cuts += 1
                request.written = False
        if isinstance(error, StreamSilentError):  # cut by this worker: nothing came
            self.lost = PeerLostError(f"{self.name} went silent: {error}")
        else:
            detail = f": {error!r}" if error else ""
            self.lost = PeerLostError(f"{self.name} closed the connection{detail} (did it die?)")
        return self.lost

    def start_reconnecting(self, now: float, window_s: float) -> float | AKVError:
        """Open the stream cut at ``now`` (:meth:`cut`) again: the wait before the first
        attempt, or the error to report when it gives up (the stream stays ``lost`` with
        it).

        A cut that starts a series is tried again at once, and attempts go on for up to
        ``window_s`` from it. A cut that repeats the series waits the series' next wait
        (:meth:`Backoff.again`: they keep doubling up to ``RECONNECT_MAX_S``), and gives up
        once ``window_s`` from the series' first cut has passed.
        """
        self.reconnecting = True
        self.silent_attempts = 0
        if self.cuts == 1:
            self.backoff.start(now, window_s)
            return 0.0
        delay = self.backoff.again(now)
        if delay is not None:
            return delay
        return self._give_up(
            PeerLostError(
                f"{self.name} {self._cut_text()}: its stream was cut {self.cuts} times in a "
                "row, each time before the requests sent again on it were answered, for "
                f"AKV_REQUEST_TIMEOUT_S ({self.backoff.window_s:g} s) (did it die?)"
            )
        )

    def _resent_waiting(self, now: float) -> bool:
        """Whether a request sent again on this stream still waits for its answer (kept,
        or in the table with its deadline not before ``now``)."""
        if not self.resent:
            return False
        table, kept = self.table, self.retained.requests
        for seq in self.resent:
            request = table.get(seq)
            if seq in kept or (request is not None and request.deadline >= now):
                return True
        return False

    def _cut_text(self) -> str:
        """How the latest cut came about, for messages ("closed the connection (...)")."""
        cause = self.cut_cause
        if isinstance(cause, StreamSilentError):
            return f"went silent ({cause})"
        return "closed the connection" + (f" ({cause!r})" if cause is not None else "")

    def _give_up(self, trouble: AKVError) -> AKVError:
        """Stop opening the stream again: it stays ``lost`` with ``trouble``."""
        self.reconnecting = False
        self.lost = trouble
        return trouble

    def attempt_failed(self, error: BaseException, now: float) -> float | AKVError:
        """An attempt to open the stream again failed with ``error``: the wait before the
        next one, or the error to report when it gives up (the server refused the stream or
        the token, the job failed, nothing listens and no restart will come, or the window
        passed; the stream stays ``lost`` with that error)."""
        kind = classify(error)
        trouble: AKVError | None = None
        retry = True
        reach = (
            f"could not be reached again within AKV_REQUEST_TIMEOUT_S ({self.backoff.window_s:g} s)"
        )
        if kind is Refusal.STOPPING and self.restartable:
            pass  # it stops, and its restart will take the stream
        elif kind in (Refusal.AUTH, Refusal.REFUSED, Refusal.STOPPING):
            trouble = PeerLostError(f"{self.name} refused to take the stream back: {error}")
            retry = False
        elif kind is Refusal.JOB_FAILED:
            trouble = error if isinstance(error, AKVError) else PeerLostError(str(error))
            retry = False
        elif kind is Refusal.GONE and not self.restartable:
            retry = False  # nothing listens there, and nothing will: the server is gone
            reach = "nothing listens at its address any more"
        elif kind is Refusal.SILENT and not self.restartable:
            self.silent_attempts += 1
            if self.silent_attempts >= RECONNECT_SILENT_ATTEMPTS:
                retry = False  # it takes connections and answers none: it is gone too
                reach = f"answered none of {self.silent_attempts} attempts to open it again"
        if kind is not Refusal.SILENT:
            self.silent_attempts = 0
        delay = self.backoff.next_delay(now) if retry else None
        if delay is not None:
            return delay
        if trouble is None:
            trouble = PeerLostError(
                f"{self.name} {self._cut_text()} and {reach}: {error!r} (did it die?)"
            )
        return self._give_up(trouble)

    def opened(self, stream: object, shares_memory: bool, now: float) -> bool:
        """A stream is open at ``now`` (``stream``: the I/O side's handle of it); True when
        it replaces a cut one, whose requests are to be sent again."""
        self.open = True
        self.stream = stream
        self.shares_memory = shares_memory
        if not self.reconnecting:
            return False
        self.silent_since = now
        self.reconnecting = False
        self.lost = None
        self.reconnects += 1
        return True

    def resend(self, server: int, deadline: float, out: list[Instruction]) -> None:
        """The stream was opened again: send the kept and the unanswered requests again, in
        their order (see :meth:`advance_replay`), each one ``resent`` until its answer comes
        on this stream (:meth:`answered`)."""
        table = self.table
        for request in table.unanswered():
            if request.op == Op.REPLAY_BARRIER:
                table.pop(request.seq)  # an earlier replay's: this one sends its own
        self.unsettled.clear()  # (those still kept are sent again; the rest are durable)
        replay = self.replay = Replay(self.retained, table.unanswered(), self.barriers)
        self.resent = {resend.seq for resend in replay.queue if resend.seq}
        if self.resent:  # then their answers tell whether it works (see cut)
            self.silent_since = None
        self.advance_replay(server, deadline, out)

    def barrier_passed(self) -> None:
        """The worker passed a barrier (``dist_async``: see :class:`Barriers`)."""
        if self.barriers is not None:
            next_seq, oldest = self.table.next_seq, self._oldest()
            self.barriers.passed_one(next_seq, next_seq if oldest is None else oldest)

    def replay_barriers(self) -> int | None:
        """For a stream about to be opened again (``dist_async``): how many barriers were
        passed before the first request it will send again (``X-AKV-Replay``); None when
        replays are not ordered by barriers."""
        return None if self.barriers is None else self.barriers.before(self._oldest())

    def _oldest(self) -> int | None:
        """The number of the first request a replay would send again now (None: none)."""
        kept = min(self.retained.requests, default=None)
        waiting = self.table.first_seq()
        if kept is None or waiting is None:
            return waiting if kept is None else kept
        return min(kept, waiting)

    def answered(self, seq: int) -> None:
        """The answer to request ``seq`` came on the stream (a success or an error)."""
        self.resent.discard(seq)

    def retain(self, request: Request, retain_bytes: int) -> bool:
        """Keep a copy of an acknowledged request that changed the server (see
        :meth:`Retained.keep`); True when that makes it ask the server for a checkpoint
        (more than ``retain_bytes`` kept, and none asked for yet)."""
        if not self.retained.keep(request):
            return False
        if self.retained.nbytes > retain_bytes and not self.asked_checkpoint:
            self.asked_checkpoint = True
            return True
        return False

    def advance_replay(self, server: int, deadline: float, out: list[Instruction]) -> None:
        """Send the replay's requests again (to ``server``, this link's index) until one
        must wait for a pull of its keys; that pull is sent now, also during the replay
        (deadline ``deadline``), and its answer goes on with the replay (a
        :data:`~akv.cluster.worker.pipeline.SETTLE` call)."""
        replay = self.replay
        assert replay is not None
        table = self.table
        while True:
            resend = replay.next(table)
            if resend is None:
                self.replay = None
                if self.barriers is None and replay.resent:
                    self.unsettled.update(replay.resent)
                return
            if not resend.settled:
                settle = settle_before_resend(resend.op, resend.arrays, replay.pushed)
                if settle:
                    replay.put_back(resend)
                    if replay.resent is not None:
                        for key, _, _ in settle:
                            replay.resent.pop(key, None)
                    self._settle(server, replay, settle_op(resend.op), settle, deadline, out)
                    return
            if resend.op == Op.REPLAY_BARRIER:
                # The server answers once every worker sent what it had pushed before that
                # barrier: the replay waits before it goes on.
                self._settle(server, replay, Op.REPLAY_BARRIER, (), deadline, out, resend.text)
                return
            if resend.request is None and resend.op in _WAIT_AFTER:
                # Its call returned once it was applied, before the program sent more (a
                # new optimizer waits on the server for its sender's rounds): the replay
                # waits for its answer too (a SETTLE call) before it goes on.
                call = Gather(None, SETTLE, server)
                call.replay = replay
                call.remaining = 1
                request = Request(resend.op, resend.arrays, deadline, call, text=resend.text)
                table.put(resend.seq, request)
                request.written = True
                out.append(Send(server, resend.op, resend.seq, resend.arrays, resend.text, 0))
                return
            if resend.request is not None:
                resend.request.written = True
            out.append(
                Send(server, resend.op, resend.seq, resend.arrays, resend.text, resend.flags)
            )

    def settle_first(
        self, server: int, request: Request, deadline: float, out: list[Instruction]
    ) -> bool:
        """Before ``request``, a new push, pull the keys it names whose push a replay sent
        again and whose round may still wait for the other workers' (:attr:`unsettled`):
        True when it waits for that pull's answer (numbered, as a replay's last request);
        False when it may go now."""
        settle = settle_unsettled(request.op, request.arrays, self.unsettled)
        if not settle:
            return False
        replay = self.replay = Replay(Retained(), [])
        replay.resent = {}
        replay.deferred.append(self.table.add(request))
        self._settle(server, replay, settle_op(request.op), settle, deadline, out)
        return True

    def _settle(
        self,
        server: int,
        replay: Replay,
        op: Op,
        arrays: Sequence[WireArray],
        deadline: float,
        out: list[Instruction],
        text: str = "",
    ) -> None:
        """Send the request ``replay`` waits for before it goes on (a
        :data:`~akv.cluster.worker.pipeline.SETTLE` call): a pull of ``arrays``' keys (an
        error it gets is the program's, for its next call on them), or a replay barrier."""
        call = Gather(None, SETTLE, server)
        call.replay = replay
        call.remaining = 1
        call.keys = [key for key, _, _ in arrays]
        request = Request(op, arrays, deadline, call, text=text)
        seq = self.table.add(request)
        request.written = True
        out.append(Send(server, op, seq, arrays, text, 0))

    @property
    def replaying(self) -> bool:
        """Whether requests are being sent again on a new stream."""
        return self.replay is not None

    @property
    def retained_bytes(self) -> int:
        """Bytes kept until a checkpoint holds them."""
        return self.retained.nbytes

    def outstanding(self) -> int:
        """Requests a replay would send now: the unanswered and the kept ones."""
        return len(self.table) + len(self.retained.requests)

    def validate(self, failed: bool) -> list[Request]:
        """Raise ``AssertionError`` naming the first broken invariant of this link (for
        tests; ``failed``: the job failed); return its requests waiting for an answer (in
        its table, held for the verdict, or held until the end of the turn)."""
        name, table = self.name, self.table
        pending = table.unanswered()
        for request in pending:
            assert table.get(request.seq) is request, f"{name}: seq {request.seq} moved"
            assert self.open or not request.written, f"{name}: {request} written on no stream"
        requests = [*pending, *(outcome.request for outcome in self.verdict_held)]
        held = self.held_push
        if held is not None:
            assert held.seq == 0 and held.op == Op.PUSH and held.push is not None, held
            requests.append(held)
        asked = [r for r in requests if r.call is not None and r.call.kind == CHECKPOINT]
        assert self.asked_checkpoint == bool(asked), f"{name}: a checkpoint asked for, or not"
        retained = self.retained
        kept = [
            array.nbytes for _, arrays, _ in retained.requests.values() for _, array, _ in arrays
        ]
        assert retained.nbytes == sum(kept), f"{name}: {retained.nbytes} bytes kept, {sum(kept)}"
        assert all(seq >= retained.durable_below for seq in retained.requests), name
        assert not (self.open and self.reconnecting), f"{name}: open and reconnecting"
        assert self.open or not self.resent, f"{name}: requests resent on no stream"
        if self.replay is not None:
            assert self.open and self.lost is None, f"{name}: replaying on no stream"
            for seq in self.replay.deferred:
                deferred = table.get(seq)
                assert deferred is None or not deferred.written, f"deferred and sent: {seq}"
        assert not (failed and requests), f"{name}: requests left after the job failed"
        return requests

    def __repr__(self) -> str:
        return f"<Link {self.name} open={self.open} lost={self.lost!r} pending={len(self.table)}>"
