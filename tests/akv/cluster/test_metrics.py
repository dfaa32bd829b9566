"""The pure parts of akv's metrics and health probes: histogram counts, per-op counts, the
families a scrape makes (labels, names, types, as prometheus_client's own parser reads
them), the scheduler's mapping of its roster, and what ready means for each role. The
metrics of a real job are tested in test_observe.py."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from akv.cluster.health import scheduler_readiness, server_readiness, worker_readiness
from akv.cluster.metrics import Families, OpCounts, ProcessMetrics, Tally, engine_families
from akv.cluster.protocol import Op
from akv.cluster.scheduler.metrics import roster_figures
from akv.cluster.scheduler.roster import Roster
from akv_engine import EngineStatistics


def scraped(figures, role: str = "server", rank: int | None = 3) -> dict[str, object]:
    """What Prometheus would read of ``figures``: families by name (without the process's
    own metrics)."""
    registry = CollectorRegistry(auto_describe=False)

    class Collector:
        def collect(self):
            families = Families(role, rank)
            figures(families)
            return families.collected()

    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, **labels: str) -> dict[str, float]:
    """Sample name -> value of the samples of ``family`` with these labels."""
    return {
        s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else ""): s.value
        for s in family.samples
        if all(s.labels.get(k) == v for k, v in labels.items())
    }


# ---------------------------------------------------------------- Tally


def test_a_tally_counts_each_value_in_the_first_bucket_that_holds_it():
    tally = Tally([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        tally.observe(value)
    assert tally.counts == [2, 2, 1]  # le is inclusive: 0.1 is in the first
    assert tally.count == 5 and math.isclose(tally.sum, 8.65)
    assert tally.buckets() == [("0.1", 2.0), ("1.0", 4.0), ("+Inf", 5.0)]


@pytest.mark.parametrize("bounds", [[], [1.0, 0.5], [1.0, 1.0]])
def test_a_tally_refuses_bounds_that_are_not_increasing(bounds):
    with pytest.raises(ValueError, match="increasing"):
        Tally(bounds)


def test_a_tally_becomes_a_histogram_that_prometheus_reads():
    tally = Tally([0.1, 1.0])
    tally.observe(0.5)
    tally.observe(2.0)
    family = scraped(lambda f: f.histogram("akv_wait_seconds", "A wait.", tally))[
        "akv_wait_seconds"
    ]
    assert family.type == "histogram"
    assert samples(family, role="server", rank="3") == {
        "akv_wait_seconds_bucket{le=0.1}": 0.0,
        "akv_wait_seconds_bucket{le=1.0}": 1.0,
        "akv_wait_seconds_bucket{le=+Inf}": 2.0,
        "akv_wait_seconds_count": 2.0,
        "akv_wait_seconds_sum": 2.5,
    }


# ---------------------------------------------------------------- OpCounts, Families


def test_requests_are_counted_by_op_name_and_unknown_ops_as_other():
    counts = OpCounts()
    counts.add(Op.PUSH, 100)
    counts.add(Op.PUSH, 20)
    counts.add(Op.PULL, 0)
    counts.add(9999, 5)
    counts.add(15, 1)  # below the slots' bound, but no op: "other" too (it was "op 15")
    families = scraped(lambda f: counts.add_to(f, answers=False))
    requests = families["akv_requests"]
    assert requests.type == "counter"
    by_op = {s.labels["op"]: s.value for s in requests.samples if s.name.endswith("_total")}
    # Every request op from the start (0 until used), an unknown one once seen.
    assert set(by_op) == {op.name.lower() for op in Op if op < Op.REPLY} | {"other"}
    assert (by_op["push"], by_op["pull"], by_op["other"], by_op["init"]) == (2, 1, 2, 0)
    sent = families["akv_request_bytes"]
    sent_by_op = {s.labels["op"]: s.value for s in sent.samples if s.name.endswith("_total")}
    assert (sent_by_op["push"], sent_by_op["pull"], sent_by_op["other"]) == (120, 0, 6)
    assert "akv_request_duration_seconds" not in families  # answers not asked for


def test_answers_add_their_bytes_and_durations_by_op():
    counts = OpCounts()
    counts.add(Op.PUSHPULL, 8)
    counts.answered(Op.PUSHPULL, 8, 0.002)
    counts.answered(Op.PUSHPULL, 8, 0.004)
    families = scraped(lambda f: counts.add_to(f, answers=True), role="worker", rank=0)
    answers = samples(families["akv_answer_bytes"], op="pushpull")
    assert answers == {"akv_answer_bytes_total": 16.0}
    durations = samples(families["akv_request_duration_seconds"], op="pushpull", rank="0")
    assert durations["akv_request_duration_seconds_count"] == 2
    assert math.isclose(durations["akv_request_duration_seconds_sum"], 0.006)
    assert durations["akv_request_duration_seconds_bucket{le=0.0025}"] == 1


def test_every_sample_carries_role_and_rank_first_and_no_rank_is_empty():
    families = scraped(lambda f: f.gauge("akv_thing", "A thing.", 1, kind="x"), "scheduler", None)
    (sample,) = families["akv_thing"].samples
    assert sample.labels == {"role": "scheduler", "rank": "", "kind": "x"}


def test_the_engines_statistics_become_tasks_by_outcome_and_by_state():
    stats = EngineStatistics(
        pushed=10, completed=6, failed=1, skipped=2, waiting=3, ready=4, running=1, slots=8
    )
    families = scraped(lambda f: engine_families(f, stats))
    tasks = families["akv_engine_tasks"]
    assert tasks.type == "counter"
    assert {s.labels["outcome"]: s.value for s in tasks.samples if "_total" in s.name} == {
        "completed": 6,
        "failed": 1,
        "skipped": 2,
    }
    queued = families["akv_engine_tasks_queued"]
    assert {s.labels["state"]: s.value for s in queued.samples} == {"waiting": 3, "ready": 4}
    assert families["akv_engine_tasks_running"].samples[0].value == 1
    assert families["akv_engine_slots"].samples[0].value == 8


def test_a_process_registry_is_its_own_and_holds_the_process_metrics():
    first = ProcessMetrics("server", lambda: 0, lambda f: f.gauge("akv_x", "X.", 1))
    second = ProcessMetrics("server", lambda: 1, lambda f: f.gauge("akv_x", "X.", 2))
    text = first.exposition().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"akv_x", "python_info", "process_cpu_seconds"} <= names
    assert 'akv_x{rank="0",role="server"} 1.0' in text
    assert 'akv_x{rank="1",role="server"} 2.0' in second.exposition().decode()


# ---------------------------------------------------------------- the scheduler's roster


def test_the_roster_becomes_nodes_by_role_and_state_and_restarts_by_server_rank():
    roster = Roster(num_workers=2, num_servers=2, heartbeat_timeout_s=5.0)
    roster.register("s0", "server", "127.0.0.1", 4000, 10, now=0.0, rank=0, restartable=True)
    roster.register("w0", "worker", "127.0.0.1", 0, 11, now=0.0)
    families = scraped(lambda f: roster_figures(f, roster), "scheduler", None)
    assert families["akv_job_assembled"].samples[0].value == 0
    roster.register("s1", "server", "127.0.0.1", 4001, 12, now=0.0)
    roster.register("w1", "worker", "127.0.0.1", 0, 13, now=0.0)
    roster.register("s0b", "server", "127.0.0.1", 4100, 20, now=1.0, rank=0, restartable=True)
    roster.finish("w1")
    families = scraped(lambda f: roster_figures(f, roster), "scheduler", None)
    nodes = {
        (s.labels["node_role"], s.labels["state"]): s.value for s in families["akv_nodes"].samples
    }
    assert nodes == {
        ("worker", "alive"): 1,
        ("worker", "finished"): 1,
        ("worker", "dead"): 0,
        ("server", "alive"): 2,
        ("server", "finished"): 0,
        ("server", "dead"): 0,
    }
    expected = {s.labels["node_role"]: s.value for s in families["akv_nodes_expected"].samples}
    assert expected == {"worker": 2, "server": 2}
    assert families["akv_job_assembled"].samples[0].value == 1
    assert families["akv_job_failed"].samples[0].value == 0
    restarts = {
        s.labels["node_rank"]: s.value
        for s in families["akv_restarts"].samples
        if s.name == "akv_restarts_total"
    }
    assert restarts == {"0": 1, "1": 0}
    roster.lost("s1", "worker", 0, "its stream ended")
    families = scraped(lambda f: roster_figures(f, roster), "scheduler", None)
    assert families["akv_job_failed"].samples[0].value == 1


# ---------------------------------------------------------------- readiness


def test_a_scheduler_is_ready_whenever_it_answers():
    assert scheduler_readiness() is None


def test_a_server_is_ready_from_its_registration_until_it_stops():
    assert server_readiness(registered=False, stopping=False) == (
        "not registered with the scheduler yet"
    )
    assert server_readiness(registered=True, stopping=False) is None
    assert server_readiness(registered=True, stopping=True) == "stopping"


def test_a_worker_is_ready_once_joined_until_its_job_fails():
    assert worker_readiness(joined=False, failed=False) == "joining the job"
    assert worker_readiness(joined=True, failed=False) is None
    assert worker_readiness(joined=True, failed=True) == "the job failed"
