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

GPU tasks run on the engine's ``"gpu"`` executor (:class:`engine.GPUExecutor`), registered on
the store's engine when the first GPU key is initialized.
"""

from __future__ import annotations

import asyncio
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
from akv.gpu_stream import follow, note_read, note_write, pending, reduce_on_stream, settle
from akv.keys import Entry
from akv.local import GUARD, LocalBackend
from engine import (
    Completed,
    Engine,
    GPUContext,
    GPUExecutor,
    GPUWork,
    Waitable,
    gather,
)

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


def reduce_at_call(device: int, arrays: list[Array], buffer: Array) -> tuple[Array, Any]:
    """Sum ``arrays`` into ``buffer`` (on GPU ``device``) on the caller's current stream there;
    return the buffer and an event recorded after the sum.

    Enqueued on the caller's stream, the sum reads the arrays after the caller's own queued
    work and before anything the caller queues later: once the call returns, the caller may
    change its arrays. A task that uses the buffer waits for the event on the GPU. One
    kernel per chunk reads every value once (:func:`akv.gpu_stream.reduce_on_stream`).
    """
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        reduce_on_stream(device, arrays, buffer)
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


def register_gpu_executor(engine: Engine, make: Callable[[], GPUExecutor]) -> GPUExecutor:
    """Register the engine's ``"gpu"`` executor (once per engine: the caller remembers);
    return it.

    Raises
    ------
    GPUUnavailableError
        CuPy is not installed.
    """
    if cupy_module() is None:
        raise GPUUnavailableError("GPU values were given, and CuPy is not installed")
    executor = make()
    engine.register_executor(GPU, executor)
    return executor


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
        ctx.after(event, *pending(entry))
        entry.gpu_after = []  # this task's completion orders what comes later
        if updater is None:
            entry.value = buffer
        else:
            assert entry.value is not None  # set by init, which every push is ordered after
            GUARD.run(store, updater, entry.key, buffer, entry.value)


def _pull_gpu(targets: KeyArrays, result: object, events: list[Any], ctx: GPUContext) -> object:
    ctx.after(*events)
    for entry, outs in targets:
        ctx.after(*pending(entry))
        for out in outs:
            if is_gpu(out):
                copy_async(out, entry.value, ctx.stream)  # on this task's stream
            else:
                copy_into(out, entry.value)  # waits for the copy (host memory)
    return result


# ---------------------------------------------------------------- on the caller's stream


def _push_now(store: object, updater: Updater | None, entry: Entry, arrays: list[Array]) -> None:
    """A push of one GPU key, enqueued on the caller's current stream of its merge GPU:
    the sum straight into the stored value (no updater), or into a buffer the updater
    applies there; no engine task, no host wait."""
    cupy = cupy_module()
    assert entry.device is not None and entry.value is not None  # a GPU key, initialized
    with cupy.cuda.Device(entry.device):
        stream = cupy.cuda.get_current_stream()
        follow(entry, stream, writing=True)
        if updater is None:
            reduce_on_stream(entry.device, arrays, entry.value)
        else:
            summed = reduce_on_stream(entry.device, arrays, cupy.empty(entry.shape, entry.dtype))
            GUARD.run(store, updater, entry.key, summed, entry.value)
        note_write(entry, stream)


def _pull_now(
    entry: Entry, outs: list[Array], executor: GPUExecutor, result: object
) -> Waitable | None:
    """A pull of one GPU key into outputs on its GPU or in host memory, enqueued on the
    caller's current stream of the key's GPU; returns the completion of the GPU copies, with
    ``result`` (None when every output is in host memory: those copies are done at the
    return)."""
    cupy = cupy_module()
    assert entry.device is not None and entry.value is not None
    value = entry.value
    with cupy.cuda.Device(entry.device):
        stream = cupy.cuda.get_current_stream()
        follow(entry, stream, writing=False)
        done = None
        gpu_outs = [out for out in outs if is_gpu(out)]
        if gpu_outs:
            for out in gpu_outs:
                cupy.copyto(out, value)
            event = note_read(entry, stream)
            done = executor.event_done(entry.device, event, result, name="pull")
        host_outs = [out for out in outs if not is_gpu(out)]
        if host_outs:
            host = value.get(stream=stream)  # blocking: done when this returns
            for out in host_outs:
                np.copyto(out, host)
    return done


_PUSHED = Completed(None, "push")


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
        self._gpu_executor: GPUExecutor | None = None
        self._gpu_entries: list[Entry] = []

    # ------------------------------------------------------------ splitting host from GPU

    def _gpu_ready(self) -> GPUExecutor:
        if self._gpu_executor is None:
            self._gpu_executor = register_gpu_executor(self._engine, self._make_executor)
        return self._gpu_executor

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
            self._gpu_entries.append(entry)
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
        """Host keys as the local store. A GPU key whose var is free is pushed on the
        caller's current stream (:func:`_push_now`: no task, done at the call); the others
        are summed at the call and applied by a task on a compute stream."""
        host, gpus = _by_device(values)
        if not gpus:
            return super().push(_on_host(values), priority, borrow)
        tasks = [super().push(_on_host(host), priority, borrow)] if host else []
        updater = self.updater
        for device, items in gpus.items():
            queued = []
            for entry, arrays in items:
                done = self._engine.run_now(
                    _push_now, self._store, updater, entry, arrays, writes=(entry.var,), name="push"
                )
                if done is None:
                    queued.append((entry, arrays))
                elif done.failed():
                    tasks.append(done)
            if not queued:
                continue
            staged = [(entry, *_stage(entry, arrays)) for entry, arrays in queued]
            tasks.append(
                self._engine.push(
                    GPUWork(_land_gpu, device=device, kind="compute"),
                    self._store,
                    updater,
                    staged,
                    writes=[entry.var for entry, _, _ in staged],
                    priority=priority,
                    executor=GPU,
                    name="push",
                )
            )
        return _joined(tasks, None) if tasks else _PUSHED

    def pull(self, targets: KeyArrays, result: object, priority: int) -> Waitable:
        """Host keys as the local store. A GPU key whose var is free, pulled into outputs
        on its GPU or in host memory, is copied on the caller's current stream
        (:func:`_pull_now`), the pull completing with the copies (an event; no task); the
        others are copied by a task on a copy stream of the key's GPU."""
        host, gpus = _by_device(targets)
        if not gpus:
            return super().pull(targets, result, priority)
        tasks = [super().pull(host, result, priority)] if host else []
        executor = self._gpu_ready()
        for device, items in gpus.items():
            queued = []
            copied = None  # on one stream: the latest copy's completion covers the others
            for entry, outs in items:
                done = None
                if all(device_of(out) in (None, device) for out in outs):
                    done = self._engine.run_now(
                        _pull_now, entry, outs, executor, result, reads=(entry.var,), name="pull"
                    )
                if done is None:
                    queued.append((entry, outs))
                elif done.failed():
                    tasks.append(done)
                else:
                    copied = done.result() or copied
            if copied is not None:
                tasks.append(copied)
            if not queued:
                continue
            tasks.append(
                self._engine.push(
                    GPUWork(_pull_gpu, device=device, kind="copy"),
                    queued,
                    result,
                    record_on_callers(out for _, outs in queued for out in outs),
                    reads=[entry.var for entry, _ in queued],
                    priority=priority,
                    executor=GPU,
                    name="pull",
                )
            )
        if not tasks:
            return Completed(result, "pull")
        return _joined(tasks, result)

    def _settle(self, entries: list[Entry]) -> None:
        """Wait for the keys' GPU work on callers' streams (before states are read)."""
        settle(entries)

    async def close(self, barrier_before_exit: bool) -> None:
        """Wait for the GPU work enqueued on callers' streams (the values' memory goes back
        to CuPy's pool with the store)."""
        if self._gpu_entries:
            await asyncio.to_thread(settle, list(self._gpu_entries))
        await super().close(barrier_before_exit)


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
