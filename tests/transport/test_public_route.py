"""Routes that answer without the token (public_route), over a real socket on 127.0.0.1:
only a GET or HEAD of the route itself; every other method, path and spelling of another
route still needs the token."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from akv_transport import create_app, public_route, serve
from tests.transport.test_http_hostile import exchange, request_bytes

pytestmark = pytest.mark.timeout(60)

TOKEN = "public-route-test-token-0123456789"


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = create_app(TOKEN)

    async def probe(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def secret(request: web.Request) -> web.Response:
        return web.Response(text="secret\n")

    public_route(app, "/probe", probe)
    app.router.add_get("/secret", secret)
    app.router.add_post("/probe/write", secret)
    runner, bound = await serve(app, "127.0.0.1", 0)
    try:
        yield bound
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_public_route_answers_without_the_token(port, method):
    status, answer = await exchange(port, request_bytes("/probe", method=method, token=b""))
    assert status == 200
    if method == "GET":
        assert answer.endswith(b"\r\n\r\nok\n")


async def test_a_public_route_answers_with_any_authorization_too(port):
    status, _ = await exchange(port, request_bytes("/probe", token=b"wrong"))
    assert status == 200


@pytest.mark.parametrize(
    "path", ["/secret", "/probe/../secret", "/probe/%2e%2e/secret", "/probe/write", "/nothing"]
)
async def test_every_other_route_needs_the_token(port, path):
    status, answer = await exchange(port, request_bytes(path, token=b""))
    assert status == 401, answer
    assert b"secret" not in answer.split(b"\r\n\r\n", 1)[1]


async def test_another_method_on_a_public_path_needs_the_token(port):
    status, _ = await exchange(port, request_bytes("/probe", method="POST", token=b""))
    assert status == 401
    status, _ = await exchange(port, request_bytes("/probe", method="POST", token=TOKEN.encode()))
    assert status == 405


async def test_the_token_still_opens_the_other_routes(port):
    status, answer = await exchange(port, request_bytes("/secret", token=TOKEN.encode()))
    assert status == 200 and answer.endswith(b"secret\n")


class _Server:
    """Stands in for a server whose handlers are its bound methods (as akv's are)."""

    def __init__(self) -> None:
        self.values = bytearray(1 << 20)

    async def secret(self, request: web.Request) -> web.Response:
        return web.Response(text="secret\n")


async def test_a_stopped_app_leaves_no_handler_alive():
    # aiohttp caches every handler it wrapped in the app's middlewares, per process: a
    # server stopped in a process that goes on (a notebook, a test suite) stayed alive with
    # what it stored, 16 MB a job (found by a review).
    server = _Server()
    gone = weakref.ref(server)
    app = create_app(TOKEN)
    app.router.add_get("/secret", server.secret)
    runner, bound = await serve(app, "127.0.0.1", 0)
    try:
        status, _ = await exchange(bound, request_bytes("/secret", token=TOKEN.encode()))
        assert status == 200
    finally:
        await runner.cleanup()
    del app, runner, server
    gc.collect()
    assert gone() is None
