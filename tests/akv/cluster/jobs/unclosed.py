"""A worker that never closes its store: ``unclosed.py raise|clean``.

As many MXNet scripts do: the store is made without ``with`` and never closed. At exit akv
closes it, with the exit barrier after a normal end; after an uncaught exception (rank 1
raises in ``raise`` mode) it leaves as a failed worker, naming the exception.
"""

import sys

import numpy as np

import akv

kv = akv.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
for step in range(20):
    if sys.argv[1] == "raise" and kv.rank == 1 and step == 3:
        raise ValueError("boom in a script that never closes its store")
    kv.push("w", np.ones(4, np.float32))
    kv.pull("w")
print(f"rank {kv.rank} done: {kv.pull('w')[0]}", flush=True)
