"""Fixtures shared by akv's tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from akv import gpu_stream
from akv_engine import gpu_available
from tests import fakecupy

# The side streams akv caches per GPU belong to the fake's previous GPUs after a reset.
fakecupy.RESET_HOOKS.append(gpu_stream._side_streams.clear)


@pytest.fixture
def cupy() -> Any:
    """The real CuPy on a machine with a CUDA GPU; the test is skipped elsewhere.
    (``tests/akv/test_gpu_paths.py`` overrides it with the fake CuPy.)"""
    if not gpu_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    import cupy

    return cupy


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fake CuPy (``tests/fakecupy.py``) installed as ``cupy`` and ``cupyx``: two fake
    GPUs, lazy streams, counters reset; no rule of CUDA's broken by the end of the test."""
    fakecupy.reset(devices=2, schedule="lazy")
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    monkeypatch.setitem(sys.modules, "cupyx", fakecupy.cupyx)
    yield fakecupy
    assert fakecupy.violations == []
