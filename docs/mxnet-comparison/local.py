"""MXNet 1.9.1's local KVStore on the operations of ``akv bench local`` (for comparison only).

Run with MXNet's own interpreter: ``/path/to/mxnet-venv/bin/python local.py``. akv never
imports this file or MXNet.
"""

import statistics
import time

import mxnet as mx


def per_call(fn, calls, rounds=5):
    fn()
    mx.nd.waitall()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        mx.nd.waitall()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main():
    kv = mx.kv.create("local")
    for mib in (4, 64):
        value, out = mx.nd.ones((mib << 18,)), mx.nd.zeros((mib << 18,))
        kv.init(f"b{mib}", value)

        def push_pull(mib=mib, value=value, out=out):
            kv.push(f"b{mib}", value)
            kv.pull(f"b{mib}", out=out)
            out.wait_to_read()

        seconds = per_call(push_pull, 200 if mib == 4 else 20)
        print(f"MXNET push+pull {mib} MiB: {seconds * 1e3:.3f} ms")
    parts, out = [mx.nd.ones((1 << 20,)) for _ in range(4)], mx.nd.zeros((1 << 20,))
    kv.init("list", parts[0])

    def push_list():
        kv.push("list", parts)
        kv.pull("list", out=out)
        out.wait_to_read()

    print(f"MXNET push 4 x 4 MiB (summed) + pull: {per_call(push_list, 100) * 1e3:.3f} ms")
    sgd = mx.kv.create("local")
    grad, out = mx.nd.ones((1 << 20,)) * 1e-3, mx.nd.zeros((1 << 20,))
    sgd.init(0, mx.nd.ones((1 << 20,)))
    sgd.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))

    def push_sgd():
        sgd.push(0, grad)
        sgd.pull(0, out=out)
        out.wait_to_read()

    print(f"MXNET push+pull 4 MiB with SGD: {per_call(push_sgd, 100) * 1e3:.3f} ms")
    keys = [f"s{i}" for i in range(1000)]
    values = [mx.nd.ones((16,)) for _ in keys]
    outs = [mx.nd.zeros((16,)) for _ in keys]
    kv.init(keys, values)

    def list_call():
        kv.push(keys, values)
        kv.pull(keys, out=outs)

    def per_key():
        for key, value, out in zip(keys, values, outs, strict=True):
            kv.push(key, value)
            kv.pull(key, out=out)

    print(f"MXNET 1000 keys x 16 floats, one list call: {1000 / per_call(list_call, 20):,.0f}/s")
    # MXNet's push and pull never block: its per-key loop is issued, then waited for
    # (per_call ends with waitall), which akv's "issued+gathered" row matches.
    seconds = per_call(per_key, 10)
    print(f"MXNET 1000 keys x 16 floats, per-key loop: {1000 / seconds:,.0f}/s")
    print(f"MXNET 1000 keys x 16 floats, per-key loop, per 1000 keys: {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
