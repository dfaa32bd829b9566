"""A server's checkpoints in a running job: when it writes them, what they hold, how the
workers drop the pushes a checkpoint holds (``DURABLE``) and bound what they keep
(``AKV_RETAIN_BYTES``), and how a restarted server restores one and takes its rank over.

The scheduler and the servers run on the cluster's loop thread (see ``cluster.py``), the
workers are AsyncKVStores on the test's loop, all on 127.0.0.1. A server "dies" the way
a killed process would: its listener and streams go, its heartbeats stop, its lock is
released, and it says no goodbye. Every wait is bounded.

The optimizer is SGD with ``learning_rate=0.5, momentum=0.5`` and the gradients are small
integers, so every value in these short runs is a dyadic rational that float32 holds
exactly: the expected weights are computed here, and compared for equality.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

import akv
from akv import (
    CheckpointError,
    ConfigError,
    InvalidArgumentError,
    PeerLostError,
    ShapeMismatchError,
)
from akv.cluster import config as _config
from akv.cluster.protocol import JOB_FAILED_EXIT, Op
from akv.cluster.scheduler.service import Scheduler
from akv.cluster.server.checkpoint import (
    KeyRecord,
    RowRecord,
    Snapshot,
    read_snapshot,
    write_snapshot,
)
from akv.cluster.server.command import run_server
from akv.cluster.server.service import ParameterServer
from tests.akv.cluster.cluster import Cluster, free_port, job_env, wait_until

pytestmark = pytest.mark.timeout(60)

LEARNING_RATE = 0.5
MOMENTUM = 0.5
#: The keys of the training runs, of two dtypes and shapes.
INITS = {
    "w": np.arange(-8, 8, dtype=np.float32) / 4,
    "b": np.arange(6, dtype=np.float64).reshape(2, 3),
}
#: Long enough that the timer never writes during a test (checkpoints come on request).
NEVER_S = "3600"
WAIT_S = 10.0
#: A pause between the rounds of the retain test: its workers, servers and checkpoint
#: threads share one process (and its GIL), where a checkpoint's hops between threads
#: would otherwise take as long as dozens of back-to-back rounds.
PACE_S = 0.005


def sgd() -> akv.optimizer.SGD:
    return akv.optimizer.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM)


def gradient(key: str, rank: int, step: int) -> np.ndarray:
    """Worker ``rank``'s gradient of ``key`` at ``step`` (small integers)."""
    base = np.arange(INITS[key].size, dtype=INITS[key].dtype).reshape(INITS[key].shape) % 5
    return (base - 2) * (rank + 1) + (step % 3)


def expected_weights(steps: int, num_workers: int) -> dict[str, np.ndarray]:
    """The weights after ``steps`` dist_sync rounds of SGD with momentum on the summed
    gradients: ``mom = momentum * mom - lr * g; w += mom`` (exact in these runs)."""
    out = {}
    for key, init in INITS.items():
        weight = init.astype(np.float64)
        mom = np.zeros_like(weight)
        for step in range(steps):
            summed = sum(gradient(key, rank, step) for rank in range(num_workers))
            mom = MOMENTUM * mom - LEARNING_RATE * summed
            weight = weight + mom
        out[key] = weight.astype(init.dtype)
    return out


async def each(stores, body: Callable[[akv.AsyncKVStore], Awaitable]) -> list:
    """``body(kv)`` on every worker at once; the results by rank."""
    results = await asyncio.wait_for(asyncio.gather(*(body(kv) for kv in stores)), 30)
    return [r for _, r in sorted(zip([kv.rank for kv in stores], results, strict=True))]


@contextlib.asynccontextmanager
async def running(cluster: Cluster) -> AsyncIterator[list[akv.AsyncKVStore]]:
    """Every worker's store, closed at the end."""
    stores = await asyncio.wait_for(cluster.workers(), 30)
    try:
        yield stores
    finally:
        await asyncio.wait_for(asyncio.gather(*(kv.close() for kv in stores)), 30)


async def start_training(kv: akv.AsyncKVStore) -> None:
    for key, init in INITS.items():
        await kv.init(key, init)
    await kv.set_optimizer(sgd())


async def train(kv: akv.AsyncKVStore, steps: range) -> dict[str, np.ndarray]:
    """Push each key's gradient and pull it back, once per step; the last values pulled."""
    pulled = {}
    for step in steps:
        for key in INITS:
            await kv.push(key, gradient(key, kv.rank, step))
        for key in INITS:
            pulled[key] = await kv.pull(key)
    return pulled


def pushed_bytes(steps: int) -> int:
    """What one worker's link keeps of ``steps`` rounds of pushes (one server)."""
    return steps * sum(init.nbytes for init in INITS.values())


def retained(stores) -> list[int]:
    return [link.retained_bytes for kv in stores for link in kv._backend.links]


def server_env(cluster: Cluster, rank: int) -> dict[str, str]:
    return {**cluster.env, "AKV_ROLE": "server", "AKV_RANK": str(rank), "AKV_PORT": "0"}


# ---------------------------------------------------------------------- writing


async def test_a_server_writes_its_keys_values_and_optimizer_then_nothing_while_idle(tmp_path):
    interval = 0.1
    with Cluster(
        2, 1, AKV_CHECKPOINT_DIR=str(tmp_path), AKV_CHECKPOINT_INTERVAL_S=str(interval)
    ) as cluster:
        server = cluster.servers[0]
        async with running(cluster) as stores:
            await each(stores, start_training)
            pulled = await each(stores, lambda kv: train(kv, range(2)))
            assert all(link.restartable for kv in stores for link in kv._backend.links)
            # Once the workers dropped every push (DURABLE), a checkpoint after the last one
            # is written (read_snapshot, which removes a writer's temporary files, waits).
            await wait_until(lambda: retained(stores) == [0, 0], "a checkpoint after round 2")
            assert (tmp_path / "server-0.akvckpt").is_file()
            generation = server.checkpoints.generation
            snapshot = read_snapshot(tmp_path, 0)
            assert snapshot is not None and snapshot.generation == generation >= 1
            assert snapshot.num_workers == 2 and snapshot.store_type == "dist_sync"
            assert {r.key for r in snapshot.keys} == set(INITS)
            expected = expected_weights(2, 2)
            for record in snapshot.keys:
                assert record.closed_round == 2
                assert record.tags == {0: 2, 1: 2}  # each worker's two pushes of the key
                assert record.value.dtype == INITS[record.key].dtype
                np.testing.assert_array_equal(record.value, expected[record.key])
                for values in pulled:
                    np.testing.assert_array_equal(record.value, values[record.key])
            assert snapshot.optimizer_config == sgd().get_config()
            assert snapshot.optimizer_states  # the momenta

            # Idle: no call changes anything, so no interval writes a checkpoint.
            await asyncio.sleep(5 * interval)
            assert server.checkpoints.generation == generation
            assert read_snapshot(tmp_path, 0).generation == generation


# ---------------------------------------------------------------------- DURABLE


async def test_durable_drops_the_pushes_a_checkpoint_holds_and_keeps_an_open_rounds(tmp_path):
    """A push in a round still open is not in the checkpoint's values: it stays kept."""
    with Cluster(2, 1, AKV_CHECKPOINT_DIR=str(tmp_path), AKV_CHECKPOINT_INTERVAL_S=NEVER_S) as (
        cluster
    ):
        server = cluster.servers[0]
        async with running(cluster) as stores:
            first, second = sorted(stores, key=lambda kv: kv.rank)
            await each(stores, start_training)
            inits = server.checkpoints.generation  # an init is answered once it is held
            assert inits >= 1
            await each(stores, lambda kv: train(kv, range(2)))
            assert retained([first, second]) == [pushed_bytes(2)] * 2  # no checkpoint: all kept
            assert server.checkpoints.generation == inits

            await first.push("w", gradient("w", 0, 2))  # round 3 of "w" waits for worker 1
            await first._backend.links[0].request(Op.CHECKPOINT, timeout_s=WAIT_S)
            assert server.checkpoints.generation == inits + 1
            open_push = INITS["w"].nbytes
            await wait_until(
                lambda: retained([first, second]) == [open_push, 0], "DURABLE to both workers"
            )

            await second.push("w", gradient("w", 1, 2))  # closes round 3
            await asyncio.gather(first.pull("w"), second.pull("w"))
            await second._backend.links[0].request(Op.CHECKPOINT, timeout_s=WAIT_S)
            await wait_until(lambda: retained(stores) == [0, 0], "DURABLE after round 3")
            snapshot = read_snapshot(tmp_path, 0)
            assert snapshot is not None and snapshot.generation == inits + 2
            assert {r.key: r.closed_round for r in snapshot.keys} == {"w": 3, "b": 2}


async def test_past_retain_bytes_the_workers_ask_for_checkpoints_and_keep_little(tmp_path):
    bound = 4096
    elements = 512
    push_bytes = elements * 4
    steps = 60
    with Cluster(
        2,
        1,
        AKV_CHECKPOINT_DIR=str(tmp_path),
        AKV_CHECKPOINT_INTERVAL_S=NEVER_S,
        AKV_RETAIN_BYTES=str(bound),
    ) as cluster:
        kept: list[list[int]] = []

        async def body(kv):
            await kv.init("g", np.zeros(elements, np.float32))
            link = kv._backend.links[0]
            seen = []
            for step in range(steps):
                await kv.push("g", np.full(elements, kv.rank + step, np.float32))
                seen.append(link.retained_bytes)
                await kv.pull("g")
                # A checkpoint asked for is written while the steps go on; how many steps
                # that takes depends on the machine's load, so the next step waits for it.
                await wait_until(lambda: not link.asked_checkpoint, "the checkpoint asked for")
                await asyncio.sleep(PACE_S)
            kept.append(seen)
            return await kv.pull("g")

        async with running(cluster) as stores:
            for value in await each(stores, body):
                np.testing.assert_array_equal(value, np.full(elements, 2 * (steps - 1) + 1))
        generation = cluster.servers[0].checkpoints.generation
        most = max(max(seen) for seen in kept)
        assert generation >= 5
        assert most <= bound + 8 * push_bytes, kept
        assert steps * push_bytes > 5 * most  # much more was pushed than was kept


# ---------------------------------------------------------------------- restarting


async def _die(cluster: Cluster, rank: int) -> None:
    """Server ``rank`` stops as a killed process would: its listener and streams go, its
    heartbeats and timers stop, the OS releases its lock; it says goodbye to nobody."""
    server = cluster.servers[rank]
    server.state.stopping = True  # its stop() (from run()'s end, or the cluster's) does nothing
    runner, server._runner = server._runner, None
    for site in list(runner.sites):
        await site.stop()
    for link in list(server.links.values()):
        link.protocol.abort()
    run = cluster._tasks[1 + rank]  # the scheduler's run(), then each server's
    run.cancel()
    for task in list(server._tasks):
        task.cancel()
    await asyncio.wait([run, *server._tasks], timeout=WAIT_S)
    await server.engine.aclose()
    server.checkpoints.close()
    await server.membership.close()


async def _restart(cluster: Cluster, rank: int) -> tuple[ParameterServer, dict]:
    """A new server ``rank`` with the same directory, on a new port; what it restored."""
    server = ParameterServer(_config.from_env(server_env(cluster, rank)))
    cluster.servers.append(server)  # the cluster stops it at the end
    await server.start()
    restored = {key: entry.rounds.closed_round for key, entry in server.state.entries.items()}
    cluster._tasks.append(asyncio.ensure_future(server.run()))
    return server, restored


async def test_a_restarted_server_restores_takes_its_rank_over_and_the_job_goes_on(tmp_path):
    with Cluster(2, 1, AKV_CHECKPOINT_DIR=str(tmp_path), AKV_CHECKPOINT_INTERVAL_S=NEVER_S) as (
        cluster
    ):
        old = cluster.servers[0]
        async with running(cluster) as stores:
            await each(stores, start_training)
            await each(stores, lambda kv: train(kv, range(3)))
            await stores[0]._backend.links[0].request(Op.CHECKPOINT, timeout_s=WAIT_S)
            await wait_until(lambda: retained(stores) == [0, 0], "DURABLE after round 3")
            await each(stores, lambda kv: train(kv, range(3, 5)))  # not in the checkpoint
            assert retained(stores) == [pushed_bytes(2)] * 2

            cluster.thread.run(_die(cluster, 0), timeout=30)
            new, restored = cluster.thread.run(_restart(cluster, 0), timeout=30)
            assert restored == {"w": 3, "b": 3}  # the checkpoint's rounds; 4 and 5 are resent
            assert new.port != old.port
            assert cluster.scheduler.roster.restarts == {0: 1}

            # Rounds 6 to 8: the workers find the new port, resend rounds 4 and 5, go on.
            pulled = await each(stores, lambda kv: train(kv, range(5, 8)))
            expected = expected_weights(8, 2)
            for values in pulled:
                for key, value in values.items():
                    np.testing.assert_array_equal(value, expected[key])
            links = [kv._backend.links[0] for kv in stores]
            assert [(link.port, link.reconnects) for link in links] == [(new.port, 1)] * 2
            closed = {key: e.rounds.closed_round for key, e in new.state.entries.items()}
            assert closed == {"w": 8, "b": 8}
            assert new.state.failure is None and new.state.duplicates == 0


@pytest.mark.parametrize("checkpointed", ["nothing", "the keys"])
async def test_inits_and_the_optimizer_set_after_the_last_checkpoint_survive_a_restart(
    tmp_path, checkpointed
):
    with Cluster(2, 1, AKV_CHECKPOINT_DIR=str(tmp_path), AKV_CHECKPOINT_INTERVAL_S=NEVER_S) as (
        cluster
    ):
        async with running(cluster) as stores:
            for key, init in INITS.items():
                await each(stores, lambda kv, key=key, init=init: kv.init(key, init))
            if checkpointed == "the keys":
                await stores[0]._backend.links[0].request(Op.CHECKPOINT, timeout_s=WAIT_S)
            await each(stores, lambda kv: kv.set_optimizer(sgd()))
            await each(stores, lambda kv: train(kv, range(2)))

            cluster.thread.run(_die(cluster, 0), timeout=30)
            cluster.thread.run(_restart(cluster, 0), timeout=30)
            pulled = await each(stores, lambda kv: train(kv, range(2, 4)))
            expected = expected_weights(4, 2)
            for values in pulled:
                for key, value in values.items():
                    np.testing.assert_array_equal(value, expected[key])


async def test_a_second_server_for_a_running_ranks_directory_is_refused(tmp_path):
    with Cluster(1, 1, AKV_CHECKPOINT_DIR=str(tmp_path), AKV_CHECKPOINT_INTERVAL_S=NEVER_S) as (
        cluster
    ):

        async def second() -> None:
            server = ParameterServer(_config.from_env(server_env(cluster, 0)))
            try:
                await server.start()
            finally:
                await server.stop()

        async with running(cluster) as (kv,):
            await kv.init(0, np.zeros(3, np.float32))
            with pytest.raises(CheckpointError, match=r"server-0\.lock is locked by another"):
                cluster.thread.run(second(), timeout=30)
            assert len(cluster.scheduler.roster.nodes) == 2  # it never registered
            assert cluster.scheduler.roster.restarts == {}
            await kv.push(0, np.ones(3, np.float32))  # the first one goes on serving
            np.testing.assert_array_equal(await kv.pull(0), np.ones(3, np.float32))
            assert kv._backend.links[0].reconnects == 0


async def test_a_checkpoint_of_a_job_with_other_workers_is_refused_at_restore(tmp_path):
    snapshot = Snapshot(
        rank=0,
        num_workers=3,
        store_type="dist_sync",
        generation=4,
        keys=[KeyRecord("w", np.ones(4, np.float32), 2, {0: 2, 1: 2, 2: 2}, {0: 2, 1: 2, 2: 2})],
        optimizer_config=None,
        optimizer_states=None,
        durable_seqs={0: 9, 1: 9, 2: 9},
    )
    write_snapshot(tmp_path, snapshot)
    env = job_env(2, 1, free_port(), AKV_CHECKPOINT_DIR=str(tmp_path))
    server = ParameterServer(_config.from_env({**env, "AKV_ROLE": "server", "AKV_RANK": "0"}))
    try:
        with pytest.raises(CheckpointError, match="a job with 3 workers, this job has 2"):
            server.checkpoints.restore()
        assert server.state.entries == {}
    finally:
        server.checkpoints.close()
        await server.engine.aclose()


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "a byte flipped",
        "of another job",
        "of another server count",
        "of an older file of another server count",
    ],
)
async def test_a_server_whose_checkpoint_cannot_be_used_exits_so_that_nobody_restarts_it(
    tmp_path, damage, caplog
):
    """A damaged checkpoint (or one of a job with other workers) is read again by every
    restart: the server exits JOB_FAILED_EXIT, which akv-launch never restarts, naming the
    file, instead of 1 (restarted up to --max-restarts for nothing)."""
    snapshot = Snapshot(
        rank=0,
        num_workers=3 if damage == "of another job" else 2,
        store_type="dist_sync",
        generation=4,
        keys=[KeyRecord("w", np.ones(4, np.float32), 2, {0: 2, 1: 2}, {0: 2, 1: 2})],
        optimizer_config=None,
        optimizer_states=None,
        durable_seqs={0: 9, 1: 9},
        # Rows [0, 5) of 10: server 0's of a job with 2 servers; this job has 1.
        row_keys=[
            RowRecord(
                "emb",
                (10, 2),
                0,
                5 if "server count" in damage else 10,
                np.array([1], np.int64),
                np.ones((1, 2), np.float32),
                2,
                {},
                {},
            )
        ],
        num_servers=2 if damage == "of another server count" else None,
    )
    path = write_snapshot(tmp_path, snapshot)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-7]
    elif damage == "a byte flipped":
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    env = job_env(2, 1, free_port(), AKV_CHECKPOINT_DIR=str(tmp_path))
    config = _config.from_env({**env, "AKV_ROLE": "server", "AKV_RANK": "0"})
    scheduler = Scheduler(_config.from_env({**env, "AKV_ROLE": "scheduler"}))
    await scheduler.start()
    try:
        assert await asyncio.wait_for(run_server(config), 30) == JOB_FAILED_EXIT
        verdict = scheduler.roster.failure
    finally:
        await scheduler.stop()
    expected = {
        "truncated": "server-0.akvckpt",
        "a byte flipped": "server-0.akvckpt",
        "of another job": "workers, this job has 2",
        "of another server count": "a job with 2 servers, this job has 1",
        "of an older file of another server count": "holds rows [0, 5) of key 'emb'; with 1 "
        "servers this server holds [0, 10)",
    }[damage]
    assert expected in caplog.text
    assert "no restart mends it" in caplog.text
    # The job's verdict names the cause, not only the exit the launcher sees.
    assert verdict is not None and verdict.startswith("server 0 could not use its checkpoint")
    assert expected in verdict


async def test_a_server_whose_checkpoint_is_locked_exits_1_and_may_be_restarted(tmp_path):
    """The lock of a rank's directory held by another process is no damage: that process
    may be gone by the next restart."""
    env = job_env(2, 1, free_port(), AKV_CHECKPOINT_DIR=str(tmp_path))
    config = _config.from_env({**env, "AKV_ROLE": "server", "AKV_RANK": "0"})
    holder = ParameterServer(config)
    holder.checkpoints.restore()  # takes the lock
    try:
        assert await asyncio.wait_for(run_server(config), 30) == 1
    finally:
        holder.checkpoints.close()
        await holder.engine.aclose()


# ---------------------------------------------------------------------- configuration


def test_a_checkpoint_dir_without_a_rank_is_a_config_error(tmp_path):
    env = job_env(2, 1, free_port(), AKV_CHECKPOINT_DIR=str(tmp_path), AKV_ROLE="server")
    with pytest.raises(ConfigError, match="AKV_CHECKPOINT_DIR is set but AKV_RANK is not"):
        _config.from_env(env)
    config = _config.from_env({**env, "AKV_RANK": "0"})
    assert config.checkpoint_dir == str(tmp_path) and config.rank == 0


async def test_a_checkpoint_request_to_a_server_without_a_directory_is_refused():
    with Cluster(1, 1) as cluster:
        async with running(cluster) as (kv,):
            link = kv._backend.links[0]
            assert not link.restartable
            with pytest.raises(InvalidArgumentError, match="server 0 writes no checkpoints"):
                await link.request(Op.CHECKPOINT, timeout_s=WAIT_S)
            await kv.init(0, np.zeros(3, np.float32))  # the stream goes on
            await kv.push(0, np.ones(3, np.float32))
            np.testing.assert_array_equal(await kv.pull(0), np.ones(3, np.float32))
            assert link.retained_bytes == 0
        assert cluster.servers[0].checkpoints is None


async def test_a_split_keys_init_is_checked_by_its_declared_shape_in_a_job_and_the_next(
    tmp_path,
):
    """A key split over the servers is a flat slice on each: its init is checked against
    the shape rank 0 declared, within a job and by a new job on the checkpoint directory,
    not only by its element count (a (32, 64) init took a (2048,) key's values)."""
    env = {
        "AKV_CHECKPOINT_DIR": str(tmp_path),
        "AKV_CHECKPOINT_INTERVAL_S": NEVER_S,
        "AKV_BIGARRAY_BOUND": "1024",
    }
    with Cluster(2, 2, **env) as cluster:
        async with running(cluster) as stores:
            first, second = sorted(stores, key=lambda kv: kv.rank)
            refused = await asyncio.gather(
                first.init("split", np.ones(2048, np.float32)),
                second.init("split", np.ones((32, 64), np.float32)),
                return_exceptions=True,
            )
            assert refused[0] is None and isinstance(refused[1], ShapeMismatchError)
            assert "(32, 64)" in str(refused[1]) and "(2048,)" in str(refused[1])
            await second.init("split", np.ones(2048, np.float32))
            await asyncio.gather(*(kv.push("split", np.ones(2048, np.float32)) for kv in stores))
    with Cluster(2, 2, **env) as cluster:
        async with running(cluster) as stores:
            refused = await asyncio.gather(
                *(kv.init("split", np.zeros((32, 64), np.float32)) for kv in stores),
                return_exceptions=True,
            )
            for error in refused:
                assert isinstance(error, ShapeMismatchError), refused
                assert "restored it from its checkpoint" in str(error), error
                assert "(2048,)" in str(error) and "(32, 64)" in str(error), error
            await asyncio.gather(*(kv.init("split", np.zeros(2048, np.float32)) for kv in stores))
            for kv in stores:  # the restored sum of the first job's two pushes
                np.testing.assert_array_equal(await kv.pull("split"), np.full(2048, 2.0))


async def test_a_job_whose_servers_restore_files_of_different_moments_fails_as_it_assembles(
    tmp_path,
):
    """Server 1's file put back from an earlier moment (as when a job failed with a server
    killed, its last file older than the others', then started again on its directory):
    the parts of a split key would mix rounds, so the job fails, naming them."""
    env = {
        "AKV_CHECKPOINT_DIR": str(tmp_path),
        "AKV_CHECKPOINT_INTERVAL_S": NEVER_S,
        "AKV_BIGARRAY_BOUND": "1024",
    }

    async def one_push(cluster: Cluster) -> None:
        async with running(cluster) as stores:
            await asyncio.gather(*(kv.init("split", np.zeros(2048, np.float32)) for kv in stores))
            await asyncio.gather(*(kv.push("split", np.ones(2048, np.float32)) for kv in stores))

    with Cluster(2, 2, **env) as cluster:
        await one_push(cluster)
    earlier = (tmp_path / "server-1.akvckpt").read_bytes()
    with Cluster(2, 2, **env) as cluster:
        await one_push(cluster)
    (tmp_path / "server-1.akvckpt").write_bytes(earlier)
    with Cluster(2, 2, **env) as cluster:
        with pytest.raises(PeerLostError, match="different points in time") as failed:
            await asyncio.wait_for(cluster.workers(), 30)
        assert "key 'split'" in str(failed.value) and "server-1.akvckpt" in str(failed.value)
    # Accepted once, the parts go on from where they are, their rounds since counted from
    # there: the next job on the directory needs no override.
    with Cluster(2, 2, **env, AKV_ACCEPT_MIXED_RESTORE="1") as cluster:
        await one_push(cluster)
    with Cluster(2, 2, **env) as cluster:
        async with running(cluster) as stores:
            await asyncio.gather(*(kv.init("split", np.zeros(2048, np.float32)) for kv in stores))
            # (no optimizer: a round's sum is the value, on each server's part alike)
            np.testing.assert_array_equal(await stores[0].pull("split"), np.full(2048, 2.0))
