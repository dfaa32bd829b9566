"""``akv bench dist``: dist_sync push+pull with 2 workers on 127.0.0.1, against raw sockets.

The command runs real jobs through akv-launch (2 workers, 1 and then 2 servers). Each
worker runs the same fixed sequence (a sync round needs every worker's push), and worker 0
reports its times per call. The floor is a raw-socket echo of the same bytes between two
processes, measured in the same run (it moves the bytes once each way, as a push and a
pull do, but with no second worker, no server work and no framing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import akv
from akv.args import Key
from akv.bench._raw import RawEcho, round_trip
from akv.bench._report import _SETTINGS, Row, Table

__all__ = ["run"]

MIB = 1 << 20
#: MXNet 1.9.1 (ps-lite) on this project's 2-core machine, 2 workers, per worker.
MXNET_S = {
    ("push+pull 4 MiB", 1): 14.1e-3,
    ("push+pull 4 MiB", 2): 15.1e-3,
    ("push+pull 64 MiB", 1): 466e-3,
    ("push+pull 64 MiB", 2): 353e-3,
    ("small key (16 floats) push+pull", 1): 771e-6,
    ("small key (16 floats) pull", 1): 405e-6,
}
SMALL_KEYS = 1000
#: (name, bytes, calls per round)
CASES = [
    ("push+pull 4 MiB", 4 * MIB, 20),
    ("push+pull 64 MiB", 64 * MIB, 3),
    ("small key (16 floats) push+pull", 64, 300),
    ("small key (16 floats) pull", 64, 300),
    (f"{SMALL_KEYS} keys x 16 floats, one list call", 64 * SMALL_KEYS, 10),
]
JOB_TIMEOUT_S = 600


def _measure(kv: akv.KVStore, rounds: int, scale: float) -> dict[str, float]:
    results: dict[str, float] = {}
    for name, nbytes, calls in CASES:
        calls = max(1, int(calls * scale))
        call = _operation(kv, name, nbytes)
        for _ in range(2):
            call()
        samples = []
        for _ in range(rounds):
            kv.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples.append((time.perf_counter() - start) / calls)
        results[name] = statistics.median(samples)
    return results


def _operation(kv: akv.KVStore, name: str, nbytes: int) -> Callable[[], None]:
    """Initialize the keys of the case ``name``; return the call that it times."""
    if name.startswith(str(SMALL_KEYS)):
        keys: list[Key] = [f"{name}/{i}" for i in range(SMALL_KEYS)]
        values = [np.ones(16, np.float32) for _ in keys]
        outs = [np.zeros(16, np.float32) for _ in keys]
        kv.init(keys, values)

        def push_pull_many() -> None:
            kv.push(keys, values)
            kv.pull(keys, out=outs)

        return push_pull_many
    value = np.ones(nbytes // 4, np.float32)
    out = np.zeros_like(value)
    kv.init(name, value)
    if name.endswith("pull") and "push" not in name:

        def pull() -> None:
            kv.pull(name, out=out)

        return pull

    def push_pull() -> None:
        kv.push(name, value)
        kv.pull(name, out=out)

    return push_pull


def worker_main(argv: list[str] | None = None) -> int:
    """One worker of the benchmark job: measure, and let worker 0 write the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    with akv.create("dist_sync") as kv:
        results = _measure(kv, args.rounds, args.scale)
        if kv.rank == 0:
            Path(args.out).write_text(json.dumps(results))
    return 0


def _job(num_servers: int, rounds: int, scale: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        command = [
            sys.executable,
            "-m",
            "akv.launch",
            "-n",
            "2",
            "-s",
            str(num_servers),
            "--",
            sys.executable,
            "-m",
            "akv.bench.dist",
            "--out",
            out,
            "--rounds",
            str(rounds),
            "--scale",
            str(scale),
        ]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if completed.returncode != 0 or not os.path.exists(out):
            raise akv.BenchmarkError(
                f"the benchmark job with {num_servers} server(s) failed "
                f"({completed.returncode}):\n{completed.stdout[-3000:]}\n"
                f"{completed.stderr[-3000:]}"
            )
        results: dict[str, float] = json.loads(Path(out).read_text())
        return results


def run() -> Table:
    """Measure dist_sync with 1 and 2 servers against raw sockets; return the table."""
    quick = _SETTINGS["rounds"] < 5
    rounds, scale = (2, 0.2) if quick else (5, 1.0)
    table = Table("akv bench dist (dist_sync, 2 workers on 127.0.0.1, times per call of worker 0)")
    floors: dict[int, float] = {}
    with RawEcho() as echo:
        for _, nbytes, calls in CASES:
            if nbytes not in floors:
                floors[nbytes] = round_trip(echo, nbytes, max(1, int(calls * scale)), rounds)
    for servers in (1, 2):
        results = _job(servers, rounds, scale)
        for name, nbytes, _ in CASES:
            unit = SMALL_KEYS if name.startswith(str(SMALL_KEYS)) else 1
            table.add(
                Row(
                    f"{name}, {servers} server{'s' if servers > 1 else ''}",
                    results[name],
                    floors[nbytes],
                    f"raw socket echo of {nbytes} B",
                    unit_ops=unit,
                    reference_s=MXNET_S.get((name, servers)),
                )
            )
    table.notes.append(
        "Targets (issue #3): 4 MiB and 64 MiB push+pull 2x faster than MXNet, 2 servers "
        "faster than 1 for 64 MiB; small-key round trip 2x faster; many small keys in one "
        "request per server."
    )
    return table


if __name__ == "__main__":
    sys.exit(worker_main())
