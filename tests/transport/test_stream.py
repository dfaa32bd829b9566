"""The framed stream's upgrade: what the client sends, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest
from aiohttp import web

from transport import (
    FrameHeader,
    Message,
    StreamProtocol,
    create_app,
    frame_bytes,
    open_stream,
    serve,
    stream_route,
)

TOKEN = "secret"


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


class Server:
    """A stream server that records each upgrade request's headers and every message."""

    def __init__(self) -> None:
        self.headers: list[Mapping[str, str]] = []
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.port = 0

    def make_protocol(self, request: web.Request) -> StreamProtocol:
        self.headers.append(dict(request.headers))
        return StreamProtocol(fresh, self.messages.put_nowait, lambda exc: None)


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
