"""A real job's /metrics, /healthz and /readyz (docs/metrics.md), over real sockets on
127.0.0.1: the metrics parse with prometheus_client's own parser and move while the job
trains, they need the job's token, the probes do not, a server is ready once registered,
and a worker serves all three on AKV_METRICS_PORT."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import akv
from akv.cluster import config as _config
from akv.cluster.scheduler.service import Scheduler
from akv.cluster.server.service import ParameterServer
from tests.akv.cluster.cluster import Cluster, close_all, free_port, job_env

pytestmark = pytest.mark.timeout(60)

METRICS_DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
#: Bounds every wait on an answer in these tests.
WAIT_S = 10.0
NEVER_S = "3600"


async def get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        return response.status, await response.text()


async def scrape(port: int, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, by name and labels (prometheus_client's parser)."""
    status, text = await get(port, "/metrics", token)
    assert status == 200, text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The one sample ``name`` with these labels (among others)."""
    found = [
        v
        for (n, sample_labels), v in samples.items()
        if n == name and labels.items() <= dict(sample_labels).items()
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


async def steps(stores: list[akv.AsyncKVStore], count: int) -> None:
    """``count`` training steps of key 3 on every worker: push, then pull."""
    for _ in range(count):
        await asyncio.gather(*(kv.push(3, np.ones(256, np.float32)) for kv in stores))
        await asyncio.gather(*(kv.pull(3, out=np.empty(256, np.float32)) for kv in stores))


async def test_a_jobs_metrics_parse_and_move_while_it_trains():
    with Cluster(2, 1) as cluster:
        token = cluster.env["AKV_TOKEN"]
        assert cluster.scheduler is not None
        server, scheduler = cluster.servers[0].port, cluster.scheduler.port
        stores = await cluster.workers()
        try:
            await asyncio.gather(*(kv.init(3, np.zeros(256, np.float32)) for kv in stores))
            await steps(stores, 1)
            before = await scrape(server, token)
            await steps(stores, 3)
            after = await scrape(server, token)
            jobs = await scrape(scheduler, token)
        finally:
            await close_all(stores)
    labels = {"role": "server", "rank": "0"}

    def pushed(samples: dict[Any, float], name: str) -> float:
        """A push goes alone, or with a pull riding on it (pushpull)."""
        return sum(value(samples, name, op=op, **labels) for op in ("push", "pushpull"))

    assert pushed(after, "akv_requests_total") - pushed(before, "akv_requests_total") == 6
    moved = pushed(after, "akv_request_bytes_total") - pushed(before, "akv_request_bytes_total")
    assert moved == 6 * 256 * 4  # 3 steps of 2 workers
    rounds = [value(s, "akv_rounds_completed_total", **labels) for s in (before, after)]
    assert rounds == [1, 4]
    waits = [
        value(s, "akv_round_last_worker_wait_seconds_count", **labels) for s in (before, after)
    ]
    assert waits == [1, 4]
    tasks = [
        value(s, "akv_engine_tasks_total", outcome="completed", **labels) for s in (before, after)
    ]
    assert tasks[1] > tasks[0]
    assert value(after, "akv_workers_connected", **labels) == 2
    assert value(after, "akv_keys", kind="dense", **labels) == 1
    assert value(after, "akv_stored_bytes", **labels) == 256 * 4
    assert value(after, "akv_job_failed", **labels) == 0
    assert value(after, "process_cpu_seconds_total") > 0  # the process's own metrics
    assert value(jobs, "akv_nodes", node_role="worker", state="alive", role="scheduler") == 2
    assert value(jobs, "akv_nodes", node_role="server", state="alive") == 1
    assert value(jobs, "akv_job_assembled", rank="") == 1


async def test_metrics_need_the_token_and_the_probes_do_not():
    with Cluster(1, 1) as cluster:
        assert cluster.scheduler is not None
        (kv,) = await cluster.workers()  # the job assembles, and ends when it closes
        try:
            for port in (cluster.scheduler.port, cluster.servers[0].port):
                assert (await get(port, "/metrics"))[0] == 401
                assert (await get(port, "/metrics", "not-the-jobs-token-0123456789"))[0] == 401
                assert await get(port, "/healthz") == (200, "ok\n")
                assert await get(port, "/readyz") == (200, "ready\n")  # registered, listening
        finally:
            await kv.close()


async def test_a_server_is_ready_once_registered_with_the_scheduler():
    env = job_env(1, 1, free_port())
    server = ParameterServer(_config.from_env({**env, "AKV_ROLE": "server"}))
    starting = asyncio.ensure_future(server.start())  # no scheduler yet: it keeps trying
    scheduler = Scheduler(_config.from_env({**env, "AKV_ROLE": "scheduler"}))
    try:
        for _ in range(int(WAIT_S / 0.05)):
            if server.port:
                break
            await asyncio.sleep(0.05)
        assert server.port, "the server never listened"
        status, body = await get(server.port, "/readyz")
        assert (status, body) == (503, "not ready: not registered with the scheduler yet\n")
        assert await get(server.port, "/healthz") == (200, "ok\n")
        await scheduler.start()
        await asyncio.wait_for(starting, WAIT_S)
        assert await get(server.port, "/readyz") == (200, "ready\n")
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await server.stop()
        await scheduler.stop()


async def test_a_worker_whose_metrics_port_another_process_holds_is_a_config_error_naming_it():
    with Cluster(1, 1) as cluster, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**cluster.worker_env(0), "AKV_METRICS_PORT": str(port)}
        with pytest.raises(akv.ConfigError) as info:
            await asyncio.wait_for(akv.create_async("dist_sync", environ=env), WAIT_S)
        assert cluster.scheduler is not None
        verdict = cluster.scheduler.roster.failure
    message = str(info.value)
    # Named as itself, though it never registered (not "disconnected from <its session id>").
    assert verdict == f"worker 0 left the job: akv.create raised ConfigError: {message}", verdict
    assert message.startswith(f"AKV_METRICS_PORT={port}: cannot listen on 127.0.0.1:{port}: ")
    assert "address already in use" in message.lower()
    assert message.endswith("; give each worker of a host its own port (or 0 for any free one)")


async def test_a_worker_serves_metrics_and_probes_on_akv_metrics_port():
    with Cluster(2, 1) as cluster:
        port = free_port()
        token = cluster.env["AKV_TOKEN"]
        env = {**cluster.worker_env(0), "AKV_METRICS_PORT": str(port)}
        first = asyncio.ensure_future(akv.create_async("dist_sync", environ=env))
        stores: list[akv.AsyncKVStore] = []
        try:
            status = 0
            for _ in range(int(WAIT_S / 0.05)):  # listening while it waits for worker 1
                try:
                    status, body = await get(port, "/readyz")
                    break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            assert (status, body) == (503, "not ready: joining the job\n")
            assert await get(port, "/healthz") == (200, "ok\n")
            second = akv.create_async("dist_sync", environ=cluster.worker_env(1))
            stores = list(await asyncio.wait_for(asyncio.gather(first, second), WAIT_S))
            assert await get(port, "/readyz") == (200, "ready\n")
            assert (await get(port, "/metrics"))[0] == 401
            await asyncio.gather(*(kv.init(3, np.zeros(256, np.float32)) for kv in stores))
            before = await scrape(port, token)
            await steps(stores, 2)
            after = await scrape(port, token)
        finally:
            first.cancel()
            await close_all(stores)
        with pytest.raises(aiohttp.ClientConnectionError):  # closed with the store
            await get(port, "/healthz")
    labels = {"role": "worker", "rank": "0", "op": "pushpull"}
    sent = [value(s, "akv_requests_total", **labels) for s in (before, after)]
    assert sent[1] - sent[0] == 2
    timed = [value(s, "akv_request_duration_seconds_count", **labels) for s in (before, after)]
    assert timed[1] - timed[0] == 2
    answers = value(after, "akv_answer_bytes_total", **labels)
    assert answers - value(before, "akv_answer_bytes_total", **labels) == 2 * 256 * 4
    assert value(after, "akv_servers_connected", role="worker") == 1
    assert value(after, "akv_engine_tasks_total", outcome="completed", role="worker") > 0


async def test_checkpoints_show_in_the_servers_metrics(tmp_path):
    extra = {"AKV_CHECKPOINT_DIR": str(tmp_path), "AKV_CHECKPOINT_INTERVAL_S": NEVER_S}
    with Cluster(1, 1, **extra) as cluster:
        token = cluster.env["AKV_TOKEN"]
        (kv,) = await cluster.workers()
        try:
            await kv.init(3, np.zeros(256, np.float32))  # answered once a checkpoint holds it
            samples = await scrape(cluster.servers[0].port, token)
        finally:
            await kv.close()
    labels = {"role": "server", "rank": "0"}
    written = value(samples, "akv_checkpoints_total", **labels)
    assert written >= 1
    assert value(samples, "akv_checkpoint_duration_seconds_count", **labels) == written
    size = (tmp_path / "server-0.akvckpt").stat().st_size
    assert value(samples, "akv_checkpoint_bytes", **labels) == size
    assert value(samples, "akv_checkpoint_failures_total", **labels) == 0


def documented() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's table: each metric family's name (counters without ``_total``, as
    the parser names families) -> its type and the roles that serve it."""
    table = {}
    for name, kind, roles in re.findall(
        r"^\| `(akv_\w+)` \| (\w+) \|[^|]*\| ([\w, ]+) \|", METRICS_DOC.read_text(), re.M
    ):
        family = name.removesuffix("_total") if kind == "counter" else name
        table[family] = (kind, {role.strip() for role in roles.split(",")})
    return table


async def test_the_docs_list_every_metric_each_role_serves_and_no_other():
    port = free_port()
    with Cluster(1, 1) as cluster:
        assert cluster.scheduler is not None
        token = cluster.env["AKV_TOKEN"]
        env = {**cluster.worker_env(0), "AKV_METRICS_PORT": str(port)}
        kv = await akv.create_async("dist_sync", environ=env)
        try:
            texts = {
                role: (await get(p, "/metrics", token))[1]
                for role, p in (
                    ("scheduler", cluster.scheduler.port),
                    ("server", cluster.servers[0].port),
                    ("worker", port),
                )
            }
        finally:
            await kv.close()
    table = documented()
    assert len(table) > 25
    served: dict[str, set[str]] = {}
    for role, text in texts.items():
        for family in text_string_to_metric_families(text):
            if family.name.startswith("akv_"):
                assert family.name in table, f"{role} serves {family.name}, not in metrics.md"
                assert family.type == table[family.name][0], family.name
                served.setdefault(family.name, set()).add(role)
    assert served == {name: roles for name, (_, roles) in table.items()}
