"""A restarted ``dist_async`` server keeps the order the barriers gave: ``async_restart.py``.

Run under ``akv-launch -n 2 -s 2 --checkpoint-dir DIR --max-restarts 1`` with a long
checkpoint interval (the checkpoint holds the inits only). Both workers push gradients of
ones, 5 each, to a dense key and to rows of a row-sparse key (both over both servers);
between two barriers worker 0 lowers the learning rate (0.1 to 0.001); both push 5 more.
After the next barrier worker 0 kills server 1, and after one more both pull: every
worker sent every push again, and the server must apply them as the barriers ordered
them, whatever order the two replays come in. Each worker prints what it pulled and what
it expected as JSON.
"""

import json
import os
import signal
import time

import numpy as np
from scheduler_view import server_pids

import akv

SPLIT = 4096  # above AKV_BIGARRAY_BOUND=1024: split over both servers
ROWS = 64
IDS = np.array([0, 31, 32, 63])  # rows of both servers, at their ends


def push_ones(kv: akv.KVStore) -> None:
    for _ in range(5):
        kv.push("w", np.ones(SPLIT, np.float32))
        kv.push("emb", akv.RowSparseArray(np.ones((len(IDS), 2), np.float32), IDS, (ROWS, 2)))


with akv.create("dist_async") as kv:
    kv.init("w", np.zeros(SPLIT, np.float32))
    kv.init("emb", akv.RowSparseArray.zeros((ROWS, 2), np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    kv.barrier()
    push_ones(kv)
    kv.barrier()
    if kv.rank == 0:
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.001))
    kv.barrier()
    push_ones(kv)
    kv.barrier()
    if kv.rank == 0:
        os.kill(server_pids()[1], signal.SIGKILL)
    time.sleep(0.3)  # both workers see the stream cut before the barrier
    kv.barrier()
    w = kv.pull("w")
    rows = kv.row_sparse_pull("emb", row_ids=IDS).data
    expected = -(0.1 * 10 + 0.001 * 10)  # 10 pushes of ones at each rate
    got = {"w": [float(w.min()), float(w.max())], "emb": [float(rows.min()), float(rows.max())]}
    print(json.dumps({"rank": kv.rank, "expected": expected, **got}), flush=True)
