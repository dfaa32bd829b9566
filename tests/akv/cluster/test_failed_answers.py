"""A server whose answer to a pull cannot be made (out of memory, a bug) answers that pull
with the error, at once, for dense and row-sparse keys over shared memory and TCP; the job
goes on. Without this the worker waited for its request's deadline (minutes) and then
blamed the server for not answering."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import akv
from akv.cluster.server import service
from akv.limits import SMALL_REPLY_BYTES, STAGED_REPLY_MIN_BYTES
from tests.akv.cluster.cluster import Cluster, on_every_worker, server_regions_in_use, wait_until

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0
WIDTH = 16
ROWS = 4096


class Failing:
    """Replaces a function of the server's: while ``on`` it raises MemoryError, for frames
    only those that carry arrays (answers, not acknowledgements or errors)."""

    def __init__(self, monkeypatch, name: str, frames: bool = True):
        self.real = getattr(service, name)
        self.frames = frames
        self.on = False
        self.raised = 0
        monkeypatch.setattr(service, name, self)

    def __call__(self, *args, **kwargs):
        carries_arrays = not self.frames or bool(args[2] if len(args) > 2 else ())
        if self.on and carries_arrays:
            self.raised += 1
            raise MemoryError("no room for the answer")
        return self.real(*args, **kwargs)


@pytest.fixture
def failing(monkeypatch) -> list[Failing]:
    return [Failing(monkeypatch, "encode_frame"), Failing(monkeypatch, "frame_bytes")]


@pytest.mark.parametrize(
    ("shm", "nbytes"),
    [("0", 64), ("0", SMALL_REPLY_BYTES + 4096), ("1", STAGED_REPLY_MIN_BYTES + 4096)],
    ids=["small copied", "sent from the value", "staged in shared memory"],
)
async def test_a_dense_answer_that_cannot_be_made_fails_its_pull(failing, shm, nbytes):
    value = np.arange(nbytes // 4, dtype=np.float32)
    with Cluster(2, 1, AKV_SHM=shm) as cluster:

        async def body(kv):
            await kv.init("w", value)
            await kv.barrier()
            for builder in failing:
                builder.on = True
            with pytest.raises(akv.ServerError, match="pull: MemoryError: no room"):
                await asyncio.wait_for(kv.pull("w"), WAIT_S)
            await kv.barrier()
            for builder in failing:
                builder.on = False
            await wait_until(lambda: server_regions_in_use(cluster) == 0, "regions given back")
            return await asyncio.wait_for(kv.pull("w"), WAIT_S)

        for pulled in await on_every_worker(cluster, "dist_sync", body):
            np.testing.assert_array_equal(pulled, value)  # nothing stored changed
    assert sum(builder.raised for builder in failing) == 2


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("failing_step", ["gather_rows", "encode_frame"])
async def test_a_row_answer_that_cannot_be_made_fails_its_row_sparse_pull(
    monkeypatch, shm, failing_step
):
    """Failing in the gather, or after it (the rows already gathered into regions of the
    shared memory: they are given back)."""
    failing = Failing(monkeypatch, failing_step, frames=failing_step == "encode_frame")
    ids = np.arange(0, 2 * ROWS, 2)  # an answer of 256 KiB: large enough for a region
    rows = akv.RowSparseArray(np.ones((ROWS, WIDTH), np.float32), ids, (2 * ROWS, WIDTH))
    with Cluster(2, 1, AKV_SHM=shm) as cluster:

        async def body(kv):
            await kv.init("emb", rows)
            await kv.barrier()
            failing.on = True
            with pytest.raises(akv.ServerError, match="row_sparse_pull: MemoryError"):
                await asyncio.wait_for(kv.row_sparse_pull("emb", row_ids=ids), WAIT_S)
            await kv.barrier()
            failing.on = False
            assert (cluster.servers[0]._local is not None) == (shm == "1")
            await wait_until(lambda: server_regions_in_use(cluster) == 0, "regions given back")
            return await asyncio.wait_for(kv.row_sparse_pull("emb", row_ids=ids[:3]), WAIT_S)

        for pulled in await on_every_worker(cluster, "dist_sync", body):
            assert pulled.indices.tolist() == [0, 2, 4]
            np.testing.assert_array_equal(pulled.data, rows.data[:3])
    assert failing.raised == 2
