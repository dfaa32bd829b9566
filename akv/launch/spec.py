""":class:`ProcessSpec`: one process (or one ``mpirun``/``srun`` group) of a job, as data.

A plan (:func:`akv.launch.plans.plan`) is a list of them; the supervisor starts them and the
exit rules name them. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ACTOR_PYTHON", "ProcessSpec"]

#: In a command of ``--launcher ray``, stands for the Python of the Ray actor that starts it
#: (``sys.executable`` there): the scheduler and servers run with the Python that Ray runs
#: akv with, on every node.
ACTOR_PYTHON = "<ray-python>"


@dataclass(frozen=True)
class ProcessSpec:
    """One process (or, for ``mpi``/``slurm``, one ``mpirun``/``srun`` group) to start.

    Attributes
    ----------
    role
        ``"scheduler"``, ``"server"`` or ``"worker"``.
    rank
        The role rank this process gets (``AKV_RANK``), or ``None``: the scheduler has none,
        and an ``mpirun``/``srun`` group's processes take theirs from the MPI/Slurm rank.
    argv
        The exact command started on this machine (for ``ssh``: the ``ssh`` command).
    env
        The complete environment of the process started on this machine.
    job_env
        The variables akv-launch sets for this process (a subset of ``env``, or for ``ssh``
        the variables the remote script exports). What ``--dry-run`` shows.
    stdin
        Text written to the process's standard input, which then stays open until the job
        stops (the ``ssh`` launcher's remote script); ``None``: stdin is ``/dev/null``.
    host
        Where the process runs, for messages; ``None`` for this machine or a whole group.
    count
        How many processes this spec starts (``mpirun -n``, ``srun --ntasks``); 1 otherwise.
    pass_fds
        File descriptors the process inherits (the scheduler's listening socket).
    log_path
        The file that also gets this process's prefixed output lines (``--log-dir``), or
        ``None``.
    """

    role: str
    rank: int | None
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    job_env: Mapping[str, str] = field(repr=False)
    stdin: str | None = field(default=None, repr=False)
    host: str | None = None
    count: int = 1
    pass_fds: tuple[int, ...] = ()
    log_path: str | None = None

    @property
    def label(self) -> str:
        """How output lines and messages name this process: ``scheduler``, ``worker 0``,
        ``servers`` (a whole ``mpirun``/``srun`` group)."""
        if self.role == "scheduler":
            return "scheduler"
        if self.rank is None:
            return f"{self.role}s"
        return f"{self.role} {self.rank}"

    def describe(self, pid: int | None) -> str:
        """``worker 1 on node2 (pid 1234)``: the label, the host and the local PID."""
        where = f" on {self.host}" if self.host else ""
        started = f" (pid {pid})" if pid is not None else ""
        return f"{self.label}{where}{started}"
