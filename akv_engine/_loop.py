"""Event loops: uvloop when it is installed, and a loop running on a thread of its own."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["UVLOOP_ENV", "LoopThread", "new_event_loop", "uvloop_available"]

T = TypeVar("T")

#: Set to ``0`` to use the standard asyncio loop even where uvloop is installed.
UVLOOP_ENV = "ENGINE_UVLOOP"
LOOP_THREAD_JOIN_TIMEOUT_S = 10.0


def uvloop_available() -> bool:
    """True when uvloop is importable and not disabled by ``ENGINE_UVLOOP=0``."""
    if os.environ.get(UVLOOP_ENV, "1") == "0":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when available (see :func:`uvloop_available`), else asyncio's."""
    if uvloop_available():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _schedule_batch() -> str:
    """Put the calling thread under ``SCHED_BATCH``; the policy it has afterwards."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return "normal (this system has no SCHED_BATCH)"
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: the calling thread
    except OSError as exc:
        return f"normal (SCHED_BATCH refused: {exc})"
    return "batch"


class LoopThread:
    """An event loop running forever on a daemon thread of its own.

    It serves blocking code that needs coroutines run somewhere (the blocking KVStore, an
    engine created outside any loop). :meth:`run` submits a coroutine and blocks until it
    finishes; :meth:`close` stops the loop and joins the thread.

    ``batch``: the thread runs under the batch scheduling policy where the system has one
    (Linux's ``SCHED_BATCH``): its fair share of the CPU is unchanged, but when an event
    wakes it, it does not preempt the thread running on that CPU (it runs once a CPU is
    free or at that thread's next tick). :attr:`scheduling` says what it got.
    """

    def __init__(self, name: str = "engine-loop", *, batch: bool = False) -> None:
        self.loop = new_event_loop()
        #: The thread's scheduling policy: ``"batch"``; ``"normal"``, the one it started
        #: with (its creator's); or ``"normal (...)"`` with why batch was not set (no such
        #: policy here, or the system refused it).
        self.scheduling = "normal"
        self._batch = batch
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self.thread_id = self._thread.ident
        self.native_id = self._thread.native_id

    def _main(self) -> None:
        if self._batch:
            self.scheduling = _schedule_batch()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    @property
    def running(self) -> bool:
        """True until :meth:`close` has stopped the loop."""
        return self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        """True when called from the loop's own thread."""
        return threading.get_ident() == self.thread_id

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it returns (or raise what it raised).

        Raises
        ------
        RuntimeError
            When called from the loop's own thread (it would wait for itself forever).
        TimeoutError
            When it has not finished within ``timeout`` seconds (it is then cancelled).
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop thread: await instead")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop (cancelling what still runs on it) and join its thread. Idempotent."""
        if not self._thread.is_alive():
            return
        if self.in_loop_thread():
            self.loop.stop()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(LOOP_THREAD_JOIN_TIMEOUT_S)
