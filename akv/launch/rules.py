"""The job's exit rules: which exit ends the job, with which code (pure, no I/O).

:class:`ExitRules` is told "this process started", "this process exited with this status",
"the grace ran out", "the launcher got this signal", and answers each with a
:class:`Decision`: go on, start a failed server again, give the scheduler and servers their
grace, or stop the job with this exit code and this message.
:func:`akv.launch.supervisor.supervise` feeds it real events; tests drive it with a few
lines.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from akv.cluster.protocol import JOB_FAILED_EXIT
from akv.launch.limits import ENDED_GRACE_S, REPORT_GRACE_S
from akv.launch.spec import ProcessSpec

__all__ = ["Decision", "ExitRules", "exit_code_of", "scheduler_verdict", "status_text"]

#: What the scheduler logs when it fails the job (``akv.cluster.scheduler.service``).
_VERDICT = re.compile(r"\bjob failed: (.+)$")
#: The process a verdict opens with: ``worker 1 (pid ...``, ``server 0 at ...``.
_NAMED = re.compile(r"(scheduler|server|worker)(?: (\d+))?\b")


def scheduler_verdict(line: str) -> str | None:
    """The reason in a scheduler's "job failed: REASON" log line, else None.

    The scheduler is the one process that knows which process failed first (by role, rank,
    pid and host); the others only see the consequences (a server closing its streams once
    it learned the news, a worker's request failing). The launcher quotes it in its summary.
    """
    match = _VERDICT.search(line.rstrip("\n"))
    return match.group(1) if match else None


@dataclass(frozen=True)
class Decision:
    """What the supervisor does next.

    ``continue``: keep waiting. ``restart``: start process ``index`` (a server that failed)
    again from the same spec, then report it with :meth:`ExitRules.started`. ``drain``: every
    worker finished; start the grace period (``grace_s``) for the scheduler and servers.
    ``report``: the scheduler or a server failed; give the workers their report grace to say
    so and exit.
    ``stop``: end the job with ``exit_code``. ``message`` (may be empty) is printed by the
    launcher as ``akv-launch: <message>``.
    """

    action: Literal["continue", "restart", "drain", "report", "stop"]
    exit_code: int = 0
    message: str = ""
    #: The process to start again (``restart`` only).
    index: int | None = None
    #: ``drain`` only: how long the processes left get to stop (seconds; inf: no bound).
    grace_s: float = math.inf
    #: The exit decided on is the job's first failure: the launcher tells the scheduler
    #: (:meth:`ExitRules.exited` only).
    blames: bool = False


def exit_code_of(returncode: int) -> int:
    """The shell's exit code for a child's status: the code itself, or 128+N for signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def status_text(returncode: int) -> str:
    """``code 3`` or ``signal SIGKILL`` for a :attr:`subprocess.Popen.returncode`."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"signal {name}"


class ExitRules:
    """The job's exit rules, as a state machine with no I/O.

    * The first worker that fails (non-zero code or a signal), in the order the exits are
      reported, decides the exit code. The other workers get ``report_grace_s`` to hear of
      it (the scheduler tells them), say why and exit on their own; then the job stops.
    * A server that fails (non-zero code or a signal) while workers still run, and before the
      job failed, is started again (``restart``) while it has restarts left: up to
      ``max_restarts`` times per server. Only a server that is a process of its own (not an
      ``mpirun``/``srun`` group) is restarted; never a worker or the scheduler, never a
      server that exited 0 or with :data:`~akv.cluster.protocol.JOB_FAILED_EXIT` (it ended
      because the job failed: a restart cannot mend that), never once every worker finished.
    * A scheduler or server that fails while workers still run (a server with no restarts
      left) fails the job with its code; the decision is ``report``: the workers get
      ``report_grace_s`` to notice, name the failed process and exit on their own
      (:meth:`report_expired` then says to stop). One that exits 0 then is only reported (a
      worker may close its store and go on).
    * When every worker exited 0 the decision is ``drain``: the scheduler and servers get
      ``grace_s`` to stop on their own (:meth:`grace_expired` then says to stop with 0); one
      that fails meanwhile fails the job (it may have lost state it was saving).
    * Once the scheduler exited 0 (every worker and server had finished: the job ended
      well), a server's exit fails nothing and is not restarted: a server killed as it
      stopped, whose restart had no job left to register with, say. When every worker
      exited too (in either order) and a restarted server still runs, the drain's grace is
      :data:`ENDED_GRACE_S` (or ``grace_s``, if shorter): every server had said goodbye
      after its final checkpoint, so what still runs then only ends its own stop, or is a
      restart with no job left to register with.
    * A signal to the launcher (:meth:`interrupted`) stops the job with 128+N.

    Parameters
    ----------
    specs
        The job's processes, in start order; events name them by index.
    grace_s, report_grace_s
        The grace periods, only for messages (the supervisor keeps the clock).
    max_restarts
        How many times each server may be restarted (``--max-restarts``); 0: never.
    """

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        grace_s: float,
        report_grace_s: float = REPORT_GRACE_S,
        *,
        max_restarts: int = 0,
    ) -> None:
        self._specs = list(specs)
        self._grace_s = grace_s
        #: The grace of the drain under way (``grace_s``, or :data:`ENDED_GRACE_S`), and
        #: since when it counts.
        self._drain_s = grace_s
        self._drain_after = "every worker finished"
        self._report_grace_s = report_grace_s
        self._max_restarts = max_restarts
        self._failure: Decision | None = None
        self._running: set[int] = set()
        self._pids: dict[int, int] = {}
        self._restarts: dict[int, int] = {}
        self._draining = False
        self._failed_first: int | None = None
        #: The scheduler exited 0: every worker and server had finished (their data is final).
        self._ended_well = False

    @property
    def running(self) -> frozenset[int]:
        """Indices of the processes started and not yet reported as exited."""
        return frozenset(self._running)

    @property
    def restarts(self) -> Mapping[int, int]:
        """How many times each process (by index) was restarted; absent: never."""
        return dict(self._restarts)

    def culprit(self, verdict: str | None) -> int | None:
        """The process to blame once the job failed: the one the scheduler's ``verdict``
        names first (it knows who failed first: a worker that left with an exception may
        exit after another that it made fail), else the first process that failed here."""
        match = _NAMED.match(verdict or "")
        if match is not None:
            role, rank = match.group(1), match.group(2)
            for index, spec in enumerate(self._specs):
                if spec.role == role and (rank is None or spec.rank == int(rank)):
                    return index
        return self._failed_first

    def started(self, index: int, pid: int) -> None:
        """Record that process ``index`` runs as ``pid`` (again, after a ``restart``)."""
        self._running.add(index)
        self._pids[index] = pid

    def start_failed(self, index: int, error: OSError) -> Decision:
        """Process ``index`` could not be started: stop the job (127 if not found, else 126)."""
        code = 127 if isinstance(error, FileNotFoundError) else 126
        who = self._specs[index].describe(None)
        return Decision("stop", code, f"could not start {who}: {error}; stopping the job")

    def exited(self, index: int, returncode: int) -> Decision:
        """Process ``index`` exited with ``returncode`` (negative: killed by that signal);
        the decision ``blames`` it when its exit is the job's first failure."""
        blamed = self._failed_first
        decision = self._exited(index, returncode)
        if blamed is None and self._failed_first == index:
            return replace(decision, blames=True)
        return decision

    def _exited(self, index: int, returncode: int) -> Decision:
        self._running.discard(index)
        spec = self._specs[index]
        who = spec.describe(self._pids.get(index))
        status = status_text(returncode)
        failed = returncode != 0
        code = exit_code_of(returncode)
        workers_left = self._running_labels("worker")
        if self._failure is not None:  # the job failed already: the workers are winding down
            if workers_left:
                return Decision("continue", 0, f"{who} exited with {status}")
            return Decision(
                "stop", self._failure.exit_code, f"{who} exited with {status}; stopping the job"
            )
        if spec.role == "scheduler" and not failed:
            self._ended_well = True
            if self._draining:
                ended = self._restart_left_over(f"{who} exited with {status}")
                if ended is not None:
                    return ended
        elif spec.role == "server" and self._ended_well and failed:
            # (Killed as it stopped and restarted, say: it has no job to register with.)
            what = f"{who} exited with {status} after the job ended well"
            if self._draining and not self._running:
                return Decision("stop", 0, f"{what}; every process finished")
            return Decision("continue", 0, what)
        if spec.role == "worker":
            if failed:
                self._failed_first = index
                if not workers_left:
                    return Decision("stop", code, f"{who} exited with {status}; stopping the job")
                # The others are told by the scheduler and fail within seconds, each saying
                # why: they get the report grace to do so before they are stopped.
                return self._job_failed(index, code, f"{who} exited with {status}", workers_left)
            if workers_left:
                return Decision("continue", 0, f"{who} exited with {status}")
            return self._all_workers_done(f"{who} exited with {status}")
        if failed:
            if workers_left:
                if returncode == JOB_FAILED_EXIT and spec.role == "server":
                    exited = (
                        f"{who} exited with {status} (the job had failed, or its checkpoint "
                        "cannot be used: no restart mends it)"
                    )
                    return self._job_failed(index, code, exited, workers_left)
                if self._restartable(spec) and self._restarts.get(index, 0) < self._max_restarts:
                    self._restarts[index] = count = self._restarts.get(index, 0) + 1
                    return Decision(
                        "restart",
                        0,
                        f"{who} exited with {status}; restarting it from its checkpoint "
                        f"(restart {count} of {self._max_restarts})",
                        index,
                    )
                if self._restartable(spec) and self._max_restarts > 0:
                    status += f" (no restarts left: --max-restarts {self._max_restarts})"
                return self._job_failed(index, code, f"{who} exited with {status}", workers_left)
            return Decision("stop", code, f"{who} exited with {status} after every worker finished")
        if self._draining and not self._running:
            return Decision("stop", 0, f"{who} exited with {status}; every process finished")
        return Decision("continue", 0, f"{who} exited with {status}")

    def _job_failed(self, index: int, code: int, exited: str, workers_left: list[str]) -> Decision:
        """Process ``index`` failed the job with ``code`` while ``workers_left`` ran: they
        get the report grace to hear of it, say so and exit (``report``)."""
        what = f"{exited} while {_count(workers_left, 'worker')} still ran"
        self._failed_first = index
        self._failure = Decision("stop", code, what)
        return Decision(
            "report",
            code,
            f"{what}; the job failed: waiting up to {self._report_grace_s:g} s for the "
            "workers to report it and exit",
        )

    def grace_expired(self) -> Decision:
        """The grace after the last worker ran out: stop what is left, exit 0."""
        left = ", ".join(self._running_labels())
        return Decision(
            "stop",
            0,
            f"{left} still running {self._drain_s:g} s after {self._drain_after}; terminating",
        )

    def report_expired(self) -> Decision:
        """The workers' report grace ran out: stop the job with the failed process's code."""
        assert self._failure is not None, "report_expired without a failure"
        left = ", ".join(self._running_labels("worker"))
        return Decision(
            "stop",
            self._failure.exit_code,
            f"{left} still running {self._report_grace_s:g} s after {self._failure.message}; "
            "stopping the job",
        )

    def interrupted(self, signo: int) -> Decision:
        """The launcher got signal ``signo`` (Ctrl-C, SIGTERM): stop with 128+N."""
        name = signal.Signals(signo).name
        return Decision("stop", 128 + signo, f"interrupted by {name}; stopping the job")

    def _restart_left_over(self, what: str) -> Decision | None:
        """Once every worker exited and the scheduler exited 0 (every server had said
        goodbye, after its final checkpoint), a restarted server that still runs either ends
        its own stop within moments or has no job to register with (restarted as the job
        ended): the drain's grace is :data:`ENDED_GRACE_S` (None when no restart runs)."""
        restarted = [self._specs[i].label for i in sorted(self._running) if i in self._restarts]
        if not (self._ended_well and restarted):
            return None
        self._draining = True
        self._drain_s = min(self._grace_s, ENDED_GRACE_S)
        self._drain_after = "the job ended well"
        left = ", ".join(self._running_labels())
        return Decision(
            "drain",
            0,
            f"{what}: the job ended well; waiting up to {self._drain_s:g} s for {left} to stop",
            grace_s=self._drain_s,
        )

    def _all_workers_done(self, what: str) -> Decision:
        if not self._running:
            return Decision("stop", 0, f"{what}; every process finished")
        ended = self._restart_left_over(what)
        if ended is not None:
            return ended
        self._draining = True
        left = ", ".join(self._running_labels())
        if math.isinf(self._grace_s):  # the per-node mode: the job may go on elsewhere
            done = f"every worker of this node finished: waiting for {left} to stop"
            done += " (they stop when the whole job ended)"
        else:
            done = f"every worker finished: waiting up to {self._grace_s:g} s for {left} to stop"
        return Decision("drain", 0, f"{what}; {done}", grace_s=self._grace_s)

    @staticmethod
    def _restartable(spec: ProcessSpec) -> bool:
        """A server that is one process (an ``mpirun``/``srun`` group cannot restart one)."""
        return spec.role == "server" and spec.count == 1

    def _running_labels(self, role: str | None = None) -> list[str]:
        return [
            self._specs[i].label
            for i in sorted(self._running)
            if role is None or self._specs[i].role == role
        ]


def _count(labels: list[str], noun: str) -> str:
    return f"1 {noun}" if len(labels) == 1 else f"{len(labels)} {noun}s"
