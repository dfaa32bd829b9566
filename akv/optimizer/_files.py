"""Files of optimizer states: written through a temporary file beside the target, read
without being read whole (:class:`FileWindow`), and bytes in memory read as a file.

:func:`write_encoded` and :func:`read_encoded` are the one way akv saves and loads a states
file (the local store's and a dist store's ``save_optimizer_states`` and
``load_optimizer_states``); :class:`ReadOnlyFile` is what :func:`akv.optimizer.decode_states`
reads a checkpoint's states or a frame's bytes through.
"""

from __future__ import annotations

import abc
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

from akv.errors import StateFileError

__all__ = ["FileWindow", "ReadOnlyFile", "ViewFile", "read_encoded", "write_encoded"]

T = TypeVar("T")

#: Bytes copied at a time from an encoded states file into its target.
_COPY_BYTES = 16 << 20


def write_encoded(path: Path, encode: Callable[[BinaryIO], object], what: str) -> None:
    """``encode(file)`` into an unnamed temporary file beside ``path`` (not memory: a big
    table's states are not held twice), then copied into ``path``, written through as
    before (a link, the file's mode): a failed encoding leaves ``path`` as it was.

    Raises
    ------
    StateFileError
        ``path`` (or the temporary file beside it) cannot be written; ``what`` names the
        call (``"save_optimizer_states"``).
    """
    try:
        with tempfile.TemporaryFile(dir=path.parent) as spilled:
            encode(spilled)
            spilled.seek(0)
            with open(path, "wb") as file:
                shutil.copyfileobj(spilled, file, _COPY_BYTES)
    except OSError as exc:
        raise StateFileError(f"{what}: cannot write {str(path)!r}: {exc}") from exc


def read_encoded(path: Path, decode: Callable[[bytes | BinaryIO], T], what: str) -> T:
    """``decode`` of the states file at ``path``, given the file itself (through a
    :class:`FileWindow`: a big table's states are not read whole into memory), or, for a
    pipe, which cannot seek, its bytes.

    Raises
    ------
    StateFileError
        ``path`` cannot be opened or read; ``what`` names the call.
    """
    try:
        with open(path, "rb") as file:
            if not file.seekable():
                return decode(file.read())
            size = os.fstat(file.fileno()).st_size
            with FileWindow(file.fileno(), 0, size) as window:
                return decode(cast(BinaryIO, window))
    except OSError as exc:
        raise StateFileError(f"{what}: cannot read {str(path)!r}: {exc}") from exc


class ReadOnlyFile(io.RawIOBase, abc.ABC):
    """A read-only, seekable file of ``size`` bytes whose subclass says how to read the
    bytes at a position (:meth:`_read_at`): memory, or part of another file. The first
    error a read raised is kept (:attr:`error`): a reader that turns errors into others
    (zipfile: a damaged archive) can then be told apart from one that could not read."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size, self._position = size, 0
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        count = min(target.nbytes, self._size - self._position)
        if count <= 0:
            return 0
        try:
            got = self._read_at(self._position, target[:count])
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._position += got
        return got

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}
        position = base[whence] + offset
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def tell(self) -> int:
        return self._position

    @abc.abstractmethod
    def _read_at(self, position: int, target: memoryview) -> int:
        """Fill ``target`` (or its start) with the bytes from ``position``; how many."""


class FileWindow(ReadOnlyFile):
    """Bytes ``[offset, offset + nbytes)`` of an open file (descriptor ``fd``), as a file of
    their own, read with ``pread`` on a duplicate of the descriptor (closing one leaves the
    other open)."""

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        super().__init__(nbytes)
        self._fd, self._offset = os.dup(fd), offset

    def _read_at(self, position: int, target: memoryview) -> int:
        data = os.pread(self._fd, target.nbytes, self._offset + position)
        target[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class ViewFile(ReadOnlyFile):
    """Bytes in memory as a file, never copied whole (a memoryview, a bytearray)."""

    def __init__(self, data: bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        super().__init__(self._view.nbytes)

    def _read_at(self, position: int, target: memoryview) -> int:
        target[:] = self._view[position : position + target.nbytes]
        return target.nbytes
