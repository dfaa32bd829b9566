"""A framed stream over one TCP (or TLS) connection: the bulk path for arrays.

The connection starts as HTTP: the client sends an authenticated ``GET`` with
``Upgrade: akv-stream/1`` and the server (an aiohttp handler) answers ``101 Switching
Protocols``; from then on both sides exchange frames (:mod:`akv_transport.frame`).
:class:`StreamProtocol` is the thin asyncio side of it: a ``BufferedProtocol`` whose
buffers come from a :class:`~akv_transport._reader.FrameReader`, so that large payloads are
received straight into the arrays they belong to, and whose writes are zero-copy
(``writelines`` of memoryviews) with an exact "drained" signal.

Both ends may run a liveness clock (:mod:`akv_transport._liveness`): an end that has written
nothing for a while sends a keepalive, and an end that has received nothing for
``silent_s`` cuts the stream (``on_lost`` gets a :class:`~akv_transport.errors.StreamSilentError`),
as a reset would. The server's settings govern the pair: its upgrade answer names them
(:data:`KEEPALIVE_HEADER`) and the client adopts them, so the two ends cannot disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from akv_transport._liveness import Due, KeepAlive, LivenessClock
from akv_transport._reader import Destinations, FrameReader, Message, ReaderStatistics
from akv_transport._shm_stream import SharedMemory
from akv_transport.errors import (
    AuthError,
    FrameError,
    RemoteError,
    StreamSilentError,
    TransportError,
)
from akv_transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, KEEPALIVE_FRAME

__all__ = [
    "HANDSHAKE_MAX_BYTES",
    "KEEPALIVE_HEADER",
    "UPGRADE_PROTOCOL",
    "AskAgain",
    "StreamProtocol",
]

log = logging.getLogger("akv_transport.stream")

#: The protocol name in the ``Upgrade`` header.
UPGRADE_PROTOCOL = "akv-stream/1"
#: The header of the server's upgrade answer that names the stream's liveness settings,
#: ``interval=<s>; silent=<s>`` (absent: the server runs none, and neither does a client
#: that adopts the server's).
KEEPALIVE_HEADER = "AKV-Keepalive"
#: Largest HTTP answer the client reads while upgrading.
HANDSHAKE_MAX_BYTES = 64 << 10


class StreamProtocol(asyncio.BufferedProtocol):
    """One end of a framed stream.

    ``on_message(message)`` is called on the loop for each complete message, in order.
    ``on_lost(exc)`` once when the connection ends (``exc`` None for a clean close), also
    when it ends before :meth:`connection_made` (a server's stream whose upgrade failed);
    a client's stream (``handshake``) reports its end only once :func:`open_stream` has
    returned it (a stream that ends before is its caller's error, not a loss).
    ``destinations(header)`` chooses where each array's payload is received.

    ``check_answer(status, headers)`` (a client's, headers by lower-case name) judges the
    server's upgrade answer first: an error it returns fails the handshake.

    ``keepalive``: the liveness this end runs (:mod:`akv_transport._liveness`; None: none).
    A client's is also the bound on the wait for the server's upgrade answer (nothing at
    all for ``silent_s``: the attempt fails), and with ``adopt_keepalive`` it is replaced
    by what the server's answer names.
    """

    def __init__(
        self,
        destinations: Destinations,
        on_message: Callable[[Message], None],
        on_lost: Callable[[BaseException | None], None],
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        handshake: bool = False,
        keepalive: KeepAlive | None = None,
        adopt_keepalive: bool = False,
        check_answer: Callable[[int, Mapping[str, str]], TransportError | None] | None = None,
    ) -> None:
        self._reader = FrameReader(destinations, max_payload_bytes=max_payload_bytes)
        self._on_message = on_message
        self._on_lost = on_lost
        #: The liveness settings this end runs (None: none).
        self.keepalive = keepalive
        self._adopt_keepalive = adopt_keepalive
        self._clock: LivenessClock | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._time: Callable[[], float] | None = None
        #: Whether the end is reported (a client's only once open_stream returned it).
        self._announce = not handshake
        #: The connection ended (and why): reported once, whatever ends it first.
        self._ended = False
        self._end_cause: BaseException | None = None
        #: close() or abort() came before connection_made: done there.
        self._close_requested = False
        self.transport: asyncio.Transport | None = None
        self._paused = False
        self._drain_waiters: list[Callable[[BaseException | None], None]] = []
        self._closed: asyncio.Future[BaseException | None] | None = None
        self._handshake: bytearray | None = bytearray() if handshake else None
        self._handshake_buffer = bytearray(HANDSHAKE_MAX_BYTES)
        self.handshake_done: asyncio.Future[None] | None = None
        self._check_answer = check_answer
        #: Bytes of an answer's body still to skip (see :meth:`ask_again`).
        self._skip = 0
        #: The memory shared with the peer on this host (None: every byte on the socket).
        self.shared: SharedMemory | None = None
        # Regions of the peer's arena to give back (by release frames), and small frames
        # that may wait: they go with the next frame written, or at the end of the loop turn
        # (fewer writes, and fewer wake-ups of the peer).
        self._releases: list[int] = []
        self._soon: list[bytes] = []
        self._flush: asyncio.Handle | None = None

    def share(self, shared: SharedMemory) -> None:
        """Carry large payloads through ``shared`` (which the stream owns and closes from
        now on). Call before the first frame."""
        self.shared = shared
        self._reader.arena = shared.peer_view()
        self._reader.shared = True

    def statistics(self) -> ReaderStatistics:
        """The counters of what this end received (see :class:`~akv_transport.ReaderStatistics`)."""
        return self._reader.statistics()

    def give_back(self, offsets: Sequence[int]) -> None:
        """Give back regions of the peer's arena that messages lent (their
        :attr:`~akv_transport.Message.borrowed` offsets), once their views were read: a release
        frame naming them goes with the next frame written, at the latest at the end of
        this loop turn. Call on the stream's loop; nothing is sent once the connection is
        closing (the peer's arena goes with it)."""
        if offsets:
            self._queue_releases(offsets)

    def write_soon(self, frame: bytes) -> None:
        """Queue a small ``frame`` that need not go at once: it is written with the next
        frame (before it), at the latest at the end of this loop turn, so that what a
        turn produces of these takes one write. Frames keep their order. Call on the
        stream's loop; raises :class:`TransportError` once the stream is closed."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise TransportError("the stream is closed")
        self._soon.append(frame)
        self._flush_soon()

    def _queue_releases(self, offsets: Sequence[int]) -> None:
        """Give ``offsets`` back by a release frame written with the next frame, at the
        latest at the end of this loop turn. ``offsets`` may be cleared once this returns."""
        self._releases.extend(offsets)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._flush_pending)

    def _pending(self) -> list[bytes]:
        """The releases and small frames waiting to go (now taken: the caller writes them)."""
        pending = SharedMemory.release_frames(self._releases) if self._releases else []
        if self._soon:
            pending.extend(self._soon)
            self._soon.clear()
        return pending

    def _flush_pending(self) -> None:
        self._flush = None
        pending = self._pending()
        transport = self.transport
        if pending and transport is not None and not transport.is_closing():
            transport.writelines(pending)
            self._note_sent()

    def _note_sent(self) -> None:
        clock = self._clock
        if clock is not None and self._time is not None:
            clock.sent(self._time())

    # -------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection always gets a full transport. No isinstance check: uvloop's
        # transports have every method of asyncio.Transport without deriving from it.
        stream = cast(asyncio.Transport, transport)
        self.transport = stream
        loop = asyncio.get_running_loop()
        if self._closed is None:
            self._closed = loop.create_future()
        if self._handshake is not None:
            self.handshake_done = loop.create_future()
        # With a high-water mark of 0 every write the kernel did not take at once pauses us,
        # and resume_writing() comes exactly when the buffer is empty again: an exact
        # "these buffers are no longer referenced" signal for zero-copy sends.
        stream.set_write_buffer_limits(high=0, low=0)
        if self._ended or self._close_requested:
            # Replaced (or refused) before the connection was handed over: close it now.
            stream.close()
            return
        if self.keepalive is not None:
            # A client waiting for the upgrade answer sends nothing: it only times silence.
            self._time = loop.time
            self._clock = LivenessClock(
                self.keepalive, loop.time(), sending=self._handshake is None
            )
            self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._handshake is not None:
            return memoryview(self._handshake_buffer)
        return self._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        clock = self._clock
        if clock is not None and self._time is not None:
            clock.received(self._time())
        if self._handshake is not None:
            self._handshake_received(nbytes)
            return
        try:
            messages = self._reader.buffer_updated(nbytes)
        except FrameError as exc:
            self._refuse(exc)
            return
        shared = self.shared
        if shared is not None:
            reader = self._reader
            try:
                if reader.given_back:
                    shared.given_back(reader.given_back)
            except FrameError as exc:
                self._refuse(exc)
                return
            if reader.to_give_back:
                self._queue_releases(reader.to_give_back)
                reader.to_give_back.clear()
        for message in messages:
            self._on_message(message)

    def eof_received(self) -> bool | None:
        try:
            self._reader.eof()
        except FrameError as exc:
            self.abort(exc)
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        """The connection ended; also called by :func:`~akv_transport.stream_route` for a
        stream whose upgrade failed before :meth:`connection_made`."""
        self._paused = False
        self._stop_clock()
        if self.shared is not None:
            self._reader.arena = None
            self.shared.close()
        self._wake_drain_waiters(exc)
        self._end(exc)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain_waiters(None)

    # -------------------------------------------------------------- sending

    def write(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Queue ``buffers`` in order (not copied: keep them unchanged until :meth:`drain`)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise TransportError("the stream is closed")
        if self.shared is not None:
            placed = self.shared.place(buffers)
            if placed is not None:
                buffers = placed
        if self._releases or self._soon:
            buffers = [*self._pending(), *buffers]
        if len(buffers) == 1:
            transport.write(buffers[0])
        else:
            transport.writelines(buffers)
        self._note_sent()

    def when_drained(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(None)`` once everything written so far has been handed to the
        kernel (at once if it has), or ``callback(error)`` if the connection is lost first."""
        if not self._paused:
            callback(None)
        else:
            self._drain_waiters.append(callback)

    async def drain(self) -> None:
        """Return once everything written so far has been handed to the kernel."""
        if not self._paused:
            return
        waiter = asyncio.get_running_loop().create_future()

        def wake(exc: BaseException | None) -> None:
            if waiter.done():
                return
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

        self._drain_waiters.append(wake)
        await waiter

    def _wake_drain_waiters(self, exc: BaseException | None) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        error = None if exc is None else TransportError(f"the stream was lost: {exc}")
        for waiter in waiters:
            waiter(error)

    # -------------------------------------------------------------- closing

    @property
    def closing(self) -> bool:
        """True once the connection is closing or closed (and before it is made)."""
        return self._ended or self.transport is None or self.transport.is_closing()

    async def wait_closed(self) -> BaseException | None:
        """Wait until the connection is gone; return what ended it (None: a clean close)."""
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
            if self._ended:
                self._closed.set_result(self._end_cause)
        return await asyncio.shield(self._closed)

    def close(self) -> None:
        """Close after the queued writes are sent; before :meth:`connection_made`, at once
        when it comes (a stream replaced before it was handed over)."""
        if self.transport is None:
            self._close_requested = True
        elif not self.transport.is_closing():
            self.transport.close()

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the connection at once (after a protocol error ``exc``, which ``on_lost``
        gets)."""
        self._stop_clock()
        if self.transport is not None:
            self.transport.abort()
        else:
            self._close_requested = True
        if exc is not None:
            self._end(exc)

    def _refuse(self, exc: FrameError) -> None:
        """The peer broke the protocol: say so in the log (nobody else may), and cut."""
        log.warning("%s: %s; closing the stream", self._peer_name(), exc)
        self.abort(exc)

    def _peer_name(self) -> str:
        transport = self.transport
        peer = None if transport is None else transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[0], peer[1]
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            return f"the stream with {where}"
        return "a local stream" if self.shared is not None else "a stream"

    def _end(self, exc: BaseException | None) -> None:
        """The connection ended (``exc``: why): fail the handshake if it was under way,
        wake wait_closed(), and report the end once (when reported at all)."""
        if self._ended:
            return
        self._ended = True
        self._end_cause = exc
        self._stop_clock()
        handshake = self.handshake_done
        if handshake is not None and not handshake.done():
            error = exc if isinstance(exc, TransportError) else None
            handshake.set_exception(
                error or TransportError(f"connection closed during the stream handshake: {exc}")
            )
            handshake.exception()  # retrieved: open_stream may have given up on it already
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(exc)
        if self._announce:
            self._on_lost(exc)

    def _handed_out(self) -> bool:
        """:func:`open_stream` returns this stream: its end is reported from now on.
        False when it ended already (then nothing is, and open_stream fails)."""
        if self._ended:
            return False
        self._announce = True
        return True

    # -------------------------------------------------------------- liveness

    def _arm(self) -> None:
        clock = self._clock
        if clock is not None and not self._ended:
            self._timer = asyncio.get_running_loop().call_at(clock.next_check, self._check)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._clock = None

    def _check(self) -> None:
        self._timer = None
        clock = self._clock
        transport = self.transport
        if clock is None or transport is None or self._time is None:
            return
        now = self._time()
        due = clock.poll(now)
        if due is Due.CUT:
            keepalive = clock.keepalive
            error = StreamSilentError(
                f"no answer for {clock.silence(now):.1f} s: the stream is silent (a live "
                f"peer sends something at least every {keepalive.interval_s:g} s; the "
                f"limit is {keepalive.silent_s:g} s)"
            )
            log.warning("%s: %s; cutting it", self._peer_name(), error)
            self.abort(error)
            return
        if due is Due.KEEPALIVE:
            if not transport.is_closing():
                self._soon.append(KEEPALIVE_FRAME)
                self._flush_pending()
            clock.sent(now)
        self._arm()

    # -------------------------------------------------------------- client handshake

    def _handshake_received(self, nbytes: int) -> None:
        assert self._handshake is not None and self.handshake_done is not None
        self._handshake += self._handshake_buffer[:nbytes]
        if self._skip:  # the body of an answer that asked again
            cut = min(self._skip, len(self._handshake))
            del self._handshake[:cut]
            self._skip -= cut
            if not self._handshake:
                return
        if self.handshake_done.done():
            self._fail_handshake(TransportError("the server answered before it was asked"))
            return
        end = self._handshake.find(b"\r\n\r\n")
        if end < 0:
            if len(self._handshake) >= HANDSHAKE_MAX_BYTES:
                self._fail_handshake(TransportError("the server's upgrade answer is too long"))
            return
        head = bytes(self._handshake[:end]).decode("latin-1")
        rest = bytes(self._handshake[end + 4 :])
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        try:
            status = int(parts[1])
        except (IndexError, ValueError):
            self._fail_handshake(TransportError(f"not an HTTP answer: {status_line!r}"))
            return
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        refused = self._check_answer(status, headers) if self._check_answer else None
        if isinstance(refused, AskAgain) and self._may_ask_again(headers, len(rest)):
            self._handshake = bytearray()
            self.handshake_done.set_exception(refused)
            self.handshake_done.exception()  # retrieved: open_stream may have given up
            return
        if refused is not None:
            self._fail_handshake(refused)
            return
        if status != 101:
            self._fail_handshake(_refusal(status, parts[2] if len(parts) > 2 else "", rest))
            return
        if headers.get("upgrade", "").lower() != UPGRADE_PROTOCOL:
            self._fail_handshake(
                TransportError(f"the server upgraded to {headers.get('upgrade')!r}")
            )
            return
        keepalive = self.keepalive
        if self._adopt_keepalive:
            try:
                keepalive = parse_keepalive(headers.get(KEEPALIVE_HEADER.lower()))
            except ValueError as exc:
                self._fail_handshake(TransportError(f"the server's upgrade answer: {exc}"))
                return
        self._handshake = None
        self._start_liveness(keepalive)
        self.handshake_done.set_result(None)
        if rest:
            self._feed(rest)

    def _may_ask_again(self, headers: Mapping[str, str], received: int) -> bool:
        """Whether an answer that asks again keeps the connection for the next request:
        then its body (``received`` bytes of it here) is skipped as it arrives."""
        length = headers.get("content-length", "")
        if headers.get("connection", "").lower() == "close" or not length.isdigit():
            return False
        if received > int(length) or self.transport is None or self.transport.is_closing():
            return False
        self._skip = int(length) - received
        return True

    def ask_again(self, request: bytes) -> None:
        """After an answer that asked again (:class:`AskAgain`), send ``request`` on the same
        connection and wait for its answer in a new :attr:`handshake_done`."""
        assert self._handshake is not None and self.transport is not None
        self.handshake_done = asyncio.get_running_loop().create_future()
        self.transport.write(request)

    def _start_liveness(self, keepalive: KeepAlive | None) -> None:
        """The stream is up: run ``keepalive`` from now on (None: no liveness)."""
        self._stop_clock()
        self.keepalive = keepalive
        if keepalive is not None and self.transport is not None:
            loop = asyncio.get_running_loop()
            self._time = loop.time
            self._clock = LivenessClock(keepalive, loop.time())
            self._arm()

    def upgrade_headers(self) -> dict[str, str]:
        """The headers a server's upgrade answer carries for this stream: its liveness
        settings (:data:`KEEPALIVE_HEADER`), which the client adopts."""
        if self.keepalive is None:
            return {}
        return {KEEPALIVE_HEADER: format_keepalive(self.keepalive)}

    def _feed(self, data: bytes) -> None:
        """Hand bytes that arrived together with the handshake to the frame reader."""
        view = memoryview(data)
        while view:
            buffer = self._reader.get_buffer(len(view))
            count = min(len(buffer), len(view))
            buffer[:count] = view[:count]
            view = view[count:]
            self.buffer_updated(count)

    def _fail_handshake(self, exc: BaseException) -> None:
        assert self.handshake_done is not None
        if not self.handshake_done.done():
            self.handshake_done.set_exception(exc)
            self.handshake_done.exception()  # retrieved: open_stream may have given up
        self._stop_clock()
        if self.transport is not None:
            self.transport.abort()


def format_keepalive(keepalive: KeepAlive) -> str:
    """The value of :data:`KEEPALIVE_HEADER` for ``keepalive``."""
    return f"interval={keepalive.interval_s!r}; silent={keepalive.silent_s!r}"


def parse_keepalive(value: str | None) -> KeepAlive | None:
    """The settings a :data:`KEEPALIVE_HEADER` value names (None for no header).

    Raises :class:`ValueError` for a value that is not ``interval=<s>; silent=<s>`` with
    settings :class:`KeepAlive` accepts.
    """
    if value is None:
        return None
    fields = {}
    for part in value.split(";"):
        name, sep, number = part.partition("=")
        try:
            fields[name.strip()] = float(number) if sep else None
        except ValueError:
            fields[name.strip()] = None
    interval, silent = fields.get("interval"), fields.get("silent")
    if interval is None or silent is None or len(fields) != 2:
        raise ValueError(f"{KEEPALIVE_HEADER}: {value!r} is not 'interval=<s>; silent=<s>'")
    return KeepAlive(interval, silent)


def _refusal(status: int, reason: str, body: bytes) -> TransportError:
    text = body.decode("utf-8", "replace").strip()[:500]
    with contextlib.suppress(ValueError):
        said = json.loads(text)
        if isinstance(said, dict) and isinstance(said.get("error"), str):
            text = said["error"]  # the server's words, not its JSON
    message = f"HTTP {status} {reason}".strip() + (f": {text}" if text else "")
    if status == 401:
        return AuthError(message)
    return RemoteError(status, message)


class AskAgain(TransportError):
    """A client's ``check_answer`` verdict: the server refused the upgrade in a way that
    another request may mend (it named the instance to sign for). On a connection the
    server keeps, :meth:`StreamProtocol.ask_again` sends it; else a new connection."""
