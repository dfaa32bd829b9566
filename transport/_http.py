"""HTTP for what it is good at: routing, authentication, TLS, status codes, the control plane.

* :func:`create_app` builds an aiohttp application whose every route requires the job's
  token (``Authorization: Bearer <token>``, compared in constant time; 401 otherwise,
  before any handler runs), caps request bodies (413), and turns handler errors into
  JSON answers with a status code. :func:`stream_route` adds the route that upgrades a
  connection to a framed stream.
* :func:`serve` starts it on a host and port (127.0.0.1 unless told otherwise), or on an
  inherited listening socket.
* :class:`HttpClient` is the control-plane client: a keep-alive connection pool, timeouts,
  and retries with backoff on connection errors (never on answers).
* :func:`server_ssl_context` / :func:`client_ssl_context`: TLS is one option away.
* :func:`parse_json`: a strict JSON decoder for what peers send (bounded nesting, finite
  numbers, integers of at most 64 bits).

Hostile peers: a connection must send a whole request header within ``idle_timeout_s``
of connecting (a keep-alive one, of its last answer), and a request body must keep
arriving (never ``idle_timeout_s`` without a byte); one IP address may hold at most
``max_connections_per_peer`` connections at once; a stream, once upgraded, may be idle as
long as it likes. aiohttp's log lines lose any ``Authorization`` value, and a client's
malformed request is one short line, at most once per
:data:`CLIENT_MISTAKE_LOG_INTERVAL_S` per peer, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import math
import random
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import aiohttp
from aiohttp import web
from aiohttp.http import HttpProcessingError

from transport._shm_stream import DEFAULT_ARENA_BYTES, LocalSite, SharedMemory
from transport._stream import UPGRADE_PROTOCOL, StreamProtocol
from transport.errors import (
    AuthError,
    JSONError,
    PayloadTooLargeError,
    RemoteError,
    TransportError,
)

__all__ = [
    "CLIENT_MISTAKE_LOG_INTERVAL_S",
    "DEFAULT_HOST",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_JSON_MAX_DEPTH",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "HttpClient",
    "RequestError",
    "client_ssl_context",
    "create_app",
    "parse_json",
    "serve",
    "serve_local",
    "server_ssl_context",
    "stream_route",
]

log = logging.getLogger("transport.http")

#: Servers bind here unless given a host.
DEFAULT_HOST = "127.0.0.1"
#: Request bodies above this are refused with 413 (override per app).
DEFAULT_MAX_BODY_BYTES = 64 << 20
#: Connection errors are retried this many times, with exponential backoff.
RETRIES = 5
RETRY_BACKOFF_S = 0.05
RETRY_BACKOFF_MAX_S = 2.0
#: Connections the client keeps open per host.
CONNECTIONS_PER_HOST = 8
#: How long the client keeps an idle connection for the next request (seconds): below a
#: server's idle timeout, so that it rarely sends on a connection the server is closing.
CLIENT_KEEPALIVE_S = 5.0
#: A connection that has not sent a whole request header this long after it opened (or
#: after its last answer), or whose request body stalled this long, is closed (seconds).
DEFAULT_IDLE_TIMEOUT_S = 10.0
#: Connections one IP address may hold open at once; more are closed at once.
DEFAULT_MAX_CONNECTIONS_PER_PEER = 64
#: A client's mistakes (malformed requests, connections refused or timed out) are logged
#: at most once per this many seconds per peer address.
CLIENT_MISTAKE_LOG_INTERVAL_S = 60.0
#: JSON nested deeper than this is refused (``{}`` and ``[]`` have depth 1).
DEFAULT_JSON_MAX_DEPTH = 32
#: JSON integers must lie in ``[JSON_MIN_INT, JSON_MAX_INT]`` (what int64 and uint64 hold).
JSON_MIN_INT = -(1 << 63)
JSON_MAX_INT = (1 << 64) - 1

TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestError(Exception):
    """Raise in a handler to answer with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _bearer(request: web.Request) -> bytes:
    """The bearer token's bytes, as sent (b"" without one).

    aiohttp decodes header bytes that are not UTF-8 with ``surrogateescape``; encoding the
    same way gives back exactly the bytes on the wire, so any bytes compare (and fail)
    rather than raise.
    """
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    try:
        return value.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte decodes to
        return b""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def create_app(token: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """An aiohttp application whose every route needs ``token``; add routes to it.

    Guarantees: a request with a wrong or missing token (any bytes) gets 401 before any
    handler runs; a body larger than ``max_body_bytes`` gets 413 (checked on
    Content-Length before the body is read, and while reading it); a truncated or garbled
    body 400; a :class:`RequestError` becomes its status with a JSON ``{"error": ...}``;
    any other exception becomes 500 with its message (the only answer logged with a
    traceback: a client's mistake never is).
    """
    if not token:
        raise ValueError("create_app needs a non-empty token")
    expected = token.encode("utf-8", "surrogateescape")

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not hmac.compare_digest(_bearer(request), expected):
            return _error(401, "missing or wrong token")
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return _error(
                413, f"request body of {length} bytes exceeds the limit of {max_body_bytes} bytes"
            )
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(exc.status, exc.message)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        except web.HTTPException:
            raise
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            # The client's mistake (a truncated or garbled body): no traceback.
            return _error(400, f"the request body is malformed or truncated: {exc}")
        except ConnectionError:
            return _error(400, "the client disconnected")  # nobody reads it; nothing to log
        except Exception as exc:
            log.exception("handler for %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app[TOKEN_KEY] = token
    return app


def stream_route(
    app: web.Application,
    make_protocol: Callable[[web.Request], StreamProtocol],
    *,
    path: str = "/v1/stream",
) -> None:
    """Add ``GET path`` that upgrades an authenticated connection to a framed stream.

    ``make_protocol(request)`` builds the server side's protocol; the handler returns when
    the stream is closed. Requests without ``Upgrade: akv-stream/1`` get 426.
    """

    async def upgrade(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() != UPGRADE_PROTOCOL:
            raise RequestError(426, f"this route needs 'Upgrade: {UPGRADE_PROTOCOL}'")
        transport = request.transport
        if transport is None:
            raise RequestError(400, "the connection is gone")
        protocol = make_protocol(request)
        guard = transport.get_protocol()
        if isinstance(guard, _Guard) and guard.shared is not None:
            protocol.share(guard.shared)
            guard.shared = None
        response = web.StreamResponse(
            status=101, headers={"Upgrade": UPGRADE_PROTOCOL, "Connection": "Upgrade"}
        )
        await response.prepare(request)
        # From here on the connection is no longer HTTP: the stream protocol takes the
        # transport over (as aiohttp's own WebSocket support does with its parser).
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        transport.resume_reading()
        await protocol.wait_closed()
        return response

    app.router.add_get(path, upgrade)


async def serve(
    app: web.Application,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    ssl_context: ssl.SSLContext | None = None,
    sock: socket.socket | None = None,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    max_connections_per_peer: int | None = DEFAULT_MAX_CONNECTIONS_PER_PEER,
) -> tuple[web.AppRunner, int]:
    """Start ``app``; return its runner (``await runner.cleanup()`` stops it) and the port.

    It listens on ``host:port`` (port 0: any free port), or on ``sock`` when given (an
    inherited listening socket, so the port was chosen without a race).

    What one peer may hold (None: no bound):

    * ``idle_timeout_s``: a connection that has not sent a whole request header this long
      after it opened (with TLS: the handshake too), or after its last answer
      (keep-alive), is closed, however slowly it trickles bytes; so is one whose request
      body sent nothing for this long. An upgraded stream is never closed for being idle,
      nor is a request whose handler takes its time.
    * ``max_connections_per_peer``: connections open at once from one IP address, streams
      included; one more is closed as soon as it is accepted.

    Listening on any address but a loopback one without ``ssl_context`` logs a warning:
    the token would cross the network in clear text.
    """
    if idle_timeout_s is not None and not (math.isfinite(idle_timeout_s) and idle_timeout_s > 0):
        raise ValueError(f"idle_timeout_s must be positive seconds or None, not {idle_timeout_s}")
    if max_connections_per_peer is not None and max_connections_per_peer < 1:
        raise ValueError(
            f"max_connections_per_peer must be at least 1 or None, not {max_connections_per_peer}"
        )
    _install_log_filter()
    if _track_request not in app.middlewares:
        app.middlewares.insert(0, _track_request)
    options: dict[str, Any] = {}
    if idle_timeout_s is not None:  # aiohttp's keep-alive timer: idle between requests
        options["keepalive_timeout"] = idle_timeout_s
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **options)
    await runner.setup()
    handlers = runner.server
    assert handlers is not None  # set up above
    connections = _Connections(handlers, idle_timeout_s, max_connections_per_peer)
    site = _Site(runner, connections, host, port, sock, ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    addresses = runner.addresses  # (host, port, ...) of each listening socket
    bound: int = addresses[0][1] if addresses else port
    if ssl_context is None:
        exposed = [a for a in addresses if isinstance(a, tuple) and not _is_loopback(a[0])]
        if exposed:
            log.warning(
                "listening on %s without TLS: the job's token and every request cross the "
                "network in clear text, readable by anyone on the path; use TLS, or bind a "
                "loopback address (127.0.0.1)",
                ", ".join(_format_address(a[0], a[1]) for a in exposed),
            )
    return runner, bound


async def serve_local(
    runner: web.AppRunner,
    token: str,
    *,
    arena_bytes: int = DEFAULT_ARENA_BYTES,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    parent_directory: str | None = None,
) -> LocalSite:
    """Serve ``runner``'s application (started by :func:`serve`) to processes on this host
    too, through a private Unix socket whose streams share memory
    (:mod:`transport._shm_stream`; ``arena_bytes`` 0: they share none); ``site.path`` is
    the socket's path, for :func:`open_stream`'s ``local_path``, and ``await site.close()``
    stops it (before ``runner.cleanup()``).

    Connections must send the token before anything else; idle ones are closed as on
    :func:`serve`'s listener.

    Raises
    ------
    TransportError
        When the socket cannot be created.
    """
    handlers = runner.server
    if handlers is None:
        raise TransportError("serve_local: the runner is not set up (call serve() first)")
    connections = _Connections(handlers, idle_timeout_s, None)
    loop = asyncio.get_running_loop()

    async def adopt(sock: socket.socket, shared: SharedMemory) -> None:
        guard = connections.protocol()
        guard.shared = shared
        try:
            await loop.connect_accepted_socket(lambda: guard, sock)
        except BaseException:
            sock.close()
            if guard.shared is not None:
                guard.shared.close()
            raise

    return LocalSite(token, adopt, arena_bytes=arena_bytes, parent_directory=parent_directory)


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address as bound, or a name) is a loopback address."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Site(web.BaseSite):
    """A listener (on ``host:port``, or on an inherited ``sock``) whose connections pass
    through a :class:`_Connections` and whose TLS handshakes have the idle deadline too:
    aiohttp's own sites offer neither."""

    def __init__(
        self,
        runner: web.AppRunner,
        connections: _Connections,
        host: str,
        port: int,
        sock: socket.socket | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._connections = connections
        self._host = host
        self._port = port
        self._sock = sock

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{_format_address(self._host, self._port)}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        handshake_s = self._connections.idle_timeout_s if self._ssl_context is not None else None
        if self._sock is not None:
            self._server = await loop.create_server(
                self._connections.protocol,
                sock=self._sock,
                ssl=self._ssl_context,
                backlog=self._backlog,
                ssl_handshake_timeout=handshake_s,
            )
        else:
            self._server = await loop.create_server(
                self._connections.protocol,
                self._host,
                self._port,
                ssl=self._ssl_context,
                backlog=self._backlog,
                reuse_address=True,
                ssl_handshake_timeout=handshake_s,
            )


class _Connections:
    """The open connections of one listener: how many each peer address holds."""

    def __init__(
        self,
        handlers: Callable[[], asyncio.Protocol],
        idle_timeout_s: float | None,
        max_per_peer: int | None,
    ) -> None:
        self._handlers = handlers  # aiohttp's Server: makes the HTTP protocol of a connection
        self.idle_timeout_s = idle_timeout_s
        self.max_per_peer = max_per_peer
        self.per_peer: dict[str, int] = {}

    def protocol(self) -> _Guard:
        """The protocol factory of the listener."""
        return _Guard(self, self._handlers())

    def admit(self, peer: str) -> bool:
        """Count a new connection of ``peer``; False (and not counted) past the limit."""
        count = self.per_peer.get(peer, 0)
        if self.max_per_peer is not None and count >= self.max_per_peer:
            if _MISTAKES.allow(peer, "crowd"):
                log.warning(
                    "closed a connection from %s at once: it holds %d already, the most one "
                    "address may (further ones from it are not logged for %g s)",
                    peer,
                    count,
                    _MISTAKES.interval_s,
                )
            return False
        self.per_peer[peer] = count + 1
        return True

    def release(self, peer: str) -> None:
        count = self.per_peer.get(peer, 0) - 1
        if count > 0:
            self.per_peer[peer] = count
        else:
            self.per_peer.pop(peer, None)


class _Guard(asyncio.Protocol):
    """Stands between one connection and aiohttp's protocol for it (to which it passes
    every event): counts the connection against its peer, and closes it when its request
    header is late or its request body stalls. :func:`_track_request` tells it when a
    request's header arrived and when its handler returned."""

    def __init__(self, connections: _Connections, inner: asyncio.Protocol) -> None:
        self._connections = connections
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.peer = "?"
        self._counted = False
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_header = False
        self._body: aiohttp.StreamReader | None = None
        self._last_data = 0.0
        #: The memory shared with a peer on this host, until its stream takes it over.
        self.shared: SharedMemory | None = None

    # -------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A full transport (not checked: uvloop's do not derive from asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self.peer = _peer_address(transport)
        if not self._connections.admit(self.peer):
            self._transport.abort()
            return
        self._counted = True
        timeout = self._connections.idle_timeout_s
        if timeout is not None:
            self._waiting_header = True
            self._timer = self._loop.call_later(timeout, self._expired)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._body is not None and self._loop is not None:
            self._last_data = self._loop.time()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._counted:
            self._release()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._counted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._counted:
            self._inner.resume_writing()

    # -------------------------------------------------------------- the request cycle

    def request_started(self, body: aiohttp.StreamReader) -> None:
        """A request's header arrived: from now on only its body may be late."""
        self._waiting_header = False
        self._stop_timer()
        timeout = self._connections.idle_timeout_s
        if timeout is None or body.is_eof() or self._loop is None:
            return
        self._body = body
        self._last_data = self._loop.time()
        self._timer = self._loop.call_later(timeout, self._expired)

    def request_finished(self) -> None:
        """The request's handler returned; aiohttp's keep-alive timer takes over."""
        self._body = None
        self._stop_timer()
        transport = self._transport
        if self._counted and transport is not None and transport.get_protocol() is not self:
            # It was upgraded to a stream, which ended (or its handler failed): neither
            # this guard nor aiohttp's protocol hears of the connection any more.
            self._release()

    def _expired(self) -> None:
        self._timer = None
        timeout = self._connections.idle_timeout_s
        if timeout is None or self._loop is None or self._transport is None:
            return
        if self._waiting_header:
            self._close_idle(f"sent no whole request header within {timeout:g} s")
            return
        body = self._body
        if body is None or body.is_eof():
            return  # the handler has the whole request: its time is its own
        silent = self._loop.time() - self._last_data
        if silent >= timeout:
            self._close_idle(f"sent nothing of its request body for {timeout:g} s")
        else:
            self._timer = self._loop.call_later(timeout - silent, self._expired)

    def _close_idle(self, why: str) -> None:
        if _MISTAKES.allow(self.peer, "idle"):
            log.info(
                "closed a connection from %s: it %s (further ones from it are not logged for %g s)",
                self.peer,
                why,
                _MISTAKES.interval_s,
            )
        if self._transport is not None:
            self._transport.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._connections.release(self.peer)


@web.middleware
async def _track_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection's :class:`_Guard` that a request's header arrived, and when
    its handler returned (:func:`serve` puts it first in every app)."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, _Guard):
        return await handler(request)
    guard.request_started(request.content)
    try:
        return await handler(request)
    finally:
        guard.request_finished()


def _peer_address(transport: asyncio.BaseTransport) -> str:
    peername = transport.get_extra_info("peername")
    if isinstance(peername, (tuple, list)) and peername:
        return str(peername[0])
    return str(peername) if peername else "?"


# ---------------------------------------------------------------------- logging


class _PerPeer:
    """Whether to log a peer's mistake of one kind now: at most once per ``interval_s``
    per address and kind, remembering at most :attr:`MAX_PEERS` of them (past that,
    nothing new is logged until old ones expire: a flood from many addresses cannot fill
    the log either)."""

    MAX_PEERS = 4096

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._pruned = 0.0

    def allow(self, peer: str, kind: str) -> bool:
        now = time.monotonic()
        key = (peer, kind)
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        if last is None and len(self._last) >= self.MAX_PEERS:
            if now - self._pruned < 1.0:
                return False
            self._pruned = now
            self._last = {p: t for p, t in self._last.items() if now - t < self.interval_s}
            if len(self._last) >= self.MAX_PEERS:
                return False
        self._last[key] = now
        return True

    def clear(self) -> None:
        self._last.clear()


_MISTAKES = _PerPeer(CLIENT_MISTAKE_LOG_INTERVAL_S)
#: What aiohttp raises for a request it cannot parse: the client's mistake, never ours.
_CLIENT_MISTAKES: tuple[type[BaseException], ...] = (HttpProcessingError, web.RequestPayloadError)
#: aiohttp's loggers (on the server side, ``aiohttp.server`` logs malformed requests).
_AIOHTTP_LOGGERS = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)
#: A credential, and whatever follows it on its line.
_SECRET = re.compile(r"(authorization|bearer)[^\r\n]*", re.IGNORECASE)


def _redact(text: str) -> str:
    return _SECRET.sub(lambda match: f"{match.group(1)} <redacted>", text)


class _AiohttpLogFilter(logging.Filter):
    """On aiohttp's loggers: a client's malformed request becomes one short line (no
    traceback, no request bytes, at most once per peer per interval), and whatever
    follows ``Authorization`` or ``Bearer`` in any other line or traceback is redacted."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, _CLIENT_MISTAKES):
            args = record.args
            peer = str(args[0]) if isinstance(args, tuple) and args else "?"
            if not _MISTAKES.allow(peer, "malformed"):
                return False
            record.msg = (
                "answered a malformed HTTP request from %s with 400 (%s; further ones from "
                "it are not logged for %g s)"
            )
            record.args = (peer, type(exc).__name__, _MISTAKES.interval_s)
            record.exc_info = None
            record.exc_text = None
            record.stack_info = None
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken record: logging reports it itself
            return True
        redacted = _redact(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        if record.exc_info is not None and record.exc_info[0] is not None:
            record.exc_text = _redact(self._formatter.formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = _redact(record.stack_info)
        return True


_LOG_FILTER = _AiohttpLogFilter()


def _install_log_filter() -> None:
    """Put :class:`_AiohttpLogFilter` on aiohttp's loggers (once)."""
    for name in _AIOHTTP_LOGGERS:
        logging.getLogger(name).addFilter(_LOG_FILTER)


# ---------------------------------------------------------------------- JSON


def _refuse_constant(name: str) -> Any:
    raise JSONError(f"{name} is not a number: JSON numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONError(f"the number {text[:40]} is out of range: JSON numbers must be finite")
    return value


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= 20 else None  # 20 characters hold any 64-bit integer
    if value is None or not JSON_MIN_INT <= value <= JSON_MAX_INT:
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} digits)"
        raise JSONError(f"the integer {shown} does not fit in 64 bits")
    return value


_DECODER = json.JSONDecoder(
    parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_refuse_constant
)
_BRACKETS = {"[": 1, "{": 1, "]": -1, "}": -1}
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _nesting(text: str) -> int:
    """How deeply JSON ``text`` nests, in linear time and without recursion.

    Exact for valid JSON; for other text, some number (the decoder refuses it anyway).
    Inside a string, escaped backslashes go first, then escaped quotes: what remains of
    each string lies between two plain quotes, so the text outside strings is every other
    piece between quotes.
    """
    plain = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", "".join(plain.split('"')[::2]))
    return max(itertools.accumulate(map(_BRACKETS.__getitem__, brackets)), default=0)


def parse_json(
    text: str | bytes | bytearray | memoryview, *, max_depth: int = DEFAULT_JSON_MAX_DEPTH
) -> Any:
    """Decode JSON from a peer, strictly.

    Besides malformed text, it refuses (with :class:`~transport.errors.JSONError`, a
    ``ValueError``): bytes that are not UTF-8; nesting deeper than ``max_depth`` (checked
    before decoding, in linear time, so the decoder never recurses deeper); ``NaN``,
    ``Infinity`` and numbers that overflow a float (``1e999``); integers outside
    ``[JSON_MIN_INT, JSON_MAX_INT]``. Nothing else escapes it.
    """
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONError(f"JSON text must be UTF-8: {exc}") from None
    # A text with fewer brackets than the bound cannot nest deeper: no scan for it.
    if text.count("[") + text.count("{") > max_depth:
        depth = _nesting(text)
        if depth > max_depth:
            raise JSONError(f"JSON nested {depth} levels deep; at most {max_depth} are accepted")
    try:
        return _DECODER.decode(text)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError(f"JSON nested too deeply; at most {max_depth} are accepted") from None
    except (ValueError, OverflowError) as exc:
        raise JSONError(f"not valid JSON: {exc}") from None


class HttpClient:
    """Control-plane requests to one base URL, carrying the token.

    Connection errors (refused, reset, DNS) are retried ``retries`` times with exponential
    backoff, so requests must be idempotent (akv's are: they carry the caller's id and
    sequence numbers); answers are never retried. Every request has a timeout.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 30.0,
        retries: int = RETRIES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._ssl = ssl_context
        self._timeout_s = timeout_s
        self._retries = retries
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit_per_host=CONNECTIONS_PER_HOST,
                keepalive_timeout=CLIENT_KEEPALIVE_S,
                ssl=self._ssl if self._ssl is not None else True,
            )
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | memoryview | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """Send a request; return (status, body) for a 2xx answer.

        Raises
        ------
        AuthError
            401: the token was refused.
        PayloadTooLargeError
            413.
        RemoteError
            Any other non-2xx answer (``.status``, and the server's message).
        TransportError
            When the connection failed after all retries, or the request timed out.
        """
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeout_s)
        body = json.dumps(json_body).encode() if json_body is not None else data
        headers = {"Content-Type": "application/json"} if json_body is not None else None
        delay = RETRY_BACKOFF_S
        for attempt in range(self._retries + 1):
            try:
                async with self._client().request(
                    method, url, data=body, params=params, timeout=timeout, headers=headers
                ) as response:
                    payload = await response.read()
                    status = response.status
            except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as exc:
                if attempt == self._retries:
                    raise TransportError(f"{method} {url} failed: {exc!r}") from exc
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, RETRY_BACKOFF_MAX_S)
                continue
            except asyncio.TimeoutError as exc:
                raise TransportError(
                    f"{method} {url} got no answer within {timeout.total} s"
                ) from exc
            if 200 <= status < 300:
                return status, payload
            message = _message(payload)
            if status == 401:
                raise AuthError(f"{method} {url}: 401 {message}")
            if status == 413:
                raise PayloadTooLargeError(f"{method} {url}: 413 {message}")
            raise RemoteError(status, f"{method} {url}: {status} {message}")
        raise TransportError(f"{method} {url} failed")  # pragma: no cover - loop always returns

    async def json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """Send JSON (or nothing), return the decoded JSON answer (decoded by
        :func:`parse_json`: a malformed one raises :class:`~transport.errors.JSONError`)."""
        _, payload = await self.request(method, path, json_body=body, **kwargs)
        return parse_json(payload) if payload else None

    async def close(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _message(payload: bytes) -> str:
    try:
        decoded = parse_json(payload)
        if isinstance(decoded, dict) and "error" in decoded:
            return str(decoded["error"])
    except ValueError:
        pass
    return payload.decode("utf-8", "replace")[:500]


def server_ssl_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a server; with ``ca``, clients must present a certificate it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if ca:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a client that trusts ``ca``; ``cert``/``key`` for mutual TLS."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert and key:
        context.load_cert_chain(cert, key)
    return context
