"""Fixtures of the distributed tests."""

from __future__ import annotations

import pytest

from akv import jit


@pytest.fixture(scope="session", autouse=True)
def row_kernels_made_before_any_job() -> None:
    """The row kernels made once per test process before any in-process job
    (tests/akv/cluster/cluster.py). A server makes them when its first row-sparse key is
    made, on its event loop, which then sends no heartbeat: with numba's cache still empty
    (a fresh checkout) and a loaded machine that took 3 s, the test cluster's heartbeat
    timeout, and the job failed ('server 0 sent no heartbeat for 3.0 s'). Production
    servers wait for them once, within the 10 s default timeout (see the issue note)."""
    jit.kernels()
