"""The rows a store holds of a row-sparse key: memory by rows stored, not rows declared.

:class:`RowIndex` maps int64 row ids to dense slots ``0, 1, 2, ...`` (in order of insertion)
with open addressing: a power-of-two table of (id, slot) pairs, a multiplicative hash of the
id, and linear probing. Where the compiled kernels are made (:mod:`akv.jit`, as in every
process that holds row-sparse keys) the probing is compiled, one id after the other; without
them it runs in NumPy for every pending id at once: one probe for all, then a window of
:data:`_PROBE_WINDOW` positions per step for the ids not yet settled. Both give the same
slots and keep the same invariant (an id sits before the first free position of its probe
sequence), so an index filled one way is read the other. Compiled, a step's lookup of 2,300
ids in an index of 250,000 takes 33-37 us instead of 110-120, and a doubling of 2^21
positions 33 ms instead of 480 (``docs/benchmarks.md``).
:class:`RowTable` is a RowIndex and a row arena, an array of ``(capacity, *row_shape)``
grown by doubling (in place, without copying, on Linux), row ``slot`` of which holds the
row of the id with that slot.

A table declared with 10^9 rows costs nothing until rows are written: both grow with the
rows stored (32 to 64 bytes of index per row, and the rows themselves). Rows are never
removed. Open addressing was chosen for issue #25 over sorted arrays, pandas and
pyarrow lookups: no dependency, and memory by ids held for ids up to 2**63.

A table of at most :data:`DIRECT_MAX_ROWS` declared rows of at least
:data:`DIRECT_MIN_ROW_BYTES` each uses a :class:`DirectIndex` instead: one int32 per
declared row (at most 1/16 of the dense table, 64 MiB), allocated zeroed and so resident
only where ids were written, whose lookup is one NumPy ``take`` (a step's 1,950 ids in
about 2 us, where probing takes 35 us compiled, 110 in NumPy).
"""

from __future__ import annotations

import abc
import contextlib
import math
import mmap
import random
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import numpy.typing as npt

from akv import jit
from akv.errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from akv.sparse import (
    RowIds,
    RowSparseArray,
    check_dtype,
    check_row_ids,
    check_shape,
    host_rows,
)

__all__ = [
    "DIRECT_MAX_ROWS",
    "DIRECT_MIN_ROW_BYTES",
    "MAX_LOAD_FACTOR",
    "MIN_ARENA_ROWS",
    "MIN_INDEX_CAPACITY",
    "REMAP_MIN_BYTES",
    "DirectIndex",
    "RowIndex",
    "RowTable",
]

#: The fewest positions a RowIndex has (a power of two).
MIN_INDEX_CAPACITY = 8
#: A RowIndex doubles before more than this fraction of its positions would hold an id.
MAX_LOAD_FACTOR = 0.5
#: The fewest rows a RowTable's arena has once it holds any.
MIN_ARENA_ROWS = 8

#: The most declared rows a table indexes with a :class:`DirectIndex` (64 MiB of int32).
DIRECT_MAX_ROWS = 2**24
#: The narrowest rows (bytes) a table indexes directly: its map is then at most 1/16 of
#: the dense table's bytes.
DIRECT_MIN_ROW_BYTES = 64

#: Marks a free position (row ids are never negative).
_EMPTY = -1
#: The largest opaque item NumPy makes (``np.dtype((np.void, n))``).
_VOID_MAX_BYTES = 2**31 - 1
#: Positions one probing step reads for each pending id (128 bytes of the table).
_PROBE_WINDOW = 8
_WINDOW_STEPS = np.arange(_PROBE_WINDOW, dtype=np.int64)
#: 2**64 / the golden ratio, odd: Knuth's multiplicative (Fibonacci) hash; an index takes
#: it when asked to (tests), else a random odd multiplier of its own, so that no list of
#: ids chosen in advance collides in every index (a fixed multiplier has such lists).
FIBONACCI_MULTIPLIER = 0x9E3779B97F4A7C15
_FIBONACCI = np.uint64(FIBONACCI_MULTIPLIER)
_HALF = np.uint64(32)
_RANDOM = random.SystemRandom()
#: Arenas live in anonymous private memory that ``mremap`` grows in place (Linux).
_REMAP = sys.platform.startswith("linux") and hasattr(mmap, "MAP_PRIVATE")
_HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)
_HUGE_PAGE = 1 << 21
#: The smallest arena that gets such memory of its own (one huge page): a smaller one is
#: cheap to copy, and a mapping per small table would waste pages and the process's count
#: of mappings.
REMAP_MIN_BYTES = _HUGE_PAGE


class _SlotIndex(abc.ABC):
    """What :class:`RowIndex` and :class:`DirectIndex` share: the checked ``lookup`` and
    ``insert`` over their ``_lookup`` and ``_insert`` (ids checked against ``_bound``:
    None for any id >= 0)."""

    __slots__ = ()

    _bound: int | None = None

    def lookup(self, ids: npt.ArrayLike) -> RowIds:
        """The slot of each id, or -1 for an id not in the index (a new int64 array).

        Raises
        ------
        InvalidArgumentError, RowIdError
            ``ids`` are not 1-D integers, or one is negative (or past the index's rows).
        """
        what = f"{type(self).__name__}.lookup"
        return self._lookup(check_row_ids(ids, self._bound, what))

    def insert(self, ids: npt.ArrayLike) -> RowIds:
        """The slot of each id; ids not yet present get the next free slots, in the order
        they first appear in ``ids`` (as a dict would number them).

        Ids already present keep their slots. An id repeated in ``ids`` gets one slot.

        Raises
        ------
        InvalidArgumentError, RowIdError
            ``ids`` are not 1-D integers, or one is negative (or past the index's rows).
        """
        what = f"{type(self).__name__}.insert"
        return self._insert(check_row_ids(ids, self._bound, what))

    @abc.abstractmethod
    def _lookup(self, ids: RowIds) -> RowIds:
        """``lookup`` of checked ids."""

    @abc.abstractmethod
    def _insert(self, ids: RowIds) -> RowIds:
        """``insert`` of checked ids."""


class RowIndex(_SlotIndex):
    """A map from row ids (int64, >= 0) to slots ``0 .. len - 1``, in insertion order.

    Parameters
    ----------
    capacity
        Positions to start with (rounded up to a power of two, at least
        :data:`MIN_INDEX_CAPACITY`); the index doubles as needed, so that at most
        :data:`MAX_LOAD_FACTOR` of its positions hold an id.

    A slot never changes once given, also across growth. Not thread-safe: one caller at a
    time.
    """

    __slots__ = ("_mask", "_multiplier", "_shift", "_size", "_table")

    def __init__(self, capacity: int = MIN_INDEX_CAPACITY, multiplier: int | None = None) -> None:
        if multiplier is None:
            multiplier = _RANDOM.getrandbits(64)
        self._multiplier = np.uint64(multiplier | 1)
        self._size = 0
        self._allocate(_power_of_two(max(int(capacity), MIN_INDEX_CAPACITY)))

    def _allocate(self, capacity: int) -> None:
        # One (id, slot) pair per position: a probe reads both from one cache line.
        self._table = np.full((capacity, 2), _EMPTY, np.int64)
        self._mask = capacity - 1
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """Positions in the table (a power of two, at least twice :func:`len`)."""
        return int(self._table.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (16 per position)."""
        return int(self._table.nbytes)

    def items(self) -> tuple[RowIds, RowIds]:
        """Every id held and its slot, sorted by id (new arrays)."""
        held = self._table[self._table[:, 0] != _EMPTY]
        order = np.argsort(held[:, 0])
        return held[order, 0], held[order, 1]

    def __repr__(self) -> str:
        return f"<RowIndex {self._size} ids, capacity {self.capacity}>"

    # ------------------------------------------------------------ probing

    def _home(self, ids: RowIds) -> RowIds:
        """Each id's first position: the top bits of ``mix(id * multiplier) * FIBONACCI``
        (mod 2**64), where ``mix(h) = h ^ (h >> 32)``.

        The multiplier alone spreads ids as well as a random hash for most multipliers,
        but some random ones pile runs of consecutive ids (an embedding table's ids) into
        long probe runs: with one of 9 multipliers tried, a lookup of 3,400 Zipf ids in
        an index of 172,000 took 1.1 ms instead of 0.07. Folding the high half into the
        low one and multiplying again by the Fibonacci constant spreads them alike for
        every multiplier. Each step is a bijection of 2**64, so ids that collide at every
        capacity can still be made for the tests (by inverting them).
        """
        hashed: npt.NDArray[np.uint64] = ids.view(np.uint64) * self._multiplier
        hashed ^= hashed >> _HALF
        hashed *= _FIBONACCI
        hashed >>= self._shift
        return hashed.view(np.int64)

    def _window(self, position: RowIds, width: int) -> RowIds:
        """The ``width`` positions from each of ``position`` on, wrapping."""
        window = position[:, None] + _WINDOW_STEPS[:width]
        window &= self._mask
        return window

    def _probe(
        self, compiled: SimpleNamespace, ids: RowIds, slots: RowIds, next_slot: int, mode: int
    ) -> int:
        """:func:`akv.jit._index_probe` on this index (``ids`` C-contiguous)."""
        return int(
            compiled.index_probe(
                self._table, ids, slots, self._multiplier, self._shift, self._mask, next_slot, mode
            )
        )

    def _lookup(self, ids: RowIds) -> RowIds:
        if ids.size == 0 or self._size == 0:
            return np.full(ids.size, -1, np.int64)
        compiled = jit.made()
        if compiled is not None:  # one id after the other, compiled: 3x faster
            found = np.empty(ids.size, np.int64)
            self._probe(compiled, np.ascontiguousarray(ids), found, 0, jit.INDEX_FIND)
            return found
        table = self._table
        # Most ids are at home: one probe for all, then a window at a time for the rest.
        position = self._home(ids)
        entry = np.take(table, position, axis=0)  # 4x faster than table[position]
        hit = entry[:, 0] == ids
        found = np.where(hit, entry[:, 1], -1)
        pending = np.flatnonzero((entry[:, 0] != _EMPTY) ^ hit)
        position = position[pending] + 1
        wanted = ids[pending]
        while pending.size:
            entries = np.take(table, self._window(position, _PROBE_WINDOW), axis=0)
            held = entries[:, :, 0]
            # An id sits before the first free position of its probe sequence, so a window
            # holds at most one match, and none after a free position.
            match = held == wanted[:, None]
            matched = _any_in_rows(match)
            found[pending[matched]] = entries[:, :, 1][match]
            going = ~(matched | _any_in_rows(held == _EMPTY))
            pending, wanted = pending[going], wanted[going]
            position = position[going] + _PROBE_WINDOW
        return found

    def _insert(self, ids: RowIds) -> RowIds:
        compiled = jit.made()
        if compiled is not None:
            ids = np.ascontiguousarray(ids)
            found = self._lookup(ids)
            count = int(np.count_nonzero(found < 0))
            if count:
                self._reserve(self._size + count)
                self._size = self._probe(compiled, ids, found, self._size, jit.INDEX_CLAIM)
            return found
        found = self._lookup(ids)
        missing = np.flatnonzero(found < 0)
        if missing.size:
            self._reserve(self._size + missing.size)
            found[missing] = self._claim(ids[missing], None)
        return found

    def _reserve(self, count: int) -> None:
        """Grow (by doubling) until ``count`` ids fit within the load factor."""
        capacity = self.capacity
        while count > capacity * MAX_LOAD_FACTOR:
            capacity *= 2
        if capacity == self.capacity:
            return
        held = self._table[self._table[:, 0] != _EMPTY]
        self._allocate(capacity)
        compiled = jit.made()
        if compiled is not None:
            ids, slots = np.ascontiguousarray(held[:, 0]), np.ascontiguousarray(held[:, 1])
            self._probe(compiled, ids, slots, 0, jit.INDEX_PLACE)
            return
        self._size = 0
        self._claim(held[:, 0], held[:, 1])

    def _claim(self, ids: RowIds, given: RowIds | None) -> RowIds:
        """Place ``ids`` (none present yet; repeats allowed) and return their slots:
        ``given[i]`` for ``ids[i]``, or the next free slots in order of first appearance
        when ``given`` is None.

        All pending ids probe at once, a window at a time, each for its first free
        position (or itself: a repeated id placed in this call). Several that pick the
        same free position are told apart by writing each one's number into the
        position's slot: the number read back names the one id that takes it. The others
        look again from that position, which an equal id now finds itself at.
        """
        table = self._table
        table_ids, table_slots = table[:, 0], table[:, 1]
        spot = np.empty(ids.size, np.int64)
        first_seen = np.zeros(ids.size, bool)
        pending = np.arange(ids.size)
        position = self._home(ids)
        wanted = ids
        width = 1  # most ids find their home free: a window for the rest only
        while pending.size:
            window = self._window(position, width)
            held = np.take(table, window, axis=0)[:, :, 0]
            match = held == wanted[:, None]
            stop = match | (held == _EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(pending.size)
            stopped = stop[rows, first]
            at = window[rows, first]
            settled = stopped & match[rows, first]
            spot[pending[settled]] = at[settled]
            candidates = np.flatnonzero(stopped ^ settled)
            if candidates.size:
                spots = at[candidates]
                table_slots[spots] = candidates
                winners = candidates[table_slots[spots] == candidates]
                table_ids[at[winners]] = wanted[winners]
                spot[pending[winners]] = at[winners]
                first_seen[pending[winners]] = True
                settled[winners] = True
            position = np.where(stopped, at, position + width)
            width = _PROBE_WINDOW
            going = ~settled
            pending, position, wanted = pending[going], position[going], wanted[going]
        placed = np.flatnonzero(first_seen)
        if given is not None:
            table_slots[spot[placed]] = given[placed]
        elif placed.size == ids.size:
            table_slots[spot] = np.arange(self._size, self._size + ids.size)
        else:
            # A repeated id: which of its copies took the position is arbitrary; number the
            # new ids by first appearance all the same.
            spots, appearance = np.unique(spot, return_index=True)
            order = np.argsort(appearance)
            table_slots[spots[order]] = np.arange(self._size, self._size + spots.size)
        self._size += int(placed.size)
        return table_slots[spot]


class DirectIndex(_SlotIndex):
    """A map from row ids in ``[0, rows)`` to slots ``0 .. len - 1``, in insertion order:
    an int32 array of ``rows`` entries holding each id's slot + 1 (0: not held).

    The array is allocated zeroed (``calloc``: pages the OS maps on first write), so an
    index costs the pages its ids fall on, at most 4 bytes per declared row. Same contract
    as :class:`RowIndex` (a slot never changes; repeated ids get one slot, new ids are
    numbered by first appearance). Not thread-safe: one caller at a time.
    """

    __slots__ = ("_bound", "_held", "_map", "_size")

    def __init__(self, rows: int) -> None:
        if not 0 <= rows <= np.iinfo(np.int32).max:
            raise InvalidArgumentError(
                f"DirectIndex: {rows} rows do not fit an int32 map (0 to {2**31 - 1})"
            )
        self._map = np.zeros(rows, np.int32)
        self._bound = rows
        #: The id of each slot, in slot order (grown by doubling).
        self._held = np.empty(MIN_INDEX_CAPACITY, np.int64)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """The ids it can hold: the declared rows."""
        return int(self._map.size)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds: its map (resident only where written) and its ids."""
        return int(self._map.nbytes + self._held.nbytes)

    def items(self) -> tuple[RowIds, RowIds]:
        """Every id held and its slot, sorted by id (new arrays)."""
        held = self._held[: self._size]
        order = np.argsort(held)
        return held[order], order

    def __repr__(self) -> str:
        return f"<DirectIndex {self._size} ids of {self.capacity}>"

    def _lookup(self, ids: RowIds) -> RowIds:
        found = np.take(self._map, ids).astype(np.int64)
        found -= 1
        return found

    def _insert(self, ids: RowIds) -> RowIds:
        found = self._lookup(ids)
        missing = np.flatnonzero(found < 0)
        if missing.size == 0:
            return found
        new = ids[missing]
        if not _unique(new):
            # Numbered by first appearance, as a dict would.
            firsts = np.sort(np.unique(new, return_index=True)[1])
            new = new[firsts]
        start, end = self._size, self._size + new.size
        if end > self._held.size:
            grown = np.empty(max(end, 2 * self._held.size), np.int64)
            grown[:start] = self._held[:start]
            self._held = grown
        self._held[start:end] = new
        self._map[new] = np.arange(start + 1, end + 1, dtype=np.int32)
        self._size = end
        found[missing] = np.take(self._map, ids[missing]) - 1
        return found


class _Arena:
    """A RowTable's rows: an array of ``(capacity, *row_shape)`` that grows, its new rows
    zero.

    On Linux the rows live in anonymous private memory that grows in place (``mremap``
    moves pages, copies no byte, and the old and new arrays are never both resident),
    with huge pages where the kernel gives them, as NumPy asks for its large arrays, once
    it reaches :data:`REMAP_MIN_BYTES`.
    Doubling a table of 400,000 rows of 64 float32 by copying stalled its caller for 150
    to 380 ms here. While a view of the rows is alive (``RowTable.rows``), where the
    mapping cannot be resized, and on other systems, it grows by copying into new memory
    instead, so that no view ever dangles.
    """

    __slots__ = ("_map", "array")

    def __init__(self, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.array: np.ndarray = np.zeros((0, *row_shape), dtype)
        self._map: mmap.mmap | None = None

    def grow(self, rows: int) -> None:
        """Room for at least ``rows`` rows (more than now): the rows held keep their
        values."""
        held, row_shape, dtype = self.array.shape[0], self.array.shape[1:], self.array.dtype
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        if not _REMAP or rows * row_bytes < REMAP_MIN_BYTES:
            grown = np.zeros((rows, *row_shape), dtype)
            grown[:held] = self.array
            self.array = grown
            return
        # Whole huge pages: the kernel then places the mapping on a huge page boundary,
        # and it stays there as it grows (random rows read through 4 KiB pages miss the
        # TLB: the benchmark's step was 5% slower).
        nbytes = -(-rows * row_bytes // _HUGE_PAGE) * _HUGE_PAGE
        rows = nbytes // row_bytes
        if self._map is not None:
            self.array = np.zeros((0, *row_shape), dtype)  # this table's own view goes
            resized = False
            try:
                self._map.resize(nbytes)
                resized = True
            except (BufferError, OSError, SystemError):
                pass  # a view of the rows is alive, or no mremap here: copied below
            finally:
                self.array = _rows_in(self._map, rows if resized else held, row_shape, dtype)
            if resized:
                _advise_huge_pages(self._map)
                return
        fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _advise_huge_pages(fresh)
        grown = _rows_in(fresh, rows, row_shape, dtype)
        grown[:held] = self.array
        self.array, self._map = grown, fresh


def _rows_in(
    memory: mmap.mmap, rows: int, row_shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    count = rows * int(np.prod(row_shape, dtype=np.int64))
    return np.frombuffer(memory, dtype, count=count).reshape(rows, *row_shape)


def _advise_huge_pages(memory: mmap.mmap) -> None:
    if _HUGE_PAGES is not None:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            memory.madvise(_HUGE_PAGES)


class RowTable:
    """The stored rows of an array of ``shape``: a :class:`RowIndex` and a row arena.

    Parameters
    ----------
    shape
        The declared shape, rows first; only rows written are stored, so ``shape[0]`` may
        be huge (10^9) at no cost.
    dtype
        The rows' dtype (one akv stores); values are never cast.

    direct
        Index the rows with a :class:`DirectIndex` (True) or a :class:`RowIndex` (False);
        None (the default) picks the direct one for tables of at most
        :data:`DIRECT_MAX_ROWS` rows of at least :data:`DIRECT_MIN_ROW_BYTES` bytes.

    A row not stored reads as zeros. Every call checks its ids against ``shape[0]``. Not
    thread-safe: one caller at a time.

    Raises
    ------
    InvalidArgumentError, UnsupportedDTypeError
    """

    __slots__ = ("_dtype", "_index", "_rows", "_shape")

    def __init__(
        self, shape: Sequence[int] | int, dtype: npt.DTypeLike, *, direct: bool | None = None
    ) -> None:
        self._shape = check_shape(shape, "RowTable")
        try:
            self._dtype = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidArgumentError(f"RowTable: {dtype!r} is not a dtype") from exc
        check_dtype(self._dtype, "RowTable")
        if direct is None:
            row_bytes = math.prod(self.row_shape) * self._dtype.itemsize
            direct = self._shape[0] <= DIRECT_MAX_ROWS and row_bytes >= DIRECT_MIN_ROW_BYTES
        self._index: RowIndex | DirectIndex = DirectIndex(self._shape[0]) if direct else RowIndex()
        self._rows = _Arena(self.row_shape, self._dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The declared shape."""
        return self._shape

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row (``shape[1:]``)."""
        return self._shape[1:]

    @property
    def dtype(self) -> np.dtype:
        """The rows' dtype."""
        return self._dtype

    def __len__(self) -> int:
        """How many rows are stored."""
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes held: the index and the whole arena (rows stored and spare)."""
        return self._index.nbytes + int(self._rows.array.nbytes)

    @property
    def rows(self) -> np.ndarray:
        """The stored rows, row ``slot`` for each slot that :meth:`rows_for` gave: a view of
        the table's own until the next call that stores new rows (the arena may then grow
        into new memory: the view stays readable, and sees no later write)."""
        return self._rows.array[: len(self._index)]

    def rows_for(self, ids: npt.ArrayLike) -> RowIds:
        """The slot of each id's row in :attr:`rows`; rows not yet stored are stored as
        zeros first. Repeated ids get the same slot.

        Raises
        ------
        InvalidArgumentError, RowIdError
        """
        return self._rows_for(self._ids(ids, "RowTable.rows_for"))

    def stored(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether each id's row is stored; stores nothing.

        Raises
        ------
        InvalidArgumentError, RowIdError
        """
        return self._index._lookup(self._ids(ids, "RowTable.stored")) >= 0

    def gather(self, ids: npt.ArrayLike, out: np.ndarray | None = None) -> np.ndarray:
        """The rows of ``ids``, in order, zeros for rows not stored; stores nothing.

        Written into ``out`` when given (a writable NumPy array of shape
        ``(len(ids), *row_shape)`` and the table's dtype), else into a new array.

        Raises
        ------
        InvalidArgumentError, RowIdError, ShapeMismatchError, DTypeMismatchError
        """
        what = "RowTable.gather"
        checked = self._ids(ids, what)
        slots = self._index._lookup(checked)
        if out is None:
            out = np.empty((slots.size, *self.row_shape), self._dtype)
        else:
            self._check_rows(out, slots.size, f"{what} out")
            if not out.flags.writeable:
                raise InvalidArgumentError(f"{what}: out is read-only; pass a writable array")
        absent = slots < 0
        if len(self._index) == 0:
            out[...] = 0
        elif absent.any():
            np.take(self._rows.array, np.where(absent, 0, slots), axis=0, out=out, mode="clip")
            out[absent] = 0
        else:
            np.take(self._rows.array, slots, axis=0, out=out, mode="clip")
        return out

    def scatter(self, ids: npt.ArrayLike, values: object) -> None:
        """Set the row of each id to its row of ``values`` (shape ``(len(ids), *row_shape)``,
        the table's dtype), storing rows not yet stored.

        Raises
        ------
        InvalidArgumentError
            An id is repeated (which row would win is undefined), or a bad argument.
        RowIdError, ShapeMismatchError, DTypeMismatchError
        """
        what = "RowTable.scatter"
        checked = self._ids(ids, what)
        rows = self._values(values, checked.size, what)
        if not _unique(checked):
            unique, counts = np.unique(checked, return_counts=True)
            raise InvalidArgumentError(
                f"{what}: row id {unique[np.argmax(counts > 1)]} is given more than once; "
                "each row may be set once per call"
            )
        self._write(self._rows_for(checked), rows)

    def add(self, ids: npt.ArrayLike, values: object) -> None:
        """Add its row of ``values`` to the row of each id (rows not yet stored start at
        zero). A repeated id gets the sum of its rows.

        Raises
        ------
        InvalidArgumentError, RowIdError, ShapeMismatchError, DTypeMismatchError
        """
        what = "RowTable.add"
        checked = self._ids(ids, what)
        rows = self._values(values, checked.size, what)
        slots = self._rows_for(checked)
        if _unique(checked):
            summed = np.take(self._rows.array, slots, axis=0)
            summed += rows
            self._write(slots, summed)
        else:
            np.add.at(self._rows.array, slots, rows)

    def load(self, ids: npt.ArrayLike, fill: Callable[[np.ndarray], object]) -> None:
        """Store the rows ``ids`` (sorted, unique) in this empty table, and let ``fill``
        write their values in place: it gets the rows, in ``ids``' order, as a writable
        view of the table's own (a restore reads them from a file straight into the
        table, never holding them twice). Rows ``fill`` leaves alone are zero.

        Raises
        ------
        InvalidArgumentError
            The table stores rows already, or ``ids`` are not sorted and unique.
        RowIdError
        """
        what = "RowTable.load"
        checked = self._ids(ids, what)
        if len(self._index):
            raise InvalidArgumentError(f"{what}: the table stores {len(self)} rows already")
        if checked.size > 1 and bool(np.any(checked[1:] <= checked[:-1])):
            raise InvalidArgumentError(f"{what}: the ids are not sorted and unique")
        slots = self._rows_for(checked)
        # An empty index numbers new ids in order of appearance: the rows are 0, 1, ...
        assert not slots.size or (slots[0] == 0 and slots[-1] == slots.size - 1), slots
        fill(self._rows.array[: slots.size])

    def ids(self) -> RowIds:
        """The ids of the rows stored, sorted (a new array)."""
        return self._index.items()[0]

    def to_sparse(self) -> RowSparseArray:
        """Every stored row as a RowSparseArray of :attr:`shape` (copies, sorted by id).

        A stored row is listed even when it holds zeros."""
        ids, slots = self._index.items()
        return RowSparseArray._trusted(self._rows.array[slots], ids, self._shape)

    def __repr__(self) -> str:
        return f"<RowTable shape={self._shape} dtype={self._dtype} rows stored={len(self)}>"

    # ------------------------------------------------------------ helpers

    def _ids(self, ids: npt.ArrayLike, what: str) -> RowIds:
        return check_row_ids(ids, self._shape[0], what)

    def _rows_for(self, ids: RowIds) -> RowIds:
        slots = self._index._insert(ids)
        stored, capacity = len(self._index), self._rows.array.shape[0]
        if stored > capacity:
            self._rows.grow(max(stored, 2 * capacity, MIN_ARENA_ROWS))
        return slots

    def _write(self, slots: RowIds, rows: np.ndarray) -> None:
        """Set arena rows ``slots`` (unique) to ``rows``."""
        size = math.prod(self.row_shape)
        if size == 0 or not slots.size:
            return
        if size * self._dtype.itemsize > _VOID_MAX_BYTES:  # no such item: rows of elements
            arena_rows = self._rows.array.reshape(self._rows.array.shape[0], size)
            arena_rows[slots] = np.ascontiguousarray(rows).reshape(slots.size, size)
            return
        # Each row as one opaque item: NumPy copies rows so about 1.5x faster than as
        # rows of elements.
        record = np.dtype((np.void, size * self._dtype.itemsize))
        arena = self._rows.array.reshape(self._rows.array.shape[0], size).view(record)[:, 0]
        arena[slots] = np.ascontiguousarray(rows).reshape(slots.size, size).view(record)[:, 0]

    def _values(self, values: object, count: int, what: str) -> np.ndarray:
        rows = host_rows(values, f"{what} values")
        self._check_rows(rows, count, f"{what} values")
        return rows

    def _check_rows(self, rows: np.ndarray, count: int, what: str) -> None:
        expected = (count, *self.row_shape)
        if rows.shape != expected:
            raise ShapeMismatchError(
                f"{what}: shape {rows.shape} does not match {expected} (one row of shape "
                f"{self.row_shape} per id, for a table of shape {self._shape})",
                expected=expected,
                got=rows.shape,
            )
        if rows.dtype != self._dtype:
            raise DTypeMismatchError(
                f"{what}: dtype {rows.dtype} does not match the table's dtype {self._dtype} "
                "(akv never casts; convert it first)",
                expected=self._dtype,
                got=rows.dtype,
            )


def _any_in_rows(flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """``flags.any(axis=1)`` for a C-contiguous ``(n, 8)`` bool array: each row's 8 bytes
    read as one uint64 (about 10x faster than NumPy's reduction over so short an axis)."""
    if flags.shape[1] == 8 and flags.flags.c_contiguous:
        words: npt.NDArray[np.uint64] = flags.view(np.uint64)[:, 0]
        return np.not_equal(words, 0)
    return np.asarray(flags.any(axis=1), bool)


def _power_of_two(count: int) -> int:
    """The smallest power of two >= ``count`` (``count`` >= 1)."""
    return 1 << (count - 1).bit_length()


def _unique(ids: RowIds) -> bool:
    """Whether no id repeats (sorted ids, the usual case, cost one comparison)."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return True
    return int(np.unique(ids).size) == int(ids.size)
