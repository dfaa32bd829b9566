"""A parameter server's checkpoint on disk, so that a restarted server restores its keys.

A server restarted with the same rank and directory calls :func:`read_snapshot` and carries
on from the :class:`Snapshot` it returns; from time to time it hands :func:`write_snapshot`
a new one. Both are plain blocking calls (the server runs them on a thread): this module
decides nothing about when to checkpoint, and reads no clock.

The file, ``server-{rank}.akvckpt``, holds no pickle and nothing that runs code on load::

    magic          8 bytes   b"AKVCKPT1" (the 1 is the format's version)
    header_nbytes  u64 LE    length of the header
    header         JSON      UTF-8 (ASCII in practice), one object; see below
    payload                  each key's array, in header order, then the optimizer states
    checksum       u32 LE    zlib.crc32 of every byte above it

The header holds ``rank``, ``num_workers``, ``store_type``, ``generation``,
``optimizer_config``, ``durable_seqs``, ``payload_nbytes``, ``optimizer_states`` (``null``
or ``{"offset", "nbytes"}``) and ``keys``: per key ``key``, ``kind`` (``"int"`` or
``"str"``), ``dtype`` (``np.dtype.str`` of a dtype in :data:`akv_transport.DTYPE_CODES`, such as
``"<f4"``), ``shape``, ``closed_round``, ``tags``, ``last_round``, ``offset`` and ``nbytes``
(offsets count from the payload's first byte), and ``untold`` where a failed round's error
waits to be told to some workers (worker rank to its message; absent otherwise), and
``declared`` for a server's part of a key split over the servers (the shape the key was
declared with; its ``shape`` is the part's, a flat slice; absent otherwise).
``round_bases`` (absent when empty): ``[[key, rounds], ...]``, the rounds that count as
none of split and row-sparse keys since a job went on from files of different moments
(``AKV_ACCEPT_MIXED_RESTORE``). A server
that holds row-sparse keys adds ``row_keys`` (absent otherwise, so that such a file is what
an older akv wrote): per key ``key``, ``kind``, ``dtype``, ``shape`` (the declared shape),
``first`` and ``end`` (the server's rows), ``rows`` (how many it stores), ``closed_round``,
``tags``, ``last_round``, ``offset``, ``nbytes`` and maybe ``untold``; its payload is the
stored rows' ids (int64, sorted, unique, in the range) then the rows. Worker ranks, the keys
of ``tags``, ``last_round``, ``untold`` and ``durable_seqs``, are decimal strings in JSON
and ints in Python. The arrays (the dense
keys', then the row-sparse keys') and the optimizer states lie back to back in header
order, without gaps, so that a reader streams the file once, checksumming as it goes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import struct
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

from akv.cluster.server.checkpoint_header import (
    HEADER_MAX_DEPTH,
    KeyRecord,
    RowRecord,
    Snapshot,
    Spill,
    SpilledArray,
    SpilledStates,
    check_bools,
    check_row_ids,
    decode_header,
    encode_header,
    in_memory,
)
from akv.errors import AKVError, CheckpointError
from akv.optimizer._files import FileWindow
from akv.rows import RowTable
from akv_transport import byte_view, parse_json

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "DIRECTORY_MODE",
    "FILE_MODE",
    "MAGIC",
    "KeyRecord",
    "RowRecord",
    "Snapshot",
    "Spill",
    "SpilledArray",
    "SpilledStates",
    "checkpoint_path",
    "in_memory",
    "make_directory",
    "open_spill",
    "read_snapshot",
    "remove_leftovers",
    "write_snapshot",
]

#: The first bytes of a checkpoint file; the trailing digit is the format's version.
MAGIC = b"AKVCKPT1"
#: Largest piece of an array handed to one write or read (and to one checksum update).
CHUNK_BYTES = 64 << 20
#: Mode of a checkpoint file: it holds the model.
FILE_MODE = 0o600
#: Mode of the directories :func:`write_snapshot` creates.
DIRECTORY_MODE = 0o700

_PREFIX = struct.Struct("<8sQ")
_TRAILER = struct.Struct("<I")
_WRITE_BUFFER_BYTES = 1 << 20
#: Bytes of the optimizer states checksummed at a time by a lean read (not kept).
_SKIM_BYTES = 8 << 20


def checkpoint_path(directory: Path, rank: int) -> Path:
    """The checkpoint file of server ``rank`` in ``directory``: ``server-{rank}.akvckpt``."""
    return Path(directory) / f"server-{rank}.akvckpt"


def write_snapshot(directory: Path, snapshot: Snapshot) -> Path:
    """Write ``snapshot`` as server ``snapshot.rank``'s checkpoint in ``directory``, atomically.

    The snapshot is checked first (every dtype, key and counter must be one
    :func:`read_snapshot` gives back unchanged; ``optimizer_config`` must survive JSON
    unchanged), before anything on disk changes. Then ``directory`` is created if missing
    (mode 0o700, missing parents too), and the checkpoint is written to a temporary file
    beside it (mode 0o600, named ``.server-{rank}.akvckpt.{pid}.{random}.tmp``), flushed,
    ``fsync``-ed, renamed over the old checkpoint with :func:`os.replace`, and the directory
    is ``fsync``-ed (skipped only where the OS refuses to open or sync a directory). Arrays
    are written from their own memory, never copied whole. The arrays must not change while
    it runs.

    So a reader sees the previous checkpoint or this one, whole, never a mix; after a
    crash, at worst a leftover temporary file, which :func:`read_snapshot` removes.

    Returns
    -------
    Path
        The checkpoint's path, :func:`checkpoint_path` of the directory and rank.

    Raises
    ------
    CheckpointError
        The snapshot cannot be written as it is, or the writing failed (the message names
        the path and the cause, which is also chained). The temporary file is removed and
        the previous checkpoint, if any, is left as it was. (Only if the final directory
        ``fsync`` fails is the new checkpoint already in place; the message says so.)
    """
    directory = Path(directory)
    path = checkpoint_path(directory, snapshot.rank)
    try:
        header = encode_header(snapshot)
    except ValueError as exc:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from None
    try:
        make_directory(directory)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoint {str(path)!r}: cannot create the directory: {exc}"
        ) from exc
    temporary = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            temporary,
            os.O_WRONLY
            | os.O_CREAT
            | os.O_EXCL
            | getattr(os, "O_CLOEXEC", 0)
            | getattr(os, "O_BINARY", 0),
            FILE_MODE,
        )
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb", buffering=_WRITE_BUFFER_BYTES) as file:
            _write_file(file, header, snapshot)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        _remove_quietly(temporary)
        if isinstance(exc, Exception):
            raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from exc
        raise
    try:
        _sync_directory(directory)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is in place, but its directory could not be synced, "
            f"so it may not survive a power loss: {exc}"
        ) from exc
    return path


def read_snapshot(directory: Path, rank: int, *, lean: bool = False) -> Snapshot | None:
    """Read server ``rank``'s checkpoint in ``directory``; ``None`` if there is none.

    It touches nothing in ``directory`` (a server may be writing meanwhile: reading is
    safe at any time). The whole file is read and its checksum checked before anything
    is returned. The arrays it returns are new: writable, C-contiguous, owning their
    memory. With ``lean``, each row-sparse key's rows are read straight into a
    new :class:`~akv.rows.RowTable` (its ``rows``), never held as an array beside it.

    Raises
    ------
    CheckpointError
        The file exists but cannot be read, or is not a whole checkpoint of server
        ``rank``: bad magic, truncated or too long, checksum mismatch, a malformed header,
        a dtype, shape or offset that does not fit, another rank. The message names the
        path and what is wrong; nothing partly read escapes.
    """
    directory = Path(directory)
    path = checkpoint_path(directory, rank)
    try:
        file = open(path, "rb")  # noqa: SIM115 (closed below, on every path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    try:
        with file:
            return _read_file(file, rank, lean)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc


# --- writing -----------------------------------------------------------------------------


def _write_file(file: BinaryIO, header: bytes, snapshot: Snapshot) -> None:
    """Write the whole file to ``file``, checksumming each piece as it goes."""
    checksum = 0

    def write(data: bytes | memoryview) -> None:
        nonlocal checksum
        view = memoryview(data)
        for start in range(0, view.nbytes, CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            file.write(chunk)
            checksum = zlib.crc32(chunk, checksum)

    def write_part(part: np.ndarray | bytes | SpilledArray | SpilledStates) -> None:
        if isinstance(part, SpilledArray | SpilledStates):
            for chunk in part.chunks(CHUNK_BYTES):
                write(chunk)
        else:
            write(part if isinstance(part, bytes) else byte_view(part))

    write(_PREFIX.pack(MAGIC, len(header)))
    write(header)
    for record in snapshot.keys:
        write_part(record.value)
    for row_record in snapshot.row_keys:
        write_part(row_record.ids)
        assert not isinstance(row_record.rows, RowTable), "encode_header refuses tables"
        write_part(row_record.rows)
    states = snapshot.optimizer_states
    if states is not None:
        assert isinstance(states, bytes | SpilledStates), "encode_header refuses a file"
        write_part(states)
    file.write(_TRAILER.pack(checksum))


def open_spill(directory: Path) -> Spill:
    """A :class:`Spill` in ``directory`` (made, as :func:`make_directory` makes it, when
    missing): an unnamed temporary file, gone once closed or once the process ends."""
    make_directory(directory)
    return Spill(tempfile.TemporaryFile(dir=directory))


def make_directory(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each with :data:`DIRECTORY_MODE`.

    (``os.makedirs`` gives missing parents the default mode, whatever its ``mode`` says.)
    """
    missing: list[Path] = []
    current = directory
    while not current.is_dir() and current.parent != current:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIRECTORY_MODE)
        except FileExistsError:
            if not path.is_dir():
                raise


def _sync_directory(directory: Path) -> None:
    """``fsync`` ``directory``, so that a rename in it survives a power loss, where the OS can.

    Skipped where the OS refuses: no ``O_DIRECTORY`` (Windows), a directory that cannot be
    opened, a file system that does not sync directories.
    """
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _SYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def remove_leftovers(directory: Path, rank: int) -> None:
    """Remove the temporary files that writers of server ``rank``'s checkpoint left behind
    (a writer that died; errors are ignored). Call it only while no writer of that rank
    runs: the server does, at its start, holding the rank's lock."""
    _remove_leftovers(Path(directory), checkpoint_path(Path(directory), rank).name)


def _remove_leftovers(directory: Path, name: str) -> None:
    try:
        leftovers = list(directory.glob(f".{name}.*tmp*"))
    except OSError:
        return
    for path in leftovers:
        _remove_quietly(path)


# --- reading -----------------------------------------------------------------------------


def _empty_table(record: RowRecord) -> RowTable | None:
    """A table for ``record``'s rows, whose ids were read: None where they are not ones a
    table takes (a damaged file: its rows are read as an array, and the checksum or the
    ids' check after it says what is wrong)."""
    try:
        check_row_ids(record.ids, record.first, record.end, record.shape, "")
        return RowTable(record.shape, record.rows.dtype)
    except (ValueError, AKVError):
        return None


# A ValueError here means the file is malformed; read_snapshot adds the path.


def _read_file(file: io.BufferedReader, rank: int, lean: bool) -> Snapshot:
    """Read and check server ``rank``'s whole checkpoint; return it once the checksum matched."""
    size = os.fstat(file.fileno()).st_size
    least = _PREFIX.size + _TRAILER.size
    if size < least:
        raise ValueError(f"truncated: {size} bytes, fewer than the {least} of any checkpoint")
    checksum = 0

    def read(nbytes: int, what: str) -> bytes:
        nonlocal checksum
        data = file.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"truncated in the {what}: {len(data)} of {nbytes} bytes")
        checksum = zlib.crc32(data, checksum)
        return data

    def read_into(view: memoryview, what: str) -> None:
        nonlocal checksum
        for start in range(0, view.nbytes, CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            done = 0
            while done < chunk.nbytes:
                got = file.readinto(chunk[done:])
                if not got:
                    raise ValueError(f"truncated in the {what}")
                done += got
            checksum = zlib.crc32(chunk, checksum)

    magic, header_nbytes = _PREFIX.unpack(read(_PREFIX.size, "prefix"))
    if magic != MAGIC:
        raise ValueError(f"not an akv checkpoint: it starts {magic!r}, not {MAGIC!r}")
    if header_nbytes > size - least:
        raise ValueError(
            f"truncated: the header alone claims {header_nbytes} bytes, the file has {size}"
        )
    payload_nbytes = size - least - header_nbytes
    header = parse_json(read(header_nbytes, "header"), max_depth=HEADER_MAX_DEPTH)
    snapshot, slots, states_nbytes = decode_header(header, payload_nbytes, rank)
    for record in slots:
        read_into(byte_view(in_memory(record.value)), f"array of key {record.key!r}")
    for row_record in snapshot.row_keys:
        read_into(byte_view(row_record.ids), f"row ids of key {row_record.key!r}")
        what = f"rows of key {row_record.key!r}"
        table = _empty_table(row_record) if lean else None
        if table is None:
            read_into(byte_view(in_memory(row_record.rows)), what)
        else:
            table.load(row_record.ids, lambda rows: read_into(byte_view(rows), what))  # noqa: B023
            row_record.rows = table
    states: bytes | BinaryIO | None = None
    if states_nbytes is not None and lean:  # checksummed here, decoded from the file later
        states = cast(BinaryIO, FileWindow(file.fileno(), file.tell(), states_nbytes))
        scratch = memoryview(bytearray(min(states_nbytes, _SKIM_BYTES)))
        try:
            for start in range(0, states_nbytes, _SKIM_BYTES):
                read_into(scratch[: min(_SKIM_BYTES, states_nbytes - start)], "optimizer states")
        except BaseException:
            states.close()
            raise
    elif states_nbytes is not None:
        states = read(states_nbytes, "optimizer states")
    data = file.read(_TRAILER.size)
    try:
        if len(data) != _TRAILER.size:
            raise ValueError("truncated in the checksum")
        (stored,) = _TRAILER.unpack(data)
        if stored != checksum:
            raise ValueError(
                f"checksum mismatch: the file says {stored:#010x}, its bytes give {checksum:#010x}"
            )
        _check_arrays(snapshot, slots)
    except BaseException:
        if states is not None and not isinstance(states, bytes):
            states.close()
        raise
    snapshot.keys = slots
    snapshot.optimizer_states = states
    return snapshot


def _check_arrays(snapshot: Snapshot, slots: list[KeyRecord]) -> None:
    """What a checksum cannot vouch for: bools of 0 or 1, row ids in order and range."""
    for record in slots:
        check_bools(record.key, in_memory(record.value))
    for row_record in snapshot.row_keys:
        where = f"row-sparse key {row_record.key!r}"
        check_row_ids(row_record.ids, row_record.first, row_record.end, row_record.shape, where)
        rows = row_record.rows
        check_bools(row_record.key, rows.rows if isinstance(rows, RowTable) else in_memory(rows))
