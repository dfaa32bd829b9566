"""Real supervised jobs on 127.0.0.1: prefixed output, log files, exit codes, stopping.

The jobs run through :func:`akv.launch.command.launch` with stand-in role programs (see
``support.py``); what is checked is what :func:`akv.launch.supervisor.supervise` does.
"""

from __future__ import annotations

import io
import os
import re
import stat
from dataclasses import replace

import pytest

from akv.errors import LaunchError
from akv.launch import command
from akv.launch.spec import ProcessSpec
from akv.launch.supervisor import supervise
from tests.akv.launch.support import (
    JOB_TIMEOUT_S,
    PYTHON,
    SERVER_DIES,
    SERVER_FAILS,
    SERVER_IGNORES_SIGTERM,
    TOKEN,
    before_summary,
    job_options,
    pids_in,
    run_job,
    wait_gone,
)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_local_job_runs_every_role_prefixes_output_and_exits_0(tmp_path, reaper):
    result = run_job(job_options(tmp_path, num_servers=2), reaper)
    assert result.code == 0, result.err
    out_lines, err_lines = result.out.splitlines(), before_summary(result.err)
    assert "[scheduler] listening on 127.0.0.1" in out_lines
    assert "[scheduler] workers closed: 0,1" in out_lines  # they reached it on the inherited fd
    assert "[server 1] server 1 host 127.0.0.1 127.0.0.1" in out_lines
    assert "[worker 0] worker 0 of 2" in out_lines
    assert "[worker 1] worker 1 on stderr" in err_lines
    assert all(line.startswith("[") for line in out_lines)
    assert err_lines[-1].startswith("akv-launch: ") and "every process finished" in err_lines[-1]
    assert len(result.pids) == 5
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_first_failing_worker_exit_code_is_the_jobs_and_nothing_survives(tmp_path, reaper):
    actions = {"0": ["sleep"], "1": ["spawn", "exit:3"], "2": ["sleep"]}
    result = run_job(job_options(tmp_path, actions, num_workers=3), reaper)
    assert result.code == 3, result.err
    worker1 = pids_in("\n".join(x for x in result.out.splitlines() if x.startswith("[worker 1]")))
    # The other workers (which sleep: nothing tells them) get the report grace, then stop.
    assert (
        f"akv-launch: worker 0, worker 2 still running 5 s after worker 1 (pid {worker1[0]}) "
        "exited with code 3 while 2 workers still ran; stopping the job"
    ) in result.err
    assert len(result.pids) == 6  # scheduler, server, 3 workers, worker 1's grandchild
    assert not wait_gone(result.pids, timeout_s=0.5)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_grandchildren_of_a_successful_job_are_ended(tmp_path, reaper):
    result = run_job(job_options(tmp_path, {"0": ["spawn", "bye"]}, num_workers=1), reaper)
    assert result.code == 0, result.err
    assert len(result.pids) == 4
    assert not wait_gone(result.pids, timeout_s=0.5)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_worker_killed_by_a_signal_exits_137_and_says_so(tmp_path, reaper):
    result = run_job(job_options(tmp_path, {"0": ["kill"]}, num_workers=1), reaper)
    assert result.code == 137
    assert "exited with signal SIGKILL; stopping the job" in result.err


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_failing_server_stops_the_job_with_its_code(tmp_path, reaper):
    options = job_options(tmp_path, {"0": ["sleep"], "1": ["sleep"]})
    result = run_job(replace(options, server_command=(PYTHON, "-c", SERVER_FAILS)), reaper)
    assert result.code == 4
    assert "exited with code 4 while 2 workers still ran; stopping the job" in result.err
    assert not wait_gone(result.pids, timeout_s=0.5)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_servers_still_up_after_the_grace_are_terminated_then_killed(tmp_path, reaper):
    options = job_options(tmp_path, grace_s=0.3)
    options = replace(options, server_command=(PYTHON, "-c", SERVER_IGNORES_SIGTERM))
    result = run_job(options, reaper)
    assert result.code == 0, result.err
    assert "server 0 still running 0.3 s after every worker finished; terminating" in result.err
    assert "did not stop within 1 s of SIGTERM; sending SIGKILL" in result.err
    assert not wait_gone(result.pids, timeout_s=0.5)


def test_a_command_that_does_not_exist_exits_127(tmp_path, reaper):
    options = job_options(tmp_path, command=(str(tmp_path / "no-such-program"),))
    result = run_job(options, reaper)
    assert result.code == 127
    assert "could not start worker 0: " in result.err


# ------------------------------------------------------------------ --max-restarts


def _restart_options(tmp_path, actions, deaths: int, max_restarts: int, **env):
    """One worker; its server SIGKILLs itself on its first ``deaths`` runs (SERVER_DIES)."""
    options = job_options(
        tmp_path,
        actions,
        num_workers=1,
        checkpoint_dir=str(tmp_path / "ckpt"),
        max_restarts=max_restarts,
        server_command=(PYTHON, "-c", SERVER_DIES),
    )
    return replace(options, env={**options.env, "TEST_SERVER_DEATHS": str(deaths), **env})


def _server_runs(tmp_path) -> list[int]:
    return [int(pid) for pid in (tmp_path / "ckpt" / "server-0.runs").read_text().split()]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_server_that_dies_is_restarted_and_the_job_succeeds(tmp_path, reaper):
    serving = tmp_path / "ckpt" / "server-0.serving"
    actions = {"0": [f"wait-for:{serving}", "bye"]}  # the worker outlives the first server
    result = run_job(_restart_options(tmp_path, actions, deaths=1, max_restarts=2), reaper)
    assert result.code == 0, result.err
    first, second = _server_runs(tmp_path)
    assert serving.read_text() == str(second)  # the restarted server ran, as a new process
    assert (
        f"akv-launch: server 0 (pid {first}) exited with signal SIGKILL; restarting it from "
        "its checkpoint (restart 1 of 2)\n"
    ) in result.err
    out_lines = result.out.splitlines()
    assert "[server 0] server 0 run 0 dies" in out_lines
    assert "[server 0] server 0 run 1 serves" in out_lines  # the same prefix
    assert f"akv-launch: server 0 (pid {second}) exited with code 0" in result.err
    assert before_summary(result.err)[-1].endswith("every process finished")
    assert len(result.pids) == 4 and {first, second} <= set(result.pids)
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_who_has_joined_is_still_said_after_a_server_is_restarted(tmp_path, reaper, monkeypatch):
    # The watch stops at a process's first exit, but a restarted server's: the job may
    # still assemble (its progress lines stopped at the restart; found by a review).
    err = io.BytesIO()

    class Watch:
        first_stop: str | None = None

        def start(self, say) -> None:
            pass

        def stop(self, wait: bool = True) -> None:
            if Watch.first_stop is None:
                Watch.first_stop = err.getvalue().decode()

    monkeypatch.setattr(command, "assembly_watch", lambda *args, **kwargs: Watch())
    serving = tmp_path / "ckpt" / "server-0.serving"
    options = _restart_options(tmp_path, {"0": [f"wait-for:{serving}", "bye"]}, 1, 2)
    out = io.BytesIO()
    environ = {**os.environ, "AKV_TOKEN": TOKEN}
    code = command.launch(options, environ, stdout=out, stderr=err, terminate_grace_s=1.0)
    reaper.extend(pids_in(out.getvalue().decode()))
    assert code == 0, err.getvalue().decode()
    assert Watch.first_stop is not None and "restarting it from" in Watch.first_stop


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_server_that_dies_more_often_than_max_restarts_fails_the_job(tmp_path, reaper):
    options = _restart_options(tmp_path, {"0": ["sleep"]}, deaths=5, max_restarts=1)
    result = run_job(options, reaper)
    assert result.code == 137, result.err
    first, second = _server_runs(tmp_path)  # started once, restarted once, not again
    assert (
        f"server 0 (pid {first}) exited with signal SIGKILL; restarting it from its "
        "checkpoint (restart 1 of 1)"
    ) in result.err
    assert (
        f"server 0 (pid {second}) exited with signal SIGKILL (no restarts left: "
        "--max-restarts 1) while 1 worker still ran; the job failed"
    ) in result.err
    assert not wait_gone(result.pids, timeout_s=0.5)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_restarted_server_is_stopped_at_the_end_like_any_other(tmp_path, reaper):
    serving = tmp_path / "ckpt" / "server-0.serving"
    options = _restart_options(
        tmp_path,
        {"0": [f"wait-for:{serving}", "bye"]},
        deaths=1,
        max_restarts=1,
        TEST_SERVER_THEN="sleep",
    )
    result = run_job(replace(options, grace_s=0.3), reaper)
    assert result.code == 0, result.err
    restarted = _server_runs(tmp_path)[1]
    # Counted from the last worker's exit, or (once the stand-in scheduler exited 0 too: it
    # exits once the worker said bye) from the job's good end.
    assert re.search(
        r"server 0 still running 0\.3 s after (every worker finished|the job ended well); "
        r"terminating",
        result.err,
    ), result.err
    assert restarted in result.pids
    assert not wait_gone([restarted], timeout_s=0.5)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_restarted_server_goes_on_writing_to_its_log_file(tmp_path, reaper):
    serving = tmp_path / "ckpt" / "server-0.serving"
    options = _restart_options(tmp_path, {"0": [f"wait-for:{serving}", "bye"]}, 1, 1)
    result = run_job(replace(options, log_dir=str(tmp_path / "logs")), reaper)
    assert result.code == 0, result.err
    lines = (tmp_path / "logs" / "server-0.log").read_text().splitlines()
    first, second = _server_runs(tmp_path)
    assert lines == [
        f'[server 0] {{"pid": {first}}}',
        "[server 0] server 0 run 0 dies",
        f'[server 0] {{"pid": {second}}}',
        "[server 0] server 0 run 1 serves",
    ]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_what_a_dead_server_left_in_its_group_is_killed_before_it_is_restarted(tmp_path, reaper):
    serving = tmp_path / "ckpt" / "server-0.serving"
    actions = {"0": [f"wait-for:{serving}", "bye"]}
    options = _restart_options(tmp_path, actions, 1, 1, TEST_SERVER_SPAWN="1")
    result = run_job(options, reaper)
    assert result.code == 0, result.err
    first = _server_runs(tmp_path)[0]
    server_pids = pids_in("\n".join(x for x in result.out.splitlines() if "[server 0]" in x))
    grandchild = server_pids[1]  # printed by the first run, after its own PID
    assert server_pids[0] == first
    message = f"akv-launch: killing what server 0 (pid {first}) left in its process group"
    assert message in result.err
    # No later stop reaches that group: the job's stop ends the restarted server's group.
    assert not wait_gone([grandchild], timeout_s=0.5)


def test_a_server_that_cannot_be_restarted_stops_the_job_like_a_start_failure(tmp_path, reaper):
    # The first run removes its own program: the restart finds nothing to start.
    program = tmp_path / "server.py"
    program.write_text(
        f"#!{PYTHON}\n"
        "import json, os, sys\n"
        "print(json.dumps({'pid': os.getpid()}), flush=True)\n"
        "os.remove(sys.argv[0])\n"
        "sys.exit(1)\n"
    )
    program.chmod(0o755)
    options = _restart_options(tmp_path, {"0": ["sleep"]}, deaths=0, max_restarts=1)
    result = run_job(replace(options, server_command=(str(program),)), reaper)
    assert result.code == 127, result.err
    assert "exited with code 1; restarting it from its checkpoint (restart 1 of 1)" in result.err
    assert "could not start server 0: " in result.err
    assert not wait_gone(result.pids, timeout_s=0.5)


# ------------------------------------------------------------------ --log-dir


def _prefixed(lines: list[str], label: str) -> list[str]:
    return [line for line in lines if line.startswith(f"[{label}] ")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_each_process_also_writes_its_prefixed_lines_to_its_own_log_file(tmp_path, reaper):
    logs = tmp_path / "logs"
    result = run_job(job_options(tmp_path, log_dir=str(logs)), reaper)
    assert result.code == 0, result.err
    console = result.out.splitlines() + result.err.splitlines()
    names = ["scheduler", "server 0", "worker 0", "worker 1"]
    files = {name: (logs / f"{name.replace(' ', '-')}.log") for name in names}
    assert sorted(path.name for path in logs.iterdir()) == sorted(p.name for p in files.values())
    for name, path in files.items():
        lines = path.read_text().splitlines()
        assert lines, name
        assert sorted(lines) == sorted(_prefixed(console, name)), name
    worker1 = files["worker 1"].read_text().splitlines()
    assert "[worker 1] worker 1 of 2" in worker1  # stdout
    assert "[worker 1] worker 1 on stderr" in worker1  # and stderr, in the same file


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_log_dir_leaves_the_console_output_unchanged(tmp_path, reaper):
    plain = run_job(job_options(tmp_path), reaper)
    logged = run_job(job_options(tmp_path, log_dir=str(tmp_path / "logs")), reaper)
    assert (plain.code, logged.code) == (0, 0)

    def shape(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if '{"pid"' not in line)

    assert shape(logged.out) == shape(plain.out)

    def launcher_lines(err: str) -> list[str]:  # without pids and the scheduler's port
        lines = [re.sub(r":\d+/status", ":PORT/status", line) for line in before_summary(err)]
        return sorted(line.split(" (pid")[0] for line in lines)

    assert launcher_lines(logged.err) == launcher_lines(plain.err)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_log_files_of_an_earlier_job_are_overwritten(tmp_path, reaper):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-0.log").write_text("[worker 0] from an earlier job\n")
    (logs / "worker-0.log").chmod(0o644)
    result = run_job(job_options(tmp_path, num_workers=1, log_dir=str(logs)), reaper)
    assert result.code == 0, result.err
    text = (logs / "worker-0.log").read_text()
    assert "earlier job" not in text
    assert "[worker 0] worker 0 of 1\n" in text
    assert stat.S_IMODE((logs / "worker-0.log").stat().st_mode) == 0o600  # narrowed


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_log_files_and_a_new_log_dir_are_the_users_only(tmp_path, reaper):
    logs = tmp_path / "new" / "logs"
    result = run_job(job_options(tmp_path, num_workers=1, log_dir=str(logs)), reaper)
    assert result.code == 0, result.err
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in logs.iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes


def test_a_log_file_that_cannot_be_opened_fails_before_any_process_starts(tmp_path):
    # Were the files opened one by one as processes start, the missing program would be
    # reported (exit 127) before the second log file is tried.
    missing = (str(tmp_path / "no-such-program"),)
    marker = tmp_path / "ran"
    command = (PYTHON, "-c", f"open({str(marker)!r}, 'w')")
    specs = [
        ProcessSpec("worker", 0, missing, {}, {}, log_path=str(tmp_path / "worker-0.log")),
        ProcessSpec("worker", 1, command, {}, {}, log_path=str(tmp_path / "no" / "w-1.log")),
    ]
    err = io.BytesIO()
    with pytest.raises(LaunchError, match=r"--log-dir: cannot write .*w-1\.log: .*nothing was"):
        supervise(specs, grace_s=1, stdout=io.BytesIO(), stderr=err, handle_signals=False)
    assert not marker.exists()
    assert err.getvalue() == b""


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_log_file_that_fails_to_write_is_reported_once_and_the_console_keeps_the_output():
    lines = "import sys\nfor i in range(3): print('line', i)\nprint('oops', file=sys.stderr)"
    spec = ProcessSpec(
        "worker", 0, (PYTHON, "-c", lines), dict(os.environ), {}, log_path="/dev/full"
    )
    out, err = io.BytesIO(), io.BytesIO()
    assert supervise([spec], grace_s=1, stdout=out, stderr=err, handle_signals=False) == 0
    assert out.getvalue().decode().splitlines() == [f"[worker 0] line {i}" for i in range(3)]
    messages = err.getvalue().decode()
    assert "[worker 0] oops\n" in messages
    assert messages.count("akv-launch: cannot write /dev/full: ") == 1
    assert "the rest of worker 0's output goes to the console only" in messages


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_the_process_whose_exit_fails_the_job_is_reported_once(tmp_path):
    env = dict(os.environ)
    die = (PYTHON, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    fail = (PYTHON, "-c", "import time, sys; time.sleep(0.5); sys.exit(4)")
    specs = [ProcessSpec("worker", 0, fail, env, {}), ProcessSpec("worker", 1, die, env, {})]
    reports: list[tuple[str, int | None, str]] = []
    code = supervise(
        specs,
        grace_s=1,
        stdout=io.BytesIO(),
        stderr=io.BytesIO(),
        handle_signals=False,
        report_failure=lambda spec, what: reports.append((spec.role, spec.rank, what)),
    )
    assert code == 128 + 9
    assert reports == [("worker", 1, "exited with signal SIGKILL")]  # not worker 0's too


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_the_report_of_a_failing_exit_names_the_last_error_the_process_logged(tmp_path):
    """A server that cannot start (its checkpoint directory locked by another job) logs why
    and exits 1: the scheduler is told why, and its verdict says so."""
    env = dict(os.environ)
    logs = (
        "import sys; sys.stderr.write('2026-12-07 22:02:39,461 akv-server ERROR "
        "/ck/server-0.lock is locked by another process\\n'); sys.exit(1)"
    )
    waits = (PYTHON, "-c", "import time; time.sleep(30)")
    specs = [
        ProcessSpec("server", 0, (PYTHON, "-c", logs), env, {}),
        ProcessSpec("worker", 0, waits, env, {}),
    ]
    reports: list[tuple[str, int | None, str]] = []
    supervise(
        specs,
        grace_s=1,
        stdout=io.BytesIO(),
        stderr=io.BytesIO(),
        handle_signals=False,
        max_restarts=0,
        report_failure=lambda spec, what: reports.append((spec.role, spec.rank, what)),
    )
    locked = "/ck/server-0.lock is locked by another process"
    assert reports == [("server", 0, f"exited with code 1 after logging: {locked}")]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_the_summary_shows_the_traceback_of_the_process_to_blame(tmp_path):
    env = dict(os.environ)
    raises = (PYTHON, "-c", "print('before'); raise ValueError('boom')")
    later = (
        PYTHON,
        "-c",
        "import sys, time; time.sleep(1); print('x', file=sys.stderr); sys.exit(3)",
    )
    specs = [ProcessSpec("worker", 0, later, env, {}), ProcessSpec("worker", 1, raises, env, {})]
    err = io.BytesIO()
    assert supervise(specs, grace_s=1, stdout=io.BytesIO(), stderr=err, handle_signals=False) == 1
    text = err.getvalue().decode()
    summary = text.split("akv-launch: worker 1's traceback:\n", 1)
    assert len(summary) == 2, text
    assert summary[1].splitlines()[0] == "    Traceback (most recent call last):"
    assert summary[1].rstrip().endswith("    ValueError: boom")
    assert "worker 0's traceback" not in text  # it printed none
