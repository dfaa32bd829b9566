"""A stream's liveness over real sockets on 127.0.0.1: keepalives keep an idle stream, a
stream that carries nothing is cut as silent, and nothing that lives is cut.

The settings are short (a keepalive after 0.2 s, a cut after 2 s of silence) so that the
tests take seconds; every wait is bounded well beyond what they should take.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web

from akv_engine import LoopThread
from akv_transport import (
    FrameHeader,
    KeepAlive,
    Message,
    StreamProtocol,
    StreamSilentError,
    create_app,
    encode_frame,
    open_stream,
    serve,
    serve_local,
    stream_route,
)
from akv_transport._stream import KEEPALIVE_HEADER, parse_keepalive
from tests.transport.test_stream import Listener, RawServer

TOKEN = "secret"
FAST = KeepAlive(interval_s=0.2, silent_s=2.0)


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


class Server:
    """A stream server whose streams run ``keepalive`` and answer every frame; it records
    their messages and ends (``record``: when it runs on the test's loop), and may block
    its own loop for ``block_s`` on each message."""

    def __init__(
        self, keepalive: KeepAlive | None = FAST, block_s: float = 0.0, record: bool = True
    ) -> None:
        self.keepalive = keepalive
        self.block_s = block_s
        self.record = record
        self.protocols: list[StreamProtocol] = []
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.lost: asyncio.Queue[BaseException | None] = asyncio.Queue()
        self.port = 0

    def make_protocol(self, request: web.Request) -> StreamProtocol:
        def on_message(message: Message) -> None:
            if self.block_s:
                time.sleep(self.block_s)  # a long computation on the loop (the GIL is free)
            protocol.write(encode_frame(message.header.op, message.header.seq))
            if self.record:
                self.messages.put_nowait(message)

        def on_lost(exc: BaseException | None) -> None:
            if self.record:
                self.lost.put_nowait(exc)

        protocol = StreamProtocol(fresh, on_message, on_lost, keepalive=self.keepalive)
        self.protocols.append(protocol)
        return protocol


@contextlib.asynccontextmanager
async def serving(server: Server) -> AsyncIterator[Server]:
    app = create_app(TOKEN)
    stream_route(app, server.make_protocol)
    runner, server.port = await serve(app)
    try:
        yield server
    finally:
        await runner.cleanup()


class Proxy(Listener):
    """Forwards connections to 127.0.0.1:``target``; while ``holes`` names a direction
    (``"to server"``, ``"to client"``) it keeps the connection but drops what goes that
    way; ``delay_s`` and ``chunk`` make the client's bytes crawl to the server."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target
        self.holes: set[str] = set()
        self.delay_s = 0.0
        self.chunk = 1 << 16

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        pipes = [
            asyncio.ensure_future(self._pipe(reader, up_writer, "to server")),
            asyncio.ensure_future(self._pipe(up_reader, writer, "to client")),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for end in (writer, up_writer):
            end.transport.abort()

    async def _pipe(self, reader, writer, direction: str) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(self.chunk if direction == "to server" else 1 << 16):
                if direction in self.holes:
                    continue
                writer.write(data)
                await writer.drain()
                if direction == "to server" and self.delay_s:
                    await asyncio.sleep(self.delay_s)


async def connect(port: int, lost, **options) -> StreamProtocol:
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await open_stream(
        "127.0.0.1", port, TOKEN, fresh, replies.put_nowait, lost, timeout_s=10.0, **options
    )
    stream.replies = replies  # type: ignore[attr-defined]
    return stream


async def test_the_client_runs_what_the_servers_upgrade_answer_names():
    async with serving(Server(FAST)) as server:
        stream = await connect(server.port, lambda exc: None)
        assert stream.keepalive == FAST
        stream.close()
        own = KeepAlive(0.5, 3.0)
        stream = await connect(server.port, lambda exc: None, keepalive=own)
        assert stream.keepalive == own
        stream.close()
    async with serving(Server(None)) as server:  # a server that runs none: neither does it
        stream = await connect(server.port, lambda exc: None)
        assert stream.keepalive is None
        stream.close()


def test_the_keepalive_header_round_trips_and_garbage_is_refused():
    assert (
        parse_keepalive(
            StreamProtocol(fresh, print, print, keepalive=FAST).upgrade_headers()[KEEPALIVE_HEADER]
        )
        == FAST
    )
    assert parse_keepalive(None) is None
    for value in ("", "interval=1", "interval=1; silent=x", "interval=5; silent=6", "a=1; b=2"):
        with pytest.raises(ValueError):
            parse_keepalive(value)


async def test_an_idle_stream_lives_on_keepalives_both_ways():
    lost: list[BaseException | None] = []
    async with serving(Server(FAST)) as server:
        stream = await connect(server.port, lost.append)
        await asyncio.sleep(1.5 * FAST.silent_s)  # idle: nothing but keepalives
        assert not stream.closing and not server.protocols[0].closing and lost == []
        assert stream.statistics().keepalives > 0
        assert server.protocols[0].statistics().keepalives > 0
        stream.write(encode_frame(3, 1))  # and it still carries frames
        reply = await asyncio.wait_for(stream.replies.get(), 10)
        assert reply.header.seq == 1
        stream.close()


async def test_a_stream_whose_answers_are_black_holed_is_cut_as_silent():
    async with serving(Server(FAST)) as server, Proxy(server.port) as proxy:
        lost = asyncio.get_running_loop().create_future()
        stream = await connect(proxy.port, lost.set_result)
        proxy.holes.add("to client")  # the connection stays open; nothing comes back
        stream.write(encode_frame(3, 1))
        started = time.monotonic()
        error = await asyncio.wait_for(lost, 10 * FAST.silent_s)
        assert isinstance(error, StreamSilentError)
        assert "the stream is silent" in str(error) and "no answer for 2." in str(error)
        assert time.monotonic() - started >= FAST.silent_s - FAST.interval_s
        # The server heard the request and the keepalives: it cut nothing; the client's cut
        # ended its connection too.
        ended = await asyncio.wait_for(server.lost.get(), 10)
        assert not isinstance(ended, StreamSilentError)


async def test_a_server_cuts_a_client_that_went_silent():
    async with serving(Server(FAST)) as server, Proxy(server.port) as proxy:
        lost = asyncio.get_running_loop().create_future()
        await connect(proxy.port, lost.set_result)
        proxy.holes.add("to server")
        error = await asyncio.wait_for(server.lost.get(), 10 * FAST.silent_s)
        assert isinstance(error, StreamSilentError)
        await asyncio.wait_for(lost, 10)  # and the client learns it from the proxy


async def test_the_wait_for_the_upgrade_answer_is_bounded_by_silence():
    async def never_answer(writer: asyncio.StreamWriter, head: bytes) -> None:
        pass  # accepts, reads, never answers

    async with RawServer(never_answer) as raw:
        with pytest.raises(StreamSilentError, match="the stream is silent"):
            await asyncio.wait_for(
                open_stream(
                    "127.0.0.1", raw.port, TOKEN, fresh, print, print, timeout_s=60, keepalive=FAST
                ),
                10 * FAST.silent_s,
            )


async def test_a_payload_that_crawls_for_longer_than_the_silence_limit_is_not_cut():
    lost: list[BaseException | None] = []
    async with serving(Server(FAST)) as server, Proxy(server.port) as proxy:
        stream = await connect(proxy.port, lost.append)
        proxy.chunk, proxy.delay_s = 16 << 10, 0.05  # 320 KiB/s: 1 MiB takes over 3 s
        value = np.arange(1 << 18, dtype=np.float32)
        started = time.monotonic()
        stream.write(encode_frame(3, 1, [(0, value, 0)]))
        message = await asyncio.wait_for(server.messages.get(), 60)
        assert time.monotonic() - started > FAST.silent_s  # it did crawl
        assert np.array_equal(np.frombuffer(message.buffers[0], np.float32), value)
        reply = await asyncio.wait_for(stream.replies.get(), 10)
        assert reply.header.seq == 1 and lost == [] and server.lost.empty()
        stream.close()


async def test_a_peer_whose_loop_is_blocked_for_less_than_the_margin_is_not_cut():
    # The server runs on a loop of its own and blocks it for 1 s per message: less than
    # silent_s - interval_s (1.8 s), so its keepalives resume in time.
    thread = LoopThread(name="test-blocked-server")
    server = Server(FAST, block_s=1.0, record=False)
    runner = None
    try:

        async def start() -> int:
            nonlocal runner
            app = create_app(TOKEN)
            stream_route(app, server.make_protocol)
            runner, port = await serve(app)
            return port

        port = thread.run(start(), timeout=10)
        lost: list[BaseException | None] = []
        stream = await connect(port, lost.append)
        # Idle for half a silence, then the server's loop blocks for 1 s: without the
        # keepalives sent before the block, the client would hear nothing for a silence.
        await asyncio.sleep(FAST.silent_s / 2)
        stream.write(encode_frame(3, 1))
        reply = await asyncio.wait_for(stream.replies.get(), 10)
        assert reply.header.seq == 1
        assert lost == [] and not stream.closing
        stream.close()
    finally:
        if runner is not None:
            thread.run(runner.cleanup(), timeout=10)
        thread.close()


async def test_a_shared_memory_stream_carries_its_keepalives_on_its_socket(tmp_path):
    server = Server(FAST)
    app = create_app(TOKEN)
    stream_route(app, server.make_protocol)
    runner, server.port = await serve(app)
    local = await serve_local(runner, TOKEN, arena_bytes=1 << 20, parent_directory=str(tmp_path))
    try:
        lost: list[BaseException | None] = []
        stream = await connect(0, lost.append, local_path=local.path, arena_bytes=1 << 20)
        assert stream.shared is not None and stream.keepalive == FAST
        await asyncio.sleep(1.25 * FAST.silent_s)
        assert lost == [] and stream.statistics().keepalives > 0
        value = np.arange(1 << 16, dtype=np.float32)  # through the arena
        stream.write(encode_frame(3, 1, [(0, value, 0)]))
        message = await asyncio.wait_for(server.messages.get(), 10)
        assert np.array_equal(np.frombuffer(message.buffers[0], np.float32), value)
        assert stream.shared.frames_shared == 1
        stream.close()
    finally:
        await local.close()
        await runner.cleanup()
