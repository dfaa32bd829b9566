"""Row-sparse keys in the local and device stores, on both faces: init, push (summed, with
and without the optimizer's lazy update), row_sparse_pull, and the refusals that leave
everything stored as it was."""

from __future__ import annotations

import re

import numpy as np
import pytest

import akv
from akv import RowSparseArray
from akv.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    KeyNotInitializedError,
    OptimizerError,
    RowIdError,
    ShapeMismatchError,
    StorageTypeError,
)

F32 = np.float32
SHAPE = (10, 3)


def rows(
    ids: list[int], values: list[list[float]], shape: tuple[int, ...] = SHAPE
) -> RowSparseArray:
    return RowSparseArray(np.array(values, F32).reshape(len(ids), *shape[1:]), ids, shape)


def dense(value: RowSparseArray) -> np.ndarray:
    return value.to_dense()


@pytest.fixture(params=["local", "device"])
def kv(request):
    store = akv.create(request.param)
    yield store
    store.close()


def all_rows(kv: akv.KVStore, key: str = "emb") -> np.ndarray:
    return dense(kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])))


def test_init_stores_the_listed_rows_and_others_read_as_zero(kv):
    kv.init("emb", rows([7, 2], [[7, 7, 7], [2, 2, 2]]))
    pulled = kv.row_sparse_pull("emb", row_ids=[2, 5, 7, 2])
    assert pulled.indices.tolist() == [2, 5, 7]  # sorted, unique; absent rows as zeros
    np.testing.assert_array_equal(pulled.data, [[2, 2, 2], [0, 0, 0], [7, 7, 7]])
    assert pulled.shape == SHAPE and pulled.dtype == F32


def test_a_push_without_an_optimizer_replaces_the_rows_with_the_sum(kv):
    kv.init("emb", rows([0, 1], [[1, 1, 1], [1, 1, 1]]))
    kv.push("emb", [rows([1, 4], [[1, 2, 3], [4, 4, 4]]), rows([4, 9], [[1, 1, 1], [9, 9, 9]])])
    expected = np.zeros(SHAPE, F32)
    expected[1] = [1, 2, 3]
    expected[4] = [5, 5, 5]
    expected[9] = [9, 9, 9]
    np.testing.assert_array_equal(all_rows(kv), expected)  # row 0 reads zero again


def test_repeated_rows_in_one_value_are_summed_once():
    value = RowSparseArray(np.ones((3, 3), F32), [4, 1, 4], SHAPE)
    with akv.create("local") as kv:
        kv.init("emb", RowSparseArray.zeros(SHAPE))
        kv.push("emb", value)
        np.testing.assert_array_equal(
            kv.row_sparse_pull("emb", row_ids=[1, 4]).data, [[1] * 3, [2] * 3]
        )


def test_sgd_updates_only_the_pushed_rows(kv):
    start = rows([0, 3], [[1, 1, 1], [3, 3, 3]])
    kv.init("emb", start)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5, wd=0.1))
    kv.push("emb", rows([3, 6], [[1, 1, 1], [2, 2, 2]]))
    got = all_rows(kv)
    np.testing.assert_array_equal(got[0], [1, 1, 1])  # lazy: no weight decay on row 0
    np.testing.assert_allclose(got[3], np.float32(1 - 0.5 * 0.1) * 3 - 0.5, rtol=1e-6)
    np.testing.assert_allclose(got[6], [-1, -1, -1], rtol=1e-6)


def test_lazy_momentum_moves_only_the_rows_each_gradient_names():
    grads = [
        rows([1, 2], [[1, 2, 3], [1, 1, 1]]),
        rows([2], [[3, 3, 3]]),  # row 1's momentum must not decay at this step
        rows([1, 2], [[0.5] * 3, [1] * 3]),
    ]
    lr, mu = F32(0.1), F32(0.9)
    weight = np.zeros(SHAPE, F32)
    weight[1], weight[2] = 1, 2
    momentum = np.zeros(SHAPE, F32)
    with akv.create("local") as kv:
        kv.init("emb", RowSparseArray.from_dense(weight))
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        for grad in grads:
            kv.push("emb", grad)
            for row, g in zip(grad.indices, grad.data, strict=True):  # MXNet's lazy kernel
                momentum[row] = mu * momentum[row] - lr * g
                weight[row] += momentum[row]
        got = all_rows(kv)
    np.testing.assert_allclose(got, weight, rtol=1e-6)
    assert not got[0].any() and not got[3:].any()  # rows never pushed stay zero


def test_row_sparse_pull_fills_a_given_out_in_place(kv):
    kv.init("emb", rows([5], [[5, 5, 5]]))
    out = RowSparseArray.zeros(SHAPE)
    assert kv.row_sparse_pull("emb", out=out, row_ids=np.array([5, 0])) is out
    assert out.indices.tolist() == [0, 5]
    np.testing.assert_array_equal(out.data, [[0, 0, 0], [5, 5, 5]])


def test_lists_of_keys_outs_and_row_ids(kv):
    kv.init(["a", "b"], [rows([1], [[1, 1, 1]]), rows([2], [[2, 2, 2]])])
    a, b = kv.row_sparse_pull(["a", "b"], row_ids=[[1], np.array([2, 3])])
    assert a.indices.tolist() == [1] and b.indices.tolist() == [2, 3]
    np.testing.assert_array_equal(b.data, [[2, 2, 2], [0, 0, 0]])
    first, second = kv.row_sparse_pull("a", row_ids=[np.array([1]), np.array([0])])
    np.testing.assert_array_equal(first.data, [[1, 1, 1]])
    np.testing.assert_array_equal(second.data, [[0, 0, 0]])


def test_a_huge_declared_table_costs_only_its_rows():
    shape = (10**9, 64)  # 256 GB if it were dense
    with akv.create("local") as kv:
        ids = np.random.default_rng(0).choice(10**9, 1000, replace=False)
        kv.init("emb", RowSparseArray(np.ones((1000, 64), F32), ids, shape))
        table = kv._inner._keys.get("emb", "test").rows
        assert table is not None and table.nbytes < 2**20
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        last = 10**9 - 1
        kv.push("emb", RowSparseArray(np.full((2, 64), 2, F32), [0, last], shape))
        pulled = kv.row_sparse_pull("emb", row_ids=[last, int(ids[0]), 0])
        assert pulled.indices.tolist() == sorted([0, int(ids[0]), last])
        expected = {0: -2.0, last: -2.0, int(ids[0]): 1.0}
        assert pulled.data[:, 0].tolist() == [expected[i] for i in pulled.indices.tolist()]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda kv: kv.push("emb", np.ones(SHAPE, F32)), StorageTypeError, "the key is row-sparse"),
        (lambda kv: kv.pull("emb"), StorageTypeError, "row_sparse_pull"),
        (lambda kv: kv.pull("emb", out=np.zeros(SHAPE, F32)), StorageTypeError, "row_sparse_pull"),
        (lambda kv: kv.push("w", rows([0], [[1, 1, 1]])), StorageTypeError, "the key is dense"),
        (lambda kv: kv.row_sparse_pull("w", row_ids=[0]), StorageTypeError, "the key is dense"),
        (
            lambda kv: kv.row_sparse_pull("emb", out=np.zeros(SHAPE, F32), row_ids=[0]),
            StorageTypeError,
            "out must be an akv.RowSparseArray",
        ),
        (lambda kv: kv.row_sparse_pull("emb", row_ids=[10]), RowIdError, "10"),
        (lambda kv: kv.row_sparse_pull("emb", row_ids=[-1]), RowIdError, "-1"),
        (lambda kv: kv.row_sparse_pull("emb"), InvalidArgumentError, "row_ids"),
        (
            lambda kv: kv.row_sparse_pull("emb", row_ids=[1.0]),  # one array, not a list
            InvalidArgumentError,
            "row ids must be integers, got dtype float64",
        ),
        (lambda kv: kv.row_sparse_pull("nope", row_ids=[0]), KeyNotInitializedError, "nope"),
        (
            lambda kv: kv.push("emb", rows([0], [[1, 1, 1, 1]], (10, 4))),
            ShapeMismatchError,
            "(10, 4)",
        ),
        (
            lambda kv: kv.push("emb", RowSparseArray(np.ones((1, 3), np.float64), [0], SHAPE)),
            DTypeMismatchError,
            "float64",
        ),
        (
            lambda kv: kv.broadcast("new", rows([0], [[1, 1, 1]])),
            StorageTypeError,
            "row_sparse_pull",
        ),
        (
            lambda kv: kv.pushpull("emb", rows([0], [[1, 1, 1]])),
            StorageTypeError,
            "then read its rows",
        ),
        # A call mixing the kinds: named as such, whichever key comes first.
        (
            lambda kv: kv.push(["w", "emb"], [np.ones(SHAPE, F32), rows([0], [[1, 1, 1]])]),
            StorageTypeError,
            "push to keys ['w', 'emb']: one call gives row-sparse values to ['emb'] and dense "
            "ones to ['w']; akv takes each kind in a call of its own",
        ),
        (
            lambda kv: kv.push(["emb", "w"], [[rows([0], [[1, 1, 1]])], [np.ones(SHAPE, F32)]]),
            StorageTypeError,
            "row-sparse values to ['emb'] and dense ones to ['w']",
        ),
        (
            lambda kv: kv.broadcast(["d", "e"], [np.ones(SHAPE, F32), rows([0], [[1, 1, 1]])]),
            StorageTypeError,
            "init the row-sparse keys (read them with row_sparse_pull) and broadcast the dense",
        ),
        (
            lambda kv: kv.init(["d", "e"], [np.ones(SHAPE, F32), rows([0], [[1, 1, 1]])]),
            StorageTypeError,
            "init keys ['d', 'e']: one call gives row-sparse values to ['e'] and dense ones",
        ),
    ],
)
def test_bad_calls_are_refused_typed_and_change_nothing(kv, call, error, message):
    kv.init("emb", rows([3], [[3, 3, 3]]))
    kv.init("w", np.zeros(SHAPE, F32))
    before = all_rows(kv)
    with pytest.raises(error, match=re.escape(message)):
        call(kv)
    np.testing.assert_array_equal(all_rows(kv), before)
    np.testing.assert_array_equal(kv.pull("w"), 0)
    assert sorted(kv.keys()) == ["emb", "w"]
    assert "new" not in list(kv.keys())


def test_a_custom_updater_is_refused_for_a_row_sparse_push():
    with akv.create("local") as kv:
        kv.init("emb", rows([3], [[3, 3, 3]]))
        kv.set_updater(lambda key, recv, stored: None)
        with pytest.raises(OptimizerError, match="custom updater"):
            kv.push("emb", rows([3], [[1, 1, 1]]))
        np.testing.assert_array_equal(all_rows(kv)[3], [3, 3, 3])


def test_a_push_of_several_keys_the_optimizer_refuses_for_one_changes_none(kv):
    """AdaGrad refuses a row update with weight decay: with ``b``'s refused, ``a`` (whose
    wd_mult is 0) is not updated either."""
    kv.init(["a", "b"], [rows([1], [[1, 1, 1]]), rows([1], [[1, 1, 1]])])
    adagrad = akv.optimizer.AdaGrad(learning_rate=0.1, wd=0.1)
    adagrad.set_wd_mult({"a": 0.0})
    kv.set_optimizer(adagrad)
    grad = rows([1], [[1, 1, 1]])
    with pytest.raises(OptimizerError, match="index 'b': a row-sparse update needs wd=0"):
        kv.push(["a", "b"], [grad, grad])
    for key in ("a", "b"):
        np.testing.assert_array_equal(all_rows(kv, key)[1], [1, 1, 1])
    kv.push("a", grad)  # a alone is updated
    assert all_rows(kv, "a")[1][0] < 1


@pytest.mark.parametrize(
    ("optimizer", "refused", "error", "message"),
    [
        (
            lambda: akv.optimizer.SGD(learning_rate=0.1),
            rows([1], [[1, 1, 1]]).data.astype(np.int32),
            akv.InvalidArgumentError,
            "index 'b': akv's optimizers update float16, float32 and float64 weights, got int32",
        ),
        (
            lambda: akv.optimizer.GroupAdaGrad(learning_rate=0.1),
            np.ones((1, 3, 2), F32),
            OptimizerError,
            "index 'b': the weight must be 2-D",
        ),
    ],
)
def test_a_push_the_update_itself_would_refuse_changes_no_key_and_stores_no_row(
    kv, optimizer, refused, error, message
):
    """What the optimizer's update refuses of a key's rows (not floating-point, not 2-D for
    GroupAdaGrad) is refused before any key of the push changes: ``a`` was updated, and
    ``b``'s pushed row was stored (as zeros, read later by an update of every stored row)."""
    kv.init("a", rows([1], [[1, 1, 1]]))
    shape = (SHAPE[0], *refused.shape[1:])
    kv.init("b", akv.RowSparseArray(refused, [1], shape))
    kv.set_optimizer(optimizer())
    grad_b = akv.RowSparseArray(refused, [5], shape)
    with pytest.raises(error, match=re.escape(message)):
        kv.push(["a", "b"], [rows([1], [[1, 1, 1]]), grad_b])
    with pytest.raises(error, match=re.escape(message)):
        kv.push("b", grad_b)
    np.testing.assert_array_equal(all_rows(kv, "a")[1], [1, 1, 1])
    table = kv._inner._keys.get("b", "test").rows
    assert table is not None and table.ids().tolist() == [1]  # row 5 was not stored


async def test_the_async_face():
    kv = await akv.create_async("local")
    try:
        await kv.init("emb", rows([1], [[1, 1, 1]]))
        await kv.push("emb", rows([1, 2], [[1, 1, 1], [2, 2, 2]]))
        pulled = await kv.row_sparse_pull("emb", row_ids=[2, 1])
        np.testing.assert_array_equal(pulled.data, [[1, 1, 1], [2, 2, 2]])
    finally:
        await kv.close()


def test_optimizer_states_of_row_sparse_keys_are_saved_and_loaded(kv, tmp_path):
    """Adam's row states survive a save and a load into another store, which then
    continues as the first one does (without the load, its moments would start at zero)."""
    path = tmp_path / "states.akv"
    kv.init("emb", rows([1, 4], [[1, 1, 1], [4, 4, 4]]))
    kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
    kv.push("emb", rows([1, 2], [[1, 2, 3], [4, 5, 6]]))
    kv.save_optimizer_states(str(path))
    with akv.create("local") as other:
        other.init("emb", kv.row_sparse_pull("emb", row_ids=[1, 2, 4]))
        other.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
        other.load_optimizer_states(str(path))
        for store in (kv, other):
            store.push("emb", rows([2, 4], [[1, 1, 1], [2, 2, 2]]))
        np.testing.assert_array_equal(all_rows(kv), all_rows(other))
