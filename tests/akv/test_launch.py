"""akv-launch: the plan and the exit rules (pure), then real supervised jobs on 127.0.0.1.

The scheduler, servers and workers of the real jobs are small Python programs standing in
for ``akv.scheduler``/``akv.server`` (through ``LaunchOptions.scheduler_command`` and
``server_command``, the seam the launcher defines for this). ``ssh``, ``mpirun`` and ``srun``
are fake executables put first on ``PATH``; they run the command on this machine. Every
process a test starts prints its PID, and the ``reaper`` fixture kills survivors by PID.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from akv.errors import AKVError
from akv.launch.command import (
    MASK,
    Host,
    LaunchError,
    LaunchOptions,
    format_dry_run,
    launch,
    main,
    mpi_flavour_from_version,
    parse_args,
    parse_hostfile,
    place,
    plan,
    remote_script,
)
from akv.launch.supervisor import ExitRules, ProcessSpec, exit_code_of, status_text

TOKEN = "f" * 64
PYTHON = sys.executable
JOB_TIMEOUT_S = 20
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "AKV_RANK": "99"}

# ------------------------------------------------------------------ stand-in programs

# One write per line: the ranks of an mpirun/srun group share one pipe, and an unbuffered
# print() writes the text and the newline separately.
_SAY = "def say(*words, file=sys.stdout): file.write(' '.join(map(str, words)) + '\\n')"
_RANK = (
    "rank = next(os.environ[n] for n in "
    "('AKV_RANK', 'OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'SLURM_PROCID') if n in os.environ)"
)

# Serves on the inherited socket until every worker said "bye <rank> <token>".
SCHEDULER = textwrap.dedent(
    f"""
    import json, os, socket, sys
    {_SAY}
    say(json.dumps({{"pid": os.getpid()}}))
    listener = socket.socket(fileno=int(os.environ["AKV_SCHEDULER_FD"]))
    if listener.getsockname()[1] != int(os.environ["AKV_SCHEDULER_PORT"]):
        sys.exit(9)
    say("listening on", listener.getsockname()[0])
    listener.settimeout(20)
    ranks = []
    while len(ranks) < int(os.environ["AKV_NUM_WORKERS"]):
        conn, _ = listener.accept()
        with conn:
            words = conn.makefile().readline().split()
        if words and words[0] == "bye":
            if words[2] != os.environ["AKV_TOKEN"]:
                sys.exit(8)
            ranks.append(words[1])
    say("workers closed:", ",".join(sorted(ranks)))
    """
)

# Stops on its own once the scheduler is gone (its port refuses connections).
SERVER = textwrap.dedent(
    f"""
    import json, os, socket, sys, time
    {_SAY}
    say(json.dumps({{"pid": os.getpid()}}))
    {_RANK}
    say("server", rank, "host", os.environ.get("AKV_HOST"), os.environ.get("DMLC_NODE_HOST"))
    address = (os.environ["AKV_SCHEDULER_HOST"], int(os.environ["AKV_SCHEDULER_PORT"]))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1).close()
        except OSError:
            break
        time.sleep(0.05)
    """
)

SERVER_FAILS = "import json, os, sys, time\nprint(json.dumps({'pid': os.getpid()}))\n" + (
    "time.sleep(0.3)\nsys.exit(4)\n"
)
SERVER_IGNORES_SIGTERM = textwrap.dedent(
    """
    import json, os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(json.dumps({"pid": os.getpid()}))
    time.sleep(30)
    """
)

# Does what TEST_ACTIONS says for its rank: "spawn" (a sleeping grandchild), "bye" (tell the
# scheduler it closed its store), "sleep", "exit:N", "kill" (SIGKILL itself).
WORKER = textwrap.dedent(
    f"""
    import json, os, signal, socket, subprocess, sys, time
    {_SAY}
    {_RANK}
    say(json.dumps({{"pid": os.getpid()}}))
    say("worker", rank, "of", os.environ["AKV_NUM_WORKERS"])
    say("worker", rank, "on stderr", file=sys.stderr)
    for action in json.loads(os.environ["TEST_ACTIONS"]).get(rank, ["bye"]):
        if action == "spawn":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            say(json.dumps({{"pid": child.pid}}))
        elif action == "bye":
            address = (os.environ["AKV_SCHEDULER_HOST"], int(os.environ["AKV_SCHEDULER_PORT"]))
            with socket.create_connection(address, timeout=10) as conn:
                conn.sendall(f"bye {{rank}} {{os.environ['AKV_TOKEN']}}\\n".encode())
        elif action == "sleep":
            time.sleep(30)
        elif action.startswith("exit:"):
            time.sleep(0.2)
            sys.exit(int(action[5:]))
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)

FAKE_SSH = textwrap.dedent(
    f"""\
    #!{PYTHON}
    # Runs `bash -s` here, in a new session (as on another machine), feeding it this stdin.
    import os, subprocess, sys, threading
    args = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(" ".join(["ssh", *args]) + "\\n")
    while args[0].startswith("-"):
        args = args[2:] if args[0] in ("-o", "-p") else args[1:]
    remote = subprocess.Popen(args[1:], stdin=subprocess.PIPE, start_new_session=True)
    def forward():
        while chunk := os.read(0, 65536):
            os.write(remote.stdin.fileno(), chunk)
        remote.stdin.close()
    threading.Thread(target=forward, daemon=True).start()
    code = remote.wait()
    os._exit(code if code >= 0 else 128 - code)
    """
)

FAKE_MPIRUN = textwrap.dedent(
    f"""\
    #!{PYTHON}
    # Open MPI's mpirun, here: only the variables named by -x reach the processes.
    import os, subprocess, sys
    args = sys.argv[1:]
    if args == ["--version"]:
        print("mpirun (Open MPI) 4.1.5")
        sys.exit(0)
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(" ".join(["mpirun", *args]) + "\\n")
    count, names = 1, []
    while args[0].startswith("-"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "-n":
            count = int(value)
        elif flag == "-x":
            names.append(value)
    base = {{"PATH": os.environ["PATH"]}}
    procs = [
        subprocess.Popen(args, env={{**base, **{{n: os.environ[n] for n in names}},
                                    "OMPI_COMM_WORLD_RANK": str(rank)}})
        for rank in range(count)
    ]
    codes = [proc.wait() for proc in procs]
    sys.exit(next((code for code in codes if code), 0))
    """
)

FAKE_SRUN = textwrap.dedent(
    f"""\
    #!{PYTHON}
    # srun, here: --ntasks copies with SLURM_PROCID; every --export name must be set.
    import os, subprocess, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(" ".join(["srun", *args]) + "\\n")
    count = 1
    while args[0].startswith("--"):
        flag, _, value = args.pop(0).partition("=")
        if flag == "--ntasks":
            count = int(value)
        elif flag == "--export" and not all(n in os.environ for n in value.split(",")[1:]):
            sys.exit(99)
    procs = [
        subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(rank)}})
        for rank in range(count)
    ]
    codes = [proc.wait() for proc in procs]
    sys.exit(next((code for code in codes if code), 0))
    """
)


# ------------------------------------------------------------------ helpers


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: this container's PID 1 never reaps them)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """The PIDs still alive after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if alive(pid)]
    return left


def pids_in(text: str) -> list[int]:
    pids = []
    for line in text.splitlines():
        _, _, rest = line.partition("] ")
        if rest.startswith('{"pid"'):
            pids.append(json.loads(rest)["pid"])
    return pids


@pytest.fixture
def reaper():
    """PIDs a test saw; any still alive at the end are killed (by PID) and fail the test."""
    seen: list[int] = []
    yield seen
    survivors = [pid for pid in seen if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the test: {survivors}"


@dataclass
class Result:
    code: int
    out: str
    err: str
    pids: list[int]


def job_options(tmp_path: Path, actions: dict | None = None, **changes) -> LaunchOptions:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    options = LaunchOptions(
        num_workers=2,
        num_servers=1,
        command=(PYTHON, str(worker)),
        env={"TEST_ACTIONS": json.dumps(actions or {})},
        grace_s=5.0,
        scheduler_command=(PYTHON, "-c", SCHEDULER),
        server_command=(PYTHON, "-c", SERVER),
    )
    return replace(options, **changes)


def run_job(options: LaunchOptions, reaper: list[int], environ: dict | None = None) -> Result:
    out, err = io.BytesIO(), io.BytesIO()
    environ = {**os.environ, "AKV_TOKEN": TOKEN} if environ is None else environ
    code = launch(options, environ, stdout=out, stderr=err, terminate_grace_s=1.0)
    result = Result(code, out.getvalue().decode(), err.getvalue().decode(), [])
    result.pids = pids_in(result.out)
    reaper.extend(result.pids)
    return result


def fake_path(tmp_path: Path) -> dict:
    """An environment whose PATH starts with fake ssh, mpirun and srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("mpirun", FAKE_MPIRUN), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "fake.log"),
        "AKV_TOKEN": TOKEN,
    }


# ------------------------------------------------------------------ command line


def test_command_after_double_dash_is_the_worker_command():
    options = parse_args(["-n", "2", "-s", "1", "--env", "A=1", "B=x=y", "--", "python", "-u"])
    assert options.command == ("python", "-u")
    assert options.env == {"A": "1", "B": "x=y"}
    assert (options.num_workers, options.num_servers, options.launcher) == (2, 1, "local")


def test_servers_default_to_the_number_of_workers_as_in_mxnet():
    assert parse_args(["-n", "3", "--", "x"]).num_servers == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0", "--", "x"], "-n/--num-workers is 0"),
        (["-n", "1", "-s", "0", "--", "x"], "-s/--num-servers is 0"),
        (["-n", "1", "--"], "missing command after `--`"),
        (["-n", "1", "python", "train.py"], "missing command: put the worker command after"),
        (["-n", "1", "--launcher", "yarn", "--", "x"], "unknown launcher 'yarn'"),
        (["-n", "x", "--", "x"], "invalid int value: 'x'"),
        (["-n", "1", "--launcher", "mpi", "--", "x"], "needs --scheduler-host"),
        (["-n", "1", "--launcher", "ssh", "--scheduler-host", "a", "--", "x"], "needs -H"),
        (["-n", "1", "--env", "AKV_RANK=3", "--", "x"], "akv-launch sets AKV_RANK itself"),
        (["-n", "1", "--env", "AKV_TOKEN=s3cret", "--", "x"], "secret on the command line"),
        (["-n", "1", "--env", "1X=2", "--", "x"], "'1X' is not a variable name"),
        (["-n", "1", "--grace-s", "-1", "--", "x"], "--grace-s is -1"),
    ],
)
def test_bad_command_lines_exit_2_with_a_message_naming_the_problem(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("akv-launch: error: ")
    assert message in err


def test_launch_error_is_an_akv_error():
    with pytest.raises(AKVError):
        parse_args(["-n", "0", "--", "x"])


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--scheduler-host" in capsys.readouterr().out


def test_python_dash_m_akv_launch_runs_main():
    done = subprocess.run(
        [PYTHON, "-m", "akv.launch", "-n", "1", "--"],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 2
    assert "missing command after `--`" in done.stderr


# ------------------------------------------------------------------ host files


def test_hostfile_takes_host_host_port_and_slots_lines_with_comments():
    text = "# cluster\n\nnode1\nnode2:2222  # ssh port\n10.0.0.3 slots=4\n"
    assert parse_hostfile(text) == [
        Host("node1"),
        Host("node2", port=2222),
        Host("10.0.0.3", slots=4),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1\nnode2 extra\n", "hosts line 2: 'node2 extra': expected `host`"),
        ("node1:99999\n", "hosts line 1: 'node1:99999': '99999' is not a TCP port"),
        ("node1 slots=0\n", "hosts line 1: 'node1 slots=0': slots must be"),
        ("-oProxyCommand=x\n", "is not a host name"),
        ("# only a comment\n\n", "hosts has no hosts"),
    ],
)
def test_unparsable_hostfile_names_the_line_and_its_content(text, message):
    with pytest.raises(LaunchError) as info:
        parse_hostfile(text, "hosts")
    assert message in str(info.value)


def test_missing_or_empty_hostfile_fails_before_anything_starts(tmp_path, capsys):
    missing = tmp_path / "nope"
    argv = ["-n", "1", "--launcher", "ssh", "--scheduler-host", "127.0.0.1", "-H"]
    assert main([*argv, str(missing), "--", "x"]) == 2
    assert f"hostfile {missing} does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    assert main([*argv, str(empty), "--", "x"]) == 2
    assert f"hostfile {empty} has no hosts" in capsys.readouterr().err


def test_placement_is_round_robin_and_respects_slots():
    a, b = Host("a"), Host("b", slots=2)
    assert [h.name for h in place([a, b], 5)] == ["a", "b", "b", "a", "b"]
    assert [h.name for h in place([Host("a"), Host("c")], 3)] == ["a", "c", "a"]


# ------------------------------------------------------------------ the plan (pure)


def _local_plan(**changes) -> list[ProcessSpec]:
    options = LaunchOptions(2, 2, ("python", "train.py"), env={"EXTRA": "1"})
    return plan(
        replace(options, **changes),
        ENV,
        token=TOKEN,
        scheduler_port=4242,
        scheduler_fd=7,
        python="/py",
    )


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
    assert specs[0].argv == ("/py", "-m", "akv.dist.scheduler")
    assert specs[1].argv == ("/py", "-m", "akv.dist.server")
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
    options = LaunchOptions(1, 1, ("x",))
    reused = plan(options, {"AKV_TOKEN": TOKEN}, scheduler_port=1)
    assert {s.env["AKV_TOKEN"] for s in reused} == {TOKEN}
    first = plan(options, {}, scheduler_port=1)
    second = plan(options, {}, scheduler_port=1)
    assert len({s.env["AKV_TOKEN"] for s in first}) == 1
    assert len(first[0].env["AKV_TOKEN"]) == 64
    assert first[0].env["AKV_TOKEN"] != second[0].env["AKV_TOKEN"]


def _ssh_plan() -> list[ProcessSpec]:
    options = LaunchOptions(
        2, 1, ("python3", "train.py"), launcher="ssh", hostfile="h", scheduler_host="10.0.0.1"
    )
    hosts = [Host("n1"), Host("n2", port=2222)]
    return plan(
        options,
        ENV,
        token=TOKEN,
        scheduler_port=4242,
        scheduler_fd=7,
        hosts=hosts,
        cwd="/work dir",
        python="/py",
    )


def test_ssh_plan_places_servers_then_workers_round_robin_with_exact_ssh_commands():
    scheduler, server, worker0, worker1 = _ssh_plan()
    assert scheduler.host is None and scheduler.env["AKV_SCHEDULER_HOST"] == "10.0.0.1"
    assert scheduler.argv == ("/py", "-m", "akv.dist.scheduler")
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
        server.job_env, "/work dir", ("python3", "-m", "akv.dist.server")
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
    started = time.monotonic()
    code, out = _run_script(remote_script({}, str(tmp_path), argv), close_stdin_after_s=0.5)
    reaper.append(int(out.split()[0]))
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5
    assert not wait_gone(reaper, timeout_s=1)


def _mpi_plan(flavour: str) -> list[ProcessSpec]:
    options = LaunchOptions(
        3, 2, ("python3", "train.py"), launcher="mpi", hostfile="hosts", scheduler_host="h0"
    )
    hosts = [Host("n1", slots=2), Host("n2")]
    return plan(
        options,
        ENV,
        token=TOKEN,
        scheduler_port=4242,
        scheduler_fd=7,
        hosts=hosts,
        mpi_flavour=flavour,
        cwd="/w",
        python="/py",
    )


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
        "akv.dist.server",
    ]
    assert list(workers.argv) == [
        *head,
        "3",
        "--hostfile",
        "/w/hosts",
        *forward,
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
        ",".join(NAMES),
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
    return plan(options, ENV, token=TOKEN, scheduler_port=4242, scheduler_fd=7, python="/py")


def test_slurm_plan_is_one_srun_step_per_role():
    _, servers, workers = _slurm_plan()
    head = ["srun", "--kill-on-bad-exit=1", "--label", f"--export=ALL,{','.join(NAMES)}"]
    assert list(workers.argv) == [head[0], "--ntasks=4", *head[1:], "python3", "t.py"]
    assert list(servers.argv) == [
        head[0],
        "--ntasks=1",
        *head[1:],
        *HOST_WRAPPER,
        "python3",
        "-m",
        "akv.dist.server",
    ]


def test_mpi_rejects_the_ssh_host_port_form():
    options = LaunchOptions(1, 1, ("x",), launcher="mpi", hostfile="h", scheduler_host="h0")
    with pytest.raises(LaunchError, match="`host:port` is the ssh form"):
        plan(options, {}, hosts=[Host("n1", port=22)], scheduler_port=1)


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


# ------------------------------------------------------------------ the exit rules (pure)


def _specs() -> list[ProcessSpec]:
    def spec(role, rank):
        return ProcessSpec(role, rank, ("x",), {}, {})

    return [spec("scheduler", None), spec("server", 0), spec("worker", 0), spec("worker", 1)]


def _rules() -> ExitRules:
    rules = ExitRules(_specs(), grace_s=15)
    for index, pid in enumerate([100, 101, 102, 103]):
        rules.started(index, pid)
    return rules


def test_first_failing_worker_decides_the_exit_code():
    rules = _rules()
    decision = rules.exited(3, 3)
    assert (decision.action, decision.exit_code) == ("stop", 3)
    assert decision.message == "worker 1 (pid 103) exited with code 3; stopping the job"


def test_a_signal_death_is_reported_as_such_with_128_plus_signo():
    decision = _rules().exited(2, -signal.SIGKILL)
    assert (decision.action, decision.exit_code) == ("stop", 137)
    assert "worker 0 (pid 102) exited with signal SIGKILL" in decision.message
    assert (status_text(-15), exit_code_of(-15), exit_code_of(4)) == ("signal SIGTERM", 143, 4)


def test_server_failure_while_workers_run_fails_the_job():
    decision = _rules().exited(1, 1)
    assert (decision.action, decision.exit_code) == ("stop", 1)
    assert decision.message == (
        "server 0 (pid 101) exited with code 1 while 2 workers still ran; stopping the job"
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


# ------------------------------------------------------------------ real local jobs


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


HELPER = textwrap.dedent(
    """
    import json, signal, sys
    from akv.launch.command import LaunchOptions, launch
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


# ------------------------------------------------------------------ through ssh, mpirun, srun


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
