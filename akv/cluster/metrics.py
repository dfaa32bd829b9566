"""A process's Prometheus metrics: what ``GET /metrics`` answers (see ``docs/metrics.md``).

Every scheduler and server, and a worker with ``AKV_METRICS_PORT``, keeps one
:class:`ProcessMetrics`: a registry of its own (never prometheus_client's global one, so
that several processes' worth in one test process do not collide) holding the process
collector (``process_*``: CPU seconds, memory, open files), the platform collector
(``python_info``), the garbage collector's (``python_gc_*``), and one collector that asks
the role for its figures at each scrape.

The hot paths only add to plain numbers on their loop (:class:`OpCounts`, :class:`Tally`,
counters the roles keep anyway); prometheus_client makes the families and their text at
the scrape, which runs on the same loop. Every ``akv_`` sample is labelled with the
process's ``role`` and ``rank`` (empty for the scheduler, and for a server or worker
before it has one), read at the scrape, so a rank learned late still labels every sample.

:func:`observe` adds ``/metrics`` (behind the app's token check, as every route of
:func:`akv_transport.create_app`) and the health probes (:mod:`akv.cluster.health`) to an app.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from akv.cluster.health import Readiness, health_routes
from akv.cluster.protocol import Op, op_label
from akv_engine import EngineStatistics

__all__ = [
    "CHECKPOINT_BUCKETS_S",
    "LATENCY_BUCKETS_S",
    "METRICS_PATH",
    "Families",
    "OpCounts",
    "ProcessMetrics",
    "Tally",
    "engine_families",
    "observe",
    "shared_memory_families",
]

#: Where the metrics are served.
METRICS_PATH = "/metrics"
#: Bucket bounds of request and round-wait histograms (seconds): a loopback request takes
#: a fraction of a millisecond, a round waits as long as its slowest worker computes.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Bucket bounds of the checkpoint duration histogram (seconds).
CHECKPOINT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Ops numbered below this are counted under their own name; others under ``other``.
_OP_SLOTS = 16
_OTHER_OP = "other"
#: The ops of requests (what a worker sends), by number.
_REQUEST_OPS = frozenset(op.value for op in Op if op.value < _OP_SLOTS)


class Tally:
    """A histogram's counts (observations at most each bound, and above the last) and
    their sum, for one thread to add to without a lock. No I/O."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be increasing and distinct, not {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        #: ``counts[i]``: observations in ``(bounds[i-1], bounds[i]]``; the last: above all.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus's cumulative buckets: ``(le, observations <= le)``, ``+Inf`` last."""
        out = []
        total = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return out


#: What a request op that was never answered shows.
_NO_DURATIONS = Tally(LATENCY_BUCKETS_S)


class OpCounts:
    """Requests by op: how many, their payload bytes, and (where answers are awaited) the
    payload bytes of the answers and a :class:`Tally` of how long each took. For one
    thread; no I/O; an add is a few list operations."""

    __slots__ = ("_durations", "answer_bytes", "request_bytes", "requests")

    def __init__(self) -> None:
        self.requests = [0] * _OP_SLOTS
        self.request_bytes = [0] * _OP_SLOTS
        self.answer_bytes = [0] * _OP_SLOTS
        self._durations: dict[int, Tally] = {}

    def add(self, op: int, nbytes: int) -> None:
        """One request of ``op`` carrying ``nbytes`` of payload."""
        slot = op if op in _REQUEST_OPS else 0
        self.requests[slot] += 1
        self.request_bytes[slot] += nbytes

    def answered(self, op: int, nbytes: int, seconds: float) -> None:
        """A request of ``op`` was answered with ``nbytes`` of payload, ``seconds`` after it
        was sent."""
        slot = op if op in _REQUEST_OPS else 0
        self.answer_bytes[slot] += nbytes
        tally = self._durations.get(slot)
        if tally is None:
            tally = self._durations[slot] = Tally(LATENCY_BUCKETS_S)
        tally.observe(seconds)

    def add_to(self, families: Families, *, answers: bool) -> None:
        """Add ``akv_requests_total``, ``akv_request_bytes_total`` and, with ``answers``,
        ``akv_answer_bytes_total`` and ``akv_request_duration_seconds``, for every request
        op (0 until used) and for ``other`` once an unknown op was counted."""
        for slot in range(_OP_SLOTS):
            if slot not in _REQUEST_OPS and not self.requests[slot]:
                continue  # every request op is shown from the start, an unknown one once seen
            op = op_label(slot) if slot else _OTHER_OP
            families.counter("akv_requests_total", "Requests, by op.", self.requests[slot], op=op)
            families.counter(
                "akv_request_bytes_total",
                "Payload bytes of the requests, by op.",
                self.request_bytes[slot],
                op=op,
            )
            if not answers:
                continue
            families.counter(
                "akv_answer_bytes_total",
                "Payload bytes of the answers to the requests, by op.",
                self.answer_bytes[slot],
                op=op,
            )
            families.histogram(
                "akv_request_duration_seconds",
                "From a request's sending to its answer, by op.",
                self._durations.get(slot, _NO_DURATIONS),
                op=op,
            )


class Families:
    """The metric families of one scrape, every sample labelled with the process's
    ``role`` and ``rank`` first. A name gets its family at its first sample; later samples
    of it must give the same label names."""

    def __init__(self, role: str, rank: int | None) -> None:
        self._base = (role, "" if rank is None else str(rank))
        self._families: dict[str, Metric] = {}

    def counter(self, name: str, documentation: str, value: float, **labels: str) -> None:
        """A sample of counter ``name`` (ending in ``_total``)."""
        family = self._family(name, labels, CounterMetricFamily, documentation)
        assert isinstance(family, CounterMetricFamily)
        family.add_metric([*self._base, *labels.values()], value)

    def gauge(self, name: str, documentation: str, value: float, **labels: str) -> None:
        """A sample of gauge ``name``."""
        family = self._family(name, labels, GaugeMetricFamily, documentation)
        assert isinstance(family, GaugeMetricFamily)
        family.add_metric([*self._base, *labels.values()], value)

    def histogram(self, name: str, documentation: str, tally: Tally, **labels: str) -> None:
        """The buckets and sum of histogram ``name`` from ``tally``."""
        family = self._family(name, labels, HistogramMetricFamily, documentation)
        assert isinstance(family, HistogramMetricFamily)
        family.add_metric([*self._base, *labels.values()], tally.buckets(), tally.sum)

    def _family(
        self,
        name: str,
        labels: dict[str, str],
        kind: Callable[..., Metric],
        documentation: str,
    ) -> Metric:
        family = self._families.get(name)
        if family is None:
            family = kind(name, documentation, labels=["role", "rank", *labels])
            self._families[name] = family
        return family

    def collected(self) -> list[Metric]:
        """Every family, in the order of their first samples."""
        return list(self._families.values())


def engine_families(families: Families, stats: EngineStatistics) -> None:
    """The engine's tasks: ``akv_engine_tasks_total`` by outcome, those queued by state,
    those running, and the slots."""
    for outcome, value in (
        ("completed", stats.completed),
        ("failed", stats.failed),
        ("skipped", stats.skipped),
    ):
        families.counter(
            "akv_engine_tasks_total",
            "Engine tasks that ended: completed, failed (raised), or skipped (a var they "
            "use carried a failure).",
            value,
            outcome=outcome,
        )
    for state, value in (("waiting", stats.waiting), ("ready", stats.ready)):
        families.gauge(
            "akv_engine_tasks_queued",
            "Engine tasks queued: waiting for their vars, or ready and waiting for a slot.",
            value,
            state=state,
        )
    families.gauge("akv_engine_tasks_running", "Engine tasks holding a slot.", stats.running)
    families.gauge("akv_engine_slots", "Engine tasks that may run at once.", stats.slots)


def shared_memory_families(families: Families, arena: int, used: int) -> None:
    """The shared memory arenas' bytes, and those in use."""
    families.gauge(
        "akv_shared_memory_bytes",
        "Bytes of the shared memory arenas this process sends through to processes on its host.",
        arena,
    )
    families.gauge("akv_shared_memory_used_bytes", "Bytes of those arenas in use.", used)


#: What a role adds to a scrape.
Figures = Callable[[Families], None]


class ProcessMetrics:
    """One process's registry (see the module docstring): ``role``'s figures, labelled
    with ``rank()`` as it is at the scrape, and the process's own metrics."""

    def __init__(self, role: str, rank: Callable[[], int | None], figures: Figures) -> None:
        self.role = role
        self._rank = rank
        self._figures = figures
        self.registry = CollectorRegistry(auto_describe=False)
        # Each yields nothing where it cannot measure (no /proc, not CPython).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(self)

    def collect(self) -> Iterable[Metric]:
        """The role's families now (prometheus_client's collector interface)."""
        families = Families(self.role, self._rank())
        self._figures(families)
        return families.collected()

    def exposition(self) -> bytes:
        """The whole registry in Prometheus's text format."""
        return generate_latest(self.registry)


def observe(app: web.Application, metrics: ProcessMetrics, readiness: Readiness) -> None:
    """Add ``GET /metrics`` (the app's token check applies) and the health probes
    ``/healthz`` and ``/readyz`` (no token: :func:`akv.cluster.health.health_routes`)."""
    app.router.add_get(METRICS_PATH, make_aiohttp_handler(metrics.registry))
    health_routes(app, readiness)
