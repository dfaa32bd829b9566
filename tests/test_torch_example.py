"""examples/torch_data_parallel.py runs as its docstring says: the loss falls, workers agree,
and shared memory on or off changes no value.

The job runs through akv-launch in a process group of its own; past its timeout the whole
group is killed by its id (``tests.akv.cluster.cluster.launch``) and the test fails.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.akv.cluster.cluster import launch, launch_shm_on_and_off

pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip(
    "sklearn", reason="the example needs scikit-learn: pip install akvstore[examples]"
)
pytestmark = pytest.mark.timeout(180)

FINAL = re.compile(
    r"\[worker (\d)\] worker \d: loss ([0-9.]+) -> ([0-9.]+) in .* weights checksum (-?[0-9.]+)"
)


JOB = ["-n", "2", "-s", "1", "--", sys.executable, "examples/torch_data_parallel.py"]
JOB += ["--epochs", "3"]


def trained(stdout: str) -> list[tuple[str, ...]]:
    """Both workers' final lines, by rank; fail unless each loss fell and the weights agree."""
    finals = sorted(FINAL.findall(stdout))
    assert [rank for rank, *_ in finals] == ["0", "1"], stdout
    for _, first, last, _ in finals:
        assert float(last) < float(first)
    assert finals[0][3] == finals[1][3]  # the same weights on both workers
    return finals


def test_the_torch_example_trains_two_workers_to_the_same_weights():
    runs = launch_shm_on_and_off(JOB, timeout=150)
    done = runs["1"]
    finals = trained(done.stdout)
    assert "epoch  3/3 [########################]" in done.stdout
    # Exactly the same losses and weights with shared memory on and off.
    assert sorted(FINAL.findall(runs["0"].stdout)) == finals


@pytest.mark.gpu
def test_the_torch_example_trains_on_the_gpu():
    """On a GPU machine the example trains on CUDA through dist_sync_device (gradients summed
    and staged on the GPU): both workers say so, the loss falls, the weights agree."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    pytest.importorskip("cupy", reason="the example trains on the CPU without CuPy")
    done = launch(JOB, timeout=150)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    workers = sorted(re.findall(r"worker (\d)/2 on (\w+)", done.stdout))
    assert workers == [("0", "cuda"), ("1", "cuda")], done.stdout
    # akv-launch gave each worker its own share of this machine's GPUs.
    gpus = re.findall(r"worker \d/2 on (cuda:\d+ \(CUDA_VISIBLE_DEVICES=[^)]*\))", done.stdout)
    assert len(gpus) == 2, done.stdout
    if torch.cuda.device_count() >= 2:
        assert gpus[0] != gpus[1], done.stdout
    trained(done.stdout)
