"""The stream from a worker to one server: requests out, replies matched back.

The I/O half of :class:`~akv.dist.worker.requests.RequestTable`: it opens the stream,
writes request frames, feeds replies to the table and delivers what the table decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from akv.dist.config import Config, format_address
from akv.dist.protocol import CLIENT_HEADER, client_header
from akv.dist.roles import client_ssl
from akv.dist.worker.requests import OnReply, Outcome, RequestTable
from akv.errors import AKVError, PeerLostError
from akv.limits import MAX_PAYLOAD_BYTES
from transport import Message, StreamProtocol, TransportError, encode_frame, open_stream

__all__ = ["ServerLink"]


class ServerLink:
    """This worker's stream to server ``rank`` at ``host:port``.

    ``on_trouble(link, error, cut)`` is called when the stream ends without :meth:`close`
    (``cut``), or when the server answers that the job failed. Either way the requests
    concerned, and those sent from then on, stay pending until the backend fails them with
    :meth:`fail_all` (naming whoever the scheduler says failed first: the server that cut
    the stream or refused the request may only be passing the news on), or their deadline
    passes.
    """

    def __init__(
        self,
        rank: int,
        host: str,
        port: int,
        on_trouble: Callable[[ServerLink, AKVError, bool], None],
    ) -> None:
        self.rank = rank
        self.host = host
        self.port = port
        self.name = f"server {rank} at {format_address(host, port)}"
        self.lost: AKVError | None = None
        self.closing = False
        self._report = on_trouble
        self._table = RequestTable(self.name)
        #: Requests a server refused because the job failed, held for the backend's verdict.
        self._held: list[Outcome] = []
        #: The stream (None until :meth:`open`).
        self.protocol: StreamProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self, config: Config, worker: int, store_type: str) -> None:
        """Connect and authenticate as worker ``worker`` of a ``store_type`` store.

        Raises the transport's ``AuthError``, ``RemoteError`` or ``TransportError``.
        """
        self._loop = asyncio.get_running_loop()
        self.protocol = await open_stream(
            self.host,
            self.port,
            config.token,
            self._table.destinations,
            self._on_message,
            self._on_lost,
            ssl_context=client_ssl(config),
            timeout_s=config.timeouts.connect_s,
            max_payload_bytes=MAX_PAYLOAD_BYTES,
            headers={CLIENT_HEADER: client_header(worker, store_type)},
        )

    def _on_message(self, message: Message) -> None:
        outcome = self._table.reply(message)
        if outcome is None:
            return
        if isinstance(outcome.error, PeerLostError) and not self.closing:
            self._held.append(outcome)  # the job failed: nothing will work
            self._report(self, outcome.error, False)
            return
        outcome.deliver()

    def _on_lost(self, exc: BaseException | None) -> None:
        detail = f": {exc!r}" if exc else ""
        self.lost = PeerLostError(f"{self.name} closed the connection{detail} (did it die?)")
        if self.closing:
            self.fail_all(self.lost)
        else:
            self._report(self, self.lost, True)

    @property
    def requests_sent(self) -> int:
        """How many requests this link has sent (for statistics and tests)."""
        return self._table.sent

    def fail_all(self, error: AKVError) -> None:
        """Fail every outstanding (and held) request with ``error``."""
        held, self._held = self._held, []
        _deliver([Outcome(o.request, None, error) for o in held] + self._table.fail_all(error))

    def sweep(self, now: float) -> None:
        """Fail the requests whose deadline (loop time) passed."""
        _deliver(self._table.sweep(now))

    def send(
        self,
        op: int,
        arrays: Sequence[tuple[Any, np.ndarray, int]],
        on_reply: OnReply,
        *,
        text: str = "",
        destinations: list[memoryview] | None = None,
        timeout_s: float,
    ) -> None:
        """Send one request now; ``on_reply`` gets the reply or the error, exactly once.

        With ``destinations``, the reply's arrays are received straight into them. The
        deadline is enforced by :meth:`sweep`, which the backend runs periodically.
        """
        if self.lost is not None and self._loop is not None and not self.closing:
            # Cut: parked until the backend knows whom to blame (or the deadline passes).
            self._table.add(op, on_reply, destinations, self._loop.time() + timeout_s)
            return
        if self.lost is not None:
            on_reply(None, self.lost)
            return
        if self.protocol is None or self._loop is None:
            on_reply(None, PeerLostError(f"{self.name}: the stream was never opened"))
            return
        seq = self._table.add(op, on_reply, destinations, self._loop.time() + timeout_s)
        try:
            self.protocol.write(encode_frame(op, seq, arrays, text=text))
        except TransportError as exc:
            # The stream is gone (its loss may not have been reported yet): the request
            # waits with the others for the backend's verdict.
            if self.lost is None:
                self._on_lost(exc)

    async def request(
        self,
        op: int,
        arrays: Sequence[tuple[Any, np.ndarray, int]] = (),
        *,
        text: str = "",
        timeout_s: float,
    ) -> Message:
        """:meth:`send` and wait for the reply (for the less frequent control requests)."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        def on_reply(message: Message | None, error: AKVError | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            elif message is not None:
                future.set_result(message)

        self.send(op, arrays, on_reply, text=text, timeout_s=timeout_s)
        return await future

    def close(self) -> None:
        """Close the stream (no loss is reported for it)."""
        self.closing = True
        if self.protocol is not None:
            self.protocol.close()


def _deliver(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        outcome.deliver()
