"""Hostile peers against create_app/serve, over real sockets on 127.0.0.1: header bytes
that are not UTF-8, malformed requests, idle and slowloris connections, connection floods,
binds without TLS, and the client's strict reading of answers (issue #9). The strict JSON
decoder's own tests are in test_json.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from akv_transport import (
    DEFAULT_MAX_STRANGERS_PER_PEER,
    DEFAULT_PROBATION_S,
    FrameHeader,
    HttpClient,
    Message,
    RequestError,
    StreamProtocol,
    TransportError,
    client_ssl_context,
    create_app,
    frame_bytes,
    open_stream,
    parse_json,
    serve,
    server_ssl_context,
    stream_route,
)
from akv_transport._http_client import _message
from akv_transport._http_log import install_log_filter
from tests.hostile import Flood, closed_within, forget_logged_mistakes
from tests.tls import make_certificates

pytestmark = pytest.mark.timeout(60)

TOKEN = "hostile-test-token-0123456789abcdef"
#: Idle timeout of the servers in these tests, and how late a close may come.
IDLE_S = 0.5
MARGIN_S = 1.5


@pytest.fixture(autouse=True)
def fresh_log_limits() -> None:
    """Every test starts with no peer's mistake logged yet (the limiter is process-wide)."""
    forget_logged_mistakes()


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


class Service:
    """An app with a JSON route, a slow route and an echoing stream route."""

    def __init__(self) -> None:
        self.port = 0
        self.streams: list[StreamProtocol] = []

    def app(self) -> web.Application:
        app = create_app(TOKEN, max_body_bytes=4096)

        async def echo(request: web.Request) -> web.Response:
            try:
                body = parse_json(await request.read())
            except ValueError as exc:
                raise RequestError(400, str(exc)) from None
            return web.json_response({"got": body})

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(3 * IDLE_S)  # longer than the idle timeout: must not matter
            return web.json_response({"slow": True})

        async def hello(request: web.Request) -> web.Response:
            return web.json_response({"hello": True})

        def make_protocol(request: web.Request) -> StreamProtocol:
            def on_message(message: Message) -> None:
                protocol.write([frame_bytes(message.header.op + 1, message.header.seq)])

            protocol = StreamProtocol(fresh, on_message, lambda exc: None)
            self.streams.append(protocol)
            return protocol

        app.router.add_post("/echo", echo)
        app.router.add_get("/slow", slow)
        app.router.add_get("/hello", hello)
        stream_route(app, make_protocol)
        return app


async def started(**options: Any) -> tuple[Service, web.AppRunner]:
    service = Service()
    runner, service.port = await serve(service.app(), "127.0.0.1", 0, **options)
    return service, runner


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    service, runner = await started(idle_timeout_s=IDLE_S, max_connections_per_peer=16)
    try:
        yield service
    finally:
        await runner.cleanup()


def request_bytes(
    path: str = "/hello",
    *,
    method: str = "GET",
    token: bytes = TOKEN.encode(),
    body: bytes = b"",
    close: bool = True,
) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1".encode(),
        b"Host: 127.0.0.1",
        b"Authorization: Bearer " + token,
        f"Content-Length: {len(body)}".encode(),
    ]
    if close:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def exchange(port: int, raw: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send ``raw`` on a new connection; return the answer's status and the rest of it
    (the server closes: every request here says ``Connection: close``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1]), answer


async def still_serving(port: int) -> None:
    status, answer = await exchange(port, request_bytes())
    assert status == 200 and answer.endswith(b'{"hello": true}')


def leaked(caplog: pytest.LogCaptureFixture, secret: str) -> list[str]:
    """Log lines with a traceback or any 8 characters of ``secret``."""
    bad = []
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        fragments = {secret[i : i + 8] for i in range(len(secret) - 7)}
        if record.exc_info or any(fragment in text for fragment in fragments):
            bad.append(text)
    return bad


# ---------------------------------------------------------------------- header bytes


@pytest.mark.parametrize(
    "token",
    [
        b"\xff\xfe\xfd",  # not UTF-8
        TOKEN[:12].encode() + b"\xff" + TOKEN[12:].encode(),  # the token with a bad byte
        TOKEN.encode() + b"\xc3",  # a truncated UTF-8 sequence after the token
        b"\xed\xa0\x80",  # an encoded surrogate
        b"\x80" * 300,
        "Ünïcödé".encode(),
        b"",
    ],
    ids=["not-utf8", "bad-byte-in-token", "truncated-utf8", "surrogate", "long", "latin", "empty"],
)
async def test_any_authorization_bytes_get_401_without_a_traceback(service, caplog, token):
    caplog.set_level(logging.DEBUG)
    status, _ = await exchange(service.port, request_bytes(token=token))
    assert status == 401
    assert leaked(caplog, TOKEN) == []
    await still_serving(service.port)


@pytest.mark.parametrize(
    "raw",
    [
        # a control character in the token: aiohttp's parser refuses the header line
        request_bytes(token=TOKEN[:10].encode() + b"\x01" + TOKEN[10:].encode()),
        # no colon: the whole line, token included, is one bad header name
        request_bytes().replace(b"Authorization: Bearer", b"Authorization Bearer"),
        # a header line far beyond aiohttp's limit, starting with the token
        request_bytes(token=TOKEN.encode() + b"x" * 20000),
        # a NUL in the token, and garbage that is no HTTP at all
        request_bytes(token=TOKEN[:20].encode() + b"\x00" + TOKEN[20:].encode()),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + TOKEN.encode() + b"\r\n\r\n",
    ],
    ids=["control-char", "no-colon", "too-long", "nul", "not-http"],
)
async def test_a_malformed_request_is_400_and_one_short_line_without_the_token(
    service, caplog, raw
):
    caplog.set_level(logging.DEBUG)
    status, _ = await exchange(service.port, raw)
    assert status == 400
    assert leaked(caplog, TOKEN) == []
    await still_serving(service.port)


async def test_malformed_requests_are_logged_once_per_peer_per_interval(service, caplog):
    caplog.set_level(logging.DEBUG)
    bad = request_bytes().replace(b"Authorization: Bearer", b"Authorization Bearer")
    for _ in range(20):
        assert (await exchange(service.port, bad))[0] == 400
    lines = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert len(lines) == 1
    assert "127.0.0.1" in lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING
    assert leaked(caplog, TOKEN) == []


def test_other_aiohttp_lines_lose_whatever_follows_a_credential(caplog):
    install_log_filter()
    caplog.set_level(logging.DEBUG)
    logger = logging.getLogger("aiohttp.server")
    logger.error("bad header %r", f"Authorization: Bearer {TOKEN}")
    try:
        raise RuntimeError(f"while reading Bearer {TOKEN}")
    except RuntimeError:
        logger.exception("Unhandled exception")
    logging.getLogger("aiohttp.access").info('"GET / HTTP/1.1" bearer=%s 200', TOKEN)
    texts = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    assert len(texts) == 3
    assert all(TOKEN[:8] not in text for text in texts), texts
    assert "Authorization <redacted>" in texts[0]
    assert "RuntimeError" in texts[1]  # a server's own error keeps its traceback


async def test_a_truncated_body_is_a_400_without_a_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    service, runner = await started(idle_timeout_s=10.0)
    try:
        # A chunked body whose chunk size is garbage: aiohttp raises while the handler reads.
        raw = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
        )
        status, _ = await exchange(service.port, raw)
        assert status == 400
        assert leaked(caplog, TOKEN) == []
        await still_serving(service.port)
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------- idle connections


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        elapsed = await closed_within(reader, IDLE_S + MARGIN_S)
    finally:
        writer.close()
    assert elapsed >= IDLE_S * 0.8
    await still_serving(service.port)


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float = 0.2) -> None:
    for byte in data:
        await asyncio.sleep(every_s)
        writer.write(bytes([byte]))


async def test_a_slowloris_header_is_closed_after_the_idle_timeout(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    sender = asyncio.ensure_future(trickle(writer, request_bytes()))
    try:
        elapsed = await closed_within(reader, IDLE_S + MARGIN_S)
    finally:
        sender.cancel()
        writer.close()
    assert elapsed < IDLE_S + MARGIN_S
    await still_serving(service.port)


async def test_a_slowloris_second_request_on_a_kept_alive_connection_is_closed(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        writer.write(request_bytes(close=False))
        head = await asyncio.wait_for(reader.readuntil(b'{"hello": true}'), 10)
        assert head.startswith(b"HTTP/1.1 200")
        sender = asyncio.ensure_future(trickle(writer, request_bytes()))
        try:
            await closed_within(reader, IDLE_S + MARGIN_S)
        finally:
            sender.cancel()
    finally:
        writer.close()


async def test_a_stalled_body_is_closed_after_the_idle_timeout(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        raw = request_bytes("/echo", method="POST", body=b'{"a": 1, "b": [1, 2, 3]}')
        writer.write(raw[:-10])  # the header and part of the body, then nothing
        await closed_within(reader, IDLE_S + MARGIN_S)
    finally:
        writer.close()
    await still_serving(service.port)


async def test_kept_alive_requests_and_slow_handlers_are_not_cut(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        for _ in range(3):  # pauses shorter than the idle timeout between requests
            writer.write(request_bytes(close=False))
            head = await asyncio.wait_for(reader.readuntil(b'{"hello": true}'), 10)
            assert head.startswith(b"HTTP/1.1 200")
            await asyncio.sleep(IDLE_S / 2)
        writer.write(request_bytes("/slow"))  # its handler outlives the idle timeout
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"slow": true}')
    finally:
        writer.close()


async def test_the_http_client_survives_idle_pauses_longer_than_the_timeout(service):
    client = HttpClient(f"http://127.0.0.1:{service.port}", TOKEN, timeout_s=10)
    try:
        for _ in range(3):
            assert await client.json("POST", "/echo", {"n": [1, 2]}) == {"got": {"n": [1, 2]}}
            await asyncio.sleep(IDLE_S * 2)  # the server closes the kept-alive connection
    finally:
        await client.close()


async def test_a_refused_connection_says_so_in_the_systems_words_not_aiohttps_repr():
    with socket.socket() as holder:  # bound, not listening: connections to it are refused
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        client = HttpClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=10, retries=0)
        try:
            with pytest.raises(TransportError) as info:
                await client.json("POST", "/echo", {"n": 1})
        finally:
            await client.close()
    assert str(info.value) == f"POST http://127.0.0.1:{port}/echo failed: connection refused"


async def test_a_tls_failure_says_tls_s_own_words(service):
    """OpenSSL's error number is not the system's: a TLS client on a plain port must not
    read it as "operation not permitted"."""
    context = ssl.create_default_context()
    client = HttpClient(
        f"https://127.0.0.1:{service.port}", TOKEN, ssl_context=context, timeout_s=10, retries=0
    )
    try:
        with pytest.raises(TransportError) as info:
            await client.json("POST", "/echo", {"n": 1})
    finally:
        await client.close()
    assert "SSL" in str(info.value) and "operation not permitted" not in str(info.value)


async def test_a_closed_http_client_refuses_requests_and_opens_no_session(service):
    client = HttpClient(f"http://127.0.0.1:{service.port}", TOKEN, timeout_s=10)
    assert await client.json("POST", "/echo", {"n": 1}) == {"got": {"n": 1}}
    await client.close()
    with pytest.raises(TransportError, match="the client is closed"):
        await client.json("POST", "/echo", {"n": 2})
    assert client._session is None  # a late request made no session that nobody closes
    await client.close()  # idempotent


async def open_echo_stream(
    port: int, ssl_context: ssl.SSLContext | None = None
) -> tuple[StreamProtocol, asyncio.Queue[Message]]:
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await open_stream(
        "127.0.0.1",
        port,
        TOKEN,
        fresh,
        replies.put_nowait,
        lambda exc: None,
        ssl_context=ssl_context,
        timeout_s=10.0,
    )
    return stream, replies


async def echo_works(stream: StreamProtocol, replies: asyncio.Queue[Message], seq: int) -> None:
    stream.write([frame_bytes(10, seq)])
    reply = await asyncio.wait_for(replies.get(), 10)
    assert (reply.header.op, reply.header.seq) == (11, seq)


async def test_an_upgraded_stream_may_stay_idle_far_longer_than_the_timeout(service):
    stream, replies = await open_echo_stream(service.port)
    try:
        await echo_works(stream, replies, 1)
        await asyncio.sleep(4 * IDLE_S)
        assert not stream.closing
        await echo_works(stream, replies, 2)
    finally:
        stream.close()


# ---------------------------------------------------------------------- connections per peer


async def test_the_connection_past_the_cap_is_closed_at_once_and_room_comes_back(caplog):
    caplog.set_level(logging.DEBUG)
    service, runner = await started(idle_timeout_s=30.0, max_connections_per_peer=4)
    opened: list[asyncio.StreamWriter] = []
    try:
        for _ in range(4):
            _, writer = await asyncio.open_connection("127.0.0.1", service.port)
            opened.append(writer)
        await asyncio.sleep(0.1)  # all four accepted
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        opened.append(writer)
        assert await closed_within(reader, 1.0) < 1.0
        assert sum("the most one address may" in r.getMessage() for r in caplog.records) == 1
        opened.pop(0).close()
        await asyncio.sleep(0.2)
        opened.pop().close()
        await still_serving(service.port)  # the first one's place
    finally:
        for writer in opened:
            writer.close()
        await runner.cleanup()


async def test_streams_count_against_the_cap_until_they_close():
    service, runner = await started(idle_timeout_s=30.0, max_connections_per_peer=2)
    try:
        first, first_replies = await open_echo_stream(service.port)
        second, _ = await open_echo_stream(service.port)
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        try:
            assert await closed_within(reader, 1.0) < 1.0
        finally:
            writer.close()
        second.close()
        await asyncio.sleep(0.2)
        third, third_replies = await open_echo_stream(service.port)
        await echo_works(third, third_replies, 1)
        await echo_works(first, first_replies, 2)
        first.close()
        third.close()
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------- strangers (issue #24)


async def test_idle_strangers_past_their_cap_keep_no_authenticated_peer_out(caplog):
    caplog.set_level(logging.DEBUG)
    service, runner = await started(idle_timeout_s=30.0)  # the default caps
    count = DEFAULT_MAX_STRANGERS_PER_PEER + 16
    client = HttpClient(f"http://127.0.0.1:{service.port}", TOKEN, timeout_s=10)
    try:
        with Flood(service.port, count) as flood:
            await asyncio.to_thread(functools.partial(flood.wait, opened=count))
            # The strangers' places of 127.0.0.1 are taken: one more idle connection is on
            # probation, and closed soon.
            reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
            try:
                await closed_within(reader, DEFAULT_PROBATION_S + MARGIN_S)
            finally:
                writer.close()
            # Requests with the token still get in, each on a new connection.
            for _ in range(5):
                await still_serving(service.port)
            assert await client.json("POST", "/echo", {"n": 1}) == {"got": {"n": 1}}
            stream, replies = await open_echo_stream(service.port)
            try:
                await echo_works(stream, replies, 1)
                # Past probation, the authenticated connections stay; strangers came and went.
                await asyncio.sleep(3 * DEFAULT_PROBATION_S)
                await echo_works(stream, replies, 2)
                assert await client.json("POST", "/echo", [2]) == {"got": [2]}
                await still_serving(service.port)
            finally:
                stream.close()
            # Those past the cap were on probation, and closed.
            await asyncio.to_thread(functools.partial(flood.wait, closed=16))
        lines = [r.getMessage() for r in caplog.records if "on probation" in r.getMessage()]
        assert lines and "the most one address may" in lines[0]
    finally:
        await client.close()
        await runner.cleanup()


async def test_strangers_from_many_addresses_fill_only_the_global_cap():
    service, runner = await started(idle_timeout_s=30.0, max_strangers=8)
    try:
        with contextlib.ExitStack() as stack:
            floods = []
            for host in (2, 3, 4):  # one address after the other
                flood = stack.enter_context(Flood(service.port, 4, source=f"127.0.0.{host}"))
                await asyncio.to_thread(functools.partial(flood.wait, opened=4))
                floods.append(flood)
            # 12 idle strangers from three addresses, 8 places in all: another address's
            # idle connection is on probation, a connection with the token is not kept out.
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", service.port, local_addr=("127.0.0.5", 0)
            )
            try:
                await closed_within(reader, DEFAULT_PROBATION_S + MARGIN_S)
            finally:
                writer.close()
            await still_serving(service.port)
            # The third address found the 8 places taken: its connections were on probation.
            await asyncio.to_thread(functools.partial(floods[2].wait, closed=4))
            assert floods[0].closed == floods[1].closed == 0
    finally:
        await runner.cleanup()


async def test_a_connection_on_probation_that_sent_bytes_gets_the_deadline_twice():
    service, runner = await started(idle_timeout_s=30.0, max_strangers_per_peer=1)
    _, idle = await asyncio.open_connection("127.0.0.1", service.port)  # the one place
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        writer.write(b"GET /hello HTTP/1.1\r\n")  # part of a header: its check may be late
        elapsed = await closed_within(reader, 2 * DEFAULT_PROBATION_S + MARGIN_S)
        assert elapsed >= 2 * DEFAULT_PROBATION_S * 0.8
    finally:
        idle.close()
        writer.close()
        await runner.cleanup()


async def test_a_connection_that_authenticates_past_its_addresss_bound_gets_503():
    service, runner = await started(idle_timeout_s=30.0, max_connections_per_peer=1)
    first_reader, first = await asyncio.open_connection("127.0.0.1", service.port)
    second_reader, second = await asyncio.open_connection("127.0.0.1", service.port)
    try:
        first.write(request_bytes(close=False))
        head = await asyncio.wait_for(first_reader.readuntil(b'{"hello": true}'), 10)
        assert head.startswith(b"HTTP/1.1 200")  # the one authenticated connection
        second.write(request_bytes(close=False))
        answer = await asyncio.wait_for(second_reader.read(), 10)  # then it is closed
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        first.write(request_bytes(close=False))
        head = await asyncio.wait_for(first_reader.readuntil(b'{"hello": true}'), 10)
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        first.close()
        second.close()
        await runner.cleanup()


async def test_serve_refuses_nonsense_bounds():
    with pytest.raises(ValueError, match="idle_timeout_s"):
        await serve(Service().app(), idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections_per_peer"):
        await serve(Service().app(), max_connections_per_peer=0)
    with pytest.raises(ValueError, match="max_strangers_per_peer"):
        await serve(Service().app(), max_strangers_per_peer=0)
    with pytest.raises(ValueError, match="max_strangers"):
        await serve(Service().app(), max_strangers=-1)


# ---------------------------------------------------------------------- binding without TLS


def open_bind_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "without TLS" in r.getMessage()]


async def test_a_bind_beyond_loopback_without_tls_warns_once(caplog):
    caplog.set_level(logging.INFO, logger="akv_transport.http")
    runner, _ = await serve(Service().app(), "0.0.0.0", 0)
    try:
        (warning,) = open_bind_warnings(caplog)
        assert warning.levelno == logging.WARNING
        assert "0.0.0.0" in warning.getMessage() and "clear text" in warning.getMessage()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_loopback_bind_does_not_warn(caplog, host):
    caplog.set_level(logging.INFO, logger="akv_transport.http")
    runner, _ = await serve(Service().app(), host, 0)
    await runner.cleanup()
    assert open_bind_warnings(caplog) == []


async def test_a_bind_beyond_loopback_with_tls_does_not_warn(caplog):
    caplog.set_level(logging.INFO, logger="akv_transport.http")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    runner, _ = await serve(Service().app(), "0.0.0.0", 0, ssl_context=context)
    await runner.cleanup()
    assert open_bind_warnings(caplog) == []


# ---------------------------------------------------------------------- TLS


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 that it signed, made now (trustme)."""
    return make_certificates(tmp_path)


async def test_tls_end_to_end_with_the_bounds_in_place(certificates):
    server_context = server_ssl_context(certificates["cert"], certificates["key"])
    client_context = client_ssl_context(certificates["ca"])
    service, runner = await started(
        idle_timeout_s=IDLE_S, max_connections_per_peer=8, ssl_context=server_context
    )
    client = HttpClient(
        f"https://127.0.0.1:{service.port}", TOKEN, ssl_context=client_context, timeout_s=10
    )
    try:
        assert await client.json("POST", "/echo", {"tls": True}) == {"got": {"tls": True}}
        stream, replies = await open_echo_stream(service.port, client_context)
        try:
            await asyncio.sleep(3 * IDLE_S)  # an idle TLS stream stays
            await echo_works(stream, replies, 7)
        finally:
            stream.close()
        # A TCP connection that never starts its TLS handshake is dropped in time, too.
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        try:
            await closed_within(reader, IDLE_S + MARGIN_S)
        finally:
            writer.close()
        # Plain HTTP to the TLS port gets no answer.
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        try:
            writer.write(request_bytes())
            assert not (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/")
        finally:
            writer.close()
        assert await client.json("POST", "/echo", [1]) == {"got": [1]}
    finally:
        await client.close()
        await runner.cleanup()


def test_the_client_decodes_answers_strictly():
    decode: Callable[[bytes], str] = _message
    assert decode(b'{"error": "nope"}') == "nope"
    assert decode(b"[" * 10000) == ("[" * 10000)[:500]  # deep garbage is shown, not parsed
