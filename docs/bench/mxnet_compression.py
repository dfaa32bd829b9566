"""MXNet 1.9.1's 64 MiB dist_sync push+pull round, dense and with 2bit compression, beside
``akv bench compression`` in the same window (run by hand, never by the tests)::

    /work/mxvenv/bin/python docs/bench/mxnet_compression.py

It starts MXNet's scheduler, one server and two workers on 127.0.0.1 itself (the DMLC_*
variables), each worker timing 4 calls per round over 5 rounds after a warm-up (each call's
pulled value waited for, as akv's blocking pull returns it), and prints
worker 0's median seconds per call for each mode. Every process it starts is ended by its
PID, with a deadline.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS, CALLS, NBYTES = 5, 4, 64 << 20


def worker(out: str, compression: str) -> None:
    import mxnet as mx

    kv = mx.kv.create("dist_sync")
    if compression != "dense":
        kv.set_gradient_compression({"type": compression, "threshold": 0.5})
    value = mx.nd.ones((NBYTES // 4,))
    kv.init(3, mx.nd.zeros((NBYTES // 4,)))
    result = mx.nd.zeros((NBYTES // 4,))
    for _ in range(2):
        kv.push(3, value)
        kv.pull(3, out=result)
    result.wait_to_read()
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            kv.push(3, value)
            kv.pull(3, out=result)
            result.wait_to_read()  # each call's value read, as akv's pull returns it
        samples.append((time.perf_counter() - start) / CALLS)
    if kv.rank == 0:
        with open(out, "w") as handle:
            json.dump(samples, handle)


def job(compression: str) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {
        **os.environ,
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "2",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        processes = []
        try:
            for role in ("scheduler", "server", "worker", "worker"):
                command = [sys.executable, "-c", "import mxnet"]
                if role == "worker":
                    command = [sys.executable, __file__, "--worker", out, compression]
                processes.append(subprocess.Popen(command, env={**base, "DMLC_ROLE": role}))
            for process in processes[2:]:
                process.wait(timeout=600)
            with open(out) as handle:
                return statistics.median(json.load(handle))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        for mode in ("dense", "2bit"):
            print(f"MXNet 1.9.1 push+pull 64 MiB, {mode}: {job(mode) * 1e3:.1f} ms per call")
