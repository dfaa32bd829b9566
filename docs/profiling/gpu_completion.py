"""The engine's two GPU completion strategies side by side, per task (docs/engine.md).

For each strategy (``host_func``, ``waiter``) it pushes a run of tiny GPU tasks (one
``+= 1`` on one element of a 64-float CuPy array) through an :class:`akv_engine.Engine` with a
:class:`akv_engine.GPUExecutor`, chained on one var (each task waits for the one before it: the
latency per task) and spread over 8 vars (independent: the throughput), and prints the
median over REPEATS runs of the wall time and the process's CPU time per task (CPU time
shows a thread that spins). It checks that every task ran::

    python docs/profiling/gpu_completion.py [TASKS] [REPEATS]

It needs CuPy and a CUDA GPU.
"""

from __future__ import annotations

import statistics
import sys
import time

import akv_engine as engine

WARMUP_TASKS = 200
COMPLETIONS = ("host_func", "waiter")
INDEPENDENT_VARS = 8


def per_task(completion: str, tasks: int, chained: bool) -> tuple[float, float]:
    """Wall and CPU seconds per task for ``tasks`` tasks (after a warm-up)."""
    import cupy

    eng = engine.Engine(slots=8)
    eng.register_executor("gpu", engine.GPUExecutor(completion=completion))
    x = cupy.zeros(64, cupy.float32)
    cupy.cuda.get_current_stream().synchronize()  # the executor's streams do not wait for it
    variables = [eng.new_var()] if chained else [eng.new_var() for _ in range(INDEPENDENT_VARS)]

    def bumper(j: int) -> object:
        def bump(ctx: object) -> None:
            view = x[j : j + 1]  # each var's tasks bump their own element: vars are unordered
            view += 1

        return bump

    bumps = [bumper(j) for j in range(len(variables))]

    def push(i: int) -> None:
        j = i % len(variables)
        eng.push(bumps[j], writes=[variables[j]], executor="gpu", name="bump")

    try:
        for i in range(WARMUP_TASKS):
            push(i)
        eng.wait_all().result(timeout=60)
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(tasks):
            push(i)
        eng.wait_all().result(timeout=60)
        result = ((time.perf_counter() - wall) / tasks, (time.process_time() - cpu) / tasks)
        # Tasks on different vars run on different streams: synchronize them all first.
        cupy.cuda.Device(0).synchronize()
        ran = int(x.sum().item())
        if ran != WARMUP_TASKS + tasks:
            raise SystemExit(f"{completion}: {ran} tasks ran, not {WARMUP_TASKS + tasks}")
        return result
    finally:
        eng.close()


def main(argv: list[str]) -> int:
    tasks = int(argv[0]) if argv else 5000
    repeats = int(argv[1]) if len(argv) > 1 else 5
    for completion in COMPLETIONS:
        for chained in (True, False):
            runs = [per_task(completion, tasks, chained) for _ in range(repeats)]
            print(
                f"{completion:9s} {'chained' if chained else 'independent':11s} "
                f"wall {1e6 * statistics.median(r[0] for r in runs):6.1f} us/task  "
                f"cpu {1e6 * statistics.median(r[1] for r in runs):6.1f} us/task",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
