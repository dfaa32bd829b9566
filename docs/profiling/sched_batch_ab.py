"""What ``AKV_SCHED_BATCH`` is worth: the worker's network thread under ``SCHED_BATCH`` or
not, alternating in blocks of 100 steps inside one job (so that both halves meet the same
machine: on a shared 2-core host, whole runs of the same code differ by 20%).

Run it as every worker of a job with ``AKV_SCHED_BATCH=0`` (the script sets the policy of
the store's ``akv-store-loop`` thread itself, block by block)::

    export AKV_SCHED_BATCH=0
    akv-launch -n 2 -s 1 -- python docs/profiling/sched_batch_ab.py 4000
    akv-launch -n 2 -s 1 -- python docs/profiling/sched_batch_ab.py 4000 dense 1956

The default step is ``akv bench sparse``'s (push of the unique ids of 8192 Zipf ids, then
``row_sparse_pull`` of them, a 10^6 x 64 float32 table, SGD); ``dense ROWS`` times a dense
push+pull of ROWS x 64 float32 instead. Blocks 0 and 1 are warm-up; of the others, even
blocks run under ``SCHED_BATCH``, odd ones under ``SCHED_OTHER``. Worker 0 prints the median
step of each kind (median of the blocks' medians, each block's first 10 steps left out) and
the median and mean of the ratios of neighbouring blocks.
"""

import os
import statistics
import sys
import threading
import time

import numpy as np

import akv
from akv.bench.sparse import ROWS, WIDTH, draw_ids

BLOCK = 100
SKIPPED = 10


def _set_policy(batch: bool) -> None:
    (thread,) = [t for t in threading.enumerate() if t.name == "akv-store-loop"]
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    os.sched_setscheduler(thread.native_id, policy, os.sched_param(0))


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    dense_rows = int(sys.argv[3]) if sys.argv[2:3] == ["dense"] else 0
    with akv.create("dist_sync") as kv:
        rng = np.random.default_rng(kv.rank)
        if dense_rows:
            value = np.ones((dense_rows, WIDTH), np.float32)
            out = np.empty_like(value)
            kv.init("d", value)
        else:
            kv.init("emb", akv.RowSparseArray.zeros((ROWS, WIDTH), np.float32))
            kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
            batches = []
            for _ in range(300):
                ids = np.unique(draw_ids(rng, ROWS))
                grad = np.ones((ids.size, WIDTH), np.float32)
                batches.append((ids, akv.RowSparseArray(grad, ids, (ROWS, WIDTH))))
        kv.barrier()
        times = []
        for step in range(steps):
            if step % BLOCK == 0:
                _set_policy((step // BLOCK) % 2 == 0)
            start = time.perf_counter()
            if dense_rows:
                kv.push("d", value)
                kv.pull("d", out=out)
            else:
                ids, batch = batches[step % len(batches)]
                kv.push("emb", batch)
                kv.row_sparse_pull("emb", row_ids=ids)
            times.append(time.perf_counter() - start)
        if kv.rank == 0:
            blocks = [
                statistics.median(times[b * BLOCK + SKIPPED : (b + 1) * BLOCK])
                for b in range(2, steps // BLOCK)
            ]
            batch, other = blocks[0::2], blocks[1::2]
            ratios = [b / o for b, o in zip(batch, other, strict=False)]
            print(
                f"SCHED_BATCH {statistics.median(batch) * 1e3:.3f} ms, SCHED_OTHER "
                f"{statistics.median(other) * 1e3:.3f} ms; batch/other median "
                f"{statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f} "
                f"({len(ratios)} pairs of blocks)"
            )


if __name__ == "__main__":
    main()
