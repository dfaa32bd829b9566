"""Many small calls on the local store's async face (issue #10): issued without awaiting,
then gathered or waited for with ``wait_all``, they run at once on free keys, in call order
per key, and cost no asyncio Task or Future each; errors still reach the await that reports
them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import akv
from tests.counting import count_tasks_and_futures

KEYS = 1000
SIZE = 16


async def small_store() -> tuple[akv.AsyncKVStore, list[str]]:
    kv = await akv.create_async("local")
    keys = [f"small/{i}" for i in range(KEYS)]
    kv.init(keys, [np.zeros(SIZE, np.float32) for _ in keys])
    return kv, keys


def fail_on_the_fourth_key(kv: akv.AsyncKVStore, keys: list[str]) -> None:
    """An updater that assigns, except for ``keys[3]``, which it refuses."""

    def updater(key, recv, stored):
        if key == keys[3]:
            raise ValueError(f"cannot update {key}")
        stored[...] = recv

    kv.set_updater(updater)


async def test_1000_pushes_and_pulls_gathered_make_no_task_or_future_each(monkeypatch):
    kv, keys = await small_store()
    counting = count_tasks_and_futures(monkeypatch)
    values = [np.full(SIZE, i, np.float32) for i in range(KEYS)]
    outs = [np.zeros(SIZE, np.float32) for _ in keys]
    waitables = []
    for key, value, out in zip(keys, values, outs, strict=True):
        waitables.append(kv.push(key, value))
        waitables.append(kv.pull(key, out=out))
    results = await asyncio.gather(*waitables)
    for waitable in waitables:
        await waitable
    tasks, futures = counting.made()
    assert tasks + futures <= 2, (tasks, futures)  # was one Task per call (2000)
    assert all(results[2 * i + 1] is outs[i] for i in range(KEYS))
    for value, out in zip(values, outs, strict=True):
        np.testing.assert_array_equal(out, value)
    await kv.close()


async def test_each_pull_sees_the_pushes_issued_before_it_on_its_key():
    kv, keys = await small_store()
    key = keys[0]
    pulls = []
    for step in range(1, 6):
        kv.push(key, np.full(SIZE, step, np.float32))
        pulls.append(kv.pull(key, out=np.zeros(SIZE, np.float32)))
        kv.push(keys[1], np.full(SIZE, -step, np.float32))  # other keys interleave freely
    seen = [float(out[0]) for out in await asyncio.gather(*pulls)]
    assert seen == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(await kv.pull(keys[1]), np.full(SIZE, -5, np.float32))
    await kv.close()


async def test_a_small_push_copies_the_value_before_returning():
    kv, keys = await small_store()
    value = np.ones(SIZE, np.float32)
    push = kv.push(keys[0], value)
    value[:] = 7  # after the call: must not reach the store
    out = np.zeros(SIZE, np.float32)
    await asyncio.gather(push, kv.pull(keys[0], out=out))
    np.testing.assert_array_equal(out, np.ones(SIZE, np.float32))
    await kv.close()


async def a_store_whose_one_slot_is_taken() -> tuple[akv.AsyncKVStore, threading.Event, Any]:
    """A local store with key ``"fast"`` whose only engine slot a task holds until the
    returned event is set (the task is returned too)."""
    kv = await akv.create_async("local", slots=1)
    kv.init("fast", np.zeros(SIZE, np.float32))
    gate = threading.Event()
    blocker = kv.engine.push(gate.wait, 5, writes=[kv.engine.new_var()])  # the only slot
    return kv, gate, blocker


async def test_a_small_call_behind_busy_work_is_queued_with_a_copy_of_its_value():
    kv, gate, blocker = await a_store_whose_one_slot_is_taken()
    value = np.ones(SIZE, np.float32)
    pushed = kv.push("fast", value)
    value[:] = 7  # the queued push copied it at the call
    pulled = kv.pull("fast", out=np.zeros(SIZE, np.float32))
    assert not pushed.done() and not pulled.done()  # queued: a slot is needed first
    gate.set()
    await blocker
    np.testing.assert_array_equal(await pulled, np.ones(SIZE, np.float32))
    await kv.close()


async def test_a_failing_small_push_raises_at_the_gather_naming_the_key():
    kv, keys = await small_store()
    fail_on_the_fourth_key(kv, keys)
    waitables = [kv.push(key, np.ones(SIZE, np.float32)) for key in keys[:5]]
    pull = kv.pull(keys[3], out=np.zeros(SIZE, np.float32))
    assert pull.failed()  # the failure travels to later work on the key
    with pytest.raises(ValueError, match="cannot update small/3"):
        await asyncio.gather(*waitables, pull)
    await kv.close()  # delivered by the gather: close does not raise it again


async def test_a_small_failure_nobody_awaited_is_raised_by_close():
    kv, keys = await small_store()
    kv.set_updater(lambda key, recv, stored: 1 / 0)
    kv.push(keys[0], np.ones(SIZE, np.float32))
    with pytest.raises(ZeroDivisionError):
        await kv.close()


async def test_wait_all_waits_for_every_call_issued_before_it():
    kv, gate, blocker = await a_store_whose_one_slot_is_taken()
    out = np.zeros(SIZE, np.float32)
    kv.push("fast", np.ones(SIZE, np.float32))  # queued behind the blocker, not awaited
    kv.pull("fast", out=out)
    waited = kv.wait_all()
    await asyncio.sleep(0.05)
    assert not waited.done()  # the calls before it are still queued
    gate.set()
    await waited
    assert blocker.done()
    np.testing.assert_array_equal(out, np.ones(SIZE, np.float32))
    await kv.close()


async def test_wait_all_after_1000_small_calls_makes_no_task_or_future_each(monkeypatch):
    kv, keys = await small_store()
    counting = count_tasks_and_futures(monkeypatch)
    values = [np.full(SIZE, i, np.float32) for i in range(KEYS)]
    outs = [np.zeros(SIZE, np.float32) for _ in keys]
    for key, value, out in zip(keys, values, outs, strict=True):
        kv.push(key, value)
        kv.pull(key, out=out)
    assert await kv.wait_all() is None
    tasks, futures = counting.made()
    assert (tasks, futures) == (0, 0)  # no list, no gather, nothing per call
    for value, out in zip(values, outs, strict=True):
        np.testing.assert_array_equal(out, value)
    await kv.close()


async def test_wait_all_raises_a_failure_nobody_awaited_once_naming_the_key():
    kv, keys = await small_store()
    fail_on_the_fourth_key(kv, keys)
    for key in keys[:5]:
        kv.push(key, np.ones(SIZE, np.float32))  # none awaited
    with pytest.raises(ValueError, match="cannot update small/3"):
        await kv.wait_all()
    await kv.wait_all()  # raised once: not again
    np.testing.assert_array_equal(await kv.pull(keys[4]), np.ones(SIZE, np.float32))
    await kv.close()  # nor by close


def test_the_blocking_face_has_wait_all_too():
    with akv.create("local") as kv:
        kv.init("k", np.zeros(SIZE, np.float32))
        kv.set_updater(lambda key, recv, stored: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            kv.push("k", np.ones(SIZE, np.float32))  # this face's calls wait, and raise
        kv.set_updater(None)
        kv.push("k", np.ones(SIZE, np.float32))
        assert kv.wait_all() is None  # the failure was raised already: not again
