"""An arena: a shared buffer backed by an anonymous memory file (``memfd``).

The memory has no name in any file system (not in ``/dev/shm``, not anywhere): it is reached
only through its file descriptor, which is close-on-exec and passed to a peer over a Unix
socket (:func:`akv_transport.shm.send_fds`). The kernel frees it when the last descriptor and the
last mapping are gone, so a process that dies, however it dies, takes its arenas with it.
"""

from __future__ import annotations

import mmap
import os
import stat
import sys
from types import TracebackType

from akv_transport._shm_wire import close_fds
from akv_transport.errors import FrameError, TransportError

if sys.platform != "win32":
    import fcntl

__all__ = ["ARENA_NAME", "MAX_ARENA_BYTES", "Arena", "next_arena_size"]

#: Arenas are never larger than this (what a peer's descriptor is checked against, too).
MAX_ARENA_BYTES = 1 << 40
#: The name an arena's memory file carries in ``/proc/PID/fd`` and ``/proc/PID/maps``
#: (``/memfd:akv-arena (deleted)``), for people who look; it names nothing one could open.
ARENA_NAME = "akv-arena"


class Arena:
    """A shared, fixed-size, zero-initialised buffer of ``nbytes`` bytes.

    Create one with ``Arena(nbytes)``, pass :attr:`fd` to a peer, and the peer adopts it with
    :meth:`Arena.from_fd`; both map the same memory. The memory file is sealed against
    shrinking and growing, and :meth:`from_fd` refuses a descriptor that is not, so no peer
    can truncate the memory under the other's mapping (which would kill it with SIGBUS on the
    next access). An arena grows by replacement: :meth:`grow` returns a new, larger one.

    Not thread-safe; views may be used from any thread while the arena is open.
    """

    def __init__(self, nbytes: int, *, name: str = ARENA_NAME) -> None:
        """Create an arena of ``nbytes`` bytes.

        Raises
        ------
        ValueError
            When ``nbytes`` is outside ``[1, MAX_ARENA_BYTES]``.
        TransportError
            When the platform has no ``memfd_create`` or the kernel refused the memory
            (the cause is attached).
        """
        if not 1 <= nbytes <= MAX_ARENA_BYTES:
            raise ValueError(f"arena: {nbytes} bytes is outside [1, {MAX_ARENA_BYTES}]")
        if not hasattr(os, "memfd_create"):
            raise TransportError(f"arena: memfd_create is not available on {sys.platform}")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise TransportError(f"arena: cannot create a memory file: {exc!r}") from exc
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            )
            memory = _map(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"arena: cannot map {nbytes} bytes: {exc!r}") from exc
        self._init(fd, memory)

    @classmethod
    def from_fd(cls, fd: int, *, max_nbytes: int = MAX_ARENA_BYTES) -> Arena:
        """Adopt a peer's arena from its descriptor, and own ``fd`` from then on.

        ``fd`` is closed by :meth:`close`, and at once if it is refused.

        Raises
        ------
        FrameError
            When ``fd`` is not a memory file sealed against shrinking, is empty, or is
            larger than ``max_nbytes``: what a peer should never send.
        TransportError
            When it cannot be mapped (the cause is attached).
        """
        try:
            info = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(info.st_mode) else 0
        except OSError as exc:
            _close_quietly(fd)
            raise FrameError(f"arena: fd {fd} is not a memory file: {exc!r}") from exc
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = f"is not a regular file (mode {info.st_mode:#o})"
        elif not seals & fcntl.F_SEAL_SHRINK:
            problem = f"is not sealed against shrinking (seals {seals:#x})"
        elif not 1 <= info.st_size <= max_nbytes:
            problem = f"holds {info.st_size} bytes, outside [1, {max_nbytes}]"
        if problem is not None:
            _close_quietly(fd)
            raise FrameError(f"arena: fd {fd} {problem}")
        try:
            memory = _map(fd, info.st_size)
        except OSError as exc:
            _close_quietly(fd)
            raise TransportError(f"arena: cannot map fd {fd}: {exc!r}") from exc
        arena = cls.__new__(cls)
        arena._init(fd, memory)
        return arena

    def _init(self, fd: int, memory: mmap.mmap) -> None:
        self._fd = fd
        self._nbytes = len(memory)
        self._memory: mmap.mmap | None = memory
        self._base: memoryview | None = memoryview(memory)
        self._unmapped = False

    # ------------------------------------------------------------------ access

    @property
    def nbytes(self) -> int:
        """The arena's size in bytes (fixed)."""
        return self._nbytes

    @property
    def fd(self) -> int:
        """The memory file's descriptor (close-on-exec), to pass to a peer.

        Raises
        ------
        TransportError
            When the arena is closed.
        """
        if self._base is None:
            raise TransportError("arena: it is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._base is None

    @property
    def unmapped(self) -> bool:
        """True once the memory is unmapped from this process: after :meth:`close`, when no
        view was still exported at the time (see :meth:`close`)."""
        return self._unmapped

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable ``memoryview`` (format ``"B"``) of ``nbytes`` bytes from ``offset``.

        Writes through it are seen by every process that maps the arena; the arena orders
        nothing: the caller's protocol says when a peer may read what was written.

        Raises
        ------
        FrameError
            (a ``ValueError``) When the range is not inside the arena: offsets often come from
            a peer's message.
        TransportError
            When the arena is closed.
        """
        base = self._base
        if base is None:
            raise TransportError("arena: it is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self._nbytes:
            raise FrameError(
                f"arena: view of {nbytes} bytes at offset {offset} is outside the arena's "
                f"{self._nbytes} bytes"
            )
        return base[offset : offset + nbytes]

    def grow(self, min_nbytes: int, *, copy: bool = True) -> Arena:
        """A new arena of at least ``min_nbytes`` (:func:`next_arena_size`), with this one's
        bytes copied to its start when ``copy``.

        This arena stays open: close it once no peer uses it any more.

        Raises
        ------
        ValueError, TransportError
            As ``Arena()`` does; TransportError when this arena is closed.
        """
        if self._base is None:
            raise TransportError("arena: it is closed")
        grown = Arena(next_arena_size(self._nbytes, min_nbytes))
        if copy:
            grown.view(0, self._nbytes)[:] = self._base
        return grown

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close the descriptor and unmap the memory. Idempotent.

        A view still exported cannot crash the process: when one is, the memory stays mapped
        (and valid) until the last exported view is released, and is unmapped then by the
        garbage collector; :attr:`unmapped` stays False. The descriptor is closed at once
        either way (before Python 3.13 the mapping keeps a duplicate of it until it is
        unmapped), and :meth:`view` refuses from now on.
        """
        base, self._base = self._base, None
        memory, self._memory = self._memory, None
        if base is None or memory is None:
            return
        base.release()
        try:
            memory.close()
            self._unmapped = True
        except BufferError:
            pass
        os.close(self._fd)

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<Arena {self._nbytes} bytes {state}>"


def next_arena_size(current_nbytes: int, needed_nbytes: int) -> int:
    """The size of the arena that replaces one of ``current_nbytes`` to hold ``needed_nbytes``:
    at least double the current size (so that growing n times costs O(log n) replacements),
    in whole pages, and at most :data:`MAX_ARENA_BYTES`.

    Raises
    ------
    ValueError
        When ``needed_nbytes`` exceeds :data:`MAX_ARENA_BYTES`.
    """
    if needed_nbytes > MAX_ARENA_BYTES:
        raise ValueError(f"arena: {needed_nbytes} bytes exceed MAX_ARENA_BYTES {MAX_ARENA_BYTES}")
    size = max(needed_nbytes, 2 * current_nbytes, 1)
    page = mmap.PAGESIZE
    return min(-(-size // page) * page, MAX_ARENA_BYTES)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """Map ``fd`` shared, readable and writable. Before Python 3.13 the mmap object keeps a
    duplicate of ``fd`` (close-on-exec, closed with the mapping): an arena holds two
    descriptors there, one from 3.13 on."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, nbytes, trackfd=False)
    return mmap.mmap(fd, nbytes)


def _close_quietly(fd: int) -> None:
    close_fds([fd])
