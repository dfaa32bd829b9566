"""The driver's side of a job on Ray: place the actors, follow them, stop them all.

:class:`RayJob` plays the part of :func:`akv.launch.supervisor.supervise` with Ray actors in
place of local processes. The plan (who gets which variables) is
:func:`akv.launch.plans.plan_local`'s, and what each exit means is decided by the same
:class:`~akv.launch.rules.ExitRules`: the first failing worker fails the job, a server that
dies is restarted while it has restarts left, once every worker finished the scheduler and
servers get their grace. A restart is Ray's: the server's actor has ``max_restarts``, and a
server whose process died ends its actor (:meth:`~akv.ray.actors.ProcessActor.die`), which
Ray starts again in the same placement group bundle, from the same arguments.

Placement: one placement group, strategy ``SPREAD``, holds the scheduler's bundle and one
bundle per server, so servers land on different nodes where the cluster has them (and all on
one node where it has one). Workers are placed by Ray's default scheduling, with
``resources_per_worker``. On a one-node cluster every process uses ``127.0.0.1``, as
``akv-launch`` does locally; on several nodes each one uses its node's address.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, TextIO

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from akv.cluster.config import TWIN_VARIABLES
from akv.errors import JobFailedError, LaunchError
from akv.launch.args import LOCAL_SCHEDULER_HOST, LaunchOptions
from akv.launch.limits import REPORT_GRACE_S, TERMINATE_GRACE_S
from akv.launch.plans import JobContext, job_token, plan_local
from akv.launch.report import Ledger, Tracebacks
from akv.launch.rules import Decision, ExitRules, scheduler_verdict, status_text
from akv.launch.spec import ACTOR_PYTHON, ProcessSpec
from akv.launch.supervisor import LOG_FILE_MODE
from akv.launch.watch import AssemblyWatch, assembly_watch, client_config, failure_reporter
from akv.ray.actors import FunctionWorker, Poll, ProcessActor, WorkerResult

__all__ = [
    "DEFAULT_SERVER_RESOURCES",
    "DEFAULT_WORKER_RESOURCES",
    "SCHEDULER_RESOURCES",
    "Outcome",
    "RayJob",
]

#: What each worker and each server reserves unless told otherwise (Ray resources).
DEFAULT_WORKER_RESOURCES: Mapping[str, float] = {"CPU": 1.0}
DEFAULT_SERVER_RESOURCES: Mapping[str, float] = {"CPU": 1.0}
#: The scheduler's bundle: a sliver of a CPU (a bundle may not be empty).
SCHEDULER_RESOURCES: Mapping[str, float] = {"CPU": 0.01}
#: How long the cluster may take to reserve the placement group (seconds).
PLACEMENT_TIMEOUT_S = 120.0
#: How long every actor may take to start and answer its first call (seconds).
START_TIMEOUT_S = 120.0
#: How often the driver asks each process actor for its output and status (seconds).
POLL_S = 0.1
#: Beyond the terminate grace, how long the actors' stop calls may take (seconds).
STOP_MARGIN_S = 5.0
#: How long the actors may take to be gone from the cluster after ``ray.kill`` (seconds).
GONE_TIMEOUT_S = 15.0


@dataclass
class _Member:
    """The driver's view of one actor of the job."""

    index: int
    spec: ProcessSpec
    actor: Any
    #: A worker of :func:`akv.ray.launch` (a :class:`FunctionWorker`), else a
    #: :class:`ProcessActor`.
    function: bool
    #: The call in flight: a poll, or a function worker's run.
    call: Any = None
    pid: int | None = None
    #: The exit of the current pid was reported to the rules.
    reported: bool = False
    #: The actor died (its restart, if any, is Ray's).
    unavailable: bool = False
    #: The actor is dead for good: nothing is asked of it any more.
    dead: bool = False
    last_poll: float = 0.0
    result: WorkerResult | None = None
    #: The rules restarted it and its new process has not answered yet.
    awaiting_restart: bool = False
    #: Why its process could not be started, and whether the program was not found.
    start_error: tuple[str, bool] | None = None


@dataclass
class Outcome:
    """How a job ended: the exit code (:class:`ExitRules`'), the last message, the
    function workers' results by rank, and the error to raise for a failed job."""

    exit_code: int
    message: str
    results: dict[int, Any] = field(default_factory=dict)
    failure: JobFailedError | None = None


class RayJob:
    """One job on the connected Ray cluster; :meth:`run` runs it to its end.

    With ``fn`` the workers are :class:`FunctionWorker` actors calling
    ``fn(*args, **kwargs)``; without, :class:`ProcessActor` actors running
    ``options.command``. Lines of the processes go to ``stdout``/``stderr`` prefixed
    ``[label] `` (and to ``--log-dir`` files); the driver's own messages are
    ``{name}: ...`` lines on ``stderr``.
    """

    def __init__(
        self,
        options: LaunchOptions,
        environ: Mapping[str, str],
        *,
        fn: Callable[..., Any] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        resources_per_server: Mapping[str, float] | None = None,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        terminate_grace_s: float = TERMINATE_GRACE_S,
        name: str = "akv-launch",
    ) -> None:
        self._options = options
        self._environ = environ
        self._token = job_token(environ)
        self._fn = fn
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._worker_resources = dict(resources_per_worker or DEFAULT_WORKER_RESOURCES)
        self._server_resources = dict(resources_per_server or DEFAULT_SERVER_RESOURCES)
        self._stdout = _writer(stdout, lambda: sys.stdout)
        self._stderr = _writer(stderr, lambda: sys.stderr)
        self._terminate_grace_s = terminate_grace_s
        self._name = name
        self._job_id = secrets.token_hex(4)
        self._members: list[_Member] = []
        self._exits: collections.deque[tuple[int, int]] = collections.deque()
        self._verdict: str | None = None
        self._start_failed: int | None = None
        self._logs: dict[int, BinaryIO] = {}
        self._group: Any = None
        # What the closing table and the culprit's traceback need, as the supervisor keeps.
        self._ledger = Ledger()
        self._tracebacks = Tracebacks()
        self._rules: ExitRules | None = None
        self._watch: AssemblyWatch | None = None
        self._report_failure: Callable[[ProcessSpec, str], None] | None = None
        # The watch's thread says its lines beside the driver's.
        self._write_lock = threading.Lock()

    @property
    def actor_names(self) -> list[str]:
        """The names of the job's actors (``akv-<job>-scheduler``, ``-server-0``, ...)."""
        return [self._actor_name(member.spec) for member in self._members]

    def run(self) -> Outcome:
        """Start every actor, follow the job to its end, then stop and kill every actor and
        remove the placement group (also on an error or Ctrl-C, which is raised again).

        Raises :class:`LaunchError` when the cluster cannot hold the job (the placement
        group or an actor not placed within their timeouts)."""
        decision: Decision | None = None
        try:
            rules = self._start()
            decision = self._follow(rules)
            return self._outcome(rules, decision)
        finally:
            if self._watch is not None:
                self._watch.stop()
            self._stop_all()
            self._say_summary()
            if decision is not None and decision.exit_code != 0 and self._rules is not None:
                self._say_failure(self._rules)
            self._close_logs()

    # ---- starting

    def _start(self) -> ExitRules:
        options = self._options
        bundles = [dict(SCHEDULER_RESOURCES)] + [
            dict(self._server_resources) for _ in range(options.num_servers)
        ]
        self._group = placement_group(bundles, strategy="SPREAD")
        if not self._group.wait(PLACEMENT_TIMEOUT_S):
            raise LaunchError(
                f"the Ray cluster did not reserve {bundles} (the scheduler, then one bundle "
                f"per server) within {PLACEMENT_TIMEOUT_S:g} s; it has "
                f"{_RAY.available_resources()} available: give the servers fewer resources "
                "or add nodes"
            )
        one_node = sum(1 for node in _RAY.nodes() if node.get("Alive")) == 1
        host = LOCAL_SCHEDULER_HOST if one_node else ""
        skeleton = self._plan(0, 0)[0]
        scheduler = self._process_actor(skeleton, 0, None)
        self._members.append(_Member(0, skeleton, scheduler, False))
        try:
            where, port, fd = ray.get(scheduler.listen.remote(host), timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            raise LaunchError(
                f"the scheduler's actor did not start within {START_TIMEOUT_S:g} s"
            ) from None
        except RayError as exc:
            raise LaunchError(
                f"the scheduler cannot listen on {host or 'its node'}: {exc}"
            ) from exc
        specs = [_with_scheduler(spec, where) for spec in self._plan(port, fd)]
        self._members[0].spec = specs[0]
        scheduler.start.remote(dict(specs[0].job_env))
        servers = [spec for spec in specs if spec.role == "server"]
        for spec in servers:
            actor = self._process_actor(spec, 1 + (spec.rank or 0), host)
            self._members.append(_Member(len(self._members), spec, actor, False))
        for spec in specs[1 + len(servers) :]:
            self._members.append(self._worker(len(self._members), spec))
        self._open_logs()
        rules = self._rules = ExitRules(
            [m.spec for m in self._members],
            options.grace_s,
            max_restarts=options.max_restarts,
        )
        self._first_answers(rules)
        config = client_config(specs)
        launcher = "akv-launch" if self._fn is None else "akv.ray.launch"
        self._report_failure = failure_reporter(config, launcher)
        self._watch = assembly_watch(config, options, self._environ, launcher=launcher)
        if self._watch is not None:
            self._watch.start(self._say)
        return rules

    def _plan(self, port: int, fd: int) -> list[ProcessSpec]:
        context = JobContext(
            environ={},
            token=self._token,
            cwd=os.getcwd(),
            python=ACTOR_PYTHON,
            scheduler_port=port,
            scheduler_fd=fd,
        )
        return plan_local(replace(self._options, launcher="local"), context)

    def _actor_name(self, spec: ProcessSpec) -> str:
        rank = "" if spec.rank is None else f"-{spec.rank}"
        return f"akv-{self._job_id}-{spec.role}{rank}"

    def _process_actor(self, spec: ProcessSpec, bundle: int, node_host: str | None) -> Any:
        """The actor of the scheduler (it listens first, then starts) or of a server
        (``node_host``: its address, ``""`` for its node's), in its bundle of the placement
        group."""
        resources = SCHEDULER_RESOURCES if spec.role == "scheduler" else self._server_resources
        actor_class = _PROCESS_ACTOR.options(
            name=self._actor_name(spec),
            max_restarts=self._options.max_restarts if spec.role == "server" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, bundle),
            **_actor_resources(resources),
        )
        if spec.role == "scheduler":
            return actor_class.remote(spec.argv, None, os.getcwd(), cwd_required=False)
        return actor_class.remote(
            spec.argv, dict(spec.job_env), os.getcwd(), cwd_required=False, node_host=node_host
        )

    def _worker(self, index: int, spec: ProcessSpec) -> _Member:
        options = {"name": self._actor_name(spec), **_actor_resources(self._worker_resources)}
        if self._fn is None:
            actor = _PROCESS_ACTOR.options(**options).remote(
                spec.argv, dict(spec.job_env), os.getcwd()
            )
            return _Member(index, spec, actor, False)
        actor = _FUNCTION_WORKER.options(**options).remote(dict(spec.job_env))
        return _Member(index, spec, actor, True)

    def _first_answers(self, rules: ExitRules) -> None:
        """Wait for every actor's first answer (its pid), then tell the rules that every
        process started, before any exit is judged."""
        calls = [
            m.actor.pid.remote() if m.function else m.actor.poll.remote() for m in self._members
        ]
        try:
            answers = ray.get(calls, timeout=START_TIMEOUT_S)
        except RayActorError as exc:
            raise LaunchError(f"an actor of the job died as it started: {exc}") from exc
        except GetTimeoutError:
            raise LaunchError(
                f"not every actor of the job started within {START_TIMEOUT_S:g} s: the "
                f"workers need {self._worker_resources} each, and the cluster has "
                f"{_RAY.available_resources()} available"
            ) from None
        polls: list[tuple[_Member, Poll]] = []
        for member, answer in zip(self._members, answers, strict=True):
            if member.function:
                member.pid = answer
                member.call = member.actor.run.remote(self._fn, self._args, self._kwargs)
            else:
                member.pid = answer.pid
                polls.append((member, answer))
            rules.started(member.index, member.pid or 0)
            member.last_poll = self._ledger.started_at[member.index] = time.monotonic()
        for member, answer in polls:
            self._take_poll(member, answer, rules)

    # ---- following

    def _follow(self, rules: ExitRules) -> Decision:
        """Apply the rules to the job's events until they say stop (the loop of
        :func:`akv.launch.supervisor.supervise`)."""
        decision = Decision("continue")
        deadline: float | None = None
        expired = rules.grace_expired
        try:
            while decision.action != "stop":
                if decision.action == "drain":
                    deadline = time.monotonic() + decision.grace_s
                    expired = rules.grace_expired
                elif decision.action == "report":
                    deadline, expired = time.monotonic() + REPORT_GRACE_S, rules.report_expired
                decision = self._next_decision(deadline, expired, rules)
                if decision.action != "stop" and decision.message:
                    self._say(decision.message)
                if decision.action == "restart":
                    decision = self._restart(decision, rules)
        except KeyboardInterrupt:
            self._say(rules.interrupted(signal.SIGINT).message)
            raise
        self._say(decision.message)
        return decision

    def _next_decision(
        self, deadline: float | None, expired: Callable[[], Decision], rules: ExitRules
    ) -> Decision:
        while True:
            if self._exits:
                index, returncode = self._exits.popleft()
                self._ledger.returncodes[index] = returncode
                self._ledger.ended_at[index] = time.monotonic()
                decision = rules.exited(index, returncode)
                if self._watch is not None and decision.action != "restart":
                    self._watch.stop(wait=False)  # (see AssemblyWatch.stop)
                if decision.blames and self._report_failure is not None:
                    member = self._members[index]
                    error = member.result.error if member.result is not None else None
                    exited = self._tracebacks.exited(index, status_text(returncode))
                    what = f"raised {error}" if error else exited
                    self._report_failure(member.spec, what)
                return decision
            if self._start_failed is not None:
                member = self._members[self._start_failed]
                return rules.start_failed(member.index, self._start_error(member))
            timeout = POLL_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return expired()
                timeout = min(timeout, remaining)
            self._ask()
            calls = {member.call: member for member in self._members if member.call is not None}
            if not calls:  # every actor is gone: only the clock can decide
                time.sleep(timeout)
                continue
            ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
            for ref in ready:
                self._answered(calls[ref], ref, rules)

    def _ask(self) -> None:
        """Poll every process actor that has no call in flight and was not polled for
        :data:`POLL_S`."""
        now = time.monotonic()
        for member in self._members:
            if member.function or member.dead or member.call is not None:
                continue
            if now - member.last_poll >= POLL_S:
                member.call = member.actor.poll.remote()
                member.last_poll = now

    def _answered(self, member: _Member, ref: Any, rules: ExitRules) -> None:
        member.call = None
        try:
            answer = ray.get(ref)
        except RayActorError as exc:
            self._actor_lost(member, exc)
            return
        except RayError as exc:  # the call itself failed: its value could not be sent
            if not member.function:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            answer = WorkerResult(error=first, traceback=str(exc))
        if member.function:
            member.result = answer
            if answer.error is not None:
                self._say(f"{member.spec.describe(member.pid)} raised {answer.error}")
            member.reported = True
            self._exits.append((member.index, 0 if answer.error is None else 1))
            return
        member.unavailable = False
        self._take_poll(member, answer, rules)

    def _take_poll(self, member: _Member, answer: Poll, rules: ExitRules) -> None:
        if answer.pid is not None and answer.pid != member.pid:  # restarted by Ray
            member.pid, member.reported, member.awaiting_restart = answer.pid, False, False
            self._ledger.returncodes.pop(member.index, None)  # it runs again
            rules.started(member.index, answer.pid)
            self._say(f"{member.spec.describe(answer.pid)} started again by Ray")
        if answer.dropped:
            self._say(f"{answer.dropped} lines of {member.spec.label} were dropped")
        for stream, line in answer.lines:
            self._emit(member, stream, line)
        if answer.start_error is not None and self._start_failed is None:
            self._start_failed = member.index
            member.start_error = answer.start_error
            member.reported = True
        elif answer.returncode is not None and not member.reported:
            member.reported = True
            self._exits.append((member.index, answer.returncode))

    def _actor_lost(self, member: _Member, exc: RayActorError) -> None:
        """The actor's process died (its process with it, by ``PR_SET_PDEATHSIG``'s
        SIGKILL): an exit with SIGKILL, unless it was reported already. Ray restarts it
        while it has restarts left (ActorUnavailableError), else it is gone."""
        restarting = isinstance(exc, ActorUnavailableError)
        member.unavailable = True
        member.dead = not restarting
        if not member.reported:
            member.reported = True
            where = "restarting" if restarting else "dead"
            self._say(f"{member.spec.label}'s Ray actor died ({where})")
            self._exits.append((member.index, -signal.SIGKILL))
        elif member.dead and member.awaiting_restart:
            # The restart the rules asked for will not come: the job must not wait for it.
            member.awaiting_restart = False
            self._say(f"Ray could not restart {member.spec.label}'s actor: {exc}")
            self._exits.append((member.index, -signal.SIGKILL))

    def _restart(self, decision: Decision, rules: ExitRules) -> Decision:
        """The rules restart a server: end its actor, unless it died already; either way
        Ray starts it again, and its next poll names the new process. It runs from now on
        for the rules (the job's end waits for its exit, as for a restart by akv-launch)."""
        assert decision.index is not None, "a restart decision names its process"
        member = self._members[decision.index]
        member.awaiting_restart = True
        if member.pid is not None:
            rules.started(decision.index, member.pid)
        if not member.unavailable:
            member.actor.die.remote()
            member.unavailable = True
        return Decision("continue")

    @staticmethod
    def _start_error(member: _Member) -> OSError:
        text, not_found = member.start_error or ("its Ray actor could not start it", False)
        return FileNotFoundError(text) if not_found else OSError(text)

    # ---- the end

    def _outcome(self, rules: ExitRules, decision: Decision) -> Outcome:
        workers = [m for m in self._members if m.spec.role == "worker"]
        results = {
            m.spec.rank or 0: m.result.value for m in workers if m.result is not None and m.function
        }
        outcome = Outcome(decision.exit_code, decision.message, results)
        if decision.exit_code == 0:
            return outcome
        index = rules.culprit(self._verdict)
        if index is None:
            index = self._start_failed
        member = self._members[index] if index is not None else None
        message = decision.message
        if self._verdict is not None:
            message += f"; the scheduler's verdict: the job failed: {self._verdict}"
        role, rank, remote = "scheduler", None, None
        if member is not None:
            role, rank = member.spec.role, member.spec.rank
            if member.result is not None and member.result.error is not None:
                remote = member.result.traceback
                message = f"{member.spec.label} raised {member.result.error}\n\n{remote}"
        outcome.failure = JobFailedError(message, role=role, rank=rank, remote_traceback=remote)
        return outcome

    def _stop_all(self) -> None:
        """Stop every process (SIGTERM, grace, SIGKILL), kill every actor, remove the
        placement group, and wait until the actors are gone."""
        stopping = {
            m.actor.stop.remote(self._terminate_grace_s): m
            for m in self._members
            if not m.function and not m.dead
        }
        if stopping:
            ready, _ = ray.wait(
                list(stopping),
                num_returns=len(stopping),
                timeout=self._terminate_grace_s + STOP_MARGIN_S,
            )
            for ref in ready:
                with contextlib.suppress(RayActorError):
                    last = ray.get(ref)
                    for stream, line in last.lines:
                        self._emit(stopping[ref], stream, line)
                    self._stopped_with(stopping[ref], last.returncode)
        for member in self._members:
            self._stopped_with(member, -signal.SIGKILL)  # what ray.kill ends
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        if self._group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
        self._wait_gone()

    def _stopped_with(self, member: _Member, returncode: int | None) -> None:
        """Record that the stop ended ``member``'s process with ``returncode``, unless its
        exit was reported before or it never started."""
        ledger = self._ledger
        if member.reported or member.pid is None or member.index in ledger.stopped:
            return
        ledger.stopped.add(member.index)
        ledger.returncodes[member.index] = returncode
        ledger.ended_at[member.index] = time.monotonic()

    def _say_summary(self) -> None:
        """The closing table: one line per process (as ``akv-launch --launcher local``)."""
        restarts = self._rules.restarts if self._rules is not None else {}
        specs = [member.spec for member in self._members]
        for line in self._ledger.summary(specs, restarts, time.monotonic()):
            self._say(line)

    def _say_failure(self, rules: ExitRules) -> None:
        """Last, where a person looks first: the scheduler's verdict, and the traceback of
        the process it blames (a command's, from its stderr; a function's is raised)."""
        if self._verdict is not None:
            self._say(f"the scheduler's verdict: the job failed: {self._verdict}")
        index = rules.culprit(self._verdict)
        if index is not None and not self._members[index].function:
            self._say(self._tracebacks.message(index, self._members[index].spec.label))

    def _wait_gone(self) -> None:
        names = set(self.actor_names)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while names and time.monotonic() < deadline:
            alive = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)}
            names &= alive
            if names:
                time.sleep(POLL_S)
        if names:
            self._say(f"{', '.join(sorted(names))} still listed {GONE_TIMEOUT_S:g} s after kill")

    # ---- output

    def _emit(self, member: _Member, stream: int, line: bytes) -> None:
        if member.spec.role == "scheduler" and self._verdict is None:
            self._verdict = scheduler_verdict(line.decode(errors="replace"))
        if stream == 2:
            self._tracebacks.note(member.index, line)
        text = f"[{member.spec.label}] ".encode() + line
        with self._write_lock:
            (self._stdout if stream == 1 else self._stderr)(text)
        log = self._logs.get(member.index)
        if log is not None:
            with contextlib.suppress(OSError, ValueError):
                log.write(text)
                log.flush()

    def _say(self, message: str) -> None:
        """Print ``{name}: message`` on stderr (from the driver's thread or the watch's)."""
        if not message:
            return
        with self._write_lock:
            self._stderr(f"{self._name}: {message}\n".encode())

    def _open_logs(self) -> None:
        """Create ``--log-dir`` (0700) and open each process's file in it (0600)."""
        if self._options.log_dir is None:
            return
        try:
            os.makedirs(self._options.log_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"--log-dir: cannot create {self._options.log_dir}: {exc}") from exc
        for member in self._members:
            path = member.spec.log_path
            if path is None or member.function:
                continue
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE)
                os.fchmod(fd, LOG_FILE_MODE)
            except OSError as exc:
                raise LaunchError(f"--log-dir: cannot write {path}: {exc}") from exc
            self._logs[member.index] = os.fdopen(fd, "wb")

    def _close_logs(self) -> None:
        logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            with contextlib.suppress(OSError):
                log.close()


# Ray's actor classes, made once (each ray.remote exports the class to the cluster). Ray's
# own functions that carry no types go through _RAY.
_PROCESS_ACTOR: Any = ray.remote(ProcessActor)
_FUNCTION_WORKER: Any = ray.remote(FunctionWorker)
_RAY: Any = ray


def _with_scheduler(spec: ProcessSpec, host: str) -> ProcessSpec:
    """``spec`` with the scheduler's address ``host`` under both names (the plan's is
    ``127.0.0.1``; on several nodes the scheduler listens on its node's address)."""
    names = dict(TWIN_VARIABLES)
    env = {**spec.job_env, "AKV_SCHEDULER_HOST": host, names["AKV_SCHEDULER_HOST"]: host}
    return replace(spec, env=env, job_env=env)


def _actor_resources(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for ``resources`` (``CPU``, ``GPU``, ``memory`` in bytes, and
    custom resources)."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
    }
    if "memory" in resources:
        options["memory"] = resources["memory"]
    if rest:
        options["resources"] = rest
    return options


def _writer(stream: BinaryIO | None, text: Callable[[], TextIO]) -> Callable[[bytes], None]:
    """Write bytes to ``stream``, else to the text stream ``text()`` is when writing (its
    binary buffer where it has one: a notebook's has none); errors are ignored."""

    def write(data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            if stream is not None:
                stream.write(data)
                stream.flush()
                return
            target = text()
            buffer = getattr(target, "buffer", None)
            if buffer is None:
                target.write(data.decode(errors="replace"))
            else:
                target.flush()
                buffer.write(data)
                buffer.flush()
            target.flush()

    return write
