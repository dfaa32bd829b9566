"""GPU tasks: stream pools, completion by host callback or waiter thread, errors, closing.

Most tests drive the executor through a fake CUDA driver whose streams are threads: work
enqueued on a stream runs later, in order, and host callbacks run on the stream's thread,
as on a GPU. The tests marked ``gpu`` use CuPy on a real device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import akv_engine as engine
from akv_engine import (
    CupyDriver,
    Engine,
    EngineClosedError,
    EngineError,
    GPUExecutor,
    GPUWork,
    gpu_available,
)

WAIT_S = 5.0
ROOT = Path(__file__).resolve().parents[2]


class FakeCudaError(RuntimeError):
    """Stands in for ``cupy.cuda.runtime.CUDARuntimeError``."""


class FakeEvent:
    def __init__(self, device: int, blocking: bool) -> None:
        self.device = device
        self.blocking = blocking
        self.fired = False
        self.error: BaseException | None = None  # what a query or wait raises once reached


class FakeStream:
    """A stream: a thread that runs its operations in order, later than they are enqueued."""

    def __init__(self, driver: FakeDriver, device: int, number: int) -> None:
        self.driver = driver
        self.device = device
        self.ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, name=f"fake-cuda-dev{device}-stream{number}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        driver = self.driver
        while True:
            op = self.ops.get()
            if op is None:
                return
            kind, a, b = op
            fault = driver.faults.get(self.device)
            if kind == "kernel":
                if fault is None:
                    try:
                        a()
                    except FakeCudaError as exc:
                        driver.set_fault(self.device, exc)
                    except BaseException as exc:
                        driver.violations.append(f"a fake kernel raised {exc!r}")
            elif kind == "record":
                if fault is None:
                    with driver.cond:
                        a.fired = True
                        driver.cond.notify_all()
            elif kind == "wait":
                with driver.cond:
                    if not driver.cond.wait_for(
                        lambda ev=a: ev.fired or self.device in driver.faults, WAIT_S
                    ):
                        driver.violations.append("a stream waited for an event that never fired")
            elif kind == "host":
                # As cudaLaunchHostFunc: not called once the device hit an error.
                if fault is None:
                    driver.local.in_callback = True
                    try:
                        a(b)
                    except BaseException as exc:  # CuPy's trampoline would lose it
                        driver.callback_errors.append(exc)
                    finally:
                        driver.local.in_callback = False
            elif kind == "marker":
                a.set()


class FakeDriver:
    """A :class:`akv_engine.CudaDriver` whose streams are threads (see the module docstring).

    It records the rules broken: a CUDA call from a host callback, a host wait on an event
    made without blocking sync, an exception out of a host callback.
    """

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.cond = threading.Condition()
        self.local = threading.local()
        self.streams: dict[int, list[FakeStream]] = {}
        self.events: list[FakeEvent] = []
        self.faults: dict[int, BaseException] = {}
        self.faulted = threading.Event()
        self.violations: list[str] = []
        self.callback_errors: list[BaseException] = []
        self.poison: BaseException | None = None
        self.queries = 0
        self.stream_error: BaseException | None = None

    # the CudaDriver protocol

    def device_count(self) -> int:
        self._api(None)
        return self.devices

    def new_stream(self, device: int) -> FakeStream:
        self._api(device)
        if self.stream_error is not None:
            raise self.stream_error
        streams = self.streams.setdefault(device, [])
        stream = FakeStream(self, device, len(streams))
        streams.append(stream)
        return stream

    def new_event(self, device: int, blocking: bool) -> FakeEvent:
        self._api(device)
        event = FakeEvent(device, blocking)
        event.error, self.poison = self.poison, None
        self.events.append(event)
        return event

    @contextlib.contextmanager
    def use(self, device: int, stream: FakeStream) -> Iterator[None]:
        self._api(device)
        previous = getattr(self.local, "current", None)
        self.local.current = (device, stream)
        try:
            yield
        finally:
            self.local.current = previous

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        self._api(stream.device)
        stream.ops.put(("record", event, None))

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self._api(stream.device)
        stream.ops.put(("wait", event, None))

    def launch_host_func(
        self, stream: FakeStream, callback: Callable[[Any], None], arg: Any
    ) -> None:
        self._api(stream.device)
        stream.ops.put(("host", callback, arg))

    def query_event(self, event: FakeEvent) -> bool:
        self._api(event.device)
        with self.cond:
            self.queries += 1
            self.cond.notify_all()
        if event.fired and event.error is not None:
            raise event.error
        return event.fired

    def synchronize_event(self, event: FakeEvent) -> None:
        self._api(event.device)
        if not event.blocking:
            self.violations.append("a host wait on an event without blocking sync spins")
        with self.cond:
            self.cond.wait_for(lambda: event.fired or event.device in self.faults, WAIT_S)
        self._api(event.device)
        if not event.fired:
            raise TimeoutError("fake synchronize: the event never fired")
        if event.error is not None:
            raise event.error

    # for the tests

    def _api(self, device: int | None) -> None:
        if getattr(self.local, "in_callback", False):
            self.violations.append("a CUDA call from a host callback")
        if device is not None and device in self.faults:
            raise self.faults[device]  # sticky, as a CUDA context error

    def set_fault(self, device: int, exc: BaseException) -> None:
        with self.cond:
            self.faults[device] = exc
            self.cond.notify_all()
        self.faulted.set()

    def current(self) -> tuple[int, FakeStream]:
        current = getattr(self.local, "current", None)
        assert current is not None, "no current stream: not inside a GPU task"
        return current

    def kernel(self, work: Callable[[], Any] = lambda: None) -> None:
        """Enqueue simulated device work on the current stream."""
        device, stream = self.current()
        self._api(device)
        stream.ops.put(("kernel", work, None))

    def drain(self, stream: FakeStream) -> None:
        """Wait until ``stream`` has run everything enqueued so far."""
        reached = threading.Event()
        stream.ops.put(("marker", reached, None))
        assert reached.wait(WAIT_S), "the fake stream did not drain"

    def close(self) -> None:
        for streams in self.streams.values():
            for stream in streams:
                stream.ops.put(None)
        for streams in self.streams.values():
            for stream in streams:
                stream.thread.join(WAIT_S)


class Gate:
    """Simulated device work that blocks until opened."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        if not self.opened.wait(WAIT_S):
            raise TimeoutError("gate never opened")


class Outcomes:
    """A ``done`` callback for driving an executor directly: counts and keeps each call."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[Any, BaseException | None, str]] = queue.SimpleQueue()
        self.count = 0

    def __call__(self, result: Any, exc: BaseException | None) -> None:
        self.count += 1
        self.calls.put((result, exc, threading.current_thread().name))

    def next(self) -> tuple[Any, BaseException | None, str]:
        return self.calls.get(timeout=WAIT_S)


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    fake = FakeDriver(devices=2)
    yield fake
    fake.close()
    assert fake.violations == []
    assert fake.callback_errors == []


@pytest.fixture(params=["host_func", "waiter"])
def completion(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def gpu(driver: FakeDriver, completion: str) -> Iterator[GPUExecutor]:
    executor = GPUExecutor(driver, completion=completion)
    yield executor
    executor.close(timeout=WAIT_S)


@pytest.fixture
def eng(gpu: GPUExecutor) -> Iterator[Engine]:
    e = Engine(slots=4)
    e.register_executor("gpu", gpu)
    yield e
    e.close(timeout=WAIT_S)


def gpu_threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


# ---------------------------------------------------------------- running and completing


def test_a_task_completes_once_its_stream_work_is_done(eng, driver):
    gate = Gate()

    def double(x, ctx):
        driver.kernel(gate)
        return 2 * x

    task = eng.push(double, 21, executor="gpu")
    assert gate.started.wait(WAIT_S)
    # The function has returned; the work it enqueued has not finished.
    assert not task.done()
    gate.opened.set()
    assert task.result(WAIT_S) == 42


def test_the_function_runs_on_the_device_thread_with_its_stream_current(eng, driver):
    seen = {}

    def probe(ctx):
        seen.update(
            thread=threading.current_thread().name,
            current=driver.current(),
            ctx=(ctx.device, ctx.kind, ctx.stream, ctx.stream_index),
        )

    eng.push(probe, executor="gpu").result(WAIT_S)
    stream = seen["ctx"][2]
    assert seen["thread"] == "gpu-dev0"
    assert seen["current"] == (0, stream)
    assert seen["ctx"] == (0, "compute", stream, 0)
    assert stream in driver.streams[0]


def test_completion_reaches_done_on_an_executor_thread_not_the_drivers(gpu, driver, completion):
    outcomes = Outcomes()
    gpu.submit(lambda ctx: driver.kernel() or "ok", (), outcomes)
    result, exc, thread = outcomes.next()
    assert (result, exc) == ("ok", None)
    assert thread == ("gpu-dev0" if completion == "host_func" else "gpu-dev0-compute0-waiter")


def test_dependents_start_after_the_gpu_work_completed(eng, driver):
    var = eng.new_var()
    log: list[str] = []
    gate = Gate()

    def produce(ctx):
        driver.kernel(lambda: (gate(), log.append("kernel")))

    eng.push(produce, writes=[var], executor="gpu")
    reader = eng.push(log.append, "reader", reads=[var], executor="inline")
    assert gate.started.wait(WAIT_S)
    assert reader.state == "waiting"
    gate.opened.set()
    reader.result(WAIT_S)
    assert log == ["kernel", "reader"]


def test_the_waiter_waits_on_events_made_with_blocking_sync(eng, driver, completion):
    for _ in range(3):
        eng.push(lambda ctx: driver.kernel(), executor="gpu")
    eng.wait_all().result(WAIT_S)
    assert len(driver.events) == 3
    assert all(event.blocking for event in driver.events)


def test_a_coroutine_function_is_refused(eng):
    async def not_gpu_work(ctx):
        return None

    task = eng.push(not_gpu_work, executor="gpu")
    with pytest.raises(EngineError, match="returned a coroutine"):
        task.result(WAIT_S)


# ---------------------------------------------------------------- devices and stream pools


def test_each_device_has_its_thread_and_streams_made_on_first_use(eng, driver):
    seen = {}

    def probe(ctx):
        seen.update(device=ctx.device, thread=threading.current_thread().name, stream=ctx.stream)

    eng.push(GPUWork(probe, device=1), executor="gpu").result(WAIT_S)
    assert seen["device"] == 1 and seen["thread"] == "gpu-dev1"
    assert seen["stream"] in driver.streams[1]
    assert 0 not in driver.streams
    assert len(driver.streams[1]) == engine._gpu.DEFAULT_COMPUTE_STREAMS + (
        engine._gpu.DEFAULT_COPY_STREAMS
    )


def test_copy_streams_are_kept_apart_from_compute_streams(eng):
    used: dict[str, set[Any]] = {"compute": set(), "copy": set()}

    def note(kind, ctx):
        assert ctx.kind == kind
        used[kind].add(ctx.stream)

    for _ in range(4):
        eng.push(GPUWork(note, kind="copy"), "copy", executor="gpu")
        eng.push(GPUWork(note, kind="compute"), "compute", executor="gpu")
        eng.push(note, "compute", executor="gpu")
    eng.wait_all().result(WAIT_S)
    assert used["copy"] and used["compute"]
    assert not used["copy"] & used["compute"]


def test_streams_are_leased_least_busy_first_and_returned_at_completion(driver, completion):
    gpu = GPUExecutor(driver, completion=completion, compute_streams=2)
    gates = [Gate() for _ in range(3)]
    launched = [threading.Event() for _ in range(3)]
    indexes: list[int] = []
    outcomes = Outcomes()

    def work(number, ctx):
        indexes.append(ctx.stream_index)
        driver.kernel(gates[number])
        launched[number].set()

    for number in range(3):
        gpu.submit(work, (number,), outcomes)
    assert all(event.wait(WAIT_S) for event in launched)
    # Two free streams first; the third task shares a stream (ties go in turn).
    assert indexes == [0, 1, 0]
    stats = gpu.statistics()
    assert (stats.in_flight, stats.leased_streams) == (3, 2)
    for gate in gates:
        gate.opened.set()
    for _ in range(3):
        assert outcomes.next()[1] is None
    stats = gpu.statistics()
    assert (stats.in_flight, stats.leased_streams) == (0, 0)
    assert (stats.submitted, stats.completed, stats.failed) == (3, 3, 0)
    gpu.close(timeout=WAIT_S)


def test_a_task_for_a_missing_device_fails(eng):
    task = eng.push(GPUWork(lambda ctx: None, device=5), executor="gpu")
    with pytest.raises(EngineError, match="device 5 does not exist"):
        task.result(WAIT_S)


def test_gpu_work_checks_its_device_and_kind_and_names_the_task(eng):
    def copy_in(ctx):
        return None

    with pytest.raises(EngineError, match="device"):
        GPUWork(copy_in, device=-1)
    with pytest.raises(EngineError, match="kind"):
        GPUWork(copy_in, kind="dma")
    with pytest.raises(EngineError, match="executor='gpu'"):
        GPUWork(copy_in)()
    task = eng.push(GPUWork(copy_in, kind="copy"), executor="gpu")
    assert task.name.startswith("copy_in")
    task.result(WAIT_S)


def test_streams_that_cannot_be_made_fail_the_devices_tasks(eng, driver):
    driver.stream_error = FakeCudaError("cudaErrorMemoryAllocation")
    task = eng.push(lambda ctx: None, executor="gpu")
    with pytest.raises(FakeCudaError, match="MemoryAllocation"):
        task.result(WAIT_S)


# ---------------------------------------------------------------- ordering across streams


def test_streams_run_independently_without_a_wait(eng, driver):
    gate = Gate()
    order: list[str] = []
    slow = eng.push(
        GPUWork(lambda ctx: driver.kernel(lambda: (gate(), order.append("copy"))), kind="copy"),
        executor="gpu",
    )
    fast = eng.push(lambda ctx: driver.kernel(lambda: order.append("compute")), executor="gpu")
    fast.result(WAIT_S)
    gate.opened.set()
    slow.result(WAIT_S)
    assert order == ["compute", "copy"]


def test_after_orders_work_across_streams_on_the_gpu(eng, driver):
    gate = Gate()
    order: list[str] = []
    launched = threading.Event()

    def produce(ctx):
        driver.kernel(lambda: (gate(), order.append("produce")))

    def consume(ctx):
        assert ctx.last_events("compute") == []  # its own stream does not count
        copy_events = ctx.last_events("copy")
        assert len(copy_events) == 1 and ctx.last_events() == copy_events
        ctx.after(*copy_events)
        driver.kernel(lambda: order.append("consume"))
        launched.set()

    # No shared var: the engine does not order them; the GPU wait does.
    producer = eng.push(GPUWork(produce, kind="copy"), writes=[eng.new_var()], executor="gpu")
    consumer = eng.push(consume, writes=[eng.new_var()], executor="gpu")
    assert gate.started.wait(WAIT_S) and launched.wait(WAIT_S)
    assert not consumer.done()
    gate.opened.set()
    consumer.result(WAIT_S)
    producer.result(WAIT_S)
    assert order == ["produce", "consume"]


# ---------------------------------------------------------------- failures


def test_a_function_that_raises_fails_its_task_and_dependents(eng, driver):
    var = eng.new_var()
    ran: list[str] = []

    def broken(ctx):
        driver.kernel()
        raise ValueError("bad shape")

    first = eng.push(broken, writes=[var], executor="gpu")
    second = eng.push(lambda ctx: ran.append("second"), reads=[var], executor="gpu")
    with pytest.raises(ValueError, match="bad shape"):
        eng.wait_all().result(WAIT_S)
    assert isinstance(second.exception(), ValueError)
    assert first.exception() is second.exception()
    assert ran == []
    # The stream went back to the pool and the executor keeps working.
    assert eng.push(lambda ctx: "fine", executor="gpu").result(WAIT_S) == "fine"


def test_an_error_at_completion_fails_the_task_and_dependents(eng, driver):
    var = eng.new_var()

    def poisoned(ctx):
        driver.kernel()
        driver.poison = FakeCudaError("cudaErrorIllegalAddress")  # its end event reports it

    first = eng.push(poisoned, writes=[var], executor="gpu")
    second = eng.push(lambda ctx: None, reads=[var], executor="inline")
    with pytest.raises(FakeCudaError, match="IllegalAddress"):
        first.result(WAIT_S)
    with pytest.raises(FakeCudaError, match="IllegalAddress"):
        second.result(WAIT_S)


def test_a_device_error_fails_the_task_though_no_callback_comes(driver, completion):
    # cudaLaunchHostFunc does not call back after a device error; the health check finds it.
    gpu = GPUExecutor(driver, completion=completion, health_check_s=0.01)
    outcomes = Outcomes()

    def fault(ctx):
        driver.kernel(lambda: (_ for _ in ()).throw(FakeCudaError("cudaErrorLaunchFailure")))

    gpu.submit(fault, (), outcomes)
    exc = outcomes.next()[1]
    assert isinstance(exc, FakeCudaError)
    gpu.close(timeout=WAIT_S)


def test_the_health_check_leaves_long_work_alone(driver):
    gpu = GPUExecutor(driver, completion="host_func", health_check_s=0.001)
    gate = Gate()
    outcomes = Outcomes()
    gpu.submit(lambda ctx: driver.kernel(gate) or "long", (), outcomes)
    with driver.cond:
        assert driver.cond.wait_for(lambda: driver.queries >= 3, WAIT_S)
    gate.opened.set()
    assert outcomes.next()[:2] == ("long", None)
    gpu.close(timeout=WAIT_S)


def test_a_device_error_is_found_by_the_next_launch_without_health_checks(driver):
    gpu = GPUExecutor(driver, completion="host_func", health_check_s=None)
    outcomes = Outcomes()

    def fault(ctx):
        driver.kernel(lambda: (_ for _ in ()).throw(FakeCudaError("cudaErrorLaunchFailure")))

    gpu.submit(fault, (), outcomes)
    assert driver.faulted.wait(WAIT_S)
    gpu.submit(lambda ctx: None, (), outcomes)
    errors = [outcomes.next()[1] for _ in range(2)]
    assert all(isinstance(exc, FakeCudaError) for exc in errors)
    assert gpu.statistics().failed == 2
    gpu.close(timeout=WAIT_S)


def test_a_raising_done_is_logged_and_the_executor_keeps_working(driver, completion, caplog):
    gpu = GPUExecutor(driver, completion=completion, compute_streams=1)
    closed_loop = asyncio.new_event_loop()
    closed_loop.close()

    def done_on_closed_loop(result, exc):
        closed_loop.call_soon_threadsafe(print, result)  # RuntimeError: loop is closed

    outcomes = Outcomes()
    with caplog.at_level(logging.ERROR, logger="akv_engine.gpu"):
        gpu.submit(lambda ctx: driver.kernel(), (), done_on_closed_loop)
        # Same stream: its completion comes after the first one's.
        gpu.submit(lambda ctx: driver.kernel() or "later", (), outcomes)
        assert outcomes.next()[:2] == ("later", None)
    (record,) = [r for r in caplog.records if r.name == "akv_engine.gpu"]
    assert record.exc_info is not None and "is closed" in str(record.exc_info[1])
    gpu.close(timeout=WAIT_S)


def test_the_host_callback_never_raises():
    engine._gpu._host_func_done(None)


# ---------------------------------------------------------------- closing


def test_close_releases_the_threads(driver, completion):
    gpu = GPUExecutor(driver, completion=completion, name="gpuclose")
    eng = Engine(slots=2)
    eng.register_executor("gpu", gpu)
    for device in (0, 1):
        eng.push(GPUWork(lambda ctx: driver.kernel(), device=device), executor="gpu")
    eng.wait_all().result(WAIT_S)
    # A device thread per device; with the waiter strategy a waiter per stream too.
    streams = engine._gpu.DEFAULT_COMPUTE_STREAMS + engine._gpu.DEFAULT_COPY_STREAMS
    assert len(gpu_threads("gpuclose-")) == 2 * (1 if completion == "host_func" else 1 + streams)
    eng.close(timeout=WAIT_S)
    assert gpu_threads("gpuclose-") == []


def test_close_waits_for_work_in_flight(gpu, driver):
    gate = Gate()
    outcomes = Outcomes()
    gpu.submit(lambda ctx: driver.kernel(gate) or "done", (), outcomes)
    assert gate.started.wait(WAIT_S)
    closer = threading.Thread(target=gpu.close, kwargs={"timeout": WAIT_S})
    closer.start()
    assert closer.is_alive()
    gate.opened.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert outcomes.next()[:2] == ("done", None)


def test_close_fails_work_still_running_and_ignores_its_late_completion(driver, completion):
    gpu = GPUExecutor(driver, completion=completion, name="gpulate")
    gate = Gate()
    outcomes = Outcomes()
    gpu.submit(lambda ctx: driver.kernel(gate), (), outcomes)
    assert gate.started.wait(WAIT_S)
    gpu.close(timeout=0.01)
    exc = outcomes.next()[1]
    assert isinstance(exc, EngineClosedError)
    gate.opened.set()
    driver.drain(driver.streams[0][0])  # the late host callback has run
    for thread in gpu_threads("gpulate-"):
        thread.join(WAIT_S)  # the waiter ends once its synchronize returns
    assert gpu_threads("gpulate-") == []
    assert outcomes.count == 1


def test_submit_after_close_fails_the_task(gpu):
    gpu.close()
    outcomes = Outcomes()
    gpu.submit(lambda ctx: None, (), outcomes)
    assert isinstance(outcomes.next()[1], EngineClosedError)


# ---------------------------------------------------------------- choosing, and CuPy absent


def test_the_completion_strategy_comes_from_the_argument_or_the_environment(driver, monkeypatch):
    monkeypatch.delenv("ENGINE_GPU_COMPLETION", raising=False)
    assert GPUExecutor(driver).completion == "waiter"
    monkeypatch.setenv("ENGINE_GPU_COMPLETION", "host_func")
    assert GPUExecutor(driver).completion == "host_func"
    assert GPUExecutor(driver, completion="waiter").completion == "waiter"
    monkeypatch.setenv("ENGINE_GPU_COMPLETION", "polling")
    with pytest.raises(EngineError, match="'polling'"):
        GPUExecutor(driver)
    with pytest.raises(EngineError, match="copy_streams"):
        GPUExecutor(driver, completion="waiter", copy_streams=0)


def test_gpu_available_never_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert gpu_available() is False

    def count_raising() -> int:
        raise RuntimeError("cudaErrorNoDevice")

    for count, expected in ((count_raising, False), (lambda: 0, False), (lambda: 1, True)):
        fake = types.SimpleNamespace(
            cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
        )
        monkeypatch.setitem(sys.modules, "cupy", fake)
        assert gpu_available() is expected


def test_the_cupy_driver_says_how_to_get_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match=r"akvstore\[gpu\]"):
        CupyDriver()
    with pytest.raises(ImportError):
        GPUExecutor()


def test_the_cupy_driver_checks_the_status_of_event_queries(monkeypatch):
    # CuPy's runtime.eventQuery returns the status unchecked (Event.done hides errors).
    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(f"status {status}")
            self.status = status

    statuses = {"done": 0, "running": 600, "faulted": 719}
    runtime = types.SimpleNamespace(
        eventQuery=lambda ptr: statuses[ptr], CUDARuntimeError=CUDARuntimeError
    )
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    )
    cupy_driver = CupyDriver()
    assert cupy_driver.query_event(types.SimpleNamespace(ptr="done")) is True
    assert cupy_driver.query_event(types.SimpleNamespace(ptr="running")) is False
    with pytest.raises(CUDARuntimeError, match="719"):
        cupy_driver.query_event(types.SimpleNamespace(ptr="faulted"))


def test_engine_imports_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import akv_engine as engine\n"
        "assert engine.gpu_available() is False\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- on a real GPU

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")

#: Spins about ``cycles`` GPU clock cycles, then writes ``value``: work slow enough that a
#: reader not ordered after it would see the old contents.
SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* out, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    out[threadIdx.x] = value;
}
"""
SLOW_CYCLES = 100_000_000  # about 50 ms at 2 GHz
REAL_WAIT_S = 60.0


@pytest.fixture
def real_eng(completion: str) -> Iterator[Engine]:
    e = Engine(slots=4)
    e.register_executor("gpu", GPUExecutor(completion=completion))
    yield e
    e.close(timeout=REAL_WAIT_S)


def _slow_fill() -> Any:
    import cupy

    return cupy.RawKernel(SLOW_FILL, "slow_fill")


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_task_completes_after_its_kernel(real_eng):
    import cupy

    kernel = _slow_fill()
    var = real_eng.new_var()

    def fill(ctx):
        assert cupy.cuda.get_current_stream() == ctx.stream
        out = cupy.zeros(32, dtype=cupy.float32)
        kernel((1,), (32,), (out, cupy.float32(7), cupy.int64(SLOW_CYCLES)))
        return out

    task = real_eng.push(fill, writes=[var], executor="gpu")
    # The reader copies on the legacy default stream, which does not wait for the task's
    # non-blocking stream: it sees 7 only if completion came after the kernel.
    reader = real_eng.push(lambda: task.result().get(), reads=[var], executor="inline")
    assert (reader.result(REAL_WAIT_S) == 7).all()


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_cuda_error_raised_by_the_function_fails_the_task(real_eng):
    import cupy

    var = real_eng.new_var()

    def bad_device(ctx):
        cupy.cuda.runtime.getDeviceProperties(1_000_000)  # cudaErrorInvalidDevice

    first = real_eng.push(bad_device, writes=[var], executor="gpu")
    second = real_eng.push(lambda ctx: None, reads=[var], executor="gpu")
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        real_eng.wait_all().result(REAL_WAIT_S)
    assert isinstance(second.exception(), cupy.cuda.runtime.CUDARuntimeError)
    assert first.exception() is second.exception()
    assert real_eng.push(lambda ctx: "fine", executor="gpu").result(REAL_WAIT_S) == "fine"


# A kernel fault leaves the CUDA context unusable: it runs in a process of its own.
FAULT_SCRIPT = r"""
import os, sys
import cupy
from akv_engine import Engine, GPUExecutor
eng = Engine(slots=2)
eng.register_executor("gpu", GPUExecutor(completion=sys.argv[1], health_check_s=0.2))
trap = cupy.RawKernel('extern "C" __global__ void trap() { __trap(); }', "trap")
trap.compile()
var = eng.new_var()
first = eng.push(lambda ctx: trap((1,), (1,), ()), writes=[var], executor="gpu")
second = eng.push(lambda ctx: None, reads=[var], executor="gpu")
for task in (first, second):
    try:
        task.result(60)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        print("failed:", exc, flush=True)
    else:
        print("succeeded", flush=True)
os._exit(0)
"""


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_error_at_completion_fails_the_task(completion):
    result = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT, completion],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("failed:") for line in lines), result.stdout


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_cross_stream_order(real_eng):
    import cupy

    kernel = _slow_fill()
    buffer = cupy.zeros(32, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()

    def produce(value, ctx):
        kernel((1,), (32,), (buffer, cupy.float32(value), cupy.int64(SLOW_CYCLES)))

    def consume_after(ctx):
        ctx.after(*ctx.last_events("copy"))
        return buffer.copy()

    # Not ordered by the engine (no shared var): ordered on the GPU by ctx.after.
    real_eng.push(GPUWork(produce, kind="copy"), 1.0, writes=[real_eng.new_var()], executor="gpu")
    unordered = real_eng.push(consume_after, writes=[real_eng.new_var()], executor="gpu")
    assert (unordered.result(REAL_WAIT_S).get() == 1).all()
    # Ordered by the engine through a var, on two streams: no GPU wait needed.
    var = real_eng.new_var()
    real_eng.push(GPUWork(produce, kind="copy"), 2.0, writes=[var], executor="gpu")
    ordered = real_eng.push(lambda ctx: buffer.copy(), reads=[var], executor="gpu")
    assert (ordered.result(REAL_WAIT_S).get() == 2).all()
