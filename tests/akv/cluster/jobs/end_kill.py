"""A server killed as the workers leave must keep what they pushed: ``end_kill.py MODE``.

Run under ``akv-launch -n 2 -s 2 --checkpoint-dir DIR --max-restarts 1`` with a long
checkpoint interval (so that no interval checkpoint holds the rounds). Every worker pushes
``ROUNDS`` rounds to three keys (one split over both servers, one row-sparse over both)
under SGD, then passes a barrier. Then:

- ``none``: both leave.
- ``at_close``: worker 0 kills server 1 and both leave while it restarts from a checkpoint
  without their rounds.
- ``after_goodbye``: worker 1 leaves (no barrier at its exit); once the scheduler says it
  finished, worker 0 kills server 1, pulls (from the restarted server) and leaves.

``read``: a later job on the same directory prints digests of the restored values as JSON:
they must be those the job ``none`` left.
"""

import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
from scheduler_view import finished_workers, server_pids

import akv

MODE = sys.argv[1]
ROUNDS = 5
ROWS = 64
SPLIT = 4096  # above AKV_BIGARRAY_BOUND=1024: split over both servers


def read(kv: akv.KVStore) -> None:
    values = {key: kv.pull(key) for key in ("w", "split")}
    values["emb"] = kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).to_dense()
    digests = {key: hashlib.sha256(value.tobytes()).hexdigest() for key, value in values.items()}
    print(json.dumps({"rank": kv.rank, "w0": float(values["w"][0]), **digests}), flush=True)


def train(kv: akv.KVStore) -> None:
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    scale = np.float32(kv.rank + 1)
    for step in range(ROUNDS):
        kv.push("w", np.linspace(-1, 1, 8, dtype=np.float32) * scale)
        kv.push("split", np.arange(SPLIT, dtype=np.float32) * scale / 1000)
        ids = np.array([step, ROWS // 2 + step, ROWS - 1 - step])
        rows = np.full((3, 2), step + 1, np.float32) * scale
        kv.push("emb", akv.RowSparseArray(rows, ids, (ROWS, 2)))
        kv.pull("w")
        kv.pull("split")
        kv.row_sparse_pull("emb", row_ids=ids)
    kv.barrier()
    if MODE == "at_close" and kv.rank == 0:
        os.kill(server_pids()[1], signal.SIGKILL)
        time.sleep(0.5)  # both workers see their streams to it cut before they leave
    elif MODE == "after_goodbye":
        kv.set_barrier_before_exit(False)
        if kv.rank == 0:
            deadline = time.monotonic() + 30
            while 1 not in finished_workers():
                assert time.monotonic() < deadline, "worker 1 did not finish within 30 s"
                time.sleep(0.05)
            os.kill(server_pids()[1], signal.SIGKILL)
            kv.pull("split")
    print(json.dumps({"rank": kv.rank, "left": True}), flush=True)


with akv.create("dist_sync") as kv:
    kv.init("w", np.zeros(8, np.float32))
    kv.init("split", np.zeros(SPLIT, np.float32))
    kv.init("emb", akv.RowSparseArray.zeros((ROWS, 2), np.float32))
    read(kv) if MODE == "read" else train(kv)
