"""One MXNet 1.9.1 dist_sync worker timing the operations of ``akv bench dist``.

Started by ``run_dist.sh`` (comparison only; akv never imports this file or MXNet).
"""

import statistics
import time

import mxnet as mx

kv = mx.kv.create("dist_sync")


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


main()
