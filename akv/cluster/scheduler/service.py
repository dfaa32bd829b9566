"""The scheduler of a distributed job: rendezvous, rank assignment, barriers, liveness.

Run it with ``akv-scheduler`` (or ``python -m akv.cluster.scheduler``), configured by the
environment (see ``docs/distributed.md``) or by flags. akv-launch starts it for you.

Every decision is :class:`~akv.cluster.scheduler.roster.Roster`'s; the handlers here only
read a request, call the roster, and write its answer.

HTTP API (JSON; every request needs the job's token):

====================  ==========================================================
``POST /v1/register`` ``{node_id, role, rank?, host, port, bound_host?, bound_port?,
                      pid, wait?}`` -> ``{rank, servers}`` once every node registered (202
                      ``{rank, waiting}`` after a poll window, or at once with ``wait:
                      false``). ``host``/``port`` are the advertised address (``servers``
                      gives it to workers), ``bound_*`` what the node listens on (default:
                      the advertised one); both carry ``finished``, the workers that
                      closed their stores
``POST /v1/barrier``  ``{node_id, number}`` -> 200 ``{passed}`` once every worker joined
                      (else 202 ``{waiting}``, the missing ranks)
``POST /v1/heartbeat`` ``{node_id}`` -> ``{failure, stop}``
``POST /v1/lost``     ``{reporter, role, rank, detail}``: a peer vanished without closing
``POST /v1/finish``   ``{node_id}``: the node closed cleanly -> ``{stop}``
``GET /v1/status``    the roster, for people and monitoring: each node's advertised
                      ``host``/``port``, and ``bound_host``/``bound_port`` when it listens
                      on another address
``GET /status``       the job's status page (HTML; ``/status.json``: its JSON twin), with
                      the token or a login at ``/login``
                      (:mod:`akv.cluster.scheduler.status_page`, ``docs/status.md``)
``GET /metrics``      Prometheus metrics (``docs/metrics.md``)
``GET /healthz``      ``ok`` (no token); ``GET /readyz``: ``ready`` (no token;
                      :mod:`akv.cluster.health` says why a scheduler always is)
====================  ==========================================================

A heartbeat may carry ``report``: what the node did so far, for the status page
(:func:`akv.cluster.scheduler.status.parse_report` says what it holds).

A malformed body gets 400. A request that does not fit the job gets 422 ``{error}``
(:class:`~akv.errors.MembershipError`: an unknown node, a role or rank that does not fit, a
rank taken, a barrier out of order); once the job failed, every registration and barrier
gets 409 ``{error}`` with the reason (``akv.cluster.protocol.JOB_FAILED_STATUS`` and
``REFUSED_STATUS``; a worker raises ``PeerLostError`` and ``MembershipError`` for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from aiohttp import web

from akv.cluster import config as _config
from akv.cluster.health import scheduler_readiness
from akv.cluster.metrics import ProcessMetrics, observe
from akv.cluster.protocol import JOB_FAILED_STATUS, REFUSED_STATUS
from akv.cluster.roles import listen, run_role, stopped_by_signal
from akv.cluster.scheduler.metrics import roster_figures
from akv.cluster.scheduler.roster import Restored, Roster, ServerAddress
from akv.cluster.scheduler.status import Reports, job_status, parse_report
from akv.cluster.scheduler.status_page import STATUS_PATH, StatusPage
from akv.errors import MembershipError, PeerLostError
from akv.limits import (
    DRAIN_S,
    SCHEDULER_CHECK_INTERVAL_S,
    SCHEDULER_END_CHECK_S,
    SCHEDULER_POLL_S,
    STARTUP_MARGIN_S,
)
from akv_transport import RequestError, create_app, parse_json

__all__ = ["Scheduler", "main", "run_scheduler"]

log = logging.getLogger("akv.cluster.scheduler")


class Scheduler:
    """The scheduler service: an aiohttp app over a :class:`~akv.cluster.scheduler.roster.Roster`.

    It starts no task of its own: :meth:`run` is its one loop (liveness checks and the
    end of the job), and whoever starts it awaits it, so its errors reach the caller.
    """

    def __init__(self, config: _config.Config) -> None:
        self.config = config
        self.roster = Roster(
            config.num_workers,
            config.num_servers,
            config.timeouts.heartbeat_timeout_s,
            config.timeouts.heartbeat_interval_s,
            config.timeouts.restart_s,
            accept_mixed_restore=config.accept_mixed_restore,
        )
        #: What servers and workers reported with their heartbeats (the status page).
        self.reports = Reports()
        self.status_page = StatusPage(config.token, self.status, secure=config.tls)
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0
        self.metrics = ProcessMetrics(
            "scheduler", lambda: None, lambda families: roster_figures(families, self.roster)
        )

    def app(self) -> web.Application:
        """The HTTP application (token check and body limit included)."""
        app = create_app(self.config.token, max_body_bytes=self.config.max_body_bytes)
        app.router.add_post("/v1/register", self._register)
        app.router.add_post("/v1/barrier", self._barrier)
        app.router.add_post("/v1/heartbeat", self._heartbeat)
        app.router.add_post("/v1/lost", self._lost)
        app.router.add_post("/v1/finish", self._finish)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/servers", self._servers)
        self.status_page.install(app)
        observe(app, self.metrics, scheduler_readiness)
        return app

    def status(self) -> dict[str, Any]:
        """The whole job now, as ``/status.json`` answers it."""
        advertised = (self.config.scheduler_host, self.port, os.getpid())
        return job_status(self.roster, self.reports, time.monotonic(), scheduler=advertised)

    async def start(self) -> int:
        """Listen (on the inherited socket, or the configured host and port); return the port."""
        config = self.config
        sock = None
        if config.scheduler_fd is not None:
            sock = socket.socket(fileno=config.scheduler_fd)
        self._runner, self.port = await listen(
            self.app(),
            config,
            config.scheduler_host,
            config.scheduler_port,
            setting="AKV_SCHEDULER_PORT",
            advice="pick a free port, on an address of this machine",
            sock=sock,
        )
        log.info(
            "akv-scheduler listening on %s:%d for %d workers and %d servers",
            config.scheduler_host,
            self.port,
            config.num_workers,
            config.num_servers,
        )
        scheme = "https" if config.tls else "http"
        address = _config.format_address(config.scheduler_host, self.port)
        log.info("the job's status page: %s://%s%s", scheme, address, STATUS_PATH)
        return self.port

    async def run(self) -> int:
        """Serve until the job ended (0) or failed (1), then stop listening.

        Every ``SCHEDULER_CHECK_INTERVAL_S`` (and when a node comes or goes) the roster
        looks for silent nodes and says whether the scheduler should exit (it lingers after
        a failure, so that every node hears the reason). A job that has not assembled
        within the connect timeout plus ``STARTUP_MARGIN_S`` of the start fails, naming the
        ranks that never registered. Errors propagate to the caller; the listener stops
        either way.
        """
        if self._runner is None:
            await self.start()
        assemble_s = self.config.timeouts.connect_s + STARTUP_MARGIN_S
        started = time.monotonic()
        deadline = started + assemble_s
        try:
            while True:
                await self._next_check()
                now = time.monotonic()
                if self.roster.check(now):
                    log.error("job failed: %s", self.roster.failure)
                    await self._notify()
                failure = self.roster.check_assembly(now, deadline)
                if failure is not None:
                    log.error(
                        "job failed after waiting %g s for it to assemble: %s", assemble_s, failure
                    )
                    await self._notify()
                status = self.roster.exit_status(now)
                if status is not None:
                    if status == 0:
                        self._ended_well(now - started)
                    return status
        except asyncio.CancelledError as exc:
            if not stopped_by_signal(exc):
                raise
            if await self._servers_finish():  # every worker had finished: no failure
                self._ended_well(time.monotonic() - started)
                return 0
            # SIGTERM or Ctrl-C: the job cannot go on without its scheduler. Fail it and
            # answer for DRAIN_S more, so that every node hears the reason.
            if self.roster.fail("the scheduler was stopped by a signal (SIGTERM or Ctrl-C)"):
                log.error("job failed: %s", self.roster.failure)
                await self._notify()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.sleep(DRAIN_S)
            raise
        finally:
            await self.stop()

    def _ended_well(self, took_s: float) -> None:
        workers, servers = self.config.num_workers, self.config.num_servers
        log.info(
            "the job ended well: %d worker%s and %d server%s finished in %.1f s",
            *(workers, "" if workers == 1 else "s", servers, "" if servers == 1 else "s"),
            took_s,
        )

    async def _servers_finish(self) -> bool:
        """Stopped by a signal: once every worker finished, the job is over but for the
        servers' goodbyes (they stop at once: a cluster manager tearing the job down), which
        get :data:`DRAIN_S`. True when they came (the job ended well)."""
        if not self.roster.servers_should_stop() or self.roster.failure is not None:
            return False
        await self._wait_for(self.roster.done, DRAIN_S)
        return self.roster.done() and self.roster.failure is None

    async def stop(self) -> None:
        """Stop listening. Idempotent: a call while another runs waits for it (which goes on
        if its caller is cancelled)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self._stopping = asyncio.ensure_future(runner.cleanup())
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    # ------------------------------------------------------------ handlers

    async def _register(self, request: web.Request) -> web.Response:
        body = await _body(request)
        with _malformed("registration"):
            node_id = str(body["node_id"])
            role = str(body["role"])
            host = str(body["host"])
            port = int(body["port"])
            # What the node listens on; host and port are what it advertises.
            bound_host = str(body.get("bound_host", host))
            bound_port = int(body.get("bound_port", port))
            pid = int(body.get("pid", 0))
            rank = None if body.get("rank") is None else int(body["rank"])
            wait = bool(body.get("wait", True))
            restartable = bool(body.get("restartable", False))
            local = _local(body.get("local"))
            instance = _instance(body.get("instance"))
            restored = _restored(body.get("restored"))
        with _refusals():
            known = node_id in self.roster.nodes
            restarts = sum(self.roster.restarts.values())
            failed, mixed = self.roster.failure, self.roster.mixed_restore
            self.roster.register(
                node_id,
                role,
                host,
                port,
                pid,
                time.monotonic(),
                rank=rank,
                bound_host=bound_host,
                bound_port=bound_port,
                restartable=restartable,
                local=local,
                instance=instance,
                restored=restored,
            )
        if self.roster.failure is not None and failed is None:
            log.error("job failed: %s", self.roster.failure)
        if self.roster.mixed_restore is not None and mixed is None:
            log.warning("%s (going on: AKV_ACCEPT_MIXED_RESTORE=1)", self.roster.mixed_restore)
        if not known and sum(self.roster.restarts.values()) > restarts:
            log.warning(
                "server %s was restarted from its checkpoint (pid %d at %s:%d); the workers "
                "reconnect to it",
                rank,
                pid,
                host,
                port,
            )
        await self._notify()
        if wait:
            await self._wait_for(self.roster.registration_settled)
        with _refusals():
            answer = self.roster.registration(node_id)
        finished = list(answer.finished)
        # (a restarted server's restore is where its job is: see Checkpoints.joined)
        restarted = self.roster.nodes[node_id].restarted
        if answer.servers is None:
            waiting = {"rank": answer.rank, "waiting": answer.waiting, "finished": finished}
            return web.json_response({**waiting, "restart": restarted}, status=202)
        servers = _addresses(answer.servers)
        whole = {"rank": answer.rank, "servers": servers, "finished": finished}
        return web.json_response({**whole, "restart": restarted})

    async def _barrier(self, request: web.Request) -> web.Response:
        body = await _body(request)
        with _malformed("barrier request"):
            node_id = str(body["node_id"])
            number = int(body["number"])
        with _refusals():
            self.roster.arrive(node_id, number, time.monotonic())
        await self._notify()
        await self._wait_for(lambda: self.roster.barrier_settled(number))
        with _refusals():
            state = self.roster.barrier(number)
        if not state.passed:
            return web.json_response({"waiting": list(state.missing)}, status=202)
        return web.json_response({"passed": number})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await _body(request)
        with _malformed("heartbeat"):
            node_id = str(body["node_id"])
            report = body.get("report")
        now = time.monotonic()
        with _refusals():
            answer = self.roster.heartbeat(node_id, now)
        if report is not None:
            with _malformed("heartbeat report"):
                role = self.roster.nodes[node_id].role
                self.reports.heard(
                    node_id, parse_report(role, report, self.roster.num_workers), now
                )
        return web.json_response({"failure": answer.failure, "stop": answer.stop})

    async def _lost(self, request: web.Request) -> web.Response:
        body = await _body(request)
        with _malformed("report"):
            reporter = str(body["reporter"])
            role = str(body["role"])
            rank = int(body["rank"])
            detail = str(body.get("detail", ""))
            itself = body.get("itself") is True
        failure = self.roster.lost(reporter, role, rank, detail, itself=itself)
        if failure is not None:
            log.error("job failed: %s", failure)
        await self._notify()
        return web.json_response({"failure": self.roster.failure})

    async def _finish(self, request: web.Request) -> web.Response:
        body = await _body(request)
        with _malformed("request"):
            node_id = str(body["node_id"])
        with _refusals():
            stop = self.roster.finish(node_id)
        await self._notify()
        return web.json_response({"stop": stop})

    async def _servers(self, request: web.Request) -> web.Response:
        """``GET /v1/servers``: where each server is now (a reconnecting worker asks: a
        restarted server may listen elsewhere); 409 once the job failed."""
        with _refusals():
            self.roster.refuse_if_failed()
        return web.json_response({"servers": _addresses(self.roster.server_addresses())})

    async def _status(self, request: web.Request) -> web.Response:
        statistics = self.roster.statistics()
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
            for n in statistics.nodes
        ]
        for node, n in zip(nodes, statistics.nodes, strict=True):
            if (n.bound_host, n.bound_port) != (n.host, n.port):  # it advertises another
                node.update(bound_host=n.bound_host, bound_port=n.bound_port)
        return web.json_response(
            {"failure": statistics.failure, "nodes": nodes, "complete": statistics.complete}
        )

    # ------------------------------------------------------------ waiting

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _next_check(self) -> None:
        """Wait ``SCHEDULER_CHECK_INTERVAL_S``, or less: until a node registered, finished
        or was lost (the job may be over), or, once the job ended well,
        ``SCHEDULER_END_CHECK_S`` (the last goodbyes are answered before it exits)."""
        if self.roster.ended_well:
            await asyncio.sleep(SCHEDULER_END_CHECK_S)
            return
        async with self._changed:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), SCHEDULER_CHECK_INTERVAL_S)

    async def _wait_for(
        self, settled: Callable[[], bool], timeout_s: float = SCHEDULER_POLL_S
    ) -> None:
        """Wait until ``settled()`` or ``timeout_s`` passed (by default
        ``SCHEDULER_POLL_S``: the caller answers "still waiting" then, and the node asks
        again)."""
        async with self._changed:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(settled), timeout_s)


def _addresses(servers: Sequence[ServerAddress]) -> list[dict[str, Any]]:
    """The address book as JSON: each server's rank, address, whether it may be
    restarted, and its way in for workers on its host (``local``, when it has one)."""
    book = []
    for s in servers:
        entry: dict[str, Any] = {
            "rank": s.rank,
            "host": s.host,
            "port": s.port,
            "restartable": s.restartable,
        }
        if s.local is not None:
            entry["local"] = {"host": s.local[0], "path": s.local[1]}
        if s.instance is not None:
            entry["instance"] = s.instance
        book.append(entry)
    return book


def _restored(value: object) -> Restored | None:
    """A registration's ``restored`` field: ``{"path": file, "rounds": [[key, rounds],
    ...]}`` or absent; a ``ValueError`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"path", "rounds"}:
        raise ValueError("restored must be an object with exactly 'path' and 'rounds'")
    rounds = value["rounds"]
    if not isinstance(rounds, list) or not all(
        isinstance(pair, list)
        and len(pair) == 2
        and type(pair[0]) in (int, str)
        and type(pair[1]) is int
        for pair in rounds
    ):
        raise ValueError("restored.rounds must be a list of [key, rounds] pairs")
    return _checked("restored.path", value["path"]), tuple((k, r) for k, r in rounds)


def _local(value: object) -> tuple[str, str] | None:
    """A registration's ``local`` field: ``{"host": identity, "path": socket}`` or absent;
    a ``ValueError`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"host", "path"}:
        raise ValueError("local must be an object with exactly 'host' and 'path'")
    host, path = _checked("local.host", value["host"]), _checked("local.path", value["path"])
    if not host or not path:
        raise ValueError("local: host and path must not be empty")
    return host, path


def _instance(value: object) -> str | None:
    """A registration's ``instance`` field: 32 to 64 lower-case hex digits, or absent; a
    ``ValueError`` for anything else."""
    if value is None:
        return None
    if not (isinstance(value, str) and 32 <= len(value) <= 64 and set(value) <= _HEX_DIGITS):
        raise ValueError("instance must be 32 to 64 lower-case hex digits")
    return value


_HEX_DIGITS = frozenset("0123456789abcdef")


async def _body(request: web.Request) -> _Fields:
    """The request's JSON object, decoded strictly (:func:`akv_transport.parse_json`: bounded
    nesting, finite numbers, 64-bit integers, UTF-8); anything else is a 400."""
    try:
        body = parse_json(await request.read())
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return _Fields(body)


#: What each field of a request body must be: a string of at most so many characters
#: (without control characters, but for ``detail``), an integer in a range (``rank`` may
#: be null), or a boolean. Fields not named here are never read.
_TEXTS = {
    "node_id": 1024,
    "role": 64,
    "host": 1024,
    "bound_host": 1024,
    "reporter": 1024,
    "detail": 65536,
    "local.host": 1024,
    "local.path": 1024,
    "restored.path": 4096,
}
_INTEGERS = {
    "port": (0, 65535),
    "bound_port": (0, 65535),
    "pid": (0, (1 << 63) - 1),
    "rank": (0, (1 << 31) - 1),
    "number": (0, (1 << 63) - 1),
}
_NULLABLE = frozenset({"rank"})
_FLAGS = frozenset({"wait", "restartable"})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _Fields(dict[str, Any]):
    """A request's JSON object whose fields are checked as a handler reads them: a value
    of another JSON type (``true`` for a port, a list for a node id) or out of range is a
    ``ValueError`` naming the field, which :func:`_malformed` turns into a 400 before
    anything reaches the roster."""

    def __getitem__(self, name: str) -> Any:
        return _checked(name, super().__getitem__(name))

    def get(self, name: str, default: Any = None) -> Any:
        try:
            value = super().__getitem__(name)
        except KeyError:
            return default
        return _checked(name, value)


def _checked(name: str, value: Any) -> Any:
    if name in _TEXTS:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, not {type(value).__name__}")
        if len(value) > _TEXTS[name]:
            raise ValueError(f"{name} has {len(value)} characters; at most {_TEXTS[name]}")
        value.encode()  # a lone surrogate (from a \ud800 escape) is no text
        if name != "detail" and _CONTROL.search(value):
            raise ValueError(f"{name} holds a control character")
    elif name in _INTEGERS:
        if value is None and name in _NULLABLE:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, not {type(value).__name__}")
        low, high = _INTEGERS[name]
        if not low <= value <= high:
            raise ValueError(f"{name} {value} is out of range {low}..{high}")
    elif name in _FLAGS and not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {type(value).__name__}")
    return value


@contextmanager
def _malformed(what: str) -> Iterator[None]:
    """Reading a body's fields: a missing field or a value of the wrong kind is a 400."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestError(400, f"malformed {what}: {exc!r}") from None


@contextmanager
def _refusals() -> Iterator[None]:
    """Calling the roster: the job failed is a 409, a request that does not fit it a 422,
    each with its message."""
    try:
        yield
    except PeerLostError as exc:
        raise RequestError(JOB_FAILED_STATUS, str(exc)) from None
    except MembershipError as exc:
        raise RequestError(REFUSED_STATUS, str(exc)) from None


# ---------------------------------------------------------------------- command line


async def run_scheduler(config: _config.Config) -> int:
    """Run a scheduler until the job ends; return the exit status."""
    return await Scheduler(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``akv-scheduler``: run the scheduler of one job; exit 0 when it ended well, 1 if not,
    2 when its configuration is wrong."""
    return run_role("scheduler", argv, "Run the scheduler of an akv job.", run_scheduler)
