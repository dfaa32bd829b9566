"""``akv bench engine``: the cost of scheduling through the engine, against plain Python.

Floors: calling the function directly (inline tasks), ``ThreadPoolExecutor.submit().result()``
(worker-thread tasks), ``asyncio.create_task`` + await (coroutine tasks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from akv.bench._report import Row, Table, time_per_call, time_per_call_async
from engine import Engine

__all__ = ["run"]

CHAIN_LENGTH = 100
FAN_OUT = 100


def _nothing() -> None:
    return None


async def _anothing() -> None:
    return None


def _inline_rows(table: Table, eng: Engine) -> None:
    var = eng.new_var()
    table.add(
        Row(
            "inline task, free var (push)",
            time_per_call(lambda: eng.push(_nothing, writes=(var,), executor="inline")),
            time_per_call(_nothing),
            "direct call",
        )
    )

    vars_ = [eng.new_var() for _ in range(FAN_OUT)]

    def fan_out() -> None:
        for v in vars_:
            eng.push(_nothing, reads=(var,), writes=(v,), executor="inline")
        eng.push(_nothing, reads=vars_, writes=(var,), executor="inline")

    def direct_fan_out() -> None:
        for _ in range(FAN_OUT + 1):
            _nothing()

    table.add(
        Row(
            f"fan-out of {FAN_OUT} + join (inline)",
            time_per_call(fan_out),
            time_per_call(direct_fan_out),
            f"{FAN_OUT + 1} direct calls",
            unit_ops=FAN_OUT + 1,
        )
    )


def _thread_rows(table: Table, eng: Engine) -> None:
    var = eng.new_var()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=eng.slots)
    try:
        floor = time_per_call(lambda: pool.submit(_nothing).result())
    finally:
        pool.shutdown()
    table.add(
        Row(
            "worker-thread task, push + result()",
            time_per_call(lambda: eng.push(_nothing, writes=(var,)).result()),
            floor,
            "pool.submit().result()",
        )
    )

    def chain() -> None:
        task = None
        for _ in range(CHAIN_LENGTH):
            task = eng.push(_nothing, writes=(var,))
        task.result()  # type: ignore[union-attr]

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:

        def pool_chain() -> None:
            future = None
            for _ in range(CHAIN_LENGTH):
                future = pool.submit(_nothing)
            future.result()  # type: ignore[union-attr]

        floor = time_per_call(pool_chain)
    finally:
        pool.shutdown()
    table.add(
        Row(
            f"chain of {CHAIN_LENGTH} writes (worker threads)",
            time_per_call(chain),
            floor,
            f"{CHAIN_LENGTH} x pool.submit (1 thread)",
            unit_ops=CHAIN_LENGTH,
        )
    )


async def _loop_rows(table: Table) -> None:
    eng = Engine()
    var = eng.new_var()

    async def via_engine() -> None:
        await eng.push(_anothing, writes=(var,))

    async def via_asyncio() -> None:
        await asyncio.create_task(_anothing())

    table.add(
        Row(
            "coroutine task, push + await",
            await time_per_call_async(via_engine),
            await time_per_call_async(via_asyncio),
            "create_task + await",
        )
    )
    await eng.aclose()


def run() -> Table:
    """Measure the engine's per-task overhead; return the table."""
    table = Table("akv bench engine (time per task)")
    eng = Engine()
    try:
        _inline_rows(table, eng)
        _thread_rows(table, eng)
    finally:
        eng.close()
    asyncio.run(_loop_rows(table))
    return table
