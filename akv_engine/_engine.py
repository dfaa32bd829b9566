"""The dependency engine: per-var ordering, priority slots, executors, failures, waits.

All engine state (var queues, the ready heap, counters) changes under one lock, so tasks
can be pushed from any thread and completed from any thread; functions themselves always
run outside the lock.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from types import CoroutineType
from typing import Any, NoReturn

from akv_engine._errors import EngineClosedError, EngineError, EngineLoopClosedError
from akv_engine._executors import CallbackExecutor, Executor, LoopExecutor, ThreadExecutor
from akv_engine._graph import to_dot
from akv_engine._task import (
    ALREADY_DONE,
    DONE,
    FAILED,
    READY,
    RUNNING,
    WAITING,
    Completed,
    Failure,
    Task,
    Waitable,
    add_note,
    note_task,
)
from akv_engine._var import Var

__all__ = [
    "DEFAULT_SLOTS",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineLoopClosedError",
    "EngineStatistics",
]

#: Tasks that may run at once when ``Engine(slots=...)`` is not given.
DEFAULT_SLOTS = 4
INLINE = "inline"
THREAD = "thread"
LOOP = "loop"
CALLBACK = "callback"


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine's counters (for metrics and tests).

    ``completed`` tasks ran and returned, ``failed`` ones raised, ``skipped`` ones did not
    run because a var they use carried an undelivered failure. ``waiting`` tasks wait for
    vars, ``ready`` ones for a slot, ``running`` ones hold a slot.
    """

    pushed: int
    completed: int
    failed: int
    skipped: int
    waiting: int
    ready: int
    running: int
    slots: int


class _AllDone(Waitable):
    """Completes when every task pending at its creation has completed."""

    __slots__ = ("_engine", "_raise_failures", "_remaining", "_reported")

    def __init__(self, engine: Engine, tasks: list[Task], raise_failures: bool) -> None:
        super().__init__(engine._lock, "wait_all" if raise_failures else "drain")
        self._engine = engine
        self._raise_failures = raise_failures
        self._remaining = len(tasks)
        self._reported: list[Failure] = []
        if not tasks:
            self._finish()
            return
        for task in tasks:
            task._add_callback(self._one_done)

    def _one_done(self, _: Waitable) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            failure = None
            if self._raise_failures:
                self._reported = self._engine._undelivered_failures_locked()
                if self._reported:
                    failure = self._reported[0]
            event, callbacks = self._complete_locked(None, failure)
        self._notify(self, event, callbacks)

    def _outcome(self) -> Any:
        reported = self._reported
        if not reported:
            return None
        first = reported[0]
        others = [f for f in reported[1:] if not f.delivered]
        if not first.delivered and others:
            names = ", ".join(repr(f.task_name) for f in others)
            add_note(first.exception, f"{len(others)} more task(s) failed too: {names}")
        for failure in reported:
            failure.delivered = True
        raise first.exception


class Engine:
    """Runs functions in an order set by the vars they read and write, and by priority.

    Guarantees
    ----------
    * Per var, tasks keep push order: consecutive reads run concurrently, a write waits
      for every earlier task on the var and blocks every later one. A var listed in both
      ``reads`` and ``writes`` counts as a write.
    * At most ``slots`` tasks run at once; ready tasks start highest ``priority`` first,
      ties in push order.
    * A task that raises stores its exception on the vars it writes; tasks that use such
      a var fail with that same exception without running, until the exception has been
      raised to the user once by a wait (then the var is usable again, as in MXNet).
    * ``push`` may be called from any thread or loop; functions run on the executor chosen
      (``"inline"``, ``"thread"``, ``"loop"``, or one registered by name).

    Parameters
    ----------
    slots:
        How many tasks may run at once (also the size of the worker-thread pool).
    loop:
        The event loop for coroutine tasks. By default the loop running when the engine is
        created, else a private loop thread started on the first coroutine task.
    """

    def __init__(
        self,
        slots: int = DEFAULT_SLOTS,
        loop: asyncio.AbstractEventLoop | None = None,
        name: str = "engine",
    ) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise EngineError(f"Engine(slots={slots!r}): slots must be an int >= 1")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self.name = name
        self._slots = slots
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._var_ids = itertools.count(1)
        self._pending: dict[int, Task] = {}
        self._ready: list[tuple[int, int, Task]] = []
        self._running = 0
        self._failures: list[Failure] = []
        self._closed = False
        self._pushed = self._completed = self._failed = self._skipped = 0
        # run_now's runs, which have no Task (counted in _running, never in _pending).
        self._running_inline = 0
        # The work list of the dispatch loop running on this thread, if any (_dispatch).
        self._dispatching = threading.local()
        # What holds a var while run_now runs a function without a Task of its own.
        self._inline_holder = Task(
            self._lock, 0, "inline work", _check_var, (), (), (), 0, INLINE, False
        )
        self._loop_executor = LoopExecutor(loop)
        self._executors: dict[str, Executor] = {
            THREAD: ThreadExecutor(slots, name=f"{name}-worker"),
            LOOP: self._loop_executor,
            CALLBACK: CallbackExecutor(self._loop_executor),
        }

    # ------------------------------------------------------------------ public API

    @property
    def slots(self) -> int:
        """How many tasks may run at once."""
        return self._slots

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop coroutine tasks run on."""
        return self._loop_executor.loop

    def new_var(self, name: str | None = None) -> Var:
        """A new var, named ``name`` (by default ``var<N>``)."""
        var_id = next(self._var_ids)
        return Var(self, var_id, name if name is not None else f"var{var_id}")

    def register_executor(self, kind: str, executor: Executor) -> None:
        """Make ``executor`` available to ``push(..., executor=kind)`` (the GPU seam)."""
        if kind == INLINE or kind in self._executors:
            raise EngineError(f"an executor named {kind!r} is already registered")
        self._executors[kind] = executor

    def push(
        self,
        fn: Callable[..., Any],
        *args: Any,
        reads: Iterable[Var] = (),
        writes: Iterable[Var] = (),
        priority: int = 0,
        name: str | None = None,
        executor: str | None = None,
        no_skip: bool = False,
    ) -> Task:
        """Schedule ``fn(*args)`` after the tasks it depends on through ``reads``/``writes``.

        Returns the :class:`Task` at once (already finished when it ran inline). The
        executor defaults to ``"loop"`` for coroutine functions and ``"thread"`` otherwise.
        ``no_skip=True`` runs the task even when one of its vars carries a failure.

        Raises
        ------
        EngineClosedError
            After :meth:`close`.
        EngineError
            For a var of another engine, or an unknown or unfit executor.
        """
        if executor is None:
            executor = LOOP if inspect.iscoroutinefunction(fn) else THREAD
        elif executor != INLINE and executor not in self._executors:
            raise EngineError(
                f"unknown executor {executor!r}; known: {[INLINE, *sorted(self._executors)]}"
            )
        # One var (the common case) needs no deduplication.
        write_vars: tuple[Var, ...]
        read_vars: tuple[Var, ...]
        if (type(writes) is tuple or type(writes) is list) and len(writes) < 2:
            write_vars = tuple(writes)
        else:
            write_vars = tuple(dict.fromkeys(writes))
        if not reads:
            read_vars = ()
        elif (type(reads) is tuple or type(reads) is list) and len(reads) == 1 and not write_vars:
            read_vars = tuple(reads)
        else:
            read_vars = tuple(v for v in dict.fromkeys(reads) if v not in write_vars)
        for var in write_vars:
            if var._engine is not self:
                raise EngineError(f"{var!r} belongs to another engine")
        for var in read_vars:
            if var._engine is not self:
                raise EngineError(f"{var!r} belongs to another engine")
        return self._push(fn, args, read_vars, write_vars, priority, name, executor, no_skip)

    def run_now(
        self,
        fn: Callable[..., Any],
        *args: Any,
        reads: tuple[Var, ...] = (),
        writes: tuple[Var, ...] = (),
        name: str | None = None,
    ) -> Waitable | None:
        """Run ``fn(*args)`` on this thread now, as an inline task on one var would run, if
        it can start at once; else return None and do nothing.

        It can when the call names one var (``reads=(var,)`` or ``writes=(var,)``), that
        var is idle (no task holds it or waits for it) and carries no undelivered failure,
        no ready task waits for a slot and a slot is free: exactly when
        ``push(fn, *args, executor="inline", ...)`` would run it before returning, at any
        priority. No Task is made: the result is a :class:`Completed` waitable (one shared
        instance for every call whose ``fn`` returned None). The var is held and a slot
        taken while ``fn`` runs, so work pushed meanwhile from other threads waits for it,
        and the statistics count it. When ``fn`` raises, the result is a failed Task and
        the failure travels as with :meth:`push` (later tasks on a written var fail with
        it until a wait delivers it).

        Returning None lets the caller choose what to push instead (a push that can run
        now may read the caller's arrays directly; one that must wait copies them first).

        Raises
        ------
        EngineClosedError
            After :meth:`close`.
        EngineError
            For a var of another engine.
        """
        if not reads and len(writes) == 1:
            var, is_write = writes[0], True
        elif not writes and len(reads) == 1:
            var, is_write = reads[0], False
        else:
            return None
        if var._engine is not self:
            raise EngineError(f"{var!r} belongs to another engine")
        holders = var._holders
        holder = self._inline_holder
        lock = self._lock
        # Below, Var._append and Var._release for an idle var are inlined, and the lock is
        # taken with acquire/release rather than `with` (half the cost): this is the path
        # of every small call of a store.
        lock.acquire()
        try:
            failure = var._failure
            free = (
                not holders
                and not var._queue
                and (failure is None or failure.delivered)
                and not self._closed
                and not self._ready
                and self._running < self._slots
            )
            if free:
                holders.append(holder)
                var._writer = is_write
                self._running += 1
                self._running_inline += 1
                self._pushed += 1
        finally:
            lock.release()
        if not free:
            if self._closed:
                raise EngineClosedError(f"engine {self.name!r} is closed")
            return None
        try:
            result = fn(*args)  # as _call_inline does, without a call more: the hot path
            if type(result) is CoroutineType:
                _refuse_coroutine(result, name or fn.__name__)
        except BaseException as exc:
            return self._inline_failed(fn, args, var, is_write, name, exc)
        startable: list[Task] | None = None
        lock.acquire()
        try:
            self._completed += 1
            self._running -= 1
            self._running_inline -= 1
            if is_write:
                var._failure = None
            if len(holders) == 1 and not var._queue:
                holders.clear()
                if is_write:
                    var._writer = False
                    var.version += 1
            else:
                granted = var._release(holder, is_write)
                if granted:
                    self._grant_locked(granted)
            if self._ready:
                startable = self._take_startable_locked()
        finally:
            lock.release()
        if startable:
            self._dispatch(startable)
        if result is None:
            return ALREADY_DONE
        return Completed(result, name if name is not None else fn.__name__)

    def wait_for_var(self, var: Var) -> Task:
        """A task that completes once every task pushed before it on ``var`` has completed.

        Awaiting it (or calling ``.result(timeout)``) raises the var's undelivered failure,
        if any, and marks it delivered; it never raises the same failure twice.
        """
        if var._engine is not self:
            raise EngineError(f"{var!r} belongs to another engine")
        return self._push(
            _check_var, (var,), (var,), (), 0, f"wait_for_var({var.name})", INLINE, True, True
        )

    def wait_all(self) -> Waitable:
        """A waitable that completes once every task pending now has completed.

        Awaiting it (or ``.result(timeout)``) raises the first failure not delivered yet
        (from any task, also earlier ones nobody waited for), noting how many others
        failed, and marks them all delivered, so a second wait does not raise them again.
        """
        with self._lock:
            tasks = list(self._pending.values())
        return _AllDone(self, tasks, raise_failures=True)

    def statistics(self) -> EngineStatistics:
        """The counters now (see :class:`EngineStatistics`)."""
        with self._lock:
            ready = len(self._ready)
            waiting = len(self._pending) - ready - (self._running - self._running_inline)
            return EngineStatistics(
                pushed=self._pushed,
                completed=self._completed,
                failed=self._failed,
                skipped=self._skipped,
                waiting=waiting,
                ready=ready,
                running=self._running,
                slots=self._slots,
            )

    def graph(self) -> dict[str, list[str]]:
        """The pending graph: each unfinished task's name -> the names it directly waits on.

        Running and ready tasks wait on nothing. A name shared by several pending tasks is
        made unique as ``name#id``.
        """
        with self._lock:
            tasks = list(self._pending.values())
            label = _labels(tasks)
            graph: dict[str, list[str]] = {}
            for task in tasks:
                blockers: dict[str, None] = {}
                if task._state == WAITING:
                    for var in task.reads + task.writes:
                        for blocker in var._blockers(task):
                            blockers[label.get(blocker.id, blocker.name)] = None
                graph[label[task.id]] = list(blockers)
            return graph

    def states(self) -> dict[str, str]:
        """Each unfinished task's name (as in :meth:`graph`) -> its state."""
        with self._lock:
            tasks = list(self._pending.values())
            label = _labels(tasks)
            return {label[task.id]: task.state for task in tasks}

    def to_dot(self) -> str:
        """The pending graph in Graphviz DOT (edges point from a task to those waiting on it)."""
        return to_dot(self.graph(), self.states())

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting tasks, wait for the pending ones, release threads and loop.

        It does not raise task failures (use :meth:`wait_all` for that). Idempotent.

        Raises
        ------
        EngineError
            When called on the engine's loop thread while tasks are pending (use
            :meth:`aclose` there).
        TimeoutError
            When pending tasks did not finish within ``timeout`` seconds.
        """
        drain = self._begin_close()
        if not drain.done() and self._on_loop_thread():
            raise EngineError(
                "Engine.close() on its own loop thread would wait forever: "
                "use `await engine.aclose()`"
            )
        drain.result(timeout)
        self._shutdown()

    async def aclose(self) -> None:
        """:meth:`close` for coroutines: await the pending tasks, then release resources."""
        await self._begin_close()
        self._shutdown()

    # ------------------------------------------------------------------ internals

    def _begin_close(self) -> Waitable:
        with self._lock:
            self._closed = True
            tasks = list(self._pending.values())
        return _AllDone(self, tasks, raise_failures=False)

    def _shutdown(self) -> None:
        for executor in self._executors.values():
            executor.close()

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop_executor._loop
        except RuntimeError:
            return False

    def _inline_failed(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        var: Var,
        is_write: bool,
        name: str | None,
        exc: BaseException,
    ) -> Task:
        """``run_now``'s ``fn`` raised: make the Task it did without, then fail it."""
        reads, writes = ((), (var,)) if is_write else ((var,), ())
        with self._lock:
            task_id = next(self._ids)
            task = Task(self._lock, task_id, name, fn, args, reads, writes, 0, INLINE, False)
            task._state = RUNNING
            self._pending[task_id] = task
            self._running_inline -= 1
            holders = var._holders
            holders[holders.index(self._inline_holder)] = task
        more = self._finish(task, None, exc, None)
        if more:
            self._dispatch(more)
        if not isinstance(exc, Exception):
            raise exc
        return task

    def _push(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        reads: tuple[Var, ...],
        writes: tuple[Var, ...],
        priority: int,
        name: str | None,
        executor: str,
        no_skip: bool,
        is_wait: bool = False,
    ) -> Task:
        lock = self._lock
        with lock:
            if self._closed:
                raise EngineClosedError(f"engine {self.name!r} is closed")
            task_id = next(self._ids)
            task = Task(
                lock, task_id, name, fn, args, reads, writes, priority, executor, no_skip, is_wait
            )
            self._pending[task_id] = task
            self._pushed += 1
            deps = len(reads) + len(writes)
            for var in reads:
                if var._append(task, False):
                    deps -= 1
            for var in writes:
                if var._append(task, True):
                    deps -= 1
            task._deps = deps
            if deps:
                return task
            if not self._ready and self._running < self._slots:
                task._state = RUNNING
                self._running += 1
                startable = [task]
            else:
                task._state = READY
                heapq.heappush(self._ready, (-priority, task_id, task))
                startable = self._take_startable_locked()
        if startable:
            self._dispatch(startable)
        return task

    def _take_startable_locked(self) -> list[Task]:
        ready = self._ready
        if not ready or self._running >= self._slots:
            return []
        startable = []
        while ready and self._running < self._slots:
            task = heapq.heappop(ready)[2]
            task._state = RUNNING
            self._running += 1
            startable.append(task)
        return startable

    def _dispatch(self, startable: list[Task]) -> None:
        """Start tasks; inline ones run here, and so do those their completion readies.

        A task that completes while it is being started (a callback task whose ``fn``
        calls ``done`` at once) hands what it readies to this loop (:meth:`_on_done`)
        instead of starting it from inside its own call: a chain of such tasks (a burst
        of pipelined pushes) runs one after another, not ever deeper in the stack.
        """
        work = startable
        local = self._dispatching
        outer = getattr(local, "work", None)
        local.work = work
        index = 0
        try:
            while index < len(work):
                task = work[index]
                index += 1
                failure = task._inherited_failure()
                if failure is not None and not task.no_skip:
                    work.extend(self._finish(task, None, None, failure))
                    continue
                if task.executor == INLINE:
                    try:
                        result = _call_inline(task.fn, task.args, task.name)
                    except Exception as exc:
                        work.extend(self._finish(task, None, exc, None))
                    except BaseException as exc:
                        work.extend(self._finish(task, None, exc, None))
                        raise
                    else:
                        work.extend(self._finish(task, result, None, None))
                else:
                    try:
                        self._executors[task.executor].submit(
                            task.fn, task.args, partial(self._on_done, task)
                        )
                    except Exception as exc:
                        if task._state != RUNNING:  # done() came first: it is not ours
                            raise
                        # Never started (its loop has closed): it fails like one that
                        # raised, so its vars, its slot and its waiters are not held.
                        work.extend(self._finish(task, None, exc, None))
        finally:
            local.work = outer
            if index < len(work):  # a BaseException stopped the loop: start the rest
                self._dispatch(work[index:])

    def _on_done(self, task: Task, result: Any, exc: BaseException | None) -> None:
        if task._state > RUNNING:
            # Complete already: a callback task's function called done at once and then
            # raised what a waiter's callback raised in it (the executor logs it).
            if exc is not None:
                raise exc
            return
        more = self._finish(task, result, exc, None)
        if more:
            self._start(more)

    def _start(self, startable: list[Task]) -> None:
        """Dispatch tasks taken from the ready heap, from a completion on this thread."""
        active = getattr(self._dispatching, "work", None)
        if active is not None:
            active.extend(startable)  # started by the dispatch loop this completion came from
        else:
            self._dispatch(startable)

    def _finish(
        self,
        task: Task,
        result: Any,
        exc: BaseException | None,
        inherited: Failure | None,
    ) -> list[Task]:
        """Complete ``task``, release its vars; return the tasks that may start now."""
        failure = inherited
        if task.is_wait and isinstance(result, Failure):
            failure, result = result, None
        elif exc is not None:
            note_task(exc, task)
            failure = Failure(exc, task.name)
        with self._lock:
            if failure is not None:
                if inherited is not None:
                    self._skipped += 1
                    task.skipped = True
                elif not task.is_wait:
                    self._failed += 1
                    self._failures.append(failure)
                for var in task.writes:
                    var._failure = failure
            else:
                self._completed += 1
                for var in task.writes:
                    var._failure = None
            ready = self._ready
            for var in task.reads:
                granted = var._release(task, False)
                if granted:
                    self._grant_locked(granted)
            for var in task.writes:
                granted = var._release(task, True)
                if granted:
                    self._grant_locked(granted)
            self._running -= 1
            del self._pending[task.id]
            # Task._complete_locked, inlined: this is the hot path of every task.
            task._result = result
            task._failure = failure
            task._state = FAILED if failure is not None else DONE
            callbacks = task._callbacks
            task._callbacks = None
            event = task._event
            startable = self._take_startable_locked() if ready else []
        if event is not None or callbacks:
            try:
                task._notify(task, event, callbacks or [])
            except BaseException:
                # A waiter's callback raised (after every one ran): that is the
                # completing thread's to see, but the tasks this completion took off the
                # ready heap (marked running) must still start.
                if startable:
                    self._start(startable)
                raise
        return startable

    def _grant_locked(self, granted: list[Task]) -> None:
        ready = self._ready
        for other in granted:
            other._deps -= 1
            if other._deps == 0:
                other._state = READY
                heapq.heappush(ready, (-other.priority, other.id, other))

    def _undelivered_failures_locked(self) -> list[Failure]:
        self._failures = [f for f in self._failures if not f.delivered]
        return list(self._failures)

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<Engine {self.name!r} slots={stats.slots} running={stats.running} "
            f"ready={stats.ready} waiting={stats.waiting}>"
        )


def _check_var(var: Var) -> Failure | None:
    failure = var._failure
    if failure is not None and not failure.delivered:
        return failure
    return None


def _labels(tasks: list[Task]) -> dict[int, str]:
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.name] = counts.get(task.name, 0) + 1
    return {t.id: t.name if counts[t.name] == 1 else f"{t.name}#{t.id}" for t in tasks}


def _call_inline(fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """``fn(*args)`` as an inline task; a coroutine function is refused (it must run on the
    loop)."""
    result = fn(*args)
    if type(result) is CoroutineType:
        _refuse_coroutine(result, name)
    return result


def _refuse_coroutine(result: CoroutineType[Any, Any, Any], name: str) -> NoReturn:
    result.close()
    raise EngineError(
        f"task {name!r} returned a coroutine: push coroutine functions with executor='loop'"
    )
