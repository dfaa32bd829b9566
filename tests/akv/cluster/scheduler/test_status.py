"""What the status page decides (:mod:`akv.cluster.scheduler.status`): no socket, a fake
clock, a real :class:`Roster`."""

from __future__ import annotations

import pytest

from akv.cluster.protocol import LAUNCHER_REPORTER
from akv.cluster.scheduler.roster import Node, Roster
from akv.cluster.scheduler.status import (
    LATE_HEARTBEATS,
    Reports,
    RoundWait,
    ServerReport,
    WaitingRound,
    WorkerReport,
    blamed,
    job_status,
    node_state,
    parse_report,
    round_wait,
    rounds_behind,
)

SCHEDULER = ("127.0.0.1", 9000, 1)


def waiting(key: str = "'w'", round_no: int = 3, waiting_s: float = 1.0, *workers: int) -> dict:
    return {"key": key, "round": round_no, "waiting_s": waiting_s, "open": 1, "workers": [*workers]}


# ------------------------------------------------------------------ reports


def test_reports_are_parsed_by_the_nodes_role():
    assert parse_report("worker", {"pushes": 4, "pulls": 3, "rounds": 2, "new": 1}, 2) == (
        WorkerReport(4, 3, 2)
    )
    server = {"keys": 2, "bytes": 64, "rounds": 5, "waiting": waiting("'w'", 6, 0.5, 1, 1)}
    assert parse_report("server", server, 2) == ServerReport(
        2, 64, 5, WaitingRound("'w'", 6, 0.5, 1, (1,))
    )
    assert parse_report("server", {"keys": 0, "bytes": 0, "rounds": 0, "waiting": None}, 2) == (
        ServerReport(0, 0, 0)
    )


@pytest.mark.parametrize(
    ("role", "report", "message"),
    [
        ("worker", [], "report must be an object"),
        ("worker", {"pushes": 1, "pulls": 1}, "report.rounds must be an integer, not NoneType"),
        ("worker", {"pushes": True, "pulls": 1, "rounds": 1}, "report.pushes must be an integer"),
        ("worker", {"pushes": -1, "pulls": 1, "rounds": 1}, r"report.pushes -1 is out of range"),
        ("server", {"keys": 1, "bytes": 2**64, "rounds": 0}, "report.bytes .* is out of range"),
        ("server", {"keys": 1, "bytes": 1, "rounds": 0, "waiting": 3}, "waiting must be an obj"),
        ("server", {"keys": 1, "bytes": 1, "rounds": 0, "waiting": waiting("k" * 81)}, "key must"),
        (
            "server",
            {"keys": 1, "bytes": 1, "rounds": 0, "waiting": waiting("'w'", 1, -1.0)},
            "waiting_s -1.0 is not a duration",
        ),
        (
            "server",
            {"keys": 1, "bytes": 1, "rounds": 0, "waiting": waiting("'w'", 1, 1.0, 2)},
            "holds 2, not a worker rank",
        ),
        (
            "server",
            {"keys": 1, "bytes": 1, "rounds": 0, "waiting": waiting("'w'", 1, 1.0, 0, 1, 0)},
            "at most 2",
        ),
        ("scheduler", {}, "a scheduler sends no report"),
    ],
)
def test_a_malformed_report_is_a_value_error_naming_the_field(role, report, message):
    with pytest.raises(ValueError, match=message):
        parse_report(role, report, num_workers=2)


# ------------------------------------------------------------------ decisions


def node(last_seen: float = 0.0, **fields) -> Node:
    return Node("n", "worker", 0, "h", 0, 1, last_seen, **fields)


@pytest.mark.parametrize(
    ("fields", "now", "assembled", "state"),
    [
        ({}, 0.5, True, "running"),
        ({}, 0.5, False, "joined"),
        ({}, LATE_HEARTBEATS * 1.0 + 0.1, True, "late"),
        ({"restartable": True}, 3.5, True, "late"),
        ({"restartable": True}, 10.5, True, "restarting"),
        ({"finished": True}, 100.0, True, "finished"),
        ({"dead": True}, 0.0, True, "dead"),
    ],
)
def test_a_nodes_state(fields, now, assembled, state):
    assert (
        node_state(
            node(**fields),
            now,
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=10.0,
            assembled=assembled,
        )
        == state
    )


def test_workers_are_behind_the_fastest_by_rounds():
    assert rounds_behind({0: 7, 1: 4, 2: 7}) == {0: 0, 1: 3, 2: 0}
    assert rounds_behind({}) == {}


def test_the_round_waits_for_every_worker_an_open_round_needs_since_the_oldest():
    a = ServerReport(1, 8, 4, WaitingRound("'a'", 5, 2.0, 1, (1,)))
    b = ServerReport(1, 8, 4, WaitingRound("'b'", 5, 1.0, 2, (0, 2)))
    idle = ServerReport(1, 8, 5)
    # b's report is older: it has waited 1 s more than it said, and that is the longest.
    wait = round_wait([(0, a, 10.0), (1, b, 8.5), (2, idle, 10.0)], now=10.0)
    assert wait == RoundWait((0, 1, 2), 2.5, 1, "'b'", 5)
    assert round_wait([(2, idle, 10.0)], now=10.0) is None


def test_the_failure_blames_the_node_its_reason_names_first():
    roster = Roster(2, 1, heartbeat_timeout_s=5.0)
    roster.register("s", "server", "10.0.0.1", 4000, 10, now=0.0)
    roster.register("w0", "worker", "10.0.0.2", 0, 11, now=0.0)
    roster.register("w1", "worker", "10.0.0.3", 0, 12, now=0.0)
    roster.heartbeat("s", 6.0)
    roster.heartbeat("w0", 6.0)
    roster.check(6.0)  # worker 1 went silent
    assert blamed(roster.failure) == {"role": "worker", "rank": 1}

    reported = Roster(2, 1, heartbeat_timeout_s=5.0)
    reported.register("s", "server", "10.0.0.1", 4000, 10, now=0.0)
    reported.register("w0", "worker", "10.0.0.2", 0, 11, now=0.0)
    reported.lost("w0", "server", 0, "its stream ended")
    assert blamed(reported.failure) == {"role": "server", "rank": 0}

    launched = Roster(1, 1, heartbeat_timeout_s=5.0)
    launched.lost(LAUNCHER_REPORTER, "worker", 0, "exited with code 3")
    assert blamed(launched.failure) == {"role": "worker", "rank": 0}

    stopped = Roster(1, 1, heartbeat_timeout_s=5.0)
    stopped.fail("the scheduler was stopped by a signal (SIGTERM or Ctrl-C)")
    assert blamed(stopped.failure) == {"role": "scheduler", "rank": None}

    unassembled = Roster(1, 1, heartbeat_timeout_s=5.0)
    unassembled.check_assembly(now=10.0, deadline=5.0)
    assert unassembled.failure is not None and blamed(unassembled.failure) is None
    assert blamed(None) is None


# ------------------------------------------------------------------ the whole job


def test_the_job_status_shows_every_rank_with_its_reports_and_who_the_round_waits_for():
    roster = Roster(2, 2, heartbeat_timeout_s=5.0, heartbeat_interval_s=1.0)
    roster.register("s0", "server", "10.0.0.1", 4000, 10, now=0.0, bound_host="0.0.0.0")
    roster.register("w0", "worker", "10.0.0.2", 0, 11, now=0.0)
    roster.register("w1", "worker", "10.0.0.3", 0, 12, now=0.0)
    reports = Reports()
    reports.heard("s0", ServerReport(3, 96, 7, WaitingRound("'w'", 8, 1.5, 1, (1,))), 1.0)
    reports.heard("w0", WorkerReport(24, 21, 8), 1.0)
    reports.heard("w1", WorkerReport(21, 21, 7), 1.0)
    roster.heartbeat("s0", 2.0)
    roster.heartbeat("w0", 2.0)
    status = job_status(roster, reports, now=2.0, scheduler=SCHEDULER)

    assert status["job"] == {
        "state": "assembling",
        "workers": 2,
        "servers": 2,
        "assembled": False,
        "restarts": 0,
    }
    assert status["failure"] is None
    assert status["round"] == {
        "waiting_for": [1],
        "waiting_s": 2.5,
        "server": 0,
        "key": "'w'",
        "round": 8,
    }
    rows = {(n["role"], n["rank"]): n for n in status["nodes"]}
    assert list(rows) == [
        ("scheduler", None),
        ("server", 0),
        ("server", 1),
        ("worker", 0),
        ("worker", 1),
    ]
    assert rows[("scheduler", None)]["address"] == "127.0.0.1:9000"
    assert rows[("server", 0)] == {
        "role": "server",
        "rank": 0,
        "address": "10.0.0.1:4000",
        "bound": "0.0.0.0:4000",
        "pid": 10,
        "state": "joined",
        "heartbeat_age_s": 0.0,
        "restarts": 0,
        "keys": 3,
        "bytes": 96,
        "rounds": 7,
        "waiting": {"key": "'w'", "round": 8, "waiting_s": 2.5, "open": 1, "workers": [1]},
    }
    assert rows[("server", 1)]["state"] == "not joined"
    assert rows[("server", 1)]["address"] is None and rows[("server", 1)]["keys"] is None
    assert rows[("worker", 0)]["address"] == "10.0.0.2"  # a worker listens on no port
    assert (rows[("worker", 0)]["pushes"], rows[("worker", 0)]["behind"]) == (24, 0)
    assert (rows[("worker", 1)]["heartbeat_age_s"], rows[("worker", 1)]["behind"]) == (2.0, 1)


def test_a_failed_job_names_the_blamed_node_and_a_dead_servers_wait_is_not_the_rounds():
    roster = Roster(1, 1, heartbeat_timeout_s=5.0, heartbeat_interval_s=1.0)
    roster.register("s0", "server", "10.0.0.1", 4000, 10, now=0.0)
    roster.register("w0", "worker", "10.0.0.2", 0, 11, now=0.0)
    reports = Reports()
    reports.heard("s0", ServerReport(1, 4, 2, WaitingRound("'w'", 3, 0.0, 1, (0,))), 0.0)
    roster.heartbeat("w0", 6.0)
    roster.check(6.0)
    status = job_status(roster, reports, now=6.0, scheduler=SCHEDULER)
    assert status["job"]["state"] == "failed"
    assert status["failure"]["blamed"] == {"role": "server", "rank": 0}
    assert status["failure"]["reason"].startswith("server 0 (pid 10 on 10.0.0.1) sent no heartbeat")
    assert status["round"] is None
    assert [n["state"] for n in status["nodes"]] == ["running", "dead", "running"]


def test_a_restarted_server_counts_its_restarts_and_shows_its_successor():
    roster = Roster(1, 1, heartbeat_timeout_s=5.0)
    roster.register("s-old", "server", "10.0.0.1", 4000, 10, now=0.0, restartable=True)
    roster.register("w0", "worker", "10.0.0.2", 0, 11, now=0.0)
    reports = Reports()
    reports.heard("s-old", ServerReport(9, 9, 9), 0.0)
    roster.register("s-new", "server", "10.0.0.1", 4001, 20, now=1.0, rank=0, restartable=True)
    status = job_status(roster, reports, now=1.0, scheduler=SCHEDULER)
    server = status["nodes"][1]
    assert (server["pid"], server["restarts"], server["keys"]) == (20, 1, None)
    assert status["job"]["restarts"] == 1
