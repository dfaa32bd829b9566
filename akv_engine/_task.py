"""Tasks and the waitable results the engine hands out.

A :class:`Waitable` is completed exactly once, from any thread, and can be waited for
from a coroutine on any event loop (``await w``) or from any thread (``w.result(timeout)``).
A :class:`Task` is the waitable for one function pushed to the engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from akv_engine._var import Var

__all__ = ["ALREADY_DONE", "Completed", "Failure", "Task", "Waitable", "gather", "then"]

WAITING = 0
READY = 1
RUNNING = 2
DONE = 3
FAILED = 4
_STATE_NAMES = {
    WAITING: "waiting",
    READY: "ready",
    RUNNING: "running",
    DONE: "done",
    FAILED: "failed",
}


#: A waitable of some kind (``on_done`` hands its callback the waitable itself).
_W = TypeVar("_W", bound="Waitable")


class Failure:
    """One failure, shared by the task that raised it and every task and var it reached.

    ``delivered`` becomes True the first time the exception is raised to a user by a wait;
    from then on the vars it reached no longer fail the tasks that use them.
    """

    __slots__ = ("delivered", "exception", "task_name")

    def __init__(self, exception: BaseException, task_name: str) -> None:
        self.exception = exception
        self.task_name = task_name
        self.delivered = False

    def __repr__(self) -> str:
        return f"<Failure in {self.task_name!r}: {self.exception!r}>"


def add_note(exception: BaseException, text: str) -> None:
    if sys.version_info >= (3, 11):
        exception.add_note(text)
    else:  # Python 3.10 keeps the note for tooling even though it does not print it.
        vars(exception)["__notes__"] = [*getattr(exception, "__notes__", []), text]


def _wake(loop: asyncio.AbstractEventLoop, thread_id: int, future: asyncio.Future[None]) -> None:
    if threading.get_ident() == thread_id:
        if not future.done() and not loop.is_closed():
            future.set_result(None)
    else:
        _call_soon_threadsafe(loop, _set_if_pending, future)


def _set_if_pending(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon_threadsafe(
    loop: asyncio.AbstractEventLoop,
    callback: Callable[..., object],
    *args: Any,
    context: contextvars.Context | None = None,
) -> None:
    """``loop.call_soon_threadsafe(callback, *args)``, or nothing once ``loop`` has closed.

    A waiter whose loop has closed is gone (``asyncio.run()`` cancels what still waits
    before it closes its loop, and nothing runs on a closed loop again): completing the
    waitable must not fail for it, since the completion is the engine's, on whatever
    thread finished the work.
    """
    try:
        loop.call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
        if not loop.is_closed():
            raise


FutureCallback = Callable[["Waitable"], object]
_Scheduled = tuple[FutureCallback, "Waitable", contextvars.Context]


class _Batch(threading.local):
    """This thread's done callbacks (asyncio's future protocol) waiting for the next turn
    of its running loop: one ``call_soon`` runs them all, instead of a handle each."""

    loop: asyncio.AbstractEventLoop | None = None
    callbacks: list[_Scheduled] | None = None


_batch = _Batch()


def _call_soon_batched(
    loop: asyncio.AbstractEventLoop,
    callback: FutureCallback,
    waitable: Waitable,
    context: contextvars.Context | None,
) -> None:
    """``loop.call_soon(callback, waitable, context=context)``, on the loop's own thread.

    Callbacks scheduled in one turn of the loop run together, in order, at the position of
    the first; each in its own context (by default a copy of the current one), as asyncio
    runs a future's callbacks.
    """
    if context is None:
        context = contextvars.copy_context()
    batch = _batch
    callbacks = batch.callbacks
    if callbacks is None or batch.loop is not loop:
        callbacks = []
        loop.call_soon(_run_batch, loop, callbacks)
        batch.loop, batch.callbacks = loop, callbacks
    callbacks.append((callback, waitable, context))


def _run_batch(loop: asyncio.AbstractEventLoop, callbacks: list[_Scheduled]) -> None:
    if _batch.callbacks is callbacks:
        _batch.loop = _batch.callbacks = None
    for index, (callback, waitable, context) in enumerate(callbacks):
        try:
            context.run(callback, waitable)
        except (SystemExit, KeyboardInterrupt):
            for later in callbacks[index + 1 :]:
                _call_soon_batched(loop, *later)
            raise
        except BaseException as exc:  # what asyncio does with a callback that raises
            loop.call_exception_handler(
                {
                    "message": f"Exception in callback {callback!r} of {waitable!r}",
                    "exception": exc,
                    "future": waitable,
                }
            )


class Waitable:
    """Something that completes once: awaitable on any loop, waitable from any thread.

    ``await w`` and ``w.result(timeout)`` return the value or raise the exception, every
    time they are called. Raising marks the failure as delivered (see :class:`Failure`).

    Once it has completed *successfully*, a waitable also passes for a done
    ``asyncio.Future`` (asyncio's duck typing, ``asyncio.isfuture``) on a thread where a
    loop is running, so that ``asyncio.gather``, ``wait``, ``wait_for`` and ``shield``
    take it as it is instead of wrapping it in a new ``asyncio.Task``. A pending or failed
    one is wrapped as any awaitable is (so cancelling the wait works, and raising a
    failure delivers it), and so is any one that ``loop.run_until_complete`` is given.
    """

    __slots__ = ("_callbacks", "_event", "_failure", "_lock", "_name", "_result", "_state")

    def __init__(self, lock: threading.Lock, name: str) -> None:
        self._lock = lock
        self._name = name
        self._state = WAITING
        self._result: Any = None
        self._failure: Failure | None = None
        # Made once a thread waits in result(): a lock held until the completion releases
        # it (cheaper than a threading.Event, which is a Condition and two more locks).
        self._event: threading.Lock | None = None
        self._callbacks: list[Callable[[Waitable], None]] | None = []

    @property
    def name(self) -> str:
        """What the waitable is called in errors, graphs and reprs."""
        return self._name

    @property
    def state(self) -> str:
        """One of ``waiting``, ``ready``, ``running``, ``done``, ``failed``."""
        return _STATE_NAMES[self._state]

    def done(self) -> bool:
        """True once the waitable has completed, successfully or not."""
        return self._state >= DONE

    def failed(self) -> bool:
        """True when the waitable completed with an exception."""
        return self._state == FAILED

    def exception(self) -> BaseException | None:
        """The exception it completed with (without raising or delivering it), else None."""
        return self._failure.exception if self._failure is not None else None

    def result(self, timeout: float | None = None) -> Any:
        """Block the calling thread until done; return the value or raise the exception.

        Raises
        ------
        TimeoutError
            When it has not completed within ``timeout`` seconds (it keeps running).
        """
        if self._state == DONE:  # asyncio.gather asks every completed waitable
            return self._result
        if self._state < DONE:
            with self._lock:
                if self._state < DONE:
                    event = self._event
                    if event is None:
                        # Held until the completion releases it (see _notify).
                        event = self._event = threading.Lock()
                        event.acquire()
                else:
                    event = None
            if event is not None:
                # Each waiter passes the released lock on, so that every one of them wakes.
                if timeout is None:
                    woken = event.acquire()
                elif timeout > 0:
                    woken = event.acquire(True, timeout)
                else:  # as threading.Event.wait: a timeout <= 0 only looks
                    woken = event.acquire(False)
                if not woken:
                    raise TimeoutError(f"{self.name!r} did not complete within {timeout} s")
                event.release()
        return self._outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state < DONE:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            thread_id = threading.get_ident()
            self._add_callback(lambda _: _wake(loop, thread_id, future))
            yield from future.__await__()
        return self._outcome()

    def _outcome(self) -> Any:
        failure = self._failure
        if failure is not None:
            failure.delivered = True
            raise failure.exception
        return self._result

    # ------------------------------------------------ asyncio's future protocol (duck typing)

    @property
    def _asyncio_future_blocking(self) -> bool | None:
        # asyncio.isfuture() is true when this is not None: only once completed
        # successfully, and only while a loop runs on this thread, the loop get_loop()
        # names. loop.run_until_complete(w) asks before its loop runs: w is then wrapped
        # as any awaitable (a pending one always is), instead of failing in get_loop().
        if self._state == DONE and asyncio._get_running_loop() is not None:
            return False
        return None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (asyncio's future protocol: a waitable serves any loop)."""
        return asyncio.get_running_loop()

    def add_done_callback(
        self, fn: FutureCallback, *, context: contextvars.Context | None = None
    ) -> None:
        """Call ``fn(self)`` on the running loop once completed (asyncio's future protocol).

        As with an ``asyncio.Future``, ``fn`` is scheduled with the loop (never called
        from here) and runs in ``context``, by default a copy of the current one.
        """
        loop = asyncio.get_running_loop()
        if self._state >= DONE:
            _call_soon_batched(loop, fn, self, context)
            return
        if context is None:
            context = contextvars.copy_context()
        thread_id = threading.get_ident()
        callback_context = context

        def completed(waitable: Waitable) -> None:
            if threading.get_ident() != thread_id:
                _call_soon_threadsafe(loop, fn, waitable, context=callback_context)
            elif not loop.is_closed():  # else nobody is left to call back (see _wake)
                _call_soon_batched(loop, fn, waitable, callback_context)

        self._add_callback(completed)

    def on_done(self: _W, fn: Callable[[_W], None]) -> None:
        """Call ``fn(self)`` once completed, successfully or not: on the thread that
        completes it, or here at once when it already has. Unlike
        :meth:`add_done_callback` it needs no running loop, so it suits releasing what a
        call holds; ``fn`` should be quick and must not raise."""
        self._add_callback(cast(Callable[[Waitable], None], fn))

    def remove_done_callback(self, fn: FutureCallback) -> int:
        """Nothing to remove once scheduled (a done asyncio.Future does the same): 0."""
        return 0

    def cancel(self, msg: object = None) -> bool:
        """Engine work is never cancelled from a wait: always False."""
        return False

    def cancelled(self) -> bool:
        """Always False (see :meth:`cancel`)."""
        return False

    def _add_callback(self, callback: Callable[[Waitable], None]) -> None:
        with self._lock:
            callbacks = self._callbacks
            if callbacks is not None:
                callbacks.append(callback)
                return
        callback(self)

    def _complete_locked(
        self, result: Any, failure: Failure | None
    ) -> tuple[threading.Lock | None, list[Callable[[Waitable], None]]]:
        """Record the outcome (caller holds the lock); return what to notify after unlocking."""
        self._result = result
        self._failure = failure
        self._state = FAILED if failure is not None else DONE
        callbacks = self._callbacks or []
        self._callbacks = None
        return self._event, callbacks

    @staticmethod
    def _notify(
        waitable: Waitable,
        event: threading.Lock | None,
        callbacks: list[Callable[[Waitable], None]],
    ) -> None:
        """Wake the waiting threads, then call every callback, even after one raised; then
        raise the first exception a callback raised (noting any others)."""
        if event is not None:
            event.release()  # wakes the threads waiting in result()
        error: BaseException | None = None
        for callback in callbacks:
            try:
                callback(waitable)
            except BaseException as exc:  # the other waiters are owed their wake-up
                if error is None:
                    error = exc
                else:
                    add_note(error, f"another done callback of {waitable.name!r} raised {exc!r}")
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.state}>"


class Completed(Waitable):
    """A waitable that is complete from the start, with ``result``.

    What :meth:`akv_engine.Engine.run_now` returns for work it ran at once: no lock, no
    callback list, no ``asyncio`` object. Callbacks added to it run at once.
    """

    __slots__ = ()

    def __init__(self, result: Any, name: str) -> None:
        self._name = name
        self._state = DONE
        self._result = result
        self._failure = None

    def _add_callback(self, callback: Callable[[Waitable], None]) -> None:
        callback(self)


#: The completed waitable whose result is None, shared by every call that has nothing else
#: to return (a push that ran at once).
ALREADY_DONE = Completed(None, "done")


class _Then(Waitable):
    """Completes with ``fn(result)`` when its source succeeds, else with its failure."""

    __slots__ = ("_fn",)

    def __init__(self, source: Waitable, fn: Callable[[Any], Any], name: str) -> None:
        super().__init__(threading.Lock(), name)
        self._fn = fn
        source._add_callback(self._source_done)

    def _source_done(self, source: Waitable) -> None:
        failure = source._failure
        result = None
        if failure is None:
            try:
                result = self._fn(source._result)
            except Exception as exc:
                failure = Failure(exc, self.name)
        with self._lock:
            event, callbacks = self._complete_locked(result, failure)
        self._notify(self, event, callbacks)


def then(source: Waitable, fn: Callable[[Any], Any]) -> Waitable:
    """A waitable that completes with ``fn(result)`` once ``source`` has completed.

    ``fn`` runs on the thread that completes ``source`` (or here, when it has already
    completed). When ``source`` fails, the result fails with the *same* failure, so raising
    it through either one delivers it; when ``fn`` raises, only the result fails.
    """
    return _Then(source, fn, f"then({source.name})")


class _Gather(Waitable):
    """Completes once all its sources have: with ``result``, or the first source's failure."""

    __slots__ = ("_left", "_result_value", "_sources")

    def __init__(self, sources: list[Waitable], result: Any, name: str) -> None:
        super().__init__(threading.Lock(), name)
        self._sources = sources
        self._result_value = result
        self._left = len(sources)
        for source in sources:
            source._add_callback(self._one_done)

    def _one_done(self, _: Waitable) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
            failure = next((s._failure for s in self._sources if s._failure is not None), None)
            event, callbacks = self._complete_locked(
                None if failure is not None else self._result_value, failure
            )
            self._sources = []
        self._notify(self, event, callbacks)


def gather(sources: list[Waitable], result: Any = None) -> Waitable:
    """A waitable that completes once every one of ``sources`` has completed.

    It completes with ``result``, or, when sources failed, with the failure of the first
    failed one in the list (the *same* failure: raising it delivers it).
    """
    if not sources:
        raise ValueError("gather() needs at least one waitable")
    return _Gather(list(sources), result, f"gather({', '.join(s.name for s in sources)})")


class Task(Waitable):
    """One function pushed to the engine, with the vars it reads and writes.

    Await it on any loop, or call :meth:`result` from any thread. ``id`` increases with
    push order; ``name`` is the one given to ``push`` (by default the function's name).
    """

    __slots__ = (
        "_deps",
        "_given_name",
        "args",
        "executor",
        "fn",
        "id",
        "is_wait",
        "no_skip",
        "priority",
        "reads",
        "skipped",
        "writes",
    )

    def __init__(
        self,
        lock: threading.Lock,
        task_id: int,
        name: str | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        reads: tuple[Var, ...],
        writes: tuple[Var, ...],
        priority: int,
        executor: str,
        no_skip: bool,
        is_wait: bool = False,
    ) -> None:
        self._lock = lock
        self._state = WAITING
        self._result: Any = None
        self._failure: Failure | None = None
        self._event: threading.Lock | None = None
        self._callbacks: list[Callable[[Waitable], None]] | None = []
        self._given_name = name
        self.id = task_id
        self.fn = fn
        self.args = args
        self.reads = reads
        self.writes = writes
        self.priority = priority
        self.executor = executor
        self.no_skip = no_skip
        self.is_wait = is_wait
        #: True once the engine skipped it: it failed with a failure one of its vars carried
        #: (not yet raised to a caller), and its function never ran.
        self.skipped = False
        self._deps = 0

    @property
    def name(self) -> str:
        """The name given to ``push``, else ``<function name>#<id>``."""
        if self._given_name is None:
            self._given_name = f"{getattr(self.fn, '__name__', 'task')}#{self.id}"
        return self._given_name

    def _inherited_failure(self) -> Failure | None:
        """The undelivered failure on one of its vars (reads first, as MXNet), if any."""
        for var in self.reads:
            failure = var._failure
            if failure is not None and not failure.delivered:
                return failure
        for var in self.writes:
            failure = var._failure
            if failure is not None and not failure.delivered:
                return failure
        return None

    def __repr__(self) -> str:
        return f"<Task #{self.id} {self.name!r} {self.state} priority={self.priority}>"


def note_task(exception: BaseException, task: Task) -> None:
    """Attach the failing task's name to its exception (shown under the traceback)."""
    add_note(exception, f"raised in engine task {task.name!r} (#{task.id})")
