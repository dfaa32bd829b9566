"""A worker for fault tests: one rank misbehaves (dies, hangs, raises, kills a server), or
says it is ready to be interrupted by the test."""

import faulthandler
import os
import signal
import sys
import time

import numpy as np
from scheduler_view import server_pids

import akv

MODE = sys.argv[1]
# A test whose process outlives what it allows asks it (SIGUSR1) where its threads are.
faulthandler.register(signal.SIGUSR1, all_threads=True)


with akv.create("dist_sync") as kv:
    kv.init(0, np.zeros(4, np.float32))
    kv.push(0, np.ones(4, np.float32))
    kv.pull(0)
    if kv.rank == 1 and MODE == "die":
        os._exit(3)
    if kv.rank == 1 and MODE == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kv.rank == 0 and MODE == "kill-server":
        for pid in server_pids():
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    if kv.rank == 1 and MODE == "kill-worker":
        os.kill(os.getpid(), signal.SIGKILL)
    if kv.rank == 1 and MODE == "raise":
        raise ValueError("boom in the training loop")
    if MODE == "interruptible":  # the test interrupts (or stops) one rank once it is ready
        print(f"rank {kv.rank} ready", flush=True)
    stopped = None
    if kv.rank == 0 and MODE == "term-server":
        stopped = server_pids()[0]
        os.kill(stopped, signal.SIGTERM)
    if kv.rank == 0 and MODE == "stop-server":
        os.kill(server_pids()[-1], signal.SIGSTOP)  # the last server hangs
    started = time.monotonic()
    try:
        # Until the failure reaches this worker (a hanging server is found by heartbeats).
        while time.monotonic() - started < 60:
            kv.push(0, np.ones(4, np.float32))
            kv.pull(0)
    except akv.AKVError as exc:
        print(
            f"rank {kv.rank} got {type(exc).__name__} after {time.monotonic() - started:.1f}"
            f" s: {exc}",
            flush=True,
        )
        kv.set_barrier_before_exit(False)
        # The server stopped by SIGTERM exits first, so that the launcher reports its exit
        # status: this worker hears of the failure while the server is still stopping.
        deadline = time.monotonic() + 30
        while stopped is not None and time.monotonic() < deadline:
            try:
                os.kill(stopped, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        sys.exit(4)
