"""``akv-server``: run one parameter server of a job until the job ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from akv.cluster.config import Config
from akv.cluster.protocol import JOB_FAILED_EXIT
from akv.cluster.roles import run_role
from akv.cluster.server.checkpointing import UnusableCheckpointError
from akv.cluster.server.service import ParameterServer
from akv.errors import AKVError

__all__ = ["main", "run_server"]

log = logging.getLogger("akv.cluster.server")


async def run_server(config: Config) -> int:
    """Run one server until the job ends; return the exit status."""
    server = ParameterServer(config)
    try:
        await server.start()
    except AKVError as exc:
        unusable = isinstance(exc, UnusableCheckpointError)
        log.error("%s%s", exc, "; no restart mends it" if unusable else "")
        if unusable:  # the job's verdict names the file, not only the exit
            await server.membership.report_failed(f"could not use its checkpoint: {exc}")
        await server.stop()
        return JOB_FAILED_EXIT if unusable else 1  # akv-launch restarts no server exiting 3
    except asyncio.CancelledError:  # SIGTERM while starting: close what was opened
        await server.stop()
        raise
    return await server.run()


def main(argv: Sequence[str] | None = None) -> int:
    """``akv-server``: run one parameter server; exit 0 when the job ended well, 3
    (:data:`JOB_FAILED_EXIT`) when it failed, 2 when its configuration is wrong."""
    return run_role("server", argv, "Run one parameter server of an akv job.", run_server)
