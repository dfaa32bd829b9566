"""A server stopped by SIGTERM once every worker finished ends the job well:
``term_at_end.py``.

Run under ``akv-launch -n 2 -s 1`` with a heartbeat interval of seconds. Both workers
push and pull a round and close their stores. While worker 0 closes, a thread of it sends
server 0 SIGTERM as soon as the scheduler says both workers finished; worker 0's stream to
the server stays open until the signal was sent, so that the server has not learnt that the
job ended (it learns it at once when every worker's stream ended after its goodbye, else at
its next heartbeat): the signal lands before its stop. Worker 0 then stays until the
server exited, so that the launcher sees the server's exit while a worker still runs.
"""

import os
import signal
import threading
import time

import numpy as np
from scheduler_view import finished_workers, server_pids

import akv
from akv.cluster.worker import link as _link

signalled = threading.Event()
_close = _link.ServerLink.close


def _close_once_signalled(self) -> None:
    signalled.wait(30)  # (on worker 0's loop, in its close, once its goodbyes were said)
    _close(self)


def stop_once_both_finished(server: int) -> None:
    try:
        deadline = time.monotonic() + 30
        while len(finished_workers()) < 2:
            assert time.monotonic() < deadline, "the workers did not finish within 30 s"
            time.sleep(0.005)
        os.kill(server, signal.SIGTERM)
    finally:  # (a failure here must not hold worker 0's close)
        signalled.set()


with akv.create("dist_sync") as kv:
    kv.init(0, np.zeros(4, np.float32))
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0)
    rank, server = kv.rank, server_pids()[0]
    stopper = threading.Thread(target=stop_once_both_finished, args=(server,))
    if rank == 0:
        _link.ServerLink.close = _close_once_signalled
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
