"""What the scheduler's ``/metrics`` says of its roster (see ``docs/metrics.md``): a plain
mapping from the :class:`~akv.cluster.scheduler.roster.Roster` to metric families, read
at each scrape. No I/O."""

from __future__ import annotations

from akv.cluster.metrics import Families
from akv.cluster.scheduler.roster import MEMBER_ROLES, Roster

__all__ = ["roster_figures"]


def roster_figures(families: Families, roster: Roster) -> None:
    """The job as the roster sees it: nodes by role and state, the job's size, whether it
    assembled or failed, and each server rank's restarts."""
    statistics = roster.statistics()
    for role in MEMBER_ROLES:
        nodes = [n for n in statistics.nodes if n.role == role]
        counts = {
            "alive": sum(not n.finished and not n.dead for n in nodes),
            "finished": sum(n.finished for n in nodes),
            "dead": sum(n.dead and not n.finished for n in nodes),
        }
        for state, value in counts.items():
            families.gauge(
                "akv_nodes",
                "Registered workers and servers, by role and state: alive (heartbeating), "
                "finished (closed or stopped cleanly), dead (silent or reported lost).",
                value,
                node_role=role,
                state=state,
            )
    for role, size in (("worker", roster.num_workers), ("server", roster.num_servers)):
        families.gauge("akv_nodes_expected", "The job's size, by role.", size, node_role=role)
    families.gauge(
        "akv_job_assembled",
        "1 once every worker and server registered, else 0.",
        int(statistics.complete),
    )
    families.gauge(
        "akv_job_failed", "1 once the job failed, else 0.", int(statistics.failure is not None)
    )
    for rank in range(roster.num_servers):
        families.counter(
            "akv_restarts_total",
            "Times a process took a server rank over from its checkpoint (a restart).",
            roster.restarts.get(rank, 0),
            node_role="server",
            node_rank=str(rank),
        )
