"""A dist_sync training run for the restart test: ``restart.py clean|kill|term``.

Every worker pushes gradients that depend on its rank and the round to three keys (one
split over both servers) under SGD with momentum, and pulls the weights, for ``ROUNDS``
rounds; it prints a digest of the final weights (their bytes' SHA-256) as JSON. With
``kill``, worker 0 sends SIGKILL to server 1 at round ``KILL_AT``; run under
``akv-launch --checkpoint-dir DIR --max-restarts 1`` the server is restarted from its
checkpoint and the weights must come out the same. With ``term`` it sends SIGTERM instead:
the server drains and writes a final checkpoint before it exits.
"""

import hashlib
import json
import os
import signal
import sys
import time

import numpy as np
from scheduler_view import server_pids

import akv

MODE = sys.argv[1]
ROUNDS = 40
KILL_AT = 17
SPLIT = 4096  # above AKV_BIGARRAY_BOUND=1024: split over both servers

with akv.create("dist_sync") as kv:
    kv.init("w", np.zeros(256, np.float32))
    kv.init("split", np.zeros(SPLIT, np.float32))
    kv.init("bias", np.zeros(3, np.float64))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.05, momentum=0.9))
    for step in range(ROUNDS):
        if MODE in ("kill", "term") and kv.rank == 0 and step == KILL_AT:
            os.kill(server_pids()[1], signal.SIGKILL if MODE == "kill" else signal.SIGTERM)
        scale = np.float32((kv.rank + 1) * (step % 5 + 1))
        kv.push("w", np.linspace(-1, 1, 256, dtype=np.float32) * scale)
        kv.push("split", np.arange(SPLIT, dtype=np.float32) * scale / 1000)
        kv.push("bias", np.array([kv.rank, step, 1.0]))
        for key in ("w", "split", "bias"):
            kv.pull(key)
        time.sleep(0.01)  # a few checkpoints (every 0.2 s) happen during the run
    final = {
        key: hashlib.sha256(kv.pull(key).tobytes()).hexdigest() for key in ("w", "split", "bias")
    }
    print(json.dumps({"rank": kv.rank, "first": float(kv.pull("w")[0]), **final}), flush=True)
