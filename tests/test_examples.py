"""The examples run as their docstrings say, and they learn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart_fits_the_weights():
    out = run("quickstart.py")
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0] / 100
    assert float(out.rsplit(":", 1)[1]) < 0.5  # distance to the true weights


def test_async_pipeline_learns_the_classifier():
    out = run("async_pipeline.py")
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0]
    assert float(re.search(r"held-out accuracy ([0-9.]+)", out).group(1)) > 0.8


def test_recommend_trains_its_tables_in_a_local_store():
    """Run alone, the example makes a local store; a short run's loss falls."""
    pytest.importorskip("torch", reason="the example needs torch")
    out = run("recommend.py", "--steps", "60", "--every", "20")
    assert "store local, keys ['users', 'items', 'head.weight', 'head.bias']" in out
    losses = [float(x) for x in re.findall(r"step +\d+/60 loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    before, after = re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+) .* steps/s", out).groups()
    assert float(after) < float(before)


def test_recommend_judges_a_run_shorter_than_its_print_interval_by_the_held_out_loss():
    """One loss window printed (steps <= every) is no reason to fail: the exit status says
    whether the held-out loss fell."""
    pytest.importorskip("torch", reason="the example needs torch")
    out = run("recommend.py", "--steps", "30", "--every", "50")
    assert len(re.findall(r"step +\d+/30 loss", out)) == 1
    before, after = re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+)", out).groups()
    assert float(after) < float(before)
    done = subprocess.run(
        [sys.executable, "examples/recommend.py", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "--steps must be at least 1, got 0" in done.stderr
