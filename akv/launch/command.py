"""``akv-launch``: start one akv job (a scheduler, servers, workers) and supervise it.

Usage::

    akv-launch -n WORKERS [-s SERVERS] [--launcher local|ssh|mpi|slurm] [-H HOSTFILE]
               [--scheduler-host HOST] [--python PYTHON] [--env K=V ...] [--dry-run]
               [--grace-s SECONDS] -- CMD...

The module has a pure half and a thin I/O half:

* :func:`parse_args`, :func:`parse_hostfile`, :func:`plan`, :func:`remote_script`,
  :func:`mpi_flavour_from_version` and :func:`format_dry_run` decide everything (which
  processes, which commands, which environment) without touching processes or sockets.
* :func:`launch` binds the scheduler's socket, asks ``mpirun`` which MPI it is, and hands
  the plan to :func:`akv._launchers.supervise`, which runs it; :func:`main` is the CLI.

See ``docs/launcher.md`` for the user's view and how this differs from MXNet's
``tools/launch.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, NoReturn

from akv.dist.config import TWIN_VARIABLES
from akv.errors import LaunchError
from akv.launch.supervisor import TERMINATE_GRACE_S, ProcessSpec, supervise
from akv.limits import MIN_TOKEN_CHARS

__all__ = [
    "DEFAULT_GRACE_S",
    "LAUNCHERS",
    "MPI_FLAVOURS",
    "Host",
    "LaunchError",
    "LaunchOptions",
    "ProcessSpec",
    "format_dry_run",
    "launch",
    "load_hostfile",
    "main",
    "mpi_flavour_from_version",
    "mpirun_argv",
    "new_token",
    "parse_args",
    "parse_hostfile",
    "place",
    "plan",
    "remote_script",
    "srun_argv",
    "ssh_argv",
    "validate",
]

LAUNCHERS = ("local", "ssh", "mpi", "slurm")
REMOTE_LAUNCHERS = ("ssh", "mpi", "slurm")
MPI_FLAVOURS = ("openmpi", "mpich")
#: How long the scheduler and servers get to stop on their own once every worker exited 0,
#: before they are terminated (seconds; ``--grace-s``).
DEFAULT_GRACE_S = 15.0
#: Random bytes in a job token (``secrets.token_hex`` gives twice as many hex characters).
TOKEN_BYTES = 32
#: Where the local launcher's scheduler listens.
LOCAL_SCHEDULER_HOST = "127.0.0.1"
#: The Python started on other hosts unless ``--python`` says otherwise.
DEFAULT_REMOTE_PYTHON = "python3"
#: How long ``mpirun --version`` may take (seconds).
MPI_VERSION_TIMEOUT_S = 10.0
#: Exit code of :func:`main` for a bad command line, host file or environment.
EXIT_USAGE = 2
#: What ``--dry-run`` shows in place of the job token.
MASK = "<masked>"
#: ``--dry-run`` shows these where the real values exist only once the socket is bound.
PORT_PLACEHOLDER = "<port>"
FD_PLACEHOLDER = "<fd>"

#: Variables that belong to the launcher: ``--env`` may not set them, and values inherited
#: from the launcher's own environment are dropped so a stale one cannot leak into the job.
OWNED_VARIABLES = frozenset(
    [name for pair in TWIN_VARIABLES for name in pair]
    + ["AKV_TOKEN", "AKV_RANK", "AKV_SCHEDULER_FD", "PYTHONUNBUFFERED"]
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HOST_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")


@dataclass(frozen=True)
class Host:
    """One line of a host file: ``host``, ``host:port`` (ssh port) or ``host slots=N``."""

    name: str
    port: int | None = None
    slots: int | None = None


@dataclass(frozen=True)
class LaunchOptions:
    """Everything the command line says, checked by :func:`validate`.

    ``scheduler_command`` and ``server_command`` replace the role commands
    ``[PYTHON, "-m", "akv.dist.scheduler"]`` and ``[PYTHON, "-m", "akv.dist.server"]``;
    they are a seam for tests and custom role programs and have no flag.
    """

    num_workers: int
    num_servers: int
    command: tuple[str, ...]
    launcher: str = "local"
    hostfile: str | None = None
    scheduler_host: str | None = None
    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    dry_run: bool = False
    grace_s: float = DEFAULT_GRACE_S
    scheduler_command: tuple[str, ...] | None = None
    server_command: tuple[str, ...] | None = None


# ------------------------------------------------------------------ command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="akv-launch",
        description="Start an akv job (one scheduler, SERVERS servers, WORKERS workers "
        "running CMD) and supervise it: output is prefixed per process, the first failing "
        "worker's exit code is the job's, and every process started is stopped at the end.",
        epilog="Example: akv-launch -n 2 -s 1 -- python train.py --epochs 3",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, metavar="WORKERS")
    parser.add_argument(
        "-s", "--num-servers", type=int, metavar="SERVERS", help="default: WORKERS (as MXNet)"
    )
    parser.add_argument("--launcher", default="local", help="local (default), ssh, mpi or slurm")
    parser.add_argument("-H", "--hostfile", help="lines: host, host:port or host slots=N")
    parser.add_argument(
        "--scheduler-host",
        help="this machine's address the other hosts reach the scheduler at "
        "(required for ssh, mpi and slurm)",
    )
    parser.add_argument(
        "--python",
        help="Python for servers (default: this Python locally, python3 on other hosts)",
    )
    parser.add_argument(
        "--env",
        action="extend",
        nargs="+",
        default=[],
        metavar="K=V",
        help="extra variables for every process",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="once every worker exited 0, how long the scheduler and servers get to stop "
        f"on their own (default {DEFAULT_GRACE_S:g})",
    )
    return parser


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    """Turn a command line (without the program name) into checked :class:`LaunchOptions`.

    The worker command is everything after the first ``--``. Raises :class:`LaunchError`
    for anything :func:`validate` rejects, or when there is no ``--`` or nothing after it.
    """
    argv = list(argv)
    parser = _parser()
    if "--" not in argv:
        if any(arg in ("-h", "--help") for arg in argv):
            parser.parse_args(argv)  # prints the help and exits 0
        raise LaunchError(
            "missing command: put the worker command after `--`, e.g. "
            "`akv-launch -n 2 -s 1 -- python train.py`"
        )
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    env: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise LaunchError(f"--env {item!r} is not NAME=VALUE")
        env[name] = value
    options = LaunchOptions(
        num_workers=args.num_workers,
        num_servers=args.num_servers if args.num_servers is not None else args.num_workers,
        command=tuple(argv[split + 1 :]),
        launcher=args.launcher,
        hostfile=args.hostfile,
        scheduler_host=args.scheduler_host,
        python=args.python,
        env=env,
        dry_run=args.dry_run,
        grace_s=args.grace_s,
    )
    validate(options)
    return options


def validate(options: LaunchOptions) -> None:
    """Check options that need no file or network; raise :class:`LaunchError` on the first
    problem, saying which flag and what to pass instead."""
    if options.num_workers < 1:
        raise LaunchError(f"-n/--num-workers is {options.num_workers}: a job needs >= 1 worker")
    if options.num_servers < 1:
        raise LaunchError(f"-s/--num-servers is {options.num_servers}: a job needs >= 1 server")
    if not options.command:
        raise LaunchError(
            "missing command after `--`: give the worker command, e.g. "
            "`akv-launch -n 2 -s 1 -- python train.py`"
        )
    if options.launcher not in LAUNCHERS:
        raise LaunchError(
            f"unknown launcher {options.launcher!r}: use one of {', '.join(LAUNCHERS)}"
        )
    if not math.isfinite(options.grace_s) or options.grace_s < 0:
        raise LaunchError(f"--grace-s is {options.grace_s}: give a number of seconds >= 0")
    remote = options.launcher in REMOTE_LAUNCHERS
    if remote and not options.scheduler_host:
        raise LaunchError(
            f"--launcher {options.launcher} needs --scheduler-host: pass the address of this "
            "machine that the other hosts can reach (the scheduler runs here and listens there)"
        )
    if not remote and options.scheduler_host:
        raise LaunchError(
            "--scheduler-host is for the ssh, mpi and slurm launchers; the local launcher's "
            f"scheduler listens on {LOCAL_SCHEDULER_HOST}"
        )
    if options.launcher == "ssh" and not options.hostfile:
        raise LaunchError("--launcher ssh needs -H HOSTFILE: the hosts to place processes on")
    if options.launcher == "local" and options.hostfile:
        raise LaunchError(
            "-H/--hostfile is for the ssh, mpi and slurm launchers; the local launcher runs "
            "every process on this machine"
        )
    for name in options.env:
        if not _NAME.match(name):
            raise LaunchError(f"--env {name}=...: {name!r} is not a variable name")
        if name == "AKV_TOKEN":
            raise LaunchError(
                "--env AKV_TOKEN=... would put the job's secret on the command line: export "
                "AKV_TOKEN in the launcher's environment instead (it is then reused)"
            )
        if name in OWNED_VARIABLES:
            raise LaunchError(
                f"--env {name}=...: akv-launch sets {name} itself (from -n, -s, "
                "--scheduler-host and the process's role and rank)"
            )


# ------------------------------------------------------------------ host files


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse host file ``text``: ``host``, ``host:port`` or ``host slots=N`` per line.

    Blank lines and ``#`` comments are skipped. Raises :class:`LaunchError` naming
    ``source``, the line number and its content for a line of another form, or when no host
    is left.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        hosts.append(_parse_host_line(line, f"{source} line {number}: {raw.strip()!r}"))
    if not hosts:
        raise LaunchError(f"{source} has no hosts (only blank lines and comments)")
    return hosts


def _parse_host_line(line: str, where: str) -> Host:
    words = line.split()
    expected = "expected `host`, `host:port` or `host slots=N`"
    slots = None
    if len(words) == 2 and words[1].startswith("slots="):
        slots_text = words[1].removeprefix("slots=")
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise LaunchError(f"{where}: slots must be a whole number >= 1")
        slots = int(slots_text)
    elif len(words) != 1:
        raise LaunchError(f"{where}: {expected}")
    name, sep, port_text = words[0].rpartition(":") if ":" in words[0] else (words[0], "", "")
    port = None
    if sep:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise LaunchError(f"{where}: {port_text!r} is not a TCP port (1-65535)")
        port = int(port_text)
    if not _HOST_NAME.match(name) or name.startswith("-"):
        raise LaunchError(f"{where}: {name!r} is not a host name or IPv4 address; {expected}")
    return Host(name, port, slots)


def load_hostfile(path: str) -> list[Host]:
    """Read and parse the host file at ``path`` (:class:`LaunchError` if unreadable)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise LaunchError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LaunchError(f"hostfile {path} cannot be read: {exc}") from exc
    return parse_hostfile(text, f"hostfile {path}")


def place(hosts: Sequence[Host], count: int) -> list[Host]:
    """Assign ``count`` processes to hosts, round-robin.

    A host with ``slots=N`` takes at most N per round; hosts without ``slots`` take one.
    Once every slot is used the assignment wraps around (the hosts are oversubscribed).
    """
    cycle: list[Host] = []
    for turn in range(max(host.slots or 1 for host in hosts)):
        cycle.extend(host for host in hosts if turn < (host.slots or 1))
    return [cycle[i % len(cycle)] for i in range(count)]


# ------------------------------------------------------------------ the plan (pure)


def new_token() -> str:
    """A fresh job token: ``secrets.token_hex(TOKEN_BYTES)``."""
    return secrets.token_hex(TOKEN_BYTES)


def plan(
    options: LaunchOptions,
    environ: Mapping[str, str],
    *,
    token: str | None = None,
    scheduler_port: int | None = None,
    scheduler_fd: int | None = None,
    hosts: Sequence[Host] | None = None,
    mpi_flavour: str = "openmpi",
    cwd: str | None = None,
    python: str | None = None,
) -> list[ProcessSpec]:
    """Decide every process of the job: what runs where, with which environment.

    Parameters
    ----------
    options
        The checked command line.
    environ
        The launcher's environment; every process inherits it, minus the
        :data:`OWNED_VARIABLES` it may hold, plus the job's variables.
    token
        The job token; default: ``environ["AKV_TOKEN"]`` if set, else :func:`new_token`.
    scheduler_port, scheduler_fd
        The port of the scheduler's listening socket and its descriptor, which the
        scheduler inherits; ``None`` (``--dry-run``) puts placeholders in their place.
    hosts
        The parsed host file; default: read ``options.hostfile`` if given.
    mpi_flavour
        ``"openmpi"`` or ``"mpich"`` (MPICH and Intel MPI): how ``mpirun`` forwards names.
    cwd
        The directory remote processes start in; default: this process's.
    python
        The Python that runs the scheduler (and local servers); default ``sys.executable``.

    Returns
    -------
    list of ProcessSpec
        The scheduler first, then the servers, then the workers, in start order. Ranks
        (local, ssh) follow that order: servers 0..S-1, workers 0..W-1.

    Raises
    ------
    LaunchError
        For options :func:`validate` rejects, or a host file that does not suit the launcher.
    """
    validate(options)
    if mpi_flavour not in MPI_FLAVOURS:
        raise LaunchError(f"unknown MPI flavour {mpi_flavour!r}: use one of {MPI_FLAVOURS}")
    if token is None:
        token = environ.get("AKV_TOKEN") or new_token()
    if hosts is None:
        hosts = load_hostfile(options.hostfile) if options.hostfile else []
    cwd = cwd if cwd is not None else os.getcwd()
    here_python = python or sys.executable
    remote = options.launcher in REMOTE_LAUNCHERS
    role_python = options.python or (DEFAULT_REMOTE_PYTHON if remote else here_python)
    scheduler_host = (options.scheduler_host if remote else None) or LOCAL_SCHEDULER_HOST
    inherited = {k: v for k, v in environ.items() if k not in OWNED_VARIABLES}

    def job_env(role: str, rank: int | None = None, node_host: str | None = None) -> dict[str, str]:
        values = {
            "AKV_ROLE": role,
            "AKV_SCHEDULER_HOST": scheduler_host,
            "AKV_SCHEDULER_PORT": PORT_PLACEHOLDER
            if scheduler_port is None
            else str(scheduler_port),
            "AKV_NUM_WORKERS": str(options.num_workers),
            "AKV_NUM_SERVERS": str(options.num_servers),
        }
        if node_host is not None:
            values["AKV_HOST"] = node_host
        env = {}
        for akv_name, mxnet_name in TWIN_VARIABLES:
            if akv_name in values:
                env[akv_name] = env[mxnet_name] = values[akv_name]
        env["AKV_TOKEN"] = token
        if rank is not None:
            env["AKV_RANK"] = str(rank)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(options.env)
        return env

    scheduler_env = job_env("scheduler")
    scheduler_env["AKV_SCHEDULER_FD"] = (
        FD_PLACEHOLDER if scheduler_fd is None else str(scheduler_fd)
    )
    specs = [
        ProcessSpec(
            role="scheduler",
            rank=None,
            argv=options.scheduler_command or (here_python, "-m", "akv.dist.scheduler"),
            env={**inherited, **scheduler_env},
            job_env=scheduler_env,
            pass_fds=() if scheduler_fd is None else (scheduler_fd,),
        )
    ]
    server_argv = options.server_command or (role_python, "-m", "akv.dist.server")
    roles = [("server", server_argv, options.num_servers)]
    roles.append(("worker", tuple(options.command), options.num_workers))
    if options.launcher == "local":
        for role, argv, count in roles:
            for rank in range(count):
                node_host = LOCAL_SCHEDULER_HOST if role == "server" else None
                env = job_env(role, rank, node_host)
                specs.append(ProcessSpec(role, rank, argv, {**inherited, **env}, env))
    elif options.launcher == "ssh":
        placement = iter(place(hosts, options.num_servers + options.num_workers))
        for role, argv, count in roles:
            for rank in range(count):
                host = next(placement)
                env = job_env(role, rank, host.name if role == "server" else None)
                specs.append(
                    ProcessSpec(
                        role,
                        rank,
                        ssh_argv(host),
                        dict(inherited),
                        env,
                        stdin=remote_script(env, cwd, argv),
                        host=host.name,
                    )
                )
    else:
        if any(host.port is not None for host in hosts):
            raise LaunchError(
                f"hostfile {options.hostfile}: `host:port` is the ssh form; the "
                f"{options.launcher} launcher takes `host` or `host slots=N` lines"
            )
        for role, argv, count in roles:
            env = job_env(role)
            if role == "server":
                # Each server advertises its own host; only the node knows its name.
                argv = (_SERVER_HOST_WRAPPER[0], "-c", _SERVER_HOST_WRAPPER[1], "akv-server")
                argv += tuple(server_argv)
            if options.launcher == "mpi":
                hostfile = os.path.join(cwd, options.hostfile) if options.hostfile else None
                full = mpirun_argv(mpi_flavour, count, list(env), argv, hosts, hostfile)
            else:
                full = srun_argv(count, list(env), argv, hosts)
            specs.append(ProcessSpec(role, None, full, {**inherited, **env}, env, count=count))
    return specs


_SERVER_HOST_WRAPPER = (
    "/bin/sh",
    'AKV_HOST="$(hostname)"; DMLC_NODE_HOST="$AKV_HOST"; export AKV_HOST DMLC_NODE_HOST; exec "$@"',
)


def ssh_argv(host: Host) -> tuple[str, ...]:
    """``ssh`` without a remote command line: the remote script comes on stdin."""
    port = ("-p", str(host.port)) if host.port is not None else ()
    return (
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        *port,
        host.name,
        "bash",
        "-s",
    )


def mpirun_argv(
    flavour: str,
    count: int,
    names: Sequence[str],
    argv: Sequence[str],
    hosts: Sequence[Host] = (),
    hostfile: str | None = None,
) -> tuple[str, ...]:
    """One ``mpirun`` for ``count`` processes of ``argv``, forwarding ``names`` by name.

    Open MPI: ``-x NAME`` per variable, hosts from ``--hostfile`` (or ``-H``). MPICH and
    Intel MPI: ``-genvlist NAME,...``, hosts as ``-hosts h1,h2:SLOTS``. The values stay in
    ``mpirun``'s environment; no value is on the command line.
    """
    command: list[str] = ["mpirun", "-n", str(count)]
    host_list = ",".join(f"{h.name}:{h.slots}" if h.slots else h.name for h in hosts)
    if flavour == "openmpi":
        if hostfile:
            command += ["--hostfile", hostfile]
        elif hosts:
            command += ["-H", host_list]
        for name in names:
            command += ["-x", name]
    else:
        if hosts:
            command += ["-hosts", host_list]
        command += ["-genvlist", ",".join(names)]
    return (*command, *argv)


def srun_argv(
    count: int, names: Sequence[str], argv: Sequence[str], hosts: Sequence[Host] = ()
) -> tuple[str, ...]:
    """One ``srun`` step for ``count`` tasks of ``argv``; ``names`` are exported by name.

    ``--kill-on-bad-exit=1`` ends the step when one task fails; ``--label`` prefixes each
    output line with the task number.
    """
    command = [
        "srun",
        f"--ntasks={count}",
        "--kill-on-bad-exit=1",
        "--label",
        f"--export=ALL,{','.join(names)}",
    ]
    if hosts:
        command.append(f"--nodelist={','.join(host.name for host in hosts)}")
    return (*command, *argv)


def remote_script(
    job_env: Mapping[str, str],
    cwd: str,
    argv: Sequence[str],
    *,
    terminate_grace_s: float = TERMINATE_GRACE_S,
) -> str:
    """The bash script ``ssh HOST bash -s`` reads on stdin for one process.

    It exports ``job_env``, changes to ``cwd``, and starts ``argv`` in its own session with
    stdin from ``/dev/null``. It then keeps reading its own stdin, which the launcher holds
    open: at EOF (the launcher stopped the job, died, or the connection dropped), and on
    SIGHUP/SIGINT/SIGTERM, it sends SIGTERM to the command's process group, waits up to
    ``terminate_grace_s``, then SIGKILL. When the command exits, what is left of its process
    group is stopped the same way. The script exits with the command's status (128+N for
    signal N). Secrets travel in this script, never on a command line.
    """
    exports = "\n".join(f"  export {name}={shlex.quote(value)}" for name, value in job_env.items())
    command = shlex.join(argv)
    ticks = max(1, round(terminate_grace_s * 10))
    return f"""\
# akv-launch: one process of an akv job; it is stopped when this script's stdin closes
akv_main() {{
{exports}
  cd -- {shlex.quote(cwd)} || exit 1
  exec 3<&0
  if command -v setsid >/dev/null 2>&1; then
    setsid {command} </dev/null 3<&- &
  else
    {command} </dev/null 3<&- &
  fi
  akv_pid=$!
  akv_stop() {{
    kill -TERM -- "-$akv_pid" 2>/dev/null || kill -TERM "$akv_pid" 2>/dev/null
    akv_ticks=0
    while kill -0 -- "-$akv_pid" 2>/dev/null && [ "$akv_ticks" -lt {ticks} ]; do
      sleep 0.1
      akv_ticks=$((akv_ticks + 1))
    done
    kill -KILL -- "-$akv_pid" 2>/dev/null || kill -KILL "$akv_pid" 2>/dev/null
  }}
  {{ while read -r _; do :; done; akv_stop; }} <&3 >/dev/null 2>&1 &
  akv_watch=$!
  exec 3<&-
  trap 'akv_stop; exit 129' HUP
  trap 'akv_stop; exit 130' INT
  trap 'akv_stop; exit 143' TERM
  wait "$akv_pid"
  akv_status=$?
  kill "$akv_watch" 2>/dev/null
  akv_stop
  exit "$akv_status"
}}
akv_main
"""


def mpi_flavour_from_version(output: str) -> str:
    """``"openmpi"`` or ``"mpich"`` from what ``mpirun --version`` printed.

    Open MPI says ``mpirun (Open MPI) 4.1.5``; MPICH's Hydra says ``HYDRA build details``;
    Intel MPI says ``Intel(R) MPI Library`` (it takes MPICH's flags). Raises
    :class:`LaunchError` quoting the first line for anything else.
    """
    lowered = output.lower()
    if "open mpi" in lowered or "open-mpi" in lowered or "open rte" in lowered:
        return "openmpi"
    if "hydra" in lowered or "mpich" in lowered or "intel(r) mpi" in lowered:
        return "mpich"
    first = output.strip().splitlines()[0] if output.strip() else "(nothing)"
    raise LaunchError(
        f"`mpirun --version` printed {first!r}: akv-launch knows Open MPI, MPICH and "
        "Intel MPI; put one of them first on PATH"
    )


def format_dry_run(specs: Sequence[ProcessSpec], token: str) -> str:
    """The exact commands of a plan as shell text, with ``token`` replaced by :data:`MASK`.

    A process that gets its variables through its environment is shown as
    ``env K=V ... CMD``; an ``ssh`` process as its command followed by the script it reads
    on stdin (as a here-document).
    """
    blocks = []
    for spec in specs:
        where = f" on {spec.host}" if spec.host else ""
        count = f" ({spec.count} processes)" if spec.count > 1 else ""
        header = f"# {spec.label}{where}{count}"
        if spec.stdin is not None:
            body = f"{shlex.join(spec.argv)} <<'AKV_SCRIPT'\n{spec.stdin}AKV_SCRIPT"
        else:
            assignments = [f"{name}={value}" for name, value in spec.job_env.items()]
            body = shlex.join(["env", *assignments, *spec.argv])
        blocks.append(f"{header}\n{body}")
    return "\n".join(blocks).replace(token, MASK) + "\n"


# ------------------------------------------------------------------ I/O


def launch(
    options: LaunchOptions,
    environ: Mapping[str, str] | None = None,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    terminate_grace_s: float = TERMINATE_GRACE_S,
) -> int:
    """Run (or, with ``options.dry_run``, print) the job; return the launcher's exit code.

    The scheduler's listening socket is bound here, before any process starts, on
    ``127.0.0.1`` (local) or ``--scheduler-host`` at port 0, and inherited by the scheduler
    as ``AKV_SCHEDULER_FD``: no other process can take the port in between. Exit codes are
    those of :func:`akv._launchers.supervise`.

    Raises
    ------
    LaunchError
        Before anything starts: a bad host file, a missing ``ssh``/``mpirun``/``srun``, a
        short ``AKV_TOKEN``, an address the scheduler cannot listen on.
    """
    environ = dict(os.environ if environ is None else environ)
    validate(options)
    out = stdout if stdout is not None else sys.stdout.buffer
    hosts = load_hostfile(options.hostfile) if options.hostfile else []
    token = environ.get("AKV_TOKEN") or new_token()
    if len(token) < MIN_TOKEN_CHARS:
        raise LaunchError(
            f"AKV_TOKEN in the launcher's environment has {len(token)} characters; the store "
            f"needs at least {MIN_TOKEN_CHARS}: unset it and akv-launch makes a fresh one"
        )
    tool = {"ssh": "ssh", "mpi": "mpirun", "slurm": "srun"}.get(options.launcher)
    found = tool is not None and shutil.which(tool, path=environ.get("PATH")) is not None
    if tool is not None and not found and not options.dry_run:
        raise LaunchError(f"--launcher {options.launcher} runs `{tool}`, which is not on PATH")
    flavour = "openmpi"
    if options.launcher == "mpi" and found:
        flavour = _detect_mpi_flavour(environ)
    if options.dry_run:
        specs = plan(options, environ, token=token, hosts=hosts, mpi_flavour=flavour)
        note = ""
        if tool is not None and not found:
            note = f"# `{tool}` is not on PATH here\n"
        out.write((note + format_dry_run(specs, token)).encode())
        out.flush()
        return 0
    host = options.scheduler_host or LOCAL_SCHEDULER_HOST
    listener = _listen(host, options.num_workers + options.num_servers)
    try:
        specs = plan(
            options,
            environ,
            token=token,
            scheduler_port=listener.getsockname()[1],
            scheduler_fd=listener.fileno(),
            hosts=hosts,
            mpi_flavour=flavour,
        )
    except BaseException:
        listener.close()
        raise
    return supervise(
        specs,
        grace_s=options.grace_s,
        terminate_grace_s=terminate_grace_s,
        stdout=out,
        stderr=stderr,
        inherited=[listener],
    )


def _listen(host: str, peers: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise LaunchError(
            f"cannot resolve --scheduler-host {host!r}: {exc}; pass an address of this "
            "machine that the other hosts can reach"
        ) from exc
    try:
        listener.bind(address)
        listener.listen(max(socket.SOMAXCONN, peers))
    except OSError as exc:
        listener.close()
        raise LaunchError(
            f"the scheduler cannot listen on {host!r}: {exc}; --scheduler-host must be an "
            "address of this machine that the other hosts can reach"
        ) from exc
    return listener


def _detect_mpi_flavour(environ: Mapping[str, str]) -> str:
    try:
        result = subprocess.run(
            ["mpirun", "--version"],
            capture_output=True,
            text=True,
            env=dict(environ),
            timeout=MPI_VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"`mpirun --version` failed: {exc}") from exc
    return mpi_flavour_from_version(result.stdout + result.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``akv-launch`` command; returns its exit code.

    0: every worker exited 0. A worker's code (128+N for signal N): the first worker that
    failed. The scheduler's or a server's code: it failed while the job ran. 130/143:
    interrupted by SIGINT/SIGTERM. 2: a bad command line, host file or environment
    (nothing was started). 126/127: a process could not be started.
    """
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        return launch(options)
    except LaunchError as exc:
        print(f"akv-launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before the supervisor took over: nothing runs yet
        return 130
