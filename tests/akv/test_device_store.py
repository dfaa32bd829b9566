"""The ``device`` store: merge placement, host values everywhere, GPU values where there is one.

The tests marked ``gpu`` need CuPy and a CUDA GPU and are skipped, with the reason, elsewhere
(``tests/gpu_check.sh`` runs them on a GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest

import akv
from akv.device import DeviceBackend, MergePlacement
from akv_engine import gpu_available

DEVICE_TYPES = ["device", "local_allreduce_device", "nccl"]

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")


# ---------------------------------------------------------------------------- placement


def test_keys_go_largest_first_to_the_least_loaded_gpu():
    placement = MergePlacement()
    sizes = [("small", 10), ("big", 1000), ("mid", 500), ("mid2", 400)]
    placed = placement.assign(sizes, [0, 1])
    # big -> 0 (both empty, lowest number); mid -> 1; mid2 -> 1 (500 < 1000); small -> 1.
    assert placed == {"big": 0, "mid": 1, "mid2": 1, "small": 1}
    assert placement.assigned == {0: 1000, 1: 910}


def test_placement_remembers_the_load_across_calls():
    placement = MergePlacement()
    placement.assign([("a", 100)], [0, 1, 2])
    placement.assign([("b", 50)], [0, 1, 2])
    assert placement.assign([("c", 10), ("d", 20)], [0, 1, 2]) == {"d": 2, "c": 2}
    assert placement.assign([("e", 1)], [2, 0, 1]) == {"e": 2}  # 100, 50, 30 assigned
    assert placement.assign([("f", 1)], [0, 1]) == {"f": 1}  # only the candidates count


def test_equal_sizes_keep_the_order_given():
    placement = MergePlacement()
    assert placement.assign([(3, 8), (1, 8), (2, 8)], [5, 7]) == {3: 5, 1: 7, 2: 5}


def test_placement_needs_a_gpu():
    with pytest.raises(akv.InvalidArgumentError, match="at least one GPU"):
        MergePlacement().assign([(0, 4)], [])


# ---------------------------------------------------------------------------- host values


@pytest.mark.parametrize("name", DEVICE_TYPES)
def test_device_stores_keep_mxnet_meaning_with_host_values(name):
    with akv.create(name) as kv:
        assert isinstance(kv._inner._backend, DeviceBackend)
        assert kv.type == name
        kv.init([0, 1], [np.zeros(3, np.float32), np.ones(2)])
        kv.push(0, [np.ones(3, np.float32)] * 4)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5))
        kv.push(1, np.ones(2))
        np.testing.assert_array_equal(kv.pull(0), np.full(3, 4.0, np.float32))
        np.testing.assert_array_equal(kv.pull(1), np.full(2, 0.5))


async def test_the_async_device_store_with_host_values():
    async with await akv.create_async("device") as kv:
        kv.init("w", np.arange(4.0))
        kv.push("w", [np.ones(4), np.ones(4)])
        np.testing.assert_array_equal(await kv.pull("w"), np.full(4, 2.0))


def test_devices_is_checked_and_only_for_local_device_stores():
    with pytest.raises(akv.InvalidArgumentError, match="non-empty list of GPU numbers"):
        akv.create("device", devices=[0, -1])
    with pytest.raises(akv.InvalidArgumentError, match="non-empty list"):
        akv.create("device", devices=[])
    with pytest.raises(akv.InvalidArgumentError, match="not of 'local'"):
        akv.create("local", devices=[0])
    with akv.create("device", devices=[0]) as kv:
        kv.init(0, np.ones(1))
        assert kv.pull(0)[0] == 1.0


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_gpu
def test_gpu_values_are_reduced_and_kept_on_the_gpu(cupy):
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros((256, 256), cupy.float32))
        entry = kv._inner._keys.get(0, "test")
        assert entry.device == 0
        kv.push(0, [cupy.full((256, 256), i, cupy.float32) for i in range(4)])
        assert isinstance(entry.value, cupy.ndarray)
        pulled = kv.pull(0)
        assert isinstance(pulled, cupy.ndarray)
        assert float(pulled[0, 0]) == 6.0
        out = cupy.empty((256, 256), cupy.float32)
        assert kv.pull(0, out=out) is out
        assert bool((out == 6.0).all())
        host = np.empty((256, 256), np.float32)
        kv.pull(0, out=host)
        assert (host == 6.0).all()


@pytest.mark.gpu
@needs_gpu
def test_the_async_face_reads_gpu_values_at_the_call(cupy):
    import asyncio

    async def main():
        async with await akv.create_async("device") as kv:
            value = cupy.ones(1 << 20, cupy.float32)
            kv.init(0, value)
            value.fill(5.0)  # after the call: the store holds the old values
            grad = cupy.full(1 << 20, 2.0, cupy.float32)
            pushed = kv.push(0, grad)
            grad.fill(7.0)
            await pushed
            assert float((await kv.pull(0))[123]) == 2.0

    asyncio.run(main())


@pytest.mark.gpu
@needs_gpu
def test_optimizers_on_the_gpu_match_numpy(cupy):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 64)).astype(np.float32)  # 2-D for GroupAdaGrad
    grads = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(5)]
    for make in (
        lambda: akv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4),
        lambda: akv.optimizer.Adam(learning_rate=0.01),
        lambda: akv.optimizer.LAMB(learning_rate=0.01),
        lambda: akv.optimizer.FTRL(learning_rate=0.1),
        lambda: akv.optimizer.FTML(wd=1e-4),
        lambda: akv.optimizer.Adamax(),
        lambda: akv.optimizer.Nadam(),
        lambda: akv.optimizer.AdamW(wd=1e-2),
        lambda: akv.optimizer.DCASGD(learning_rate=0.1, momentum=0.9),
        lambda: akv.optimizer.LARS(learning_rate=0.1, momentum=0.9, eta=0.1),
        lambda: akv.optimizer.GroupAdaGrad(learning_rate=0.1),
    ):
        with akv.create("device") as gpu_kv, akv.create("local") as cpu_kv:
            gpu_kv.set_optimizer(make())
            cpu_kv.set_optimizer(make())
            gpu_kv.init(0, cupy.asarray(weight))
            cpu_kv.init(0, weight)
            for grad in grads:
                gpu_kv.push(0, cupy.asarray(grad))
                cpu_kv.push(0, grad)
            np.testing.assert_allclose(
                cupy.asnumpy(gpu_kv.pull(0)), cpu_kv.pull(0), rtol=2e-5, atol=2e-6
            )


@pytest.mark.gpu
@needs_gpu
def test_keys_spread_over_gpus_and_pushes_from_each_are_summed(cupy):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with akv.create("device", devices=[0, 1]) as kv:
        kv.init([0, 1], [cupy.zeros(1 << 20, cupy.float32), cupy.zeros(1 << 19, cupy.float32)])
        devices = {key: kv._inner._keys.get(key, "test").device for key in (0, 1)}
        assert devices == {0: 0, 1: 1}
        values = []
        for device in (0, 1):
            with cupy.cuda.Device(device):
                values.append(cupy.ones(1 << 19, cupy.float32))
        kv.push(1, values)
        with cupy.cuda.Device(0):
            out = cupy.empty(1 << 19, cupy.float32)
        kv.pull(1, out=out)
        assert float(out[-1]) == 2.0


@pytest.mark.gpu
@needs_gpu
def test_cuda_tensors_in_place(cupy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    for name in ("device", "local"):
        with akv.create(name) as kv:
            kv.init(0, torch.nn.Parameter(torch.ones(64, device="cuda")))
            kv.push(0, [torch.ones(64, device="cuda")] * 3)
            param = torch.nn.Parameter(torch.zeros(64, device="cuda"))
            before = param.data_ptr()
            kv.pull(0, out=param)
            assert param.data_ptr() == before
            assert torch.equal(param.detach(), torch.full((64,), 3.0, device="cuda"))
            pulled = kv.pull(0)
            assert isinstance(pulled, torch.Tensor) and pulled.device.type == "cuda"


@pytest.mark.gpu
@needs_gpu
def test_the_local_store_copies_gpu_values_to_the_host(cupy):
    with akv.create("local") as kv:
        kv.init(0, cupy.arange(4, dtype=cupy.float32))
        assert type(kv._inner._keys.get(0, "test").value) is np.ndarray
        pulled = kv.pull(0)
        assert isinstance(pulled, cupy.ndarray)
        assert cupy.asnumpy(pulled).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.gpu
@needs_gpu
def test_calls_from_two_streams_are_ordered_on_the_gpu(cupy):
    """A push on one stream, a pull on another, a push on a third (each on the caller's
    stream, no task): each waits on the GPU for what it must."""
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros(1 << 20, cupy.float32))
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        with streams[0]:
            kv.push(0, [cupy.full(1 << 20, 1.0, cupy.float32) for _ in range(3)])
        out = cupy.empty(1 << 20, cupy.float32)
        with streams[1]:
            kv.pull(0, out=out)
            assert float(out[-1]) == 3.0
        with streams[2]:
            kv.push(0, cupy.full(1 << 20, 5.0, cupy.float32))
        assert float(kv.pull(0)[-1]) == 5.0


@pytest.mark.gpu
@needs_gpu
def test_host_stores_stage_cupy_values_through_pinned_buffers(cupy):
    from akv.arrays import is_pinned

    with akv.create("local") as kv:
        kv.init(0, np.zeros(1 << 20, np.float32))
        for value in (1.0, 2.0):
            kv.push(0, [cupy.full(1 << 20, value, cupy.float32)] * 2)
        assert is_pinned(kv._inner._keys.get(0, "test").value)
        out = cupy.empty(1 << 20, cupy.float32)
        kv.pull(0, out=out)
        assert float(out[0]) == 4.0 and float(out[-1]) == 4.0
