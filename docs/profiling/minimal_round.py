"""The floor of a small-key round for akv's own architecture, without akv's layers.

akv's blocking dist store calls from the caller's thread, hands the work to an event-loop
thread, and is answered by a server process that runs one event loop. This script builds
exactly that and nothing more: a server process that sums the 16 floats of 2 workers
and answers both, and 2 worker processes whose calling thread hands each message to a
loop thread (``call_soon_threadsafe``) and blocks until the loop thread has the answer.
No framing beyond a length, no engine, no request table. It is what the same threads and
wake-ups cost on this machine; compare it with ``small_round.py``, which times the same
round through akv (see docs/benchmarks.md)::

    python docs/profiling/minimal_round.py [ROUNDS] [unix|tcp]

Worker 0 prints the wall time per round and the CPU time of its process per round.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
import tempfile
import threading
import time

import numpy as np

from akv_engine import new_event_loop

WORKERS = 2
FLOATS = 16
LENGTH = struct.Struct("<I")
MESSAGE_BYTES = LENGTH.size + 4 * FLOATS
START_TIMEOUT_S = 20.0
WARMUP_ROUNDS = 300


class _Summer(asyncio.Protocol):
    """The server's side of one worker: each message joins the round; the last one of a
    round answers every worker with the sum."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data
        while len(self.data) >= MESSAGE_BYTES:
            values = np.frombuffer(self.data, np.float32, FLOATS, LENGTH.size).copy()
            del self.data[:MESSAGE_BYTES]
            members = _ROUND
            members.append((self, values))
            if len(members) == WORKERS:
                total = members[0][1] + members[1][1]
                answer = LENGTH.pack(total.nbytes) + total.tobytes()
                for member, _ in members:
                    member.transport.write(answer)  # type: ignore[attr-defined]
                members.clear()


#: The server's open round: each worker's side and values, in arrival order.
_ROUND: list[tuple[_Summer, np.ndarray]] = []


class _Answers(asyncio.Protocol):
    """A worker's loop-thread side: hands each answer to the waiting caller."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.answer: np.ndarray | None = None
        self.arrived = threading.Lock()
        self.arrived.acquire()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) >= MESSAGE_BYTES:
            self.answer = np.frombuffer(self.data, np.float32, FLOATS, LENGTH.size).copy()
            del self.data[:MESSAGE_BYTES]
            self.arrived.release()


def _serve(address: str | tuple[str, int], ready: int) -> None:
    loop = new_event_loop()
    if isinstance(address, str):
        server = loop.run_until_complete(loop.create_unix_server(_Summer, address))
    else:
        server = loop.run_until_complete(loop.create_server(_Summer, *address))
    os.write(ready, b"x")
    loop.run_until_complete(server.serve_forever())


def _work(address: str | tuple[str, int], rank: int, rounds: int) -> None:
    loop = new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    if isinstance(address, str):
        connect = loop.create_unix_connection(_Answers, address)
    else:
        connect = loop.create_connection(_Answers, *address)
    transport, answers = asyncio.run_coroutine_threadsafe(connect, loop).result(START_TIMEOUT_S)
    if not isinstance(address, str):
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    values = np.ones(FLOATS, np.float32)

    def one_round() -> np.ndarray:
        loop.call_soon_threadsafe(transport.write, LENGTH.pack(values.nbytes) + values.tobytes())
        if not answers.arrived.acquire(timeout=START_TIMEOUT_S):
            raise TimeoutError("no answer from the server")
        assert answers.answer is not None
        return answers.answer

    for _ in range(WARMUP_ROUNDS):
        one_round()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        total = one_round()
    wall = (time.perf_counter() - wall) / rounds * 1e6
    cpu = (time.process_time() - cpu) / rounds * 1e6
    assert total[0] == WORKERS, total  # every worker sent ones
    if rank == 0:
        print(f"round {wall:.0f} us, process CPU {cpu:.0f} us", flush=True)
    loop.call_soon_threadsafe(transport.close)


def main(rounds: int, kind: str) -> int:
    with tempfile.TemporaryDirectory() as private:
        if kind == "unix":
            address: str | tuple[str, int] = os.path.join(private, "server.sock")
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                address = ("127.0.0.1", probe.getsockname()[1])
        ready, told = os.pipe()
        server = os.fork()  # before this process has any thread or loop
        if server == 0:
            os.close(ready)
            _serve(address, told)
            os._exit(0)
        os.close(told)
        workers = []
        try:
            if os.read(ready, 1) != b"x":
                raise RuntimeError("the server did not start")
            for rank in range(WORKERS):
                pid = os.fork()
                if pid == 0:
                    status = 1
                    try:
                        _work(address, rank, rounds)
                        status = 0
                    finally:
                        os._exit(status)
                workers.append(pid)
            statuses = []
            while workers:
                statuses.append(os.waitstatus_to_exitcode(os.waitpid(workers[0], 0)[1]))
                workers.pop(0)
        finally:
            os.close(ready)
            for pid in [server, *workers]:  # those not ended already
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        return 0 if statuses == [0] * WORKERS else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000, *sys.argv[2:3] or ["unix"]))
