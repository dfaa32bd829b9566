"""``akv-launch`` end to end: :func:`main` and :func:`launch`, ``python -m akv.launch``,
the checks made before anything starts, and jobs through fake ``ssh``, ``mpirun`` and
``srun`` (see ``support.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest

import akv
from akv.errors import LaunchError
from akv.launch import main as package_main
from akv.launch.args import parse_args
from akv.launch.command import launch, main
from tests.akv.launch.support import (
    JOB_TIMEOUT_S,
    PYTHON,
    SERVER_DIES,
    TOKEN,
    fake_path,
    job_options,
    pids_in,
    run_job,
    wait_gone,
)


def test_python_dash_m_akv_launch_runs_main():
    done = subprocess.run(
        [PYTHON, "-m", "akv.launch", "-n", "1", "--"],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 2
    assert "missing command after `--`" in done.stderr


def test_the_console_script_entry_point_is_main():
    assert package_main is main


def test_python_dash_m_akv_launch_version_prints_the_version():
    done = subprocess.run(
        [PYTHON, "-m", "akv.launch", "--version"],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"akv-launch {akv.__version__}\n", "")


def test_dry_run_starts_nothing(tmp_path, capfdbinary, monkeypatch):
    marker = tmp_path / "ran"
    command = [PYTHON, "-c", f"open({str(marker)!r}, 'w')"]
    monkeypatch.setenv("AKV_TOKEN", TOKEN)
    assert main(["-n", "2", "-s", "1", "--dry-run", "--", *command]) == 0
    out = capfdbinary.readouterr().out.decode()
    assert "# worker 1\nenv AKV_ROLE=worker" in out
    assert "'AKV_SCHEDULER_PORT=<port>'" in out
    assert TOKEN not in out
    time.sleep(0.2)
    assert not marker.exists()


def test_dry_run_without_double_dash_shows_the_whole_worker_command(capfdbinary, monkeypatch):
    monkeypatch.setenv("AKV_TOKEN", TOKEN)
    assert main(["-n", "1", "--dry-run", "python", "train.py", "--epochs", "3", "-n", "5"]) == 0
    out = capfdbinary.readouterr().out.decode()
    assert out.endswith(" PYTHONUNBUFFERED=1 python train.py --epochs 3 -n 5\n")


def test_dry_run_creates_no_log_dir(tmp_path, capfdbinary, monkeypatch):
    monkeypatch.setenv("AKV_TOKEN", TOKEN)
    logs = tmp_path / "logs"
    assert main(["-n", "1", "--dry-run", "--log-dir", str(logs), "python", "x"]) == 0
    out = capfdbinary.readouterr().out.decode()
    assert f"# worker 0, output also in {logs}/worker-0.log\n" in out
    assert not logs.exists()


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_job_started_without_double_dash_passes_every_later_word_to_the_workers(tmp_path, reaper):
    worker = job_options(tmp_path).command[1]
    options = parse_args(["-n", "2", "-s", "1", PYTHON, worker, "--epochs", "3", "-n", "5"])
    stand_ins = job_options(tmp_path)
    options = replace(
        options,
        env=stand_ins.env,
        grace_s=stand_ins.grace_s,
        scheduler_command=stand_ins.scheduler_command,
        server_command=stand_ins.server_command,
    )
    result = run_job(options, reaper)
    assert result.code == 0, result.err
    arguments = '["--epochs", "3", "-n", "5"]'
    assert f"[worker 0] worker 0 arguments {arguments}" in result.out.splitlines()
    assert f"[worker 1] worker 1 arguments {arguments}" in result.out.splitlines()
    assert not wait_gone(result.pids)


def test_a_log_dir_that_cannot_be_created_is_refused_before_anything_starts(tmp_path, reaper):
    blocker = tmp_path / "file"
    blocker.write_text("")
    options = job_options(tmp_path, log_dir=str(blocker / "logs"))
    with pytest.raises(LaunchError, match=f"--log-dir {blocker}/logs cannot be created"):
        launch(options, {**os.environ, "AKV_TOKEN": TOKEN})


HELPER = textwrap.dedent(
    """
    import json, signal, sys
    from akv.launch import LaunchOptions, launch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    sys.exit(launch(LaunchOptions(**json.loads(sys.argv[1])), terminate_grace_s=2))
    """
)


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize(("signo", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_every_process_and_exits_128_plus_signo(
    tmp_path, reaper, signo, code
):
    options = job_options(tmp_path, {"0": ["spawn", "sleep"], "1": ["sleep"]})
    fields = {k: v for k, v in vars(options).items() if v is not None}
    out_path = tmp_path / "out"
    with open(out_path, "wb") as out:
        launcher = subprocess.Popen(
            [PYTHON, "-c", HELPER, json.dumps(fields)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 10
        while len(pids_in(out_path.read_text())) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        reaper.extend(pids_in(out_path.read_text()))
        assert len(reaper) == 5, out_path.read_text()
        launcher.send_signal(signo)
        assert launcher.wait(timeout=10) == code
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
    assert f"akv-launch: interrupted by {signal.Signals(signo).name}" in out_path.read_text()
    assert not wait_gone(reaper, timeout_s=0.5)


def test_a_short_inherited_token_is_refused_up_front(tmp_path, reaper):
    with pytest.raises(LaunchError, match=r"AKV_TOKEN .* has 5 characters"):
        launch(job_options(tmp_path), {**os.environ, "AKV_TOKEN": "short"})


def test_a_scheduler_host_that_is_not_this_machine_is_refused_up_front(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1\n")
    options = job_options(
        tmp_path, launcher="ssh", hostfile=str(hostfile), scheduler_host="192.0.2.1"
    )
    with pytest.raises(LaunchError, match=r"the scheduler cannot listen on '192\.0\.2\.1'"):
        launch(options, fake_path(tmp_path))


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_ssh_job_is_supervised_through_ssh(tmp_path, reaper):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\nnodeB:2222\n")
    options = job_options(
        tmp_path, launcher="ssh", hostfile=str(hostfile), scheduler_host="127.0.0.1", python=PYTHON
    )
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 0, result.err
    assert "[scheduler] workers closed: 0,1" in result.out
    assert "[server 0] server 0 host nodeA nodeA" in result.out
    assert "[worker 1] worker 1 of 2" in result.out
    log = (tmp_path / "fake.log").read_text()
    assert "-p 2222 nodeB bash -s" in log and TOKEN not in log
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_an_ssh_server_that_dies_is_restarted_by_running_its_ssh_again(tmp_path, reaper):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\n")
    serving = tmp_path / "ckpt" / "server-0.serving"
    options = job_options(
        tmp_path,
        {"0": [f"wait-for:{serving}", "bye"]},
        num_workers=1,
        launcher="ssh",
        hostfile=str(hostfile),
        scheduler_host="127.0.0.1",
        python=PYTHON,
        checkpoint_dir=str(tmp_path / "ckpt"),
        max_restarts=1,
        server_command=(PYTHON, "-c", SERVER_DIES),
    )
    options = replace(options, env={**options.env, "TEST_SERVER_DEATHS": "1"})
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 0, result.err
    # The remote script reports the server's SIGKILL as 137, as ssh would.
    assert "server 0 on nodeA (pid " in result.err
    assert "exited with code 137; restarting it from its checkpoint (restart 1 of 1)" in result.err
    assert "[server 0] server 0 run 1 serves" in result.out
    ssh_runs = (tmp_path / "fake.log").read_text().count(" nodeA bash -s")
    assert ssh_runs == 3  # server, worker, and the server again
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_ssh_job_failure_stops_the_remote_processes(tmp_path, reaper):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\nnodeB\n")
    actions = {"0": ["spawn", "sleep"], "1": ["exit:3"]}
    options = job_options(
        tmp_path,
        actions,
        launcher="ssh",
        hostfile=str(hostfile),
        scheduler_host="127.0.0.1",
        python=PYTHON,
    )
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 3, result.err
    assert "worker 1 on nodeA (pid " in result.err
    # The "remote" processes run in sessions of their own: only the script's stdin watch
    # (EOF once ssh is gone) can stop them.
    assert len(result.pids) == 5
    assert not wait_gone(result.pids, timeout_s=8)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_mpi_job_is_supervised_through_mpirun(tmp_path, reaper):
    options = job_options(tmp_path, launcher="mpi", scheduler_host="127.0.0.1")
    options = replace(options, num_servers=2)
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 0, result.err
    assert "[scheduler] workers closed: 0,1" in result.out
    assert "[workers] worker 1 of 2" in result.out
    assert f"[servers] server 1 host {socket.gethostname()}" in result.out
    assert "mpirun -n 2 -x AKV_ROLE" in (tmp_path / "fake.log").read_text()
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_slurm_job_failure_is_supervised_through_srun(tmp_path, reaper):
    options = job_options(
        tmp_path, {"0": ["bye"], "1": ["exit:5"]}, launcher="slurm", scheduler_host="127.0.0.1"
    )
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 5, result.err
    assert "akv-launch: workers (pid " in result.err and "exited with code 5" in result.err
    assert "srun --ntasks=2 --kill-on-bad-exit=1" in (tmp_path / "fake.log").read_text()
    assert not wait_gone(result.pids, timeout_s=1)


@pytest.mark.parametrize(
    ("launcher", "tool"), [("ssh", "ssh"), ("mpi", "mpirun"), ("slurm", "srun")]
)
def test_a_missing_ssh_mpirun_or_srun_is_named_before_anything_starts(tmp_path, launcher, tool):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1\n")
    options = job_options(
        tmp_path, launcher=launcher, hostfile=str(hostfile), scheduler_host="127.0.0.1"
    )
    environ = {"PATH": str(tmp_path), "AKV_TOKEN": TOKEN}
    with pytest.raises(LaunchError, match=f"runs `{tool}`, which is not on PATH"):
        launch(options, environ)


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_children_die_with_a_launcher_killed_by_sigkill(reaper):
    sleeper = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"
    launcher = subprocess.Popen(
        [PYTHON, "-m", "akv.launch", "-n", "2", "-s", "1", "--", PYTHON, "-c", sleeper],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "AKV_TOKEN"},
    )
    reaper.append(launcher.pid)
    workers: list[int] = []
    deadline = time.monotonic() + 30
    while len(workers) < 2 and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        if line.startswith("[worker"):
            workers.append(int(line.split("] ", 1)[1]))
    reaper.extend(workers)
    assert len(workers) == 2
    launcher.kill()  # no chance to clean up: the kernel's parent-death signal must do it
    launcher.wait(10)
    assert not wait_gone(workers, timeout_s=5.0)


# ------------------------------------------------------------------ --log-dir through ssh, mpirun


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_ssh_job_logs_each_remote_process_to_its_own_file(tmp_path, reaper):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\nnodeB\n")
    logs = tmp_path / "logs"
    options = job_options(
        tmp_path,
        launcher="ssh",
        hostfile=str(hostfile),
        scheduler_host="127.0.0.1",
        python=PYTHON,
        log_dir=str(logs),
    )
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 0, result.err
    assert sorted(p.name for p in logs.iterdir()) == [
        "scheduler.log",
        "server-0.log",
        "worker-0.log",
        "worker-1.log",
    ]
    worker1 = (logs / "worker-1.log").read_text().splitlines()
    assert "[worker 1] worker 1 of 2" in worker1
    assert "[worker 1] worker 1 on stderr" in worker1
    assert all(line.startswith("[worker 1] ") for line in worker1)
    assert not wait_gone(result.pids)


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_mpi_group_output_goes_to_one_log_file_per_role(tmp_path, reaper):
    logs = tmp_path / "logs"
    options = job_options(tmp_path, launcher="mpi", scheduler_host="127.0.0.1", log_dir=str(logs))
    result = run_job(options, reaper, fake_path(tmp_path))
    assert result.code == 0, result.err
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "servers.log", "workers.log"]
    workers = (logs / "workers.log").read_text().splitlines()
    assert "[workers] worker 0 of 2" in workers and "[workers] worker 1 of 2" in workers
    assert not wait_gone(result.pids)


def test_a_log_file_that_cannot_be_opened_exits_2_before_anything_starts(
    tmp_path, capsys, monkeypatch
):
    logs = tmp_path / "logs"
    (logs / "worker-0.log").mkdir(parents=True)  # a directory where the file should go
    marker = tmp_path / "ran"
    monkeypatch.setenv("AKV_TOKEN", TOKEN)
    argv = ["-n", "1", "--log-dir", str(logs), PYTHON, "-c", f"open({str(marker)!r}, 'w')"]
    assert main(argv) == 2
    assert f"akv-launch: error: --log-dir: cannot write {logs}/worker-0.log: " in (
        capsys.readouterr().err
    )
    assert not marker.exists()
