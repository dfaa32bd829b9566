"""Real supervised jobs on 127.0.0.1: prefixed output, log files, exit codes, stopping.

The jobs run through :func:`akv.launch.command.launch` with stand-in role programs (see
``support.py``); what is checked is what :func:`akv.launch.supervisor.supervise` does.
"""

from __future__ import annotations

import io
import os
from dataclasses import replace

import pytest

from akv.errors import LaunchError
from akv.launch.spec import ProcessSpec
from akv.launch.supervisor import supervise
from tests.akv.launch.support import (
    JOB_TIMEOUT_S,
    PYTHON,
    SERVER_FAILS,
    SERVER_IGNORES_SIGTERM,
    job_options,
    pids_in,
    run_job,
    wait_gone,
)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_local_job_runs_every_role_prefixes_output_and_exits_0(tmp_path, reaper):
    result = run_job(job_options(tmp_path, num_servers=2), reaper)
    assert result.code == 0, result.err
    out_lines, err_lines = result.out.splitlines(), result.err.splitlines()
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
    assert f"akv-launch: worker 1 (pid {worker1[0]}) exited with code 3; stopping the job" in (
        result.err
    )
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
    assert [line.split(" (pid")[0] for line in shape(logged.err)] == [
        line.split(" (pid")[0] for line in shape(plain.err)
    ]


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_log_files_of_an_earlier_job_are_overwritten(tmp_path, reaper):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-0.log").write_text("[worker 0] from an earlier job\n")
    result = run_job(job_options(tmp_path, num_workers=1, log_dir=str(logs)), reaper)
    assert result.code == 0, result.err
    text = (logs / "worker-0.log").read_text()
    assert "earlier job" not in text
    assert "[worker 0] worker 0 of 1\n" in text


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
