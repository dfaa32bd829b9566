"""The aiohttp server of the control plane: routing, authentication, body limits, listening.

* :func:`create_app` builds an aiohttp application whose every route requires the job's
  token (a request signed with it, :mod:`akv_transport._auth`, whose answer then proves
  the server holds it too; or ``Authorization: Bearer <token>``, compared in constant
  time; 401 otherwise, before any handler runs), caps request bodies (413), and turns
  handler errors into JSON answers with a status code (:class:`RequestError` for a chosen one).
  :func:`stream_route` adds the route that upgrades a connection to a framed stream;
  :func:`public_route` one that answers without the token (health probes).
* :func:`serve` starts it on a host and port (127.0.0.1 unless told otherwise), or on an
  inherited listening socket, every connection behind the bounds of
  :mod:`akv_transport._http_guard` (idle and slow connections time out; connections that have
  not authenticated are capped per address and in all, apart from the authenticated ones,
  which they never displace) and aiohttp's logs behind the filter of
  :mod:`akv_transport._http_log` (no token, no traceback for a client's mistake); listening
  beyond loopback without TLS logs a warning. :func:`serve_local` serves the same
  application to processes on this host.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web, web_app

from akv_transport._admission import Admission, check_bound
from akv_transport._auth import (
    INSTANCE_HEADER,
    INSTANCE_PROOF_HEADER,
    PROOF_HEADER,
    Verifier,
    instance_proof,
    is_signed,
    proof,
)
from akv_transport._http_guard import Connections, Guard, Handler, authenticate, track_request
from akv_transport._http_log import CLIENT_MISTAKES, install_log_filter, log
from akv_transport._shm_stream import DEFAULT_ARENA_BYTES, LocalSite, SharedMemory
from akv_transport._stream import UPGRADE_PROTOCOL, StreamProtocol
from akv_transport.errors import TransportError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_PROBATION",
    "DEFAULT_MAX_STRANGERS",
    "DEFAULT_MAX_STRANGERS_PER_PEER",
    "DEFAULT_PROBATION_S",
    "RequestError",
    "app_instance",
    "create_app",
    "public_route",
    "serve",
    "serve_local",
    "stream_route",
]

#: Servers bind here unless given a host.
DEFAULT_HOST = "127.0.0.1"
#: Request bodies above this are refused with 413 (override per app).
DEFAULT_MAX_BODY_BYTES = 64 << 20
#: A connection that has not sent a whole request header this long after it opened (or
#: after its last answer), or whose request body stalled this long, is closed (seconds).
DEFAULT_IDLE_TIMEOUT_S = 10.0
#: Authenticated connections (a request on them carried the token) one IP address may hold
#: open at once, streams included; a new connection from an address that holds this many
#: is closed at once. Generous: it bounds a buggy process, not a stranger.
DEFAULT_MAX_CONNECTIONS_PER_PEER = 256
#: Connections that have not authenticated (yet) one IP address may hold open at once, each
#: for the idle timeout at most; they never count against the authenticated ones.
DEFAULT_MAX_STRANGERS_PER_PEER = 64
#: The same, all addresses together (so that many addresses cannot exhaust descriptors).
DEFAULT_MAX_STRANGERS = 256
#: A new connection that finds the strangers' places taken is on probation: closed unless a
#: request on it carries the token within this many seconds (twice this for one that sent
#: bytes, whose token check may be late); a job's own connection sends one at once.
DEFAULT_PROBATION_S = 0.5
#: Connections on probation at once, all addresses together; past this, the oldest (first
#: those that sent nothing) are closed to make room for new ones.
DEFAULT_MAX_PROBATION = 64

TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)
INSTANCE_KEY: web.AppKey[str] = web.AppKey("instance", str)
#: An accepted signed request's MAC (:mod:`akv_transport._auth`), which its answer's proof
#: covers.
MAC_KEY: web.RequestKey[str] = web.RequestKey("mac", str)
#: The resources of the app's routes that need no token (:func:`public_route`).
PUBLIC_KEY: web.AppKey[set[web.AbstractResource]] = web.AppKey("public", set)
#: The methods a public route answers without the token.
_PUBLIC_METHODS = frozenset({"GET", "HEAD"})


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

    Guarantees: a request with a wrong or missing token (any bytes), a signed request
    replayed, for another instance of this app or out of its time window gets 401 before
    any handler runs (a signed one's names this app's instance in ``AKV-Instance``); an
    accepted signed request's answer, whatever its status, carries ``AKV-Proof``
    (:mod:`akv_transport._auth`); one with the token makes its connection authenticated
    (on a listener of :func:`serve`: 503, and the connection closed, when its address
    holds all the authenticated connections it may); a body larger than
    ``max_body_bytes`` gets 413 (checked on Content-Length before the body is read, and
    while reading it); a truncated or garbled body 400; a :class:`RequestError` becomes
    its status with a JSON ``{"error": ...}``; any other exception becomes 500 with its
    message (the only answer logged with a traceback: a client's mistake never is).
    """
    if not token:
        raise ValueError("create_app needs a non-empty token")
    expected = token.encode("utf-8", "surrogateescape")
    verifier = Verifier(expected)
    public: set[web.AbstractResource] = set()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        mac = None
        # The route aiohttp matched, not the path as written: no spelling of another
        # route's path reaches it without the token.
        if request.method not in _PUBLIC_METHODS or request.match_info.route.resource not in public:
            header = request.headers.get("Authorization", "")
            if is_signed(header):
                verdict = verifier.check(header, request.method, request.rel_url.raw_path)
                if verdict.mac is None:
                    refused = _error(401, verdict.reason)
                    refused.headers[INSTANCE_HEADER] = verifier.instance
                    if verdict.claimed:  # (a right MAC: its sender holds the token)
                        refused.headers[INSTANCE_PROOF_HEADER] = instance_proof(
                            expected, verdict.claimed, verifier.instance
                        )
                    return refused
                mac = request[MAC_KEY] = verdict.mac
            elif not hmac.compare_digest(_bearer(request), expected):
                return _error(401, "missing or wrong token")
            if not authenticate(request):
                refused = _error(
                    503, "this address holds all the authenticated connections it may; retry later"
                )
                refused.force_close()
                return _proven(refused, mac)
        try:
            response = await _answer(request, handler)
        except web.HTTPException as exc:
            if mac is not None:
                exc.headers[PROOF_HEADER] = proof(expected, mac, exc.status)
            raise
        return _proven(response, mac)

    def _proven(response: web.StreamResponse, mac: str | None) -> web.StreamResponse:
        if mac is not None and not response.prepared:
            response.headers[PROOF_HEADER] = proof(expected, mac, response.status)
        return response

    async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        except CLIENT_MISTAKES as exc:
            # The client's mistake (a truncated or garbled body): no traceback.
            return _error(400, f"the request body is malformed or truncated: {exc}")
        except ConnectionError:
            return _error(400, "the client disconnected")  # nobody reads it; nothing to log
        except Exception as exc:
            log.exception("handler for %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app[TOKEN_KEY] = token
    app[PUBLIC_KEY] = public
    app[INSTANCE_KEY] = verifier.instance
    return app


def app_instance(app: web.Application) -> str:
    """The instance of ``app`` (made by :func:`create_app`): what signed requests to it
    must name (:mod:`akv_transport._auth`). Not a secret: tell it to the clients (the
    scheduler's address book does), so that they sign for it from their first request
    and never take another's from an answer."""
    return app[INSTANCE_KEY]


def public_route(app: web.Application, path: str, handler: Handler) -> None:
    """Add ``GET path`` (and ``HEAD``) to ``app`` (made by :func:`create_app`), answered
    without the token: for what anyone who reaches the port may know (a health probe's
    "ok"), never for the job's data.

    A request on it does not authenticate its connection: the connection stays a
    stranger's, within the strangers' budgets of :func:`serve`. Its other methods, and
    every other route, still need the token.
    """
    resource = app.router.add_get(path, handler).resource
    assert resource is not None  # a route added to a router has its resource
    app[PUBLIC_KEY].add(resource)


def stream_route(
    app: web.Application,
    make_protocol: Callable[[web.Request], StreamProtocol],
    *,
    path: str = "/v1/stream",
) -> None:
    """Add ``GET path`` that upgrades an authenticated connection to a framed stream.

    ``make_protocol(request)`` builds the server side's protocol; the handler returns when
    the stream is closed. The upgrade answer names the protocol's liveness settings, which
    the client adopts (:meth:`StreamProtocol.upgrade_headers`). A stream whose upgrade
    fails (the client went away) is reported lost all the same. Requests without
    ``Upgrade: akv-stream/1`` get 426.
    """

    async def upgrade(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() != UPGRADE_PROTOCOL:
            raise RequestError(426, f"this route needs 'Upgrade: {UPGRADE_PROTOCOL}'")
        transport = request.transport
        if transport is None:
            raise RequestError(400, "the connection is gone")
        protocol = make_protocol(request)
        guard = transport.get_protocol()
        if isinstance(guard, Guard) and guard.shared is not None:
            protocol.share(guard.shared)
            guard.shared = None
        headers = {
            "Upgrade": UPGRADE_PROTOCOL,
            "Connection": "Upgrade",
            **protocol.upgrade_headers(),
        }
        mac = request.get(MAC_KEY)
        if mac is not None:  # (prepared here: the guard cannot add it afterwards)
            headers[PROOF_HEADER] = proof(request.app[TOKEN_KEY], mac, 101)
        response = web.StreamResponse(status=101, headers=headers)
        # A stream that never starts (the client went away) is reported lost all the same:
        # the application admitted it in make_protocol.
        try:
            await response.prepare(request)
        except BaseException as exc:
            transport.abort()
            protocol.connection_lost(exc if isinstance(exc, Exception) else None)
            raise
        if transport.is_closing():
            protocol.connection_lost(ConnectionResetError("the connection closed at the upgrade"))
            return response
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
    max_strangers_per_peer: int | None = DEFAULT_MAX_STRANGERS_PER_PEER,
    max_strangers: int | None = DEFAULT_MAX_STRANGERS,
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
    * ``max_connections_per_peer``: authenticated connections (a request on them passed the
      token check) open at once from one IP address, streams included; a new connection
      from an address that holds this many is closed as soon as it is accepted.
    * ``max_strangers_per_peer`` (never more than ``max_connections_per_peer``) and
      ``max_strangers``: connections not yet authenticated, per IP address and in all.
      They never count against the authenticated ones, and never take their place: a new
      connection that finds the strangers' places taken is on probation, closed unless it
      authenticates within :data:`DEFAULT_PROBATION_S` (at most :data:`DEFAULT_MAX_PROBATION`
      at once; the oldest make room for new ones). A connection of the job sends its
      request with the token at once, so strangers holding idle connections cannot keep
      it out.

    Listening on any address but a loopback one without ``ssl_context`` logs a warning:
    the token would cross the network in clear text.
    """
    if idle_timeout_s is not None and not (math.isfinite(idle_timeout_s) and idle_timeout_s > 0):
        raise ValueError(f"idle_timeout_s must be positive seconds or None, not {idle_timeout_s}")
    check_bound("max_connections_per_peer", max_connections_per_peer)
    check_bound("max_strangers_per_peer", max_strangers_per_peer)
    check_bound("max_strangers", max_strangers)
    admission: Admission[Guard] = Admission(
        max_authenticated_per_peer=max_connections_per_peer,
        max_strangers_per_peer=max_strangers_per_peer,
        max_strangers=max_strangers,
        max_probation=DEFAULT_MAX_PROBATION,
    )
    install_log_filter()
    if track_request not in app.middlewares:
        app.middlewares.insert(0, track_request)
    if _forget_handlers not in app.on_cleanup:
        app.on_cleanup.append(_forget_handlers)
    options: dict[str, Any] = {}
    if idle_timeout_s is not None:  # aiohttp's keep-alive timer: idle between requests
        options["keepalive_timeout"] = idle_timeout_s
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **options)
    await runner.setup()
    handlers = runner.server
    assert handlers is not None  # set up above
    connections = Connections(handlers, idle_timeout_s, admission, DEFAULT_PROBATION_S)
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
    (:mod:`akv_transport._shm_stream`; ``arena_bytes`` 0: they share none); ``site.path`` is
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
    unbounded: Admission[Guard] = Admission(
        max_authenticated_per_peer=None,
        max_strangers_per_peer=None,
        max_strangers=None,
        max_probation=0,
    )  # the peers authenticated on the socket already, and are this host's processes
    connections = Connections(handlers, idle_timeout_s, unbounded, DEFAULT_PROBATION_S)
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


async def _forget_handlers(app: web.Application) -> None:
    """Clear aiohttp's cache of request handlers wrapped in their middlewares
    (``web_app._cached_build_middleware``, per process, up to 1,024 handlers) as ``app``
    stops: it holds each handler, and a handler bound to a server holds the server and the
    values it stores, long after the app stopped (16 MB a job of a process that runs its
    servers in-process, test after test). Other apps only build theirs again."""
    cached = getattr(web_app, "_cached_build_middleware", None)
    clear = getattr(cached, "cache_clear", None)
    if clear is not None:
        clear()


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
    through a :class:`Connections` and whose TLS handshakes have the idle deadline too:
    aiohttp's own sites offer neither."""

    def __init__(
        self,
        runner: web.AppRunner,
        connections: Connections,
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
        where: dict[str, Any] = (
            {"sock": self._sock}
            if self._sock is not None
            else {"host": self._host, "port": self._port, "reuse_address": True}
        )
        self._server = await loop.create_server(
            self._connections.protocol,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=handshake_s,
            **where,
        )
