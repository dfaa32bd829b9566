"""What akv-launch tells a person about the job, decided without I/O: who has joined while
the job assembles (from the scheduler's ``GET /v1/status``), and the summary of every
process at the end.

:class:`~akv.launch.watch.AssemblyWatch` polls the scheduler and prints
:func:`progress_line`; :func:`akv.launch.supervisor.supervise` prints
:func:`summary_lines`.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from akv.launch.limits import TRACEBACK_MAX_LINES
from akv.launch.rules import status_text
from akv.launch.spec import ProcessSpec

__all__ = [
    "Assembly",
    "Ledger",
    "ProcessRecord",
    "Tracebacks",
    "assembled_line",
    "assembly",
    "progress_line",
    "seconds_text",
    "summary_lines",
]

#: How many of the processes not yet joined a progress line names; the rest are counted.
MAX_NAMED = 8

#: How a Python traceback starts on a process's stderr.
_TRACEBACK_START = b"Traceback (most recent call last):"
#: An akv process's error log line (``2026-12-07 22:02:39,461 akv-server ERROR what``).
_ERROR_LINE = re.compile(rb"^\S+ \S+ akv[\w.-]* (?:ERROR|CRITICAL) (.+?)\s*$")
#: The most of an error line a failure report carries.
_ERROR_MAX_CHARS = 2000


@dataclass(frozen=True)
class Assembly:
    """Which ranks of each role have joined the job, and how many there are to join."""

    expected: Mapping[str, int]
    joined: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def missing(self, role: str) -> list[int]:
        """The ranks of ``role`` that have not joined, in order."""
        return [r for r in range(self.expected[role]) if r not in self.joined.get(role, ())]

    @property
    def complete(self) -> bool:
        return not any(self.missing(role) for role in self.expected)


def assembly(status: Any, num_workers: int, num_servers: int) -> Assembly:
    """The :class:`Assembly` that the scheduler's ``/v1/status`` answer ``status`` shows:
    each node of its ``nodes`` with a role, a rank in range and not ``dead`` has joined.
    Anything malformed counts as not joined (the answer is only shown, never trusted)."""
    expected = {"server": num_servers, "worker": num_workers}
    joined: dict[str, set[int]] = {role: set() for role in expected}
    nodes = status.get("nodes") if isinstance(status, dict) else None
    for node in nodes if isinstance(nodes, list) else []:
        if not isinstance(node, dict) or node.get("dead"):
            continue
        role, rank = node.get("role"), node.get("rank")
        if role in expected and type(rank) is int and 0 <= rank < expected[role]:
            joined[role].add(rank)
    return Assembly(expected, {role: frozenset(ranks) for role, ranks in joined.items()})


def progress_line(state: Assembly) -> str:
    """``2/3 workers joined; waiting for worker 2`` (servers first when some are missing:
    ``0/1 servers and 2/3 workers joined; waiting for server 0, worker 2``); at most
    :data:`MAX_NAMED` processes named, then ``and N more``."""
    counts, waiting = [], []
    for role in ("server", "worker"):
        missing = state.missing(role)
        if missing or role == "worker":
            total = state.expected[role]
            counts.append(f"{total - len(missing)}/{total} {role}s")
            waiting += [f"{role} {rank}" for rank in missing]
    named = ", ".join(waiting[:MAX_NAMED])
    if len(waiting) > MAX_NAMED:
        named += f" and {len(waiting) - MAX_NAMED} more"
    line = f"{' and '.join(counts)} joined"
    return f"{line}; waiting for {named}" if waiting else line


def assembled_line(state: Assembly, elapsed_s: float) -> str:
    """``every process joined: 1 server and 3 workers, in 1.2 s``."""
    servers, workers = state.expected["server"], state.expected["worker"]
    return (
        f"every process joined: {_count(servers, 'server')} and {_count(workers, 'worker')}, "
        f"in {elapsed_s:.1f} s"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


@dataclass(frozen=True)
class ProcessRecord:
    """One line of the summary: a process (or an ``mpirun``/``srun`` group of ``count``)
    of ``role`` and ``rank``, its last exit status (``None``: never started), whether the
    launcher stopped it, how long it ran from its first start to its last exit, and how
    many times it was restarted."""

    role: str
    rank: int | None
    returncode: int | None
    run_s: float
    restarts: int = 0
    stopped: bool = False
    count: int = 1


@dataclass
class Ledger:
    """What the closing table shows of each process (by its spec's index): when it first
    started and last exited, its last exit status (absent or None: not started, or still
    running), and whether the launcher stopped it; kept by whoever runs the processes."""

    started_at: dict[int, float] = field(default_factory=dict)
    ended_at: dict[int, float] = field(default_factory=dict)
    returncodes: dict[int, int | None] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)

    def summary(
        self, specs: Sequence[ProcessSpec], restarts: Mapping[int, int], now: float
    ) -> list[str]:
        """:func:`summary_lines` of every spec (run times of processes still running count
        to ``now``); no line when no process was started."""
        if not self.started_at:
            return []
        records = [
            ProcessRecord(
                spec.role,
                spec.rank,
                self.returncodes.get(index),
                self.ended_at.get(index, now) - self.started_at.get(index, now),
                restarts.get(index, 0),
                index in self.stopped,
                spec.count,
            )
            for index, spec in enumerate(specs)
        ]
        return summary_lines(records)


class Tracebacks:
    """Each process's latest Python traceback on its stderr, from its first line on (at
    most :data:`~akv.launch.limits.TRACEBACK_MAX_LINES`, the last ones), for the job's
    summary: fed every stderr line, by process index."""

    def __init__(self) -> None:
        self._kept: dict[int, collections.deque[bytes]] = {}
        self._errors: dict[int, str] = {}

    def note(self, index: int, line: bytes) -> None:
        """Process ``index`` wrote ``line`` (ending in a newline) on its stderr."""
        error = _ERROR_LINE.match(line)
        if error is not None:
            self._errors[index] = error.group(1).decode(errors="replace")[:_ERROR_MAX_CHARS]
        if line.startswith(_TRACEBACK_START):
            self._kept[index] = collections.deque(maxlen=TRACEBACK_MAX_LINES)
        kept = self._kept.get(index)
        if kept is not None:
            kept.append(line)

    def started(self, index: int) -> None:
        """Process ``index`` (re)started: the errors its earlier run logged are not its."""
        self._errors.pop(index, None)

    def exited(self, index: int, status: str) -> str:
        """What a failure report says of process ``index``'s exit: ``exited with code 1``,
        and the last error it logged, if any (a server that could not start says why
        there, and the job's verdict then says it too)."""
        error = self._errors.get(index)
        return f"exited with {status}" + (f" after logging: {error}" if error else "")

    def message(self, index: int | None, label: str) -> str:
        """``worker 1's traceback:`` and its lines, indented; empty when process ``index``
        left none."""
        if index is None or not self._kept.get(index):
            return ""
        lines = b"".join(b"    " + line for line in self._kept[index])
        return f"{label}'s traceback:\n{lines.decode(errors='replace')}".rstrip()


def summary_lines(records: Sequence[ProcessRecord]) -> list[str]:
    """The summary as a table: a header line, then one line per process: role, rank
    (``-`` for the scheduler, ``0-3`` for a group of 4), exit (``0``, ``3``, ``SIGKILL``;
    ``SIGTERM (stopped)`` for one the launcher stopped; ``not started``), run time,
    restarts."""
    rows = [("role", "rank", "exit", "run time", "restarts")]
    for record in records:
        if record.role == "scheduler":
            rank = "-"
        elif record.rank is None:
            rank = f"0-{record.count - 1}" if record.count > 1 else "0"
        else:
            rank = str(record.rank)
        if record.returncode is None:
            exit_text = "not started"
        else:
            exit_text = status_text(record.returncode).removeprefix("code ").removeprefix("signal ")
            if record.stopped:
                exit_text += " (stopped)"
        run = seconds_text(record.run_s) if record.returncode is not None else "-"
        rows.append((record.role, rank, exit_text, run, str(record.restarts)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        cells[3] = row[3].rjust(widths[3])  # run times line up on the right
        lines.append("  ".join(cells).rstrip())
    return lines


def seconds_text(seconds: float) -> str:
    """``0.4 s``, ``12.3 s``, ``4 min 05 s``; ``forever`` for infinity."""
    if math.isinf(seconds):
        return "forever"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"
