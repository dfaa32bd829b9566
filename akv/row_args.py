"""The checks of row-sparse arguments: which keys, values, outputs and row ids a store call
takes, before anything is scheduled (pure: no I/O, nothing stored is touched).

A row-sparse key takes only row-sparse values (an :class:`~akv.RowSparseArray`, or a torch
sparse COO tensor) of its shape and dtype; a dense key only dense ones. Errors name the key
and the shapes or the offending row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from akv.args import Key, _is_list, group, normalize_key, pairs
from akv.errors import (
    InvalidArgumentError,
    StorageTypeError,
)
from akv.keys import Entry, KeyTable
from akv.local_rows import RowPull, RowPush, sum_rows
from akv.sparse import RowIds, RowSparseArray, as_row_sparse, check_row_ids, is_row_sparse

__all__ = [
    "check_rows_fit",
    "dense_only",
    "init_rows",
    "no_row_pushpull",
    "no_row_sparse_out",
    "row_pulls",
    "row_pushes",
    "sparse_call",
]


def sparse_call(key: object, value: object, what: str) -> bool:
    """Whether the values of a call (``init``, ``push``, ...) of ``key`` are row-sparse (a
    key's list of values: its first one decides, the checks that follow refuse a mix).

    Raises
    ------
    StorageTypeError
        A call of several keys gives dense values to some and row-sparse ones to others
        (MXNet takes both in one call; akv takes each kind in a call of its own, so that a
        call is one kind of work, checked whole before any key changes).
    """
    if not isinstance(key, (list, tuple)) or not _is_list(value):
        return _row_sparse_value(value)
    kinds = [_row_sparse_value(item) for item in value]
    if all(kinds) or not any(kinds):
        return bool(kinds) and kinds[0]
    keys = list(key)
    rows = [k for k, sparse in zip(keys, kinds, strict=False) if sparse]
    dense = [k for k, sparse in zip(keys, kinds, strict=False) if not sparse]
    verb = what.split()[0]
    advice = (
        "init the row-sparse keys (read them with row_sparse_pull) and broadcast the dense ones"
        if verb == "broadcast"
        else f"{verb} the row-sparse keys and the dense keys in two calls"
    )
    raise StorageTypeError(
        f"{what} keys {keys!r}: one call gives row-sparse values to {rows!r} and dense ones "
        f"to {dense!r}; akv takes each kind in a call of its own: {advice}"
    )


def _row_sparse_value(value: object) -> bool:
    """Whether one key's value (or its first, in a list of values) is row-sparse."""
    if _is_list(value):
        return bool(value) and _row_sparse_value(value[0])
    return is_row_sparse(value)


def check_rows_fit(entry: Entry, value: RowSparseArray, what: str) -> None:
    """``value`` has ``entry``'s shape and dtype.

    Raises
    ------
    ShapeMismatchError, DTypeMismatchError
    """
    entry.check(value, f"{what} row-sparse")


def _row_entry(table: KeyTable, key: Key, what: str) -> Entry:
    entry = table.get(key, what)
    if entry.rows is None:
        raise StorageTypeError(
            f"{what} key {key!r}: the key is dense (shape {entry.shape}), the value is "
            "row-sparse; push dense arrays to it, or init a new key with a RowSparseArray"
        )
    return entry


def dense_only(entry: Entry, what: str) -> None:
    """Refuse a dense call (``pull``, a dense ``push``) on a row-sparse key.

    Raises
    ------
    StorageTypeError
    """
    if entry.rows is not None:
        hint = (
            "pull its rows with row_sparse_pull(key, row_ids=...)"
            if what.startswith("pull")
            else "push an akv.RowSparseArray (or a torch sparse COO tensor)"
        )
        raise StorageTypeError(
            f"{what} key {entry.key!r}: the key is row-sparse (shape {entry.shape}); {hint}"
        )


def no_row_sparse_out(entry: Entry, out: object) -> None:
    """Refuse a row-sparse ``out`` for ``pull`` of dense ``entry`` (MXNet's ``pull`` skips
    such an output and leaves it as it was).

    Raises
    ------
    StorageTypeError
    """
    if type(out) is not np.ndarray and is_row_sparse(out):
        raise StorageTypeError(
            f"pull into key {entry.key!r}: out is row-sparse ({type(out).__name__}) and the "
            f"key is dense (shape {entry.shape}); pull it into a dense array (MXNet's pull "
            "skips a row-sparse out, leaving it as it was)"
        )


def no_row_pushpull(table: KeyTable, keys: object) -> None:
    """Refuse ``pushpull`` of a row-sparse key (as MXNet 1.9 does): push, then pull rows.

    Raises
    ------
    StorageTypeError
    """
    for key in keys if _is_list(keys) else [keys]:
        entry = table.get(normalize_key(key), "pushpull to")
        if entry.rows is not None:
            raise StorageTypeError(
                f"pushpull key {entry.key!r}: the key is row-sparse; push its gradient, then "
                "read its rows with row_sparse_pull(key, row_ids=...)"
            )


def row_pushes(table: KeyTable, keys: object, values: object, copy: bool = True) -> list[RowPush]:
    """Each key's entry with the sum of the row-sparse values pushed to it: arrays of its
    own, but for a key pushed one value with ``copy`` False (that value, as given).

    Raises
    ------
    KeyNotInitializedError, StorageTypeError, ShapeMismatchError, DTypeMismatchError,
    RowIdError, MixedKeyKindsError, InvalidArgumentError
    """
    pushes = []
    for key, given in group(keys, values, "push").items():
        entry = _row_entry(table, key, "push to")
        rows = [as_row_sparse(value, f"push to key {key!r}") for value in given]
        for value in rows:
            check_rows_fit(entry, value, "push to")
        pushes.append((entry, rows[0] if len(rows) == 1 and not copy else sum_rows(rows)))
    return pushes


def init_rows(key: Key, values: Sequence[object]) -> RowSparseArray:
    """The one row-sparse value an init gives ``key``.

    Raises
    ------
    InvalidArgumentError, StorageTypeError, RowIdError
    """
    if len(values) != 1:
        raise InvalidArgumentError(f"init key {key!r}: takes one value per key, got {len(values)}")
    return as_row_sparse(values[0], f"init key {key!r}")


def row_pulls(
    table: KeyTable, keys: object, out: object, row_ids: object
) -> tuple[list[RowPull], object]:
    """The pulls of ``row_sparse_pull(keys, out, row_ids=...)`` and the call's result.

    ``keys`` and ``row_ids`` pair up as MXNet pairs them: one key and one array of ids; a
    list of keys and a list of id arrays, one each (or a list of them per key); one key
    with several id arrays (and as many outputs). ``out`` (optional) is a RowSparseArray
    per pair, nested as the ids are (a list per key where a key has several), filled in
    place; one key's single array of ids fills each of several outputs, as in MXNet.
    Without ``out`` new ones are made and returned (one, or a list, shaped as the pairs).

    Raises
    ------
    KeyNotInitializedError, StorageTypeError, RowIdError, ShapeMismatchError,
    DTypeMismatchError, InvalidArgumentError
    """
    if row_ids is None:
        raise InvalidArgumentError("row_sparse_pull needs row_ids: the rows to pull")
    listed = _is_list(keys) or (_is_list(row_ids) and not _is_array_of_ids(row_ids))
    if _is_list(keys) and _is_list(row_ids):  # a list of ints is one array of ids
        row_ids = [np.asarray(ids) if _is_array_of_ids(ids) else ids for ids in row_ids]
    id_pairs = pairs(keys, row_ids if listed else [row_ids], "row_sparse_pull")
    flat: list[tuple[Key, object]] = [(k, ids) for k, given in id_pairs for ids in given]
    if out is None:
        outs: list[object] = [None] * len(flat)
    else:  # paired with the keys as the ids are: a list (of lists) of outputs, flattened
        out_pairs = pairs(keys, out, "row_sparse_pull out")
        outs = [o for _, given in out_pairs for o in given]
        if len(flat) == 1 < len(outs):  # MXNet: one array of ids fills every output
            flat *= len(outs)
        if [k for k, _ in flat] != [k for k, given in out_pairs for _ in given]:
            raise InvalidArgumentError(
                f"row_sparse_pull: {len(flat)} row id arrays and {len(outs)} outputs do not "
                "pair up, key by key"
            )
    pulls: list[RowPull] = []
    made: list[RowSparseArray] = []
    for (key, ids), given_out in zip(flat, outs, strict=True):
        entry = table.get(key, "row_sparse_pull from")
        if entry.rows is None:
            raise StorageTypeError(
                f"row_sparse_pull from key {key!r}: the key is dense (shape {entry.shape}); "
                "pull it with pull()"
            )
        checked = _sorted_unique(
            check_row_ids(
                cast("npt.ArrayLike", ids), entry.shape[0], f"row_sparse_pull key {key!r}"
            )
        )
        if given_out is None:
            target = RowSparseArray.zeros(entry.shape, entry.dtype)
            made.append(target)
        elif isinstance(given_out, RowSparseArray):
            check_rows_fit(entry, given_out, "row_sparse_pull into")
            target = given_out
        else:
            raise StorageTypeError(
                f"row_sparse_pull key {key!r}: out must be an akv.RowSparseArray, got "
                f"{type(given_out).__name__} (MXNet refuses a dense out too)"
            )
        pulls.append((entry, checked, target))
    if out is not None:
        return pulls, out
    return pulls, made if listed or len(made) > 1 else made[0]


def _sorted_unique(ids: RowIds) -> RowIds:
    """``ids`` sorted without repeats: as they are when they already are (a batch's
    ``unique`` ids), in a copy of their own, else ``np.unique``."""
    unique: RowIds
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        unique = ids.copy()
    else:
        unique = np.unique(ids)
    return unique


def _is_array_of_ids(value: object) -> bool:
    """A list or tuple of numbers (one array of row ids, checked as such: floats are
    refused as ids), not a list of arrays."""
    return _is_list(value) and all(np.ndim(v) == 0 for v in value)
