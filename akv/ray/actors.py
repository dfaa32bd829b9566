"""What runs inside the Ray actors of a job: plain classes, made actors by :mod:`akv.ray.job`.

:class:`ProcessActor` owns one process of the job (the scheduler, a server, or a worker
command under ``akv-launch --launcher ray``), started exactly as ``akv-launch`` starts it:
the same command, the job's variables, its own session. Its output lines are kept until the
driver asks for them (:meth:`ProcessActor.poll`), so the driver prints them prefixed as
``akv-launch`` does. :class:`FunctionWorker` sets the job's variables in its own process and
calls the user's function.

Why a subprocess for the scheduler and the servers, not a thread of the actor: a server is
then exactly ``akv-server`` (its signal handling, its exit codes, its final checkpoint on
SIGTERM), one that dies is seen with its exit status, and the actor can stop it and what it
started as a process group. The child gets SIGKILL if the actor's process dies
(``PR_SET_PDEATHSIG``), so ``ray.kill`` leaves nothing behind.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NoReturn

from akv.exits import close_open_stores
from akv.launch.args import OWNED_VARIABLES
from akv.launch.limits import MAX_LINE_BYTES, OUTPUT_SETTLE_S, POLL_INTERVAL_S
from akv.launch.spec import ACTOR_PYTHON
from akv.launch.supervisor import _live_groups, _signal_group, die_with_parent
from akv_transport import remove_leftovers

__all__ = ["FunctionWorker", "Poll", "ProcessActor", "WorkerResult"]

#: Output lines an actor keeps for the driver between two polls; older ones are dropped.
MAX_KEPT_LINES = 20_000
#: Exit status of an actor process that ends itself so that Ray restarts it.
RESTART_EXIT = 1


@dataclass(frozen=True)
class Poll:
    """What a :class:`ProcessActor` says when polled.

    ``pid``: its process (None if it could not be started); ``lines``: the output lines
    since the last poll, each ``(stream, line)`` with ``stream`` 1 (stdout) or 2 (stderr);
    ``returncode``: None while the process runs, else its status (negative: a signal);
    ``start_error``: why the process could not be started, and whether the program was not
    found. ``dropped``: lines lost because nobody polled for too long.
    """

    pid: int | None
    lines: list[tuple[int, bytes]] = field(default_factory=list)
    returncode: int | None = None
    start_error: tuple[str, bool] | None = None
    dropped: int = 0


@dataclass(frozen=True)
class WorkerResult:
    """What :meth:`FunctionWorker.run` returns: the function's ``value``, or the
    ``error`` it raised (``Type: message``) with its formatted ``traceback``."""

    value: Any = None
    error: str | None = None
    traceback: str | None = None


def node_address() -> str:
    """The address of this Ray node (where a server binds and the scheduler listens on a
    cluster of several nodes)."""
    import ray.util

    get_address: Callable[[], str] = ray.util.get_node_ip_address
    return str(get_address())


def job_environ(job_env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without the variables that belong to the launcher (a stale one must not
    leak in: see :data:`~akv.launch.args.OWNED_VARIABLES`), plus the job's."""
    return {
        **{name: value for name, value in base.items() if name not in OWNED_VARIABLES},
        **job_env,
    }


class ProcessActor:
    """One process of the job, run by an actor.

    Parameters
    ----------
    argv
        The command (:data:`ACTOR_PYTHON` in it is this process's Python).
    env
        The job's variables for this process; None: do not start yet (the scheduler: it
        binds its socket first, see :meth:`listen`, then :meth:`start`).
    cwd
        Where the command starts; with ``cwd_required`` False, a directory missing on this
        node is replaced by the actor's own.
    node_host
        Set as ``AKV_HOST``/``DMLC_NODE_HOST`` (a server's address): ``""`` means this
        node's address, None leaves the job's value.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        cwd: str | None = None,
        *,
        cwd_required: bool = True,
        node_host: str | None = None,
    ) -> None:
        self._argv = [sys.executable if word == ACTOR_PYTHON else word for word in argv]
        self._cwd = cwd if cwd_required or (cwd and os.path.isdir(cwd)) else None
        self._node_host = node_host
        self._lock = threading.Lock()
        self._lines: collections.deque[tuple[int, bytes]] = collections.deque()
        self._dropped = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._pumps: list[threading.Thread] = []
        self._start_error: tuple[str, bool] | None = None
        self._listener: socket.socket | None = None
        self._reported = False
        if env is not None:
            self.start(env)

    def listen(self, host: str) -> tuple[str, int, int]:
        """Bind the scheduler's socket on ``host`` (``""``: this node's address), port 0;
        return ``(host, port, fd)``: the scheduler inherits ``fd`` (``AKV_SCHEDULER_FD``),
        so no other process can take the port before it listens."""
        host = host or node_address()
        info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = info[0]
        listener = socket.socket(family, kind, proto)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        self._listener = listener
        return host, listener.getsockname()[1], listener.fileno()

    def start(self, env: Mapping[str, str]) -> None:
        """Start the process with the job's variables ``env`` over this process's own
        environment; a failure to start is kept for :meth:`poll`."""
        environ = job_environ(env, os.environ)
        if self._node_host is not None:
            host = self._node_host or node_address()
            environ["AKV_HOST"] = environ["DMLC_NODE_HOST"] = host
        fds = () if self._listener is None else (self._listener.fileno(),)
        try:
            proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=environ,
                cwd=self._cwd,
                pass_fds=fds,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        except OSError as exc:
            self._start_error = (f"{exc}", isinstance(exc, FileNotFoundError))
            return
        finally:
            if self._listener is not None:
                self._listener.close()  # the scheduler holds it now
                self._listener = None
        self._proc = proc
        for stream, pipe in ((1, proc.stdout), (2, proc.stderr)):
            pump = threading.Thread(target=self._pump, args=(stream, pipe), daemon=True)
            pump.start()
            self._pumps.append(pump)

    def poll(self) -> Poll:
        """The process's pid, its output lines since the last poll, and its exit status
        once it exited (after its last lines: the pipes are drained first, for up to
        :data:`~akv.launch.limits.OUTPUT_SETTLE_S`)."""
        proc = self._proc
        returncode = None if proc is None else proc.poll()
        if returncode is not None:
            self._settle()
        with self._lock:
            lines, self._lines = list(self._lines), collections.deque()
            dropped, self._dropped = self._dropped, 0
        return Poll(
            None if proc is None else proc.pid, lines, returncode, self._start_error, dropped
        )

    def stop(self, grace_s: float) -> Poll:
        """SIGTERM the process group, wait up to ``grace_s`` for it to empty, SIGKILL what
        is left; return the last poll (its exit status and last lines)."""
        proc = self._proc
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            alive = _live_groups({proc.pid})
            while alive and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL_S)
                alive = _live_groups(alive)
            if alive:
                _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
            if proc.returncode is not None:
                remove_leftovers(pid=proc.pid)  # what a process killed by SIGKILL left
        return self.poll()

    def die(self) -> NoReturn:
        """End this actor's process so that Ray restarts the actor (its ``max_restarts``),
        which starts the process again from the same arguments: a server then restores its
        checkpoint. What the dead process left in its group is killed first."""
        proc = self._proc
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=OUTPUT_SETTLE_S)
            remove_leftovers(pid=proc.pid)
        os._exit(RESTART_EXIT)

    def _pump(self, stream: int, pipe: BinaryIO) -> None:
        with pipe:
            while True:
                try:
                    line = pipe.readline(MAX_LINE_BYTES)
                except (OSError, ValueError):
                    return
                if not line:
                    return
                with self._lock:
                    if len(self._lines) >= MAX_KEPT_LINES:
                        self._lines.popleft()
                        self._dropped += 1
                    self._lines.append((stream, line if line.endswith(b"\n") else line + b"\n"))

    def _settle(self) -> None:
        deadline = time.monotonic() + OUTPUT_SETTLE_S
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


class FunctionWorker:
    """A worker of :func:`akv.ray.launch`: its process gets the job's variables ``env``
    (over its own environment, without stale launcher variables), then :meth:`run` calls
    the user's function there."""

    def __init__(self, env: Mapping[str, str]) -> None:
        environ = job_environ(env, os.environ)
        for name in [name for name in os.environ if name not in environ]:
            del os.environ[name]
        os.environ.update(environ)

    def pid(self) -> int:
        """This worker's process id."""
        return os.getpid()

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> WorkerResult:
        """``fn(*args, **kwargs)``: its value, or the exception it raised, formatted here
        (with its traceback), so that an exception that cannot be pickled still arrives.
        ``SystemExit`` with status 0 or None counts as a return of None.

        A blocking store ``fn`` left open is then closed as at a process's exit (the actor
        outlives ``fn``): with the exit barrier after a return, or leaving the job as failed
        after a raise, so that the other workers fail at once naming this one rather than
        wait for it until the driver stops the job."""
        failure: BaseException | None = None
        try:
            result = WorkerResult(value=fn(*args, **kwargs))
        except SystemExit as exc:
            result = WorkerResult() if exc.code in (0, None) else self._failed(exc)
            failure = None if result.error is None else exc
        except BaseException as exc:
            result, failure = self._failed(exc), exc
        close_open_stores(failure)
        return result

    @staticmethod
    def _failed(exc: BaseException) -> WorkerResult:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return WorkerResult(error=error, traceback=traceback.format_exc())
