"""What a server counts as it works, and what its ``/metrics`` says (``docs/metrics.md``).

:class:`ServerMetrics` is told of the few things the state's counters do not hold, at the
places where the server carries its decisions out: each request frame (its op and payload
bytes), the rounds each push task closes (with how long the longest of them waited for
its last worker), each checkpoint (duration and size, or its failure). Everything else is
read at the scrape: the state's counters and status, the engine's statistics, the shared
memory arena. All of it runs on the server's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from akv.cluster.health import server_readiness
from akv.cluster.metrics import (
    CHECKPOINT_BUCKETS_S,
    LATENCY_BUCKETS_S,
    Families,
    OpCounts,
    ProcessMetrics,
    Tally,
    engine_families,
    shared_memory_families,
)
from akv_transport import ArenaBook

if TYPE_CHECKING:
    from akv.cluster.server.service import ParameterServer

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """One server's metrics (see the module docstring); :attr:`process` is its registry.

    It listens to the server's checkpoints (:attr:`Checkpoints.on_written
    <akv.cluster.server.checkpointing.Checkpoints.on_written>`) from its creation on.
    """

    def __init__(self, server: ParameterServer) -> None:
        self._server = server
        #: Request frames received, by op.
        self.requests = OpCounts()
        self.rounds = 0
        self.round_waits = Tally(LATENCY_BUCKETS_S)
        self.checkpoints = 0
        self.checkpoint_failures = 0
        self.checkpoint_seconds = Tally(CHECKPOINT_BUCKETS_S)
        self.checkpoint_bytes = 0
        if server.checkpoints is not None:
            server.checkpoints.on_written = self.checkpoint_written
        self.process = ProcessMetrics("server", lambda: server.rank, self.figures)

    def readiness(self) -> str | None:
        """Why ``/readyz`` says not ready, or None (:func:`akv.cluster.health.server_readiness`)."""
        return server_readiness(self._server.membership.registered, self._server.state.stopping)

    def landed(self, rounds: int, waited_s: float | None) -> None:
        """A push task closes ``rounds`` rounds; the longest-open dist_sync one waited
        ``waited_s`` for its last push (None: none)."""
        self.rounds += rounds
        if waited_s is not None:
            self.round_waits.observe(waited_s)

    def checkpoint_written(self, seconds: float, nbytes: int | None) -> None:
        """A checkpoint took ``seconds``; it has ``nbytes`` (None: it failed)."""
        if nbytes is None:
            self.checkpoint_failures += 1
            return
        self.checkpoints += 1
        self.checkpoint_seconds.observe(seconds)
        self.checkpoint_bytes = nbytes

    def figures(self, families: Families) -> None:
        """Everything the server's ``/metrics`` shows but the process's own metrics."""
        server = self._server
        state = server.state
        status = state.status()
        self.requests.add_to(families, answers=False)
        families.counter(
            "akv_rounds_completed_total",
            "Rounds closed (dist_sync: every worker pushed; dist_async: every push).",
            self.rounds,
        )
        families.histogram(
            "akv_round_last_worker_wait_seconds",
            "For each push that closes dist_sync rounds: how long the longest-open of them "
            "had waited for that push, its last worker's, since its first push.",
            self.round_waits,
        )
        families.gauge(
            "akv_workers_connected",
            "Workers with an open stream to this server.",
            len(status["workers_connected"]),
        )
        families.gauge(
            "akv_workers_reconnecting",
            "Workers whose stream was cut, within their grace to come back.",
            len(status["workers_reconnecting"]),
        )
        families.counter(
            "akv_reconnects_total",
            "Streams a worker opened again after a cut (its process reconnected).",
            state.reconnects,
        )
        families.counter(
            "akv_duplicate_pushes_total",
            "Resent pushes answered without being counted again.",
            status["duplicate_pushes"],
        )
        rows = status["row_sparse_keys"]
        families.gauge("akv_keys", "Keys held, by kind.", status["keys"] - rows, kind="dense")
        families.gauge("akv_keys", "Keys held, by kind.", rows, kind="row_sparse")
        stored = sum(e.nbytes for e in state.entries.values())
        stored += sum(e.rows.nbytes for e in state.rows.entries.values())
        families.gauge(
            "akv_stored_bytes",
            "Bytes of the keys' values held (row-sparse keys: their row tables).",
            stored,
        )
        families.gauge(
            "akv_job_failed", "1 once the job failed, else 0.", int(status["failure"] is not None)
        )
        families.counter("akv_checkpoints_total", "Checkpoints written.", self.checkpoints)
        families.counter(
            "akv_checkpoint_failures_total",
            "Checkpoints that could not be written.",
            self.checkpoint_failures,
        )
        families.histogram(
            "akv_checkpoint_duration_seconds",
            "From a checkpoint's start (copying the values) to its file in place.",
            self.checkpoint_seconds,
        )
        families.gauge(
            "akv_checkpoint_bytes",
            "The size of the last checkpoint written.",
            self.checkpoint_bytes,
        )
        regions = state.value_regions
        arena, used = (
            (regions.nbytes, regions.regions.used_bytes)
            if isinstance(regions, ArenaBook)
            else (0, 0)
        )
        shared_memory_families(families, arena, used)
        engine_families(families, server.engine.statistics())
