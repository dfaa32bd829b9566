"""A framed stream between two processes on one host: frames over a private Unix socket,
large payloads through shared memory.

Each side of such a stream sends through an :class:`~akv_transport._shm_arena.Arena` (a sealed
memfd) and maps the peer's. A client's arena is its stream's own; a :class:`LocalSite`
sends through one arena for all its streams (:class:`ArenaBook`), so that what lies in a
region of it reaches every local peer without a copy. A frame whose payload is at least
``min_bytes`` is sent as its header and one offset per array
(:data:`~akv_transport.frame.VERSION_ARENA`): each array is copied once into a free region of
the sender's arena (or is there already, in a region the caller took), and the receiver
copies it from there into the buffer it chose for it, then gives the regions back with a
*release* frame (:data:`~akv_transport.frame.VERSION_RELEASE`). A stream accepts releases only
of what it sent. Small frames, and any frame whose payload finds no free region, travel on
the socket as usual; the order of frames never changes.

One pair of verbs says who holds a region, at every level: ``take`` and ``give_back``
(:class:`RegionAllocator`, :class:`ArenaBook`, :class:`SharedMemory`, and
:meth:`StreamProtocol.give_back <akv_transport.StreamProtocol.give_back>` for the regions of the
peer's arena that a message lent). *Release* names only the frame on the wire by which a
receiver gives the sender's regions back (:meth:`SharedMemory.release_frames` makes them,
:meth:`SharedMemory.given_back` takes in what they name).

Setting a stream up (:class:`LocalSite` on the server, :func:`connect_local` on the client):

1. The client connects to the site's socket (mode 0600 in a private 0700 directory,
   :class:`~akv_transport._shm_socket.ShmListener`) and sends the job's token, which the site
   checks in constant time before it reads anything else; a descriptor sent before the
   token is accepted is never installed.
2. The client sends ``akv-arena/1`` with its arena's descriptor (or none: it shares no
   memory), and the site answers ``akv-arena/1`` with its own (or none).
3. The socket becomes an ordinary stream connection: the client's authenticated HTTP
   ``Upgrade`` (:func:`~akv_transport._stream.open_stream`) and then frames, exactly as over
   TCP.

Nothing here has a name in the file system but the site's socket: the arenas are reached
only through their descriptors (close-on-exec), and the kernel frees them when the
processes that map them have closed them, or died: a client's when its stream closes, a
site's once the site and its last stream are closed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from akv_transport._shm_arena import Arena
from akv_transport._shm_socket import DIRECTORY_PREFIX, ShmConnection, ShmListener, connect_shm
from akv_transport._shm_wire import close_fds, send_fds
from akv_transport.errors import FrameError, TransportError
from akv_transport.frame import (
    MAX_ARENA_ARRAYS,
    MAX_RELEASE_OFFSETS,
    PREFIX_BYTES,
    VERSION,
    encode_release,
    to_arena_prefix,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_ARENA_BYTES",
    "DEFAULT_MIN_SHARED_BYTES",
    "ArenaBook",
    "LocalSite",
    "RegionAllocator",
    "SharedMemory",
    "connect_local",
    "remove_leftovers",
]

log = logging.getLogger("akv_transport")

#: Each side's arena: its pages take memory only once used, and a region is taken from the
#: lowest free offset, so what a stream holds is about the most it had in flight at once.
DEFAULT_ARENA_BYTES = 1 << 30
#: A frame's payload goes through the arena from this size on; smaller ones cost less on
#: the socket than a region and its release.
DEFAULT_MIN_SHARED_BYTES = 64 << 10
#: Regions start at a multiple of this (a cache line; NumPy's copies are fastest aligned).
ALIGNMENT = 64
_HELLO = b"akv-arena/1"


class RegionAllocator:
    """Which regions of an arena of ``nbytes`` are in use: first fit from the lowest free
    offset, every region aligned to :data:`ALIGNMENT`. No I/O."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        #: Free ranges ``(start, end)``, sorted and never adjacent.
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes > 0 else []
        #: offset -> size of each region in use.
        self._used: dict[int, int] = {}
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        """Bytes in use (aligned sizes)."""
        return self._used_bytes

    @property
    def regions(self) -> int:
        """Regions in use."""
        return len(self._used)

    def in_use(self, offset: int) -> bool:
        """Whether a region in use starts at ``offset``."""
        return offset in self._used

    def take(self, nbytes: int) -> int | None:
        """The offset of a free region of ``nbytes`` (at least 1), now in use; None when no
        free range is large enough."""
        size = -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
        for index, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, end)
                self._used[start] = size
                self._used_bytes += size
                return start
        return None

    def give_back(self, offset: int) -> None:
        """Give the region at ``offset`` back: free again.

        Raises :class:`FrameError` when no region starts there (offsets come from a peer).
        """
        size = self._used.pop(offset, None)
        if size is None:
            raise FrameError(f"release of offset {offset}, where no region of the arena is in use")
        self._used_bytes -= size
        start, end = offset, offset + size
        free = self._free
        low, high = 0, len(free)
        while low < high:  # the first free range after this region
            middle = (low + high) // 2
            if free[middle][0] < start:
                low = middle + 1
            else:
                high = middle
        index = low
        if index < len(free) and free[index][0] == end:
            end = free[index][1]
            del free[index]
        if index > 0 and free[index - 1][1] == start:
            start = free[index - 1][0]
            index -= 1
            del free[index]
        free.insert(index, (start, end))


class ArenaBook:
    """Which regions of one arena are taken, by whom: shared by the streams that send
    through that arena (a :class:`LocalSite` gives one to every stream it serves, so that
    a region one stream's caller took can be sent on any of them without a copy).

    A region is taken either for a frame (:meth:`take_for_frame`: copied there by
    :meth:`SharedMemory.place`, free again once the peer gave it back,
    :meth:`give_back_sent`) or by a caller ahead of any frame (:meth:`take`: a *reserved*
    region), free again once the caller gave it back (:meth:`give_back`) and the peers gave
    it back from every frame, on any stream, that carried it. :meth:`take`,
    :meth:`give_back` and :meth:`holds` may be called from any thread. The arena is closed
    when the last stream that uses the book closed (:meth:`join`, :meth:`leave`).
    """

    def __init__(self, arena: Arena, *, min_bytes: int = DEFAULT_MIN_SHARED_BYTES) -> None:
        self.arena = arena
        self.min_bytes = min_bytes
        self.regions = RegionAllocator(arena.nbytes)
        self._lock = threading.Lock()
        #: Reserved regions: their sorted starts, and start -> reservation.
        self._reserved_starts: list[int] = []
        self._reserved: dict[int, _Reservation] = {}
        self._base = _address(arena.view(0, arena.nbytes))
        self._streams = 0

    @property
    def nbytes(self) -> int:
        """The arena's size."""
        return self.arena.nbytes

    def join(self) -> None:
        """A stream sends through this book from now on."""
        with self._lock:
            self._streams += 1

    def leave(self) -> None:
        """A stream that joined is closed: the arena closes with the last one."""
        with self._lock:
            self._streams -= 1
            last = self._streams <= 0
        if last:
            self.arena.close()

    def take(self, nbytes: int, keep_free: int = 0) -> memoryview | None:
        """A writable region of ``nbytes`` of the arena, the caller's until
        :meth:`give_back`; None when ``nbytes`` is below ``min_bytes`` (it would travel on
        the socket), the arena is closed, no free range is large enough, or taking it would
        leave less than ``keep_free`` bytes of the arena free."""
        if nbytes < self.min_bytes or self.arena.closed:
            return None
        with self._lock:
            regions = self.regions
            if regions.nbytes - regions.used_bytes - nbytes < keep_free:
                return None
            offset = regions.take(nbytes)
            if offset is None:
                return None
            bisect.insort(self._reserved_starts, offset)
            self._reserved[offset] = _Reservation(nbytes)
        return self.arena.view(offset, nbytes)

    def fits(self, nbytes: int, keep_free: int = 0) -> bool:
        """Whether ``nbytes`` more would leave ``keep_free`` bytes of the arena free now
        (by bytes: whether one free range is large enough is for :meth:`take`)."""
        with self._lock:
            regions = self.regions
            return regions.nbytes - regions.used_bytes - nbytes >= keep_free

    def give_back(self, view: memoryview | np.ndarray) -> None:
        """Give back a region :meth:`take` returned (or an array over all of it): free once
        no frame that carried it is still unreleased; a no-op once the arena is closed."""
        if self.arena.closed:
            return
        offset = _address(view) - self._base
        with self._lock:
            reservation = self._reserved.get(offset)
            if reservation is None or not reservation.kept:
                raise ValueError(f"give_back: no region is reserved at offset {offset}")
            reservation.kept = False
            if not reservation.in_flight:
                self._give_back_reserved(offset)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies inside a region a caller took (and has not given back)
        here: a frame that carries it is sent without a copy."""
        if self.arena.closed or not self._reserved:
            return False
        offset = _address(array) - self._base
        with self._lock:
            start = self._reserved_start(offset, array.nbytes)
            return start is not None and self._reserved[start].kept

    def _give_back_reserved(self, start: int) -> None:
        """Free the reserved region at ``start`` (call with the lock held)."""
        del self._reserved[start]
        self._reserved_starts.remove(start)
        self.regions.give_back(start)

    def take_for_frame(self, payloads: list[memoryview]) -> tuple[list[int], list[int]] | None:
        """The offsets that carry ``payloads`` in one frame, and the indices of the
        payloads that need a copy there (regions taken now; a payload that lies in a
        reserved region is sent from there); None when a payload finds no free region
        (nothing is taken). Each offset is the frame's until :meth:`give_back_sent`."""
        offsets: list[int] = []
        copies: list[int] = []
        sent: list[int] = []
        with self._lock:
            for index, payload in enumerate(payloads):
                reserved = self._reserved_offset(payload) if self._reserved else None
                if reserved is not None:
                    offset, start = reserved
                    sent.append(start)
                else:
                    allocated = self.regions.take(payload.nbytes)
                    if allocated is None:
                        for taken in copies:
                            self.regions.give_back(offsets[taken])
                        return None
                    offset = allocated
                    copies.append(index)
                offsets.append(offset)
            for start in sent:  # in flight until the peer gives it back
                self._reserved[start].in_flight += 1
        return offsets, copies

    def _reserved_offset(self, payload: memoryview) -> tuple[int, int] | None:
        """The offset of ``payload`` in the arena and the start of the region a caller
        holds that it lies inside; None when it lies in none (call with the lock held)."""
        offset = _address(payload) - self._base
        start = self._reserved_start(offset, payload.nbytes)
        if start is None or not self._reserved[start].kept:
            return None
        return offset, start

    def give_back_sent(self, offsets: Sequence[int]) -> None:
        """Frames no longer carry the regions at ``offsets`` (each one taken by
        :meth:`take_for_frame`: the caller checked): free them, or count a reserved one no
        longer in flight."""
        with self._lock:
            for offset in offsets:
                self._give_back_sent_offset(offset)

    def is_reserved(self, offset: int) -> bool:
        """Whether ``offset`` lies in a reserved region."""
        with self._lock:
            return bool(self._reserved) and self._reserved_start(offset) is not None

    def _give_back_sent_offset(self, offset: int) -> None:
        """A frame no longer carries the region at ``offset``: free it, or for a reserved
        one count it no longer in flight (call with the lock held; ``offset`` was sent)."""
        start = self._reserved_start(offset) if self._reserved else None
        if start is None:
            self.regions.give_back(offset)
            return
        reservation = self._reserved[start]
        reservation.in_flight -= 1
        if not reservation.in_flight and not reservation.kept:
            self._give_back_reserved(start)

    def _reserved_start(self, offset: int, nbytes: int = 1) -> int | None:
        """The start of the reserved region that ``nbytes`` from ``offset`` lie inside;
        None when there is none (call with the lock held)."""
        index = bisect.bisect_right(self._reserved_starts, offset) - 1
        if index < 0:
            return None
        start = self._reserved_starts[index]
        return start if offset + nbytes <= start + self._reserved[start].size else None


class SharedMemory:
    """One side's shared memory for one stream: the book of the arena its large payloads
    travel through (its own arena, or one a :class:`LocalSite` shares among its streams),
    and the peer's arena (mapped, read only by the frame reader).

    Either may be None: that direction then carries every payload on the socket.

    A region can also be taken ahead (:meth:`take`) by a caller that writes a payload
    there itself: a frame whose array lies in such a (reserved) region is sent without a
    copy. The region is free again once the caller gave it back (:meth:`give_back`) and the
    peer gave it back from every frame that carried it (:meth:`given_back`), whichever
    comes last: the peer may keep reading a payload in place after it answered the
    request. :meth:`take` and :meth:`give_back` may be called from any thread; the rest
    belongs to the stream's loop.
    """

    def __init__(
        self,
        own: Arena | ArenaBook | None,
        peer: Arena | None,
        *,
        min_bytes: int = DEFAULT_MIN_SHARED_BYTES,
    ) -> None:
        if isinstance(own, Arena):
            own = ArenaBook(own, min_bytes=min_bytes)
        if own is not None:
            own.join()
        self.book = own
        self.own = own.arena if own is not None else None
        self.peer = peer
        self.min_bytes = min_bytes
        self.regions = own.regions if own is not None else RegionAllocator(0)
        #: The offsets this stream's frames carry that its peer has not given back yet.
        self._sent: dict[int, int] = {}
        self._closed = False
        #: Frames sent through the arena, those too large for the free regions, and the
        #: arrays sent from reserved regions without a copy.
        self.frames_shared = 0
        self.frames_not_fitting = 0
        self.arrays_in_place = 0

    def peer_view(self) -> memoryview | None:
        """The peer's arena, whole (None: it shares none)."""
        return None if self.peer is None else self.peer.view(0, self.peer.nbytes)

    def take(self, nbytes: int) -> memoryview | None:
        """A writable region of ``nbytes`` of the arena this side sends through, the
        caller's until :meth:`give_back` (see :meth:`ArenaBook.take`); None also when there
        is none."""
        return None if self.book is None else self.book.take(nbytes)

    def give_back(self, view: memoryview | np.ndarray) -> None:
        """Give back a region :meth:`take` returned (or an array over all of it); a
        no-op once the arena is closed."""
        if self.book is not None:
            self.book.give_back(view)

    def place(self, buffers: Sequence[bytes | memoryview]) -> list[bytes | memoryview] | None:
        """The buffers that send this frame (prefix and header, then each array's payload,
        as :func:`~akv_transport.frame.encode_frame` makes them) through the arena: each
        payload copied into a region of its own now, or referred to where it lies in a
        reserved region; None when it goes on the socket as it is (small, no arena, too
        many arrays, or no free region large enough)."""
        book = self.book
        if book is None or self._closed or not 2 <= len(buffers) <= MAX_ARENA_ARRAYS + 1:
            return None
        own = book.arena
        if own.closed:
            return None
        head = buffers[0]
        if len(head) < PREFIX_BYTES or head[3] != VERSION:
            return None
        if int.from_bytes(head[8:PREFIX_BYTES], "little") < self.min_bytes:
            return None
        payloads = [memoryview(payload).cast("B") for payload in buffers[1:]]
        taken = book.take_for_frame(payloads)
        if taken is None:
            self.frames_not_fitting += 1
            return None
        offsets, copies = taken
        sent = self._sent
        for offset in offsets:
            sent[offset] = sent.get(offset, 0) + 1
        for index in copies:
            payload = payloads[index]
            own.view(offsets[index], payload.nbytes)[:] = payload
        self.frames_shared += 1
        self.arrays_in_place += len(payloads) - len(copies)
        return to_arena_prefix(head, offsets)

    def given_back(self, offsets: list[int]) -> None:
        """The peer gave these regions back (its release frames named them): free them (a
        reserved one once its caller gave it back too), and clear ``offsets``. Raises
        :class:`FrameError` for one this stream did not send."""
        sent = self._sent
        given: list[int] = []
        try:
            for offset in offsets:
                count = sent.get(offset, 0)
                if not count:
                    raise FrameError(self._not_sent(offset))
                if count == 1:
                    del sent[offset]
                else:
                    sent[offset] = count - 1
                given.append(offset)
        finally:
            if given and self.book is not None:  # anything sent has a book
                self.book.give_back_sent(given)
            offsets.clear()

    def _not_sent(self, offset: int) -> str:
        if self.book is not None and self.book.is_reserved(offset):
            return f"release of offset {offset}, in a reserved region not sent"
        return f"release of offset {offset}, where no region of the arena is in use"

    @staticmethod
    def release_frames(offsets: list[int]) -> list[bytes]:
        """The release frames that give ``offsets`` of the peer's arena back (and clear
        ``offsets``)."""
        step = MAX_RELEASE_OFFSETS
        releases = [encode_release(offsets[i : i + step]) for i in range(0, len(offsets), step)]
        offsets.clear()
        return releases

    def close(self) -> None:
        """Let go of both arenas: the regions the peer never gave back are free again, this
        side's arena closes with the last stream that sends through it, and the peer's is
        unmapped (the memory is freed once the peer closed it too; views still held
        elsewhere keep it mapped until they go). Idempotent."""
        if self._closed:
            return
        self._closed = True
        book = self.book
        if book is not None:
            book.give_back_sent([o for o, count in self._sent.items() for _ in range(count)])
            self._sent.clear()
            book.leave()
        if self.peer is not None:
            self.peer.close()


class _Reservation:
    """A reserved region: its size, whether the caller still holds it, and how many sent
    frames carry it that the peer has not given back yet."""

    __slots__ = ("in_flight", "kept", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.kept = True
        self.in_flight = 0


def _address(buffer: memoryview | np.ndarray) -> int:
    """The address of a buffer's first byte."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _make_arena(nbytes: int) -> Arena | None:
    """An arena of ``nbytes``; None (and a log line) where the platform has none."""
    if nbytes <= 0:
        return None
    try:
        return Arena(nbytes)
    except (TransportError, ValueError) as exc:
        log.warning("no shared memory for this stream (%s): payloads go on the socket", exc)
        return None


async def _exchange(
    connection: ShmConnection, own: Arena | None, send_first: bool
) -> tuple[socket.socket, Arena | None]:
    """Send this side's arena and receive the peer's (in that order when ``send_first``);
    return the socket, taken back from ``connection``, and the peer's arena."""
    fds = [own.fd] if own is not None else []
    if send_first:
        await connection.send(_HELLO, fds)
    message = await connection.recv()
    fds_received = list(message.fds)
    peer: Arena | None = None
    try:
        if message.data != _HELLO or len(fds_received) > 1:
            raise FrameError(f"arena exchange: the peer sent {bytes(message.data[:40])!r}")
        if fds_received:
            peer = Arena.from_fd(fds_received.pop())
    finally:
        close_fds(fds_received)
    sock = connection.detach()
    if not send_first:
        try:
            send_fds(sock, _HELLO, fds)
        except BaseException:
            if peer is not None:
                peer.close()
            sock.close()
            raise
    return sock, peer


async def _trade(
    connection: ShmConnection, own: Arena | None, send_first: bool, timeout_s: float
) -> tuple[socket.socket, Arena | None]:
    """:func:`_exchange` within ``timeout_s``; on any failure ``connection`` is closed."""
    try:
        return await asyncio.wait_for(_exchange(connection, own, send_first), timeout_s)
    except BaseException:
        connection.close()
        raise


async def connect_local(
    path: str, token: str, *, arena_bytes: int, timeout_s: float
) -> tuple[socket.socket, SharedMemory]:
    """Connect to the :class:`LocalSite` at ``path``, authenticate with ``token`` and trade
    arenas (``arena_bytes`` of this side's; 0: share none); return the connected socket,
    ready for the stream's HTTP upgrade, and the stream's :class:`SharedMemory`.

    Raises ``AuthError`` when the site refused the token, ``TransportError`` when it cannot
    be reached or broke the exchange.
    """
    connection = await connect_shm(path, token, timeout_s=timeout_s)
    own = _make_arena(arena_bytes)
    try:
        sock, peer = await _trade(connection, own, True, timeout_s)
    except BaseException as exc:
        if own is not None:
            own.close()
        if isinstance(exc, (OSError, asyncio.TimeoutError, FrameError)):
            raise TransportError(f"cannot share memory through {path!r}: {exc!r}") from exc
        raise
    return sock, SharedMemory(own, peer)


class LocalSite:
    """A private Unix socket through which processes on this host open streams that share
    memory (see the module docstring).

    ``await adopt(sock, shared)`` takes each connection once its arenas were traded: it
    serves the connection (HTTP, then the stream) and owns ``sock`` and ``shared`` from then
    on, also when it raises.

    The site's side of every stream sends through one arena (:attr:`book`): a region
    reserved there reaches any of the site's peers without a copy (a server keeps the
    values it answers with in such regions). The arena lives while the site or any of its
    streams does: it is freed once the site and all its streams are closed.
    """

    def __init__(
        self,
        token: str,
        adopt: Callable[[socket.socket, SharedMemory], Awaitable[None]],
        *,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        parent_directory: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._listener = ShmListener(token, parent_directory=parent_directory)
        self._adopt = adopt
        self._arena_bytes = arena_bytes
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        arena = _make_arena(arena_bytes)
        self._book = None if arena is None else ArenaBook(arena)
        if self._book is not None:
            self._book.join()  # the site's own hold, let go by close()
        self._closed = False
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    @property
    def book(self) -> ArenaBook | None:
        """The regions of the arena the site's side of every stream sends through (None:
        the site shares no memory)."""
        return self._book

    @property
    def path(self) -> str:
        """The socket's path, which the clients connect to."""
        return self._listener.path

    @property
    def directory(self) -> str:
        """The site's private directory."""
        return self._listener.directory

    async def _accept(self) -> None:
        while True:
            try:
                connection = await self._listener.accept()
            except TransportError:
                return
            task = asyncio.get_running_loop().create_task(self._take(connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _take(self, connection: ShmConnection) -> None:
        book = self._book
        own = None if book is None or book.arena.closed else book.arena
        try:
            sock, peer = await _trade(connection, own, False, self._timeout_s)
        except (OSError, asyncio.TimeoutError, TransportError) as exc:
            log.info("a local stream broke off while trading arenas: %r", exc)
            return
        except Exception as exc:  # a bug: logged, and only this connection is lost
            log.error("trading arenas with a local stream failed: %r", exc, exc_info=exc)
            return
        await self._adopt(sock, SharedMemory(book if own is not None else None, peer))

    async def close(self) -> None:
        """Stop accepting and remove the socket and its directory (streams already open
        go on, and the arena with them). Idempotent."""
        if not self._closed and self._book is not None:
            self._book.leave()
        self._closed = True
        self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self._accepting, *self._tasks, return_exceptions=True)
        await self._listener.close()


def remove_leftovers(parent_directory: str | None = None, *, pid: int | None = None) -> list[str]:
    """Remove the site directories (``akv-shm-<pid>-*``, holding at most a socket) left by
    processes that are gone (``pid``: only that process's, which must be gone), as a
    process killed by SIGKILL leaves them; return what was removed. Only directories this
    user owns are touched."""
    parent = parent_directory or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(DIRECTORY_PREFIX):
            continue
        owner = name[len(DIRECTORY_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or (pid is not None and int(owner) != pid):
            continue
        if _alive(int(owner)):
            continue
        directory = os.path.join(parent, name)
        with contextlib.suppress(OSError):
            if os.lstat(directory).st_uid != os.getuid():
                continue
            entries = [os.path.join(directory, entry) for entry in os.listdir(directory)]
            if not all(stat.S_ISSOCK(os.lstat(entry).st_mode) for entry in entries):
                continue  # not only a socket: not ours to remove
            for entry in entries:
                os.unlink(entry)
            os.rmdir(directory)
            removed.append(directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
