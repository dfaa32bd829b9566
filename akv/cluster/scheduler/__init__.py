"""The job's scheduler (``akv-scheduler``, ``python -m akv.cluster.scheduler``).

:class:`Roster` holds every decision (who is in the job, ranks, barriers, liveness, the
end); :class:`Scheduler` serves it over HTTP.
"""

from akv.cluster.scheduler.roster import Roster
from akv.cluster.scheduler.service import Scheduler, main

__all__ = ["Roster", "Scheduler", "main"]
