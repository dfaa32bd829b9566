"""The errors the engine raises about its own use (one base class, a few reasons)."""

from __future__ import annotations

__all__ = ["EngineClosedError", "EngineError", "EngineLoopClosedError"]


class EngineError(Exception):
    """Base class of the errors the engine raises about its own use."""


class EngineClosedError(EngineError, RuntimeError):
    """A task was pushed after ``close()``."""


class EngineLoopClosedError(EngineError, RuntimeError):
    """A coroutine or callback task was ready to start, but the event loop it runs on
    has closed: typically an engine made inside one ``asyncio.run()`` and used from a
    later one. The task fails with it (its vars are released as for any failure)."""
