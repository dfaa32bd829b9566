"""What a store knows about each key, and the staging buffers pushes are merged into."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from akv.args import Key, check_one_kind
from akv.arrays import NUMPY, Array, Origin, cupy_module, is_gpu, is_pinned, pinned_empty
from akv.errors import (
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    ShapeMismatchError,
)
from akv.fused import sum_into
from akv.rows import RowTable
from akv_engine import Var

__all__ = [
    "MAX_SPARE_BUFFERS",
    "Described",
    "Entry",
    "KeyTable",
    "Part",
    "Parted",
    "Staged",
    "VarFactory",
    "merge_into",
]

#: What a new key is made from: its first value (an array, or a row-sparse value).
V = TypeVar("V")

#: Makes the engine var of a new key, named for it (``Engine.new_var``). Deciders that create
#: keys are given one, so that they need not know the engine.
VarFactory = Callable[[str], Var]


class Described(Protocol):
    """What :meth:`Entry.check` reads: an array, or a frame's description of one."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


class Failable(Protocol):
    """What :class:`KeyTable` reads of a key's init call (an engine waitable)."""

    def failed(self) -> bool: ...


#: Staging buffers kept per key for reuse (fresh pages cost about twice a warm copy).
MAX_SPARE_BUFFERS = 2


@dataclass(frozen=True, slots=True)
class Part:
    """Elements ``[start, stop)`` of a key's flattened value, held by server ``server``."""

    server: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """How many elements the part holds."""
        return self.stop - self.start


class Parted:
    """A split key's value held part by part: one flat array per part of the key, in part
    order (a push staged where the stream to each part's server sends it from, with no
    array of the whole key: :mod:`akv.cluster.worker.staging`). :meth:`Entry.wire_view`
    reads it as it reads an array of the key's shape."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.arrays = arrays


#: A pushed value as staged: an array of the key's shape, or a split key's parts.
Staged = np.ndarray | Parted


class Entry:
    """One initialized key: its shape, dtype, engine var, where it lives, and reusable
    staging buffers.

    ``value`` is the backend's array for the key (the stored value in a local store).
    ``parts`` says which server holds which elements (one part, on "server" 0, for a key
    that lives in this process). ``device`` is the GPU the key's value and merge buffers
    live on, or None for host memory. ``origin`` is the library of the key's first value,
    which new pull outputs are made in. ``pinned``: host staging buffers are allocated in
    page-locked memory (for asynchronous copies to and from a GPU).
    """

    __slots__ = (
        "_spares",
        "device",
        "dtype",
        "gpu_after",
        "init",
        "key",
        "nbytes",
        "origin",
        "parts",
        "pinned",
        "pushes",
        "rows",
        "shape",
        "size",
        "value",
        "var",
    )

    def __init__(
        self,
        key: Key,
        shape: tuple[int, ...],
        dtype: np.dtype,
        var: Var,
        parts: tuple[Part, ...] | None = None,
        device: int | None = None,
        origin: Origin = NUMPY,
    ) -> None:
        self.key = key
        self.shape = shape
        self.dtype = dtype
        self.size = math.prod(shape)  # exact: a row-sparse key's declared size may pass 2**63
        self.nbytes = self.size * dtype.itemsize
        self.var = var
        self.parts = parts if parts is not None else (Part(0, 0, self.size),)
        self.device = device
        self.origin = origin
        self.pinned = False
        #: Pushes of this key so far (a dist worker numbers each push with it, so that a
        #: server never counts a resent one twice).
        self.pushes = 0
        self.value: Array | None = None
        #: The stored rows of a row-sparse key (None: a dense key, whose value is ``value``).
        self.rows: RowTable | None = None
        #: The key's GPU work enqueued outside engine tasks, as ``(stream, event)`` pairs:
        #: the latest write first (or a placeholder), then the reads since
        #: (:mod:`akv.gpu_stream`).
        self.gpu_after: list[tuple[tuple[int, int], Any]] = []
        #: The ``init`` call that made the key, until it is done and seen to (a key whose
        #: init failed is not held: see :meth:`KeyTable.add`).
        self.init: Failable | None = None
        self._spares: list[Array] = []

    def wire_view(self, array: np.ndarray | Parted, part: Part) -> np.ndarray:
        """The piece of ``array`` (C-contiguous, the key's shape; or its parts) that
        ``part`` covers."""
        if isinstance(array, Parted):
            return array.arrays[self.parts.index(part)]
        if len(self.parts) == 1:
            return array
        return array.reshape(-1)[part.start : part.stop]

    def layout(self) -> tuple[tuple[int, ...], list[tuple[int, int, int]]]:
        """The key's shape and its parts as (server, first element, end element)."""
        return self.shape, [(p.server, p.start, p.stop) for p in self.parts]

    def take_buffer(self) -> Array:
        """A C-contiguous array of the key's shape and dtype that nobody else uses, on the
        key's device."""
        try:
            return self._spares.pop()
        except IndexError:
            if self.device is None:
                if self.pinned:
                    return pinned_empty(self.shape, self.dtype)
                return np.empty(self.shape, self.dtype)
            cupy = cupy_module()
            with cupy.cuda.Device(self.device):
                return cupy.empty(self.shape, self.dtype)

    def use_pinned(self) -> None:
        """Allocate the key's host buffers in page-locked memory from now on (spares in
        pageable memory are dropped, and never kept again)."""
        if not self.pinned:
            self.pinned = True
            self._spares.clear()

    def give_buffer(self, buffer: Array) -> None:
        """Return a buffer taken with :meth:`take_buffer` (or the old stored array).

        GPU buffers are not kept: CuPy's pool reuses them in stream order, which a spare
        list could not (a buffer may still be read by queued work when it is given back).
        Once the key is pinned, pageable buffers are not kept either.
        """
        if (
            self.device is None
            and len(self._spares) < MAX_SPARE_BUFFERS
            and (not self.pinned or is_pinned(buffer))
        ):
            self._spares.append(buffer)

    def check(self, array: Described, what: str) -> None:
        """Raise unless ``array`` has exactly the key's shape and dtype (no silent cast)."""
        if array.shape != self.shape:
            raise ShapeMismatchError(
                f"{what} key {self.key!r}: shape {array.shape} does not match the "
                f"initialized shape {self.shape}",
                key=self.key,
                expected=self.shape,
                got=array.shape,
            )
        if array.dtype is not self.dtype and array.dtype != self.dtype:
            raise DTypeMismatchError(
                f"{what} key {self.key!r}: dtype {array.dtype} does not match the "
                f"initialized dtype {self.dtype} (akv never casts; convert it first)",
                key=self.key,
                expected=self.dtype,
                got=array.dtype,
            )

    def __repr__(self) -> str:
        return f"<Entry {self.key!r} shape={self.shape} dtype={self.dtype}>"


class KeyTable:
    """The keys of one store: one kind (int or str), each initialized exactly once."""

    def __init__(self) -> None:
        self.kind: type | None = None
        self._entries: dict[Key, Entry] = {}
        #: Why the last init of a key that is not initialized now was refused.
        self._refused: dict[Key, str] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[Key]:
        """The initialized keys, in initialization order."""
        return list(self._entries)

    def entries(self) -> list[Entry]:
        """Every entry, in initialization order."""
        return list(self._entries.values())

    def get(self, key: Key, what: str) -> Entry:
        """The entry of an initialized key.

        Raises
        ------
        MixedKeyKindsError, KeyNotInitializedError
        """
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        check_one_kind([key], self.kind)
        refused = self._refused.get(key)
        if refused is not None:
            raise KeyNotInitializedError(
                f"{what} key {key!r}: the key is not initialized in this store, whose init "
                f"of it was refused ({refused}); init it again with a value that fits",
                key=key,
            )
        raise KeyNotInitializedError(
            f"{what} key {key!r}: the key was never initialized (call init first)", key=key
        )

    def add(
        self, items: list[tuple[Key, V]], make_entry: Callable[[Key, V], Entry], what: str
    ) -> list[Entry]:
        """Register new keys atomically: all of them, or (on any error) none.

        ``make_entry(key, value)`` makes each key's entry (the backend's kind of entry);
        ``what``: the call (init, broadcast), which the errors name.

        Raises
        ------
        MixedKeyKindsError, DuplicateInitError
        """
        keys = [key for key, _ in items]
        with self._lock:
            kind = check_one_kind(keys, self.kind)
            seen: set[Key] = set()
            for key in keys:
                held = self._entries.get(key)
                if held is not None and held.init is not None and held.init.failed():
                    del self._entries[key]  # its init failed: forgotten (see discard)
                    held = None
                if held is not None or key in seen:
                    raise DuplicateInitError(
                        f"{what} key {key!r}: the key is already initialized (init and "
                        "broadcast may be called once per key)",
                        key=key,
                    )
                seen.add(key)
            entries = [make_entry(key, array) for key, array in items]
            for entry in entries:
                self._entries[entry.key] = entry
                self._refused.pop(entry.key, None)
            self.kind = kind
        return entries

    def discard(self, entries: list[Entry], reason: str) -> None:
        """Forget the keys of ``entries`` (an ``init`` that failed for ``reason``: the key
        may be initialized again, and a call of it until then says why it is not), each only
        while it is still that entry; a table left empty takes keys of either kind again.
        (Run once the init's waiters are woken: an ``add`` meanwhile already takes a key
        whose init failed as free.)"""
        with self._lock:
            for entry in entries:
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                    self._refused[entry.key] = reason
            if not self._entries:
                self.kind = None


def merge_into(buffer: Array, arrays: list[Array]) -> Array:
    """Write the sum of ``arrays`` (all of ``buffer``'s shape and dtype) into ``buffer``.

    All on the host, or all on ``buffer``'s GPU (then in one kernel:
    :func:`akv.fused.sum_into`)."""
    if type(buffer) is not np.ndarray and is_gpu(buffer):
        return sum_into(buffer, arrays)
    if len(arrays) == 1:
        np.copyto(buffer, arrays[0])
        return buffer
    np.add(arrays[0], arrays[1], out=buffer)
    for array in arrays[2:]:
        np.add(buffer, array, out=buffer)
    return buffer
