"""Streams cut at random points: the workers reconnect and resend, the servers apply each
push exactly once, and the job ends with exactly the values of a clean run.

Each server binds a free port and advertises a proxy's (``AKV_ADVERTISE``), so every byte
between the workers and the servers passes through the proxies of
:mod:`tests.akv.cluster.test_advertise`; a :class:`CuttingProxy` drops connections after a
random number of bytes (seeded), a bounded number of times. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

import akv
from akv_engine import LoopThread
from tests.akv.cluster.test_advertise import AdvertisedCluster, Proxy, proxies

pytestmark = pytest.mark.timeout(120)

ROUNDS = 40
SPLIT_ELEMENTS = 4096  # with AKV_BIGARRAY_BOUND=1024: split over both servers


class CuttingProxy(Proxy):
    """A :class:`Proxy` that aborts a connection (both sockets, as a reset) once it has
    forwarded a random number of bytes (either way), until it has cut ``cuts`` of them."""

    def __init__(
        self, thread: LoopThread, rng: random.Random, cuts: int, max_bytes: int, where: str
    ):
        super().__init__(thread)
        self.where = where
        self.rng = rng
        self.cuts_left = cuts
        self.cut = 0
        self.max_bytes = max_bytes

    read_bytes = 1 << 14

    def _new_connection(self) -> list[int]:
        return [self.rng.randrange(200, self.max_bytes)]  # what it forwards before a cut

    def _forward(self, data: bytes, direction: str, budget: list[int]) -> tuple[bytes, bool]:
        if self.where in ("both", direction):
            # Requests are cut after so many bytes; replies after so many reads, so that a
            # small reply (a push's) is as likely to be lost as a large one.
            budget[0] -= len(data) if direction == "to server" else 1000
        if budget[0] > 0 or self.cuts_left <= 0:
            return data, False
        self.cuts_left -= 1
        self.cut += 1
        # Forward part of a request, then cut; drop a whole reply (the server handled its
        # request: the resent one must not be applied again).
        keep = len(data) + budget[0] if direction == "to server" else 0
        return data[: max(keep, 0)], True


def cutting_proxies(count: int, seed: int, cuts: int, max_bytes: int, where: str):
    """``count`` proxies that cut connections (``cuts`` each) after a random number of
    bytes ``where`` (``"to server"``, ``"to worker"`` or ``"both"``); closed at the end."""
    rng = random.Random(seed)
    return proxies(count, lambda thread: CuttingProxy(thread, rng, cuts, max_bytes, where))


async def train(kv: akv.AsyncKVStore) -> dict[str, list[float]]:
    """A small dist_sync training run with momentum (so that a push applied twice, or a
    lost one, changes every later value): per round, each worker pushes gradients that
    depend on its rank and the round, then pulls the weights."""
    await kv.init("w", np.zeros(64, np.float32))
    await kv.init("split", np.zeros(SPLIT_ELEMENTS, np.float32))
    await kv.init("bias", np.zeros(3, np.float64))
    await kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.05, momentum=0.9))
    rank = kv.rank
    for step in range(ROUNDS):
        scale = np.float32((rank + 1) * (step % 7 + 1))
        await kv.push("w", np.linspace(-1, 1, 64, dtype=np.float32) * scale)
        await kv.push("split", np.arange(SPLIT_ELEMENTS, dtype=np.float32) * scale / 1000)
        await kv.push("bias", np.array([rank, step, 1.0]))
        await kv.pull("w")
        await kv.pull("split")
        await kv.pull("bias")  # in dist_sync a worker pulls a key before pushing it again
    values = {key: (await kv.pull(key)).tolist() for key in ("w", "split", "bias")}
    return values


async def run_job(behind: list[Proxy]) -> list[dict[str, list[float]]]:
    with AdvertisedCluster(2, behind, AKV_BIGARRAY_BOUND="1024") as cluster:
        stores = await cluster.workers()
        try:
            results = await asyncio.wait_for(asyncio.gather(*(train(kv) for kv in stores)), 90)
            reconnects = [sum(link.reconnects for link in kv._backend.links) for kv in stores]
            cut = sum(getattr(proxy, "cut", 0) for proxy in behind)  # cuts while training
        finally:
            await asyncio.wait_for(asyncio.gather(*(kv.close() for kv in stores)), 30)
        for server in cluster.servers:
            assert server.state.failure is None, server.state.failure
        duplicates = sum(server.state.duplicates for server in cluster.servers)
        return [*results, {"reconnects": reconnects, "duplicates": duplicates, "cut": cut}]


@pytest.mark.parametrize(
    ("seed", "where"), [(1, "both"), (2, "to worker"), (3, "to server"), (4, "to worker")]
)
async def test_cut_streams_reconnect_and_the_job_ends_with_the_values_of_a_clean_run(seed, where):
    """Cut "to worker", the replies of requests the server handled are lost: the resent
    pushes must be answered without being applied again."""
    with proxies(2) as clean:
        *expected, clean_stats = await run_job(clean)
    assert clean_stats["reconnects"] == [0, 0] and clean_stats["duplicates"] == 0
    with cutting_proxies(2, seed, cuts=6, max_bytes=60_000, where=where) as cutting:
        *got, stats = await run_job(cutting)
    # Streams were cut while the workers trained, and came back. (Not one reconnect per
    # cut: a stream cut after its last answer needed comes back only if it is used again.)
    assert stats["cut"] > 0 and sum(stats["reconnects"]) > 0
    if where == "to worker":  # replies were lost: resent pushes were answered, not applied
        assert stats["duplicates"] > 0
    for values, clean_values in zip(got, expected, strict=True):
        for key in clean_values:
            np.testing.assert_array_equal(np.array(values[key]), np.array(clean_values[key]))
    assert got[0] == got[1]  # both workers pulled the same weights
