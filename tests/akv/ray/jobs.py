"""The functions the Ray tests run on their workers (imported there by name: Ray's workers
have the test run's working directory, the repository root, on their path)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import akv
from tests.akv.cluster.jobs.scheduler_view import server_pids

#: The size of the key of :func:`sum_through_a_restart`.
SIZE = 1000


def fail_on_rank_1() -> str:
    """Rank 1 raises; rank 0 returns without joining a store."""
    if os.environ["AKV_RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")
    return "rank 0 returned"


def fail_with_a_store_open(report: str) -> str:
    """Rank 1 opens a store without ``with`` and raises; rank 0 waits in a barrier and
    writes what the barrier did to the file ``report``."""
    kv = akv.create("dist_sync")
    kv.init("w", np.zeros(4, np.float32))
    if kv.rank == 1:
        raise ValueError("rank 1 fails with its store open")
    try:
        kv.barrier()
    except akv.AKVError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "the barrier passed"
    with open(report, "w") as file:
        file.write(outcome)
    return outcome


def sum_through_a_restart(rounds: int, kill_at: int) -> dict[str, object]:
    """dist_sync rounds in which every worker pushes ``rank + 1`` under SGD with learning
    rate 1 (so the value is ``-3 * rounds`` with two workers, exactly); worker 0 kills
    server 0 by its pid with SIGKILL at round ``kill_at``. Returns the value's distinct
    elements and the servers' pids before the kill and at the end."""
    killed: list[int] = []
    with akv.create("dist_sync") as kv:
        kv.init("w", np.zeros(SIZE, np.float32))
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        for step in range(rounds):
            if kv.rank == 0 and step == kill_at:
                killed = server_pids()
                os.kill(killed[0], signal.SIGKILL)
            kv.push("w", np.full(SIZE, kv.rank + 1, np.float32))
            kv.pull("w")
            time.sleep(0.01)
        value = kv.pull("w")
        kv.barrier()
        return {
            "values": sorted(set(value.tolist())),
            "killed": killed,
            "servers": server_pids(),
        }
