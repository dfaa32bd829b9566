"""Alternate akv and MXNet 1.9.1 dist_sync jobs (2 workers) and print medians side by side.

Usage (from anywhere)::

    MXNET_PYTHON=/path/to/mxnet-venv/bin/python python side_by_side.py RUNS SERVERS

Each run starts an akv job (``akv-launch ... python -m akv.bench.dist``) and then an MXNet
job (``run_dist.sh``) with the same operations, so both see the same machine. Times are
medians per call (per step for the ResNet-18 steps) of worker 0, in microseconds.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB_TIMEOUT_S = 600
# akv bench dist's row names -> dist_worker.py's
NAMES = {
    "small key (16 floats) push+pull": "small push+pull",
    "small key (16 floats) pull": "small pull",
    "push+pull 4 MiB": "4MiB push+pull",
    "push+pull 64 MiB": "64MiB push+pull",
    "1000 keys x 16 floats, one list call": "1000 keys list push+pull (per call)",
    "ResNet-18 step, per-key calls": "ResNet-18 step, per-key calls",
    "ResNet-18 step, list calls": "ResNet-18 step, list calls",
}


def akv_run(servers: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        command = [
            sys.executable,
            "-m",
            "akv.launch",
            "-n",
            "2",
            "-s",
            servers,
            "--",
            sys.executable,
            "-m",
            "akv.bench.dist",
            "--out",
            out,
            "--rounds",
            "3",
        ]
        subprocess.run(command, capture_output=True, timeout=JOB_TIMEOUT_S, cwd=ROOT, check=True)
        with open(out) as handle:
            samples = json.load(handle)  # {row name: [seconds per call, one per round]}
        return {NAMES[name]: statistics.median(times) * 1e6 for name, times in samples.items()}


def mxnet_run(servers: str) -> dict[str, float]:
    done = subprocess.run(
        ["bash", os.path.join(HERE, "run_dist.sh"), servers],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    return {name: float(us) for name, us in re.findall(r"MXNET (.*): (\d+) us", done.stdout)}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    servers = sys.argv[2] if len(sys.argv) > 2 else "1"
    results: dict[str, dict[str, list[float]]] = {"akv": {}, "mxnet": {}}
    for _ in range(runs):
        for who, run in (("akv", akv_run), ("mxnet", mxnet_run)):
            for name, us in run(servers).items():
                results[who].setdefault(name, []).append(us)
    title = f"us per call, median of {runs} alternating runs, {servers} server(s)"
    print(f"{title:60} {'akv':>10} {'MXNet':>10} {'MXNet/akv':>9}")
    for name in NAMES.values():
        ours = statistics.median(results["akv"][name])
        theirs = statistics.median(results["mxnet"].get(name, [float("nan")]))
        print(f"{name:60} {ours:10.0f} {theirs:10.0f} {theirs / ours:9.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
