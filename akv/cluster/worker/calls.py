"""What the worker's state names as calls, and how each ends on the I/O side.

The state (:class:`~akv.cluster.worker.state.WorkerState`) holds each store call's token
without looking inside it, and names it in the instructions that end it:
:class:`~akv.cluster.worker.instructions.CopyOut` (a pull's values into its other
outputs), :class:`~akv.cluster.worker.instructions.Unstage` (a push's staging buffers go
back) and :class:`~akv.cluster.worker.instructions.Finish`. Each token here does what those
mean for its kind of call: an engine task's ``done`` (a push, a pull), or a future that a
coroutine awaits (a control request, a wait for acknowledgements).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from akv.arrays import copy_into
from akv.errors import AKVError
from akv_engine import Task

__all__ = ["Answer", "Call", "Done", "PullCall", "PushCall", "give_back_if_skipped"]

#: What an engine task of the ``callback`` executor is given to report its end.
Done = Callable[[Any, BaseException | None], None]


class Call(Protocol):
    """What the instructions name as a call (a push's, a pull's, or an awaited request's)."""

    def finish(self, error: AKVError | None, reply: Any) -> None: ...

    def unstage(self) -> None: ...

    def copy_out(self, copies: list[tuple[Any, Any]]) -> None: ...


def give_back_if_skipped(give_back: Callable[[], None]) -> Callable[[Task], None]:
    """A task's ``on_done``: give back what its call staged (a region of a shared arena, a
    push buffer) if the engine skipped the task. A skipped task's function never runs, so
    nothing that would give its staging back ever sees it; a task that ran gives it back
    itself, once answered."""

    def done(task: Task) -> None:
        if task.skipped:
            give_back()

    return done


class PushCall:
    """A push's call: its engine task's ``done``, and how to give its staging back."""

    __slots__ = ("done", "give_back")

    def __init__(self, done: Done, give_back: Callable[[], None]) -> None:
        self.done = done
        self.give_back = give_back

    def finish(self, error: AKVError | None, reply: Any) -> None:
        self.done(None, error)

    def unstage(self) -> None:
        self.give_back()

    def copy_out(self, copies: list[tuple[Any, Any]]) -> None:
        """Nothing to copy (a push)."""


class PullCall:
    """A pull's (or a pushpull's) call: its engine task's ``done`` and ``result``, how to
    give a pushpull's staging back, and the GPU events that GPU outputs are written after."""

    __slots__ = ("after", "done", "error", "give_back", "result")

    def __init__(self, done: Done, result: Any, give_back: Callable[[], None], after: list[Any]):
        self.done = done
        self.result = result
        self.give_back = give_back
        self.after = after
        self.error: BaseException | None = None

    def copy_out(self, copies: list[tuple[Any, Any]]) -> None:
        after = self.after
        try:
            for out, source in copies:
                copy_into(out, source, after)
        except Exception as exc:  # reported by the call, never swallowed
            self.error = exc

    def unstage(self) -> None:
        self.give_back()

    def finish(self, error: AKVError | None, reply: Any) -> None:
        failed = error or self.error
        if failed is not None:
            self.done(None, failed)
        else:
            self.done(self.result, None)


class Answer:
    """The call of a request whose caller awaits ``future``: it gets the reply, or the
    error."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def finish(self, error: AKVError | None, reply: Any) -> None:
        future = self.future
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(reply)

    def unstage(self) -> None:
        """Nothing to give back (a control request sends arrays of its own)."""

    def copy_out(self, copies: list[tuple[Any, Any]]) -> None:
        """Nothing to copy (only pulls copy)."""
