"""Workers and servers on one host share memory; with AKV_SHM=0 or across hosts they use TCP,
and the values are exactly the same either way."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import akv
from akv.limits import STAGED_REPLY_MIN_BYTES
from tests.akv.cluster.cluster import Cluster, server_books, wait_until

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")

#: Large enough to go through the arena (more than 64 KiB), small enough to be quick.
SHAPE = (300, 1000)


async def exercise(stores) -> list[dict[str, np.ndarray]]:
    """Pushes and pulls of a large and a small key on every worker; what each pulled."""

    async def body(kv):
        rng = np.random.default_rng(kv.rank)
        big = rng.standard_normal(SHAPE).astype(np.float32)
        small = rng.standard_normal(16).astype(np.float32)
        await kv.init(["big", "small"], [np.zeros(SHAPE, np.float32), np.zeros(16, np.float32)])
        seen = {}
        for step in range(3):
            await kv.push(["big", "small"], [big * (step + 1), small * (step + 1)])
            seen[f"big {step}"], seen[f"small {step}"] = await kv.pull(["big", "small"])
        seen["pushpull"] = await kv.pushpull("big", big)
        return seen

    return list(await asyncio.gather(*(body(kv) for kv in stores)))


def shared(stores) -> list[bool]:
    return [link.shares_memory for kv in stores for link in kv._backend.links]


def lent_bytes(cluster: Cluster) -> int:
    """Payload bytes the servers read in place, out of the workers' shared memory."""
    return sum(
        link.protocol.statistics().payload_bytes_lent
        for server in cluster.servers
        for link in server.links.values()
        if getattr(link, "protocol", None) is not None
    )


def frames_shared(cluster: Cluster, stores) -> tuple[int, int]:
    """Frames sent through shared memory: by the workers, by the servers."""
    pushed = sum(
        link.protocol.shared.frames_shared
        for kv in stores
        for link in kv._backend.links
        if link.shares_memory
    )
    answered = sum(
        link.protocol.shared.frames_shared
        for server in cluster.servers
        for link in server.links.values()
        if getattr(link, "protocol", None) is not None and link.protocol.shared is not None
    )
    return pushed, answered


async def run(cluster: Cluster) -> tuple[list[dict[str, np.ndarray]], list[bool]]:
    stores = await cluster.workers()
    try:
        values = await exercise(stores)
        cluster.frames = frames_shared(cluster, stores)
        cluster.lent = lent_bytes(cluster)
        return values, shared(stores)
    finally:
        await asyncio.gather(*(kv.close() for kv in stores))


def same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


async def test_on_one_host_streams_share_memory_and_the_values_match_tcp():
    with Cluster(2, 2) as cluster:
        on, links = await run(cluster)
        assert links == [True] * 4
        assert all(s.membership.local is not None for s in cluster.servers)
        pushed, answered = cluster.frames
        assert pushed >= 2 * 4  # every push of "big" went through a worker's arena
        assert answered >= 2 * 4  # and every pull answer of it through a server's
        # The servers summed every push (3 pushes of both keys in one frame and a
        # pushpull of "big", per worker) straight out of the workers' shared memory.
        assert cluster.lent == 2 * (4 * np.zeros(SHAPE, np.float32).nbytes + 3 * 16 * 4)
        directories = [os.path.dirname(s.membership.local["path"]) for s in cluster.servers]
    for directory in directories:  # the servers stopped: their sockets are gone
        assert not os.path.exists(directory)
    with Cluster(2, 2, AKV_SHM="0") as cluster:
        off, links = await run(cluster)
        assert links == [False] * 4
        assert all(s.membership.local is None for s in cluster.servers)
        assert cluster.frames == (0, 0)
        assert cluster.lent == 0
    assert same(on, off)
    total = sum(
        np.random.default_rng(r).standard_normal(SHAPE).astype(np.float32) for r in range(2)
    )
    assert np.allclose(on[0]["big 2"], 3 * total, rtol=1e-5, atol=1e-5)


def server_arenas(cluster: Cluster) -> list:
    return [
        link.protocol.shared
        for server in cluster.servers
        for link in server.links.values()
        if getattr(link, "protocol", None) is not None and link.protocol.shared is not None
    ]


@pytest.mark.parametrize("case", ["in the arena", "arena too small", "optimizer"])
async def test_large_answers_to_local_workers_are_sent_without_a_copy_where_they_can_be(case):
    shape = (STAGED_REPLY_MIN_BYTES // 4,)
    # An arena too small for the value: the sum is kept aside, the answer copied aside.
    small = {"AKV_SHM_ARENA_BYTES": str(STAGED_REPLY_MIN_BYTES // 2)}
    with Cluster(2, 1, **(small if case == "arena too small" else {})) as cluster:
        stores = sorted(await cluster.workers(), key=lambda kv: kv.rank)

        async def body(kv):
            await kv.init("w", np.zeros(shape, np.float32))
            if case == "optimizer":
                await kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
            seen = []
            for step in range(3):
                await kv.push("w", np.full(shape, kv.rank + step, np.float32))
                seen.append(await kv.pull("w"))
            return seen

        try:
            seen = await asyncio.gather(*(body(kv) for kv in stores))
            arenas = server_arenas(cluster)
            assert len(arenas) == 2 and all(shared.own is not None for shared in arenas)
            (book,) = server_books(cluster)
            assert all(shared.book is book for shared in arenas)  # one arena for both
            (entry,) = cluster.servers[0].state.entries.values()
            # "in the arena": each round's sum was made in a region of the arena both
            # streams send through, and each answer went from there (no copy on the
            # server). "optimizer": the value changes in place, so it is kept aside; each
            # answer was copied into a region by an engine thread, then the frame went
            # without another copy. "arena too small": copied aside, on the socket.
            in_arena = case == "in the arena"
            assert book.holds(entry.value) == in_arena
            sent_in_place = 0 if case == "arena too small" else 2 * 3
            assert sum(shared.arrays_in_place for shared in arenas) == sent_in_place
            # Older sums are freed once the workers have read them: the stored one stays.
            await wait_until(
                lambda: book.regions.regions == (1 if in_arena else 0),
                "the workers to hand the answers' regions back",
            )
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    for values in seen:
        for step, value in enumerate(values):
            # Sums 1, 3, 5; with the optimizer w -= 1.0 * sum, so w = -(step + 1) ** 2.
            expected = -((step + 1) ** 2) if case == "optimizer" else 1 + 2 * step
            np.testing.assert_array_equal(value, np.full(shape, expected, np.float32))


async def test_workers_on_another_host_use_tcp():
    with Cluster(2, 1) as cluster:
        cluster.env["AKV_HOST_ID"] = "another host"  # the workers only: the server started
        values, links = await run(cluster)
        assert links == [False, False]
    with Cluster(2, 1) as cluster:
        same_host, _ = await run(cluster)
    assert same(values, same_host)


async def test_a_worker_falls_back_to_tcp_when_the_socket_is_gone():
    with Cluster(1, 1) as cluster:
        server = cluster.servers[0]
        os.unlink(server._local.path)  # as if the file were cleaned away
        values, links = await run(cluster)
        assert links == [False]
        assert values[0]["big 0"].shape == SHAPE


def test_nothing_is_left_in_the_file_system_after_a_server_is_killed(tmp_path):
    """The launcher removes what the killed server left (its socket and directory)."""
    env = {"TMPDIR": str(tmp_path), "AKV_HEARTBEAT_TIMEOUT_S": "2"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "akv.launch",
            "-n",
            "1",
            "-s",
            "1",
            "--",
            sys.executable,
            "-c",
            "import time; import akv; kv = akv.create('dist_sync'); time.sleep(60)",
        ],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        directories: list[str] = []
        while time.monotonic() < deadline and not directories:
            directories = [n for n in os.listdir(tmp_path) if n.startswith("akv-shm-")]
            time.sleep(0.1)
        assert len(directories) == 1, os.listdir(tmp_path)
        pid = int(directories[0].split("-")[2])
        os.kill(pid, signal.SIGKILL)  # the server, by the pid in its directory's name
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert [n for n in os.listdir(tmp_path) if n.startswith("akv-shm-")] == []


async def test_a_cut_shared_memory_stream_reconnects_and_loses_nothing():
    """A stream through the Unix socket that is cut mid-job (pushes staged in its arena
    and not answered yet) is opened again with fresh arenas; every value stays right."""
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers()
        try:
            first = await exercise(stores)
            server = cluster.servers[0]

            async def cut() -> None:  # on the server's loop: drop worker 0's stream
                (link,) = [
                    link
                    for link in server.links.values()
                    if getattr(link, "peer", None) is not None and link.peer.worker == 0
                ]
                link.protocol.abort()

            async def body(kv):
                rng = np.random.default_rng(kv.rank)
                big = rng.standard_normal(SHAPE).astype(np.float32)
                seen = []
                for step in range(4):
                    await kv.push("big", big * (step + 10))  # staged in the arena
                    if step == 1 and kv.rank == 0:  # cut before the push is answered
                        await asyncio.wrap_future(
                            asyncio.run_coroutine_threadsafe(cut(), cluster.thread.loop)
                        )
                    seen.append(await kv.pull("big"))
                return seen

            after = await asyncio.gather(*(body(kv) for kv in stores))
            links = [link for kv in stores for link in kv._backend.links]
            assert [link.reconnects for link in links] == [1, 0]
            assert all(link.shares_memory for link in links)
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    total = sum(
        np.random.default_rng(r).standard_normal(SHAPE).astype(np.float32) for r in range(2)
    )
    for seen in after:
        for step, value in enumerate(seen):
            assert np.allclose(value, (step + 10) * total, rtol=1e-5, atol=1e-4)
    assert len(first) == 2


@pytest.mark.parametrize("shm", ["1", "0"])
async def test_a_row_push_read_in_place_survives_its_workers_stream_being_cut(shm):
    """Worker 0's row push waits on the server for worker 1's, read where it lies in
    worker 0's arena; worker 0's stream is cut meanwhile and opened again with fresh
    arenas (its push resent and recognized): the round sums the rows as they were pushed.
    Over TCP the same: the push is resent from the push buffer its rows wait in, which
    goes back once answered."""
    shape = (10_000, 64)
    with Cluster(2, 1, AKV_SHM=shm) as cluster:
        fast, slow = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        server = cluster.servers[0]

        async def on_server(fn):
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(fn(), cluster.thread.loop)
            )

        def held_in_place() -> bool:
            entries = list(server.state.rows.entries.values())
            return (
                bool(entries)
                and len(entries[0].pending) == 1
                and (shm == "0" or not entries[0].pending[0][1].flags.writeable)
            )

        async def cut() -> None:
            (link,) = [
                link
                for link in server.links.values()
                if getattr(link, "peer", None) is not None and link.peer.worker == 0
            ]
            link.protocol.abort()

        try:
            await asyncio.gather(
                *(
                    kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
                    for kv in (fast, slow)
                )
            )
            ids = np.arange(0, 2000, 2)  # 1000 rows of 64 float32: through the arena
            grad = akv.RowSparseArray(np.full((ids.size, 64), 3.0, np.float32), ids, shape)
            await fast.push("emb", grad)
            await wait_until(held_in_place, "worker 0's push held in place on the server")
            await on_server(cut)
            await slow.push("emb", akv.RowSparseArray(np.ones((1, 64), np.float32), [1], shape))
            pulled = await fast.row_sparse_pull("emb", row_ids=np.arange(4))
            assert [link.reconnects for link in fast._backend.links] == [1]
            buffers = fast._backend._rows.push_buffers
            await wait_until(lambda: not buffers._lent, "worker 0's push buffer given back")
            assert (buffers.kept_bytes > 0) == (shm == "0")
        finally:
            await asyncio.gather(*(kv.close() for kv in (fast, slow)))
    np.testing.assert_array_equal(pulled.data[:, 0], [3, 1, 3, 0])


async def test_row_answers_to_local_workers_are_gathered_into_the_servers_arena():
    # 400 rows of 64 float32: 100 KiB, above the smallest payload worth the arena; 4 rows
    # (1 KiB) go on the socket.
    shape = (10_000, 64)
    with Cluster(2, 1) as cluster:
        stores = sorted(await cluster.workers(), key=lambda kv: kv.rank)

        async def body(kv):
            await kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
            await kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
            ids = np.arange(kv.rank, 800, 2)
            grad = akv.RowSparseArray(np.ones((ids.size, 64), np.float32), ids, shape)
            await kv.push("emb", grad)
            many = await kv.row_sparse_pull("emb", row_ids=np.arange(400))
            few = await kv.row_sparse_pull("emb", row_ids=np.arange(4))
            return many, few

        try:
            answers = await asyncio.gather(*(body(kv) for kv in stores))
            arenas = server_arenas(cluster)
            # One large answer a worker gathered into a region, sent from there.
            assert sum(shared.arrays_in_place for shared in arenas) == 2
            (book,) = server_books(cluster)
            await wait_until(
                lambda: book.regions.regions == 0, "the workers to hand the regions back"
            )
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    for many, few in answers:
        np.testing.assert_array_equal(many.indices, np.arange(400))
        np.testing.assert_array_equal(many.data, np.full((400, 64), -1, np.float32))
        np.testing.assert_array_equal(few.data, np.full((4, 64), -1, np.float32))


@pytest.mark.parametrize("shm", ["1", "0"])
async def test_row_pushes_are_staged_in_the_workers_arena_and_taken_at_the_call(shm):
    # 300 rows of 64 float32 (75 KiB) a worker: staged in a region of the worker's arena
    # (on one host), sent from there, the region given back once answered; over TCP copied
    # into arrays of their own. Either way the caller's arrays are taken at the call: a
    # change right after push() reaches no server.
    shape = (10_000, 64)
    with Cluster(2, 1, AKV_SHM=shm) as cluster:
        stores = sorted(await cluster.workers(), key=lambda kv: kv.rank)

        async def body(kv):
            await kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
            ids = np.arange(kv.rank, 600, 2)
            data = np.ones((ids.size, 64), np.float32)
            for _ in range(3):
                kv.push("emb", akv.RowSparseArray(data, ids, shape))  # not awaited: pipelined
                data[:] = 100  # changed before the push's task ran
                data[:] = 1
                data[0] = 7
                pulled = await kv.row_sparse_pull("emb", row_ids=ids)
                data[0] = 1
            await kv.barrier()
            return pulled

        try:
            pulled = await asyncio.gather(*(body(kv) for kv in stores))
            links = [link for kv in stores for link in kv._backend.links]
            arenas = [link.protocol.shared for link in links if link.protocol.shared is not None]
            assert len(arenas) == (2 if shm == "1" else 0)
            assert sum(shared.arrays_in_place for shared in arenas) == (6 if shm == "1" else 0)
            books = {id(shared.book): shared.book for shared in arenas}.values()
            await wait_until(
                lambda: all(book.regions.regions == 0 for book in books),
                "the server to hand the pushes' regions back",
            )
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    for rank, rows in enumerate(pulled):
        # Without an optimizer each round's rows are its pushes' sum: ones, and 7 in the
        # first row the worker pushed (pushed before the change: the value at the call).
        assert rows.data[0, 0] == 1 and rows.data[1:].max() == 1, rank


@pytest.mark.parametrize("behind", ["push", "pushpull"])
async def test_a_push_the_engine_skips_gives_its_arena_region_back(behind):
    """With ``AKV_STRICT_PUSH=1`` a push the server refuses (worker 0's second push in one
    ``dist_sync`` round) fails its task; the push (or pushpull) called behind it on the key
    never starts (the engine skips it: the failure was not raised yet), so the region of the
    arena its value was staged in goes back at once, not never."""
    shape = (64, 1024)  # 256 KiB: staged in the worker's arena
    with Cluster(2, 1, AKV_STRICT_PUSH="1") as cluster:
        fast, slow = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        try:
            await asyncio.gather(
                *(kv.init("w", np.zeros(shape, np.float32)) for kv in (fast, slow))
            )
            book = fast._backend.links[0].protocol.shared.book
            # The init's region comes back by a release frame that may follow its reply.
            await wait_until(lambda: not book._reserved, "the init's region given back")
            first = fast.push("w", np.ones(shape, np.float32))
            refused = fast.push("w", np.ones(shape, np.float32))  # twice in round 1
            skipped = getattr(fast, behind)("w", np.ones(shape, np.float32))
            assert len(book._reserved) == 3  # each staged in a region at its call
            await asyncio.wait_for(first, 20)  # counted: the round is open
            with pytest.raises(akv.DoublePushError):
                await asyncio.wait_for(refused, 20)
            with pytest.raises(akv.DoublePushError):
                await asyncio.wait_for(skipped, 20)
            await slow.push("w", np.ones(shape, np.float32))
            await wait_until(lambda: not book._reserved, "every staging region given back")
            pulled = await fast.pull("w")
            np.testing.assert_array_equal(pulled, np.full(shape, 2, np.float32))
        finally:
            await asyncio.gather(*(kv.close() for kv in (fast, slow)))


@pytest.mark.parametrize("shm", ["1", "0"])
async def test_a_split_key_is_staged_part_by_part_in_the_arenas_without_a_buffer_of_its_own(
    monkeypatch, shm
):
    # A key split over both servers: on one host each part is summed straight into a
    # region of the arena of the stream to its server and sent from there, so the worker
    # takes no staging buffer of the key (which held a whole copy of it, then copied
    # part by part into the arenas: one more copy of the key in every worker's memory).
    # Over TCP a push still takes one. Either way a change right after push() reaches
    # no server.
    # 2 MiB: two parts of 1 MiB, each through an arena; above AHEAD_COPY_MAX_BYTES, so no
    # value is asked ahead into a buffer of the key either.
    shape = (512, 1024)
    taken: list[object] = []
    take_buffer = akv.keys.Entry.take_buffer

    def counted(entry):
        if type(entry) is akv.keys.Entry:  # a worker's (a server's entries are subclasses)
            taken.append(entry.key)
        return take_buffer(entry)

    monkeypatch.setattr(akv.keys.Entry, "take_buffer", counted)
    with Cluster(2, 2, AKV_SHM=shm, AKV_BIGARRAY_BOUND="1024") as cluster:
        stores = sorted(await cluster.workers(), key=lambda kv: kv.rank)

        async def body(kv):
            await kv.init("w", np.zeros(shape, np.float32))
            grad = np.full(shape, kv.rank + 1, np.float32)
            out = np.empty(shape, np.float32)
            for _ in range(3):
                kv.push("w", grad)  # not awaited: pipelined
                grad[:] = 100  # changed before the push's task ran: sent as it was
                await kv.pull("w", out=out)
                grad[:] = kv.rank + 1
            await kv.barrier()
            return out

        try:
            pulled = await asyncio.gather(*(body(kv) for kv in stores))
            assert [len(kv._backend.links) for kv in stores] == [2, 2]
            links = [link for kv in stores for link in kv._backend.links]
            arenas = [link.protocol.shared for link in links if link.protocol.shared is not None]
            # Every part of every push sent from where it was staged (2 workers x 3 pushes).
            assert sum(shared.arrays_in_place for shared in arenas) == (12 if shm == "1" else 0)
            books = [shared.book for shared in arenas]
            await wait_until(
                lambda: all(book.regions.regions == 0 for book in books),
                "the servers to hand the pushes' regions back",
            )
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    # The pulls land in ``out``: staging buffers are the pushes' only use of them.
    assert taken == ([] if shm == "1" else ["w"] * 6)
    for out in pulled:  # each round's sum: 1 + 2
        np.testing.assert_array_equal(out, np.full(shape, 3, np.float32))


@pytest.mark.parametrize(
    ("shm", "arena", "let_go"),
    [("1", "0", True), ("1", str(4 << 20), False), ("0", "0", False)],
    ids=["shared", "arena for one value", "tcp"],
)
async def test_a_servers_init_value_is_let_go_once_the_stored_value_lies_in_its_arena(
    shm, arena, let_go
):
    # The init's value is a buffer of the server's own, written. Once a round's sum (in
    # the server's arena, where local workers read answers from) replaced it, the key has
    # no use for it: kept as a spare it held the key's size for the whole job, as much as
    # the stored value. Where the arena cannot hold two values of the key beside the
    # quarter stored values leave free (4 MiB for 2 MiB), every other round's sum is a
    # buffer of the key's own, which the init's value then serves as before; over TCP
    # every sum is one.
    shape = (512, 1024)  # 2 MiB
    env = {"AKV_SHM": shm, **({"AKV_SHM_ARENA_BYTES": arena} if arena != "0" else {})}
    with Cluster(2, 1, **env) as cluster:
        stores = await cluster.workers()
        try:
            await asyncio.gather(*(kv.init("w", np.zeros(shape, np.float32)) for kv in stores))
            (entry,) = cluster.servers[0].state.entries.values()
            init_value = weakref.ref(entry.value)
            for _ in range(4):
                await asyncio.gather(*(kv.push("w", np.ones(shape, np.float32)) for kv in stores))
                pulled = await asyncio.gather(*(kv.pull("w") for kv in stores))
            gc.collect()
            assert (init_value() is None) == let_go
            if let_go:
                assert server_books(cluster)[0].holds(entry.value)
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
    for value in pulled:
        np.testing.assert_array_equal(value, np.full(shape, 2, np.float32))
