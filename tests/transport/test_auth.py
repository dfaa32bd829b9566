"""Requests signed with the token, never sending it, and answers that prove their sender
(akv_transport._auth): the rules alone, then akv's HTTP client and streams against a real
server, a process posing as one (it took a gone server's port) and a replayed request."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from akv_transport import (
    AuthError,
    HttpClient,
    RemoteError,
    TransportError,
    UnprovenPeerError,
    app_instance,
    create_app,
    open_stream,
    serve,
    stream_route,
)
from akv_transport._auth import (
    INSTANCE_HEADER,
    INSTANCES,
    PROOF_HEADER,
    Verifier,
    check_proof,
    proof,
    sign,
)
from akv_transport._stream import StreamProtocol
from akv_transport.errors import UntrustedPeerError
from tests.transport.test_http_hostile import exchange, request_bytes

pytestmark = pytest.mark.timeout(60)

TOKEN = "signed-requests-test-token-0123456789"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the rules, without I/O


def test_a_signed_request_is_accepted_once_and_its_proof_checks():
    clock = Clock()
    verifier = Verifier(TOKEN, clock=clock)
    signed = sign(TOKEN, "POST", "/v1/push", verifier.instance, now=clock.now)
    assert TOKEN not in signed.header
    verdict = verifier.check(signed.header, "POST", "/v1/push")
    assert verdict.mac == signed.mac
    assert verifier.check(signed.header, "POST", "/v1/push").reason == "a request replayed"
    answer = proof(TOKEN, signed.mac, 200)
    assert check_proof(TOKEN, signed.mac, 200, answer)
    assert not check_proof(TOKEN, signed.mac, 500, answer)  # another status
    assert not check_proof("another-token-0123456789", signed.mac, 200, answer)
    assert not check_proof(TOKEN, signed.mac, 200, None)
    assert not check_proof(TOKEN, signed.mac, 200, "")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token": "another-token-0123456789"}, "missing or wrong token"),
        ({"method": "GET"}, "missing or wrong token"),
        ({"path": "/v1/pull"}, "missing or wrong token"),
        ({"instance": "0" * 32}, "another instance"),
        ({"instance": ""}, "another instance"),
        ({"late_s": 121.0}, "off this process's clock"),
        ({"late_s": -121.0}, "off this process's clock"),
    ],
)
def test_a_request_signed_otherwise_is_refused(change, reason):
    clock = Clock()
    verifier = Verifier(TOKEN, clock=clock)
    signed = sign(
        change.get("token", TOKEN),
        change.get("method", "POST"),
        change.get("path", "/v1/push"),
        change.get("instance", verifier.instance),
        now=clock.now - change.get("late_s", 0.0),
    )
    verdict = verifier.check(signed.header, "POST", "/v1/push")
    assert verdict.mac is None and reason in verdict.reason
    assert verdict.wrong_instance == (reason == "another instance")


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer x",
        "AKV-HMAC-SHA256",
        "AKV-HMAC-SHA256 i=, t=1, n=00",
        "AKV-HMAC-SHA256 i=a, t=x, n=0123456789abcdef, m=" + "0" * 64,
        "AKV-HMAC-SHA256 i=a, t=1e9, n=0123456789abcdef, m=" + "0" * 64,
        "AKV-HMAC-SHA256 i=a, t=1, n=short, m=" + "0" * 64,
        "AKV-HMAC-SHA256 i=a, t=1, n=0123456789abcdef, m=00",
        "AKV-HMAC-SHA256 i=a, i=a, t=1, n=0123456789abcdef, m=" + "0" * 64,
        "AKV-HMAC-SHA256 i=\udcff, t=1, n=0123456789abcdef, m=" + "\udcff" * 64,
        "AKV-HMAC-SHA256 i=a, t=99999999999999999999, n=0123456789abcdef, m=" + "0" * 64,
    ],
)
def test_a_malformed_header_is_refused_without_raising(header):
    assert Verifier(TOKEN).check(header, "GET", "/").mac is None


def test_nonces_are_forgotten_once_their_requests_are_out_of_time_and_capped_until_then():
    clock = Clock()
    verifier = Verifier(TOKEN, clock=clock, monotonic=clock, max_skew_s=10, max_nonces=3)
    for _ in range(3):
        signed = sign(TOKEN, "GET", "/", verifier.instance, now=clock.now)
        assert verifier.check(signed.header, "GET", "/").mac is not None
    late = sign(TOKEN, "GET", "/", verifier.instance, now=clock.now)
    assert "too many requests" in verifier.check(late.header, "GET", "/").reason
    clock.now += 21  # twice the skew: none of them could be accepted again
    fresh = sign(TOKEN, "GET", "/", verifier.instance, now=clock.now)
    assert verifier.check(fresh.header, "GET", "/").mac is not None
    assert len(verifier._seen) == 1


def test_a_wall_clock_stepped_forward_and_back_does_not_make_a_seen_request_new():
    wall, steady = Clock(), Clock(0.0)
    verifier = Verifier(TOKEN, clock=wall, monotonic=steady, max_skew_s=10)
    captured = sign(TOKEN, "GET", "/", verifier.instance, now=wall.now)
    assert verifier.check(captured.header, "GET", "/").mac is not None
    wall.now += 300  # stepped forward: another request comes (and prunes what it may)
    steady.now += 1
    later = sign(TOKEN, "GET", "/", verifier.instance, now=wall.now)
    assert verifier.check(later.header, "GET", "/").mac is not None
    wall.now -= 300  # and back: the captured request's time is good again
    steady.now += 1
    assert verifier.check(captured.header, "GET", "/").reason == "a request replayed"


# ---------------------------------------------------------------- against real listeners


@pytest.fixture
async def app_server() -> AsyncIterator[tuple[int, list[str]]]:
    """A server with ``/hello`` (200), ``/fail`` (500) and ``/teapot`` (a raised 409);
    yields its port and the Authorization headers it received."""
    seen: list[str] = []

    @web.middleware
    async def note(request: web.Request, handler):
        seen.append(request.headers.get("Authorization", ""))
        return await handler(request)

    app = create_app(TOKEN)
    app.middlewares.insert(0, note)

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": True})

    async def fail(request: web.Request) -> web.Response:
        raise RuntimeError("broken on purpose")

    async def teapot(request: web.Request) -> web.Response:
        raise web.HTTPConflict()

    app.router.add_get("/hello", hello)
    app.router.add_post("/fail", fail)
    app.router.add_get("/teapot", teapot)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        yield port, seen
    finally:
        await runner.cleanup()


async def test_the_client_learns_the_instance_once_and_never_sends_the_token(app_server):
    port, seen = app_server
    client = HttpClient(f"http://127.0.0.1:{port}", TOKEN)
    try:
        assert await client.json("GET", "/hello") == {"hello": True}
        assert len(seen) == 2  # the first request named no instance: asked again
        assert await client.json("GET", "/hello") == {"hello": True}
        assert len(seen) == 3
    finally:
        await client.close()
    assert all(TOKEN not in header and header.startswith("AKV-HMAC-SHA256 ") for header in seen)


async def test_errors_a_real_server_answers_are_proven_and_raised_as_its_answers(app_server):
    port, _ = app_server
    client = HttpClient(f"http://127.0.0.1:{port}", TOKEN)
    try:
        with pytest.raises(RemoteError, match="broken on purpose") as failed:
            await client.json("POST", "/fail", {})
        assert failed.value.status == 500 and not isinstance(failed.value, UntrustedPeerError)
        with pytest.raises(RemoteError) as teapot:
            await client.json("GET", "/teapot")
        assert teapot.value.status == 409
        with pytest.raises(RemoteError) as missing:
            await client.json("GET", "/nothing")
        assert missing.value.status == 404
    finally:
        await client.close()


async def test_a_wrong_token_is_an_auth_error_at_once(app_server):
    port, seen = app_server
    client = HttpClient(f"http://127.0.0.1:{port}", "another-token-0123456789")
    try:
        with pytest.raises(AuthError, match="401 missing or wrong token"):
            await client.json("GET", "/hello")
    finally:
        await client.close()
    assert len(seen) == 1  # the instance named is not proven for a wrong token: not asked again


async def test_a_replayed_request_is_refused_and_a_bearer_token_still_opens(app_server):
    port, seen = app_server
    client = HttpClient(f"http://127.0.0.1:{port}", TOKEN)
    try:
        await client.json("GET", "/hello")
    finally:
        await client.close()
    captured = seen[-1]
    replay = request_bytes("/hello", token=TOKEN.encode()).replace(
        b"Bearer " + TOKEN.encode(), captured.encode()
    )
    status, answer = await exchange(port, replay)
    assert status == 401 and b"replayed" in answer
    status, answer = await exchange(port, request_bytes("/hello", token=TOKEN.encode()))
    assert status == 200 and PROOF_HEADER.encode() not in answer  # (curl, Prometheus)


async def test_a_restarted_server_is_asked_again_on_the_same_port():
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": True})

    first = create_app(TOKEN)
    first.router.add_get("/hello", hello)
    runner, port = await serve(first, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}", TOKEN)
    try:
        await client.json("GET", "/hello")
        known = INSTANCES.get(f"127.0.0.1:{port}")
        await runner.cleanup()
        second = create_app(TOKEN)
        second.router.add_get("/hello", hello)
        runner, _ = await serve(second, "127.0.0.1", port)
        assert await client.json("GET", "/hello") == {"hello": True}
        assert INSTANCES.get(f"127.0.0.1:{port}") not in ("", known)
    finally:
        await client.close()
        await runner.cleanup()


def stream_to(port: int, token: str = TOKEN, lost: list | None = None, **options):
    """``open_stream`` to 127.0.0.1:``port``, its messages dropped (its end noted in
    ``lost`` when given)."""
    on_lost = lost.append if lost is not None else (lambda exc: None)
    return open_stream(
        "127.0.0.1", port, token, lambda h: None, print, on_lost, timeout_s=10, **options
    )


class Impostor:
    """Listens on 127.0.0.1 as a process that took a gone server's port: it keeps each
    request's head and answers ``answer`` (a 401 naming an instance first, as a real
    server would, so that the client signs again), without the token."""

    def __init__(
        self, answer: bytes, *, close_after_401: bool = False, first: bytes | None = None
    ) -> None:
        self.answer = answer
        self.first = first
        self.close_after_401 = close_after_401
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def __aenter__(self) -> Impostor:
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if length:
                    await reader.readexactly(int(length[1]))
                if len(self.requests) == 1 and self.first is not None:
                    writer.write(self.first)
                elif len(self.requests) == 1:
                    body = b'{"error": "ask again"}'
                    closing = b"Connection: close\r\n" if self.close_after_401 else b""
                    writer.write(
                        b"HTTP/1.1 401 Unauthorized\r\n"
                        + f"{INSTANCE_HEADER}: {'ab' * 16}\r\n".encode()
                        + closing
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    if self.close_after_401:
                        await writer.drain()
                        return
                else:
                    writer.write(self.answer)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_an_answer_from_a_process_without_the_token_is_refused_and_learns_nothing():
    body = b'{"rank": 0}'
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with Impostor(ok, first=ok) as impostor:
        client = HttpClient(f"http://127.0.0.1:{impostor.port}", TOKEN, retries=0)
        try:
            with pytest.raises(UnprovenPeerError, match="does not prove"):
                await client.json("POST", "/v1/register", {"role": "worker"})
        finally:
            await client.close()
    assert len(impostor.requests) == 1
    assert not any(TOKEN.encode() in request for request in impostor.requests)


async def test_an_instance_named_by_a_process_without_the_token_is_not_adopted():
    body = b'{"rank": 0}'
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with Impostor(ok) as impostor:
        client = HttpClient(f"http://127.0.0.1:{impostor.port}", TOKEN, retries=0)
        try:
            with pytest.raises(AuthError, match="401"):
                await client.json("POST", "/v1/register", {"role": "worker"})
        finally:
            await client.close()
    assert len(impostor.requests) == 1  # its 401 proves nothing: not signed for its choice
    assert INSTANCES.get(f"127.0.0.1:{impostor.port}") == ""


@pytest.mark.parametrize("close_after_401", [False, True])
async def test_a_stream_to_a_process_without_the_token_is_refused_and_learns_nothing(
    close_after_401,
):
    upgraded = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: akv-stream/1\r\nConnection: Upgrade\r\n\r\n"
    )
    lost: list[BaseException | None] = []
    async with Impostor(upgraded, close_after_401=close_after_401) as impostor:
        with pytest.raises(AuthError):  # its 401 names an instance it does not prove
            await stream_to(impostor.port, lost=lost)
    assert len(impostor.requests) == 1 and lost == []
    async with Impostor(upgraded, first=upgraded) as impostor:
        with pytest.raises(UnprovenPeerError, match="without proving"):
            await stream_to(impostor.port, lost=lost)
    assert len(impostor.requests) == 1 and lost == []
    assert not any(TOKEN.encode() in request for request in impostor.requests)


async def test_a_stream_to_a_real_server_learns_its_instance_on_one_connection_and_opens():
    upgrades: list[object] = []

    @web.middleware
    async def note(request: web.Request, handler):
        upgrades.append(request.transport)
        return await handler(request)

    app = create_app(TOKEN)
    app.middlewares.insert(0, note)

    def make(request: web.Request) -> StreamProtocol:
        return StreamProtocol(lambda h: None, print, lambda exc: None)

    stream_route(app, make)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        INSTANCES._known.pop(f"127.0.0.1:{port}", None)
        protocol = await stream_to(port)
        assert INSTANCES.get(f"127.0.0.1:{port}") != ""
        # The first request named no instance; the second, on the same connection, did.
        assert len(upgrades) == 2 and upgrades[0] is upgrades[1]
        protocol.close()
        again = await stream_to(port)
        assert len(upgrades) == 3  # known now: asked once
        again.close()
    finally:
        await runner.cleanup()


async def test_a_process_on_a_gone_servers_port_cannot_get_requests_signed_for_another():
    """It passes the client's request on to another process of the job (B), whose 401
    names and proves B's instance: the client, which knows B by that instance at B's
    address, does not adopt it for this one, so nothing it signs is accepted by B."""
    accepted: list[bytes] = []

    async def push(request: web.Request) -> web.Response:
        accepted.append(await request.read())
        return web.json_response({"ok": True})

    app = create_app(TOKEN)
    app.router.add_post("/v1/push", push)
    runner, b_port = await serve(app, "127.0.0.1", 0)
    captured: list[bytes] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                body = await reader.readexactly(int(length[1])) if length else b""
                auth = re.search(rb"(?i)\r\nauthorization: *([^\r\n]+)", head)
                assert auth is not None
                captured.append(auth[1])
                closing = head[:-2] + b"Connection: close\r\n\r\n"
                _status, answer = await exchange(b_port, closing + body)
                writer.write(answer)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    impostor = await asyncio.start_server(relay, "127.0.0.1", 0)
    a_port = impostor.sockets[0].getsockname()[1]
    b_client = HttpClient(f"http://127.0.0.1:{b_port}", TOKEN, retries=0)
    client = HttpClient(f"http://127.0.0.1:{a_port}", TOKEN, retries=0)
    try:
        assert await b_client.json("POST", "/v1/push", {"v": 1}) == {"ok": True}
        with pytest.raises(AuthError):
            await client.json("POST", "/v1/push", {"v": 2})
        assert INSTANCES.get(f"127.0.0.1:{a_port}") == ""
        evil = b'{"v": 666}'
        for auth in captured:  # nothing the client sent opens B
            request = (
                b"POST /v1/push HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth + b"\r\n"
                b"Connection: close\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s"
            ) % (len(evil), evil)
            status, _ = await exchange(b_port, request)
            assert status == 401
        assert accepted == [b'{"v": 1}']
    finally:
        await client.close()
        await b_client.close()
        impostor.close()
        await runner.cleanup()


async def test_a_stream_signed_for_a_named_instance_opens_at_once_and_refuses_another():
    """The instance a holder of the token named (akv's address book): the upgrade is signed
    for it from the first request, and a server that names another (a restart, or a
    process a request was passed on to) is a TransportError to ask again, not adopted."""
    upgrades: list[str] = []

    @web.middleware
    async def note(request: web.Request, handler):
        upgrades.append(request.headers.get("Authorization", ""))
        return await handler(request)

    def make(request: web.Request) -> StreamProtocol:
        return StreamProtocol(lambda h: None, print, lambda exc: None)

    app, other = create_app(TOKEN), create_app(TOKEN)
    app.middlewares.insert(0, note)
    stream_route(app, make)
    runner, port = await serve(app, "127.0.0.1", 0)
    peer = f"127.0.0.1:{port}"
    try:
        INSTANCES._known.pop(peer, None)
        protocol = await stream_to(port, instance=app_instance(app))
        assert len(upgrades) == 1 and f"i={app_instance(app)}," in upgrades[0]
        protocol.close()
        with pytest.raises(TransportError, match="another instance") as refused:
            await stream_to(port, instance=app_instance(other))
        assert not isinstance(refused.value, AuthError)
        assert len(upgrades) == 2 and INSTANCES.get(peer) == ""  # not asked again, not adopted
        # A 401 that proves nothing is not the named server's (whoever named it took the
        # token): retried as for an impostor, never taken for a wrong token (fatal).
        with pytest.raises(UnprovenPeerError, match="401"):
            await stream_to(port, "another-token-0123456789", instance=app_instance(app))
    finally:
        await runner.cleanup()
