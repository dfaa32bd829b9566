"""The I/O half of a worker's stream to one server: it opens the stream (again, when the
state says so), writes the frames the state decides, and hands what arrives to it.

Every decision is the worker's state's (:class:`~akv.cluster.worker.state.WorkerState`,
per server a :class:`~akv.cluster.worker.reconnect.Link`): which requests go when, which
are resent after a cut, how long to wait before the next attempt, when to give up. This
module feeds it :class:`~akv.cluster.worker.events.StreamOpened`,
:class:`~akv.cluster.worker.events.FrameArrived`,
:class:`~akv.cluster.worker.events.StreamCut` and
:class:`~akv.cluster.worker.events.ConnectFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from akv.cluster.config import Config, format_address
from akv.cluster.protocol import (
    CLIENT_HEADER,
    DURABLE_HEADER,
    REPLAY_HEADER,
    STALENESS_HEADER,
    client_header,
)
from akv.cluster.roles import client_ssl
from akv.cluster.worker.calls import Answer
from akv.cluster.worker.events import (
    ConnectFailed,
    Event,
    FrameArrived,
    RequestIssued,
    StreamCut,
    StreamOpened,
)
from akv.cluster.worker.instructions import Send
from akv.cluster.worker.job import unless
from akv.cluster.worker.reconnect import Link
from akv.cluster.worker.requests import WireArray
from akv.errors import AKVError, AuthenticationError, ConnectTimeoutError, ServerError
from akv.limits import CONNECT_RETRY_S, MAX_PAYLOAD_BYTES
from akv_transport import (
    AuthError,
    Message,
    RemoteError,
    StreamProtocol,
    TransportError,
    UntrustedPeerError,
    encode_frame,
    open_stream,
)

if TYPE_CHECKING:
    from akv.cluster.worker.metrics import WorkerMetrics

__all__ = ["ServerLink", "local_address", "server_instance", "server_name"]

log = logging.getLogger("akv.cluster")


def local_address(entry: dict[str, Any]) -> tuple[str, str] | None:
    """A server's way in for workers on its host, from its address book entry."""
    local = entry.get("local")
    if isinstance(local, dict) and isinstance(local.get("host"), str):
        return str(local["host"]), str(local.get("path", ""))
    return None


def server_instance(entry: dict[str, Any]) -> str | None:
    """The instance a server's streams are signed for, from its address book entry (None:
    learned at the first contact)."""
    instance = entry.get("instance")
    return instance if isinstance(instance, str) and instance else None


def server_name(rank: int, host: str, port: int) -> str:
    """How messages name server ``rank`` at ``host:port``."""
    return f"server {rank} at {format_address(host, port)}"


class ServerLink:
    """This worker's stream to server ``rank`` at ``host:port``, index ``index`` of the
    state's links (``state``: that :class:`~akv.cluster.worker.reconnect.Link`).

    ``handle(event)`` feeds an event to the worker's state and carries out what it says.
    ``locate(rank)`` asks the scheduler where the server is now (a restarted server may
    listen elsewhere); ``restartable``: the server writes checkpoints; ``local``: its way
    in for workers on its host (shared memory).
    """

    def __init__(
        self,
        index: int,
        rank: int,
        host: str,
        port: int,
        state: Link,
        handle: Callable[[Event], None],
        *,
        locate: Callable[[int], Awaitable[dict[str, Any] | None]] | None = None,
        restartable: bool = False,
        local: tuple[str, str] | None = None,
        instance: str | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.index = index
        self.rank = rank
        self.host = host
        self.port = port
        self.name = state.name
        self.restartable = restartable
        #: The server's way in for workers on its host: (host identity, Unix socket path).
        self.local = local
        #: The instance the scheduler names for the server: streams are signed for it.
        self.instance = instance
        self._state = state
        self._handle = handle
        #: Counts what the stream carries (``AKV_METRICS_PORT``; None: nothing counted).
        self.metrics = metrics
        self._locate = locate
        #: The stream (None until :meth:`open`, and while it is cut).
        self.protocol: StreamProtocol | None = None
        self._opener: tuple[Config, int, str, str] | None = None
        self._reopening: asyncio.Task[None] | None = None
        #: The Unix socket whose failure was logged at INFO (its retries log at DEBUG).
        self._said_unreachable: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ what the state knows

    @property
    def shares_memory(self) -> bool:
        """Whether the stream runs through the server's Unix socket with shared memory."""
        protocol = self.protocol
        return protocol is not None and protocol.shared is not None

    @property
    def lost(self) -> AKVError | None:
        """Why the stream is down (None while it is up)."""
        return self._state.lost

    @property
    def reconnecting(self) -> bool:
        """Whether the stream is cut and being opened again (to a restarted server, say)."""
        return self._state.reconnecting

    @property
    def reconnects(self) -> int:
        """How many times the stream was cut and opened again."""
        return self._state.reconnects

    @property
    def retained_bytes(self) -> int:
        """Bytes of acknowledged changes kept until the server's checkpoint holds them."""
        return self._state.retained_bytes

    @property
    def asked_checkpoint(self) -> bool:
        """Whether a checkpoint asked for (past ``AKV_RETAIN_BYTES``) is still awaited."""
        return self._state.asked_checkpoint

    @property
    def requests_sent(self) -> int:
        """How many requests this link numbered (for statistics and tests)."""
        return self._state.table.sent

    # ------------------------------------------------------------ opening

    async def open(self, config: Config, worker: int, store_type: str, session: str = "") -> None:
        """Connect and authenticate as worker ``worker`` (process ``session``) of a
        ``store_type`` store; the state hears that the stream is open.

        Raises the transport's ``AuthError``, ``RemoteError`` or ``TransportError``.
        """
        self._loop = loop = asyncio.get_running_loop()
        self._opener = (config, worker, store_type, session)
        self._opened(await self._connect(config, worker, store_type, session), loop)

    async def join(
        self,
        opener: tuple[Config, int, str, str],
        deadline: float,
        failure: Callable[[], AKVError | None],
        broken: asyncio.Event | None = None,
    ) -> None:
        """:meth:`open` the first stream (``opener``: its arguments), retrying until
        ``deadline`` (a ``time.monotonic`` reading) while the server cannot be reached; a
        restartable server is looked up again before each retry (killed since it
        registered, its restart listens elsewhere). The job's failure (``failure()``),
        heard meanwhile, ends the retries; ``broken``, set with it, also ends a lookup
        under way (a scheduler that stopped answering would hold it to the deadline).

        Raises
        ------
        AuthenticationError, ServerError
            The server refused the token, or the stream.
        ConnectTimeoutError
            Not reached by ``deadline``.
        AKVError
            The job's failure (``failure()``), or the scheduler's refusal of a lookup
            (``PeerLostError``: the job failed).
        """
        config, worker = opener[0], opener[1]
        while True:
            try:
                await self.open(*opener)
                return
            except AuthError as exc:
                raise AuthenticationError(f"{self.name} refused this job's token: {exc}") from exc
            except RemoteError as exc:
                raise ServerError(
                    f"{self.name} refused the stream: {exc}", server=self.name
                ) from exc
            except TransportError as exc:
                failed = failure()
                if failed is not None:
                    raise failed from exc
                if time.monotonic() > deadline:
                    raise ConnectTimeoutError(
                        f"worker {worker} could not reach {self.name} within "
                        f"{config.timeouts.connect_s:g} s: {exc}"
                    ) from exc
                await asyncio.sleep(CONNECT_RETRY_S)
                left_s = deadline - time.monotonic()
                if self.restartable and left_s > 0 and failure() is None:
                    # Bounded by the deadline: a scheduler that hangs answers no lookup.
                    lookup = self.relocate(rename_state=True)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(
                            lookup if broken is None else unless(broken, lookup), left_s
                        )
                    failed = failure()
                    if failed is not None:
                        raise failed from exc

    async def _connect(
        self, config: Config, worker: int, store_type: str, session: str
    ) -> StreamProtocol:
        headers = {CLIENT_HEADER: client_header(worker, store_type, session)}
        if config.staleness is not None:
            headers[STALENESS_HEADER] = str(config.staleness)
        if self._state.durable_note:
            headers[DURABLE_HEADER] = self._state.durable_note
        replay = self._state.replay_barriers() if self._state.reconnecting else None
        if replay is not None:
            headers[REPLAY_HEADER] = str(replay)
        options: dict[str, Any] = {
            "instance": self.instance,
            "timeout_s": config.timeouts.connect_s,
            "max_payload_bytes": MAX_PAYLOAD_BYTES,
            "headers": headers,
        }
        stream = _Stream(self)
        callbacks = (self._state.table.destinations, stream.on_message, stream.on_lost)
        if config.shm and self.local is not None and self.local[0] == config.host_id:
            try:
                stream.protocol = await open_stream(
                    self.host,
                    self.port,
                    config.token,
                    *callbacks,
                    local_path=self.local[1],
                    arena_bytes=config.shm_arena_bytes,
                    **options,
                )
                return stream.protocol
            except AuthError:
                raise
            except (TransportError, OSError) as exc:  # e.g. a server that died: try TCP
                path = self.local[1]
                level = logging.DEBUG if path == self._said_unreachable else logging.INFO
                if isinstance(exc, UntrustedPeerError):  # another user's socket: say so
                    level = logging.WARNING
                self._said_unreachable = path  # (a restart's retries say it once)
                log.log(level, "%s: no stream through %s (%r); trying TCP", self.name, path, exc)
        stream.protocol = await open_stream(
            self.host,
            self.port,
            config.token,
            *callbacks,
            ssl_context=client_ssl(config),
            **options,
        )
        return stream.protocol

    def _opened(self, protocol: StreamProtocol, loop: asyncio.AbstractEventLoop) -> None:
        self.protocol = protocol
        self._said_unreachable = None  # (a later failure of its socket is news again)
        self._handle(StreamOpened(self.index, protocol, protocol.shared is not None, loop.time()))

    async def relocate(self, rename_state: bool = False) -> None:
        """Ask the scheduler where the server is now (a restart moves it), and open streams
        there from now on; messages name where it is (with ``rename_state``, the state's
        too, at once). Unchanged when the scheduler does not say."""
        if self._locate is None:
            return
        entry = await self._locate(self.rank)
        if entry is not None:
            self.host, self.port = str(entry["host"]), int(entry["port"])
            self.local = local_address(entry)
            self.instance = server_instance(entry)
            self.name = server_name(self.rank, self.host, self.port)
            if rename_state:
                self._state.rename(self.name)

    def reconnect(self, delay_s: float) -> None:
        """In ``delay_s``, ask the scheduler where the server is and open the stream again
        (the state hears ``StreamOpened``, or ``ConnectFailed``)."""
        assert self._loop is not None
        self._reopening = self._loop.create_task(self._reopen(delay_s))

    async def _reopen(self, delay_s: float) -> None:
        assert self._opener is not None and self._loop is not None
        loop = self._loop
        wanted = self._state  # whether the state still wants the stream (not given up)
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            if wanted.reconnecting:
                await self.relocate()
            if not wanted.reconnecting:  # the job failed meanwhile, or the store left
                self._reopening = None
                return
            protocol = await self._connect(*self._opener)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the state decides what it means (classify)
            self._reopening = None
            self._handle(ConnectFailed(self.index, exc, loop.time()))
            return
        self._reopening = None
        if not wanted.reconnecting:
            protocol.close()
            return
        moved = "" if self.name == self._state.name else f" to {self.name}"
        log.warning(
            "worker %d: the stream to %s was cut (%r); reconnected%s, resending %d requests",
            self._opener[1],
            self._state.name,
            self._state.cut_cause,
            moved,
            self._state.outstanding(),
        )
        self._state.rename(self.name)
        self._opened(protocol, loop)

    # ------------------------------------------------------------ carrying out

    def send(self, send: Send) -> None:
        """Write the request frame the state decided (nothing while the stream is cut: the
        state sends it again on the next one)."""
        protocol = self.protocol
        if protocol is None:
            return
        try:
            protocol.write(
                encode_frame(send.op, send.seq, send.arrays, text=send.text, flags=send.flags)
            )
        except TransportError as exc:
            # The stream is gone (its loss may not have been reported yet): the request is
            # resent on the next stream.
            self._lost(protocol, exc)
            return
        if self.metrics is not None:
            self.metrics.sent(self._state.table, send)

    def _lost(self, protocol: StreamProtocol, exc: BaseException | None) -> None:
        if protocol is not self.protocol:
            return  # a stream that never became the link's, or was replaced
        self.protocol = None
        assert self._loop is not None
        self._handle(StreamCut(self.index, exc, self._loop.time()))

    async def request(
        self,
        op: int,
        arrays: Sequence[WireArray] = (),
        *,
        text: str = "",
        timeout_s: float,
        destinations: Sequence[memoryview] = (),
    ) -> Message:
        """Send one request to this server and wait for its reply (the control requests:
        init, optimizer, states, goodbye, checkpoint; the row-sparse ones). A reply's
        arrays land in ``destinations`` when they have exactly their sizes (else the reply
        is an error).

        Raises the server's error, or the job's failure.
        """
        return await self.issue(
            op, arrays, text=text, timeout_s=timeout_s, destinations=destinations
        )

    def issue(
        self,
        op: int,
        arrays: Sequence[WireArray] = (),
        *,
        text: str = "",
        timeout_s: float,
        destinations: Sequence[memoryview] = (),
    ) -> asyncio.Future[Message]:
        """:meth:`request`, sent now (before this returns: a request issued after it goes
        out after it on the stream); the future gets the reply or the error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Message] = loop.create_future()
        self._handle(
            RequestIssued(
                Answer(future), self.index, op, arrays, text, timeout_s, loop.time(), destinations
            )
        )
        return future

    def close(self) -> None:
        """Stop opening the stream again, and close it (the state was told the store
        leaves: its end is no loss)."""
        if self._reopening is not None:
            self._reopening.cancel()
            self._reopening = None
        if self.protocol is not None:
            self.protocol.close()


class _Stream:
    """One stream's callbacks: what arrives goes to the state; its end is the link's loss
    only while it is the link's stream (not one whose opening failed)."""

    __slots__ = ("link", "protocol")

    def __init__(self, link: ServerLink) -> None:
        self.link = link
        self.protocol: StreamProtocol | None = None

    def on_message(self, message: Message) -> None:
        link = self.link
        loop = link._loop
        assert loop is not None
        if link.metrics is not None:
            link.metrics.arrived(link._state.table, message)
        link._handle(FrameArrived(link.index, message, loop.time()))

    def on_lost(self, exc: BaseException | None) -> None:
        if self.protocol is not None:
            self.link._lost(self.protocol, exc)
