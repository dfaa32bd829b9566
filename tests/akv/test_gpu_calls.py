"""The ``device`` store's calls on the caller's stream, and the pipelined multi-GPU reduce,
on the fake CuPy (``tests/fakecupy.py``: streams run lazily, so a missing wait reads stale
memory; every submission is counted).

What a call costs is counted, never timed: the stream submissions (kernels and copies), the
completions the host waits for, and the engine tasks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import akv
from akv import gpu_stream
from tests import fakecupy

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


@pytest.fixture
def cupy(fake_cupy: Any) -> Any:
    """The fake CuPy (``fake_cupy`` of ``tests/akv/conftest.py``)."""
    return fake_cupy


class Costs:
    """What a piece of code submitted to streams, waited for, and pushed to the engine."""

    def __init__(self, kv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        inner = getattr(kv, "_inner", kv)
        self.engine = inner.engine
        self.backend = inner._backend
        self.tasks = 0
        push = self.engine._push

        def counting(*args: Any) -> Any:
            self.tasks += 1
            return push(*args)

        monkeypatch.setattr(self.engine, "_push", counting)
        self.start()

    def start(self) -> None:
        fakecupy.synchronize_all()
        self.counts = dict(fakecupy.counts)
        self.tasks = 0
        stats = self.backend._gpu_executor.statistics()
        self.watched, self.submitted = stats.watched, stats.submitted

    def now(self) -> dict[str, int]:
        stats = self.backend._gpu_executor.statistics()
        counts = fakecupy.counts
        return {
            "submissions": counts["kernel"] - self.counts.get("kernel", 0),
            "records": counts["record"] - self.counts.get("record", 0),
            "waits": counts["wait"] - self.counts.get("wait", 0),
            "host_waits": counts["host_wait"] - self.counts.get("host_wait", 0),
            "engine_tasks": self.tasks,
            "gpu_tasks": stats.submitted - self.submitted,
            "watched": stats.watched - self.watched,
        }


def test_a_small_keys_push_and_pull_cost_two_submissions_and_one_completion(cupy, monkeypatch):
    with akv.create("device") as kv:
        kv.init("small", cupy.zeros(4, F32))
        value, out = cupy.ones(4, F32), cupy.zeros(4, F32)
        kv.push("small", value)
        kv.pull("small", out=out)  # a warm-up: the executor exists
        costs = Costs(kv, monkeypatch)
        kv.push("small", value)
        kv.pull("small", out=out)
        assert costs.now() == {
            "submissions": 2,  # the push's copy into the value, the pull's copy out
            "records": 2,  # the end of the write, the end of the read
            "waits": 0,  # one stream: it orders everything
            "host_waits": 1,  # the pull's completion, on the calling thread
            "engine_tasks": 0,
            "gpu_tasks": 0,
            "watched": 0,
        }
        assert fakecupy.peek(out).tolist() == [1.0] * 4


async def test_the_async_face_completes_a_pull_through_one_watcher(cupy, monkeypatch):
    async with await akv.create_async("device") as kv:
        kv.init(0, cupy.zeros(8, F32))
        out = cupy.empty(8, F32)
        await kv.pull(0, out=out)
        costs = Costs(kv, monkeypatch)
        pushed = kv.push(0, [cupy.ones(8, F32), cupy.ones(8, F32)])
        assert pushed.done()  # enqueued on the caller's stream
        assert await kv.pull(0, out=out) is out
        now = costs.now()
        assert (now["engine_tasks"], now["gpu_tasks"], now["watched"]) == (0, 0, 1)
        assert now["host_waits"] == 1
        assert fakecupy.peek(out).tolist() == [2.0] * 8


def test_a_push_of_four_values_is_one_kernel(cupy, monkeypatch):
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros(64, F32))
        values = [cupy.full(64, float(i), F32) for i in range(4)]
        costs = Costs(kv, monkeypatch)
        elementwise = fakecupy.counts["elementwise"]
        kv.push(0, values)
        assert fakecupy.counts["elementwise"] - elementwise == 1
        assert costs.now()["submissions"] == 1
        assert kv.pull(0).get().tolist() == [6.0] * 64


def test_an_sgd_push_is_two_kernels_the_sum_and_the_update(cupy, monkeypatch):
    with akv.create("device") as kv:
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5))
        kv.init(0, cupy.ones(64, F32))
        kv.push(0, cupy.ones(64, F32))
        costs = Costs(kv, monkeypatch)
        kv.push(0, [cupy.ones(64, F32), cupy.ones(64, F32)])
        assert costs.now()["submissions"] == 1 + 2 + 1  # two fills, the sum, the update
        assert kv.pull(0).get().tolist() == [-0.5] * 64


def test_an_optimizer_reads_a_single_gradient_where_it_is(cupy, monkeypatch):
    with akv.create("device") as kv:
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5))
        kv.init(0, cupy.ones(64, F32))
        grad = cupy.ones(64, F32)
        kv.push(0, grad)
        costs = Costs(kv, monkeypatch)
        kv.push(0, grad)
        grad.fill(7.0)  # after the push, on the same stream: the update read the old one
        assert costs.now()["submissions"] == 2  # the update (no copy of the gradient), the fill
        assert kv.pull(0).get().tolist() == [0.0] * 64


def test_a_custom_updater_gets_a_copy_of_a_single_value(cupy):
    seen = []

    def updater(key: Any, recv: Any, stored: Any) -> None:
        seen.append(recv)
        stored += recv

    with akv.create("device") as kv:
        kv.set_updater(updater)
        kv.init(0, cupy.zeros(8, F32))
        grad = cupy.ones(8, F32)
        kv.push(0, grad)
        assert seen[0] is not grad
        assert kv.pull(0).get().tolist() == [1.0] * 8


def test_work_on_another_stream_waits_for_the_keys_work(cupy):
    """A push on one stream, a pull on another, a push on a third: each waits (on the GPU)
    for what it must, or the lazy fake would let it read or write the wrong memory."""
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros(16, F32))
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        with streams[0]:
            value = cupy.full(16, 3.0, F32)
            kv.push(0, value)
        out = cupy.empty(16, F32)
        with streams[1]:
            kv.pull(0, out=out)  # waits for the push on streams[0]
        assert fakecupy.peek(out).tolist() == [3.0] * 16
        with streams[2]:
            kv.push(0, cupy.full(16, 5.0, F32))
        assert kv.pull(0).get().tolist() == [5.0] * 16


async def test_a_write_waits_for_a_read_on_another_stream(cupy):
    async with await akv.create_async("device") as kv:
        await kv.init(0, cupy.full(16, 1.0, F32))
        reader, writer = (cupy.cuda.Stream(non_blocking=True) for _ in range(2))
        out = cupy.empty(16, F32)
        with reader:
            pulled = kv.pull(0, out=out)  # queued on `reader`, not run yet
        with writer:
            kv.push(0, cupy.full(16, 9.0, F32))  # must not overwrite before the read
        writer.synchronize()  # the GPU runs the writer first (unless it waits for the read)
        await pulled
        assert fakecupy.peek(out).tolist() == [1.0] * 16
        assert (await kv.pull(0)).get().tolist() == [9.0] * 16


def test_tasks_on_the_key_wait_for_work_on_callers_streams(cupy):
    with akv.create("device") as kv:
        kv.init(0, cupy.zeros(16, F32))
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            kv.push(0, cupy.full(16, 4.0, F32))  # on `stream`, not run yet
        elsewhere = fakecupy.cuda.Device(1)
        with elsewhere:
            out = cupy.empty(16, F32)
        kv.pull(0, out=out)  # to another GPU: a task on a copy stream
        assert fakecupy.peek(out).tolist() == [4.0] * 16


def test_saved_optimizer_states_follow_updates_on_callers_streams(cupy, tmp_path):
    path = tmp_path / "states"
    with akv.create("device") as kv:
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        kv.init(0, cupy.zeros(8, F32))
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            kv.push(0, cupy.ones(8, F32))  # the update runs on `stream`, later
        kv.save_optimizer_states(path)
    saved = akv.optimizer.decode_states(path.read_bytes())
    np.testing.assert_allclose(saved.states[0], np.full(8, -0.1, F32))


# ---------------------------------------------------------------------------- many GPUs


def test_chunks_cover_the_array():
    assert gpu_stream.chunk_slices(10, 4, chunk_bytes=16) == [
        slice(0, 4),
        slice(4, 8),
        slice(8, 10),
    ]
    assert gpu_stream.chunk_slices(0, 4) == [slice(0, 0)]
    assert gpu_stream.chunk_slices(3, 8, chunk_bytes=1) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_peer_copies_run_on_a_side_stream_and_each_chunks_sum_waits_for_its_own(cupy, monkeypatch):
    """With values on both GPUs, the reduce on GPU 0 copies GPU 1's value chunk by chunk on
    a side stream; the sum of chunk k waits for the copy of chunk k only (so later copies
    overlap it), and GPU 1's later work waits for the copies (the caller may overwrite)."""
    monkeypatch.setattr(gpu_stream, "PEER_CHUNK_BYTES", 64 * 4)
    count = 64 * 3 + 10  # four chunks
    with akv.create("device", devices=[0]) as kv:
        kv.init(0, cupy.zeros(count, F32))
        local = cupy.arange(count, dtype=F32)
        with fakecupy.cuda.Device(1):
            remote = cupy.full(count, 100.0, F32)  # queued on GPU 1's stream
        caller = cupy.cuda.get_current_stream()
        with fakecupy.logging_ops() as log:
            kv.push(0, [local, remote])
        with fakecupy.cuda.Device(1):
            remote.fill(-1.0)  # after the push, on GPU 1's stream
        copies = {stream for stream, _, label in log if label == "memcpy"}
        assert len(copies) == 1 and caller not in copies  # one side stream
        steps = [
            "copy" if label == "memcpy" else "sum" if label.startswith("akv_sum") else kind
            for stream, kind, label in log
            if label == "memcpy" or (stream is caller and kind in ("wait", "kernel"))
        ]
        assert steps == ["copy", "wait", "sum"] * 4
        want = np.arange(count, dtype=F32) + 100.0
        assert kv.pull(0).get().tolist() == want.tolist()


def test_keys_reduced_with_peers_keep_numpys_order_of_addition(cupy):
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(300).astype(F32) for _ in range(3)]
    with akv.create("device", devices=[0]) as kv:
        kv.init(0, cupy.zeros(300, F32))
        with fakecupy.cuda.Device(1):
            remote = cupy.asarray(values[1])
        kv.push(0, [cupy.asarray(values[0]), remote, cupy.asarray(values[2])])
        want = values[0] + values[1]
        want += values[2]
        np.testing.assert_array_equal(kv.pull(0).get(), want)
