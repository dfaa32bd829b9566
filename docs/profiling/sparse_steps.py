"""Time ``akv bench sparse``'s step alone (no floor blocks), to profile it.

Run it as every worker of a job, for instance with 2 workers and 1 server::

    akv-launch -n 2 -s 1 -- python docs/profiling/sparse_steps.py 3000

Each worker inits a 10^6 x 64 float32 row-sparse key with akv's SGD on the servers, draws
up to 300 batches of 8192 Zipf-like ids (the bench's ``draw_ids``) before the timing, then
runs the given number of steps (push of the unique ids' gradient, ``row_sparse_pull`` of
them), reusing the batches in turn. Worker 0 prints the median, p10, p90, mean and
longest step (the mean and the longest show the stalls of a table's growth). While it
runs, read each process's CPU from ``/proc/PID/stat`` or attach ``py-spy record --gil``.
"""

import statistics
import sys
import time

import numpy as np

import akv
from akv.bench.sparse import ROWS, WIDTH, draw_ids

WARMUP = 5


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with akv.create("dist_sync") as kv:
        kv.init("emb", akv.RowSparseArray.zeros((ROWS, WIDTH), np.float32))
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
        rng = np.random.default_rng(kv.rank)
        batches = []
        for _ in range(min(steps, 300)):
            ids = np.unique(draw_ids(rng, ROWS))
            grad = np.ones((ids.size, WIDTH), np.float32)
            batches.append((ids, akv.RowSparseArray(grad, ids, (ROWS, WIDTH))))
        kv.barrier()
        times = []
        for step in range(steps + WARMUP):
            ids, batch = batches[step % len(batches)]
            start = time.perf_counter()
            kv.push("emb", batch)
            kv.row_sparse_pull("emb", row_ids=ids)
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
        if kv.rank == 0:
            p10, p90 = np.percentile(times, [10, 90]) * 1e3
            print(
                f"step median {statistics.median(times) * 1e3:.3f} ms, p10 {p10:.3f}, "
                f"p90 {p90:.3f}, mean {statistics.fmean(times) * 1e3:.3f}, "
                f"longest {max(times) * 1e3:.1f}"
            )


if __name__ == "__main__":
    main()
