"""The framed stream's upgrade: what the client sends, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping

import pytest
from aiohttp import web

from akv_transport import (
    FrameError,
    FrameHeader,
    Message,
    StreamProtocol,
    TransportError,
    create_app,
    frame_bytes,
    open_stream,
    serve,
    stream_route,
)
from akv_transport._auth import PROOF_HEADER, proof
from akv_transport.frame import encode_release

TOKEN = "secret"


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


class Server:
    """A stream server that records each upgrade request's headers and every message."""

    def __init__(self) -> None:
        self.headers: list[Mapping[str, str]] = []
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.lost: list[BaseException | None] = []
        self.port = 0

    def make_protocol(self, request: web.Request) -> StreamProtocol:
        self.headers.append(dict(request.headers))
        return StreamProtocol(fresh, self.messages.put_nowait, self.lost.append)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    recorder = Server()
    app = create_app(TOKEN)
    stream_route(app, recorder.make_protocol)
    runner, recorder.port = await serve(app)
    try:
        yield recorder
    finally:
        await runner.cleanup()


async def connect(server: Server, headers: Mapping[str, str] | None = None) -> StreamProtocol:
    return await open_stream(
        "127.0.0.1",
        server.port,
        TOKEN,
        fresh,
        lambda message: None,
        lambda exc: None,
        timeout_s=10.0,
        headers=headers,
    )


async def test_the_upgrade_request_carries_the_headers_given_as_given(server):
    stream = await connect(server, headers={"X-Client": "3 dist_sync", "X-Empty": ""})
    try:
        stream.write([frame_bytes(5, 1)])
        message = await asyncio.wait_for(server.messages.get(), 10)
    finally:
        stream.close()
    assert message.header.op == 5
    (headers,) = server.headers
    assert headers["X-Client"] == "3 dist_sync"
    assert headers["X-Empty"] == ""


async def test_without_headers_only_the_upgrade_itself_is_sent(server):
    stream = await connect(server)
    stream.close()
    (headers,) = server.headers
    assert sorted(headers) == ["Authorization", "Connection", "Host", "Upgrade"]


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ({"Authorization": "Bearer other"}, "sets the Authorization header itself"),
        ({"upgrade": "h2c"}, "sets the upgrade header itself"),
        ({"X Client": "1"}, "not an HTTP header name"),
        ({"X-Client": "1\r\nX-Injected: 1"}, "not a one-line str"),
        ({"X-Client": "\u20ac"}, "not Latin-1"),
    ],
)
async def test_a_header_that_cannot_be_sent_raises_before_connecting(headers, problem):
    # Port 1 on 127.0.0.1 refuses connections: reaching it would raise TransportError.
    with pytest.raises(ValueError, match=problem):
        await open_stream(
            "127.0.0.1", 1, TOKEN, fresh, lambda message: None, lambda exc: None, headers=headers
        )


# ---------------------------------------------------------------- a stream's beginning and end

UPGRADED = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: akv-stream/1\r\nConnection: Upgrade\r\n\r\n"
)


def proven(answer: bytes, request: bytes, token: str = TOKEN) -> bytes:
    """``answer`` (a whole HTTP answer head) with the ``AKV-Proof`` of a server holding
    ``token`` for the signed ``request`` (its head, as read)."""
    mac = re.search(rb"m=([0-9a-f]{64})", request)
    assert mac is not None, request
    status = int(answer.split(b" ", 2)[1])
    line = f"{PROOF_HEADER}: {proof(token, mac[1].decode(), status)}\r\n".encode()
    return answer[:-2] + line + b"\r\n"


class Listener:
    """Listens on 127.0.0.1 (a port the system chose) while in ``async with``; each
    connection runs :meth:`_connected`, and tasks left in ``_tasks`` are cancelled at
    the end."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        raise NotImplementedError


class RawServer(Listener):
    """A TCP server on 127.0.0.1 that reads an upgrade request and does what ``answer``
    says with the connection; it notes when each connection ended."""

    def __init__(self, answer) -> None:
        super().__init__()
        self.answer = answer
        self.ended: asyncio.Queue[bytes] = asyncio.Queue()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await self.answer(writer, head)
            rest = await reader.read()  # until the client closes
        except (OSError, asyncio.IncompleteReadError):
            rest = b""
        finally:
            writer.close()
        self.ended.put_nowait(rest)


async def test_a_stream_that_ends_right_after_its_upgrade_is_not_returned_nor_reported_lost():
    async def upgrade_then_reset(writer: asyncio.StreamWriter, head: bytes) -> None:
        writer.write(proven(UPGRADED, head))
        await writer.drain()
        writer.transport.abort()

    lost: list[BaseException | None] = []
    async with RawServer(upgrade_then_reset) as raw:
        for _ in range(20):  # the reset comes with the answer, or a moment after it
            with pytest.raises(TransportError, match="closed"):
                await open_stream(
                    "127.0.0.1", raw.port, TOKEN, fresh, lambda m: None, lost.append, timeout_s=10
                )
    # A stream nobody was handed is nobody's loss: the caller saw open_stream fail.
    assert lost == []


async def test_a_stream_given_up_on_is_closed_not_left_open():
    async def never_answer(writer: asyncio.StreamWriter, head: bytes) -> None:
        pass  # holds the connection, reading until the client closes it

    async with RawServer(never_answer) as raw:
        with pytest.raises(TransportError, match="TimeoutError"):
            await open_stream(
                "127.0.0.1", raw.port, TOKEN, fresh, lambda m: None, lambda e: None, timeout_s=0.3
            )
        await asyncio.wait_for(raw.ended.get(), 10)  # the client closed its connection


async def test_a_stream_closed_before_its_connection_is_made_closes_when_it_is():
    lost: list[BaseException | None] = []
    made: list[StreamProtocol] = []

    def make_protocol(request: web.Request) -> StreamProtocol:
        protocol = StreamProtocol(fresh, lambda m: None, lost.append)
        protocol.close()  # replaced by a newer stream before the upgrade answer went out
        made.append(protocol)
        return protocol

    app = create_app(TOKEN)
    stream_route(app, make_protocol)
    runner, port = await serve(app)
    try:
        client_lost = asyncio.get_running_loop().create_future()
        try:
            stream = await open_stream(
                "127.0.0.1", port, TOKEN, fresh, lambda m: None, client_lost.set_result
            )
        except TransportError:
            pass  # closed at once: before open_stream could return it
        else:
            await asyncio.wait_for(client_lost, 10)
            assert stream.closing
        (protocol,) = made
        assert await asyncio.wait_for(protocol.wait_closed(), 10) is None
        assert lost == [None]  # its end is reported once, like any other
    finally:
        await runner.cleanup()


async def test_a_stream_whose_upgrade_fails_is_reported_lost():
    lost = asyncio.get_running_loop().create_future()

    def make_protocol(request: web.Request) -> StreamProtocol:
        assert request.transport is not None
        request.transport.abort()  # the client is gone before the upgrade answer
        return StreamProtocol(fresh, lambda m: None, lost.set_result)

    app = create_app(TOKEN)
    stream_route(app, make_protocol)
    runner, port = await serve(app)
    try:
        with pytest.raises(TransportError):
            await open_stream("127.0.0.1", port, TOKEN, fresh, lambda m: None, lambda e: None)
        assert await asyncio.wait_for(lost, 10) is not None  # admitted, then lost: reported
    finally:
        await runner.cleanup()


async def test_a_release_frame_on_a_stream_that_shares_no_memory_closes_it(server, caplog):
    lost = asyncio.get_running_loop().create_future()
    stream = await open_stream(
        "127.0.0.1", server.port, TOKEN, fresh, lambda m: None, lost.set_result, timeout_s=10
    )
    stream.write([encode_release([0, 64])])
    assert await asyncio.wait_for(lost, 10) is None  # the server closed it
    assert server.lost and isinstance(server.lost[0], FrameError)
    assert "a release frame arrived on a stream that shares no memory" in str(server.lost[0])
    assert "a release frame arrived on a stream that shares no memory" in caplog.text
