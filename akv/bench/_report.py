"""Timing and tables shared by the ``akv bench`` commands.

Each row times one operation and a floor measured in the same run (NumPy's own copy or
add of the same bytes, a plain function call, raw sockets), and reports the ratio
akv / floor. Times are medians over several rounds so one slow round does not decide.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import TextIO

__all__ = ["Row", "Table", "configure", "time_per_call", "time_per_call_async"]

_SETTINGS = {"rounds": 5, "min_round_s": 0.05}


def configure(quick: bool) -> None:
    """Quick mode (a smoke run: 2 short rounds per measurement) or full mode (5 rounds)."""
    if quick:
        _SETTINGS.update(rounds=2, min_round_s=0.005)
    else:
        _SETTINGS.update(rounds=5, min_round_s=0.05)


def _plan(rounds: int, min_round_s: float) -> Generator[int, float, float]:
    """Yield how many calls to time next; receive the seconds they took; return the median.

    The first rounds double the count until a round lasts ``min_round_s``; then
    ``rounds`` rounds of that count are timed.
    """
    calls = 1
    while True:
        elapsed = yield calls
        if elapsed >= min_round_s or calls >= 1 << 20:
            break
        calls = max(calls * 2, int(calls * min_round_s / max(elapsed, 1e-9)))
    samples = [elapsed / calls]
    for _ in range(rounds - 1):
        samples.append((yield calls) / calls)
    return statistics.median(samples)


def time_per_call(fn: Callable[[], object], *, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` over several rounds (see :func:`configure`)."""
    for _ in range(warmup):
        fn()
    plan = _plan(_SETTINGS["rounds"], _SETTINGS["min_round_s"])
    calls = next(plan)
    try:
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            calls = plan.send(time.perf_counter() - start)
    except StopIteration as done:
        return done.value


async def time_per_call_async(fn: Callable[[], Awaitable[object]], *, warmup: int = 2) -> float:
    """:func:`time_per_call` for a coroutine function, awaited on the running loop."""
    for _ in range(warmup):
        await fn()
    plan = _plan(_SETTINGS["rounds"], _SETTINGS["min_round_s"])
    calls = next(plan)
    try:
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                await fn()
            calls = plan.send(time.perf_counter() - start)
    except StopIteration as done:
        return done.value


@dataclass
class Row:
    """One measured operation: akv's time against the floor's, per call."""

    name: str
    akv_s: float
    floor_s: float
    floor: str
    unit_ops: int = 1
    reference_s: float | None = None
    reference: str = ""

    @property
    def ratio(self) -> float:
        """akv's time over the floor's (1.0 = as fast as the floor)."""
        return self.akv_s / self.floor_s if self.floor_s > 0 else float("inf")


@dataclass
class Table:
    """Rows printed as a fixed-width table, or written as JSON."""

    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def render(self) -> str:
        head = (
            f"{'operation':44} {'akv':>12} {'floor':>12} {'ratio':>6}  {'floor is':30} "
            f"{'MXNet 1.9.1*':>12} {'speedup':>7}"
        )
        lines = [self.title, "=" * len(self.title), head, "-" * len(head)]
        for row in self.rows:
            ref, speedup = "-", "-"
            if row.reference_s is not None:
                ref = _fmt(row.reference_s, row.unit_ops)
                speedup = f"{row.reference_s / row.akv_s:.2f}x"
            lines.append(
                f"{row.name:44} {_fmt(row.akv_s, row.unit_ops):>12} "
                f"{_fmt(row.floor_s, row.unit_ops):>12} {row.ratio:6.2f}  {row.floor:30} "
                f"{ref:>12} {speedup:>7}"
            )
        lines.append("")
        lines.append(
            "ratio = akv / floor (1.00 = as fast as the floor). * MXNet 1.9.1 was measured on "
            "this project's 2-core machine (docs/benchmarks.md): a reference, not part of this "
            "run; speedup = MXNet / akv."
        )
        lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def write(self, stream: TextIO = sys.stdout, json_path: str | None = None) -> None:
        stream.write(self.render())
        stream.flush()
        if json_path:
            rows = [{**asdict(r), "ratio": r.ratio} for r in self.rows]
            with open(json_path, "w") as handle:
                json.dump(
                    {"title": self.title, "rows": rows, "notes": self.notes}, handle, indent=2
                )


def _fmt(seconds: float, unit_ops: int) -> str:
    """Times as ms/us per call, or ops/s when a call does ``unit_ops`` > 1 operations."""
    if unit_ops > 1:
        return f"{unit_ops / seconds:,.0f}/s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
