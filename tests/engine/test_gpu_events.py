"""Completions of GPU work that was never a task (``GPUExecutor.event_done``), and the
pooled end events of chained tasks; on the fake CUDA driver of ``test_gpu.py``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from akv_engine import Engine, GPUExecutor, gather, then
from tests.engine.test_gpu import WAIT_S, FakeCudaError, FakeDriver, Gate


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    """The fake CUDA driver of ``test_gpu.py``; no rule broken by the end of the test."""
    driver = FakeDriver(devices=2)
    yield driver
    driver.close()
    assert driver.violations == [] and driver.callback_errors == []


@pytest.fixture(params=["host_func", "waiter"])
def strategy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def executor(fake: FakeDriver, strategy: str) -> Iterator[GPUExecutor]:
    made = GPUExecutor(fake, completion=strategy)
    yield made
    made.close(timeout=WAIT_S)


def recorded_after(driver: FakeDriver, work: Gate | None = None) -> object:
    """A blocking-sync event recorded on a new stream of device 0, after ``work``."""
    stream = driver.new_stream(0)
    if work is not None:
        stream.ops.put(("kernel", work, None))
    event = driver.new_event(0, True)
    driver.record(event, stream)
    return event


def watcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-events") and t.is_alive()]


def test_a_blocking_wait_waits_on_the_calling_thread_without_a_watcher(executor, fake):
    gate = Gate()
    done = executor.event_done(0, recorded_after(fake, gate), result="value")
    assert not done.done()  # asked without blocking: the work has not run
    waiter = threading.Thread(target=lambda: gate.started.wait(WAIT_S) and gate.opened.set())
    waiter.start()
    assert done.result() == "value"
    waiter.join(WAIT_S)
    assert done.done() and executor.statistics().watched == 0


async def test_await_hands_the_event_to_the_devices_watcher_thread(executor, fake):
    gate = Gate()
    done = executor.event_done(0, recorded_after(fake, gate), result=7)
    waiting = asyncio.ensure_future(_await(done))
    await asyncio.to_thread(gate.started.wait, WAIT_S)
    assert not waiting.done()
    gate.opened.set()
    assert await asyncio.wait_for(waiting, WAIT_S) == 7
    assert executor.statistics().watched == 1


async def _await(waitable: object) -> object:
    return await waitable  # type: ignore[misc]


def test_done_asks_without_blocking(executor, fake):
    gate = Gate()
    done = executor.event_done(0, recorded_after(fake, gate))
    assert gate.started.wait(WAIT_S)
    assert not done.done()
    gate.opened.set()
    done.result(WAIT_S)  # through the watcher (a timeout was given)
    assert done.done() and executor.statistics().watched == 1


def test_then_and_gather_start_the_watch(executor, fake):
    first = executor.event_done(0, recorded_after(fake), result=1)
    second = executor.event_done(1, _recorded_on(fake, 1), result=2)
    doubled = then(first, lambda value: value * 2)
    both = gather([doubled, second], result="both")
    assert both.result(WAIT_S) == "both" and doubled.result(WAIT_S) == 2
    assert executor.statistics().watched == 2
    assert len({t.name for t in watcher_threads()}) >= 2  # one per device


def _recorded_on(driver: FakeDriver, device: int) -> object:
    stream = driver.new_stream(device)
    event = driver.new_event(device, True)
    driver.record(event, stream)
    return event


def test_an_error_of_the_wait_fails_the_waitable(executor, fake):
    fake.poison = FakeCudaError("illegal address")
    done = executor.event_done(0, recorded_after(fake), result=1)
    with pytest.raises(FakeCudaError, match="illegal address"):
        done.result()
    assert done.failed()
    with pytest.raises(FakeCudaError):
        executor.event_done(0, _poisoned(fake)).result(WAIT_S)


def _poisoned(driver: FakeDriver) -> object:
    driver.poison = FakeCudaError("again")
    return recorded_after(driver)


def test_close_stops_the_watcher_threads(fake):
    made = GPUExecutor(fake)
    made.event_done(0, recorded_after(fake)).result(WAIT_S)
    assert watcher_threads()
    made.close(timeout=WAIT_S)
    assert not [t for t in watcher_threads() if t.name.startswith("gpu-dev0")]


# ---------------------------------------------------------------- chained tasks


def test_chained_tasks_reuse_their_end_events(fake, strategy):
    """Each task of a chain (each waits for the previous through a var) records one end
    event, taken from the device's pool: a chain of 50 makes a handful of events, not 50,
    and its host work per task is one record and one completion."""
    gpu_executor = GPUExecutor(fake, completion=strategy)
    eng = Engine(slots=4)
    eng.register_executor("gpu", gpu_executor)
    try:
        var = eng.new_var()
        ran = []
        tasks = [
            eng.push(lambda ctx, i=i: ran.append(i), writes=[var], executor="gpu")
            for i in range(50)
        ]
        tasks[-1].result(WAIT_S)
        stats = gpu_executor.statistics()
        assert ran == list(range(50))
        assert (stats.submitted, stats.completed) == (50, 50)
        assert stats.events_made <= 2
        assert len(fake.events) == stats.events_made
    finally:
        eng.close(timeout=WAIT_S)
        gpu_executor.close(timeout=WAIT_S)
