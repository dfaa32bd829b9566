"""Waitables for GPU work that was never an engine task: done once a CUDA event has happened.

Work enqueued straight on a caller's stream (no task, no executor thread) still needs a
completion where a host caller waits for it. :class:`EventDone` is that completion, made
lazily: nothing watches its event until somebody asks.

* ``result()`` without a timeout synchronizes on the event on the calling thread (the one
  host wait, no thread hand-off);
* ``await``, ``result(timeout)``, ``then``/``gather`` and asyncio callbacks hand the event
  to the executor's watcher thread of the event's device, which synchronizes on it and
  completes the waitable (one hand-off);
* ``done()`` asks the event without blocking.

Events must be made with blocking sync (``cudaEventBlockingSync``), so that a wait sleeps.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from akv_engine._task import DONE, Failure, Waitable

if TYPE_CHECKING:
    from akv_engine._gpu import CudaDriver

__all__ = ["EventDone", "EventWatcher"]

_STOP = object()


class EventDone(Waitable):
    """Completes with ``result`` once ``event`` (recorded on a stream of ``device``) has
    happened, or fails with the CUDA error the wait raised. See the module docstring for
    who waits, and when."""

    __slots__ = ("_device", "_gpu_event", "_value", "_watcher", "_watching")

    def __init__(
        self, watcher: EventWatcher, device: int, event: Any, result: Any, name: str
    ) -> None:
        super().__init__(threading.Lock(), name)
        self._watcher = watcher
        self._device = device
        self._gpu_event = event
        self._value = result
        self._watching = False

    def done(self) -> bool:
        """True once the event has happened (asked without blocking) or the wait failed."""
        if self._state < DONE:
            try:
                happened = self._watcher.driver.query_event(self._gpu_event)
            except BaseException as exc:
                self._finish(exc)
            else:
                if happened:
                    self._finish(None)
        return self._state >= DONE

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the event: here (``timeout`` None), else through the watcher thread."""
        if self._state < DONE:
            if timeout is None and not self._watching:
                self._settle()
            else:
                self._watch()
        return super().result(timeout)

    def _add_callback(self, callback: Any) -> None:
        if self._state < DONE:
            self._watch()
        super()._add_callback(callback)

    def _watch(self) -> None:
        with self._lock:
            if self._watching or self._state >= DONE:
                return
            self._watching = True
        self._watcher.watch(self._device, self)

    def _settle(self) -> None:
        """Block until the event has happened, then complete (a no-op if done already)."""
        try:
            self._watcher.driver.synchronize_event(self._gpu_event)
        except BaseException as exc:
            self._finish(exc)
        else:
            self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        with self._lock:
            if self._state >= DONE:
                return
            failure = Failure(exc, self._name) if exc is not None else None
            event, callbacks = self._complete_locked(self._value if exc is None else None, failure)
            self._gpu_event = self._value = None
        self._notify(self, event, callbacks)


class EventWatcher:
    """A thread per device (started at its first :meth:`watch`) that waits for the events of
    :class:`EventDone` waitables in turn and completes them."""

    def __init__(self, driver: CudaDriver, name: str) -> None:
        self.driver = driver
        self._name = name
        self._lock = threading.Lock()
        self._queues: dict[int, queue.SimpleQueue[Any]] = {}
        self._threads: list[threading.Thread] = []
        self._watched = 0
        self._closed = False

    @property
    def watched(self) -> int:
        """How many waitables were handed to a watcher thread so far."""
        return self._watched

    def make(self, device: int, event: Any, result: Any, name: str) -> EventDone:
        """A waitable done once ``event`` (of ``device``) has happened."""
        return EventDone(self, device, event, result, name)

    def watch(self, device: int, waitable: EventDone) -> None:
        """Have ``waitable`` completed by ``device``'s watcher thread (once the watcher
        closed, here: the calling thread waits for its event)."""
        with self._lock:
            self._watched += 1
            queue_ = None if self._closed else self._queues.get(device)
            if queue_ is None and not self._closed:
                queue_ = self._queues[device] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_serve,
                    args=(queue_,),
                    name=f"{self._name}-dev{device}-events",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        if queue_ is None:  # closed: no thread serves a queue any more
            waitable._settle()
            return
        queue_.put(waitable)

    def close(self, deadline: float | None) -> None:
        """Stop the threads once they have completed what they hold (up to ``deadline``, a
        ``time.monotonic()`` value; past it, a thread waiting for an event stays, a daemon,
        until the event happens). A waitable watched afterwards is settled by its caller."""
        with self._lock:
            queues, threads = list(self._queues.values()), list(self._threads)
            self._queues, self._threads, self._closed = {}, [], True
        for queue_ in queues:
            queue_.put(_STOP)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                thread.join(remaining)


def _serve(queue_: queue.SimpleQueue[Any]) -> None:
    while True:
        waitable = queue_.get()
        if waitable is _STOP:
            return
        waitable._settle()
