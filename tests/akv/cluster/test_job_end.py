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
