"""Messages with file descriptors over a Unix stream socket: the framing, without I/O,
blocking :func:`send_fds` / :func:`recv_fds`, and :func:`recv_message` (one message on an
event loop, for a handshake).

A message is an 8-byte header, then ``nbytes`` of data::

    <I nbytes> <H nfds> <H flags = 0>

and its ``nfds`` file descriptors travel as one ``SCM_RIGHTS`` control message attached to the
``sendmsg`` that carries the header's first byte. The kernel hands them out with the
``recvmsg`` that reads that byte (Linux never lets one ``recvmsg`` read past a segment that
carried descriptors), so a receiver has every descriptor of a message by the time it has the
message's first byte. :class:`MessageParser` checks exactly that, and refuses descriptors that
arrive with no message to carry them.

Descriptors are received close-on-exec (``MSG_CMSG_CLOEXEC``, so that a concurrent
``fork``/``exec`` never inherits them) and the receiver owns them: every path that refuses a
message closes what came with it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from akv_transport.errors import FrameError, TransportError

__all__ = [
    "DEFAULT_MAX_FDS_PER_MESSAGE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "HEADER_BYTES",
    "MAX_FDS_PER_MESSAGE",
    "ExactReader",
    "MessageParser",
    "ShmMessage",
    "close_fds",
    "decode_header",
    "encode_header",
    "readable",
    "recv_fds",
    "recv_message",
    "send_fds",
]

#: Data bytes one message may carry unless told otherwise (control messages: small).
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
#: Descriptors one message may carry unless told otherwise.
DEFAULT_MAX_FDS_PER_MESSAGE = 16
#: The kernel's own bound on descriptors in one ``SCM_RIGHTS`` message (Linux ``SCM_MAX_FD``).
MAX_FDS_PER_MESSAGE = 253

_HEADER = struct.Struct("<IHH")
#: Size of a message's header.
HEADER_BYTES = _HEADER.size
_FD_BYTES = array.array("i").itemsize
#: Received descriptors are close-on-exec from the start where the platform allows it.
_RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


@dataclass(frozen=True)
class ShmMessage:
    """One message: its data and the descriptors that came with it.

    The receiver owns ``fds``: it must close each one, or hand it to something that does
    (:meth:`Arena.from_fd <akv_transport.shm.Arena.from_fd>` takes one over).
    """

    data: bytes
    fds: tuple[int, ...] = ()


def encode_header(nbytes: int, nfds: int, *, max_bytes: int, max_fds: int) -> bytes:
    """The header of a message of ``nbytes`` data bytes and ``nfds`` descriptors.

    Raises
    ------
    FrameError
        When ``nbytes`` exceeds ``max_bytes`` or ``nfds`` exceeds ``max_fds``.
    """
    if nbytes > max_bytes:
        raise FrameError(f"shm message: {nbytes} data bytes exceed the bound of {max_bytes}")
    if nfds > max_fds:
        raise FrameError(f"shm message: {nfds} fds exceed the bound of {max_fds}")
    return _HEADER.pack(nbytes, nfds, 0)


def decode_header(
    buffer: bytes | bytearray | memoryview, offset: int = 0, *, max_bytes: int, max_fds: int
) -> tuple[int, int]:
    """``(nbytes, nfds)`` of the header at ``buffer[offset:offset + HEADER_BYTES]``.

    Raises
    ------
    FrameError
        When a field is out of its bound, or the flags are not 0.
    """
    nbytes, nfds, flags = _HEADER.unpack_from(buffer, offset)
    if flags != 0:
        raise FrameError(f"shm message header: flags {flags:#x}, expected 0")
    if nbytes > max_bytes:
        raise FrameError(f"shm message header: {nbytes} data bytes exceed the bound of {max_bytes}")
    if nfds > max_fds:
        raise FrameError(f"shm message header: {nfds} fds exceed the bound of {max_fds}")
    return nbytes, nfds


class MessageParser:
    """A sans-IO parser of a stream of messages and the descriptors received with it.

    :meth:`feed` takes what one ``recvmsg`` returned (its bytes and its descriptors);
    :meth:`next_message` returns the messages completed, one at a time and in order, then
    None, and raises :class:`FrameError` only when it reaches a fault, so that the messages
    before it are delivered. The parser owns the descriptors it holds until it hands them out
    in a message; :meth:`close` closes them. After a FrameError the stream is out of step:
    the parser is closed, and so should the connection be.
    """

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_fds: int = DEFAULT_MAX_FDS_PER_MESSAGE,
    ) -> None:
        check_limits(max_bytes, max_fds)
        self.max_bytes = max_bytes
        self.max_fds = max_fds
        self._buffer = bytearray()
        self._fds: list[int] = []

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet handed out in a message."""
        return len(self._buffer)

    @property
    def held_fds(self) -> int:
        """Descriptors received and not yet handed out in a message."""
        return len(self._fds)

    def feed(self, data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> None:
        """Take one ``recvmsg``'s bytes and descriptors (the parser owns ``fds`` from now)."""
        self._fds.extend(fds)
        self._buffer += data

    def next_message(self) -> ShmMessage | None:
        """The next complete message, or None until more is fed.

        Raises
        ------
        FrameError
            A header out of bounds, a message whose descriptors did not arrive with its
            first byte, or descriptors that arrived with no message. What the parser held is
            closed.
        """
        buffer = self._buffer
        try:
            if len(buffer) < HEADER_BYTES:
                if not buffer and self._fds:
                    raise FrameError(f"shm message: {len(self._fds)} fds arrived with no message")
                return None
            nbytes, nfds = decode_header(buffer, max_bytes=self.max_bytes, max_fds=self.max_fds)
            if nfds > len(self._fds):
                raise FrameError(
                    f"shm message: the header declares {nfds} fds but "
                    f"{len(self._fds)} arrived with it"
                )
        except FrameError:
            self.close()
            raise
        end = HEADER_BYTES + nbytes
        if len(buffer) < end:
            return None
        fds = tuple(self._fds[:nfds])
        del self._fds[:nfds]
        data = bytes(buffer[HEADER_BYTES:end])
        del buffer[:end]
        return ShmMessage(data, fds)

    def eof(self) -> None:
        """The peer closed its end: raise if a message was cut short.

        Raises
        ------
        FrameError
            When part of a message is buffered (it is dropped, its descriptors closed).
        """
        if self._buffer or self._fds:
            held = len(self._buffer)
            self.close()
            raise FrameError(f"shm message: the stream ended {held} bytes into a message")

    def close(self) -> None:
        """Drop what is buffered and close the descriptors held."""
        self._buffer.clear()
        fds, self._fds = self._fds, []
        close_fds(fds)


def send_fds(
    sock: socket.socket,
    data: bytes | bytearray | memoryview,
    fds: Sequence[int] = (),
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_fds: int = DEFAULT_MAX_FDS_PER_MESSAGE,
) -> None:
    """Send one message (``data`` and ``fds``) over a blocking AF_UNIX stream socket.

    Returns once the whole message is in the kernel. The kernel holds its own reference to
    each descriptor from then on, so the caller may close its ``fds`` at once.

    Raises
    ------
    FrameError
        Before sending anything, when ``data`` or ``fds`` exceed their bounds.
    TransportError
        When the socket fails (the cause is attached); the stream is then unusable.
    """
    check_limits(max_bytes, max_fds)
    view = memoryview(data).cast("B")
    header = encode_header(len(view), len(fds), max_bytes=max_bytes, max_fds=max_fds)
    buffers: list[bytes | memoryview] = [header, view]
    total = HEADER_BYTES + len(view)
    try:
        sent = sock.sendmsg(buffers, rights(fds))
        if sent < total:
            sock.sendall(b"".join(buffers)[sent:])
    except OSError as exc:
        raise TransportError(f"cannot send an shm message: {exc!r}") from exc


def recv_fds(
    sock: socket.socket,
    maxfds: int = DEFAULT_MAX_FDS_PER_MESSAGE,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> ShmMessage:
    """Receive exactly one message from a blocking AF_UNIX stream socket.

    Reads no byte past the message, so it can alternate with other readers of the socket.
    The descriptors are close-on-exec and owned by the caller.

    Raises
    ------
    FrameError
        When the message exceeds ``max_bytes`` or ``maxfds`` (descriptors beyond the bound
        are closed by the kernel, the others here), or the stream ends inside it.
    TransportError
        When the peer closed the connection before the message began, or the socket failed
        (timeouts included: the cause is attached).
    """
    reader = ExactReader(max_bytes=max_bytes, max_fds=maxfds)
    while True:
        try:
            data, fds = recv_some(sock, reader.wanted, maxfds)
        except FrameError:
            reader.close()
            raise
        except OSError as exc:
            reader.close()
            raise TransportError(f"cannot receive an shm message: {exc!r}") from exc
        message = reader.add(data, fds)
        if message is not None:
            return message


class ExactReader:
    """Collects exactly one message from reads of :attr:`wanted` bytes each (no I/O).

    A reader that asks for no more than :attr:`wanted` never takes a byte of the next
    message off the socket, so a handshake can be read before the stream is handed on.
    """

    def __init__(self, *, max_bytes: int, max_fds: int) -> None:
        self._max_bytes = max_bytes
        self._max_fds = max_fds
        self._received = bytearray()
        self._fds: list[int] = []
        self._want = HEADER_BYTES

    @property
    def wanted(self) -> int:
        """Bytes still missing from the message (or its header, until the header is whole)."""
        return self._want - len(self._received)

    def add(self, data: bytes, fds: Sequence[int] = ()) -> ShmMessage | None:
        """Take one read's bytes (empty: the stream ended) and descriptors; return the
        message once it is whole.

        Raises
        ------
        FrameError
            When the header is out of bounds, the descriptors do not match it, or the
            stream ended inside the message; what was received is closed.
        TransportError
            When the stream ended before the message began.
        """
        self._fds.extend(fds)
        if len(data) > self.wanted:
            self.close()
            raise ValueError(f"ExactReader: {len(data)} bytes given, {self.wanted} wanted")
        if not data:
            held = len(self._received)
            self.close()
            if held == 0:
                raise TransportError("the peer closed the connection")
            raise FrameError(f"shm message: the stream ended {held} bytes into a message")
        self._received += data
        if self._want == HEADER_BYTES and len(self._received) == HEADER_BYTES:
            try:
                nbytes, _ = decode_header(
                    self._received, max_bytes=self._max_bytes, max_fds=self._max_fds
                )
            except FrameError:
                self.close()
                raise
            self._want += nbytes
        if len(self._received) < self._want:
            return None
        fds, self._fds = self._fds, []
        parser = MessageParser(max_bytes=self._max_bytes, max_fds=self._max_fds)
        parser.feed(self._received, fds)
        message = parser.next_message()
        assert message is not None  # the bytes are exactly one message: it raised otherwise
        if parser.held_fds:
            extra = parser.held_fds
            parser.close()
            close_fds(message.fds)
            raise FrameError(f"shm message: {extra} fds arrived with no message")
        return message

    def close(self) -> None:
        """Close the descriptors received so far."""
        fds, self._fds = self._fds, []
        close_fds(fds)


def recv_some(sock: socket.socket, nbytes: int, maxfds: int) -> tuple[bytes, list[int]]:
    """One ``recvmsg`` of at most ``nbytes``, and the descriptors it brought (close-on-exec).

    Raises
    ------
    FrameError
        When the peer sent more descriptors than ``maxfds`` (the kernel closed the excess;
        the rest are closed here).
    OSError
        From the socket.
    """
    ancillary = socket.CMSG_SPACE(maxfds * _FD_BYTES) if maxfds else 0
    data, ancdata, flags, _ = sock.recvmsg(nbytes, ancillary, _RECV_FLAGS)
    return data, take_fds(ancdata, flags, maxfds)


def take_fds(ancdata: Iterable[tuple[int, int, bytes]], flags: int, maxfds: int) -> list[int]:
    """The descriptors in ``recvmsg``'s control messages, made close-on-exec.

    Raises
    ------
    FrameError
        When the control data was truncated (more descriptors than ``maxfds``); every
        descriptor that did arrive is closed first.
    """
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_BYTES])
    received = fds.tolist()
    if not _RECV_FLAGS:
        for fd in received:
            os.set_inheritable(fd, False)
    if flags & socket.MSG_CTRUNC or len(received) > maxfds:
        close_fds(received)
        raise FrameError(f"shm message: the peer sent more fds than the bound of {maxfds}")
    return received


def rights(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    """``sendmsg``'s ancillary data that passes ``fds`` (none for no descriptors)."""
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def close_fds(fds: Iterable[int]) -> None:
    """Close each descriptor, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def check_limits(max_bytes: int, max_fds: int) -> None:
    """Raise ValueError unless the bounds are ones the framing can carry."""
    if not 0 <= max_bytes < (1 << 32):
        raise ValueError(f"shm message: max_bytes {max_bytes} is outside [0, 2**32)")
    if not 0 <= max_fds <= MAX_FDS_PER_MESSAGE:
        raise ValueError(
            f"shm message: max_fds {max_fds} is outside [0, MAX_FDS_PER_MESSAGE "
            f"{MAX_FDS_PER_MESSAGE}]"
        )


async def recv_message(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, *, max_bytes: int, max_fds: int
) -> ShmMessage:
    """Exactly one message from a non-blocking socket (nothing of the next is read), on
    ``loop``: for a handshake, before a connection reads its stream on its own."""
    reader = ExactReader(max_bytes=max_bytes, max_fds=max_fds)
    try:
        while True:
            try:
                data, fds = recv_some(sock, reader.wanted, max_fds)
            except (BlockingIOError, InterruptedError):
                await readable(loop, sock)
                continue
            message = reader.add(data, fds)
            if message is not None:
                return message
    except OSError as exc:
        raise TransportError(f"cannot receive an shm message: {exc!r}") from exc
    finally:
        reader.close()


async def readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until ``sock`` is readable, on ``loop``."""
    waiter = loop.create_future()
    fileno = sock.fileno()
    loop.add_reader(fileno, _wake, waiter)
    try:
        await waiter
    finally:
        loop.remove_reader(fileno)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
