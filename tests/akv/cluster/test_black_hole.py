"""A connection that stays open and carries nothing (a proxy that black-holes it): the
streams' liveness finds it within seconds, the worker opens the stream again and
resends, and a server that cannot be reached at all is the one the job's failure names.

Each server binds a free port and advertises a proxy's (``AKV_ADVERTISE``,
:mod:`tests.akv.cluster.test_advertise`), ``AKV_SHM=0``: every byte between the workers
and the servers goes through the proxies. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import akv
from akv.cluster.config import _TIMEOUTS
from akv.errors import AKVError
from akv.limits import STREAM_SILENT_S
from akv_engine import LoopThread
from tests.akv.cluster.test_advertise import AdvertisedCluster, Proxy, proxies
from tests.akv.cluster.test_reconnect import train

pytestmark = pytest.mark.timeout(180)

#: Every timeout at its default, the streams' liveness included (the test cluster's own
#: are shorter).
DEFAULT_TIMEOUTS = {name: str(default) for name, default in _TIMEOUTS.values()}
#: The server-to-worker bytes one connection carries before it is black-holed: mid-job.
BLACK_HOLE_AFTER_BYTES = 100_000


class BlackHoleProxy(Proxy):
    """A :class:`Proxy` that, once armed, keeps the connections it holds open but drops
    what goes ``where`` on them (``"to worker"``, or ``"both"``): ``first_only`` black-holes
    the first connection alone once it has carried :data:`BLACK_HOLE_AFTER_BYTES` to the
    worker; otherwise :meth:`black_hole_all` swallows everything, and every connection
    accepted from then on is held open and never forwarded."""

    def __init__(self, thread: LoopThread, where: str = "to worker", first_only: bool = True):
        super().__init__(thread)
        self.where = where
        self.first_only = first_only
        self.swallowing = False
        self.holed = 0  # connections black-holed
        self.swallowed = 0  # connections accepted and never forwarded

    def _new_connection(self) -> dict:
        return {"number": self.connections, "to worker": 0, "holed": self.swallowing}

    def black_hole_all(self) -> None:
        self.swallowing = True

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if not self.swallowing:
            await super()._connected(reader, writer)
            return
        self.swallowed += 1
        self._writers.add(writer)
        try:
            while await reader.read(1 << 16):  # held open, read, never answered
                pass
        except OSError:
            pass
        finally:
            writer.close()

    def _forward(self, data: bytes, direction: str, connection: dict) -> tuple[bytes, bool]:
        if direction == "to worker":
            connection["to worker"] += len(data)
        if self.first_only:
            if (
                connection["number"] == 1
                and not connection["holed"]
                and connection["to worker"] > BLACK_HOLE_AFTER_BYTES
            ):
                connection["holed"] = True
                self.holed += 1
        elif self.swallowing and not connection["holed"]:
            connection["holed"] = True
            self.holed += 1
        if connection["holed"] and self.where in ("both", direction):
            return b"", False
        return data, False


async def test_a_black_holed_answer_direction_is_cut_and_the_job_ends_with_the_clean_values():
    """Default timeouts: the worker hears nothing on one stream for AKV_STREAM_SILENT_S
    (20 s), cuts it, opens another and resends; before streams had liveness this job
    waited out the 300 s request deadline."""
    with proxies(2) as clean, AdvertisedCluster(2, clean, AKV_BIGARRAY_BOUND="1024") as cluster:
        stores = await cluster.workers()
        try:
            expected = await asyncio.wait_for(asyncio.gather(*(train(kv) for kv in stores)), 60)
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    kinds = iter([BlackHoleProxy, Proxy])  # server 0's proxy holes one connection
    with (
        proxies(2, lambda thread: next(kinds)(thread)) as behind,
        AdvertisedCluster(2, behind, AKV_BIGARRAY_BOUND="1024", **DEFAULT_TIMEOUTS) as cluster,
    ):
        stores = await cluster.workers()
        started = time.monotonic()
        try:
            # Within a minute: the silence is found after 20 s, not at a 300 s deadline.
            got = await asyncio.wait_for(asyncio.gather(*(train(kv) for kv in stores)), 60)
            took = time.monotonic() - started
            reconnects = sum(link.reconnects for kv in stores for link in kv._backend.links)
        finally:
            await asyncio.wait_for(asyncio.gather(*(kv.close() for kv in stores)), 30)
        assert [server.state.failure for server in cluster.servers] == [None, None]
    assert behind[0].holed == 1
    assert reconnects >= 1
    assert took >= STREAM_SILENT_S - 5  # it did wait for the silence (the test is not void)
    for values, clean_values in zip(got, expected, strict=True):
        for key in clean_values:
            np.testing.assert_array_equal(np.array(values[key]), np.array(clean_values[key]))


async def test_a_server_that_cannot_be_reached_at_all_is_the_one_named():
    """Every connection to server 1 black-holed, and new ones held open unanswered: the
    workers cut their streams as silent, cannot open new ones, and the job fails naming
    server 1, not a worker that its streams went silent from."""
    # Short settings, so that the workers give up on server 1 after about 18 s (a 3 s
    # silence, a 10 s window to reconnect, a last attempt of 5 s at most), well before
    # the pulls' own deadline (the round timeout) would end the job without a verdict.
    fast = {
        "AKV_STREAM_KEEPALIVE_S": "0.5",
        "AKV_STREAM_SILENT_S": "3",
        "AKV_CONNECT_TIMEOUT_S": "5",
        "AKV_REQUEST_TIMEOUT_S": "10",
        "AKV_ROUND_TIMEOUT_S": "60",
        "AKV_BIGARRAY_BOUND": "1024",
    }

    def make(thread: LoopThread) -> Proxy:
        return BlackHoleProxy(thread, where="both", first_only=False)

    with proxies(2, make) as behind, AdvertisedCluster(2, behind, **fast) as cluster:
        stores = await cluster.workers()

        async def job(kv: akv.AsyncKVStore) -> None:
            await kv.init("w", np.zeros(4096, np.float32))  # split over both servers
            for step in range(1000):
                if step == 5 and kv.rank == 0:
                    behind[1].thread.loop.call_soon_threadsafe(behind[1].black_hole_all)
                await kv.push("w", np.ones(4096, np.float32))
                await kv.pull("w")

        started = time.monotonic()
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(job(kv) for kv in stores), return_exceptions=True), 90
            )
            took = time.monotonic() - started
        finally:
            await asyncio.wait_for(
                asyncio.gather(*(kv.close() for kv in stores), return_exceptions=True), 30
            )
        failure = cluster.scheduler.roster.failure
    assert behind[1].holed >= 2 and behind[1].swallowed >= 1
    for outcome in outcomes:
        assert isinstance(outcome, AKVError), (outcomes, failure, took)
        assert "server 1" in str(outcome), outcome
    assert failure is not None and failure.startswith("server 1"), failure
    assert "vanished" not in failure and not failure.startswith("worker"), failure
    assert took < 60, took
