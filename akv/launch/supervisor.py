"""Run the processes of one akv job and apply its exit rules (the I/O half of akv-launch).

:mod:`akv.launch.plans` decides *what* to run (a list of :class:`ProcessSpec`) and
:class:`~akv.launch.rules.ExitRules` decides what each exit means; this module only does
the I/O. :func:`supervise` starts the processes (each in its own session, so each is its
own process group), prefixes their output (and copies it to their ``--log-dir`` files),
feeds exit events to the rules, starts a failed server again when they say so, and at the
end stops every process group it started, by PID: SIGTERM, a grace, then SIGKILL.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, BinaryIO, Literal, Protocol

from akv.errors import LaunchError
from akv.launch.limits import (
    MAX_LINE_BYTES,
    OUTPUT_SETTLE_S,
    POLL_INTERVAL_S,
    REPORT_GRACE_S,
    TERMINATE_GRACE_S,
)
from akv.launch.report import Ledger, Tracebacks
from akv.launch.rules import Decision, ExitRules, scheduler_verdict, status_text
from akv.launch.spec import ProcessSpec
from akv_transport import remove_leftovers

__all__ = ["die_with_parent", "supervise"]

#: What :func:`signal.signal` takes and returns: a function, ``SIG_DFL``/``SIG_IGN``, or
#: ``None`` (a handler not installed from Python).
_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

#: The mode of the ``--log-dir`` files: the user's only.
LOG_FILE_MODE = 0o600

#: ``prctl`` option that sets the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


class Watch(Protocol):
    """What watches a job while it runs (:class:`akv.launch.watch.AssemblyWatch`):
    started once every process was started, with a thread-safe way to print a launcher
    message; stopped before the job's summary."""

    def start(self, say: Callable[[str], None]) -> None: ...

    def stop(self, wait: bool = True) -> None: ...


def die_with_parent() -> Callable[[], None] | None:
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
    max_restarts: int = 0,
    terminate_grace_s: float = TERMINATE_GRACE_S,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    inherited: Sequence[socket.socket] = (),
    handle_signals: bool = True,
    report_failure: Callable[[ProcessSpec, str], None] | None = None,
    watch: Watch | None = None,
) -> int:
    """Run the job's processes to the end and return the launcher's exit code.

    Processes start in ``specs`` order, each in a new session (so each is its own process
    group). Every line a child writes to stdout (stderr) is written to ``stdout``
    (``stderr``) as one write, prefixed ``[label] ``, so lines never interleave; a final line
    without a newline gets one, and lines longer than :data:`MAX_LINE_BYTES` are split. Each
    exit is judged by :class:`ExitRules` and reported on ``stderr`` as ``akv-launch: ...``.
    A spec with a ``log_path`` also has its stdout and stderr lines, with the same prefix,
    written to that file, which is created (or emptied) before anything starts.

    A server that the rules restart (``max_restarts``) is started again from its spec (same
    command, environment, prefix and log file, which it goes on appending to) once what is
    left of its old process group was killed; the new process is the one stopped at the end.

    Before it returns (normally, on an exception, or on SIGINT/SIGTERM) it sends SIGTERM to
    every process group it started, waits up to ``terminate_grace_s`` for them to empty, and
    sends SIGKILL to the rest; grandchildren in those groups go too. A second SIGINT or
    SIGTERM during that wait skips to SIGKILL. Then it prints the summary: one line per
    process with its role, rank, last exit, run time and restarts
    (:func:`~akv.launch.report.summary_lines`).

    Parameters
    ----------
    specs
        The processes, from :func:`akv.launch.plans.plan`.
    grace_s
        Once every worker exited 0, how long the others get to stop on their own.
    max_restarts
        How many times each server that fails while workers run is started again
        (``--max-restarts``; see :class:`ExitRules`).
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
    report_failure
        ``report_failure(spec, what)`` is called (on this thread; it must be quick and
        swallow its errors) when the exit of ``spec``'s process fails the job, with what
        was seen (``exited with signal SIGKILL``): the launcher tells the scheduler, so that
        its verdict names that process even when nobody else saw it die.
    watch
        Started once every process was started (the assembly's progress lines), stopped
        when the job ends.

    Returns
    -------
    int
        The exit code :class:`ExitRules` decided: 0, the first failing worker's code (128+N
        for signal N), a failing scheduler's or server's code, 128+N for an interruption,
        126/127 when a process could not be started (or restarted).

    Raises
    ------
    LaunchError
        A ``log_path`` cannot be opened for writing; nothing was started.
    """
    supervisor = _Supervisor(
        specs,
        grace_s=grace_s,
        max_restarts=max_restarts,
        terminate_grace_s=terminate_grace_s,
        stdout=stdout if stdout is not None else sys.stdout.buffer,
        stderr=stderr if stderr is not None else sys.stderr.buffer,
        report_failure=report_failure,
        watch=watch,
    )
    return supervisor.run(inherited, handle_signals)


class _Supervisor:
    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        grace_s: float,
        max_restarts: int,
        terminate_grace_s: float,
        stdout: BinaryIO,
        stderr: BinaryIO,
        report_failure: Callable[[ProcessSpec, str], None] | None = None,
        watch: Watch | None = None,
    ) -> None:
        self._specs = list(specs)
        self._report_failure = report_failure
        self._watch = watch
        #: When each spec was first started, and when its newest process exited.
        #: The specs whose process still ran when the launcher stopped the job.
        self._ledger = Ledger()
        self._rules: ExitRules | None = None
        self._grace_s = grace_s
        self._max_restarts = max_restarts
        self._terminate_grace_s = terminate_grace_s
        self._stdout = stdout
        self._stderr = stderr
        # Reentrant: a failed log write reports itself while the lock is held.
        self._write_lock = threading.RLock()
        self._logs: dict[int, BinaryIO] = {}
        # SimpleQueue.put is reentrant: the signal handlers may call it at any point.
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        #: The newest process of each spec (a restarted server's old one is gone).
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        #: How many times each spec was started: an exit event names the start it is of.
        self._generations: dict[int, int] = {}
        self._pumps: dict[int, list[threading.Thread]] = {}
        self._signo: int | None = None
        #: The scheduler's "job failed: ..." reason, the first one it logged.
        self._verdict: str | None = None
        #: Each process's latest traceback on stderr.
        self._tracebacks = Tracebacks()

    def run(self, inherited: Sequence[socket.socket], handle_signals: bool) -> int:
        rules = self._rules = ExitRules(self._specs, self._grace_s, max_restarts=self._max_restarts)
        previous = self._install_signal_handlers() if handle_signals else {}
        decision = Decision("continue")
        failed = False
        try:
            self._open_logs()
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
            if self._watch is not None and decision.action != "stop":
                self._watch.start(self._say)
            if self._signo is not None and decision.action != "stop":
                decision = rules.interrupted(self._signo)
            deadline: float | None = None
            expired = rules.grace_expired
            while decision.action != "stop":
                if decision.action == "drain":
                    deadline = time.monotonic() + decision.grace_s
                    expired = rules.grace_expired
                elif decision.action == "report":
                    deadline = time.monotonic() + REPORT_GRACE_S
                    expired = rules.report_expired
                decision = self._next_decision(deadline, expired, rules)
                if decision.action != "stop" and decision.message:
                    self._say(decision.message)
                if decision.action == "restart":
                    decision = self._restart(decision, rules)
            self._say(decision.message)
            failed = decision.exit_code != 0
            return decision.exit_code
        finally:
            if self._watch is not None:
                self._watch.stop()
            for sock in inherited:
                sock.close()
            self._stop_all()
            self._say_summary()
            if failed:  # last, where a person looks first: who failed the job, and how
                if self._verdict is not None:
                    self._say(f"the scheduler's verdict: the job failed: {self._verdict}")
                self._show_traceback(rules.culprit(self._verdict))
            self._close_logs()
            for signo, handler in previous.items():
                signal.signal(signo, handler)

    # ---- events

    def _next_decision(
        self, deadline: float | None, expired: Callable[[], Decision], rules: ExitRules
    ) -> Decision:
        """The next event's decision; ``expired()``'s once ``deadline`` passes first."""
        while True:
            timeout = POLL_INTERVAL_S * 10
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return expired()
                timeout = min(timeout, remaining)
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                continue
            if event.kind == "signal":
                return rules.interrupted(event.value)
            if event.generation != self._generations.get(event.index):
                continue  # the exit of a process that was since restarted: already judged
            self._let_output_settle(event.index)
            decision = rules.exited(event.index, event.value)
            if self._watch is not None and decision.action != "restart":
                self._watch.stop(wait=False)  # (see AssemblyWatch.stop)
            if decision.blames and self._report_failure is not None:
                spec = self._specs[event.index]
                self._report_failure(
                    spec, self._tracebacks.exited(event.index, status_text(event.value))
                )
            return decision

    def _install_signal_handlers(self) -> dict[int, _SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signo: int, frame: FrameType | None) -> None:
            if self._signo is None:
                self._signo = signo
            self._events.put(_Event("signal", -1, signo))

        previous: dict[int, _SignalHandler] = {}
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
            preexec_fn=die_with_parent(),
        )
        self._procs[index] = proc
        self._tracebacks.started(index)
        self._ledger.started_at.setdefault(index, time.monotonic())
        generation = self._generations[index] = self._generations.get(index, 0) + 1
        if spec.stdin is not None and proc.stdin is not None:
            try:
                proc.stdin.write(spec.stdin.encode())
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it already exited; its exit status says why
        prefix = f"[{spec.label}] ".encode()
        pumps = [
            threading.Thread(
                target=self._pump, args=(index, proc.stdout, prefix, self._stdout), daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(index, proc.stderr, prefix, self._stderr), daemon=True
            ),
        ]
        # A restarted process's old pumps stay listed: they are joined at the end too.
        self._pumps.setdefault(index, []).extend(pumps)
        for pump in pumps:
            pump.start()
        threading.Thread(target=self._wait, args=(index, proc, generation), daemon=True).start()
        return proc.pid

    def _wait(self, index: int, proc: subprocess.Popen[bytes], generation: int) -> None:
        returncode = proc.wait()
        if self._generations.get(index) == generation:
            self._ledger.ended_at[index] = time.monotonic()
        self._events.put(_Event("exit", index, returncode, generation))

    def _restart(self, decision: Decision, rules: ExitRules) -> Decision:
        """Start process ``decision.index`` again: ``continue``, or the rules' ``stop`` when
        it cannot be started or the launcher was interrupted meanwhile."""
        assert decision.index is not None, "a restart decision names its process"
        if self._signo is not None:
            return rules.interrupted(self._signo)
        index = decision.index
        old = self._procs[index]  # reaped: its exit event came from its wait()
        if old.stdin is not None:
            with contextlib.suppress(OSError):
                old.stdin.close()
        if _live_groups({old.pid}):
            # What the dead server left in its group must not run beside its successor.
            who = self._specs[index].describe(old.pid)
            self._say(f"killing what {who} left in its process group before restarting it")
            _signal_group(old.pid, signal.SIGKILL)
        remove_leftovers(pid=old.pid)  # a server killed by SIGKILL leaves its Unix socket
        try:
            pid = self._start(index, self._specs[index])
        except OSError as exc:
            return rules.start_failed(index, exc)
        rules.started(index, pid)
        return Decision("continue")

    def _pump(self, index: int, stream: BinaryIO, prefix: bytes, out: BinaryIO) -> None:
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
                if self._verdict is None and self._specs[index].role == "scheduler":
                    self._verdict = scheduler_verdict(line.decode(errors="replace"))
                if out is self._stderr:
                    self._tracebacks.note(index, line)
                self._emit(index, out, prefix + line)

    def _show_traceback(self, index: int | None) -> None:
        """Print the traceback of the process the job's failure is blamed on, if it left
        one (the first lines of the summary name it)."""
        if index is not None:
            self._let_output_settle(index)
            self._say(self._tracebacks.message(index, self._specs[index].label))

    def _emit(self, index: int, out: BinaryIO, line: bytes) -> None:
        """Write one prefixed line to ``out`` and to process ``index``'s log file."""
        with self._write_lock:
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass  # keep draining, so the child never blocks on a full pipe
            log = self._logs.get(index)
            if log is None:
                return
            try:
                log.write(line)
                log.flush()
            except (OSError, ValueError) as exc:
                del self._logs[index]
                with contextlib.suppress(OSError, ValueError):
                    log.close()
                self._say(
                    f"cannot write {self._specs[index].log_path}: {exc}; the rest of "
                    f"{self._specs[index].label}'s output goes to the console only"
                )

    # ---- log files

    def _open_logs(self) -> None:
        for index, spec in enumerate(self._specs):
            if spec.log_path is None:
                continue
            try:
                # Only the user reads them (as the checkpoints): a job's output may name
                # hosts, paths and data. Closed by _close_logs, under the pumps' lock.
                fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE)
                os.fchmod(fd, LOG_FILE_MODE)  # a file of an earlier job may be wider open
                self._logs[index] = os.fdopen(fd, "wb")
            except OSError as exc:
                raise LaunchError(
                    f"--log-dir: cannot write {spec.log_path}: {exc}; nothing was started"
                ) from exc

    def _close_logs(self) -> None:
        with self._write_lock:
            logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            with contextlib.suppress(OSError):
                log.close()

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
        self._ledger.stopped = {index for index, proc in self._procs.items() if proc.poll() is None}
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
            else:
                remove_leftovers(pid=proc.pid)  # what a server killed by SIGKILL left
        for pumps in self._pumps.values():
            for pump in pumps:
                pump.join(OUTPUT_SETTLE_S)

    def _say_summary(self) -> None:
        """One line per process: role, rank, last exit, run time, restarts."""
        restarts = self._rules.restarts if self._rules is not None else {}
        self._ledger.returncodes.update(
            (index, proc.returncode) for index, proc in self._procs.items()
        )
        for line in self._ledger.summary(self._specs, restarts, time.monotonic()):
            self._say(line)

    def _second_signal(self) -> bool:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return False
            if event.kind == "signal":
                return True


@dataclass(frozen=True)
class _Event:
    """A process exited (``value``: its return code) or the launcher got signal ``value``."""

    kind: Literal["exit", "signal"]
    #: The spec's index (-1 for a signal).
    index: int
    value: int
    #: Which start of the spec exited (see ``_Supervisor._generations``); 0 for a signal.
    generation: int = 0


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
