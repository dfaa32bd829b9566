"""The job's scheduler (``akv-scheduler``, ``python -m akv.dist.scheduler``).

:class:`Roster` holds every decision (who is in the job, ranks, barriers, liveness, the
end); :class:`Scheduler` serves it over HTTP.
"""

from akv.dist.scheduler.roster import Roster
from akv.dist.scheduler.service import Scheduler, main

__all__ = ["Roster", "Scheduler", "main"]
