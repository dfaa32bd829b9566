"""How long a small message's round trip takes over a Unix socket and over TCP loopback.

Issue #10 asks for small control messages to go over the Unix socket when that is faster
than TCP loopback. :func:`measure_round_trips` measures both in one run, against an echo
in a child process, two ways each:

* ``raw``: blocking sockets, one ``sendall`` and ``recv`` calls per round trip: the kernel's
  floor for the path;
* ``ShmConnection``: the framed asyncio connection of :mod:`akv_transport.shm`, the same code
  over either socket family: what a caller of this module pays.

Blocks of round trips alternate between the paths, so that a machine that gets busier or
quieter during the run shifts every path alike. Run it with::

    python -m akv_transport._shm_bench [--round-trips N] [--message-bytes B] [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from akv_transport._shm_socket import ShmConnection

__all__ = ["RoundTrip", "format_round_trips", "measure_round_trips"]

#: How long the echo process may take to end once its sockets are closed (seconds).
ECHO_EXIT_TIMEOUT_S = 10.0
#: Round trips per path before any is measured.
WARMUP_ROUND_TRIPS = 200

#: The echo: one thread per inherited socket, bytes back as they come, until EOF.
_ECHO = """
import socket, sys, threading
def echo(fd):
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = sock.recv(65536)
        if not data:
            break
        sock.sendall(data)
    sock.close()
threads = [threading.Thread(target=echo, args=(int(fd),)) for fd in sys.argv[1:]]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


@dataclass(frozen=True)
class RoundTrip:
    """The round-trip times measured on one path, in microseconds."""

    path: str
    round_trips: int
    median_us: float
    p10_us: float
    p90_us: float


def measure_round_trips(
    *,
    round_trips: int = 5000,
    message_bytes: int = 64,
    blocks: int = 10,
    use_uvloop: bool = False,
) -> list[RoundTrip]:
    """Measure ``round_trips`` round trips of ``message_bytes`` on each path, in ``blocks``
    alternating blocks, against an echo in a child process; return one row per path:
    ``raw unix``, ``raw tcp``, ``ShmConnection unix``, ``ShmConnection tcp``.

    Must be called where no event loop runs (it runs its own, uvloop's if ``use_uvloop``).
    The child is ended by closing its sockets, and killed if it outlives
    :data:`ECHO_EXIT_TIMEOUT_S`.
    """
    if round_trips < blocks or blocks < 1 or message_bytes < 1:
        raise ValueError(
            f"measure_round_trips: round_trips {round_trips}, blocks {blocks}, "
            f"message_bytes {message_bytes}: need round_trips >= blocks >= 1, bytes >= 1"
        )
    ours: list[socket.socket] = []
    theirs: list[socket.socket] = []
    for make in (_unix_pair, _unix_pair, _tcp_pair, _tcp_pair):
        mine, other = make()
        ours.append(mine)
        theirs.append(other)
    fds = [sock.fileno() for sock in theirs]
    echo = subprocess.Popen(
        [sys.executable, "-c", _ECHO, *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL
    )
    for sock in theirs:
        sock.close()
    try:
        loop = _new_loop(use_uvloop)
        try:
            samples = loop.run_until_complete(
                _measure(ours, round_trips=round_trips, message_bytes=message_bytes, blocks=blocks)
            )
        finally:
            loop.close()
    finally:
        for sock in ours:
            sock.close()
        try:
            echo.wait(ECHO_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait(ECHO_EXIT_TIMEOUT_S)
    rows = []
    for path, times in samples.items():
        cuts = statistics.quantiles(times, n=10)
        rows.append(
            RoundTrip(
                path, len(times), statistics.median(times) / 1e3, cuts[0] / 1e3, cuts[-1] / 1e3
            )
        )
    return rows


def format_round_trips(rows: list[RoundTrip], message_bytes: int) -> str:
    """The rows as a table, with each path's median against ``raw tcp``'s and its pair's."""
    by_path = {row.path: row for row in rows}
    lines = [
        f"round trip of a {message_bytes}-byte message, microseconds",
        f"{'path':<20} {'n':>7} {'median':>8} {'p10':>8} {'p90':>8}  unix/tcp",
    ]
    for row in rows:
        family = row.path.rsplit(" ", 1)[-1]
        pair = by_path.get(row.path[: -len(family)] + "tcp")
        ratio = f"{row.median_us / pair.median_us:8.2f}" if family == "unix" and pair else ""
        lines.append(
            f"{row.path:<20} {row.round_trips:>7} {row.median_us:>8.1f} {row.p10_us:>8.1f} "
            f"{row.p90_us:>8.1f}  {ratio}"
        )
    return "\n".join(lines)


async def _measure(
    sockets: list[socket.socket], *, round_trips: int, message_bytes: int, blocks: int
) -> dict[str, list[int]]:
    raw_unix, connection_unix_sock, raw_tcp, connection_tcp_sock = sockets
    connection_unix = ShmConnection(connection_unix_sock)
    connection_tcp = ShmConnection(connection_tcp_sock)
    message = bytes(range(256)) * (message_bytes // 256 + 1)
    message = message[:message_bytes]

    def raw(sock: socket.socket) -> Callable[[int], Awaitable[list[int]]]:
        buffer = bytearray(message_bytes)
        view = memoryview(buffer)

        async def run(count: int) -> list[int]:
            times = []
            clock = time.perf_counter_ns
            for _ in range(count):
                start = clock()
                sock.sendall(message)
                received = 0
                while received < message_bytes:
                    received += sock.recv_into(view[received:])
                times.append(clock() - start)
            return times

        return run

    def framed(connection: ShmConnection) -> Callable[[int], Awaitable[list[int]]]:
        async def run(count: int) -> list[int]:
            times = []
            clock = time.perf_counter_ns
            for _ in range(count):
                start = clock()
                await connection.send(message)
                await connection.recv()
                times.append(clock() - start)
            return times

        return run

    paths = {
        "raw unix": raw(raw_unix),
        "raw tcp": raw(raw_tcp),
        "ShmConnection unix": framed(connection_unix),
        "ShmConnection tcp": framed(connection_tcp),
    }
    samples: dict[str, list[int]] = {path: [] for path in paths}
    try:
        for run in paths.values():
            await run(WARMUP_ROUND_TRIPS)
        per_block = round_trips // blocks
        for _ in range(blocks):
            for path, run in paths.items():
                samples[path] += await run(per_block)
    finally:
        connection_unix.close()
        connection_tcp.close()
    return samples


def _unix_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=20000)
    parser.add_argument("--message-bytes", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--uvloop", action="store_true", help="run the asyncio side on uvloop")
    args = parser.parse_args(argv)
    rows = measure_round_trips(
        round_trips=args.round_trips,
        message_bytes=args.message_bytes,
        blocks=args.blocks,
        use_uvloop=args.uvloop,
    )
    loop_name = "uvloop" if args.uvloop else "asyncio"
    print(format_round_trips(rows, args.message_bytes) + f"\n(event loop: {loop_name})")


if __name__ == "__main__":
    main()
