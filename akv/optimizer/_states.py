"""akv's portable optimizer-state format: a NumPy ``.npz`` archive, never a pickle.

The archive (an uncompressed zip, readable by ``numpy.load(..., allow_pickle=False)``)
holds one ``.npy`` member per state array, named ``a0.npy``, ``a1.npy``..., and the member
:data:`STRUCTURE_MEMBER`, UTF-8 JSON::

    {"format": "akv.optimizer-states", "version": 1,
     "key_kind": "int" | "str",
     "keys": [key, ...],
     "states": [tree, ...],                  # one per key, same order
     "index_update_counts": [[key, count], ...],
     "num_update": int,
     "optimizer": optimizer config | null,
     "shared_state": {name: number | null, ...}}   # optional; absent means {}

where a state ``tree`` is ``null``, ``{"array": "a0", "shape": [...], "dtype": "<f4"}``,
``{"tuple": [tree, ...]}`` or ``{"list": [tree, ...]}``; the state of a row-sparse key
(:class:`RowStates`) is ``{"rows": {"shape": [...], "ids": array, "leaves": [array, ...]}}``:
the rows that have a state, and for each array of the state's structure, in order, one row
per id. ``shared_state`` is :meth:`~akv.optimizer.Optimizer.shared_state` (what the optimizer
keeps for all indexes together: Nadam's momentum schedule, LARS's last learning rate); files
written before it existed lack it, and readers that predate it ignore it.
``docs/optimizer.md`` describes the format for other readers.
"""

from __future__ import annotations

import abc
import io
import json
import numbers
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol, cast

import numpy as np

from akv.arrays import is_cupy, to_host
from akv.errors import (
    AKVError,
    InvalidArgumentError,
    MixedKeyKindsError,
    StateFormatError,
)
from akv.optimizer._base import Index, State
from akv.optimizer._files import ReadOnlyFile, ViewFile
from akv.rows import RowTable
from akv_transport import byte_view, parse_json

__all__ = [
    "STATE_FORMAT_NAME",
    "STATE_FORMAT_VERSION",
    "STRUCTURE_MEMBER",
    "JoinedRows",
    "LazyRows",
    "RowStates",
    "SavedStates",
    "StoredRows",
    "decode_states",
    "encode_states",
]

STATE_FORMAT_NAME = "akv.optimizer-states"
STATE_FORMAT_VERSION = 1
STRUCTURE_MEMBER = "structure.json"

MAX_STRUCTURE_BYTES = 64 << 20
"""Largest structure member :func:`decode_states` reads (a guard against hostile input)."""

_NPY_HEADER_SLACK_BYTES = 64 << 10
"""Room for a ``.npy`` header beyond its data when sizing a member against its declaration."""

_ARRAY_KINDS = "biufc"

#: Rows gathered at a time when :class:`StoredRows` are saved (a few MiB each).
_GATHER_ROWS = 1 << 16
#: Bytes of a member read at a time into a table's rows.
_READ_BYTES = 8 << 20

# What zipfile raises for malformed, truncated or unsupported archives (its error for an
# unknown compression method is a RuntimeError subclass).
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError)
#: The size of a zip file's end-of-central-directory record: no zip file is shorter.
_ZIP_END_BYTES = 22


class RowSource(Protocol):
    """A table of rows (:class:`akv.rows.RowTable`), as :class:`StoredRows` reads it."""

    @property
    def row_shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def gather(self, ids: Any) -> np.ndarray: ...


class LazyRows(abc.ABC):
    """A leaf of :class:`RowStates` being saved whose array is never made: it is written
    as ``np.lib.format.write_array`` writes that array, byte for byte, a piece at a time."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> np.dtype: ...

    def write_npy(self, file: BinaryIO) -> None:
        """Write the rows as ``np.lib.format.write_array`` writes the array."""
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": self.shape,
        }
        np.lib.format.write_array_header_1_0(file, header)
        self.write_rows(file)

    @abc.abstractmethod
    def write_rows(self, file: BinaryIO) -> None:
        """Write the rows' bytes (C order)."""


@dataclass(frozen=True)
class StoredRows(LazyRows):
    """The rows ``ids`` of ``table``, still in it, gathered a slice at a time as they are
    written (never copied whole: a checkpoint of a big table does not hold it twice). A
    server's checkpoint spills its tables' rows with :meth:`write_rows`."""

    table: RowSource
    ids: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.ids.size), *self.table.row_shape)

    @property
    def dtype(self) -> np.dtype:
        return self.table.dtype

    def write_rows(self, file: BinaryIO) -> None:
        """Write the rows' bytes (C order), :data:`_GATHER_ROWS` rows gathered at a time."""
        for first in range(0, self.ids.size, _GATHER_ROWS):
            rows = self.table.gather(self.ids[first : first + _GATHER_ROWS])
            file.write(np.ascontiguousarray(rows).data)


@dataclass(frozen=True)
class JoinedRows(LazyRows):
    """The rows of ``parts`` (arrays of the same row shape and dtype) one after the other,
    written as their concatenation would be, never concatenated: a table's states gathered
    from the servers of its row ranges are not held twice."""

    parts: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(part.shape[0] for part in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def write_rows(self, file: BinaryIO) -> None:
        for part in self.parts:
            file.write(np.ascontiguousarray(part).data)


@dataclass(frozen=True)
class RowStates:
    """The optimizer state of a row-sparse key, as saved: the rows ``ids`` (int64, sorted,
    unique) of a weight of ``shape`` have a state, and ``leaves[i]`` holds, one row per
    id, the rows of the ``i``-th array of the state's structure (in the order
    :meth:`~akv.optimizer.Updater.update_rows` flattens it)."""

    shape: tuple[int, ...]
    ids: np.ndarray
    #: Arrays; or, in states being saved, rows never gathered into one (:class:`LazyRows`);
    #: or, decoded with ``row_tables``, tables of the rows (:class:`~akv.rows.RowTable`).
    leaves: tuple[np.ndarray | LazyRows | RowTable, ...]

    def rows(self, first: int, end: int) -> RowStates:
        """The states of rows ``[first, end)`` only (of states read back: arrays)."""
        low, high = np.searchsorted(self.ids, [first, end])
        leaves = [leaf for leaf in self.leaves if isinstance(leaf, np.ndarray)]
        assert len(leaves) == len(self.leaves), "rows of states still in their tables"
        return RowStates(self.shape, self.ids[low:high], tuple(leaf[low:high] for leaf in leaves))

    @staticmethod
    def join(parts: list[RowStates]) -> RowStates:
        """The states of parts holding disjoint rows, given in row order, as one to save
        (the parts' leaves, arrays, are joined as they are written: :class:`JoinedRows`)."""
        first = parts[0]
        leaves: list[np.ndarray | LazyRows | RowTable] = []
        for i in range(len(first.leaves)):
            arrays = [leaf for part in parts if isinstance(leaf := part.leaves[i], np.ndarray)]
            assert len(arrays) == len(parts), "states read back hold arrays"
            leaves.append(arrays[0] if len(arrays) == 1 else JoinedRows(tuple(arrays)))
        return RowStates(first.shape, np.concatenate([part.ids for part in parts]), tuple(leaves))


@dataclass(frozen=True)
class SavedStates:
    """What :func:`decode_states` read.

    Attributes
    ----------
    states : dict
        Key to state (``None``, array, or tuples and lists of those; :class:`RowStates` for
        a row-sparse key). Every array is a new writeable C-contiguous array that shares
        memory with no other.
    index_update_counts : dict
        Key to the number of updates applied to it.
    num_update : int
        The optimizer's ``num_update``.
    optimizer_config : dict or None
        The optimizer's :meth:`~akv.optimizer.Optimizer.get_config`, if it was saved.
    shared_state : dict
        The optimizer's :meth:`~akv.optimizer.Optimizer.shared_state` (``{}`` for most).
    """

    states: dict[Index, State | RowStates]
    index_update_counts: dict[Index, int]
    num_update: int
    optimizer_config: dict[str, Any] | None = field(default=None)
    shared_state: dict[str, float | None] = field(default_factory=dict)


def encode_states(
    states: Mapping[Index, State | RowStates],
    *,
    index_update_counts: Mapping[Index, int] | None = None,
    num_update: int = 0,
    optimizer_config: Mapping[str, Any] | None = None,
    shared_state: Mapping[str, float | None] | None = None,
    file: BinaryIO | None = None,
) -> bytes:
    """Encode optimizer states (and optionally the optimizer's config) as bytes (or into
    ``file``, a seekable binary file, from where it is: then ``b""`` is returned).

    Parameters
    ----------
    states : mapping
        Key (all ``int`` or all ``str``) to state: ``None``, a NumPy array, or a tuple or
        list of states; or a :class:`RowStates`.
    index_update_counts : mapping, optional
        Key to the number of updates applied (``Optimizer.index_update_counts``).
    num_update : int, default 0
        ``Optimizer.num_update``.
    optimizer_config : dict, optional
        ``Optimizer.get_config()``, to be restored with the states.
    shared_state : dict, optional
        ``Optimizer.shared_state()``: names to finite numbers or ``None``.

    Returns
    -------
    bytes
        An archive that :func:`decode_states` turns back into equal states, bit for bit.
        It holds no time of writing: equal states encode to equal bytes.

    Raises
    ------
    MixedKeyKindsError
        Keys of both kinds.
    InvalidArgumentError
        A key or count of the wrong type, or a state this format cannot hold (an object
        array, a dict...), or a shared state that is not names to numbers or ``None``.
    """
    counts = dict(index_update_counts or {})
    shared = _encode_shared_state(shared_state or {})
    keys = [_normalise_key(key) for key in states]
    count_keys = [_normalise_key(key) for key in counts]
    kinds = {type(key) for key in keys + count_keys}
    if len(kinds) > 1:
        raise MixedKeyKindsError("cannot encode states whose keys mix int and str")
    key_kind = "str" if kinds == {str} else "int"
    members: dict[str, np.ndarray | LazyRows] = {}
    trees = [
        _encode_tree(key, state, members, "state")
        for key, state in zip(keys, states.values(), strict=True)
    ]
    for key, count in zip(count_keys, counts.values(), strict=True):
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise InvalidArgumentError(f"update count of key {key!r} must be an int >= 0")
    if isinstance(num_update, bool) or not isinstance(num_update, numbers.Integral):
        raise InvalidArgumentError(f"num_update must be an int, got {num_update!r}")
    structure = {
        "format": STATE_FORMAT_NAME,
        "version": STATE_FORMAT_VERSION,
        "key_kind": key_kind,
        "keys": keys,
        "states": trees,
        "index_update_counts": [
            [k, int(c)] for k, c in zip(count_keys, counts.values(), strict=True)
        ],
        "num_update": int(num_update),
        "optimizer": dict(optimizer_config) if optimizer_config is not None else None,
        "shared_state": shared,
    }
    try:
        text = json.dumps(structure, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"the optimizer config is not JSON-serialisable: {exc}") from exc
    memory = io.BytesIO() if file is None else None
    target = memory if file is None else file
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(_member(STRUCTURE_MEMBER), text.encode("utf-8"))
        for name, array in members.items():
            with archive.open(_member(f"{name}.npy"), "w", force_zip64=True) as member:
                if isinstance(array, LazyRows):
                    array.write_npy(member)
                else:
                    np.lib.format.write_array(member, array, allow_pickle=False)
    return b"" if memory is None else memory.getvalue()


def _member(name: str) -> zipfile.ZipInfo:
    """An archive member stamped with zip's epoch (1980-01-01), not the time of writing:
    the same states are the same bytes, whenever they are saved."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o600 << 16  # -rw-------, as zipfile gives a member named by str
    return info


def decode_states(
    data: bytes | bytearray | memoryview | BinaryIO, *, row_tables: bool = False
) -> SavedStates:
    """Decode what :func:`encode_states` wrote: ``data``, or a seekable binary file that
    holds it (from its start). With ``row_tables``, each row-sparse state's leaves are read
    straight into tables of their rows (:class:`~akv.rows.RowTable`), never held as arrays
    beside them.

    Raises
    ------
    InvalidArgumentError
        ``data`` is neither bytes-like nor a binary file.
    StateFormatError
        ``data`` is not an archive of this format (corrupt, another format name, another
        version), or its structure is inconsistent (an array whose shape or dtype differs
        from its declaration, a missing member, bad keys or counts); the message says what.
    OSError
        ``data`` is a :class:`ReadOnlyFile` that could not be read (zipfile would have
        called that a damaged archive).
    """
    if isinstance(data, bytes):
        source: BinaryIO = io.BytesIO(data)  # shares the bytes
    elif isinstance(data, (bytearray, memoryview)):
        source = cast(BinaryIO, ViewFile(data))  # io.BytesIO would copy them
    elif callable(getattr(data, "read", None)) and callable(getattr(data, "seek", None)):
        source = data
    else:
        raise InvalidArgumentError(f"optimizer states must be bytes, got {type(data).__name__}")
    try:
        return _decode(source, row_tables)
    except StateFormatError:
        if isinstance(source, ReadOnlyFile) and source.error is not None:
            raise source.error from None
        raise


def _decode(source: BinaryIO, row_tables: bool) -> SavedStates:
    not_ours = "optimizer states are not an akv state archive"
    # Shorter than a zip file's end record: zipfile's own words for bytes, said alike for a
    # file (whose seek before its start zipfile would report as a ValueError).
    try:
        source.seek(0, io.SEEK_END)
        size: int | None = source.tell()
        source.seek(0)
    except (OSError, ValueError):  # not seekable: zipfile says why below
        size = None
    if size is not None and size < _ZIP_END_BYTES:
        raise StateFormatError(f"{not_ours}: File is not a zip file")
    try:
        archive = zipfile.ZipFile(source)
    except _ZIP_ERRORS as exc:
        raise StateFormatError(f"{not_ours}: {exc}") from exc
    with archive:
        structure = _read_structure(archive)
        key_kind = structure["key_kind"]
        keys = structure["keys"]
        trees = structure["states"]
        if not isinstance(keys, list) or not isinstance(trees, list) or len(keys) != len(trees):
            raise StateFormatError(
                "optimizer states: 'keys' and 'states' are not lists of one length"
            )
        keys = [_decode_key(key, key_kind, "keys") for key in keys]
        if len(set(keys)) != len(keys):
            raise StateFormatError("optimizer states: a key appears twice")
        used: set[str] = set()
        states = {
            key: _decode_tree(archive, key, tree, used, "state", row_tables)
            for key, tree in zip(keys, trees, strict=True)
        }
        counts = _decode_counts(structure["index_update_counts"], key_kind)
        num_update = structure["num_update"]
        if isinstance(num_update, bool) or not isinstance(num_update, int) or num_update < 0:
            raise StateFormatError(f"optimizer states: bad num_update {num_update!r}")
        config = structure["optimizer"]
        if config is not None and not isinstance(config, dict):
            raise StateFormatError("optimizer states: 'optimizer' is neither a config nor null")
        shared = _decode_shared_state(structure.get("shared_state", {}))
    return SavedStates(states, counts, num_update, config, shared)


# -- encoding helpers ----------------------------------------------------------------------


def _normalise_key(key: object) -> Index:
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (numbers.Integral, str)):
        raise InvalidArgumentError(f"state key {key!r} is neither an int nor a str")
    return key if isinstance(key, str) else int(key)


def _encode_tree(
    key: Index, state: object, members: dict[str, np.ndarray | LazyRows], path: str
) -> Any:
    if state is None:
        return None
    if isinstance(state, LazyRows):
        name = f"a{len(members)}"
        members[name] = state
        return {"array": name, "shape": list(state.shape), "dtype": state.dtype.str}
    if isinstance(state, RowStates):
        return {
            "rows": {
                "shape": list(state.shape),
                "ids": _encode_tree(key, state.ids, members, f"{path}.ids"),
                "leaves": [
                    _encode_tree(key, leaf, members, f"{path}.leaves[{i}]")
                    for i, leaf in enumerate(state.leaves)
                ],
            }
        }
    if is_cupy(state):
        state = to_host(state)  # saved from the GPU, loaded onto the weight's device
    if isinstance(state, np.ndarray):
        if state.dtype.kind not in _ARRAY_KINDS or state.dtype.fields is not None:
            raise InvalidArgumentError(
                f"{path} of key {key!r}: arrays of dtype {state.dtype} cannot be saved"
            )
        name = f"a{len(members)}"
        members[name] = state
        return {"array": name, "shape": list(state.shape), "dtype": state.dtype.str}
    if isinstance(state, (tuple, list)):
        kind = "tuple" if isinstance(state, tuple) else "list"
        return {
            kind: [
                _encode_tree(key, member, members, f"{path}[{i}]") for i, member in enumerate(state)
            ]
        }
    raise InvalidArgumentError(
        f"{path} of key {key!r}: a {type(state).__name__} cannot be saved "
        "(states are None, numpy arrays, or tuples and lists of them)"
    )


def _encode_shared_state(values: Mapping[str, float | None]) -> dict[str, float | None]:
    if not isinstance(values, Mapping):
        raise InvalidArgumentError(f"shared_state must be a dict, got {type(values).__name__}")
    encoded: dict[str, float | None] = {}
    for name, value in values.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"shared_state name {name!r} is not a str")
        if value is not None and not _is_finite_number(value):
            raise InvalidArgumentError(
                f"shared_state {name!r} must be a finite number or None, got {value!r}"
            )
        encoded[name] = None if value is None else float(value)
    return encoded


def _is_finite_number(value: object) -> bool:
    return (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, numbers.Real)
        and bool(np.isfinite(float(value)))
    )


# -- decoding helpers ----------------------------------------------------------------------


def _decode_shared_state(values: object) -> dict[str, float | None]:
    if not isinstance(values, dict) or not all(
        value is None or _is_finite_number(value) for value in values.values()
    ):
        raise StateFormatError(
            "optimizer states: 'shared_state' is not an object of numbers or nulls"
        )
    return {name: None if value is None else float(value) for name, value in values.items()}


def _read_structure(archive: zipfile.ZipFile) -> dict[str, Any]:
    try:
        info = archive.getinfo(STRUCTURE_MEMBER)
    except KeyError:
        raise StateFormatError(
            f"optimizer states: the archive has no {STRUCTURE_MEMBER!r} member (not written by akv)"
        ) from None
    _check_stored(info)
    if info.file_size > MAX_STRUCTURE_BYTES:
        raise StateFormatError(
            f"optimizer states: {STRUCTURE_MEMBER} is {info.file_size} bytes, more than "
            f"MAX_STRUCTURE_BYTES ({MAX_STRUCTURE_BYTES})"
        )
    try:
        structure = parse_json(archive.read(info))
    except (*_ZIP_ERRORS, UnicodeDecodeError) as exc:
        raise StateFormatError(f"optimizer states: unreadable {STRUCTURE_MEMBER}: {exc}") from exc
    if not isinstance(structure, dict):
        raise StateFormatError(f"optimizer states: {STRUCTURE_MEMBER} is not a JSON object")
    if structure.get("format") != STATE_FORMAT_NAME:
        raise StateFormatError(
            f"optimizer states: format {structure.get('format')!r} is not {STATE_FORMAT_NAME!r}"
        )
    if structure.get("version") != STATE_FORMAT_VERSION:
        raise StateFormatError(
            f"optimizer states: format version {structure.get('version')!r} is not supported "
            f"(this akv reads version {STATE_FORMAT_VERSION})"
        )
    required = ("key_kind", "keys", "states", "index_update_counts", "num_update", "optimizer")
    missing = [name for name in required if name not in structure]
    if missing:
        raise StateFormatError(f"optimizer states: {STRUCTURE_MEMBER} lacks {missing}")
    if structure["key_kind"] not in ("int", "str"):
        raise StateFormatError(
            f"optimizer states: key_kind {structure['key_kind']!r} is neither 'int' nor 'str'"
        )
    return structure


def _check_stored(info: zipfile.ZipInfo) -> None:
    # akv writes plain stored members; refusing anything else keeps decompressors (and
    # decompression bombs) out of the way of hostile input.
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise StateFormatError(
            f"optimizer states: member {info.filename} is compressed or encrypted "
            "(akv writes neither)"
        )


def _decode_key(key: object, key_kind: str, where: str) -> Index:
    expected = str if key_kind == "str" else int
    if isinstance(key, bool) or not isinstance(key, expected):
        raise StateFormatError(f"optimizer states: {where} holds {key!r}, not a {key_kind} key")
    return key


def _decode_counts(pairs: object, key_kind: str) -> dict[Index, int]:
    if not isinstance(pairs, list):
        raise StateFormatError("optimizer states: index_update_counts is not a list")
    counts: dict[Index, int] = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise StateFormatError(
                f"optimizer states: index_update_counts entry {pair!r} is not a [key, count] pair"
            )
        key = _decode_key(pair[0], key_kind, "index_update_counts")
        count = pair[1]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise StateFormatError(f"optimizer states: bad update count {count!r} of key {key!r}")
        counts[key] = count
    return counts


def _decode_tree(
    archive: zipfile.ZipFile,
    key: Index,
    tree: object,
    used: set[str],
    path: str,
    row_tables: bool = False,
) -> State | RowStates:
    if tree is None:
        return None
    if isinstance(tree, dict) and set(tree) == {"rows"} and path == "state":
        return _decode_rows(archive, key, tree["rows"], used, row_tables)
    if isinstance(tree, dict) and len(tree) == 1:
        ((kind, members),) = tree.items()
        if kind in ("tuple", "list") and isinstance(members, list):
            decoded = [
                _decode_state(archive, key, member, used, f"{path}[{i}]")
                for i, member in enumerate(members)
            ]
            return tuple(decoded) if kind == "tuple" else decoded
    if isinstance(tree, dict) and set(tree) == {"array", "shape", "dtype"}:
        return _read_array(archive, key, tree, used, path)
    raise StateFormatError(f"optimizer states: {path} of key {key!r} is malformed: {tree!r}")


def _decode_state(
    archive: zipfile.ZipFile, key: Index, tree: object, used: set[str], path: str
) -> State:
    """A tree inside a state (never a :class:`RowStates`)."""
    state = _decode_tree(archive, key, tree, used, path)
    assert not isinstance(state, RowStates)  # only a whole state may be one
    return state


def _decode_rows(
    archive: zipfile.ZipFile, key: Index, rows: object, used: set[str], row_tables: bool
) -> RowStates:
    where = f"optimizer states: the row-sparse state of key {key!r}"
    if not isinstance(rows, dict) or set(rows) != {"shape", "ids", "leaves"}:
        raise StateFormatError(f"{where} is malformed: {rows!r}")
    shape = rows["shape"]
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise StateFormatError(f"{where}: bad shape {shape!r}")
    ids = _decode_state(archive, key, rows["ids"], used, "state.ids")
    leaves = rows["leaves"]
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
        raise StateFormatError(f"{where}: ids are not a 1-D int64 array")
    if ids.size and (ids[0] < 0 or ids[-1] >= shape[0] or np.any(ids[1:] <= ids[:-1])):
        raise StateFormatError(f"{where}: ids are not sorted, unique and in [0, {shape[0]})")
    if not isinstance(leaves, list):
        raise StateFormatError(f"{where}: leaves are not a list")
    arrays: list[np.ndarray | RowTable] = []
    for i, leaf in enumerate(leaves):
        path = f"state.leaves[{i}]"
        if row_tables and isinstance(leaf, dict) and set(leaf) == {"array", "shape", "dtype"}:
            arrays.append(_read_table(archive, key, leaf, used, path, ids, shape[0]))
            continue
        array = _decode_state(archive, key, leaf, used, path)
        if not isinstance(array, np.ndarray) or array.shape[:1] != ids.shape:
            raise StateFormatError(f"{where}: leaf {i} does not hold one row per id")
        arrays.append(array)
    return RowStates(tuple(shape), ids, tuple(arrays))


def _read_array(
    archive: zipfile.ZipFile, key: Index, ref: dict[str, Any], used: set[str], path: str
) -> np.ndarray:
    info, shape, declared = _member_of(archive, key, ref, used, path)
    where = f"optimizer states: {path} of key {key!r}"
    try:
        with archive.open(info) as member:
            array = np.lib.format.read_array(member, allow_pickle=False)
    except _ZIP_ERRORS as exc:
        raise StateFormatError(f"{where}: member {info.filename} is unreadable: {exc}") from exc
    if array.shape != shape or array.dtype != declared:
        raise StateFormatError(
            f"{where}: member {info.filename} holds shape {array.shape} dtype {array.dtype}, "
            f"declared shape {shape} dtype {declared}"
        )
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.ascontiguousarray(array).copy()
    return array


def _read_table(
    archive: zipfile.ZipFile,
    key: Index,
    ref: dict[str, Any],
    used: set[str],
    path: str,
    ids: np.ndarray,
    rows: int,
) -> RowTable:
    """The rows ``ids`` of a table of ``rows`` rows, read from the member ``ref`` names
    straight into the table (:meth:`RowTable.load`)."""
    info, shape, declared = _member_of(archive, key, ref, used, path)
    where = f"optimizer states: {path} of key {key!r}"
    if shape[:1] != ids.shape:
        raise StateFormatError(f"{where} does not hold one row per id")
    try:
        table = RowTable((rows, *shape[1:]), declared)
    except AKVError as exc:
        raise StateFormatError(f"{where}: {exc}") from exc

    def fill(target: np.ndarray) -> None:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                held, fortran, dtype = np.lib.format.read_array_header_1_0(member)
            else:
                held, fortran, dtype = np.lib.format.read_array_header_2_0(member)
            if held != shape or dtype != declared or (fortran and len(shape) > 1):
                raise StateFormatError(
                    f"{where}: member {info.filename} holds shape {held} dtype {dtype}, "
                    f"declared shape {shape} dtype {declared} in C order"
                )
            view, done = byte_view(target), 0
            while done < view.nbytes:  # a slice at a time: a member's read is a copy
                data = member.read(min(_READ_BYTES, view.nbytes - done))
                if not data:
                    raise StateFormatError(f"{where}: member {info.filename} ends early")
                view[done : done + len(data)] = data
                done += len(data)

    try:
        table.load(ids, fill)
    except _ZIP_ERRORS as exc:
        raise StateFormatError(f"{where}: member {info.filename} is unreadable: {exc}") from exc
    return table


def _member_of(
    archive: zipfile.ZipFile, key: Index, ref: dict[str, Any], used: set[str], path: str
) -> tuple[zipfile.ZipInfo, tuple[int, ...], np.dtype]:
    """The member an array reference names (used once), with its declared shape and dtype,
    checked against its size."""
    where = f"optimizer states: {path} of key {key!r}"
    name, shape, dtype = ref["array"], ref["shape"], ref["dtype"]
    if not isinstance(name, str) or name in used:
        raise StateFormatError(f"{where}: array reference {name!r} is invalid or used twice")
    used.add(name)
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise StateFormatError(f"{where}: bad shape {shape!r}")
    try:
        declared = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise StateFormatError(f"{where}: bad dtype {dtype!r}") from exc
    if declared.kind not in _ARRAY_KINDS or declared.fields is not None:
        raise StateFormatError(f"{where}: dtype {dtype!r} is not a numeric dtype")
    try:
        info = archive.getinfo(f"{name}.npy")
    except KeyError:
        raise StateFormatError(f"{where}: the archive has no member {name}.npy") from None
    _check_stored(info)
    expected_bytes = int(np.prod(shape, dtype=np.int64)) * declared.itemsize
    if info.file_size > expected_bytes + _NPY_HEADER_SLACK_BYTES:
        raise StateFormatError(
            f"{where}: member {name}.npy is {info.file_size} bytes, too large for shape "
            f"{tuple(shape)} and dtype {declared}"
        )
    return info, tuple(shape), declared
