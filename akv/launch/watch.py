""":class:`AssemblyWatch`: while a job assembles, ask its scheduler who has joined and say
so (the I/O around :mod:`akv.launch.report`).

It runs on a thread of its own, with an event loop of its own, and asks the scheduler's
``GET /v1/status`` (with the job's token) every :data:`PROGRESS_POLL_S`. It prints the
status page's address at once, then a line each time who has joined changed (from
:data:`PROGRESS_DELAY_S` on, so that a job that assembles at once prints only the last
line), and one line when every process joined; then it stops asking. It gives up quietly
once the job could no longer assemble (the connect timeout and its margin passed: the
scheduler fails the job then, and says why), and never fails the job itself.


Besides, what else akv-launch asks of the job's scheduler, whoever runs the processes
(:func:`akv.launch.supervisor.supervise` or :class:`akv.ray.job.RayJob`): how to reach it
(:func:`client_config`), and telling it of a process seen to fail (:func:`failure_reporter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from akv.cluster.config import Config, from_env, parse_log_level
from akv.cluster.protocol import LAUNCHER_REPORTER
from akv.cluster.roles import scheduler_client
from akv.errors import AKVError
from akv.launch.args import LaunchOptions
from akv.launch.limits import (
    PROGRESS_DELAY_S,
    PROGRESS_POLL_S,
    REPORT_EXIT_S,
    STATUS_REQUEST_TIMEOUT_S,
)
from akv.launch.report import assembled_line, assembly, progress_line
from akv.launch.spec import ProcessSpec
from akv.limits import STARTUP_MARGIN_S

__all__ = [
    "AssemblyWatch",
    "assembly_watch",
    "client_config",
    "failure_reporter",
    "status_url",
]


def status_url(config: Config) -> str:
    """The scheduler's status page, ``http(s)://HOST:PORT/status`` (never with the token)."""
    return f"{config.scheduler_url}/status"


class AssemblyWatch:
    """Says who has joined a job while it assembles (see the module's docstring).

    ``config`` is how this machine reaches the job's scheduler (its address, token and
    TLS); ``progress``: whether to print the progress lines (the launcher's log level is
    INFO or lower), besides the status page's address; ``token_made``: the launcher made the
    job's token (none was exported), which the page's line then says how to know;
    ``launcher``: what the user ran (``akv-launch``, ``akv.ray.launch``), for that line.
    """

    def __init__(
        self,
        config: Config,
        *,
        progress: bool = True,
        token_made: bool = False,
        launcher: str = "akv-launch",
    ) -> None:
        self._config = config
        self._progress = progress
        self._token_made = token_made
        self._launcher = launcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, say: Callable[[str], None]) -> None:
        """Print the status page's address with ``say``, and start watching (on a daemon
        thread); ``say`` must be safe to call from that thread."""
        asks = "it asks for the job's token"
        if self._token_made:  # (never printed: a secret in a log)
            asks += f", made for this job only: export AKV_TOKEN before {self._launcher} to know it"
        say(f"the job's status page: {status_url(self._config)} ({asks})")
        if not self._progress:
            return
        self._thread = threading.Thread(
            target=self._run, args=(say,), name="akv-launch-watch", daemon=True
        )
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop watching: nothing is said from now on; with ``wait``, returns once the
        thread ended (within a poll and a request). The launcher stops it without waiting
        at a process's first exit but a restarted server's (who has joined no longer tells
        how the job is doing: a worker that joined and died counts as not joined), and
        waiting at the end."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(PROGRESS_POLL_S + 2 * STATUS_REQUEST_TIMEOUT_S)

    def _run(self, say: Callable[[str], None]) -> None:
        with contextlib.suppress(Exception):  # a watch never fails the job
            asyncio.run(self._watch(say))

    async def _watch(self, say: Callable[[str], None]) -> None:
        config = self._config
        started = time.monotonic()
        give_up = started + config.timeouts.connect_s + STARTUP_MARGIN_S
        client = scheduler_client(config, STATUS_REQUEST_TIMEOUT_S, retries=0)
        said = ""
        try:
            while not self._stop.is_set() and time.monotonic() < give_up:
                try:
                    status = await client.json("GET", "/v1/status")
                except Exception:  # not listening yet, or not akv's scheduler: ask again
                    status = None
                if status is not None and not self._stop.is_set():
                    state = assembly(status, config.num_workers, config.num_servers)
                    if state.complete:
                        say(assembled_line(state, time.monotonic() - started))
                        return
                    line = progress_line(state)
                    if line != said and time.monotonic() - started >= PROGRESS_DELAY_S:
                        say(line)
                        said = line
                await asyncio.to_thread(self._stop.wait, PROGRESS_POLL_S)
        finally:
            await client.close()


def assembly_watch(
    config: Config | None,
    options: LaunchOptions,
    environ: Mapping[str, str],
    *,
    launcher: str = "akv-launch",
) -> AssemblyWatch | None:
    """The job's :class:`AssemblyWatch` (None when ``config``, how to reach the scheduler,
    is not known here): its progress lines only at the job's log level INFO or lower;
    ``launcher`` as :class:`AssemblyWatch` takes it."""
    if config is None:
        return None
    level = options.log_level or environ.get("AKV_LOG_LEVEL") or "INFO"
    try:
        progress = parse_log_level(level) <= logging.INFO
    except AKVError:
        progress = True  # the processes refuse the level themselves, and say so
    token_made = not environ.get("AKV_TOKEN")
    return AssemblyWatch(config, progress=progress, token_made=token_made, launcher=launcher)


def client_config(specs: Sequence[ProcessSpec]) -> Config | None:
    """How this machine reaches the job's scheduler (the address the servers and workers
    are given, the token, TLS), from a server's or worker's variables (for ``ssh``, those
    of its remote script); None when they cannot be read here."""
    member = next((spec for spec in specs if spec.role != "scheduler"), None)
    if member is None:
        return None
    try:
        return from_env({**member.env, **member.job_env}, role="scheduler")
    except AKVError:
        return None


def failure_reporter(
    config: Config | None, launcher: str = "akv-launch"
) -> Callable[[ProcessSpec, str], None] | None:
    """What tells the job's scheduler that ``launcher`` (what the user ran: ``akv-launch``,
    ``akv.ray.launch``) saw one of its processes fail (a
    worker killed by a signal tells nobody itself; the servers give it
    ``AKV_RECONNECT_GRACE_S`` to come back, and the job may be stopped before then), so that
    the scheduler's verdict names it. None when the scheduler's configuration cannot be
    read here. The report is best effort, bounded by :data:`REPORT_EXIT_S`."""
    if config is None:
        return None

    def report(spec: ProcessSpec, what: str) -> None:
        if spec.rank is None or spec.role == "scheduler":
            return  # an mpirun/srun group: which rank failed is not known here
        body = {
            "reporter": LAUNCHER_REPORTER,
            "role": spec.role,
            "rank": spec.rank,
            "detail": f"{what} (seen by {launcher})",
        }

        async def post() -> None:
            client = scheduler_client(config, REPORT_EXIT_S, retries=0)
            try:
                await client.json("POST", "/v1/lost", body)
            finally:
                await client.close()

        with contextlib.suppress(Exception):  # the scheduler may be gone: nothing to tell
            asyncio.run(asyncio.wait_for(post(), REPORT_EXIT_S))

    return report
