"""``akv bench fusion``: the ResNet-18 step through ``akv.torch.DistributedOptimizer``, with
one store key per parameter and with fused buckets (issue #26).

Jobs under akv-launch: 2 workers, 1 server, ``dist_sync``; a model of ResNet-18's 62
parameter arrays (:func:`akv.bench.steps.resnet18_shapes`, 44.6 MiB of float32), a step of
``zero_grad``, ``backward`` of the sum of the parameters (each gradient ones, ready as the
backward pass reaches it) and ``step``, with akv's SGD in the store. Each fused row against
the unfused one of the same run. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from akv.bench._report import _SETTINGS, Row, Table
from akv.bench.dist import MIB, launch_job
from akv.bench.soak import percentile
from akv.bench.steps import resnet18_shapes

__all__ = ["BUCKETS", "run", "worker_main"]

#: The bucket sizes measured (None: one key per parameter).
BUCKETS: tuple[int | None, ...] = (None, 1 * MIB, 4 * MIB, 16 * MIB)


def worker_main(argv: list[str] | None = None) -> int:
    """One worker; worker 0 writes ``{"steps": [seconds per step, ...]}`` to ``--out``."""
    import torch

    import akv.torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-bytes", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(shape)) for _, shape in resnet18_shapes()]
    )
    with akv.create("dist_sync") as kv:
        opt = akv.torch.DistributedOptimizer(
            params.named_parameters(),
            kv,
            akv.optimizer.SGD(learning_rate=0.001),
            bucket_bytes=args.bucket_bytes or None,
        )
        times = []
        for step in range(args.steps + 2):
            start = time.perf_counter()
            opt.zero_grad()
            sum(param.sum() for param in params).backward()
            opt.step()
            if step >= 2:
                times.append(time.perf_counter() - start)
        opt.close()
        if kv.rank == 0:
            Path(args.out).write_text(json.dumps({"steps": times, "keys": [len(opt.store_keys)]}))
    return 0


def run() -> Table:
    """The step with each bucket size, against the unfused step of the same run."""
    steps = 6 if _SETTINGS["rounds"] < 5 else 30
    table = Table("akv bench fusion (ResNet-18 through DistributedOptimizer, 2 workers, dist_sync)")
    samples = {}
    keys = {}
    for bucket in BUCKETS:
        arguments = ["--steps", str(steps), "--bucket-bytes", str(bucket or 0)]
        results = launch_job("akv.bench.fusion", arguments, 1, {})
        samples[bucket] = results["steps"]
        keys[bucket] = int(results["keys"][0])
    unfused = statistics.median(samples[None])
    for bucket in BUCKETS:
        label = "one key per parameter" if bucket is None else f"buckets of {bucket // MIB} MiB"
        table.add(
            Row(
                f"ResNet-18 step, {label} ({keys[bucket]} keys)",
                statistics.median(samples[bucket]),
                unfused,
                "the step with one key per parameter",
                akv_p90_s=percentile(samples[bucket], 0.9),
            )
        )
    table.notes.append(
        "A step: zero_grad, backward (each gradient pushed when ready: a bucket once all of "
        "its gradients are), step (the weights pulled); akv's SGD on the server, shared memory "
        "on (the default)."
    )
    return table


if __name__ == "__main__":
    sys.exit(worker_main())
