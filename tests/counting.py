"""Counting the asyncio Tasks and Futures a piece of code makes (for "no Task per call")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


class Counting:
    """Counts the Tasks made through the running loop's task factory and the Futures made
    with its ``create_future`` (what ``asyncio.gather`` wraps an awaitable in, and what a
    pending waitable's ``await`` waits on), from :func:`count_tasks_and_futures` on."""

    def __init__(self) -> None:
        self.tasks = 0
        self.futures = 0

    def made(self) -> tuple[int, int]:
        """(Tasks, Futures) made so far."""
        return self.tasks, self.futures


def count_tasks_and_futures(monkeypatch: pytest.MonkeyPatch) -> Counting:
    """Start counting on the running loop (a test's own: it is not restored afterwards)."""
    loop = asyncio.get_running_loop()
    counting = Counting()
    create_future = loop.create_future
    previous_factory = loop.get_task_factory()

    def counting_future() -> asyncio.Future[Any]:
        counting.futures += 1
        return create_future()

    def counting_task(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        counting.tasks += 1
        if previous_factory is not None:
            return previous_factory(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    monkeypatch.setattr(loop, "create_future", counting_future)
    loop.set_task_factory(counting_task)
    return counting
