"""Row-sparse updates (``Updater.update_rows``): every registered optimizer, lazy or standard,
against the same optimizer's dense update of the same numbers.

Lazy: the dense update applied to the gradient's rows only (weight and state rows), the
other rows untouched. Standard: the dense update of the whole (declared) weight with a
zero gradient in the rows the gradient does not list.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import akv
from akv import optimizer as opt
from akv.errors import OptimizerError, StateFormatError
from akv.optimizer._base import _REGISTRY
from akv.rows import RowTable

ROWS, WIDTH = 12, 3
STEPS = [np.array([1, 4, 7]), np.array([4, 11]), np.array([0, 1, 4])]
INITIAL_ROWS = np.array([1, 2, 4, 9])  # row 2 and 9 are stored, and no gradient names them

SETTINGS = {
    "sgd": {"momentum": 0.9, "wd": 0.1, "learning_rate": 0.1},
    "adagrad": {"learning_rate": 0.1, "wd": 0.0},
    "ftrl": {"wd": 0.1},
    "lamb": {"wd": 0.1},
    "groupadagrad": {"learning_rate": 0.1, "wd": 0.0},
    "lars": {"momentum": 0.9, "eta": 0.5},
    "dcasgd": {"momentum": 0.9, "learning_rate": 0.1},
}

# Adamax divides 0 by 0 where a weight and all its gradients so far are zero (MXNet's dense
# update does too): in the dense reference, the rows that are zero and unnamed at the first
# step become NaN, where the row update leaves them unstored until a gradient names them.
ZERO_OVER_ZERO = {"adamax"}

# SGLD refuses row-sparse updates (its noise goes to every row; see test_more_optimizers.py).
NO_ROW_UPDATE = {"sgld"}
ROW_UPDATED = sorted(set(_REGISTRY) - NO_ROW_UPDATE)


def _optimizer(name: str, **extra: object) -> opt.Optimizer:
    params = {"wd": 0.05, "rescale_grad": 0.5, "clip_gradient": 2.0, **SETTINGS.get(name, {})}
    params.update(extra)
    return opt.create(name, **params)


def _weights(rng: np.random.Generator) -> tuple[RowTable, np.ndarray]:
    table = RowTable((ROWS, WIDTH), np.float32)
    dense = np.zeros((ROWS, WIDTH), np.float32)
    values = rng.standard_normal((len(INITIAL_ROWS), WIDTH)).astype(np.float32)
    table.scatter(INITIAL_ROWS, values)
    dense[INITIAL_ROWS] = values
    return table, dense


def _gradients(rng: np.random.Generator) -> list[akv.RowSparseArray]:
    return [
        akv.RowSparseArray(
            (3 * rng.standard_normal((len(ids), WIDTH))).astype(np.float32), ids, (ROWS, WIDTH)
        )
        for ids in STEPS
    ]


def _dense_reference(
    optimizer: opt.Optimizer, dense: np.ndarray, grads: list[akv.RowSparseArray], lazy: bool
) -> np.ndarray:
    """The optimizer's dense update, on the gradient's rows (lazy) or on every row."""
    state = optimizer.create_state_multi_precision(0, dense)
    for grad in grads:
        if not lazy:
            optimizer.update_multi_precision(0, dense, grad.to_dense(), state)
            continue
        ids = grad.indices
        rows = dense[ids]
        state_rows = _rows_of(state, ids)
        optimizer.update_multi_precision(0, rows, grad.data.copy(), state_rows)
        dense[ids] = rows
        _put_rows(state, state_rows, ids)
    return dense


def _rows_of(state, ids):
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(_rows_of(member, ids) for member in state)
    return state[ids]


def _put_rows(state, parts, ids):
    if isinstance(state, (tuple, list)):
        for member, part in zip(state, parts, strict=True):
            _put_rows(member, part, ids)
    elif state is not None:
        state[ids] = parts


def _has_lazy_update(name: str) -> bool:
    return "lazy_update" in {param for param, _ in _REGISTRY[name]._CONFIG_PARAMS}


@pytest.mark.parametrize(
    ("name", "lazy_update"),
    [(name, True) for name in ROW_UPDATED]
    + [(name, False) for name in ROW_UPDATED if _has_lazy_update(name)],
)
def test_a_row_update_is_the_dense_update_of_its_rows(name, lazy_update):
    extra = {"lazy_update": lazy_update} if _has_lazy_update(name) else {}
    rng = np.random.default_rng(5)
    table, dense = _weights(rng)
    grads = _gradients(rng)
    updater = opt.get_updater(_optimizer(name, **extra))
    how = updater.optimizer.row_sparse_update(0)
    for grad in grads:
        updater.update_rows(0, table, grad)
    with np.errstate(invalid="ignore" if name in ZERO_OVER_ZERO else "warn"):
        expected = _dense_reference(_optimizer(name, **extra), dense, grads, lazy=how == "lazy")
    got = akv.RowSparseArray.to_dense(table.to_sparse())
    if name in ZERO_OVER_ZERO:
        unset = sorted(set(range(ROWS)) - set(INITIAL_ROWS) - set(STEPS[0]))
        assert np.flatnonzero(np.isnan(expected).any(axis=1)).tolist() == unset
        kept = sorted(set(range(ROWS)) - set(unset))
        got, expected = got[kept], expected[kept]
    np.testing.assert_allclose(got, expected, 1e-6, 1e-7)
    assert updater.optimizer.index_update_counts[0] == len(grads)
    # NAG without momentum (its setting here) and LBSGD with batch_scale=1 call MXNet's
    # sgd_update (and sgd_mom_update), lazy by default.
    lazy_in_mxnet = name in {
        *("sgd", "ccsgd", "adam", "adagrad", "ftrl", "groupadagrad", "nag", "lbsgd")
    }
    assert how == ("lazy" if lazy_in_mxnet and lazy_update else "standard")
    if how == "lazy":
        # Rows stored but never named by a gradient keep their weight exactly, and get no
        # state; rows never stored and never named are not stored.
        np.testing.assert_array_equal(table.gather([2, 9]), dense[[2, 9]])
        assert set(table.ids()) == set(INITIAL_ROWS) | {0, 7, 11}


def test_lazy_sgd_momentum_keeps_an_untouched_rows_momentum():
    """A row's momentum decays only when a gradient names it (MXNet's lazy update)."""
    table = RowTable((4, 1), np.float32)
    updater = opt.get_updater(opt.SGD(learning_rate=1.0, momentum=0.5))
    one = akv.RowSparseArray(np.ones((1, 1), np.float32), [1], (4, 1))
    other = akv.RowSparseArray(np.ones((1, 1), np.float32), [3], (4, 1))
    updater.update_rows(0, table, one)  # mom[1] = -1, w[1] = -1
    updater.update_rows(0, table, other)  # row 1 untouched: its momentum stays -1
    updater.update_rows(0, table, one)  # mom[1] = -0.5 - 1, w[1] = -2.5
    assert table.gather([1, 3]).ravel().tolist() == [-2.5, -1.0]


def test_a_new_rows_master_copy_is_its_weight():
    """float16 rows with multi_precision: the float32 master copy of a row starts as the
    row's weight (not zeros), so the first update of a stored row keeps its value."""
    table = RowTable((4, 2), np.float16)
    table.scatter([2], np.array([[1.0, -2.0]], np.float16))
    updater = opt.get_updater(opt.SGD(learning_rate=0.5, multi_precision=True))
    updater.update_rows(0, table, akv.RowSparseArray(np.ones((1, 2), np.float16), [2], (4, 2)))
    np.testing.assert_array_equal(table.gather([2]), [[0.5, -2.5]])
    master = updater.row_states[0][0]
    assert master.dtype == np.float32
    np.testing.assert_array_equal(master.gather([2]), [[0.5, -2.5]])


def test_adagrad_with_weight_decay_refuses_a_row_update_and_changes_nothing():
    table = RowTable((4, 2), np.float32)
    table.scatter([1], np.ones((1, 2), np.float32))
    updater = opt.get_updater(opt.AdaGrad(wd=0.1))
    grad = akv.RowSparseArray(np.ones((1, 2), np.float32), [1], (4, 2))
    with pytest.raises(OptimizerError, match=r"AdaGrad: index 0: a row-sparse update needs wd=0"):
        updater.update_rows(0, table, grad)
    np.testing.assert_array_equal(table.gather([1]), np.ones((1, 2)))
    assert updater.optimizer.index_update_counts == {}
    assert updater.row_states == {}


def _adam_steps(updater: opt.Updater, table: RowTable, steps: list[list[int]]) -> None:
    for ids in steps:
        grad = akv.RowSparseArray(np.ones((len(ids), 2), np.float32), ids, (10**9, 2))
        updater.update_rows("emb", table, grad)


def test_row_states_round_trip_through_dump_and_load():
    """Saved and loaded, the row states (and counts) continue as if never interrupted."""
    steps = [[1, 5], [5, 10**9 - 1], [1, 7]]
    table = RowTable((10**9, 2), np.float32)
    updater = opt.get_updater(opt.Adam(learning_rate=0.1))
    _adam_steps(updater, table, steps[:2])
    data = updater.dump_states(dump_optimizer=True)
    saved = opt.decode_states(data).states["emb"]
    assert isinstance(saved, opt.RowStates) and saved.ids.tolist() == [1, 5, 10**9 - 1]
    assert [leaf.shape for leaf in saved.leaves] == [(3, 2), (3, 2)]  # Adam's mean and var
    restored_table = RowTable((10**9, 2), np.float32)
    restored_table.scatter(table.ids(), table.gather(table.ids()))
    restored = opt.get_updater(opt.SGD())
    restored.load_states(data)
    _adam_steps(updater, table, steps[2:])
    _adam_steps(restored, restored_table, steps[2:])
    np.testing.assert_array_equal(
        table.gather([1, 5, 7, 10**9 - 1]), restored_table.gather([1, 5, 7, 10**9 - 1])
    )
    assert restored.optimizer.index_update_counts == {"emb": 3}


def test_row_states_are_saved_from_their_tables_a_slice_at_a_time_as_gathered_arrays(
    monkeypatch,
):
    """The leaves stay in their tables until written (no gathered copy of a big table's
    states beside the archive), in slices, and the archive is the same bytes as that of
    the gathered arrays."""
    from akv.optimizer import _states

    table = RowTable((10**9, 2), np.float32)
    updater = opt.get_updater(opt.Adam(learning_rate=0.1))
    _adam_steps(updater, table, [[1, 5, 9, 10**9 - 1], [5, 7]])
    monkeypatch.setattr(_states, "_GATHER_ROWS", 2)  # 5 rows: three slices a leaf
    gathered: list[int] = []
    gather = RowTable.gather

    def counted(self, ids, out=None):
        gathered.append(len(np.atleast_1d(ids)))
        return gather(self, ids, out)

    monkeypatch.setattr(RowTable, "gather", counted)
    data = updater.dump_states(dump_optimizer=True)
    assert max(gathered) == 2 and sum(gathered) == 2 * 5  # two leaves of 5 rows, by 2
    saved = opt.decode_states(data).states["emb"]
    tables = updater.row_states["emb"]
    ids = tables[0].ids()
    eager = opt.RowStates(saved.shape, ids, tuple(gather(t, ids) for t in tables))
    monkeypatch.setattr(RowTable, "gather", gather)
    by_arrays = opt.encode_states(
        {"emb": eager},
        index_update_counts=updater.optimizer.index_update_counts,
        num_update=updater.optimizer.num_update,
        optimizer_config=updater.optimizer.get_config(),
        shared_state=updater.optimizer.shared_state(),
    )
    assert data == by_arrays
    for leaf, table_ in zip(saved.leaves, tables, strict=True):
        np.testing.assert_array_equal(leaf, gather(table_, ids))


def test_row_states_are_decoded_from_a_file_straight_into_tables(tmp_path):
    """``row_tables``: each leaf is read from its member into a table of its rows, in
    slices (no array of the leaf is ever made: tracemalloc sees the 8 MiB slices, not the
    32 MiB leaves); from bytes or from a file, the tables hold the arrays' rows."""
    import io
    import tracemalloc

    ids = np.arange(0, 2 * 10**6, 4)  # 500,000 rows of 16 float32: 32 MiB a leaf
    leaves = tuple(np.full((ids.size, 16), value, np.float32) for value in (1.0, 2.0))
    data = opt.encode_states({"emb": opt.RowStates((2 * 10**6, 16), ids, leaves)})
    del leaves
    path = tmp_path / "states"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with open(path, "rb") as file:
            saved = opt.decode_states(file, row_tables=True).states["emb"]
        held, peak = tracemalloc.get_traced_memory()  # held: the tables' indexes
    finally:
        tracemalloc.stop()
    assert peak - held < 24 * 2**20, (peak, held)  # less than a leaf beyond what is kept
    for from_bytes in (False, True):
        if from_bytes:
            saved = opt.decode_states(io.BytesIO(data), row_tables=True).states["emb"]
        assert all(isinstance(leaf, RowTable) for leaf in saved.leaves)
        for value, table in zip((1.0, 2.0), saved.leaves, strict=True):
            assert table.shape == (2 * 10**6, 16) and np.array_equal(table.ids(), ids)
            assert (table.gather(ids[::997]) == value).all()


@pytest.mark.parametrize("row_tables", [False, True])
def test_a_row_leaf_whose_member_differs_from_its_declaration_is_refused(row_tables):
    import io
    import zipfile

    data = opt.encode_states({0: opt.RowStates((4, 2), np.array([1, 3]), (np.ones((2, 2)),))})
    # The leaf's member holds 2 x 1 where the structure declares 2 x 2 (same byte count).
    forged = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(forged, "w") as new:
        for info in old.infolist():
            member = old.read(info)
            if info.filename == "a1.npy":
                member_file = io.BytesIO()
                np.save(member_file, np.ones((2, 1), np.float64).astype(np.complex128))
                member = member_file.getvalue()
            new.writestr(info, member)
    with pytest.raises(StateFormatError, match="holds shape"):
        opt.decode_states(forged.getvalue(), row_tables=row_tables)


def test_loaded_row_states_that_do_not_fit_the_optimizer_are_refused():
    table = RowTable((4, 2), np.float32)
    momentum = opt.get_updater(opt.SGD(momentum=0.9))
    momentum.update_rows(0, table, akv.RowSparseArray(np.ones((1, 2), np.float32), [1], (4, 2)))
    adam = opt.get_updater(opt.Adam())
    adam.load_states(momentum.dump_states())
    grad = akv.RowSparseArray(np.ones((1, 2), np.float32), [1], (4, 2))
    with pytest.raises(StateFormatError, match="row-sparse state of index 0 does not fit"):
        adam.update_rows(0, table, grad)
    np.testing.assert_array_equal(
        table.gather([1]), np.full((1, 2), -0.01, np.float32)
    )  # unchanged


def test_a_malformed_row_state_is_refused():
    good = opt.encode_states({0: opt.RowStates((4, 2), np.array([1, 3]), (np.ones((2, 2)),))})
    assert opt.decode_states(good).states[0].ids.tolist() == [1, 3]
    bad = opt.encode_states({0: opt.RowStates((4, 2), np.array([3, 1]), (np.ones((2, 2)),))})
    with pytest.raises(StateFormatError, match="sorted, unique"):
        opt.decode_states(bad)
    short = opt.encode_states({0: opt.RowStates((4, 2), np.array([1, 3]), (np.ones((1, 2)),))})
    with pytest.raises(StateFormatError, match="one row per id"):
        opt.decode_states(short)


def test_states_saved_for_one_storage_type_are_refused_by_the_other():
    """States are either rows (a row-sparse key's) or arrays (a dense key's): loaded where the
    key has the other type they would be dropped without a word (the momentum starting
    again from zero), so the update refuses them, naming the index, and changes nothing."""
    grad_rows = akv.RowSparseArray(np.ones((1, 2), np.float32), [1], (4, 2))
    row_key = opt.get_updater(opt.SGD(momentum=0.9))
    row_key.update_rows("w", RowTable((4, 2), np.float32), grad_rows)
    dense_key = opt.get_updater(opt.SGD(momentum=0.9))
    dense_key("w", np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
    weight = np.ones((4, 2), np.float32)
    loaded = opt.get_updater(opt.SGD(momentum=0.9))
    loaded.load_states(row_key.dump_states())
    with pytest.raises(StateFormatError, match="index 'w' was saved for a row-sparse key, but"):
        loaded("w", np.zeros((4, 2), np.float32), weight)
    np.testing.assert_array_equal(weight, np.ones((4, 2), np.float32))
    table = RowTable((4, 2), np.float32)
    table.scatter(np.array([1]), np.ones((1, 2), np.float32))
    loaded.load_states(dense_key.dump_states())
    with pytest.raises(StateFormatError, match="index 'w' was saved for a dense key, but"):
        loaded.update_rows("w", table, grad_rows)
    np.testing.assert_array_equal(table.gather([1]), np.ones((1, 2), np.float32))
    assert (
        loaded.optimizer.index_update_counts.get("w", 0)
        == dense_key.optimizer.index_update_counts["w"]
    )


def test_an_optimizer_that_overrides_the_one_argument_row_sparse_update_still_works():
    # row_sparse_update(index) is public: a subclass written before the dtype mattered
    # (row_sparse_update_for) must keep working, not fail every row push with a TypeError.
    class Standard(opt.SGD):
        def row_sparse_update(self, index):
            return "standard"

    with akv.create("local") as kv:
        kv.init(0, akv.RowSparseArray(np.ones((3, 2), np.float32), [0, 1, 2], (3, 2)))
        kv.set_optimizer(Standard(learning_rate=0.1, wd=1.0))
        kv.push(0, akv.RowSparseArray(np.ones((1, 2), np.float32), [0], (3, 2)))
        got = kv.row_sparse_pull(0, row_ids=np.arange(3)).to_dense()
    np.testing.assert_allclose(got[:, 0], [0.8, 0.9, 0.9], rtol=1e-6)  # every row decays


def test_nag_rows_and_a_dense_key_updated_at_once_each_keep_their_formula():
    # The row update once said "rows" on the optimizer itself, which every key shares: a
    # dense key updated on another thread meanwhile took the row formula (2609 of 3000).
    shared = opt.NAG(learning_rate=0.1, momentum=0.9, wd=0.5)
    alone = opt.NAG(learning_rate=0.1, momentum=0.9, wd=0.5)
    stop = threading.Event()

    def row_updates() -> None:
        rows = np.ones((64, 256), np.float32)
        state = shared.create_state("rows", rows)
        while not stop.is_set():
            shared.update_rows("rows", rows, np.ones_like(rows), state)
            rows[:], state[:] = 1, 0

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns within each update
    thread = threading.Thread(target=row_updates)
    thread.start()
    differ = 0
    try:
        for _ in range(3000):
            dense, reference = np.ones(1000, np.float32), np.ones(1000, np.float32)
            states = shared.create_state(0, dense), alone.create_state(0, reference)
            shared.update(0, dense, np.ones_like(dense), states[0])
            alone.update(0, reference, np.ones_like(reference), states[1])
            differ += not np.array_equal(states[0], states[1])
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join(10)
    assert differ == 0


def test_nag_with_momentum_updates_every_stored_row():
    """MXNet's nag_mom_update has no row-sparse form (its dense fallback updates every row);
    without momentum NAG is lazy (sgd_update)."""
    assert opt.NAG(momentum=0.9).row_sparse_update_for(0, np.dtype(np.float32)) == "standard"
    assert opt.NAG().row_sparse_update_for(0, np.dtype(np.float32)) == "lazy"
    mp = opt.NAG(multi_precision=True)  # mp_sgd_update: no row-sparse form either
    assert mp.row_sparse_update_for(0, np.dtype(np.float16)) == "standard"
    assert mp.row_sparse_update_for(0, np.dtype(np.float32)) == "lazy"


@pytest.mark.parametrize(
    ("params", "how"),
    [
        ({}, "lazy"),
        ({"momentum": 0.9, "multi_precision": True}, "lazy"),
        ({"batch_scale": 2}, "standard"),
        ({"warmup_strategy": "lars"}, "standard"),
    ],
)
def test_lbsgd_is_lazy_with_batch_scale_1_and_no_lars(params, how):
    for dtype in (np.float16, np.float32):
        assert opt.LBSGD(**params).row_sparse_update_for(0, np.dtype(dtype)) == how
