"""What one switch of the worker is worth to ``akv bench sparse``'s step: the switch on and
off in alternating blocks of 100 steps inside one job, so that both halves meet the same
machine (on a shared 2-core host, whole runs of the same code differ by 20%).

Run it as every worker of a job::

    AKV_SCHED_BATCH=0 akv-launch -n 2 -s 1 -- python docs/profiling/step_ab.py sched-batch 4000
    AKV_SHM=0 akv-launch -n 2 -s 1 -- python docs/profiling/step_ab.py push-buffers 4000
    akv-launch -n 2 -s 1 -- python docs/profiling/step_ab.py sched-batch 4000 dense 1956

The switches:

- ``sched-batch``: the store's network thread (``akv-store-loop``) under ``SCHED_BATCH``
  or ``SCHED_OTHER`` (run with ``AKV_SCHED_BATCH=0``: the script sets the policy itself).
- ``push-buffers``: a row push's rows wait for their answers in the worker's reused push
  buffers, or in arrays of their own as before those existed (matters over TCP:
  ``AKV_SHM=0``).

The default step is ``akv bench sparse``'s (push of the unique ids of 8192 Zipf ids, then
``row_sparse_pull`` of them, a 10^6 x 64 float32 table, SGD); ``dense ROWS`` times a dense
push+pull of ROWS x 64 float32 instead. Blocks 0 and 1 are warm-up; of the others, even
blocks run with the switch on, odd ones off. Worker 0 prints the median step of each (median
of the blocks' medians, each block's first 10 steps left out) and the median and mean of the
ratios of neighbouring blocks (on / off: 0.90 is 10% faster with it on).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import akv
from akv.bench.sparse import ROWS, WIDTH, draw_ids

BLOCK = 100
SKIPPED = 10


Switch = tuple[Callable[[bool], None], Callable[[], str]]


def sched_batch(kv: akv.KVStore) -> Switch:
    """Sets the policy of the store's network thread."""
    (thread,) = [t for t in threading.enumerate() if t.name == "akv-store-loop"]

    def switch(on: bool) -> None:
        policy = os.SCHED_BATCH if on else os.SCHED_OTHER
        os.sched_setscheduler(thread.native_id, policy, os.sched_param(0))

    return switch, lambda: ""


def push_buffers(kv: akv.KVStore) -> Switch:
    """Lets row pushes take push buffers, or makes them copy into arrays of their own."""
    rows = kv._inner._backend._rows
    region = rows._region
    state = {"on": True}
    counts = {"in push buffers": 0, "copied": 0}

    def placed(server: int, nbytes: int) -> Any:
        taken = region(server, nbytes)
        if taken is not None and taken[0] is rows.push_buffers:
            if not state["on"]:
                rows.push_buffers.give_back(taken[1])
                counts["copied"] += 1
                return None
            counts["in push buffers"] += 1
        return taken

    rows._region = placed

    def switch(on: bool) -> None:
        state["on"] = on

    return switch, lambda: f"; rows pushed: {counts}"


SWITCHES = {"sched-batch": sched_batch, "push-buffers": push_buffers}


def summary(name: str, times: Sequence[float], block: int = BLOCK, skipped: int = SKIPPED) -> str:
    """The line worker 0 prints: the median step with the switch on and off, and the
    ratios of neighbouring blocks (blocks 0 and 1 left out)."""
    blocks = [
        statistics.median(times[b * block + skipped : (b + 1) * block])
        for b in range(2, len(times) // block)
    ]
    on, off = blocks[0::2], blocks[1::2]
    ratios = [a / b for a, b in zip(on, off, strict=False)]
    return (
        f"{name} on {statistics.median(on) * 1e3:.3f} ms, off {statistics.median(off) * 1e3:.3f}"
        f" ms; on/off median {statistics.median(ratios):.3f}, mean "
        f"{statistics.fmean(ratios):.3f} ({len(ratios)} pairs of blocks)"
    )


def main(argv: Sequence[str]) -> None:
    name = argv[0]
    steps = int(argv[1]) if len(argv) > 1 else 4000
    dense_rows = int(argv[3]) if list(argv[2:3]) == ["dense"] else 0
    with akv.create("dist_sync") as kv:
        switch, report = SWITCHES[name](kv)
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
                switch((step // BLOCK) % 2 == 0)
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
            print(summary(name, times) + report())


if __name__ == "__main__":
    main(sys.argv[1:])
