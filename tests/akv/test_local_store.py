"""The local store's meaning (MXNet's, measured on 1.9.1) and where akv does better."""

from __future__ import annotations

import asyncio
import copy
import pickle
import re
import threading

import numpy as np
import pytest

import akv
from akv import (
    ClosedError,
    DTypeMismatchError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    MixedKeyKindsError,
    ReentrantCallError,
    ShapeMismatchError,
    UnknownStoreTypeError,
    UnsupportedDTypeError,
)

SHAPE = (2, 3)


def ones(scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    return np.full(SHAPE, scale, dtype)


@pytest.fixture
def kv():
    store = akv.create("local")
    yield store
    store.close()


def add_twice(key, recv, stored):
    stored += recv * 2


# ------------------------------------------------------------ MXNet's documented examples


def test_init_then_pull_gives_the_initial_value(kv):
    kv.init("3", ones(2))
    np.testing.assert_array_equal(kv.pull("3"), ones(2))


def test_push_without_updater_replaces_the_stored_value(kv):
    kv.init("3", ones(2))
    kv.push("3", ones(8))
    np.testing.assert_array_equal(kv.pull("3"), ones(8))
    kv.push("3", ones(1))
    np.testing.assert_array_equal(kv.pull("3"), ones(1))


def test_a_list_of_values_for_one_key_is_summed(kv):
    kv.init("3", ones(2))
    kv.push("3", [ones(), ones(), ones(), ones()])
    np.testing.assert_array_equal(kv.pull("3"), ones(4))


def test_a_list_of_keys_takes_a_list_of_values(kv):
    kv.init(["4", "5", "6"], [ones(), ones(), ones()])
    kv.push(["4", "5", "6"], [ones(7), ones(8), ones(9)])
    out = [np.zeros(SHAPE, np.float32) for _ in range(3)]
    kv.pull(["4", "5", "6"], out=out)
    assert [o[0, 0] for o in out] == [7, 8, 9]


def test_updater_changes_the_stored_value_in_place(kv):
    kv.init(3, ones(4))
    kv.set_updater(add_twice)
    np.testing.assert_array_equal(kv.pull(3), ones(4))
    kv.push(3, ones())
    np.testing.assert_array_equal(kv.pull(3), ones(6))


def test_pull_into_a_list_of_outputs_fills_each(kv):
    kv.init(3, ones(6))
    outs = [np.zeros(SHAPE, np.float32) for _ in range(4)]
    assert kv.pull(3, out=outs) is outs
    for out in outs:
        np.testing.assert_array_equal(out, ones(6))


def test_updater_with_lists_of_lists(kv):
    kv.init([5, 7, 9], [ones(), ones(), ones()])
    kv.set_updater(add_twice)
    kv.push([5, 7, 9], [ones(), ones(), ones()])
    assert [kv.pull(k)[0, 0] for k in (5, 7, 9)] == [3, 3, 3]
    kv.push([5, 7, 9], [[ones()] * 4, [ones()] * 4, [ones()] * 4])
    assert [kv.pull(k)[0, 0] for k in (5, 7, 9)] == [11, 11, 11]


def test_a_key_repeated_in_one_call_is_summed(kv):
    kv.init(1, ones())
    kv.push([1, 1, 1], [ones(1), ones(2), [ones(3), ones(4)]])
    np.testing.assert_array_equal(kv.pull(1), ones(10))
    first, second = kv.pull([1, 1])
    np.testing.assert_array_equal(first, ones(10))
    assert first is not second


def test_pushpull_without_out_writes_into_the_value(kv):
    kv.init(2, ones())
    kv.set_updater(add_twice)
    value = ones(3)
    assert kv.pushpull(2, value) is value
    np.testing.assert_array_equal(value, ones(7))


def test_pushpull_into_out_leaves_the_pushed_value_alone(kv):
    kv.init(2, ones())
    value, out = ones(3), np.zeros(SHAPE, np.float32)
    kv.pushpull(2, value, out=out)
    np.testing.assert_array_equal(out, ones(3))
    np.testing.assert_array_equal(value, ones(3))


def test_broadcast_initializes_and_pulls_once_per_key(kv):
    out = np.zeros(SHAPE, np.float32)
    kv.broadcast("w", ones(5), out=out)
    np.testing.assert_array_equal(out, ones(5))
    with pytest.raises(DuplicateInitError, match=r"^broadcast key 'w': the key is already"):
        kv.broadcast("w", ones(6), out=out)
    with pytest.raises(UnsupportedDTypeError, match=r"^broadcast value for key 's': dtype <U1"):
        kv.broadcast("s", np.array(["a"]), out=out)
    np.testing.assert_array_equal(kv.pull("w"), ones(5))


def test_store_properties(kv):
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    kv.barrier()  # one worker: returns at once
    kv.set_barrier_before_exit(False)


def test_type_names_are_case_insensitive():
    with akv.create("LOCAL") as store:
        assert store.type == "LOCAL"  # reported as given, as MXNet does


def test_dtypes_are_kept(kv):
    for key, dtype in enumerate([np.float16, np.float64, np.int32, np.int64, np.uint8]):
        kv.init(key, np.arange(6, dtype=dtype).reshape(SHAPE))
        kv.push(key, [np.ones(SHAPE, dtype), np.ones(SHAPE, dtype)])
        pulled = kv.pull(key)
        assert pulled.dtype == dtype
        np.testing.assert_array_equal(pulled, np.full(SHAPE, 2, dtype))


# ------------------------------------------------------------ value semantics (no aliasing)


def test_changing_the_init_array_afterwards_does_not_change_the_store(kv):
    source = ones(1)
    kv.init(0, source)
    source[:] = 99
    np.testing.assert_array_equal(kv.pull(0), ones(1))


def test_changing_the_pushed_array_afterwards_does_not_change_the_store(kv):
    kv.init(0, ones())
    pushed = ones(5)
    kv.push(0, pushed)
    pushed[:] = 99
    np.testing.assert_array_equal(kv.pull(0), ones(5))


def test_pull_never_hands_out_the_stored_array(kv):
    kv.init(0, ones(5))
    first = kv.pull(0)
    first[:] = 99
    np.testing.assert_array_equal(kv.pull(0), ones(5))


async def test_async_push_copies_before_returning_even_when_not_awaited():
    kv = await akv.create_async("local", inline_max_bytes=1 << 20)
    kv.init(0, ones())
    gate = threading.Event()
    kv.set_updater(lambda key, recv, stored: (gate.wait(5), np.copyto(stored, recv)))
    big = np.ones((1 << 19,), np.float32)  # 2 MiB > 1 MiB: the update runs on a worker thread
    kv.init(1, big)
    blocker = kv.push(1, big)
    pushed = ones(7)
    queued = kv.push(0, pushed)
    pushed[:] = -1  # the push is still queued or running; the store read it already
    gate.set()
    await blocker
    await queued
    np.testing.assert_array_equal(await kv.pull(0), ones(7))
    await kv.close()


# ------------------------------------------------------------ errors: typed, named, nothing changed


def test_shape_mismatch_names_the_key_and_both_shapes_and_changes_nothing(kv):
    kv.init(3, ones(1))
    with pytest.raises(ShapeMismatchError) as info:
        kv.push(3, np.ones((3, 2), np.float32))
    assert str(info.value) == (
        "push to key 3: shape (3, 2) does not match the initialized shape (2, 3)"
    )
    assert (info.value.key, info.value.expected, info.value.got) == (3, (2, 3), (3, 2))
    np.testing.assert_array_equal(kv.pull(3), ones(1))


def test_dtype_mismatch_is_an_error_not_a_silent_cast(kv):
    kv.init(3, ones(1))
    with pytest.raises(DTypeMismatchError, match=r"dtype float64 does not match .* float32"):
        kv.push(3, ones(2, np.float64))
    np.testing.assert_array_equal(kv.pull(3), ones(1))
    with pytest.raises(DTypeMismatchError, match="pull into key 3"):
        kv.pull(3, out=np.zeros(SHAPE, np.float64))


def test_a_bad_value_in_a_list_call_changes_no_key(kv):
    kv.init([1, 2], [ones(1), ones(1)])
    with pytest.raises(ShapeMismatchError, match="key 2"):
        kv.push([1, 2], [ones(5), np.ones((4,), np.float32)])
    assert [kv.pull(k)[0, 0] for k in (1, 2)] == [1, 1]


def test_uninitialized_key_is_named(kv):
    kv.init(1, ones())
    with pytest.raises(KeyNotInitializedError, match="push to key 42: the key was never") as info:
        kv.push(42, ones())
    assert info.value.key == 42
    with pytest.raises(KeyNotInitializedError, match="pull from key 42"):
        kv.pull(42)


def test_duplicate_init_is_an_error_and_keeps_the_first_value(kv):
    kv.init(1, ones(1))
    with pytest.raises(DuplicateInitError, match="init key 1: the key is already initialized"):
        kv.init(1, ones(2))
    with pytest.raises(DuplicateInitError, match="key 7"):
        kv.init([7, 8, 7], [ones(), ones(), ones()])  # repeats caught anywhere, not only adjacent
    assert kv.keys() == [1]  # nothing from the failed call was registered
    np.testing.assert_array_equal(kv.pull(1), ones(1))


def test_mixed_key_kinds_are_an_error(kv):
    kv.init(1, ones())
    with pytest.raises(MixedKeyKindsError, match="keyed by int, got str key 'a'"):
        kv.init("a", ones())
    with pytest.raises(MixedKeyKindsError, match="all be int or all be str"):
        kv.push([1, "a"], [ones(), ones()])


def test_unknown_store_type_is_an_error():
    with pytest.raises(UnknownStoreTypeError, match="unknown store type 'horovod'"):
        akv.create("horovod")
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        akv.create(3)
    with pytest.raises(InvalidArgumentError, match="unknown store option"):
        akv.create("local", bogus=1)
    with pytest.raises(InvalidArgumentError, match="slots must be an int >= 1"):
        akv.create("local", slots=0)
    with pytest.raises(InvalidArgumentError, match="inline_max_bytes must be an int >= 0"):
        akv.create("local", inline_max_bytes=-1)


def test_bad_arguments_are_typed_errors(kv):
    kv.init(1, ones())
    with pytest.raises(InvalidArgumentError, match="expected an array, got float"):
        kv.push(1, 3.0)
    with pytest.raises(InvalidArgumentError, match="2 keys need a list of 2 values"):
        kv.push([1, 1], ones())
    with pytest.raises(InvalidArgumentError, match="keys must be int or str"):
        kv.push(1.5, ones())
    with pytest.raises(InvalidArgumentError, match="keys must be int or str"):
        kv.push(True, ones())
    with pytest.raises(InvalidArgumentError, match="read-only"):
        kv.pull(1, out=np.broadcast_to(np.float32(0), SHAPE))
    with pytest.raises(InvalidArgumentError, match="one value per key"):
        kv.init(2, [ones(), ones()])
    with pytest.raises(InvalidArgumentError, match="empty list"):
        kv.push(1, [])


def test_a_list_of_numbers_for_one_key_says_a_list_holds_arrays(kv):
    kv.init(1, ones(4))
    listed = r"got a list of numbers \(4\); a list given for one key holds its arrays"
    with pytest.raises(InvalidArgumentError, match=r"^push for key 1: " + listed):
        kv.push(1, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(InvalidArgumentError, match=r"^init for key 2: got a list of numbers \(2\)"):
        kv.init(2, [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match=r"got float 1\.0: pass an array \(np"):
        kv.push(1, 1.0)  # no list: no word of lists
    np.testing.assert_array_equal(kv.pull(1), ones(4))


@pytest.mark.parametrize(
    "value",
    [
        np.array(["ab", "cd"]),
        np.array([object(), object()]),
        np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", "f4")]),
    ],
    ids=["str", "object", "datetime", "record"],
)
def test_a_value_that_is_not_numbers_is_refused_at_init_as_every_store_refuses_it(kv, value):
    """A local store summed strings by keeping the last one; a distributed store could not
    send them: every store refuses them at init, and the key stays free."""
    with pytest.raises(
        UnsupportedDTypeError,
        match=rf"key 'u': dtype {re.escape(str(value.dtype))} is not a number type",
    ):
        kv.init("u", value)
    assert kv.keys() == []
    kv.init("u", np.zeros(2, bool))  # booleans, integers and complex numbers are numbers
    kv.init("v", np.zeros(2, np.complex64))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kv.init("w", np.zeros(2, ml_dtypes.float8_e4m3fn))  # and ml_dtypes' floats


def test_numpy_integer_keys_are_ints(kv):
    kv.init(np.int64(5), ones(3))
    np.testing.assert_array_equal(kv.pull(5), ones(3))


# ------------------------------------------------------------ updaters


def test_updater_gets_the_key_as_given_str_stays_str(kv):
    seen = []
    kv.init("weight", ones())
    kv.set_updater(lambda key, recv, stored: seen.append(key))
    kv.push("weight", ones())
    assert seen == ["weight"]


def test_an_exception_in_the_updater_reaches_the_caller(kv):
    kv.init(1, ones(1))

    def broken(key, recv, stored):
        raise ValueError(f"cannot update {key}")

    kv.set_updater(broken)
    with pytest.raises(ValueError, match="cannot update 1"):
        kv.push(1, ones())
    kv.set_updater(None)
    np.testing.assert_array_equal(kv.pull(1), ones(1))  # delivered once; the key is usable


def test_calling_the_store_from_its_updater_raises(kv):
    kv.init(1, ones())
    kv.set_updater(lambda key, recv, stored: kv.pull(1))
    with pytest.raises(ReentrantCallError, match="inside that store's updater"):
        kv.push(1, ones())


@pytest.mark.parametrize("inline_max_bytes", [0, 1 << 20])  # on a worker thread, inline
def test_closing_the_store_from_its_updater_raises_and_the_store_stays_open(inline_max_bytes):
    # It waited for the very push that ran it (worker thread), or closed the store on the
    # way to "no current event loop".
    kv = akv.create("local", inline_max_bytes=inline_max_bytes)
    kv.init(1, ones())
    kv.set_updater(lambda key, recv, stored: kv.close())
    with pytest.raises(ReentrantCallError, match="inside that store's updater"):
        kv.push(1, ones())
    kv.set_updater(None)
    kv.push(1, ones() * 3)
    np.testing.assert_array_equal(kv.pull(1), ones() * 3)
    kv.close()


async def test_closing_the_async_store_from_its_updater_raises_and_it_stays_open():
    kv = await akv.create_async("local", inline_max_bytes=0)
    kv.init(1, ones())
    kv.set_updater(lambda key, recv, stored: kv.close())
    with pytest.raises(ReentrantCallError, match="inside that store's updater"):
        await kv.push(1, ones())
    kv.set_updater(None)
    np.testing.assert_array_equal(await kv.pull(1), ones())
    await kv.close()


def test_set_updater_rejects_non_callables(kv):
    with pytest.raises(InvalidArgumentError, match="callable"):
        kv.set_updater(3)


# ------------------------------------------------------------ threads, loops, closing


def test_many_threads_at_once_lose_no_update(kv):
    kv.init(list(range(4)), [np.zeros(4, np.int64) for _ in range(4)])
    kv.set_updater(lambda key, recv, stored: np.add(stored, recv, out=stored))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(200):
                key = (seed + i) % 4
                kv.push(key, np.ones(4, np.int64))
                kv.pull(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sum(int(kv.pull(k)[0]) for k in range(4)) == 800


def test_blocking_store_works_inside_a_running_event_loop():
    """As in Jupyter: the calling thread runs a loop of its own."""

    async def notebook_cell() -> np.ndarray:
        with akv.create("local") as store:
            store.init(0, ones())
            store.push(0, [ones(), ones()])
            return store.pull(0)

    np.testing.assert_array_equal(asyncio.run(notebook_cell()), ones(2))


def test_closed_store_rejects_calls():
    store = akv.create("local")
    store.init(0, ones())
    store.close()
    store.close()  # idempotent
    with pytest.raises(ClosedError, match="closed"):
        store.push(0, ones())


def test_store_is_a_context_manager():
    with akv.create("local") as store:
        store.init(0, ones())
    with pytest.raises(ClosedError):
        store.pull(0)


def test_engine_is_exposed_for_metrics(kv):
    kv.init(0, ones())
    kv.push(0, ones())
    stats = kv.engine.statistics()
    assert stats.completed >= 2 and stats.failed == 0


# ------------------------------------------------------------ the awaitable face


async def test_fifty_unawaited_pushes_then_a_pull_see_all_fifty():
    kv = await akv.create_async("local")
    kv.init(0, np.zeros(3, np.float32))
    kv.set_updater(lambda key, recv, stored: np.add(stored, recv, out=stored))
    for _ in range(50):
        kv.push(0, np.ones(3, np.float32))
    np.testing.assert_array_equal(await kv.pull(0), np.full(3, 50, np.float32))
    await kv.close()


async def test_big_unawaited_work_keeps_order_across_worker_threads():
    kv = await akv.create_async("local", inline_max_bytes=1 << 20)
    big = np.zeros(1 << 19, np.float32)  # above the inline bound: worker threads
    kv.init(0, big)
    kv.set_updater(lambda key, recv, stored: np.add(stored, recv, out=stored))
    pulls = []
    for _ in range(5):
        kv.push(0, np.ones_like(big))
        pulls.append(kv.pull(0))
    results = [float((await p)[0]) for p in pulls]
    assert results == [1, 2, 3, 4, 5]
    await kv.close()


async def test_async_errors_raise_at_the_call():
    kv = await akv.create_async("local")
    kv.init(0, ones())
    with pytest.raises(ShapeMismatchError):
        kv.push(0, np.ones(3, np.float32))  # no await needed: raised before scheduling
    await kv.close()


async def test_an_unawaited_failing_push_fails_the_next_pull():
    kv = await akv.create_async("local")
    kv.init(0, ones(1))

    def broken(key, recv, stored):
        raise RuntimeError("bad update")

    kv.set_updater(broken)
    kv.push(0, ones())
    with pytest.raises(RuntimeError, match="bad update"):
        await kv.pull(0)
    await kv.close()


async def test_a_wait_for_close_that_times_out_leaves_the_close_going_on():
    """``asyncio.wait_for(kv.close(), t)`` cancels its wait, not the close: a later
    ``close()`` waits for the same close and returns (it raised CancelledError)."""
    kv = await akv.create_async("local", slots=1, inline_max_bytes=1 << 20)
    gate = threading.Event()
    big = np.zeros(1 << 19, np.float32)
    await kv.init("w", big)
    kv.set_updater(lambda key, recv, stored: gate.wait(5))
    pushed = kv.push("w", big)  # the close waits for it
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(kv.close(), 0.01)
    gate.set()
    await asyncio.wait_for(kv.close(), 10)
    await kv.close()  # and again
    assert pushed.done()


async def test_close_raises_a_failure_nobody_awaited():
    kv = await akv.create_async("local")
    kv.init(0, ones(1))
    kv.set_updater(lambda key, recv, stored: 1 / 0)
    kv.push(0, ones())
    with pytest.raises(ZeroDivisionError):
        await kv.close()
    with pytest.raises(ClosedError):
        kv.pull(0)


async def test_async_store_is_an_async_context_manager():
    async with await akv.create_async("local") as kv:
        kv.init("a", ones(2))
        assert (await kv.pull("a"))[0, 0] == 2
    with pytest.raises(ClosedError):
        kv.pull("a")


@pytest.mark.parametrize("priority", ["high", 1.5, True, None])
def test_a_priority_that_is_not_an_int_is_refused_by_every_call(kv, priority):
    kv.init("a", ones(2))
    kv.init("emb", akv.RowSparseArray.zeros((4, 2), np.float32))
    calls = {
        "push": lambda: kv.push("a", ones(2), priority=priority),
        "pull": lambda: kv.pull("a", priority=priority),
        "pushpull": lambda: kv.pushpull("a", ones(2), priority=priority),
        "row_sparse_pull": lambda: kv.row_sparse_pull("emb", priority=priority, row_ids=[1]),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgumentError, match=f"{name}: priority must be an int"):
            call()
    np.testing.assert_array_equal(kv.pull("a", priority=np.int64(2)), ones(2))  # unchanged


async def test_priority_orders_work_that_piles_up():
    kv = await akv.create_async("local", slots=1, inline_max_bytes=1 << 20)
    gate = threading.Event()
    started: list[str] = []

    def updater(key, recv, stored):
        if key == "blocker":
            gate.wait(5)
        started.append(key)

    big = np.zeros(1 << 19, np.float32)
    kv.init("blocker", big)
    kv.init(["low", "mid", "high"], [ones(), ones(), ones()])
    kv.set_updater(updater)
    first = kv.push("blocker", big)  # holds the only slot on a worker thread
    waits = [kv.push(k, ones(), priority=p) for k, p in (("low", -3), ("mid", -2), ("high", -1))]
    gate.set()
    await first
    for wait in waits:
        await wait
    assert started == ["blocker", "high", "mid", "low"]
    await kv.close()


async def test_init_reads_its_values_at_the_call_even_when_its_work_waits():
    """The store copies what it is given: values changed once init returned (its work
    waiting behind a busy slot) do not reach the store, dense or row-sparse, one key or
    several."""
    kv = await akv.create_async("local", slots=1, inline_max_bytes=1 << 20)
    gate = threading.Event()
    big = np.zeros(1 << 19, np.float32)
    await kv.init("blocker", big)
    kv.set_updater(lambda key, recv, stored: gate.wait(5))
    busy = kv.push("blocker", big)  # holds the only slot on a worker thread
    dense = np.ones((4, 3), np.float32)
    rows = akv.RowSparseArray(np.ones((2, 3), np.float32), [1, 7], (10, 3))
    others = [akv.RowSparseArray(np.ones((1, 3), np.float32), [i], (10, 3)) for i in (2, 3)]
    inits = [
        kv.init("d", dense),
        kv.init(["d2", "d3"], [dense, dense]),
        kv.init("r", rows),
        kv.init(["r2", "r3"], others),
    ]
    dense[...] = 666
    rows.data[...] = 666
    for other in others:
        other.data[...] = 666
    gate.set()
    await busy
    for init in inits:
        await init
    for key in ("d", "d2", "d3"):
        np.testing.assert_array_equal(await kv.pull(key), np.ones((4, 3)), err_msg=key)
    for key, ids in (("r", [1, 7]), ("r2", [2]), ("r3", [3])):
        pulled = await kv.row_sparse_pull(key, row_ids=ids)
        np.testing.assert_array_equal(pulled.data, np.ones((len(ids), 3)), err_msg=key)
    await kv.close()


def test_async_store_cannot_be_constructed_directly():
    with pytest.raises(TypeError, match="create_async"):
        akv.AsyncKVStore()


# ------------------------------------------------------------ optimizers in the store


def test_sgd_in_the_store_follows_mxnet(kv):
    kv.init("w", np.ones(3, np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    kv.push("w", np.ones(3, np.float32))
    np.testing.assert_allclose(kv.pull("w"), np.full(3, 0.9), rtol=1e-6)
    kv.push("w", np.full(3, 2.0, np.float32))
    np.testing.assert_allclose(kv.pull("w"), np.full(3, 0.7), rtol=1e-6)


def test_mxnets_default_sgd_on_zeros_gives_minus_a_hundredth(kv):
    kv.init(3, np.zeros((2, 2), np.float32))
    kv.set_optimizer(akv.optimizer.SGD())
    kv.push(3, np.ones((2, 2), np.float32))
    np.testing.assert_allclose(kv.pull(3), np.full((2, 2), -0.01), rtol=1e-6)


def test_sgd_momentum_and_wd_in_the_store(kv):
    kv.init(0, np.ones(1, np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    seen = []
    for _ in range(3):
        kv.push(0, np.ones(1, np.float32))
        seen.append(float(kv.pull(0)[0]))
    assert seen == pytest.approx([0.899, 0.707201, 0.4338747], rel=1e-6)


def test_optimizer_states_round_trip_through_the_store(tmp_path):
    path = tmp_path / "states.npz"
    grads = [np.linspace(-1, 1, 5, dtype=np.float32) * step for step in (1, 2, 3, 4)]
    with akv.create("local") as reference:  # four steps without interruption
        reference.init("w", np.zeros(5, np.float32))
        reference.set_optimizer(akv.optimizer.Adam(learning_rate=0.05))
        for grad in grads:
            reference.push("w", grad)
        expected = reference.pull("w")
    with akv.create("local") as first:  # two steps, save (with the optimizer)
        first.init("w", np.zeros(5, np.float32))
        first.set_optimizer(akv.optimizer.Adam(learning_rate=0.05))
        for grad in grads[:2]:
            first.push("w", grad)
        first.save_optimizer_states(path, dump_optimizer=True)
        halfway = first.pull("w")
    with akv.create("local") as second:  # resume from the file: same weights as before
        second.init("w", halfway)
        second.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))  # replaced by the file's
        second.load_optimizer_states(path)
        for grad in grads[2:]:
            second.push("w", grad)
        np.testing.assert_array_equal(second.pull("w"), expected)


def test_saving_states_needs_an_optimizer_and_loading_checks_the_file(kv, tmp_path):
    kv.init(0, ones())
    with pytest.raises(akv.AKVError, match="needs an optimizer: call set_optimizer first"):
        kv.save_optimizer_states(tmp_path / "x.npz")
    kv.set_optimizer(akv.optimizer.SGD())
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an archive")
    with pytest.raises(akv.StateFormatError):
        kv.load_optimizer_states(bad)
    with pytest.raises(akv.AKVError, match="cannot read"):
        kv.load_optimizer_states(tmp_path / "missing.npz")
    with pytest.raises(InvalidArgumentError, match=r"takes an akv\.optimizer\.Optimizer"):
        kv.set_optimizer("sgd")


def test_saved_states_leave_the_file_as_it_was_when_the_encoding_fails(kv, tmp_path, monkeypatch):
    """States are encoded into an unnamed temporary file first (not memory), then written
    through the path asked for (a link stays a link, the file keeps its mode): a save whose
    encoding fails leaves the old file and no leftover."""
    from akv import optimizer as optimizer_module

    kv.init(0, ones())
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(0, ones())
    target = tmp_path / "states.npz"
    target.write_bytes(b"old")
    target.chmod(0o640)
    path = tmp_path / "link.npz"
    path.symlink_to(target)
    kv.save_optimizer_states(path)
    saved = target.read_bytes()
    assert optimizer_module.decode_states(saved).states.keys() == {0}
    assert path.is_symlink() and (target.stat().st_mode & 0o777) == 0o640
    kv.push(0, ones())

    def broken(*args, **kwargs):
        raise akv.InvalidArgumentError("cannot encode this state")

    monkeypatch.setattr(optimizer_module.Updater, "dump_states", broken)
    with pytest.raises(akv.InvalidArgumentError, match="cannot encode this state"):
        kv.save_optimizer_states(path)
    assert target.read_bytes() == saved and sorted(tmp_path.iterdir()) == [path, target]
    with pytest.raises(akv.StateFileError, match="cannot write"):
        kv.save_optimizer_states(tmp_path / "missing" / "states.npz")
    monkeypatch.undo()
    long = tmp_path / ("s" * 240 + ".npz")  # a temporary name beside it must fit too
    kv.save_optimizer_states(long)
    assert optimizer_module.decode_states(long.read_bytes()).states.keys() == {0}


def test_states_load_from_a_pipe_and_a_file_that_fails_to_read_names_it(kv, tmp_path, monkeypatch):
    """States are decoded from their file (not read whole), a pipe's read first (it cannot
    seek); a read that fails part way is a StateFileError naming the file, not a damaged
    archive."""
    import errno
    import os

    from akv.optimizer import _files

    kv.init(0, ones())
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(0, ones())
    saved = tmp_path / "states.npz"
    kv.save_optimizer_states(saved)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    feeder = threading.Thread(target=lambda: fifo.write_bytes(saved.read_bytes()))
    feeder.start()
    kv.load_optimizer_states(fifo)
    feeder.join(10)

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files.os, "pread", failing)
    with pytest.raises(akv.StateFileError, match=r"cannot read .*states\.npz.*Input/output"):
        kv.load_optimizer_states(saved)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("AKV_ENGINE_SLOTS", "many"), ("AKV_ENGINE_SLOTS", "0"), ("AKV_INLINE_MAX_BYTES", "-1")],
)
async def test_a_bad_store_variable_is_a_config_error_naming_it(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(akv.ConfigError, match=variable):
        await akv.create_async("local")


def test_store_variables_are_read_when_a_store_is_created(monkeypatch):
    monkeypatch.setenv("AKV_ENGINE_SLOTS", "3")
    with akv.create("local") as kv:
        assert kv.engine.statistics().slots == 3


# ---------------------------------------------------------------- MXNet's store type names

LOCAL_NAMES = [
    "local",
    "local_allreduce_cpu",
    "local_update_cpu",
    "local_allreduce_device",
    "device",
    "nccl",
]


@pytest.mark.parametrize("name", LOCAL_NAMES)
def test_every_mxnet_local_or_device_name_makes_a_store_with_host_values(name):
    with akv.create(name) as kv:
        assert kv.type == name  # MXNet: create('local_allreduce_cpu').type == that name
        kv.init(0, np.zeros(3, np.float32))
        kv.push(0, [np.ones(3, np.float32), np.full(3, 2.0, np.float32)])
        np.testing.assert_array_equal(kv.pull(0), np.full(3, 3.0, np.float32))


def test_the_type_is_reported_as_given_and_matched_without_case():
    with akv.create("Local_AllReduce_CPU") as kv:
        assert kv.type == "Local_AllReduce_CPU" and kv.rank == 0


@pytest.mark.parametrize(
    ("name", "mode", "device"),
    [
        ("local", "local", False),
        ("local_update_cpu", "local", False),
        ("device", "local", True),
        ("nccl", "local", True),
        ("dist_sync", "dist_sync", False),
        ("dist_async", "dist_async", False),
        ("dist_sync_device", "dist_sync", True),
        ("dist_device_sync", "dist_sync", True),
        ("dist_async_device", "dist_async", True),
        ("DIST_DEVICE_ASYNC", "dist_async", True),
    ],
)
def test_a_store_type_name_means_what_mxnet_means(name, mode, device):
    meaning = akv.store_type(name)
    assert (meaning.name, meaning.mode, meaning.device) == (name, mode, device)
    assert meaning.distributed == (mode != "local")


@pytest.mark.parametrize("name", ["dist", "local_sync", "dist_sync_gpu", "kvstore", ""])
def test_names_mxnet_would_silently_accept_are_refused(name):
    with pytest.raises(UnknownStoreTypeError, match="akv knows: local, local_allreduce_cpu"):
        akv.create(name)


@pytest.mark.parametrize("copy_it", [copy.deepcopy, pickle.dumps], ids=["deepcopy", "pickle"])
def test_a_store_refuses_to_be_deep_copied_or_pickled_naming_why(kv, copy_it):
    """A deep copy or a pickle would try to copy the store's loop, threads and streams."""
    kv.init(3, ones())
    for store in (kv, kv._inner):
        with pytest.raises(InvalidArgumentError, match="cannot be pickled or deep-copied: a"):
            copy_it(store)
    np.testing.assert_array_equal(kv.pull(3), ones())  # the store goes on


def test_a_shallow_copy_shares_the_store():
    with akv.create("local") as kv:
        kv.init(3, ones())
        twin = copy.copy(kv)
        twin.push(3, ones(2.0))
        np.testing.assert_array_equal(kv.pull(3), ones(2.0))
        assert copy.copy(kv._inner)._keys is kv._inner._keys


def test_updates_on_push_says_whether_this_process_set_an_optimizer_or_updater():
    with akv.create("local") as kv:
        assert not kv.updates_on_push
        kv.set_updater(add_twice)
        assert kv.updates_on_push and kv._inner.updates_on_push
        kv.set_updater(None)  # plain assignment again
        assert not kv.updates_on_push
        with pytest.raises(InvalidArgumentError):
            kv.set_optimizer("sgd")  # refused: nothing set
        assert not kv.updates_on_push
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
        assert kv.updates_on_push


def test_a_key_whose_init_failed_is_free_before_its_failure_is_seen_to():
    """The init's waiters wake before its done-callbacks run: a retry in between finds the
    key free already (the failed init's entry is read as not held)."""
    from akv.keys import Entry, KeyTable
    from akv_engine import Var

    class Outcome:
        def __init__(self, failed: bool) -> None:
            self._failed = failed

        def failed(self) -> bool:
            return self._failed

    def make(key, value):
        return Entry(key, (2,), np.dtype(np.float32), Var(None, 0, str(key)))

    table = KeyTable()
    (first,) = table.add([("k", None)], make, "init")
    first.init = Outcome(failed=False)  # still running, or done well
    with pytest.raises(DuplicateInitError):
        table.add([("k", None)], make, "init")
    first.init = Outcome(failed=True)  # failed; discard() not run yet
    (second,) = table.add([("k", None)], make, "init")
    assert second is not first and table.keys() == ["k"]
    table.discard([first], "refused")  # the late discard of the failed one leaves the new entry
    assert table.keys() == ["k"] and table.get("k", "pull") is second


def test_set_optimizer_again_keeps_the_momentum_as_a_distributed_store_does(kv):
    # The same optimizer with the same or new hyper-parameters goes on with its updater
    # (states, counts); the local store started afresh (momentum lost) where the servers
    # keep it, so the same program gave other numbers in the two (found by a review).
    kv.init(0, np.zeros(2, np.float32))
    for lr in (0.1, 0.1, 0.2):  # mom = 0.9 * mom - lr * 1; w += mom
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=lr, momentum=0.9))
        kv.push(0, np.ones(2, np.float32))
    np.testing.assert_allclose(kv.pull(0), [-0.661, -0.661], rtol=1e-6)  # not -0.2 - 0.2
    kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))  # another optimizer: fresh
    kv.push(0, np.ones(2, np.float32))
    np.testing.assert_allclose(kv.pull(0), [-0.761, -0.761], rtol=1e-5)  # Adam's first step


async def test_a_set_optimizer_applies_to_the_pushes_after_it_not_those_queued_before():
    kv = await akv.create_async("local")
    kv.init(0, np.zeros(2, np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    gate = threading.Event()
    var = kv._keys.get(0, "hold").var
    held = kv.engine.push(lambda: gate.wait(10), writes=[var], name="hold key 0")
    early = kv.push(0, np.ones(2, np.float32))  # queued behind the hold: under lr 0.1
    again = kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
    late = kv.push(0, np.ones(2, np.float32))  # under lr 1.0
    kv.init(1, np.zeros(2, np.float32))  # a key made after the call: under lr 1.0 too
    new = kv.push(1, np.ones(2, np.float32))
    gate.set()
    await asyncio.gather(held, early, again, late, new)
    np.testing.assert_allclose(await kv.pull(0), [-1.1, -1.1], rtol=1e-6)  # not -2
    np.testing.assert_allclose(await kv.pull(1), [-1.0, -1.0], rtol=1e-6)  # not -0.1
    await kv.close()


async def test_a_failed_push_before_a_set_optimizer_fails_only_its_own_key():
    # The reconfigure is ordered after the earlier pushes whatever they did: key 0's failure
    # stays key 0's, where it was passed on to every key made after the call (found by a
    # review of this change).
    class Guarded(akv.optimizer.SGD):
        def update(self, index, weight, grad, state):
            if not np.isfinite(grad).all():
                raise FloatingPointError(f"key {index}: non-finite gradient")
            super().update(index, weight, grad, state)

    kv = await akv.create_async("local")
    kv.init(0, np.zeros(2, np.float32))
    await kv.set_optimizer(Guarded(learning_rate=0.1))
    bad = kv.push(0, np.array([np.nan, 1], np.float32))
    kv.set_optimizer(Guarded(learning_rate=0.01))
    await kv.init(1, np.zeros(2, np.float32))
    await kv.push(1, np.ones(2, np.float32))
    np.testing.assert_allclose(await kv.pull(1), [-0.01, -0.01], rtol=1e-6)
    with pytest.raises(FloatingPointError, match="key 0: non-finite gradient"):
        await bad
    await kv.close()
