"""The scheduler's decisions (:class:`Roster`), driven directly: no socket, a fake clock."""

from __future__ import annotations

import pytest

from akv.cluster.protocol import LAUNCHER_REPORTER
from akv.cluster.scheduler.roster import (
    BarrierState,
    HeartbeatAnswer,
    NodeStatus,
    Registration,
    Roster,
    ServerAddress,
)
from akv.errors import MembershipError, PeerLostError
from akv.limits import SCHEDULER_LINGER_S


def full_roster() -> Roster:
    roster = Roster(num_workers=2, num_servers=1, heartbeat_timeout_s=5.0)
    roster.register("s", "server", "127.0.0.1", 4000, 10, now=0.0)
    roster.register("w-b", "worker", "127.0.0.1", 0, 11, now=0.0, rank=1)
    roster.register("w-a", "worker", "127.0.0.1", 0, 12, now=0.0)
    roster.validate_state()
    return roster


# ------------------------------------------------------------------ registration


def test_registration_assigns_requested_or_lowest_free_ranks_and_is_idempotent():
    roster = full_roster()
    assert roster.complete()
    assert roster.nodes["w-b"].rank == 1 and roster.nodes["w-a"].rank == 0
    assert roster.register("w-a", "worker", "127.0.0.1", 0, 12, now=1.0).rank == 0
    assert [s.port for s in roster.servers()] == [4000]
    roster.validate_state()


def test_registration_says_what_is_missing_and_refuses_extras():
    roster = Roster(num_workers=2, num_servers=1, heartbeat_timeout_s=5.0)
    roster.register("w", "worker", "h", 0, 1, now=0.0)
    assert roster.missing() == (
        "1 of 2 workers and 1 of 1 servers have not registered yet "
        "(registered: workers [0], servers [])"
    )
    with pytest.raises(MembershipError, match="worker rank 0 is already taken by worker 0"):
        roster.register("w2", "worker", "h", 0, 2, now=0.0, rank=0)
    roster.register("w3", "worker", "h", 0, 3, now=0.0)
    with pytest.raises(MembershipError, match="all 2 worker ranks are taken"):
        roster.register("w4", "worker", "h", 0, 4, now=0.0)
    roster.validate_state()


def test_a_rank_out_of_range_is_refused_naming_the_node_and_the_range():
    roster = Roster(num_workers=2, num_servers=1, heartbeat_timeout_s=5.0)
    with pytest.raises(
        MembershipError, match=r"server from h \(pid 7\) asked for server rank 1.*range 0\.\.0"
    ):
        roster.register("s", "server", "h", 4000, 7, now=0.0, rank=1)
    with pytest.raises(MembershipError, match="worker rank -1"):
        roster.register("w", "worker", "h", 0, 8, now=0.0, rank=-1)
    assert roster.nodes == {}


def test_only_workers_and_servers_register():
    roster = Roster(num_workers=1, num_servers=1, heartbeat_timeout_s=5.0)
    with pytest.raises(MembershipError, match="cannot register role 'scheduler'"):
        roster.register("x", "scheduler", "h", 0, 1, now=0.0)
    assert roster.nodes == {}


def test_a_registered_node_gets_the_address_book_once_every_node_registered():
    roster = Roster(num_workers=1, num_servers=2, heartbeat_timeout_s=5.0)
    roster.register("w", "worker", "h", 0, 1, now=0.0)
    roster.register("s1", "server", "10.0.0.3", 4001, 2, now=0.0, rank=1)
    waiting = roster.registration("w")
    assert waiting == Registration(0, None, roster.missing())
    assert not roster.registration_settled()
    roster.register("s0", "server", "10.0.0.2", 4000, 3, now=0.0)
    assert roster.registration_settled()
    assert roster.registration("w") == Registration(
        0, (ServerAddress(0, "10.0.0.2", 4000), ServerAddress(1, "10.0.0.3", 4001))
    )


def test_an_unknown_node_is_refused_everywhere():
    roster = full_roster()
    for call in (
        lambda: roster.registration("ghost"),
        lambda: roster.heartbeat("ghost", now=1.0),
        lambda: roster.arrive("ghost", 1, now=1.0),
        lambda: roster.finish("ghost"),
    ):
        with pytest.raises(MembershipError, match="unknown node id 'ghost': register first"):
            call()


# ------------------------------------------------------------------ barriers


def test_a_barrier_passes_when_every_worker_joined_and_names_the_missing():
    roster = full_roster()
    roster.arrive("w-a", 1, now=0.0)
    assert not roster.passed(1)
    assert roster.barrier_missing(1) == [1]
    roster.arrive("w-a", 1, now=0.1)  # a retried request changes nothing
    assert roster.arrive("w-b", 1, now=0.2) == BarrierState(1, ())
    assert roster.passed(1) and roster.barrier(1).passed and roster.barrier_settled(1)
    with pytest.raises(MembershipError, match="joined barrier 3 but its last one was 1"):
        roster.arrive("w-a", 3, now=0.3)
    roster.validate_state()


def test_a_barrier_waits_and_says_which_workers_are_missing():
    roster = full_roster()
    state = roster.arrive("w-b", 1, now=0.0)
    assert state == BarrierState(1, (0,))
    assert not state.passed and not roster.barrier_settled(1)


def test_only_workers_call_barriers():
    roster = full_roster()
    with pytest.raises(MembershipError, match=r"server 0 \(pid 10 on 127.0.0.1\) called a barrier"):
        roster.arrive("s", 1, now=0.0)


# ------------------------------------------------------------------ liveness and failure


def test_a_silent_node_fails_the_job_naming_it():
    roster = full_roster()
    roster.heartbeat("w-a", now=4.0)
    roster.heartbeat("s", now=4.0)
    assert roster.check(now=4.5) == []
    dead = roster.check(now=6.0)
    assert [n.describe() for n in dead] == ["worker 1 (pid 11 on 127.0.0.1)"]
    assert roster.failure.startswith("worker 1 (pid 11 on 127.0.0.1) sent no heartbeat for 6.0 s")
    assert roster.servers_should_stop()


def test_a_heartbeat_carries_the_failure_and_the_order_to_stop():
    roster = full_roster()
    assert roster.heartbeat("s", now=1.0) == HeartbeatAnswer(None, False)
    roster.fail("worker 1 died")
    assert roster.heartbeat("s", now=2.0) == HeartbeatAnswer("worker 1 died", True)


def test_the_first_failure_is_kept():
    roster = full_roster()
    assert roster.fail("first")
    assert not roster.fail("second")
    assert roster.failure == "first"


def test_a_disconnect_reported_by_a_server_fails_the_job_unless_the_worker_finished():
    roster = full_roster()
    roster.finish("w-a")
    assert roster.lost("server 0", "worker", 0, "connection reset") is None
    assert roster.failure is None
    failure = roster.lost("server 0", "worker", 1, "connection reset")
    assert "worker 1 (pid 11 on 127.0.0.1) disconnected from server 0" in roster.failure
    assert failure == roster.failure
    assert roster.lost("server 0", "worker", 1, "again") is None  # reported once


def test_a_node_that_reports_by_its_node_id_is_named_as_a_node_not_by_the_id():
    roster = full_roster()
    failure = roster.lost("w-a", "server", 0, "connection reset")
    assert failure == (
        "server 0 (pid 10 on 127.0.0.1) disconnected from worker 0 (pid 12 on 127.0.0.1) "
        "without closing: connection reset"
    )


def test_after_a_failure_registrations_and_barriers_are_refused_with_the_reason():
    roster = full_roster()
    roster.fail("server 0 (pid 10 on 127.0.0.1) sent no heartbeat")
    reason = r"the job failed: server 0 \(pid 10 on 127.0.0.1\) sent no heartbeat"
    with pytest.raises(PeerLostError, match=reason):
        roster.register("late", "worker", "h", 0, 20, now=1.0)
    with pytest.raises(PeerLostError, match=reason):
        roster.registration("w-a")
    with pytest.raises(PeerLostError, match=reason):
        roster.arrive("w-a", 1, now=1.0)
    with pytest.raises(PeerLostError, match=reason):
        roster.barrier(1)
    assert roster.registration_settled() and roster.barrier_settled(1)


# ------------------------------------------------------------------ the end


def test_servers_stop_after_every_worker_finished_and_the_job_ends_after_them():
    roster = full_roster()
    assert not roster.finish("w-a")
    assert not roster.servers_should_stop()
    assert roster.finish("w-b")
    assert roster.servers_should_stop() and not roster.done()
    roster.finish("s")
    assert roster.done()


def test_the_scheduler_exits_0_one_check_after_the_job_ended():
    roster = full_roster()
    for node_id in ("w-a", "w-b", "s"):
        roster.finish(node_id)
    assert roster.exit_status(now=10.0) is None  # the end is noted, not acted on yet
    assert roster.exit_status(now=10.5) == 0


def test_after_a_failure_the_scheduler_lingers_for_two_heartbeats_then_exits_1():
    roster = Roster(1, 1, heartbeat_timeout_s=5.0, heartbeat_interval_s=4.0)
    assert roster.exit_status(now=0.0) is None
    roster.fail("worker 0 died")
    assert roster.linger_s() == 8.0
    assert roster.exit_status(now=1.0) is None
    assert roster.exit_status(now=9.0) is None
    assert roster.exit_status(now=9.5) == 1
    assert Roster(1, 1, 5.0, heartbeat_interval_s=0.1).linger_s() == 0.0
    quick = Roster(1, 1, 5.0, heartbeat_interval_s=0.1)
    quick.fail("x")
    assert quick.linger_s() == SCHEDULER_LINGER_S


def test_a_running_job_never_exits():
    roster = full_roster()
    roster.finish("w-a")
    assert roster.exit_status(now=1000.0) is None


def test_statistics_list_every_node_by_role_and_rank():
    roster = full_roster()
    roster.finish("w-a")
    statistics = roster.statistics()
    assert statistics.complete and statistics.failure is None
    assert statistics.nodes == (
        NodeStatus("server", 0, "127.0.0.1", 4000, 10, False, False),
        NodeStatus("worker", 0, "127.0.0.1", 0, 12, True, False),
        NodeStatus("worker", 1, "127.0.0.1", 0, 11, False, False),
    )


def test_validate_state_catches_a_broken_invariant():
    roster = full_roster()
    roster.nodes["w-a"].rank = 1
    with pytest.raises(AssertionError, match=r"two workers hold the same rank: \[1, 1\]"):
        roster.validate_state()


def test_a_node_reporting_itself_is_named_as_stopping_not_as_lost():
    roster = full_roster()
    failure = roster.lost("s", "server", 0, "was stopped by a signal")
    assert failure == "server 0 (pid 10 on 127.0.0.1) was stopped by a signal"
    assert roster.nodes["s"].dead


def test_the_launcher_reports_what_it_saw_of_a_process_by_role_and_rank():
    roster = full_roster()
    detail = "exited with signal SIGKILL (seen by akv-launch)"
    failure = roster.lost(LAUNCHER_REPORTER, "worker", 1, detail)
    assert failure is not None and failure.startswith("worker 1 (pid ")
    assert failure.endswith(f") {detail}")
    assert "disconnected" not in failure


# ------------------------------------------------------------------ restartable servers


def restartable_roster(restart_s: float = 30.0) -> Roster:
    roster = Roster(num_workers=1, num_servers=1, heartbeat_timeout_s=5.0, restart_s=restart_s)
    roster.register("s1", "server", "127.0.0.1", 4000, 10, now=0.0, rank=0, restartable=True)
    roster.register("w", "worker", "127.0.0.1", 0, 11, now=0.0)
    return roster


def test_a_restarted_server_takes_over_its_rank_and_gives_workers_its_new_address():
    roster = restartable_roster()
    roster.register("s2", "server", "127.0.0.1", 4100, 20, now=1.0, rank=0, restartable=True)
    assert "s1" not in roster.nodes and roster.restarts == {0: 1}
    assert roster.server_addresses() == [ServerAddress(0, "127.0.0.1", 4100, True)]
    assert roster.registration("w").servers == (ServerAddress(0, "127.0.0.1", 4100, True),)
    assert roster.failure is None
    roster.validate_state()


def test_a_server_restarted_after_the_job_ended_takes_over_and_is_told_to_stop():
    """Killed as it stopped, while a worker's process still ran (its store closed): the
    launcher restarts it. Before, the scheduler refused the restart its rank ("already
    taken" by the server that had finished), which exited 1 and failed a job that had
    ended well."""
    roster = restartable_roster()
    roster.finish("w")
    roster.finish("s1")
    assert roster.done()
    roster.register("s2", "server", "127.0.0.1", 4100, 20, now=1.0, rank=0, restartable=True)
    assert "s1" not in roster.nodes and roster.restarts == {0: 1}
    assert roster.heartbeat("s2", 2.0) == HeartbeatAnswer(None, True)
    assert not roster.done()  # until it finished too
    roster.finish("s2")
    assert roster.done() and roster.failure is None
    roster.validate_state()


def test_only_a_restartable_server_may_take_over_a_restartable_rank():
    roster = restartable_roster()
    with pytest.raises(MembershipError, match="already taken"):
        roster.register("s2", "server", "127.0.0.1", 4100, 20, now=1.0, rank=0)
    plain = full_roster()
    with pytest.raises(MembershipError, match="already taken"):
        plain.register("s2", "server", "127.0.0.1", 4100, 20, now=1.0, rank=0, restartable=True)


def test_a_silent_restartable_server_has_the_restart_window_before_the_job_fails():
    roster = restartable_roster(restart_s=30.0)
    roster.heartbeat("w", 34.0)
    assert roster.check(6.0) == [] and roster.failure is None  # past the heartbeat timeout
    assert roster.check(34.0) == [] and roster.failure is None
    (dead,) = roster.check(35.5)
    assert dead.node_id == "s1"
    assert "was not restarted from its checkpoint within 30 s" in (roster.failure or "")


def test_a_restart_within_the_window_keeps_the_job_alive():
    roster = restartable_roster(restart_s=30.0)
    roster.heartbeat("w", 20.0)
    assert roster.check(20.0) == []
    roster.register("s2", "server", "127.0.0.1", 4100, 20, now=20.0, rank=0, restartable=True)
    roster.heartbeat("w", 40.0)
    roster.heartbeat("s2", 40.0)
    assert roster.check(40.0) == [] and roster.failure is None


# ------------------------------------------------------------------ restored checkpoints


def _restored_job(rounds: tuple[int, int]) -> Roster:
    """Two restartable servers restored from files whose split key "w" and row-sparse key 3
    had these rounds applied (server 0's, server 1's), and the two workers."""
    roster = Roster(num_workers=2, num_servers=2, heartbeat_timeout_s=5.0)
    for rank, applied in enumerate(rounds):
        restored = (f"/ck/server-{rank}.akvckpt", (("w", 7), (3, applied)))
        roster.register(
            f"s{rank}", "server", "h", 4000 + rank, 10 + rank, now=0.0, rank=rank,
            restartable=True, restored=restored,
        )  # fmt: skip
    assert roster.failure is None  # (not whole yet)
    roster.register("w0", "worker", "h", 0, 20, now=0.0)
    roster.register("w1", "worker", "h", 0, 21, now=0.0)
    return roster


def test_servers_restored_from_one_moment_make_a_job():
    roster = _restored_job((9, 9))
    assert roster.failure is None and roster.registration("w0").servers is not None


def test_servers_restored_from_different_moments_fail_the_job_naming_key_rounds_and_files():
    """A job that failed with a server killed (its file older) and was started again on
    its directory: the parts of its split and row-sparse keys would mix rounds."""
    roster = _restored_job((9, 5))
    assert roster.failure is not None
    for part in ("key 3", "9 rounds", "server 0's /ck/server-0.akvckpt", "5 in server 1's",
                 "AKV_ACCEPT_MIXED_RESTORE=1"):  # fmt: skip
        assert part in roster.failure, roster.failure
    with pytest.raises(PeerLostError, match="different points in time"):
        roster.registration("w0")


def test_a_server_restarted_within_the_job_is_not_compared_with_the_others():
    """A restart restores an older file by design: the workers replay what it lacks."""
    roster = _restored_job((9, 9))
    restored = ("/ck/server-1.akvckpt", (("w", 2), (3, 4)))
    roster.register(
        "s1-again", "server", "h", 4101, 30, now=1.0, rank=1, restartable=True, restored=restored
    )
    assert roster.failure is None and roster.restarts == {1: 1}
    assert roster.nodes["s1-again"].restarted and not roster.nodes["s0"].restarted


def test_restored_checkpoints_of_different_moments_may_be_accepted():
    """AKV_ACCEPT_MIXED_RESTORE=1: the job goes on with the parts as they are, told why."""
    roster = Roster(2, 2, heartbeat_timeout_s=5.0, accept_mixed_restore=True)
    for rank, applied in enumerate((9, 5)):
        restored = (f"/ck/server-{rank}.akvckpt", ((3, applied),))
        roster.register(
            f"s{rank}", "server", "h", 4000 + rank, 10 + rank, now=0.0, rank=rank,
            restartable=True, restored=restored,
        )  # fmt: skip
    roster.register("w0", "worker", "h", 0, 20, now=0.0)
    roster.register("w1", "worker", "h", 0, 21, now=0.0)
    assert roster.failure is None and roster.registration("w1").servers is not None
    assert roster.mixed_restore is not None and "key 3" in roster.mixed_restore
