"""The engine fixture of the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from akv_engine import Engine
from tests.engine.common import WAIT_S


@pytest.fixture
def eng() -> Iterator[Engine]:
    e = Engine(slots=4)
    yield e
    e.close(timeout=WAIT_S)
