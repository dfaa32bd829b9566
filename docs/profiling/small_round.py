"""Time a dist_sync small-key round (push + pull of 16 floats) and the CPU it costs.

Run it as every worker of a job, for instance with 2 workers and 1 server::

    python -m akv.launch -n 2 -s 1 -- python docs/profiling/small_round.py

Worker 0 prints, for each of 3 repeats of ``AKV_PROFILE_ROUNDS`` rounds (2000 by default),
the wall time per round, the CPU time of the calling thread per round, and the CPU time of
the whole process per round (the calling thread, the store's loop thread and the heartbeat
thread). To see the kernel's share or the syscalls, run it under a profiler as the job's
command, e.g. ``-- perf stat -e task-clock,context-switches -- python ...`` or
``-- strace -f -c -- python ...``.
"""

import os
import time

import numpy as np

import akv

ROUNDS = int(os.environ.get("AKV_PROFILE_ROUNDS", "2000"))


def main() -> None:
    with akv.create("dist_sync") as kv:
        value, out = np.ones(16, np.float32), np.zeros(16, np.float32)
        kv.init(1, value)
        kv.barrier()
        for _ in range(3):
            wall, caller, process = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(ROUNDS):
                kv.push(1, value)
                kv.pull(1, out=out)
            wall = (time.perf_counter() - wall) / ROUNDS * 1e6
            caller = (time.thread_time() - caller) / ROUNDS * 1e6
            process = (time.process_time() - process) / ROUNDS * 1e6
            if kv.rank == 0:
                print(
                    f"round {wall:.0f} us, calling thread CPU {caller:.0f} us, "
                    f"process CPU {process:.0f} us",
                    flush=True,
                )
            assert out[0] == kv.num_workers, out  # every worker pushed ones


if __name__ == "__main__":
    main()
