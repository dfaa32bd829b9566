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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from transport._stream import UPGRADE_PROTOCOL, StreamProtocol
from transport.errors import AuthError, PayloadTooLargeError, RemoteError, TransportError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY_BYTES",
    "HttpClient",
    "RequestError",
    "client_ssl_context",
    "create_app",
    "serve",
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

TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestError(Exception):
    """Raise in a handler to answer with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def create_app(token: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """An aiohttp application whose every route needs ``token``; add routes to it.

    Guarantees: a request with a wrong or missing token gets 401 before any handler runs;
    a body larger than ``max_body_bytes`` gets 413 (checked on Content-Length before the
    body is read, and while reading it); a :class:`RequestError` becomes its status with a
    JSON ``{"error": ...}``; any other exception becomes 500 with its message.
    """
    if not token:
        raise ValueError("create_app needs a non-empty token")
    expected = token.encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not hmac.compare_digest(_bearer(request).encode(), expected):
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
) -> tuple[web.AppRunner, int]:
    """Start ``app``; return its runner (``await runner.cleanup()`` stops it) and the port.

    It listens on ``host:port`` (port 0: any free port), or on ``sock`` when given (an
    inherited listening socket, so the port was chosen without a race).
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    if sock is not None:
        site: web.BaseSite = web.SockSite(runner, sock, ssl_context=ssl_context)
    else:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
    await site.start()
    addresses = runner.addresses  # (host, port, ...) of each listening socket
    bound: int = addresses[0][1] if addresses else port
    return runner, bound


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
        """Send JSON (or nothing), return the decoded JSON answer."""
        _, payload = await self.request(method, path, json_body=body, **kwargs)
        return json.loads(payload) if payload else None

    async def close(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _message(payload: bytes) -> str:
    try:
        decoded = json.loads(payload)
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
