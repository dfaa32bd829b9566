"""How a worker's frames reach the server and its replies go back: its stream
(:class:`StreamLink`) or the response to its single request (:class:`OneShotLink`).

Thin: a stream link asks the server's state where each frame's payloads land and hands each
message to the server; it decides nothing.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Protocol

from akv.cluster.config import Config
from akv.cluster.server.buffers import Landing
from akv.cluster.server.instructions import Peer
from akv.cluster.server.state import ServerState
from akv.limits import MAX_PAYLOAD_BYTES
from akv_transport import (
    DISCARD,
    Destination,
    FrameHeader,
    InPlace,
    Message,
    StreamProtocol,
    byte_view,
)

__all__ = ["Link", "LinkedServer", "OneShotLink", "StreamLink"]


class Link(Protocol):
    """Where a peer's replies go: its stream, or the response to its single request."""

    @property
    def closing(self) -> bool: ...

    def send(self, buffers: list[Any]) -> None: ...

    def send_soon(self, frame: bytes) -> None: ...

    def when_drained(self, callback: Callable[[BaseException | None], None]) -> None: ...


class LinkedServer(Protocol):
    """What a stream link needs of the server: its state (where payloads land), where
    messages and lost streams go, and its configuration (the streams' keepalive)."""

    state: ServerState
    config: Config

    def message(self, peer: Peer, message: Message, landing: Landing) -> None: ...

    def lost(self, peer: Peer, exc: BaseException | None) -> None: ...


class StreamLink:
    """One worker's stream to this server: frames in to the state, replies out."""

    def __init__(self, server: LinkedServer, peer: Peer) -> None:
        self.server = server
        self.peer = peer
        # Frames complete in the order their headers arrived: each landing is taken by the
        # next message (a resent request may repeat a number another frame still uses).
        self._landings: collections.deque[Landing] = collections.deque()
        self.protocol = StreamProtocol(
            self._destinations,
            self._on_message,
            self._on_lost,
            max_payload_bytes=MAX_PAYLOAD_BYTES,
            keepalive=server.config.timeouts.keepalive,
        )

    @property
    def closing(self) -> bool:
        return self.protocol.closing

    def send(self, buffers: list[Any]) -> None:
        self.protocol.write(buffers)

    def send_soon(self, frame: bytes) -> None:
        self.protocol.write_soon(frame)

    def when_drained(self, callback: Callable[[BaseException | None], None]) -> None:
        self.protocol.when_drained(callback)

    def _destinations(self, header: FrameHeader) -> list[Destination]:
        """Where the frame's payloads go, as the state decided: buffers it chose, and
        DISCARD for the rest (a refused frame's payload is read and dropped, never given
        memory)."""
        landing = self.server.state.header_arrived(self.peer, header)
        self._landings.append(landing)
        in_place = landing.read_in_place and self.protocol.shared is not None
        return [
            DISCARD if b is None else InPlace(byte_view(b)) if in_place else byte_view(b)
            for b in landing.buffers
        ]

    def _on_message(self, message: Message) -> None:
        landing = self._landings.popleft()
        if message.borrowed:
            borrowed = message.borrowed
            landing.lend(message.buffers, lambda: self.protocol.give_back(borrowed))
        self.server.message(self.peer, message, landing)

    def _on_lost(self, exc: BaseException | None) -> None:
        self.server.lost(self.peer, exc)


class OneShotLink:
    """A single frame that came in an HTTP body; its reply is the response body."""

    closing = False

    def __init__(self) -> None:
        self.reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def send(self, buffers: list[Any]) -> None:
        if not self.reply.done():
            self.reply.set_result(b"".join(bytes(b) for b in buffers))

    def send_soon(self, frame: bytes) -> None:
        self.send([frame])

    def when_drained(self, callback: Callable[[BaseException | None], None]) -> None:
        callback(None)
