"""Stand-in programs, fake ``ssh``/``mpirun``/``srun`` and helpers for the launcher's tests.

The scheduler, servers and workers of the real jobs are small Python programs standing in
for ``akv.cluster.scheduler``/``akv.cluster.server`` (through ``LaunchOptions.scheduler_command``
and ``server_command``, the seam the launcher defines for this). ``ssh``, ``mpirun`` and
``srun`` are fake executables put first on ``PATH``; they run the command on this machine.
Every process a test starts prints its PID, and the ``reaper`` fixture (``conftest.py``)
kills survivors by PID.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path

from akv.launch.args import LaunchOptions
from akv.launch.command import launch

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

# Counts its runs in AKV_CHECKPOINT_DIR/server-RANK.runs (one PID a line). Its first
# TEST_SERVER_DEATHS runs SIGKILL themselves (with TEST_SERVER_SPAWN=1 after starting a
# sleeping grandchild in their process group); a later run writes its PID to
# server-RANK.serving, then serves as SERVER does (TEST_SERVER_THEN=serve) or sleeps (sleep).
SERVER_DIES = textwrap.dedent(
    f"""
    import json, os, pathlib, signal, socket, subprocess, sys, time
    {_SAY}
    say(json.dumps({{"pid": os.getpid()}}))
    {_RANK}
    checkpoints = pathlib.Path(os.environ["AKV_CHECKPOINT_DIR"])
    checkpoints.mkdir(exist_ok=True)
    runs = checkpoints / f"server-{{rank}}.runs"
    run = len(runs.read_text().split()) if runs.exists() else 0
    with runs.open("a") as file:
        file.write(f"{{os.getpid()}}\\n")
    if run < int(os.environ["TEST_SERVER_DEATHS"]):
        if os.environ.get("TEST_SERVER_SPAWN"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            say(json.dumps({{"pid": child.pid}}))
        say("server", rank, "run", run, "dies")
        os.kill(os.getpid(), signal.SIGKILL)
    say("server", rank, "run", run, "serves")
    (checkpoints / f"server-{{rank}}.serving").write_text(str(os.getpid()))
    if os.environ.get("TEST_SERVER_THEN") == "sleep":
        time.sleep(30)
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
# scheduler it closed its store), "sleep", "exit:N", "kill" (SIGKILL itself), "wait-for:PATH"
# (until PATH exists; exit 7 if it does not within 15 s).
WORKER = textwrap.dedent(
    f"""
    import json, os, signal, socket, subprocess, sys, time
    {_SAY}
    {_RANK}
    say(json.dumps({{"pid": os.getpid()}}))
    say("worker", rank, "of", os.environ["AKV_NUM_WORKERS"])
    say("worker", rank, "arguments", json.dumps(sys.argv[1:]))
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
        elif action.startswith("wait-for:"):
            deadline = time.monotonic() + 15
            while not os.path.exists(action[9:]):
                if time.monotonic() > deadline:
                    say("worker", rank, "gave up waiting for", action[9:])
                    sys.exit(7)
                time.sleep(0.05)
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


def before_summary(err: str) -> list[str]:
    """The launcher's stderr lines before its summary table (whose run times vary)."""
    lines = err.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith(SUMMARY_HEADER)), None)
    return lines if header is None else lines[:header]


#: How the summary table starts.
SUMMARY_HEADER = "akv-launch: role "


def pids_in(text: str) -> list[int]:
    pids = []
    for line in text.splitlines():
        _, _, rest = line.partition("] ")
        if rest.startswith('{"pid"'):
            pids.append(json.loads(rest)["pid"])
    return pids


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
