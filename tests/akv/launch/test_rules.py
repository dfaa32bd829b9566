"""The exit rules, driven without processes: which exit ends the job, with which code."""

from __future__ import annotations

import signal

from akv.cluster.protocol import JOB_FAILED_EXIT
from akv.launch.rules import ExitRules, exit_code_of, scheduler_verdict, status_text
from akv.launch.spec import ProcessSpec


def _specs() -> list[ProcessSpec]:
    def spec(role, rank):
        return ProcessSpec(role, rank, ("x",), {}, {})

    return [spec("scheduler", None), spec("server", 0), spec("worker", 0), spec("worker", 1)]


def _rules() -> ExitRules:
    rules = ExitRules(_specs(), grace_s=15)
    for index, pid in enumerate([100, 101, 102, 103]):
        rules.started(index, pid)
    return rules


def test_first_failing_worker_decides_the_exit_code_and_the_others_get_the_report_grace():
    rules = _rules()
    decision = rules.exited(3, 3)
    assert (decision.action, decision.exit_code) == ("report", 3)
    assert decision.message == (
        "worker 1 (pid 103) exited with code 3 while 1 worker still ran; the job failed: "
        "waiting up to 5 s for the workers to report it and exit"
    )
    last = rules.exited(2, 1)
    assert (last.action, last.exit_code) == ("stop", 3)
    assert last.message == "worker 0 (pid 102) exited with code 1; stopping the job"


def test_a_failing_last_worker_stops_the_job_at_once():
    rules = _rules()
    assert rules.exited(2, 0).action == "continue"
    decision = rules.exited(3, 3)
    assert (decision.action, decision.exit_code) == ("stop", 3)
    assert decision.message == "worker 1 (pid 103) exited with code 3; stopping the job"


def test_a_signal_death_is_reported_as_such_with_128_plus_signo():
    decision = _rules().exited(2, -signal.SIGKILL)
    assert (decision.action, decision.exit_code) == ("report", 137)
    assert "worker 0 (pid 102) exited with signal SIGKILL" in decision.message
    assert (status_text(-15), exit_code_of(-15), exit_code_of(4)) == ("signal SIGTERM", 143, 4)


def test_server_failure_while_workers_run_fails_the_job_after_the_workers_report_it():
    rules = _rules()
    decision = rules.exited(1, 1)
    assert (decision.action, decision.exit_code) == ("report", 1)
    assert decision.message == (
        "server 0 (pid 101) exited with code 1 while 2 workers still ran; the job failed: "
        "waiting up to 5 s for the workers to report it and exit"
    )
    assert rules.exited(2, 4).action == "continue"  # the server's failure decides the code
    last = rules.exited(3, 4)
    assert (last.action, last.exit_code) == ("stop", 1)
    assert last.message == "worker 1 (pid 103) exited with code 4; stopping the job"


def test_workers_that_do_not_exit_after_a_server_failure_are_stopped_after_the_grace():
    rules = _rules()
    rules.exited(1, -signal.SIGKILL)
    rules.exited(2, 4)
    decision = rules.report_expired()
    assert (decision.action, decision.exit_code) == ("stop", 137)
    assert decision.message == (
        "worker 1 still running 5 s after server 0 (pid 101) exited with signal SIGKILL while "
        "2 workers still ran; stopping the job"
    )


def test_a_server_that_exits_0_early_is_only_reported():
    decision = _rules().exited(1, 0)
    assert decision.action == "continue"
    assert decision.message == "server 0 (pid 101) exited with code 0"


def test_when_every_worker_exits_0_the_others_get_their_grace_then_are_terminated():
    rules = _rules()
    assert rules.exited(2, 0).action == "continue"
    drain = rules.exited(3, 0)
    assert drain.action == "drain"
    assert "waiting up to 15 s for scheduler, server 0 to stop" in drain.message
    expired = rules.grace_expired()
    assert (expired.action, expired.exit_code) == ("stop", 0)
    assert expired.message == (
        "scheduler, server 0 still running 15 s after every worker finished; terminating"
    )


def test_the_job_ends_with_0_when_the_others_stop_on_their_own_in_the_grace():
    rules = _rules()
    rules.exited(2, 0)
    rules.exited(3, 0)
    assert rules.exited(0, 0).action == "continue"
    assert (rules.exited(1, 0).action, rules.running) == ("stop", frozenset())


def test_a_server_that_fails_during_the_grace_fails_the_job():
    rules = _rules()
    rules.exited(2, 0)
    rules.exited(3, 0)
    decision = rules.exited(1, 2)
    assert (decision.action, decision.exit_code) == ("stop", 2)
    assert "after every worker finished" in decision.message


def test_interruption_exits_128_plus_signo():
    assert _rules().interrupted(signal.SIGINT).exit_code == 130
    assert _rules().interrupted(signal.SIGTERM).exit_code == 143


def test_a_process_that_cannot_start_stops_the_job_with_127():
    decision = _rules().start_failed(2, FileNotFoundError(2, "No such file", "trian.py"))
    assert (decision.action, decision.exit_code) == ("stop", 127)
    assert decision.message.startswith("could not start worker 0: ")


def test_processes_are_named_by_role_rank_host_and_pid():
    assert ProcessSpec("worker", 1, ("x",), {}, {}, host="node2").describe(1234) == (
        "worker 1 on node2 (pid 1234)"
    )
    assert ProcessSpec("server", None, ("x",), {}, {}, count=3).describe(None) == "servers"


def test_the_scheduler_verdict_is_read_from_its_job_failed_line():
    line = (
        "2026-12-03 09:00:00,000 akv.cluster.scheduler ERROR job failed: "
        "worker 1 (pid 7 on h) died\n"
    )
    assert scheduler_verdict(line) == "worker 1 (pid 7 on h) died"
    assert scheduler_verdict("scheduler waiting: 1 of 2 workers have not registered") is None


# ------------------------------------------------------------------ --max-restarts


def _restarting_rules(max_restarts: int) -> ExitRules:
    """Scheduler 100, servers 0 and 1 (101, 102), workers 0 and 1 (103, 104)."""

    def spec(role, rank):
        return ProcessSpec(role, rank, ("x",), {}, {})

    specs = [spec("scheduler", None), spec("server", 0), spec("server", 1)]
    specs += [spec("worker", 0), spec("worker", 1)]
    rules = ExitRules(specs, grace_s=15, max_restarts=max_restarts)
    for index, pid in enumerate([100, 101, 102, 103, 104]):
        rules.started(index, pid)
    return rules


def test_a_server_that_fails_while_workers_run_is_restarted_while_it_has_restarts_left():
    rules = _restarting_rules(2)
    decision = rules.exited(2, -signal.SIGKILL)
    assert (decision.action, decision.exit_code, decision.index) == ("restart", 0, 2)
    assert decision.message == (
        "server 1 (pid 102) exited with signal SIGKILL; restarting it from its checkpoint "
        "(restart 1 of 2)"
    )
    assert 2 not in rules.running
    rules.started(2, 4242)
    assert 2 in rules.running
    second = rules.exited(2, 1)
    assert (second.action, second.index) == ("restart", 2)
    assert second.message == (
        "server 1 (pid 4242) exited with code 1; restarting it from its checkpoint (restart 2 of 2)"
    )
    assert rules.restarts == {2: 2}


def test_a_server_that_ended_because_the_job_failed_is_not_restarted():
    rules = _restarting_rules(2)
    decision = rules.exited(1, JOB_FAILED_EXIT)
    assert (decision.action, decision.exit_code) == ("report", JOB_FAILED_EXIT)
    assert decision.message == (
        "server 0 (pid 101) exited with code 3 (the job had failed, or its checkpoint cannot "
        "be used: no restart mends it) while 2 workers still ran; the job failed: waiting "
        "up to 5 s for the workers to report it and exit"
    )
    assert rules.restarts == {}


def test_restarts_are_counted_per_server():
    rules = _restarting_rules(1)
    assert rules.exited(1, 1).action == "restart"
    rules.started(1, 201)
    assert rules.exited(2, 1).action == "restart"  # server 0's restart is not server 1's
    rules.started(2, 202)
    assert rules.restarts == {1: 1, 2: 1}


def test_a_server_with_no_restarts_left_fails_the_job_saying_the_restarts_were_used_up():
    rules = _restarting_rules(1)
    rules.exited(1, -signal.SIGKILL)
    rules.started(1, 201)
    decision = rules.exited(1, -signal.SIGKILL)
    assert (decision.action, decision.exit_code) == ("report", 137)
    assert decision.message == (
        "server 0 (pid 201) exited with signal SIGKILL (no restarts left: --max-restarts 1) "
        "while 2 workers still ran; the job failed: waiting up to 5 s for the workers to "
        "report it and exit"
    )
    assert rules.exited(2, 1).action == "continue"  # the other server: the job failed already
    rules.exited(3, 1)
    last = rules.exited(4, 1)
    assert (last.action, last.exit_code) == ("stop", 137)


def test_without_max_restarts_a_failing_server_is_not_restarted():
    decision = _restarting_rules(0).exited(1, 1)
    assert decision.action == "report"
    assert "restart" not in decision.message


def test_a_server_that_exits_0_is_never_restarted():
    rules = _restarting_rules(2)
    decision = rules.exited(1, 0)
    assert (decision.action, decision.message) == (
        "continue",
        "server 0 (pid 101) exited with code 0",
    )
    assert rules.restarts == {}


def test_nothing_is_restarted_once_every_worker_finished():
    rules = _restarting_rules(2)
    rules.exited(3, 0)
    assert rules.exited(4, 0).action == "drain"
    decision = rules.exited(1, -signal.SIGKILL)
    assert (decision.action, decision.exit_code) == ("stop", 137)
    assert decision.message == (
        "server 0 (pid 101) exited with signal SIGKILL after every worker finished"
    )


def test_nothing_is_restarted_after_the_job_failed():
    rules = _restarting_rules(2)
    assert rules.exited(0, 1).action == "report"  # the scheduler failed
    decision = rules.exited(1, -signal.SIGKILL)
    assert decision.action == "continue"
    assert decision.message == "server 0 (pid 101) exited with signal SIGKILL"
    assert rules.restarts == {}


def test_workers_and_the_scheduler_are_never_restarted():
    worker = _restarting_rules(2).exited(3, -signal.SIGKILL)
    assert (worker.action, worker.exit_code) == ("report", 137)
    scheduler = _restarting_rules(2).exited(0, 1)
    assert (scheduler.action, scheduler.exit_code) == ("report", 1)
    assert "restart" not in worker.message + scheduler.message


def test_a_group_of_servers_is_never_restarted():
    specs = [
        ProcessSpec("server", None, ("mpirun",), {}, {}, count=2),
        ProcessSpec("worker", None, ("mpirun",), {}, {}, count=2),
    ]
    rules = ExitRules(specs, grace_s=15, max_restarts=3)
    rules.started(0, 10)
    rules.started(1, 11)
    decision = rules.exited(0, 1)
    assert (decision.action, decision.exit_code) == ("report", 1)
    assert "restart" not in decision.message


def test_the_culprit_is_the_process_the_verdict_names_first():
    rules = _rules()
    rules.exited(2, 1)  # worker 0 failed first here, because worker 1 failed the job
    verdict = "worker 1 (pid 103 on h) left its store because its code failed: ValueError: x"
    assert rules.culprit(verdict) == 3
    assert rules.culprit("server 0 at 127.0.0.1:9 was stopped by a signal") == 1


def test_without_a_verdict_naming_a_process_the_culprit_is_the_first_that_failed():
    rules = _rules()
    assert rules.culprit(None) is None
    rules.exited(2, 1)
    rules.exited(3, 1)
    assert rules.culprit(None) == 2
    assert rules.culprit("the scheduler was stopped by a signal (SIGTERM or Ctrl-C)") == 2


def _server_restarted_after_its_goodbye() -> ExitRules:
    """Every process started; worker 1 exited 0, and server 0, killed just after its
    goodbye while worker 0's process still runs, was restarted (pid 201)."""
    rules = ExitRules(_specs(), grace_s=15, max_restarts=1)
    for index, pid in enumerate([100, 101, 102, 103]):
        rules.started(index, pid)
    assert rules.exited(3, 0).action == "continue"  # worker 1
    assert rules.exited(1, -signal.SIGKILL).action == "restart"
    rules.started(1, 201)
    return rules


def test_once_the_scheduler_ended_well_a_servers_exit_fails_nothing():
    """Server 0 is killed just after its goodbye, while worker 0's process still runs: it is
    restarted, the scheduler then exits 0 (the job ended well), and the restart, with no
    job to register with, exits 1. Before, that failed the job (exit 1)."""
    rules = _server_restarted_after_its_goodbye()
    assert rules.exited(0, 0).action == "continue"  # the scheduler: the job ended well
    late = rules.exited(1, 1)
    assert (late.action, late.exit_code) == ("continue", 0)
    assert "exited with code 1 after the job ended well" in late.message
    final = rules.exited(2, 0)  # worker 0, the last process
    assert (final.action, final.exit_code) == ("stop", 0), final


def test_a_restarted_server_gets_a_short_grace_once_the_scheduler_and_workers_ended_well():
    """Server 0 is killed just after its goodbye, while worker 0's process still runs: it is
    restarted; worker 0 then exits, and the scheduler exits 0. The restart has no job to
    register with: it gets 2 s to stop, not the 15 s grace (nor its connect timeout), and
    the job's exit is 0. A server restarted earlier, that only ends its own stop, would stop
    within those 2 s by itself."""
    rules = _server_restarted_after_its_goodbye()
    assert rules.exited(2, 0).action == "drain"  # worker 0: the scheduler and server 0 left
    ended = rules.exited(0, 0)  # the scheduler: the job ended well
    assert (ended.action, ended.grace_s) == ("drain", 2.0), ended
    assert ended.message.endswith("the job ended well; waiting up to 2 s for server 0 to stop")
    expired = rules.grace_expired()
    assert expired.message == "server 0 still running 2 s after the job ended well; terminating"
    assert (expired.action, expired.exit_code) == ("stop", 0)


def test_the_short_grace_holds_when_the_last_worker_exits_after_the_scheduler():
    """The same, the scheduler exiting 0 before the last worker's process (a worker says
    goodbye, then its process ends): the short grace starts at that exit."""
    rules = _server_restarted_after_its_goodbye()
    assert rules.exited(0, 0).action == "continue"  # the scheduler: the job ended well
    ended = rules.exited(2, 0)  # worker 0, the last worker
    assert (ended.action, ended.grace_s) == ("drain", 2.0), ended
    assert ended.message.endswith("the job ended well; waiting up to 2 s for server 0 to stop")
    done = rules.exited(1, 0)  # the restart ends its own stop within the grace
    assert (done.action, done.exit_code) == ("stop", 0), done


def test_the_scheduler_ending_well_stops_nothing_that_was_not_restarted():
    """Without a restart, the servers still running when the scheduler exits 0 finish their
    own stop (the drain goes on)."""
    rules = ExitRules(_specs(), grace_s=15, max_restarts=1)
    for index, pid in enumerate([100, 101, 102, 103]):
        rules.started(index, pid)
    assert rules.exited(3, 0).action == "continue"
    drain = rules.exited(2, 0)
    assert (drain.action, drain.grace_s) == ("drain", 15)  # the launcher's grace
    assert rules.exited(0, 0).action == "continue"
    assert rules.exited(1, 0).action == "stop"
