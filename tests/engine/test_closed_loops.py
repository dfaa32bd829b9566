"""Loops that close while the engine goes on: a waiter whose loop closed is gone, a task
whose loop closed fails, and neither stops the engine."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import akv_engine as engine
from akv_engine import Engine, EngineLoopClosedError, Waitable
from tests.engine.common import WAIT_S, Gate


async def _await_briefly(waitable: Waitable) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waitable, 1e-4)


async def _add_done_callback(waitable: Waitable) -> None:
    waitable.add_done_callback(lambda _: None)


@pytest.mark.parametrize("wait", [_await_briefly, _add_done_callback])
def test_a_waiter_whose_loop_closed_does_not_stop_later_tasks(
    wait: Callable[[Waitable], Awaitable[None]], caplog: pytest.LogCaptureFixture
) -> None:
    eng = Engine(slots=1)  # the second runs on the worker thread that completed the first
    var = eng.new_var()
    release = threading.Event()
    first = eng.push(release.wait, WAIT_S, writes=[var])
    try:
        asyncio.run(wait(first))  # returns and closes the loop the waiter was on

        async def go_on() -> str:
            second = eng.push(lambda: "second", writes=[var])
            release.set()  # the first completes with a waiter whose loop has closed
            return await asyncio.wait_for(second, WAIT_S)  # type: ignore[no-any-return]

        assert asyncio.run(go_on()) == "second"
        assert first.result(WAIT_S) is True
        # Waking a waiter that is gone is no error at all (not even a logged one).
        assert not [r for r in caplog.records if r.name.startswith("akv_engine")]
    finally:
        release.set()
        eng.close(timeout=WAIT_S)


def test_a_raising_done_callback_is_logged_and_later_tasks_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = Engine(slots=1)  # one worker thread: it must survive the callback
    var = eng.new_var()
    gate = Gate()
    first = eng.push(gate, writes=[var])
    second = eng.push(lambda: "second", writes=[var])
    called: list[Waitable] = []

    def broken(_: Waitable) -> None:
        raise RuntimeError("broken callback")

    first.on_done(broken)
    first.on_done(called.append)  # after the raising one, and still called
    try:
        with caplog.at_level(logging.ERROR, logger="akv_engine.executors"):
            gate.opened.set()
            assert second.result(WAIT_S) == "second"
        assert called == [first]
        (record,) = [r for r in caplog.records if r.name == "akv_engine.executors"]
        assert record.exc_info is not None and str(record.exc_info[1]) == "broken callback"
        assert eng.push(lambda: "third", writes=[var]).result(WAIT_S) == "third"
    finally:
        gate.opened.set()
        eng.close(timeout=WAIT_S)


async def _coroutine() -> str:
    return "ran"


def _callback(done: engine.DoneCallback) -> None:
    done("ran", None)


_FUNCTIONS: dict[str, Callable[..., Any]] = {"loop": _coroutine, "callback": _callback}


async def _engine_on_a_loop() -> Engine:
    return Engine(slots=2)  # its loop: this asyncio.run()'s, closed once it returns


@pytest.mark.parametrize("executor", ["loop", "callback"])
def test_a_task_whose_loop_closed_fails_and_releases_its_var(executor: str) -> None:
    eng = asyncio.run(_engine_on_a_loop())
    var = eng.new_var()
    try:

        async def use_in_another_run() -> None:
            task = eng.push(_FUNCTIONS[executor], writes=[var], executor=executor)
            with pytest.raises(EngineLoopClosedError, match="has closed"):
                await task

        asyncio.run(use_in_another_run())
        assert eng.push(lambda: "after", writes=[var]).result(WAIT_S) == "after"
        assert eng.statistics().failed == 1
    finally:
        eng.close(timeout=WAIT_S)


def test_a_task_readied_for_a_closed_loop_by_a_worker_fails_and_releases_its_var() -> None:
    eng = asyncio.run(_engine_on_a_loop())
    var = eng.new_var()
    gate = Gate()
    try:
        eng.push(gate, writes=[var])
        task = eng.push(_coroutine, writes=[var])  # started by the worker that ends the gate
        after = eng.push(lambda: "after", no_skip=True, writes=[var])
        gate.opened.set()
        with pytest.raises(EngineLoopClosedError) as raised:
            task.result(WAIT_S)
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert after.result(WAIT_S) == "after"
        stats = eng.statistics()
        assert (stats.failed, stats.running, stats.waiting) == (1, 0, 0)
    finally:
        gate.opened.set()
        eng.close(timeout=WAIT_S)


@pytest.mark.parametrize("make_loop", [asyncio.new_event_loop, engine.new_event_loop])
def test_run_until_complete_takes_a_completed_waitable(
    eng: Engine, make_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    loop = make_loop()
    try:
        done = eng.run_now(lambda: "value", writes=(eng.new_var(),))
        assert done is not None and done.done()
        assert loop.run_until_complete(done) == "value"
        pushed = eng.push(lambda: "pushed", writes=[eng.new_var()])
        pushed.result(WAIT_S)
        assert loop.run_until_complete(pushed) == "pushed"
    finally:
        loop.close()


async def _run_async_then_wait(eng: Engine, executor: str, var: Any) -> Waitable:
    gate = Gate()
    eng.push(gate, writes=[var])  # the task starts once it is done, on the engine's loop
    task = eng.push(_FUNCTIONS[executor], writes=[var], executor=executor)
    task.on_done(_broken_callback)
    after = eng.push(lambda: "after", writes=[var])
    gate.opened.set()
    assert await asyncio.wait_for(after, WAIT_S) == "after"
    return task


def _broken_callback(_: Waitable) -> None:
    raise RuntimeError("broken callback")


@pytest.mark.parametrize("executor", ["loop", "callback"])
def test_a_raising_done_callback_of_a_task_done_on_the_loop_completes_it_once(
    executor: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback task calls ``done`` inside its own function, so what a waiter's callback
    raises comes back through that function: it is logged, and the task completes once
    (not failed a second time, its var released once, the counters right)."""

    async def run() -> Waitable:
        eng = Engine(slots=2)
        try:
            return await _run_async_then_wait(eng, executor, eng.new_var())
        finally:
            stats = eng.statistics()
            assert (stats.completed, stats.failed, stats.running, stats.waiting) == (3, 0, 0, 0)
            eng.close(timeout=WAIT_S)

    with caplog.at_level(logging.ERROR, logger="akv_engine"):
        task = asyncio.run(run())
    assert task.result(0) == "ran"
    logged = [r for r in caplog.records if r.name.startswith("akv_engine")]
    assert len(logged) == 1 and "broken callback" in str(logged[0].exc_info[1])  # type: ignore[index]
