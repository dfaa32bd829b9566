"""Run the processes of one akv job and apply its exit rules (the I/O half of akv-launch).

:mod:`akv.launch` decides *what* to run (a list of :class:`ProcessSpec`); this module runs
it. It is split in two on purpose:

* :class:`ExitRules` is pure: it is told "this process exited with this status" and
  answers with a :class:`Decision` (go on, give the scheduler and servers their grace, or
  stop the job with this exit code and this message). Tests drive it without processes.
* :func:`supervise` starts the processes (each in its own session, so each is its own
  process group), prefixes their output, feeds exit events to the rules, and at the end
  stops every process group it started, by PID: SIGTERM, a grace, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Literal

__all__ = [
    "OUTPUT_SETTLE_S",
    "TERMINATE_GRACE_S",
    "Decision",
    "ExitRules",
    "ProcessSpec",
    "exit_code_of",
    "status_text",
    "supervise",
]

#: How long a process group gets between SIGTERM and SIGKILL when the job is stopped (s).
TERMINATE_GRACE_S = 5.0
#: After a process exits, how long its last output lines may take to arrive before the
#: launcher reports the exit anyway (a grandchild may hold the pipe open) (s).
OUTPUT_SETTLE_S = 0.5
#: Longest piece of a child's output printed as one line; longer lines are split (bytes).
MAX_LINE_BYTES = 64 << 10
#: How often the supervisor looks at the clock and at process groups while it waits (s).
POLL_INTERVAL_S = 0.05

ROLES = ("scheduler", "server", "worker")


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


# ------------------------------------------------------------------ the exit rules (pure)


@dataclass(frozen=True)
class Decision:
    """What the supervisor does next.

    ``continue``: keep waiting. ``drain``: every worker finished; start the grace period for
    the scheduler and servers. ``stop``: end the job with ``exit_code``. ``message`` (may be
    empty) is printed by the launcher as ``akv-launch: <message>``.
    """

    action: Literal["continue", "drain", "stop"]
    exit_code: int = 0
    message: str = ""


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
      reported, decides the exit code; the job stops.
    * A scheduler or server that fails while workers still run fails the job with its code;
      one that exits 0 then is only reported (a worker may close its store and go on).
    * When every worker exited 0 the decision is ``drain``: the scheduler and servers get
      ``grace_s`` to stop on their own (:meth:`grace_expired` then says to stop with 0); one
      that fails meanwhile fails the job (it may have lost state it was saving).
    * A signal to the launcher (:meth:`interrupted`) stops the job with 128+N.

    Parameters
    ----------
    specs
        The job's processes, in start order; events name them by index.
    grace_s
        The grace period, only for messages (the supervisor keeps the clock).
    """

    def __init__(self, specs: Sequence[ProcessSpec], grace_s: float) -> None:
        self._specs = list(specs)
        self._grace_s = grace_s
        self._running: set[int] = set()
        self._pids: dict[int, int] = {}
        self._draining = False

    @property
    def running(self) -> frozenset[int]:
        """Indices of the processes started and not yet reported as exited."""
        return frozenset(self._running)

    def started(self, index: int, pid: int) -> None:
        """Record that process ``index`` runs as ``pid``."""
        self._running.add(index)
        self._pids[index] = pid

    def start_failed(self, index: int, error: OSError) -> Decision:
        """Process ``index`` could not be started: stop the job (127 if not found, else 126)."""
        code = 127 if isinstance(error, FileNotFoundError) else 126
        who = self._specs[index].describe(None)
        return Decision("stop", code, f"could not start {who}: {error}; stopping the job")

    def exited(self, index: int, returncode: int) -> Decision:
        """Process ``index`` exited with ``returncode`` (negative: killed by that signal)."""
        self._running.discard(index)
        spec = self._specs[index]
        who = spec.describe(self._pids.get(index))
        status = status_text(returncode)
        failed = returncode != 0
        code = exit_code_of(returncode)
        workers_left = self._running_labels("worker")
        if spec.role == "worker":
            if failed:
                return Decision("stop", code, f"{who} exited with {status}; stopping the job")
            if workers_left:
                return Decision("continue", 0, f"{who} exited with {status}")
            return self._all_workers_done(f"{who} exited with {status}")
        if failed:
            if workers_left:
                return Decision(
                    "stop",
                    code,
                    f"{who} exited with {status} while {_count(workers_left, 'worker')} still "
                    "ran; stopping the job",
                )
            return Decision("stop", code, f"{who} exited with {status} after every worker finished")
        if self._draining and not self._running:
            return Decision("stop", 0, f"{who} exited with {status}; every process finished")
        return Decision("continue", 0, f"{who} exited with {status}")

    def grace_expired(self) -> Decision:
        """The grace after the last worker ran out: stop what is left, exit 0."""
        left = ", ".join(self._running_labels())
        return Decision(
            "stop",
            0,
            f"{left} still running {self._grace_s:g} s after every worker finished; terminating",
        )

    def interrupted(self, signo: int) -> Decision:
        """The launcher got signal ``signo`` (Ctrl-C, SIGTERM): stop with 128+N."""
        name = signal.Signals(signo).name
        return Decision("stop", 128 + signo, f"interrupted by {name}; stopping the job")

    def _all_workers_done(self, what: str) -> Decision:
        if not self._running:
            return Decision("stop", 0, f"{what}; every process finished")
        self._draining = True
        left = ", ".join(self._running_labels())
        return Decision(
            "drain",
            0,
            f"{what}; every worker finished: waiting up to {self._grace_s:g} s for {left} to stop",
        )

    def _running_labels(self, role: str | None = None) -> list[str]:
        return [
            self._specs[i].label
            for i in sorted(self._running)
            if role is None or self._specs[i].role == role
        ]


def _count(labels: list[str], noun: str) -> str:
    return f"1 {noun}" if len(labels) == 1 else f"{len(labels)} {noun}s"


# ------------------------------------------------------------------ the supervisor (I/O)


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, a function that makes the child get SIGKILL when the launcher dies.

    Children run in sessions of their own (so that each can be stopped as a group), which
    also means that nothing stops them if the launcher itself is killed with SIGKILL; the
    kernel's parent-death signal does. Resolved before the fork: the child only makes one
    C call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(1)

    return arm


def supervise(
    specs: Sequence[ProcessSpec],
    *,
    grace_s: float,
    terminate_grace_s: float = TERMINATE_GRACE_S,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    inherited: Sequence[socket.socket] = (),
    handle_signals: bool = True,
) -> int:
    """Run the job's processes to the end and return the launcher's exit code.

    Processes start in ``specs`` order, each in a new session (so each is its own process
    group). Every line a child writes to stdout (stderr) is written to ``stdout``
    (``stderr``) as one write, prefixed ``[label] ``, so lines never interleave; a final line
    without a newline gets one, and lines longer than :data:`MAX_LINE_BYTES` are split. Each
    exit is judged by :class:`ExitRules` and reported on ``stderr`` as ``akv-launch: ...``.

    Before it returns (normally, on an exception, or on SIGINT/SIGTERM) it sends SIGTERM to
    every process group it started, waits up to ``terminate_grace_s`` for them to empty, and
    sends SIGKILL to the rest; grandchildren in those groups go too. A second SIGINT or
    SIGTERM during that wait skips to SIGKILL.

    Parameters
    ----------
    specs
        The processes, from :func:`akv.launch.plan`.
    grace_s
        Once every worker exited 0, how long the others get to stop on their own.
    terminate_grace_s
        Time between SIGTERM and SIGKILL when the job is stopped.
    stdout, stderr
        Binary streams for the children's lines and the launcher's messages (default: this
        process's).
    inherited
        Sockets handed to a child through ``pass_fds``; closed here once every process was
        started, so only the child holds them.
    handle_signals
        On the main thread, make SIGINT and SIGTERM stop the job (exit 130 and 143), unless
        the launcher was started with that signal ignored. The previous handlers are
        restored on return.

    Returns
    -------
    int
        The exit code :class:`ExitRules` decided: 0, the first failing worker's code (128+N
        for signal N), a failing scheduler's or server's code, 128+N for an interruption,
        126/127 when a process could not be started.
    """
    supervisor = _Supervisor(
        specs,
        grace_s=grace_s,
        terminate_grace_s=terminate_grace_s,
        stdout=stdout if stdout is not None else sys.stdout.buffer,
        stderr=stderr if stderr is not None else sys.stderr.buffer,
    )
    return supervisor.run(inherited, handle_signals)


class _Supervisor:
    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        grace_s: float,
        terminate_grace_s: float,
        stdout: BinaryIO,
        stderr: BinaryIO,
    ) -> None:
        self._specs = list(specs)
        self._grace_s = grace_s
        self._terminate_grace_s = terminate_grace_s
        self._stdout = stdout
        self._stderr = stderr
        self._write_lock = threading.Lock()
        # SimpleQueue.put is reentrant: the signal handlers may call it at any point.
        self._events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pumps: dict[int, list[threading.Thread]] = {}
        self._signo: int | None = None

    def run(self, inherited: Sequence[socket.socket], handle_signals: bool) -> int:
        rules = ExitRules(self._specs, self._grace_s)
        previous = self._install_signal_handlers() if handle_signals else {}
        decision = Decision("continue")
        try:
            for index, spec in enumerate(self._specs):
                if self._signo is not None:
                    break
                try:
                    pid = self._start(index, spec)
                except OSError as exc:
                    decision = rules.start_failed(index, exc)
                    break
                rules.started(index, pid)
            for sock in inherited:
                sock.close()
            if self._signo is not None and decision.action != "stop":
                decision = rules.interrupted(self._signo)
            deadline: float | None = None
            while decision.action != "stop":
                if decision.action == "drain":
                    deadline = time.monotonic() + self._grace_s
                decision = self._next_decision(rules, deadline)
                if decision.action != "stop" and decision.message:
                    self._say(decision.message)
            self._say(decision.message)
            return decision.exit_code
        finally:
            for sock in inherited:
                sock.close()
            self._stop_all()
            for signo, handler in previous.items():
                signal.signal(signo, handler)

    # ---- events

    def _next_decision(self, rules: ExitRules, deadline: float | None) -> Decision:
        while True:
            timeout = POLL_INTERVAL_S * 10
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return rules.grace_expired()
                timeout = min(timeout, remaining)
            try:
                kind, index, value = self._events.get(timeout=timeout)
            except queue.Empty:
                continue
            if kind == "signal":
                return rules.interrupted(value)
            self._let_output_settle(index)
            return rules.exited(index, value)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signo: int, frame: object) -> None:
            if self._signo is None:
                self._signo = signo
            self._events.put(("signal", -1, signo))

        previous: dict[int, object] = {}
        for signo in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signo) is signal.SIG_IGN:
                continue  # started with it ignored (nohup, `&` in a script): keep it so
            previous[signo] = signal.signal(signo, on_signal)
        return previous

    # ---- processes

    def _start(self, index: int, spec: ProcessSpec) -> int:
        proc = subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(spec.env),
            pass_fds=spec.pass_fds,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        self._procs[index] = proc
        if spec.stdin is not None and proc.stdin is not None:
            try:
                proc.stdin.write(spec.stdin.encode())
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it already exited; its exit status says why
        prefix = f"[{spec.label}] ".encode()
        pumps = [
            threading.Thread(
                target=self._pump, args=(proc.stdout, prefix, self._stdout), daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(proc.stderr, prefix, self._stderr), daemon=True
            ),
        ]
        self._pumps[index] = pumps
        for pump in pumps:
            pump.start()
        threading.Thread(target=self._wait, args=(index, proc), daemon=True).start()
        return proc.pid

    def _wait(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        self._events.put(("exit", index, proc.wait()))

    def _pump(self, stream: BinaryIO, prefix: bytes, out: BinaryIO) -> None:
        with stream:
            while True:
                try:
                    line = stream.readline(MAX_LINE_BYTES)
                except (OSError, ValueError):
                    return
                if not line:
                    return
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._write_lock:
                    try:
                        out.write(prefix + line)
                        out.flush()
                    except (OSError, ValueError):
                        pass  # keep draining, so the child never blocks on a full pipe

    def _let_output_settle(self, index: int) -> None:
        deadline = time.monotonic() + OUTPUT_SETTLE_S
        for pump in self._pumps.get(index, ()):
            pump.join(max(0.0, deadline - time.monotonic()))

    def _say(self, message: str) -> None:
        if not message:
            return
        with self._write_lock:
            try:
                self._stderr.write(f"akv-launch: {message}\n".encode())
                self._stderr.flush()
            except (OSError, ValueError):
                pass

    # ---- stopping

    def _stop_all(self) -> None:
        """SIGTERM every group started, wait for them to empty, SIGKILL the rest."""
        for proc in self._procs.values():
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # a remote script stops its command on EOF
        groups = {index: proc.pid for index, proc in self._procs.items()}
        for pgid in groups.values():
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self._terminate_grace_s
        alive = _live_groups(set(groups.values()))
        while alive and time.monotonic() < deadline:
            if self._second_signal():
                break
            time.sleep(POLL_INTERVAL_S)
            alive = _live_groups(alive)
        for index, pgid in groups.items():
            if pgid in alive:
                spec = self._specs[index]
                self._say(
                    f"{spec.describe(pgid)} did not stop within "
                    f"{self._terminate_grace_s:g} s of SIGTERM; sending SIGKILL"
                )
                _signal_group(pgid, signal.SIGKILL)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=self._terminate_grace_s)
            except subprocess.TimeoutExpired:
                self._say(f"pid {proc.pid} survived SIGKILL for {self._terminate_grace_s:g} s")
        for pumps in self._pumps.values():
            for pump in pumps:
                pump.join(OUTPUT_SETTLE_S)

    def _second_signal(self) -> bool:
        while True:
            try:
                kind, _, _ = self._events.get_nowait()
            except queue.Empty:
                return False
            if kind == "signal":
                return True


def _signal_group(pgid: int, signo: int) -> None:
    # ProcessLookupError: the group is empty; PermissionError: it is no longer ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signo)


def _live_groups(pgids: set[int]) -> set[int]:
    """The process groups in ``pgids`` that still have a member that is not a zombie.

    ``killpg(pgid, 0)`` also succeeds for a group of zombies (orphans whose new parent does
    not reap them, as in containers whose PID 1 is not an init), so on Linux the members'
    states are read from ``/proc``.
    """
    candidates = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        candidates.add(pgid)
    if not candidates or not os.path.isdir("/proc"):
        return candidates
    live = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) in candidates:
            live.add(int(fields[2]))
    return live
