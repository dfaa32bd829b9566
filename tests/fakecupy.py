"""A fake CuPy (and ``cupyx``) on the CPU, for running akv's GPU code paths without a GPU.

Install it with the ``cupy`` fixture of ``tests/akv/test_gpu_paths.py`` (it puts this
module in ``sys.modules["cupy"]`` and :data:`cupyx` in ``sys.modules["cupyx"]`` with
``monkeypatch``, after :func:`reset`). The production :class:`akv_engine.CupyDriver` then drives
the engine's GPU executor on the fake's streams and events.

What it models, after CuPy's API (names, signatures, errors) and CUDA's semantics:

* **Devices.** ``cuda.Device(i)`` is a context manager; the current device is per thread
  (default 0). Every allocation (``empty``, ``zeros``, ``asarray``...) lands on the *current*
  device. Kernels (ufuncs, ``fill``, ``astype``...) run on the current device and refuse
  arrays that live on another one, as CuPy without peer access does; ``copyto`` and
  ``ndarray.copy`` may copy between devices (a peer memcpy), as CuPy's do.
* **Memory.** Device arrays wrap NumPy buffers whose addresses are their ``data.ptr``.
  Memory comes from a stream-ordered pool, as CuPy's: a freed block goes back to the pool
  of the stream that was current when it was allocated and is handed out again by that
  stream's next allocation of the size, with its old contents (new memory is filled with
  0xFF bytes: NaN for floats, so reading memory nobody wrote shows). Freeing a block while
  another stream still has queued work on it is recorded as a violation (CuPy could hand
  it out under that work). ``cupyx.empty_pinned`` gives NumPy arrays in a pinned pool,
  which the fake recognises by address.
* **Streams run lazily.** Work enqueued on a stream (kernels, copies, event records, waits,
  host functions) runs later, in stream order, only when something needs it: a host
  synchronization (``get``, ``float(x)``, ``Stream.synchronize``, ``Event.synchronize``), a
  stream that waits for an event recorded on it (``wait_event`` forces the other stream up to
  that record), or a host function launched on it (the stream then runs up to and including
  the host function: the GPU "finished" that work). So work that is not ordered by an event
  or a host wait has not happened yet when another stream or the host looks: a missing
  ``wait_event`` reads stale or uninitialized memory, deterministically. ``schedule="eager"``
  (see :func:`reset`) runs everything at the call instead (a synchronous GPU).
* **Copies.** ``runtime.memcpyAsync`` works on the real addresses (``ctypes.memmove``) and
  checks them against ``kind``: a device pointer must be inside a live device array, a host
  pointer outside. With pinned host memory the copy is queued; with pageable memory it is
  synchronous, as CUDA's (device to host returns once copied; host to device stages the
  source at the call). ``ndarray.set``/``get`` follow the same rules.
* **No implicit conversion.** ``np.asarray(cupy_array)`` raises ``TypeError``; a NumPy array
  in a ufunc, ``copyto`` (non-scalar) or any CuPy function raises as CuPy's.
* **The rules of host callbacks.** A fake CUDA call made from inside a host function is
  recorded as a violation, and so is an exception escaping one.

Tests read :data:`violations` (expected empty), :func:`peek` (an array's memory as it is now,
without synchronizing: what a consumer on an unordered stream would see),
:func:`pending` (queued stream work) and :data:`counts` (what was submitted to streams:
``"kernel"`` for kernels and copies, ``"record"``, ``"wait"``, ``"host"``; ``"host_wait"`` for
host synchronizations; ``"pinned"`` for ``empty_pinned`` calls; ``"elementwise"`` for
``ElementwiseKernel`` launches). :func:`logging_ops` records each submission in order, with
its stream and a label. ``ElementwiseKernel`` (``tests/fakekernels.py``) runs its operation
with NumPy. :func:`held` delays the GPU: while it is active, host
functions and host waits do not run streams (a deterministic "the GPU is slow").
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import ctypes
import itertools
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

WAIT_S = 20.0
_ALIGN = 512  # CuPy rounds allocations up to 512 bytes

# ------------------------------------------------------------------------------ the state

DEVICES = 2
SCHEDULE = "lazy"
#: Broken rules seen since the last :func:`reset` (a test expects none).
violations: list[str] = []
#: What was submitted since the last :func:`reset` (see the module docstring).
counts: collections.Counter[str] = collections.Counter()
#: Called by :func:`reset` (code that caches streams of the fake forgets them).
RESET_HOOKS: list[Callable[[], None]] = []
#: While :func:`logging_ops` is active: ``(stream, kind, label)`` per submission.
_op_log: list[tuple[Any, str, str]] | None = None

_lock = threading.RLock()
_changed = threading.Condition(_lock)
_local = threading.local()
_ptrs = itertools.count(0x1000)
_null: dict[int, Stream] = {}
_streams: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()
_device_streams: dict[int, weakref.WeakSet[Stream]] = {}
_events: weakref.WeakValueDictionary[int, Event] = weakref.WeakValueDictionary()
_live: dict[int, _BlockState] = {}  # address -> state, for every block in use
_pools: dict[tuple[Any, ...], list[np.ndarray]] = {}
_freed: deque[tuple[tuple[Any, ...], np.ndarray]] = deque()  # filled by finalizers
_held = False
_deferred: list[Stream] = []  # streams whose host functions wait for held() to end
_blocked = 0  # host threads waiting for held() to end


def reset(devices: int = 2, schedule: str = "lazy") -> None:
    """Forget every stream, event and block; ``devices`` fake GPUs; ``schedule`` "lazy"
    (streams run when something needs their work) or "eager" (at the call)."""
    global DEVICES, SCHEDULE, _held
    if schedule not in ("lazy", "eager"):
        raise ValueError(f"unknown schedule {schedule!r}")
    with _lock:
        DEVICES = devices
        SCHEDULE = schedule
        violations.clear()
        counts.clear()
        _held = False
        _deferred.clear()
        _streams.clear()
        _events.clear()
        _live.clear()
        _pools.clear()
        _freed.clear()
        _device_streams.clear()
        _null.clear()
        for device in range(devices):
            _device_streams[device] = weakref.WeakSet()
            _null[device] = Stream._make_null(device)
    for hook in RESET_HOOKS:
        hook()


def _api() -> None:
    if getattr(_local, "in_callback", False):
        violations.append("a CUDA call from inside a host function")


# ------------------------------------------------------------------------------ errors


class _Runtime(types.SimpleNamespace):
    pass


class CUDARuntimeError(RuntimeError):
    """As ``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""

    _NAMES: ClassVar[dict[int, str]] = {
        1: "cudaErrorInvalidValue",
        101: "cudaErrorInvalidDevice",
        400: "cudaErrorInvalidResourceHandle",
        600: "cudaErrorNotReady",
    }

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        name = self._NAMES.get(status, f"cudaError {status}")
        super().__init__(f"{name}: {detail}" if detail else name)


def _check_device(device: int) -> None:
    if not 0 <= device < DEVICES:
        raise CUDARuntimeError(101, f"device {device} ({DEVICES} fake devices)")


# ------------------------------------------------------------------------------ devices


def _current_device() -> int:
    return int(getattr(_local, "device", 0))


def _set_device(device: int) -> None:
    _check_device(device)
    _local.device = device


class Device:
    """``cupy.cuda.Device``: a device number; a context manager making it current."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device() if device is None else int(device)
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        _api()
        previous = _current_device()
        _set_device(self.id)
        self._previous.append(previous)
        return self

    def __exit__(self, *exc: object) -> None:
        _local.device = self._previous.pop()

    def use(self) -> None:
        _api()
        _set_device(self.id)

    def synchronize(self) -> None:
        _api()
        _host_wait()
        with _lock:
            for stream in [_null[self.id], *_device_streams[self.id]]:
                stream._run()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


# ------------------------------------------------------------------------------ streams


class _Op:
    __slots__ = ("arg", "fn", "kind", "seq", "states")

    def __init__(
        self, kind: str, fn: Any, arg: Any, states: tuple[_BlockState, ...], seq: int
    ) -> None:
        self.kind = kind
        self.fn = fn
        self.arg = arg
        self.states = states
        self.seq = seq


class Stream:
    """``cupy.cuda.Stream``: a queue of work that runs lazily, in order (module docstring)."""

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: int | None = None,
    ) -> None:
        _api()
        device = _current_device()
        _check_device(device)
        self._init(device, 0 if null else next(_ptrs))
        self.non_blocking = non_blocking
        if not null:
            _streams[self.ptr] = self
            _device_streams[device].add(self)

    @classmethod
    def _make_null(cls, device: int) -> Stream:
        stream = cls.__new__(cls)
        stream._init(device, 0)
        stream.non_blocking = False
        return stream

    def _init(self, device: int, ptr: int) -> None:
        self.device_id = device
        self.ptr = ptr
        self._ops: deque[_Op] = deque()
        self._seq = 0
        self._done = 0

    # -- queueing and running

    def _enqueue(
        self,
        kind: str,
        fn: Any = None,
        arg: Any = None,
        states: tuple[_BlockState, ...] = (),
        label: str = "",
    ) -> int:
        with _lock:
            counts[kind] += 1
            if _op_log is not None:
                _op_log.append((self, kind, label))
            self._seq += 1
            for state in states:
                state.pending[self] = state.pending.get(self, 0) + 1
                state.last[self] = self._seq
            self._ops.append(_Op(kind, fn, arg, states, self._seq))
            seq = self._seq
            if SCHEDULE == "eager":
                self._run()
        return seq

    def _run(self, until: int | None = None) -> None:
        with _lock:
            ops = self._ops
            while ops and (until is None or ops[0].seq <= until):
                op = ops.popleft()
                try:
                    self._execute(op)
                finally:
                    self._done = op.seq
                    for state in op.states:
                        state.pending[self] -= 1
            _changed.notify_all()

    def _execute(self, op: _Op) -> None:
        if op.kind == "kernel":
            try:
                with np.errstate(all="ignore"):
                    op.fn()
            except BaseException as exc:
                violations.append(f"a fake kernel raised {exc!r}")
        elif op.kind == "wait":
            stream, seq = op.arg
            stream._run(seq)
        elif op.kind == "host":
            _local.in_callback = True
            try:
                op.fn(op.arg)
            except BaseException as exc:  # CuPy's trampoline would lose it
                violations.append(f"a host function raised {exc!r}")
            finally:
                _local.in_callback = False

    def _progress(self) -> None:
        """The GPU gets to the end of what is queued (later, while :func:`held`)."""
        with _lock:
            if _held:
                _deferred.append(self)
                _changed.notify_all()
            else:
                self._run()

    # -- CuPy's API

    @property
    def done(self) -> bool:
        return not self._ops

    def synchronize(self) -> None:
        _api()
        _host_wait()
        self._run()

    def record(self, event: Event | None = None) -> Event:
        _api()
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        _api()
        token = event._token
        if token is not None:  # waiting for an event never recorded returns at once
            self._enqueue("wait", arg=token)

    def launch_host_func(self, callback: Callable[[Any], None], arg: Any) -> None:
        _api()
        self._enqueue("host", callback, arg)
        self._progress()

    def add_callback(self, callback: Callable[[Stream, int, Any], None], arg: Any) -> None:
        self.launch_host_func(lambda a: callback(self, 0, a), arg)

    def use(self) -> Stream:
        _api()
        _current_streams()[self.device_id] = self
        return self

    def __enter__(self) -> Stream:
        _api()
        streams = _current_streams()
        _stream_stack().append((self.device_id, streams.get(self.device_id)))
        streams[self.device_id] = self
        return self

    def __exit__(self, *exc: object) -> None:
        device, previous = _stream_stack().pop()
        streams = _current_streams()
        if previous is None:
            streams.pop(device, None)
        else:
            streams[device] = previous

    def __repr__(self) -> str:
        return f"<fake Stream {self.ptr:#x} (device {self.device_id})>"


def _current_streams() -> dict[int, Stream]:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    return streams


def _stream_stack() -> list[tuple[int, Stream | None]]:
    stack = getattr(_local, "stream_stack", None)
    if stack is None:
        stack = _local.stream_stack = []
    return stack


def get_current_stream(device_id: int = -1) -> Stream:
    """``cupy.cuda.get_current_stream``: this thread's stream for the device (default: the
    current one), the device's null stream unless a stream was entered."""
    device = _current_device() if device_id < 0 else device_id
    _check_device(device)
    return _current_streams().get(device) or _null[device]


def _stream_of(ptr: int) -> Stream:
    if ptr == 0:
        return _null[_current_device()]
    stream = _streams.get(ptr)
    if stream is None:
        raise CUDARuntimeError(400, f"no stream {ptr:#x}")
    return stream


def _host_wait() -> None:
    """A host thread waits for GPU work: while :func:`held`, until it is released."""
    global _blocked
    with _lock:
        counts["host_wait"] += 1
        if not _held:
            return
        _blocked += 1
        _changed.notify_all()
        try:
            if not _changed.wait_for(lambda: not _held, WAIT_S):
                raise TimeoutError("fake GPU: a host wait outlived held()")
        finally:
            _blocked -= 1


# ------------------------------------------------------------------------------ events


class Event:
    """``cupy.cuda.Event``: a point in a stream."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        _api()
        self.device = _current_device()
        self.block = block
        self.ptr = next(_ptrs)
        self._token: tuple[Stream, int] | None = None
        self._recorded_s = 0.0
        _events[self.ptr] = self

    def record(self, stream: Stream | None = None) -> None:
        _api()
        if stream is None:
            stream = get_current_stream()
        if stream.device_id != self.device:
            raise CUDARuntimeError(
                400, f"event of device {self.device} recorded on a stream of {stream.device_id}"
            )
        self._token = (stream, stream._enqueue("record"))
        self._recorded_s = time.perf_counter()  # host time: for get_elapsed_time

    @property
    def done(self) -> bool:
        token = self._token
        return token is None or token[0]._done >= token[1]

    def synchronize(self) -> None:
        _api()
        if not self.block:
            violations.append("a host wait on an event without blocking sync spins a core")
        _host_wait()
        token = self._token
        if token is not None:
            token[0]._run(token[1])


def _elapsed_ms(start: Event, end: Event) -> float:
    """``cuda.get_elapsed_time``: here, the host time between the two records, in ms (a
    fake GPU has no clock; benchmarks on the fake check their code, not speeds)."""
    _api()
    return 1e3 * (end._recorded_s - start._recorded_s)


def _event_query(ptr: int) -> int:
    _api()
    event = _events.get(ptr)
    if event is None:
        return 400
    return 0 if event.done else 600


# ------------------------------------------------------------------------------ memory


class _BlockState:
    """What outlives a block's arrays: its memory, where it lives, the work queued on it."""

    __slots__ = ("address", "device", "key", "last", "nbytes", "pending", "raw")

    def __init__(self, raw: np.ndarray, device: int | None, key: tuple[Any, ...]) -> None:
        self.raw = raw
        self.address = int(raw.ctypes.data)
        self.nbytes = int(raw.nbytes)
        self.device = device  # None: pinned host memory
        self.key = key  # the pool it returns to
        self.pending: dict[Stream, int] = {}  # stream -> queued operations using the block
        self.last: dict[Stream, int] = {}  # stream -> the latest of them


class _Block:
    """One allocation; freed (back to its pool) when the last array using it goes."""

    __slots__ = ("__weakref__", "state")

    def __init__(self, state: _BlockState) -> None:
        self.state = state
        weakref.finalize(self, _free, state)


def _free(state: _BlockState) -> None:
    # A finalizer: it may run on any thread, at any point, so it takes no lock.
    alloc_stream: Stream | None = state.key[2] if state.device is not None else None
    busy = [
        stream
        for stream, count in list(state.pending.items())
        if count > 0 and stream is not alloc_stream and not _ordered(alloc_stream, stream, state)
    ]
    if busy:
        where = "pinned memory" if state.device is None else f"memory of device {state.device}"
        violations.append(
            f"{where} ({state.nbytes} bytes) freed while {busy} still had work queued on it: "
            "the pool may hand it out again under that work"
        )
    _live.pop(state.address, None)
    _freed.append((state.key, state.raw))


def _ordered(alloc_stream: Stream | None, other: Stream, state: _BlockState) -> bool:
    """Whether the pool's stream waits (a queued ``wait_event``) for ``other``'s work on the
    block: then its next allocations are ordered after that work."""
    if alloc_stream is None:  # the pinned pool is not stream-ordered
        return False
    last = state.last.get(other, 0)
    return builtins.any(
        op.kind == "wait" and op.arg[0] is other and op.arg[1] >= last
        for op in list(alloc_stream._ops)
    )


def _allocate(nbytes: int, device: int | None) -> _Block:
    """A block from the pool of the current stream (device) or the pinned pool (None)."""
    size = builtins.max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    with _lock:
        while _freed:
            key, raw = _freed.popleft()
            _pools.setdefault(key, []).append(raw)
        key: tuple[Any, ...]
        if device is None:
            key = ("pinned", None, None, size)
        else:
            key = ("device", device, get_current_stream(device), size)
        free = _pools.get(key)
        if free:
            raw = free.pop()
        else:
            raw = np.empty(size, np.uint8)
            raw.fill(0xFF)  # never written: NaN for floats
        state = _BlockState(raw, device, key)
        _live[state.address] = state
        return _Block(state)


def _find(ptr: int, nbytes: int) -> _BlockState | None:
    """The live block holding ``[ptr, ptr + nbytes)``, or None (pageable host memory)."""
    for state in list(_live.values()):
        if state.address <= ptr < state.address + state.nbytes:
            if ptr + nbytes > state.address + state.nbytes:
                raise CUDARuntimeError(1, f"a copy of {nbytes} bytes runs past its block")
            return state
    return None


def _view(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return raw[: count * dtype.itemsize].view(dtype).reshape(shape)


# ------------------------------------------------------------------------------ pinned memory


class _PinnedOwner:
    """The base of a pinned NumPy array: the block lives as long as the array's views."""

    def __init__(self, block: _Block) -> None:
        self.block = block
        state = block.state
        self.__array_interface__ = {
            "shape": (state.nbytes,),
            "typestr": "|u1",
            "data": (state.address, False),
            "version": 3,
        }


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    """``cupyx.empty_pinned``: a NumPy array in (fake) page-locked memory."""
    _api()
    counts["pinned"] += 1
    dtype = np.dtype(dtype)
    shape = _shape(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.asarray(_PinnedOwner(_allocate(nbytes, None)))
    return _view(raw, shape, dtype)


def zeros_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    array = empty_pinned(shape, dtype, order)
    array.fill(0)
    return array


# ------------------------------------------------------------------------------ copies


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream_ptr: int) -> None:
    """``runtime.memcpyAsync`` on real addresses (see the module docstring)."""
    _api()
    stream = _stream_of(stream_ptr)
    with _lock:
        dst_state = _find(dst, size)
        src_state = _find(src, size)
        dst_device = dst_state is not None and dst_state.device is not None
        src_device = src_state is not None and src_state.device is not None
        if kind == memcpyDefault:
            kind = [[0, 1], [2, 3]][src_device][dst_device]
        expected = {0: (False, False), 1: (True, False), 2: (False, True), 3: (True, True)}
        if expected.get(kind) != (dst_device, src_device):
            raise CUDARuntimeError(
                1,
                f"memcpyAsync kind {kind} with a {'device' if dst_device else 'host'} "
                f"destination and a {'device' if src_device else 'host'} source",
            )
        states = tuple(s for s in (dst_state, src_state) if s is not None)
        # The raw buffers stay referenced by the queued copy, so it never writes freed memory.
        keep = tuple(s.raw for s in states)
        if kind == memcpyHostToHost:
            stream._run()
            ctypes.memmove(dst, src, size)
            return
        if kind == memcpyHostToDevice and src_state is None:
            # From pageable memory: CUDA stages the source before the call returns.
            staged = (ctypes.c_char * size).from_address(src).raw

            def copy() -> None:
                ctypes.memmove(dst, staged, size)

        else:

            def copy(keep: tuple[np.ndarray, ...] = keep) -> None:
                ctypes.memmove(dst, src, size)

        stream._enqueue("kernel", copy, states=states, label="memcpy")
        if kind == memcpyDeviceToHost and dst_state is None:
            stream._run()  # into pageable memory: returns once copied


# ------------------------------------------------------------------------------ arrays


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(n) for n in shape)


class Flags:
    """``ndarray.flags``: CuPy's has these three (no ``writeable``)."""

    def __init__(self, array: np.ndarray, owndata: bool) -> None:
        self.c_contiguous = bool(array.flags.c_contiguous)
        self.f_contiguous = bool(array.flags.f_contiguous)
        self.owndata = owndata

    def __getitem__(self, name: str) -> bool:
        return bool(
            {
                "C_CONTIGUOUS": self.c_contiguous,
                "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata,
            }[name]
        )


class MemoryPointer:
    """``ndarray.data``: the device address of the first element."""

    def __init__(self, array: ndarray) -> None:
        self.ptr = int(array._a.__array_interface__["data"][0])
        self.device_id = array._block.state.device
        self.mem = array._block

    @property
    def device(self) -> Device:
        return Device(self.device_id)


class ndarray(np.lib.mixins.NDArrayOperatorsMixin):
    """``cupy.ndarray``: NumPy memory standing in for a GPU's (module docstring)."""

    _a: np.ndarray
    _block: _Block
    _base: ndarray | None

    def __init__(
        self,
        shape: Any,
        dtype: Any = float,
        memptr: Any = None,
        strides: Any = None,
        order: str = "C",
    ) -> None:
        if memptr is not None or strides is not None or order != "C":
            raise NotImplementedError("fake cupy.ndarray: only new C-ordered arrays")
        _api()
        dtype = np.dtype(dtype)
        shape = _shape(shape)
        device = _current_device()
        block = _allocate(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, device)
        self._a = _view(block.state.raw, shape, dtype)
        self._block = block
        self._base = None

    @classmethod
    def _wrap(cls, a: np.ndarray, block: _Block, base: ndarray | None) -> ndarray:
        array = cls.__new__(cls)
        array._a = a
        array._block = block
        array._base = base
        return array

    # -- attributes

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    base = property(lambda self: self._base)

    @property
    def device(self) -> Device:
        return Device(self._block.state.device)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self)

    @property
    def flags(self) -> Flags:
        return Flags(self._a, self._base is None)

    @property
    def T(self) -> ndarray:
        return self.transpose()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.data.ptr, False),
            "strides": None if self._a.flags.c_contiguous else self.strides,
            "version": 3,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, int(self._block.state.device))  # kDLCUDA

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __repr__(self) -> str:
        return f"<fake cupy.ndarray shape={self.shape} dtype={self.dtype} device={self.device.id}>"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return int(self.shape[0])

    def __iter__(self) -> Iterator[ndarray]:
        for i in range(len(self)):
            yield self[i]

    # -- host transfers

    def get(
        self,
        stream: Stream | None = None,
        order: str = "C",
        out: np.ndarray | None = None,
        blocking: bool = True,
    ) -> np.ndarray:
        _api()
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            if out.dtype != self.dtype or out.shape != self.shape:
                raise ValueError("get(out=): shape or dtype mismatch")
            host = out
        else:
            host = np.empty(self.shape, self.dtype)
        if stream is None:
            stream = get_current_stream(self._block.state.device)
        source = self._a
        pinned = _find(int(host.ctypes.data), host.nbytes) if host.size else None
        states = (self._block.state,) + ((pinned,) if pinned is not None else ())
        stream._enqueue("kernel", lambda: np.copyto(host, source), states=states)
        if blocking or pinned is None:
            _host_wait()
            stream._run()
        return host

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        _api()
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        if stream is None:
            stream = get_current_stream()
        target = self._a
        pinned = _find(int(arr.ctypes.data), arr.nbytes) if arr.size else None
        if pinned is None or pinned.device is not None:
            source = np.array(arr)  # pageable: staged at the call
            stream._enqueue(
                "kernel", lambda: np.copyto(target, source), states=(self._block.state,)
            )
        else:
            stream._enqueue(
                "kernel", lambda: np.copyto(target, arr), states=(self._block.state, pinned)
            )

    # -- scalars (a synchronizing read)

    def _scalar(self) -> Any:
        if self.size != 1:
            raise TypeError("only size-1 arrays can be converted to Python scalars")
        return self.get().reshape(()).item()

    def item(self) -> Any:
        return self._scalar()

    def tolist(self) -> Any:
        return self.get().tolist()

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __complex__(self) -> complex:
        return complex(self._scalar())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous.")
        return bool(self._scalar())

    def __index__(self) -> int:
        if self.dtype.kind not in "iub":
            raise TypeError("only integer arrays can be indices")
        return int(self._scalar())

    # -- views, copies and element-wise work

    def _like_view(self, a: np.ndarray) -> ndarray:
        return ndarray._wrap(a, self._block, self._base if self._base is not None else self)

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        return _call(np.reshape, (self, shape), {"order": order})

    def ravel(self, order: str = "C") -> ndarray:
        return _call(np.ravel, (self,), {"order": order})

    def flatten(self) -> ndarray:
        return self.copy().reshape(-1)

    def transpose(self, *axes: Any) -> ndarray:
        return _call(np.transpose, (self, axes or None), {})

    def squeeze(self, axis: Any = None) -> ndarray:
        return _call(np.squeeze, (self,), {"axis": axis})

    def view(self, dtype: Any = None) -> ndarray:
        if dtype is None:
            return self._like_view(self._a.view())
        return self._like_view(self._a.view(dtype))

    def copy(self, order: str = "C") -> ndarray:
        """A contiguous copy on the *current* device (a peer copy from another one)."""
        _api()
        out = ndarray(self.shape, self.dtype)
        target, source = out._a, self._a
        get_current_stream()._enqueue(
            "kernel",
            lambda: np.copyto(target, source),
            states=(out._block.state, self._block.state),
        )
        return out

    def astype(
        self,
        dtype: Any,
        order: str = "K",
        casting: Any = None,
        subok: Any = None,
        copy: bool = True,
    ) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _call(lambda a: a.astype(dtype), (self,), {})

    def fill(self, value: Any) -> None:
        _api()
        if isinstance(value, np.ndarray):
            raise TypeError(f"Unsupported type {np.ndarray}")
        target = self._a
        _kernel([self], lambda: target.fill(value))

    def __getitem__(self, key: Any) -> ndarray:
        _api()
        items = key if isinstance(key, tuple) else (key,)
        if builtins.any(isinstance(k, ndarray) for k in items):
            # Advanced indexing by GPU arrays: the result's shape depends on their values.
            _check_here([self, *(k for k in items if isinstance(k, ndarray))])
            stream = get_current_stream()
            _host_wait()
            stream._run()
            real = tuple(k._a if isinstance(k, ndarray) else k for k in items)
            return asarray(self._a[real])
        if not builtins.any(k is Ellipsis for k in items):
            items = (*items, Ellipsis)  # a 0-d view instead of a NumPy scalar
        result = self._a[items]
        if np.may_share_memory(result, self._block.state.raw):
            return self._like_view(result)
        # Advanced indexing by lists: a copy, made on the stream.
        return _call(lambda a: a[items], (self,), {})

    def __setitem__(self, key: Any, value: Any) -> None:
        _api()
        arrays = [self, *([value] if isinstance(value, ndarray) else [])]
        target = self._a
        if isinstance(value, ndarray):
            source: Any = value._a
        elif isinstance(value, np.ndarray):
            source = np.array(value)  # an explicit host-to-device copy, staged now
        else:
            source = value
        np.empty_like(target)[key] = (
            source if not isinstance(value, ndarray) else np.zeros(value.shape, value.dtype)
        )  # raises now for a bad key or shape

        def assign() -> None:
            target[key] = source

        _kernel(arrays, assign)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method not in ("__call__", "reduce", "accumulate", "outer"):
            return NotImplemented
        if kwargs.get("where", True) is not True:
            raise TypeError("fake cupy: ufuncs take no where=")
        out = kwargs.pop("out", None)
        if out is not None:
            outs = out if isinstance(out, tuple) else (out,)
            if builtins.all(o is None for o in outs):
                out = None
            else:
                kwargs["out"] = outs[0] if len(outs) == 1 else outs
        return _call(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        implementation = _FUNCTIONS.get(func)
        if implementation is None:
            return NotImplemented
        return implementation(*args, **kwargs)

    # -- the usual methods, as CuPy's (each returns an array)

    def sum(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.sum, (self, *args), kwargs)

    def mean(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.mean, (self, *args), kwargs)

    def max(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.max, (self, *args), kwargs)

    def min(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.min, (self, *args), kwargs)

    def all(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.all, (self, *args), kwargs)

    def any(self, *args: Any, **kwargs: Any) -> ndarray:
        return _call(np.any, (self, *args), kwargs)

    def dot(self, other: Any, out: Any = None) -> ndarray:
        return _call(np.dot, (self, other), {} if out is None else {"out": out})

    def clip(self, a_min: Any = None, a_max: Any = None, out: Any = None) -> ndarray:
        kwargs = {} if out is None else {"out": out}
        return _call(np.clip, (self, a_min, a_max), kwargs)


def _check_here(arrays: list[ndarray]) -> None:
    """Kernels run on the current device and read no other device's memory."""
    device = _current_device()
    for array in arrays:
        where = array._block.state.device
        if where != device:
            raise ValueError(
                f"The device where the array resides ({where}) is different from the "
                f"current device ({device}). Peer access is unavailable between these devices."
            )


def _kernel(arrays: list[ndarray], fn: Callable[[], Any]) -> None:
    """Queue ``fn`` (NumPy work on ``arrays``' memory) as a kernel on the current stream."""
    _check_here(arrays)
    states = tuple({id(a._block.state): a._block.state for a in arrays}.values())
    get_current_stream()._enqueue("kernel", fn, states=states)


def _scan(value: Any, arrays: list[ndarray]) -> None:
    """Collect the fake arrays in ``value``; refuse NumPy arrays."""
    if isinstance(value, ndarray):
        arrays.append(value)
    elif isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type {np.ndarray}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _scan(item, arrays)


def _real(value: Any) -> Any:
    """``value`` with each fake array replaced by the NumPy view of its memory."""
    if isinstance(value, dict):
        return {k: _real(v) for k, v in value.items()}
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, list):
        return [_real(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_real(v) for v in value)
    return value


def _call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a NumPy function on fake arrays as a kernel on the current stream.

    Arguments are checked (no NumPy arrays, every array on the current device) and the
    function is tried at once on the arrays' memory as it is now, for the result's shape and
    dtype and for errors (into scratch outputs: nothing is written); the real run is queued.
    A result that is a view (a reshape) is returned as a view; one that is not an array (a
    Python bool) needs the values: the stream is run first, as a synchronizing call would.
    """
    _api()
    arrays: list[ndarray] = []
    for value in (*args, *kwargs.values()):
        _scan(value, arrays)
    stream = get_current_stream()
    states = tuple({id(a._block.state): a._block.state for a in arrays}.values())
    out = kwargs.get("out")
    if out is not None:
        _check_here(arrays)
        outs = out if isinstance(out, tuple) else (out,)
        scratch = tuple(np.empty(o.shape, o.dtype) for o in outs)
        with _lock, np.errstate(all="ignore"):
            func(
                *_real(args),
                **{**_real(kwargs), "out": scratch if len(scratch) > 1 else scratch[0]},
            )
        real_args, real_kwargs = _real(args), _real(kwargs)
        stream._enqueue("kernel", lambda: func(*real_args, **real_kwargs), states=states)
        return out
    real_args, real_kwargs = _real(args), _real(kwargs)
    try:
        with _lock, np.errstate(all="ignore"):
            probe = func(*real_args, **real_kwargs)
    except (ValueError, TypeError, IndexError, AttributeError):
        raise
    except Exception:
        probe = None  # depends on the values (a singular matrix...): computed below
    results = probe if isinstance(probe, tuple) else (probe,)
    if probe is None or not builtins.all(isinstance(r, (np.ndarray, np.generic)) for r in results):
        _check_here(arrays)
        _host_wait()
        stream._run()
        with _lock, np.errstate(all="ignore"):
            value = func(*real_args, **real_kwargs)
        if isinstance(value, (np.ndarray, np.generic)):
            return asarray(value)
        return value
    made: list[ndarray] = []
    fills: list[tuple[int, np.ndarray]] = []
    for index, result in enumerate(results):
        if isinstance(result, np.ndarray):
            owner = next(
                (a for a in arrays if np.may_share_memory(result, a._block.state.raw)), None
            )
            if owner is not None:
                made.append(owner._like_view(result))
                continue
        result = np.asarray(result)
        target = ndarray(result.shape, result.dtype)
        made.append(target)
        fills.append((index, target._a))
    if fills:
        _check_here(arrays)
        states = states + tuple(made[i]._block.state for i, _ in fills)

        def run() -> None:
            value = func(*real_args, **real_kwargs)
            values = value if isinstance(value, tuple) else (value,)
            for index, target in fills:
                np.copyto(target, values[index])

        stream._enqueue("kernel", run, states=states)
    return tuple(made) if isinstance(probe, tuple) else made[0]


# ------------------------------------------------------------------------------ functions


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return full(shape, 0, dtype)


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return full(shape, 1, dtype)


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    array = ndarray(shape, dtype)
    array.fill(fill_value)
    return array


def empty_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def ones_like(a: ndarray, dtype: Any = None, order: str = "K", shape: Any = None) -> ndarray:
    return ones(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full_like(
    a: ndarray, fill_value: Any, dtype: Any = None, order: str = "K", shape: Any = None
) -> ndarray:
    return full(
        a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype
    )


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> ndarray:
    return asarray(np.arange(start, stop, step, dtype=dtype))


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    """A CuPy array: ``a`` itself, or a copy of host data on the current device."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _api()
    host = np.array(a, dtype=dtype)  # staged at the call
    array = ndarray(host.shape, host.dtype)
    target = array._a
    get_current_stream()._enqueue(
        "kernel", lambda: np.copyto(target, host), states=(array._block.state,)
    )
    return array


def array(
    obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0
) -> ndarray:
    if isinstance(obj, ndarray):
        result = obj.astype(obj.dtype if dtype is None else dtype) if copy else asarray(obj, dtype)
        return result
    return asarray(obj, dtype)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return _call(lambda x: np.ascontiguousarray(x, dtype=dtype), (a,), {})
    return asarray(np.ascontiguousarray(a, dtype=dtype))


def asnumpy(
    a: Any, stream: Stream | None = None, order: str = "C", out: Any = None, blocking: bool = True
) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def get_array_module(*args: Any) -> Any:
    return sys.modules[__name__] if builtins.any(isinstance(a, ndarray) for a in args) else np


def from_dlpack(x: Any) -> ndarray:
    if isinstance(x, ndarray):
        return x.view()
    raise TypeError(f"fake cupy.from_dlpack: {type(x).__name__} is not on a (fake) GPU")


def copyto(dst: Any, src: Any, casting: str = "same_kind", where: Any = None) -> None:
    """``cupy.copyto``, as CuPy's: a memcpy on the current stream when it can, else a kernel
    on ``dst``'s device (after a copy of ``src`` there if it lives elsewhere)."""
    _api()
    if not isinstance(dst, ndarray):
        raise TypeError(f"copyto: dst must be a cupy.ndarray, got {type(dst).__name__}")
    if where is not None:
        _copyto_where(dst, src, casting, where)
        return
    if isinstance(src, (bool, int, float, complex)) or (
        isinstance(src, (np.ndarray, np.generic)) and not isinstance(src, ndarray)
    ):
        if isinstance(src, np.ndarray) and src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        value = src.item() if isinstance(src, (np.ndarray, np.generic)) else src
        np.copyto(np.empty((), dst.dtype), src, casting=casting)  # the cast check
        target = dst._a
        _kernel([dst], lambda: target.fill(value))
        return
    if not isinstance(src, ndarray):
        raise TypeError(f"Unsupported type {type(src)}")
    if not np.can_cast(src.dtype, dst.dtype, casting):
        raise TypeError(f"Cannot cast {src.dtype} to {dst.dtype} in {casting} casting mode")
    if not builtins.all(
        s in (d, 1)
        for s, d in itertools.zip_longest(reversed(src.shape), reversed(dst.shape), fillvalue=1)
    ):
        raise ValueError(
            f"could not broadcast input array from shape {src.shape} into shape {dst.shape}"
        )
    if dst.size == 0:
        return
    contiguous = (dst._a.flags.c_contiguous and src._a.flags.c_contiguous) or (
        dst._a.flags.f_contiguous and src._a.flags.f_contiguous
    )
    if contiguous and dst.dtype == src.dtype and dst.size == src.size:
        # dst.data.copy_from_async(src.data): a memcpy (peer, if need be) on the current stream
        target, source = dst._a, src._a
        get_current_stream()._enqueue(
            "kernel",
            lambda: np.copyto(target, source.reshape(target.shape)),
            states=(dst._block.state, src._block.state),
            label="memcpy",
        )
        return
    with Device(dst.device.id):
        if src.device != dst.device:
            src = src.copy()
        target, source = dst._a, src._a
        _kernel([dst, src], lambda: np.copyto(target, source, casting=casting))


def _copyto_where(dst: ndarray, src: Any, casting: str, where: Any) -> None:
    """``copyto`` with a mask: a kernel on ``dst``'s device; the mask and an array ``src``
    are fake arrays there (CuPy: ``where`` must be a cupy.ndarray)."""
    if not isinstance(where, ndarray):
        raise TypeError(f"copyto: where must be a cupy.ndarray, got {type(where).__name__}")
    arrays = [dst, where, *([src] if isinstance(src, ndarray) else [])]
    if isinstance(src, np.ndarray):
        raise TypeError(f"Unsupported type {np.ndarray}")
    target, mask = dst._a, where._a
    source = src._a if isinstance(src, ndarray) else src
    _kernel(arrays, lambda: np.copyto(target, source, casting=casting, where=mask))


def result_type(*arrays_and_dtypes: Any) -> np.dtype:
    return np.result_type(*(a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes))


def _function(np_func: Callable[..., Any]) -> Callable[..., Any]:
    def function(*args: Any, **kwargs: Any) -> Any:
        return _call(np_func, args, kwargs)

    function.__name__ = np_func.__name__
    return function


class ufunc:
    """A CuPy ufunc: NumPy's, on fake arrays only."""

    def __init__(self, np_ufunc: np.ufunc) -> None:
        self._ufunc = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin = np_ufunc.nin
        self.nout = np_ufunc.nout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrays = [a for a in (*args, kwargs.get("out")) if isinstance(a, ndarray)]
        if not arrays:
            for a in args:
                if isinstance(a, np.ndarray):
                    raise TypeError(f"Unsupported type {np.ndarray}")
            return asarray(self._ufunc(*args, **kwargs))
        return arrays[0].__array_ufunc__(self._ufunc, "__call__", *args, **kwargs)


_UFUNCS = [
    "add",
    "subtract",
    "multiply",
    "divide",
    "true_divide",
    "floor_divide",
    "power",
    "negative",
    "abs",
    "absolute",
    "sqrt",
    "square",
    "sign",
    "exp",
    "log",
    "maximum",
    "minimum",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "equal",
    "not_equal",
    "logical_and",
    "logical_or",
    "logical_not",
    "isfinite",
    "isnan",
    "isinf",
]
_NUMPY_FUNCTIONS = [
    "cumsum",
    "dot",
    "clip",
    "sum",
    "mean",
    "max",
    "min",
    "amax",
    "amin",
    "all",
    "any",
    "allclose",
    "array_equal",
    "reshape",
    "ravel",
    "transpose",
    "squeeze",
    "where",
    "concatenate",
    "stack",
]

_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    np.copyto: copyto,
    np.empty_like: empty_like,
    np.zeros_like: zeros_like,
    np.ones_like: ones_like,
    np.full_like: full_like,
    np.result_type: result_type,
}
for _name in _NUMPY_FUNCTIONS:
    globals()[_name] = _FUNCTIONS[getattr(np, _name)] = _function(getattr(np, _name))
for _name in _UFUNCS:
    globals()[_name] = ufunc(getattr(np, _name))
for _name in [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool_",
    "complex64",
    "complex128",
    "dtype",
    "newaxis",
    "inf",
    "nan",
    "pi",
    "e",
]:
    globals()[_name] = getattr(np, _name)
del _name


def is_available() -> bool:
    return True


# ------------------------------------------------------------------------------ cuda, cupyx

memcpyHostToHost = 0
memcpyHostToDevice = 1
memcpyDeviceToHost = 2
memcpyDeviceToDevice = 3
memcpyDefault = 4


def _device_synchronize() -> None:
    Device().synchronize()


class _MemoryPool:
    """``get_default_memory_pool()`` and the pinned one: only ``free_all_blocks``."""

    def free_all_blocks(self) -> None:
        _api()


_memory_pool, _pinned_memory_pool = _MemoryPool(), _MemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _memory_pool


def get_default_pinned_memory_pool() -> _MemoryPool:
    return _pinned_memory_pool


runtime = _Runtime(
    CUDARuntimeError=CUDARuntimeError,
    getDeviceProperties=lambda device: {"name": f"fake GPU {device}".encode()},
    getDeviceCount=lambda: DEVICES,
    getDevice=_current_device,
    setDevice=_set_device,
    deviceCanAccessPeer=lambda device, peer: 0,
    deviceSynchronize=_device_synchronize,
    eventQuery=_event_query,
    memcpyAsync=_memcpy_async,
    memcpyHostToHost=memcpyHostToHost,
    memcpyHostToDevice=memcpyHostToDevice,
    memcpyDeviceToHost=memcpyDeviceToHost,
    memcpyDeviceToDevice=memcpyDeviceToDevice,
    memcpyDefault=memcpyDefault,
)

cuda = types.ModuleType("cupy.cuda")
cuda.Device = Device
cuda.Stream = Stream
cuda.Event = Event
cuda.runtime = runtime
cuda.get_current_stream = get_current_stream
cuda.get_elapsed_time = _elapsed_ms
cuda.get_device_id = _current_device
cuda.is_available = is_available
cuda.MemoryPointer = MemoryPointer

from tests.fakekernels import ElementwiseKernel  # noqa: E402, F401 - uses the names above

cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned = empty_pinned
cupyx.zeros_pinned = zeros_pinned


# ------------------------------------------------------------------------------ for the tests


@contextlib.contextmanager
def logging_ops() -> Iterator[list[tuple[Any, str, str]]]:
    """Record every submission to a stream while active: ``(stream, kind, label)``."""
    global _op_log
    log: list[tuple[Any, str, str]] = []
    with _lock:
        _op_log = log
    try:
        yield log
    finally:
        with _lock:
            _op_log = None


def peek(array: ndarray) -> np.ndarray:
    """A copy of ``array``'s memory as it is now, without running any stream: what work on a
    stream that is not ordered after the pending work would read."""
    with _lock:
        return np.array(array._a)


def pending() -> int:
    """How many operations are queued on every stream, not run yet."""
    with _lock:
        streams = [*_null.values(), *_streams.values()]
        return builtins.sum(len(stream._ops) for stream in streams)


def synchronize_all() -> None:
    """Run every stream to its end (a test's "the GPU caught up")."""
    with _lock:
        for stream in [*_null.values(), *_streams.values()]:
            stream._run()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Delay the GPU: host functions and host waits do not run streams until the block ends
    (then the streams whose host functions were launched run, in launch order)."""
    global _held
    with _lock:
        _held = True
    try:
        yield
    finally:
        with _lock:
            _held = False
            deferred = list(_deferred)
            _deferred.clear()
            for stream in deferred:
                stream._run()
            _changed.notify_all()


def wait_for_gpu_work(count: int, timeout: float = WAIT_S) -> None:
    """Inside :func:`held`: wait until ``count`` completions wait for the GPU (host functions
    launched, or host threads waiting for an event or a stream)."""
    with _lock:
        if not _changed.wait_for(lambda: len(_deferred) + _blocked >= count, timeout):
            raise TimeoutError(f"fake GPU: {len(_deferred) + _blocked} of {count} waiting")


reset()
