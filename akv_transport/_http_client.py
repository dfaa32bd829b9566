"""The control-plane HTTP client: :class:`HttpClient`.

Guarantees: every request is signed with the token (never sending it:
:mod:`akv_transport._auth`) and has a timeout; an answer that does not prove its sender holds
the token raises :class:`~akv_transport.errors.UnprovenPeerError` and is not used; connection errors
(refused, reset, DNS) are retried with exponential backoff and jitter, answers never are;
a non-2xx answer raises an error that names the request, the status and the server's
message (:class:`~akv_transport.errors.AuthError` for 401,
:class:`~akv_transport.errors.PayloadTooLargeError` for 413,
:class:`~akv_transport.errors.RemoteError` otherwise); JSON answers are decoded strictly
(:func:`akv_transport.parse_json`). Idle connections are kept :data:`CLIENT_KEEPALIVE_S`, below
any server's idle timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
import yarl

from akv_transport._auth import (
    INSTANCE_HEADER,
    INSTANCE_PROOF_HEADER,
    INSTANCES,
    PROOF_HEADER,
    check_proof,
    peer_of,
    sign,
)
from akv_transport._json import parse_json
from akv_transport.errors import (
    AuthError,
    PayloadTooLargeError,
    RemoteError,
    TransportError,
    UnprovenPeerError,
)

__all__ = ["CLIENT_KEEPALIVE_S", "CONNECTIONS_PER_HOST", "RETRIES", "HttpClient"]

#: Connection errors are retried this many times, with exponential backoff.
RETRIES = 5
RETRY_BACKOFF_S = 0.05
RETRY_BACKOFF_MAX_S = 2.0
#: Connections the client keeps open per host.
CONNECTIONS_PER_HOST = 8
#: How long the client keeps an idle connection for the next request (seconds): below a
#: server's idle timeout, so that it rarely sends on a connection the server is closing.
CLIENT_KEEPALIVE_S = 5.0


class HttpClient:
    """Control-plane requests to one base URL, signed with the token.

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
        self._token = token
        self._ssl = ssl_context
        self._timeout_s = timeout_s
        self._retries = retries
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            # A request after close() would open a session that nobody closes (aiohttp
            # warns "Unclosed client session" when it is collected).
            raise TransportError(f"{self.base_url}: the client is closed")
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit_per_host=CONNECTIONS_PER_HOST,
                keepalive_timeout=CLIENT_KEEPALIVE_S,
                ssl=self._ssl if self._ssl is not None else True,
            )
            self._session = aiohttp.ClientSession(connector=connector)
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
        parsed = yarl.URL(url)
        signed_path, peer = parsed.raw_path, peer_of(parsed)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeout_s)
        body = json.dumps(json_body).encode() if json_body is not None else data
        headers = {"Content-Type": "application/json"} if json_body is not None else {}
        delay = RETRY_BACKOFF_S
        attempt = asked_again = 0
        while True:
            instance = INSTANCES.get(peer)
            signed = sign(self._token, method, signed_path, instance)
            headers["Authorization"] = signed.header
            try:
                async with self._client().request(
                    method, url, data=body, params=params, timeout=timeout, headers=headers
                ) as response:
                    payload = await response.read()
                    status = response.status
                    answer = response.headers
            except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as exc:
                if attempt == self._retries:
                    raise TransportError(f"{method} {url} failed: {_reason(exc)}") from exc
                attempt += 1
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, RETRY_BACKOFF_MAX_S)
                continue
            except asyncio.TimeoutError as exc:
                raise TransportError(
                    f"{method} {url} got no answer within {timeout.total} s"
                ) from exc
            if status == 401:
                named = answer.get(INSTANCE_HEADER)
                # A first request, or one to a process that restarted: ask again, signed
                # for the instance named (once more at most, should it restart meanwhile).
                if asked_again < 2 and INSTANCES.learn(
                    peer,
                    named,
                    instance,
                    token=self._token,
                    mac=signed.mac,
                    named_proof=answer.get(INSTANCE_PROOF_HEADER),
                ):
                    asked_again += 1
                    continue
                raise AuthError(f"{method} {url}: 401 {_message(payload)}")
            if not check_proof(self._token, signed.mac, status, answer.get(PROOF_HEADER)):
                raise UnprovenPeerError(
                    f"{method} {url}: the answer ({status}) does not prove that its sender "
                    "holds the job's token; not used (another process may be posing as a "
                    "process of the job that is gone, or it runs an akv without answer proofs)"
                )
            if 200 <= status < 300:
                return status, payload
            message = _message(payload)
            if status == 413:
                raise PayloadTooLargeError(f"{method} {url}: 413 {message}")
            raise RemoteError(status, f"{method} {url}: {status} {message}")

    async def json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """Send JSON (or nothing), return the decoded JSON answer (decoded by
        :func:`parse_json`: a malformed one raises :class:`~akv_transport.errors.JSONError`)."""
        _, payload = await self.request(method, path, json_body=body, **kwargs)
        return parse_json(payload) if payload else None

    async def close(self) -> None:
        """Close the pooled connections; every request after this raises
        :class:`~akv_transport.errors.TransportError`. Idempotent."""
        self._closed = True
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


def _reason(exc: aiohttp.ClientError) -> str:
    """Why a connection failed, in the system's words where it gave some ("connection
    refused"), not aiohttp's internal repr."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, ssl.SSLError):  # (its errno is OpenSSL's, not the system's)
        return str(os_error)
    if isinstance(os_error, OSError):
        if os_error.errno is not None and os_error.errno > 0:
            return os.strerror(os_error.errno).lower()
        if os_error.strerror:
            return os_error.strerror.lower()
    return str(exc) or type(exc).__name__
