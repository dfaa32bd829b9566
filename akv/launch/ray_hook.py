"""``akv-launch --launcher ray``: hand the job to :mod:`akv.ray`, importing Ray only then.

``--dry-run`` needs no Ray: it prints each actor's command and variables from the plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import BinaryIO

from akv.errors import LaunchError
from akv.launch.args import LaunchOptions
from akv.launch.plans import JobContext, format_dry_run, job_token, plan_local
from akv.launch.spec import ACTOR_PYTHON

__all__ = ["launch_with_ray"]


def launch_with_ray(
    options: LaunchOptions,
    environ: Mapping[str, str],
    *,
    stdout: BinaryIO,
    stderr: BinaryIO | None,
    terminate_grace_s: float,
) -> int:
    """Run the job on Ray (:func:`akv.ray.launch_command`), or print it (``--dry-run``);
    the launcher's exit code.

    Raises :class:`LaunchError` when Ray is not installed, saying which extra to install.
    """
    if options.dry_run:
        context = JobContext(
            environ={}, token=job_token(environ), cwd=os.getcwd(), python=ACTOR_PYTHON
        )
        note = (
            "# --launcher ray: each process runs in a Ray actor, the scheduler and the servers "
            f"in one placement group (SPREAD); {ACTOR_PYTHON} is the actor's Python\n"
        )
        text = note + format_dry_run(plan_local(options, context), context.token)
        stdout.write(text.encode())
        stdout.flush()
        return 0
    try:
        from akv.ray import launch_command
    except ImportError as exc:
        raise LaunchError(
            f"--launcher ray needs Ray ({exc.__cause__ or exc}): install the ray extra "
            "(pip install 'akvstore[ray]')"
        ) from exc
    return launch_command(
        options, environ, stdout=stdout, stderr=stderr, terminate_grace_s=terminate_grace_s
    )
