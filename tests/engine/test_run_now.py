"""``Engine.run_now``: short work on a free var run at once without a Task, under push's
contract, and completed waitables that asyncio takes as done futures (no Task or Future per
call)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

import akv_engine as engine
from akv_engine import Engine, EngineClosedError, EngineError
from akv_engine._task import ALREADY_DONE
from tests.counting import count_tasks_and_futures
from tests.engine.common import WAIT_S, Gate

# ------------------------------------------------------------ running at once


def test_on_an_idle_var_it_runs_now_and_makes_no_task(eng):
    var = eng.new_var()
    done = eng.run_now(lambda: None, writes=(var,))
    assert done is ALREADY_DONE  # shared: nothing allocated for a call that returns None
    value = eng.run_now(lambda x: x * 2, 21, reads=(var,), name="double")
    assert isinstance(value, engine.Completed)
    assert value.done() and value.result() == 42 and value.name == "double"
    stats = eng.statistics()
    assert (stats.pushed, stats.completed, stats.running, stats.waiting) == (2, 2, 0, 0)
    assert var.version == 1 and var.idle
    assert eng.graph() == {}


def test_behind_a_busy_var_it_does_nothing(eng):
    var = eng.new_var()
    gate = Gate()
    ran: list[str] = []
    eng.push(gate, writes=[var])
    assert gate.started.wait(WAIT_S)
    assert eng.run_now(ran.append, "now", writes=(var,)) is None
    assert eng.run_now(ran.append, "now", reads=(var,)) is None
    gate.opened.set()
    eng.wait_for_var(var).result(WAIT_S)
    assert eng.run_now(ran.append, "later", reads=(var,)) is ALREADY_DONE
    assert ran == ["later"] and eng.statistics().pushed == 3  # the gate, wait_for_var, later


def test_a_read_behind_a_queued_write_does_nothing(eng):
    var = eng.new_var()
    gate = Gate()
    eng.push(gate, reads=[var])
    assert gate.started.wait(WAIT_S)
    write = eng.push(lambda: "write", writes=[var])
    assert eng.run_now(lambda: "read", reads=(var,)) is None  # a write is queued before it
    gate.opened.set()
    assert write.result(WAIT_S) == "write"


def test_it_never_jumps_ahead_of_ready_work_whatever_its_priority():
    eng = Engine(slots=1)
    gate = Gate()
    eng.push(gate, writes=[eng.new_var()])
    assert gate.started.wait(WAIT_S)
    waiting = eng.push(lambda: "ready", writes=[eng.new_var()], priority=-5)
    assert eng.run_now(lambda: "now", writes=(eng.new_var(),)) is None  # no free slot
    gate.opened.set()
    assert waiting.result(WAIT_S) == "ready"
    assert eng.run_now(lambda: "now", writes=(eng.new_var(),)).result() == "now"
    eng.close(WAIT_S)


def test_several_vars_are_left_to_push(eng):
    one, two = eng.new_var(), eng.new_var()
    assert eng.run_now(lambda: None, writes=(one, two)) is None
    assert eng.run_now(lambda: None, reads=(one,), writes=(two,)) is None
    assert eng.statistics().pushed == 0


def test_work_pushed_from_another_thread_while_it_runs_waits_for_it(eng):
    var = eng.new_var()
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()
    pushed: list[engine.Waitable] = []

    def slow() -> None:
        inside.set()
        assert release.wait(WAIT_S)
        order.append("now")

    def other_thread() -> None:
        assert inside.wait(WAIT_S)
        pushed.append(eng.push(order.append, "other", writes=[var], name="other"))
        release.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    done = eng.run_now(slow, writes=(var,), name="slow")
    thread.join(WAIT_S)
    pushed[0].result(WAIT_S)
    assert done is ALREADY_DONE and order == ["now", "other"]


def test_graph_and_statistics_see_a_run_in_progress(eng):
    var = eng.new_var()
    seen: dict[str, object] = {}

    def look() -> None:
        queued = eng.push(lambda: None, writes=[var], name="queued")
        seen["graph"] = eng.graph()
        seen["stats"] = eng.statistics()
        seen["queued"] = queued

    eng.run_now(look, writes=(var,))
    assert seen["graph"] == {"queued": ["inline work"]}
    stats = seen["stats"]
    assert isinstance(stats, engine.EngineStatistics)
    assert (stats.running, stats.waiting) == (1, 1)
    queued = seen["queued"]
    assert isinstance(queued, engine.Task)
    queued.result(WAIT_S)  # started once the var was free


# ------------------------------------------------------------ failures


def test_a_failure_is_a_failed_task_that_fails_later_work_until_delivered(eng):
    var = eng.new_var()

    def broken() -> None:
        raise ValueError("bad value")

    failed = eng.run_now(broken, writes=(var,), name="broken")
    assert isinstance(failed, engine.Task) and failed.failed()
    assert "raised in engine task 'broken'" in failed.exception().__notes__[0]
    assert eng.run_now(lambda: "never", reads=(var,)) is None  # the var carries the failure
    skipped = eng.push(lambda: "never", reads=[var], executor="inline")
    assert skipped.failed() and skipped.exception() is failed.exception()
    with pytest.raises(ValueError, match="bad value"):
        failed.result()
    assert eng.run_now(lambda: "again", reads=(var,)).result() == "again"
    eng.wait_all().result(WAIT_S)  # delivered once: not raised a second time
    assert eng.statistics().failed == 1 and var.idle


def test_a_failure_nobody_awaited_is_raised_by_wait_all(eng):
    var = eng.new_var()
    eng.run_now(lambda: 1 / 0, writes=(var,))
    with pytest.raises(ZeroDivisionError):
        eng.wait_all().result(WAIT_S)


def test_a_base_exception_propagates_and_frees_the_var(eng):
    var = eng.new_var()

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.run_now(interrupted, writes=(var,))
    assert var.idle and eng.statistics().running == 0
    with pytest.raises(KeyboardInterrupt):
        eng.wait_all().result(WAIT_S)


def test_a_coroutine_function_is_refused(eng):
    async def coroutine() -> None:
        return None

    task = eng.run_now(coroutine, writes=(eng.new_var(),))
    with pytest.raises(EngineError, match="returned a coroutine"):
        task.result()


def test_after_close_it_raises(eng):
    eng.close(WAIT_S)
    with pytest.raises(EngineClosedError):
        eng.run_now(lambda: None, writes=(eng.new_var(),))


# ------------------------------------------------------------ asyncio's side


async def test_asyncio_gather_takes_completed_waitables_without_tasks_or_futures(monkeypatch):
    counting = count_tasks_and_futures(monkeypatch)
    eng = Engine(slots=4)
    var = eng.new_var()
    before = counting.made()
    waitables = [eng.run_now(lambda i=i: i, reads=(var,)) for i in range(1000)]
    waitables += [eng.run_now(lambda: None, writes=(var,)) for _ in range(1000)]
    results = await asyncio.gather(*waitables)
    assert results == list(range(1000)) + [None] * 1000
    for waitable in waitables:
        await waitable
    assert counting.made() == before  # not one Task or Future for 2000 calls
    await eng.aclose()


async def test_gather_still_wraps_pending_waitables_so_cancelling_works(monkeypatch):
    counting = count_tasks_and_futures(monkeypatch)
    eng = Engine(slots=1)
    gate = Gate()
    pending = eng.push(gate, writes=[eng.new_var()])
    assert gate.started.wait(WAIT_S)
    tasks_before = counting.tasks
    gathered = asyncio.gather(pending)
    assert counting.tasks == tasks_before + 1  # the usual wrapper of an awaitable
    await asyncio.sleep(0)
    gathered.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gathered  # at once: the work still runs
    assert not pending.done()
    gate.opened.set()
    await pending
    await eng.aclose()


async def test_gather_delivers_a_failure_so_it_is_raised_once(eng):
    var = eng.new_var()
    failed = eng.run_now(lambda: 1 / 0, writes=(var,))
    with pytest.raises(ZeroDivisionError):
        await asyncio.gather(failed, eng.run_now(lambda: None, writes=(eng.new_var(),)))
    await eng.wait_all()  # delivered by the gather: not raised again
    assert eng.run_now(lambda: "usable", writes=(var,)).result() == "usable"


async def test_asyncio_waits_and_shield_take_completed_waitables(eng):
    done = eng.run_now(lambda: "value", writes=(eng.new_var(),))
    assert await asyncio.wait_for(done, WAIT_S) == "value"
    assert await asyncio.shield(done) == "value"
    finished, _ = await asyncio.wait([done])
    assert finished == {done}
    assert asyncio.isfuture(done) and not done.cancel() and not done.cancelled()


async def test_done_callbacks_run_later_on_the_loop_in_their_context(eng):
    done = eng.run_now(lambda: "value", writes=(eng.new_var(),))
    variable: contextvars.ContextVar[str] = contextvars.ContextVar("variable")
    calls: list[tuple[str, object]] = []
    context = contextvars.copy_context()
    context.run(variable.set, "given")
    variable.set("current")
    done.add_done_callback(lambda w: calls.append(("first", variable.get())))
    done.add_done_callback(lambda w: calls.append(("second", variable.get())), context=context)
    assert calls == []  # never from inside add_done_callback, as asyncio's futures
    await asyncio.sleep(0)
    assert calls == [("first", "current"), ("second", "given")]


async def test_a_raising_done_callback_goes_to_the_loop_and_the_rest_still_run(eng):
    loop = asyncio.get_running_loop()
    reported: list[BaseException] = []
    loop.set_exception_handler(lambda loop, context: reported.append(context["exception"]))
    done = eng.run_now(lambda: None, writes=(eng.new_var(),))
    ran: list[int] = []

    def broken(_: object) -> None:
        raise RuntimeError("callback")

    done.add_done_callback(broken)
    done.add_done_callback(lambda w: ran.append(1))
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert ran == [1] and [str(e) for e in reported] == ["callback"]


async def test_a_done_callback_on_a_pending_waitable_runs_once_it_completes(eng):
    gate = Gate()
    task = eng.push(gate, writes=[eng.new_var()])
    completed = asyncio.get_running_loop().create_future()
    task.add_done_callback(completed.set_result)
    gate.opened.set()
    assert await asyncio.wait_for(completed, WAIT_S) is task
