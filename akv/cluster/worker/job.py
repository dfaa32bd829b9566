"""A worker's dealings with the scheduler while it is in the job: heartbeats on a thread of
their own, barriers, who failed first, and the report of its own failure.

I/O only (HTTP to the scheduler, a thread); what follows from the answers is the backend's
and the worker's state's (:mod:`akv.cluster.worker.backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from akv.cluster.membership import Membership, scheduler_refusal
from akv.errors import AKVError, BarrierTimeoutError, PeerLostError
from akv.limits import BLAME_TIMEOUT_S, HEARTBEAT_STOP_S, REPORT_FAILURE_S
from akv_engine import LoopThread
from akv_transport import RemoteError, TransportError

__all__ = ["BROKEN", "Heartbeat", "pass_barrier", "report_failure", "unless", "who_failed"]

log = logging.getLogger("akv.cluster")


class Heartbeat:
    """Runs :meth:`Membership.heartbeats` on a thread and loop of its own, so that a busy
    event loop is never mistaken for a dead worker; ``on_failure(reason)`` hears a failed
    job or a silent scheduler (on that thread). ``report()`` (on that thread too) is what
    each heartbeat carries (the worker's :class:`~akv.cluster.worker.activity.Activity`)."""

    def __init__(
        self,
        membership: Membership,
        on_failure: Callable[[str], None],
        report: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._membership = membership
        self._on_failure = on_failure
        self._report = report
        self._stop = threading.Event()
        self._wake = asyncio.Event()  # set on the heartbeat's loop: the stop is heard at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="akv-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        loop_thread = LoopThread(name="akv-heartbeat-loop")
        self._loop = loop_thread.loop
        try:
            beats = self._membership.heartbeats(
                self._on_failure, self._stop.is_set, self._report, self._wake
            )
            loop_thread.run(beats)
        except Exception as exc:  # reported, never swallowed: the store fails with it
            self._on_failure(f"the heartbeat to the scheduler failed: {exc!r}")
        finally:
            loop_thread.close()

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most a heartbeat request's time)."""
        self._stop.set()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: it stopped already
                loop.call_soon_threadsafe(self._wake.set)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            interval = self._membership.config.timeouts.heartbeat_interval_s
            self._thread.join(interval + HEARTBEAT_STOP_S)


async def pass_barrier(
    membership: Membership, number: int, check: Callable[[], None], broken: asyncio.Event
) -> None:
    """Pass barrier ``number`` once every worker called it (``check()`` raises when the
    store broke, which sets ``broken``: a wait on a scheduler that stopped answering ends
    when the heartbeat finds it lost, not at the request's deadline).

    Raises
    ------
    BarrierTimeoutError
        Naming the workers that never arrived within ``AKV_BARRIER_TIMEOUT_S``.
    PeerLostError, MembershipError, ServerError
        The scheduler refused (the job failed) or did not answer.
    """
    timeout_s = membership.config.timeouts.barrier_s
    deadline = time.monotonic() + timeout_s
    body = {"node_id": membership.node_id, "number": number}
    while True:
        check()
        try:
            answer = await unless(broken, membership.client.json("POST", "/v1/barrier", body))
            if answer is BROKEN:  # the store broke meanwhile
                check()
                raise PeerLostError("the store broke while it waited at a barrier")
        except RemoteError as exc:
            raise scheduler_refusal(exc) from exc
        except TransportError as exc:
            raise PeerLostError(f"the scheduler did not answer a barrier: {exc}") from exc
        if not isinstance(answer, dict):
            raise PeerLostError(f"the scheduler answered a barrier with {answer!r}")
        if "passed" in answer:
            return
        if time.monotonic() > deadline:
            missing = tuple(answer.get("waiting", ()))
            raise BarrierTimeoutError(
                f"barrier {number} timed out after {timeout_s:g} s: "
                f"workers {list(missing)} never arrived",
                missing=missing,
            )


#: What :func:`unless` returns when the store broke first.
BROKEN = object()


async def unless(broken: asyncio.Event, request: Awaitable[Any]) -> Any:
    """``request``'s answer, or :data:`BROKEN` (the request cancelled) once ``broken`` is
    set."""
    answer = asyncio.ensure_future(request)
    waiting = asyncio.ensure_future(broken.wait())
    try:
        done, _ = await asyncio.wait({answer, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not answer.done():
            answer.cancel()
    return answer.result() if answer in done else BROKEN


async def who_failed(
    membership: Membership, server: str, rank: int, error: AKVError, cut: bool
) -> AKVError:
    """What to fail the job with when server ``rank`` (named ``server``) cut its stream
    (``cut``) or refused a request with ``error``: the scheduler's verdict, which names the
    process that failed first (asked within :data:`~akv.limits.BLAME_TIMEOUT_S`; a server
    often only passes the news on), else ``error``."""
    failure = await membership.verdict("server", rank, str(error), cut, BLAME_TIMEOUT_S)
    if failure is None:
        return error
    seen = "ending its stream" if cut else "refusing a request"
    return PeerLostError(f"the job failed: {failure} (this worker saw {server} {seen})")


async def report_failure(
    membership: Membership, rank: int, reason: str, *, left: bool = True
) -> None:
    """Tell the scheduler that this worker (``rank``) left the job (``left``; else: that it
    failed, and is still there) for ``reason``, within :data:`~akv.limits.REPORT_FAILURE_S`
    (a scheduler that does not answer is only logged: the servers still see this worker's
    streams end without a goodbye)."""
    detail = f"left the job: {reason}" if left else f"failed: {reason}"
    try:
        await asyncio.wait_for(
            # (itself: also before it registered, when the scheduler does not know its id)
            membership.report_lost(membership.node_id, "worker", rank, detail, itself=True),
            REPORT_FAILURE_S,
        )
    except (asyncio.TimeoutError, TransportError, AKVError, ValueError) as exc:
        log.warning("worker %d: the scheduler did not take its failure report: %r", rank, exc)
