"""Streams between processes on one host: a private Unix socket, payloads in shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web

from akv_transport import (
    AuthError,
    FrameError,
    FrameHeader,
    FrameReader,
    InPlace,
    Message,
    StreamProtocol,
    TransportError,
    create_app,
    encode_frame,
    frame_bytes,
    open_stream,
    remove_leftovers,
    serve,
    serve_local,
    stream_route,
)
from akv_transport._shm_stream import ALIGNMENT, ArenaBook, RegionAllocator, SharedMemory
from akv_transport.frame import encode_release, to_arena_prefix
from akv_transport.shm import Arena

TOKEN = "secret"

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


# ---------------------------------------------------------------------- regions


def test_regions_are_taken_from_the_lowest_free_offset_and_merge_when_freed():
    regions = RegionAllocator(1024)
    a = regions.take(100)
    b = regions.take(64)
    c = regions.take(1)
    assert (a, b, c) == (0, 128, 192)
    assert regions.take(1024) is None
    regions.give_back(b)
    assert regions.take(64) == 128  # the hole is reused first
    regions.give_back(128)
    regions.give_back(a)
    regions.give_back(c)
    assert regions.used_bytes == 0 and regions.regions == 0
    assert regions.take(1024) == 0  # every range merged back into one


def test_a_region_that_is_not_in_use_cannot_be_released():
    regions = RegionAllocator(4096)
    offset = regions.take(10)
    with pytest.raises(FrameError, match="offset 64"):
        regions.give_back(64)
    regions.give_back(offset)
    with pytest.raises(FrameError, match="offset 0"):
        regions.give_back(offset)


def test_regions_are_aligned():
    regions = RegionAllocator(1 << 20)
    offsets = [regions.take(n) for n in (1, 63, 65, 1000, 7)]
    assert all(o is not None and o % ALIGNMENT == 0 for o in offsets)


# ---------------------------------------------------------------------- the reader


def arrays(n: int, seed: int = 0) -> list[tuple[int, np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return [(k, rng.standard_normal(n).astype(np.float32), k) for k in range(3)]


def test_the_reader_copies_an_arena_frame_out_and_notes_the_region_to_give_back():
    own = Arena(1 << 20)
    sender = SharedMemory(own, None, min_bytes=1)
    buffers = encode_frame(7, 1, arrays(1000))
    placed = sender.place(buffers)
    assert placed is not None and sum(len(b) for b in placed) < 400  # only header and offset
    reader = FrameReader(fresh)
    reader.arena = own.view(0, own.nbytes)
    reader.shared = True  # as StreamProtocol.share() sets it: releases may come
    wire = b"".join(bytes(b) for b in placed)
    view = reader.get_buffer(-1)
    view[: len(wire)] = wire
    (message,) = reader.buffer_updated(len(wire))
    for (_, array, _), got in zip(arrays(1000), message.buffers, strict=True):
        assert np.array_equal(np.frombuffer(got, np.float32), array)
    assert reader.to_give_back == [0, 4032, 8064]  # each array's region (4000 B, aligned)
    assert reader.statistics().payload_bytes_shared == 3 * 4000
    # Handing the region back makes it free again.
    view = reader.get_buffer(-1)
    release = encode_release(reader.to_give_back)
    view[: len(release)] = release
    assert reader.buffer_updated(len(release)) == []
    sender.given_back(reader.given_back)
    assert sender.regions.regions == 0
    own.close()


def in_place(header: FrameHeader) -> list[InPlace]:
    return [InPlace(memoryview(bytearray(a.nbytes))) for a in header.arrays]


def test_an_in_place_destination_reads_an_arena_frame_where_it_lies_until_given_back():
    own = Arena(1 << 20)
    sender = SharedMemory(own, None, min_bytes=1)
    placed = sender.place(encode_frame(7, 1, arrays(1000)))
    assert placed is not None
    reader = FrameReader(in_place)
    reader.arena = own.view(0, own.nbytes)
    wire = b"".join(bytes(b) for b in placed)
    reader.get_buffer(-1)[: len(wire)] = wire
    (message,) = reader.buffer_updated(len(wire))
    for (_, array, _), got in zip(arrays(1000), message.buffers, strict=True):
        assert got.readonly
        assert np.array_equal(np.frombuffer(got, np.float32), array)
    # Nothing was copied out or given back: the message lends the regions.
    assert message.borrowed == (0, 4032, 8064)
    assert reader.to_give_back == []
    assert reader.statistics().payload_bytes_lent == 3 * 4000
    # The views are the sender's memory itself.
    own.view(0, 4)[:] = b"\x00\x00\x80\x3f"
    assert np.frombuffer(message.buffers[0], np.float32)[0] == 1.0
    sender.given_back(list(message.borrowed))
    assert sender.regions.regions == 0
    del message
    own.close()


def test_an_in_place_destination_receives_a_socket_frame_into_its_buffer():
    targets: list[InPlace] = []

    def destinations(header: FrameHeader) -> list[InPlace]:
        targets.extend(in_place(header))
        return targets

    reader = FrameReader(destinations)
    wire = b"".join(bytes(b) for b in encode_frame(7, 1, arrays(1000)))
    view = reader.get_buffer(-1)
    view[: len(wire)] = wire
    (message,) = reader.buffer_updated(len(wire))
    assert message.borrowed == ()
    for (_, array, _), got, target in zip(arrays(1000), message.buffers, targets, strict=True):
        assert not got.readonly
        assert np.array_equal(np.frombuffer(target.buffer, np.float32), array)


class Wire:
    """A transport that records what is written, one entry per write call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, buffers) -> None:
        self.writes.append(b"".join(bytes(b) for b in buffers))

    def is_closing(self) -> bool:
        return self.closing

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass


async def test_regions_are_given_back_with_the_next_frame_or_at_the_end_of_the_turn():
    peer = Arena(1 << 20)
    sender = SharedMemory(peer, None, min_bytes=1)
    received: list[Message] = []
    protocol = StreamProtocol(fresh, received.append, lambda exc: None)
    wire = Wire()
    protocol.connection_made(wire)
    protocol.share(SharedMemory(None, peer))
    release = encode_release([0, 4032, 8064])
    reply = b"".join(bytes(b) for b in encode_frame(8, 1))

    def arrive(seq: int) -> None:
        placed = sender.place(encode_frame(7, seq, arrays(1000)))
        data = b"".join(bytes(b) for b in placed)
        protocol.get_buffer(-1)[: len(data)] = data
        protocol.buffer_updated(len(data))

    arrive(1)  # the regions are copied out; a reply written in the same turn takes them
    protocol.write(encode_frame(8, 1))
    assert wire.writes == [release + reply]
    await asyncio.sleep(0)
    assert wire.writes == [release + reply]  # nothing left to flush
    sender.given_back([0, 4032, 8064])
    arrive(2)  # nothing else written in this turn: they go on their own at its end
    assert wire.writes == [release + reply]
    await asyncio.sleep(0)
    assert wire.writes == [release + reply, release]
    assert len(received) == 2
    peer.close()


async def test_frames_written_soon_go_in_order_with_the_next_write_or_at_the_end_of_the_turn():
    protocol = StreamProtocol(fresh, lambda message: None, lambda exc: None)
    wire = Wire()
    protocol.connection_made(wire)
    first, second, third, fourth = (frame_bytes(8, seq, flags=1) for seq in range(1, 5))
    answer = b"".join(bytes(b) for b in encode_frame(8, 5))
    protocol.write_soon(first)
    protocol.write_soon(second)
    assert wire.writes == []  # they wait for the next write
    protocol.write(encode_frame(8, 5))
    assert wire.writes == [first + second + answer]  # one write, in the order queued
    await asyncio.sleep(0)
    assert wire.writes == [first + second + answer]  # nothing left to flush
    protocol.write_soon(third)
    protocol.write_soon(fourth)
    await asyncio.sleep(0)  # nothing else written in this turn: they go together at its end
    assert wire.writes == [first + second + answer, third + fourth]
    wire.closing = True
    with pytest.raises(TransportError):
        protocol.write_soon(first)


def test_an_arena_frame_from_a_peer_that_shared_no_arena_breaks_the_stream():
    reader = FrameReader(fresh)
    wire = b"".join(bytes(b) for b in to_arena_prefix(encode_frame(7, 1, arrays(10))[0], [0] * 3))
    reader.get_buffer(-1)[: len(wire)] = wire
    with pytest.raises(FrameError, match="shared none"):
        reader.buffer_updated(len(wire))


def test_a_release_on_a_stream_that_shares_no_memory_breaks_it():
    reader = FrameReader(fresh)  # a TCP stream's: it lent nothing, so nothing comes back
    release = encode_release([0, 4032])
    reader.get_buffer(-1)[: len(release)] = release
    with pytest.raises(FrameError, match="a release frame arrived on a stream that shares no"):
        reader.buffer_updated(len(release))
    assert reader.given_back == []


def test_an_offset_outside_the_peers_arena_breaks_the_stream():
    arena = Arena(4096)
    reader = FrameReader(fresh)
    reader.arena = arena.view(0, arena.nbytes)
    head = encode_frame(7, 1, arrays(1000))[0]
    wire = b"".join(bytes(b) for b in to_arena_prefix(head, [0, 64, 1024]))
    reader.get_buffer(-1)[: len(wire)] = wire
    with pytest.raises(FrameError, match="at offset 1024 is outside the peer's arena"):
        reader.buffer_updated(len(wire))
    arena.close()


def test_an_array_in_a_reserved_region_is_sent_without_a_copy_and_stays_reserved():
    own = Arena(1 << 20)
    sender = SharedMemory(own, None, min_bytes=1)
    region = sender.take(4000)
    staged = np.frombuffer(region, np.float32)
    staged[:] = np.arange(1000)
    other = np.full(1000, 7.0, np.float32)
    placed = sender.place(encode_frame(7, 1, [("a", staged, 0), ("b", other, 0)]))
    assert sender.arrays_in_place == 1 and sender.regions.regions == 2  # b got a region
    reader = FrameReader(fresh)
    reader.arena = own.view(0, own.nbytes)
    wire = b"".join(bytes(b) for b in placed)
    reader.get_buffer(-1)[: len(wire)] = wire
    (message,) = reader.buffer_updated(len(wire))
    assert np.array_equal(np.frombuffer(message.buffers[0], np.float32), np.arange(1000))
    assert np.array_equal(np.frombuffer(message.buffers[1], np.float32), other)
    sender.given_back(reader.to_give_back)  # b's region is freed, a's stays reserved
    assert sender.regions.regions == 1
    assert sender.take(1 << 20) is None  # the reserved region still holds its place
    sender.give_back(staged)
    assert sender.regions.regions == 0
    with pytest.raises(ValueError, match="no region is reserved"):
        sender.give_back(staged)
    own.close()


def test_a_reserved_region_given_back_while_the_peer_reads_it_is_freed_by_the_release():
    own = Arena(1 << 16)
    sender = SharedMemory(own, None, min_bytes=1)
    region = sender.take(4000)
    staged = np.frombuffer(region, np.float32)
    placed = sender.place(encode_frame(7, 1, [("a", staged, 0)]))
    assert placed is not None and sender.arrays_in_place == 1
    sender.give_back(staged)  # the caller is done (its request was answered) ...
    assert sender.regions.regions == 1  # ... but the peer still reads the payload in place
    assert sender.take(1 << 16) is None
    with pytest.raises(ValueError, match="no region is reserved"):
        sender.give_back(staged)
    sender.given_back([0])
    assert sender.regions.regions == 0 and sender.take(1 << 16) is not None
    with pytest.raises(FrameError, match="offset 0"):
        sender.given_back([0])  # released twice
    own.close()


def test_a_release_of_a_reserved_region_never_sent_breaks_the_stream():
    own = Arena(1 << 16)
    sender = SharedMemory(own, None, min_bytes=1)
    sender.take(4000)
    with pytest.raises(FrameError, match="not sent"):
        sender.given_back([0])
    own.close()


def test_a_release_of_an_offset_not_in_use_breaks_the_stream():
    own = Arena(1 << 16)
    sender = SharedMemory(own, None)
    with pytest.raises(FrameError, match="offset 128"):
        sender.given_back([128])
    own.close()


def test_small_frames_and_frames_that_find_no_room_stay_on_the_socket():
    own = Arena(64 << 10)
    shared = SharedMemory(own, None, min_bytes=1024)
    assert shared.place(encode_frame(1, 1, arrays(10))) is None  # 120 bytes: small
    assert shared.place(encode_frame(1, 1, arrays(100_000))) is None  # 1.2 MB: no room
    assert shared.frames_not_fitting == 1
    assert shared.place(encode_frame(1, 1, arrays(1000))) is not None
    own.close()


# ---------------------------------------------------------------------- end to end


def open_files() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return names


class Server:
    def __init__(self, destinations=fresh) -> None:
        self.destinations = destinations
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.protocols: list[StreamProtocol] = []
        self.port = 0

    def make_protocol(self, request: web.Request) -> StreamProtocol:
        protocol = StreamProtocol(self.destinations, self.on_message, lambda exc: None)
        self.protocols.append(protocol)
        return protocol

    def on_message(self, message: Message) -> None:
        # Echo every frame back: the answer crosses the shared memory the other way.
        protocol = self.protocols[-1]
        arrays = [
            (a.key, np.frombuffer(b, np.float32), a.tag)
            for a, b in zip(message.header.arrays, message.buffers, strict=True)
        ]
        protocol.write(encode_frame(message.header.op, message.header.seq, arrays))
        self.messages.put_nowait(message)


@pytest.fixture
async def site(tmp_path, request) -> AsyncIterator[tuple[Server, str]]:
    server = Server(getattr(request, "param", fresh))  # the server's destinations
    app = create_app(TOKEN)
    stream_route(app, server.make_protocol)
    runner, server.port = await serve(app)
    local = await serve_local(runner, TOKEN, arena_bytes=64 << 20, parent_directory=str(tmp_path))
    server.local = local
    try:
        yield server, local.path
    finally:
        await local.close()
        await runner.cleanup()


async def connect(path: str, replies: asyncio.Queue[Message], **options) -> StreamProtocol:
    return await open_stream(
        "127.0.0.1",
        0,
        options.pop("token", TOKEN),
        fresh,
        replies.put_nowait,
        lambda exc: None,
        timeout_s=10.0,
        local_path=path,
        arena_bytes=options.pop("arena_bytes", 64 << 20),
    )


async def all_given_back(stream: StreamProtocol) -> None:
    """Wait (at most a second) until the peer gave back every region of the stream's arena."""
    for _ in range(100):
        if stream.shared.regions.regions == 0:
            return
        await asyncio.sleep(0.01)
    assert stream.shared.regions.regions == 0


@pytest.mark.parametrize("n", [16, 100_000, 1_000_000])
async def test_frames_cross_both_ways_with_the_same_values(site, n):
    server, path = site
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await connect(path, replies)
    try:
        sent = arrays(n, seed=n)
        for seq in range(3):  # regions are given back and reused
            stream.write(encode_frame(9, seq, sent))
        for seq in range(3):
            reply = await asyncio.wait_for(replies.get(), 10)
            assert reply.header.seq == seq
            for (_, array, _), got in zip(sent, reply.buffers, strict=True):
                assert np.array_equal(np.frombuffer(got, np.float32), array)
        big = n * 12 >= stream.shared.min_bytes
        assert stream.shared.frames_shared == (3 if big else 0)
        assert server.protocols[0].shared.frames_shared == (3 if big else 0)
        await all_given_back(stream)  # soon after the server read them
    finally:
        stream.close()


@pytest.mark.parametrize("site", [in_place], indirect=True)
async def test_a_lent_region_stays_taken_until_the_reader_releases_it(site):
    server, path = site
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await connect(path, replies)
    try:
        sent = arrays(100_000)
        stream.write(encode_frame(9, 1, sent))
        message = await asyncio.wait_for(server.messages.get(), 10)
        assert len(message.borrowed) == 3
        for (_, array, _), got in zip(sent, message.buffers, strict=True):
            assert np.array_equal(np.frombuffer(got, np.float32), array)
        await asyncio.wait_for(replies.get(), 10)  # the echo came after any release would
        assert stream.shared.regions.regions == 3
        server.protocols[0].give_back(message.borrowed)
        await all_given_back(stream)
    finally:
        stream.close()


async def test_a_frame_larger_than_the_arena_goes_on_the_socket(site):
    server, path = site
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await connect(path, replies, arena_bytes=1 << 20)
    try:
        sent = arrays(200_000)  # 2.4 MB, more than the client's 1 MiB arena
        stream.write(encode_frame(9, 1, sent))
        reply = await asyncio.wait_for(replies.get(), 10)
        for (_, array, _), got in zip(sent, reply.buffers, strict=True):
            assert np.array_equal(np.frombuffer(got, np.float32), array)
        assert stream.shared.frames_not_fitting == 1
        assert server.protocols[0].shared.frames_shared == 1  # the server's arena is larger
    finally:
        stream.close()


async def test_a_client_without_an_arena_still_gets_a_stream(site):
    _, path = site
    replies: asyncio.Queue[Message] = asyncio.Queue()
    stream = await connect(path, replies, arena_bytes=0)
    try:
        sent = arrays(100_000)
        stream.write(encode_frame(9, 1, sent))
        reply = await asyncio.wait_for(replies.get(), 10)
        for (_, array, _), got in zip(sent, reply.buffers, strict=True):
            assert np.array_equal(np.frombuffer(got, np.float32), array)
        assert stream.shared.own is None and stream.shared.peer is not None
    finally:
        stream.close()


async def test_a_peer_with_the_wrong_token_cannot_attach(site):
    server, path = site
    with pytest.raises(AuthError):
        await connect(path, asyncio.Queue(), token="wrong")
    assert server.protocols == []


async def test_the_socket_is_private_and_nothing_is_left_after_close(tmp_path):
    app = create_app(TOKEN)
    stream_route(app, Server().make_protocol)
    runner, _ = await serve(app)
    local = await serve_local(runner, TOKEN, parent_directory=str(tmp_path))
    try:
        assert stat.S_IMODE(os.stat(local.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(local.path).st_mode) == 0o600
    finally:
        await local.close()
        await runner.cleanup()
    assert os.listdir(tmp_path) == []


async def test_no_arena_descriptor_reaches_a_child_process(site):
    _, path = site
    stream = await connect(path, asyncio.Queue())
    try:
        # A child that keeps every descriptor it may inherit lists its memory files.
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import os\n"
                "for fd in os.listdir('/proc/self/fd'):\n"
                "    try: print(os.readlink('/proc/self/fd/' + fd))\n"
                "    except OSError: pass\n",
            ],
            close_fds=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "akv-arena" not in child.stdout
        assert any("akv-arena" in name for name in open_files())  # the test would see one
    finally:
        stream.close()


def test_leftovers_of_a_killed_process_are_removed(tmp_path):
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import asyncio, sys\n"
            "from akv_transport.shm import ShmListener\n"
            "async def main():\n"
            "    listener = ShmListener('t', parent_directory=sys.argv[1])\n"
            "    print(listener.path, flush=True)\n"
            "    await asyncio.sleep(60)\n"
            "asyncio.run(main())\n",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        assert remove_leftovers(str(tmp_path)) == []  # alive: kept
    finally:
        child.kill()
        child.wait(timeout=30)
    (removed,) = remove_leftovers(str(tmp_path), pid=child.pid)
    assert removed == os.path.dirname(path)
    assert os.listdir(tmp_path) == []


def test_leftovers_that_hold_more_than_a_socket_are_not_touched(tmp_path):
    directory = tmp_path / "akv-shm-999999999-x"
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")
    assert remove_leftovers(str(tmp_path)) == []
    assert directory.exists()


async def test_the_site_sends_through_one_arena_that_outlives_its_streams(site):
    server, path = site
    streams = [await connect(path, asyncio.Queue()) for _ in range(2)]
    for _ in range(100):
        if len(server.protocols) == 2:
            break
        await asyncio.sleep(0.01)
    served = [protocol.shared for protocol in server.protocols]
    site_arena = server.local.book.arena
    assert served[0].own is served[1].own is site_arena
    assert streams[0].shared.peer is not streams[1].shared.peer  # each maps it on its own
    mine = streams[0].shared
    streams[0].close()
    await asyncio.wait_for(streams[0].wait_closed(), 10)
    assert mine.own.closed and mine.peer.closed  # the client's own arena and its mapping
    for _ in range(100):
        if served[0].peer.closed:
            break
        await asyncio.sleep(0.01)
    assert served[0].peer.closed and not site_arena.closed  # the other stream still uses it
    await server.local.close()
    assert not site_arena.closed
    streams[1].close()
    await asyncio.wait_for(streams[1].wait_closed(), 10)
    for _ in range(100):
        if site_arena.closed:
            break
        await asyncio.sleep(0.01)
    assert site_arena.closed  # the site and its last stream are gone


def shared_book(nbytes: int = 1 << 20) -> tuple[ArenaBook, SharedMemory, SharedMemory]:
    """A book the caller holds (as a site does) and two streams that send through it."""
    book = ArenaBook(Arena(nbytes), min_bytes=1)
    book.join()
    return book, SharedMemory(book, None, min_bytes=1), SharedMemory(book, None, min_bytes=1)


def read_placed(arena: Arena, placed: list) -> list[np.ndarray]:
    reader = FrameReader(fresh)
    reader.arena = arena.view(0, arena.nbytes)
    wire = b"".join(bytes(b) for b in placed)
    reader.get_buffer(-1)[: len(wire)] = wire
    (message,) = reader.buffer_updated(len(wire))
    return [np.frombuffer(buffer, np.float32) for buffer in message.buffers]


def test_a_region_reserved_in_a_shared_arena_reaches_every_stream_without_a_copy():
    book, first, second = shared_book()
    value = np.frombuffer(book.take(4000), np.float32)
    value[:] = np.arange(1000)
    assert book.holds(value) and not book.holds(np.arange(1000, dtype=np.float32))
    frames = [s.place(encode_frame(7, 1, [("a", value, 0)])) for s in (first, second)]
    assert first.arrays_in_place == second.arrays_in_place == 1
    assert book.regions.regions == 1
    for placed in frames:
        (got,) = read_placed(book.arena, placed)
        assert np.array_equal(got, np.arange(1000))
    book.give_back(value)  # replaced by a newer value: no longer the caller's ...
    assert not book.holds(value) and book.regions.regions == 1  # ... but both peers read it
    first.given_back([0])
    assert book.regions.regions == 1
    with pytest.raises(FrameError, match="offset 0, in a reserved region not sent"):
        first.given_back([0])  # this stream's peer released it already
    second.given_back([0])
    assert book.regions.regions == 0
    first.close()
    second.close()
    book.leave()
    assert book.arena.closed


def test_a_stream_cannot_release_a_region_another_stream_sent():
    book, first, second = shared_book()
    placed = first.place(encode_frame(7, 1, arrays(1000)))
    offsets = [int(x) for x in np.frombuffer(bytes(placed[2]), np.uint64)]
    assert book.regions.regions == 3 and first._sent  # three copies, sent on the first
    with pytest.raises(FrameError, match=f"offset {offsets[0]}, where no region"):
        second.given_back([offsets[0]])
    assert book.regions.regions == 3
    first.given_back(offsets)
    assert book.regions.regions == 0
    book.leave()


def test_closing_a_stream_gives_back_what_its_peer_never_released():
    book, stream, other = shared_book()
    value = np.frombuffer(book.take(4000), np.float32)
    stream.place(encode_frame(7, 1, [("a", value, 0), ("b", np.ones(1000, np.float32), 0)]))
    assert book.regions.regions == 2
    book.give_back(value)
    stream.close()
    stream.close()  # idempotent
    assert book.regions.regions == 0 and not book.arena.closed  # still the site's and other's
    assert stream.place(encode_frame(7, 2, arrays(1000))) is None  # closed: on the socket
    other.close()
    assert not book.arena.closed
    book.leave()
    assert book.arena.closed


async def test_a_site_refuses_nothing_but_cannot_be_reached_once_closed(tmp_path):
    app = create_app(TOKEN)
    runner, _ = await serve(app)
    local = await serve_local(runner, TOKEN, parent_directory=str(tmp_path))
    path = local.path
    await local.close()
    await runner.cleanup()
    with pytest.raises(TransportError):
        await connect(path, asyncio.Queue())


def test_a_region_too_small_to_travel_through_the_arena_is_not_reserved():
    own = Arena(1 << 20)
    shared = SharedMemory(own, None, min_bytes=4096)
    assert shared.take(4095) is None  # it would go on the socket anyway
    region = shared.take(4096)
    assert region is not None and shared.regions.regions == 1
    shared.give_back(region)
    own.close()


def test_a_reservation_can_leave_part_of_the_arena_free():
    book = ArenaBook(Arena(4096), min_bytes=1)
    book.join()
    first = book.take(1000, keep_free=2048)
    assert first is not None and book.regions.used_bytes == 1024
    assert book.take(1000, keep_free=2100) is None  # 4096 - 1024 - 1000 < 2100
    second = book.take(1000, keep_free=1024)
    assert second is not None and book.regions.used_bytes == 2048
    book.give_back(first)
    assert book.regions.used_bytes == 1024
    book.leave()
