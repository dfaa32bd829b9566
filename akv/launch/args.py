"""The ``akv-launch`` command line: parse it into :class:`LaunchOptions` and check them.

Pure: no file, process or socket is touched (``-H`` is only a path here). The rule for
where the worker command starts is :func:`split_command`'s; everything :func:`validate`
rejects is a :class:`~akv.errors.LaunchError` naming the flag and what to pass instead.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, NoReturn

from akv import __version__
from akv.cluster.config import (
    ADVERTISE_VARIABLE,
    CHECKPOINT_DIR_VARIABLE,
    RANK_FROM_VARIABLE,
    TWIN_VARIABLES,
    format_address,
    is_wildcard,
    parse_address,
    parse_log_level,
)
from akv.errors import ConfigError, LaunchError
from akv.launch.limits import DEFAULT_GRACE_S

__all__ = [
    "ALL_GPUS",
    "CHECKPOINT_INTERVAL_VARIABLE",
    "CHECKPOINT_VARIABLES",
    "DEFAULT_MASTER_PORT",
    "GPU_VARIABLE",
    "LAUNCHERS",
    "LOCAL_SCHEDULER_HOST",
    "OWNED_VARIABLES",
    "REMOTE_LAUNCHERS",
    "RESTARTING_LAUNCHERS",
    "TORCH_VARIABLES",
    "LaunchOptions",
    "SplitCommandLine",
    "parse_args",
    "per_node_scheduler",
    "scheduler_address",
    "scheduler_listen_host",
    "split_command",
    "validate",
]

LAUNCHERS = ("local", "ssh", "mpi", "slurm", "ray")
REMOTE_LAUNCHERS = ("ssh", "mpi", "slurm")
#: The launchers whose plans give each server a process of its own, which can be started
#: again alone (``--max-restarts``); mpi and slurm run every server in one mpirun/srun.
#: (ray: Ray restarts a server's actor, see :mod:`akv.ray`.)
RESTARTING_LAUNCHERS = ("local", "ssh", "ray")
#: How often a server writes its checkpoint (``--checkpoint-interval-s``).
CHECKPOINT_INTERVAL_VARIABLE = "AKV_CHECKPOINT_INTERVAL_S"
#: The servers' checkpoint variables, and the flag that sets each.
CHECKPOINT_VARIABLES = {
    CHECKPOINT_DIR_VARIABLE: "--checkpoint-dir",
    CHECKPOINT_INTERVAL_VARIABLE: "--checkpoint-interval-s",
}
#: Where the local launcher's scheduler listens.
LOCAL_SCHEDULER_HOST = "127.0.0.1"
#: The variables PyTorch programs read, which akv-launch sets for each worker it ranks
#: (``MASTER_ADDR``/``MASTER_PORT`` too, but a user's ``--env`` may set those).
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: The devices a worker sees (``--gpus-per-worker``).
GPU_VARIABLE = "CUDA_VISIBLE_DEVICES"
#: ``--gpus-per-worker all``: every worker sees every GPU of its machine.
ALL_GPUS = "all"
#: The scheduler's port in the per-node mode when ``--master-addr`` comes without
#: ``--master-port`` (torchrun's default).
DEFAULT_MASTER_PORT = 29500
#: Variables that belong to the launcher: ``--env`` may not set them, and values inherited
#: from the launcher's own environment are dropped so a stale one cannot leak into the job
#: (a stale checkpoint directory would have the servers restore another job's values).
OWNED_VARIABLES = frozenset(
    [name for pair in TWIN_VARIABLES for name in pair]
    + ["AKV_TOKEN", "AKV_RANK", "AKV_SCHEDULER_FD", ADVERTISE_VARIABLE, "PYTHONUNBUFFERED"]
    + [RANK_FROM_VARIABLE, *TORCH_VARIABLES]
    + list(CHECKPOINT_VARIABLES)
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_EXAMPLE = "akv-launch -n 2 -s 1 python train.py"


@dataclass(frozen=True)
class LaunchOptions:
    """Everything the command line says, checked by :func:`validate`.

    ``scheduler_command`` and ``server_command`` replace the role commands
    ``[PYTHON, "-m", "akv.cluster.scheduler"]`` and ``[PYTHON, "-m", "akv.cluster.server"]``;
    they are a seam for tests and custom role programs and have no flag.
    """

    num_workers: int
    num_servers: int
    command: tuple[str, ...]
    launcher: str = "local"
    hostfile: str | None = None
    scheduler_host: str | None = None
    #: The address the other processes are told to reach the scheduler at, when it is not
    #: ``scheduler_host`` (where it listens): a host alone (``[IPv6]`` in brackets).
    scheduler_advertise: str | None = None
    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    dry_run: bool = False
    grace_s: float = DEFAULT_GRACE_S
    log_dir: str | None = None
    #: Where each server keeps its checkpoint (``AKV_CHECKPOINT_DIR``), a path on the
    #: server's host; ``None``: servers write no checkpoint.
    checkpoint_dir: str | None = None
    #: How often each server writes its checkpoint (``AKV_CHECKPOINT_INTERVAL_S``);
    #: ``None``: the server's default.
    checkpoint_interval_s: float | None = None
    #: How many times each server that fails while workers run is started again.
    max_restarts: int = 0
    #: The Ray cluster ``--launcher ray`` connects to (``ray.init(address=...)``); None:
    #: ``RAY_ADDRESS``, else a local Ray instance.
    ray_address: str | None = None
    #: How many GPUs each worker of a machine gets through ``CUDA_VISIBLE_DEVICES``: a
    #: number (0: none), :data:`ALL_GPUS` (every worker sees every GPU; akv sets nothing),
    #: or ``None``: the machine's GPUs shared out evenly, when any are found.
    gpus_per_worker: int | str | None = None
    #: ``AKV_LOG_LEVEL`` for every process, and the launcher's own level (``--log-level``).
    log_level: str | None = None
    #: The per-node mode (``--nnodes``): this command is one of ``nnodes`` launchers, one per
    #: machine, and starts this machine's share of the job; ``None``: it starts all of it.
    nnodes: int | None = None
    #: This machine's number in the per-node mode (``--node-rank``); node 0 runs the
    #: scheduler.
    node_rank: int | None = None
    #: The per-node mode's ``HOST:PORT`` where every node reaches the scheduler (node 0
    #: listens on PORT): ``--scheduler``, or ``--master-addr``/``--master-port``.
    scheduler: str | None = None
    #: The address other machines reach this machine's servers at, in the per-node mode
    #: (``--node-host``; default: the address this machine reaches the scheduler from).
    node_host: str | None = None
    scheduler_command: tuple[str, ...] | None = None
    server_command: tuple[str, ...] | None = None


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    """Turn a command line (without the program name) into checked :class:`LaunchOptions`.

    The worker command starts where :func:`split_command` says: after the first ``--``, or
    at the first word that is neither an option nor an option's value. ``-h``/``--help``
    and ``--version`` print and raise :class:`SystemExit` (0). Raises :class:`LaunchError`
    for a flag argparse rejects, for anything :func:`validate` rejects, and when there is no
    command.
    """
    split = split_command(argv)
    args = _parser()[0].parse_args(split.options)
    num_workers = _num_workers(args)
    command = split.command
    if not command and not split.separated:
        raise LaunchError(
            f"missing command: give the worker command after the options, e.g. `{_EXAMPLE}`"
        )
    env: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise LaunchError(f"--env {item!r} is not NAME=VALUE")
        env[name] = value
    servers = args.num_servers
    if servers is None:  # MXNet's default: a server per worker; per node: one per node
        servers = args.nnodes if args.nnodes is not None else num_workers
    options = LaunchOptions(
        num_workers=num_workers,
        num_servers=servers,
        command=tuple(command),
        launcher=args.launcher,
        hostfile=args.hostfile,
        scheduler_host=args.scheduler_host,
        scheduler_advertise=args.scheduler_advertise,
        python=args.python,
        env=env,
        dry_run=args.dry_run,
        # The per-node mode: the job ends when every node's workers ended, not this node's.
        grace_s=args.grace_s
        if args.grace_s is not None
        else (math.inf if args.nnodes is not None else DEFAULT_GRACE_S),
        log_dir=args.log_dir,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_interval_s=args.checkpoint_interval_s,
        max_restarts=args.max_restarts,
        ray_address=args.ray_address,
        gpus_per_worker=_gpus(args.gpus_per_worker),
        log_level=args.log_level,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        scheduler=_scheduler(args),
        node_host=args.node_host,
    )
    validate(options)
    return options


def _num_workers(args: argparse.Namespace) -> int:
    """``-n``/``-np``, or ``--nproc-per-node`` times the nodes (both only if they agree)."""
    nodes = args.nnodes if args.nnodes is not None else 1
    per_node = args.nproc_per_node
    if per_node is None:
        if args.num_workers is None:
            raise LaunchError(
                "missing -n/--num-workers WORKERS (or -np WORKERS, or --nproc-per-node N): "
                f"how many workers the job runs, e.g. `{_EXAMPLE}`"
            )
        return int(args.num_workers)
    if per_node < 1:
        raise LaunchError(f"--nproc-per-node is {per_node}: give the workers per node (>= 1)")
    if args.num_workers is not None and args.num_workers != per_node * nodes:
        raise LaunchError(
            f"-n {args.num_workers} contradicts --nproc-per-node {per_node} on {nodes} "
            f"node(s) ({per_node * nodes} workers): give one of them"
        )
    return int(per_node * nodes)


def _scheduler(args: argparse.Namespace) -> str | None:
    """The per-node mode's ``HOST:PORT``, from ``--scheduler`` or torchrun's
    ``--master-addr``/``--master-port``."""
    if args.master_addr is None:
        if args.master_port is not None:
            raise LaunchError("--master-port needs --master-addr: the scheduler's host")
        return args.scheduler if args.scheduler is None else str(args.scheduler)
    if args.scheduler is not None:
        raise LaunchError(
            "--scheduler and --master-addr both say where the scheduler is: give one of them"
        )
    port = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
    return format_address(str(args.master_addr).strip("[]"), int(port))


def _gpus(text: str | None) -> int | str | None:
    if text is None or text == ALL_GPUS:
        return text
    try:
        return int(text)
    except ValueError:
        raise LaunchError(
            f"--gpus-per-worker {text!r}: give a number of GPUs (0: none) or `all`"
        ) from None


class SplitCommandLine(NamedTuple):
    """A command line cut in two by :func:`split_command`."""

    #: The launcher's words (options and their values), for argparse.
    options: list[str]
    #: The worker command's words.
    command: list[str]
    #: Whether a ``--`` separated them.
    separated: bool


def split_command(argv: Sequence[str]) -> SplitCommandLine:
    """Split a command line into the launcher's options and the worker command.

    Words are read from the left. ``--`` ends the options: the command is what follows it.
    Otherwise the first word that is not an option (does not start with ``-``, or is a lone
    ``-``) and is not the value of the option before it starts the command, and every word
    from there on is the command's (``-n 2 python train.py -n 5`` gives ``-n 5`` to
    ``train.py``). An option that takes a value takes the next word (unless it is ``--``,
    or the value is attached: ``-n2``, ``--num-workers=2``); one that takes several
    (``--env``) also takes each following word that contains ``=`` and does not start with
    ``-``. Long options may be abbreviated as argparse allows (``--num-w``). Unknown
    options take no value; argparse then rejects them.
    """
    actions = _parser()[1]
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            return SplitCommandLine(words[:index], words[index + 1 :], True)
        if word == "-" or not word.startswith("-"):
            return SplitCommandLine(words[:index], words[index:], False)
        index += 1 + _values_taken(word, words[index + 1 :], actions)
    return SplitCommandLine(words, [], False)


def validate(options: LaunchOptions) -> None:
    """Check options that need no file or network; raise :class:`LaunchError` on the first
    problem, saying which flag and what to pass instead."""
    if options.num_workers < 1:
        raise LaunchError(f"-n/--num-workers is {options.num_workers}: a job needs >= 1 worker")
    _validate_habits(options)
    if options.num_servers < 1:
        raise LaunchError(f"-s/--num-servers is {options.num_servers}: a job needs >= 1 server")
    if not options.command:
        raise LaunchError(f"missing command after `--`: give the worker command, e.g. `{_EXAMPLE}`")
    if options.launcher not in LAUNCHERS:
        raise LaunchError(
            f"unknown launcher {options.launcher!r}: use one of {', '.join(LAUNCHERS)}"
        )
    if math.isnan(options.grace_s) or options.grace_s < 0:
        raise LaunchError(f"--grace-s is {options.grace_s}: give a number of seconds >= 0")
    if options.log_dir is not None and not options.log_dir:
        raise LaunchError("--log-dir is empty: give a directory (it is created if missing)")
    _validate_checkpoints(options)
    _validate_ray(options)
    remote = options.launcher in REMOTE_LAUNCHERS
    if remote and not options.scheduler_host:
        raise LaunchError(
            f"--launcher {options.launcher} needs --scheduler-host: pass the address of this "
            "machine that the other hosts can reach (the scheduler runs here and listens there)"
        )
    if not remote and options.scheduler_host and options.nnodes is None:
        raise LaunchError(
            "--scheduler-host is for the ssh, mpi and slurm launchers; the local launcher's "
            f"scheduler listens on {LOCAL_SCHEDULER_HOST}"
        )
    if not remote and options.scheduler_advertise is not None:
        raise LaunchError(
            "--scheduler-advertise is for the ssh, mpi and slurm launchers; the local "
            f"launcher's processes reach the scheduler at {LOCAL_SCHEDULER_HOST}"
        )
    scheduler_address(options)  # a bad --scheduler-advertise, or a wildcard without one
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
        if name in CHECKPOINT_VARIABLES:
            raise LaunchError(
                f"--env {name}=...: akv-launch sets {name} for the servers itself: pass "
                f"{CHECKPOINT_VARIABLES[name]} instead"
            )
        if name in OWNED_VARIABLES:
            raise LaunchError(
                f"--env {name}=...: akv-launch sets {name} itself (from -n, -s, "
                "--scheduler-host and the process's role and rank)"
            )


def per_node_scheduler(options: LaunchOptions) -> tuple[str, int]:
    """The per-node mode's scheduler address ``(host, port)`` (an IPv6 host without
    brackets); a :class:`LaunchError` when it is missing, has no port, or is a wildcard."""
    if options.scheduler is None:
        raise LaunchError(
            "--nnodes needs the scheduler's address, the same on every node: pass "
            "--scheduler HOST:PORT (or --master-addr HOST [--master-port PORT]), an address "
            "of node 0 that every node reaches"
        )
    try:
        host, port = parse_address(options.scheduler, "--scheduler")
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None
    if port is None:
        raise LaunchError(
            f"--scheduler {options.scheduler}: give HOST:PORT; node 0 listens on PORT, and "
            "every node must know it"
        )
    return host, port


def scheduler_listen_host(options: LaunchOptions) -> str:
    """Where the scheduler listens: ``--scheduler-host`` (ssh, mpi, slurm, and the per-node
    mode when given), every interface in the per-node mode (``0.0.0.0``, or ``::`` for an
    IPv6 ``--scheduler``), else :data:`LOCAL_SCHEDULER_HOST`."""
    if options.scheduler_host and (options.launcher in REMOTE_LAUNCHERS or options.nnodes):
        return options.scheduler_host
    if options.nnodes is not None:
        return "::" if ":" in per_node_scheduler(options)[0] else "0.0.0.0"
    return LOCAL_SCHEDULER_HOST


def scheduler_address(options: LaunchOptions) -> str:
    """The host the servers and workers are told to reach the scheduler at (their
    ``AKV_SCHEDULER_HOST``; an IPv6 address without brackets): ``--scheduler-advertise``,
    else ``--scheduler-host``, else :data:`LOCAL_SCHEDULER_HOST`.

    Raises :class:`LaunchError` for a ``--scheduler-advertise`` that is not a host (or has a
    port: akv-launch chooses the scheduler's port when it binds the socket), and for a
    wildcard ``--scheduler-host`` (``0.0.0.0``, ``::``) without ``--scheduler-advertise``.
    In the per-node mode: the host of :func:`per_node_scheduler`.
    """
    if options.nnodes is not None:
        return per_node_scheduler(options)[0]
    if options.scheduler_advertise is not None:
        try:
            host, port = parse_address(options.scheduler_advertise, "--scheduler-advertise")
        except ConfigError as exc:
            raise LaunchError(str(exc)) from None
        if port is not None:
            raise LaunchError(
                f"--scheduler-advertise {options.scheduler_advertise}: give a host alone; "
                "akv-launch chooses the scheduler's port when it binds its socket, and the "
                "other processes are told that port"
            )
        return host
    host = options.scheduler_host or LOCAL_SCHEDULER_HOST
    if is_wildcard(host):
        raise LaunchError(
            f"--scheduler-host {host} is a wildcard address: the scheduler can listen there, "
            "but no other process can connect to it; also pass --scheduler-advertise HOST, "
            "the address of this machine that the other hosts reach"
        )
    return host


def _validate_ray(options: LaunchOptions) -> None:
    """The checks of ``--launcher ray`` and ``--ray-address``: Ray places the processes."""
    if options.launcher != "ray":
        if options.ray_address is not None:
            raise LaunchError("--ray-address is for --launcher ray")
        return
    for flag, value in (
        ("-H/--hostfile", options.hostfile),
        ("--scheduler-host", options.scheduler_host),
        ("--scheduler-advertise", options.scheduler_advertise),
        ("--python", options.python),
    ):
        if value is not None:
            raise LaunchError(
                f"{flag} is not for --launcher ray: Ray places every process, each on the "
                "address of its node, with the Python of Ray's workers"
            )
    if options.ray_address is not None and not options.ray_address:
        raise LaunchError("--ray-address is empty: give the Ray cluster's address (HOST:PORT)")


def _validate_habits(options: LaunchOptions) -> None:
    """The checks of the per-node mode, ``--gpus-per-worker`` and ``--log-level``."""
    if options.log_level is not None:
        try:
            parse_log_level(options.log_level, "--log-level")
        except ConfigError as exc:
            raise LaunchError(str(exc)) from None
        if "AKV_LOG_LEVEL" in options.env:
            raise LaunchError("--env AKV_LOG_LEVEL=... and --log-level: give one of them")
    gpus = options.gpus_per_worker
    if gpus is not None and gpus != ALL_GPUS:
        if not isinstance(gpus, int) or gpus < 0:
            raise LaunchError(f"--gpus-per-worker {gpus!r}: give a number >= 0, or `all`")
        if options.launcher in ("mpi", "slurm"):
            tool = "mpirun's" if options.launcher == "mpi" else "srun's (--gpus-per-task)"
            raise LaunchError(
                f"--gpus-per-worker is for the local and ssh launchers: under --launcher "
                f"{options.launcher} one command starts every worker, so give them their "
                f"devices with {tool} own options"
            )
    if gpus is not None and GPU_VARIABLE in options.env:
        raise LaunchError(
            f"--env {GPU_VARIABLE}=... and --gpus-per-worker both choose the workers' GPUs: "
            "give one of them"
        )
    if options.nnodes is None:
        for flag, value in (
            ("--node-rank", options.node_rank),
            ("--scheduler/--master-addr", options.scheduler),
            ("--node-host", options.node_host),
        ):
            if value is not None:
                raise LaunchError(
                    f"{flag} is for the per-node mode: pass --nnodes N too (one akv-launch per "
                    "node), or leave it out to run the whole job from here"
                )
        return
    if options.nnodes < 1:
        raise LaunchError(f"--nnodes is {options.nnodes}: give the number of nodes (>= 1)")
    if options.node_rank is None:
        if options.nnodes > 1:
            raise LaunchError(
                f"--nnodes {options.nnodes} needs --node-rank K (0..{options.nnodes - 1}): "
                "each node's own number; node 0 runs the scheduler"
            )
    elif not 0 <= options.node_rank < options.nnodes:
        raise LaunchError(
            f"--node-rank is {options.node_rank}: give 0..{options.nnodes - 1} for "
            f"--nnodes {options.nnodes}"
        )
    if options.launcher != "local":
        raise LaunchError(
            f"--nnodes is the per-node mode, where each node runs its own akv-launch: it "
            f"takes no --launcher {options.launcher} (which starts every node from here)"
        )
    if options.scheduler_advertise is not None:
        raise LaunchError(
            "--scheduler-advertise is not for the per-node mode: every node reaches the "
            "scheduler at --scheduler HOST:PORT"
        )
    if options.num_workers < options.nnodes:
        raise LaunchError(
            f"-n {options.num_workers} workers over --nnodes {options.nnodes}: every node "
            "needs at least one worker"
        )
    per_node_scheduler(options)


def _validate_checkpoints(options: LaunchOptions) -> None:
    """The checks of ``--checkpoint-dir``, ``--checkpoint-interval-s`` and
    ``--max-restarts``."""
    if options.checkpoint_dir is not None and not options.checkpoint_dir:
        raise LaunchError("--checkpoint-dir is empty: give a directory on each server's host")
    interval = options.checkpoint_interval_s
    if interval is not None:
        if not math.isfinite(interval) or interval <= 0:
            raise LaunchError(
                f"--checkpoint-interval-s is {interval}: give a number of seconds > 0"
            )
        if options.checkpoint_dir is None:
            raise LaunchError(
                "--checkpoint-interval-s needs --checkpoint-dir DIR: without a directory "
                "the servers write no checkpoint"
            )
    if options.max_restarts < 0:
        raise LaunchError(
            f"--max-restarts is {options.max_restarts}: give how many times a server may be "
            "restarted (>= 0)"
        )
    if options.max_restarts == 0:
        return
    if options.checkpoint_dir is None:
        raise LaunchError(
            f"--max-restarts {options.max_restarts} needs --checkpoint-dir DIR: a server "
            "restarted without a checkpoint would start empty, and the values the job had "
            "stored on it would be lost"
        )
    if options.launcher not in RESTARTING_LAUNCHERS:
        tool = "mpirun" if options.launcher == "mpi" else "srun"
        raise LaunchError(
            f"--max-restarts is for the {', '.join(RESTARTING_LAUNCHERS[:-1])} and "
            f"{RESTARTING_LAUNCHERS[-1]} launchers: "
            f"under --launcher {options.launcher} one `{tool}` runs every server, so one "
            "server cannot be started again alone (--checkpoint-dir alone is allowed)"
        )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)


def _parser() -> tuple[argparse.ArgumentParser, list[argparse.Action]]:
    """The argparse parser, and its options (for :func:`split_command`)."""
    parser = _Parser(
        prog="akv-launch",
        usage="%(prog)s -n WORKERS [options] [--] CMD...\n"
        "       %(prog)s --nnodes NODES --node-rank K --scheduler HOST:PORT "
        "--nproc-per-node N [options] [--] CMD...",
        description="Start an akv job (one scheduler, SERVERS servers, WORKERS workers "
        "running CMD) and supervise it: output is prefixed per process, the first failing "
        "worker's exit code is the job's, and every process started is stopped at the end. "
        "CMD starts at the first word that is not an option or an option's value (or after "
        "`--`); every word from there on is CMD's.",
        epilog="Examples: akv-launch -n 2 -s 1 python train.py --epochs 3; "
        "akv-launch -n 2 --log-dir logs -- python train.py",
    )
    add = parser.add_argument
    actions = [
        add(
            "-n",
            "-np",
            "--num-workers",
            type=int,
            metavar="WORKERS",
            help="number of workers (>= 1; required unless --nproc-per-node gives it; -np "
            "is horovodrun's spelling)",
        ),
        add(
            "--nproc-per-node",
            "--nproc_per_node",
            type=int,
            metavar="N",
            help="workers per node, as torchrun's: -n is N times --nnodes (1 without it)",
        ),
        add(
            "-s",
            "--num-servers",
            type=int,
            metavar="SERVERS",
            help="number of servers (>= 1; default: WORKERS, as MXNet)",
        ),
        add("--launcher", default="local", help="local (default), ssh, mpi, slurm or ray"),
        add(
            "--ray-address",
            metavar="ADDR",
            help="--launcher ray: the Ray cluster to run on (default: RAY_ADDRESS, else a "
            "local Ray instance); needs the ray extra",
        ),
        add("-H", "--hostfile", help="lines: host, host:port or host slots=N"),
        add(
            "--scheduler-host",
            help="this machine's address the other hosts reach the scheduler at, and where "
            "it listens (required for ssh, mpi and slurm)",
        ),
        add(
            "--scheduler-advertise",
            metavar="HOST",
            help="the address the other hosts are told to reach the scheduler at, when it "
            "is not --scheduler-host (NAT; --scheduler-host 0.0.0.0)",
        ),
        add(
            "--python",
            help="Python for servers (default: this Python locally, python3 on other hosts)",
        ),
        add(
            "--env",
            action="extend",
            nargs="+",
            default=[],
            metavar="K=V",
            help="extra variables for every process (each following word with `=` is one)",
        ),
        add("--dry-run", action="store_true", help="print the commands, run nothing"),
        add(
            "--grace-s",
            type=float,
            metavar="SECONDS",
            help="once every worker exited 0, how long the scheduler and servers get to stop "
            f"on their own (default {DEFAULT_GRACE_S:g}; per-node mode: until they stop, "
            "when the whole job ended)",
        ),
        add(
            "--log-dir",
            metavar="DIR",
            help="also write each process's prefixed output lines (stdout and stderr) to "
            "DIR/scheduler.log, DIR/server-RANK.log and DIR/worker-RANK.log (mpi and slurm: "
            "one DIR/servers.log and DIR/workers.log per group); DIR is created, the files "
            "are overwritten",
        ),
        add(
            "--checkpoint-dir",
            metavar="DIR",
            help="each server keeps its checkpoint in DIR/server-RANK.akvckpt "
            "(AKV_CHECKPOINT_DIR; servers only); for ssh, mpi and slurm DIR is a path on "
            "each server's host; a relative DIR is taken from this working directory",
        ),
        add(
            "--checkpoint-interval-s",
            type=float,
            metavar="SECONDS",
            help="how often each server writes its checkpoint (AKV_CHECKPOINT_INTERVAL_S, "
            "> 0; default: the server's); needs --checkpoint-dir",
        ),
        add(
            "--max-restarts",
            type=int,
            default=0,
            metavar="N",
            help="start a server that fails while workers run again from its checkpoint, "
            "up to N times per server (default 0; needs --checkpoint-dir; local, ssh and ray "
            "only); workers and the scheduler are never restarted",
        ),
        add(
            "--gpus-per-worker",
            metavar="N|all",
            help="GPUs each worker of a machine gets through CUDA_VISIBLE_DEVICES, in "
            "LOCAL_RANK order (0: none; all: every worker sees every GPU); default: this "
            "machine's GPUs (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`) shared out evenly",
        ),
        add(
            "--log-level",
            metavar="LEVEL",
            help="AKV_LOG_LEVEL for every process: DEBUG, INFO (default), WARNING, ERROR or "
            "CRITICAL, any case; above INFO the launcher prints no progress lines either",
        ),
        add(
            "--nnodes",
            type=int,
            metavar="NODES",
            help="per-node mode, for clusters without ssh: run one akv-launch on each of "
            "NODES machines, with the same options but --node-rank; each starts its share "
            "of the servers and workers, node 0 also the scheduler",
        ),
        add(
            "--node-rank",
            "--node_rank",
            type=int,
            metavar="K",
            help="per-node mode: this machine's number, 0..NODES-1",
        ),
        add(
            "--scheduler",
            metavar="HOST:PORT",
            help="per-node mode: node 0's address and the port its scheduler listens on, "
            "which every node reaches",
        ),
        add(
            "--master-addr",
            "--master_addr",
            metavar="HOST",
            help="per-node mode: torchrun's spelling of --scheduler's HOST",
        ),
        add(
            "--master-port",
            "--master_port",
            type=int,
            metavar="PORT",
            help=f"per-node mode: torchrun's spelling of --scheduler's PORT (default "
            f"{DEFAULT_MASTER_PORT})",
        ),
        add(
            "--node-host",
            metavar="HOST",
            help="per-node mode: the address other nodes reach this node's servers at "
            "(default: the address this node reaches the scheduler from)",
        ),
        add("--version", action="version", version=f"akv-launch {__version__}"),
    ]
    return parser, actions


def _values_taken(word: str, rest: Sequence[str], actions: Sequence[argparse.Action]) -> int:
    """How many of the words ``rest`` after option ``word`` are its values."""
    if word.startswith("--"):
        if "=" in word:
            return 0
        action = _long_option(word, actions)
    else:
        action = next((a for a in actions if word in a.option_strings), None)
        if action is None and len(word) > 2:  # -n2: the value is attached
            return 0
    if action is None or action.nargs == 0 or not rest or rest[0] == "--":
        return 0
    if action.nargs != "+":
        return 1
    taken = 1
    while taken < len(rest) and "=" in rest[taken] and not rest[taken].startswith("-"):
        taken += 1
    return taken


def _long_option(word: str, actions: Sequence[argparse.Action]) -> argparse.Action | None:
    """The action of long option ``word``, spelled out or abbreviated to a unique prefix."""
    exact = [a for a in actions if word in a.option_strings]
    if exact:
        return exact[0]
    matches = [a for a in actions if any(s.startswith(word) for s in a.option_strings)]
    return matches[0] if len(matches) == 1 else None
