"""A job that a test runs twice with one ``--checkpoint-dir`` (tests/akv/cluster/test_restart.py):
both runs init a row-sparse key and a dense key to ones and push three rounds of ones with
SGD (learning rate 1); each worker prints the values it pulls at the end as JSON. The second
run starts from the first's checkpoints, so its rounds add to the first's. ``resume.py fail``:
worker 1 raises once its rounds are done (the job fails)."""

import json
import sys

import numpy as np

import akv

ROWS, WIDTH, STEPS = 10, 4, 3

with akv.create("dist_sync") as kv:
    ones = akv.RowSparseArray(np.ones((ROWS, WIDTH), np.float32), np.arange(ROWS), (ROWS, WIDTH))
    kv.init("emb", ones)
    kv.init("d", np.ones(8, np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
    for _ in range(STEPS):
        kv.push("emb", ones)
        kv.push("d", np.ones(8, np.float32))
        # Every row, so every server's round is applied before the next push.
        kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
        kv.pull("d")
    rows = kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data
    dense = kv.pull("d")
    if sys.argv[1:] == ["fail"] and kv.rank == 1:
        raise RuntimeError("worker 1 fails after its rounds")
    print(
        json.dumps(
            {
                "rank": kv.rank,
                "emb": sorted(set(rows.ravel().tolist())),
                "d": sorted(set(dense.tolist())),
            }
        ),
        flush=True,
    )
