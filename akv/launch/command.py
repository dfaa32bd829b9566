"""``akv-launch``'s two entry points: :func:`main` (the command) and :func:`launch`.

Thin I/O around the pure parts: :func:`launch` reads the host file, looks for ``ssh``,
``mpirun`` or ``srun`` on ``PATH`` (and asks ``mpirun`` which MPI it is), creates
``--log-dir``, binds the scheduler's socket, and hands the plan
(:func:`akv.launch.plans.plan`) to :func:`akv.launch.supervisor.supervise`. See
``docs/launcher.md`` for the user's view and how this differs from MXNet's
``tools/launch.py``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import BinaryIO

from akv.errors import LaunchError
from akv.launch.args import (
    LaunchOptions,
    parse_args,
    per_node_scheduler,
    scheduler_listen_host,
    validate,
)
from akv.launch.devices import visible_devices
from akv.launch.hosts import load_hostfile
from akv.launch.limits import (
    MPI_VERSION_TIMEOUT_S,
    NVIDIA_SMI_TIMEOUT_S,
    TERMINATE_GRACE_S,
)
from akv.launch.plans import (
    LAUNCHER_TOOLS,
    JobContext,
    format_dry_run,
    job_token,
    mpi_flavour_from_version,
    plan,
)
from akv.launch.supervisor import supervise
from akv.launch.watch import assembly_watch, client_config, failure_reporter

__all__ = ["EXIT_USAGE", "launch", "main"]

#: Exit code of :func:`main` for a bad command line, host file or environment.
EXIT_USAGE = 2
#: Exit code of :func:`main` for Ctrl-C before the supervisor took over (128 + SIGINT).
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """The ``akv-launch`` command; returns its exit code.

    0: every worker exited 0 (or ``--help``, ``--version``, ``--dry-run``). A worker's code
    (128+N for signal N): the first worker that failed. The scheduler's or a server's code:
    it failed while the job ran. 130/143: interrupted by SIGINT/SIGTERM. 2: a bad command
    line, host file or environment (nothing was started). 126/127: a process could not be
    started.
    """
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        return launch(options)
    except LaunchError as exc:
        print(f"akv-launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before the supervisor took over: nothing runs yet
        return EXIT_INTERRUPTED


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
    those of :func:`akv.launch.supervisor.supervise`.

    Raises
    ------
    LaunchError
        Before anything starts: a bad host file, a missing ``ssh``/``mpirun``/``srun``, a
        short ``AKV_TOKEN``, a ``--log-dir`` that cannot be created or written, an address
        the scheduler cannot listen on.
    """
    environ = dict(os.environ if environ is None else environ)
    validate(options)
    out = stdout if stdout is not None else sys.stdout.buffer
    if options.launcher == "ray":  # Ray places the processes: akv.ray runs the job
        from akv.launch.ray_hook import launch_with_ray

        return launch_with_ray(
            options, environ, stdout=out, stderr=stderr, terminate_grace_s=terminate_grace_s
        )
    hosts = load_hostfile(options.hostfile) if options.hostfile else []
    if options.nnodes is not None and not environ.get("AKV_TOKEN"):
        raise LaunchError(
            "--nnodes: every node's akv-launch needs the same AKV_TOKEN: generate one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'` and export it as "
            "AKV_TOKEN on every node"
        )
    token = job_token(environ)
    tool = LAUNCHER_TOOLS.get(options.launcher)
    found = tool is not None and shutil.which(tool, path=environ.get("PATH")) is not None
    if tool is not None and not found and not options.dry_run:
        raise LaunchError(f"--launcher {options.launcher} runs `{tool}`, which is not on PATH")
    flavour = "openmpi"
    if options.launcher == "mpi" and found:
        flavour = _detect_mpi_flavour(environ)
    local = options.launcher == "local"
    context = JobContext(
        environ=environ,
        token=token,
        cwd=os.getcwd(),
        python=sys.executable,
        hosts=hosts,
        mpi_flavour=flavour,
        gpus=visible_devices(environ, _nvidia_smi(environ)) if local else None,
        node_host=_node_host(options) if options.nnodes is not None else None,
    )
    if options.nnodes is not None:
        context = replace(context, scheduler_port=per_node_scheduler(options)[1])
    if options.dry_run:
        note = f"# `{tool}` is not on PATH here\n" if tool is not None and not found else ""
        out.write((note + format_dry_run(plan(options, context), token)).encode())
        out.flush()
        return 0
    listeners = []
    if options.nnodes is None or not options.node_rank:  # this node runs the scheduler
        port = context.scheduler_port or 0
        listener = _listen(scheduler_listen_host(options), port, options)
        listeners.append(listener)
        context = replace(
            context, scheduler_port=listener.getsockname()[1], scheduler_fd=listener.fileno()
        )
    try:
        specs = plan(options, context)
        if options.log_dir is not None:
            _make_log_dir(options.log_dir)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    config = client_config(specs)
    return supervise(
        specs,
        grace_s=options.grace_s,
        max_restarts=options.max_restarts,
        terminate_grace_s=terminate_grace_s,
        stdout=out,
        stderr=stderr,
        inherited=listeners,
        report_failure=failure_reporter(config),
        watch=assembly_watch(config, options, environ),
    )


def _make_log_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"--log-dir {path} cannot be created: {exc}") from exc


def _listen(host: str, port: int, options: LaunchOptions) -> socket.socket:
    """The scheduler's listening socket on ``host`` and ``port`` (0: any free one)."""
    peers = options.num_workers + options.num_servers
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise LaunchError(
            f"cannot resolve --scheduler-host {host!r}: {exc}; pass an address of this "
            "machine that the other hosts can reach"
        ) from exc
    try:
        if port:  # the per-node mode's fixed port: a job just ended may leave TIME_WAITs
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(socket.SOMAXCONN, peers))
    except OSError as exc:
        listener.close()
        if port:
            raise LaunchError(
                f"the scheduler cannot listen on port {port} of this node ({host}): {exc}; "
                "choose another port in --scheduler (or --master-port), the same on every node"
            ) from exc
        raise LaunchError(
            f"the scheduler cannot listen on {host!r}: {exc}; --scheduler-host must be an "
            "address of this machine that the other hosts can reach"
        ) from exc
    return listener


def _node_host(options: LaunchOptions) -> str:
    """This machine's address that the other nodes reach, by default: the one it reaches
    the scheduler from (a UDP socket's source address after ``connect``, which sends
    nothing); ``127.0.0.1`` when that cannot be found."""
    host, port = per_node_scheduler(options)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _nvidia_smi(environ: Mapping[str, str]) -> str | None:
    """What ``nvidia-smi -L`` prints (the GPUs of this machine), or None without it."""
    if "CUDA_VISIBLE_DEVICES" in environ or not shutil.which(
        "nvidia-smi", path=environ.get("PATH")
    ):
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            env=dict(environ),
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


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
