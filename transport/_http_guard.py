"""What a hostile peer may hold of an HTTP listener: bounds per connection, no HTTP logic.

A :class:`Connections` (one per listener) makes a :class:`Guard` for each accepted
connection, which stands between it and aiohttp's protocol and guarantees:

* one IP address holds at most ``max_per_peer`` connections at once, upgraded streams
  included; one more is aborted as soon as it is accepted;
* a connection that has not sent a whole request header within ``idle_timeout_s`` of
  opening (or of its last answer) is aborted, however slowly it trickles bytes, and so is
  one whose request body sends nothing for that long;
* a request whose handler takes its time, and an upgraded stream however idle, are never
  cut.

The :func:`track_request` middleware tells the guard when a request's header arrived and
when its handler returned. Each closed connection is one rationed line
(:func:`transport._http_log.log_mistake`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import aiohttp
from aiohttp import web

from transport._http_log import log_mistake
from transport._shm_stream import SharedMemory

__all__ = ["Connections", "Guard", "Handler", "track_request"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Connections:
    """The open connections of one listener: how many each peer address holds."""

    def __init__(
        self,
        handlers: Callable[[], asyncio.Protocol],
        idle_timeout_s: float | None,
        max_per_peer: int | None,
    ) -> None:
        self._handlers = handlers  # aiohttp's Server: makes the HTTP protocol of a connection
        self.idle_timeout_s = idle_timeout_s
        self.max_per_peer = max_per_peer
        self.per_peer: dict[str, int] = {}

    def protocol(self) -> Guard:
        """The protocol factory of the listener."""
        return Guard(self, self._handlers())

    def admit(self, peer: str) -> bool:
        """Count a new connection of ``peer``; False (and not counted) past the limit."""
        count = self.per_peer.get(peer, 0)
        if self.max_per_peer is not None and count >= self.max_per_peer:
            log_mistake(
                logging.WARNING,
                peer,
                "crowd",
                "closed a connection from %s at once: it holds %d already, the most one "
                "address may",
                peer,
                count,
            )
            return False
        self.per_peer[peer] = count + 1
        return True

    def release(self, peer: str) -> None:
        count = self.per_peer.get(peer, 0) - 1
        if count > 0:
            self.per_peer[peer] = count
        else:
            self.per_peer.pop(peer, None)


class Guard(asyncio.Protocol):
    """Stands between one connection and aiohttp's protocol for it (to which it passes
    every event): counts the connection against its peer, and closes it when its request
    header is late or its request body stalls. :func:`track_request` tells it when a
    request's header arrived and when its handler returned."""

    def __init__(self, connections: Connections, inner: asyncio.Protocol) -> None:
        self._connections = connections
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.peer = "?"
        self._counted = False
        self._timer: asyncio.TimerHandle | None = None
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
        if not self._connections.admit(self.peer):
            self._transport.abort()
            return
        self._counted = True
        timeout = self._connections.idle_timeout_s
        if timeout is not None:
            self._waiting_header = True
            self._start_timer(timeout)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._body is not None and self._loop is not None:
            self._last_data = self._loop.time()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._counted:
            self._release()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._counted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._counted:
            self._inner.resume_writing()

    # -------------------------------------------------------------- the request cycle

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
        if self._counted and transport is not None and transport.get_protocol() is not self:
            # It was upgraded to a stream, which ended (or its handler failed): neither
            # this guard nor aiohttp's protocol hears of the connection any more.
            self._release()

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

    def _close_idle(self, why: str) -> None:
        log_mistake(
            logging.INFO, self.peer, "idle", "closed a connection from %s: it %s", self.peer, why
        )
        if self._transport is not None:
            self._transport.abort()

    def _start_timer(self, delay_s: float) -> None:
        assert self._loop is not None  # set by connection_made, before any timer
        self._timer = self._loop.call_later(delay_s, self._expired)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._connections.release(self.peer)


@web.middleware
async def track_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection's :class:`Guard` that a request's header arrived, and when
    its handler returned (:func:`transport.serve` puts it first in every app)."""
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
