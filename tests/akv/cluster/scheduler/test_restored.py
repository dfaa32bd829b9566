"""Whether the servers of a job starting from a checkpoint directory restored checkpoints
of one job (akv.cluster.scheduler.restored), and the registration field that tells it."""

from __future__ import annotations

import pytest

from akv.cluster.protocol import RestoredCheckpoint, parse_restored
from akv.cluster.scheduler.restored import disagreement
from akv.cluster.scheduler.roster import Roster
from akv.errors import PeerLostError

JOB = {0: "a" * 32, 1: "b" * 32}
OTHER = {0: "c" * 32, 1: "d" * 32}


def checkpoint(number: int, rank: int, sessions=JOB) -> RestoredCheckpoint:
    return RestoredCheckpoint(number, f"/ck/server-{rank}.akvckpt", sessions if number else {})


def test_servers_that_restored_one_jobs_checkpoints_or_none_agree():
    assert disagreement({0: checkpoint(0, 0), 1: checkpoint(0, 1)}) is None  # a fresh job
    assert disagreement({0: checkpoint(12, 0), 1: checkpoint(3, 1)}) is None  # one job
    # A file written before sessions were kept says nothing against the others.
    assert disagreement({0: checkpoint(12, 0), 1: checkpoint(3, 1, sessions={})}) is None
    # A worker that never reached a server is missing from its file: no disagreement.
    assert disagreement({0: checkpoint(12, 0), 1: checkpoint(3, 1, sessions={0: JOB[0]})}) is None


def test_a_server_without_a_checkpoint_beside_one_that_restored_is_no_disagreement():
    """A server that never held a key writes none: a missing file is not told from a
    deleted one here (a job that found one lost marks the directory instead)."""
    assert disagreement({0: checkpoint(12, 0), 1: checkpoint(0, 1)}) is None


def test_checkpoints_of_two_jobs_are_named_with_the_worker_they_differ_in():
    why = disagreement({0: checkpoint(12, 0), 1: checkpoint(4, 1, sessions=OTHER)})
    assert why is not None
    assert "server 0 restored checkpoint 12 from /ck/server-0.akvckpt and server 1 restored" in why
    assert "written while worker 0 was another process" in why


def test_the_registration_field_round_trips_and_refuses_what_does_not_fit():
    given = checkpoint(12, 0)
    assert parse_restored(given.to_json()) == given
    assert parse_restored(None) is None
    for bad in (
        [],
        {"checkpoint": -1, "path": "p", "sessions": {}},
        {"checkpoint": 1, "path": 5, "sessions": {}},
        {"checkpoint": 1, "path": "p", "sessions": []},
        {"checkpoint": 1, "path": "p", "sessions": {"x": "s"}},
        {"checkpoint": True, "path": "p", "sessions": {}},
    ):
        with pytest.raises(ValueError):
            parse_restored(bad)


def register_servers(roster: Roster, restored: list[RestoredCheckpoint | None]) -> None:
    for rank, value in enumerate(restored):
        roster.register(
            f"s{rank}",
            "server",
            "127.0.0.1",
            4000 + rank,
            10 + rank,
            0.0,
            rank=rank,
            restartable=True,
            restored=value,
        )


def test_the_roster_fails_a_job_whose_servers_disagree_once_the_last_registers():
    roster = Roster(num_workers=2, num_servers=2, heartbeat_timeout_s=5.0)
    register_servers(roster, [checkpoint(12, 0)])
    assert roster.failure is None  # one server so far
    register_servers(roster, [checkpoint(12, 0), checkpoint(4, 1, sessions=OTHER)])
    assert roster.failure is not None and "and server 1 restored checkpoint 4" in roster.failure
    with pytest.raises(PeerLostError, match="not of one job"):
        roster.register("w", "worker", "127.0.0.1", 0, 20, 0.0)


@pytest.mark.parametrize(
    "restored",
    [
        [checkpoint(12, 0), checkpoint(3, 1)],
        [checkpoint(0, 0), checkpoint(0, 1)],
        [None, None],  # no checkpoint directory
        [checkpoint(12, 0), None],  # only one says: nothing to compare
        [checkpoint(12, 0), checkpoint(0, 1)],  # server 1 never held a key
    ],
)
def test_the_roster_starts_a_job_whose_servers_agree(restored):
    roster = Roster(num_workers=2, num_servers=2, heartbeat_timeout_s=5.0)
    register_servers(roster, restored)
    assert roster.failure is None


def test_a_restarted_server_is_not_checked_against_the_others():
    roster = Roster(num_workers=2, num_servers=2, heartbeat_timeout_s=5.0)
    register_servers(roster, [checkpoint(12, 0), checkpoint(3, 1)])
    # Server 1 restarted from no file (deleted): the workers' notes decide, not this check.
    roster.register(
        "s1-again",
        "server",
        "127.0.0.1",
        4100,
        30,
        1.0,
        rank=1,
        restartable=True,
        restored=checkpoint(0, 1),
    )
    assert roster.failure is None and roster.restarts == {1: 1}
