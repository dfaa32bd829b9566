"""Where a worker's row pushes wait for their answers when no shared arena takes them."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["MAX_SPARE_PUSH_BUFFERS", "MAX_SPARE_PUSH_BYTES", "PushBuffers"]

#: Free push buffers kept for reuse, at most this many and this many bytes in all: a push
#: of several row-sparse keys over several servers takes one buffer per key and server.
MAX_SPARE_PUSH_BUFFERS = 32
MAX_SPARE_PUSH_BYTES = 64 << 20


class PushBuffers:
    """Reusable memory for the rows of row pushes sent over a socket, where no shared arena
    takes them: rows wait there until every server answered, as in an arena's region.

    A push's rows differ in size from step to step, so a dense key's spare buffers (of the
    key's shape) do not fit; fresh arrays of that size cost page faults on every push (the
    allocator gives their pages back to the system and takes new ones: about a tenth of a
    two-worker step over TCP). A buffer is taken for ``nbytes`` (the smallest free one
    large enough, else a new one a quarter larger where that may be kept) and given back by
    the array laid over it; the most recently given back are kept free, at most
    :data:`MAX_SPARE_PUSH_BUFFERS` of at most :data:`MAX_SPARE_PUSH_BYTES` in all.
    Thread-safe: a push takes in its caller's thread, its answers give back on the loop's.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory, the caller's until :meth:`give_back`."""
        with self._lock:
            free = self._free
            fits = [index for index, buffer in enumerate(free) if buffer.nbytes >= nbytes]
            if fits:
                buffer = free.pop(min(fits, key=lambda index: free[index].nbytes))
            else:
                # A quarter more, for the next pushes' sizes; none for one too big to keep.
                spare = nbytes // 4 if nbytes + nbytes // 4 <= MAX_SPARE_PUSH_BYTES else 0
                buffer = np.empty(max(nbytes + spare, 1), np.uint8)
            self._lent[buffer.ctypes.data] = buffer
        return buffer.data[:nbytes]

    def give_back(self, view: memoryview | np.ndarray) -> None:
        """Give back what :meth:`take` returned (or an array laid over it from its start);
        raises ValueError for memory not taken here."""
        address = np.asarray(view).ctypes.data
        with self._lock:
            buffer = self._lent.pop(address, None)
            if buffer is None:
                raise ValueError(f"give_back: no push buffer was lent at address {address:#x}")
            if buffer.nbytes > MAX_SPARE_PUSH_BYTES:
                return
            free = self._free
            free.append(buffer)
            while len(free) > MAX_SPARE_PUSH_BUFFERS or _nbytes(free) > MAX_SPARE_PUSH_BYTES:
                del free[0]  # the oldest: the sizes of recent pushes are kept

    @property
    def kept_bytes(self) -> int:
        """The bytes of the free buffers kept."""
        with self._lock:
            return _nbytes(self._free)


def _nbytes(buffers: list[np.ndarray]) -> int:
    return sum(buffer.nbytes for buffer in buffers)
