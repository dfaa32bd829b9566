"""The distributed mode's decisions, without any process or socket."""

from __future__ import annotations

import pytest

from akv.dist import config as _config
from akv.dist.placement import Part, place, server_of
from akv.dist.scheduler.roster import Roster
from akv.dist.server.rounds import KeyRounds
from akv.errors import ConfigError, DoublePushError, ServerError

TOKEN = "t" * 32


def env(**extra: str) -> dict[str, str]:
    base = {
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "9091",
        "DMLC_NUM_WORKER": "2",
        "DMLC_NUM_SERVER": "1",
        "AKV_TOKEN": TOKEN,
    }
    base.update(extra)
    return {k: v for k, v in base.items() if v != "<unset>"}


# ------------------------------------------------------------------ configuration


def test_mxnet_variables_configure_a_worker():
    config = _config.from_env(env())
    assert (config.role, config.scheduler_host, config.scheduler_port) == (
        "worker",
        "127.0.0.1",
        9091,
    )
    assert (config.num_workers, config.num_servers, config.rank) == (2, 1, None)
    assert config.scheduler_url == "http://127.0.0.1:9091"
    assert TOKEN not in repr(config)


def test_akv_twins_work_alone_and_agreeing_with_mxnet_names():
    config = _config.from_env(env(DMLC_NUM_WORKER="<unset>", AKV_NUM_WORKERS="3"))
    assert config.num_workers == 3
    assert _config.from_env(env(AKV_NUM_WORKERS="2")).num_workers == 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"DMLC_ROLE": "<unset>"}, r"DMLC_ROLE \(or AKV_ROLE\) is not set: set it to worker"),
        ({"DMLC_ROLE": "boss"}, r"is 'boss': set it to worker, server or scheduler"),
        ({"DMLC_PS_ROOT_URI": "<unset>"}, r"DMLC_PS_ROOT_URI \(or AKV_SCHEDULER_HOST\) is not set"),
        ({"DMLC_PS_ROOT_PORT": "http"}, r"DMLC_PS_ROOT_PORT='http' is not an integer"),
        ({"DMLC_PS_ROOT_PORT": "70000"}, r"is not a TCP port"),
        ({"DMLC_NUM_WORKER": "0"}, r"DMLC_NUM_WORKER=0 must be at least 1"),
        ({"DMLC_NUM_SERVER": "<unset>"}, r"DMLC_NUM_SERVER \(or AKV_NUM_SERVERS\) is not set"),
        ({"AKV_NUM_WORKERS": "3"}, r"AKV_NUM_WORKERS='3' contradicts DMLC_NUM_WORKER='2'"),
        ({"AKV_TOKEN": "<unset>"}, r"AKV_TOKEN is not set: .*akv-launch sets AKV_TOKEN"),
        ({"AKV_TOKEN": "short"}, r"AKV_TOKEN is too short"),
        ({"AKV_RANK": "2"}, r"rank 2 \(from AKV_RANK\) is out of range for 2 workers"),
        ({"AKV_TLS_CERT": "c.pem"}, r"AKV_TLS_CERT and AKV_TLS_KEY go together"),
        ({"AKV_ROUND_TIMEOUT_S": "-1"}, r"AKV_ROUND_TIMEOUT_S='-1' must be a positive number"),
        ({"MXNET_KVSTORE_BIGARRAY_BOUND": "many"}, r"is not a number of elements"),
    ],
)
def test_bad_configuration_names_the_variable(changes, message):
    with pytest.raises(ConfigError, match=message):
        _config.from_env(env(**changes))


def test_rank_comes_from_mpi_or_slurm_when_akv_rank_is_absent():
    assert _config.from_env(env(OMPI_COMM_WORLD_RANK="1")).rank == 1
    assert _config.from_env(env(SLURM_PROCID="0")).rank == 0
    assert _config.from_env(env(AKV_RANK="0", PMI_RANK="1")).rank == 0


def test_bigarray_bound_reads_mxnets_variable_and_timeouts_are_configurable():
    config = _config.from_env(env(MXNET_KVSTORE_BIGARRAY_BOUND="1e3", AKV_BARRIER_TIMEOUT_S="2.5"))
    assert config.bigarray_bound == 1000
    assert config.timeouts.barrier_s == 2.5


# ------------------------------------------------------------------ placement


def test_placement_is_stable_and_independent_of_order():
    assert server_of("conv1_weight", 4) == server_of("conv1_weight", 4)
    assert [server_of(k, 3) for k in range(6)] == [server_of(k, 3) for k in range(6)]
    # Pinned values: the hash must not change between releases (workers must agree).
    assert [server_of(k, 7) for k in (0, 1, 2, "w", "conv1_weight")] == [5, 2, 3, 3, 6]
    assert server_of(10**30, 5) in range(5)  # no overflow for big int keys (MXNet's 9973 bug)


def test_placement_spreads_keys_over_servers():
    used = {server_of(k, 4) for k in range(64)}
    assert used == {0, 1, 2, 3}


def test_small_arrays_live_on_one_server_big_ones_on_all():
    assert place(3, 999, 2, 1000) == (Part(server_of(3, 2), 0, 999),)
    assert place(3, 1000, 2, 1000) == (Part(0, 0, 500), Part(1, 500, 1000))
    parts = place("x", 10, 3, 5)
    assert [p.size for p in parts] == [3, 3, 4]
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 6), (6, 10)]
    assert place("x", 10**7, 1, 5) == (Part(0, 0, 10**7),)


# ------------------------------------------------------------------ sync rounds


def test_a_round_completes_once_every_worker_pushed():
    rounds = KeyRounds(3, num_workers=2, sync=True)
    first = rounds.accept_push(1, now=0.0)
    assert (first.first, first.closes, first.round) == (True, False, 1)
    assert rounds.missing() == [0]
    second = rounds.accept_push(0, now=0.1)
    assert (second.first, second.closes, second.round) == (False, True, 1)
    assert rounds.missing() == []


def test_a_worker_pushing_twice_in_a_round_is_an_error_and_the_round_is_untouched():
    rounds = KeyRounds(3, num_workers=2, sync=True)
    rounds.accept_push(0, now=0.0)
    with pytest.raises(DoublePushError, match=r"worker 0 pushed key 3 twice in round 1.*\[1\]"):
        rounds.accept_push(0, now=0.1)
    assert rounds.missing() == [1]
    assert rounds.accept_push(1, now=0.2).closes


def test_a_pull_waits_for_the_round_of_the_pullers_last_push():
    rounds = KeyRounds("w", num_workers=2, sync=True)
    assert rounds.pull(rounds.last_push_round(0), "before any push")
    rounds.accept_push(0, now=0.0)
    assert not rounds.pull(rounds.last_push_round(0), "ticket-0")
    assert rounds.pull(rounds.last_push_round(1), "worker 1 has not pushed: answer now")
    decision = rounds.accept_push(1, now=0.0)
    assert decision.closes
    assert rounds.applied(decision.round) == ["ticket-0"]
    assert rounds.waiting_tickets() == []


def test_a_pull_for_a_round_never_pushed_is_refused():
    rounds = KeyRounds(1, num_workers=2, sync=True)
    with pytest.raises(ServerError, match="asks for round 2"):
        rounds.pull(2, "t")


def test_overdue_rounds_name_the_missing_workers():
    rounds = KeyRounds(1, num_workers=3, sync=True)
    rounds.accept_push(2, now=10.0)
    assert not rounds.overdue(now=15.0, timeout_s=10.0)
    assert rounds.overdue(now=21.0, timeout_s=10.0)
    assert rounds.missing() == [0, 1]
    rounds.pull(1, "t1")
    assert rounds.take_waiting() == ["t1"]


def test_async_pushes_are_rounds_of_their_own_and_pulls_never_wait():
    rounds = KeyRounds(1, num_workers=2, sync=False)
    assert rounds.accept_push(0, 0.0).closes
    again = rounds.accept_push(0, 0.0)
    assert (again.closes, again.round) == (True, 2)
    assert rounds.pull(rounds.last_push_round(0), "t")


def test_an_unknown_worker_rank_cannot_push():
    with pytest.raises(ServerError, match="unknown worker rank 5"):
        KeyRounds(1, num_workers=2, sync=True).accept_push(5, 0.0)


# ------------------------------------------------------------------ the scheduler's roster


def full_roster() -> Roster:
    roster = Roster(num_workers=2, num_servers=1, heartbeat_timeout_s=5.0)
    roster.register("s", "server", "127.0.0.1", 4000, 10, now=0.0)
    roster.register("w-b", "worker", "127.0.0.1", 0, 11, now=0.0, rank=1)
    roster.register("w-a", "worker", "127.0.0.1", 0, 12, now=0.0)
    return roster


def test_registration_assigns_requested_or_lowest_free_ranks_and_is_idempotent():
    roster = full_roster()
    assert roster.complete()
    assert roster.nodes["w-b"].rank == 1 and roster.nodes["w-a"].rank == 0
    assert roster.register("w-a", "worker", "127.0.0.1", 0, 12, now=1.0).rank == 0
    assert [s.port for s in roster.servers()] == [4000]


def test_registration_says_what_is_missing_and_refuses_extras():
    roster = Roster(num_workers=2, num_servers=1, heartbeat_timeout_s=5.0)
    roster.register("w", "worker", "h", 0, 1, now=0.0)
    assert roster.missing() == (
        "1 of 2 workers and 1 of 1 servers have not registered yet "
        "(registered: workers [0], servers [])"
    )
    with pytest.raises(ServerError, match="worker rank 0 is already taken by worker 0"):
        roster.register("w2", "worker", "h", 0, 2, now=0.0, rank=0)
    roster.register("w3", "worker", "h", 0, 3, now=0.0)
    with pytest.raises(ServerError, match="all 2 worker ranks are taken"):
        roster.register("w4", "worker", "h", 0, 4, now=0.0)


def test_a_barrier_passes_when_every_worker_joined_and_names_the_missing():
    roster = full_roster()
    roster.arrive("w-a", 1, now=0.0)
    assert not roster.passed(1)
    assert roster.barrier_missing(1) == [1]
    roster.arrive("w-a", 1, now=0.1)  # a retried request changes nothing
    roster.arrive("w-b", 1, now=0.2)
    assert roster.passed(1)
    with pytest.raises(ServerError, match="joined barrier 3 but its last one was 1"):
        roster.arrive("w-a", 3, now=0.3)


def test_a_silent_node_fails_the_job_naming_it():
    roster = full_roster()
    roster.heartbeat("w-a", now=4.0)
    roster.heartbeat("s", now=4.0)
    assert roster.check(now=4.5) == []
    dead = roster.check(now=6.0)
    assert [n.describe() for n in dead] == ["worker 1 (pid 11 on 127.0.0.1)"]
    assert roster.failure.startswith("worker 1 (pid 11 on 127.0.0.1) sent no heartbeat for 6.0 s")
    assert roster.servers_should_stop()


def test_a_disconnect_reported_by_a_server_fails_the_job_unless_the_worker_finished():
    roster = full_roster()
    roster.finish("w-a")
    roster.lost("server 0", "worker", 0, "connection reset")
    assert roster.failure is None
    roster.lost("server 0", "worker", 1, "connection reset")
    assert "worker 1 (pid 11 on 127.0.0.1) disconnected from server 0" in roster.failure


def test_servers_stop_after_every_worker_finished_and_the_job_ends_after_them():
    roster = full_roster()
    roster.finish("w-a")
    assert not roster.servers_should_stop()
    roster.finish("w-b")
    assert roster.servers_should_stop() and not roster.done()
    roster.finish("s")
    assert roster.done()


def test_role_flags_override_the_environment(tmp_path):
    from akv.dist.roles import config_from_args, role_parser

    token_file = tmp_path / "token"
    token_file.write_text("f" * 32 + "\n")
    args = role_parser("akv-server", "test").parse_args(
        [
            "--num-workers",
            "3",
            "--host",
            "10.1.2.3",
            "--port",
            "7000",
            "--token-file",
            str(token_file),
        ]
    )
    config = config_from_args("server", args, {**env(), "DMLC_ROLE": "server"})
    assert (config.role, config.num_workers, config.host, config.port) == (
        "server",
        3,
        "10.1.2.3",
        7000,
    )
    assert config.token == "f" * 32
    missing = role_parser("akv-server", "test").parse_args(["--token-file", "/no/such/file"])
    with pytest.raises(ConfigError, match="--token-file '/no/such/file'"):
        config_from_args("server", missing, env())
