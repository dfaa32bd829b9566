"""A worker's requests on row-sparse keys: which rows go to which server, and where the
rows of a pull's answer land. Pure: no I/O.

A row-sparse key is split by rows over every server (:func:`~akv.cluster.placement.row_parts`:
``entry.parts`` count rows). Values are sorted by row id, so each server's rows are one
contiguous slice of them (two binary searches), sent without a copy. A push goes to every
server, an empty one where the value has no row in the server's range: a push is the whole
key's new value (without an optimizer every other row reads as zero again; a standard
optimizer update changes every stored row; Adam counts the key's updates), and a
``dist_sync`` round counts one push per worker. A pull asks only the servers that hold rows
it asks for, and their answers land straight in the slices of the output that are theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from akv.cluster.protocol import RowMeta, encode_meta, encode_row_meta
from akv.cluster.worker.requests import WireArray
from akv.keys import Entry
from akv.sparse import RowIds, RowSparseArray

__all__ = [
    "PushBuffers",
    "init_check_text",
    "init_requests",
    "pull_requests",
    "push_requests",
    "slices",
]

#: Free push buffers kept for reuse, at most this many and this many bytes in all.
MAX_SPARE_PUSH_BUFFERS = 4
MAX_SPARE_PUSH_BYTES = 64 << 20


def slices(entry: Entry, ids: RowIds) -> list[tuple[int, int, int]]:
    """``(server, first, end)`` for each server of ``entry``: the positions of sorted
    ``ids`` that fall in the server's row range."""
    starts = [part.start for part in entry.parts]
    edges = np.searchsorted(ids, [*starts, entry.shape[0]]).tolist()
    return [(part.server, edges[i], edges[i + 1]) for i, part in enumerate(entry.parts)]


def init_requests(
    entries: list[Entry], values: list[RowSparseArray]
) -> dict[int, tuple[list[WireArray], str]]:
    """Rank 0's ``ROW_INIT`` to each server: every key, with its rows in the server's
    range (the arrays) and its declared shape, dtype and range (the text)."""
    requests: dict[int, tuple[list[WireArray], list[RowMeta]]] = {}
    for entry, value in zip(entries, values, strict=True):
        ranges = slices(entry, value.indices)
        for (server, first, end), part in zip(ranges, entry.parts, strict=True):
            arrays, metas = requests.setdefault(server, ([], []))
            meta = (entry.key, entry.shape, str(entry.dtype), part.start, part.stop)
            metas.append(meta)
            arrays.append((entry.key, value.indices[first:end], 0))
            arrays.append((entry.key, value.data[first:end], 0))
    return {
        server: (arrays, encode_row_meta(metas)) for server, (arrays, metas) in requests.items()
    }


def init_check_text(entries: list[Entry]) -> str:
    """Another worker's ``INIT_CHECK`` of row-sparse keys (sent to every server): their
    shapes and ``"<dtype> row_sparse"``, so that a dense init of the same key differs."""
    return encode_meta([(entry.key, entry.shape, f"{entry.dtype} row_sparse") for entry in entries])


#: ``region(server, nbytes)``: memory that a request to ``server`` is sent from without a
#: copy (a region of the stream's shared arena) and its owner (what takes it back), or None.
Region = Callable[[int, int], tuple[Any, memoryview] | None]


def push_requests(
    pushes: list[tuple[Entry, RowSparseArray, int]], region: Region | None = None
) -> tuple[dict[int, list[WireArray]], list[tuple[Any, np.ndarray]]]:
    """Each server's ``ROW_PUSH`` arrays: per key, its ids and rows in the server's range
    (none, for some: every server gets every key, see the module), tagged with the push
    number; copied now (the caller may change the values once this returns): each
    server's rows into ``region(server, nbytes)`` where it gives one, else into arrays of
    their own. Also returns the ``(owner, rows)`` that lie in regions."""
    requests: dict[int, list[WireArray]] = {}
    placed: list[tuple[Any, np.ndarray]] = []
    for entry, value, tag in pushes:
        ids = value.indices.copy()
        for server, first, end in slices(entry, ids):
            rows = value.data[first:end]
            taken = region(server, rows.nbytes) if region is not None and rows.size else None
            if taken is None:
                held = rows.copy()
            else:
                held = np.frombuffer(taken[1], rows.dtype).reshape(rows.shape)
                held[...] = rows
                placed.append((taken[0], held))
            arrays = requests.setdefault(server, [])
            arrays.append((entry.key, ids[first:end], tag))
            arrays.append((entry.key, held, tag))
    return requests, placed


class PushBuffers:
    """Reusable memory for the rows of row pushes sent over a socket, where no shared arena
    takes them: rows wait there until every server answered, as in an arena's region.

    A push's rows differ in size from step to step, so a dense key's spare buffers (of the
    key's shape) do not fit; fresh arrays of that size cost page faults on every push (the
    allocator gives their pages back to the system and takes new ones: about a fifth of a
    two-worker step over TCP). A buffer is taken for ``nbytes`` (the smallest free one
    large enough, else a new one a quarter larger) and given back by the array laid over
    it; the most recently given back are kept free, at most :data:`MAX_SPARE_PUSH_BUFFERS`
    of at most :data:`MAX_SPARE_PUSH_BYTES` in all. Thread-safe: a push takes in its
    caller's thread, its answers give back on the loop's.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory, the caller's until :meth:`give_back`."""
        with self._lock:
            free = self._free
            fits = [index for index, buffer in enumerate(free) if buffer.nbytes >= nbytes]
            if fits:
                buffer = free.pop(min(fits, key=lambda index: free[index].nbytes))
            else:
                buffer = np.empty(max(nbytes + nbytes // 4, 1), np.uint8)
            self._lent[buffer.ctypes.data] = buffer
        return buffer.data[:nbytes]

    def give_back(self, view: memoryview | np.ndarray) -> None:
        """Give back what :meth:`take` returned (or an array laid over it from its start);
        raises ValueError for memory not taken here."""
        address = np.asarray(view).ctypes.data
        with self._lock:
            buffer = self._lent.pop(address, None)
            if buffer is None:
                raise ValueError(f"give_back: no push buffer was lent at address {address:#x}")
            if buffer.nbytes > MAX_SPARE_PUSH_BYTES:
                return
            free = self._free
            free.append(buffer)
            while len(free) > MAX_SPARE_PUSH_BUFFERS or _nbytes(free) > MAX_SPARE_PUSH_BYTES:
                del free[0]  # the oldest: the sizes of recent pushes are kept

    @property
    def kept_bytes(self) -> int:
        """The bytes of the free buffers kept."""
        with self._lock:
            return _nbytes(self._free)


def _nbytes(buffers: list[np.ndarray]) -> int:
    return sum(buffer.nbytes for buffer in buffers)


def pull_requests(
    pulls: list[tuple[Entry, RowIds, np.ndarray]],
) -> dict[int, tuple[list[WireArray], list[memoryview]]]:
    """Each server's ``ROW_PULL``: per key with requested rows in its range, those ids, and
    where the rows it answers land (the slice of that key's output ``data``, C-contiguous,
    one row per id)."""
    requests: dict[int, tuple[list[WireArray], list[memoryview]]] = {}
    for entry, ids, data in pulls:
        for server, first, end in slices(entry, ids):
            if end > first:
                arrays, landings = requests.setdefault(server, ([], []))
                arrays.append((entry.key, ids[first:end], 0))
                landings.append(memoryview(cast(Any, data[first:end])).cast("B"))
    return requests
