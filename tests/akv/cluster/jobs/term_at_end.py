"""A server stopped by SIGTERM once every worker finished ends the job well:
``term_at_end.py``.

Run under ``akv-launch -n 2 -s 1`` with a heartbeat interval of seconds. Both workers
push and pull a round and close their stores. While worker 0 closes, a thread of it sends
server 0 SIGTERM as soon as the scheduler says both workers finished: the signal lands as
the server learns that the job ended and stops (before its stop, or during it); worker 0
then stays until the server exited, so that the launcher sees the server's exit while a
worker still runs.
"""

import os
import signal
import threading
import time

import numpy as np
from scheduler_view import finished_workers, server_pids

import akv


def stop_once_both_finished(server: int) -> None:
    deadline = time.monotonic() + 30
    while len(finished_workers()) < 2:
        assert time.monotonic() < deadline, "the workers did not finish within 30 s"
        time.sleep(0.005)
    os.kill(server, signal.SIGTERM)


with akv.create("dist_sync") as kv:
    kv.init(0, np.zeros(4, np.float32))
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0)
    rank, server = kv.rank, server_pids()[0]
    stopper = threading.Thread(target=stop_once_both_finished, args=(server,))
    if rank == 0:
        stopper.start()
if rank == 0:
    stopper.join()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
print(f"rank {rank} left", flush=True)
