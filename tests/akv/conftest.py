"""Fixtures shared by akv's tests."""

from __future__ import annotations

from typing import Any

import pytest

from akv_engine import gpu_available


@pytest.fixture
def cupy() -> Any:
    """The real CuPy on a machine with a CUDA GPU; the test is skipped elsewhere.
    (``tests/akv/test_gpu_paths.py`` overrides it with the fake CuPy.)"""
    if not gpu_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    import cupy

    return cupy
