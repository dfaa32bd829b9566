"""A worker that never closes its store: ``unclosed.py raise|exit|clean``.

As many MXNet scripts do: the store is made without ``with`` and never closed. At exit akv
closes it, with the exit barrier after a normal end; after an uncaught exception (rank 1
raises in ``raise`` mode, calls ``sys.exit(3)`` in ``exit`` mode) it leaves as a failed
worker, naming the exception or the status. After akv's
close at exit, it prints the akv threads still running (none: a thread left running into
the interpreter's finalization may crash the process).
"""

import atexit
import sys
import threading
import time

import numpy as np

import akv


def _threads_left() -> None:
    """Registered before the store exists, so it runs after akv's close (atexit: last in,
    first out)."""
    deadline = time.monotonic() + 2.0  # a daemon thread's last instructions after its join
    while time.monotonic() < deadline:
        left = sorted(t.name for t in threading.enumerate() if t.name.startswith("akv-"))
        if not left:
            break
        time.sleep(0.01)
    print(f"akv threads left at exit: {left}", flush=True)


atexit.register(_threads_left)
kv = akv.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
for step in range(20):
    if sys.argv[1] == "raise" and kv.rank == 1 and step == 3:
        raise ValueError("boom in a script that never closes its store")
    if sys.argv[1] == "exit" and kv.rank == 1 and step == 3:
        sys.exit(3)
    kv.push("w", np.ones(4, np.float32))
    kv.pull("w")
print(f"rank {kv.rank} done: {kv.pull('w')[0]}", flush=True)
