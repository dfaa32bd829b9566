"""What a hostile peer may hold of an HTTP listener: bounds per connection, no HTTP logic.

A :class:`Connections` (one per listener) makes a :class:`Guard` for each accepted
connection, which stands between it and aiohttp's protocol and guarantees:

* connections that have not authenticated (strangers) never take the place of the job's
  own: who may hold a connection is decided by :class:`akv_transport._admission.Admission`
  (strangers and authenticated connections have separate budgets per address; a new
  connection that finds the strangers' places taken is on probation: it is closed unless
  a request on it passes the token check within ``probation_s``);
* a connection that has not sent a whole request header within ``idle_timeout_s`` of
  opening (or of its last answer) is aborted, however slowly it trickles bytes, and so is
  one whose request body sends nothing for that long;
* a request whose handler takes its time, and an upgraded stream however idle, are never
  cut.

The :func:`track_request` middleware tells the guard when a request's header arrived and
when its handler returned; :func:`authenticate` (called by the token check) that a request
on it carried the token. Each closed connection is one rationed line
(:func:`akv_transport._http_log.log_mistake`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import aiohttp
from aiohttp import web

from akv_transport._admission import Admission, Standing
from akv_transport._http_log import log_mistake
from akv_transport._shm_stream import SharedMemory

__all__ = ["Connections", "Guard", "Handler", "authenticate", "track_request"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Connections:
    """The open connections of one listener: who holds them, by address and standing."""

    def __init__(
        self,
        handlers: Callable[[], asyncio.Protocol],
        idle_timeout_s: float | None,
        admission: Admission[Guard],
        probation_s: float,
    ) -> None:
        self._handlers = handlers  # aiohttp's Server: makes the HTTP protocol of a connection
        self.idle_timeout_s = idle_timeout_s
        self.admission = admission
        self.probation_s = probation_s

    def protocol(self) -> Guard:
        """The protocol factory of the listener."""
        return Guard(self, self._handlers())


class Guard(asyncio.Protocol):
    """Stands between one connection and aiohttp's protocol for it (to which it passes
    every event): has the connection admitted (:class:`Connections`), and closes it when
    its request header is late, its request body stalls, or it is on probation and did
    not authenticate in time. :func:`track_request` tells it when a request's header
    arrived and when its handler returned, :func:`authenticate` when a request on it
    carried the token."""

    def __init__(self, connections: Connections, inner: asyncio.Protocol) -> None:
        self._connections = connections
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.peer = "?"
        self._admitted = False  # aiohttp's protocol has the connection
        self._spoke = False
        self._extended = False  # its probation was extended once
        self._timer: asyncio.TimerHandle | None = None
        self._probation: asyncio.TimerHandle | None = None
        self._crowded = ""  # why it is on probation
        self._waiting_header = False
        self._body: aiohttp.StreamReader | None = None
        self._last_data = 0.0
        #: The memory shared with a peer on this host, until its stream takes it over.
        self.shared: SharedMemory | None = None

    # -------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A full transport (not checked: uvloop's do not derive from asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self.peer = _peer_address(transport)
        decision = self._connections.admission.admit(self, self.peer)
        for evicted in decision.evicted:
            evicted._close_crowded("a newer connection took its place on probation")
        if decision.standing is None:
            log_mistake(
                logging.WARNING,
                self.peer,
                "crowd",
                "closed a connection from %s at once: %s",
                self.peer,
                decision.why,
            )
            self._transport.abort()
            return
        self._admitted = True
        if decision.standing is Standing.PROBATION:
            self._crowded = decision.why
            self._probation = self._loop.call_later(
                self._connections.probation_s, self._probation_over
            )
        timeout = self._connections.idle_timeout_s
        if timeout is not None:
            self._waiting_header = True
            self._start_timer(timeout)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if not self._spoke:
            self._spoke = True
            self._connections.admission.spoke(self)
        if self._body is not None and self._loop is not None:
            self._last_data = self._loop.time()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._end_probation()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._admitted:
            self._connections.admission.release(self)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    # -------------------------------------------------------------- the request cycle

    def authenticated(self) -> bool:
        """A request on this connection passed the token check. False when its address
        holds all the authenticated connections it may (answer it, then close it)."""
        if not self._admitted:
            return True  # not a connection of the listener's (nothing to count)
        if not self._connections.admission.authenticate(self):
            return False
        self._end_probation()
        return True

    def request_started(self, body: aiohttp.StreamReader) -> None:
        """A request's header arrived: from now on only its body may be late."""
        self._waiting_header = False
        self._stop_timer()
        timeout = self._connections.idle_timeout_s
        if timeout is None or body.is_eof() or self._loop is None:
            return
        self._body = body
        self._last_data = self._loop.time()
        self._start_timer(timeout)

    def request_finished(self) -> None:
        """The request's handler returned; aiohttp's keep-alive timer takes over."""
        self._body = None
        self._stop_timer()
        transport = self._transport
        if transport is not None and transport.get_protocol() is not self:
            # It was upgraded to a stream, which ended (or its handler failed): neither
            # this guard nor aiohttp's protocol hears of the connection any more.
            self._connections.admission.release(self)

    def _expired(self) -> None:
        self._timer = None
        timeout = self._connections.idle_timeout_s
        if timeout is None or self._loop is None or self._transport is None:
            return
        if self._waiting_header:
            self._close_idle(f"sent no whole request header within {timeout:g} s")
            return
        body = self._body
        if body is None or body.is_eof():
            return  # the handler has the whole request: its time is its own
        silent = self._loop.time() - self._last_data
        if silent >= timeout:
            self._close_idle(f"sent nothing of its request body for {timeout:g} s")
        else:
            self._start_timer(timeout - silent)

    def _probation_over(self) -> None:
        self._probation = None
        if self._connections.admission.standing(self) is not Standing.PROBATION:
            return
        probation_s = self._connections.probation_s
        if self._spoke and not self._extended and self._loop is not None:
            # Its bytes may be a request whose token check has not run yet (a loop that
            # was held up runs this timer before the handler): once, wait as long again.
            self._extended = True
            self._probation = self._loop.call_later(probation_s, self._probation_over)
            return
        self._close_crowded(f"it sent no request with the token within {probation_s:g} s")

    def _close_idle(self, why: str) -> None:
        log_mistake(
            logging.INFO, self.peer, "idle", "closed a connection from %s: it %s", self.peer, why
        )
        if self._transport is not None:
            self._transport.abort()

    def _close_crowded(self, why: str) -> None:
        """Close a connection on probation (``why``: what ended it)."""
        log_mistake(
            logging.WARNING,
            self.peer,
            "crowd",
            "closed a connection from %s, on probation since %s: %s",
            self.peer,
            self._crowded,
            why,
        )
        self._end_probation()
        if self._transport is not None:
            self._transport.abort()

    def _start_timer(self, delay_s: float) -> None:
        assert self._loop is not None  # set by connection_made, before any timer
        self._timer = self._loop.call_later(delay_s, self._expired)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end_probation(self) -> None:
        if self._probation is not None:
            self._probation.cancel()
            self._probation = None


def authenticate(request: web.Request) -> bool:
    """Tell the connection's :class:`Guard` that ``request`` passed the token check: the
    connection is authenticated from now on. False when its address holds all the
    authenticated connections it may (the caller refuses the request and closes it)."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    return guard.authenticated() if isinstance(guard, Guard) else True


@web.middleware
async def track_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection's :class:`Guard` that a request's header arrived, and when
    its handler returned (:func:`akv_transport.serve` puts it first in every app)."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, Guard):
        return await handler(request)
    guard.request_started(request.content)
    try:
        return await handler(request)
    finally:
        guard.request_finished()


def _peer_address(transport: asyncio.BaseTransport) -> str:
    peername = transport.get_extra_info("peername")
    if isinstance(peername, (tuple, list)) and peername:
        return str(peername[0])
    return str(peername) if peername else "?"
