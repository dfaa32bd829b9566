"""``akv bench soak``: many dist_sync rounds with 4 workers and 2 servers, checked and timed.

The command runs one job through akv-launch (4 workers, 2 servers, on 127.0.0.1). In every
round each worker pushes ``(rank + 1) * (round % 7 + 1)`` into a small key (on one server)
and a big key (split over both servers), then pulls both: without an optimizer the servers
store the round's sum, which every worker checks exactly. Worker 0 times each round and
samples the servers' resident memory (``VmRSS``) as the rounds go. The report: rounds per
second, the p50 and p99 round latency against a raw-socket echo of the same bytes measured
in the same run, the number of wrong sums (must be 0) and the servers' memory over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import akv
from akv.bench._raw import RawEcho, round_trip
from akv.bench._report import _SETTINGS, Row, Table
from akv.launch.supervisor import die_with_parent

__all__ = ["SoakResult", "percentile", "run", "soak", "sum_of_round"]

WORKERS = 4
SERVERS = 2
SMALL_ELEMENTS = 16
BIG_ELEMENTS = 1 << 16  # 256 KiB of float32, split over the servers (see BIGARRAY_BOUND)
#: Elements above which a key is split over every server, for the soak's job.
BIGARRAY_BOUND = 1 << 12
#: How many memory samples worker 0 takes over the run.
MEMORY_SAMPLES = 20
JOB_TIMEOUT_S = 900


def sum_of_round(round_number: int, num_workers: int) -> float:
    """The exact sum the servers hold after ``round_number``: every worker pushed
    ``(rank + 1) * (round % 7 + 1)`` (small integers: exact in float32)."""
    return float((round_number % 7 + 1) * num_workers * (num_workers + 1) // 2)


def percentile(samples: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``samples`` (``fraction`` in [0, 1])."""
    ordered = sorted(samples)
    rank = math.ceil(fraction * len(ordered))
    return ordered[min(len(ordered), max(1, rank)) - 1]


@dataclass
class SoakResult:
    """What worker 0 measured: round times (s), wrong sums, and server memory samples
    ``[(round, {server rank: VmRSS in bytes})]``."""

    rounds: int
    seconds: float
    latencies: list[float]
    wrong_sums: int
    memory: list[tuple[int, dict[int, int]]]


def _server_pids() -> dict[int, int]:
    """The servers' PIDs from the scheduler's ``/v1/status``, asked as akv's processes ask
    (a signed request, never the token itself; TLS as the job's)."""
    from akv.cluster import config as _config
    from akv.cluster.roles import scheduler_client

    async def ask() -> list[dict[str, Any]]:
        client = scheduler_client(_config.from_env(role="worker"), timeout_s=10)
        try:
            status = await client.json("GET", "/v1/status")
            return list(status["nodes"])
        finally:
            await client.close()

    nodes = asyncio.run(ask())
    return {int(n["rank"]): int(n["pid"]) for n in nodes if n["role"] == "server"}


def _rss_bytes(pid: int) -> int:
    """A process's resident memory from ``/proc`` (0 where there is no ``/proc``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def soak(kv: akv.KVStore, rounds: int) -> SoakResult:
    """Run ``rounds`` checked rounds on ``kv`` (every worker of the job calls it)."""
    small = np.zeros(SMALL_ELEMENTS, np.float32)
    big = np.zeros(BIG_ELEMENTS, np.float32)
    kv.init(["small", "big"], [small, big])
    outs = [np.empty_like(small), np.empty_like(big)]
    pids = _server_pids() if kv.rank == 0 else {}
    every = max(1, rounds // MEMORY_SAMPLES)
    memory: list[tuple[int, dict[int, int]]] = []
    latencies = []
    wrong = 0
    kv.barrier()
    began = time.perf_counter()
    for number in range(rounds):
        mine = float((kv.rank + 1) * (number % 7 + 1))
        small.fill(mine)
        big.fill(mine)
        start = time.perf_counter()
        kv.push(["small", "big"], [small, big])
        kv.pull(["small", "big"], out=outs)
        latencies.append(time.perf_counter() - start)
        expected = sum_of_round(number, kv.num_workers)
        if not ((outs[0] == expected).all() and (outs[1] == expected).all()):
            wrong += 1
        if pids and number % every == 0:
            memory.append((number, {rank: _rss_bytes(pid) for rank, pid in pids.items()}))
    seconds = time.perf_counter() - began
    if pids:
        memory.append((rounds, {rank: _rss_bytes(pid) for rank, pid in pids.items()}))
    return SoakResult(rounds, seconds, latencies, wrong, memory)


def worker_main(argv: list[str] | None = None) -> int:
    """One worker of the soak job; worker 0 writes the results to ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    with akv.create("dist_sync") as kv:
        result = soak(kv, args.rounds)
        if kv.rank == 0:
            Path(args.out).write_text(json.dumps(result.__dict__))
    return 0 if result.wrong_sums == 0 else 1


def run_launcher(
    command: list[str], env: dict[str, str], timeout_s: float, what: str
) -> subprocess.CompletedProcess[str]:
    """Run an akv-launch ``command`` to its end, its output captured, as a child that the
    kernel kills (SIGKILL) when this process dies: a benchmark stopped by a signal takes
    its job with it (the launcher's own children die with the launcher the same way).

    Raises
    ------
    BenchmarkError
        The job ran past ``timeout_s`` (it was killed; the one line names ``what``).
    """
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            preexec_fn=die_with_parent(),
        )
    except subprocess.TimeoutExpired:
        raise akv.BenchmarkError(
            f"{what} ran past its timeout of {timeout_s:g} s and was stopped"
        ) from None


def run_job(rounds: int, timeout_s: float = JOB_TIMEOUT_S) -> SoakResult:
    """Run the soak job (4 workers, 2 servers) through akv-launch; return worker 0's result.

    Raises
    ------
    BenchmarkError
        The job failed, ran past ``timeout_s``, or a sum was wrong (with the job's output).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "soak.json")
        command = [
            *(sys.executable, "-m", "akv.launch", "-n", str(WORKERS), "-s", str(SERVERS)),
            *("--", sys.executable, "-m", "akv.bench.soak", "--out", out),
            *("--rounds", str(rounds)),
        ]
        env = {**os.environ, "AKV_BIGARRAY_BOUND": str(BIGARRAY_BOUND)}
        env.pop("AKV_TOKEN", None)
        completed = run_launcher(command, env, timeout_s, "the soak job")
        if completed.returncode != 0 or not os.path.exists(out):
            raise akv.BenchmarkError(
                f"the soak job failed ({completed.returncode}):\n"
                f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
            )
        data = json.loads(Path(out).read_text())
    memory = [(int(n), {int(r): int(b) for r, b in m.items()}) for n, m in data["memory"]]
    return SoakResult(
        data["rounds"], data["seconds"], data["latencies"], data["wrong_sums"], memory
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def run() -> Table:
    """The soak: rounds per second, p50/p99 latency against raw sockets, memory over time."""
    quick = _SETTINGS["rounds"] < 5
    rounds = 200 if quick else 5000
    nbytes = 4 * (SMALL_ELEMENTS + BIG_ELEMENTS)
    with RawEcho() as echo:
        floor = round_trip(echo, nbytes, 50, 5)
    result = run_job(rounds)
    table = Table(
        f"akv bench soak (dist_sync, {WORKERS} workers, {SERVERS} servers on 127.0.0.1, "
        f"{rounds} rounds of push+pull of a {SMALL_ELEMENTS}-float key and a "
        f"{BIG_ELEMENTS}-float key split over the servers; worker 0's times)"
    )
    floor_note = f"raw socket echo of {nbytes} B"
    table.add(Row("round, p50", percentile(result.latencies, 0.5), floor, floor_note))
    table.add(Row("round, p99", percentile(result.latencies, 0.99), floor, floor_note))
    table.notes.append(
        f"{result.rounds / result.seconds:.0f} rounds/s over {result.seconds:.1f} s; "
        f"wrong sums: {result.wrong_sums}"
    )
    for rank in sorted(result.memory[0][1]) if result.memory else []:
        series = [m[rank] for _, m in result.memory]
        half = len(series) // 2
        table.notes.append(
            f"server {rank} VmRSS: {_mib(series[0])} after round 0, "
            f"{_mib(series[half])} at round {result.memory[half][0]}, "
            f"{_mib(series[-1])} at the end (second half grew "
            f"{_mib(series[-1] - series[half])})"
        )
    return table


if __name__ == "__main__":
    sys.exit(worker_main())
