"""Staging between GPU values and host memory through page-locked (pinned) buffers.

Copies between a GPU and pageable host memory run at a fraction of the link's speed and
block the calling thread; from or into pinned memory they run at full speed, asynchronously
on a stream. Every store that keeps values in host memory (``local``, ``dist_*``) stages GPU
values this way, in pinned buffers kept per key and reused across calls
(``Entry.take_buffer`` once ``entry.pinned`` is set):

* **Push.** A key's GPU values are summed on their GPU at the call, on the caller's stream
  (one kernel: :func:`akv.gpu_stream.reduce_on_stream`), and the sum is copied into a pinned
  buffer on a copy stream: by a GPU task that later work on the key follows
  (:func:`stage_to_pinned`, for the distributed stores, whose send follows it), or at the
  call (:func:`pinned_now`, for the local store, which then treats the buffer as the staged
  sum of a host push: no further copy).
* **Pull.** The value lands in (or is) a pinned buffer, and a copy on a stream writes each
  GPU output from there (:func:`from_pinned`, :func:`copy_async`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from akv.arrays import Array, cupy_module, device_of, is_gpu
from akv.errors import GPUUnavailableError
from akv.gpu_stream import reduce_at_call, reduce_on_stream, side_stream
from akv.keys import Entry
from akv_engine import Engine, GPUContext, GPUExecutor, GPUWork, Var

__all__ = [
    "GPU",
    "copy_async",
    "from_pinned",
    "gpu_only",
    "pinned_now",
    "register_gpu_executor",
    "stage_to_pinned",
    "to_pinned",
]

#: The name the engine's GPU executor is registered under.
GPU = "gpu"


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
            # Its memory comes from the pool of that GPU's current stream, which may still
            # copy out of it for an earlier call (freed on the host once queued there).
            freed = cupy.cuda.Event(disable_timing=True)
            freed.record(cupy.cuda.get_current_stream())
        stream.wait_event(freed)
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


def stage_to_pinned(
    engine: Engine,
    values: list[tuple[Entry, list[Array]]],
    priority: int,
    ready: Callable[[Entry], None],
) -> dict[int, np.ndarray]:
    """Stage each key's GPU values (see the module docstring): summed on their GPU at the
    call, then copied into a pinned buffer of the key by a GPU task per device on a copy
    stream, which writes the keys' vars (work on the keys issued later follows it).
    ``ready(entry)`` readies a key for GPU values first. Returns ``id(entry) -> pinned
    buffer`` for the keys that had GPU values."""
    cupy = cupy_module()
    by_device: dict[int, list[tuple[Array, np.ndarray, Any]]] = {}
    vars_of: dict[int, list[Var]] = {}
    pinned: dict[int, np.ndarray] = {}
    for entry, arrays in values:
        device = next((d for a in arrays if (d := device_of(a)) is not None), None)
        if device is None:
            continue
        ready(entry)
        with cupy.cuda.Device(device):
            summed, event = reduce_at_call(device, arrays, cupy.empty(entry.shape, entry.dtype))
        pinned[id(entry)] = buffer = entry.take_buffer()
        by_device.setdefault(device, []).append((summed, buffer, event))
        vars_of.setdefault(device, []).append(entry.var)
    for device, staged in by_device.items():
        engine.push(
            GPUWork(to_pinned, device=device, kind="copy"),
            staged,
            writes=vars_of[device],
            priority=priority,
            executor=GPU,
            name="stage",
        )
    return pinned


def pinned_now(entry: Entry, arrays: list[Array]) -> np.ndarray:
    """The sum of a key's GPU values in a pinned buffer of the key, copied before this
    returns: summed on the first value's GPU on the caller's stream (a single C-contiguous
    value is copied as it is), then copied on that GPU's copy stream and waited for.
    The key's buffers are pinned from now on."""
    entry.use_pinned()
    cupy = cupy_module()
    device = device_of(arrays[0])
    assert device is not None  # the caller passes GPU values only
    with cupy.cuda.Device(device):
        if len(arrays) == 1 and device_of(arrays[0]) == device and arrays[0].flags.c_contiguous:
            source = arrays[0]
        else:
            source = reduce_on_stream(device, arrays, cupy.empty(entry.shape, entry.dtype))
        caller = cupy.cuda.get_current_stream()
        copier = side_stream(device, "copy")
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(caller)
        copier.wait_event(ready)
        buffer = entry.take_buffer()
        copy_async(buffer, source, copier)
        copied = cupy.cuda.Event(block=True, disable_timing=True)
        copied.record(copier)
        copied.synchronize()
    return cast(np.ndarray, buffer)


def gpu_only(arrays: list[Array]) -> bool:
    """Whether every value of a push is on a GPU (then it is staged through pinned memory)."""
    return bool(arrays) and all(is_gpu(array) for array in arrays)
