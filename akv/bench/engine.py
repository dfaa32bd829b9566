"""``akv bench engine``: the cost of scheduling through the engine, against plain Python.

Floors: calling the function directly (inline tasks), ``ThreadPoolExecutor.submit().result()``
(worker-thread tasks), ``asyncio.create_task`` + await (coroutine tasks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from akv.bench._report import Row, Table, compare, compare_async
from akv_engine import Engine

__all__ = ["run"]

CHAIN_LENGTH = 100
FAN_OUT = 100


def _nothing() -> None:
    return None


async def _anothing() -> None:
    return None


def _add(table: Table, name: str, times: list[float], floor: str, unit_ops: int = 1) -> None:
    table.add(Row(name, times[0], times[1], floor, unit_ops=unit_ops))


def _inline_rows(table: Table, eng: Engine) -> None:
    var = eng.new_var()
    _add(
        table,
        "inline task, free var (push)",
        compare(lambda: eng.push(_nothing, writes=(var,), executor="inline"), _nothing),
        "direct call",
    )

    vars_ = [eng.new_var() for _ in range(FAN_OUT)]

    def fan_out() -> None:
        for v in vars_:
            eng.push(_nothing, reads=(var,), writes=(v,), executor="inline")
        eng.push(_nothing, reads=vars_, writes=(var,), executor="inline")

    def direct_fan_out() -> None:
        for _ in range(FAN_OUT + 1):
            _nothing()

    _add(
        table,
        f"fan-out of {FAN_OUT} + join (inline)",
        compare(fan_out, direct_fan_out),
        f"{FAN_OUT + 1} direct calls",
        unit_ops=FAN_OUT + 1,
    )


def _thread_rows(table: Table, eng: Engine) -> None:
    var = eng.new_var()

    def chain() -> None:
        for _ in range(CHAIN_LENGTH - 1):
            eng.push(_nothing, writes=(var,))
        eng.push(_nothing, writes=(var,)).result()

    with concurrent.futures.ThreadPoolExecutor(max_workers=eng.slots) as pool:
        _add(
            table,
            "worker-thread task, push + result()",
            compare(
                lambda: eng.push(_nothing, writes=(var,)).result(),
                lambda: pool.submit(_nothing).result(),
            ),
            "pool.submit().result()",
        )
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:

        def pool_chain() -> None:
            for _ in range(CHAIN_LENGTH - 1):
                pool.submit(_nothing)
            pool.submit(_nothing).result()

        _add(
            table,
            f"chain of {CHAIN_LENGTH} writes (worker threads)",
            compare(chain, pool_chain),
            f"{CHAIN_LENGTH} x pool.submit (1 thread)",
            unit_ops=CHAIN_LENGTH,
        )


async def _loop_rows(table: Table) -> None:
    eng = Engine()
    var = eng.new_var()

    async def via_engine() -> None:
        await eng.push(_anothing, writes=(var,))

    async def via_asyncio() -> None:
        await asyncio.create_task(_anothing())

    _add(
        table,
        "coroutine task, push + await",
        await compare_async(via_engine, via_asyncio),
        "create_task + await",
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
