"""How the benchmarks compute their times (akv.bench._report's compare and _plan,
akv.bench._raw's round_trip): each function's own median, in the order given. The clock
is faked where the numbers matter; the one test on the real clock asserts only an order."""

from __future__ import annotations

import itertools
import struct
import time
import types

import pytest

import akv.bench._raw as raw
import akv.bench._report as report
from akv.bench._raw import round_trip
from akv.bench._report import _plan, compare

MS = 1e-3


class _Clock:
    """A perf_counter that moves only when a timed function says it took some time."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def _costing(clock: _Clock, costs: list[float]):
    """A function whose n-th call takes ``costs[n]`` seconds on ``clock``."""
    left = iter(costs)

    def call() -> None:
        clock.spend(next(left))

    return call


def test_compare_reports_each_functions_median_in_the_order_given(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    # One call per round (any round is long enough), 3 rounds after one calibration round.
    monkeypatch.setitem(report._SETTINGS, "rounds", 3)
    monkeypatch.setitem(report._SETTINGS, "min_round_s", 0.0)
    # Calibration, then rounds of 3, 1 and 2 ms (median 2, max 3, min 1), and a tenth of it.
    slow = _costing(clock, [5 * MS, 3 * MS, 1 * MS, 2 * MS])
    fast = _costing(clock, [0.5 * MS, 0.3 * MS, 0.1 * MS, 0.2 * MS])
    assert compare(slow, fast, warmup=0) == pytest.approx([2 * MS, 0.2 * MS])


def test_plan_times_each_function_in_turn_and_returns_each_ones_median():
    plan = _plan(2, rounds=3, min_round_s=0.01)
    # Calibration: function 0 takes 1 ms for one call, so it asks for 10 calls (10 ms);
    # function 1's single call lasts the round already.
    assert next(plan) == (0, 1)
    assert plan.send(1 * MS) == (0, 10)
    assert plan.send(20 * MS) == (1, 1)
    assert plan.send(20 * MS) == (0, 10)
    # The rounds alternate; each sample is the round's time over its calls.
    seconds_of_rounds = [
        (0, 10, 30 * MS),  # 3 ms per call
        (1, 1, 0.3 * MS),
        (0, 10, 10 * MS),  # 1 ms
        (1, 1, 0.1 * MS),
        (0, 10, 20 * MS),  # 2 ms
        (1, 1, 0.2 * MS),
    ]
    for (index, calls, elapsed), following in itertools.pairwise(seconds_of_rounds):
        assert plan.send(elapsed) == following[:2], (index, calls)
    with pytest.raises(StopIteration) as done:
        plan.send(seconds_of_rounds[-1][2])
    assert done.value.value == pytest.approx([2 * MS, 0.2 * MS])


def test_compare_on_the_real_clock_reports_the_slower_function_slower(monkeypatch):
    monkeypatch.setitem(report._SETTINGS, "rounds", 3)
    monkeypatch.setitem(report._SETTINGS, "min_round_s", 0.005)

    def slow() -> None:
        time.sleep(2 * MS)

    def fast() -> None:
        time.sleep(0.2 * MS)

    slow_s, fast_s = compare(slow, fast, warmup=1)
    assert slow_s > fast_s
    fast_s, slow_s = compare(fast, slow, warmup=1)
    assert slow_s > fast_s


class _TimedEcho:
    """A raw peer whose exchanges take ``costs[r]`` seconds each in timed round ``r`` (on
    ``clock``; the untimed first exchange takes a long time, as a starting peer's)."""

    def __init__(self, clock: _Clock, costs: list[float]) -> None:
        self.clock = clock
        self.costs = iter([1.0, *costs])
        self.cost = 0.0

    def before(self, nbytes: int, iterations: int) -> None:
        self.cost = next(self.costs)

    def exchange(self, header: bytes, payload: memoryview, back: memoryview) -> None:
        assert struct.unpack("<Q", header)[0] == len(payload) == len(back)
        self.clock.spend(self.cost)


def test_round_trip_is_the_median_of_its_rounds_per_exchange(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(raw, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    # Rounds of 3, 1, 2 and 6 ms per exchange: median 2.5 ms (max 6, min 1, mean 3).
    echo = _TimedEcho(clock, [3 * MS, 1 * MS, 2 * MS, 6 * MS])
    assert round_trip(echo, 64, iterations=4, rounds=4) == pytest.approx(2.5 * MS)
