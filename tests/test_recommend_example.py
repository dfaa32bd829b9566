"""examples/recommend.py under akv-launch: a dist_sync store, its tables split by rows over
two servers, both workers training the same tables. (Run alone, it is tested in
tests/test_examples.py.)

The job runs through akv-launch in a process group of its own; past its timeout the whole
group is killed by its id (``tests.akv.cluster.cluster.launch``) and the test fails.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.akv.cluster.cluster import launch

pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytestmark = pytest.mark.timeout(180)

FINAL = re.compile(
    r"\[worker (\d)\] worker \d: loss ([0-9.]+) -> ([0-9.]+), held-out loss ([0-9.]+) -> ([0-9.]+)"
)
JOB = ["-n", "2", "-s", "2", "--", sys.executable, "examples/recommend.py"]


def test_two_workers_train_the_same_tables_and_the_loss_falls():
    done = launch([*JOB, "--steps", "60", "--every", "20"], timeout=150)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.count("store dist_sync") == 2, done.stdout
    finals = sorted(FINAL.findall(done.stdout))
    assert [rank for rank, *_ in finals] == ["0", "1"], done.stdout
    for _, first, last, before, after in finals:
        assert float(last) < float(first)
        assert float(after) < float(before)
    assert finals[0][3:] == finals[1][3:]  # the same tables on both workers
