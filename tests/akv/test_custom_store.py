"""Custom stores (MXNet's ``KVStoreBase``): the registry, ``teststore``, ``is_capable``.

The first tests are MXNet 1.9.1's ``tests/python/unittest/test_kvstore_custom.py`` ported to
akv's API (NumPy arrays for NDArrays; the "devices" of its aggregation tests are the
positions of a pushed list, as in akv's local store). Where akv differs it says so.
"""

from __future__ import annotations

import numpy as np
import pytest

import akv
from akv.custom import TestStore
from akv.errors import CapabilityError, InvalidArgumentError

SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
NUM_DEVS = 4


def check_diff_to_scalar(array: np.ndarray, x: float) -> None:
    assert np.sum(np.abs(array - x)) == 0, (array, x)


def ones() -> np.ndarray:
    return np.ones(SHAPE, np.float32)


def empty() -> np.ndarray:
    return np.empty(SHAPE, np.float32)


@pytest.fixture
def made():
    """Stores made by a test, closed at its end (a teststore has nothing to close)."""
    stores = []

    def make(name: str):
        store = akv.create(name)
        stores.append(store)
        return store

    yield make
    for store in stores:
        if isinstance(store, akv.KVStore):
            store.close()


@pytest.mark.parametrize("name", ["device", "teststore"])
@pytest.mark.parametrize("key", [3, "a"])
def test_broadcast_single_kv_pair(made, name, key):
    kv = made(name)
    out = empty()
    kv.broadcast(key, ones(), out)
    check_diff_to_scalar(out, 1)
    outs = [empty() for _ in range(3)]  # MXNet repeats one array: a list of one output
    kv.broadcast(key + key, ones(), outs)
    for o in outs:
        check_diff_to_scalar(o, 1)


@pytest.mark.parametrize("keys", [KEYS, STR_KEYS])
def test_broadcast_list_kv_pair(made, keys):
    kv = made("device")
    outs = [empty() for _ in keys]
    kv.broadcast(keys, [ones() for _ in keys], outs)
    for o in outs:
        check_diff_to_scalar(o, 1)
    out_lists = [[empty(), empty()] for _ in keys]
    kv.broadcast([k + k for k in keys], [ones() for _ in keys], out_lists)
    for o in out_lists:
        for oo in o:
            check_diff_to_scalar(oo, 1)


def check_aggregator(kv, key, key_list=None, in_place=True):
    kv.broadcast(key, np.zeros(SHAPE, np.float32), out=empty())
    vals = [ones() for _ in range(NUM_DEVS)]
    outs = [empty() for _ in range(NUM_DEVS)]
    kv.pushpull(key, vals, out=outs)
    for out in outs:
        check_diff_to_scalar(out, NUM_DEVS)
    if in_place:
        kv.pushpull(key, vals)
        for val in vals:
            check_diff_to_scalar(val, NUM_DEVS)
    if key_list is None:
        return
    kv.broadcast(
        key_list,
        [np.zeros(SHAPE, np.float32) for _ in key_list],
        out=[empty() for _ in key_list],
    )
    vals = [[ones() * 2.0 for _ in range(NUM_DEVS)] for _ in key_list]
    outs = [[empty() for _ in range(NUM_DEVS)] for _ in key_list]
    kv.pushpull(key_list, vals, out=outs)
    for out in outs:
        for o in out:
            check_diff_to_scalar(o, NUM_DEVS * 2.0)
    if in_place:
        kv.pushpull(key_list, vals)
        for val in vals:
            for v in val:
                check_diff_to_scalar(v, NUM_DEVS * 2.0)


@pytest.mark.parametrize("in_place", [True, False], ids=["single_kv_pair", "list_kv_pair"])
def test_pushpull(made, in_place):
    check_aggregator(made("device"), 3, KEYS, in_place)
    check_aggregator(made("device"), "a", STR_KEYS, in_place)
    check_aggregator(made("teststore"), 3, in_place=in_place)
    check_aggregator(made("teststore"), "a", in_place=in_place)


def test_custom_store():
    kv = akv.create("teststore")
    out = np.empty((1,), np.float32)
    kv.broadcast(1, np.ones((1,), np.float32), out=out)
    check_diff_to_scalar(out, 1)
    assert type(kv).is_capable("optimizer") is False
    arr_list = [np.empty((1,), np.float32) for _ in range(2)]
    kv.pushpull(1, [np.ones((1,), np.float32)] * 2, out=arr_list)
    for arr in arr_list:
        check_diff_to_scalar(arr, 2)
    kv.pushpull(1, arr_list)
    for arr in arr_list:
        check_diff_to_scalar(arr, 4)


def test_get_type_device():
    kv = akv.create("TestStore")  # names are case-insensitive, as MXNet's
    assert kv.type == "teststore" and kv.rank == 0 and kv.num_workers == 1
    assert isinstance(kv, TestStore)


# ---------------------------------------------------------------------- beyond MXNet's tests


def test_a_registered_store_is_what_create_makes_and_a_later_class_replaces_it_with_a_warning():
    @akv.KVStoreBase.register
    class EchoStore(akv.KVStoreBase):
        def broadcast(self, key, value, out, priority=0):
            out[...] = value

        def pushpull(self, key, value, out=None, priority=0):
            self.broadcast(key, sum(value), out)

        def is_capable(self, capability):
            return False

        type = "echostore"
        rank = 0
        num_workers = 1

    try:
        kv = akv.create("EchoStore")
        assert isinstance(kv, EchoStore)
        out = np.zeros(2)
        kv.pushpull(0, [np.ones(2), np.ones(2)], out)
        np.testing.assert_array_equal(out, [2, 2])
        with pytest.raises(
            CapabilityError, match=r"set_optimizer: store 'echostore' \(EchoStore\)"
        ):
            kv.set_optimizer(akv.optimizer.SGD())
        with pytest.raises(CapabilityError, match="has no optimizer"):
            kv.save_optimizer_states("states.akv")
        with pytest.raises(InvalidArgumentError, match="without options"):
            akv.create("echostore", slots=2)

        class Other(akv.KVStoreBase):  # same name, another class
            pass

        Other.__name__ = "EchoStore"
        with pytest.warns(UserWarning, match="replaces .*EchoStore as store 'echostore'"):
            akv.KVStoreBase.register(Other)
        assert akv.KVStoreBase.kv_registry["echostore"] is Other
    finally:
        akv.KVStoreBase.kv_registry.pop("echostore", None)


def test_a_class_missing_a_method_cannot_be_made():
    class Half(akv.KVStoreBase):
        def broadcast(self, key, value, out, priority=0):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize("name", ["Local", "Dist_Sync", "NCCL"])
def test_a_custom_store_may_not_hide_a_built_in_type(name):
    klass = type(name, (TestStore,), {})
    with pytest.raises(InvalidArgumentError, match="one of akv's own store types"):
        akv.KVStoreBase.register(klass)
    assert name.lower() not in akv.KVStoreBase.kv_registry


def test_only_store_classes_are_registered():
    with pytest.raises(InvalidArgumentError, match=r"not a subclass of akv\.KVStoreBase"):
        akv.KVStoreBase.register(dict)


def test_akvs_own_stores_are_store_bases_with_an_optimizer(made):
    kv = made("local")
    assert isinstance(kv, akv.KVStoreBase)
    assert kv.is_capable("optimizer") and kv.is_capable(akv.KVStoreBase.OPTIMIZER)
    with pytest.raises(CapabilityError, match="unknown capability 'sparsity'"):
        kv.is_capable("sparsity")
    with pytest.raises(CapabilityError, match="unknown capability"):
        akv.create("teststore").is_capable("compression")


async def test_a_custom_store_is_not_made_by_create_async():
    with pytest.raises(InvalidArgumentError, match="blocking interface only"):
        await akv.create_async("teststore")


def test_creates_return_type_names_every_built_in_store_type():
    import typing

    from akv.factory import BuiltinName

    assert set(typing.get_args(BuiltinName)) == set(akv.STORE_TYPES)
