"""examples/torch_data_parallel.py runs as its docstring says: the loss falls, workers agree,
and shared memory on or off changes no value.

The job runs through akv-launch in a process group of its own; past its timeout the whole
group is killed by its id (``tests.akv.dist.cluster.launch``) and the test fails.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.akv.dist.cluster import launch_shm_on_and_off

pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("sklearn", reason="the example needs scikit-learn: pip install akv[examples]")
pytestmark = pytest.mark.timeout(180)

FINAL = re.compile(
    r"\[worker (\d)\] worker \d: loss ([0-9.]+) -> ([0-9.]+) in .* weights checksum (-?[0-9.]+)"
)


def test_the_torch_example_trains_two_workers_to_the_same_weights():
    runs = launch_shm_on_and_off(
        [
            "-n",
            "2",
            "-s",
            "1",
            "--",
            sys.executable,
            "examples/torch_data_parallel.py",
            "--epochs",
            "3",
        ],
        timeout=150,
    )
    done = runs["1"]
    finals = sorted(FINAL.findall(done.stdout))
    assert [rank for rank, *_ in finals] == ["0", "1"], done.stdout
    for _, first, last, _ in finals:
        assert float(last) < float(first)
    assert finals[0][3] == finals[1][3]  # the same weights on both workers
    assert "epoch  3/3 [########################]" in done.stdout
    # Exactly the same losses and weights with shared memory on and off.
    assert sorted(FINAL.findall(runs["0"].stdout)) == finals
