"""The engine's contract: ordering, concurrency, priority, executors, failures, waits, graph."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import akv_engine as engine
from akv_engine import Engine, EngineClosedError, EngineError
from tests.engine.common import WAIT_S, Gate


def test_consecutive_reads_run_concurrently(eng):
    var = eng.new_var()
    barrier = threading.Barrier(2, timeout=WAIT_S)
    tasks = [eng.push(barrier.wait, reads=[var]) for _ in range(2)]
    # Both reads must be running at the same time for the barrier to let them through.
    assert sorted(t.result(WAIT_S) for t in tasks) == [0, 1]


def test_write_waits_for_every_earlier_read(eng):
    var = eng.new_var()
    gate = Gate()
    read = eng.push(gate, reads=[var])
    write = eng.push(lambda: "write", writes=[var])
    assert gate.started.wait(WAIT_S)
    time.sleep(0.05)
    assert write.state == "waiting"
    gate.opened.set()
    assert write.result(WAIT_S) == "write"
    assert read.done()


def test_read_pushed_after_queued_write_waits_for_it(eng):
    var = eng.new_var()
    log: list[str] = []
    gate = Gate()
    first_read = eng.push(gate, reads=[var])
    write = eng.push(log.append, "write", writes=[var])
    late_read = eng.push(log.append, "late read", reads=[var])
    assert gate.started.wait(WAIT_S)
    time.sleep(0.05)
    # The late read is not granted beside the running read: the queued write comes first.
    assert late_read.state == "waiting"
    gate.opened.set()
    late_read.result(WAIT_S)
    assert log == ["write", "late read"]
    assert first_read.done() and write.done()


def test_writes_are_exclusive_and_in_push_order(eng):
    var = eng.new_var()
    log: list[int] = []
    active = [0]

    def write(i: int) -> None:
        active[0] += 1
        assert active[0] == 1, "two writes ran at once"
        time.sleep(0.001)
        log.append(i)
        active[0] -= 1

    tasks = [eng.push(write, i, writes=[var]) for i in range(20)]
    for task in tasks:
        task.result(WAIT_S)
    assert log == list(range(20))
    assert var.version == 20


def test_var_in_reads_and_writes_counts_as_write(eng):
    var = eng.new_var()
    gate = Gate()
    eng.push(gate, reads=[var])
    both = eng.push(lambda: "both", reads=[var], writes=[var])
    assert both.writes == (var,) and both.reads == ()
    assert gate.started.wait(WAIT_S)
    time.sleep(0.05)
    assert both.state == "waiting"
    gate.opened.set()
    assert both.result(WAIT_S) == "both"


def test_ready_tasks_start_by_priority_when_the_slot_frees():
    eng = Engine(slots=1)
    gate = Gate()
    eng.push(gate)
    assert gate.started.wait(WAIT_S)
    started: list[int] = []
    tasks = [eng.push(started.append, p, priority=p) for p in (1, 5, 3, 9, 7)]
    gate.opened.set()
    for task in tasks:
        task.result(WAIT_S)
    assert started == [9, 7, 5, 3, 1]
    eng.close()


def test_equal_priorities_start_in_push_order():
    eng = Engine(slots=1)
    gate = Gate()
    eng.push(gate)
    assert gate.started.wait(WAIT_S)
    started: list[str] = []
    tasks = [eng.push(started.append, name, priority=2) for name in "abcde"]
    tasks.append(eng.push(started.append, "high", priority=3))
    gate.opened.set()
    for task in tasks:
        task.result(WAIT_S)
    assert started == ["high", "a", "b", "c", "d", "e"]
    eng.close()


def test_slots_bound_how_many_tasks_run_at_once():
    eng = Engine(slots=2)
    lock = threading.Lock()
    running = [0]
    peak = [0]

    def work() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    tasks = [eng.push(work) for _ in range(10)]
    for task in tasks:
        task.result(WAIT_S)
    assert peak[0] == 2
    eng.close()


def test_plain_function_runs_on_a_worker_thread(eng):
    here = threading.get_ident()
    assert eng.push(threading.get_ident).result(WAIT_S) != here


def test_inline_function_runs_on_the_pushing_thread(eng):
    task = eng.push(threading.get_ident, executor="inline")
    assert task.done()
    assert task.result() == threading.get_ident()


def test_inline_task_runs_on_the_thread_that_frees_its_var(eng):
    var = eng.new_var()
    worker_thread: list[int] = []

    def write() -> None:
        time.sleep(0.05)
        worker_thread.append(threading.get_ident())

    eng.push(write, writes=[var])
    follower = eng.push(threading.get_ident, reads=[var], executor="inline")
    assert follower.result(WAIT_S) == worker_thread[0]


async def test_coroutine_task_runs_on_the_engines_loop():
    eng = Engine()
    loop = asyncio.get_running_loop()

    async def where() -> asyncio.AbstractEventLoop:
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    assert await eng.push(where) is loop
    await eng.aclose()


def test_coroutine_task_without_a_loop_uses_a_private_loop_thread(eng):
    async def double(x: int) -> tuple[int, int]:
        await asyncio.sleep(0.001)
        return 2 * x, threading.get_ident()

    value, thread_id = eng.push(double, 21).result(WAIT_S)
    assert value == 42
    assert thread_id != threading.get_ident()


def test_task_is_awaitable_from_another_loop_while_a_thread_completes_it(eng):
    var = eng.new_var()
    gate = Gate()
    task = eng.push(gate, writes=[var])

    async def waiter() -> str:
        threading.Timer(0.05, gate.opened.set).start()
        return await asyncio.wait_for(task, WAIT_S)

    assert asyncio.run(waiter()) == "gate"


def test_result_times_out_without_cancelling_the_task(eng):
    gate = Gate()
    task = eng.push(gate)
    with pytest.raises(TimeoutError, match=r"did not complete within 0\.05 s"):
        task.result(timeout=0.05)
    gate.opened.set()
    assert task.result(WAIT_S) == "gate"


def test_failure_reaches_dependents_which_do_not_run(eng):
    var = eng.new_var()
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("bad value")

    failing = eng.push(boom, writes=[var], name="boom")
    dependent = eng.push(ran.append, "dependent", reads=[var], name="dependent")
    with pytest.raises(ValueError, match="bad value") as info:
        dependent.result(WAIT_S)
    assert ran == []
    assert failing.failed() and dependent.failed()
    assert dependent.exception() is failing.exception()
    assert "raised in engine task 'boom'" in "".join(getattr(info.value, "__notes__", []))
    assert eng.statistics().skipped == 1


def test_failure_travels_along_write_edges_only(eng):
    source, middle, only_read = eng.new_var(), eng.new_var(), eng.new_var()

    def boom() -> None:
        raise RuntimeError("root cause")

    eng.push(boom, writes=[source])
    # Reads the failed var and writes another: that other var carries the failure on.
    eng.push(lambda: None, reads=[source, only_read], writes=[middle])
    downstream = eng.push(lambda: "ran", reads=[middle])
    unrelated = eng.push(lambda: "ran", reads=[only_read])
    with pytest.raises(RuntimeError, match="root cause"):
        downstream.result(WAIT_S)
    assert unrelated.result(WAIT_S) == "ran"


def test_wait_for_var_raises_a_failure_once_then_the_var_is_usable(eng):
    var = eng.new_var()

    def boom() -> None:
        raise KeyError("lost")

    eng.push(boom, writes=[var])
    with pytest.raises(KeyError, match="lost"):
        eng.wait_for_var(var).result(WAIT_S)
    assert eng.wait_for_var(var).result(WAIT_S) is None
    assert eng.push(lambda: "fine", reads=[var]).result(WAIT_S) == "fine"


async def test_wait_for_var_is_awaitable_and_waits_for_earlier_tasks():
    eng = Engine()
    var = eng.new_var()
    log: list[str] = []

    async def slow_write() -> None:
        await asyncio.sleep(0.02)
        log.append("write")

    eng.push(slow_write, writes=[var])
    await eng.wait_for_var(var)
    assert log == ["write"]
    await eng.aclose()


def test_wait_all_raises_the_first_failure_once_naming_the_others(eng):
    a, b = eng.new_var(), eng.new_var()

    def fail(message: str) -> None:
        raise ValueError(message)

    eng.push(fail, "first", writes=[a], name="first")
    eng.push(lambda: None, reads=[a], no_skip=True).result(WAIT_S)
    eng.push(fail, "second", writes=[b], name="second")
    with pytest.raises(ValueError, match="first") as info:
        eng.wait_all().result(WAIT_S)
    assert "1 more task(s) failed too: 'second'" in "".join(info.value.__notes__)
    assert eng.wait_all().result(WAIT_S) is None


def test_awaiting_the_failed_task_delivers_its_failure(eng):
    var = eng.new_var()

    def boom() -> None:
        raise OSError("disk")

    task = eng.push(boom, writes=[var])
    with pytest.raises(OSError):
        task.result(WAIT_S)
    with pytest.raises(OSError):
        task.result(WAIT_S)  # a task always reports its own outcome
    assert eng.wait_all().result(WAIT_S) is None
    assert eng.push(lambda: "ok", writes=[var]).result(WAIT_S) == "ok"


def test_no_skip_task_runs_despite_a_failed_var(eng):
    var = eng.new_var()

    def boom() -> None:
        raise ValueError("x")

    eng.push(boom, writes=[var])
    cleanup = eng.push(lambda: "cleaned", reads=[var], no_skip=True)
    assert cleanup.result(WAIT_S) == "cleaned"


def test_wait_all_waits_for_pending_tasks(eng):
    done: list[int] = []
    for i in range(5):
        eng.push(lambda i=i: (time.sleep(0.01), done.append(i)))
    eng.wait_all().result(WAIT_S)
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_graph_lists_what_each_pending_task_waits_on(eng):
    var, other = eng.new_var("w"), eng.new_var("o")
    gate = Gate()
    eng.push(gate, writes=[var], name="writer")
    assert gate.started.wait(WAIT_S)
    eng.push(lambda: None, reads=[var], name="reader1")
    eng.push(lambda: None, reads=[var], name="reader2")
    eng.push(lambda: None, writes=[var, other], name="writer2")
    eng.push(lambda: None, reads=[other], name="reader3")
    graph = eng.graph()
    assert graph == {
        "writer": [],
        "reader1": ["writer"],
        "reader2": ["writer"],
        "writer2": ["reader2", "reader1"],
        "reader3": ["writer2"],
    }
    assert eng.states()["writer"] == "running"
    dot = eng.to_dot()
    assert dot.startswith("digraph engine {")
    assert '"writer" -> "reader1";' in dot
    assert '"writer2" -> "reader3";' in dot
    gate.opened.set()
    eng.wait_all().result(WAIT_S)
    assert eng.graph() == {}


def test_graph_disambiguates_repeated_names(eng):
    var = eng.new_var()
    gate = Gate()
    first = eng.push(gate, writes=[var], name="step")
    assert gate.started.wait(WAIT_S)
    second = eng.push(lambda: None, writes=[var], name="step")
    assert eng.graph() == {f"step#{first.id}": [], f"step#{second.id}": [f"step#{first.id}"]}
    gate.opened.set()


def test_to_dot_escapes_quotes():
    assert '"a\\"b"' in engine.to_dot({'a"b': []})


def test_statistics_count_run_failed_skipped_and_waiting(eng):
    var = eng.new_var()
    gate = Gate()
    eng.push(gate, writes=[var])
    assert gate.started.wait(WAIT_S)
    eng.push(lambda: None, reads=[var])
    stats = eng.statistics()
    assert (stats.running, stats.waiting, stats.pushed) == (1, 1, 2)
    gate.opened.set()
    eng.wait_all().result(WAIT_S)

    def boom() -> None:
        raise ValueError("x")

    eng.push(boom, writes=[var])
    eng.push(lambda: None, reads=[var])
    with pytest.raises(ValueError):
        eng.wait_all().result(WAIT_S)
    stats = eng.statistics()
    assert (stats.completed, stats.failed, stats.skipped) == (2, 1, 1)
    assert (stats.running, stats.waiting, stats.ready) == (0, 0, 0)


def test_close_waits_for_pending_tasks_and_rejects_new_ones():
    eng = Engine()
    done: list[int] = []
    eng.push(lambda: (time.sleep(0.05), done.append(1)))
    eng.close(timeout=WAIT_S)
    assert done == [1]
    with pytest.raises(EngineClosedError):
        eng.push(lambda: None)


def test_bad_arguments_are_clear_errors(eng):
    other = Engine()
    with pytest.raises(EngineError, match="belongs to another engine"):
        eng.push(lambda: None, reads=[other.new_var()])
    with pytest.raises(EngineError, match="unknown executor 'gpu'"):
        eng.push(lambda: None, executor="gpu")
    with pytest.raises(EngineError, match="slots must be an int >= 1"):
        Engine(slots=0)
    other.close()


def test_inline_coroutine_function_fails_its_task(eng):
    async def coro() -> None:
        return None

    task = eng.push(coro, executor="inline")
    with pytest.raises(EngineError, match="returned a coroutine"):
        task.result(WAIT_S)


def test_registered_executor_completes_tasks_from_its_own_thread(eng):
    class FakeStreamExecutor:
        """Stands in for a GPU executor: work completes later, on another thread."""

        def __init__(self) -> None:
            self.closed = False

        def submit(self, fn, args, done):
            threading.Timer(0.01, lambda: done(fn(*args), None)).start()

        def close(self):
            self.closed = True

    fake = FakeStreamExecutor()
    eng.register_executor("fake-gpu", fake)
    var = eng.new_var()
    first = eng.push(lambda: "on stream", writes=[var], executor="fake-gpu")
    after = eng.push(lambda: "after", reads=[var], executor="inline")
    assert after.result(WAIT_S) == "after"
    assert first.result() == "on stream"
    with pytest.raises(EngineError, match="already registered"):
        eng.register_executor("fake-gpu", fake)
    eng.close()
    assert fake.closed


def test_random_programs_match_sequential_execution():
    """MXNet's RandSumExpr: random reads/writes over vars give the sequential result."""
    rng = random.Random(7)
    eng = Engine(slots=4)
    num_vars = 6
    vars_ = [eng.new_var() for _ in range(num_vars)]
    values = [1] * num_vars
    expected = [1] * num_vars
    for _ in range(300):
        target = rng.randrange(num_vars)
        sources = rng.sample(range(num_vars), rng.randrange(0, 3))
        sources = [s for s in sources if s != target]
        expected[target] = sum(expected[s] for s in sources) + expected[target] + 1

        def op(target=target, sources=sources):
            if rng.random() < 0.1:
                time.sleep(0.0005)
            values[target] = sum(values[s] for s in sources) + values[target] + 1

        eng.push(
            op,
            reads=[vars_[s] for s in sources],
            writes=[vars_[target]],
            executor=rng.choice(["thread", "inline"]),
            priority=rng.randrange(3),
        )
    eng.wait_all().result(WAIT_S)
    assert values == expected
    eng.close()


def test_tasks_can_be_pushed_from_many_threads_at_once(eng):
    var = eng.new_var()
    counter = [0]

    def add() -> None:
        counter[0] += 1

    def pusher() -> None:
        for _ in range(200):
            eng.push(add, writes=[var], executor="inline")

    threads = [threading.Thread(target=pusher) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    eng.wait_all().result(WAIT_S)
    assert counter[0] == 800
    assert var.version == 800


# -- then: a waitable derived from another -------------------------------------------------


def test_then_completes_with_the_function_of_the_result(eng):
    gate = Gate()
    task = eng.push(gate, executor="thread")
    derived = engine.then(task, lambda _: "converted")
    assert not derived.done()
    gate.opened.set()
    assert derived.result(WAIT_S) == "converted"
    finished = eng.push(lambda: 3, executor="inline")
    assert engine.then(finished, lambda n: n * 2).result(WAIT_S) == 6


async def test_then_shares_the_sources_failure_so_it_is_delivered_once(eng):
    def boom():
        raise ValueError("boom")

    var = eng.new_var()
    task = eng.push(boom, writes=[var], executor="inline")
    derived = engine.then(task, lambda _: pytest.fail("never called on failure"))
    with pytest.raises(ValueError, match="boom"):
        await derived
    assert task.exception() is derived.exception()
    # Delivered through the derived waitable: the var is usable again.
    assert eng.push(lambda: "ok", reads=[var], executor="inline").result(WAIT_S) == "ok"


def test_then_fails_alone_when_its_function_raises(eng):
    task = eng.push(lambda: 1, executor="inline")

    def convert(_):
        raise RuntimeError("cannot convert")

    derived = engine.then(task, convert)
    with pytest.raises(RuntimeError, match="cannot convert"):
        derived.result(WAIT_S)
    assert task.result(WAIT_S) == 1


async def test_a_long_chain_of_callback_tasks_done_at_once_runs_without_recursion():
    """Callback tasks whose ``fn`` reports ``done`` before returning (a pipelined push)
    start one another through the dispatch loop, not ever deeper in the stack: a chain
    far longer than Python's recursion limit completes, in order."""
    eng = Engine(slots=1, loop=asyncio.get_running_loop())
    var = eng.new_var("chain")
    order: list[int] = []

    held = []

    def at_once(i: int, done) -> None:
        order.append(i)
        if i == 0:
            held.append(done)  # the first holds the var until all others queued behind it
        else:
            done(i, None)

    try:
        tasks = [
            eng.push(at_once, i, writes=[var], executor="callback", name="push")
            for i in range(5000)
        ]
        (release,) = held
        release(0, None)
        results = [await asyncio.wait_for(task, WAIT_S) for task in tasks]
    finally:
        await eng.aclose()
    assert results == list(range(5000))
    assert order == list(range(5000))
    assert eng.statistics().failed == 0


def test_on_done_is_called_on_success_on_failure_and_at_once_when_done(eng):
    seen = []
    gate = Gate()
    task = eng.push(gate, executor="thread")
    task.on_done(lambda waitable: seen.append(("ran", waitable.failed())))
    assert seen == []
    gate.opened.set()
    task.result(WAIT_S)
    assert seen == [("ran", False)]

    def boom():
        raise ValueError("boom")

    var = eng.new_var()
    failed = eng.push(boom, writes=[var], executor="inline")
    skipped = eng.push(lambda: pytest.fail("skipped"), writes=[var], executor="inline")
    for waitable in (failed, skipped):  # both done already: called here, at once
        waitable.on_done(lambda waitable: seen.append(("failed", waitable.failed())))
    assert seen[1:] == [("failed", True), ("failed", True)]
    with pytest.raises(ValueError, match="boom"):
        skipped.result(WAIT_S)


def test_a_task_is_marked_skipped_only_when_the_engine_skipped_it(eng):
    def boom():
        raise ValueError("boom")

    var = eng.new_var()
    failed = eng.push(boom, writes=[var], executor="inline")
    skipped = eng.push(lambda: pytest.fail("skipped"), writes=[var], executor="inline")
    assert failed.failed() and not failed.skipped
    assert skipped.failed() and skipped.skipped
    with pytest.raises(ValueError, match="boom"):
        skipped.result(WAIT_S)  # raised: the var is usable again
    ran = eng.push(lambda: "ok", writes=[var], executor="inline")
    assert ran.result(WAIT_S) == "ok" and not ran.skipped
