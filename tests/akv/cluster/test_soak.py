"""A bounded soak: many dist_sync rounds with 4 workers and 2 servers (issue #9)."""

from __future__ import annotations

import sys

import pytest

from akv.bench.soak import SERVERS, percentile, run_job, sum_of_round

ROUNDS = 1500
#: Resident memory a server may still gain over the second half of the rounds (allocator
#: noise); a per-round leak of even 1 KiB would add about 0.7 MiB.
SECOND_HALF_GROWTH_BYTES = 2 << 20


def test_sum_of_round_is_what_the_workers_push():
    assert sum_of_round(0, 4) == 1 + 2 + 3 + 4
    assert sum_of_round(13, 2) == 7 * (1 + 2)


def test_percentile_is_nearest_rank():
    samples = [float(n) for n in range(1, 101)]
    assert percentile(samples, 0.5) == 50.0
    assert percentile(samples, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
@pytest.mark.timeout(300)
def test_many_rounds_give_exact_sums_and_server_memory_stops_growing():
    result = run_job(ROUNDS, timeout_s=240)
    assert result.rounds == ROUNDS and len(result.latencies) == ROUNDS
    assert result.wrong_sums == 0
    half = len(result.memory) // 2
    for rank in range(SERVERS):
        first, middle, last = (result.memory[i][1][rank] for i in (0, half, -1))
        assert first > 0
        assert last - middle < SECOND_HALF_GROWTH_BYTES, result.memory
