"""Where a ready task's function runs.

The engine knows three kinds out of the box:

* ``"inline"``: on the thread that made the task ready (the pushing thread when its vars
  are free, else the thread that finished the last task it waited for). Meant for short
  work, where a hop to another thread would cost more than the work.
* ``"thread"``: on the engine's pool of worker threads (NumPy releases the GIL there).
* ``"loop"``: a coroutine function, run as an asyncio task on the engine's event loop.
* ``"callback"``: a plain function that starts work on the loop and reports its end
  through a callback (cheaper than a coroutine for short network round trips).

Other kinds plug in through the :class:`Executor` protocol (the GPU kind runs functions on
CuPy streams and reports completion when the stream's event fires): an executor receives
the function and its arguments and must call ``done(result, exception)`` exactly once,
from any thread, when the work is finished.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from akv_engine._errors import EngineLoopClosedError
from akv_engine._loop import LoopThread

__all__ = ["CallbackExecutor", "DoneCallback", "Executor", "LoopExecutor", "ThreadExecutor"]

DoneCallback = Callable[[Any, "BaseException | None"], None]

log = logging.getLogger("akv_engine.executors")


class Executor(Protocol):
    """The seam for a new kind of work (registered with ``Engine.register_executor``)."""

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        """Start ``fn(*args)``; call ``done(result, None)`` or ``done(None, exc)`` once.

        Raising instead means nothing was started and ``done`` will not be called: the
        engine then fails the task with that exception.
        """
        ...

    def close(self) -> None:
        """Release threads, streams or other resources; no submit follows."""
        ...


_STOP = object()


class ThreadExecutor(Executor):
    """A fixed pool of daemon worker threads fed from one queue, started on first use.

    The engine never hands it more tasks than it has slots, so with ``num_threads`` equal
    to the engine's slots a submitted task always finds a free thread at once and the
    engine's priority order is the order in which work starts.
    """

    def __init__(self, num_threads: int, name: str = "engine-worker") -> None:
        self._num_threads = num_threads
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        if len(self._threads) < self._num_threads:
            self._grow()
        self._queue.put((fn, args, done))

    def _grow(self) -> None:
        with self._start_lock:
            if len(self._threads) < self._num_threads:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _work(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            fn, args, done = item
            try:
                result = fn(*args)
            except BaseException as exc:
                _call_done(done, None, exc)
            else:
                _call_done(done, result, None)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(_STOP)
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()
        self._threads.clear()


class LoopExecutor(Executor):
    """Runs coroutine functions as asyncio tasks on one event loop.

    With no loop given it starts a private :class:`~akv_engine.LoopThread` on first use.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._loop_thread: LoopThread | None = None
        self._start_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the coroutines run on (starting the private loop thread if needed)."""
        if self._loop is None:
            with self._start_lock:
                if self._loop is None:
                    self._loop_thread = LoopThread()
                    self._loop = self._loop_thread.loop
        return self._loop

    def call(self, callback: Callable[..., Any], *args: Any) -> None:
        """``callback(*args)`` on the loop's thread: now if this is it, else soon.

        Raises
        ------
        EngineLoopClosedError
            When the loop has closed (nothing will ever run on it again).
        """
        loop = self._loop or self.loop
        # get_running_loop() without the RuntimeError it raises off the loop's thread.
        if asyncio._get_running_loop() is loop:
            callback(*args)
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError as exc:
            if not loop.is_closed():
                raise
            raise EngineLoopClosedError(
                f"the event loop {loop!r} that runs this engine's coroutine and callback "
                "tasks has closed (an engine made inside asyncio.run() serves that run "
                "only): make the engine in the loop that uses it, or outside any loop "
                "for a loop thread of its own"
            ) from exc

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        self.call(self._start, fn, args, done)

    def _start(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        task = self.loop.create_task(self._run(fn, args, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _run(fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        try:
            result = await fn(*args)
        except BaseException as exc:
            _call_done(done, None, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            _call_done(done, result, None)

    def close(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.close()
            self._loop_thread = None


class CallbackExecutor(Executor):
    """Runs functions that start work on the loop and report the end through a callback.

    ``fn(*args, done)`` is called on the loop's thread (at once when the task becomes ready
    there, else through ``call_soon_threadsafe``); it starts the work and returns, and the
    work calls ``done(result, None)`` or ``done(None, exc)`` exactly once, from the loop,
    when it ends. There is no ``asyncio.Task`` or ``Future`` per task and no extra turn of
    the loop: the form for short network round trips.
    """

    def __init__(self, loops: LoopExecutor) -> None:
        self._loops = loops

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        self._loops.call(self._start, fn, args, done)

    @staticmethod
    def _start(fn: Callable[..., Any], args: tuple[Any, ...], done: DoneCallback) -> None:
        try:
            fn(*args, done)
        except Exception as exc:
            # Also what ``done`` raised when ``fn`` called it at once (a waiter's callback):
            # the engine's done logs it then, the task being complete already.
            _call_done(done, None, exc)

    def close(self) -> None:
        """Nothing of its own to release (the loop belongs to the LoopExecutor)."""


def _call_done(done: DoneCallback, result: Any, exc: BaseException | None) -> None:
    try:
        done(result, exc)
    except Exception:
        # The engine's done completes the task and starts what it readied before it
        # raises what a waiter's done callback raised; there is nobody to hand that to
        # here, and raising would end this worker (the GPU executor does the same).
        log.exception("akv_engine: a task's completion callback raised")
