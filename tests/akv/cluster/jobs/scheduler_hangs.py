"""The scheduler hangs (SIGSTOP) as the workers leave: ``scheduler_hangs.py``, under
``akv-launch -n 2 -s 1``.

Worker 0 stops the scheduler after a round, then both leave their ``with`` block, whose
close waits at the exit barrier. Each prints what its close raised, as JSON, and exits 5.
"""

import json
import os
import signal
import sys
import time

import numpy as np
from scheduler_view import scheduler_pid

import akv

rank = -1
stopped_at = time.monotonic()
try:
    with akv.create("dist_sync") as kv:
        rank = kv.rank
        kv.init(0, np.zeros(4, np.float32))
        kv.push(0, np.ones(4, np.float32))
        kv.pull(0)
        kv.barrier()
        if rank == 0:
            os.kill(scheduler_pid(), signal.SIGSTOP)
        stopped_at = time.monotonic()
except akv.AKVError as exc:
    after_s = time.monotonic() - stopped_at
    said = {"rank": rank, "error": type(exc).__name__, "message": str(exc), "after_s": after_s}
    print(json.dumps(said), flush=True)
    sys.exit(5)
