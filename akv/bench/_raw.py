"""The raw-socket floors for ``akv bench dist``, on 127.0.0.1 with plain blocking sockets.

- An echo between two processes. ``python -m akv.bench._raw PORT`` serves: it reads an
  8-byte length, then that many bytes into a preallocated buffer with ``recv_into``, and
  sends them back. :func:`round_trip` measures the client side: send N bytes, receive
  them back (a push and a pull of N bytes).
- A sync round of two clients (:class:`RawRound`): ``python -m akv.bench._raw round PORT``
  reads N bytes of float32 from each of two clients, adds them with NumPy and sends the
  sum to both; ``python -m akv.bench._raw peer PORT`` is the second client, which runs the
  rounds the first asks for on its standard input. :func:`round_trip` on a
  :class:`RawRound` measures the first client: the same bytes and processes as a
  2-worker, 1-server round over TCP, with no framing, no event loop and no Python
  beyond the socket calls.
- The same round through shared memory (:class:`RawShmRound`): the three processes map
  one memfd. Each client copies its N bytes into a region of its own there and says so
  on a pipe; the server (``python -m akv.bench._raw shmround ...``) adds the two regions
  into a third with akv's server's own ``split_add`` (from
  :data:`~akv.limits.SPLIT_ADD_MIN_BYTES` on, a second thread adds half) and says so to
  both; each client copies the sum out. These are the copies and the sum of the memcpy
  floor, made by three processes on their own cores and caches, with two pipe wake-ups
  each way and nothing else: the floor of a shared-memory design with a server process.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from akv.cluster.server.updates import split_add

__all__ = ["RawEcho", "RawRound", "RawShmRound", "round_trip"]

CHUNK_BYTES = 1 << 20
START_TIMEOUT_S = 20.0


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK_BYTES))
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def serve(listener_fd: int) -> None:
    listener = socket.socket(fileno=listener_fd)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(8)
    data = bytearray()
    while True:
        try:
            _recv_exactly(conn, memoryview(buffer))
        except ConnectionError:
            return
        (length,) = struct.unpack("<Q", buffer)
        if len(data) < length:
            data = bytearray(length)
        view = memoryview(data)[:length]
        _recv_exactly(conn, view)
        conn.sendall(view)


def serve_round(listener_fd: int) -> None:
    """Serve sync rounds to two clients until one leaves: each round, a thread per client
    reads its N bytes of float32, the two threads add half of the sum each, and each sends
    the sum to its client."""
    listener = socket.socket(fileno=listener_fd)
    conns = [listener.accept()[0] for _ in range(2)]
    received: list[np.ndarray] = [np.empty(0, np.float32), np.empty(0, np.float32)]
    total = [np.empty(0, np.float32)]
    barrier = threading.Barrier(2)

    def client(index: int, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = memoryview(bytearray(8))
        while True:
            try:
                _recv_exactly(conn, header)
            except ConnectionError:
                barrier.abort()
                return
            (length,) = struct.unpack("<Q", header)
            if received[index].nbytes < length:
                received[index] = np.empty(length // 4, np.float32)
            mine = received[index][: length // 4]
            try:
                _recv_exactly(conn, mine.data.cast("B"))
                barrier.wait()
                if index == 0 and total[0].nbytes < length:
                    total[0] = np.empty(length // 4, np.float32)
                barrier.wait()
                half = slice(0, len(mine) // 2) if index == 0 else slice(len(mine) // 2, len(mine))
                out = total[0][: len(mine)]
                np.add(received[0][half], received[1][half], out=out[half])
                barrier.wait()
                conn.sendall(out.data.cast("B"))
            except (ConnectionError, threading.BrokenBarrierError):
                barrier.abort()
                return

    threads = [threading.Thread(target=client, args=(i, c)) for i, c in enumerate(conns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _connect(port: int, server: subprocess.Popen[bytes] | None = None) -> socket.socket:
    """Connect to ``port``, retrying while ``server`` (when this process started it) starts."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline or (server is not None and server.poll() is not None):
                raise
            time.sleep(0.05)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


#: How long a helper process may take to leave on its own before it is killed: it may
#: still be starting (importing akv) when it is told to leave, which took over 5 s once
#: on a loaded 2-core machine.
END_WAIT_S = 30.0


def _end(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(END_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


class RawEcho:
    """An echo server process and a connected client socket."""

    #: The server's arguments before its port.
    _SERVER: tuple[str, ...] = ()

    def __init__(self) -> None:
        # The server process inherits a listening socket: a port it would bind itself
        # could be taken meanwhile by another process's outgoing connection.
        with socket.create_server(("127.0.0.1", 0), backlog=2) as listener:
            port = listener.getsockname()[1]
            self.process = subprocess.Popen(
                [sys.executable, "-m", "akv.bench._raw", *self._SERVER, str(listener.fileno())],
                pass_fds=(listener.fileno(),),
            )
        self._started(port)
        try:
            self.sock = _connect(port, self.process)
        except OSError:
            self.close()
            raise

    def _started(self, port: int) -> None:
        """Start what else takes part, once the server process is started."""

    def before(self, nbytes: int, iterations: int) -> None:
        """Nothing to prepare: the echo answers whatever comes."""

    def exchange(self, header: bytes, payload: memoryview, back: memoryview) -> None:
        """Send ``payload`` (announced by ``header``, its length) and receive ``back``."""
        _socket_exchange(self.sock, header, payload, back)

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
        _end(self.process)

    def __enter__(self) -> RawEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawRound(RawEcho):
    """A summing round server process, a second client process, and this process's
    connected client socket (see the module docstring)."""

    _SERVER = ("round",)

    def _started(self, port: int) -> None:
        self.peer = subprocess.Popen(
            [sys.executable, "-m", "akv.bench._raw", "peer", str(port)], stdin=subprocess.PIPE
        )

    def before(self, nbytes: int, iterations: int) -> None:
        """Have the second client take part in the next ``iterations`` rounds of ``nbytes``."""
        assert self.peer.stdin is not None
        self.peer.stdin.write(f"{nbytes} {iterations}\n".encode())
        self.peer.stdin.flush()

    def close(self) -> None:
        if self.peer.stdin is not None:
            self.peer.stdin.close()  # the second client leaves at the end of its input
        _end(self.peer)
        super().close()


def peer(port: int) -> None:
    """The second client of a :class:`RawRound`: for each line ``N ITERATIONS`` on standard
    input, take part in that many rounds of N bytes (float32 ones)."""
    sock = _connect(port)
    _take_part(partial(_socket_exchange, sock))
    sock.close()


def _socket_exchange(
    sock: socket.socket, header: bytes, payload: memoryview, back: memoryview
) -> bool:
    """One round on ``sock``: send ``header`` and ``payload``, receive ``back``."""
    sock.sendall(header)
    sock.sendall(payload)
    _recv_exactly(sock, back)
    return True


def _take_part(exchange: Callable[[bytes, memoryview, memoryview], bool]) -> None:
    """A second client's rounds: for each line ``N ITERATIONS`` on standard input, that many
    calls of ``exchange`` with N bytes of float32 ones (until one returns False: the server
    left). The buffers of a size are made
    once and every page of them written first, so that no round pays for first touches."""
    buffers: dict[int, tuple[memoryview, memoryview]] = {}
    for line in sys.stdin:
        nbytes, iterations = (int(word) for word in line.split())
        if nbytes not in buffers:
            buffers[nbytes] = _touched(nbytes, 1.0), _touched(nbytes, 0.0)
        payload, back = buffers[nbytes]
        header = struct.pack("<Q", nbytes)
        for _ in range(iterations):
            if not exchange(header, payload, back):
                return


def _touched(nbytes: int, value: float) -> memoryview:
    """``nbytes`` of float32 ``value`` (every page written), as bytes."""
    return np.full(nbytes // 4, value, np.float32).data.cast("B")


#: The bytes a client's signal to the shared-memory round server carries: the round's N.
_SIGNAL = struct.Struct("<Q")


def _read_exactly(fd: int, count: int) -> bytes:
    """``count`` bytes from pipe ``fd``; b"" at its end."""
    data = b""
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _regions(fd: int, max_bytes: int) -> tuple[mmap.mmap, list[memoryview]]:
    """The shared arena of a :class:`RawShmRound`: client 0's region, client 1's, the sum."""
    # Mapped with every page in place, so that no round pays for first touches.
    mapping = mmap.mmap(fd, 3 * max_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    view = memoryview(mapping)
    return mapping, [view[i * max_bytes : (i + 1) * max_bytes] for i in range(3)]


def serve_shm_round(fd: int, max_bytes: int, signals: list[int], answers: list[int]) -> None:
    """Serve shared-memory rounds until a client's pipe ends: read N from both clients'
    ``signals``, add their regions' first N bytes as float32 into the third, write a byte
    to both ``answers``."""
    mapping, regions = _regions(fd, max_bytes)
    helper = concurrent.futures.ThreadPoolExecutor(1)
    try:
        while True:
            sizes = [_read_exactly(signal, _SIGNAL.size) for signal in signals]
            if not all(sizes):
                return
            (nbytes,) = _SIGNAL.unpack(sizes[0])
            first, second, total = (
                np.frombuffer(region[:nbytes], np.float32) for region in regions
            )
            split_add(helper, first, second, total)  # as akv's server adds
            del first, second, total  # the mapping closes below only without exports
            for answer in answers:
                os.write(answer, b"x")
    finally:
        helper.shutdown()
        for region in regions:
            region.release()
        mapping.close()


class RawShmRound:
    """A sync round of two clients through shared memory (see the module docstring): a
    server process, a second client process and this process's side, for rounds of at
    most ``max_bytes``. The arena is a memfd: it has no name, and nothing of it is left
    once the three processes have ended."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._fd = os.memfd_create("akv-bench-raw-round", os.MFD_CLOEXEC)
        opened = [self._fd]
        try:
            os.posix_fallocate(self._fd, 0, 3 * max_bytes)
            signals, answers = [os.pipe() for _ in range(2)], [os.pipe() for _ in range(2)]
            opened += [fd for pair in signals + answers for fd in pair]
            server_fds = [signals[0][0], signals[1][0], answers[0][1], answers[1][1]]
            self.process = subprocess.Popen(
                [sys.executable, "-m", "akv.bench._raw", "shmround", str(self._fd), str(max_bytes)]
                + [str(fd) for fd in server_fds],
                pass_fds=[self._fd, *server_fds],
            )
            peer_fds = [signals[1][1], answers[1][0]]
            self.peer = subprocess.Popen(
                [sys.executable, "-m", "akv.bench._raw", "shmpeer", str(self._fd), str(max_bytes)]
                + [str(fd) for fd in peer_fds],
                pass_fds=[self._fd, *peer_fds],
                stdin=subprocess.PIPE,
            )
            self._mapping, (self._mine, _, self._total) = _regions(self._fd, max_bytes)
        except BaseException:
            for fd in opened:
                os.close(fd)  # the server's pipes end: a server started leaves
            for started in ("peer", "process"):
                if hasattr(self, started):
                    _end(getattr(self, started))
            raise
        # This side keeps its own ends; the children have theirs.
        self._signal, self._answer = signals[0][1], answers[0][0]
        for fd in opened:
            if fd not in (self._fd, self._signal, self._answer):
                os.close(fd)

    def before(self, nbytes: int, iterations: int) -> None:
        """Have the second client take part in the next ``iterations`` rounds of ``nbytes``."""
        if nbytes > self._max_bytes:
            raise ValueError(f"a round of {nbytes} bytes exceeds this arena's {self._max_bytes}")
        assert self.peer.stdin is not None
        self.peer.stdin.write(f"{nbytes} {iterations}\n".encode())
        self.peer.stdin.flush()

    def exchange(self, header: bytes, payload: memoryview, back: memoryview) -> None:
        """One round (see :func:`_shm_exchange`)."""
        sides = (self._mine, self._total, self._signal, self._answer)
        if not _shm_exchange(sides, header, payload, back):
            raise ConnectionError("the shared-memory round server ended")

    def close(self) -> None:
        if self.peer.stdin is not None:
            self.peer.stdin.close()  # the second client leaves at the end of its input
        _end(self.peer)
        os.close(self._signal)  # the server's pipes end: it leaves
        _end(self.process)
        os.close(self._answer)
        for region in (self._mine, self._total):
            region.release()
        self._mapping.close()
        os.close(self._fd)

    def __enter__(self) -> RawShmRound:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shm_peer(fd: int, max_bytes: int, signal: int, answer: int) -> None:
    """The second client of a :class:`RawShmRound`: for each line ``N ITERATIONS`` on
    standard input, take part in that many rounds of N bytes (float32 ones)."""
    mapping, regions = _regions(fd, max_bytes)
    try:
        _take_part(partial(_shm_exchange, (regions[1], regions[2], signal, answer)))
    finally:
        os.close(signal)
        for region in regions:
            region.release()
        mapping.close()


def _shm_exchange(
    sides: tuple[memoryview, memoryview, int, int],
    header: bytes,
    payload: memoryview,
    back: memoryview,
) -> bool:
    """One shared-memory round of a client whose ``sides`` are its region, the sum's, its
    signal pipe and its answer pipe: copy ``payload`` in, signal its length (``header``),
    wait for the sum, copy it out into ``back``. False when the server left."""
    mine, total, signal, answer = sides
    nbytes = len(payload)
    mine[:nbytes] = payload
    os.write(signal, header)
    if not _read_exactly(answer, 1):
        return False
    back[:] = total[:nbytes]
    return True


def round_trip(echo: RawEcho | RawShmRound, nbytes: int, iterations: int, rounds: int = 5) -> float:
    """Median seconds to send ``nbytes`` and receive as many back (``echo`` a
    :class:`RawEcho`, :class:`RawRound` or :class:`RawShmRound`).

    One untimed exchange comes first: the first one waits for processes that are still
    starting and touches the memory of the size for the first time, which would weigh on
    a median of few rounds (``akv bench --quick`` times two)."""
    payload, back = _touched(nbytes, 1.0), _touched(nbytes, 0.0)
    header = struct.pack("<Q", nbytes)
    echo.before(nbytes, 1)
    echo.exchange(header, payload, back)
    samples = []
    for _ in range(rounds):
        echo.before(nbytes, iterations)
        start = time.perf_counter()
        for _ in range(iterations):
            echo.exchange(header, payload, back)
        samples.append((time.perf_counter() - start) / iterations)
    return statistics.median(samples)


if __name__ == "__main__":
    if sys.argv[1] == "shmround":
        fd, limit, *pipes = (int(word) for word in sys.argv[2:])
        serve_shm_round(fd, limit, pipes[:2], pipes[2:])
    elif sys.argv[1] == "shmpeer":
        fd, limit, signal, answer = (int(word) for word in sys.argv[2:])
        shm_peer(fd, limit, signal, answer)
    elif sys.argv[1] == "round":
        serve_round(int(sys.argv[2]))
    elif sys.argv[1] == "peer":
        peer(int(sys.argv[2]))
    else:
        serve(int(sys.argv[1]))
