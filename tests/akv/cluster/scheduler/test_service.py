"""The scheduler over HTTP on 127.0.0.1: the wire answers workers and servers read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from akv.cluster import config as _config
from akv.cluster.scheduler import Scheduler
from tests.akv.cluster.cluster import free_port, job_env

pytestmark = pytest.mark.timeout(60)


class Client:
    """Raw requests to one scheduler: (status, JSON answer)."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session = session
        self.base = f"http://127.0.0.1:{port}"

    async def post(self, path: str, body: Any = None, data: bytes | None = None) -> tuple:
        async with self.session.post(self.base + path, json=body, data=data) as response:
            return response.status, await response.json()

    async def get(self, path: str) -> tuple:
        async with self.session.get(self.base + path) as response:
            return response.status, await response.json()

    async def register(self, node_id: str, role: str, **extra: Any) -> tuple:
        body = {"node_id": node_id, "role": role, "host": "127.0.0.1", "port": 0, "pid": 1}
        return await self.post("/v1/register", {**body, **extra})


async def scheduler_and_client(
    num_workers: int, num_servers: int
) -> AsyncIterator[tuple[Scheduler, Client]]:
    env = job_env(num_workers, num_servers, free_port(), AKV_ROLE="scheduler")
    scheduler = Scheduler(_config.from_env(env))
    await scheduler.start()
    headers = {"Authorization": f"Bearer {env['AKV_TOKEN']}"}
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            yield scheduler, Client(session, scheduler.port)
    finally:
        await scheduler.stop()


@pytest.fixture
async def one_each() -> AsyncIterator[tuple[Scheduler, Client]]:
    async for pair in scheduler_and_client(1, 1):
        yield pair


@pytest.fixture
async def two_workers() -> AsyncIterator[tuple[Scheduler, Client]]:
    async for pair in scheduler_and_client(2, 1):
        yield pair


# ------------------------------------------------------------------ registration


async def test_a_node_that_does_not_wait_gets_its_rank_and_what_is_missing(one_each):
    _, client = one_each
    status, answer = await client.register("w", "worker", wait=False)
    assert status == 202
    assert answer["rank"] == 0
    assert answer["waiting"].startswith("0 of 1 workers and 1 of 1 servers have not registered")
    status, answer = await client.register("s", "server", port=4000, wait=False)
    assert (status, answer) == (
        200,
        {
            "rank": 0,
            "servers": [{"rank": 0, "host": "127.0.0.1", "port": 4000, "restartable": False}],
            "finished": [],
            "restart": False,  # (a server restarted within its job is told so)
        },
    )


async def test_a_waiting_registration_is_answered_when_the_last_node_registers(one_each):
    _, client = one_each
    worker = asyncio.ensure_future(client.register("w", "worker"))
    try:
        await client.register("s", "server", port=4000, wait=False)
        status, answer = await asyncio.wait_for(worker, 30)
    finally:
        worker.cancel()
    assert status == 200
    assert answer["servers"] == [
        {"rank": 0, "host": "127.0.0.1", "port": 4000, "restartable": False}
    ]


async def test_a_servers_instance_reaches_the_workers_address_book(one_each):
    _, client = one_each
    instance = "0123456789abcdef" * 2  # (what its app drew: workers sign their streams for it)
    await client.register("s", "server", port=4000, wait=False, instance=instance)
    status, answer = await client.register("w", "worker", wait=False)
    assert status == 200
    assert answer["servers"] == [
        {"rank": 0, "host": "127.0.0.1", "port": 4000, "restartable": False, "instance": instance}
    ]


async def test_a_taken_rank_is_refused_with_422_naming_the_holder(two_workers):
    _, client = two_workers
    await client.register("a", "worker", rank=1, wait=False)
    status, answer = await client.register("b", "worker", rank=1, wait=False)
    assert status == 422
    assert answer == {
        "error": "worker rank 1 is already taken by worker 1 (pid 1 on 127.0.0.1); a worker "
        "from 127.0.0.1 (pid 1) asked for it too"
    }


async def test_a_role_that_does_not_register_is_refused_with_422(one_each):
    _, client = one_each
    status, answer = await client.register("x", "scheduler", wait=False)
    assert status == 422
    assert "cannot register role 'scheduler'" in answer["error"]


# ------------------------------------------------------------------ barriers and heartbeats


async def test_a_barrier_passes_once_every_worker_joined(two_workers):
    _, client = two_workers
    await client.register("a", "worker", wait=False)
    await client.register("b", "worker", wait=False)
    first = asyncio.ensure_future(client.post("/v1/barrier", {"node_id": "a", "number": 1}))
    try:
        second = await client.post("/v1/barrier", {"node_id": "b", "number": 1})
        assert await asyncio.wait_for(first, 30) == (200, {"passed": 1})
    finally:
        first.cancel()
    assert second == (200, {"passed": 1})


async def test_a_barrier_from_a_server_is_refused_with_422_not_400(one_each):
    # MembershipError is a ValueError: the refusal must not be taken for a malformed body.
    _, client = one_each
    await client.register("s", "server", wait=False)
    status, answer = await client.post("/v1/barrier", {"node_id": "s", "number": 1})
    assert status == 422
    assert "called a barrier; only workers do" in answer["error"]


async def test_a_heartbeat_or_goodbye_from_an_unknown_node_is_refused_with_422(one_each):
    _, client = one_each
    for path in ("/v1/heartbeat", "/v1/finish"):
        status, answer = await client.post(path, {"node_id": "ghost"})
        assert (status, answer) == (422, {"error": "unknown node id 'ghost': register first"})


@pytest.mark.parametrize(
    ("path", "body", "data", "message"),
    [
        ("/v1/register", {"role": "worker"}, None, "malformed registration: KeyError('node_id')"),
        (
            "/v1/register",
            {"node_id": "w", "role": "worker", "host": "h", "port": "x"},
            None,
            "malformed registration: ValueError",
        ),
        ("/v1/barrier", {"node_id": "w", "number": None}, None, "malformed barrier request"),
        ("/v1/heartbeat", None, b"{not json", "the body is not JSON"),
        ("/v1/finish", [1, 2], None, "the body must be a JSON object"),
        ("/v1/lost", {"reporter": "server 0", "role": "worker"}, None, "malformed report"),
    ],
)
async def test_a_malformed_body_is_400(one_each, path, body, data, message):
    _, client = one_each
    status, answer = await client.post(path, body, data=data)
    assert status == 400
    assert answer["error"].startswith(message)


# ------------------------------------------------------------------ failure and the end


async def test_after_a_lost_node_registrations_are_refused_and_heartbeats_carry_the_reason(
    two_workers,
):
    scheduler, client = two_workers
    await client.register("a", "worker", wait=False)
    await client.register("s", "server", wait=False)
    status, answer = await client.post(
        "/v1/lost",
        {"reporter": "server 0", "role": "worker", "rank": 0, "detail": "connection reset"},
    )
    reason = (
        "worker 0 (pid 1 on 127.0.0.1) disconnected from server 0 without closing: connection reset"
    )
    assert (status, answer) == (200, {"failure": reason})
    status, answer = await client.register("b", "worker", wait=False)
    assert (status, answer) == (409, {"error": f"the job failed: {reason}"})
    status, answer = await client.post("/v1/barrier", {"node_id": "a", "number": 1})
    assert (status, answer) == (409, {"error": f"the job failed: {reason}"})
    assert await client.post("/v1/heartbeat", {"node_id": "s"}) == (
        200,
        {"failure": reason, "stop": True},
    )
    assert scheduler.roster.failure == reason


async def test_the_scheduler_exits_0_once_the_workers_and_then_the_servers_finished(one_each):
    scheduler, client = one_each
    await client.register("w", "worker", wait=False)
    await client.register("s", "server", wait=False)
    assert await client.post("/v1/finish", {"node_id": "w"}) == (200, {"stop": True})
    assert await client.post("/v1/heartbeat", {"node_id": "s"}) == (
        200,
        {"failure": None, "stop": True},
    )
    run = asyncio.ensure_future(scheduler.run())
    try:
        await client.post("/v1/finish", {"node_id": "s"})
        assert await asyncio.wait_for(run, 30) == 0
    finally:
        run.cancel()


async def test_status_lists_every_node(one_each):
    _, client = one_each
    await client.register("w", "worker", wait=False)
    status, answer = await client.get("/v1/status")
    assert status == 200
    assert answer == {
        "failure": None,
        "complete": False,
        "nodes": [
            {
                "role": "worker",
                "rank": 0,
                "host": "127.0.0.1",
                "port": 0,
                "pid": 1,
                "finished": False,
                "dead": False,
            }
        ],
    }
