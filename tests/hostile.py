"""What the hostile-peer tests share (``tests/transport/test_http_hostile.py`` and
``tests/akv/cluster/test_hostile_http.py``).

The limiter that logs a peer's mistake at most once a minute is process-wide, so a test that
counts such lines starts with :func:`forget_logged_mistakes`; this is the one place the tests
outside ``transport``'s own reach into its private modules for it.
"""

from __future__ import annotations

import asyncio
import time

from transport._http_log import MISTAKES


def forget_logged_mistakes() -> None:
    """Every peer's next mistake is logged again, as in a fresh process."""
    MISTAKES.clear()


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closed the connection (it sends nothing first)."""
    started_at = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:
        data = b""
    assert data == b"", data[:200]
    return time.monotonic() - started_at
