"""MXNet 1.9.1's row-sparse step of ``akv bench sparse`` (issue #25), run beside it in the same
window (by hand, never by the tests; akv never imports this file or MXNet)::

    /work/mxvenv/bin/python docs/mxnet-comparison/sparse.py [--servers 1 2] [--runs 1]
                                                            [--steps 100] [--rows 1000000]

The workload is akv's: a row-sparse table of ``rows`` x 64 float32 on the servers, 2 workers,
``dist_sync`` with MXNet's SGD (``lazy_update=True``, its default; learning rate 0.1) on the
servers; each step each worker draws 8192 Zipf-like row ids (a = 1.2, seeded by its rank,
every batch drawn before the timing), pushes the gradient of their unique rows (ones) and
``row_sparse_pull``-s them into a row-sparse ``out``, then waits for it. 5 untimed steps,
then ``steps`` steps timed one by one. MXNet's dist store refuses a row-sparse init that
does not list every row, so the init lists all ``rows`` rows (zeros).

For each server count the script starts MXNet's scheduler, the servers and two workers on
127.0.0.1 itself (the ``DMLC_*`` variables, a free port), and prints worker 0's median,
p10 and p90 step in ms and the mean count of unique ids a step. Every process it starts is
ended by its PID, each wait bounded by a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WIDTH, BATCH, ZIPF_A, WARMUP_STEPS, JOB_TIMEOUT_S = 64, 8192, 1.2, 5, 600


def worker(out: str, rows: int, steps: int) -> None:
    import mxnet as mx
    import numpy as np

    kv = mx.kv.create("dist_sync")
    shape = (rows, WIDTH)
    every = mx.nd.sparse.row_sparse_array(
        (np.zeros(shape, np.float32), np.arange(rows, dtype=np.int64)), shape=shape
    )
    kv.init(0, every)
    del every
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    rng = np.random.default_rng(kv.rank)
    batches = []
    for _ in range(steps + WARMUP_STEPS):
        ids = np.unique(np.minimum(rng.zipf(ZIPF_A, BATCH) - 1, rows - 1).astype(np.int64))
        grad = mx.nd.sparse.row_sparse_array(
            (np.ones((ids.size, WIDTH), np.float32), ids), shape=shape
        )
        batches.append((mx.nd.array(ids, dtype="int64"), grad, ids.size))
    result = mx.nd.sparse.zeros("row_sparse", shape)
    mx.nd.waitall()
    kv._barrier()
    samples = []
    for step, (ids, grad, _) in enumerate(batches):
        start = time.perf_counter()
        kv.push(0, grad)
        kv.row_sparse_pull(0, out=result, row_ids=ids)
        result.wait_to_read()
        if step >= WARMUP_STEPS:
            samples.append(time.perf_counter() - start)
    unique = statistics.mean(size for _, _, size in batches)
    kv._barrier()
    # The check: lazy SGD with learning rate 0.1 made each row -0.1 x the number of times
    # the two workers' batches listed it (both workers' batches redrawn from their seeds).
    counts = np.zeros(rows, np.int64)
    for rank in range(2):
        other = np.random.default_rng(rank)
        for _ in range(steps + WARMUP_STEPS):
            drawn = np.minimum(other.zipf(ZIPF_A, BATCH) - 1, rows - 1).astype(np.int64)
            counts[np.unique(drawn)] += 1
    probe = np.unique(np.concatenate([np.arange(min(rows, 1000)), batches[-1][0].asnumpy()]))
    kv.row_sparse_pull(0, out=result, row_ids=mx.nd.array(probe, dtype="int64"))
    got = result.asnumpy()[probe]
    expected = -0.1 * counts[probe].astype(np.float32)[:, None]
    if not np.allclose(got, np.broadcast_to(expected, got.shape), rtol=1e-4, atol=1e-4):
        raise SystemExit(f"worker {kv.rank}: the pulled rows differ from lazy SGD's")
    if kv.rank == 0:
        with open(out, "w") as handle:
            json.dump({"step": samples, "unique": unique, "checked": True}, handle)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job(servers: int, rows: int, steps: int) -> dict[str, float]:
    """One MXNet job; worker 0's median, p10 and p90 step (s) and mean unique ids."""
    base = {
        **os.environ,
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(_free_port()),
        "DMLC_NUM_SERVER": str(servers),
        "DMLC_NUM_WORKER": "2",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for role in ["scheduler"] + ["server"] * servers + ["worker"] * 2:
                command = [sys.executable, "-c", "import mxnet"]
                if role == "worker":
                    command = [sys.executable, __file__, "--worker", out, str(rows), str(steps)]
                processes.append(subprocess.Popen(command, env={**base, "DMLC_ROLE": role}))
            deadline = time.monotonic() + JOB_TIMEOUT_S
            for process in processes[1 + servers :]:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            for process in processes[: 1 + servers]:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if any(process.returncode for process in processes):
                codes = [process.returncode for process in processes]
                raise SystemExit(f"the MXNet job with {servers} server(s) failed: {codes}")
            with open(out) as handle:
                data = json.load(handle)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
    samples = sorted(data["step"])
    return {
        "median": statistics.median(samples),
        "p10": samples[len(samples) // 10],
        "p90": samples[min(len(samples) - 1, (len(samples) * 9) // 10)],
        "unique": data["unique"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=10**6)
    args = parser.parse_args()
    for run in range(args.runs):
        for servers in args.servers:
            result = job(servers, args.rows, args.steps)
            print(
                f"MXNet 1.9.1 sparse step, {servers} server(s), run {run + 1}: "
                f"median {result['median'] * 1e3:.2f} ms, p10 {result['p10'] * 1e3:.2f}, "
                f"p90 {result['p90'] * 1e3:.2f} ({result['unique']:.0f} unique ids a step)",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
