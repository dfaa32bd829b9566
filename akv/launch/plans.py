"""The plan of a job: the list of :class:`ProcessSpec` to start, one plan per launcher.

Pure: every fact about this machine (the environment, the working directory, the Python,
the scheduler's socket, the host file's hosts, which MPI) comes in a :class:`JobContext`,
and nothing here starts a process, opens a file or a socket. (:func:`new_token` draws
random bytes; that is all.) Here too: the exact ``ssh``, ``mpirun`` and ``srun`` command
lines, the ``ssh`` launcher's remote script, reading ``mpirun --version``, and the text
``--dry-run`` prints.
"""

from __future__ import annotations

import os
import secrets
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from akv.cluster.config import ADVERTISE_VARIABLE, CHECKPOINT_DIR_VARIABLE, TWIN_VARIABLES
from akv.errors import LaunchError
from akv.launch.args import (
    CHECKPOINT_INTERVAL_VARIABLE,
    GPU_VARIABLE,
    LOCAL_SCHEDULER_HOST,
    OWNED_VARIABLES,
    REMOTE_LAUNCHERS,
    LaunchOptions,
    per_node_scheduler,
    scheduler_address,
    scheduler_listen_host,
    validate,
)
from akv.launch.devices import worker_devices
from akv.launch.hosts import Host, assign_hosts, node_share
from akv.launch.limits import TERMINATE_GRACE_S, TOKEN_BYTES
from akv.launch.spec import ProcessSpec
from akv.limits import MIN_TOKEN_CHARS

__all__ = [
    "FD_PLACEHOLDER",
    "LAUNCHER_TOOLS",
    "MASK",
    "MPI_FLAVOURS",
    "PORT_PLACEHOLDER",
    "JobContext",
    "format_dry_run",
    "job_token",
    "log_file_name",
    "mpi_flavour_from_version",
    "mpirun_argv",
    "new_token",
    "plan",
    "plan_local",
    "plan_mpi",
    "plan_node",
    "plan_slurm",
    "plan_ssh",
    "remote_script",
    "srun_argv",
    "ssh_argv",
]

MPI_FLAVOURS = ("openmpi", "mpich")
#: The program each remote launcher runs on this machine.
LAUNCHER_TOOLS = {"ssh": "ssh", "mpi": "mpirun", "slurm": "srun"}
#: The Python started on other hosts unless ``--python`` says otherwise.
DEFAULT_REMOTE_PYTHON = "python3"
#: What ``--dry-run`` shows in place of the job token.
MASK = "<masked>"
#: ``--dry-run`` shows these where the real values exist only once the socket is bound.
PORT_PLACEHOLDER = "<port>"
FD_PLACEHOLDER = "<fd>"

_SERVER_HOST_WRAPPER = (
    "/bin/sh",
    "-c",
    'AKV_HOST="$(hostname)"; DMLC_NODE_HOST="$AKV_HOST"; export AKV_HOST DMLC_NODE_HOST; exec "$@"',
    "akv-server",
)
#: What a server binds when its host file line has ``advertise=ADDR``: every interface.
WILDCARD_HOST = "0.0.0.0"
WILDCARD_HOST_IPV6 = "::"


@dataclass(frozen=True)
class JobContext:
    """What a plan needs besides the command line: facts about this machine and this job.

    Attributes
    ----------
    environ
        The launcher's environment; every process inherits it, minus the
        :data:`~akv.launch.args.OWNED_VARIABLES` it may hold, plus the job's variables.
    token
        The job token (see :func:`job_token`).
    cwd
        The directory remote processes start in (and the base of a relative ``mpi`` host
        file and of a relative ``--checkpoint-dir``).
    python
        The Python that runs the scheduler (and local servers), normally ``sys.executable``.
    scheduler_port, scheduler_fd
        The port of the scheduler's listening socket and its descriptor, which the
        scheduler inherits; ``None`` (``--dry-run``) puts placeholders in their place.
    hosts
        The host file's hosts (required for ``ssh``; optional for ``mpi`` and ``slurm``).
    mpi_flavour
        ``"openmpi"`` or ``"mpich"`` (MPICH and Intel MPI): how ``mpirun`` forwards names.
    gpus
        This machine's GPUs (:func:`~akv.launch.devices.visible_devices`), which its
        workers share out; ``None``: not looked at.
    node_host
        The per-node mode's default address of this machine's servers (the one it reaches
        the scheduler from).
    """

    environ: Mapping[str, str]
    token: str
    cwd: str
    python: str
    scheduler_port: int | None = None
    scheduler_fd: int | None = None
    hosts: Sequence[Host] = field(default=())
    mpi_flavour: str = "openmpi"
    gpus: Sequence[str] | None = None
    node_host: str | None = None


def plan(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """Decide every process of the job: what runs where, with which environment.

    Checks ``options`` (:func:`~akv.launch.args.validate`) and the MPI flavour, then returns
    the plan of ``options.launcher``: :func:`plan_local`, :func:`plan_ssh`,
    :func:`plan_mpi` or :func:`plan_slurm`. Every plan lists the scheduler first, then the
    servers, then the workers, in start order; ranks (local, ssh) follow that order:
    servers 0..S-1, workers 0..W-1. With ``options.log_dir`` each spec's ``log_path`` is
    ``log_dir/`` + :func:`log_file_name`.

    Raises
    ------
    LaunchError
        For options :func:`~akv.launch.args.validate` rejects, an unknown MPI flavour, or
        hosts that do not suit the launcher.
    """
    validate(options)
    if context.mpi_flavour not in MPI_FLAVOURS:
        raise LaunchError(f"unknown MPI flavour {context.mpi_flavour!r}: use one of {MPI_FLAVOURS}")
    if options.nnodes is not None:
        return plan_node(options, context)
    return _PLANS[options.launcher](options, context)


def plan_local(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """Every process on this machine, each started directly with its whole environment.

    Servers advertise ``127.0.0.1``.
    """
    inherited = _inherited(context.environ)
    specs = [_scheduler_spec(options, context)]
    places = _places(options, context, [range(options.num_workers)], context.gpus)
    for role, argv, count in _roles(options, context):
        for rank in range(count):
            node_host = LOCAL_SCHEDULER_HOST if role == "server" else None
            extra = _worker_env(places[rank]) if role == "worker" else {}
            env = _job_env(options, context, role, rank, node_host, extra=extra)
            specs.append(
                ProcessSpec(
                    role,
                    rank,
                    argv,
                    {**inherited, **env},
                    env,
                    log_path=_log_path(options, role, rank),
                )
            )
    return specs


def plan_ssh(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """One ``ssh HOST bash -s`` per server and worker, placed by
    :func:`~akv.launch.hosts.assign_hosts` (servers first); the job's variables travel in
    the :func:`remote_script` on stdin, never on a command line or in ssh's environment.
    Servers advertise their host file name, or bind every interface and advertise the
    line's ``advertise=ADDR`` (:func:`_server_address`)."""
    inherited = _inherited(context.environ)
    specs = [_scheduler_spec(options, context)]
    hosts = assign_hosts(context.hosts, options.num_servers + options.num_workers)
    worker_hosts = [host.name for host in hosts[options.num_servers :]]
    # The workers by host: their local ranks; their GPUs are another machine's (unknown).
    groups = [
        [rank for rank, name in enumerate(worker_hosts) if name == host]
        for host in dict.fromkeys(worker_hosts)
    ]
    places = _places(options, context, groups, None, master=worker_hosts[0])
    placement = iter(hosts)
    for role, argv, count in _roles(options, context):
        for rank in range(count):
            host = next(placement)
            node_host, advertise = _server_address(host) if role == "server" else (None, None)
            extra = _worker_env(places[rank]) if role == "worker" else {}
            env = _job_env(options, context, role, rank, node_host, advertise, extra)
            specs.append(
                ProcessSpec(
                    role,
                    rank,
                    ssh_argv(host),
                    dict(inherited),
                    env,
                    stdin=remote_script(env, context.cwd, argv),
                    host=host.name,
                    log_path=_log_path(options, role, rank),
                )
            )
    return specs


def plan_mpi(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """One ``mpirun`` for the servers and one for the workers (:func:`mpirun_argv`).

    Ranks come from the MPI runtime; each server learns its node's name from ``hostname``.
    A host file with ``advertise=`` lines goes to ``mpirun`` as a host list (``-H``), which
    Open MPI reads without akv's options.
    """
    hostfile = os.path.join(context.cwd, options.hostfile) if options.hostfile else None
    if any(host.advertise for host in context.hosts):
        hostfile = None

    def mpirun(count: int, names: Sequence[str], argv: Sequence[str]) -> tuple[str, ...]:
        return mpirun_argv(context.mpi_flavour, count, names, argv, context.hosts, hostfile)

    return _group_plan(options, context, mpirun)


def plan_slurm(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """One ``srun`` step for the servers and one for the workers (:func:`srun_argv`).

    Ranks come from Slurm; each server learns its node's name from ``hostname``.
    """

    def srun(count: int, names: Sequence[str], argv: Sequence[str]) -> tuple[str, ...]:
        return srun_argv(count, names, argv, context.hosts)

    return _group_plan(options, context, srun)


def plan_node(options: LaunchOptions, context: JobContext) -> list[ProcessSpec]:
    """The per-node mode (``--nnodes``): this node's share of the job, every process on
    this machine, started directly as :func:`plan_local` starts them.

    Node 0 runs the scheduler (listening on ``--scheduler``'s port, every interface unless
    ``--scheduler-host``); each node runs a block of the server ranks and a block of the
    worker ranks (:func:`~akv.launch.hosts.node_share`). Servers bind and advertise
    ``--node-host``, else ``context.node_host``. Everyone reaches the scheduler at
    ``--scheduler``'s host; the workers' ``MASTER_ADDR`` is it too (node 0 runs worker 0).
    """
    node = options.node_rank or 0
    nodes = options.nnodes or 1
    node_host = options.node_host or context.node_host or LOCAL_SCHEDULER_HOST
    inherited = _inherited(context.environ)
    specs = [_scheduler_spec(options, context)] if node == 0 else []
    workers = node_share(options.num_workers, nodes, node)
    places = _places(
        options, context, [workers], context.gpus, master=per_node_scheduler(options)[0]
    )
    server_argv, worker_argv = (argv for _, argv, _ in _roles(options, context))
    for role, argv, ranks in (
        ("server", server_argv, node_share(options.num_servers, nodes, node)),
        ("worker", worker_argv, workers),
    ):
        for rank in ranks:
            if role == "server":
                env = _job_env(options, context, role, rank, node_host)
            else:
                env = _job_env(options, context, role, rank, extra=_worker_env(places[rank]))
            log_path = _log_path(options, role, rank)
            specs.append(
                ProcessSpec(role, rank, argv, {**inherited, **env}, env, log_path=log_path)
            )
    return specs


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker stands: its rank among the job's ``world_size`` workers, its rank
    and their number on its machine, its GPUs (``CUDA_VISIBLE_DEVICES``; ``None``: not
    set), and ``MASTER_ADDR:MASTER_PORT`` (see :func:`master_port`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    devices: str | None
    master_addr: str
    master_port: str


def master_port(scheduler_port: int | None) -> str:
    """The workers' ``MASTER_PORT``: the scheduler's port + 1 (- 1 for 65535), for
    ``torch.distributed``'s rendezvous on worker 0's machine, which must not be akv's
    scheduler; :data:`PORT_PLACEHOLDER` + 1 while the port is not known (``--dry-run``)."""
    if scheduler_port is None:
        return f"{PORT_PLACEHOLDER}+1"
    return str(scheduler_port + 1 if scheduler_port < 65535 else scheduler_port - 1)


def log_file_name(role: str, rank: int | None) -> str:
    """The ``--log-dir`` file of a process: ``scheduler.log``, ``server-0.log``,
    ``worker-1.log``; for a whole ``mpirun``/``srun`` group (``rank`` ``None``)
    ``servers.log`` or ``workers.log``."""
    if role == "scheduler":
        return "scheduler.log"
    if rank is None:
        return f"{role}s.log"
    return f"{role}-{rank}.log"


def new_token() -> str:
    """A fresh job token: ``secrets.token_hex(TOKEN_BYTES)``."""
    return secrets.token_hex(TOKEN_BYTES)


def job_token(environ: Mapping[str, str]) -> str:
    """The job's token: ``AKV_TOKEN`` from the launcher's environment, else :func:`new_token`.

    Raises :class:`LaunchError` if the inherited one is shorter than
    :data:`akv.limits.MIN_TOKEN_CHARS`.
    """
    token = environ.get("AKV_TOKEN")
    if not token:
        return new_token()
    if len(token) < MIN_TOKEN_CHARS:
        raise LaunchError(
            f"AKV_TOKEN in the launcher's environment has {len(token)} characters; the store "
            f"needs at least {MIN_TOKEN_CHARS}: unset it and akv-launch makes a fresh one"
        )
    return token


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
    """The exact commands of a plan as shell text, with ``token`` replaced by :data:`MASK`
    in every form the text holds it (as it is, and as quoted for the shell).

    A process that gets its variables through its environment is shown as
    ``env K=V ... CMD``; an ``ssh`` process as its command followed by the script it reads
    on stdin (as a here-document). A process with a log file says so in its header line.
    """
    blocks = []
    for spec in specs:
        where = f" on {spec.host}" if spec.host else ""
        count = f" ({spec.count} processes)" if spec.count > 1 else ""
        log = f", output also in {spec.log_path}" if spec.log_path else ""
        header = f"# {spec.label}{where}{count}{log}"
        if spec.stdin is not None:
            body = f"{shlex.join(spec.argv)} <<'AKV_SCRIPT'\n{spec.stdin}AKV_SCRIPT"
        else:
            assignments = [f"{name}={value}" for name, value in spec.job_env.items()]
            body = shlex.join(["env", *assignments, *spec.argv])
        blocks.append(f"{header}\n{body}")
    text = "\n".join(blocks)
    # shlex.quote leaves a token of safe characters as it is, else wraps it in '...' with
    # each ' written '"'"': that inner form is masked first (it holds the token's pieces).
    for form in (token.replace("'", "'\"'\"'"), token):
        text = text.replace(form, MASK)
    return text + "\n"


# ------------------------------------------------------------------ shared by the plans


def _group_plan(
    options: LaunchOptions,
    context: JobContext,
    group_argv: Callable[[int, Sequence[str], Sequence[str]], tuple[str, ...]],
) -> list[ProcessSpec]:
    """The scheduler, then one ``mpirun``/``srun`` per role: ``group_argv(count, names of
    the job's variables, argv)``."""
    if any(host.port is not None for host in context.hosts):
        raise LaunchError(
            f"hostfile {options.hostfile}: `host:port` is the ssh form; the "
            f"{options.launcher} launcher takes `host` or `host slots=N` lines"
        )
    inherited = _inherited(context.environ)
    specs = [_scheduler_spec(options, context)]
    for role, argv, count in _roles(options, context):
        # Each rank's RANK and LOCAL_RANK are the runtime's (OMPI_COMM_WORLD_RANK, ...).
        world = {"WORLD_SIZE": str(options.num_workers)} if role == "worker" else {}
        env = _job_env(options, context, role, extra=world)
        if role == "server":
            # Each server advertises its own host; only the node knows its name.
            argv = (*_server_host_wrapper(context.hosts), *argv)
        specs.append(
            ProcessSpec(
                role,
                None,
                group_argv(count, list(env), argv),
                {**inherited, **env},
                env,
                count=count,
                log_path=_log_path(options, role, None),
            )
        )
    return specs


_PLANS: dict[str, Callable[[LaunchOptions, JobContext], list[ProcessSpec]]] = {
    "local": plan_local,
    "ssh": plan_ssh,
    "mpi": plan_mpi,
    "slurm": plan_slurm,
}


def _server_address(host: Host) -> tuple[str, str | None]:
    """``(AKV_HOST, AKV_ADVERTISE)`` of a server on ``host``: its host file name and no
    advertised address, or with ``advertise=ADDR`` every interface (``0.0.0.0``, ``::``
    for an ``[IPv6]`` ADDR) and ADDR."""
    if host.advertise is None:
        return host.name, None
    wildcard = WILDCARD_HOST_IPV6 if host.advertise.startswith("[") else WILDCARD_HOST
    return wildcard, host.advertise


def _server_host_wrapper(hosts: Sequence[Host]) -> tuple[str, ...]:
    """The ``/bin/sh -c`` that starts an ``mpirun``/``srun`` server: ``AKV_HOST`` is the
    node's ``hostname``; on a node whose ``hostname`` is the name of a host file line with
    ``advertise=ADDR``, the server binds every interface and advertises ADDR instead."""
    advertised = [host for host in hosts if host.advertise is not None]
    if not advertised:
        return _SERVER_HOST_WRAPPER
    branches = []
    for host in advertised:
        bind, advertise = _server_address(host)
        branches.append(
            f"{shlex.quote(host.name)}) AKV_HOST={shlex.quote(bind)}; "
            f"{ADVERTISE_VARIABLE}={shlex.quote(str(advertise))}; export {ADVERTISE_VARIABLE};;"
        )
    script = (
        f'unset {ADVERTISE_VARIABLE}; AKV_HOST="$(hostname)"; case "$AKV_HOST" in '
        + " ".join(branches)
        + ' esac; DMLC_NODE_HOST="$AKV_HOST"; export AKV_HOST DMLC_NODE_HOST; exec "$@"'
    )
    return (*_SERVER_HOST_WRAPPER[:2], script, *_SERVER_HOST_WRAPPER[3:])


def _places(
    options: LaunchOptions,
    context: JobContext,
    machines: Sequence[Sequence[int]],
    gpus: Sequence[str] | None,
    master: str = LOCAL_SCHEDULER_HOST,
) -> dict[int, WorkerPlace]:
    """Each worker's :class:`WorkerPlace`, by rank: ``machines`` holds the worker ranks of
    each machine, in local-rank order; ``gpus`` that machine's devices (``None``: unknown),
    shared out by :func:`~akv.launch.devices.worker_devices` unless ``--env`` sets
    ``CUDA_VISIBLE_DEVICES`` for every worker."""
    places = {}
    for ranks in machines:
        if GPU_VARIABLE in options.env:
            devices: list[str | None] = [None] * len(ranks)
        else:
            devices = worker_devices(gpus, len(ranks), options.gpus_per_worker)
        for local_rank, rank in enumerate(ranks):
            places[rank] = WorkerPlace(
                rank,
                options.num_workers,
                local_rank,
                len(ranks),
                devices[local_rank],
                master,
                master_port(context.scheduler_port),
            )
    return places


def _worker_env(place: WorkerPlace) -> dict[str, str]:
    """The variables PyTorch programs read (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and the worker's GPUs."""
    env = {
        "RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": place.master_port,
    }
    if place.devices is not None:
        env[GPU_VARIABLE] = place.devices
    return env


def _scheduler_spec(options: LaunchOptions, context: JobContext) -> ProcessSpec:
    env = _job_env(options, context, "scheduler")
    fd = context.scheduler_fd
    env["AKV_SCHEDULER_FD"] = FD_PLACEHOLDER if fd is None else str(fd)
    return ProcessSpec(
        role="scheduler",
        rank=None,
        argv=options.scheduler_command or (context.python, "-m", "akv.cluster.scheduler"),
        env={**_inherited(context.environ), **env},
        job_env=env,
        pass_fds=() if fd is None else (fd,),
        log_path=_log_path(options, "scheduler", None),
    )


def _roles(options: LaunchOptions, context: JobContext) -> list[tuple[str, tuple[str, ...], int]]:
    """``(role, argv, count)`` of the servers, then the workers."""
    remote = options.launcher in REMOTE_LAUNCHERS
    python = options.python or (DEFAULT_REMOTE_PYTHON if remote else context.python)
    server_argv = options.server_command or (python, "-m", "akv.cluster.server")
    return [
        ("server", tuple(server_argv), options.num_servers),
        ("worker", tuple(options.command), options.num_workers),
    ]


def _job_env(
    options: LaunchOptions,
    context: JobContext,
    role: str,
    rank: int | None = None,
    node_host: str | None = None,
    advertise: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables akv-launch sets for one process (or group), under both names.

    The scheduler's ``AKV_SCHEDULER_HOST`` is where it listens; the others' is where they
    reach it (``--scheduler-advertise``, if given). Only servers get the checkpoint
    variables (``--checkpoint-dir`` made absolute against ``context.cwd``). ``extra``
    (a worker's :func:`_worker_env`) comes before ``--env``, which may override what it
    does not own (``MASTER_PORT``).
    """
    port = context.scheduler_port
    listen = scheduler_listen_host(options)
    values = {
        "AKV_ROLE": role,
        "AKV_SCHEDULER_HOST": listen if role == "scheduler" else scheduler_address(options),
        "AKV_SCHEDULER_PORT": PORT_PLACEHOLDER if port is None else str(port),
        "AKV_NUM_WORKERS": str(options.num_workers),
        "AKV_NUM_SERVERS": str(options.num_servers),
    }
    if node_host is not None:
        values["AKV_HOST"] = node_host
    env = {}
    for akv_name, mxnet_name in TWIN_VARIABLES:
        if akv_name in values:
            env[akv_name] = env[mxnet_name] = values[akv_name]
    if advertise is not None:
        env[ADVERTISE_VARIABLE] = advertise
    env["AKV_TOKEN"] = context.token
    if rank is not None:
        env["AKV_RANK"] = str(rank)
    if role == "server" and options.checkpoint_dir is not None:
        # Absolute, so that it names the same directory wherever the server's shell starts.
        env[CHECKPOINT_DIR_VARIABLE] = os.path.join(context.cwd, options.checkpoint_dir)
        if options.checkpoint_interval_s is not None:
            env[CHECKPOINT_INTERVAL_VARIABLE] = repr(options.checkpoint_interval_s)
    if options.log_level is not None:
        env["AKV_LOG_LEVEL"] = options.log_level
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    env.update(options.env)
    return env


def _inherited(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name not in OWNED_VARIABLES}


def _log_path(options: LaunchOptions, role: str, rank: int | None) -> str | None:
    if options.log_dir is None:
        return None
    return os.path.join(options.log_dir, log_file_name(role, rank))
