"""The ``device`` store's backend: values and merge buffers on GPUs, work on CuPy streams.

MXNet's ``device`` store (CommDevice) reduces on the GPUs instead of in host memory. Here:

* A key initialized from a GPU array (CuPy, a CUDA torch tensor, a GPU JAX array) keeps its
  value on one GPU, its *merge device*. Merge devices are placed as CommDevice places its
  merge buffers (:class:`MergePlacement`): each init call's keys by size, largest first,
  each to the GPU with the fewest bytes assigned so far.
* A push copies the values it is given to the merge device and sums them there, at the call
  and on the caller's current CUDA stream (so the values are read after the caller's own
  queued work, and the caller may reuse its arrays once the call returns). The engine task
  that applies the sum (assignment, an updater, an optimizer) runs on a compute stream of the
  merge device and waits for that staging on the GPU (``cudaStreamWaitEvent``), never on
  the host.
* A pull copies the value to each output on a copy stream of the merge device; a GPU output
  on another device gets a peer copy.
* A key initialized from a host array (NumPy, a CPU tensor) behaves exactly as in the
  ``local`` store: so a machine without a GPU runs every ``device`` store program, as MXNet's
  device store does with CPU contexts.

GPU tasks run on the engine's ``"gpu"`` executor (:class:`akv_engine.GPUExecutor`), registered on
the store's engine when the first GPU key is initialized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from akv.args import Key
from akv.arrays import (
    Array,
    copy_into,
    cupy_module,
    device_of,
    is_gpu,
    record_on_callers,
    to_host,
)
from akv.backend import KeyArrays, Updater
from akv.errors import GPUUnavailableError, InvalidArgumentError
from akv.keys import Entry, merge_into
from akv.local import GUARD, LocalBackend
from akv_engine import Engine, GPUContext, GPUExecutor, GPUWork, Waitable, gather

__all__ = [
    "DeviceBackend",
    "MergePlacement",
    "copy_async",
    "from_pinned",
    "reduce_at_call",
    "register_gpu_executor",
    "to_pinned",
]

GPU = "gpu"


class MergePlacement:
    """Which GPU each key lives on: MXNet CommDevice's rule, remembered across calls.

    ``assign`` takes one call's keys with their sizes and the candidate GPUs; it places the
    keys largest first (ties in the order given), each on the candidate with the fewest bytes
    assigned so far (ties to the lowest device number), and counts the bytes.
    """

    def __init__(self) -> None:
        self.assigned: dict[int, int] = {}

    def assign(self, sizes: Sequence[tuple[Key, int]], devices: Sequence[int]) -> dict[Key, int]:
        """``{key: device}`` for ``sizes`` (``[(key, bytes), ...]``) over ``devices``."""
        if not devices:
            raise InvalidArgumentError("merge placement needs at least one GPU")
        candidates = sorted(set(devices))
        for device in candidates:
            self.assigned.setdefault(device, 0)
        placed: dict[Key, int] = {}
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i][1]):
            key, nbytes = sizes[index]
            device = min(candidates, key=lambda d: (self.assigned[d], d))
            self.assigned[device] += nbytes
            placed[key] = device
        return placed


def _to_device(array: Array, device: int) -> Array:
    """``array`` on GPU ``device``: itself, or a copy on the current stream there.

    A copy from another GPU is ordered on both: it waits (on the GPU) for the work queued so
    far on the caller's current stream of the source GPU, and work queued there later waits
    for the copy (so the caller may overwrite the array once the call returns).
    """
    source = device_of(array)
    if source == device:
        return array
    cupy = cupy_module()
    if source is None:  # host memory: staged at the call, copied on the current stream
        with cupy.cuda.Device(device):
            copy = cupy.empty(array.shape, array.dtype)
            copy.set(np.ascontiguousarray(array))
            return copy
    with cupy.cuda.Device(source):
        array = cupy.ascontiguousarray(array)
        source_stream = cupy.cuda.get_current_stream()
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(source_stream)
    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream()
        stream.wait_event(ready)
        copy = cupy.empty(array.shape, array.dtype)
        cupy.copyto(copy, array)  # a peer copy, on this stream
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(stream)
    with cupy.cuda.Device(source):
        source_stream.wait_event(copied)
    return copy


def reduce_at_call(device: int, arrays: list[Array], buffer: Array) -> tuple[Array, Any]:
    """Sum ``arrays`` into ``buffer`` (on GPU ``device``) on the caller's current stream there;
    return the buffer and an event recorded after the sum.

    Enqueued on the caller's stream, the sum reads the arrays after the caller's own queued
    work and before anything the caller queues later: once the call returns, the caller may
    change its arrays. A task that uses the buffer waits for the event on the GPU.
    """
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        local = [_to_device(array, device) for array in arrays]
        merge_into(buffer, local)
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
    return buffer, event


def _stage(entry: Entry, arrays: list[Array]) -> tuple[Array, Any]:
    assert entry.device is not None
    return reduce_at_call(entry.device, arrays, entry.take_buffer())


def copy_async(dst: Array, src: Array, stream: Any) -> None:
    """Enqueue ``dst <- src`` on ``stream``: between a GPU and pinned host memory, or from a
    GPU (the stream's) to a GPU.

    With pinned host memory the copy is asynchronous (a pageable one would block the thread).
    A non-contiguous GPU side goes through a contiguous GPU buffer.
    """
    cupy = cupy_module()
    runtime = cupy.cuda.runtime
    if is_gpu(dst) and is_gpu(src):
        _gpu_to_gpu(dst, src, stream)
        return
    gpu, host = (dst, src) if is_gpu(dst) else (src, dst)
    with gpu.device:
        contiguous = gpu if gpu.flags.c_contiguous else cupy.empty(gpu.shape, gpu.dtype)
        if is_gpu(src):
            if contiguous is not gpu:
                with stream:
                    cupy.copyto(contiguous, gpu)
            kind = runtime.memcpyDeviceToHost
            runtime.memcpyAsync(
                host.ctypes.data, contiguous.data.ptr, host.nbytes, kind, stream.ptr
            )
        else:
            kind = runtime.memcpyHostToDevice
            runtime.memcpyAsync(
                contiguous.data.ptr, host.ctypes.data, host.nbytes, kind, stream.ptr
            )
            if contiguous is not gpu:
                with stream:
                    cupy.copyto(gpu, contiguous)


def _gpu_to_gpu(dst: Array, src: Array, stream: Any) -> None:
    """``dst <- src``, ordered on ``stream`` (of ``src``'s GPU): a peer copy to another GPU is
    a memcpy on the stream; a strided ``dst`` there is then filled on its own GPU, on the
    current stream there, between event waits (CuPy's ``copyto`` would run that part on the
    other GPU's stream, unordered with ``stream``)."""
    cupy = cupy_module()
    with stream:
        if device_of(dst) == device_of(src):
            cupy.copyto(dst, src)
            return
        src = cupy.ascontiguousarray(src)
        if dst.flags.c_contiguous:
            cupy.copyto(dst, src)  # a peer memcpy, on the stream
            return
        with dst.device:
            landing = cupy.empty(dst.shape, dst.dtype)
        cupy.copyto(landing, src)
        landed = cupy.cuda.Event(disable_timing=True)
        landed.record(stream)
    with dst.device:
        other = cupy.cuda.get_current_stream()
        other.wait_event(landed)
        cupy.copyto(dst, landing)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(other)
    stream.wait_event(done)


def to_pinned(staged: list[tuple[Array, Array, Any]], ctx: GPUContext) -> None:
    """A GPU task: copy each summed GPU buffer into its pinned host buffer once its event
    has fired (``staged``: ``[(gpu buffer, pinned buffer, event), ...]``)."""
    for gpu, pinned, event in staged:
        ctx.after(event)
        copy_async(pinned, gpu, ctx.stream)


def from_pinned(
    landed: list[tuple[Array, list[Array]]], events: list[Any], ctx: GPUContext
) -> None:
    """A GPU task: copy each pinned host buffer into its GPU outputs, after ``events`` (see
    :func:`record_on_callers`)."""
    ctx.after(*events)
    for pinned, outs in landed:
        for out in outs:
            copy_async(out, pinned, ctx.stream)


def register_gpu_executor(engine: Engine, make: Callable[[], GPUExecutor]) -> None:
    """Register the engine's ``"gpu"`` executor (once per engine: the caller remembers).

    Raises
    ------
    GPUUnavailableError
        CuPy is not installed.
    """
    if cupy_module() is None:
        raise GPUUnavailableError("GPU values were given, and CuPy is not installed")
    engine.register_executor(GPU, make())


def _init_gpu(staged: list[tuple[Entry, Array, Any]], ctx: GPUContext) -> None:
    for entry, buffer, event in staged:
        ctx.after(event)
        entry.value = buffer


def _land_gpu(
    store: object,
    updater: Updater | None,
    staged: list[tuple[Entry, Array, Any]],
    ctx: GPUContext,
) -> None:
    for entry, buffer, event in staged:
        ctx.after(event)
        if updater is None:
            entry.value = buffer
        else:
            assert entry.value is not None  # set by init, which every push is ordered after
            GUARD.run(store, updater, entry.key, buffer, entry.value)


def _pull_gpu(targets: KeyArrays, result: object, events: list[Any], ctx: GPUContext) -> object:
    ctx.after(*events)
    for entry, outs in targets:
        for out in outs:
            if is_gpu(out):
                copy_async(out, entry.value, ctx.stream)  # on this task's stream
            else:
                copy_into(out, entry.value)  # waits for the copy (host memory)
    return result


class DeviceBackend(LocalBackend):
    """Holds a ``device`` store's values: GPU keys on their merge devices, host keys as in
    the local store."""

    keeps_gpu_arrays = True
    returns_pushes_early = False

    def __init__(
        self,
        engine: Engine,
        store: object,
        inline_max_bytes: int | None,
        devices: Sequence[int] | None = None,
        executor: Callable[[], GPUExecutor] = GPUExecutor,
    ) -> None:
        """``devices``: the GPUs merge buffers may be placed on (by default every GPU an init
        value came from so far). ``executor`` makes the engine's GPU executor (a seam for
        tests)."""
        super().__init__(engine, store, inline_max_bytes)
        self.type = "device"
        self.placement = MergePlacement()
        self._devices = list(devices) if devices is not None else None
        self._seen: set[int] = set()
        self._make_executor = executor
        self._registered = False

    # ------------------------------------------------------------ splitting host from GPU

    def _gpu_ready(self) -> None:
        if not self._registered:
            register_gpu_executor(self._engine, self._make_executor)
            self._registered = True

    # ------------------------------------------------------------ the work

    def init(self, entries: list[Entry], arrays: list[Array]) -> Waitable:
        """Host values as the local store; GPU values placed, then copied at the call."""
        pairs = list(zip(entries, arrays, strict=True))
        gpu = [(entry, array) for entry, array in pairs if is_gpu(array)]
        if not gpu:
            return super().init(entries, arrays)
        self._gpu_ready()
        self._seen.update(d for _, array in gpu if (d := device_of(array)) is not None)
        candidates = self._devices if self._devices is not None else sorted(self._seen)
        places = self.placement.assign([(e.key, e.nbytes) for e, _ in gpu], candidates)
        tasks: list[Waitable] = []
        host = [(entry, array) for entry, array in pairs if not is_gpu(array)]
        if host:
            tasks.append(super().init([e for e, _ in host], [a for _, a in host]))
        by_device: dict[int, list[tuple[Entry, Array, Any]]] = {}
        for entry, array in gpu:
            entry.device = places[entry.key]
            by_device.setdefault(entry.device, []).append((entry, *_stage(entry, [array])))
        for device, staged in by_device.items():
            tasks.append(
                self._engine.push(
                    GPUWork(_init_gpu, device=device, kind="copy"),
                    staged,
                    writes=[entry.var for entry, _, _ in staged],
                    executor=GPU,
                    name="init",
                )
            )
        return _joined(tasks, None)

    def push(self, values: KeyArrays, priority: int, borrow: bool) -> Waitable:
        """Host keys as the local store; GPU keys staged at the call, applied on a stream."""
        host, gpus = _by_device(values)
        if not gpus:
            return super().push(_on_host(values), priority, borrow)
        tasks = [super().push(_on_host(host), priority, borrow)] if host else []
        for device, items in gpus.items():
            staged = [(entry, *_stage(entry, arrays)) for entry, arrays in items]
            tasks.append(
                self._engine.push(
                    GPUWork(_land_gpu, device=device, kind="compute"),
                    self._store,
                    self.updater,
                    staged,
                    writes=[entry.var for entry, _, _ in staged],
                    priority=priority,
                    executor=GPU,
                    name="push",
                )
            )
        return _joined(tasks, None)

    def pull(self, targets: KeyArrays, result: object, priority: int) -> Waitable:
        """Host keys as the local store; GPU keys copied out on a copy stream."""
        host, gpus = _by_device(targets)
        if not gpus:
            return super().pull(targets, result, priority)
        tasks = [super().pull(host, result, priority)] if host else []
        for device, items in gpus.items():
            tasks.append(
                self._engine.push(
                    GPUWork(_pull_gpu, device=device, kind="copy"),
                    items,
                    result,
                    record_on_callers(out for _, outs in items for out in outs),
                    reads=[entry.var for entry, _ in items],
                    priority=priority,
                    executor=GPU,
                    name="pull",
                )
            )
        return _joined(tasks, result)


def _by_device(items: KeyArrays) -> tuple[KeyArrays, dict[int, KeyArrays]]:
    """``items`` split into those of host keys and, per merge GPU, those of GPU keys."""
    host: KeyArrays = []
    gpus: dict[int, KeyArrays] = {}
    for entry, arrays in items:
        if entry.device is None:
            host.append((entry, arrays))
        else:
            gpus.setdefault(entry.device, []).append((entry, arrays))
    return host, gpus


def _on_host(values: KeyArrays) -> KeyArrays:
    """Values of host keys, copied to the host where they came from a GPU (``values``
    itself when none did: the common case allocates nothing)."""
    if all(not is_gpu(array) for _, arrays in values for array in arrays):
        return values
    return [(entry, [to_host(array) for array in arrays]) for entry, arrays in values]


def _joined(tasks: list[Waitable], result: object) -> Waitable:
    """One waitable for a call's tasks (the task itself when there is one)."""
    return tasks[0] if len(tasks) == 1 else gather(tasks, result)
