"""Where a worker's row pushes wait for their answers on streams without a shared arena
(``PushBuffers``), and which memory ``RowCalls`` places them in: buffers reused rather than
fresh pages on every push, given back only once every server answered, never for a server
that keeps copies past the answer."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from akv.cluster.config import Timeouts
from akv.cluster.worker import push_buffers as push_buffers_module
from akv.cluster.worker.push_buffers import (
    MAX_SPARE_PUSH_BUFFERS,
    MAX_SPARE_PUSH_BYTES,
    PushBuffers,
)
from akv.cluster.worker.row_calls import RowCalls
from akv.errors import ServerError
from akv.sparse import RowSparseArray
from akv_engine import Engine


def address(view) -> int:
    return np.asarray(view).ctypes.data


def test_a_buffer_given_back_is_taken_again_by_a_push_it_fits():
    buffers = PushBuffers()
    first = buffers.take(1000)
    assert len(first) == 1000 and not first.readonly
    rows = np.frombuffer(first, np.float32).reshape(10, 25)  # as a push lays its rows
    buffers.give_back(rows)
    again = buffers.take(900)
    assert address(again) == address(first) and len(again) == 900
    bigger = buffers.take(2000)  # none free fits: a new one
    assert address(bigger) != address(again)


def test_a_push_of_many_keys_over_many_servers_reuses_every_buffer_the_next_step():
    """One buffer per key and server: 10 row-sparse keys over 2 servers take 20 a step,
    all of them free again and fitting the next step's rows."""
    buffers = PushBuffers()
    rng = np.random.default_rng(0)
    first = [buffers.take(int(n)) for n in rng.integers(90_000, 110_000, 20)]
    for view in first:
        buffers.give_back(view)
    second = [buffers.take(int(n)) for n in rng.integers(90_000, 110_000, 20)]
    assert {address(view) for view in second} == {address(view) for view in first}


def test_the_smallest_free_buffer_that_fits_is_taken():
    buffers = PushBuffers()
    views = [buffers.take(n) for n in (4000, 1000, 2000)]
    for view in views:
        buffers.give_back(view)
    assert address(buffers.take(1500)) == address(views[2])
    assert address(buffers.take(100)) == address(views[1])
    assert address(buffers.take(100)) == address(views[0])


def test_memory_not_lent_here_is_refused_and_changes_nothing():
    buffers = PushBuffers()
    lent = buffers.take(64)
    with pytest.raises(ValueError, match="no push buffer was lent"):
        buffers.give_back(np.empty(16, np.float32))
    buffers.give_back(lent)
    with pytest.raises(ValueError, match="no push buffer was lent"):
        buffers.give_back(lent)  # twice
    assert buffers.kept_bytes == 64 + 64 // 4  # kept once, a quarter larger than asked


def test_the_free_buffers_kept_are_bounded_in_number_and_bytes(monkeypatch):
    buffers = PushBuffers()
    views = [buffers.take(1000 + n) for n in range(MAX_SPARE_PUSH_BUFFERS + 2)]
    for view in views:
        buffers.give_back(view)
    assert len(buffers._free) == MAX_SPARE_PUSH_BUFFERS
    kept = {address(buffer) for buffer in buffers._free}
    assert kept == {address(view) for view in views[-MAX_SPARE_PUSH_BUFFERS:]}  # the newest

    monkeypatch.setattr(push_buffers_module, "MAX_SPARE_PUSH_BYTES", 10_000)
    small = PushBuffers()
    views = [small.take(3000) for _ in range(4)]  # 3750 bytes each
    for view in views:
        small.give_back(view)
    assert small.kept_bytes <= 10_000 and len(small._free) == 2
    huge = small.take(20_000)
    assert np.asarray(huge).base.nbytes == 20_000  # never kept: no room for later sizes
    small.give_back(huge)  # larger than all that may be kept: dropped
    assert all(address(buffer) != address(huge) for buffer in small._free)
    assert MAX_SPARE_PUSH_BYTES >= 16 << 20  # a 10^4-row push of 64 float32s fits


def test_takes_and_gives_back_from_two_threads_lend_each_buffer_once():
    """A push takes in its caller's thread, its answer gives back on the loop's: a buffer
    lent twice at once would see the other thread's bytes."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside take and give_back
    buffers = PushBuffers()
    overwritten = []

    def churn(mark: int) -> None:
        for step in range(3000):
            view = np.frombuffer(buffers.take(512 + step % 7 * 64), np.uint8)
            view[...] = mark
            time.sleep(0)  # let the other thread run while this one holds it
            if not (view == mark).all():
                overwritten.append(step)
            buffers.give_back(view)

    threads = [threading.Thread(target=churn, args=(mark,)) for mark in (1, 2)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(switch)
    assert not any(thread.is_alive() for thread in threads)
    assert overwritten == [] and buffers._lent == {}


class SlowList(list):
    """A free list whose pop lets other threads run in the middle of a take."""

    def pop(self, index=-1):
        time.sleep(0.05)
        return super().pop(index)


def test_two_takes_at_once_never_get_the_same_free_buffer():
    buffers = PushBuffers()
    buffers.give_back(buffers.take(1000))  # one free buffer
    buffers._free = SlowList(buffers._free)
    taken: list[int] = []
    failed: list[BaseException] = []

    def take() -> None:
        try:
            taken.append(address(buffers.take(800)))
        except BaseException as exc:  # reported by the assert below
            failed.append(exc)

    threads = [threading.Thread(target=take) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert failed == [] and len(set(taken)) == 2


class Link:
    """A server link whose answers the test gives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.answers: list[asyncio.Future] = []
        self.sent: list[list] = []
        #: The push numbers of each request's arrays.
        self.tags: list[list[int]] = []
        self._loop = loop

    def issue(self, op, arrays, timeout_s=None, destinations=()):
        answer = self._loop.create_future()
        self.answers.append(answer)
        self.sent.append([np.array(array, copy=True) for _, array, _ in arrays])
        self.tags.append([tag for _, _, tag in arrays])
        return answer


class Arena:
    """A stream's shared arena that takes what it is given room for."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.back: list[np.ndarray] = []

    def take(self, nbytes: int):
        return memoryview(bytearray(nbytes)) if nbytes <= self.room else None

    def give_back(self, view) -> None:
        self.back.append(view)


def row_calls(links, streams, engine=None) -> RowCalls:
    return RowCalls(
        engine=engine,  # type: ignore[arg-type]
        links=lambda: links,
        timeouts=Timeouts(),
        stream_of=lambda server: streams[server],
    )


async def test_rows_wait_in_a_push_buffer_until_every_server_answered():
    loop = asyncio.get_running_loop()
    links = [Link(loop), Link(loop)]
    calls = row_calls(links, [SimpleNamespace(shared=None)] * 2)
    owner, view = calls._region(0, 12)
    assert owner is calls.push_buffers
    rows = np.frombuffer(view, np.float32).reshape(1, 3)
    rows[...] = [1, 2, 3]
    requests = {0: [("emb", np.array([0]), 1), ("emb", rows, 1)], 1: [("emb", rows[:0], 1)]}
    emb = SimpleNamespace(key="emb", pushes=0)  # the key's entry: numbered by the push
    await calls._send_push(requests, [emb], [(owner, rows)])
    assert emb.pushes == 1 and links[0].tags == [[1, 1]] and links[1].tags == [[1]]
    np.testing.assert_array_equal(links[0].sent[0][1], [[1, 2, 3]])
    links[0].answers[0].set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert calls.push_buffers.kept_bytes == 0  # server 1 has not answered: still lent
    assert address(calls._region(0, 12)[1]) != address(view)
    links[1].answers[0].set_exception(ConnectionResetError("cut"))  # failed: given back too
    for _ in range(3):
        await asyncio.sleep(0)
    assert calls.push_buffers.kept_bytes > 0
    assert address(calls._region(1, 8)[1]) == address(view)  # reused by the next push


def test_rows_go_to_the_arena_where_it_takes_them_else_to_push_buffers():
    arena = Arena(room=100)
    calls = row_calls([], [SimpleNamespace(shared=arena), None])
    assert calls._region(0, 100)[0] is arena
    assert calls._region(0, 101)[0] is calls.push_buffers  # full (or below its minimum)
    assert calls._region(1, 100) is None  # its server keeps copies past the answer


async def test_a_push_the_engine_skips_gives_its_buffer_back_at_once():
    """The engine skips a push whose key carries a failure not yet raised (here a failed
    write before it): its requests never go, so no answer would give its rows back."""
    loop = asyncio.get_running_loop()
    engine = Engine(loop=loop)
    try:
        links = [Link(loop)]
        calls = row_calls(links, [SimpleNamespace(shared=None)], engine)
        entry = calls.new_entry("emb", (10, 3), np.dtype(np.float32))

        def refused() -> None:
            raise ValueError("an earlier write to the key failed")

        engine.push(refused, writes=[entry.var], executor="inline")
        value = RowSparseArray(np.ones((2, 3), np.float32), [1, 4], (10, 3))
        skipped = calls.push([(entry, value)], priority=0)
        assert skipped.done()  # at once: skipped where it was pushed
        with pytest.raises(ValueError, match="earlier write"):
            await skipped  # the failure, raised to the caller
        assert links[0].sent == []  # never sent
        assert calls.push_buffers._lent == {} and calls.push_buffers.kept_bytes > 0

        sent = calls.push([(entry, value)], priority=0)  # the failure was raised: runs
        await asyncio.wait_for(sent, 10)
        assert len(links[0].sent) == 1 and len(calls.push_buffers._lent) == 1  # answer due
    finally:
        engine.close(timeout=10)


async def test_a_pull_one_server_refused_raises_once_every_server_answered():
    """A failed round's error from one server ends the pull only once the others answered:
    their rounds may still wait for other workers' pushes, and a call made after the error
    (a new optimizer) must not reach them first."""
    loop = asyncio.get_running_loop()
    engine = Engine(loop=loop)
    try:
        links = [Link(loop), Link(loop)]
        calls = row_calls(links, [SimpleNamespace(shared=None)] * 2, engine)
        entry = calls.new_entry("emb", (10, 3), np.dtype(np.float32))  # rows 0-4 | 5-9
        out = RowSparseArray.zeros((10, 3), np.float32)
        pulling = calls.pull([(entry, np.array([1, 7]), out)], "pulled", priority=0)
        for _ in range(100):
            if links[0].answers and links[1].answers:
                break
            await asyncio.sleep(0)
        links[0].answers[0].set_exception(ServerError("round 1 failed on server 0"))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not pulling.done()  # server 1 has not answered yet
        links[1].answers[0].set_result(None)
        with pytest.raises(ServerError, match="round 1 failed on server 0"):
            await asyncio.wait_for(pulling, 10)
    finally:
        engine.close(timeout=10)
