"""A private, authenticated Unix socket between processes on one host (asyncio).

:class:`ShmListener` creates a fresh directory (mode 0700, ``tempfile.mkdtemp``) with one
socket in it (mode 0600): only the job's user (and root) can reach it, and each connection
must send the job's token before anything else. :func:`connect_shm` is the client side. Both
hand out a :class:`ShmConnection`, which carries small messages and file descriptors
(:mod:`akv_transport._shm_wire`'s framing) in order, over any stream socket: descriptors only over
AF_UNIX.

The handshake: the client sends one message whose data is the token and which carries no
descriptor; the listener compares it in constant time (``hmac.compare_digest``) and answers
``akv-shm/1 accepted`` or ``akv-shm/1 refused``, then closes a refused connection. Nothing the
client sent before it was accepted reaches the application, and a descriptor sent with the
token is never even installed in the listener's process (it is received with no room for
descriptors, so the kernel drops it).

What survives a SIGKILL of the listener's process: only its directory, with the socket file
in it (a socket nobody listens on: connecting is refused). Every descriptor, arena and
connection dies with the process. :meth:`ShmListener.close` removes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from akv_transport._shm_trust import check_listener_path, check_peer
from akv_transport._shm_wire import (
    DEFAULT_MAX_FDS_PER_MESSAGE,
    DEFAULT_MAX_MESSAGE_BYTES,
    HEADER_BYTES,
    MessageParser,
    ShmMessage,
    check_limits,
    close_fds,
    encode_header,
    recv_message,
    rights,
    take_fds,
)
from akv_transport.errors import AuthError, FrameError, TransportError, UntrustedPeerError

__all__ = [
    "DEFAULT_MAX_PENDING_CONNECTIONS",
    "DEFAULT_MAX_QUEUED_MESSAGES",
    "HANDSHAKE_TIMEOUT_S",
    "MAX_QUEUED_FDS",
    "MAX_TOKEN_BYTES",
    "RECV_BUFFER_BYTES",
    "ShmConnection",
    "ShmConnectionStatistics",
    "ShmListener",
    "ShmListenerStatistics",
    "connect_shm",
]

#: A connection that has not completed the handshake this long after it was accepted is
#: closed (seconds).
HANDSHAKE_TIMEOUT_S = 10.0
#: The longest token the handshake accepts.
MAX_TOKEN_BYTES = 4096
#: Connections a listener holds that are not accepted yet (in the handshake, or waiting for
#: :meth:`ShmListener.accept`); more are closed at once.
DEFAULT_MAX_PENDING_CONNECTIONS = 64
#: Received messages a connection queues before it stops reading from the socket.
DEFAULT_MAX_QUEUED_MESSAGES = 64
#: Received descriptors a connection queues before it stops reading from the socket.
MAX_QUEUED_FDS = 64
#: How long a listener stops accepting after ``accept()`` failed (out of descriptors).
ACCEPT_RETRY_DELAY_S = 1.0
#: Bytes one ``recvmsg`` may bring.
RECV_BUFFER_BYTES = 64 << 10
#: The socket's name inside the listener's directory.
SOCKET_NAME = "socket"
#: A listener's directory is ``{tempdir}/akv-shm-{pid}-{random}``: the pid tells a person
#: (or a clean-up script) whose it was.
DIRECTORY_PREFIX = "akv-shm-"

_ACCEPTED = b"akv-shm/1 accepted"
_REFUSED = b"akv-shm/1 refused"
_MAX_ANSWER_BYTES = 64
#: ``sun_path`` holds 108 bytes, with the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107
_RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_FD_BYTES = 4


class ShmConnection:
    """One end of a stream of messages with descriptors; obtained from
    :meth:`ShmListener.accept` or :func:`connect_shm`.

    Takes over a connected stream socket (any family: descriptors pass only over AF_UNIX)
    and must be created and used on one event loop. Messages arrive in the order they were
    sent. Once ``max_queued_messages`` received messages (or :data:`MAX_QUEUED_FDS`
    descriptors) are queued, the connection stops reading until :meth:`recv` takes some, so
    a peer that sends faster than it is read is held back by the kernel. The bound can be
    overshot by what one read brings: :data:`RECV_BUFFER_BYTES` of messages, or one
    message's descriptors.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_fds_per_message: int = DEFAULT_MAX_FDS_PER_MESSAGE,
        max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
    ) -> None:
        if sock.type != socket.SOCK_STREAM:
            raise ValueError(f"ShmConnection needs a stream socket, not {sock.type!r}")
        if max_queued_messages < 1:
            raise ValueError(f"ShmConnection: max_queued_messages {max_queued_messages} < 1")
        self._loop = asyncio.get_running_loop()
        self._unix = sock.family == socket.AF_UNIX
        self._max_fds = max_fds_per_message if self._unix else 0
        self._parser = MessageParser(max_bytes=max_message_bytes, max_fds=self._max_fds)
        self._max_queued_messages = max_queued_messages
        sock.setblocking(False)
        self._sock = sock
        self._fileno = sock.fileno()
        self._ancillary = socket.CMSG_SPACE(self._max_fds * _FD_BYTES) if self._max_fds else 0
        self._recv_view = memoryview(bytearray(RECV_BUFFER_BYTES))
        self._messages: deque[ShmMessage] = deque()
        self._queued_fds = 0
        self._receiver: asyncio.Future[None] | None = None
        self._read_error: TransportError | None = None
        self._write_error: TransportError | None = None
        self._sends: deque[_Send] = deque()
        self._reading = False
        self._writing = False
        self._closed = False
        self._start_reading()

    # ------------------------------------------------------------------ the public face

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def unix(self) -> bool:
        """True when the socket is AF_UNIX (descriptors can pass)."""
        return self._unix

    def statistics(self) -> ShmConnectionStatistics:
        """What the connection holds now."""
        return ShmConnectionStatistics(
            queued_messages=len(self._messages),
            queued_fds=self._queued_fds,
            reading=self._reading,
            waiting_sends=len(self._sends),
        )

    async def send(
        self, data: bytes | bytearray | memoryview = b"", fds: Sequence[int] = ()
    ) -> None:
        """Send one message; return once it is in the kernel.

        Messages leave in the order of the calls. The message is taken at the call: the caller
        may change ``data`` and close ``fds`` as soon as it returns, or once it is cancelled
        (a cancelled send still goes out, in its turn; the kernel, or a duplicate the
        connection keeps meanwhile, holds each descriptor).

        Raises
        ------
        FrameError
            Before sending anything, when ``data`` or ``fds`` exceed the bounds, or ``fds``
            are given on a socket that is not AF_UNIX.
        TransportError
            When the connection is closed or failed (the cause is attached).
        """
        if self._closed:
            raise TransportError("shm connection: it is closed")
        if self._write_error is not None:
            raise self._write_error
        if fds and not self._unix:
            raise FrameError("shm message: fds can only pass over an AF_UNIX socket")
        view = memoryview(data).cast("B")
        header = encode_header(
            len(view), len(fds), max_bytes=self._parser.max_bytes, max_fds=self._max_fds
        )
        sent = 0
        if not self._sends:
            try:
                sent = self._sock.sendmsg([header, view], rights(fds))
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise self._fail_writing(exc) from exc
            if sent == HEADER_BYTES + len(view):
                return
        rest = memoryview(b"".join([header, view])[sent:])
        kept: list[int] = []
        if sent == 0:
            try:
                for fd in fds:
                    kept.append(os.dup(fd))
            except OSError as exc:
                close_fds(kept)
                raise TransportError(f"shm connection: cannot hold fds to send: {exc!r}") from exc
        done = self._loop.create_future()
        self._sends.append(_Send(rest, kept, done))
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fileno, self._on_writable)
        await done

    async def recv(self) -> ShmMessage:
        """The next message, in order; the caller owns its descriptors.

        One task at a time may wait here.

        Raises
        ------
        FrameError
            When the peer broke the framing or a bound (the connection is shut down; the
            messages received before it were delivered first).
        TransportError
            When the peer closed the connection, or it was closed here or failed.
        """
        while not self._messages:
            if self._read_error is not None:
                raise self._read_error
            if self._receiver is not None:
                raise RuntimeError("shm connection: another task is already in recv()")
            waiter = self._loop.create_future()
            self._receiver = waiter
            try:
                await waiter
            finally:
                self._receiver = None
        message = self._messages.popleft()
        self._queued_fds -= len(message.fds)
        if not self._reading and self._read_error is None and not self._backlogged():
            self._start_reading()
        return message

    def close(self) -> None:
        """Close the socket at once, and every descriptor received and not yet handed out
        or held for a send. Idempotent.

        Sends waiting in :meth:`send` and a task waiting in :meth:`recv` get a
        TransportError.
        """
        if self._closed:
            return
        self._closed = True
        error = TransportError("shm connection: it is closed")
        self._stop_reading()
        if self._read_error is None:
            self._read_error = error
        self._fail_sends(error)
        for message in self._messages:
            close_fds(message.fds)
        self._messages.clear()
        self._queued_fds = 0
        self._parser.close()
        self._wake_receiver()
        self._sock.close()

    def detach(self) -> socket.socket:
        """Stop using the socket and hand it over (blocking off, nothing buffered here):
        the connection is closed from then on, the socket is the caller's.

        Raises
        ------
        TransportError
            When the connection is closed or failed, a send is still waiting, or bytes or
            messages were received that nobody took (the peer sent ahead of the protocol).
        """
        if self._closed or self._read_error is not None or self._write_error is not None:
            raise TransportError("shm connection: cannot detach a closed or failed connection")
        if self._sends or self._messages or self._parser.buffered_bytes:
            raise TransportError(
                "shm connection: cannot detach with sends waiting or data received ahead"
            )
        self._stop_reading()
        self._stop_writing()
        self._closed = True
        self._read_error = self._write_error = TransportError("shm connection: detached")
        self._parser.close()
        self._sock.setblocking(True)
        return self._sock

    # ------------------------------------------------------------------ receiving

    def _start_reading(self) -> None:
        self._reading = True
        self._loop.add_reader(self._fileno, self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fileno)

    def _backlogged(self) -> bool:
        return (
            len(self._messages) >= self._max_queued_messages or self._queued_fds >= MAX_QUEUED_FDS
        )

    def _on_readable(self) -> None:
        try:
            nbytes, ancdata, flags, _ = self._sock.recvmsg_into(
                [self._recv_view], self._ancillary, _RECV_FLAGS
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._end_reading(TransportError(f"shm connection: cannot receive: {exc!r}"))
            return
        try:
            fds = take_fds(ancdata, flags, self._max_fds)
            if nbytes == 0:
                self._parser.eof()
                self._end_reading(TransportError("shm connection: closed by the peer"))
                return
            self._parser.feed(self._recv_view[:nbytes], fds)
            while (message := self._parser.next_message()) is not None:
                self._messages.append(message)
                self._queued_fds += len(message.fds)
        except FrameError as exc:
            # The messages before the fault are delivered; then recv() raises it.
            self._end_reading(exc)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            return
        if self._messages:
            self._wake_receiver()
            if self._backlogged():
                self._stop_reading()

    def _end_reading(self, error: TransportError) -> None:
        self._stop_reading()
        self._read_error = error
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        if self._receiver is not None and not self._receiver.done():
            self._receiver.set_result(None)

    # ------------------------------------------------------------------ sending

    def _on_writable(self) -> None:
        while self._sends:
            item = self._sends[0]
            try:
                sent = self._sock.sendmsg([item.rest], rights(item.fds))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail_writing(exc)
                return
            close_fds(item.fds)
            item.fds = []
            item.rest = item.rest[sent:]
            if item.rest:
                return
            self._sends.popleft()
            if not item.done.done():
                item.done.set_result(None)
        self._stop_writing()

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            if not self._loop.is_closed():
                self._loop.remove_writer(self._fileno)

    def _fail_writing(self, exc: OSError) -> TransportError:
        error = TransportError(f"shm connection: cannot send: {exc!r}")
        error.__cause__ = exc
        self._write_error = error
        self._fail_sends(error)
        return error

    def _fail_sends(self, error: TransportError) -> None:
        self._stop_writing()
        sends, self._sends = self._sends, deque()
        for item in sends:
            close_fds(item.fds)
            if not item.done.done():
                item.done.set_exception(error)


@dataclass(frozen=True)
class ShmConnectionStatistics:
    """What a connection holds (:meth:`ShmConnection.statistics`)."""

    #: Messages received and not yet taken by :meth:`ShmConnection.recv`.
    queued_messages: int
    #: Descriptors those messages carry.
    queued_fds: int
    #: False while the queue is full, and after the stream ended or failed.
    reading: bool
    #: Messages (or the rest of one) waiting for room in the socket.
    waiting_sends: int


@dataclass
class _Send:
    """A message, or its rest, waiting for the socket; ``fds`` are duplicates it owns."""

    rest: memoryview
    fds: list[int]
    done: asyncio.Future[None]


@dataclass(frozen=True)
class ShmListenerStatistics:
    """What a listener has done so far (:meth:`ShmListener.statistics`)."""

    #: Connections handed out by :meth:`ShmListener.accept`.
    accepted: int
    #: Authenticated connections waiting for :meth:`ShmListener.accept`.
    pending: int
    #: Connections in the handshake.
    handshaking: int
    #: Connections closed without being attached: a wrong token, a malformed or late
    #: handshake, or too many connections pending at once.
    refused: int
    #: Times ``accept()`` failed in the kernel (out of descriptors, say), and the last error.
    accept_errors: int
    last_accept_error: str | None


class ShmListener:
    """A private Unix socket that hands out authenticated :class:`ShmConnection` objects.

    Create it on a running loop (``ShmListener(token)``, or ``async with``), give its
    :attr:`path` to the peers (and its token, which they know already), and take connections
    with :meth:`accept`. A connection is handed out only after it sent the right token;
    a wrong one is answered "refused" and closed, and the listener goes on serving.

    :meth:`close` removes the socket and the directory; call it (or use ``async with``): a
    listener left open leaves them behind, and so does a process killed by SIGKILL (nothing
    else: descriptors and arenas die with the process).
    """

    def __init__(
        self,
        token: str | bytes,
        *,
        parent_directory: str | None = None,
        max_pending_connections: int = DEFAULT_MAX_PENDING_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_fds_per_message: int = DEFAULT_MAX_FDS_PER_MESSAGE,
        max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
    ) -> None:
        """Create the directory and the socket, and start accepting.

        Raises
        ------
        ValueError
            When the token is empty or longer than :data:`MAX_TOKEN_BYTES`.
        TransportError
            When the socket cannot be created, for instance because the path would exceed
            the 107 bytes a Unix socket's name may have (pass a shorter
            ``parent_directory``).
        """
        self._token = _token_bytes(token)
        self._loop = asyncio.get_running_loop()
        self._max_pending = max_pending_connections
        self._handshake_timeout_s = handshake_timeout_s
        self._connection_options = {
            "max_message_bytes": max_message_bytes,
            "max_fds_per_message": max_fds_per_message,
            "max_queued_messages": max_queued_messages,
        }
        check_limits(max_message_bytes, max_fds_per_message)
        if max_queued_messages < 1 or max_pending_connections < 1:
            raise ValueError(
                f"shm listener: max_queued_messages {max_queued_messages} and "
                f"max_pending_connections {max_pending_connections} must be at least 1"
            )
        self._directory = tempfile.mkdtemp(
            prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-", dir=parent_directory
        )
        self._path = os.path.join(self._directory, SOCKET_NAME)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if len(os.fsencode(self._path)) > _MAX_SOCKET_PATH_BYTES:
                raise TransportError(
                    f"shm listener: the socket path {self._path!r} is longer than "
                    f"{_MAX_SOCKET_PATH_BYTES} bytes"
                )
            try:
                # The file takes the socket's mode (less the umask) when it is bound, so it
                # is never more open than 0600, not even for an instant.
                os.fchmod(self._sock.fileno(), 0o600)
                self._sock.bind(self._path)
                os.chmod(self._path, 0o600)
                self._sock.listen(max_pending_connections)
                self._sock.setblocking(False)
            except OSError as exc:
                raise TransportError(
                    f"shm listener: cannot listen at {self._path!r}: {exc!r}"
                ) from exc
        except BaseException:
            self._sock.close()
            self._remove_files()
            raise
        self._pending: deque[ShmConnection] = deque()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._accept_waiters: list[asyncio.Future[None]] = []
        self._retry: asyncio.TimerHandle | None = None
        self._failure: BaseException | None = None
        self._accepted = 0
        self._refused = 0
        self._accept_errors = 0
        self._last_accept_error: str | None = None
        self._closed = False
        self._loop.add_reader(self._sock.fileno(), self._on_acceptable)

    @property
    def path(self) -> str:
        """The socket's path, for :func:`connect_shm`."""
        return self._path

    @property
    def directory(self) -> str:
        """The listener's private directory (mode 0700), which holds only the socket."""
        return self._directory

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def statistics(self) -> ShmListenerStatistics:
        """What the listener has done so far."""
        return ShmListenerStatistics(
            accepted=self._accepted,
            pending=len(self._pending),
            handshaking=len(self._handshakes),
            refused=self._refused,
            accept_errors=self._accept_errors,
            last_accept_error=self._last_accept_error,
        )

    async def accept(self) -> ShmConnection:
        """The next authenticated connection, in the order their handshakes completed.

        Raises
        ------
        TransportError
            When the listener is closed (also while waiting).
        Exception
            What a handshake raised that it should not have (a bug, not a peer's fault),
            as it was raised.
        """
        while not self._pending:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise TransportError("shm listener: it is closed")
            waiter = self._loop.create_future()
            self._accept_waiters.append(waiter)
            try:
                await waiter
            finally:
                self._accept_waiters.remove(waiter)
        self._accepted += 1
        return self._pending.popleft()

    async def close(self) -> None:
        """Stop accepting, remove the socket and the directory, and close the connections
        not accepted yet (those handed out are the caller's). Idempotent.

        Raises
        ------
        TransportError
            When the directory cannot be removed (something else was put into it).
        """
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        if not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._wake_accepters()
        handshakes = list(self._handshakes)
        for task in handshakes:
            task.cancel()
        try:
            self._remove_files()
        finally:
            await asyncio.gather(*handshakes, return_exceptions=True)
            while self._pending:
                self._pending.popleft().close()

    async def __aenter__(self) -> ShmListener:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    def _remove_files(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        try:
            os.rmdir(self._directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TransportError(
                f"shm listener: cannot remove its directory {self._directory!r}: {exc!r}"
            ) from exc

    def _on_acceptable(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            # Out of descriptors (EMFILE, ENFILE) or memory: the socket stays readable, so
            # wait before trying again rather than spin (what asyncio's servers do).
            self._accept_errors += 1
            self._last_accept_error = repr(exc)
            self._loop.remove_reader(self._sock.fileno())
            self._retry = self._loop.call_later(ACCEPT_RETRY_DELAY_S, self._resume_accepting)
            return
        if len(self._handshakes) + len(self._pending) >= self._max_pending:
            sock.close()
            self._refused += 1
            return
        sock.setblocking(False)
        task = self._loop.create_task(self._handshake(sock))
        self._handshakes.add(task)
        task.add_done_callback(self._handshake_done)

    def _handshake_done(self, task: asyncio.Task[None]) -> None:
        self._handshakes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._failure = exc
            self._wake_accepters()

    def _wake_accepters(self, *, all_of_them: bool = True) -> None:
        for waiter in self._accept_waiters:
            if not waiter.done():
                waiter.set_result(None)
                if not all_of_them:
                    return

    def _resume_accepting(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_acceptable)

    async def _handshake(self, sock: socket.socket) -> None:
        try:
            hello = await asyncio.wait_for(
                recv_message(self._loop, sock, max_bytes=MAX_TOKEN_BYTES, max_fds=0),
                self._handshake_timeout_s,
            )
            if not hmac.compare_digest(hello.data, self._token):
                with contextlib.suppress(OSError):
                    sock.send(_answer(_REFUSED))
                raise AuthError("shm listener: wrong token")
            await asyncio.wait_for(
                self._loop.sock_sendall(sock, _answer(_ACCEPTED)), self._handshake_timeout_s
            )
            connection = ShmConnection(sock, **self._connection_options)
        except (TransportError, OSError, asyncio.TimeoutError):
            sock.close()
            self._refused += 1
            return
        except BaseException:
            sock.close()
            raise
        if self._closed:
            connection.close()
            return
        self._pending.append(connection)
        self._wake_accepters(all_of_them=False)


async def connect_shm(
    path: str,
    token: str | bytes,
    *,
    timeout_s: float = 30.0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_fds_per_message: int = DEFAULT_MAX_FDS_PER_MESSAGE,
    max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
) -> ShmConnection:
    """Connect to the :class:`ShmListener` at ``path`` and authenticate with ``token``.

    Raises
    ------
    ValueError
        When the token is empty or longer than :data:`MAX_TOKEN_BYTES`.
    AuthError
        When the listener refused the token.
    UntrustedPeerError
        When the socket, its directory or the process listening is not this user's (the
        token is not sent: :mod:`akv_transport._shm_trust`).
    TransportError
        When the connection failed, timed out or the answer was not the handshake's (the
        cause is attached).
    """
    secret = _token_bytes(token)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)

    async def handshake() -> None:
        check_listener_path(path)
        await loop.sock_connect(sock, path)
        check_peer(sock, path)
        await loop.sock_sendall(
            sock, encode_header(len(secret), 0, max_bytes=MAX_TOKEN_BYTES, max_fds=0) + secret
        )
        answer = await recv_message(loop, sock, max_bytes=_MAX_ANSWER_BYTES, max_fds=0)
        if answer.data == _REFUSED:
            raise AuthError(f"the shm listener at {path!r} refused the token")
        if answer.data != _ACCEPTED:
            raise TransportError(
                f"the shm listener at {path!r} answered {answer.data!r}, not {_ACCEPTED!r}"
            )

    try:
        await asyncio.wait_for(handshake(), timeout_s)
        return ShmConnection(
            sock,
            max_message_bytes=max_message_bytes,
            max_fds_per_message=max_fds_per_message,
            max_queued_messages=max_queued_messages,
        )
    except (AuthError, UntrustedPeerError):
        sock.close()
        raise
    except (TransportError, OSError, asyncio.TimeoutError) as exc:
        sock.close()
        raise TransportError(f"cannot connect to the shm listener at {path!r}: {exc!r}") from exc
    except BaseException:
        sock.close()
        raise


def _answer(data: bytes) -> bytes:
    return encode_header(len(data), 0, max_bytes=_MAX_ANSWER_BYTES, max_fds=0) + data


def _token_bytes(token: str | bytes) -> bytes:
    secret = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not 1 <= len(secret) <= MAX_TOKEN_BYTES:
        raise ValueError(f"shm token: {len(secret)} bytes is outside [1, {MAX_TOKEN_BYTES}]")
    return secret
