"""GPU values in the stores that keep values in host memory (``local``, ``dist_sync``,
``dist_async``): staged through pinned buffers of their key, reused across calls, copied on
a copy stream; on the fake CuPy (``tests/fakecupy.py``, which counts ``empty_pinned`` calls).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import akv
from akv.arrays import is_pinned
from tests import fakecupy
from tests.akv.cluster.cluster import Cluster

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def cupy(fake_cupy: Any) -> Any:
    """The fake CuPy (``fake_cupy`` of ``tests/akv/conftest.py``)."""
    return fake_cupy


def entry_of(kv: Any, key: Any) -> Any:
    return getattr(kv, "_inner", kv)._keys.get(key, "test")


def test_local_pushes_of_cupy_values_reuse_two_pinned_buffers(cupy):
    with akv.create("local") as kv:
        kv.init("w", np.zeros(64, F32))  # a host key, pushed GPU values later
        entry = entry_of(kv, "w")
        made = fakecupy.counts["pinned"]
        caller = cupy.cuda.get_current_stream()
        with fakecupy.logging_ops() as log:
            for i in range(6):
                kv.push("w", cupy.full(64, float(i), F32))
        # The staged buffer becomes the stored value, the old one the next staging buffer.
        assert fakecupy.counts["pinned"] - made == 2
        assert is_pinned(entry.value)
        copies = {stream for stream, _, label in log if label == "memcpy"}
        assert copies and caller not in copies  # device to host on a copy stream
        assert kv.pull("w").tolist() == [5.0] * 64
        out = cupy.empty(64, F32)
        kv.pull("w", out=out)
        assert fakecupy.peek(out).tolist() == [5.0] * 64


def test_a_local_key_initialized_from_cupy_is_stored_pinned(cupy):
    with akv.create("local") as kv:
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5))
        made = fakecupy.counts["pinned"]
        kv.init("w", cupy.ones(32, F32))
        entry = entry_of(kv, "w")
        assert is_pinned(entry.value) and fakecupy.counts["pinned"] - made == 1
        for _ in range(4):
            kv.push("w", [cupy.ones(32, F32), cupy.ones(32, F32)])  # summed on the GPU
        # With an optimizer the stored value stays; one staging buffer comes and goes.
        assert fakecupy.counts["pinned"] - made == 2
        pulled = kv.pull("w")
        assert isinstance(pulled, cupy.ndarray)
        assert pulled.get().tolist() == [-3.0] * 32


def test_mixed_host_and_gpu_values_of_a_key_are_summed(cupy):
    with akv.create("local") as kv:
        kv.init(0, np.zeros(8, F32))
        with cupy.cuda.Device(1):
            peer = cupy.full(8, 2.0, F32)
        kv.push(0, [cupy.ones(8, F32), np.full(8, 4.0, F32), peer])
        assert kv.pull(0).tolist() == [7.0] * 8
        kv.push(0, [cupy.ones(8, F32), peer])  # two GPUs: summed on the first's
        assert kv.pull(0).tolist() == [3.0] * 8


async def test_a_local_push_reads_gpu_values_at_the_call(cupy):
    async with await akv.create_async("local") as kv:
        await kv.init("w", cupy.zeros(16, F32))
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            grad = cupy.arange(16, dtype=F32)  # still queued on `stream`
            pushed = kv.push("w", grad)
            grad.fill(-1.0)  # after the push, on the same stream
        await pushed
        assert (await kv.pull("w")).get().tolist() == list(range(16))


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
async def test_distributed_host_stores_stage_gpu_values_through_reused_pinned_buffers(
    cupy, store_type
):
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers(store_type)
        made: list[int] = []

        async def body(kv: Any) -> list[float]:
            await kv.init("w", cupy.zeros(64, F32))
            assert entry_of(kv, "w").pinned
            out = cupy.empty(64, F32)
            for _ in range(4):
                await kv.push("w", cupy.full(64, kv.rank + 1.0, F32))
                await kv.barrier()
                await kv.pull("w", out=out)
                await kv.barrier()
                made.append(fakecupy.counts["pinned"])
            return fakecupy.peek(out).tolist()

        results = await asyncio.gather(*(body(kv) for kv in stores))
        if store_type == "dist_sync":
            assert results == [[3.0] * 64] * 2
        else:  # each push replaces the value as it comes: one worker's is last
            assert all(len(set(r)) == 1 and r[0] in (1.0, 2.0) for r in results)
        # The buffers are the keys' own: the last rounds allocate no pinned memory.
        assert made[-1] == made[len(made) // 2]
        await asyncio.gather(*(kv.close() for kv in stores))
