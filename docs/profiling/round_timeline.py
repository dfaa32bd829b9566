"""Where a dist_sync round's time goes: one job's rounds as a timeline across its processes.

Runs a job of 2 workers and 1 server (through ``akv.launch``; shared memory by default,
``AKV_SHM=0`` for TCP) in which the server and both workers note the time (the monotonic
clock, which every process on the host shares) whenever their streams receive bytes
(``recv<`` ... ``recv>``: the frames handled) and write them (``write``; ``flush``: small
frames written at the end of a loop turn), and each worker notes when its push and pull
calls begin and return. Every worker pushes a key of ``FLOATS`` float32 and pulls it,
``ROUNDS`` times::

    python docs/profiling/round_timeline.py [FLOATS] [ROUNDS]

It prints three rounds from the middle of the run as one merged timeline (time since the
round began, the step since the line before, the process and event), then the medians
over the middle half of the rounds of:

- ``round``: from one return of worker 0's pull to the next;
- ``push call``: worker 0's push, on the calling thread;
- ``push to wire``: from the push's return to worker 0's loop thread writing the request;
- ``server, last frame in to first answer out``: from the server starting to handle the
  frame that closes the round to the first answer written;
- ``answer in to pull return``: from worker 0's stream receiving the answer to its pull
  returning;
- ``server busy``: the server's time inside its stream callbacks and writes per round.

The stamps cost about a microsecond each, so the times come out a little longer than
those of ``small_round.py``. The events are the transport's (``StreamProtocol``), wrapped
in the job's processes only; nothing in akv is changed.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROUNDS_SHOWN = 3
ENV_DIR = "AKV_TIMELINE_DIR"
_events: list[tuple[int, str]] = []


def _stamp(tag: str, cls: type, name: str, label: str) -> None:
    """Wrap ``cls.name`` so that each call notes ``tag:label<`` and ``tag:label>``."""
    inner: Callable[..., Any] = getattr(cls, name)
    clock, note = time.perf_counter_ns, _events.append
    begin, end = f"{tag}:{label}<", f"{tag}:{label}>"

    def stamped(*args: Any) -> Any:
        note((clock(), begin))
        try:
            return inner(*args)
        finally:
            note((clock(), end))

    setattr(cls, name, stamped)


def _instrument(tag: str) -> None:
    """Stamp this process's stream events; write them to the job's directory at exit."""
    from akv_transport._stream import StreamProtocol

    _stamp(tag, StreamProtocol, "buffer_updated", "recv")
    _stamp(tag, StreamProtocol, "write", "write")
    _stamp(tag, StreamProtocol, "_flush_pending", "flush")
    path = Path(os.environ[ENV_DIR]) / f"{tag}.{os.getpid()}"

    def dump() -> None:
        path.write_text("".join(f"{t} {event}\n" for t, event in _events))

    atexit.register(dump)


def _server() -> int:
    _instrument("S")
    from akv.cluster.server import main

    return main([])


def _worker(floats: int, rounds: int) -> None:
    import numpy as np

    import akv

    rank = int(os.environ["AKV_RANK"])
    _instrument(f"W{rank}")
    clock, note = time.perf_counter_ns, _events.append
    push_begin, push_end, pull_end = f"W{rank}:push<", f"W{rank}:push>", f"W{rank}:pull>"
    with akv.create("dist_sync") as kv:
        value, out = np.ones(floats, np.float32), np.zeros(floats, np.float32)
        kv.init(1, value)
        kv.barrier()
        for _ in range(rounds):
            note((clock(), push_begin))
            kv.push(1, value)
            note((clock(), push_end))
            kv.pull(1, out=out)
            note((clock(), pull_end))
        assert out[0] == kv.num_workers, out  # every worker pushed ones


def _run_job(floats: int, rounds: int, directory: str) -> int:
    from akv.launch.args import parse_args
    from akv.launch.command import launch

    here = os.path.abspath(__file__)
    options = parse_args(
        ["-n", "2", "-s", "1", "--", sys.executable, here, "--worker", str(floats), str(rounds)]
    )
    options = dataclasses.replace(options, server_command=(sys.executable, here, "--server"))
    return launch(options, {**os.environ, ENV_DIR: directory})


def _load(directory: str) -> list[tuple[int, str]]:
    events = []
    for path in Path(directory).iterdir():
        for line in path.read_text().splitlines():
            stamp, event = line.split()
            events.append((int(stamp), event))
    events.sort()
    return events


def _intervals(events: list[tuple[int, str]]) -> dict[str, list[float]]:
    """Each round's spans (us), between consecutive returns of worker 0's pull."""
    marks = [i for i, (_, event) in enumerate(events) if event == "W0:pull>"]
    spans: dict[str, list[float]] = {}

    def add(name: str, start: int | None, end: int | None) -> None:
        if start is not None and end is not None and end >= start:
            spans.setdefault(name, []).append((end - start) / 1e3)

    for first, last in itertools.pairwise(marks):
        window = events[first + 1 : last + 1]
        times = {event: t for t, event in reversed(window)}  # each event's first time
        add("round", events[first][0], events[last][0])
        add("push call", times.get("W0:push<"), times.get("W0:push>"))
        pushed = times.get("W0:push>")
        written = next((t for t, e in window if e == "W0:write<" and t >= (pushed or 0)), None)
        add("push to wire", pushed, written)
        # The round's first answer is the server's first write after a frame came in (a
        # write before any is the previous round's answer to the other worker).
        closing = answer = None
        for t, event in window:
            if event == "S:recv<":
                closing = t
            elif event == "S:write<" and closing is not None:
                answer = t
                break
        add("server, last frame in to first answer out", closing, answer)
        received = [t for t, e in window if e == "W0:recv<"]
        add("answer in to pull return", received[-1] if received else None, events[last][0])
        add("server busy", 0, _busy(window, "S:"))
    return spans


def _busy(window: list[tuple[int, str]], prefix: str) -> int:
    """The time (ns) that the process of ``prefix`` spent inside its stamped calls: a
    write inside a receive counts once."""
    busy = depth = 0
    opened = 0
    for t, event in window:
        if not event.startswith(prefix):
            continue
        if event.endswith("<"):
            if not depth:
                opened = t
            depth += 1
        elif depth:  # a call that began before the window is not counted
            depth -= 1
            if not depth:
                busy += t - opened
    return busy


def _report(events: list[tuple[int, str]]) -> None:
    marks = [i for i, (_, event) in enumerate(events) if event == "W0:pull>"]
    middle = len(marks) // 2
    shown = marks[middle : middle + 1 + ROUNDS_SHOWN]
    for first, last in itertools.pairwise(shown):
        start = previous = events[first][0]
        print(f"round of {(events[last][0] - start) / 1e3:.1f} us")
        for t, event in events[first + 1 : last + 1]:
            print(f"  {(t - start) / 1e3:8.1f} +{(t - previous) / 1e3:7.1f}  {event}")
            previous = t
    spans = _intervals(events)
    rounds = len(spans.get("round", []))
    print(f"medians over the middle half of {rounds} rounds (us):")
    for name, values in spans.items():
        half = values[len(values) // 4 : len(values) - len(values) // 4] or values
        print(f"  {name}: {statistics.median(half):.1f}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--server"]:
        return _server()
    if argv[:1] == ["--worker"]:
        _worker(int(argv[1]), int(argv[2]))
        return 0
    floats = int(argv[0]) if argv else 16
    rounds = int(argv[1]) if len(argv) > 1 else 3000
    with tempfile.TemporaryDirectory(prefix="akv-timeline-") as directory:
        code = _run_job(floats, rounds, directory)
        if code:
            print(f"the job failed (exit code {code})", file=sys.stderr)
            return code
        _report(_load(directory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
