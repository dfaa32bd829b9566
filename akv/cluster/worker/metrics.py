"""A worker's ``/metrics`` and health probes, served when ``AKV_METRICS_PORT`` is set.

A worker is the user's program, which serves nothing of its own; with ``AKV_METRICS_PORT``
its distributed store starts a small HTTP listener on the store's loop, on ``AKV_HOST``
(127.0.0.1 by default) and that port, with the same token check, TLS and bounds as a
server's: ``/metrics`` (token), ``/healthz`` and ``/readyz`` (no token). It opens when the
store starts joining the job (so ``/readyz`` says 503 while it joins) and closes with
the store.

:class:`WorkerMetrics` counts what the worker's streams carry, at the two places where
frames are written and read (:class:`~akv.cluster.worker.link.ServerLink`): per op the
requests sent and their payload bytes, the answers' payload bytes, and each request's
time from its frame's writing to its answer (``time.perf_counter``: the loop's clock is
coarse under uvloop). The rest is read at the scrape: reconnects, the bytes kept for
restarts, the streams open, the shared memory arenas, the engine's statistics.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from akv.cluster.config import Config, format_address
from akv.cluster.health import worker_readiness
from akv.cluster.metrics import (
    Families,
    OpCounts,
    ProcessMetrics,
    engine_families,
    observe,
    shared_memory_families,
)
from akv.cluster.protocol import COUNTED
from akv.cluster.roles import listen
from akv.cluster.worker.instructions import Send
from akv.cluster.worker.requests import RequestTable
from akv_engine import Engine
from akv_transport import Message, create_app

if TYPE_CHECKING:
    from akv.cluster.worker.backend import DistBackend

__all__ = ["WorkerMetrics"]

log = logging.getLogger("akv.cluster")


class WorkerMetrics:
    """One worker's metrics and their listener (see the module docstring), reading
    ``backend`` (its rank, streams and failure) and ``engine`` at each scrape."""

    def __init__(self, backend: DistBackend, engine: Engine) -> None:
        self._backend = backend
        self._engine = engine
        #: Requests sent, by op, and their answers.
        self.requests = OpCounts()
        self.process = ProcessMetrics("worker", self._rank, self.figures)
        self.port = 0
        self._runner: web.AppRunner | None = None

    @classmethod
    async def serve(cls, backend: DistBackend, engine: Engine) -> WorkerMetrics | None:
        """A worker's metrics, listening already, when ``AKV_METRICS_PORT`` is set (else
        None); raises as :meth:`start`."""
        if backend.config.metrics_port is None:
            return None
        metrics = cls(backend, engine)
        await metrics.start(backend.config)
        return metrics

    def _rank(self) -> int | None:
        rank = self._backend.rank
        return rank if rank >= 0 else None

    # ------------------------------------------------------------ counting

    def sent(self, table: RequestTable, send: Send) -> None:
        """``send``'s frame was written (its request is in ``table`` until answered)."""
        nbytes = 0
        for _, array, _ in send.arrays:
            nbytes += array.nbytes
        self.requests.add(send.op, nbytes)
        request = table.get(send.seq)
        if request is not None:
            request.sent_at = time.perf_counter()

    def arrived(self, table: RequestTable, message: Message) -> None:
        """``message`` arrived (before the worker's state hears of it): an answer ends its
        request's time."""
        header = message.header
        if header.flags & COUNTED:  # an interim answer: the request's own follows
            return
        request = table.get(header.seq)
        if request is None or not request.sent_at:
            return
        self.requests.answered(
            request.op, header.payload_len, time.perf_counter() - request.sent_at
        )

    # ------------------------------------------------------------ serving

    def readiness(self) -> str | None:
        """Why ``/readyz`` says not ready, or None (:func:`akv.cluster.health.worker_readiness`)."""
        return worker_readiness(self._rank() is not None, self._backend.broken is not None)

    async def start(self, config: Config) -> None:
        """Listen on ``config.host`` and ``config.metrics_port`` (0: any free port).

        Raises
        ------
        ConfigError
            The port cannot be bound (taken, or not this host's), naming it.
        """
        assert config.metrics_port is not None  # the backend starts it only then
        app = create_app(config.token, max_body_bytes=config.max_body_bytes)
        observe(app, self.process, self.readiness)
        self._runner, self.port = await listen(
            app,
            config,
            config.host,
            config.metrics_port,
            setting="AKV_METRICS_PORT",
            advice="give each worker of a host its own port (or 0 for any free one)",
        )
        log.info(
            "worker metrics on http%s://%s/metrics",
            "s" if config.tls else "",
            format_address(config.host, self.port),
        )

    async def stop(self) -> None:
        """Stop listening. Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------ scraping

    def figures(self, families: Families) -> None:
        """Everything the worker's ``/metrics`` shows but the process's own metrics."""
        links = self._backend.links
        self.requests.add_to(families, answers=True)
        families.gauge(
            "akv_servers_connected",
            "Servers this worker has an open stream to.",
            sum(link.protocol is not None for link in links),
        )
        families.counter(
            "akv_reconnects_total",
            "Times a stream to a server was cut and opened again.",
            sum(link.reconnects for link in links),
        )
        families.gauge(
            "akv_retained_bytes",
            "Bytes of acknowledged pushes kept until a server's checkpoint holds them.",
            sum(link.retained_bytes for link in links),
        )
        failed = self._backend.broken is not None
        families.gauge("akv_job_failed", "1 once the job failed, else 0.", int(failed))
        arena = used = 0
        for link in links:
            shared = link.protocol.shared if link.protocol is not None else None
            if shared is not None and shared.own is not None:
                arena += shared.own.nbytes
                used += shared.regions.used_bytes
        shared_memory_families(families, arena, used)
        engine_families(families, self._engine.statistics())
