"""The scheduler's status page over HTTP on 127.0.0.1: who may see it (the token, or a
login's cookie), what the login sets, and what heartbeats bring to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest

from akv.cluster import config as _config
from akv.cluster.scheduler import Scheduler
from akv.cluster.scheduler.status_page import COOKIE, MAX_LOGIN_BYTES
from akv_transport import client_ssl_context
from tests.akv.cluster.cluster import Cluster, close_all, free_port, job_env, wait_until
from tests.tls import make_certificates

pytestmark = pytest.mark.timeout(60)


class Page:
    """A browser-like client of one scheduler: it keeps cookies (also for 127.0.0.1) and
    follows no redirect."""

    def __init__(self, session: aiohttp.ClientSession, base: str, token: str) -> None:
        self.session = session
        self.base = base
        self.token = token

    async def get(self, path: str, token: str | None = None) -> tuple[int, dict, str]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with self.session.get(
            self.base + path, headers=headers, allow_redirects=False
        ) as response:
            return response.status, dict(response.headers), await response.text()

    async def login(self, token: str, **kwargs) -> tuple[int, aiohttp.ClientResponse, str]:
        async with self.session.post(
            self.base + "/login", data={"token": token}, allow_redirects=False, **kwargs
        ) as response:
            return response.status, response, await response.text()


async def started(env: dict[str, str]) -> Scheduler:
    scheduler = Scheduler(_config.from_env({**env, "AKV_ROLE": "scheduler"}))
    await scheduler.start()
    return scheduler


@pytest.fixture
async def page() -> AsyncIterator[tuple[Scheduler, Page]]:
    env = job_env(2, 1, free_port())
    scheduler = await started(env)
    jar = aiohttp.CookieJar(unsafe=True)
    try:
        async with aiohttp.ClientSession(cookie_jar=jar) as session:
            yield scheduler, Page(session, f"http://127.0.0.1:{scheduler.port}", env["AKV_TOKEN"])
    finally:
        await scheduler.stop()


async def test_without_token_or_login_the_page_redirects_and_its_json_is_401(page):
    _, client = page
    status, headers, _ = await client.get("/status")
    assert (status, headers["Location"]) == (303, "/login")
    status, headers, body = await client.get("/status.json")
    assert status == 401 and "log in at /login" in body
    assert headers["Cache-Control"] == "no-store"
    assert "script-src" not in headers["Content-Security-Policy"]  # default-src 'none'
    for wrong in ("wrong-token", ""):
        status, _, body = await client.get("/status.json", token=wrong)
        assert status == 401 and "missing or wrong token" in body


async def test_the_token_as_a_bearer_header_opens_the_page_and_its_json(page):
    _, client = page
    status, headers, body = await client.get("/status.json", token=client.token)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert '"role": "worker"' in body and client.token not in body
    status, headers, body = await client.get("/status", token=client.token)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<meta http-equiv="refresh" content="2">' in body
    assert 'data-state="not joined"' in body and client.token not in body


async def test_a_login_sets_an_http_only_strict_cookie_that_is_not_the_token(page):
    scheduler, client = page
    status, _, form = await client.get("/login")
    assert status == 200 and 'name="token" type="password"' in form
    status, response, body = await client.login("not-the-token")
    assert status == 401 and 'id="login-error"' in body
    assert "Set-Cookie" not in response.headers

    status, response, _ = await client.login(client.token)
    assert (status, response.headers["Location"]) == (303, "/status")
    cookie = response.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=") and client.token not in cookie
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= attributes
    assert "SameSite=Strict" in cookie and "secure" not in attributes
    session = response.cookies[COOKIE].value
    assert len(scheduler.status_page.sessions) == 1

    status, _, body = await client.get("/status")
    assert status == 200 and 'id="nodes"' in body and client.token not in body
    status, _, body = await client.get("/status.json")
    assert status == 200 and client.token not in body
    status, headers, _ = await client.get("/login")
    assert (status, headers["Location"]) == (303, "/status")

    async with client.session.post(client.base + "/logout", allow_redirects=False) as response:
        assert (response.status, response.headers["Location"]) == (303, "/login")
    assert len(scheduler.status_page.sessions) == 0
    # The session ended on the scheduler, not only in this client's jar.
    client.session.cookie_jar.update_cookies({COOKIE: session})
    status, _, _ = await client.get("/status")
    assert status == 303


async def test_a_forged_cookie_or_an_oversized_login_gets_nothing(page):
    _, client = page
    client.session.cookie_jar.update_cookies({COOKIE: "forged-session-id"})
    status, _, _ = await client.get("/status")
    assert status == 303
    status, _, _ = await client.get("/status.json")
    assert status == 401
    long_token = "x" * (MAX_LOGIN_BYTES + 1)
    status, response, _ = await client.login(long_token)
    assert status == 413 and "Set-Cookie" not in response.headers

    async def chunks():
        yield f"token={client.token}".encode()

    async with client.session.post(client.base + "/login", data=chunks()) as response:
        assert response.status == 413  # a body of unknown length


async def test_over_tls_the_cookie_is_secure(tmp_path):
    made = make_certificates(tmp_path)
    tls = {"AKV_TLS_CA": made["ca"], "AKV_TLS_CERT": made["cert"], "AKV_TLS_KEY": made["key"]}
    env = job_env(1, 1, free_port(), **tls)
    scheduler = await started(env)
    # The job's CA asks every client for a certificate it signed: a browser too.
    context = client_ssl_context(made["ca"], made["cert"], made["key"])
    try:
        async with aiohttp.ClientSession() as session:
            client = Page(session, f"https://127.0.0.1:{scheduler.port}", env["AKV_TOKEN"])
            status, response, _ = await client.login(client.token, ssl=context)
            assert status == 303
            assert "secure" in response.headers["Set-Cookie"].lower().replace(";", " ").split()
    finally:
        await scheduler.stop()


async def test_a_heartbeat_with_a_malformed_report_is_400_and_a_good_one_is_shown(page):
    scheduler, client = page
    headers = {"Authorization": f"Bearer {client.token}"}
    register = {"node_id": "w", "role": "worker", "host": "127.0.0.1", "port": 0, "wait": False}
    async with client.session.post(client.base + "/v1/register", json=register, headers=headers):
        pass
    bad = {"node_id": "w", "report": {"pushes": "many", "pulls": 0, "rounds": 0}}
    async with client.session.post(client.base + "/v1/heartbeat", json=bad, headers=headers) as r:
        assert r.status == 400 and "report.pushes must be an integer" in await r.text()
    good = {"node_id": "w", "report": {"pushes": 5, "pulls": 4, "rounds": 5}}
    async with client.session.post(client.base + "/v1/heartbeat", json=good, headers=headers) as r:
        assert r.status == 200
    worker = scheduler.status()["nodes"][2]
    assert (worker["role"], worker["pushes"], worker["pulls"], worker["rounds"]) == (
        "worker",
        5,
        4,
        5,
    )


async def test_a_running_jobs_heartbeats_bring_each_nodes_counts_to_the_page():
    with Cluster(2, 1) as cluster:
        stores = await cluster.workers()

        async def body(kv):
            await kv.init("w", np.zeros(4, np.float32))
            for _ in range(3):
                await kv.push("w", np.ones(4, np.float32))
                await kv.pull("w")

        await asyncio.gather(*(body(kv) for kv in stores))
        scheduler = cluster.scheduler
        assert scheduler is not None

        def counted() -> bool:
            rows = scheduler.status()["nodes"]
            return [row.get("rounds") for row in rows[1:]] == [3, 3, 3]

        await wait_until(counted, "every node reported three rounds")
        server, worker0, worker1 = scheduler.status()["nodes"][1:]
        assert (server["keys"], server["bytes"]) == (1, 16)
        assert (worker0["pushes"], worker0["pulls"], worker0["behind"]) == (3, 3, 0)
        assert worker1["state"] == "running"
        await close_all(stores)
