"""An answer the worker cannot read cuts its stream every time it is resent: the worker
opens the stream again with growing waits, not in a tight loop, and the request fails
within its deadline with an error naming the server; the store goes on.

The job runs in this process (:class:`tests.akv.cluster.cluster.Cluster`, on 127.0.0.1).
The fault is injected on the workers' side only: every answer that carries key
:data:`POISON` is given read-only buffers to land in, which the stream's reader refuses
with a ``FrameError`` that cuts the stream, as it would refuse any answer it cannot land.
Before the fix the worker reconnected and resent about every 3 ms, each cut starting the
backoff from zero. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from akv.cluster.protocol import OK
from akv.cluster.worker.link import ServerLink
from akv.cluster.worker.requests import RequestTable
from akv.errors import ServerError
from akv.limits import RECONNECT_FIRST_S, RECONNECT_MAX_S
from akv_transport import Destination, FrameHeader
from tests.akv.cluster.cluster import Cluster

pytestmark = pytest.mark.timeout(90)

POISON = "poison"
REQUEST_S = 3.0
WAIT_S = 30.0


class Unreadable:
    """Answers (successes) that carry :data:`POISON` land, on the workers, in read-only
    buffers: the reader refuses them and cuts the stream. ``refused``: how many."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refused = 0
        real = RequestTable.destinations

        def destinations(table: RequestTable, header: FrameHeader) -> list[Destination]:
            chosen = list(real(table, header))
            if header.aux == OK and any(info.key == POISON for info in header.arrays):
                self.refused += 1
                return [memoryview(bytes(info.nbytes)) for info in header.arrays]
            return chosen

        monkeypatch.setattr(RequestTable, "destinations", destinations)


def reconnect_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The wait before each attempt to open a cut stream again, in order (every link)."""
    waits: list[float] = []
    real = ServerLink.reconnect

    def reconnect(link: ServerLink, delay_s: float) -> None:
        waits.append(delay_s)
        real(link, delay_s)

    monkeypatch.setattr(ServerLink, "reconnect", reconnect)
    return waits


async def test_an_answer_that_cuts_the_stream_each_time_is_resent_with_growing_waits(monkeypatch):
    unreadable = Unreadable(monkeypatch)
    waits = reconnect_waits(monkeypatch)
    with Cluster(1, 1, AKV_REQUEST_TIMEOUT_S=str(REQUEST_S)) as cluster:
        (kv,) = await cluster.workers("dist_async")
        try:
            await asyncio.wait_for(kv.init(POISON, np.zeros(4, np.float32)), WAIT_S)
            await asyncio.wait_for(kv.init("w", np.ones(4, np.float32)), WAIT_S)
            with pytest.raises(ServerError) as caught:
                await asyncio.wait_for(kv.pull(POISON), WAIT_S)
            tried = list(waits)
            # The store goes on: the request that failed is not resent, the stream is up.
            np.testing.assert_array_equal(await asyncio.wait_for(kv.pull("w"), WAIT_S), 1)
        finally:
            await asyncio.wait_for(kv.close(), WAIT_S)
    error = caught.value
    assert error.server.startswith("server 0 at 127.0.0.1:"), error
    assert "FrameError" in str(error) and "read-only" in str(error), error
    # Each cut came before the resent pull was answered: the waits doubled from the first
    # cut on, up to the longest, instead of every attempt going at once; the last one of the
    # series ends early, with the window. A cut that came after the pull's deadline, before
    # the clock's check of deadlines did, failed it and started a new series (at once).
    series = tried[:-1] if len(tried) > 1 and tried[-1] == 0.0 else tried
    assert unreadable.refused >= 3 and len(series) >= 3, (unreadable.refused, tried)
    doubling = [0.0] + [min(RECONNECT_FIRST_S * 2**i, RECONNECT_MAX_S) for i in range(20)]
    assert series[:-1] == doubling[: len(series) - 1], tried
    assert 0.0 < series[-1] <= doubling[len(series) - 1], tried
    # So their number is bounded: at once, then 20 ms doubling to 1 s, within REQUEST_S.
    assert len(series) <= 2 + int(np.log2(RECONNECT_MAX_S / RECONNECT_FIRST_S)) + REQUEST_S
