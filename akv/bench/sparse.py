"""``akv bench sparse``: an embedding table on the servers, against akv's own dense round.

The workload (issue #25): a row-sparse table of 10^6 x 64 float32 on the servers, 2 workers,
``dist_sync`` with SGD (lazy); each step each worker draws 8192 row ids (Zipf-like: a few hot
rows and a long tail; seeded per worker), pushes their gradient (the unique ids' rows) and
``row_sparse_pull``-s them. Jobs under akv-launch with 1 and 2 servers, shared memory on and
off. The floor, measured in the same job: a dense push+pull of one key of the bytes the step
moved (its unique rows, once each way), the round akv would make if the rows were a dense
array of their own.

Memory: a local store's RSS growth against the bytes of the rows stored, after touching
10^6 (and, in full mode, 10^7) distinct rows of a table declared as 10^9 x 64 float32.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import akv
from akv.bench._report import _SETTINGS, Row, Table
from akv.bench.dist import launch_job
from akv.bench.soak import percentile

__all__ = ["ROWS", "WIDTH", "draw_ids", "memory_growth", "run", "step_rows", "worker_main"]

ROWS = 10**6
WIDTH = 64
BATCH = 8192
#: Zipf's exponent for the ids: a few hot rows, a long tail (about 2,000 unique ids of 8,192).
ZIPF_A = 1.2
#: MXNet 1.9.1's step of this workload (issue #25, 2026-12-04, this project's machine).
MXNET_STEP_S = {1: 15.6e-3, 2: 19.7e-3}
WARMUP_STEPS = 5


def draw_ids(rng: np.random.Generator, rows: int = ROWS, batch: int = BATCH) -> np.ndarray:
    """A batch's row ids: Zipf-like, folded into ``[0, rows)``."""
    return np.minimum(rng.zipf(ZIPF_A, batch) - 1, rows - 1).astype(np.int64)


def worker_main(argv: list[str] | None = None) -> int:
    """One worker of the benchmark job; worker 0 writes ``{"step": [...], "floor": [...]}``
    (seconds per step of the sparse workload, and per dense push+pull of its bytes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args(argv)
    with akv.create("dist_sync") as kv:
        kv.init("emb", akv.RowSparseArray.zeros((args.rows, WIDTH), np.float32))
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
        rng = np.random.default_rng(kv.rank)
        # Every batch drawn before the timing: a step times akv's push and pull (and the
        # wait for the other worker's), not NumPy's Zipf sampling (about 1 ms a batch).
        batches = []
        for _ in range(args.steps + WARMUP_STEPS):
            ids = np.unique(draw_ids(rng, args.rows))
            rows = np.ones((ids.size, WIDTH), np.float32)
            batches.append((ids, akv.RowSparseArray(rows, ids, (args.rows, WIDTH))))
        kv.barrier()
        steps = []
        for step, (ids, grad) in enumerate(batches):
            start = time.perf_counter()
            kv.push("emb", grad)
            kv.row_sparse_pull("emb", row_ids=ids)
            if step >= WARMUP_STEPS:
                steps.append(time.perf_counter() - start)
        # The floor: a step's bytes as one dense key, pushed and pulled (its rows: a batch's
        # unique ids from one seed, the same on every worker).
        typical = np.unique(draw_ids(np.random.default_rng(99), args.rows)).size
        dense = np.ones((typical, WIDTH), np.float32)
        kv.init("dense", dense)
        floor = []
        for step in range(args.steps + WARMUP_STEPS):
            start = time.perf_counter()
            kv.push("dense", dense)
            kv.pull("dense", out=dense)
            if step >= WARMUP_STEPS:
                floor.append(time.perf_counter() - start)
        if kv.rank == 0:
            results = {"step": steps, "floor": floor, "rows": [float(typical)]}
            Path(args.out).write_text(json.dumps(results))
    return 0


#: The ways a job's streams can go: the label in the rows, and ``AKV_SHM``.
TRANSPORTS = (("shared memory", "1"), ("TCP", "0"))


def step_rows(
    steps: int,
    rows: int = ROWS,
    servers: tuple[int, ...] = (1, 2),
    transports: tuple[tuple[str, str], ...] = TRANSPORTS,
) -> list[Row]:
    """A row per server count and transport: the step against the dense floor."""
    out = []
    for count in servers:
        for transport, shm in transports:
            arguments = ["--steps", str(steps), "--rows", str(rows)]
            results = launch_job("akv.bench.sparse", arguments, count, {"AKV_SHM": shm})
            step = statistics.median(results["step"])
            unique = int(results["rows"][0])
            out.append(
                Row(
                    f"sparse step, {count} server{'s' if count > 1 else ''}, {transport}",
                    step,
                    statistics.median(results["floor"]),
                    f"dense push+pull of {unique} x {WIDTH} float32",
                    akv_p90_s=percentile(results["step"], 0.9),
                    reference_s=MXNET_STEP_S.get(count) if rows == ROWS else None,
                )
            )
    return out


def _rss_bytes() -> int:
    """This process's resident memory now (Linux's ``/proc/self/statm``, in pages)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def memory_growth(count: int) -> tuple[int, int, float]:
    """A local store's RSS growth (bytes) after touching ``count`` distinct rows of a
    10^9 x 64 float32 table (256 GB declared), the bytes of those rows, and the seconds
    the pushes took."""
    shape = (10**9, WIDTH)
    with akv.create("local") as kv:
        kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
        # SGD's lazy update adds each push's rows to the table (without an optimizer a
        # push would replace the rows stored with its own).
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        chunk = 1 << 18
        rng = np.random.default_rng(count)
        ids = np.unique(rng.integers(0, shape[0], int(count * 1.01)))[:count]
        rng.shuffle(ids)
        rows = np.ones((chunk, WIDTH), np.float32)
        before = _rss_bytes()  # the ids and the pushed rows are not the store's
        start = time.perf_counter()
        for first in range(0, count, chunk):
            part = np.sort(ids[first : first + chunk])
            kv.push("emb", akv.RowSparseArray(rows[: part.size], part, shape))
        elapsed = time.perf_counter() - start
        kv.wait_all()
        return _rss_bytes() - before, count * WIDTH * 4, elapsed


def run() -> Table:
    """The steps (1 and 2 servers, shared memory and TCP) and the memory rows."""
    quick = _SETTINGS["rounds"] < 5
    table = Table("akv bench sparse (a 10^6 x 64 float32 table, 2 workers, dist_sync, SGD)")
    for row in step_rows(20 if quick else 100):
        table.add(row)
    table.notes.append(
        "The step: each worker draws 8192 Zipf-like ids (a=1.2: about 2,000 unique), pushes "
        "their gradient and row_sparse_pulls them; the floor is the same job's dense "
        "push+pull of those bytes."
    )
    for count in [10**5] if quick else [10**6, 10**7]:
        grown, stored, elapsed = memory_growth(count)
        table.notes.append(
            f"Memory: a local store's RSS grew {grown / 2**20:,.0f} MiB for {count:,} "
            f"rows touched of a 10^9 x 64 float32 table ({stored / 2**20:,.0f} MiB of rows; "
            f"ratio {grown / stored:.2f}; pushes {elapsed:.1f} s)."
        )
    table.notes.append(
        "Targets (issue #25): the step at least 4x faster than MXNet with shared memory, 2x "
        "with AKV_SHM=0; within 1.5x of the dense floor; RSS within 2x of the rows' bytes."
    )
    return table


if __name__ == "__main__":
    sys.exit(worker_main())
