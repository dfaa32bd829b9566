"""The raw-socket floor for ``akv bench dist``: an echo between two processes on 127.0.0.1.

``python -m akv.bench._raw PORT`` serves: it reads an 8-byte length, then that many bytes
into a preallocated buffer with ``recv_into``, and sends them back. :func:`round_trip`
measures the client side: send N bytes, receive them back (a push and a pull of N bytes).
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import time

__all__ = ["RawEcho", "round_trip"]

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


class RawEcho:
    """An echo server process and a connected client socket."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen([sys.executable, "-m", "akv.bench._raw", str(port)])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def __enter__(self) -> RawEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def round_trip(echo: RawEcho, nbytes: int, iterations: int, rounds: int = 5) -> float:
    """Median seconds to send ``nbytes`` and receive them back."""
    payload = memoryview(bytearray(nbytes))
    back = memoryview(bytearray(nbytes))
    header = struct.pack("<Q", nbytes)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            echo.sock.sendall(header)
            echo.sock.sendall(payload)
            _recv_exactly(echo.sock, back)
        samples.append((time.perf_counter() - start) / iterations)
    return statistics.median(samples)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
