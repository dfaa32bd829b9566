"""What the engine's tests share: the time bound of every wait, and a gate."""

from __future__ import annotations

import threading

#: The longest any test waits for anything.
WAIT_S = 5.0


class Gate:
    """A function that blocks until opened, recording when it started."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.opened.wait(WAIT_S), "gate never opened"
        return "gate"
