"""The ``reaper`` fixture: no process a launcher test started may outlive it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.akv.launch.support import alive


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """PIDs a test saw; any still alive at the end are killed (by PID) and fail the test."""
    seen: list[int] = []
    yield seen
    survivors = [pid for pid in seen if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the test: {survivors}"
