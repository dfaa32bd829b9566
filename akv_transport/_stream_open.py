"""The client's side of a stream's start: :func:`open_stream` connects, signs the upgrade
request (:mod:`akv_transport._auth`), checks the server's proof and hands back the
:class:`~akv_transport._stream.StreamProtocol`."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Literal

from akv_transport._auth import (
    INSTANCE_HEADER,
    INSTANCE_PROOF_HEADER,
    INSTANCES,
    PROOF_HEADER,
    Signed,
    check_instance,
    check_proof,
    sign,
)
from akv_transport._liveness import KeepAlive
from akv_transport._reader import Destinations, Message
from akv_transport._shm_stream import connect_local
from akv_transport._stream import UPGRADE_PROTOCOL, AskAgain, StreamProtocol
from akv_transport.errors import TransportError, UnprovenPeerError
from akv_transport.frame import DEFAULT_MAX_PAYLOAD_BYTES

__all__ = ["open_stream"]

#: Request headers that :func:`open_stream` writes itself, so a caller may not pass them.
_OWN_HEADERS = frozenset(
    {"host", "authorization", "connection", "upgrade", "content-length", "transfer-encoding"}
)
#: An HTTP header name (RFC 9110's token).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


async def open_stream(
    host: str,
    port: int,
    token: str,
    destinations: Destinations,
    on_message: Callable[[Message], None],
    on_lost: Callable[[BaseException | None], None],
    *,
    path: str = "/v1/stream",
    ssl_context: ssl.SSLContext | None = None,
    timeout_s: float = 30.0,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    headers: Mapping[str, str] | None = None,
    local_path: str | None = None,
    arena_bytes: int = 0,
    keepalive: KeepAlive | Literal["server"] | None = "server",
    instance: str | None = None,
) -> StreamProtocol:
    """Connect, authenticate and upgrade to a framed stream; return its protocol.

    With ``local_path`` (a :class:`~akv_transport._shm_stream.LocalSite`'s socket, on this
    host) the stream runs over that Unix socket instead of TCP to ``host:port``, and with
    ``arena_bytes`` it carries large payloads through shared memory
    (:mod:`akv_transport._shm_stream`): an arena of that many bytes for this side's, and the
    peer's.

    ``headers`` are sent with the upgrade request, in order and as given, for the
    application to read on the other side (``request.headers`` in ``stream_route``'s
    ``make_protocol``); nothing is sent beyond the authentication and the upgrade itself.

    ``keepalive``: the stream's liveness (:mod:`akv_transport._liveness`). ``"server"`` (the
    default): what the server's upgrade answer names (none if it names none), and until
    then the default ``silent_s`` bounds the wait for that answer; a :class:`KeepAlive`:
    those settings whatever the server runs; None: no liveness on this end.

    ``instance``: the server's instance, as a party that holds the token told it (akv's
    workers take it from the scheduler's address book): the upgrade is signed for it, and
    a server that names another (restarted, or another process on that address, which a
    process on a gone server's address could pass the request on to) is refused with a
    :class:`~akv_transport.errors.TransportError`; ask that party again. A ``401`` that
    does not prove its sender holds the token is then an
    :class:`~akv_transport.errors.UnprovenPeerError`, not an ``AuthError``: that party took
    this token, so the refusal is not the server's. None: learned from the server's first
    answer (:mod:`akv_transport._auth`).

    ``on_lost`` is called only for a stream this returned: a stream that ends before
    (during the upgrade, or right after it) makes this raise instead, and a connection
    this gives up on (a timeout, a refusal) is closed.

    Raises
    ------
    ValueError
        Before connecting, when a header name is not an HTTP token, a value holds a line
        break or a character outside Latin-1, or a name is one that the upgrade request
        sets itself (``Host``, ``Authorization``, ``Connection``, ``Upgrade``,
        ``Content-Length``, ``Transfer-Encoding``).
    AuthError
        When the server refused the token (401).
    RemoteError
        For any other refusal, with the HTTP status.
    TransportError
        When the connection failed or timed out (the cause is attached).
    """
    loop = asyncio.get_running_loop()

    own: KeepAlive | None
    if isinstance(keepalive, str):
        if keepalive != "server":
            raise ValueError(f"open_stream: keepalive {keepalive!r} is not 'server'")
        own, adopt = KeepAlive(), True
    else:
        own, adopt = keepalive, False
    made: list[StreamProtocol] = []
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    where = authority if local_path is None else f"{authority} through {local_path}"
    peer = authority  # (through local_path too: the same server, the same instance)
    if local_path is not None:
        authority = "localhost"
    extra = _header_lines(headers or {})
    # The instance and signature of the request last sent (request() makes each).
    used = ""
    signed: Signed | None = None

    def check_answer(status: int, answer: Mapping[str, str]) -> TransportError | None:
        assert signed is not None  # an answer comes to a request sent
        if status == 401:
            named = answer.get(INSTANCE_HEADER.lower())
            named_proof = answer.get(INSTANCE_PROOF_HEADER.lower())
            if instance is not None:  # told by a holder of the token: never another
                if not check_instance(token, signed.mac, named, named_proof):
                    # The party that named the instance took this token: not the server.
                    return UnprovenPeerError(
                        f"{where} refused the stream's upgrade (401) without proving that it "
                        "holds the job's token (another process may be posing as the server)"
                    )
                if named != instance:
                    return TransportError(
                        f"{where} is another instance of the server than the one named "
                        "(it restarted, or another process of the job answers there)"
                    )
                return None  # refused (out of time, replayed): _refusal says so
            if INSTANCES.learn(
                peer,
                named,
                used,
                token=token,
                mac=signed.mac,
                named_proof=named_proof,
            ):
                return AskAgain(f"{where} is another instance than this process knew")
            return None  # refused: _refusal says so
        if not check_proof(token, signed.mac, status, answer.get(PROOF_HEADER.lower())):
            return UnprovenPeerError(
                f"{where} answered the stream's upgrade ({status}) without proving that it "
                "holds the job's token; not used (another process may be posing as a server "
                "of the job that is gone, or it runs an akv without answer proofs)"
            )
        return None

    def factory() -> StreamProtocol:
        protocol = StreamProtocol(
            destinations,
            on_message,
            on_lost,
            max_payload_bytes=max_payload_bytes,
            handshake=True,
            keepalive=own,
            adopt_keepalive=adopt,
            check_answer=check_answer,
        )
        made.append(protocol)
        return protocol

    def request() -> bytes:
        nonlocal signed, used
        used = instance if instance is not None else INSTANCES.get(peer)
        signed = sign(token, "GET", path, used)
        return (
            f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: {signed.header}\r\n"
            f"Connection: Upgrade\r\nUpgrade: {UPGRADE_PROTOCOL}\r\n"
        ).encode("latin-1") + extra

    async def connect() -> StreamProtocol:
        protocol = await connect_once()
        # At most two answers that ask again (a first contact, a restart meanwhile): on the
        # connection the server kept, else on a new one.
        for asked in range(3):
            assert protocol.handshake_done is not None
            try:
                await protocol.handshake_done
                return protocol
            except AskAgain:
                if asked == 2:
                    raise
                if protocol.transport is None or protocol.transport.is_closing():
                    protocol.abort()
                    made.remove(protocol)
                    protocol = await connect_once()
                else:
                    protocol.ask_again(request())
        raise AssertionError("unreachable")  # pragma: no cover

    async def connect_once() -> StreamProtocol:
        """A new connection, its upgrade request sent."""
        if local_path is not None:
            sock, shared = await connect_local(
                local_path, token, arena_bytes=arena_bytes, timeout_s=timeout_s
            )
            try:
                transport, protocol = await loop.create_unix_connection(factory, sock=sock)
            except BaseException:
                sock.close()
                shared.close()
                raise
            protocol.share(shared)
        else:
            transport, protocol = await loop.create_connection(
                factory,
                host,
                port,
                ssl=ssl_context,
                server_hostname=host if ssl_context is not None else None,
            )
        transport.write(request())
        return protocol

    try:
        protocol = await asyncio.wait_for(connect(), timeout_s)
        if not protocol._handed_out():
            raise TransportError(
                f"the stream to {where} closed right after its upgrade: {protocol._end_cause!r}"
            )
        return protocol
    except BaseException as exc:
        for protocol in made:  # given up on: never left open, never reported lost
            protocol.abort()
        if isinstance(exc, TransportError) or not isinstance(
            exc, (OSError, asyncio.TimeoutError, ssl.SSLError)
        ):
            raise
        raise TransportError(f"cannot open a stream to {where}: {exc!r}") from exc


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """The request's extra header lines and the blank line that ends it, checked first."""
    lines = []
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"open_stream: {name!r} is not an HTTP header name")
        if name.lower() in _OWN_HEADERS:
            raise ValueError(f"open_stream: the upgrade request sets the {name} header itself")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise ValueError(f"open_stream: header {name}: {value!r} is not a one-line str")
        try:
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        except UnicodeEncodeError:
            raise ValueError(f"open_stream: header {name}: {value!r} is not Latin-1") from None
    lines.append(b"\r\n")
    return b"".join(lines)
