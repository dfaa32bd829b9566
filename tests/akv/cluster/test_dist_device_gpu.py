"""The dist ``*_device`` stores, and framework tensors on a GPU, on a real GPU.

Marked ``gpu``: ``tests/gpu_check.sh`` runs them on a GPU machine; elsewhere they are skipped
with the reason. The CuPy tests take the ``cupy`` module as their argument, so that
``tests/akv/test_gpu_paths.py`` also runs them on the fake CuPy (lazy streams: an ordering
bug shows there on every run). On a real GPU each producer's kernels are queued behind a
long spin on the caller's stream, so that a copy not ordered after them would read the
values before they are written (the GPU is slow on purpose, as the fake's lazy streams).

Each test is a plain function running its coroutine with ``asyncio.run``: the GPU machine's
image has no pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np
import pytest

import akv
from tests.akv.cluster.cluster import Cluster, on_every_worker

pytestmark = pytest.mark.timeout(120)

F32 = np.float32
N = 1 << 20  # 4 MiB of float32: split over both servers with AKV_BIGARRAY_BOUND below
SPIN_CYCLES = 20_000_000  # about 10 ms at the H200's 1.98 GHz


_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


@functools.cache
def _spin_kernel(cupy: Any) -> Any:
    return cupy.RawKernel(_SPIN_SOURCE, "spin")


def spin(cupy: Any, cycles: int = SPIN_CYCLES) -> None:
    """Keep the GPU busy on the current stream for ``cycles`` clock cycles (a no-op on the
    fake, whose streams run lazily anyway)."""
    if hasattr(cupy, "RawKernel"):
        _spin_kernel(cupy)((1,), (1,), (np.int64(cycles),))


def host(cupy: Any, array: Any) -> np.ndarray:
    """The array's values, read after the device finished everything queued."""
    cupy.cuda.Device(array.device.id).synchronize()
    return cupy.asnumpy(array)


async def _sync_round(cupy: Any, kv: Any) -> dict[str, Any]:
    rank_value = kv.rank + 1.0
    stream = cupy.cuda.Stream(non_blocking=True)
    await kv.init(["w", "b"], [cupy.zeros(N, F32), cupy.zeros(7, F32)])
    with stream:
        spin(cupy)
        grad = cupy.full(N, rank_value, F32)  # queued behind the spin
        pushed = kv.push(["w", "b"], [grad, cupy.full(7, rank_value, F32)])
        grad.fill(-100.0)  # after the call: the push has taken the value
        out = cupy.empty(N, F32)
        spin(cupy)
        out.fill(-5.0)  # queued before the pull: the pulled value comes after it
        pulled = kv.pull("w", out=out)
    await pushed
    assert await pulled is out
    seen: dict[str, Any] = {"w": np.unique(host(cupy, out)).tolist()}
    new = await kv.pull("b")
    assert isinstance(new, cupy.ndarray)
    seen["b"] = host(cupy, new).tolist()
    value = cupy.full(7, 10.0 * rank_value, F32)
    assert await kv.pushpull("b", value) is value
    seen["pushpull"] = host(cupy, value).tolist()
    host_out = np.empty(N, F32)
    await kv.pull("w", out=host_out)
    seen["host"] = np.unique(host_out).tolist()
    return seen


@pytest.mark.gpu
def test_dist_sync_device_rounds_of_two_workers_on_the_gpu(cupy):
    """Two workers, two servers, shared memory on and off: pushes read the values after the
    caller's queued kernels and are taken at the call; pulls land after the caller's queued
    work on the output; GPU and host outputs get the sum."""

    async def main(shm: str) -> None:
        with Cluster(2, 2, AKV_BIGARRAY_BOUND="4096", AKV_SHM=shm) as cluster:
            seen = await on_every_worker(
                cluster, "dist_sync_device", functools.partial(_sync_round, cupy)
            )
        for one in seen:
            assert one == {
                "w": [3.0],
                "b": [3.0] * 7,
                "pushpull": [30.0] * 7,
                "host": [3.0],
            }, f"AKV_SHM={shm}"

    for shm in ("1", "0"):
        asyncio.run(main(shm))


@pytest.mark.gpu
def test_dist_sync_device_server_optimizer_matches_the_local_store(cupy):
    """GPU keys with an optimizer on the servers: the weights come back as the local store
    computes them from the summed gradients."""
    rng = np.random.default_rng(1)
    weight = rng.standard_normal(N).astype(F32)
    grads = [[rng.standard_normal(N).astype(F32) for _ in range(2)] for _ in range(3)]

    async def main() -> list[np.ndarray]:
        async def body(kv: Any) -> np.ndarray:
            await kv.init("w", cupy.asarray(weight))
            await kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.01))
            out = cupy.empty(N, F32)
            for step in grads:  # in dist_sync a worker pulls before it pushes again
                await kv.push("w", cupy.asarray(step[kv.rank]))
                await kv.pull("w", out=out)
            return host(cupy, out)

        with Cluster(2, 2, AKV_BIGARRAY_BOUND="4096") as cluster:
            return await on_every_worker(cluster, "dist_sync_device", body)

    results = asyncio.run(main())
    with akv.create("local") as local:
        local.set_optimizer(akv.optimizer.Adam(learning_rate=0.01))
        local.init("w", weight)
        for step in grads:
            local.push("w", step[0] + step[1])
        want = local.pull("w")
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_dist_async_device_applies_each_push_on_the_gpu(cupy):
    """dist_async_device without an optimizer: each push replaces the value when it arrives,
    and a pull sees the worker's own earlier pushes, each read after the caller's queued
    kernels."""

    async def main() -> list[float]:
        with Cluster(1, 1) as cluster:
            (kv,) = await cluster.workers("dist_async_device")
            try:
                await kv.init("w", cupy.zeros(N, F32))
                stream = cupy.cuda.Stream(non_blocking=True)
                with stream:
                    for value in (1.0, 2.0, 3.0):
                        spin(cupy, SPIN_CYCLES // 4)
                        kv.push("w", cupy.full(N, value, F32))
                    out = cupy.empty(N, F32)
                    pulled = kv.pull("w", out=out)
                await pulled
                return np.unique(host(cupy, out)).tolist()
            finally:
                await kv.close()

    assert asyncio.run(main()) == [3.0]


# ---------------------------------------------------------------------------- framework tensors


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["dist_sync_device", "dist_sync"])
def test_cuda_tensors_through_a_dist_store(cupy, store):
    """torch CUDA tensors made on a torch side stream: a push reads them after torch's
    queued work (DLPack orders the producer's stream first), a pull writes the Parameter in
    place after torch's queued work on it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")

    async def body(kv: Any) -> list[float]:
        side = torch.cuda.Stream()
        await kv.init("w", torch.zeros(N, device="cuda"))
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
            grad = torch.full((N,), kv.rank + 1.0, device="cuda")
            await kv.push("w", grad)
            param = torch.nn.Parameter(torch.empty(N, device="cuda"))
            before = param.data_ptr()
            torch.cuda._sleep(SPIN_CYCLES)
            param.data.fill_(-5.0)
            await kv.pull("w", out=param)
        assert param.data_ptr() == before
        torch.cuda.synchronize()
        return torch.unique(param.detach()).tolist()

    async def main() -> list[list[float]]:
        with Cluster(2, 1) as cluster:
            return await on_every_worker(cluster, store, body)

    assert asyncio.run(main()) == [[3.0], [3.0]]


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["device", "local"])
def test_jax_gpu_arrays_in_a_store(cupy, store):
    """JAX arrays on a GPU go in through DLPack and a pull without ``out`` gives a JAX array
    on the GPU with the sum."""
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU here")
    with akv.create(store) as kv:
        kv.init(0, jax.device_put(np.zeros(4096, F32), gpu))
        kv.push(0, [jax.device_put(np.full(4096, i, F32), gpu) for i in range(1, 4)])
        pulled = kv.pull(0)
        assert isinstance(pulled, jax.Array)
        assert {device.platform for device in pulled.devices()} == {"gpu"}
        assert np.unique(np.asarray(pulled)).tolist() == [6.0]
