"""Whether the servers of a job starting from a checkpoint directory restored checkpoints
of one job (pure, no I/O).

Each server restores its own file (``server-<rank>.akvckpt``), and nothing else ties the
files together: after a failed job one may have been deleted or put back, or the directory
may hold files of two jobs. A job started from such a directory would read keys of
different points in time without a word. So each server tells the scheduler, when it
registers, what it restored (:class:`~akv.cluster.protocol.RestoredCheckpoint`), and when
the last server of the job registers the scheduler fails the job if they disagree
(:func:`disagreement`): some
restored a checkpoint and others none, or two were written by different jobs (a worker's
session, the process it ran in, differs between them). Files of one job at different
checkpoints (an older copy put back) are not told apart here: within a job, the workers'
notes do that (:mod:`akv.cluster.server.durability`).
"""

from __future__ import annotations

from collections.abc import Mapping

from akv.cluster.protocol import RestoredCheckpoint

__all__ = ["disagreement"]


def disagreement(servers: Mapping[int, RestoredCheckpoint]) -> str | None:
    """Why the servers' checkpoints (by server rank) are not of one job, or None: none
    restored one, or every one did and no worker has two sessions among them."""
    restored = {rank: c for rank, c in sorted(servers.items()) if c.checkpoint}
    if not restored:
        return None
    advice = ": start the job with another --checkpoint-dir, or put the checkpoints of one job back"
    first, checkpoint = next(iter(restored.items()))
    missing = [rank for rank in sorted(servers) if rank not in restored]
    if missing:
        rank = missing[0]
        return (
            f"the servers' checkpoints are not of one job: server {first} "
            f"{checkpoint.describe()}, but server {rank} {servers[rank].describe()}{advice}"
        )
    seen: dict[int, tuple[str, int]] = {}
    for rank, checkpoint in restored.items():
        for worker, session in sorted(checkpoint.sessions.items()):
            other = seen.setdefault(worker, (session, rank))
            if other[0] != session:
                return (
                    f"the servers' checkpoints are not of one job: server {other[1]} "
                    f"{restored[other[1]].describe()} and server {rank} "
                    f"{checkpoint.describe()}, written while worker {worker} was another "
                    f"process{advice}"
                )
    return None
