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
(offsets count from the payload's first byte). A server that holds row-sparse keys adds
``row_keys`` (absent otherwise, so that such a file is what an older akv wrote): per key
``key``, ``kind``, ``dtype``, ``shape`` (the declared shape), ``first`` and ``end`` (the
server's rows), ``rows`` (how many it stores), ``closed_round``, ``tags``, ``last_round``,
``offset`` and ``nbytes``; its payload is the stored rows' ids (int64, sorted, unique, in
the range) then the rows. Worker ranks, the keys of ``tags``, ``last_round`` and
``durable_seqs``, are decimal strings in JSON and ints in Python. The arrays (the dense
keys', then the row-sparse keys') and the optimizer states lie back to back in header
order, without gaps, so that a reader streams the file once, checksumming as it goes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import secrets
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import numpy as np

from akv.errors import CheckpointError
from akv_transport import DEFAULT_JSON_MAX_DEPTH, DTYPE_CODES, parse_json
from akv_transport.frame import MAX_NDIM

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CHUNK_BYTES",
    "DIRECTORY_MODE",
    "FILE_MODE",
    "MAGIC",
    "KeyRecord",
    "RowRecord",
    "Snapshot",
    "checkpoint_path",
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
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U64_MAX = (1 << 64) - 1
# NumPy refuses arrays whose non-zero dimensions multiply (times the itemsize) past this.
_MAX_ARRAY_BYTES = (1 << 63) - 1
# The header is one object; the optimizer config is a value inside it.
_HEADER_MAX_DEPTH = DEFAULT_JSON_MAX_DEPTH + 1
_RANK_TEXT = re.compile(r"0|[1-9][0-9]{0,19}")
_DTYPES_BY_STR = {dtype.str: dtype for dtype in DTYPE_CODES}
_HEADER_FIELDS = frozenset(
    {
        "rank",
        "num_workers",
        "store_type",
        "generation",
        "optimizer_config",
        "durable_seqs",
        "payload_nbytes",
        "optimizer_states",
        "keys",
    }
)
_KEY_FIELDS = frozenset(
    {"key", "kind", "dtype", "shape", "closed_round", "tags", "last_round", "offset", "nbytes"}
)
_STATES_FIELDS = frozenset({"offset", "nbytes"})
_ROW_KEY_FIELDS = frozenset(
    {
        "key",
        "kind",
        "dtype",
        "shape",
        "first",
        "end",
        "rows",
        "closed_round",
        "tags",
        "last_round",
        "offset",
        "nbytes",
    }
)
_IDS = np.dtype("<i8")


@dataclass
class KeyRecord:
    """One key as a server holds it: its value and how far each worker's pushes reached it.

    ``key`` is the key, or this server's part of a split key (an ``int`` within int64, or a
    ``str``). ``value`` is C-contiguous, of a dtype in :data:`akv_transport.DTYPE_CODES`.
    ``closed_round`` counts the rounds applied into ``value``; ``tags`` maps a worker rank
    to the number of that worker's last push reflected in ``value``, ``last_round`` to the
    round of that push.
    """

    key: int | str
    value: np.ndarray
    closed_round: int
    tags: dict[int, int]
    last_round: dict[int, int]


@dataclass
class RowRecord:
    """One row-sparse key as a server holds it: the declared ``shape``, the server's rows
    ``[first, end)``, the rows it stores (``ids``: int64, sorted, unique, in the range;
    ``rows``: one row of ``shape[1:]`` per id, C-contiguous) and its rounds as
    :class:`KeyRecord`'s."""

    key: int | str
    shape: tuple[int, ...]
    first: int
    end: int
    ids: np.ndarray
    rows: np.ndarray
    closed_round: int
    tags: dict[int, int]
    last_round: dict[int, int]


@dataclass
class Snapshot:
    """Everything a server needs to carry on after a restart.

    ``generation`` increases with every checkpoint a server writes (the caller's to count).
    ``optimizer_config`` is a JSON object (or ``None``), ``optimizer_states`` opaque bytes
    (or ``None``); ``durable_seqs`` maps a worker rank to a sequence number below which every
    request of that worker is reflected. ``store_type`` is kept as given
    (``"dist_sync"``, ``"dist_async"``). Counters and ranks are non-negative ints.
    """

    rank: int
    num_workers: int
    store_type: str
    generation: int
    keys: list[KeyRecord]
    optimizer_config: dict[str, Any] | None
    optimizer_states: bytes | None
    durable_seqs: dict[int, int]
    row_keys: list[RowRecord] = field(default_factory=list)


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
        header = _encode_header(snapshot)
    except ValueError as exc:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {exc}") from None
    try:
        _make_directory(directory)
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


def read_snapshot(directory: Path, rank: int) -> Snapshot | None:
    """Read server ``rank``'s checkpoint in ``directory``; ``None`` if there is none.

    It touches nothing in ``directory`` (a server may be writing meanwhile: reading is
    safe at any time). The whole file is read and its checksum checked before anything
    is returned. The arrays it returns are new: writable, C-contiguous, owning their
    memory.

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
            return _read_file(file, rank)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc


# --- writing -----------------------------------------------------------------------------


def _encode_header(snapshot: Snapshot) -> bytes:
    """The header's bytes; ``ValueError``, naming the field, for what cannot be kept."""
    _count(snapshot.rank, "rank")
    _count(snapshot.num_workers, "num_workers")
    _count(snapshot.generation, "generation")
    if not isinstance(snapshot.store_type, str):
        raise ValueError(f"store_type must be a str, not {type(snapshot.store_type).__name__}")
    durable_seqs = _rank_map_to_json(snapshot.durable_seqs, "durable_seqs")
    seen: set[tuple[str, int | str]] = set()
    encoded: list[dict[str, Any]] = []
    offset = 0
    records: list[KeyRecord | RowRecord] = [*snapshot.keys, *snapshot.row_keys]
    for record in records:
        if isinstance(record, RowRecord):
            entry = _encode_row_record(record, offset)
        else:
            entry = _encode_record(record, offset)
        if (entry["kind"], record.key) in seen:
            raise ValueError(f"key {record.key!r} appears twice")
        seen.add((entry["kind"], record.key))
        encoded.append(entry)
        offset += entry["nbytes"]
    keys, row_keys = encoded[: len(snapshot.keys)], encoded[len(snapshot.keys) :]
    states: dict[str, int] | None = None
    if snapshot.optimizer_states is not None:
        if not isinstance(snapshot.optimizer_states, bytes):
            kind = type(snapshot.optimizer_states).__name__
            raise ValueError(f"optimizer_states must be bytes or None, not {kind}")
        states = {"offset": offset, "nbytes": len(snapshot.optimizer_states)}
        offset += len(snapshot.optimizer_states)
    header = {
        "rank": snapshot.rank,
        "num_workers": snapshot.num_workers,
        "store_type": snapshot.store_type,
        "generation": snapshot.generation,
        "optimizer_config": _checked_config(snapshot.optimizer_config),
        "durable_seqs": durable_seqs,
        "payload_nbytes": offset,
        "optimizer_states": states,
        "keys": keys,
    }
    if row_keys:
        header["row_keys"] = row_keys
    # ASCII (every other character escaped) round-trips any str, lone surrogates included.
    text = json.dumps(header, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.encode("ascii")


def _key_kind(key: object) -> str:
    if isinstance(key, str):
        return "str"
    if isinstance(key, int) and not isinstance(key, bool):
        if not _I64_MIN <= key <= _I64_MAX:
            raise ValueError(f"key {key}: an int key must fit in int64")
        return "int"
    raise ValueError(f"key {key!r}: a key must be an int or a str, not {type(key).__name__}")


def _encode_record(record: KeyRecord, offset: int) -> dict[str, Any]:
    key = record.key
    kind = _key_kind(key)
    value = record.value
    if not isinstance(value, np.ndarray):
        kind_name = type(value).__name__
        raise ValueError(f"key {key!r}: the value must be a NumPy array, not {kind_name}")
    if value.dtype not in DTYPE_CODES:
        known = ", ".join(sorted(_DTYPES_BY_STR))
        raise ValueError(f"key {key!r}: dtype {value.dtype.str} is not one of {known}")
    if not value.flags.c_contiguous:
        raise ValueError(f"key {key!r}: the value must be C-contiguous")
    if value.ndim > MAX_NDIM:
        raise ValueError(f"key {key!r}: {value.ndim} dimensions; at most {MAX_NDIM} are kept")
    where = f"key {key!r}"
    _count(record.closed_round, f"{where}: closed_round")
    return {
        "key": key,
        "kind": kind,
        "dtype": value.dtype.str,
        "shape": list(value.shape),
        "closed_round": record.closed_round,
        "tags": _rank_map_to_json(record.tags, f"{where}: tags"),
        "last_round": _rank_map_to_json(record.last_round, f"{where}: last_round"),
        "offset": offset,
        "nbytes": value.nbytes,
    }


def _encode_row_record(record: RowRecord, offset: int) -> dict[str, Any]:
    key = record.key
    kind = _key_kind(key)
    where = f"row-sparse key {key!r}"
    ids, rows = record.ids, record.rows
    if not isinstance(ids, np.ndarray) or ids.dtype != _IDS or ids.ndim != 1:
        raise ValueError(f"{where}: ids must be a 1-D int64 NumPy array")
    if not isinstance(rows, np.ndarray) or rows.dtype not in DTYPE_CODES:
        raise ValueError(f"{where}: rows must be a NumPy array of a dtype in DTYPE_CODES")
    shape = tuple(record.shape)
    if not shape or len(shape) > MAX_NDIM or rows.shape != (ids.size, *shape[1:]):
        raise ValueError(f"{where}: rows of shape {rows.shape} for {ids.size} ids of {shape}")
    if not (ids.flags.c_contiguous and rows.flags.c_contiguous):
        raise ValueError(f"{where}: ids and rows must be C-contiguous")
    _check_row_ids(ids, record.first, record.end, shape, where)
    _count(record.closed_round, f"{where}: closed_round")
    return {
        "key": key,
        "kind": kind,
        "dtype": rows.dtype.str,
        "shape": [_count(size, f"{where}: shape") for size in shape],
        "first": record.first,
        "end": record.end,
        "rows": int(ids.size),
        "closed_round": record.closed_round,
        "tags": _rank_map_to_json(record.tags, f"{where}: tags"),
        "last_round": _rank_map_to_json(record.last_round, f"{where}: last_round"),
        "offset": offset,
        "nbytes": ids.nbytes + rows.nbytes,
    }


def _check_row_ids(
    ids: np.ndarray, first: int, end: int, shape: tuple[int, ...], where: str
) -> None:
    """``ids`` sorted, unique and in ``[first, end)``, a range of ``shape[0]``'s rows."""
    _count(first, f"{where}: first")
    _count(end, f"{where}: end")
    if not first <= end <= shape[0]:
        raise ValueError(f"{where}: rows [{first}, {end}) are not rows of shape {list(shape)}")
    if ids.size and (ids[0] < first or ids[-1] >= end or bool(np.any(ids[1:] <= ids[:-1]))):
        raise ValueError(f"{where}: its ids are not sorted, unique and in [{first}, {end})")


def _checked_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``config``, if JSON gives it back equal (no tuples, NaN, non-str keys, deep nesting)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"optimizer_config must be a dict or None, not {type(config).__name__}")
    try:
        text = json.dumps(config, allow_nan=False)
        same = parse_json(text, max_depth=DEFAULT_JSON_MAX_DEPTH) == config
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"optimizer_config is not JSON: {exc}") from None
    if not same:
        raise ValueError(
            "optimizer_config does not come back from JSON unchanged (a tuple, a non-str key?)"
        )
    return config


def _rank_map_to_json(mapping: dict[int, int], what: str) -> dict[str, int]:
    if not isinstance(mapping, dict):
        raise ValueError(f"{what} must be a dict, not {type(mapping).__name__}")
    for rank, count in mapping.items():
        _count(rank, f"{what}: worker rank {rank!r}")
        _count(count, f"{what}[{rank}]")
    return {str(rank): count for rank, count in mapping.items()}


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

    write(_PREFIX.pack(MAGIC, len(header)))
    write(header)
    for record in snapshot.keys:
        write(_bytes_of(record.value))
    for row_record in snapshot.row_keys:
        write(_bytes_of(row_record.ids))
        write(_bytes_of(row_record.rows))
    if snapshot.optimizer_states is not None:
        write(snapshot.optimizer_states)
    file.write(_TRAILER.pack(checksum))


def _bytes_of(array: np.ndarray) -> memoryview:
    """The memory of a C-contiguous array as bytes, without a copy (0-d and empty too).

    (``memoryview(array).cast("B")`` refuses arrays with a zero in their shape.)
    """
    return memoryview(cast("Buffer", array.reshape(-1).view(np.uint8)))


def _make_directory(directory: Path) -> None:
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
# A ValueError here means the file is malformed; read_snapshot adds the path.


def _read_file(file: io.BufferedReader, rank: int) -> Snapshot:
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
    header = parse_json(read(header_nbytes, "header"), max_depth=_HEADER_MAX_DEPTH)
    snapshot, slots, states_nbytes = _decode_header(header, payload_nbytes, rank)
    for record in slots:
        read_into(_bytes_of(record.value), f"array of key {record.key!r}")
    for row_record in snapshot.row_keys:
        read_into(_bytes_of(row_record.ids), f"row ids of key {row_record.key!r}")
        read_into(_bytes_of(row_record.rows), f"rows of key {row_record.key!r}")
    states = None if states_nbytes is None else read(states_nbytes, "optimizer states")
    data = file.read(_TRAILER.size)
    if len(data) != _TRAILER.size:
        raise ValueError("truncated in the checksum")
    (stored,) = _TRAILER.unpack(data)
    if stored != checksum:
        raise ValueError(
            f"checksum mismatch: the file says {stored:#010x}, its bytes give {checksum:#010x}"
        )
    for record in slots:
        _check_bools(record.key, record.value)
    for row_record in snapshot.row_keys:
        where = f"row-sparse key {row_record.key!r}"
        _check_row_ids(row_record.ids, row_record.first, row_record.end, row_record.shape, where)
        _check_bools(row_record.key, row_record.rows)
    snapshot.keys = slots
    snapshot.optimizer_states = states
    return snapshot


def _decode_header(
    header: object, payload_nbytes: int, rank: int
) -> tuple[Snapshot, list[KeyRecord], int | None]:
    """The snapshot a header describes, with empty arrays to read the payload into.

    Every offset and size is checked against the payload before an array is allocated, so
    what is allocated never exceeds the file's size.
    """
    row_entries: object = []
    if isinstance(header, dict) and "row_keys" in header:
        header = dict(header)
        row_entries = header.pop("row_keys")
    fields = _fields(header, _HEADER_FIELDS, "the header")
    if _count(fields["rank"], "rank") != rank:
        raise ValueError(f"it holds server {fields['rank']}'s keys, not server {rank}'s")
    claimed = _count(fields["payload_nbytes"], "payload_nbytes")
    if claimed != payload_nbytes:
        raise ValueError(
            f"truncated or too long: the header gives the payload {claimed} bytes, "
            f"the file holds {payload_nbytes}"
        )
    store_type = fields["store_type"]
    if not isinstance(store_type, str):
        raise ValueError(f"store_type {store_type!r} is not a string")
    config = fields["optimizer_config"]
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"optimizer_config is a {type(config).__name__}, not an object or null")
    keys = fields["keys"]
    if not isinstance(keys, list):
        raise ValueError(f"keys is a {type(keys).__name__}, not a list")
    if not isinstance(row_entries, list):
        raise ValueError(f"row_keys is a {type(row_entries).__name__}, not a list")
    records: list[KeyRecord] = []
    row_records: list[RowRecord] = []
    seen: set[tuple[type, int | str]] = set()
    offset = 0
    for index, entry in enumerate([*keys, *row_entries]):
        record: KeyRecord | RowRecord
        if index < len(keys):
            record = _decode_record(entry, index, offset, payload_nbytes)
            records.append(record)
            offset += record.value.nbytes
        else:
            record = _decode_row_record(entry, index - len(keys), offset, payload_nbytes)
            row_records.append(record)
            offset += record.ids.nbytes + record.rows.nbytes
        if (type(record.key), record.key) in seen:
            raise ValueError(f"key {record.key!r} appears twice")
        seen.add((type(record.key), record.key))
    states_nbytes: int | None = None
    if fields["optimizer_states"] is not None:
        states = _fields(fields["optimizer_states"], _STATES_FIELDS, "optimizer_states")
        _check_place(states, offset, payload_nbytes, "optimizer_states")
        states_nbytes = states["nbytes"]
        offset += states["nbytes"]
    if offset != payload_nbytes:
        raise ValueError(
            f"the arrays and states take {offset} bytes; the payload has {payload_nbytes}"
        )
    snapshot = Snapshot(
        rank=rank,
        num_workers=_count(fields["num_workers"], "num_workers"),
        store_type=store_type,
        generation=_count(fields["generation"], "generation"),
        keys=[],
        optimizer_config=config,
        optimizer_states=None,
        durable_seqs=_rank_map_from_json(fields["durable_seqs"], "durable_seqs"),
        row_keys=row_records,
    )
    return snapshot, records, states_nbytes


def _decode_key(fields: dict[str, Any], what: str) -> tuple[int | str, np.dtype, tuple[int, ...]]:
    """A key record's key, dtype and shape, checked."""
    key, kind = fields["key"], fields["kind"]
    if kind == "int":
        key = _integer(key, _I64_MIN, _I64_MAX, f"{what}.key")
    elif kind != "str" or not isinstance(key, str):
        raise ValueError(f"{what}: key {key!r} of kind {kind!r} (kinds: 'int', 'str')")
    where = f"key {key!r}"
    dtype = _DTYPES_BY_STR.get(fields["dtype"]) if isinstance(fields["dtype"], str) else None
    if dtype is None:
        raise ValueError(
            f"{where}: dtype {fields['dtype']!r} is not one of {sorted(_DTYPES_BY_STR)}"
        )
    shape = fields["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValueError(f"{where}: shape {shape!r} is not a list of at most {MAX_NDIM} sizes")
    dims = tuple(_count(size, f"{where}: shape") for size in shape)
    return key, dtype, dims


def _decode_row_record(entry: object, index: int, offset: int, payload_nbytes: int) -> RowRecord:
    fields = _fields(entry, _ROW_KEY_FIELDS, f"row_keys[{index}]")
    key, dtype, shape = _decode_key(fields, f"row_keys[{index}]")
    where = f"row-sparse key {key!r}"
    if not shape:
        raise ValueError(f"{where}: a row-sparse key has at least one dimension")
    rows = _count(fields["rows"], f"{where}: rows")
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    _check_place(fields, offset, payload_nbytes, where)
    if fields["nbytes"] != rows * (_IDS.itemsize + row_bytes):
        raise ValueError(f"{where}: nbytes {fields['nbytes']} does not fit {rows} rows of {shape}")
    return RowRecord(
        key=key,
        shape=shape,
        first=_count(fields["first"], f"{where}: first"),
        end=_count(fields["end"], f"{where}: end"),
        ids=np.empty(rows, _IDS),
        rows=np.empty((rows, *shape[1:]), dtype),
        closed_round=_count(fields["closed_round"], f"{where}: closed_round"),
        tags=_rank_map_from_json(fields["tags"], f"{where}: tags"),
        last_round=_rank_map_from_json(fields["last_round"], f"{where}: last_round"),
    )


def _decode_record(entry: object, index: int, offset: int, payload_nbytes: int) -> KeyRecord:
    fields = _fields(entry, _KEY_FIELDS, f"keys[{index}]")
    key, dtype, dims = _decode_key(fields, f"keys[{index}]")
    where = f"key {key!r}"
    if math.prod(size for size in dims if size) * dtype.itemsize > _MAX_ARRAY_BYTES:
        raise ValueError(f"{where}: shape {list(dims)} is too large for an array")
    _check_place(fields, offset, payload_nbytes, where)
    if fields["nbytes"] != math.prod(dims) * dtype.itemsize:
        raise ValueError(
            f"{where}: nbytes {fields['nbytes']} does not fit shape {list(dims)} of {dtype.str}"
        )
    return KeyRecord(
        key=key,
        value=np.empty(dims, dtype),
        closed_round=_count(fields["closed_round"], f"{where}: closed_round"),
        tags=_rank_map_from_json(fields["tags"], f"{where}: tags"),
        last_round=_rank_map_from_json(fields["last_round"], f"{where}: last_round"),
    )


def _check_place(fields: Mapping[str, object], offset: int, payload_nbytes: int, what: str) -> None:
    """Check that ``fields`` place a piece at ``offset``, within the payload."""
    start = _count(fields["offset"], f"{what}: offset")
    nbytes = _count(fields["nbytes"], f"{what}: nbytes")
    if start != offset:
        raise ValueError(f"{what}: offset {start}, expected {offset} (pieces lie back to back)")
    if start + nbytes > payload_nbytes:
        raise ValueError(
            f"{what}: bytes {start} to {start + nbytes} lie outside the payload of {payload_nbytes}"
        )


def _check_bools(key: int | str, value: np.ndarray) -> None:
    """NumPy expects a bool to be the byte 0 or 1; a file could hold any byte."""
    if value.dtype == np.bool_ and bool((value.view(np.uint8) > 1).any()):
        raise ValueError(f"key {key!r}: a bool array holds a byte other than 0 and 1")


def _fields(value: object, names: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    if value.keys() != names:
        missing, unknown = sorted(names - value.keys()), sorted(value.keys() - names)
        raise ValueError(f"{what}: fields missing {missing}, unknown {unknown}")
    return value


def _rank_map_from_json(value: object, what: str) -> dict[int, int]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    mapping: dict[int, int] = {}
    for text, count in value.items():
        if not _RANK_TEXT.fullmatch(text) or int(text) > _U64_MAX:
            raise ValueError(f"{what}: {text!r} is not a worker rank")
        mapping[int(text)] = _count(count, f"{what}[{text}]")
    return mapping


# --- both --------------------------------------------------------------------------------


def _count(value: object, what: str) -> int:
    """``value`` if it is an int in [0, 2**64) (a rank, a counter, a size); else ValueError."""
    return _integer(value, 0, _U64_MAX, what)


def _integer(value: object, least: int, most: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, not {type(value).__name__} {value!r}")
    if not least <= value <= most:
        raise ValueError(f"{what} is {value}, outside [{least}, {most}]")
    return value
