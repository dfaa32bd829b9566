"""A worker's next round after a restart must not run ahead of its resent one:
``runs_ahead.py``.

Run under ``akv-launch -n 2 -s 1 --checkpoint-dir DIR --max-restarts 1`` with a long
checkpoint interval. Both workers push and pull key ``a`` for 6 rounds; a new key at
round 4 makes a checkpoint of rounds 1-4. Worker 0 then kills the server and computes for
4 s holding the GIL (its replay of rounds 5 and 6 waits for it). Worker 1 pulls a key it
never pushed (answered once both workers reconnected) and does round 7 at once: its
replay sent its round-6 push again, which waits on the restarted server for worker 0's,
while worker 1's own pull of round 6 was answered by the server that died. Each worker
prints what it pulled after round 7 as JSON.
"""

import json
import os
import signal
import sys
import time

import numpy as np
from scheduler_view import server_pids

import akv

ONE = np.ones(2, np.float32)


with akv.create("dist_sync") as kv:
    kv.init(["a", "x"], [np.zeros(2, np.float32)] * 2)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    for step in range(1, 7):
        kv.push("a", ONE)
        kv.pull("a")
        if step == 4:
            kv.init("c", ONE)  # answered once a checkpoint holds it (rounds 1-4)
    if kv.rank == 0:
        os.kill(server_pids()[0], signal.SIGKILL)
        sys.setswitchinterval(0.5)  # a busy training step that holds the GIL
        started = time.monotonic()
        while time.monotonic() - started < 4:
            pass
        sys.setswitchinterval(0.005)
    else:
        time.sleep(0.3)
        kv.pull("x")
    kv.push("a", ONE)
    print(json.dumps({"rank": kv.rank, "a": kv.pull("a").tolist()}), flush=True)
