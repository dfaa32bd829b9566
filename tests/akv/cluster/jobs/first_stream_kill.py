"""A server killed after the workers registered, before a worker opened its first stream to
it: ``first_stream_kill.py``, under ``akv-launch -n 2 -s 2 --checkpoint-dir DIR
--max-restarts 1``.

Worker 0 SIGKILLs server 1 just before it opens its first stream to it (``ServerLink.open``
wrapped), so that its first stream must reach the restart, which listens elsewhere. Then
each worker pushes ``ROUNDS`` rounds of ones to a key split over both servers and prints the
value it pulls last, as JSON.
"""

import json
import os
import signal
import time

import numpy as np
from scheduler_view import server_pids

import akv
from akv.cluster.worker import link as _link

ROUNDS = 3
SPLIT = 4096  # above AKV_BIGARRAY_BOUND=1024: split over both servers

_open = _link.ServerLink.open
_killed: list[int] = []


async def _open_after_kill(self, config, worker, store_type, session=""):
    if worker == 0 and self.rank == 1 and not _killed:
        _killed.append(server_pids()[1])
        os.kill(_killed[0], signal.SIGKILL)
        time.sleep(0.3)  # dead before the first try: its restart listens on another port
    return await _open(self, config, worker, store_type, session)


_link.ServerLink.open = _open_after_kill

with akv.create("dist_sync") as kv:
    kv.init("split", np.zeros(SPLIT, np.float32))
    for _ in range(ROUNDS):
        kv.push("split", np.ones(SPLIT, np.float32))
        value = kv.pull("split")
    print(json.dumps({"rank": kv.rank, "ends": [float(value[0]), float(value[-1])]}), flush=True)
