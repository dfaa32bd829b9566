"""The GPU code paths of the stores, run end to end on a fake GPU (``tests/fakecupy.py``).

The fake CuPy is installed as ``cupy`` and ``cupyx`` for each test; the engine's GPU executor
runs on it through the production :class:`akv_engine.CupyDriver`. Its streams run lazily (only
when an event wait, a host function or a host synchronization needs their work), so work
that the code does not order is visibly not done: :func:`fakecupy.peek` shows an array's
memory as it is, and reading memory nobody wrote shows NaN. Each test ends with no
violation of CUDA's rules recorded by the fake.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import akv
from akv.cluster.worker.backend import DistBackend
from akv.device import DeviceBackend
from tests import fakecupy, profiling
from tests.akv import test_device_store
from tests.akv.cluster import test_dist_device_gpu
from tests.akv.cluster.cluster import Cluster

pytestmark = pytest.mark.timeout(60)

gpu_completion = profiling.load("gpu_completion")

F32 = np.float32


@pytest.fixture(params=["host_func", "waiter"])
def completion(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both completion strategies of the GPU executor (stores make theirs with defaults)."""
    monkeypatch.setenv("ENGINE_GPU_COMPLETION", request.param)
    return str(request.param)


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The fake CuPy, two fake GPUs, lazy streams; no violation by the end of the test."""
    fakecupy.reset(devices=2, schedule="lazy")
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    monkeypatch.setitem(sys.modules, "cupyx", fakecupy.cupyx)
    yield fakecupy
    assert fakecupy.violations == []


def entry_of(kv, key):
    inner = getattr(kv, "_inner", kv)
    return inner._keys.get(key, "test")


def on(device, make):
    """``make()`` with ``device`` current (the fake allocates on the current device)."""
    with fakecupy.cuda.Device(device):
        return make()


def peek(array) -> np.ndarray:
    assert isinstance(array, fakecupy.ndarray)
    return fakecupy.peek(array)


# ---------------------------------------------------------------------------- the fake itself


def test_the_fake_refuses_what_cupy_refuses(cupy):
    a = cupy.ones((2, 3), F32)
    assert a.device.id == 0 and isinstance(a.data.ptr, int)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type"):
        np.add(a, np.ones((2, 3), F32))
    with pytest.raises(ValueError, match=r"non-scalar numpy\.ndarray"):
        np.copyto(a, np.ones((2, 3), F32))
    b = on(1, lambda: cupy.ones((2, 3), F32))
    assert b.device.id == 1
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        np.add(a, b)
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        b.fill(2.0)  # a kernel on device 0 (current) cannot write device 1's memory
    host = np.empty((2, 3), F32)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="InvalidValue"):
        cupy.cuda.runtime.memcpyAsync(
            a.data.ptr, host.ctypes.data, a.nbytes, cupy.cuda.runtime.memcpyDeviceToHost, 0
        )
    with pytest.raises(AttributeError):
        a.flags.writeable  # noqa: B018 - CuPy's flags have no writeable


def test_the_fake_runs_streams_only_when_their_work_is_needed(cupy):
    a = cupy.full(4, 3.0, F32)
    assert np.isnan(peek(a)).all()  # queued, not run: nothing has needed it
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        b = a * 2  # on another stream, unordered with the fill
    ready = cupy.cuda.Event()
    ready.record(stream)
    other = cupy.cuda.Stream(non_blocking=True)
    other.wait_event(ready)
    c = cupy.empty(4, F32)
    with other:
        cupy.copyto(c, b)
    other.synchronize()  # runs `stream` up to the event: b read a before the fill ran
    assert np.isnan(peek(c)).all()
    assert a.get().tolist() == [3.0] * 4  # a host read runs the null stream


def test_the_fake_sees_memory_freed_under_queued_work(cupy):
    stream = cupy.cuda.Stream(non_blocking=True)
    a = cupy.ones(4, F32)  # from the null stream's pool
    stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:
        b = a + 1  # queued on another stream, reading a
    del a  # back to the null stream's pool while `stream` still reads it
    assert "freed while" in cupy.violations.pop()
    stream.synchronize()
    assert b.get().tolist() == [2.0] * 4


def test_pinned_copies_are_queued_and_pageable_ones_are_not(cupy):
    a = cupy.arange(6, dtype=F32)
    stream = cupy.cuda.Stream(non_blocking=True)
    ready = cupy.cuda.Event()
    ready.record()
    stream.wait_event(ready)
    pinned = cupy.cupyx.empty_pinned((6,), F32)
    runtime = cupy.cuda.runtime
    runtime.memcpyAsync(pinned.ctypes.data, a.data.ptr, 24, runtime.memcpyDeviceToHost, stream.ptr)
    assert cupy.pending() > 0 and not (pinned == np.arange(6)).all()
    stream.synchronize()
    assert pinned.tolist() == list(range(6))
    pageable = np.empty(6, F32)
    runtime.memcpyAsync(
        pageable.ctypes.data, a.data.ptr, 24, runtime.memcpyDeviceToHost, stream.ptr
    )
    assert pageable.tolist() == list(range(6))  # returned once copied


# ---------------------------------------------------------------------------- the device store


@pytest.mark.parametrize("schedule", ["lazy", "eager"])
def test_device_store_init_push_pull(cupy, completion, schedule):
    cupy.reset(devices=2, schedule=schedule)
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros((8, 4), F32))
        entry = entry_of(kv, 0)
        assert entry.device == 0 and isinstance(entry.value, cupy.ndarray)
        kv.push(0, [cupy.full((8, 4), i, F32) for i in range(4)])
        pulled = kv.pull(0)
        assert isinstance(pulled, cupy.ndarray) and pulled.device.id == 0
        assert (peek(pulled) == 6.0).all()  # written when the pull completed
        out = cupy.empty((8, 4), F32)
        assert kv.pull(0, out=out) is out
        assert (peek(out) == 6.0).all()
        host = np.empty((8, 4), F32)
        assert kv.pull(0, out=host) is host
        assert (host == 6.0).all()
        strided = cupy.zeros((8, 8), F32)[:, ::2]
        kv.pull(0, out=strided)
        assert (peek(strided) == 6.0).all()
        kv.push(0, cupy.ones((8, 4), F32))
        assert kv.pull(0).get().tolist() == [[1.0] * 4] * 8


def test_pushes_from_two_devices_are_summed_after_their_producers(cupy, completion):
    with akv.create("device") as kv:
        kv.init("w", cupy.zeros(64, F32))
        assert entry_of(kv, "w").device == 0
        # Each value is written by work still queued on its device's stream at the push.
        values = [on(d, lambda d=d: cupy.full(64, 1.0 + d, F32)) for d in (0, 1)]
        strided = on(1, lambda: cupy.full((64, 2), 4.0, F32))[:, 0]
        kv.push("w", [*values, strided, np.full(64, 5.0, F32)])
        assert kv.pull("w").get().tolist() == [12.0] * 64
        kv.push("w", values)
        out1 = on(1, lambda: cupy.empty(64, F32))
        kv.pull("w", out=out1)  # a peer copy to device 1, done when the pull is
        assert (peek(out1) == 3.0).all()
        strided = on(1, lambda: cupy.zeros((64, 2), F32))[:, 1]
        kv.pull("w", out=strided)
        assert (peek(strided) == 3.0).all()
        both = [cupy.empty(64, F32), on(1, lambda: cupy.empty(64, F32)), np.empty(64, F32)]
        kv.pull("w", out=both)
        assert all(
            (peek(o) if isinstance(o, cupy.ndarray) else o).tolist() == [3.0] * 64 for o in both
        )


def test_host_and_gpu_keys_in_one_call_and_pushpull(cupy, completion):
    with akv.create("device") as kv:
        kv.init(
            ["g", "h", "g1"], [cupy.zeros(6, F32), np.zeros(6, F32), on(1, lambda: cupy.ones(3))]
        )
        assert [entry_of(kv, k).device for k in ("g", "h", "g1")] == [0, None, 1]
        kv.push(["g", "h", "g1"], [cupy.full(6, 2.0, F32), cupy.full(6, 3.0, F32), np.ones(3)])
        g, h, g1 = kv.pull(["g", "h", "g1"])
        assert (g.device.id, type(h), g1.device.id) == (0, np.ndarray, 1)
        assert (peek(g).tolist(), h.tolist(), peek(g1).tolist()) == (
            [2.0] * 6,
            [3.0] * 6,
            [1.0] * 3,
        )
        value = cupy.full(6, 5.0, F32)
        assert kv.pushpull("g", value) is value  # pulled into the value pushed
        assert peek(value).tolist() == [5.0] * 6
        out = [cupy.empty(6, F32), np.empty(6, F32)]
        kv.pushpull(["g", "h"], [cupy.full(6, 7.0, F32), cupy.full(6, 8.0, F32)], out=out)
        assert (peek(out[0]).tolist(), out[1].tolist()) == ([7.0] * 6, [8.0] * 6)


def test_a_push_from_the_callers_own_stream_reads_that_streams_work(cupy, completion):
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros(32, F32))
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:  # the caller's stream: the gradient and the push are queued on it
            grad = cupy.arange(32, dtype=F32) * 2
            kv.push(0, grad)
            grad.fill(-1.0)  # after the push, on the same stream
        assert kv.pull(0).get().tolist() == [2.0 * i for i in range(32)]


def test_merge_placement_over_two_devices(cupy, completion):
    with akv.create("device", devices=[0, 1]) as kv:
        kv.init(
            ["big", "mid", "small"],
            [cupy.zeros(4096, F32), cupy.zeros(2048, F32), cupy.zeros(1024, F32)],
        )
        devices = {key: entry_of(kv, key).device for key in ("big", "mid", "small")}
        assert devices == {"big": 0, "mid": 1, "small": 1}  # CommDevice's rule
        assert kv._inner._backend.placement.assigned == {0: 4096 * 4, 1: 3072 * 4}
        values = [cupy.full(2048, 2.0, F32), on(1, lambda: cupy.full(2048, 3.0, F32))]
        kv.push("mid", values)  # merged on device 1
        assert entry_of(kv, "mid").value.device.id == 1
        pulled = kv.pull("mid")  # a new output: where the key's first value came from
        assert isinstance(pulled, cupy.ndarray) and pulled.device.id == 0
        assert (peek(pulled) == 5.0).all()
        out1 = on(1, lambda: cupy.empty(2048, F32))
        kv.pull("mid", out=out1)
        assert (peek(out1) == 5.0).all()
        news = kv.pull(["big", "small"])
        assert [a.device.id for a in news] == [0, 0]
        assert [float(a[0]) for a in news] == [0.0, 0.0]


OPTIMIZERS = {
    "sgd_momentum": lambda: akv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
    "adam": lambda: akv.optimizer.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=1.0),
    "lamb": lambda: akv.optimizer.LAMB(learning_rate=0.01),
    "nag": lambda: akv.optimizer.NAG(learning_rate=0.1, momentum=0.9, rescale_grad=0.5),
    "signum": lambda: akv.optimizer.Signum(learning_rate=0.01, wd_lh=0.01),
    "ftrl": lambda: akv.optimizer.FTRL(learning_rate=0.1),
    "ftml": lambda: akv.optimizer.FTML(wd=1e-3, clip_gradient=1.0),
    "adamax": lambda: akv.optimizer.Adamax(wd=1e-3),
    "nadam": lambda: akv.optimizer.Nadam(rescale_grad=0.5),
    "adamw": lambda: akv.optimizer.AdamW(wd=1e-2),
    "dcasgd": lambda: akv.optimizer.DCASGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
    "lars": lambda: akv.optimizer.LARS(learning_rate=0.1, momentum=0.9, eta=0.1, wd=1e-3),
    "groupadagrad": lambda: akv.optimizer.GroupAdaGrad(learning_rate=0.1, clip_gradient=1.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_on_gpu_keys_match_numpy(cupy, name):
    make = OPTIMIZERS[name]
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 16)).astype(F32)
    grads = [rng.standard_normal((32, 16)).astype(F32) for _ in range(4)]
    with akv.create("device") as gpu_kv, akv.create("local") as cpu_kv:
        gpu_kv.set_optimizer(make())
        cpu_kv.set_optimizer(make())
        gpu_kv.init(3, on(1, lambda: cupy.asarray(weight)))
        cpu_kv.init(3, weight)
        for grad in grads:
            gpu_kv.push(3, on(1, lambda g=grad: cupy.asarray(g)))
            cpu_kv.push(3, grad)
        entry = entry_of(gpu_kv, 3)
        assert entry.device == 1 and entry.value.device.id == 1
        states = gpu_kv._inner._backend._optimizer_updater.states[3]
        arrays = states if isinstance(states, tuple) else (states,)
        assert all(
            isinstance(s, cupy.ndarray) and s.device.id == 1 for s in arrays if s is not None
        )
        np.testing.assert_allclose(gpu_kv.pull(3).get(), cpu_kv.pull(3), rtol=1e-6, atol=1e-7)


def test_an_updater_on_another_gpu_than_the_current_one(cupy):
    """Outside any GPU task (device 0 current), the state and the scratch buffers are made
    on the weight's GPU and the kernels run there."""
    updater = akv.optimizer.get_updater(akv.optimizer.Adam(learning_rate=0.1))
    weight = on(1, lambda: cupy.zeros(16, F32))
    updater(0, on(1, lambda: cupy.ones(16, F32)), weight)
    mean, var = updater.states[0]
    assert (mean.device.id, var.device.id) == (1, 1)
    reference = np.zeros(16, F32)
    akv.optimizer.get_updater(akv.optimizer.Adam(learning_rate=0.1))(0, np.ones(16, F32), reference)
    np.testing.assert_array_equal(weight.get(), reference)
    with pytest.raises(akv.InvalidArgumentError, match=r"cupy\.ndarray there too"):
        updater(0, np.ones(16, F32), weight)
    with pytest.raises(akv.InvalidArgumentError, match=r"cupy\.ndarray there too"):
        updater(0, cupy.ones(16, F32), weight)  # on GPU 0


def test_multi_precision_on_a_gpu_key(cupy):
    weight = np.linspace(-1, 1, 64).astype(np.float16)
    grad = np.linspace(1, 2, 64).astype(np.float16)

    def make():
        return akv.optimizer.SGD(learning_rate=0.1, momentum=0.5, multi_precision=True)

    with akv.create("device") as gpu_kv, akv.create("local") as cpu_kv:
        gpu_kv.set_optimizer(make())
        cpu_kv.set_optimizer(make())
        gpu_kv.init(0, cupy.asarray(weight))
        cpu_kv.init(0, weight)
        for _ in range(3):
            gpu_kv.push(0, cupy.asarray(grad))
            cpu_kv.push(0, grad)
        _, master = gpu_kv._inner._backend._optimizer_updater.states[0]
        assert master.dtype == np.float32 and isinstance(master, cupy.ndarray)
        np.testing.assert_array_equal(gpu_kv.pull(0).get(), cpu_kv.pull(0))


def test_optimizer_states_saved_from_gpu_keys_load_back(cupy, tmp_path):
    path = tmp_path / "states.npz"
    rng = np.random.default_rng(1)
    weight = rng.standard_normal(256).astype(F32)
    grads = [rng.standard_normal(256).astype(F32) for _ in range(4)]

    def run(kv, as_array):
        kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.05))
        kv.init("w", as_array(weight))
        for grad in grads[:2]:
            kv.push("w", as_array(grad))
        kv.save_optimizer_states(path, dump_optimizer=True)
        kv.push("w", as_array(grads[2]))  # undone by the load
        kv.load_optimizer_states(path)
        kv.push("w", as_array(grads[3]))
        return kv.pull("w")

    with akv.create("device") as gpu_kv:
        got = run(gpu_kv, lambda a: on(1, lambda: cupy.asarray(a)))
        mean, _ = gpu_kv._inner._backend._optimizer_updater.states["w"]
        assert isinstance(mean, cupy.ndarray) and mean.device.id == 1  # back on the GPU
    saved = akv.optimizer.decode_states(path.read_bytes())
    assert all(type(s) is np.ndarray for s in saved.states["w"])
    with akv.create("local") as cpu_kv:  # the same steps, loading the file the GPU wrote
        cpu_kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.05))
        cpu_kv.init("w", weight)
        for grad in grads[:3]:
            cpu_kv.push("w", grad)
        cpu_kv.load_optimizer_states(path)
        cpu_kv.push("w", grads[3])
        want = cpu_kv.pull("w")
    assert got.device.id == 1
    np.testing.assert_allclose(got.get(), want, rtol=1e-6)


async def test_the_async_face_reads_values_at_the_call(cupy, completion):
    async with await akv.create_async("device") as kv:
        value = cupy.ones(256, F32)
        kv.init(0, value)
        value.fill(5.0)  # after the call: the store holds the old values
        grad = cupy.full(256, 2.0, F32)
        host = np.full(256, 3.0, F32)
        peer = on(1, lambda: cupy.full(256, 4.0, F32))
        pushed = kv.push(0, [grad, host, peer])
        grad.fill(7.0)
        host.fill(7.0)
        on(1, lambda: peer.fill(7.0))
        await pushed
        assert (await kv.pull(0)).get().tolist() == [9.0] * 256
        assert value.get().tolist() == [5.0] * 256


async def test_a_push_keeps_its_buffers_until_the_gpu_is_done(cupy, completion):
    """With the GPU held back, the optimizer's work is queued but not run: nothing the push
    staged may go back to CuPy's pool before it is. A push of a free key is enqueued on the
    caller's stream (done at the call); one of a key whose var is held (by a pull to another
    GPU, a task) is applied by a task, done once the GPU is."""
    async with await akv.create_async("device") as kv:
        await kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0, momentum=0.5))
        await kv.init([0, 1], [cupy.zeros(128, F32), cupy.zeros(64, F32)])
        with cupy.held():
            first = kv.push(0, cupy.ones(128, F32))
            assert first.done()  # on the caller's stream: no task
            elsewhere = on(1, lambda: cupy.empty(64, F32))
            pulled_elsewhere = kv.pull(1, out=elsewhere)  # a task holds key 1
            second = kv.push(1, cupy.ones(64, F32))  # so this one is a task too
            await asyncio.to_thread(cupy.wait_for_gpu_work, 1)
            assert not pulled_elsewhere.done() and not second.done()
            assert cupy.violations == []
        await asyncio.gather(first, second, pulled_elsewhere)
        assert peek(elsewhere).tolist() == [0.0] * 64  # pulled before the push
        pulled = await kv.pull([0, 1])
        assert [a.get()[0] for a in pulled] == [-1.0, -1.0]


# ---------------------------------------------------------------------------- the local store


def test_the_local_store_copies_gpu_values_to_the_host(cupy):
    with akv.create("local") as kv:
        kv.init(0, on(1, lambda: cupy.arange(4, dtype=F32)))
        assert type(entry_of(kv, 0).value) is np.ndarray
        kv.push(0, [on(1, lambda: cupy.full(4, 2.0, F32)), cupy.ones(4, F32)])
        pulled = kv.pull(0)
        assert isinstance(pulled, cupy.ndarray) and pulled.device.id == 1
        assert peek(pulled).tolist() == [3.0] * 4  # copied when the pull completed
        out = cupy.zeros((4, 2), F32)[:, 0]
        kv.pull(0, out=out)
        assert peek(out).tolist() == [3.0] * 4


async def test_the_async_local_store_with_gpu_values(cupy):
    async with await akv.create_async("local") as kv:
        kv.init("w", cupy.zeros(8, F32))
        grad = cupy.ones(8, F32)
        pushed = kv.push("w", grad)
        grad.fill(4.0)
        await pushed
        assert peek(await kv.pull("w")).tolist() == [1.0] * 8


# ---------------------------------------------------------------------------- the GPU tests of
# test_device_store and test_dist_device_gpu, run on the fake (written for a GPU machine)


@pytest.mark.parametrize(
    "test",
    [
        test_device_store.test_gpu_values_are_reduced_and_kept_on_the_gpu,
        test_device_store.test_the_async_face_reads_gpu_values_at_the_call,
        test_device_store.test_optimizers_on_the_gpu_match_numpy,
        test_device_store.test_keys_spread_over_gpus_and_pushes_from_each_are_summed,
        test_device_store.test_the_local_store_copies_gpu_values_to_the_host,
        test_device_store.test_calls_from_two_streams_are_ordered_on_the_gpu,
        test_device_store.test_host_stores_stage_cupy_values_through_pinned_buffers,
        test_dist_device_gpu.test_dist_sync_device_rounds_of_two_workers_on_the_gpu,
        test_dist_device_gpu.test_dist_sync_device_server_optimizer_matches_the_local_store,
        test_dist_device_gpu.test_dist_async_device_applies_each_push_on_the_gpu,
    ],
    ids=lambda test: test.__name__,
)
def test_the_gpu_machine_tests_pass_on_the_fake(cupy, test):
    test(cupy)


# ---------------------------------------------------------------------------- dist_sync_device


def pinned(array) -> bool:
    state = fakecupy._find(int(array.ctypes.data), array.nbytes)
    return state is not None and state.device is None


@pytest.mark.parametrize("servers", [1, 2])
async def test_dist_sync_device_with_gpu_values(cupy, completion, servers):
    with Cluster(2, servers, AKV_BIGARRAY_BOUND="16") as cluster:  # "w" splits over 2 servers
        stores = await cluster.workers("dist_sync_device")
        assert all(isinstance(kv._backend, DistBackend) for kv in stores)

        async def body(kv):
            r = kv.rank + 1.0
            seen = {}
            await kv.init(["w", "b"], [cupy.zeros((4, 8), F32), cupy.zeros(3, F32)])
            w = entry_of(kv, "w")
            assert w.pinned and w.device is None
            # Two GPUs' values for "w": summed on device 0 at the call.
            values = [cupy.full((4, 8), r, F32), on(1, lambda: cupy.full((4, 8), r, F32))]
            await kv.push(["w", "w", "b"], [*values, cupy.full(3, r, F32)])
            await kv._backend.acknowledged()  # acknowledged: the staging buffer is the key's again
            assert all(pinned(buffer) for buffer in w._spares) and w._spares
            spares = list(w._spares)
            outs = [cupy.empty((4, 8), F32), on(1, lambda: cupy.empty((4, 8), F32))]
            await kv.pull("w", out=outs)
            seen["outs"] = [peek(o)[0, 0] for o in outs]
            new = await kv.pull("b")
            assert isinstance(new, cupy.ndarray) and new.device.id == 0
            seen["new"] = peek(new).tolist()
            await kv.push("w", cupy.full((4, 8), r, F32))
            strided = cupy.zeros((4, 16), F32)[:, ::2]
            host = np.empty((4, 8), F32)
            await kv.pull("w", out=[strided, host])
            seen["second"] = (peek(strided)[3, 7], host[3, 7])
            await kv._backend.acknowledged()
            # Reused, not remade: at most one more, for the pull that landed while the
            # pipelined push still held the first buffer.
            assert all(pinned(b) for b in w._spares)
            assert len([b for b in w._spares if not any(b is s for s in spares)]) <= 1
            value = cupy.full(3, 10.0 * r, F32)
            assert await kv.pushpull("b", value) is value
            seen["pushpull"] = peek(value).tolist()
            return seen

        for seen in await asyncio.gather(*(body(kv) for kv in stores)):
            assert seen == {
                "outs": [6.0, 6.0],
                "new": [3.0] * 3,
                "second": (3.0, 3.0),
                "pushpull": [30.0] * 3,
            }
        await asyncio.gather(*(kv.close() for kv in stores))


async def test_dist_sync_device_key_from_host_memory_takes_gpu_values(cupy):
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers("dist_sync_device")

        async def body(kv):
            await kv.init("h", np.zeros(5, F32))
            assert not entry_of(kv, "h").pinned
            await kv.push("h", cupy.full(5, kv.rank + 1.0, F32))
            assert entry_of(kv, "h").pinned  # staged through pinned memory from then on
            out = cupy.empty(5, F32)
            await kv.pull("h", out=out)
            return peek(out).tolist()

        assert await asyncio.gather(*(body(kv) for kv in stores)) == [[3.0] * 5] * 2
        await asyncio.gather(*(kv.close() for kv in stores))


async def test_dist_sync_device_optimizer_states_of_gpu_keys_load_back(cupy, tmp_path):
    path = tmp_path / "states.npz"
    grads = [np.linspace(-1, 1, 12, dtype=F32) * (i + 1) for i in range(3)]
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers("dist_sync_device")

        async def body(kv):
            await kv.init("w", on(1, lambda: cupy.zeros(12, F32)))
            await kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
            await kv.push("w", on(1, lambda: cupy.asarray(grads[0])))
            await kv.pull("w")
            if kv.rank == 0:
                await kv.save_optimizer_states(path)
            await kv.barrier()
            await kv.push("w", on(1, lambda: cupy.asarray(grads[1])))  # undone by the load
            await kv.pull("w")
            await kv.barrier()
            if kv.rank == 0:
                await kv.load_optimizer_states(path)
            await kv.barrier()
            await kv.push("w", on(1, lambda: cupy.asarray(grads[2])))
            pulled = await kv.pull("w")
            assert pulled.device.id == 1
            return pulled.get()

        results = await asyncio.gather(*(body(kv) for kv in stores))
        await asyncio.gather(*(kv.close() for kv in stores))
    with akv.create("local") as local:
        local.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
        local.init("w", np.zeros(12, F32))
        local.push("w", grads[0] * 2)
        local.push("w", grads[1] * 2)
        local.load_optimizer_states(path)
        local.push("w", grads[2] * 2)
        want = local.pull("w")
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_device_backend_takes_an_executor_factory(cupy):
    """The seam: a DeviceBackend made with another GPU executor factory uses it."""
    from akv_engine import Engine, GPUExecutor

    made = []

    def factory():
        made.append(GPUExecutor(completion="waiter", compute_streams=1, copy_streams=1))
        return made[-1]

    engine = Engine(slots=4)
    backend = DeviceBackend(engine, object(), None, executor=factory)
    assert made == []
    backend._gpu_ready()
    assert len(made) == 1
    engine.close(timeout=10)


async def test_dist_sync_device_landing_copies_come_before_later_work_on_the_key(cupy):
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers("dist_sync_device")
        await kv.init("w", cupy.zeros(16, F32))
        out = cupy.empty(16, F32)
        with cupy.held():
            pulled = kv.pull("w", out=out)
            await asyncio.to_thread(cupy.wait_for_gpu_work, 1)  # its landing copy, held
            pushed = kv.push("w", cupy.ones(16, F32))
            assert kv.engine.graph()["stage"] == ["land"]  # the push's GPU staging waits
        assert await pulled is out
        await pushed
        assert peek(out).tolist() == [0.0] * 16
        assert (await kv.pull("w")).get().tolist() == [1.0] * 16
        await kv.close()


async def test_pull_outputs_are_written_after_the_callers_queued_work_on_them(cupy, completion):
    """An output the caller just filled (the fill still queued on its stream) gets the pulled
    value, not the fill, whichever runs first on the GPU otherwise."""
    async with await akv.create_async("device") as kv:
        await kv.init("w", cupy.full(8, 6.0, F32))
        outs = [cupy.zeros(8, F32), on(1, lambda: cupy.zeros(8, F32))]
        await kv.pull("w", out=outs)
        cupy.synchronize_all()  # the GPU catches up with everything queued
        assert [peek(o).tolist() for o in outs] == [[6.0] * 8] * 2
    with Cluster(1, 1) as cluster:
        (dist,) = await cluster.workers("dist_sync_device")
        await dist.init("w", cupy.full(8, 6.0, F32))
        outs = [cupy.zeros(8, F32), on(1, lambda: cupy.zeros(8, F32))]
        await dist.pull("w", out=outs)
        cupy.synchronize_all()
        assert [peek(o).tolist() for o in outs] == [[6.0] * 8] * 2
        await dist.close()


async def test_host_stores_write_gpu_outputs_after_the_callers_queued_work(cupy):
    """The same for the local and dist_sync stores, whose copies run on an engine or loop
    thread: its current stream is not the one the caller queued the fills on."""
    async with await akv.create_async("local", inline_max_bytes=0) as kv:
        await kv.init("w", np.full(8, 6.0, F32))
        with cupy.cuda.Stream(non_blocking=True):
            out = cupy.zeros(8, F32)
            pulled = kv.pull("w", out=out)
        await pulled
        cupy.synchronize_all()
        assert peek(out).tolist() == [6.0] * 8
    with Cluster(1, 1) as cluster:  # dist_sync writes GPU outputs on the loop thread
        (dist,) = await cluster.workers("dist_sync")
        await dist.init("w", np.full(8, 6.0, F32))
        with cupy.cuda.Stream(non_blocking=True):
            outs = [cupy.zeros(8, F32), cupy.zeros(8, F32)]
            pulled = dist.pull("w", out=outs)
        await pulled
        cupy.synchronize_all()
        assert [peek(o).tolist() for o in outs] == [[6.0] * 8] * 2
        await dist.close()


# ---------------------------------------------------------------------------- profiling script


@pytest.mark.parametrize("completion", ["host_func", "waiter"])
@pytest.mark.parametrize("chained", [True, False])
def test_the_completion_script_runs_every_task(cupy, completion, chained):
    """docs/profiling/gpu_completion.py on the fake: every task ran (it checks the count
    itself and exits otherwise), and the times are positive."""
    wall, cpu = gpu_completion.per_task(completion, 50, chained)
    assert wall > 0 and cpu >= 0


# ------------------------------------------------- what a GPU-paths review found (2026-12-07)


async def test_a_push_landed_by_a_task_keeps_the_old_value_for_reads_on_other_streams(
    cupy, monkeypatch
):
    """A pull into a GPU output on another stream (S2) queues a copy of the key's value; a
    push the engine runs as a task (its one slot busy) then replaced the value at launch,
    and the old value's memory went back to its allocating stream's pool at once: the
    caller's next allocation took it and wrote it before S2's copy ran. (With host-function
    completion, where the fake's timing lets the task finish its host side first.)"""
    import threading

    monkeypatch.setenv("ENGINE_GPU_COMPLETION", "host_func")

    async with await akv.create_async("device", slots=1) as kv:
        await kv.init("k", cupy.zeros(64, F32))
        await kv.push("k", cupy.full(64, 3.0, F32))  # the value: from the null stream's pool
        cupy.synchronize_all()
        s2 = cupy.cuda.Stream(non_blocking=True)
        with s2:
            out = cupy.zeros(64, F32)
            pulled = kv.pull("k", out=out)  # on S2, at the call: its copy queued there
        engine = kv.engine
        gate = threading.Event()
        busy = engine.push(gate.wait, 10, writes=[engine.new_var()], name="busy")
        pushed = kv.push("k", cupy.ones(64, F32))  # the slot is busy: a task lands it
        assert "push" in engine.graph()
        with cupy.held():
            gate.set()
            await busy
            old = entry_of(kv, "k").value.data.ptr
            for _ in range(2000):  # until the task has launched (replaced the value)
                if entry_of(kv, "k").value.data.ptr != old:
                    break
                await asyncio.sleep(0.001)
            cupy.full(64, 9.0, F32)  # the caller's next allocation, on the null stream
            cupy.synchronize_all()  # (the fake runs the null stream first, then S2)
        await pushed
        await pulled
        assert peek(out).tolist() == [3.0] * 64


async def test_a_pull_awaited_after_its_store_closed_completes(cupy, completion):
    """The watcher threads are gone once the store closed: a GPU pull's waitable awaited
    then is settled by its caller (it waited for ever on a queue nobody served)."""
    kv = await akv.create_async("device")
    await kv.init("k", cupy.full(64, 3.0, F32))
    await kv.pull("k", out=cupy.zeros(64, F32))  # starts device 0's watcher thread
    out = cupy.zeros(64, F32)
    pulled = kv.pull("k", out=out)
    await kv.close()
    await asyncio.wait_for(pulled, 30)
    assert peek(out).tolist() == [3.0] * 64


def test_a_peer_copy_into_a_strided_output_waits_for_its_landings_memory(cupy):
    """Two copies to strided outputs on GPU 1 from two streams of GPU 0: the second's
    landing buffer took the first's memory (freed on the host once its copy out was queued
    on GPU 1's stream) and was written before that copy ran."""
    from akv.pinned import _gpu_to_gpu

    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    src1, src2 = cupy.full(64, 1.0, F32), cupy.full(64, 2.0, F32)
    dst1 = on(1, lambda: cupy.zeros((64, 2), F32))[:, 0]  # strided: through a landing
    dst2 = on(1, lambda: cupy.zeros((64, 2), F32))[:, 0]
    cupy.synchronize_all()
    _gpu_to_gpu(dst1, src1, first)
    _gpu_to_gpu(dst2, src2, second)
    second.synchronize()  # the GPU runs the second copy's stream first
    cupy.synchronize_all()
    assert peek(dst1).tolist() == [1.0] * 64 and peek(dst2).tolist() == [2.0] * 64


def test_row_ids_on_a_gpu_are_read_on_the_host_as_mxnet_takes_ids_of_any_context(cupy):
    """A row-sparse key's rows live on the host; ids given on a GPU (CuPy, a torch CUDA
    tensor) are copied there for the lookup, the same rows as from NumPy ids."""
    kv = akv.create("device")
    table = np.arange(24, dtype=F32).reshape(6, 4)
    kv.init("emb", akv.RowSparseArray.from_dense(table))
    ids = on(1, lambda: cupy.asarray(np.array([4, 1, 4], np.int64)))
    pulled = kv.row_sparse_pull("emb", row_ids=ids)
    assert pulled.indices.tolist() == [1, 4]
    np.testing.assert_array_equal(pulled.data, table[[1, 4]])
    with pytest.raises(akv.RowIdError, match="row id 6"):
        kv.row_sparse_pull("emb", row_ids=on(0, lambda: cupy.asarray(np.array([6], np.int64))))
    kv.close()
