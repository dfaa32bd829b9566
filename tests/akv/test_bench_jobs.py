"""The benchmark jobs launched through akv-launch: a benchmark that is stopped (SIGTERM) or
whose job runs past its timeout leaves no process of the job behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import akv
import akv.bench.dist as dist
from akv.bench.soak import run_job

ROOT = Path(__file__).resolve().parents[2]
#: Bounds on the waits below (none is a timed assertion: each only stops a stuck test).
START_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 30.0
#: A soak job that runs far longer than the test: it is stopped, never finished.
ENDLESS = ["--rounds", str(10**9)]


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and parent of a live process; None once it is gone (or a zombie,
    which has exited and only waits to be reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return None if state in "ZX" else (state, int(ppid))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _descendants(root: int) -> dict[int, bytes]:
    """Every live process below ``root``, with its command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = stat[1]
    found: dict[int, bytes] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = _cmdline(pid)
                frontier.append(pid)
    return found


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_bench_stopped_with_sigterm_takes_its_launched_job_with_it():
    script = (
        f"from akv.bench.dist import launch_job; launch_job('akv.bench.soak', {ENDLESS!r}, 1, {{}})"
    )
    bench = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    job: dict[int, bytes] = {}
    try:
        # The launcher, then its processes (a server and 2 workers at least): all checked.
        _wait_for(
            lambda: bench.poll() is not None or len(_descendants(bench.pid)) >= 4,
            START_TIMEOUT_S,
            "the launcher and its job",
        )
        assert bench.poll() is None, "the bench ended before it was stopped"
        job = _descendants(bench.pid)
        launchers = [pid for pid, line in job.items() if b"akv.launch" in line]
        assert launchers and _stat(launchers[0]) is not None, job
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=GONE_TIMEOUT_S) == -signal.SIGTERM
        _wait_for(
            lambda: all(_stat(pid) is None for pid in job),
            GONE_TIMEOUT_S,
            f"the launcher {launchers[0]} and its job {sorted(job)} to end",
        )
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid, line in job.items():  # only the processes seen, if they are still they
            if _stat(pid) is not None and _cmdline(pid) == line:
                os.kill(pid, signal.SIGKILL)


def test_a_job_past_its_timeout_is_a_benchmark_error(monkeypatch):
    monkeypatch.setattr(dist, "JOB_TIMEOUT_S", 0.5)
    with pytest.raises(akv.BenchmarkError, match=r"akv\.bench\.soak.*ran past its timeout"):
        dist.launch_job("akv.bench.soak", ENDLESS, 1, {})
    with pytest.raises(akv.BenchmarkError, match="the soak job ran past its timeout"):
        run_job(10**9, timeout_s=0.5)
