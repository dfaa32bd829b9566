"""akv.rows: the row index (open addressing in NumPy) and the row table of a row-sparse key."""

from __future__ import annotations

import errno
import mmap
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import akv
from akv import jit
from akv import rows as rows_module
from akv.rows import (
    DIRECT_MAX_ROWS,
    DIRECT_MIN_ROW_BYTES,
    FIBONACCI_MULTIPLIER,
    MAX_LOAD_FACTOR,
    MIN_INDEX_CAPACITY,
    REMAP_MIN_BYTES,
    DirectIndex,
    RowIndex,
    RowTable,
)

F32 = np.float32
INT64_MAX = 2**63 - 1
#: The multiplier's inverse mod 2**64. An index with the Fibonacci multiplier hashes ``id``
#: to the top bits of ``FIB * mix(FIB * id)``, ``mix(h) = h ^ (h >> 32)`` (its own inverse),
#: so ``id = mix(k * INVERSE) * INVERSE`` hashes to ``k``'s top bits: small ``k`` all hash
#: to position 0 at every capacity.
INVERSE = pow(FIBONACCI_MULTIPLIER, -1, 2**64)


def _mix(h: int) -> int:
    return h ^ (h >> 32)


def colliding_ids(count: int, last: bool = False) -> np.ndarray:
    """``count`` distinct ids that all hash to position 0 (``last``: to the last position)
    at any capacity below 2**40."""
    keys = range(2**64 - 1, 2**64 - 1 - 40 * count, -1) if last else range(1, 40 * count)
    ids = [(_mix((k * INVERSE) % 2**64) * INVERSE) % 2**64 for k in keys]
    return np.array([i for i in ids if i <= INT64_MAX][:count], np.int64)


class DictIndex:
    """The reference: a dict that gives new ids the next slots, in order."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def insert(self, ids: np.ndarray) -> None:
        for i in ids.tolist():
            self.slots.setdefault(i, len(self.slots))

    def lookup(self, ids: np.ndarray) -> list[int]:
        return [self.slots.get(i, -1) for i in ids.tolist()]


def check_against(index: RowIndex, reference: DictIndex, ids: np.ndarray) -> None:
    """Insert ``ids`` into both: the slots must be the dict's, and the load factor kept."""
    slots = index.insert(ids)
    reference.insert(ids)
    assert slots.tolist() == reference.lookup(ids)
    assert len(index) == len(reference.slots)
    assert index.capacity * MAX_LOAD_FACTOR >= len(index)


# ---------------------------------------------------------------- RowIndex


@pytest.fixture(params=["numpy", "compiled"])
def probing(request, monkeypatch):
    """Each RowIndex test twice: probing in NumPy (a window of positions for every id at
    once) and compiled (numba, one id after the other); both must give the same slots."""
    if request.param == "numpy":
        monkeypatch.setattr(jit, "made", lambda: None)
    elif jit.kernels() is None:
        pytest.skip("the compiled kernels are not available here (numba, AKV_JIT)")
    return request.param


@pytest.mark.usefixtures("probing")
def test_index_agrees_with_a_dict_on_random_ids():
    rng = np.random.default_rng(25)
    index, reference = RowIndex(), DictIndex()
    for step in range(60):
        high = 2**63 - 1 if step % 3 == 0 else 5000
        ids = rng.integers(0, high, size=int(rng.integers(0, 400)), dtype=np.int64)
        check_against(index, reference, ids)
        probe = np.concatenate([ids, rng.integers(0, 6000, size=300)])
        assert index.lookup(probe).tolist() == reference.lookup(probe)
    ids, slots = index.items()
    assert ids.tolist() == sorted(reference.slots)
    assert slots.tolist() == [reference.slots[i] for i in ids.tolist()]


@pytest.mark.usefixtures("probing")
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.one_of(st.integers(0, 64), st.integers(0, INT64_MAX)), max_size=50),
        max_size=8,
    )
)
def test_index_agrees_with_a_dict(batches):
    index, reference = RowIndex(), DictIndex()
    for batch in batches:
        check_against(index, reference, np.array(batch, np.int64))
    probe = np.arange(70, dtype=np.int64)
    assert index.lookup(probe).tolist() == reference.lookup(probe)


def fibonacci() -> RowIndex:
    """An index with the fixed multiplier, whose colliding ids are known."""
    return RowIndex(multiplier=FIBONACCI_MULTIPLIER)


@pytest.mark.usefixtures("probing")
def test_colliding_ids_all_share_a_home():
    ids = colliding_ids(50)
    for capacity in (8, 1024, 2**20):
        assert set(RowIndex(capacity, FIBONACCI_MULTIPLIER)._home(ids).tolist()) == {0}


@pytest.mark.usefixtures("probing")
def test_each_index_hashes_with_its_own_multiplier_so_no_ids_collide_everywhere():
    ids = colliding_ids(50)
    homes = [set(RowIndex(2**20)._home(ids).tolist()) for _ in range(3)]
    assert all(len(home) > 40 for home in homes)  # spread, not piled on one position
    assert len({RowIndex()._multiplier for _ in range(8)}) == 8


@pytest.mark.usefixtures("probing")
def test_consecutive_ids_spread_for_every_multiplier():
    """A run of consecutive ids (an embedding table's) lands at its home positions as
    random ids would, whatever the multiplier: with the multiplier alone, this one put 77%
    of 100,000 consecutive ids away from home (long probe runs: lookups 15x slower)."""
    ids = np.arange(100_000, dtype=np.int64)
    for multiplier in (0x912E6CFE7CBCBACD, FIBONACCI_MULTIPLIER, None):
        index = RowIndex(multiplier=multiplier)
        index.insert(ids)
        away = np.mean(index._table[index._home(ids), 0] != ids)
        assert away < 0.3, (multiplier, away)  # about 0.17 at this load (0.38)
    assert index.lookup(ids).tolist() == list(range(100_000))


@pytest.mark.usefixtures("probing")
def test_ids_that_hash_alike_are_all_found():
    ids = colliding_ids(700)[:600]
    index, reference = fibonacci(), DictIndex()
    check_against(index, reference, ids[:300])  # all at once: they collide with each other
    for chunk in np.array_split(ids[300:], 7):  # then with those already placed
        check_against(index, reference, chunk)
    assert index.lookup(ids).tolist() == reference.lookup(ids)
    absent = colliding_ids(700)[600:]  # they probe the whole cluster, then a free position
    assert index.lookup(absent).tolist() == [-1] * 100


@pytest.mark.usefixtures("probing")
def test_ids_that_hash_to_the_last_position_wrap_around():
    ids = colliding_ids(5, last=True)
    index = RowIndex(8, FIBONACCI_MULTIPLIER)
    assert set(index._home(ids).tolist()) == {7}
    assert index.insert(ids[:3]).tolist() == [0, 1, 2]
    assert sorted(index._table[:, 0].tolist())[-3:] == sorted(ids[:3].tolist())
    assert index._table[0, 0] in ids  # the probe went on from the end to the start
    assert index.lookup(ids).tolist() == [0, 1, 2, -1, -1]
    assert index.insert(ids).tolist() == [0, 1, 2, 3, 4]  # and past a doubling


def test_an_index_probed_both_ways_in_turn():
    """An index filled partly in NumPy and partly compiled (a process whose kernels were
    made after its first rows) finds every id either way."""
    if jit.kernels() is None:
        pytest.skip("the compiled kernels are not available here (numba, AKV_JIT)")
    rng = np.random.default_rng(7)
    index, reference = RowIndex(), DictIndex()
    with pytest.MonkeyPatch.context() as patch:
        for step in range(40):
            if step % 2:
                patch.setattr(jit, "made", lambda: None)
            else:
                patch.undo()
            ids = np.concatenate([rng.integers(0, 3000, 200), colliding_ids(60)[step : step + 3]])
            check_against(index, reference, ids)
            probe = np.concatenate([ids, rng.integers(0, 4000, 300)])
            assert index.lookup(probe).tolist() == reference.lookup(probe)


@pytest.mark.usefixtures("probing")
def test_colliding_and_equal_ids_in_one_insert():
    ids = np.repeat(colliding_ids(20), 3)
    np.random.default_rng(1).shuffle(ids)
    index = fibonacci()
    slots = index.insert(ids)
    assert len(index) == 20
    assert slots.tolist() == [list(dict.fromkeys(ids.tolist())).index(i) for i in ids.tolist()]
    assert index.lookup(ids).tolist() == slots.tolist()


@pytest.mark.usefixtures("probing")
def test_growth_across_many_doublings_keeps_every_slot():
    index = RowIndex()
    assert index.capacity == MIN_INDEX_CAPACITY
    given = []
    for start in range(0, 3000, 7):  # small batches: about 10 doublings
        given.append(index.insert(np.arange(start, start + 7) * 1_000_003))
    every = np.arange(0, 3003) * 1_000_003
    assert index.lookup(every).tolist() == np.concatenate(given).tolist()
    assert index.lookup(every).tolist() == list(range(3003))
    assert index.capacity == 8192
    assert index.nbytes == 16 * index.capacity


@pytest.mark.usefixtures("probing")
def test_one_large_insert_grows_at_once():
    index = RowIndex()
    slots = index.insert(np.arange(10_000, dtype=np.int64)[::-1])
    assert sorted(slots.tolist()) == list(range(10_000))
    assert index.capacity == 32768


@pytest.mark.usefixtures("probing")
def test_present_ids_do_not_grow_the_index():
    index = RowIndex()
    index.insert(np.arange(4))
    capacity = index.capacity
    for _ in range(5):
        assert index.insert(np.arange(4)).tolist() == [0, 1, 2, 3]
    assert (len(index), index.capacity) == (4, capacity)


@pytest.mark.usefixtures("probing")
def test_the_largest_id_and_zero():
    index = RowIndex()
    assert index.insert([INT64_MAX, 0]).tolist() == [0, 1]
    assert index.lookup(np.array([0, INT64_MAX, 1], np.uint64)).tolist() == [1, 0, -1]


@pytest.mark.usefixtures("probing")
def test_an_empty_index_and_no_ids():
    index = RowIndex()
    assert index.lookup([5, 6]).tolist() == [-1, -1]
    assert index.lookup([]).tolist() == []
    assert index.insert([]).tolist() == []
    assert len(index) == 0
    assert index.items()[0].tolist() == []


@pytest.mark.usefixtures("probing")
def test_negative_ids_are_refused():
    index = RowIndex()
    with pytest.raises(akv.RowIdError, match=r"RowIndex.insert: row id -1 at position 1"):
        index.insert([3, -1])
    with pytest.raises(akv.RowIdError, match=r"RowIndex.lookup: row id -7 at position 0"):
        index.lookup([-7])
    with pytest.raises(akv.InvalidArgumentError, match="integers"):
        index.lookup([1.5])
    assert len(index) == 0


@pytest.mark.usefixtures("probing")
def test_capacity_is_a_power_of_two():
    assert RowIndex(1000).capacity == 1024
    assert RowIndex(0).capacity == MIN_INDEX_CAPACITY


# ---------------------------------------------------------------- DirectIndex


def test_direct_index_agrees_with_a_dict():
    rng = np.random.default_rng(26)
    index, reference = DirectIndex(5000), DictIndex()
    for _ in range(60):
        ids = rng.integers(0, 5000, size=int(rng.integers(0, 400)), dtype=np.int64)
        if rng.random() < 0.5:
            ids = np.unique(ids)  # sorted and unique: the usual case
        slots = index.insert(ids)
        reference.insert(ids)
        assert slots.tolist() == reference.lookup(ids)
        assert len(index) == len(reference.slots)
        probe = rng.integers(0, 5000, size=300)
        assert index.lookup(probe).tolist() == reference.lookup(probe)
    ids, slots = index.items()
    assert ids.tolist() == sorted(reference.slots)
    assert slots.tolist() == [reference.slots[i] for i in ids.tolist()]


def test_direct_index_numbers_repeated_new_ids_by_first_appearance():
    index = DirectIndex(100)
    index.insert([50])
    assert index.insert([7, 50, 3, 7, 99, 3]).tolist() == [1, 0, 2, 1, 3, 2]
    assert index.lookup([3, 7, 99, 50, 0]).tolist() == [2, 1, 3, 0, -1]
    assert len(index) == 4


def test_direct_index_grows_its_ids_across_doublings():
    index = DirectIndex(10**6)
    given = [index.insert(np.arange(start, start + 7) * 97) for start in range(0, 3000, 7)]
    every = np.arange(0, 3003) * 97
    assert index.lookup(every).tolist() == np.concatenate(given).tolist() == list(range(3003))
    assert index.items()[0].tolist() == every.tolist()


def test_direct_index_refuses_ids_outside_its_rows():
    index = DirectIndex(10)
    with pytest.raises(akv.RowIdError, match=r"DirectIndex.insert: row id 10 at position 1"):
        index.insert([3, 10])
    with pytest.raises(akv.RowIdError, match=r"DirectIndex.lookup: row id -1 at position 0"):
        index.lookup([-1])
    assert len(index) == 0
    with pytest.raises(akv.InvalidArgumentError, match="int32 map"):
        DirectIndex(2**31)


@pytest.mark.parametrize(
    ("shape", "dtype", "direct"),
    [
        ((10**6, 64), np.float32, True),  # the benchmark's table: 4 MB of map
        ((DIRECT_MAX_ROWS, 16), np.float32, True),
        ((DIRECT_MAX_ROWS + 1, 16), np.float32, False),  # a map over 64 MiB
        ((10**9, 64), np.float32, False),
        ((10**6, DIRECT_MIN_ROW_BYTES // 4 - 1), np.float32, False),  # map > 1/16 of rows
        ((10**6, 8), np.float64, True),
        ((10, 2), np.float32, False),
    ],
)
def test_a_table_indexes_directly_only_small_tables_of_wide_rows(shape, dtype, direct):
    table = RowTable(shape, dtype)
    assert isinstance(table._index, DirectIndex if direct else RowIndex)
    assert len(table) == 0


# ---------------------------------------------------------------- RowTable


def test_absent_rows_read_as_zeros():
    table = RowTable((100, 3), F32)
    assert table.gather([4, 99]).tolist() == [[0] * 3] * 2
    table.scatter([4], np.ones((1, 3), F32))
    assert table.gather([99, 4, 5]).tolist() == [[0] * 3, [1] * 3, [0] * 3]
    assert len(table) == 1  # gather stores nothing


def test_scatter_sets_and_add_accumulates():
    table = RowTable((10, 2), np.float64)
    table.scatter([3, 1], np.array([[1.0, 2.0], [3.0, 4.0]]))
    table.add([1, 7], np.array([[10.0, 10.0], [5.0, 6.0]]))
    table.scatter([3], np.array([[0.5, 0.5]]))
    assert table.gather([1, 3, 7]).tolist() == [[13, 14], [0.5, 0.5], [5, 6]]
    assert table.ids().tolist() == [1, 3, 7]


def test_add_sums_a_repeated_id():
    table = RowTable((10, 1), F32)
    table.add([2, 5, 2, 2], np.array([[1], [2], [3], [4]], F32))
    assert table.gather([2, 5]).tolist() == [[8], [2]]


def test_scatter_refuses_a_repeated_id():
    table = RowTable((10, 1), F32)
    with pytest.raises(akv.InvalidArgumentError, match="row id 5 is given more than once"):
        table.scatter([5, 1, 5], np.zeros((3, 1), F32))


def test_rows_for_stores_zero_rows_and_gives_their_slots():
    table = RowTable((10**6, 2), np.int32)
    slots = table.rows_for([500, 7, 500])
    assert slots[0] == slots[2]
    assert table.rows.shape == (2, 2)
    assert table.rows.tolist() == [[0, 0], [0, 0]]
    table.rows[slots[1]] = [3, 4]
    assert table.gather([7]).tolist() == [[3, 4]]
    assert table.rows_for([7]).tolist() == [slots[1]]


def test_to_sparse_lists_every_stored_row_sorted():
    table = RowTable((50, 2), F32)
    table.add([40, 3], np.ones((2, 2), F32))
    table.rows_for([20])
    value = table.to_sparse()
    assert isinstance(value, akv.RowSparseArray)
    assert value.shape == (50, 2)
    assert value.indices.tolist() == [3, 20, 40]
    assert value.data.tolist() == [[1, 1], [0, 0], [1, 1]]
    value.data[:] = 9
    assert table.gather([3]).tolist() == [[1, 1]]


def test_the_arena_grows_across_doublings_and_keeps_rows():
    rng = np.random.default_rng(7)
    table = RowTable((10**7, 4), F32)
    dense: dict[int, np.ndarray] = {}
    for _ in range(40):
        ids = np.unique(rng.integers(0, 10**7, size=int(rng.integers(1, 200))))
        values = rng.standard_normal((ids.size, 4)).astype(F32)
        table.add(ids, values)
        for i, row in zip(ids.tolist(), values, strict=True):
            dense[i] = dense.get(i, np.zeros(4, F32)) + row
    assert len(table) == len(dense)
    assert table.rows.shape[0] == len(dense)
    ids = np.array(sorted(dense))
    assert np.array_equal(table.gather(ids), np.array([dense[i] for i in ids.tolist()]))
    assert table.to_sparse().indices.tolist() == ids.tolist()


#: Rows of 64 float32: 8,192 of them fill REMAP_MIN_BYTES.
WIDE = 64


def _scatter_new_rows(table: RowTable, first: int, count: int, value: float) -> None:
    ids = np.arange(first, first + count) * 7  # spread over the declared rows
    table.scatter(ids, np.full((count, WIDE), value, F32))


@pytest.mark.parametrize("in_place", [True, False], ids=["remapped", "copied"])
def test_a_large_arena_grows_past_the_mapping_threshold_and_keeps_rows(monkeypatch, in_place):
    monkeypatch.setattr(rows_module, "_REMAP", in_place and rows_module._REMAP)
    table = RowTable((10**6, WIDE), F32)
    for batch in range(8):
        _scatter_new_rows(table, 3000 * batch, 3000, batch + 1)
    assert table.rows.nbytes > 2 * REMAP_MIN_BYTES
    ids = np.arange(24000) * 7
    expected = np.repeat(np.arange(1, 9, dtype=F32), 3000)[:, None] * np.ones(WIDE, F32)
    assert np.array_equal(table.gather(ids), expected)
    assert not table.gather([1, 6 * 24000 + 1]).any()  # rows never written read as zeros
    table.rows_for([999_999])
    assert len(table) == 24001
    assert not table.gather([999_999]).any()  # a new row is stored as zeros


@pytest.mark.skipif(not rows_module._REMAP, reason="arenas grow in place on Linux only")
def test_a_large_arena_grows_in_its_own_mapping_without_a_copy():
    table = RowTable((10**6, WIDE), F32)
    _scatter_new_rows(table, 0, 9000, 1.0)  # 2.2 MiB: a mapping of its own
    mapping = table._rows._map
    assert mapping is not None
    assert len(mapping) % (2 << 20) == 0  # whole huge pages
    for batch in range(1, 4):
        _scatter_new_rows(table, 9000 * batch, 9000, batch + 1)
    assert table._rows._map is mapping  # resized, never replaced
    assert len(mapping) >= 36000 * WIDE * 4
    assert len(mapping) % (2 << 20) == 0
    assert table.gather([0, 7 * 35999]).tolist() == [[1.0] * WIDE, [4.0] * WIDE]


@pytest.mark.skipif(not rows_module._REMAP, reason="arenas grow in place on Linux only")
def test_a_view_of_the_rows_held_across_growth_stays_valid():
    table = RowTable((10**6, WIDE), F32)
    _scatter_new_rows(table, 0, 9000, 1.0)
    view = table.rows
    mapping = table._rows._map
    _scatter_new_rows(table, 9000, 20000, 2.0)  # grows while the view is alive: copied
    assert table._rows._map is not mapping
    assert view.shape == (9000, WIDE) and bool(np.all(view == 1.0))  # still readable
    assert table.gather([0, 7 * 28999]).tolist() == [[1.0] * WIDE, [2.0] * WIDE]
    del view
    mapping = table._rows._map
    _scatter_new_rows(table, 29000, 40000, 3.0)  # nothing holds a view: resized in place
    assert table._rows._map is mapping
    assert table.gather([7 * 28999, 7 * 68999]).tolist() == [[2.0] * WIDE, [3.0] * WIDE]


@pytest.mark.skipif(not rows_module._REMAP, reason="arenas grow in place on Linux only")
def test_a_mapping_that_cannot_be_resized_is_copied_into_a_new_one(monkeypatch):
    class Unresizable(mmap.mmap):
        def resize(self, newsize: int) -> None:
            raise OSError(errno.ENOMEM, "no mremap here")

    monkeypatch.setattr(rows_module.mmap, "mmap", Unresizable)
    table = RowTable((10**6, WIDE), F32)
    _scatter_new_rows(table, 0, 9000, 1.0)
    first = table._rows._map
    assert isinstance(first, Unresizable)
    _scatter_new_rows(table, 9000, 20000, 2.0)
    assert table._rows._map is not first
    assert table.gather([0, 7 * 28999]).tolist() == [[1.0] * WIDE, [2.0] * WIDE]
    assert len(table) == 29000


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "hashed"])
@pytest.mark.parametrize("count", [0, 5, 40_000])  # 40,000 rows of WIDE: a mapped arena
def test_a_table_is_loaded_in_place_from_sorted_ids(probing, direct, count):
    """``load`` hands ``fill`` the new rows in the ids' order as the table's own memory:
    what it writes there is what the table stores; the table then grows as any other."""
    ids = np.sort(np.random.default_rng(count).choice(10**6, count, replace=False))
    values = np.arange(count * WIDE, dtype=F32).reshape(count, WIDE)
    table = RowTable((10**6, WIDE), F32, direct=direct)
    handed: list[np.ndarray] = []

    def fill(rows: np.ndarray) -> None:
        handed.append(rows)
        rows[:] = values

    table.load(ids, fill)
    assert handed[0].shape == (count, WIDE) and handed[0].flags.writeable
    assert count == 0 or np.shares_memory(handed[0], table.rows)
    assert len(table) == count and np.array_equal(table.ids(), ids)
    assert np.array_equal(table.gather(ids), values)
    handed.clear()  # the view goes: the arena may grow in place again
    more = np.setdiff1d(np.arange(1000), ids)[:300]
    table.scatter(more, np.ones((300, WIDE), F32))
    assert np.array_equal(table.gather(ids), values) and table.gather(more).min() == 1


def test_a_load_refuses_a_table_with_rows_and_ids_not_sorted_and_unique():
    table = RowTable((10, 2), F32)
    for ids, message in [([3, 1], "not sorted and unique"), ([1, 1], "not sorted and unique")]:
        with pytest.raises(akv.InvalidArgumentError, match=message):
            table.load(ids, lambda rows: None)
    with pytest.raises(akv.RowIdError):
        table.load([1, 10], lambda rows: None)
    assert len(table) == 0
    table.load([1, 4], lambda rows: None)  # rows left alone are zeros
    assert len(table) == 2 and not table.gather([1, 4]).any()
    with pytest.raises(akv.InvalidArgumentError, match="stores 2 rows already"):
        table.load([5], lambda rows: None)


def test_a_table_of_one_row():
    table = RowTable((1, 3), F32)
    table.add([0], np.ones((1, 3), F32))
    table.add([0], np.ones((1, 3), F32))
    assert table.gather([0, 0]).tolist() == [[2] * 3] * 2
    assert table.to_sparse().to_dense().tolist() == [[2] * 3]
    with pytest.raises(akv.RowIdError, match=r"row id 1 at position 0 is outside \[0, 1\)"):
        table.gather([1])


def test_the_first_and_last_of_a_billion_rows():
    table = RowTable((10**9, 2), F32)
    table.scatter([10**9 - 1, 0], np.array([[1, 2], [3, 4]], F32))
    assert table.gather([0, 10**9 - 1]).tolist() == [[3, 4], [1, 2]]
    with pytest.raises(akv.RowIdError, match=r"row id 1000000000 at position 1"):
        table.add([5, 10**9], np.zeros((2, 2), F32))
    assert len(table) == 2  # the refused add stored nothing


def test_a_billion_declared_rows_cost_what_is_touched():
    tracemalloc.start()
    try:
        table = RowTable((10**9, 16), F32)
        empty = table.nbytes
        ids = np.random.default_rng(9).choice(10**9, size=10**5, replace=False)
        table.add(ids, np.ones((ids.size, 16), F32))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert empty < 1024
    assert len(table) == 10**5
    assert table.nbytes < 100 * 2**20
    assert peak < 100 * 2**20
    assert table.gather(ids[:5]).sum() == 5 * 16


def test_gather_into_out():
    table = RowTable((10, 2), F32)
    table.scatter([1], np.ones((1, 2), F32))
    out = np.full((3, 2), 7, F32)
    assert table.gather([1, 2, 1], out=out) is out
    assert out.tolist() == [[1, 1], [0, 0], [1, 1]]
    empty = RowTable((10, 2), F32)
    assert empty.gather([3], out=out[:1]).tolist() == [[0, 0]]


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (np.zeros((2, 3), F32), akv.ShapeMismatchError, r"shape \(2, 3\) does not match \(2, 2\)"),
        (np.zeros((2, 2), np.float64), akv.DTypeMismatchError, "float64 does not match .*float32"),
    ],
)
def test_gather_checks_out(out, error, message):
    with pytest.raises(error, match=message):
        RowTable((10, 2), F32).gather([1, 2], out=out)


def test_gather_refuses_a_read_only_out():
    out = np.zeros((1, 2), F32)
    out.flags.writeable = False
    with pytest.raises(akv.InvalidArgumentError, match="read-only"):
        RowTable((10, 2), F32).gather([1], out=out)


@pytest.mark.parametrize("method", ["scatter", "add"])
def test_values_must_match_rows_and_dtype(method):
    table = RowTable((10, 2), F32)
    with pytest.raises(akv.ShapeMismatchError, match=r"values: shape \(2, 3\) does not match"):
        getattr(table, method)([1, 2], np.zeros((2, 3), F32))
    with pytest.raises(akv.DTypeMismatchError, match="never casts"):
        getattr(table, method)([1, 2], np.zeros((2, 2), np.float64))
    with pytest.raises(akv.InvalidArgumentError, match="expected a NumPy array"):
        getattr(table, method)([1], [[1.0, 2.0]])
    assert len(table) == 0


def test_a_table_refuses_bad_shapes_and_dtypes():
    with pytest.raises(akv.InvalidArgumentError, match="negative dimension"):
        RowTable((-1, 2), F32)
    with pytest.raises(akv.UnsupportedDTypeError, match="is not one akv stores"):
        RowTable((10, 2), object)
    with pytest.raises(akv.InvalidArgumentError, match="is not a dtype"):
        RowTable((10, 2), "no such dtype")


@pytest.mark.parametrize("direct", [False, True])
def test_a_table_against_a_dense_array(direct):
    rng = np.random.default_rng(11)
    table = RowTable((300, 3), np.int64, direct=direct)
    assert isinstance(table._index, DirectIndex if direct else RowIndex)
    dense = np.zeros((300, 3), np.int64)
    for _ in range(200):
        ids = rng.integers(0, 300, size=int(rng.integers(0, 20)))
        values = rng.integers(-5, 5, size=(ids.size, 3))
        if rng.random() < 0.5:
            table.add(ids, values)
            np.add.at(dense, ids, values)
        else:
            ids, first = np.unique(ids, return_index=True)
            table.scatter(ids, values[first])
            dense[ids] = values[first]
    assert np.array_equal(table.gather(np.arange(300)), dense)
    assert np.array_equal(table.to_sparse().to_dense(), dense)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("shape", [(20,), (20, 2, 3), (20, 0), (20, 1)])
def test_rows_of_any_shape(shape, direct):
    rng = np.random.default_rng(5)
    table = RowTable(shape, np.float64, direct=direct)
    dense = np.zeros(shape)
    for _ in range(30):
        ids = np.unique(rng.integers(0, 20, size=5))
        values = rng.standard_normal((ids.size, *shape[1:]))
        table.add(ids, values)
        dense[ids] += values
        ids = ids[::-1].copy()
        values = rng.standard_normal((ids.size, *shape[1:]))[:, ...]
        if rng.random() < 0.3:
            table.scatter(ids, values)
            dense[ids] = values
    assert np.array_equal(table.gather(np.arange(20)), dense)


def test_values_may_be_strided():
    table = RowTable((10, 2), F32)
    values = np.arange(12, dtype=F32).reshape(3, 4)[:, ::2]
    table.scatter([3, 1, 2], values)
    table.add([9, 3], values[1:][::-1])
    assert table.gather([1, 2, 3, 9]).tolist() == [[4, 6], [8, 10], [4, 8], [8, 10]]


def test_rows_wider_than_numpys_largest_item_are_written_element_by_element(monkeypatch):
    """A row of 2 GiB or more is no NumPy void item: an init of such a key failed with a
    raw 'invalid itemsize' ValueError, even with no rows."""
    wide = RowTable((10, 2**29), np.float32)  # 2 GiB rows: none written, none allocated
    wide.scatter(np.zeros(0, np.int64), np.zeros((0, 2**29), np.float32))
    assert len(wide) == 0
    monkeypatch.setattr(rows_module, "_VOID_MAX_BYTES", 8)  # rows of 12 bytes take that path
    table = RowTable((10, 3), np.float32)
    table.scatter([4, 1], np.arange(6, dtype=np.float32).reshape(2, 3))
    table.scatter([1], np.full((1, 3), 9, np.float32))
    np.testing.assert_array_equal(table.gather([1, 4, 5]), [[9, 9, 9], [0, 1, 2], [0, 0, 0]])
