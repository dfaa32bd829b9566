"""One MXNet 1.9.1 dist_sync worker timing the operations of ``akv bench dist``.

Started by ``run_dist.sh`` (comparison only; akv never imports this file or MXNet). The
ResNet-18 steps make the very calls akv's make: this script loads ``akv/bench/steps.py``
(which imports only the standard library) by its path, since akv is not installed in
MXNet's environment.
"""

import importlib.util
import os
import statistics
import time

import mxnet as mx

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS_PATH = os.path.join(HERE, os.pardir, os.pardir, "akv", "bench", "steps.py")
#: Rounds of one step each, as ``akv bench dist`` times steps with ``--rounds 3`` (3 x 4).
STEP_ROUNDS = 12

kv = mx.kv.create("dist_sync")


def load_steps():
    spec = importlib.util.spec_from_file_location("akv_bench_steps", STEPS_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(name, fn, calls, rounds=5):
    fn()
    fn()
    mx.nd.waitall()
    samples = []
    for _ in range(rounds):
        kv._barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        mx.nd.waitall()
        samples.append((time.perf_counter() - start) / calls)
    if kv.rank == 0:
        print(f"MXNET {name}: {statistics.median(samples) * 1e6:.0f} us", flush=True)


def main():
    small, small_out = mx.nd.ones((16,)), mx.nd.zeros((16,))
    kv.init(1, small)

    def push_pull():
        kv.push(1, small)
        kv.pull(1, out=small_out)
        small_out.wait_to_read()

    def pull():
        kv.pull(1, out=small_out)
        small_out.wait_to_read()

    bench("small push+pull", push_pull, 300)
    bench("small pull", pull, 300)
    keys = list(range(100, 1100))
    values = [mx.nd.ones((16,)) for _ in keys]
    outs = [mx.nd.zeros((16,)) for _ in keys]
    kv.init(keys, values)

    def list_call():
        kv.push(keys, values)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    bench("1000 keys list push+pull (per call)", list_call, 10)
    for key, (name, elements, calls, rounds) in enumerate(
        [("4MiB push+pull", 1 << 20, 20, 5), ("64MiB push+pull", 16 << 20, 3, 3)], start=2
    ):
        value, out = mx.nd.ones((elements,)), mx.nd.zeros((elements,))
        kv.init(key, value)

        def big(key=key, value=value, out=out):
            kv.push(key, value)
            kv.pull(key, out=out)
            out.wait_to_read()

        bench(name, big, calls, rounds)
    step_rows(load_steps())


def step_rows(steps):
    """ResNet-18's 62 arrays: per-key calls (each gradient pushed last layer first with
    ``priority=-i``, then each weight pulled), then one list push and one list pull."""
    shapes = [shape for _, shape in steps.resnet18_shapes()]
    for base, name, step in (
        (2000, "ResNet-18 step, per-key calls", steps.per_key_step),
        (3000, "ResNet-18 step, list calls", steps.list_step),
    ):
        keys = [base + i for i in range(len(shapes))]
        grads = [mx.nd.ones(shape) for shape in shapes]
        weights = [mx.nd.zeros(shape) for shape in shapes]
        kv.init(keys, weights)

        def one_step(step=step, keys=keys, grads=grads, weights=weights):
            step(kv, keys, grads, weights)
            mx.nd.waitall()

        bench(name, one_step, 1, STEP_ROUNDS)


main()
