"""The plans (pure): which processes, which commands, which environment, per launcher.

Also the remote script of the ``ssh`` launcher, run here by ``bash -s`` as ssh would run
it on another host, reading ``mpirun --version``, and the ``--dry-run`` text.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from dataclasses import replace

import pytest

from akv.errors import LaunchError
from akv.launch.args import LaunchOptions
from akv.launch.hosts import Host
from akv.launch.plans import (
    MASK,
    JobContext,
    format_dry_run,
    job_token,
    log_file_name,
    mpi_flavour_from_version,
    plan,
    plan_local,
    plan_mpi,
    plan_slurm,
    plan_ssh,
    remote_script,
)
from akv.launch.spec import ProcessSpec
from tests.akv.launch.support import ENV, JOB_TIMEOUT_S, PYTHON, TOKEN, wait_gone


def context(**changes) -> JobContext:
    """This machine and this job, as the plans see them (the socket is port 4242, fd 7)."""
    facts = JobContext(
        environ=ENV, token=TOKEN, cwd="/w", python="/py", scheduler_port=4242, scheduler_fd=7
    )
    return replace(facts, **changes)


def _local_plan(**changes) -> list[ProcessSpec]:
    options = LaunchOptions(2, 2, ("python", "train.py"), env={"EXTRA": "1"})
    return plan(replace(options, **changes), context())


def test_local_plan_starts_scheduler_then_servers_then_workers_with_ranks_in_that_order():
    specs = _local_plan()
    assert [(s.role, s.rank) for s in specs] == [
        ("scheduler", None),
        ("server", 0),
        ("server", 1),
        ("worker", 0),
        ("worker", 1),
    ]
    assert [s.label for s in specs] == ["scheduler", "server 0", "server 1", "worker 0", "worker 1"]
    assert specs[0].argv == ("/py", "-m", "akv.cluster.scheduler")
    assert specs[1].argv == ("/py", "-m", "akv.cluster.server")
    assert specs[3].argv == ("python", "train.py")


def test_every_process_gets_the_job_environment_under_both_names():
    for spec in _local_plan():
        env = spec.env
        assert env["AKV_ROLE"] == env["DMLC_ROLE"] == spec.role
        assert env["AKV_SCHEDULER_HOST"] == env["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert env["AKV_SCHEDULER_PORT"] == env["DMLC_PS_ROOT_PORT"] == "4242"
        assert env["AKV_NUM_WORKERS"] == env["DMLC_NUM_WORKER"] == "2"
        assert env["AKV_NUM_SERVERS"] == env["DMLC_NUM_SERVER"] == "2"
        assert env["AKV_TOKEN"] == TOKEN
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["EXTRA"] == "1"
        assert env["HOME"] == "/tmp"  # the launcher's environment is inherited
        assert set(spec.job_env) <= set(env)
        if spec.role == "scheduler":
            assert "AKV_RANK" not in env  # the stale AKV_RANK=99 of ENV is dropped
        else:
            assert env["AKV_RANK"] == str(spec.rank)


def test_only_the_scheduler_inherits_the_listening_socket():
    scheduler, *others = _local_plan()
    assert scheduler.pass_fds == (7,)
    assert scheduler.env["AKV_SCHEDULER_FD"] == "7"
    assert all(not s.pass_fds and "AKV_SCHEDULER_FD" not in s.env for s in others)


def test_local_servers_advertise_127_0_0_1():
    servers = [s for s in _local_plan() if s.role == "server"]
    assert all(s.env["AKV_HOST"] == s.env["DMLC_NODE_HOST"] == "127.0.0.1" for s in servers)


def test_token_comes_from_the_launchers_environment_or_is_fresh_per_job():
    assert job_token({"AKV_TOKEN": TOKEN}) == TOKEN
    first, second = job_token({}), job_token({"AKV_TOKEN": ""})
    assert len(first) == 64 and len(second) == 64
    assert first != second


def test_a_short_inherited_token_is_refused():
    with pytest.raises(LaunchError, match=r"AKV_TOKEN .* has 5 characters; .* at least 16"):
        job_token({"AKV_TOKEN": "short"})


def test_every_process_of_a_plan_gets_the_same_token():
    options = LaunchOptions(2, 2, ("x",))
    specs = plan(options, context(token="t" * 64))
    assert {s.env["AKV_TOKEN"] for s in specs} == {"t" * 64}


def _ssh_plan() -> list[ProcessSpec]:
    options = LaunchOptions(
        2, 1, ("python3", "train.py"), launcher="ssh", hostfile="h", scheduler_host="10.0.0.1"
    )
    hosts = [Host("n1"), Host("n2", port=2222)]
    return plan(options, context(hosts=hosts, cwd="/work dir"))


def test_ssh_plan_places_servers_then_workers_round_robin_with_exact_ssh_commands():
    scheduler, server, worker0, worker1 = _ssh_plan()
    assert scheduler.host is None and scheduler.env["AKV_SCHEDULER_HOST"] == "10.0.0.1"
    assert scheduler.argv == ("/py", "-m", "akv.cluster.scheduler")
    assert [(s.label, s.host) for s in (server, worker0, worker1)] == [
        ("server 0", "n1"),
        ("worker 0", "n2"),
        ("worker 1", "n1"),
    ]
    ssh = ("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new")
    assert server.argv == (*ssh, "n1", "bash", "-s")
    assert worker0.argv == (*ssh, "-p", "2222", "n2", "bash", "-s")


def test_ssh_keeps_the_token_off_every_command_line():
    for spec in _ssh_plan()[1:]:
        assert TOKEN not in " ".join(spec.argv)
        assert "AKV_TOKEN" not in spec.env  # not even in ssh's own environment
        assert f"export AKV_TOKEN={TOKEN}\n" in spec.stdin


def test_ssh_script_exports_the_environment_cds_and_runs_the_command():
    _, server, worker0, _ = _ssh_plan()
    assert server.job_env["AKV_HOST"] == server.job_env["DMLC_NODE_HOST"] == "n1"
    assert worker0.job_env["AKV_RANK"] == "0" and "AKV_HOST" not in worker0.job_env
    assert server.stdin == remote_script(
        server.job_env, "/work dir", ("python3", "-m", "akv.cluster.server")
    )
    script = worker0.stdin
    assert "  export AKV_ROLE=worker\n" in script
    assert "  export AKV_SCHEDULER_PORT=4242\n" in script
    assert "  cd -- '/work dir' || exit 1\n" in script
    assert "setsid python3 train.py </dev/null 3<&- &" in script
    assert script.endswith("akv_main\n")


def _run_script(script: str, close_stdin_after_s: float | None = None):
    """Run ``script`` as ``bash -s`` does on a remote host; stdin stays open unless told."""
    shell = subprocess.Popen(
        ["bash", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        shell.stdin.write(script.encode())
        shell.stdin.flush()
        if close_stdin_after_s is not None:
            time.sleep(close_stdin_after_s)
            shell.stdin.close()
        code = shell.wait(timeout=JOB_TIMEOUT_S)
        return code, shell.stdout.read().decode()
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait(timeout=5)
        for stream in (shell.stdin, shell.stdout, shell.stderr):
            stream.close()


def test_remote_script_runs_the_command_with_the_environment_and_returns_its_code(tmp_path):
    argv = [PYTHON, "-c", "import os, sys; print(os.getcwd(), os.environ['X']); sys.exit(5)"]
    script = remote_script({"X": "it's set"}, str(tmp_path), argv)
    assert _run_script(script) == (5, f"{tmp_path} it's set\n")


def test_remote_script_stops_the_command_when_its_stdin_closes(tmp_path, reaper):
    argv = [PYTHON, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(30)"]
    code, out = _run_script(remote_script({}, str(tmp_path), argv), close_stdin_after_s=0.5)
    reaper.append(int(out.split()[0]))
    assert code == 128 + signal.SIGTERM
    assert not wait_gone(reaper, timeout_s=1)


def _mpi_plan(flavour: str) -> list[ProcessSpec]:
    options = LaunchOptions(
        3, 2, ("python3", "train.py"), launcher="mpi", hostfile="hosts", scheduler_host="h0"
    )
    hosts = [Host("n1", slots=2), Host("n2")]
    return plan(options, context(hosts=hosts, mpi_flavour=flavour))


NAMES = [
    "AKV_ROLE",
    "DMLC_ROLE",
    "AKV_SCHEDULER_HOST",
    "DMLC_PS_ROOT_URI",
    "AKV_SCHEDULER_PORT",
    "DMLC_PS_ROOT_PORT",
    "AKV_NUM_WORKERS",
    "DMLC_NUM_WORKER",
    "AKV_NUM_SERVERS",
    "DMLC_NUM_SERVER",
    "AKV_TOKEN",
    "PYTHONUNBUFFERED",
]
#: A group of workers also gets WORLD_SIZE (RANK and LOCAL_RANK are the runtime's).
WORKER_NAMES = [*NAMES[:-1], "WORLD_SIZE", "PYTHONUNBUFFERED"]
HOST_WRAPPER = (
    "/bin/sh",
    "-c",
    'AKV_HOST="$(hostname)"; DMLC_NODE_HOST="$AKV_HOST"; export AKV_HOST DMLC_NODE_HOST; exec "$@"',
    "akv-server",
)


def test_open_mpi_plan_is_two_mpiruns_forwarding_variables_by_name():
    scheduler, servers, workers = _mpi_plan("openmpi")
    assert scheduler.role == "scheduler" and scheduler.pass_fds == (7,)
    forward = [arg for name in NAMES for arg in ("-x", name)]
    worker_forward = [arg for name in WORKER_NAMES for arg in ("-x", name)]
    head = ["mpirun", "-n"]
    assert list(servers.argv) == [
        *head,
        "2",
        "--hostfile",
        "/w/hosts",
        *forward,
        *HOST_WRAPPER,
        "python3",
        "-m",
        "akv.cluster.server",
    ]
    assert list(workers.argv) == [
        *head,
        "3",
        "--hostfile",
        "/w/hosts",
        *worker_forward,
        "python3",
        "train.py",
    ]
    assert (servers.label, servers.count, workers.label, workers.count) == (
        "servers",
        2,
        "workers",
        3,
    )


def test_mpich_plan_uses_genvlist_and_hosts():
    _, servers, workers = _mpi_plan("mpich")
    hosts = ["-hosts", "n1:2,n2"]
    assert list(workers.argv) == [
        "mpirun",
        "-n",
        "3",
        *hosts,
        "-genvlist",
        ",".join(WORKER_NAMES),
        "python3",
        "train.py",
    ]
    assert list(servers.argv[:6]) == ["mpirun", "-n", "2", *hosts, "-genvlist"]


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_mpi_and_slurm_leave_ranks_to_the_runtime_and_values_to_the_environment(flavour):
    for spec in [*_mpi_plan(flavour)[1:], *_slurm_plan()[1:]]:
        assert "AKV_RANK" not in spec.env
        assert spec.rank is None
        assert spec.env["AKV_TOKEN"] == TOKEN
        assert TOKEN not in " ".join(spec.argv)


def _slurm_plan() -> list[ProcessSpec]:
    options = LaunchOptions(4, 1, ("python3", "t.py"), launcher="slurm", scheduler_host="h0")
    return plan(options, context())


def test_slurm_plan_is_one_srun_step_per_role():
    _, servers, workers = _slurm_plan()
    head = ["srun", "--kill-on-bad-exit=1", "--label", f"--export=ALL,{','.join(NAMES)}"]
    worker_export = f"--export=ALL,{','.join(WORKER_NAMES)}"
    assert list(workers.argv) == [
        head[0],
        "--ntasks=4",
        *head[1:3],
        worker_export,
        "python3",
        "t.py",
    ]
    assert list(servers.argv) == [
        head[0],
        "--ntasks=1",
        *head[1:],
        *HOST_WRAPPER,
        "python3",
        "-m",
        "akv.cluster.server",
    ]


def test_mpi_rejects_the_ssh_host_port_form():
    options = LaunchOptions(1, 1, ("x",), launcher="mpi", hostfile="h", scheduler_host="h0")
    with pytest.raises(LaunchError, match="`host:port` is the ssh form"):
        plan(options, context(hosts=[Host("n1", port=22)]))


@pytest.mark.parametrize(
    ("output", "flavour"),
    [
        ("mpirun (Open MPI) 4.1.5\n\nReport bugs to https://www.open-mpi.org/", "openmpi"),
        ("HYDRA build details:\n    Version: 4.1.2", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.6", "mpich"),
    ],
)
def test_mpi_flavour_is_read_from_mpirun_version(output, flavour):
    assert mpi_flavour_from_version(output) == flavour


def test_unknown_mpi_is_named():
    with pytest.raises(LaunchError, match="printed 'spectrum 10'"):
        mpi_flavour_from_version("spectrum 10\n")


def test_dry_run_text_shows_exact_commands_and_masks_the_token():
    text = format_dry_run(_local_plan() + _ssh_plan()[1:], TOKEN)
    assert TOKEN not in text
    assert f"AKV_TOKEN={MASK}" in text
    worker = _local_plan()[3]
    line = shlex.join(["env", *[f"{k}={v}" for k, v in worker.job_env.items()], *worker.argv])
    assert line.replace(TOKEN, MASK) in text
    ssh = "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new"
    assert f"{ssh} n1 bash -s <<'AKV_SCRIPT'" in text


@pytest.mark.parametrize(
    "token", ["Zqw'Xvy-Tqx-0123456789abcdef", 'Wkx "Jhy" $Pqz `Rtw` Yuv\\Mnb ' * 3]
)
def test_dry_run_masks_a_token_that_the_shell_quotes(token):
    specs = plan(LaunchOptions(1, 1, ("python", "train.py")), context(token=token))
    hosts = context(hosts=[Host("n1")], token=token)
    options = LaunchOptions(1, 1, ("python3", "t.py"), launcher="ssh", hostfile="h")
    specs += plan(replace(options, scheduler_host="10.0.0.1"), hosts)[1:]
    text = format_dry_run(specs, token)
    pieces = [piece for piece in re.split(r"[^A-Za-z0-9]+", token) if len(piece) > 2]
    assert not [piece for piece in pieces if piece in text], text
    assert text.count(MASK) == len(specs), text  # each process gets the token once


def test_plan_is_the_launchers_own_plan():
    local = LaunchOptions(1, 1, ("x",))
    remote = replace(local, hostfile="h", scheduler_host="h0")
    hosts = context(hosts=[Host("n1")])
    assert plan(local, context()) == plan_local(local, context())
    assert plan(replace(remote, launcher="ssh"), hosts) == plan_ssh(
        replace(remote, launcher="ssh"), hosts
    )
    assert plan(replace(remote, launcher="mpi"), hosts) == plan_mpi(
        replace(remote, launcher="mpi"), hosts
    )
    assert plan(replace(remote, launcher="slurm"), hosts) == plan_slurm(
        replace(remote, launcher="slurm"), hosts
    )


def test_an_unknown_mpi_flavour_is_refused():
    options = LaunchOptions(1, 1, ("x",), launcher="mpi", scheduler_host="h0")
    with pytest.raises(LaunchError, match="unknown MPI flavour 'lam'"):
        plan(options, context(mpi_flavour="lam"))


def test_dry_run_placeholders_stand_for_the_port_and_descriptor_not_yet_bound():
    scheduler, *_ = plan(
        LaunchOptions(1, 1, ("x",)), context(scheduler_port=None, scheduler_fd=None)
    )
    assert scheduler.env["AKV_SCHEDULER_PORT"] == "<port>"
    assert scheduler.env["AKV_SCHEDULER_FD"] == "<fd>"
    assert scheduler.pass_fds == ()


# ------------------------------------------------------------------ --log-dir


def test_log_files_are_named_by_role_and_rank():
    assert log_file_name("scheduler", None) == "scheduler.log"
    assert log_file_name("server", 0) == "server-0.log"
    assert log_file_name("worker", 12) == "worker-12.log"
    assert log_file_name("worker", None) == "workers.log"


def test_without_log_dir_no_process_has_a_log_file():
    assert all(spec.log_path is None for spec in _local_plan() + _ssh_plan() + _slurm_plan())


def test_local_and_ssh_plans_give_every_process_its_own_log_file():
    local = [s.log_path for s in _local_plan(log_dir="logs")]
    assert local == [
        "logs/scheduler.log",
        "logs/server-0.log",
        "logs/server-1.log",
        "logs/worker-0.log",
        "logs/worker-1.log",
    ]
    options = LaunchOptions(
        2, 1, ("x",), launcher="ssh", hostfile="h", scheduler_host="h0", log_dir="/var/l"
    )
    ssh = plan(options, context(hosts=[Host("n1")]))
    assert [s.log_path for s in ssh] == [
        "/var/l/scheduler.log",
        "/var/l/server-0.log",
        "/var/l/worker-0.log",
        "/var/l/worker-1.log",
    ]


@pytest.mark.parametrize("launcher", ["mpi", "slurm"])
def test_mpi_and_slurm_groups_share_one_log_file_per_role(launcher):
    options = LaunchOptions(3, 2, ("x",), launcher=launcher, scheduler_host="h0", log_dir="d")
    specs = plan(options, context())
    assert [s.log_path for s in specs] == ["d/scheduler.log", "d/servers.log", "d/workers.log"]


def test_dry_run_names_each_processs_log_file():
    text = format_dry_run(_local_plan(log_dir="logs"), TOKEN)
    assert "# scheduler, output also in logs/scheduler.log\n" in text
    assert "# worker 1, output also in logs/worker-1.log\n" in text


# ------------------------------------------------------------------ --checkpoint-dir


def test_only_servers_get_the_checkpoint_directory_and_interval():
    specs = _local_plan(checkpoint_dir="/ckpt", checkpoint_interval_s=2.5, max_restarts=1)
    for spec in specs:
        if spec.role == "server":
            assert spec.env["AKV_CHECKPOINT_DIR"] == spec.job_env["AKV_CHECKPOINT_DIR"] == "/ckpt"
            assert spec.env["AKV_CHECKPOINT_INTERVAL_S"] == "2.5"
        else:
            assert "AKV_CHECKPOINT_DIR" not in spec.env
            assert "AKV_CHECKPOINT_INTERVAL_S" not in spec.env


def test_a_relative_checkpoint_directory_is_taken_from_the_working_directory():
    servers = [s for s in _local_plan(checkpoint_dir="ckpt") if s.role == "server"]
    assert {s.env["AKV_CHECKPOINT_DIR"] for s in servers} == {"/w/ckpt"}
    assert all("AKV_CHECKPOINT_INTERVAL_S" not in s.env for s in servers)  # the server's default


def test_a_stale_inherited_checkpoint_directory_does_not_reach_the_job():
    stale = {**ENV, "AKV_CHECKPOINT_DIR": "/old-job", "AKV_CHECKPOINT_INTERVAL_S": "9"}
    options = LaunchOptions(1, 1, ("x",))
    for spec in plan(options, context(environ=stale)):
        assert "AKV_CHECKPOINT_DIR" not in spec.env, spec.label
        assert "AKV_CHECKPOINT_INTERVAL_S" not in spec.env, spec.label


def test_ssh_servers_get_the_checkpoint_directory_in_their_remote_script():
    options = LaunchOptions(
        1,
        1,
        ("python3", "train.py"),
        launcher="ssh",
        hostfile="h",
        scheduler_host="10.0.0.1",
        checkpoint_dir="/data/ckpt",
        max_restarts=2,
    )
    _, server, worker = plan(options, context(hosts=[Host("n1")]))
    assert server.stdin is not None and worker.stdin is not None
    assert "export AKV_CHECKPOINT_DIR=/data/ckpt\n" in server.stdin
    assert "AKV_CHECKPOINT_DIR" not in worker.stdin


def test_mpi_and_slurm_servers_get_the_checkpoint_directory_forwarded_by_name():
    common = {"scheduler_host": "h0", "checkpoint_dir": "/ckpt"}
    for launcher in ("mpi", "slurm"):
        options = LaunchOptions(2, 2, ("python3", "t.py"), launcher=launcher, **common)
        _, servers, workers = plan(options, context())
        assert servers.env["AKV_CHECKPOINT_DIR"] == "/ckpt"
        assert "AKV_CHECKPOINT_DIR" in " ".join(servers.argv)  # forwarded by name
        assert "AKV_CHECKPOINT_DIR" not in workers.env
