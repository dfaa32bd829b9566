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
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

__all__ = ["RawEcho", "RawRound", "round_trip"]

CHUNK_BYTES = 1 << 20
START_TIMEOUT_S = 20.0


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK_BYTES))
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def serve(port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
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


def serve_round(port: int) -> None:
    """Serve sync rounds to two clients until one leaves: each round, a thread per client
    reads its N bytes of float32, the two threads add half of the sum each, and each sends
    the sum to its client."""
    listener = socket.create_server(("127.0.0.1", port), backlog=2)
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _end(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


class RawEcho:
    """An echo server process and a connected client socket."""

    #: The server's arguments before its port.
    _SERVER: tuple[str, ...] = ()

    def __init__(self) -> None:
        port = _free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "akv.bench._raw", *self._SERVER, str(port)]
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
    for line in sys.stdin:
        nbytes, iterations = (int(word) for word in line.split())
        header = struct.pack("<Q", nbytes)
        payload = np.ones(nbytes // 4, np.float32).data.cast("B")
        back = memoryview(bytearray(nbytes))
        for _ in range(iterations):
            sock.sendall(header)
            sock.sendall(payload)
            _recv_exactly(sock, back)
    sock.close()


def round_trip(echo: RawEcho, nbytes: int, iterations: int, rounds: int = 5) -> float:
    """Median seconds to send ``nbytes`` and receive as many back (``echo`` a
    :class:`RawEcho` or a :class:`RawRound`)."""
    payload = memoryview(bytearray(nbytes))
    back = memoryview(bytearray(nbytes))
    header = struct.pack("<Q", nbytes)
    samples = []
    for _ in range(rounds):
        echo.before(nbytes, iterations)
        start = time.perf_counter()
        for _ in range(iterations):
            echo.sock.sendall(header)
            echo.sock.sendall(payload)
            _recv_exactly(echo.sock, back)
        samples.append((time.perf_counter() - start) / iterations)
    return statistics.median(samples)


if __name__ == "__main__":
    if sys.argv[1] == "round":
        serve_round(int(sys.argv[2]))
    elif sys.argv[1] == "peer":
        peer(int(sys.argv[2]))
    else:
        serve(int(sys.argv[1]))
