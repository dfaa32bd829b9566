"""MXNet 1.9.1's ``tests/python/unittest/test_kvstore.py``, the tests that need row-sparse
values, ported to akv's API: ``test_single_kv_pair``, ``test_row_sparse_pull``, ``test_init``,
``test_list_kv_pair``, ``test_sparse_aggregator``, ``test_updater`` and
``test_invalid_pull``, each with its ``'default'`` and ``'row_sparse'`` variants, on int and
str keys as MXNet runs them (the semantics are ported; the code is akv's).

Where akv deliberately differs from MXNet the test asserts akv's documented behaviour and a
comment says what MXNet does (sources at tag 1.9.1):

* A row-sparse key takes only row-sparse values and a dense key only dense ones; MXNet's
  ``local`` store takes a row_sparse push to a dense key (the stored value becomes the
  pushed row_sparse array, ``src/kvstore/kvstore_local.h:267-273``) and pulls it into dense
  outputs.
* ``pull`` of a row-sparse key is refused (use ``row_sparse_pull``); MXNet's ``local``
  store copies the whole stored value into a dense output (``kvstore_local.h:277-290``,
  ``comm.h:206-210``), and into a row_sparse one only with ``ignore_sparse=False``.
* ``pull`` of a dense key into a row-sparse output is refused; MXNet skips such outputs,
  logging a warning once (``kvstore_local.h:367-386``).
* A custom updater (``set_updater``) cannot take a row-sparse push; MXNet's updater gets
  the row_sparse gradient as an NDArray (``kvstore_local.h:246-266``).
* Row ids are 1-D integer arrays; MXNet's test passes 2-D float32 ones, which MXNet
  flattens and casts (``kvstore_local.h:467-490``; its docstring asks for 1-D).

MXNet's ``rand_ndarray(shape, 'row_sparse')`` (a random density, rows drawn with it,
uniform values) is :func:`rand_row_sparse`, seeded. MXNet's devices (``mx.cpu(i)``) have no
counterpart in a local akv store: a list of values for one key is summed all the same.
"""

from __future__ import annotations

import numpy as np
import pytest

import akv
from akv import RowSparseArray
from akv.errors import (
    InvalidArgumentError,
    MixedKeyKindsError,
    OptimizerError,
    StorageTypeError,
)

F32 = np.float32
SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
NUM_DEVS = 4
ALL_ROWS = np.arange(SHAPE[0])
STYPES = ["default", "row_sparse"]


@pytest.fixture
def stores():
    """Makes local stores and closes them at the end of the test."""
    made: list[akv.KVStore] = []

    def make() -> akv.KVStore:
        made.append(akv.create("local"))
        return made[-1]

    yield make
    for store in made:
        store.close()


def value(stype: str, fill: float = 0.0) -> np.ndarray | RowSparseArray:
    """MXNet's ``mx.nd.zeros(shape, stype=stype)``, or ``(mx.nd.ones(shape) * fill)
    .tostype(stype)`` (a row_sparse one lists every nonzero row)."""
    dense = np.full(SHAPE, fill, F32)
    return dense if stype == "default" else RowSparseArray.from_dense(dense)


def init_kv(make, stype: str = "default", str_keys: bool = False) -> akv.KVStore:
    """MXNet's ``init_kv`` (int keys 3, 5, 7, 11) or ``init_kv_with_str`` ('a', 'b', 'c',
    'd'): every key zero, of storage type ``stype``."""
    kv = make()
    kv.init("a" if str_keys else 3, value(stype))
    kv.init(STR_KEYS if str_keys else KEYS, [value(stype) for _ in KEYS])
    return kv


def rand_row_sparse(rng: np.random.Generator) -> RowSparseArray:
    """A random row-sparse value: a random density, each row present with it."""
    rows = np.flatnonzero(rng.random(SHAPE[0]) < rng.random())
    return RowSparseArray(rng.random((len(rows), *SHAPE[1:]), F32), rows, SHAPE)


def read(kv: akv.KVStore, key: object) -> np.ndarray:
    """A key's whole value: pulled, or, for a row-sparse key, every row row_sparse_pulled."""
    if kv._inner._keys.get(key, "test").rows is None:
        return kv.pull(key)
    return kv.row_sparse_pull(key, row_ids=ALL_ROWS).to_dense()


def dense(value: np.ndarray | RowSparseArray) -> np.ndarray:
    return value.to_dense() if isinstance(value, RowSparseArray) else value


def single_and_list_keys():
    return pytest.mark.parametrize(
        ("str_keys", "key", "key_list"), [(False, 3, KEYS), (True, "a", STR_KEYS)]
    )


@single_and_list_keys()
@pytest.mark.parametrize("stype", STYPES)
def test_single_kv_pair(stores, stype, str_keys, key, key_list):
    kv = init_kv(stores, stype, str_keys)
    kv.push(key, value(stype, 1))
    if stype == "default":
        out = np.empty(SHAPE, F32)
        kv.pull(key, out=out)
    else:
        out = RowSparseArray.zeros(SHAPE)
        kv.row_sparse_pull(key, out=out, row_ids=ALL_ROWS)
    np.testing.assert_array_equal(dense(out), 1)


@single_and_list_keys()
def test_a_row_sparse_push_to_a_dense_key_is_refused(stores, str_keys, key, key_list):
    # MXNet's test_single_kv_pair and test_list_kv_pair push row_sparse values to the dense
    # keys of init_kv(); MXNet's local store then stores the pushed row_sparse array and
    # pull converts it into the dense output. akv keeps a key's storage type.
    kv = init_kv(stores, "default", str_keys)
    with pytest.raises(StorageTypeError, match="the key is dense"):
        kv.push(key, value("row_sparse", 1))
    with pytest.raises(StorageTypeError, match="the key is dense"):
        kv.push(key_list, [value("row_sparse", 4)] * len(key_list))
    for k in [key, *key_list]:
        np.testing.assert_array_equal(kv.pull(k), 0)


@pytest.mark.parametrize("count", [1, 4])
def test_row_sparse_pull(stores, count):
    kv = init_kv(stores, "row_sparse", str_keys=True)
    kv.init("e", value("row_sparse", 1))
    rng = np.random.default_rng(count)
    outs = [RowSparseArray.zeros(SHAPE) for _ in range(count)]
    # MXNet draws SHAPE[0] ids (repeats allowed) and passes them as a (2, 2) float32
    # NDArray, which it flattens and casts; akv takes 1-D integer ids.
    row_ids = [rng.integers(SHAPE[0], size=SHAPE[0]) for _ in range(count)]
    kv.row_sparse_pull(
        "e", out=outs[0] if count == 1 else outs, row_ids=row_ids[0] if count == 1 else row_ids
    )
    for out, ids in zip(outs, row_ids, strict=True):
        assert out.indices.tolist() == sorted(set(ids.tolist()))
        expected = np.zeros(SHAPE, F32)
        expected[ids] = 1
        np.testing.assert_array_equal(out.to_dense(), expected)


def test_row_ids_are_one_dimensional_integers(stores):
    kv = init_kv(stores, "row_sparse", str_keys=True)
    kv.init("e", value("row_sparse", 1))
    out = RowSparseArray.zeros(SHAPE)
    # MXNet's test passes ids as a 2-D float32 array (MXNet flattens and casts them).
    with pytest.raises(InvalidArgumentError, match="must be 1-D"):
        kv.row_sparse_pull("e", out=out, row_ids=np.array([[0, 1], [3, 1]]))
    with pytest.raises(InvalidArgumentError, match="must be integers"):
        kv.row_sparse_pull("e", out=out, row_ids=np.array([0.0, 1.0], F32))
    assert out.indices.tolist() == []


def test_one_array_of_row_ids_fills_every_output(stores):
    # MXNet's row_sparse_pull with one array of ids and several outputs fills the first and
    # copies it into the others.
    kv = init_kv(stores, "row_sparse", str_keys=True)
    kv.init("e", value("row_sparse", 1))
    outs = [RowSparseArray.zeros(SHAPE) for _ in range(3)]
    assert kv.row_sparse_pull("e", out=outs, row_ids=np.array([3, 1, 3])) is outs
    for out in outs:
        assert out.indices.tolist() == [1, 3]
        np.testing.assert_array_equal(out.data, 1)


def test_outputs_that_do_not_pair_with_the_row_ids_key_by_key_are_refused(stores):
    kv = init_kv(stores, "row_sparse", str_keys=True)
    outs = [[RowSparseArray.zeros(SHAPE)], [RowSparseArray.zeros(SHAPE)] * 2]
    with pytest.raises(InvalidArgumentError, match="do not pair up"):
        kv.row_sparse_pull(["b", "c"], out=outs, row_ids=[[ALL_ROWS] * 2, [ALL_ROWS]])
    with pytest.raises(InvalidArgumentError, match="do not pair up"):
        kv.row_sparse_pull("b", out=outs[1], row_ids=[ALL_ROWS] * 3)


@pytest.mark.parametrize("key", [3, "a"])
def test_init(stores, key):
    kv = stores()
    kv.init(key, np.full(SHAPE, 4, F32))
    out = np.zeros(SHAPE, F32)
    kv.pull(key, out=out)
    np.testing.assert_array_equal(out, 4)


@pytest.mark.parametrize("key", [3, "a"])
def test_init_row_sparse(stores, key):
    kv = stores()
    kv.init(key, value("row_sparse", 4))
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=ALL_ROWS).to_dense(), 4)
    # MXNet's local store pulls a row_sparse key into a dense output (the whole value).
    with pytest.raises(StorageTypeError, match="row_sparse_pull"):
        kv.pull(key, out=np.zeros(SHAPE, F32))


@single_and_list_keys()
@pytest.mark.parametrize("stype", STYPES)
def test_list_kv_pair(stores, stype, str_keys, key, key_list):
    kv = init_kv(stores, stype, str_keys)
    kv.push(key_list, [value(stype, 4) for _ in key_list])
    if stype == "default":
        outs = [np.empty(SHAPE, F32) for _ in key_list]
        kv.pull(key_list, out=outs)
    else:
        outs = [RowSparseArray.zeros(SHAPE) for _ in key_list]
        kv.row_sparse_pull(key_list, out=outs, row_ids=[ALL_ROWS] * len(key_list))
    for out in outs:
        np.testing.assert_array_equal(dense(out), 4)


@pytest.mark.parametrize("sparse_pull", [True, False])
def test_sparse_aggregator(stores, sparse_pull):
    kv = init_kv(stores, "row_sparse", str_keys=True)
    rng = np.random.default_rng(7)

    # single key: the values of four devices are summed; each output gets the sum
    vals = [rand_row_sparse(rng) for _ in range(NUM_DEVS)]
    expected_sum = sum(v.to_dense() for v in vals)
    kv.push("a", vals)
    if not sparse_pull:
        # MXNet: pull(..., ignore_sparse=False) copies the whole stored row_sparse value
        # into row_sparse outputs (local store only; the dist store refuses
        # ignore_sparse=False). akv has no such pull of a row-sparse key.
        with pytest.raises(StorageTypeError, match="row_sparse_pull"):
            kv.pull("a", out=vals)
        return
    kv.row_sparse_pull("a", out=vals, row_ids=[ALL_ROWS] * len(vals))
    np.testing.assert_allclose(sum(v.to_dense() for v in vals), expected_sum * NUM_DEVS)

    # list of keys, each with the same four values; outputs nested as the values are
    # (MXNet's test reuses one list of outputs for every key, as it does here)
    vals = [[rand_row_sparse(rng) for _ in range(NUM_DEVS)]] * len(STR_KEYS)
    expected_sum = sum(v.to_dense() for v in vals[0])
    kv.push(STR_KEYS, vals)
    kv.row_sparse_pull(STR_KEYS, out=vals, row_ids=[[ALL_ROWS] * NUM_DEVS] * len(vals))
    for outs in vals:
        np.testing.assert_allclose(sum(v.to_dense() for v in outs), expected_sum * NUM_DEVS)


def add_into(key, recv, stored):
    """MXNet's ``updater``/``str_updater``: ``stored += recv``."""
    stored += recv


@single_and_list_keys()
def test_updater(stores, str_keys, key, key_list):
    kv = init_kv(stores, "default", str_keys)
    seen_keys = set()

    def updater(k, recv, stored):
        seen_keys.add(k)
        add_into(k, recv, stored)

    kv.set_updater(updater)
    kv.push(key, [value("default", 1) for _ in range(NUM_DEVS)])
    outs = [np.empty(SHAPE, F32) for _ in range(NUM_DEVS)]
    kv.pull(key, out=outs)
    for out in outs:
        np.testing.assert_array_equal(out, NUM_DEVS)

    num_push = 4
    vals = [[value("default", 1) for _ in range(NUM_DEVS)]] * len(key_list)
    for _ in range(num_push):
        kv.push(key_list, vals)
    outs = [[np.empty(SHAPE, F32) for _ in range(NUM_DEVS)] for _ in key_list]
    kv.pull(key_list, out=outs)
    for out in (o for per_key in outs for o in per_key):
        np.testing.assert_array_equal(out, NUM_DEVS * num_push)
    assert all(type(k) is (str if str_keys else int) for k in seen_keys)


@single_and_list_keys()
def test_updater_row_sparse(stores, str_keys, key, key_list):
    # MXNet's row_sparse variant pushes row_sparse values to dense keys through the custom
    # updater, which gets the row_sparse sum (stored += recv works on NDArrays). akv refuses
    # a row-sparse value for a dense key, and a custom updater for a row-sparse key (it
    # takes dense arrays): set_optimizer updates rows.
    dense_kv = init_kv(stores, "default", str_keys)
    dense_kv.set_updater(add_into)
    with pytest.raises(StorageTypeError, match="the key is dense"):
        dense_kv.push(key, [value("row_sparse", 1) for _ in range(NUM_DEVS)])
    np.testing.assert_array_equal(dense_kv.pull(key), 0)

    rows_kv = init_kv(stores, "row_sparse", str_keys)
    rows_kv.set_updater(add_into)
    with pytest.raises(OptimizerError, match="custom updater"):
        rows_kv.push(key_list, [[value("row_sparse", 1)] * NUM_DEVS] * len(key_list))
    for k in [key, *key_list]:
        np.testing.assert_array_equal(read(rows_kv, k), 0)


@single_and_list_keys()
def test_invalid_pull(stores, str_keys, key, key_list):
    kv = init_kv(stores, "default", str_keys)

    # pull of a dense key into row-sparse outputs: MXNet ignores them (they keep their
    # value, 2); akv refuses, and leaves them as they were
    out = value("row_sparse", 2)
    with pytest.raises(StorageTypeError, match="out is row-sparse"):
        kv.pull(key, out=out)
    np.testing.assert_array_equal(out.to_dense(), 2)
    outs = [value("row_sparse", 2) for _ in key_list]
    with pytest.raises(StorageTypeError, match="out is row-sparse"):
        kv.pull(key_list, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.to_dense(), 2)

    # row_sparse_pull into dense outputs is refused (MXNet refuses it too); of a dense key
    # as well
    with pytest.raises(StorageTypeError):
        kv.row_sparse_pull(key, out=np.full(SHAPE, 2, F32), row_ids=np.array([1]))
    with pytest.raises(StorageTypeError):
        kv.row_sparse_pull(
            key_list,
            out=[np.full(SHAPE, 2, F32) for _ in key_list],
            row_ids=[np.array([1])] * len(key_list),
        )
    rows_kv = init_kv(stores, "row_sparse", str_keys)
    with pytest.raises(StorageTypeError, match=r"out must be an akv\.RowSparseArray"):
        rows_kv.row_sparse_pull(key, out=np.full(SHAPE, 2, F32), row_ids=np.array([1]))

    # a store takes keys of one kind (int or str), as MXNet's
    other, other_list = ("a", STR_KEYS) if not str_keys else (3, KEYS)
    twos = np.full(SHAPE, 2, F32)
    for call in (
        lambda: kv.init(other, twos),
        lambda: kv.push(other, twos),
        lambda: kv.pull(other, out=twos),
        lambda: kv.row_sparse_pull(other, out=value("row_sparse", 2), row_ids=np.array([1])),
        lambda: kv.init(other_list, [twos] * len(other_list)),
        lambda: kv.push(other_list, [twos] * len(other_list)),
        lambda: kv.pull(other_list, out=[twos] * len(other_list)),
        lambda: kv.row_sparse_pull(
            other_list,
            out=[value("row_sparse", 2) for _ in other_list],
            row_ids=[np.array([1])] * len(other_list),
        ),
    ):
        with pytest.raises(MixedKeyKindsError):
            call()
