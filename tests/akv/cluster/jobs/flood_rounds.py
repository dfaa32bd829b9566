"""A worker for the flood tests: dist_sync rounds of SGD, in two halves; with a path as its
argument it says when it is halfway and waits for that file before the second half. It
prints its weights at the end, after a barrier (and ``close()`` has one more)."""

import json
import os
import sys
import time

import numpy as np

import akv

ROUNDS = 4  # per half
GO_WAIT_S = 60

go = sys.argv[1] if len(sys.argv) > 1 else None


def rounds(kv: akv.KVStore) -> None:
    for _ in range(ROUNDS):
        kv.push(0, np.full(4, kv.rank + 1, np.float32))
        kv.pull(0)


with akv.create("dist_sync") as kv:
    kv.init(0, np.zeros(4, np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    rounds(kv)
    if go is not None:
        print(f"rank {kv.rank} halfway", flush=True)
        deadline = time.monotonic() + GO_WAIT_S
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit(f"rank {kv.rank}: no go-ahead within {GO_WAIT_S} s")
            time.sleep(0.05)
    rounds(kv)
    kv.barrier()
    print(json.dumps({"rank": kv.rank, "weights": kv.pull(0).tolist()}), flush=True)
