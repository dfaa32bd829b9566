"""The scheduler of a distributed job: rendezvous, rank assignment, barriers, liveness.

Run it with ``akv-scheduler`` (or ``python -m akv.scheduler``), configured by the
environment (see ``docs/distributed.md``) or by flags. akv-launch starts it for you.

HTTP API (JSON; every request needs the job's token):

====================  ==========================================================
``POST /v1/register`` ``{node_id, role, rank?, host, port, pid, wait?}`` -> ``{rank,
                      servers}`` once every node registered (202 ``{rank, waiting}`` after
                      a poll window, or at once with ``wait: false``)
``POST /v1/barrier``  ``{node_id, number}`` -> 200 once every worker joined (else 202)
``POST /v1/heartbeat`` ``{node_id}`` -> ``{failure, stop}``
``POST /v1/lost``     ``{reporter, role, rank, detail}``: a peer vanished without closing
``POST /v1/finish``   ``{node_id}``: the node closed cleanly
``GET /v1/status``    the roster, for people and monitoring
====================  ==========================================================

Once the job failed, register and barrier answer 409 with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from akv.dist import config as _config
from akv.dist.roles import run_role, server_ssl
from akv.dist.scheduler.roster import Roster
from akv.errors import AKVError
from akv.limits import SCHEDULER_CHECK_INTERVAL_S, SCHEDULER_LINGER_S, SCHEDULER_POLL_S
from transport import RequestError, create_app, serve

__all__ = ["Scheduler", "main"]

log = logging.getLogger("akv.dist.scheduler")



class Scheduler:
    """The scheduler service: an aiohttp app over a :class:`~akv._roster.Roster`."""

    def __init__(self, config: _config.Config) -> None:
        self.config = config
        self.roster = Roster(
            config.num_workers, config.num_servers, config.timeouts.heartbeat_timeout_s
        )
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._ended_at: float | None = None

    def app(self) -> web.Application:
        """The HTTP application (token check and body limit included)."""
        app = create_app(self.config.token, max_body_bytes=self.config.max_body_bytes)
        app.router.add_post("/v1/register", self._register)
        app.router.add_post("/v1/barrier", self._barrier)
        app.router.add_post("/v1/heartbeat", self._heartbeat)
        app.router.add_post("/v1/lost", self._lost)
        app.router.add_post("/v1/finish", self._finish)
        app.router.add_get("/v1/status", self._status)
        return app

    async def start(self) -> int:
        """Listen (on the inherited socket, or the configured host and port); return the port."""
        config = self.config
        ssl_context = server_ssl(config)
        sock = None
        if config.scheduler_fd is not None:
            sock = socket.socket(fileno=config.scheduler_fd)
        self._runner, self.port = await serve(
            self.app(),
            config.scheduler_host,
            config.scheduler_port,
            ssl_context=ssl_context,
            sock=sock,
        )
        log.info(
            "akv-scheduler listening on %s:%d for %d workers and %d servers",
            config.scheduler_host,
            self.port,
            config.num_workers,
            config.num_servers,
        )
        return self.port

    async def run(self) -> int:
        """Serve until the job ended (0) or failed (1), then linger briefly and stop."""
        if self._runner is None:
            await self.start()
        try:
            while True:
                await asyncio.sleep(SCHEDULER_CHECK_INTERVAL_S)
                async with self._changed:
                    dead = self.roster.check(time.monotonic())
                    if dead:
                        log.error("job failed: %s", self.roster.failure)
                        self._changed.notify_all()
                if self.roster.done() or self.roster.failure is not None:
                    if self._ended_at is None:
                        self._ended_at = time.monotonic()
                    elif time.monotonic() - self._ended_at > self._linger_s():
                        break
            return 1 if self.roster.failure is not None else 0
        finally:
            await self.stop()

    def _linger_s(self) -> float:
        if self.roster.failure is None:
            return 0.0
        return max(SCHEDULER_LINGER_S, 2 * self.config.timeouts.heartbeat_interval_s)

    async def stop(self) -> None:
        """Stop listening. Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------ handlers

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    def _refuse_if_failed(self) -> None:
        if self.roster.failure is not None:
            raise RequestError(409, f"the job failed: {self.roster.failure}")

    async def _wait(self, predicate: Any) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), SCHEDULER_POLL_S)
            except asyncio.TimeoutError:
                return False
        return True

    async def _register(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._refuse_if_failed()
        try:
            node = self.roster.register(
                str(body["node_id"]),
                str(body["role"]),
                str(body["host"]),
                int(body["port"]),
                int(body.get("pid", 0)),
                time.monotonic(),
                rank=None if body.get("rank") is None else int(body["rank"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(400, f"malformed registration: {exc!r}") from None
        except AKVError as exc:
            raise RequestError(409, str(exc)) from None
        async with self._changed:
            self._changed.notify_all()
        if body.get("wait", True):
            ready = await self._wait(lambda: self.roster.complete() or self.roster.failure)
        else:
            ready = self.roster.complete()
        self._refuse_if_failed()
        if not ready:
            return web.json_response(
                {"rank": node.rank, "waiting": self.roster.missing()}, status=202
            )
        servers = [{"rank": s.rank, "host": s.host, "port": s.port} for s in self.roster.servers()]
        return web.json_response({"rank": node.rank, "servers": servers})

    async def _barrier(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._refuse_if_failed()
        try:
            number = int(body["number"])
            self.roster.arrive(str(body["node_id"]), number, time.monotonic())
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(400, f"malformed barrier request: {exc!r}") from None
        except AKVError as exc:
            raise RequestError(409, str(exc)) from None
        async with self._changed:
            self._changed.notify_all()
        passed = await self._wait(lambda: self.roster.passed(number) or self.roster.failure)
        self._refuse_if_failed()
        if not passed:
            return web.json_response({"waiting": self.roster.barrier_missing(number)}, status=202)
        return web.json_response({"passed": number})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            self.roster.heartbeat(str(body["node_id"]), time.monotonic())
        except KeyError as exc:
            raise RequestError(400, f"malformed heartbeat: {exc!r}") from None
        except AKVError as exc:
            raise RequestError(409, str(exc)) from None
        return web.json_response(
            {"failure": self.roster.failure, "stop": self.roster.servers_should_stop()}
        )

    async def _lost(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            self.roster.lost(
                str(body["reporter"]),
                str(body["role"]),
                int(body["rank"]),
                str(body.get("detail", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(400, f"malformed report: {exc!r}") from None
        if self.roster.failure is not None:
            log.error("job failed: %s", self.roster.failure)
        async with self._changed:
            self._changed.notify_all()
        return web.json_response({"failure": self.roster.failure})

    async def _finish(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            self.roster.finish(str(body["node_id"]))
        except KeyError as exc:
            raise RequestError(400, f"malformed request: {exc!r}") from None
        except AKVError as exc:
            raise RequestError(409, str(exc)) from None
        async with self._changed:
            self._changed.notify_all()
        return web.json_response({"stop": self.roster.servers_should_stop()})

    async def _status(self, request: web.Request) -> web.Response:
        nodes = [
            {
                "role": n.role,
                "rank": n.rank,
                "host": n.host,
                "port": n.port,
                "pid": n.pid,
                "finished": n.finished,
                "dead": n.dead,
            }
            for n in sorted(self.roster.nodes.values(), key=lambda n: (n.role, n.rank))
        ]
        return web.json_response(
            {"failure": self.roster.failure, "nodes": nodes, "complete": self.roster.complete()}
        )


# ---------------------------------------------------------------------- command line


async def run_scheduler(config: _config.Config) -> int:
    """Run a scheduler until the job ends; return the exit status."""
    return await Scheduler(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``akv-scheduler``: run the scheduler of one job; exit 0 when it ended well, 1 if not."""
    return run_role("scheduler", argv, "Run the scheduler of an akv job.", run_scheduler)


