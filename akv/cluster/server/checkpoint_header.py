"""A checkpoint's records (:class:`KeyRecord`, :class:`RowRecord`, :class:`Snapshot`) and
its JSON header, encoded and decoded with every field checked; no I/O (the file around the
header, its payload and checksum are :mod:`akv.cluster.server.checkpoint`'s, whose docstring
describes the format).

A ``ValueError`` from here names the field that cannot be kept (encoding) or is malformed
(decoding); :mod:`~akv.cluster.server.checkpoint` turns it into a
:class:`~akv.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from akv.rows import RowTable
from akv_transport import DEFAULT_JSON_MAX_DEPTH, DTYPE_CODES, byte_view, parse_json
from akv_transport.frame import MAX_NDIM

__all__ = [
    "HEADER_MAX_DEPTH",
    "KeyRecord",
    "RowRecord",
    "Snapshot",
    "Spill",
    "SpilledArray",
    "SpilledStates",
    "check_bools",
    "check_row_ids",
    "decode_header",
    "encode_header",
    "in_memory",
]

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U64_MAX = (1 << 64) - 1
# NumPy refuses arrays whose non-zero dimensions multiply (times the itemsize) past this.
_MAX_ARRAY_BYTES = (1 << 63) - 1
#: The JSON depth a header may have: it is one object; the optimizer config is a value
#: inside it.
HEADER_MAX_DEPTH = DEFAULT_JSON_MAX_DEPTH + 1
_RANK_TEXT = re.compile(r"0|[1-9][0-9]{0,19}")
#: The longest worker session id kept (a worker's is a uuid4 hex: 32).
MAX_SESSION_CHARS = 128
#: The longest message kept of a failed round's error.
MAX_MESSAGE_CHARS = 4096
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
#: The header's fields that files written before them lack.
_OPTIONAL_FIELDS = frozenset({"row_keys", "sessions", "num_servers", "round_bases"})
_KEY_FIELDS = frozenset(
    {"key", "kind", "dtype", "shape", "closed_round", "tags", "last_round", "offset", "nbytes"}
)
#: The fields of a key's entry that files written before them lack.
_RECORD_OPTIONAL = frozenset({"untold", "declared"})
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
    round of that push; ``untold`` to the message of a failed round's error that worker was
    not told of yet (its next pull of the key raises it).
    """

    key: int | str
    value: np.ndarray | SpilledArray
    closed_round: int
    tags: dict[int, int]
    last_round: dict[int, int]
    #: Workers not told yet of a round of the key that failed, with its error's message.
    untold: dict[int, str] = field(default_factory=dict)
    #: The shape a key split over the servers was declared with (``value`` is this
    #: server's part); None for a key not split.
    declared: tuple[int, ...] | None = None


@dataclass
class RowRecord:
    """One row-sparse key as a server holds it: the declared ``shape``, the server's rows
    ``[first, end)``, the rows it stores (``ids``: int64, sorted, unique, in the range;
    ``rows``: one row of ``shape[1:]`` per id, C-contiguous; read with ``lean``, a
    table of them) and its rounds as :class:`KeyRecord`'s."""

    key: int | str
    shape: tuple[int, ...]
    first: int
    end: int
    ids: np.ndarray
    rows: np.ndarray | SpilledArray | RowTable
    closed_round: int
    tags: dict[int, int]
    last_round: dict[int, int]
    untold: dict[int, str] = field(default_factory=dict)


class Spill:
    """What a checkpoint copied of a server's keys, in an unnamed temporary file (``file``)
    of the checkpoint directory instead of memory, from the copy (made while the keys are
    held) until the checkpoint is written from it: a big table is never held twice, as it
    and a copy. Each part is appended and read back by its offset; :meth:`close` removes
    the file."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file

    def append(self, write: Callable[[BinaryIO], object]) -> tuple[int, int]:
        """``write(file)`` at the file's end; where what it wrote starts, and its bytes."""
        offset = self.file.seek(0, 2)
        write(self.file)
        return offset, self.file.seek(0, 2) - offset

    def array(self, value: np.ndarray) -> SpilledArray:
        """``value`` appended (in C order)."""
        offset, _ = self.append(lambda file: file.write(byte_view(np.ascontiguousarray(value))))
        return SpilledArray(self, offset, value.dtype, value.shape)

    def chunks(self, offset: int, nbytes: int, size: int) -> Iterator[bytes]:
        """The ``nbytes`` bytes from ``offset``, ``size`` at a time."""
        self.file.seek(offset)
        left = nbytes
        while left:
            data = self.file.read(min(size, left))
            if not data:
                raise ValueError(f"the checkpoint's spilled copy ends {left} bytes early")
            left -= len(data)
            yield data

    def close(self) -> None:
        """Close (and so remove) the file. Bytes still buffered are not needed: a failure to
        write them (the full disk that failed the copy, again) is not raised."""
        with contextlib.suppress(OSError):
            self.file.close()


@dataclass(frozen=True)
class SpilledArray:
    """An array a :class:`Spill` holds from ``offset``: C order, of ``dtype`` and ``shape``
    (what a checkpoint writes of it is those bytes)."""

    spill: Spill
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def chunks(self, size: int) -> Iterator[bytes]:
        return self.spill.chunks(self.offset, self.nbytes, size)


@dataclass(frozen=True)
class SpilledStates:
    """Encoded optimizer states a :class:`Spill` holds: ``nbytes`` from ``offset``."""

    spill: Spill
    offset: int
    nbytes: int

    def chunks(self, size: int) -> Iterator[bytes]:
        return self.spill.chunks(self.offset, self.nbytes, size)


def in_memory(array: np.ndarray | SpilledArray | RowTable) -> np.ndarray:
    """An array of a record that was read (reading never spills) as an array."""
    assert isinstance(array, np.ndarray), "a checkpoint read holds its arrays in memory"
    return array


@dataclass
class Snapshot:
    """Everything a server needs to carry on after a restart.

    ``generation`` increases with every checkpoint a server writes (the caller's to count).
    ``optimizer_config`` is a JSON object (or ``None``), ``optimizer_states`` opaque bytes
    (or ``None``); when writing, the arrays and the states may also be in a :class:`Spill`
    (:class:`SpilledArray`, :class:`SpilledStates`); read ``lean``, the states are a file
    to read them from (its reader closes it). ``durable_seqs`` maps a worker
    rank to a sequence number below which every request of that worker is reflected.
    ``store_type`` is kept as given (``"dist_sync"``, ``"dist_async"``). Counters and ranks
    are non-negative ints.
    """

    rank: int
    num_workers: int
    store_type: str
    generation: int
    keys: list[KeyRecord]
    optimizer_config: dict[str, Any] | None
    optimizer_states: bytes | SpilledStates | BinaryIO | None
    durable_seqs: dict[int, int]
    row_keys: list[RowRecord] = field(default_factory=list)
    #: Each worker's session (its process) when the checkpoint was written: a worker of
    #: another session is of a new job, whose pushes are numbered afresh.
    sessions: dict[int, str] = field(default_factory=dict)
    #: The job's servers (None: not known, a file written before it was kept): a job with
    #: another number places its keys otherwise.
    num_servers: int | None = None
    #: The rounds that count as none of the split and row-sparse keys: the rounds each had
    #: applied when a job went on from files of different moments (``AKV_ACCEPT_MIXED_RESTORE``;
    #: empty otherwise). A new job's scheduler compares the rounds applied since.
    round_bases: dict[int | str, int] = field(default_factory=dict)
    #: When writing: the temporary file that holds the spilled parts (whoever writes the
    #: snapshot closes it).
    spill: Spill | None = None


def encode_header(snapshot: Snapshot) -> bytes:
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
        saved = snapshot.optimizer_states
        if isinstance(saved, bytes):
            nbytes = len(saved)
        elif isinstance(saved, SpilledStates):
            nbytes = saved.nbytes
        else:
            kind = type(saved).__name__
            raise ValueError(f"optimizer_states must be bytes, spilled or None, not {kind}")
        states = {"offset": offset, "nbytes": nbytes}
        offset += nbytes
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
    if snapshot.sessions:
        header["sessions"] = _rank_map_to_json(snapshot.sessions, "sessions", _session)
    if snapshot.num_servers is not None:
        header["num_servers"] = _count(snapshot.num_servers, "num_servers")
    if snapshot.round_bases:
        header["round_bases"] = _round_bases_to_json(snapshot.round_bases)
    # ASCII (every other character escaped) round-trips any str, lone surrogates included.
    text = json.dumps(header, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.encode("ascii")


def _round_bases_to_json(bases: dict[int | str, int]) -> list[list[Any]]:
    pairs = []
    for key, base in bases.items():
        _key_kind(key)
        pairs.append([key, _count(base, f"round_bases: key {key!r}")])
    return pairs


def _round_bases_from_json(value: object) -> dict[int | str, int]:
    if not isinstance(value, list):
        raise ValueError(f"round_bases is a {type(value).__name__}, not a list")
    bases: dict[int | str, int] = {}
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (int, str):
            raise ValueError(f"round_bases: {pair!r} is not a [key, rounds] pair")
        bases[pair[0]] = _count(pair[1], f"round_bases: key {pair[0]!r}")
    return bases


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
    if not isinstance(value, np.ndarray | SpilledArray):
        kind_name = type(value).__name__
        raise ValueError(f"key {key!r}: the value must be a NumPy array, not {kind_name}")
    if value.dtype not in DTYPE_CODES:
        known = ", ".join(sorted(_DTYPES_BY_STR))
        raise ValueError(f"key {key!r}: dtype {value.dtype.str} is not one of {known}")
    if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
        raise ValueError(f"key {key!r}: the value must be C-contiguous")
    if len(value.shape) > MAX_NDIM:
        ndim = len(value.shape)
        raise ValueError(f"key {key!r}: {ndim} dimensions; at most {MAX_NDIM} are kept")
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
        **_untold_to_json(record.untold, where),
        **_declared_to_json(record.declared, where),
    }


def _declared_to_json(declared: tuple[int, ...] | None, where: str) -> dict[str, Any]:
    """A split key's declared shape as a header field (none for a key not split, or one of
    more than :data:`MAX_NDIM` dimensions: a restore of it compares its dtype alone)."""
    if declared is None or len(declared) > MAX_NDIM:
        return {}
    return {"declared": [_count(size, f"{where}: declared") for size in declared]}


def _encode_row_record(record: RowRecord, offset: int) -> dict[str, Any]:
    key = record.key
    kind = _key_kind(key)
    where = f"row-sparse key {key!r}"
    ids, rows = record.ids, record.rows
    if not isinstance(ids, np.ndarray) or ids.dtype != _IDS or ids.ndim != 1:
        raise ValueError(f"{where}: ids must be a 1-D int64 NumPy array")
    if not isinstance(rows, np.ndarray | SpilledArray) or rows.dtype not in DTYPE_CODES:
        raise ValueError(f"{where}: rows must be a NumPy array of a dtype in DTYPE_CODES")
    shape = tuple(record.shape)
    if not shape or len(shape) > MAX_NDIM or rows.shape != (ids.size, *shape[1:]):
        raise ValueError(f"{where}: rows of shape {rows.shape} for {ids.size} ids of {shape}")
    contiguous = not isinstance(rows, np.ndarray) or rows.flags.c_contiguous
    if not (ids.flags.c_contiguous and contiguous):
        raise ValueError(f"{where}: ids and rows must be C-contiguous")
    check_row_ids(ids, record.first, record.end, shape, where)
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
        **_untold_to_json(record.untold, where),
    }


def check_row_ids(
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


def _untold_to_json(untold: dict[int, str], where: str) -> dict[str, Any]:
    """The ``untold`` field of a key's entry: absent when no failure waits to be told (a
    file an older akv wrote has none)."""
    return {"untold": _rank_map_to_json(untold, f"{where}: untold", _message)} if untold else {}


def _rank_map_to_json(
    mapping: Mapping[int, Any], what: str, item: Callable[[object, str], Any] | None = None
) -> dict[str, Any]:
    """A map of worker ranks to values that ``item`` checks (counts by default), as a JSON
    object."""
    check = _count if item is None else item
    if not isinstance(mapping, dict):
        raise ValueError(f"{what} must be a dict, not {type(mapping).__name__}")
    for rank, count in mapping.items():
        _count(rank, f"{what}: worker rank {rank!r}")
        check(count, f"{what}[{rank}]")
    return {str(rank): count for rank, count in mapping.items()}


def decode_header(
    header: object, payload_nbytes: int, rank: int
) -> tuple[Snapshot, list[KeyRecord], int | None]:
    """The snapshot a header describes, with empty arrays to read the payload into.

    Every offset and size is checked against the payload before an array is allocated, so
    what is allocated never exceeds the file's size.
    """
    row_entries: object = []
    sessions: object = {}
    num_servers: object = None
    round_bases: object = []
    if isinstance(header, dict) and not _OPTIONAL_FIELDS.isdisjoint(header):
        header = dict(header)
        row_entries = header.pop("row_keys", [])
        sessions = header.pop("sessions", {})
        num_servers = header.pop("num_servers", None)
        round_bases = header.pop("round_bases", [])
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
        sessions=_rank_map_from_json(sessions, "sessions", _session),
        num_servers=None if num_servers is None else _count(num_servers, "num_servers"),
        round_bases=_round_bases_from_json(round_bases),
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
    fields = _fields(entry, _ROW_KEY_FIELDS, f"row_keys[{index}]", _RECORD_OPTIONAL)
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
        untold=_rank_map_from_json(fields.get("untold", {}), f"{where}: untold", _message),
    )


def _decode_record(entry: object, index: int, offset: int, payload_nbytes: int) -> KeyRecord:
    fields = _fields(entry, _KEY_FIELDS, f"keys[{index}]", _RECORD_OPTIONAL)
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
        untold=_rank_map_from_json(fields.get("untold", {}), f"{where}: untold", _message),
        declared=_declared_from_json(fields.get("declared"), f"{where}: declared"),
    )


def _declared_from_json(value: object, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise ValueError(f"{what} {value!r} is not a list of at most {MAX_NDIM} sizes")
    return tuple(_count(size, what) for size in value)


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


def check_bools(key: int | str, value: np.ndarray) -> None:
    """NumPy expects a bool to be the byte 0 or 1; a file could hold any byte."""
    if value.dtype == np.bool_ and bool((value.view(np.uint8) > 1).any()):
        raise ValueError(f"key {key!r}: a bool array holds a byte other than 0 and 1")


def _fields(
    value: object, names: frozenset[str], what: str, optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``value``, a JSON object with the fields ``names`` and maybe some of ``optional``."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    if value.keys() - optional != names:
        present = value.keys() - optional
        missing, unknown = sorted(names - present), sorted(present - names)
        raise ValueError(f"{what}: fields missing {missing}, unknown {unknown}")
    return value


def _message(value: object, what: str) -> str:
    """``value`` if it is an error's message (a str of at most MAX_MESSAGE_CHARS)."""
    if not isinstance(value, str) or len(value) > MAX_MESSAGE_CHARS:
        raise ValueError(f"{what} is not an error message")
    return value


def _session(value: object, what: str) -> str:
    """``value`` if it is a worker's session id (a str of at most MAX_SESSION_CHARS)."""
    if not isinstance(value, str) or len(value) > MAX_SESSION_CHARS:
        raise ValueError(f"{what} is not a session id")
    return value


def _rank_map_from_json(
    value: object, what: str, item: Callable[[object, str], Any] | None = None
) -> dict[int, Any]:
    """A JSON object of worker ranks (as text) to values that ``item`` checks (counts by
    default)."""
    check = _count if item is None else item
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    mapping: dict[int, Any] = {}
    for text, count in value.items():
        if not _RANK_TEXT.fullmatch(text) or int(text) > _U64_MAX:
            raise ValueError(f"{what}: {text!r} is not a worker rank")
        mapping[int(text)] = check(count, f"{what}[{text}]")
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
