"""The per-variable queue: MXNet's versioned-var rules as a plain object.

A :class:`Var` knows nothing about threads, loops or executors. The engine calls
:meth:`Var._append` when a task that uses the var is pushed and :meth:`Var._release` when
it finishes; both return whether (or which) tasks were granted access. All calls happen
under the engine's lock.

Rules (the order in which tasks were pushed is kept per var):

* a read is granted at once when no write is running and none is queued; otherwise it
  queues behind the write (a queued write is never starved by later reads);
* a write is granted when nothing runs on the var and nothing is queued before it;
* when the last running read finishes, a queued write at the head is granted;
* when a write finishes, every consecutive queued read after it is granted together
  (they run concurrently), or, if a write is next, that write.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from akv_engine._task import Failure, Task

__all__ = ["Var"]


class Var:
    """A handle for one mutable thing (a stored value, a merge buffer, a user array).

    Create it with :meth:`akv_engine.Engine.new_var`. ``version`` counts the writes that
    finished on it. A var holds the failure of the last task that failed while writing it
    until that failure is delivered to the user (see :class:`akv_engine.Engine`).
    """

    __slots__ = ("_engine", "_failure", "_holders", "_queue", "_writer", "id", "name", "version")

    def __init__(self, engine: object, var_id: int, name: str) -> None:
        self._engine = engine
        self.id = var_id
        self.name = name
        self.version = 0
        self._queue: deque[tuple[Task, bool]] = deque()
        self._holders: list[Task] = []
        self._writer = False
        self._failure: Failure | None = None

    def __repr__(self) -> str:
        return f"<Var {self.name!r} version={self.version} pending={len(self._queue)}>"

    @property
    def idle(self) -> bool:
        """True when no task holds the var and none waits for it."""
        return not self._holders and not self._queue

    def _append(self, task: Task, is_write: bool) -> bool:
        """Queue ``task`` on this var; return True when it is granted at once."""
        if is_write:
            if not self._queue and not self._holders:
                self._holders.append(task)
                self._writer = True
                return True
        elif not self._queue and not self._writer:
            self._holders.append(task)
            return True
        self._queue.append((task, is_write))
        return False

    def _release(self, task: Task, is_write: bool) -> list[Task]:
        """Mark ``task`` finished on this var; return the tasks granted as a result."""
        holders = self._holders
        if len(holders) == 1:
            holders.clear()
        else:
            holders.remove(task)
        if is_write:
            self._writer = False
            self.version += 1
        if holders or not self._queue:
            return []
        queue = self._queue
        if queue[0][1]:
            granted_write = queue.popleft()[0]
            holders.append(granted_write)
            self._writer = True
            return [granted_write]
        granted: list[Task] = []
        while queue and not queue[0][1]:
            reader = queue.popleft()[0]
            holders.append(reader)
            granted.append(reader)
        return granted

    def _blockers(self, task: Task) -> list[Task]:
        """The tasks ``task`` waits for directly on this var (for the engine's graph)."""
        position = -1
        is_write = False
        for index, (queued, queued_write) in enumerate(self._queue):
            if queued is task:
                position, is_write = index, queued_write
                break
        if position < 0:
            return []
        ahead = [entry for entry in list(self._queue)[:position]]
        if is_write:
            # A write waits for everything back to (and including) the nearest earlier write.
            blockers: list[Task] = []
            for queued, queued_write in reversed(ahead):
                blockers.append(queued)
                if queued_write:
                    return blockers
            return blockers or list(self._holders)
        for queued, queued_write in reversed(ahead):
            if queued_write:
                return [queued]
        return list(self._holders) if self._writer else []
