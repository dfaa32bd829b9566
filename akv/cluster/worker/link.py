"""The stream from a worker to one server: requests out, replies matched back.

The I/O half of :class:`~akv.cluster.worker.requests.RequestTable`: it opens the stream,
writes request frames, feeds replies to the table and delivers what the table decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from akv.cluster.config import Config, format_address
from akv.cluster.protocol import CLIENT_HEADER, COUNTED, STOPPING_STATUS, Op, client_header
from akv.cluster.roles import client_ssl
from akv.cluster.worker.requests import (
    Landing,
    OnReply,
    Outcome,
    Request,
    RequestTable,
    WireArray,
    pull_rides_on_push,
    push_then_pull,
    settle_before_resend,
)
from akv.errors import AKVError, PeerLostError
from akv.limits import MAX_PAYLOAD_BYTES, RECONNECT_FIRST_S, RECONNECT_MAX_S
from transport import (
    AuthError,
    Message,
    RemoteError,
    StreamProtocol,
    TransportError,
    encode_frame,
    open_stream,
)

__all__ = ["ServerLink", "local_address"]

log = logging.getLogger("akv.cluster")

# Looked up once: an enum member lookup is not free, and every message asks.
_DURABLE, _PUSH, _PULL, _PUSHPULL = Op.DURABLE, Op.PUSH, Op.PULL, Op.PUSHPULL
_COUNTED = COUNTED


#: A pipelined push held until the end of the loop turn: arrays, on_reply, timeout_s and
#: the on_counted callback (for the pushpull it becomes when a pull goes with it).
_HeldPush = tuple[Sequence[WireArray], OnReply, float, Callable[[], None] | None]


def _flags(on_counted: Callable[[], None] | None) -> int:
    """A request's frame flags: ``COUNTED`` when it waits to hear that its push counted."""
    return _COUNTED if on_counted is not None else 0


def local_address(entry: dict[str, Any]) -> tuple[str, str] | None:
    """A server's way in for workers on its host, from its address book entry."""
    local = entry.get("local")
    if isinstance(local, dict) and isinstance(local.get("host"), str):
        return str(local["host"]), str(local.get("path", ""))
    return None


class ServerLink:
    """This worker's stream to server ``rank`` at ``host:port``.

    When the stream is cut, the link opens a new one (with backoff, for up to
    ``AKV_REQUEST_TIMEOUT_S``; the server's address is asked of the scheduler first,
    ``locate``, since a restarted server may listen elsewhere) and sends every unanswered
    request again, with its number: the server answers a resent request without applying
    it twice. Requests sent meanwhile wait and go out on the new stream.

    To a server that writes checkpoints (``restartable``) the link also keeps a copy of
    each acknowledged push until the server reports a checkpoint that holds it
    (``DURABLE``), and sends those again too after a reconnect: a server restored from an
    older checkpoint then gets every push it lost. Past ``retain_bytes`` kept, it asks the
    server for a checkpoint.

    ``on_trouble(link, error, cut)`` is called when the stream cannot be opened again
    (``cut``: refused, or the deadline passed), or when the server answers that the job
    failed. Either way the requests concerned, and those sent from then on, stay pending
    until the backend fails them with :meth:`fail_all` (naming whoever the scheduler says
    failed first: the server that cut the stream or refused the request may only be
    passing the news on), or their deadline passes.
    """

    def __init__(
        self,
        rank: int,
        host: str,
        port: int,
        on_trouble: Callable[[ServerLink, AKVError, bool], None],
        *,
        locate: Callable[[int], Awaitable[dict[str, Any] | None]] | None = None,
        restartable: bool = False,
        local: tuple[str, str] | None = None,
    ) -> None:
        self.rank = rank
        self.host = host
        self.port = port
        self.name = f"server {rank} at {format_address(host, port)}"
        self.lost: AKVError | None = None
        self.closing = False
        self.failed = False
        #: What :meth:`fail_all` failed the requests with; later requests fail with it too.
        self._failure: AKVError | None = None
        self.restartable = restartable
        #: The server's way in for workers on its host: (host identity, Unix socket path).
        self.local = local
        #: How many times the stream was cut and opened again.
        self.reconnects = 0
        self._report = on_trouble
        self._locate = locate
        self._table = RequestTable(self.name)
        #: Requests a server refused because the job failed, held for the backend's verdict.
        self._held: list[Outcome] = []
        #: Acknowledged requests kept until a checkpoint holds them: seq -> (op, arrays,
        #: text).
        self._retained: dict[int, tuple[int, list[WireArray], str]] = {}
        self.retained_bytes = 0
        self._durable_below = 0
        self._asked_checkpoint = False
        self._opener: tuple[Config, int, str, str] | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        #: Resending on a new stream: requests made meanwhile wait (``_deferred``) so that
        #: they go out after those before them.
        self._replaying = False
        self._replay: asyncio.Task[None] | None = None
        self._deferred: list[int] = []
        #: A pipelined push held until the end of the loop turn: (arrays, on_reply,
        #: timeout_s). A pull of the same keys made in the same turn goes with it as one
        #: pushpull; any other request sends it first.
        self._held_push: _HeldPush | None = None
        #: The stream (None until :meth:`open`).
        self.protocol: StreamProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self, config: Config, worker: int, store_type: str, session: str = "") -> None:
        """Connect and authenticate as worker ``worker`` (process ``session``) of a
        ``store_type`` store.

        Raises the transport's ``AuthError``, ``RemoteError`` or ``TransportError``.
        """
        self._loop = asyncio.get_running_loop()
        self._opener = (config, worker, store_type, session)
        options: dict[str, Any] = {
            "timeout_s": config.timeouts.connect_s,
            "max_payload_bytes": MAX_PAYLOAD_BYTES,
            "headers": {CLIENT_HEADER: client_header(worker, store_type, session)},
        }
        streams = (self._table.destinations, self._on_message, self._on_lost)
        if config.shm and self.local is not None and self.local[0] == config.host_id:
            try:
                self.protocol = await open_stream(
                    self.host,
                    self.port,
                    config.token,
                    *streams,
                    local_path=self.local[1],
                    arena_bytes=config.shm_arena_bytes,
                    **options,
                )
                return
            except AuthError:
                raise
            except (TransportError, OSError) as exc:  # e.g. a server that died: try TCP
                log.info("%s: no stream through %s (%r); trying TCP", self.name, self.local[1], exc)
        self.protocol = await open_stream(
            self.host,
            self.port,
            config.token,
            *streams,
            ssl_context=client_ssl(config),
            **options,
        )

    @property
    def shares_memory(self) -> bool:
        """Whether the stream runs through the server's Unix socket with shared memory."""
        protocol = self.protocol
        return protocol is not None and protocol.shared is not None

    def _on_message(self, message: Message) -> None:
        header = message.header
        if header.op == _DURABLE:
            self._durable(header.aux)
            return
        if header.flags & _COUNTED:  # its push is counted: kept as an answered push is
            request = self._table.get(header.seq) if self.restartable else None
            if request is not None:
                self._retain(header.seq, request)
            self._table.counted(header.seq)
            return
        # The request, to keep a copy of once answered (only for a server with checkpoints).
        request = self._table.get(header.seq) if self.restartable else None
        outcome = self._table.reply(message)
        if outcome is None:
            return
        if isinstance(outcome.error, PeerLostError) and not self.closing:
            self._held.append(outcome)  # the job failed: nothing will work
            self._report(self, outcome.error, False)
            return
        if request is not None and outcome.error is None:
            self._retain(header.seq, request)
        outcome.deliver()

    def _retain(self, seq: int, request: Request) -> None:
        """Keep a copy of an acknowledged request that changed the server (a push, an init,
        an optimizer or its states) until a checkpoint holds it."""
        op = _RETAINED.get(request.op)
        if op is None or seq < self._durable_below or seq in self._retained:
            return  # (a pushpull asked ahead is kept once counted, not again when answered)
        arrays = [(key, array.copy(), tag) for key, array, tag in request.arrays]
        self._retained[seq] = (op, arrays, request.text)
        self.retained_bytes += sum(array.nbytes for _, array, _ in arrays)
        config = self._config()
        if self.retained_bytes > config.retain_bytes and not self._asked_checkpoint:
            self._asked_checkpoint = True
            timeout_s = config.timeouts.request_s
            self.send(Op.CHECKPOINT, (), self._checkpointed, timeout_s=timeout_s)

    def _checkpointed(self, message: Message | None, error: AKVError | None) -> None:
        self._asked_checkpoint = False
        if error is not None and not self.closing:
            self._report(self, error, False)

    def _durable(self, below: int) -> None:
        """The server's checkpoint holds every request of this worker numbered below
        ``below``: drop the copies kept of those."""
        self._durable_below = max(self._durable_below, below)
        for seq in [seq for seq in self._retained if seq < below]:
            _, arrays, _ = self._retained.pop(seq)
            self.retained_bytes -= sum(array.nbytes for _, array, _ in arrays)

    def _on_lost(self, exc: BaseException | None) -> None:
        self.protocol = None
        detail = f": {exc!r}" if exc else ""
        self.lost = PeerLostError(f"{self.name} closed the connection{detail} (did it die?)")
        if self.closing:
            self.fail_all(self.lost)
        elif self.failed or self._loop is None or self._opener is None:
            self._report(self, self.lost, True)
        elif self._reconnecting is None:
            self._reconnecting = self._loop.create_task(self._reconnect(exc))

    def _config(self) -> Config:
        """The job's configuration (known once :meth:`open` was called)."""
        assert self._opener is not None
        return self._opener[0]

    async def _reconnect(self, cause: BaseException | None) -> None:
        """Open the stream again and resend; report trouble when that cannot be done."""
        assert self._opener is not None and self._loop is not None
        config, worker, store_type, session = self._opener
        loop = self._loop
        window = config.timeouts.request_s
        deadline = loop.time() + window
        delay = RECONNECT_FIRST_S
        last: BaseException | None = cause
        trouble: AKVError | None = None
        try:
            while not (self.closing or self.failed):
                try:
                    if self._locate is not None:
                        entry = await self._locate(self.rank)
                        if entry is not None:
                            self.host, self.port = str(entry["host"]), int(entry["port"])
                            self.local = local_address(entry)
                    await self.open(config, worker, store_type, session)
                except (AuthError, RemoteError) as exc:
                    if (
                        self.restartable
                        and isinstance(exc, RemoteError)
                        and exc.status == STOPPING_STATUS
                    ):
                        last = exc  # it stops, and its restart will take the stream
                    else:
                        trouble = PeerLostError(
                            f"{self.name} refused to take the stream back: {exc}"
                        )
                        break
                except PeerLostError as exc:  # the scheduler says the job failed
                    trouble = exc
                    break
                except TransportError as exc:
                    last = exc
                    if isinstance(exc.__cause__, ConnectionRefusedError) and not self.restartable:
                        break  # nothing listens there, and nothing will: the server is gone
                else:
                    self.lost = None
                    self.reconnects += 1
                    log.warning(
                        "worker %d: the stream to %s was cut (%r); reconnected, resending %d "
                        "requests",
                        worker,
                        self.name,
                        cause,
                        len(self._table) + len(self._retained),
                    )
                    self._replaying = True
                    self._deferred.clear()
                    assert self.protocol is not None
                    self._replay = loop.create_task(self._resend(self.protocol))
                    return
                if loop.time() + delay > deadline:
                    break
                await asyncio.sleep(delay)
                delay = min(2 * delay, RECONNECT_MAX_S)
        finally:
            self._reconnecting = None
        if self.closing or self.failed:
            return
        if trouble is None:
            trouble = PeerLostError(
                f"{self.name} closed the connection ({cause!r}) and could not be reached "
                f"again (AKV_REQUEST_TIMEOUT_S {window:g} s): {last!r} (did it die?)"
            )
        self.lost = trouble
        self._report(self, trouble, True)

    async def _resend(self, protocol: StreamProtocol) -> None:
        """Send the kept pushes and the unanswered requests again on ``protocol``, in their
        order, then those made meanwhile; a second push of a key waits for a pull of it
        first (:func:`settle_before_resend`). Stops when a newer stream took over."""
        by_seq: dict[int, tuple[int, int, Sequence[WireArray], str, int]] = {
            seq: (seq, op, arrays, text, 0) for seq, (op, arrays, text) in self._retained.items()
        }
        # A pushpull asked ahead is kept once counted and may still wait for its answer:
        # then it is resent once, as the request it is.
        by_seq.update(
            (seq, (seq, r.op, r.arrays, r.text, _flags(r.on_counted)))
            for seq, r in self._table.unanswered()
        )
        frames = sorted(by_seq.values(), key=lambda frame: frame[0])
        pushed: set[object] = set()
        try:
            for seq, op, arrays, text, flags in frames:
                if not await self._resend_one(protocol, seq, op, arrays, text, flags, pushed):
                    return
            while self._deferred:  # made while this ran, in their order
                seq = self._deferred.pop(0)
                r = self._table.get(seq)
                if r is not None and not await self._resend_one(
                    protocol, seq, r.op, r.arrays, r.text, _flags(r.on_counted), pushed
                ):
                    return
            self._replaying = False
        except TransportError:
            pass  # cut again: the next stream resends
        finally:
            if self.protocol is protocol:
                self._replay = None

    async def _resend_one(
        self,
        protocol: StreamProtocol,
        seq: int,
        op: int,
        arrays: Sequence[WireArray],
        text: str,
        flags: int,
        pushed: set[object],
    ) -> bool:
        """Resend one request (after the pull it must wait for); False when the stream
        was replaced meanwhile."""
        settle = settle_before_resend(op, arrays, pushed)
        if settle:
            # Its own answer does not matter: the resent push's does.
            with contextlib.suppress(AKVError):
                timeout_s = self._config().timeouts.request_s
                await self._request_now(Op.PULL, settle, timeout_s=timeout_s)
        if protocol is not self.protocol or self.failed or self.closing:
            return False
        protocol.write(encode_frame(op, seq, arrays, text=text, flags=flags))
        return True

    async def _request_now(
        self, op: int, arrays: Sequence[WireArray], *, timeout_s: float
    ) -> Message:
        """A request sent at once, also during a replay (which waits for it)."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._send_now(op, arrays, _resolve(future), "", None, timeout_s)
        return await future

    @property
    def requests_sent(self) -> int:
        """How many requests this link has sent (for statistics and tests)."""
        return self._table.sent

    def fail_all(self, error: AKVError) -> None:
        """Fail every outstanding (and held) request with ``error``; stop reconnecting."""
        self.failed = True
        self._failure = error
        for task in (self._reconnecting, self._replay):
            if task is not None:
                task.cancel()
        held, self._held = self._held, []
        _deliver([Outcome(o.request, None, error) for o in held] + self._table.fail_all(error))

    def sweep(self, now: float) -> None:
        """Fail the requests whose deadline (loop time) passed."""
        _deliver(self._table.sweep(now))

    def send(
        self,
        op: int,
        arrays: Sequence[WireArray],
        on_reply: OnReply,
        *,
        text: str = "",
        destinations: Sequence[Landing] | None = None,
        timeout_s: float,
        hold: bool = False,
        on_counted: Callable[[], None] | None = None,
    ) -> None:
        """Send one request now; ``on_reply`` gets the reply or the error, exactly once.

        With ``destinations``, the reply's arrays are received straight into them. The
        deadline is enforced by :meth:`sweep`, which the backend runs periodically. The
        arrays must stay unchanged until the reply (the request may be sent again).

        ``hold`` (a pipelined push): sent at the end of this loop turn, or before the next
        request, whichever comes first; a pull of the same keys made before then goes with
        it as one pushpull (:func:`~akv.cluster.worker.requests.pull_rides_on_push`), whose
        answer tells both (an error only the pull).

        ``on_counted`` (a pushpull, or a held push if it becomes one): the request asks the
        server to say once its push is counted (``COUNTED``), and ``on_counted()`` hears
        it, before the answer.
        """
        if self._failure is not None:  # the job failed: nothing is sent any more
            self._send_held()
            on_reply(None, self._failure)
            return
        held = self._held_push
        if held is not None:
            self._held_push = None
            pushed, pushed_reply, pushed_timeout_s, pushed_counted = held
            if op == _PULL and pull_rides_on_push(pushed, arrays):
                on_reply = push_then_pull(pushed_reply, on_reply)
                op, arrays, on_counted = _PUSHPULL, pushed, pushed_counted
            else:
                self.send(_PUSH, pushed, pushed_reply, timeout_s=pushed_timeout_s)
        if hold and self._loop is not None:
            self._held_push = (arrays, on_reply, timeout_s, on_counted)
            self._loop.call_soon(self._send_held)
            return
        if (self.lost is not None or self._replaying) and self._loop and not self.closing:
            # Cut: kept, and sent once the stream is open again and the requests before it
            # were resent (or failed by the backend's verdict, or when the deadline passes).
            deadline = self._loop.time() + timeout_s
            seq = self._table.add(op, on_reply, destinations, deadline, arrays, text, on_counted)
            if self.lost is None:
                self._deferred.append(seq)
            return
        if self.lost is not None:
            on_reply(None, self.lost)
            return
        self._send_now(op, arrays, on_reply, text, destinations, timeout_s, on_counted)

    def _send_held(self) -> None:
        held = self._held_push
        if held is not None:
            self._held_push = None
            self.send(_PUSH, held[0], held[1], timeout_s=held[2])

    def _send_now(
        self,
        op: int,
        arrays: Sequence[WireArray],
        on_reply: OnReply,
        text: str,
        destinations: Sequence[Landing] | None,
        timeout_s: float,
        on_counted: Callable[[], None] | None = None,
    ) -> None:
        if self.protocol is None or self._loop is None:
            on_reply(None, PeerLostError(f"{self.name}: the stream was never opened"))
            return
        deadline = self._loop.time() + timeout_s
        seq = self._table.add(op, on_reply, destinations, deadline, arrays, text, on_counted)
        try:
            frame = encode_frame(op, seq, arrays, text=text, flags=_flags(on_counted))
            self.protocol.write(frame)
        except TransportError as exc:
            # The stream is gone (its loss may not have been reported yet): the request
            # is resent on the next stream.
            if self.lost is None:
                self._on_lost(exc)

    async def request(
        self,
        op: int,
        arrays: Sequence[WireArray] = (),
        *,
        text: str = "",
        timeout_s: float,
    ) -> Message:
        """:meth:`send` and wait for the reply (for the less frequent control requests)."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.send(op, arrays, _resolve(future), text=text, timeout_s=timeout_s)
        return await future

    def close(self) -> None:
        """Close the stream (no loss is reported for it); stop reconnecting."""
        self._send_held()
        self.closing = True
        for task in (self._reconnecting, self._replay):
            if task is not None:
                task.cancel()
        if self.protocol is not None:
            self.protocol.close()


#: The requests kept for a restart (those that change a server), and the op each is
#: resent as (a pushpull's pull was answered: its push is what the server must get again).
_RETAINED: dict[int, Op] = {
    Op.PUSH: Op.PUSH,
    Op.PUSHPULL: Op.PUSH,
    Op.INIT: Op.INIT,
    Op.SET_OPTIMIZER: Op.SET_OPTIMIZER,
    Op.LOAD_STATES: Op.LOAD_STATES,
}


def _resolve(future: asyncio.Future[Message]) -> OnReply:
    """The ``on_reply`` that settles ``future`` with the reply or the error."""

    def on_reply(message: Message | None, error: AKVError | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        elif message is not None:
            future.set_result(message)

    return on_reply


def _deliver(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        outcome.deliver()
