"""Timing and tables shared by the ``akv bench`` commands.

Each row times one operation and a floor measured in the same run (NumPy's own copy or
add of the same bytes, a plain function call, raw sockets), and reports the ratio
akv / floor. Times are medians over several rounds so one slow round does not decide.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import TextIO, TypedDict

__all__ = ["Row", "Table", "compare", "compare_async", "configure", "time_per_call"]


class _Settings(TypedDict):
    rounds: int
    min_round_s: float


_SETTINGS: _Settings = {"rounds": 5, "min_round_s": 0.05}


def configure(quick: bool) -> None:
    """Quick mode (a smoke run: 2 short rounds per measurement) or full mode (5 rounds)."""
    if quick:
        _SETTINGS.update({"rounds": 2, "min_round_s": 0.005})
    else:
        _SETTINGS.update({"rounds": 5, "min_round_s": 0.05})


def _plan(
    count: int, rounds: int, min_round_s: float
) -> Generator[tuple[int, int], float, list[float]]:
    """Yield which of ``count`` functions to time next and how many calls; receive the
    seconds they took; return each function's median seconds per call.

    First each function's call count doubles until one round lasts ``min_round_s``; then
    the functions take turns, round after round, so that a machine that speeds up or slows
    down during the run affects them alike and their ratio stays fair.
    """
    counts = []
    for index in range(count):
        calls = 1
        while True:
            elapsed = yield index, calls
            if elapsed >= min_round_s or calls >= 1 << 20:
                break
            calls = max(calls * 2, int(calls * min_round_s / max(elapsed, 1e-9)))
        counts.append(calls)
    samples: list[list[float]] = [[] for _ in range(count)]
    for _ in range(rounds):
        for index in range(count):
            samples[index].append((yield index, counts[index]) / counts[index])
    return [statistics.median(s) for s in samples]


def compare(*fns: Callable[[], object], warmup: int = 2) -> list[float]:
    """Median seconds per call of each function, timed in alternating rounds."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    plan = _plan(len(fns), _SETTINGS["rounds"], _SETTINGS["min_round_s"])
    index, calls = next(plan)
    try:
        while True:
            fn = fns[index]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            index, calls = plan.send(time.perf_counter() - start)
    except StopIteration as done:
        medians: list[float] = done.value
        return medians


async def compare_async(*fns: Callable[[], object], warmup: int = 2) -> list[float]:
    """:func:`compare` where a function may be a coroutine function (awaited on the loop)."""
    calls_of = [_call_async(fn) if asyncio.iscoroutinefunction(fn) else None for fn in fns]
    for fn in fns:
        for _ in range(warmup):
            result = fn()
            if asyncio.iscoroutine(result):
                await result
    plan = _plan(len(fns), _SETTINGS["rounds"], _SETTINGS["min_round_s"])
    index, calls = next(plan)
    try:
        while True:
            timed = calls_of[index]
            if timed is not None:
                elapsed = await timed(calls)
            else:
                fn = fns[index]
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = time.perf_counter() - start
            index, calls = plan.send(elapsed)
    except StopIteration as done:
        medians: list[float] = done.value
        return medians


def _call_async(fn: Callable[[], Awaitable[object]]) -> Callable[[int], Awaitable[float]]:
    async def timed(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            await fn()
        return time.perf_counter() - start

    return timed


def time_per_call(fn: Callable[[], object], *, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` over several rounds (see :func:`configure`)."""
    return compare(fn, warmup=warmup)[0]


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
    #: akv's 90th percentile over the rounds, where the suite reports one.
    akv_p90_s: float | None = None
    #: A second floor for the same work (``akv bench dist``: memory copies beside raw TCP).
    second_floor_s: float | None = None
    second_floor: str = ""
    #: A third (``akv bench dist``: the raw shared-memory round beside the memory copies).
    third_floor_s: float | None = None
    third_floor: str = ""

    @property
    def ratio(self) -> float:
        """akv's time over the floor's (1.0 = as fast as the floor)."""
        return self.akv_s / self.floor_s if self.floor_s > 0 else float("inf")

    @property
    def second_ratio(self) -> float | None:
        """akv's time over the second floor's; None where the row has no second floor."""
        return self._ratio_to(self.second_floor_s)

    @property
    def third_ratio(self) -> float | None:
        """akv's time over the third floor's; None where the row has no third floor."""
        return self._ratio_to(self.third_floor_s)

    def _ratio_to(self, floor_s: float | None) -> float | None:
        if floor_s is None:
            return None
        return self.akv_s / floor_s if floor_s > 0 else float("inf")


@dataclass
class Table:
    """Rows printed as a fixed-width table, or written as JSON."""

    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: The heading of the second floor's column (shown when a row has a second floor).
    second_floor_heading: str = "floor 2"
    #: The heading of the third floor's column (shown when a row has a third floor).
    third_floor_heading: str = "floor 3"

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def render(self) -> str:
        with_p90 = any(row.akv_p90_s is not None for row in self.rows)
        # The extra floors' columns, shown when some row has that floor: (heading, the
        # row's attribute with the floor's seconds, the one with akv's ratio to it).
        extras = [
            (heading, seconds, ratio)
            for heading, seconds, ratio in (
                (self.second_floor_heading, "second_floor_s", "second_ratio"),
                (self.third_floor_heading, "third_floor_s", "third_ratio"),
            )
            if any(getattr(row, seconds) is not None for row in self.rows)
        ]
        # The text columns are as wide as their longest cell: every row's numbers line up.
        name_width = max([44, *(len(row.name) for row in self.rows)])
        floor_width = max([30, *(len(row.floor) for row in self.rows)])
        head = " ".join(
            [
                f"{'operation':{name_width}} {'akv':>12}",
                *([f"{'akv p90':>12}"] if with_p90 else []),
                f"{'floor':>12} {'ratio':>6}  {'floor is':{floor_width}}",
                *[f"{heading:>12} {'ratio':>6}" for heading, _, _ in extras],
                f"{'MXNet 1.9.1*':>12} {'speedup':>7}",
            ]
        )
        lines = [self.title, "=" * len(self.title), head, "-" * len(head)]
        for row in self.rows:
            ref, speedup = "-", "-"
            if row.reference_s is not None:
                ref = _fmt(row.reference_s, row.unit_ops)
                speedup = f"{row.reference_s / row.akv_s:.2f}x"
            p90 = "-" if row.akv_p90_s is None else _fmt(row.akv_p90_s, row.unit_ops)
            cells = [
                f"{'-':>12} {'-':>6}"
                if getattr(row, seconds) is None
                else f"{_fmt(getattr(row, seconds), row.unit_ops):>12} {getattr(row, ratio):6.2f}"
                for _, seconds, ratio in extras
            ]
            lines.append(
                " ".join(
                    [
                        f"{row.name:{name_width}} {_fmt(row.akv_s, row.unit_ops):>12}",
                        *([f"{p90:>12}"] if with_p90 else []),
                        f"{_fmt(row.floor_s, row.unit_ops):>12} {row.ratio:6.2f}  "
                        f"{row.floor:{floor_width}}",
                        *cells,
                        f"{ref:>12} {speedup:>7}",
                    ]
                )
            )
        lines.append("")
        lines.append(
            "ratio = akv / floor (1.00 = as fast as the floor). * MXNet 1.9.1 was measured on "
            "this project's 2-core machine (docs/benchmarks.md): a reference, not part of this "
            "run; speedup = MXNet / akv."
        )
        for heading, _, _ in extras:
            lines.append(f"The ratio after '{heading}' is akv / that floor.")
        lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def write(self, stream: TextIO = sys.stdout, json_path: str | None = None) -> None:
        stream.write(self.render())
        stream.flush()
        if json_path:
            rows = [
                {
                    **asdict(r),
                    "ratio": r.ratio,
                    "second_ratio": r.second_ratio,
                    "third_ratio": r.third_ratio,
                }
                for r in self.rows
            ]
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
