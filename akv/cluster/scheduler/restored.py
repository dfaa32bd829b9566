"""Whether the servers of a job starting from a checkpoint directory restored checkpoints
of one job (pure, no I/O).

Each server restores its own file (``server-<rank>.akvckpt``), and nothing else ties the
files together: the directory may hold files of two jobs (one copied in from another
run's). A job started from them would read keys of different jobs without a word. So each
server tells the scheduler, when it registers, what it restored
(:class:`~akv.cluster.protocol.RestoredCheckpoint`), and when the last server of the job
registers the scheduler fails the job if two were written by different jobs (a worker's
session, the process it ran in, differs between them): :func:`disagreement`.

A server without a file is no disagreement: a server that never held a key writes none,
so a missing file cannot be told from a deleted one here. A directory whose checkpoint a
running job found lost is marked instead (``server-<rank>.lost``, see
:mod:`akv.cluster.server.checkpointing`), and no server restores from it. Files of one job
at different checkpoints are not told apart here either.
"""

from __future__ import annotations

from collections.abc import Mapping

from akv.cluster.protocol import RestoredCheckpoint

__all__ = ["disagreement"]


def disagreement(servers: Mapping[int, RestoredCheckpoint]) -> str | None:
    """Why the servers' checkpoints (by server rank) are not of one job, or None: no worker
    has two sessions among the checkpoints they restored."""
    restored = {rank: c for rank, c in sorted(servers.items()) if c.checkpoint}
    seen: dict[int, tuple[str, int]] = {}
    for rank, checkpoint in restored.items():
        for worker, session in sorted(checkpoint.sessions.items()):
            other = seen.setdefault(worker, (session, rank))
            if other[0] != session:
                return (
                    f"the servers' checkpoints are not of one job: server {other[1]} "
                    f"{restored[other[1]].describe()} and server {rank} "
                    f"{checkpoint.describe()}, written while worker {worker} was another "
                    "process: start the job with another --checkpoint-dir, or put the "
                    "checkpoints of one job back"
                )
    return None
