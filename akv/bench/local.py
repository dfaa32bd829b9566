"""``akv bench local``: the local store against NumPy doing the same copies and adds.

Every row times akv and its floor in alternating rounds (see :func:`compare`), so the
ratio holds even when the machine's speed drifts during the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

import akv
from akv.args import Key
from akv.bench._report import Row, Table, compare, compare_async
from akv_engine import Waitable

__all__ = ["run"]

MIB = 1 << 20
#: MXNet 1.9.1 on this project's 2-core machine (float32, one key), see docs/benchmarks.md.
MXNET_S = {
    "push+pull 4 MiB": 0.45e-3,
    "push+pull 64 MiB": 14.6e-3,
    "push 4 x 4 MiB (summed) + pull": 6.1e-3,
    "push+pull 4 MiB with SGD": 6.6e-3,
    "1000 keys x 16 floats, one list call": 1000 / 93_000,
    "1000 keys x 16 floats, per-key loop": 1000 / 69_000,
    # MXNet's calls never block: its per-key loop is already "issued, then waited for".
    "1000 keys x 16 floats, issued+gathered": 1000 / 69_000,
    "1000 keys x 16 floats, issued+awaited": 1000 / 69_000,
    "1000 keys x 16 floats, issued+wait_all": 1000 / 69_000,
}
SMALL_KEYS = 1000
SMALL_SIZE = 16
SGD_LR = 0.01


def _floats(nbytes: int, value: float = 1.0) -> np.ndarray:
    return np.full(nbytes // 4, value, np.float32)


def _two_copies(nbytes: int) -> Callable[[], None]:
    """The floor of a push+pull: the bytes copied in, then out, by NumPy."""
    src, mid, dst = _floats(nbytes), _floats(nbytes, 0.0), _floats(nbytes, 0.0)

    def two_copies() -> None:
        np.copyto(mid, src)
        np.copyto(dst, mid)

    return two_copies


def _small_keys(
    kv: akv.KVStore | akv.AsyncKVStore,
) -> tuple[list[Key], list[np.ndarray], list[np.ndarray], Callable[[], None]]:
    """Initialize the small keys; return them, their values, outputs, and the NumPy floor."""
    keys: list[Key] = [f"small/{i}" for i in range(SMALL_KEYS)]
    values = [np.ones(SMALL_SIZE, np.float32) for _ in keys]
    outs = [np.zeros(SMALL_SIZE, np.float32) for _ in keys]
    kv.init(keys, values)
    mids = [np.zeros(SMALL_SIZE, np.float32) for _ in keys]

    def numpy_copies() -> None:
        for value, mid, out in zip(values, mids, outs, strict=True):
            np.copyto(mid, value)
            np.copyto(out, mid)

    return keys, values, outs, numpy_copies


def _row(
    table: Table, name: str, times: list[float], floor: str, unit_ops: int = 1, prefix: str = ""
) -> None:
    table.add(
        Row(prefix + name, times[0], times[1], floor, unit_ops=unit_ops, reference_s=MXNET_S[name])
    )


def _blocking_rows(table: Table, kv: akv.KVStore) -> None:
    for nbytes in (4 * MIB, 64 * MIB):
        name = f"push+pull {nbytes // MIB} MiB"
        value, out = _floats(nbytes), _floats(nbytes, 0.0)
        kv.init(name, value)

        def push_pull(name: str = name, value: np.ndarray = value, out: np.ndarray = out) -> None:
            kv.push(name, value)
            kv.pull(name, out=out)

        _row(table, name, compare(push_pull, _two_copies(nbytes)), "2 x np.copyto")

    name = "push 4 x 4 MiB (summed) + pull"
    parts = [_floats(4 * MIB) for _ in range(4)]
    out, merge = _floats(4 * MIB, 0.0), _floats(4 * MIB, 0.0)
    kv.init(name, parts[0])

    def push_list() -> None:
        kv.push(name, parts)
        kv.pull(name, out=out)

    def numpy_sum() -> None:
        np.add(parts[0], parts[1], out=merge)
        np.add(merge, parts[2], out=merge)
        np.add(merge, parts[3], out=merge)
        np.copyto(out, merge)

    _row(table, name, compare(push_list, numpy_sum), "3 x np.add + np.copyto")

    name = "push+pull 4 MiB with SGD"
    with akv.create("local") as sgd_store:
        weight, grad = _floats(4 * MIB), _floats(4 * MIB, 1e-3)
        out, scratch = _floats(4 * MIB, 0.0), _floats(4 * MIB, 0.0)
        sgd_store.init(0, weight)
        sgd_store.set_optimizer(akv.optimizer.SGD(learning_rate=SGD_LR))

        def push_sgd() -> None:
            sgd_store.push(0, grad)
            sgd_store.pull(0, out=out)

        def numpy_sgd() -> None:
            np.multiply(grad, SGD_LR, out=scratch)
            np.subtract(weight, scratch, out=weight)
            np.copyto(out, weight)

        _row(table, name, compare(push_sgd, numpy_sgd), "w -= lr*g in NumPy + np.copyto")


def _small_key_rows(table: Table, kv: akv.KVStore) -> None:
    keys, values, outs, numpy_copies = _small_keys(kv)

    def list_call() -> None:
        kv.push(keys, values)
        kv.pull(keys, out=outs)

    def per_key() -> None:
        for key, value, out in zip(keys, values, outs, strict=True):
            kv.push(key, value)
            kv.pull(key, out=out)

    for name, fn in (
        ("1000 keys x 16 floats, one list call", list_call),
        ("1000 keys x 16 floats, per-key loop", per_key),
    ):
        _row(table, name, compare(fn, numpy_copies), "2000 x np.copyto", unit_ops=SMALL_KEYS)


async def _async_rows(table: Table) -> None:
    async with await akv.create_async("local") as kv:
        nbytes = 4 * MIB
        value, out = _floats(nbytes), _floats(nbytes, 0.0)
        kv.init("big", value)

        async def push_pull() -> None:
            kv.push("big", value)
            await kv.pull("big", out=out)

        name = "push+pull 4 MiB"
        times = await compare_async(push_pull, _two_copies(nbytes))
        _row(table, name, times, "2 x np.copyto", prefix="async ")

        keys, values, outs, numpy_copies = _small_keys(kv)

        async def list_call() -> None:
            kv.push(keys, values)
            await kv.pull(keys, out=outs)

        async def per_key() -> None:
            for key, v, o in zip(keys, values, outs, strict=True):
                await kv.push(key, v)
                await kv.pull(key, out=o)

        def issued() -> list[Waitable]:
            """A push and a pull per key, none awaited."""
            waitables = []
            for key, v, o in zip(keys, values, outs, strict=True):
                waitables.append(kv.push(key, v))
                waitables.append(kv.pull(key, out=o))
            return waitables

        async def issued_then_gathered() -> None:
            await asyncio.gather(*issued())

        async def issued_then_awaited_each() -> None:
            for waitable in issued():
                await waitable

        async def issued_then_wait_all() -> None:  # as MXNet's loop ends with waitall()
            issued()
            await kv.wait_all()

        for name, fn in (
            ("1000 keys x 16 floats, one list call", list_call),
            ("1000 keys x 16 floats, per-key loop", per_key),
            ("1000 keys x 16 floats, issued+gathered", issued_then_gathered),
            ("1000 keys x 16 floats, issued+awaited", issued_then_awaited_each),
            ("1000 keys x 16 floats, issued+wait_all", issued_then_wait_all),
        ):
            times = await compare_async(fn, numpy_copies)
            _row(table, name, times, "2000 x np.copyto", unit_ops=SMALL_KEYS, prefix="async ")


def run() -> Table:
    """Measure the local store, blocking and async faces; return the table."""
    table = Table("akv bench local (float32, one key unless noted; times per call)")
    with akv.create("local") as kv:
        _blocking_rows(table, kv)
        _small_key_rows(table, kv)
    asyncio.run(_async_rows(table))
    table.notes.append(
        "Targets: push+pull within 1.3x of 2 x np.copyto; list-of-4 push 3x faster "
        "than MXNet; SGD push+pull 4x faster; small keys at or above MXNet in both call styles."
    )
    table.notes.append(
        "issued+gathered / issued+awaited / issued+wait_all: a push and a pull per key issued "
        "without awaiting, then `await asyncio.gather(*all)` / each awaited in turn / `await "
        "kv.wait_all()` (as MXNet's loop ends with `mx.nd.waitall()`). Target: at "
        "least 1.5x faster than MXNet's per-key loop (whose calls never block either)."
    )
    return table
