"""Row-sparse keys in this process: the work of ``init``, ``push`` and ``row_sparse_pull``
on a key whose value is a :class:`~akv.rows.RowTable` (the local and device stores).

A row-sparse key stores only the rows that exist; a row it does not list reads as zero. Its
entry's var orders these tasks exactly as it orders a dense key's. Semantics (as MXNet's
``local`` store, except that only existing rows are stored):

* ``init``: the rows listed are the rows stored.
* ``push`` without an optimizer: the stored rows become the sum of the values pushed (the
  union of their rows; every other row reads as zero again).
* ``push`` with the store's optimizer: only the rows of the summed gradient are updated,
  with their optimizer states (MXNet's ``lazy_update``), through
  :meth:`akv.optimizer.Updater.update_rows`. A custom updater (``set_updater``) is given
  dense arrays by contract and cannot take a row-sparse gradient: refused, typed.
* ``row_sparse_pull``: the requested rows (sorted, unique; absent ones as zeros).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from akv import jit
from akv import optimizer as _optimizer
from akv.backend import Updater
from akv.errors import OptimizerError
from akv.keys import Entry
from akv.rows import RowTable
from akv.sparse import RowIds, RowSparseArray

__all__ = ["RowPull", "RowPush", "apply_row_push", "pull_rows", "store_rows", "sum_rows"]

#: One key's summed row-sparse push.
RowPush = tuple[Entry, RowSparseArray]
#: One key's requested rows (sorted, unique, checked) and the array each pull fills.
RowPull = tuple[Entry, RowIds, RowSparseArray]


def sum_rows(values: Sequence[RowSparseArray]) -> RowSparseArray:
    """The sum of row-sparse values of one key (their rows' union; a row listed by several
    is their sum, added in the order of ``values``), in arrays of its own: the caller may
    change the values given once this returns.

    Each value's ids are sorted and unique (as a RowSparseArray holds them), so the union is
    a merge: a stable argsort of their concatenation (sorted runs: one merge pass), each
    id's position in the union from it; the first value's rows are copied to theirs, each
    later value's added. For two gradients of 2,000 rows of 64 float32 (a quarter of the
    rows shared), 0.16 ms here (0.29 ms in a busy server), where ``np.union1d``, a
    ``searchsorted`` per value and an indexed add of each took 0.53 ms (0.70 ms; NumPy
    2's ``union1d`` alone 0.3 ms).
    """
    first = values[0]
    if len(values) == 1:
        return RowSparseArray._trusted(first.data.copy(), first.indices.copy(), first.shape)
    compiled = jit.kernels() if first.dtype in jit.DTYPES and first.data.size else None
    if compiled is not None and all(value.data.dtype == first.dtype for value in values):
        return _merged(compiled, values)
    merged = np.concatenate([value.indices for value in values])
    order = np.argsort(merged, kind="stable")
    ordered = merged[order]
    starts = np.empty(ordered.size, bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    ids = ordered[starts]
    # where[i]: the position in ids of merged[i].
    where = np.empty(merged.size, np.int64)
    where[order] = np.cumsum(starts) - 1
    data = np.zeros((ids.size, *first.shape[1:]), first.dtype)
    end = 0
    for value in values:
        begin, end = end, end + value.indices.size
        if begin == 0:
            data[where[:end]] = value.data  # copied, not added to zeros: the rows as given
        else:
            data[where[begin:end]] += value.data
    return RowSparseArray._trusted(data, ids, first.shape)


def _merged(compiled: SimpleNamespace, values: Sequence[RowSparseArray]) -> RowSparseArray:
    """:func:`sum_rows` by :mod:`akv.jit`'s merge, value by value: the same numbers."""
    shape = values[0].shape
    width = math.prod(shape[1:])
    ids, data = values[0].indices, values[0].data
    for value in values[1:]:
        room = ids.size + value.indices.size
        out_ids = np.empty(room, np.int64)
        out = np.empty((room, width), data.dtype)
        count = compiled.merge_rows(
            np.ascontiguousarray(ids, np.int64),
            np.ascontiguousarray(data).reshape(ids.size, width),
            np.ascontiguousarray(value.indices, np.int64),
            np.ascontiguousarray(value.data).reshape(value.indices.size, width),
            out_ids,
            out,
        )
        ids, data = out_ids[:count], out[:count].reshape(count, *shape[1:])
    return RowSparseArray._trusted(data, ids, shape)


def table_of(entry: Entry) -> RowTable:
    """The rows of a row-sparse key (set when the key is made)."""
    assert entry.rows is not None, f"key {entry.key!r} is not row-sparse"
    return entry.rows


def store_rows(entries: list[Entry], values: list[RowSparseArray]) -> None:
    """``init``: each key's rows are the rows its first value lists."""
    for entry, value in zip(entries, values, strict=True):
        table_of(entry).scatter(value.indices, value.data)


def check_updater(updater: Updater | None, entry: Entry) -> _optimizer.Updater | None:
    """The optimizer's updater a push to row-sparse ``entry`` goes through (None: the rows
    are replaced).

    Raises
    ------
    OptimizerError
        A custom updater (``set_updater``): it takes dense arrays and cannot update rows.
    """
    if updater is None or isinstance(updater, _optimizer.Updater):
        return updater
    raise OptimizerError(
        f"push to row-sparse key {entry.key!r}: a custom updater (set_updater) takes dense "
        "arrays and cannot update rows; use set_optimizer (its lazy update touches only the "
        "pushed rows), or push to a dense key"
    )


def apply_row_push(updater: _optimizer.Updater | None, pushed: list[RowPush]) -> None:
    """Apply one push call, key by key (see the module's docstring); a key the optimizer
    refuses (:meth:`~akv.optimizer.Updater.check_rows`) fails the call before any key
    changes."""
    if updater is not None and len(pushed) > 1:  # one key: update_rows checks it first
        for entry, _ in pushed:
            updater.check_rows(entry.key, table_of(entry))
    for entry, grad in pushed:
        table = table_of(entry)
        if updater is None:
            fresh = RowTable(table.shape, table.dtype)
            fresh.scatter(grad.indices, grad.data)
            entry.rows = fresh
        else:
            updater.update_rows(entry.key, table, grad)


def pull_rows(pulls: list[RowPull], result: object) -> object:
    """Fill each pull's array with the rows it asked for; the task returns ``result``."""
    for entry, ids, out in pulls:
        table = table_of(entry)
        out._set(table.gather(ids), ids, table.shape)
    return result
