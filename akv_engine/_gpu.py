"""GPU tasks: functions that enqueue work on CUDA streams, completed without blocking.

A :class:`GPUExecutor` is registered with ``Engine.register_executor("gpu", executor)``.
A task pushed with ``executor="gpu"`` runs ``fn(*args, ctx)``, where ``ctx`` is a
:class:`GPUContext` naming the device and the stream leased to the task, with that device and
stream current. The function only *enqueues* GPU work (CuPy calls on the current stream) and
returns; the task completes, with that return value, once the stream has finished the work.

Which device and which kind of stream (``"compute"`` or ``"copy"``) a task uses is set by
pushing a :class:`GPUWork` wrapper instead of the bare function; a bare function runs on
device 0's compute streams.

Every CUDA call goes through a :class:`CudaDriver` (:class:`CupyDriver` in production, a fake
in the tests), so that the executor's logic runs and is tested without a GPU. ``cupy`` is
imported only when a :class:`CupyDriver` is made.

Threads, per device that has had a task: one *device thread* that creates the device's
streams, runs the task functions and hands completions to the engine; with the ``"waiter"``
completion strategy also one *waiter thread* per stream that blocks on the end events of the
stream's tasks.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from akv_engine._errors import EngineClosedError, EngineError
from akv_engine._executors import DoneCallback
from akv_engine._gpu_events import EventWatcher
from akv_engine._task import Waitable

__all__ = [
    "CLOSE_TIMEOUT_S",
    "COMPLETION_ENV",
    "DEFAULT_COMPLETION",
    "DEFAULT_COMPUTE_STREAMS",
    "DEFAULT_COPY_STREAMS",
    "HEALTH_CHECK_INTERVAL_S",
    "Completion",
    "CudaDriver",
    "CupyDriver",
    "GPUContext",
    "GPUExecutor",
    "GPUStatistics",
    "GPUWork",
    "StreamKind",
    "gpu_available",
]

log = logging.getLogger("akv_engine.gpu")

StreamKind = Literal["compute", "copy"]
#: How the executor learns that a task's stream work finished (see :class:`GPUExecutor`).
Completion = Literal["host_func", "waiter"]
STREAM_KINDS: tuple[StreamKind, ...] = ("compute", "copy")
COMPLETIONS: tuple[Completion, ...] = ("host_func", "waiter")

#: The completion strategy when none is given: the waiter threads, measured on an H200 at
#: about two thirds of host callbacks' latency per task, with less CPU (docs/engine.md).
DEFAULT_COMPLETION: Completion = "waiter"
#: Set to ``host_func`` or ``waiter`` to choose the strategy of executors made without one.
COMPLETION_ENV = "ENGINE_GPU_COMPLETION"
#: Streams per device for each kind (MXNet's engine has two copy workers per device).
DEFAULT_COMPUTE_STREAMS = 2
DEFAULT_COPY_STREAMS = 2
#: With ``host_func``, how often an idle device thread asks the driver whether launched work
#: failed (cudaLaunchHostFunc never calls back after a device error). ``None`` turns it off.
HEALTH_CHECK_INTERVAL_S = 1.0
#: How long ``close()`` waits for work in flight before failing it.
CLOSE_TIMEOUT_S = 30.0

_CUDA_NOT_READY = 600  # cudaErrorNotReady (and hipErrorNotReady)
#: End events kept per device for reuse.
_MAX_FREE_EVENTS = 16


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one GPU; never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) >= 1
    except Exception:
        return False


class CudaDriver(Protocol):
    """Every CUDA call the executor makes: the seam that a fake replaces in tests.

    Streams and events are opaque objects of the driver. Calls come from the executor's
    device and waiter threads only, never from a host-function callback.
    """

    def device_count(self) -> int:
        """How many devices are visible."""
        ...

    def new_stream(self, device: int) -> Any:
        """A new non-blocking stream on ``device`` (it does not sync with the null stream)."""
        ...

    def new_event(self, device: int, blocking: bool) -> Any:
        """A new event on ``device`` without timing; ``blocking`` makes a host wait sleep."""
        ...

    def use(self, device: int, stream: Any) -> AbstractContextManager[None]:
        """Make ``device`` and ``stream`` current on this thread for the ``with`` block."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the current end of ``stream``."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait, on the GPU, until ``event`` has happened."""
        ...

    def launch_host_func(self, stream: Any, callback: Callable[[Any], None], arg: Any) -> None:
        """Call ``callback(arg)`` on a driver thread once the work enqueued before it is done.

        The callback holds the GIL, must make no CUDA call and must not raise.
        """
        ...

    def query_event(self, event: Any) -> bool:
        """Whether ``event`` has happened, without blocking; raises the device's CUDA error."""
        ...

    def synchronize_event(self, event: Any) -> None:
        """Block (sleeping, without the GIL) until ``event`` has happened, or raise its error."""
        ...


class CupyDriver(CudaDriver):
    """:class:`CudaDriver` over CuPy (imported here, not when ``akv_engine`` is).

    What it relies on in CuPy (``cupy_backends/cuda/api/runtime.pyx``): ``eventSynchronize``,
    ``launchHostFunc``, ``streamWaitEvent`` and kernel launches release the GIL while in the
    driver, so no thread blocks in CUDA holding the GIL a host-function callback needs.
    ``runtime.eventQuery`` returns the status unchecked (``Event.done`` turns an error into
    False), so :meth:`query_event` checks it itself.

    Raises
    ------
    ImportError
        When CuPy is not installed.
    """

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise ImportError(
                f"GPU tasks need CuPy: pip install 'akvstore[gpu]' ({exc})", name="cupy"
            ) from exc
        self._cupy = cupy

    def device_count(self) -> int:
        return int(self._cupy.cuda.runtime.getDeviceCount())

    def new_stream(self, device: int) -> Any:
        with self._cupy.cuda.Device(device):
            return self._cupy.cuda.Stream(non_blocking=True)

    def new_event(self, device: int, blocking: bool) -> Any:
        with self._cupy.cuda.Device(device):
            return self._cupy.cuda.Event(block=blocking, disable_timing=True)

    @contextlib.contextmanager
    def use(self, device: int, stream: Any) -> Iterator[None]:
        with self._cupy.cuda.Device(device), stream:
            yield

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def launch_host_func(self, stream: Any, callback: Callable[[Any], None], arg: Any) -> None:
        stream.launch_host_func(callback, arg)

    def query_event(self, event: Any) -> bool:
        runtime = self._cupy.cuda.runtime
        status = int(runtime.eventQuery(event.ptr))
        if status == 0:
            return True
        if status == _CUDA_NOT_READY:
            return False
        raise runtime.CUDARuntimeError(status)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()


@dataclass(frozen=True)
class GPUWork:
    """A function for the GPU executor, with the device and the kind of stream it runs on.

    Push it in place of the function: ``eng.push(GPUWork(copy_in, device=1, kind="copy"),
    host_array, writes=[v], executor="gpu")`` runs ``copy_in(host_array, ctx)`` on one of
    device 1's copy streams. Copy streams are kept apart from compute streams so that
    transfers overlap computation. The task's default name is the function's name.

    Raises
    ------
    EngineError
        For a negative device or an unknown kind.
    """

    fn: Callable[..., Any]
    device: int = 0
    kind: StreamKind = "compute"

    def __post_init__(self) -> None:
        if not isinstance(self.device, int) or self.device < 0:
            raise EngineError(f"GPUWork(device={self.device!r}): device must be an int >= 0")
        if self.kind not in STREAM_KINDS:
            raise EngineError(f"GPUWork(kind={self.kind!r}): kind must be one of {STREAM_KINDS}")
        # The engine names a task after its function's __name__.
        object.__setattr__(self, "__name__", self.name)

    @property
    def name(self) -> str:
        """The function's name."""
        return str(getattr(self.fn, "__name__", "gpu_task"))

    def __call__(self, *args: Any) -> Any:
        raise EngineError(
            f"GPUWork({self.name}) runs only on a GPU executor: push it with "
            "executor='gpu' (the name the GPUExecutor was registered under)"
        )


@dataclass(frozen=True)
class GPUStatistics:
    """A snapshot of a :class:`GPUExecutor`'s counters.

    ``in_flight`` tasks were submitted and have not completed; ``leased_streams`` counts the
    streams that hold at least one of them. ``events_made``: end events created (they are
    pooled per device and reused once their task completed). ``watched``: waitables of
    :meth:`GPUExecutor.event_done` handed to a watcher thread.
    """

    completion: Completion
    devices: int
    submitted: int
    completed: int
    failed: int
    in_flight: int
    leased_streams: int
    events_made: int = 0
    watched: int = 0


class _Slot:
    """One stream of a device's pool: its lease count, latest end event, waiter's queue."""

    __slots__ = ("busy", "index", "kind", "last_event", "stream", "waiter_queue")

    def __init__(self, stream: Any, kind: StreamKind, index: int) -> None:
        self.stream = stream
        self.kind = kind
        self.index = index
        self.busy = 0
        self.last_event: Any = None
        self.waiter_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()


class _Job:
    __slots__ = ("args", "done", "end_event", "fn", "id", "kind", "result", "slot")

    def __init__(
        self, job_id: int, work: GPUWork, args: tuple[Any, ...], done: DoneCallback
    ) -> None:
        self.id = job_id
        self.fn: Callable[..., Any] | None = work.fn
        self.kind = work.kind
        self.args: tuple[Any, ...] | None = args
        self.done = done
        self.result: Any = None
        self.slot: _Slot | None = None
        self.end_event: Any = None


class _Device:
    """The state of one device: its stream pools, threads and tasks in flight."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.pools: dict[str, list[_Slot]] = {}
        self.next_slot: dict[str, int] = dict.fromkeys(STREAM_KINDS, 0)
        self.broken: BaseException | None = None
        self.in_flight: dict[int, _Job] = {}
        self.threads: list[threading.Thread] = []
        #: End events of completed tasks, for reuse (appended under the executor's lock,
        #: taken by the device thread only).
        self.free_events: list[Any] = []


class GPUContext:
    """What a GPU task's function receives as its last argument.

    It is valid while the function runs, on the executor's device thread, with ``device``
    and ``stream`` current (CuPy calls there enqueue on ``stream``).

    Guarantees
    ----------
    A task starts only after the tasks it depends on (through vars) have *completed*, so
    their GPU work is finished and needs no GPU-side wait. :meth:`after` is for work the
    engine does not order: a task on another stream, pushed without a shared var, whose
    results this one reads.
    """

    __slots__ = ("_device", "_driver", "_slot")

    def __init__(self, driver: CudaDriver, device: _Device, slot: _Slot) -> None:
        self._driver = driver
        self._device = device
        self._slot = slot

    @property
    def device(self) -> int:
        """The device the task runs on."""
        return self._device.index

    @property
    def kind(self) -> StreamKind:
        """``"compute"`` or ``"copy"``: the pool the stream was leased from."""
        return self._slot.kind

    @property
    def stream(self) -> Any:
        """The leased stream (a ``cupy.cuda.Stream`` with :class:`CupyDriver`)."""
        return self._slot.stream

    @property
    def stream_index(self) -> int:
        """The stream's position in its pool (``0 .. streams - 1``)."""
        return self._slot.index

    def after(self, *events: Any) -> None:
        """Make work enqueued from now on on this stream wait, on the GPU, for ``events``.

        It is ``cudaStreamWaitEvent``: no host thread waits.
        """
        for event in events:
            self._driver.wait_event(self._slot.stream, event)

    def last_events(self, kind: StreamKind | None = None) -> list[Any]:
        """The end events of the latest task launched on each *other* stream of this device.

        With ``kind``, only streams of that pool. ``ctx.after(*ctx.last_events("copy"))``
        orders this task's work after everything launched on the copy streams so far.
        """
        events = []
        for pool_kind, slots in self._device.pools.items():
            if kind is not None and pool_kind != kind:
                continue
            for slot in slots:
                if slot is not self._slot and slot.last_event is not None:
                    events.append(slot.last_event)
        return events


_STOP = object()
_LAUNCH = 0
_FINISHED = 1


def _host_func_done(arg: tuple[queue.SimpleQueue[Any], int]) -> None:
    # Runs on a CUDA driver thread, holding the GIL: it makes no CUDA call and only posts the
    # job's id (the job holds CUDA objects, which must not be freed on this thread). Nothing
    # may escape: CuPy's trampoline would drop the exception and leak the callback.
    with contextlib.suppress(BaseException):
        arg[0].put((_FINISHED, arg[1]))


class GPUExecutor:
    """Runs GPU tasks on per-device pools of streams; reports completion without blocking.

    Guarantees
    ----------
    * ``fn(*args, ctx)`` runs on the device's thread with the device and a leased stream
      current; ``ctx`` is a :class:`GPUContext`. The task completes with ``fn``'s return
      value once the stream has finished the work enqueued by ``fn``; no thread of the
      engine or the event loop blocks or polls for it.
    * Each device has ``compute_streams`` compute and ``copy_streams`` copy streams,
      non-blocking, created on its first task. A task leases the least busy stream of its
      kind (ties in turn) and returns it when it completes; streams are shared when there
      are more tasks than streams.
    * The end of every task is recorded as an event; :meth:`GPUContext.last_events` and
      :meth:`GPUContext.after` let a task on another stream wait for it on the GPU.
    * A task fails with the exception ``fn`` raised, or with the CUDA error seen when its
      work completes (also an error of the device that the stream callbacks do not report:
      see ``health_check_s``). A bad device index fails the task with :class:`EngineError`.
    * ``done`` is called exactly once per task, from the device thread (``host_func``) or
      the stream's waiter thread (``waiter``); the engine may run inline dependents there.

    Parameters
    ----------
    driver:
        The CUDA calls; by default a :class:`CupyDriver` (which needs CuPy).
    completion:
        ``"host_func"``: ``cudaLaunchHostFunc`` after the task's work; the callback posts the
        task's id to the device thread, which completes it. ``"waiter"``: a thread per
        stream blocks on the end event of each of the stream's tasks in turn (events made
        with ``cudaEventBlockingSync``, so the wait sleeps; one thread per stream, so a
        long task on one stream does not hold back completions on the others).
        By default ``$ENGINE_GPU_COMPLETION``, else ``"waiter"`` (:data:`DEFAULT_COMPLETION`).
    compute_streams, copy_streams:
        The pool sizes per device (each at least 1).
    health_check_s:
        With ``host_func``: while tasks are in flight and nothing else happens, the device
        thread queries their end events this often, failing the tasks of a device that
        hit an error (cudaLaunchHostFunc does not call back then). ``None``: only when a
        later launch on the device fails.
    name:
        The prefix of the threads' names.

    Raises
    ------
    EngineError
        For an unknown completion strategy or pool sizes below 1.
    """

    def __init__(
        self,
        driver: CudaDriver | None = None,
        *,
        completion: Completion | None = None,
        compute_streams: int = DEFAULT_COMPUTE_STREAMS,
        copy_streams: int = DEFAULT_COPY_STREAMS,
        health_check_s: float | None = HEALTH_CHECK_INTERVAL_S,
        name: str = "gpu",
    ) -> None:
        chosen = completion if completion is not None else os.environ.get(COMPLETION_ENV)
        if chosen is None or chosen == "":
            chosen = DEFAULT_COMPLETION
        if chosen not in COMPLETIONS:
            raise EngineError(
                f"unknown GPU completion strategy {chosen!r} (from the argument or "
                f"${COMPLETION_ENV}); known: {list(COMPLETIONS)}"
            )
        for label, count in (("compute_streams", compute_streams), ("copy_streams", copy_streams)):
            if not isinstance(count, int) or count < 1:
                raise EngineError(f"GPUExecutor({label}={count!r}): must be an int >= 1")
        self._driver: CudaDriver = driver if driver is not None else CupyDriver()
        self._completion: Completion = "waiter" if chosen == "waiter" else "host_func"
        self._pool_sizes: dict[StreamKind, int] = {"compute": compute_streams, "copy": copy_streams}
        self._health_check_s = health_check_s if self._completion == "host_func" else None
        self._name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._devices: dict[int, _Device] = {}
        self._num_devices: int | None = None
        self._closed = False
        self._submitted = self._completed = self._failed = self._events_made = 0
        self._events = EventWatcher(self._driver, name)

    @property
    def completion(self) -> Completion:
        """The completion strategy in use."""
        return self._completion

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        """Queue ``fn`` (a :class:`GPUWork` or a function for device 0's compute streams).

        Never raises: every problem reaches ``done`` as the task's exception.
        """
        try:
            work = fn if isinstance(fn, GPUWork) else GPUWork(fn)
            num_devices = self._device_count()
            if work.device >= num_devices:
                raise EngineError(
                    f"GPU task {work.name!r}: device {work.device} does not exist "
                    f"({num_devices} visible)"
                )
            with self._lock:
                if self._closed:
                    raise EngineClosedError(f"GPU executor {self._name!r} is closed")
                job = _Job(next(self._ids), work, args, done)
                device = self._device_locked(work.device)
                device.in_flight[job.id] = job
                self._submitted += 1
        except Exception as exc:
            _call_done(done, None, exc)
            return
        device.queue.put((_LAUNCH, job))

    def event_done(
        self, device: int, event: Any, result: Any = None, name: str = "gpu event"
    ) -> Waitable:
        """A waitable that completes with ``result`` once ``event`` has happened: the
        completion of GPU work enqueued outside any task (on a caller's own stream), with no
        task and no thread involved until somebody waits for it (``result()`` without a
        timeout waits on the calling thread; ``await`` and callbacks through a watcher
        thread of ``device``). ``event`` must be made with blocking sync
        (``new_event(device, blocking=True)``); a CUDA error of the wait fails the waitable.
        """
        return self._events.make(device, event, result, name)

    def statistics(self) -> GPUStatistics:
        """The counters now (see :class:`GPUStatistics`)."""
        with self._lock:
            return GPUStatistics(
                completion=self._completion,
                devices=len(self._devices),
                submitted=self._submitted,
                completed=self._completed,
                failed=self._failed,
                in_flight=sum(len(d.in_flight) for d in self._devices.values()),
                leased_streams=sum(
                    1
                    for d in self._devices.values()
                    for slots in d.pools.values()
                    for slot in slots
                    if slot.busy
                ),
                events_made=self._events_made,
                watched=self._events.watched,
            )

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Refuse new tasks, wait up to ``timeout`` s for those in flight, stop the threads.

        Tasks still in flight after ``timeout`` fail with :class:`EngineClosedError` (their
        GPU work may still run; a late completion is ignored). Later submits fail the same
        way. Idempotent. (The engine closes its executors after its tasks finished, so this
        normally finds nothing in flight.)
        """
        current = threading.current_thread()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._closed = True
            devices = list(self._devices.values())
            own_thread = any(current in d.threads for d in devices)
            # On its own device thread, completions could not be processed while waiting.
            while not own_thread and any(d.in_flight for d in devices):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._idle.wait(remaining)
            leftovers = [(d, job) for d in devices for job in list(d.in_flight.values())]
        for device, job in leftovers:
            self._complete(
                device,
                job,
                None,
                EngineClosedError(f"GPU executor {self._name!r} closed before the work completed"),
            )
        for device in devices:
            device.queue.put(_STOP)  # the device thread stops its waiters
        for device in devices:
            self._join(device.threads[0], current, deadline)
            # Read after the device thread ended: it adds its waiters to the list as it starts.
            for thread in device.threads[1:]:
                self._join(thread, current, deadline)
        self._events.close(deadline)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _join(thread: threading.Thread, current: threading.Thread, deadline: float | None) -> None:
        # Past the deadline this does not wait: a waiter blocked on work that did not finish
        # stays (a daemon thread) until that work ends.
        if thread is not current:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)

    def _device_count(self) -> int:
        if self._num_devices is None:
            self._num_devices = self._driver.device_count()
        return self._num_devices

    def _device_locked(self, index: int) -> _Device:
        device = self._devices.get(index)
        if device is None:
            device = self._devices[index] = _Device(index)
            thread = threading.Thread(
                target=self._run_device,
                args=(device,),
                name=f"{self._name}-dev{index}",
                daemon=True,
            )
            device.threads.append(thread)
            thread.start()
        return device

    def _run_device(self, device: _Device) -> None:
        try:
            self._make_streams(device)
        except BaseException as exc:
            device.broken = exc
        try:
            self._serve_device(device)
        finally:
            for slots in device.pools.values():
                for slot in slots:
                    slot.waiter_queue.put(_STOP)

    def _make_streams(self, device: _Device) -> None:
        for kind, size in self._pool_sizes.items():
            slots = device.pools[kind] = []
            for i in range(size):
                slot = _Slot(self._driver.new_stream(device.index), kind, i)
                slots.append(slot)
                if self._completion == "waiter":
                    thread = threading.Thread(
                        target=self._run_waiter,
                        args=(device, slot),
                        name=f"{self._name}-dev{device.index}-{kind}{i}-waiter",
                        daemon=True,
                    )
                    device.threads.append(thread)
                    thread.start()

    def _serve_device(self, device: _Device) -> None:
        get = device.queue.get
        while True:
            timeout = self._health_check_s if device.in_flight else None
            try:
                item = get(timeout=timeout)
            except queue.Empty:
                self._check_in_flight(device)
                continue
            if item is _STOP:
                return
            tag, payload = item
            if tag == _LAUNCH:
                self._launch(device, payload)
            else:
                self._finish_host_func(device, payload)

    def _launch(self, device: _Device, job: _Job) -> None:
        fn, args = job.fn, job.args
        job.fn = job.args = None
        with self._lock:
            if job.id not in device.in_flight or fn is None or args is None:
                return  # failed by close() while queued
        if device.broken is not None:
            self._complete(device, job, None, device.broken)
            return
        slot = self._lease(device, job.kind)
        job.slot = slot
        try:
            with self._driver.use(device.index, slot.stream):
                result = fn(*args, GPUContext(self._driver, device, slot))
                if inspect.iscoroutine(result):
                    result.close()
                    raise EngineError(
                        "a GPU task returned a coroutine: its function must enqueue GPU "
                        "work and return, not be a coroutine function"
                    )
                event = self._end_event(device)
                self._driver.record(event, slot.stream)
            slot.last_event = event
            job.result = result
            job.end_event = event
            if self._completion == "host_func":
                self._driver.launch_host_func(slot.stream, _host_func_done, (device.queue, job.id))
            else:
                slot.waiter_queue.put(job)
        except BaseException as exc:
            self._complete(device, job, None, exc)
            # A CUDA error may be sticky: then work launched earlier failed too, silently.
            self._check_in_flight(device)

    def _end_event(self, device: _Device) -> Any:
        """A pooled end event of ``device``, or a new one (blocking sync: waits sleep)."""
        free = device.free_events
        if free:
            return free.pop()  # only this (the device) thread takes from the pool
        self._events_made += 1
        return self._driver.new_event(device.index, True)

    def _lease(self, device: _Device, kind: StreamKind) -> _Slot:
        slots = device.pools[kind]
        start = device.next_slot[kind]
        with self._lock:
            slot = min(
                (slots[(start + i) % len(slots)] for i in range(len(slots))),
                key=lambda s: s.busy,
            )
            slot.busy += 1
        device.next_slot[kind] = (slot.index + 1) % len(slots)
        return slot

    def _finish_host_func(self, device: _Device, job_id: int) -> None:
        with self._lock:
            job = device.in_flight.get(job_id)
        if job is None:  # failed already (health check, close)
            return
        try:
            # The callback ran after the event in stream order; the query only surfaces an
            # error of the device.
            self._driver.query_event(job.end_event)
        except BaseException as exc:
            self._complete(device, job, None, exc)
            self._check_in_flight(device)
            return
        self._complete(device, job, job.result, None)

    def _check_in_flight(self, device: _Device) -> None:
        if self._completion != "host_func":
            return  # the waiter's synchronize raises the error itself
        with self._lock:
            launched = [job for job in device.in_flight.values() if job.end_event is not None]
        for job in launched:
            try:
                self._driver.query_event(job.end_event)
            except BaseException as exc:
                self._complete(device, job, None, exc)

    def _run_waiter(self, device: _Device, slot: _Slot) -> None:
        get = slot.waiter_queue.get
        synchronize = self._driver.synchronize_event
        while True:
            job = get()
            if job is _STOP:
                return
            try:
                synchronize(job.end_event)
            except BaseException as exc:
                self._complete(device, job, None, exc)
            else:
                self._complete(device, job, job.result, None)

    def _complete(self, device: _Device, job: _Job, result: Any, exc: BaseException | None) -> None:
        """Return the job's stream and call its ``done``, unless it was completed already."""
        with self._lock:
            if device.in_flight.pop(job.id, None) is None:
                return
            if job.slot is not None:
                job.slot.busy -= 1
            if exc is None:
                self._completed += 1
                # The event has happened: it may be recorded again (a task waiting on it
                # through last_events() then waits for a later point, never an earlier one).
                if job.end_event is not None and len(device.free_events) < _MAX_FREE_EVENTS:
                    device.free_events.append(job.end_event)
            else:
                self._failed += 1
            if self._closed and not device.in_flight:
                self._idle.notify_all()
        job.result = None
        _call_done(job.done, result, exc)


def _call_done(done: DoneCallback, result: Any, exc: BaseException | None) -> None:
    try:
        done(result, exc)
    except Exception:
        # Nothing to hand it to: raising would end a device thread and hang every later
        # task. (The engine's done raises when a waiting loop was closed.)
        log.exception("akv_engine.gpu: a task's completion callback raised")
