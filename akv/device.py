"""The ``device`` store's backend: values and merge buffers on GPUs, work on CuPy streams.

MXNet's ``device`` store (CommDevice) reduces on the GPUs instead of in host memory. Here:

* A key initialized from a GPU array (CuPy, a CUDA torch tensor, a GPU JAX array) keeps its
  value on one GPU, its *merge device*. Merge devices are placed as CommDevice places its
  merge buffers (:class:`MergePlacement`): each init call's keys by size, largest first,
  each to the GPU with the fewest bytes assigned so far.
* A push sums the values it is given on the merge device, at the call and on the caller's
  current CUDA stream, in one kernel (values on other GPUs come by peer copies pipelined
  with the sum: :mod:`akv.gpu_stream`), so the values are read after the caller's own
  queued work and the caller may reuse its arrays once the call returns. A key whose engine
  var is free is pushed on that stream with no engine task: the sum goes into the stored
  value, or an updater applies it there. Otherwise the engine task that applies the sum
  runs on a compute stream of the merge device and waits for the sum on the GPU
  (``cudaStreamWaitEvent``), never on the host.
* A pull of a free key into outputs on its GPU (or in host memory) copies on the caller's
  current stream and completes with an event (:meth:`akv_engine.GPUExecutor.event_done`);
  otherwise a task copies on a copy stream of the merge device (a GPU output on another
  device gets a peer copy). Work on a key from different streams is ordered by events kept
  in the key's entry.
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
)
from akv.backend import KeyArrays, Updater
from akv.errors import InvalidArgumentError
from akv.exits import off_loop
from akv.gpu_stream import (
    follow,
    note_read,
    note_write,
    pending,
    reduce_at_call,
    reduce_on_stream,
    settle,
)
from akv.keys import Entry
from akv.local import GUARD, LocalBackend
from akv.pinned import GPU, copy_async, from_pinned, register_gpu_executor, to_pinned
from akv_engine import (
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


def _stage(entry: Entry, arrays: list[Array]) -> tuple[Array, Any]:
    assert entry.device is not None
    return reduce_at_call(entry.device, arrays, entry.take_buffer())


def _init_gpu(staged: list[tuple[Entry, Array, Any]], ctx: GPUContext) -> None:
    for entry, buffer, event in staged:
        ctx.after(event)
        entry.value = buffer


def _land_gpu(
    store: object,
    updater: Updater | None,
    staged: list[tuple[Entry, Array, Any]],
    ctx: GPUContext,
) -> list[Array]:
    """Apply each staged sum on this task's stream; returns the values it replaced, which
    the task's result holds until its GPU work is done: reads queued on other streams
    (``gpu_after``, waited for here) may still use them, and their memory would otherwise
    go back to the pool of the stream that allocated them at once."""
    replaced = []
    for entry, buffer, event in staged:
        ctx.after(event, *pending(entry))
        entry.gpu_after = []  # this task's completion orders what comes later
        if updater is None:
            replaced.append(entry.value)
            entry.value = buffer
        else:
            assert entry.value is not None  # set by init, which every push is ordered after
            GUARD.run(store, updater, entry.key, buffer, entry.value)
    return replaced


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


def _push_now(
    store: object,
    updater: Updater | None,
    entry: Entry,
    arrays: list[Array],
    reads_gradient: bool,
) -> None:
    """A push of one GPU key, enqueued on the caller's current stream of its merge GPU:
    the sum straight into the stored value (no updater), or into a buffer the updater
    applies there; no engine task, no host wait. ``reads_gradient``: the updater only reads
    its gradient (akv's optimizers), so a single value on the key's GPU is handed to it as
    it is, without a copy (the update is enqueued before the call returns)."""
    cupy = cupy_module()
    assert entry.device is not None and entry.value is not None  # a GPU key, initialized
    with cupy.cuda.Device(entry.device):
        stream = cupy.cuda.get_current_stream()
        follow(entry, stream, writing=True)
        if updater is None:
            reduce_on_stream(entry.device, arrays, entry.value)
        else:
            if reads_gradient and len(arrays) == 1 and device_of(arrays[0]) == entry.device:
                summed = arrays[0]
            else:
                summed = cupy.empty(entry.shape, entry.dtype)
                reduce_on_stream(entry.device, arrays, summed)
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
        super().__init__(engine, store, inline_max_bytes, executor)
        self.type = "device"
        self.placement = MergePlacement()
        self._devices = list(devices) if devices is not None else None
        self._seen: set[int] = set()
        self._gpu_entries: list[Entry] = []

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
                    reads=[self._optimizer_var],  # (see LocalBackend.init)
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
            return super().push(values, priority, borrow)
        tasks = [super().push(host, priority, borrow)] if host else []
        updater = self.updater
        reads_gradient = updater is not None and updater is self._optimizer_updater
        for device, items in gpus.items():
            queued = []
            for entry, arrays in items:
                done = self._engine.run_now(
                    _push_now,
                    self._store,
                    updater,
                    entry,
                    arrays,
                    reads_gradient,
                    writes=(entry.var,),
                    name="push",
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
            await off_loop(settle, list(self._gpu_entries))
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


def _joined(tasks: list[Waitable], result: object) -> Waitable:
    """One waitable for a call's tasks (the task itself when there is one)."""
    return tasks[0] if len(tasks) == 1 else gather(tasks, result)
