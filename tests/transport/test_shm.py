"""Shared memory between processes on one host (issue #10): arenas, descriptors over Unix
sockets, the private authenticated socket, host identity, and the round-trip measurement.

Real processes and real sockets: children are started with ``sys.executable`` and ended by
PID with bounded waits (:func:`children`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import mmap
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("shared memory through memfd is Linux only", allow_module_level=True)

from hypothesis import given
from hypothesis import strategies as st

from akv_transport import (
    AuthError,
    FrameError,
    TransportError,
    _shm_bench,
    _shm_host,
    _shm_socket,
    _shm_wire,
)
from akv_transport.shm import (
    HEADER_BYTES,
    MAX_ARENA_BYTES,
    MAX_QUEUED_FDS,
    Arena,
    MessageParser,
    ShmConnection,
    ShmListener,
    ShmMessage,
    connect_shm,
    host_identity,
    identity_from,
    next_arena_size,
    recv_fds,
    send_fds,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "shm-test-token-0123456789abcdef"
#: How long a child may take for anything (it imports transport first).
CHILD_S = 20.0


# --------------------------------------------------------------------------- helpers


class Children:
    """Starts Python children; ends every one still alive by PID, with bounded waits."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []

    def start(
        self, code: str, *args: object, pass_fds: tuple[int, ...] = (), close_fds: bool = True
    ) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        process = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=pass_fds,
            close_fds=close_fds,
            cwd=ROOT,
            env=env,
        )
        self.processes.append(process)
        return process

    def finish(self, process: subprocess.Popen[str]) -> str:
        """Wait for a normal exit (bounded); return stdout, or fail with stderr."""
        try:
            stdout, stderr = process.communicate(timeout=CHILD_S)
        except subprocess.TimeoutExpired:
            self.kill(process)
            pytest.fail("the child did not finish in time")
        assert process.returncode == 0, stderr
        return stdout

    def kill(self, process: subprocess.Popen[str]) -> None:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=CHILD_S)


@pytest.fixture
def children() -> Iterator[Children]:
    started = Children()
    try:
        yield started
    finally:
        for process in started.processes:
            started.kill(process)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


def read_line(process: subprocess.Popen[str]) -> str:
    """One line of the child's stdout, waiting at most CHILD_S."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], CHILD_S)
    if not ready:
        pytest.fail("the child printed nothing in time")
    line = process.stdout.readline()
    if not line:
        assert process.stderr is not None
        pytest.fail(f"the child ended early: {process.stderr.read()}")
    return line.strip()


def unique_name() -> str:
    return f"akv-test-{uuid.uuid4().hex}"


def memfd_holders(name: str, pids: list[str] | None = None) -> list[str]:
    """Every ``/proc/PID/fd/N`` and ``/proc/PID/maps`` (of the processes we may read) that
    refers to the memory file named ``name``."""
    marker = f"/memfd:{name} "
    found = []
    for pid in pids if pids is not None else [p for p in os.listdir("/proc") if p.isdigit()]:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (os.readlink(f"/proc/{pid}/fd/{fd}") + " ").startswith(marker):
                        found.append(f"/proc/{pid}/fd/{fd}")
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            if marker in maps.read():
                found.append(f"/proc/{pid}/maps")
    return found


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def our_directories() -> set[str]:
    prefix = f"akv-shm-{os.getpid()}-"
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(prefix)}


# --------------------------------------------------------------------------- arenas

CHILD_WRITES_THROUGH_A_SOCKETPAIR = """
import socket, sys
from akv_transport.shm import Arena, recv_fds, send_fds
sock = socket.socket(fileno=int(sys.argv[1]))
message = recv_fds(sock, 1)
(fd,) = message.fds
arena = Arena.from_fd(fd)
seen = bytes(arena.view(100, 11))
arena.view(5000, 10)[:] = b"from child"
send_fds(sock, seen)
arena.close()
"""


def test_a_child_that_adopts_the_fd_reads_and_writes_the_parents_arena(children):
    ours, theirs = socket.socketpair()
    ours.settimeout(CHILD_S)
    child = children.start(
        CHILD_WRITES_THROUGH_A_SOCKETPAIR, theirs.fileno(), pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    with ours, Arena(1 << 16) as arena:
        arena.view(100, 11)[:] = b"from parent"
        send_fds(ours, b"arena", [arena.fd])
        reply = recv_fds(ours, 0)
        assert reply.data == b"from parent"
        assert bytes(arena.view(5000, 10)) == b"from child"
        assert bytes(arena.view(0, 100)) == bytes(100)
    children.finish(child)


CHILD_CONNECTS_AND_WRITES = """
import asyncio, sys
from akv_transport.shm import Arena, connect_shm
async def main():
    connection = await connect_shm(sys.argv[1], sys.argv[2], timeout_s=20)
    message = await connection.recv()
    (fd,) = message.fds
    arena = Arena.from_fd(fd)
    offset = int(message.data)
    arena.view(offset, 5)[:] = b"child"
    await connection.send(b"written")
    arena.close()
    connection.close()
asyncio.run(main())
"""


async def test_a_child_attached_through_the_listener_writes_into_the_arena(children):
    async with ShmListener(TOKEN) as listener:
        child = children.start(CHILD_CONNECTS_AND_WRITES, listener.path, TOKEN)
        connection = await asyncio.wait_for(listener.accept(), CHILD_S)
        with Arena(4096) as arena:
            await connection.send(b"64", [arena.fd])
            reply = await asyncio.wait_for(connection.recv(), CHILD_S)
            assert reply == ShmMessage(b"written", ())
            assert bytes(arena.view(64, 5)) == b"child"
        connection.close()
        await asyncio.to_thread(children.finish, child)
        assert listener.statistics().accepted == 1


def test_a_view_still_exported_keeps_the_memory_mapped_after_close():
    name = unique_name()
    arena = Arena(4096, name=name)
    fd = arena.fd
    view = arena.view(8, 4)
    arena.close()
    assert arena.closed and not arena.unmapped
    assert not fd_is_open(fd)
    view[:] = b"safe"  # no crash: the mapping is still there
    assert bytes(view) == b"safe"
    # The mapping (and, before Python 3.13, the mmap object's duplicate of the fd).
    assert "/proc/self/maps" in memfd_holders(name, ["self"])
    with pytest.raises(TransportError, match="closed"):
        arena.view(0, 1)
    with pytest.raises(TransportError, match="closed"):
        _ = arena.fd
    arena.close()  # idempotent
    del view
    gc.collect()
    assert memfd_holders(name, ["self"]) == []


def test_close_unmaps_and_closes_the_fd_at_once_when_no_view_is_exported():
    name = unique_name()
    arena = Arena(4096, name=name)
    fd = arena.fd
    view = arena.view(0, 16)
    view.release()
    assert {f"/proc/self/fd/{fd}", "/proc/self/maps"} <= set(memfd_holders(name, ["self"]))
    arena.close()
    assert arena.unmapped
    assert not fd_is_open(fd)
    assert memfd_holders(name, ["self"]) == []


def test_an_arena_has_no_name_in_the_file_system():
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    name = unique_name()
    with Arena(4096, name=name) as arena:
        assert os.readlink(f"/proc/self/fd/{arena.fd}") == f"/memfd:{name} (deleted)"
        if os.path.isdir("/dev/shm"):
            assert set(os.listdir("/dev/shm")) == shm_before
        assert not [n for n in set(os.listdir(tempfile.gettempdir())) - tmp_before if name in n]


def test_an_arena_cannot_be_shrunk_or_grown_under_a_peers_mapping():
    with Arena(8192) as arena:
        for size in (4096, 16384, 0):
            with pytest.raises(PermissionError):
                os.ftruncate(arena.fd, size)
        assert os.fstat(arena.fd).st_size == 8192


def test_from_fd_refuses_a_memfd_that_is_not_sealed_and_closes_it():
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(FrameError, match="not sealed against shrinking"):
        Arena.from_fd(fd)
    assert not fd_is_open(fd)


def test_from_fd_refuses_what_is_not_a_memory_file(tmp_path):
    read_end, write_end = os.pipe()
    with pytest.raises(FrameError, match="not a regular file"):
        Arena.from_fd(read_end)
    assert not fd_is_open(read_end)
    os.close(write_end)
    path = tmp_path / "file"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    with pytest.raises(FrameError, match="not a memory file"):
        Arena.from_fd(fd)
    assert not fd_is_open(fd)


def test_from_fd_refuses_an_arena_beyond_the_bound():
    with Arena(8192) as arena:
        fd = os.dup(arena.fd)
        with pytest.raises(FrameError, match=r"8192 bytes, outside \[1, 4096\]"):
            Arena.from_fd(fd, max_nbytes=4096)
        assert not fd_is_open(fd)
        adopted = Arena.from_fd(os.dup(arena.fd), max_nbytes=8192)
        adopted.view(0, 3)[:] = b"abc"
        assert bytes(arena.view(0, 3)) == b"abc"
        adopted.close()


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (0, -1), (4000, 97), (4097, 0)])
def test_a_view_outside_the_arena_is_refused(offset, nbytes):
    with Arena(4096) as arena, pytest.raises(FrameError, match="outside the arena's 4096"):
        arena.view(offset, nbytes)


def test_the_size_of_an_arena_is_checked():
    for nbytes in (0, MAX_ARENA_BYTES + 1):
        with pytest.raises(ValueError, match="outside"):
            Arena(nbytes)


def test_grow_returns_a_larger_arena_with_the_bytes_and_leaves_the_old_one_open():
    with Arena(4096) as small:
        small.view(4090, 6)[:] = b"edge!!"
        with small.grow(5000) as grown:
            assert grown.nbytes == 8192
            assert bytes(grown.view(4090, 6)) == b"edge!!"
            assert bytes(grown.view(4096, 4096)) == bytes(4096)
            assert grown.fd != small.fd
            with small.grow(100_000, copy=False) as bigger:
                assert bigger.nbytes == next_arena_size(4096, 100_000)
                assert bytes(bigger.view(4090, 6)) == bytes(6)
        assert not small.closed


@given(current=st.integers(0, 1 << 30), needed=st.integers(0, 1 << 32))
def test_the_next_arena_size_holds_the_need_doubles_and_is_in_pages(current, needed):
    size = next_arena_size(current, needed)
    assert size >= max(needed, 2 * current, 1)
    assert size % mmap.PAGESIZE == 0
    assert size - max(needed, 2 * current, 1) < mmap.PAGESIZE


def test_the_next_arena_size_refuses_beyond_the_bound():
    with pytest.raises(ValueError, match="MAX_ARENA_BYTES"):
        next_arena_size(0, MAX_ARENA_BYTES + 1)


# --------------------------------------------------------------------------- inheritance

CHILD_REPORTS_ITS_FDS = """
import os
for fd in os.listdir("/proc/self/fd"):
    try:
        print(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
"""


def fd_links() -> set[str]:
    """What each of this process's descriptors refers to (``/memfd:...``, ``socket:[...]``)."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
    return links


async def test_no_fd_of_the_shared_memory_path_is_inherited_by_a_child(children):
    before = fd_links()
    name = unique_name()
    arena = Arena(4096, name=name)
    blocking_ours, blocking_theirs = socket.socketpair()
    send_fds(blocking_theirs, b"", [arena.fd])
    (received_blocking,) = recv_fds(blocking_ours, 1).fds
    listener = ShmListener(TOKEN)
    client = await connect_shm(listener.path, TOKEN)
    server = await listener.accept()
    await client.send(b"", [arena.fd])
    (received_async,) = (await server.recv()).fds
    adopted = Arena.from_fd(os.dup(received_async))
    ours = fd_links() - before
    # The arena, its mapping's duplicate, the fds received both ways, the adopted arena;
    # the listening socket, both ends of its connection and of the socketpair.
    assert f"/memfd:{name} (deleted)" in ours
    assert len([link for link in ours if link.startswith("socket:")]) >= 5
    control_name = unique_name()
    control_arena = Arena(4096, name=control_name)
    control = os.dup(control_arena.fd)
    os.set_inheritable(control, True)
    try:
        child = children.start(CHILD_REPORTS_ITS_FDS, close_fds=False)
        inherited = set((await asyncio.to_thread(children.finish, child)).split("\n"))
        assert f"/memfd:{control_name} (deleted)" in inherited  # the test can see inheritance
        assert ours & inherited == set()
    finally:
        for fd in (received_blocking, received_async, control):
            os.close(fd)
        for closing in (client, server, adopted, control_arena, arena):
            closing.close()
        await listener.close()
        blocking_ours.close()
        blocking_theirs.close()


def test_received_fds_are_close_on_exec_without_msg_cmsg_cloexec(monkeypatch):
    monkeypatch.setattr(_shm_wire, "_RECV_FLAGS", 0)
    ours, theirs = socket.socketpair()
    with ours, theirs, Arena(4096) as arena:
        send_fds(theirs, b"x", [arena.fd])
        (fd,) = recv_fds(ours, 1).fds
        try:
            assert not os.get_inheritable(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- send_fds / recv_fds


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.settimeout(10)
    with ours, theirs:
        yield ours, theirs


def nothing_to_read(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0.05)
    return not readable


def test_data_and_fds_arrive_together_and_in_order(pair):
    ours, theirs = pair
    with Arena(4096) as first, Arena(4096) as second:
        send_fds(theirs, b"one", [first.fd, second.fd])
        send_fds(theirs, memoryview(b"two"))
        message = recv_fds(ours, 2)
        assert message.data == b"one" and len(message.fds) == 2
        assert recv_fds(ours, 2) == ShmMessage(b"two", ())
        for fd, arena in zip(message.fds, (first, second), strict=True):
            assert os.fstat(fd).st_ino == os.fstat(arena.fd).st_ino
            os.close(fd)


def test_sending_too_many_fds_or_bytes_is_refused_before_anything_is_sent(pair):
    ours, theirs = pair
    with Arena(4096) as arena, pytest.raises(FrameError, match="3 fds exceed the bound of 2"):
        send_fds(theirs, b"", [arena.fd] * 3, max_fds=2)
    with pytest.raises(FrameError, match="11 data bytes exceed the bound of 10"):
        send_fds(theirs, bytes(11), max_bytes=10)
    assert nothing_to_read(ours)


def test_receiving_more_fds_than_the_bound_closes_every_one(pair):
    ours, theirs = pair
    name = unique_name()
    with Arena(4096, name=name) as arena:
        send_fds(theirs, b"many", [arena.fd] * 3)
        own = memfd_holders(name, ["self"])
        with pytest.raises(FrameError, match="more fds than the bound of 2"):
            recv_fds(ours, 2)
        assert memfd_holders(name, ["self"]) == own


def test_receiving_a_message_longer_than_the_bound_is_refused_and_its_fds_closed(pair):
    ours, theirs = pair
    name = unique_name()
    with Arena(4096, name=name) as arena:
        send_fds(theirs, bytes(100), [arena.fd])
        own = memfd_holders(name, ["self"])
        with pytest.raises(FrameError, match="100 data bytes exceed the bound of 99"):
            recv_fds(ours, 1, max_bytes=99)
        assert memfd_holders(name, ["self"]) == own


def test_a_header_that_declares_fds_that_did_not_come_is_refused(pair):
    ours, theirs = pair
    theirs.sendall(struct.pack("<IHH", 0, 1, 0))
    with pytest.raises(FrameError, match="declares 1 fds but 0 arrived"):
        recv_fds(ours, 1)


def test_a_header_with_flags_is_refused(pair):
    ours, theirs = pair
    theirs.sendall(struct.pack("<IHH", 0, 0, 1))
    with pytest.raises(FrameError, match="flags 0x1"):
        recv_fds(ours, 1)


def test_a_stream_that_ends_inside_a_message_is_a_frame_error(pair):
    ours, theirs = pair
    theirs.sendall(struct.pack("<IHH", 10, 0, 0) + b"abc")
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match="ended 11 bytes into a message"):
        recv_fds(ours, 1)


def test_a_stream_that_ends_between_messages_is_a_transport_error(pair):
    ours, theirs = pair
    send_fds(theirs, b"last")
    theirs.shutdown(socket.SHUT_WR)
    assert recv_fds(ours, 1).data == b"last"
    with pytest.raises(TransportError, match="closed the connection") as caught:
        recv_fds(ours, 1)
    assert not isinstance(caught.value, FrameError)


def test_recv_fds_reads_no_byte_of_the_next_message(pair):
    ours, theirs = pair
    send_fds(theirs, b"first")
    theirs.sendall(b"raw bytes")
    assert recv_fds(ours, 1).data == b"first"
    assert ours.recv(100) == b"raw bytes"


def test_a_socket_error_is_a_transport_error_with_its_cause(pair):
    ours, _ = pair
    ours.settimeout(0.05)
    with pytest.raises(TransportError, match="cannot receive") as caught:
        recv_fds(ours, 1)
    assert isinstance(caught.value.__cause__, OSError)


messages = st.lists(st.binary(max_size=300), max_size=20)


@given(payloads=messages, cuts=st.lists(st.integers(1, 400), max_size=40))
def test_the_parser_returns_the_messages_whatever_the_reads(payloads, cuts):
    stream = b"".join(
        _shm_wire.encode_header(len(p), 0, max_bytes=300, max_fds=0) + p for p in payloads
    )
    parser = MessageParser(max_bytes=300, max_fds=0)
    got: list[ShmMessage] = []
    position = 0
    for cut in [*cuts, len(stream)]:
        parser.feed(stream[position : position + cut])
        position += cut
        while (message := parser.next_message()) is not None:
            got.append(message)
    parser.eof()
    assert [message.data for message in got] == payloads


def test_the_parser_refuses_fds_that_came_with_no_message():
    name = unique_name()
    with Arena(4096, name=name) as arena:
        fd = os.dup(arena.fd)
        parser = MessageParser()
        parser.feed(_shm_wire.encode_header(1, 0, max_bytes=1, max_fds=0) + b"x", [fd])
        assert parser.next_message() == ShmMessage(b"x", ())
        with pytest.raises(FrameError, match="1 fds arrived with no message"):
            parser.next_message()
        assert not fd_is_open(fd)


def test_the_parser_closes_what_it_holds_when_the_stream_is_cut():
    with Arena(4096) as arena:
        fd = os.dup(arena.fd)
        parser = MessageParser()
        parser.feed(_shm_wire.encode_header(5, 1, max_bytes=5, max_fds=1), [fd])
        assert parser.next_message() is None
        assert parser.held_fds == 1 and parser.buffered_bytes == HEADER_BYTES
        with pytest.raises(FrameError, match="ended 8 bytes into a message"):
            parser.eof()
        assert not fd_is_open(fd)


# --------------------------------------------------------------------------- the listener


async def test_the_socket_is_0600_in_a_0700_directory_of_our_own():
    async with ShmListener(TOKEN) as listener:
        directory = os.stat(listener.directory)
        socket_file = os.stat(listener.path)
        assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
        assert stat.S_ISSOCK(socket_file.st_mode) and stat.S_IMODE(socket_file.st_mode) == 0o600
        assert directory.st_uid == socket_file.st_uid == os.getuid()
        assert os.listdir(listener.directory) == ["socket"]
        assert os.path.dirname(listener.path) == listener.directory


async def test_nothing_is_left_in_the_file_system_after_close():
    before = our_directories()
    listener = ShmListener(TOKEN)
    assert our_directories() - before == {os.path.basename(listener.directory)}
    client = await connect_shm(listener.path, TOKEN)
    await listener.close()
    assert our_directories() == before
    assert not os.path.exists(listener.directory)
    await listener.close()  # idempotent
    with pytest.raises(TransportError, match="closed by the peer"):
        await asyncio.wait_for(client.recv(), 10)  # a connection nobody accepted is closed
    client.close()


async def test_a_wrong_token_cannot_attach_and_the_listener_keeps_serving():
    async with ShmListener(TOKEN) as listener:
        with pytest.raises(AuthError, match="refused the token"):
            await connect_shm(listener.path, TOKEN + "x")
        with pytest.raises(AuthError):
            await connect_shm(listener.path, TOKEN[:-1])
        statistics = listener.statistics()
        assert (statistics.refused, statistics.pending, statistics.accepted) == (2, 0, 0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(listener.accept(), 0.2)
        client = await connect_shm(listener.path, TOKEN)
        server = await asyncio.wait_for(listener.accept(), 10)
        await client.send(b"ping")
        assert (await asyncio.wait_for(server.recv(), 10)).data == b"ping"
        await server.send(b"pong")
        assert (await asyncio.wait_for(client.recv(), 10)).data == b"pong"
        assert listener.statistics().accepted == 1
        client.close()
        server.close()


async def test_fds_sent_with_the_token_are_never_attached():
    name = unique_name()
    async with ShmListener(TOKEN) as listener:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        with sock, Arena(4096, name=name) as arena:
            await asyncio.to_thread(sock.connect, listener.path)
            own = memfd_holders(name, ["self"])
            await asyncio.to_thread(send_fds, sock, TOKEN.encode(), [arena.fd])
            with pytest.raises(TransportError):  # closed (or reset) with no answer
                await asyncio.to_thread(recv_fds, sock, 0)
            assert memfd_holders(name, ["self"]) == own
        assert listener.statistics().refused == 1
        assert listener.statistics().pending == 0


async def test_connections_beyond_the_pending_bound_are_closed_at_once():
    async with ShmListener(TOKEN, max_pending_connections=1) as listener:
        first = await connect_shm(listener.path, TOKEN)
        with pytest.raises(TransportError, match="cannot connect"):  # closed, or reset
            await connect_shm(listener.path, TOKEN, timeout_s=10)
        statistics = listener.statistics()
        assert (statistics.pending, statistics.refused) == (1, 1)
        server = await asyncio.wait_for(listener.accept(), 10)
        second = await connect_shm(listener.path, TOKEN)  # room again
        for connection in (first, server, second):
            connection.close()


async def test_a_client_that_says_nothing_is_dropped_after_the_handshake_timeout():
    async with ShmListener(TOKEN, handshake_timeout_s=0.2) as listener:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        with sock:
            await asyncio.to_thread(sock.connect, listener.path)
            assert await asyncio.to_thread(sock.recv, 100) == b""
        assert listener.statistics().refused == 1


async def test_a_token_longer_than_the_bound_is_refused():
    async with ShmListener(TOKEN) as listener:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        with sock:
            await asyncio.to_thread(sock.connect, listener.path)
            await asyncio.to_thread(sock.sendall, struct.pack("<IHH", 5000, 0, 0))
            assert await asyncio.to_thread(sock.recv, 100) == b""
        assert listener.statistics().refused == 1
    with pytest.raises(ValueError, match="outside"):
        await connect_shm("/nonexistent", "x" * 5000)


async def test_a_failure_of_the_listeners_own_code_surfaces_at_accept(monkeypatch):
    def broken(*args: object) -> bool:
        raise RuntimeError("a bug in the handshake")

    monkeypatch.setattr(_shm_socket, "hmac", types.SimpleNamespace(compare_digest=broken))
    async with ShmListener(TOKEN) as listener:
        waiting = asyncio.ensure_future(listener.accept())
        with contextlib.suppress(TransportError):
            await connect_shm(listener.path, TOKEN, timeout_s=5)
        with pytest.raises(RuntimeError, match="a bug in the handshake"):
            await asyncio.wait_for(waiting, 10)


async def test_accept_raises_once_the_listener_closes():
    listener = ShmListener(TOKEN)
    waiting = asyncio.ensure_future(listener.accept())
    await asyncio.sleep(0)
    await listener.close()
    with pytest.raises(TransportError, match="closed"):
        await asyncio.wait_for(waiting, 10)


async def test_a_socket_path_too_long_is_refused_and_leaves_nothing(tmp_path):
    parent = tmp_path / ("d" * 100)
    parent.mkdir()
    with pytest.raises(TransportError, match="longer than 107 bytes"):
        ShmListener(TOKEN, parent_directory=str(parent))
    assert list(parent.iterdir()) == []


async def test_connecting_where_nobody_listens_is_a_transport_error(tmp_path):
    with pytest.raises(TransportError, match="cannot connect") as caught:
        await connect_shm(str(tmp_path / "none"), TOKEN, timeout_s=5)
    assert isinstance(caught.value.__cause__, OSError)


CHILD_HOLDS_A_LISTENER_AND_AN_ARENA = """
import asyncio, sys
from akv_transport.shm import Arena, ShmListener
async def main():
    listener = ShmListener(sys.argv[1], parent_directory=sys.argv[3])
    arena = Arena(1 << 20, name=sys.argv[2])
    arena.view(0, 4)[:] = b"held"
    print(listener.directory, arena.fd, flush=True)
    connection = await listener.accept()
    await connection.send(b"attached", [arena.fd])
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_after_a_sigkill_only_the_directory_is_left_and_the_memory_is_gone(
    children, tmp_path
):
    # A directory of its own: a server started meanwhile by another test removes what dead
    # processes left in the shared temporary directory (remove_leftovers), this one included.
    name = unique_name()
    child = children.start(CHILD_HOLDS_A_LISTENER_AND_AN_ARENA, TOKEN, name, tmp_path)
    directory, fd = (await asyncio.to_thread(read_line, child)).split()
    try:
        path = os.path.join(directory, "socket")
        assert os.readlink(f"/proc/{child.pid}/fd/{fd}") == f"/memfd:{name} (deleted)"
        connection = await connect_shm(path, TOKEN, timeout_s=CHILD_S)
        message = await asyncio.wait_for(connection.recv(), CHILD_S)
        with Arena.from_fd(message.fds[0]) as arena:
            assert bytes(arena.view(0, 4)) == b"held"
        held = memfd_holders(name)
        assert {f"/proc/{child.pid}/fd/{fd}", f"/proc/{child.pid}/maps"} <= set(held)
        assert all(holder.startswith(f"/proc/{child.pid}/") for holder in held)

        os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(child.wait, CHILD_S)
        assert child.returncode == -signal.SIGKILL
        assert memfd_holders(name) == []  # no descriptor, no mapping: the kernel freed it
        with pytest.raises(TransportError):
            await asyncio.wait_for(connection.recv(), CHILD_S)
        connection.close()
        assert os.listdir(directory) == ["socket"]  # the one thing a SIGKILL leaves
        with pytest.raises(TransportError, match="cannot connect"):
            await connect_shm(path, TOKEN, timeout_s=5)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, "socket"))
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(directory)


# --------------------------------------------------------------------------- connections


@pytest.fixture
async def connected() -> AsyncIterator[tuple[ShmConnection, ShmConnection]]:
    ours, theirs = socket.socketpair()
    first, second = ShmConnection(ours), ShmConnection(theirs)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


async def test_messages_and_fds_arrive_in_order(connected):
    sender, receiver = connected
    with Arena(4096) as arena:
        for index in range(50):
            await sender.send(str(index).encode(), [arena.fd] if index % 7 == 0 else [])
        for index in range(50):
            message = await asyncio.wait_for(receiver.recv(), 10)
            assert message.data == str(index).encode()
            assert len(message.fds) == (1 if index % 7 == 0 else 0)
            for fd in message.fds:
                assert os.fstat(fd).st_ino == os.fstat(arena.fd).st_ino
                os.close(fd)


async def test_a_connection_stops_reading_while_its_queue_is_full(connected):
    sender, receiver = connected
    with Arena(4096) as arena:
        for index in range(40):
            await sender.send(bytes([index]), [arena.fd] * 4)
        for _ in range(1000):  # until the receiver has read up to its bound (or 10 s)
            if not receiver.statistics().reading:
                break
            await asyncio.sleep(0.01)
        held = receiver.statistics()
        assert not held.reading
        assert MAX_QUEUED_FDS <= held.queued_fds < MAX_QUEUED_FDS + 4
        for index in range(40):
            message = await asyncio.wait_for(receiver.recv(), 10)
            assert message.data == bytes([index]) and len(message.fds) == 4
            for fd in message.fds:
                os.close(fd)
        assert receiver.statistics().queued_fds == 0


async def test_a_message_that_waits_for_room_keeps_its_fds_after_the_caller_closed_them():
    ours, theirs = socket.socketpair()
    sender = ShmConnection(ours)
    name = unique_name()
    big = bytes(range(256)) * 3000  # more than a socketpair's buffer holds
    first = asyncio.ensure_future(sender.send(big))
    await asyncio.sleep(0.05)
    assert sender.statistics().waiting_sends == 1
    arena = Arena(4096, name=name)
    arena.view(0, 5)[:] = b"still"
    second = asyncio.ensure_future(sender.send(b"with fd", [arena.fd]))
    await asyncio.sleep(0)
    assert sender.statistics().waiting_sends == 2
    arena.close()  # the connection holds a duplicate until the kernel has the message
    receiver = ShmConnection(theirs)
    try:
        assert (await asyncio.wait_for(receiver.recv(), 10)).data == big
        message = await asyncio.wait_for(receiver.recv(), 10)
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert message.data == b"with fd"
        with Arena.from_fd(message.fds[0]) as adopted:
            assert bytes(adopted.view(0, 5)) == b"still"
        assert memfd_holders(name, ["self"]) == []
    finally:
        sender.close()
        receiver.close()


async def test_a_peer_that_breaks_the_framing_is_cut_after_its_good_messages(connected):
    sender, receiver = connected
    await sender.send(b"good")
    sender._sock.send(struct.pack("<IHH", 0, 0, 7))
    assert (await asyncio.wait_for(receiver.recv(), 10)).data == b"good"
    with pytest.raises(FrameError, match="flags 0x7"):
        await asyncio.wait_for(receiver.recv(), 10)
    with pytest.raises(TransportError):
        await asyncio.wait_for(sender.recv(), 10)  # the receiver shut the connection down


async def test_a_peer_that_closes_ends_recv_with_a_transport_error(connected):
    sender, receiver = connected
    await sender.send(b"bye")
    sender.close()
    assert (await asyncio.wait_for(receiver.recv(), 10)).data == b"bye"
    with pytest.raises(TransportError, match="closed by the peer") as caught:
        await asyncio.wait_for(receiver.recv(), 10)
    assert not isinstance(caught.value, FrameError)


async def test_a_closed_connection_refuses_and_wakes_its_waiters(connected):
    _, receiver = connected
    waiting = asyncio.ensure_future(receiver.recv())
    await asyncio.sleep(0)
    receiver.close()
    with pytest.raises(TransportError, match="closed"):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(TransportError, match="closed"):
        await receiver.send(b"x")
    with pytest.raises(TransportError, match="closed"):
        await receiver.recv()
    receiver.close()  # idempotent
    assert receiver.closed


async def test_sending_over_the_bounds_is_refused_before_anything_is_sent(connected):
    sender, receiver = connected
    with pytest.raises(FrameError, match="exceed the bound"):
        await sender.send(bytes(_shm_wire.DEFAULT_MAX_MESSAGE_BYTES + 1))
    with Arena(4096) as arena, pytest.raises(FrameError, match="17 fds exceed"):
        await sender.send(b"", [arena.fd] * 17)
    await sender.send(b"after")
    assert (await asyncio.wait_for(receiver.recv(), 10)).data == b"after"


async def test_fds_do_not_pass_over_tcp():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        client = socket.create_connection(listening.getsockname())
        server, _ = listening.accept()
    first, second = ShmConnection(client), ShmConnection(server)
    try:
        with Arena(4096) as arena, pytest.raises(FrameError, match="AF_UNIX"):
            await first.send(b"", [arena.fd])
        await first.send(b"over tcp")
        assert (await asyncio.wait_for(second.recv(), 10)).data == b"over tcp"
    finally:
        first.close()
        second.close()


# --------------------------------------------------------------------------- host identity

CHILD_PRINTS_HOST_IDENTITY = "from akv_transport.shm import host_identity; print(host_identity())"


def test_host_identity_is_equal_in_the_same_process_and_in_a_child(children):
    identity = host_identity()
    assert identity == host_identity()
    assert identity.startswith("boot=") and " ipc=ipc:[" in identity and " mnt=mnt:[" in identity
    child = children.start(CHILD_PRINTS_HOST_IDENTITY)
    assert children.finish(child).strip() == identity


def facts(**changes: str | None) -> dict[str, str | None]:
    known = {
        _shm_host._BOOT_ID: "0b6c4c0e-2c43-4d55-9f0e-5a9d31a1c0de",
        "/proc/self/ns/ipc": "ipc:[4026531839]",
        "/proc/self/ns/mnt": "mnt:[4026531841]",
    }
    names = {"boot": _shm_host._BOOT_ID, "ipc": "/proc/self/ns/ipc", "mnt": "/proc/self/ns/mnt"}
    for name, value in changes.items():
        known[names[name]] = value
    return known


@pytest.mark.parametrize(
    "change",
    [
        {"boot": "5f0e2d7a-0000-4000-8000-000000000000"},
        {"ipc": "ipc:[4026532000]"},
        {"mnt": "mnt:[1]"},
    ],
)
def test_host_identity_differs_when_the_boot_or_a_namespace_differs(monkeypatch, change):
    monkeypatch.setattr(_shm_host, "_read_proc", facts().get)
    here = host_identity()
    monkeypatch.setattr(_shm_host, "_read_proc", facts(**change).get)
    assert host_identity() != here


@pytest.mark.parametrize("missing", ["boot", "ipc", "mnt"])
def test_without_a_fact_the_identity_matches_no_other_process(monkeypatch, missing):
    monkeypatch.setattr(_shm_host, "_read_proc", facts(**{missing: None}).get)
    unknown = host_identity()
    assert unknown.startswith("unknown ")
    monkeypatch.setattr(_shm_host, "_read_proc", facts().get)
    assert host_identity() != unknown
    monkeypatch.setattr(_shm_host.os, "getpid", lambda: -1)
    monkeypatch.setattr(_shm_host, "_read_proc", facts(**{missing: None}).get)
    assert host_identity() != unknown


def test_the_identity_reads_the_real_proc_files():
    assert _shm_host._read_proc(_shm_host._BOOT_ID) == Path(_shm_host._BOOT_ID).read_text().strip()
    assert _shm_host._read_proc("/proc/self/ns/ipc") == os.readlink("/proc/self/ns/ipc")
    assert _shm_host._read_proc("/nonexistent/boot_id") is None
    assert identity_from("b", {"ipc": "i", "mnt": "m"}, "h") == "boot=b ipc=i mnt=m host=h"


# --------------------------------------------------------------------------- measurement


def test_round_trips_are_measured_on_every_path_in_one_run():
    rows = _shm_bench.measure_round_trips(round_trips=200, blocks=2)
    assert [row.path for row in rows] == [
        "raw unix",
        "raw tcp",
        "ShmConnection unix",
        "ShmConnection tcp",
    ]
    for row in rows:
        assert row.round_trips == 200
        assert 0 < row.p10_us <= row.median_us <= row.p90_us
        assert math.isfinite(row.p90_us)
    table = _shm_bench.format_round_trips(rows, 64)
    assert "raw unix" in table and "unix/tcp" in table
