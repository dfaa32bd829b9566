"""``akv bench sparse``: an embedding table on the servers, against akv's own dense rounds.

The workload (issue #25): a row-sparse table of 10^6 x 64 float32 on the servers, 2 workers,
``dist_sync`` with SGD (lazy); each step each worker draws 8192 row ids (Zipf-like: a few hot
rows and a long tail; seeded by its rank, every batch drawn before the timing), pushes their
gradient (the unique ids' rows, ones) and ``row_sparse_pull``-s them. A job under akv-launch
per server count (1, 2) and transport (shared memory, TCP: ``AKV_SHM``).

Two floors, measured in the same job, in blocks that alternate with the steps' blocks (so
that the machine's drift affects them alike), each a dense ``push`` + ``pull`` of one key:

- ``floor``: a key of 8192 x 64 float32 (2 MiB), a batch's rows before duplicates are summed;
- ``floor 2``: a key of the step's bytes, U x 64 float32 with U a batch's unique ids (about
  1,950): what a step moves each way, the round akv would make if the rows were a dense array
  of their own (the issue's "dense round moving the same bytes").

Memory: RSS against the bytes of the rows stored after touching 10^6 and 10^7 distinct rows
of a table declared as 10^9 x 64 float32 (256 GB dense), in a local store (this process's
growth) and in a ``dist_sync`` job over 2 servers (each server's growth, read from ``/proc``).

Options (``akv bench sparse --help`` lists them): ``--servers``, ``--shm``,
``--steps``, ``--rows``, ``--memory`` (touched-row counts, ``0`` for none) and
``--memory-stores``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import akv
from akv import jit
from akv.bench._report import _SETTINGS, Row, Table
from akv.bench.dist import launch_job
from akv.bench.soak import _server_pids, percentile
from akv.cluster.placement import row_parts

__all__ = [
    "BATCH",
    "MEMORY_TABLE_ROWS",
    "ROWS",
    "WIDTH",
    "dist_memory",
    "draw_ids",
    "memory_growth",
    "options_parser",
    "run",
    "step_rows",
    "worker_main",
]

ROWS = 10**6
WIDTH = 64
BATCH = 8192
#: Zipf's exponent for the ids: a few hot rows, a long tail (about 1,950 unique ids of 8,192).
ZIPF_A = 1.2
#: The table the memory rows declare: 10^9 x 64 float32 (256 GB dense).
MEMORY_TABLE_ROWS = 10**9
#: Distinct rows pushed a round in the memory rows (16 MiB of rows: a large step's, so that
#: the round's buffers, which the allocator keeps for the next rounds, stay a step's size).
MEMORY_CHUNK = 1 << 16
#: MXNet 1.9.1's step of this workload (worker 0's median step; the median of 6 runs of
#: ``docs/mxnet-comparison/sparse.py``, which checks MXNet's rows, alternating with akv's on
#: this project's 2-core machine, 2026-12-05; see docs/benchmarks.md). With 1 server MXNet
#: took 3.3-3.7 ms on a quiet machine and 12-16 ms while other processes ran; the issue's
#: 15.6 and 19.7 ms (2026-12-04) came from no script kept.
MXNET_STEP_S = {1: 3.6e-3, 2: 14.2e-3}
WARMUP_STEPS = 5
#: Steps (and rounds of each floor) per block; blocks of the three alternate.
BLOCK = 10
TRANSPORTS = {"shared memory": "1", "TCP": "0"}
SHM_CHOICES = {"on": "shared memory", "off": "TCP"}
FLOOR = f"dense push+pull of {BATCH} x {WIDTH} float32"
SAME_BYTES_FLOOR = "dense push+pull of the step's {unique} x {width} float32"


def draw_ids(rng: np.random.Generator, rows: int = ROWS, batch: int = BATCH) -> np.ndarray:
    """A batch's row ids: Zipf-like, folded into ``[0, rows)``."""
    return np.minimum(rng.zipf(ZIPF_A, batch) - 1, rows - 1).astype(np.int64)


# ---------------------------------------------------------------------- workers


def worker_main(argv: list[str] | None = None) -> int:
    """One worker of a benchmark job (``--mode step`` or ``memory``); worker 0 writes its
    results as JSON to ``--out``.

    ``step``: ``{"step": [s, ...], "floor": [...], "same_bytes": [...], "unique": U}``
    (seconds per sparse step, per dense round of 8192 rows and of U rows).
    ``memory``: ``{"touched": N, "before": {rank: RSS}, "after": {rank: RSS},
    "stored": {rank: rows}, "seconds": s}``.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("step", "memory"), default="step")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--touched", type=int, default=10**6)
    parser.add_argument("--servers", type=int, default=1)
    args = parser.parse_args(argv)
    with akv.create("dist_sync") as kv:
        if args.mode == "memory":
            results: dict[str, object] = _touch_rows(kv, args.touched, args.servers)
        else:
            results = _steps(kv, args.steps, args.rows)
        if kv.rank == 0:
            Path(args.out).write_text(json.dumps(results))
    return 0


def _steps(kv: akv.KVStore, steps: int, rows: int) -> dict[str, object]:
    """The sparse steps and both floors, in alternating blocks (every worker runs this)."""
    kv.init("emb", akv.RowSparseArray.zeros((rows, WIDTH), np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    rng = np.random.default_rng(kv.rank)
    # Every batch drawn before the timing: a step times akv's push and pull (and the wait
    # for the other worker's), not NumPy's Zipf sampling (about 1 ms a batch).
    batches = []
    for _ in range(steps + WARMUP_STEPS):
        ids = np.unique(draw_ids(rng, rows))
        grad = np.ones((ids.size, WIDTH), np.float32)
        batches.append((ids, akv.RowSparseArray(grad, ids, (rows, WIDTH))))
    # The same-bytes floor's key: a batch's mean count of unique ids over every worker's
    # batches (the same on every worker: a key's shape must agree).
    counts = []
    for rank in range(kv.num_workers):
        drawn = np.random.default_rng(rank)
        counts += [np.unique(draw_ids(drawn, rows)).size for _ in range(steps + WARMUP_STEPS)]
    unique = round(statistics.mean(counts))
    # The floors' keys (every worker the same sizes: a dist_sync round needs both).
    dense = {
        "floor": np.ones((BATCH, WIDTH), np.float32),
        "same_bytes": np.ones((unique, WIDTH), np.float32),
    }
    outs = {name: np.empty_like(value) for name, value in dense.items()}
    kv.init(list(dense), list(dense.values()))
    for name, value in dense.items():
        for _ in range(WARMUP_STEPS):
            kv.push(name, value)
            kv.pull(name, out=outs[name])
    times: dict[str, list[float]] = {"step": [], "floor": [], "same_bytes": []}
    kv.barrier()
    for step, (ids, batch) in enumerate(batches):
        start = time.perf_counter()
        kv.push("emb", batch)
        kv.row_sparse_pull("emb", row_ids=ids)
        if step >= WARMUP_STEPS:
            times["step"].append(time.perf_counter() - start)
        done = step - WARMUP_STEPS + 1
        if done > 0 and (done % BLOCK == 0 or done == steps):
            # A block of each floor after each block of steps (as many rounds).
            for name, value in dense.items():
                for _ in range(done - len(times[name])):
                    start = time.perf_counter()
                    kv.push(name, value)
                    kv.pull(name, out=outs[name])
                    times[name].append(time.perf_counter() - start)
    return {**times, "unique": unique}


def _touch_rows(kv: akv.KVStore, count: int, servers: int) -> dict[str, object]:
    """Push ``count`` distinct rows of a 10^9 x 64 table split over the job's ``servers``
    servers; worker 0 reads their RSS before and after (every worker runs this)."""
    shape = (MEMORY_TABLE_ROWS, WIDTH)
    kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
    # SGD's lazy update adds each push's rows to the table (without an optimizer a push
    # would replace the rows stored with its own).
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
    ids = _distinct_ids(count)
    # Each round takes a chunk; each worker pushes its half of it (the round's sum is the
    # union: every id of the chunk once).
    chunk = MEMORY_CHUNK
    rows = np.ones((chunk, WIDTH), np.float32)
    # A pull of a row of every server's range waits for the round to be applied (in
    # dist_sync a worker pulls before it pushes the key again).
    starts = np.array([part.start for part in row_parts(shape[0], servers)], np.int64)
    probe = np.unique(starts)
    pids = _server_pids() if kv.rank == 0 else {}
    kv.barrier()
    before = {rank: _memory_of(pid) for rank, pid in pids.items()}
    start = time.perf_counter()
    for first in range(0, count, chunk):
        part = np.sort(ids[first : first + chunk])
        mine = part[kv.rank :: kv.num_workers]
        kv.push("emb", akv.RowSparseArray(rows[: mine.size], mine, shape))
        kv.row_sparse_pull("emb", row_ids=probe)
    elapsed = time.perf_counter() - start
    kv.barrier()
    after = {rank: _memory_of(pid) for rank, pid in pids.items()}
    stored = np.bincount(np.searchsorted(starts, ids, side="right") - 1, minlength=servers)
    return {
        "touched": count,
        "before": before,
        "after": after,
        "stored": {rank: int(stored[rank]) for rank in pids},
        "seconds": elapsed,
    }


def _memory_of(pid: int) -> dict[str, int]:
    """A process's ``VmRSS``, ``RssAnon`` and ``RssShmem`` (bytes) from ``/proc`` (its own
    memory, and the shared-memory transport's pages it touched)."""
    fields = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                fields[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields


def _distinct_ids(count: int) -> np.ndarray:
    """``count`` distinct ids of the memory table, in random order (seeded: every worker
    draws the same)."""
    rng = np.random.default_rng(count)
    ids = np.unique(rng.integers(0, MEMORY_TABLE_ROWS, int(count * 1.01) + 16))[:count]
    rng.shuffle(ids)
    return ids


# ---------------------------------------------------------------------- measuring


def step_rows(
    steps: int,
    rows: int = ROWS,
    servers: Sequence[int] = (1, 2),
    transports: Sequence[str] = tuple(TRANSPORTS),
    notes: list[str] | None = None,
) -> list[Row]:
    """A row per server count and transport (keys of :data:`TRANSPORTS`): the step's median
    against both floors of the same job, its p90, MXNet's step (the 10^6-row table only).
    ``notes`` gets a line per row with the spread (p10-p90) of the step and of the floors."""
    out = []
    for count in servers:
        for transport in transports:
            arguments = ["--steps", str(steps), "--rows", str(rows)]
            env = {"AKV_SHM": TRANSPORTS[transport]}
            results = launch_job("akv.bench.sparse", arguments, count, env)
            unique = int(results["unique"])
            row = Row(
                f"sparse step, {count} server{'s' if count > 1 else ''}, {transport}",
                statistics.median(results["step"]),
                statistics.median(results["floor"]),
                FLOOR,
                akv_p90_s=percentile(results["step"], 0.9),
                reference_s=MXNET_STEP_S.get(count) if rows == ROWS else None,
                second_floor_s=statistics.median(results["same_bytes"]),
                second_floor=SAME_BYTES_FLOOR.format(unique=unique, width=WIDTH),
            )
            if notes is not None:
                notes.append(f"{row.name}: {_spread(results)}; floor 2 is {row.second_floor}")
            out.append(row)
    return out


def _spread(results: dict[str, Any]) -> str:
    """The p10-p90 of the step and of both floors, in ms."""
    parts = []
    for name in ("step", "floor", "same_bytes"):
        low, high = percentile(results[name], 0.1), percentile(results[name], 0.9)
        parts.append(f"{name} {low * 1e3:.2f}-{high * 1e3:.2f} ms")
    return "p10-p90: " + ", ".join(parts)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def _ratio(grown: float, stored: float) -> str:
    """``grown / stored`` to two places; "-" where nothing is stored (a server that holds
    none of the touched rows)."""
    return f"{grown / stored:.2f}" if stored > 0 else "-"


def _rss_now() -> int:
    """This process's resident memory now (Linux's ``/proc/self/statm``, in pages)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def memory_growth(count: int) -> tuple[int, int, float]:
    """A local store's RSS growth (bytes) after touching ``count`` distinct rows of a
    10^9 x 64 float32 table (256 GB declared), the bytes of those rows, and the seconds
    the pushes took."""
    shape = (MEMORY_TABLE_ROWS, WIDTH)
    with akv.create("local") as kv:
        kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        chunk = MEMORY_CHUNK
        ids = _distinct_ids(count)
        rows = np.ones((chunk, WIDTH), np.float32)
        before = _rss_now()  # the ids and the pushed rows are not the store's
        start = time.perf_counter()
        for first in range(0, count, chunk):
            part = np.sort(ids[first : first + chunk])
            kv.push("emb", akv.RowSparseArray(rows[: part.size], part, shape))
        kv.wait_all()
        elapsed = time.perf_counter() - start
        return _rss_now() - before, count * WIDTH * 4, elapsed


def dist_memory(count: int, servers: int = 2) -> dict[int, dict[str, int]]:
    """What each server of a ``dist_sync`` job of 2 workers and ``servers`` servers grew by
    after touching ``count`` distinct rows of a 10^9 x 64 float32 table: ``{rank:
    {"VmRSS": bytes, "RssAnon": ..., "RssShmem": ..., "rows": bytes of the rows it
    stores, "seconds": the pushes' time}}``."""
    arguments = ["--mode", "memory", "--touched", str(count), "--servers", str(servers)]
    data = launch_job("akv.bench.sparse", arguments, servers, {})
    out = {}
    for rank, after in data["after"].items():
        before = data["before"][rank]
        grown = {name: after[name] - before[name] for name in after}
        stored = data["stored"][rank] * WIDTH * 4
        out[int(rank)] = {**grown, "rows": stored, "seconds": data["seconds"]}
    return out


# ---------------------------------------------------------------------- the command


def options_parser() -> argparse.ArgumentParser:
    """The options of ``akv bench sparse``."""
    parser = argparse.ArgumentParser(
        prog="akv bench sparse",
        description="a row-sparse embedding workload against akv's dense rounds",
    )
    parser.add_argument(
        "--servers", type=int, nargs="+", default=[1, 2], help="server counts (default 1 2)"
    )
    parser.add_argument(
        "--shm",
        choices=sorted(SHM_CHOICES),
        nargs="+",
        default=["on", "off"],
        help="shared memory on (AKV_SHM=1) and/or off (TCP; default on off)",
    )
    parser.add_argument(
        "--steps", type=int, help="timed steps per job (default 100; quick 20; 0: no steps)"
    )
    parser.add_argument("--rows", type=int, default=ROWS, help="the table's rows (default 10^6)")
    parser.add_argument(
        "--memory",
        type=int,
        nargs="+",
        help="touched-row counts of the memory rows (default 10^6 10^7; quick 10^5; 0: none)",
    )
    parser.add_argument(
        "--memory-stores",
        choices=("local", "dist"),
        nargs="+",
        default=["local", "dist"],
        help="where the memory rows are measured (default local dist: 2 servers)",
    )
    return parser


def run(argv: Sequence[str] = ()) -> Table:
    """The steps and the memory rows, as ``argv`` (:func:`options_parser`) asks."""
    quick = _SETTINGS["rounds"] < 5
    options = options_parser().parse_args(list(argv))
    steps = (20 if quick else 100) if options.steps is None else options.steps
    counts = options.memory or ([10**5] if quick else [10**6, 10**7])
    for value, what, least in ((steps, "--steps", 0), (options.rows, "--rows", 1)):
        if value < least:
            raise akv.BenchmarkError(
                f"akv bench sparse: {what} must be at least {least}, got {value}"
            )
    table = Table(
        f"akv bench sparse (a {options.rows:,} x {WIDTH} float32 table, 2 workers, dist_sync, "
        "SGD; ms per step of worker 0)",
        second_floor_heading="floor 2",
    )
    if steps:
        transports = [SHM_CHOICES[choice] for choice in options.shm]
        spreads: list[str] = []
        for row in step_rows(steps, options.rows, options.servers, transports, spreads):
            table.add(row)
        table.notes.append(
            f"The step: each worker draws {BATCH} Zipf-like ids (a={ZIPF_A}), pushes the "
            f"gradient of the unique ones and row_sparse_pulls them; {steps} timed steps "
            f"after {WARMUP_STEPS} warm-up steps. 'floor': the same job's {FLOOR}; 'floor 2': "
            "its dense push+pull of the step's bytes (a batch's mean count of unique ids), "
            "the target's floor; both timed in blocks of rounds alternating with blocks of "
            "steps."
        )
        table.notes.extend(spreads)
    table.notes.append(f"Row sums and updates: {jit.describe()} (AKV_JIT).")
    for count in [count for count in counts if count > 0]:
        if "local" in options.memory_stores:
            grown, stored, elapsed = memory_growth(count)
            table.notes.append(
                f"Memory, local store: RSS grew {grown / 2**20:,.0f} MiB for {count:,} rows "
                f"touched of a 10^9 x {WIDTH} float32 table ({stored / 2**20:,.0f} MiB of "
                f"rows; ratio {_ratio(grown, stored)}; pushes {elapsed:.1f} s)."
            )
        if "dist" in options.memory_stores:
            grown_by = dist_memory(count)
            each = "; ".join(
                f"server {rank} {_mib(grown['VmRSS'])} for {_mib(grown['rows'])} of rows "
                f"(ratio {_ratio(grown['VmRSS'], grown['rows'])}; of it "
                f"{_mib(grown['RssShmem'])} the transport's shared pages, "
                f"{_mib(grown['RssAnon'])} its own: ratio "
                f"{_ratio(grown['RssAnon'], grown['rows'])})"
                for rank, grown in sorted(grown_by.items())
            )
            rows = sum(grown["rows"] for grown in grown_by.values())
            total = _ratio(sum(grown["VmRSS"] for grown in grown_by.values()), rows)
            own = _ratio(sum(grown["RssAnon"] for grown in grown_by.values()), rows)
            elapsed = max(grown["seconds"] for grown in grown_by.values())
            table.notes.append(
                f"Memory, dist_sync over 2 servers, {count:,} rows touched: servers' VmRSS grew "
                f"{each}; together ratio {total} (own memory {own}); pushes {elapsed:.1f} s."
            )
    table.notes.append(
        "Targets: the step at least 4x faster than MXNet with shared memory, 2x "
        "with AKV_SHM=0; within 1.5x of the dense round of the same bytes (floor 2); RSS "
        "within 2x of the rows' bytes."
    )
    return table


if __name__ == "__main__":
    sys.exit(worker_main())
