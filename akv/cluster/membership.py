"""One process's membership in a job: registering with the scheduler, heartbeats, goodbye.

Workers and servers both use :class:`Membership`: a worker registers and waits for the
whole address book (every server), a server only for its rank. Heartbeats run on a loop
of their own choosing (a worker runs them on a thread of their own, so that a busy event
loop is never mistaken for a dead worker) and report a failed job or a silent scheduler
to a callback, once per cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from akv.cluster.config import Config
from akv.cluster.protocol import JOB_FAILED_STATUS, REFUSED_STATUS
from akv.cluster.roles import scheduler_client
from akv.errors import (
    AKVError,
    AuthenticationError,
    ConnectTimeoutError,
    MembershipError,
    PeerLostError,
    ServerError,
)
from akv.limits import (
    CONNECT_RETRY_S,
    GOODBYE_TIMEOUT_S,
    HEARTBEAT_REQUEST_INTERVALS,
    MIN_HEARTBEAT_REQUEST_S,
    VERDICT_POLL_S,
)
from akv_transport import AuthError, HttpClient, RemoteError, TransportError

__all__ = ["Membership", "scheduler_refusal"]

log = logging.getLogger("akv.cluster")


class Membership:
    """The scheduler's view of this process (``role``: ``"worker"`` or ``"server"``).

    :attr:`client` is this process's HTTP client for the scheduler, bound to the loop
    that first used it; heartbeats use a client of their own on their own loop.
    """

    def __init__(self, config: Config, role: str, node_id: str, restartable: bool = False) -> None:
        """``restartable``: a server that writes checkpoints, whose restart (with the same
        rank and checkpoint directory, which it holds locked) may take its rank over."""
        self.config = config
        self.role = role
        self.node_id = node_id
        self.restartable = restartable
        self.rank: int | None = config.rank
        #: Whether the scheduler answered a registration (a goodbye before that is moot).
        self.registered = False
        #: Whether the scheduler refused the registration (the rank is not this process's).
        self.refused = False
        #: Whether the heartbeats found the scheduler silent past the heartbeat timeout (a
        #: goodbye to it then is not waited for).
        self.scheduler_lost = False
        #: A server's way in for workers on its host: ``{"host": host identity, "path":
        #: its Unix socket}`` (None: TCP only).
        self.local: dict[str, str] | None = None
        #: A server's instance (:func:`akv_transport.app_instance`): workers sign for it.
        self.instance: str | None = None
        #: A server restored from a checkpoint: the rounds of its keys that other servers
        #: hold parts of (:attr:`~akv.cluster.server.checkpointing.Checkpoints.restored`).
        self.restored: dict[str, Any] | None = None
        self._client: HttpClient | None = None
        self._closed = False

    @property
    def client(self) -> HttpClient:
        """The HTTP client for the scheduler (made on first use)."""
        if self._client is None:
            if self._closed:
                raise TransportError(f"{self.config.scheduler_url}: the client is closed")
            self._client = scheduler_client(self.config, self.config.timeouts.request_s)
        return self._client

    async def register(
        self, port: int, deadline: float, *, whole_job: bool | None = None
    ) -> dict[str, Any]:
        """Join the job; return the scheduler's answer once this process has its rank
        (a worker: and every server's address, under ``"servers"``).

        ``whole_job``: wait until every worker and server registered (default: a worker
        does, a server only needs its rank; a server that registered calls it again with
        True to wait for the whole job, by a deadline of its own).

        ``port`` is the port this process listens on (a worker: 0); the scheduler records
        it with the bound host, and gives workers the advertised address
        (:meth:`~akv.cluster.config.Config.advertised`).

        Raises
        ------
        AuthenticationError
            The scheduler refused the job's token.
        MembershipError, PeerLostError, ServerError
            The scheduler refused the registration (the job failed, or a rank or role
            that does not fit).
        ConnectTimeoutError
            ``deadline`` (a ``time.monotonic()`` reading) passed first; says what was
            missing.
        ConfigError
            A server that binds a wildcard address has no advertised address.
        """
        config = self.config
        if whole_job is None:
            whole_job = self.role == "worker"
        # host and port: where workers reach this process (the advertised address, which
        # the address book gives out and messages name); bound_*: what it listens on.
        host, advertised_port = config.advertised(port)
        body: dict[str, Any] = {
            "node_id": self.node_id,
            "role": self.role,
            "rank": self.rank,
            "host": host,
            "port": advertised_port,
            "bound_host": config.host,
            "bound_port": port,
            "pid": os.getpid(),
            # A server needs only its rank: workers find it through the address book.
            "wait": whole_job,
            "restartable": self.restartable,
        }
        if self.local is not None:
            body["local"] = self.local
        if self.instance is not None:
            body["instance"] = self.instance
        if self.restored is not None:
            body["restored"] = self.restored
        last_note = ""
        while True:
            answer: dict[str, Any] | None
            try:
                answer = await self.client.json("POST", "/v1/register", body)
            except AuthError as exc:
                self.refused = True
                raise AuthenticationError(f"the scheduler refused this job's token: {exc}") from exc
            except RemoteError as exc:
                self.refused = True
                raise scheduler_refusal(exc) from exc
            except TransportError as exc:
                answer = None
                note = f"the scheduler at {config.scheduler_url} is not reachable ({exc})"
            if answer is not None:
                note = str(answer.get("waiting", ""))
                if "rank" in answer:
                    self.rank = body["rank"] = int(answer["rank"])
                    self.registered = True
                    if not whole_job or "servers" in answer:
                        return answer
            if time.monotonic() > deadline:
                raise ConnectTimeoutError(
                    f"{self.role} gave up joining the job after "
                    f"{config.timeouts.connect_s:g} s: {note}"
                )
            if note != last_note:
                log.info("%s waiting: %s", self.role, note)
                last_note = note
            if answer is None:
                await asyncio.sleep(CONNECT_RETRY_S)

    async def server_address(self, rank: int) -> dict[str, Any] | None:
        """Where server ``rank`` is now, as the scheduler's address book says (it changes
        when a server is restarted): its entry (``host``, ``port``, and ``local`` for a
        server with a way in for its host); None when the scheduler does not say
        (unreachable, or the job is not assembled).

        Raises
        ------
        PeerLostError
            The scheduler refused: the job failed.
        """
        try:
            answer = await self.client.json("GET", "/v1/servers")
        except RemoteError as exc:
            raise scheduler_refusal(exc) from exc
        except (TransportError, ValueError):
            return None
        for server in answer.get("servers") or () if isinstance(answer, dict) else ():
            if isinstance(server, dict) and server.get("rank") == rank:
                return server
        return None

    async def heartbeats(
        self,
        on_failure: Callable[[str], None],
        should_stop: Callable[[], bool],
        report: Callable[[], dict[str, Any]] | None = None,
        wake: asyncio.Event | None = None,
    ) -> bool:
        """Tell the scheduler every interval that this process lives, until
        ``should_stop()`` or the scheduler says the job is over. ``wake``, when set, ends
        the wait for the next heartbeat at once (``should_stop()`` is asked, and it is
        cleared).

        ``report()``, when given, is called for each heartbeat and sent with it: what this
        process did so far, for the job's status page (a server's
        :func:`~akv.cluster.server.report.heartbeat_report`, a worker's
        :meth:`~akv.cluster.worker.activity.Activity.report`).

        ``on_failure(reason)`` is called when the scheduler reports the job failed
        (``reason``: "the job failed: <the scheduler's verdict>", the wording every process
        uses), and when it has not answered for the heartbeat timeout (then this returns).
        Returns True when the scheduler said stop, False otherwise. Runs on the calling
        loop, with an HTTP client of its own.
        """
        timeouts = self.config.timeouts
        request_s = max(
            MIN_HEARTBEAT_REQUEST_S, timeouts.heartbeat_interval_s * HEARTBEAT_REQUEST_INTERVALS
        )
        client = scheduler_client(self.config, request_s, retries=0)
        answered = time.monotonic()
        reported = ""
        try:
            while not should_stop():
                body: dict[str, Any] = {"node_id": self.node_id}
                if report is not None:
                    body["report"] = report()
                try:
                    answer = await client.json("POST", "/v1/heartbeat", body)
                    answered = time.monotonic()
                except (TransportError, ValueError) as exc:
                    silent = time.monotonic() - answered
                    if silent > timeouts.heartbeat_timeout_s:
                        self.scheduler_lost = True
                        on_failure(
                            f"the scheduler at {self.config.scheduler_url} has not answered "
                            f"for {silent:.1f} s ({exc})"
                        )
                        return False
                    answer = {}
                if not isinstance(answer, dict):
                    answer = {}
                failure = answer.get("failure")
                if failure and failure != reported:
                    reported = str(failure)
                    on_failure(f"the job failed: {reported}")
                if answer.get("stop"):
                    return True
                if wake is None:
                    await asyncio.sleep(timeouts.heartbeat_interval_s)
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeouts.heartbeat_interval_s)
                    wake.clear()
            return False
        finally:
            await client.close()

    async def job_ended(self, timeout_s: float) -> bool:
        """Whether the scheduler says that the job ended well (it tells this node to stop,
        and knows no failure), asked once within ``timeout_s``; False when it cannot be
        asked or does not know this node."""
        body = {"node_id": self.node_id}
        try:
            answer = await asyncio.wait_for(
                self.client.json("POST", "/v1/heartbeat", body), timeout_s
            )
        except (asyncio.TimeoutError, TransportError, RemoteError, ValueError):
            return False
        return isinstance(answer, dict) and bool(answer.get("stop")) and not answer.get("failure")

    async def verdict(
        self, role: str, rank: int, detail: str, report: bool, timeout_s: float
    ) -> str | None:
        """The job's failure as the scheduler knows it: the first process that failed, by
        role, rank and address. That may be another process than ``role`` ``rank``, the
        peer that cut its connection to this one (``report``: it is reported lost first) or
        refused a request: a server closes its streams and refuses requests once it learns
        that the job failed. Asks until the scheduler knows a failure or ``timeout_s``
        passed (then None)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        body = {"reporter": self.node_id, "role": role, "rank": rank, "detail": detail}
        method, path = ("POST", "/v1/lost") if report else ("GET", "/v1/status")
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                request = self.client.json(method, path, body if report else None)
                answer = await asyncio.wait_for(request, remaining)
            except (TransportError, ValueError, asyncio.TimeoutError, RemoteError):
                return None
            failure = answer.get("failure") if isinstance(answer, dict) else None
            if failure:
                return str(failure)
            method, path, report = "GET", "/v1/status", False
            await asyncio.sleep(min(VERDICT_POLL_S, max(0.0, deadline - loop.time())))

    async def report_lost(
        self, reporter: str, role: str, rank: int | None, detail: str, itself: bool = False
    ) -> None:
        """Tell the scheduler that ``role`` ``rank`` vanished (``reporter`` saw it; or
        ``itself``: the node reports its own failure, maybe before it registered)."""
        body = {"reporter": reporter, "role": role, "rank": rank, "detail": detail}
        if itself:
            body["itself"] = True
        await self.client.json("POST", "/v1/lost", body)

    async def report_failed(self, detail: str) -> bool:
        """Tell the scheduler that this node fails the job, ``detail`` saying why (it follows
        the node's name in the job's verdict), before it exits; True when the scheduler
        heard it (a node that cannot reach it leaves the verdict to what sees it exit)."""
        report = self.report_lost(self.node_id, self.role, self.rank, detail, itself=True)
        try:
            await asyncio.wait_for(report, GOODBYE_TIMEOUT_S)
        except (asyncio.TimeoutError, TransportError, RemoteError, ValueError) as exc:
            log.info("could not tell the scheduler why this %s fails: %r", self.role, exc)
            return False
        return True

    async def finish(self) -> None:
        """Say goodbye to the scheduler (this process is done with the job); not to one
        found silent (:attr:`scheduler_lost`)."""
        if self.scheduler_lost:
            return
        await self.client.json(
            "POST", "/v1/finish", {"node_id": self.node_id}, timeout_s=GOODBYE_TIMEOUT_S
        )

    async def close(self) -> None:
        """Close the HTTP client; a request after this raises
        :class:`~akv_transport.TransportError` (none opens a new connection). Idempotent;
        makes no client when none was made."""
        self._closed = True
        if self._client is not None:
            await self._client.close()


def scheduler_refusal(exc: RemoteError) -> AKVError:
    """The error for a scheduler's HTTP refusal: the job failed (``JOB_FAILED_STATUS``), or
    a registration, heartbeat or barrier that does not fit the job (``REFUSED_STATUS``);
    anything else is the scheduler's own failure."""
    if exc.status == JOB_FAILED_STATUS:
        return PeerLostError(f"the scheduler refused: {exc}")
    if exc.status == REFUSED_STATUS:
        return MembershipError(f"the scheduler refused: {exc}")
    return ServerError(f"the scheduler: {exc}", server="scheduler")
