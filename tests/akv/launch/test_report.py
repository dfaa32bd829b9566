"""What akv-launch tells a person (pure): who has joined, and the summary table."""

from __future__ import annotations

from akv.launch.report import (
    ProcessRecord,
    Tracebacks,
    assembled_line,
    assembly,
    progress_line,
    seconds_text,
    summary_lines,
)


def node(role: str, rank: object, **extra: object) -> dict[str, object]:
    return {"role": role, "rank": rank, "host": "127.0.0.1", "port": 1, **extra}


def test_progress_names_the_workers_still_missing():
    status = {"nodes": [node("server", 0), node("worker", 0), node("worker", 1)]}
    state = assembly(status, num_workers=3, num_servers=1)
    assert progress_line(state) == "2/3 workers joined; waiting for worker 2"
    assert not state.complete


def test_progress_names_servers_first_and_counts_beyond_eight():
    state = assembly({"nodes": [node("worker", 3)]}, num_workers=12, num_servers=2)
    assert progress_line(state) == (
        "0/2 servers and 1/12 workers joined; waiting for server 0, server 1, worker 0, "
        "worker 1, worker 2, worker 4, worker 5, worker 6 and 5 more"
    )


def test_a_malformed_or_dead_node_has_not_joined():
    status = {
        "nodes": [
            node("server", 0, dead=True),
            node("worker", "0"),
            node("worker", 7),
            node("scheduler", None),
            "junk",
            node("worker", True),
        ]
    }
    state = assembly(status, num_workers=1, num_servers=1)
    assert (state.missing("server"), state.missing("worker")) == ([0], [0])
    assert assembly(["not", "a", "dict"], 1, 1).missing("worker") == [0]


def test_a_complete_job_says_so_once():
    status = {"nodes": [node("server", 0), node("worker", 0), node("worker", 1)]}
    state = assembly(status, num_workers=2, num_servers=1)
    assert state.complete
    assert assembled_line(state, 1.234) == "every process joined: 1 server and 2 workers, in 1.2 s"


def test_the_summary_is_a_table_of_role_rank_exit_run_time_and_restarts():
    lines = summary_lines(
        [
            ProcessRecord("scheduler", None, 0, 12.34),
            ProcessRecord("server", 1, -15, 75.0, restarts=2, stopped=True),
            ProcessRecord("worker", 0, 3, 0.25),
            ProcessRecord("worker", 1, -9, 1.0),
            ProcessRecord("workers", None, 0, 2.0, count=4),
            ProcessRecord("worker", 2, None, 0.0),
        ]
    )
    assert lines == [
        "role       rank  exit                 run time  restarts",
        "scheduler  -     0                      12.3 s  0",
        "server     1     SIGTERM (stopped)  1 min 15 s  2",
        "worker     0     3                       0.2 s  0",
        "worker     1     SIGKILL                 1.0 s  0",
        "workers    0-3   0                       2.0 s  0",
        "worker     2     not started                 -  0",
    ]


def test_seconds_read_as_a_person_would():
    assert [seconds_text(s) for s in (0.04, 59.94, 60, 3725, float("inf"))] == [
        "0.0 s",
        "59.9 s",
        "1 min 00 s",
        "62 min 05 s",
        "forever",
    ]


def test_a_failure_report_carries_the_last_error_the_process_logged():
    """A server that could not start (its checkpoint directory locked by another job) logs
    why and exits 1: the report of its exit, and so the job's verdict, say why."""
    kept = Tracebacks()
    assert kept.exited(1, "code 1") == "exited with code 1"
    kept.note(1, b"2026-12-07 22:02:39,461 akv-server INFO server 0 listening\n")
    kept.note(1, b"2026-12-07 22:02:39,461 akv-server ERROR /ck/server-0.lock is locked\n")
    kept.note(1, b"some other line with ERROR in it\n")
    kept.note(2, b"2026-12-07 22:02:40,001 akv.cluster.worker CRITICAL gone\n")
    locked = "exited with code 1 after logging: /ck/server-0.lock is locked"
    assert kept.exited(1, "code 1") == locked
    assert kept.exited(2, "SIGKILL") == "exited with SIGKILL after logging: gone"
    assert kept.exited(3, "code 3") == "exited with code 3"
    kept.started(1)  # restarted: what its earlier run logged is not this run's
    assert kept.exited(1, "code 1") == "exited with code 1"
