"""Run an akv job on a Ray cluster: :func:`launch` for a function, ``akv-launch --launcher
ray`` for a command (:func:`launch_command`).

The scheduler and the servers run as Ray actors, in one placement group that spreads the
servers over the nodes; each worker is an actor too. Every process gets the variables
``akv-launch`` gives it (:func:`akv.launch.plans.plan_local`'s), the job's token among them:
it travels in the actors' arguments and their processes' environment, never on a command
line. See ``docs/ray.md``.

This is the one part of akv that imports Ray (the ``ray`` extra); ``import akv`` does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO

try:
    import ray
except ImportError as exc:  # pragma: no cover - exercised where Ray is missing
    raise ImportError(
        "akv.ray needs Ray: install the ray extra (pip install 'akvstore[ray]')"
    ) from exc

from akv.launch.args import LaunchOptions, validate
from akv.launch.limits import DEFAULT_GRACE_S, TERMINATE_GRACE_S
from akv.ray.job import DEFAULT_SERVER_RESOURCES, DEFAULT_WORKER_RESOURCES, RayJob

__all__ = ["DEFAULT_SERVER_RESOURCES", "DEFAULT_WORKER_RESOURCES", "launch", "launch_command"]


def launch(
    fn: Callable[..., Any],
    *,
    num_workers: int,
    num_servers: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_interval_s: float | None = None,
    max_restarts: int = 0,
    resources_per_worker: Mapping[str, float] | None = None,
    resources_per_server: Mapping[str, float] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_workers`` workers of an akv job on Ray, and
    return what each returned, in rank order.

    Connects to Ray first if this process is not connected (``ray.init()``: ``RAY_ADDRESS``,
    else a local instance). Each worker is an actor whose process has the job's variables
    (``AKV_*``/``DMLC_*``, the token, its rank) when ``fn`` runs, so ``akv.create("dist_sync")``
    in ``fn`` joins the job. ``env`` adds variables for every process (not those akv sets).

    With ``checkpoint_dir`` (a path on each server's node) the servers write checkpoints
    there (every ``checkpoint_interval_s``); with ``max_restarts`` > 0 (which needs it) a
    server whose process or actor dies is started again by Ray, up to that many times, in
    its bundle of the placement group, and restores its checkpoint: the job goes on.

    ``resources_per_worker`` and ``resources_per_server`` are Ray resources (``CPU``,
    ``GPU``, ``memory``, custom ones; default :data:`DEFAULT_WORKER_RESOURCES` and
    :data:`DEFAULT_SERVER_RESOURCES`). Once every worker returned, the scheduler and the
    servers get ``grace_s`` to stop on their own.

    Whatever happens, every actor of the job is killed and its placement group removed
    before this returns or raises.

    Raises
    ------
    JobFailedError
        The job failed. A worker's exception: ``rank`` is its rank and
        ``remote_traceback`` its traceback (also in the message); a server or the
        scheduler that failed: its ``role`` and ``rank``, and the scheduler's verdict in
        the message.
    LaunchError
        Bad arguments (as ``akv-launch`` says them), or a cluster that cannot hold the job.
    """
    options = LaunchOptions(
        num_workers=num_workers,
        num_servers=num_servers,
        command=(getattr(fn, "__qualname__", repr(fn)),),
        launcher="ray",
        env=dict(env or {}),
        grace_s=grace_s,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval_s=checkpoint_interval_s,
        max_restarts=max_restarts,
    )
    validate(options)
    if not ray.is_initialized():
        ray.init()
    job = RayJob(
        options,
        os.environ,
        fn=fn,
        args=args,
        kwargs=kwargs,
        resources_per_worker=resources_per_worker,
        resources_per_server=resources_per_server,
        name="akv.ray",
    )
    outcome = job.run()
    if outcome.failure is not None:
        raise outcome.failure
    return [outcome.results[rank] for rank in range(num_workers)]


def launch_command(
    options: LaunchOptions,
    environ: Mapping[str, str],
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    terminate_grace_s: float = TERMINATE_GRACE_S,
) -> int:
    """``akv-launch --launcher ray``: run ``options.command`` on every worker, each in an
    actor, and return the launcher's exit code (as :func:`akv.launch.launch`: 0, the first
    failing worker's code, a failing server's or the scheduler's, 130 on Ctrl-C).

    Connects to ``options.ray_address`` (or ``RAY_ADDRESS``, else a local instance) unless
    this process is connected already, and disconnects at the end if it connected.
    """
    validate(options)
    connected = ray.is_initialized()
    if not connected:
        ray.init(address=options.ray_address)
    try:
        job = RayJob(
            options, environ, stdout=stdout, stderr=stderr, terminate_grace_s=terminate_grace_s
        )
        try:
            return job.run().exit_code
        except KeyboardInterrupt:
            return 130
    finally:
        if not connected:
            ray.shutdown()
