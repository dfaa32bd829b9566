"""Row-sparse keys in dist_sync and dist_async stores: split by row ranges over the servers,
pushes summed per round, the optimizer's lazy update on the servers, row_sparse_pull, and
the refusals. A whole job on 127.0.0.1 (tests/akv/cluster/cluster.py)."""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest

import akv
from akv import jit
from akv.cluster.placement import row_parts
from akv.cluster.protocol import Op
from akv.cluster.worker.push_buffers import MAX_SPARE_PUSH_BUFFERS
from akv.cluster.worker.rows import pull_requests, push_requests
from akv.errors import RowIdError, ShapeMismatchError, StorageTypeError
from akv.keys import Entry
from tests.akv.cluster.cluster import Cluster, each, on_every_worker, wait_until

WIDTH = 3
ROWS = 10  # over two servers: rows [0, 5) on server 0, [5, 10) on server 1


def rsp(ids, rows, num_rows=ROWS, dtype=np.float32):
    data = np.asarray(rows, dtype).reshape(len(ids), WIDTH)
    return akv.RowSparseArray(data, np.asarray(ids, np.int64), (num_rows, WIDTH))


def row(value):
    return [value] * WIDTH


@pytest.mark.parametrize("shm", ["1", "0"])
async def test_pushes_are_summed_per_round_and_replace_the_rows_at_the_range_ends(shm):
    """Rows at both ends of each server's range; without an optimizer the stored rows
    become the round's sum (rows it does not list read as zero again). Over shared memory
    and over TCP."""
    with Cluster(2, 2, AKV_SHM=shm) as cluster:

        async def body(kv):
            assert all(link.shares_memory == (shm == "1") for link in kv._backend.links)
            await kv.init("emb", rsp([0, 4, 5, 9], [row(1), row(2), row(3), row(4)]))
            first = await kv.row_sparse_pull("emb", row_ids=[9, 0, 4, 5, 7])
            mine = [4, 5] if kv.rank == 0 else [0, 4, 9]
            await kv.push("emb", rsp(mine, [row(10 * (kv.rank + 1))] * len(mine)))
            after = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
            return first, after

        for first, after in await on_every_worker(cluster, "dist_sync", body):
            assert first.indices.tolist() == [0, 4, 5, 7, 9]
            np.testing.assert_array_equal(first.data[:, 0], [1, 2, 3, 0, 4])
            expected = np.zeros(ROWS, np.float32)
            expected[[4, 5]] += 10
            expected[[0, 4, 9]] += 20
            np.testing.assert_array_equal(after.to_dense()[:, 0], expected)
        for server, (first, end) in zip(cluster.servers, [(0, 5), (5, 10)], strict=True):
            entry = server.state.rows.entries["emb"]
            assert (entry.first, entry.end) == (first, end)
            assert set(entry.rows.ids().tolist()) <= set(range(first, end))


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
async def test_sgd_updates_only_the_pushed_rows_on_the_servers(store_type):
    with Cluster(2, 2) as cluster:

        async def body(kv):
            await kv.init("emb", rsp([1, 6, 8], [row(1), row(1), row(1)]))
            await kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5, wd=0.1))
            await kv.push("emb", rsp([6, 7], [row(1), row(2)]))
            await kv.barrier()  # dist_async: both workers' pushes applied
            return await kv.row_sparse_pull("emb", row_ids=[1, 6, 7, 8])

        for pulled in await on_every_worker(cluster, store_type, body):
            got = pulled.data[:, 0]
            if store_type == "dist_sync":  # one round of the sum: g = 2 and 4
                w6 = (1 - 0.5 * 0.1) * 1 - 0.5 * 2
                w7 = -0.5 * 4
            else:  # two updates, one per worker's push
                w6 = (1 - 0.05) * ((1 - 0.05) * 1 - 0.5) - 0.5
                w7 = (1 - 0.05) * (-0.5 * 2) - 0.5 * 2
            np.testing.assert_allclose(got, [1.0, w6, w7, 1.0], rtol=1e-6)


async def test_a_table_of_one_row_and_a_declared_billion_rows():
    with Cluster(1, 2) as cluster:
        stores = await cluster.workers()
        (kv,) = stores
        try:
            await kv.init("one", rsp([0], [row(5)], num_rows=1))
            await kv.push("one", rsp([0], [row(2)], num_rows=1))
            one = await kv.row_sparse_pull("one", row_ids=[0])
            np.testing.assert_array_equal(one.data, [row(2)])
            huge = 10**9
            ids = [0, huge // 2 - 1, huge // 2, huge - 1]
            await kv.init("huge", akv.RowSparseArray.zeros((huge, WIDTH), np.float32))
            await kv.push("huge", rsp(ids, [row(i) for i in range(4)], num_rows=huge))
            pulled = await kv.row_sparse_pull("huge", row_ids=[huge - 1, 7, 0])
            np.testing.assert_array_equal(pulled.data[:, 0], [0, 0, 3])
            for server in cluster.servers:
                entry = server.state.rows.entries["huge"]
                assert len(entry.rows) == 2 and entry.rows.nbytes < 1 << 20
        finally:
            await kv.close()


async def test_refusals_name_the_key_and_change_nothing():
    with Cluster(2, 2) as cluster:
        stores = await cluster.workers()
        try:

            async def body(kv):
                await kv.init("emb", rsp([2], [row(1)]))
                with pytest.raises(ShapeMismatchError, match="key 'emb'"):
                    await kv.push("emb", rsp([1], [row(1)], num_rows=11))
                with pytest.raises(StorageTypeError, match="row-sparse"):
                    await kv.pull("emb")
                with pytest.raises(RowIdError):
                    await kv.row_sparse_pull("emb", row_ids=[ROWS])
                return await kv.row_sparse_pull("emb", row_ids=[2])

            for pulled in await each(stores, body):
                np.testing.assert_array_equal(pulled.data, [row(1)])
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))


async def test_a_dense_init_of_a_row_sparse_key_is_refused():
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers()
        try:
            by_rank = {kv.rank: kv for kv in stores}
            await asyncio.gather(
                by_rank[0].init("emb", rsp([2], [row(1)])),
                asyncio.wait_for(
                    _expect(
                        ShapeMismatchError,
                        by_rank[1].init("emb", np.zeros((ROWS, WIDTH), np.float32)),
                    ),
                    20,
                ),
            )
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))


async def _expect(error, call):
    with pytest.raises(error, match="row_sparse"):
        await call


def test_a_pull_asks_only_the_servers_that_hold_its_rows():
    entry = Entry("emb", (ROWS, WIDTH), np.dtype(np.float32), None, row_parts(ROWS, 2))
    ids = np.array([0, 3, 4], np.int64)
    data = np.zeros((3, WIDTH), np.float32)
    assert [server for server, _, _ in pull_requests([(entry, ids, data)])] == [0]
    ids = np.array([4, 5], np.int64)
    requests = pull_requests([(entry, ids, np.zeros((2, WIDTH), np.float32))])
    assert [(server, [a[1].tolist() for a in arrays]) for server, arrays, _ in requests] == [
        (0, [[4]]),
        (1, [[5]]),
    ]
    value = rsp([9], [row(1)])
    pushed, placed = push_requests([(entry, value, 1)])  # every server: server 0's empty
    assert {server: arrays[0][1].tolist() for server, arrays in pushed.items()} == {0: [], 1: [9]}
    assert placed == []


async def test_row_sparse_optimizer_states_saved_over_two_servers_load_into_a_local_store(
    tmp_path,
):
    """Each server saves the row states of its range; the file is one, as a local store's,
    and a local store that loads it continues as the servers do."""
    path = tmp_path / "states.akv"
    with Cluster(1, 2) as cluster:
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", rsp([1, 8], [row(1), row(8)]))
            await kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
            await kv.push("emb", rsp([1, 4, 5, 9], [row(1), row(2), row(3), row(4)]))
            await kv.save_optimizer_states(str(path))
            weights = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
            await kv.push("emb", rsp([4, 8], [row(1), row(1)]))
            after = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
        finally:
            await kv.close()
    saved = akv.optimizer.decode_states(path.read_bytes()).states["emb"]
    assert saved.ids.tolist() == [1, 4, 5, 9]  # rows of both servers, in order
    with akv.create("local") as local:
        local.init("emb", weights)
        local.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
        local.load_optimizer_states(str(path))
        local.push("emb", rsp([4, 8], [row(1), row(1)]))
        local_after = local.row_sparse_pull("emb", row_ids=np.arange(ROWS))
    np.testing.assert_array_equal(local_after.data, after.data)
    with Cluster(1, 2) as cluster:  # and back: the file cut by rows for two servers
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", weights)
            await kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.1))
            await kv.load_optimizer_states(str(path))
            await kv.push("emb", rsp([4, 8], [row(1), row(1)]))
            again = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
        finally:
            await kv.close()
    np.testing.assert_array_equal(again.data, after.data)


def step_grad(rank: int, step: int) -> akv.RowSparseArray:
    """Worker ``rank``'s row gradient at ``step``: rows at both servers' range ends and one
    that moves (small integers: sums are exact)."""
    ids = [0, 4, 5, 9, (3 * step + rank) % ROWS]
    values = [row(rank + 1 + (i + step) % 3) for i in range(len(ids))]
    return rsp(ids, values)


async def test_a_restarted_server_restores_its_rows_and_states_and_the_job_goes_on(tmp_path):
    """Checkpoints hold row-sparse keys (rows, rounds, optimizer row states): server 1 dies
    after two rounds its checkpoint lacks; restarted, it restores, the workers resend those
    rounds exactly once, and the job ends with the weights of an uninterrupted run."""
    from tests.akv.cluster.test_checkpoints import NEVER_S, WAIT_S, _die, _restart, retained

    steps, cut = 8, 3
    optimizer = lambda: akv.optimizer.SGD(learning_rate=0.5, momentum=0.9, wd=0.1)  # noqa: E731
    initial = rsp([1, 8], [row(1), row(8)])
    with akv.create("local") as local:  # the uninterrupted run: both workers' sums
        local.init("emb", initial)
        local.set_optimizer(optimizer())
        for step in range(steps):
            local.push("emb", [step_grad(0, step), step_grad(1, step)])
        expected = local.row_sparse_pull("emb", row_ids=np.arange(ROWS))

    async def train(kv, steps_range):
        for step in steps_range:
            await kv.push("emb", step_grad(kv.rank, step))
            pulled = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
        return pulled

    env = {"AKV_CHECKPOINT_DIR": str(tmp_path), "AKV_CHECKPOINT_INTERVAL_S": NEVER_S}
    with Cluster(2, 2, **env) as cluster:
        stores = await cluster.workers()
        try:
            await each(stores, lambda kv: kv.init("emb", initial))
            await each(stores, lambda kv: kv.set_optimizer(optimizer()))
            await each(stores, lambda kv: train(kv, range(cut)))
            for link in stores[0]._backend.links:
                await link.request(Op.CHECKPOINT, timeout_s=WAIT_S)
            await wait_until(lambda: retained(stores) == [0] * 4, "DURABLE after the cut")
            await each(stores, lambda kv: train(kv, range(cut, cut + 2)))  # not checkpointed
            cluster.thread.run(_die(cluster, 1), timeout=30)
            new, _ = cluster.thread.run(_restart(cluster, 1), timeout=30)
            restored = new.state.rows.entries["emb"]
            assert restored.rounds.closed_round == cut and (restored.first, restored.end) == (5, 10)
            results = await each(stores, lambda kv: train(kv, range(cut + 2, steps)))
            assert new.state.failure is None and new.state.duplicates == 0
            assert new.state.rows.entries["emb"].rounds.closed_round == steps
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    for pulled in results:
        np.testing.assert_array_equal(pulled.data, expected.data)


@pytest.mark.parametrize("store_type", ["dist_async", "dist_sync_device", "dist_async_device"])
async def test_a_push_is_the_keys_whole_new_value_on_every_server(store_type):
    """Row 3 lies on server 0, row 7 on server 1: a push of row 7 alone clears row 3 too
    (without an optimizer the stored rows become the push, on every server)."""
    with Cluster(2, 2) as cluster:

        async def body(kv):
            await kv.init("emb", rsp([3], [row(1)]))
            await kv.push("emb", rsp([7], [row(1)]))
            await kv.barrier()
            return await kv.row_sparse_pull("emb", row_ids=[3, 7])

        sync = store_type.startswith("dist_sync")
        for pulled in await on_every_worker(cluster, store_type, body):
            np.testing.assert_array_equal(pulled.data[:, 0], [0, 2 if sync else 1])


async def test_pushes_without_pulls_keep_no_growing_list_of_answers():
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", rsp([1], [row(1)]))
            for _ in range(30):
                await kv.push("emb", rsp([2], [row(1)]))
            await kv.barrier()
            assert kv._backend._rows._unanswered == {}
            for _ in range(30):
                await kv.push("emb", rsp([2], [row(1)]))
            await asyncio.wait(kv._backend._rows._unanswered["emb"], timeout=20)
            await kv.push("emb", rsp([2], [row(1)]))
            # The 30 answered without an error were dropped when this one was sent.
            assert len(kv._backend._rows._unanswered["emb"]) == 1
        finally:
            await kv.close()


async def init_both(fast, slow) -> None:
    """Both workers init 'emb' with rows 0 and 9 of zeros."""
    await asyncio.gather(*(kv.init("emb", rsp([0, 9], [row(0), row(0)])) for kv in (fast, slow)))


async def round_kept(fast, slow) -> None:
    """Worker 1 pushes 2s: both then pull the round of worker 0's first push (1s) and this
    one, 3s (a refused second push of worker 0 changed nothing)."""
    await slow.push("emb", rsp([0, 9], [row(2), row(2)]))
    pulled = await asyncio.gather(
        *(kv.row_sparse_pull("emb", row_ids=[0, 9]) for kv in (fast, slow))
    )
    for rows in pulled:
        np.testing.assert_array_equal(rows.data, [row(3), row(3)])


@pytest.mark.parametrize("call", ["row_sparse_pull", "push"])
async def test_a_refused_row_push_is_raised_by_the_next_call_and_the_round_is_kept(call):
    """A pipelined row push the servers refuse (a second push in one dist_sync round) is
    raised by the worker's next row_sparse_pull or push of the key, at its call, once; the
    round sums the pushes it counted. (How answers still in flight are settled:
    tests/akv/cluster/worker.)"""
    with Cluster(2, 2) as cluster:
        fast, slow = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        try:
            await init_both(fast, slow)
            await fast.push("emb", rsp([0, 9], [row(1), row(1)]))
            await fast.push("emb", rsp([0, 9], [row(5), row(5)]))  # refused by both servers
            answers = fast._backend._rows._unanswered["emb"]
            await wait_until(lambda: all(a.done() for a in answers), "the push answers")
            # Raised by the pull's call, at once: not sent to wait for the round that the
            # refused push never joined (which waits for worker 1).
            refused = r"an earlier push of key 'emb' failed: worker 0 pushed key 'emb' twice"
            with pytest.raises(akv.DoublePushError, match=refused):
                if call == "push":  # refused at its call: nothing sent
                    await fast.push("emb", rsp([0, 9], [row(7), row(7)]))
                else:
                    await fast.row_sparse_pull("emb", row_ids=[0, 9])
            # Told once: neither server's refusal is kept (the first push's answers are).
            assert fast._backend._rows.take_failed(["emb"]) is None
            await round_kept(fast, slow)
            assert fast._backend._rows._unanswered == {}
        finally:
            await asyncio.gather(*(kv.close() for kv in (fast, slow)))


async def test_a_strict_row_push_ends_once_answered_and_raises_a_refusal_at_its_call():
    """AKV_STRICT_PUSH=1 holds for row pushes as for dense ones: a push ends once every
    server answered it, and a server's refusal (a second push in one dist_sync round) is
    raised by that push (it was left to the next call of the key); the round is kept."""
    with Cluster(2, 2, AKV_STRICT_PUSH="1") as cluster:
        fast, slow = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        try:
            await init_both(fast, slow)
            await fast.push("emb", rsp([0, 9], [row(1), row(1)]))
            assert fast._backend._rows._unanswered == {}  # answered within the call
            with pytest.raises(akv.DoublePushError, match="worker 0 pushed key 'emb' twice"):
                await fast.push("emb", rsp([0, 9], [row(5), row(5)]))
            await round_kept(fast, slow)
        finally:
            await asyncio.gather(*(kv.close() for kv in (fast, slow)))


async def test_the_status_counts_the_keys_a_row_pull_names_as_for_a_dense_pull():
    """The worker's activity (the status page) counts a row pull's keys, as a dense
    pull's and a push's: not each array of ids or output of one key."""
    with Cluster(1, 2) as cluster:
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", rsp([1], [row(1)]))
            await kv.row_sparse_pull("emb", row_ids=[[1], [2], [3]])
            outs = [akv.RowSparseArray.zeros((ROWS, WIDTH), np.float32) for _ in range(2)]
            await kv.row_sparse_pull("emb", out=outs, row_ids=[1])
            await kv.row_sparse_pull(["emb", "emb"], row_ids=[[1], [2]])
            await kv.push(["emb", "emb"], [rsp([1], [row(1)]), rsp([2], [row(1)])])
            assert kv._backend.activity.report() == {"pushes": 1, "pulls": 3, "rounds": 1}
        finally:
            await kv.close()


async def test_a_pull_sent_before_its_push_is_refused_raises_the_refusal_without_waiting():
    """A pull sent right after a push that the servers then refuse (a double push in
    dist_sync) waits on them for the round of the worker's last counted push, which here
    waits for worker 1 (say, at a barrier): the refusal ends the pull at once, raised as an
    earlier push's error, once; the round is kept."""
    with Cluster(2, 2) as cluster:
        fast, slow = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        try:
            await init_both(fast, slow)
            await fast.push("emb", rsp([0, 9], [row(1), row(1)]))
            # Issued together: the pull goes out before the second push's refusal is read.
            second = asyncio.ensure_future(fast.push("emb", rsp([0, 9], [row(5), row(5)])))
            pull = asyncio.ensure_future(fast.row_sparse_pull("emb", row_ids=[0, 9]))
            await second
            refused = r"an earlier push of key 'emb' failed: worker 0 pushed key 'emb' twice"
            with pytest.raises(akv.DoublePushError, match=refused):
                await asyncio.wait_for(pull, 10)  # not the round's deadline (20 s)
            assert fast._backend._rows.take_failed(["emb"]) is None  # told once
            await round_kept(fast, slow)
        finally:
            await asyncio.gather(*(kv.close() for kv in (fast, slow)))


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
async def test_a_row_key_of_zero_width_works_as_in_the_local_store(store_type):
    """Rows of no columns (a shape (10, 0)): a pull's landing of no bytes was refused by
    memoryview with a TypeError."""

    async def body(kv):
        value = akv.RowSparseArray(np.ones((2, 0), np.float32), [1, 7], (10, 0))
        await kv.init("z", value)
        await kv.push("z", value)
        return await kv.row_sparse_pull("z", row_ids=[1, 3, 7])

    with Cluster(2, 2) as cluster:
        for pulled in await on_every_worker(cluster, store_type, body):
            assert pulled.shape == (10, 0) and pulled.indices.tolist() == [1, 3, 7]
            assert pulled.data.shape == (3, 0)


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
@pytest.mark.parametrize("shm", ["1", "0"])
async def test_a_dense_key_of_zero_width_works_too(store_type, shm):
    """A dense (10, 0) key: the server refused its push's payload with a TypeError of
    memoryview in its reader (the stream cut, the push resent for ever)."""

    async def body(kv):
        await kv.init("z", np.zeros((10, 0), np.float32))
        await kv.push("z", np.ones((10, 0), np.float32))
        return await kv.pull("z")

    with Cluster(2, 1, AKV_SHM=shm) as cluster:
        for pulled in await on_every_worker(cluster, store_type, body):
            assert pulled.shape == (10, 0)


@pytest.mark.parametrize("shm", ["1", "0"])
async def test_a_row_init_reads_its_rows_at_the_call(shm):
    """Rank 0's init is sent by a task on the loop, after the call returned: the rows it
    sends are copied at the call (they were slices of the caller's arrays, which the
    caller may change then)."""
    with Cluster(1, 2, AKV_SHM=shm) as cluster:
        (kv,) = await cluster.workers()
        try:
            value = rsp([0, 9], [row(1), row(1)])
            init = kv.init("emb", value)
            value.data[...] = 666
            await init
            pulled = await kv.row_sparse_pull("emb", row_ids=[0, 9])
            np.testing.assert_array_equal(pulled.data, [row(1), row(1)])
        finally:
            await kv.close()


@pytest.mark.parametrize("store_type", ["dist_async", "dist_sync"])
def test_row_pushes_from_several_threads_are_each_counted_once(store_type):
    """The blocking face from 4 threads at once, each pushing the same row key: a push is
    numbered by its task, in the order the key's pushes run (numbered at the call, a later
    number could run first, and the server took the earlier one for a resend and dropped
    it: 3-43 of 200 pushes lost). dist_sync: one worker, so each push is a round."""
    threads, each_pushes, rows = 4, 50, 20_000
    with Cluster(1, 2) as cluster:
        kv = akv.create(store_type, environ=cluster.worker_env(0))
        try:
            kv.init("emb", akv.RowSparseArray.zeros((rows, WIDTH), np.float32))
            kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
            grad = akv.RowSparseArray(
                np.ones((rows, WIDTH), np.float32), np.arange(rows), (rows, WIDTH)
            )
            errors: list[BaseException] = []

            def push_many() -> None:
                try:
                    for _ in range(each_pushes):
                        kv.push("emb", grad)
                except BaseException as exc:
                    errors.append(exc)

            workers = [threading.Thread(target=push_many) for _ in range(threads)]
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join(60)
            assert errors == [] and not any(t.is_alive() for t in workers)
            pulled = kv.row_sparse_pull("emb", row_ids=np.arange(rows))
            np.testing.assert_array_equal(pulled.data, -float(threads * each_pushes))
        finally:
            kv.close()


async def test_pushes_over_tcp_wait_in_reused_buffers_and_each_is_applied_as_it_was_called():
    """Without shared memory a push's rows are copied at the call into a reusable buffer
    (not fresh pages each time) and wait there until both servers answered: pipelined
    pushes from one array changed after each call are each applied as they were called."""
    with Cluster(1, 2, AKV_SHM="0") as cluster:
        (kv,) = await cluster.workers()
        try:
            assert not any(link.shares_memory for link in kv._backend.links)
            await kv.init("emb", rsp([0], [row(0)]))
            await kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
            source = np.zeros((ROWS, WIDTH), np.float32)
            expected = np.zeros((ROWS, WIDTH), np.float32)
            for step in range(24):
                ids = np.arange(step % 3, ROWS, 1 + step % 4)  # both servers, sizes vary
                source[: len(ids)] = step + 1
                await kv.push("emb", akv.RowSparseArray(source[: len(ids)], ids, (ROWS, WIDTH)))
                source[...] = -1000  # the push took its rows at the call
                expected[ids] -= step + 1
            pulled = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
            np.testing.assert_array_equal(pulled.to_dense(), expected)
            buffers = kv._backend._rows.push_buffers
            await wait_until(lambda: not buffers._lent, "every push buffer given back")
            assert 0 < len(buffers._free) <= MAX_SPARE_PUSH_BUFFERS
        finally:
            await kv.close()


FAILED_ROUND = r"key 'emb' in round 1 failed on server"


async def push_into_a_failed_round(kv: akv.AsyncKVStore, cluster: Cluster) -> None:
    """Push ``emb``'s rows into round 1, whose update every server then refuses (AdaGrad
    with weight decay has no row update), and wait until both servers failed it."""
    await kv.init("emb", rsp([0, 9], [row(1), row(1)]))
    await kv.set_optimizer(akv.optimizer.AdaGrad(learning_rate=0.1, wd=0.1))
    await kv.push("emb", rsp([0, 9], [row(1), row(1)]))
    await kv.barrier()
    rounds = [server.state.rows.entries["emb"].rounds for server in cluster.servers]
    await wait_until(lambda: all(r.applied_round == 1 for r in rounds), "the round")


async def test_a_failed_row_update_is_raised_by_each_workers_next_pull_after_it():
    """A dist_sync row push is answered once counted; when its round's update then fails on
    the servers (AdaGrad refuses weight decay for rows), each worker's next row_sparse_pull
    of the key raises it, even one sent after the failure, and the rows are unchanged."""
    with Cluster(2, 2) as cluster:

        async def body(kv):
            await push_into_a_failed_round(kv, cluster)
            with pytest.raises(akv.ServerError, match=FAILED_ROUND):
                await kv.row_sparse_pull("emb", row_ids=[0, 9])
            return await kv.row_sparse_pull("emb", row_ids=[0, 9])  # told once

        for pulled in await on_every_worker(cluster, "dist_sync", body):
            np.testing.assert_array_equal(pulled.data, [row(1), row(1)])


def test_a_pull_naming_a_key_twice_sends_a_request_per_time_to_a_server():
    """A request names each key once (a server refuses one that repeats a key): a pull with
    several id arrays of one key asks a server once per array that has rows there."""
    entry = Entry("emb", (ROWS, WIDTH), np.dtype(np.float32), None, row_parts(ROWS, 2))
    first, second = np.array([1, 7], np.int64), np.array([2, 3], np.int64)
    data = [np.zeros((2, WIDTH), np.float32), np.zeros((2, WIDTH), np.float32)]
    requests = pull_requests([(entry, first, data[0]), (entry, second, data[1])])
    asked = [(server, [a[1].tolist() for a in arrays]) for server, arrays, _ in requests]
    assert asked == [(0, [[1]]), (0, [[2, 3]]), (1, [[7]])]
    other = Entry("other", (ROWS, WIDTH), np.dtype(np.float32), None, row_parts(ROWS, 2))
    both = pull_requests([(entry, first, data[0]), (other, second, data[1])])
    assert [(server, len(arrays)) for server, arrays, _ in both] == [(0, 2), (1, 1)]


async def test_one_key_pulled_with_several_id_arrays_or_outputs_as_in_mxnet():
    """``row_sparse_pull`` of one key with a list of id arrays, of one id array into several
    outputs, and of a key list naming a key twice: each output gets its ids' rows, as in the
    local store."""
    with Cluster(1, 2) as cluster:
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", rsp([1, 8], [row(1), row(8)]))
            pairs = await kv.row_sparse_pull("emb", row_ids=[np.array([1]), np.array([8, 2])])
            assert [p.indices.tolist() for p in pairs] == [[1], [2, 8]]
            assert [p.data[:, 0].tolist() for p in pairs] == [[1], [0, 8]]
            outs = [akv.RowSparseArray.zeros((ROWS, WIDTH), np.float32) for _ in range(2)]
            await kv.row_sparse_pull("emb", out=outs, row_ids=np.array([8, 1]))
            for out in outs:
                assert out.indices.tolist() == [1, 8] and out.data[:, 0].tolist() == [1, 8]
            twice = await kv.row_sparse_pull(["emb", "emb"], row_ids=[[1], [1, 8]])
            assert [p.data[:, 0].tolist() for p in twice] == [[1], [1, 8]]
        finally:
            await kv.close()


async def test_a_failed_row_update_no_pull_told_is_raised_by_close():
    """A worker that pushes and never pulls the key again still hears that the servers'
    update failed: its close raises it, after its goodbyes, and tells the scheduler why it
    leaves (so the job's verdict names it, not "stopped by a signal" once the launcher sees
    the process exit with 1)."""
    with Cluster(2, 2) as cluster:
        stores = await cluster.workers()

        async def body(kv):
            await push_into_a_failed_round(kv, cluster)
            with pytest.raises(akv.ServerError, match=FAILED_ROUND):
                await kv.close()
            return True

        try:
            assert await each(stores, body) == [True, True]
        finally:  # closed already where the test passes (a close raises its error again)
            await asyncio.gather(*(kv.close() for kv in stores), return_exceptions=True)
        assert cluster.scheduler is not None
        failure = cluster.scheduler.roster.failure or ""
        assert re.search(r"worker \d .*left the job: its close raised ServerError: ", failure)
        assert re.search(FAILED_ROUND, failure), failure


async def test_states_saved_right_after_a_push_hold_its_rounds_update(tmp_path):
    """dist_sync answers a push once counted: worker 0's save, sent while its push's round
    still waits for worker 1, is written once that round is applied (as a pull waits), so
    the file holds the momentum of that round, as a local store's would."""
    path = tmp_path / "states.akv"
    with Cluster(2, 2) as cluster:
        first, second = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        try:
            for kv in (first, second):
                await kv.init("emb", rsp([0, 9], [row(1), row(1)]))
                await kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
            await first.push("emb", rsp([0, 9], [row(1), row(1)]))
            save = asyncio.ensure_future(first.save_optimizer_states(str(path)))
            rounds = [server.state.rows.entries["emb"].rounds for server in cluster.servers]
            await wait_until(lambda: all(r.waiting_tickets() for r in rounds), "the save parked")
            await second.push("emb", rsp([0, 9], [row(2), row(2)]))
            await asyncio.wait_for(save, 20)
        finally:
            await asyncio.gather(first.close(), second.close())
    saved = akv.optimizer.decode_states(path.read_bytes()).states["emb"]
    assert saved.ids.tolist() == [0, 9]
    np.testing.assert_allclose(saved.leaves[0], [row(-0.3), row(-0.3)], rtol=1e-6)


async def test_bounded_staleness_holds_row_pushes_as_dense_ones():
    """dist_async with AKV_STALENESS=0: the fast worker's second row push, and its pull
    behind it, wait on the server until the slow worker pushed; then the pull sees it."""
    with Cluster(2, 1, AKV_STALENESS="0") as cluster:
        fast, slow = sorted(await cluster.workers("dist_async"), key=lambda kv: kv.rank)
        try:
            await asyncio.gather(*(kv.init("emb", rsp([0], [row(0)])) for kv in (fast, slow)))
            await fast.push("emb", rsp([1], [row(1)]))
            await fast.push("emb", rsp([1], [row(2)]))
            pull = asyncio.ensure_future(fast.row_sparse_pull("emb", row_ids=[1]))
            state = cluster.servers[0].state
            await wait_until(
                lambda: state.waiting is not None and len(state.waiting) == 2, "parked"
            )
            assert not pull.done()
            await slow.push("emb", rsp([1], [row(10)]))
            pulled = await asyncio.wait_for(pull, 20)
            np.testing.assert_array_equal(pulled.data, [row(2)])  # no optimizer: replaced
        finally:
            await asyncio.gather(fast.close(), slow.close())


def test_a_pull_after_a_push_also_waits_on_the_servers_holding_none_of_its_rows():
    """A pull of rows of server 0 alone, after a push that went to both servers, asks
    server 1 too, for no row: then the next push never reaches a server whose previous
    round still waits for another worker (a DoublePushError, about 1 run in 300 steps)."""
    entry = Entry("emb", (ROWS, WIDTH), np.dtype(np.float32), None, row_parts(ROWS, 2))
    data = np.zeros((1, WIDTH), np.float32)
    ids = np.array([1], np.int64)
    requests = pull_requests([(entry, ids, data)], {"emb": {0, 1}})
    asked = [(server, [a[1].tolist() for a in arrays]) for server, arrays, _ in requests]
    assert asked == [(0, [[1]]), (1, [[]])]
    assert [len(landings[0]) for _, _, landings in requests] == [WIDTH * 4, 0]
    assert not requests[1][2][0].readonly  # a reply's destination must be writable


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
async def test_which_servers_a_row_pull_asks_after_a_push(store_type):
    with Cluster(2, 2) as cluster:
        asked: list[tuple[int, int]] = []  # (server, worker) of each ROW_PULL
        for rank, server in enumerate(cluster.servers):

            def record(peer, message, landing, rank=rank, given=server.message):
                if message.header.op == Op.ROW_PULL:
                    asked.append((rank, peer.worker))
                given(peer, message, landing)

            server.message = record

        async def body(kv):
            await kv.init("emb", rsp([0], [row(0)]))
            await kv.push("emb", rsp([0, 9], [row(1), row(1)]))
            first = await kv.row_sparse_pull("emb", row_ids=[0])  # rows of server 0 only
            again = await kv.row_sparse_pull("emb", row_ids=[0])  # no push since
            return first, again

        results = await on_every_worker(cluster, store_type, body)
        expected = [(0, 0), (0, 1)] * 2 + ([(1, 0), (1, 1)] if store_type == "dist_sync" else [])
        assert sorted(asked) == sorted(expected)
        if store_type == "dist_sync":
            for first, again in results:
                np.testing.assert_array_equal(first.data, [row(2)])
                np.testing.assert_array_equal(again.data, [row(2)])


async def test_a_servers_loop_goes_on_while_a_row_keys_kernels_are_made(monkeypatch):
    """The first compile of the row kernels takes seconds: a server makes them on a thread
    (its heartbeats and other requests go on) and answers the row key's init once they are
    made, so that its rounds use them."""
    pytest.importorskip("numba")
    monkeypatch.setenv("AKV_JIT", "1")
    made = jit.kernels()
    assert made is not None
    gate = threading.Event()

    def slow_compile():
        assert gate.wait(20)
        return made

    monkeypatch.setattr(jit, "_kernels", None)
    monkeypatch.setattr(jit, "_loading", None)
    monkeypatch.setattr(jit, "_compile", slow_compile)
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        try:
            row_init = asyncio.ensure_future(kv.init("emb", rsp([1], [row(1)])))
            await kv.init("dense", np.ones(3, np.float32))  # answered meanwhile
            np.testing.assert_array_equal(await kv.pull("dense"), np.ones(3, np.float32))
            assert not row_init.done() and not jit.settled()
            gate.set()
            await asyncio.wait_for(row_init, 20)
            assert jit.settled() and jit.kernels() is made
            await kv.push("emb", rsp([1, 2], [row(2), row(3)]))
            pulled = await kv.row_sparse_pull("emb", row_ids=[1, 2])
            np.testing.assert_array_equal(pulled.data, [row(2), row(3)])
        finally:
            gate.set()
            await kv.close()


async def test_momentum_turned_off_and_on_again_by_set_optimizer_updates_as_a_local_store():
    """A second ``set_optimizer`` of SGD that turns momentum off, then on again: every key's
    state that no longer fits is made anew on the servers, as a local store starts afresh.
    Before, the next row-sparse update failed on every server ("zip() argument 2 is longer
    than argument 1"; found by a review, 5 of 5 runs)."""
    phases = [0.9, 0.0, 0.9]
    dense = np.ones(8, np.float32)

    def run_phases(kv):
        for momentum in phases:
            yield kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1, momentum=momentum))
            for step in range(2):
                yield kv.push("emb", step_grad(0, step))
                yield kv.push("w", dense)

    with akv.create("local") as local:
        local.init("emb", rsp([1, 8], [row(1), row(8)]))
        local.init("w", np.zeros(8, np.float32))
        for _ in run_phases(local):
            pass
        expected = local.row_sparse_pull("emb", row_ids=np.arange(ROWS)), local.pull("w")
    with Cluster(1, 2, AKV_BIGARRAY_BOUND="4") as cluster:  # "w" split over both servers
        (kv,) = await cluster.workers()
        try:
            await kv.init("emb", rsp([1, 8], [row(1), row(8)]))
            await kv.init("w", np.zeros(8, np.float32))
            for call in run_phases(kv):
                await call
            rows = await kv.row_sparse_pull("emb", row_ids=np.arange(ROWS))
            weights = await kv.pull("w")
        finally:
            await kv.close()
    np.testing.assert_allclose(rows.to_dense(), expected[0].to_dense(), rtol=1e-6)
    np.testing.assert_allclose(weights, expected[1], rtol=1e-6)
