"""The scheduler and every server log one line when the job ended well."""

from __future__ import annotations

import asyncio
import logging
import re

import numpy as np

from tests.akv.cluster.cluster import Cluster, close_all


def test_the_scheduler_and_each_server_say_the_job_ended_well(caplog):
    caplog.set_level(logging.INFO, logger="akv")
    with Cluster(num_workers=2, num_servers=2) as cluster:

        async def job() -> list[object]:
            stores = await cluster.workers()
            await asyncio.gather(*(kv.init(3, np.zeros(4, np.float32)) for kv in stores))
            await close_all(stores)
            done, _ = await asyncio.wait(cluster._tasks, timeout=20)
            return [task.result() for task in done]

        assert cluster.thread.run(job(), timeout=40) == [0, 0, 0]
    ended = [r.getMessage() for r in caplog.records if "the job ended well" in r.getMessage()]
    assert sorted(m for m in ended if m.startswith("server")) == [
        "server 0: the job ended well; stopping",
        "server 1: the job ended well; stopping",
    ]
    (scheduler,) = [m for m in ended if not m.startswith("server")]
    assert re.fullmatch(
        r"the job ended well: 2 workers and 2 servers finished in \d+\.\d s", scheduler
    )
    # Even rounds: no server says a round never closed.
    assert not [r for r in caplog.records if "never closed" in r.getMessage()]


def test_a_server_says_which_rounds_never_closed_when_the_job_ends(caplog):
    """Uneven pushes in dist_sync: worker 0 pushes key 3 twice and worker 1 once, so round 2
    waits for worker 1 when the job ends and its push is never applied (MXNet says nothing
    of it). The server names the round, the key and the workers, in one warning."""
    caplog.set_level(logging.INFO, logger="akv")
    with Cluster(num_workers=2, num_servers=1) as cluster:

        async def job() -> list[object]:
            stores = sorted(await cluster.workers(), key=lambda kv: kv.rank)
            await asyncio.gather(*(kv.init(3, np.zeros(4, np.float32)) for kv in stores))
            await asyncio.gather(*(kv.push(3, np.ones(4, np.float32)) for kv in stores))
            await asyncio.gather(*(kv.pull(3) for kv in stores))
            await stores[0].push(3, np.ones(4, np.float32))
            await close_all(stores)
            done, _ = await asyncio.wait(cluster._tasks, timeout=20)
            return [task.result() for task in done]

        assert cluster.thread.run(job(), timeout=40) == [0, 0]
    warned = [r for r in caplog.records if "never closed" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in warned] == [
        (
            "WARNING",
            "server 0: the job ended with 1 dist_sync round(s) never closed, whose pushes are "
            "not applied (a round is applied once every worker pushed it): round 2 of key 3 "
            "(pushed by workers [0], not by [1])",
        )
    ]
