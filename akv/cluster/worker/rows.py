"""A worker's requests on row-sparse keys: which rows go to which server, and where the
rows of a pull's answer land. Pure: no I/O.

A row-sparse key is split by rows over every server (:func:`~akv.cluster.placement.row_parts`:
``entry.parts`` count rows). Values are sorted by row id, so each server's rows are one
contiguous slice of them (two binary searches), sent without a copy. A push goes to every
server, an empty one where the value has no row in the server's range: a push is the whole
key's new value (without an optimizer every other row reads as zero again; a standard
optimizer update changes every stored row; Adam counts the key's updates), and a
``dist_sync`` round counts one push per worker. A pull asks only the servers that hold rows
it asks for, and their answers land straight in the slices of the output that are theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from akv.cluster.protocol import RowMeta, encode_meta, encode_row_meta
from akv.cluster.worker.requests import WireArray
from akv.keys import Entry
from akv.sparse import RowIds, RowSparseArray
from akv_transport import byte_view

__all__ = [
    "PullRequest",
    "init_check_text",
    "init_requests",
    "pull_requests",
    "push_requests",
    "slices",
]


def slices(entry: Entry, ids: RowIds) -> list[tuple[int, int, int]]:
    """``(server, first, end)`` for each server of ``entry``: the positions of sorted
    ``ids`` that fall in the server's row range."""
    starts = [part.start for part in entry.parts]
    edges = np.searchsorted(ids, [*starts, entry.shape[0]]).tolist()
    return [(part.server, edges[i], edges[i + 1]) for i, part in enumerate(entry.parts)]


def init_requests(
    entries: list[Entry], values: list[RowSparseArray]
) -> dict[int, tuple[list[WireArray], str]]:
    """Rank 0's ``ROW_INIT`` to each server: every key, with its rows in the server's
    range (the arrays, copied now: the caller may change its values once the call
    returns) and its declared shape, dtype and range (the text)."""
    requests: dict[int, tuple[list[WireArray], list[RowMeta]]] = {}
    for entry, value in zip(entries, values, strict=True):
        ranges = slices(entry, value.indices)
        for (server, first, end), part in zip(ranges, entry.parts, strict=True):
            arrays, metas = requests.setdefault(server, ([], []))
            meta = (entry.key, entry.shape, str(entry.dtype), part.start, part.stop)
            metas.append(meta)
            arrays.append((entry.key, value.indices[first:end].copy(), 0))
            arrays.append((entry.key, value.data[first:end].copy(), 0))
    return {
        server: (arrays, encode_row_meta(metas)) for server, (arrays, metas) in requests.items()
    }


def init_check_text(entries: list[Entry]) -> str:
    """Another worker's ``INIT_CHECK`` of row-sparse keys (sent to every server): their
    shapes and ``"<dtype> row_sparse"``, so that a dense init of the same key differs."""
    return encode_meta([(entry.key, entry.shape, f"{entry.dtype} row_sparse") for entry in entries])


#: ``region(server, nbytes)``: memory that a request to ``server`` is sent from without a
#: copy (a region of the stream's shared arena) and its owner (what takes it back), or None.
Region = Callable[[int, int], tuple[Any, memoryview] | None]


def push_requests(
    pushes: list[tuple[Entry, RowSparseArray, int]], region: Region | None = None
) -> tuple[dict[int, list[WireArray]], list[tuple[Any, np.ndarray]]]:
    """Each server's ``ROW_PUSH`` arrays: per key, its ids and rows in the server's range
    (none, for some: every server gets every key, see the module), tagged with the push
    number; copied now (the caller may change the values once this returns): each
    server's rows into ``region(server, nbytes)`` where it gives one, else into arrays of
    their own. Also returns the ``(owner, rows)`` that lie in regions."""
    requests: dict[int, list[WireArray]] = {}
    placed: list[tuple[Any, np.ndarray]] = []
    for entry, value, tag in pushes:
        ids = value.indices.copy()
        for server, first, end in slices(entry, ids):
            rows = value.data[first:end]
            taken = region(server, rows.nbytes) if region is not None and rows.size else None
            if taken is None:
                held = rows.copy()
            else:
                held = np.frombuffer(taken[1], rows.dtype).reshape(rows.shape)
                held[...] = rows
                placed.append((taken[0], held))
            arrays = requests.setdefault(server, [])
            arrays.append((entry.key, ids[first:end], tag))
            arrays.append((entry.key, held, tag))
    return requests, placed


_NO_IDS = np.zeros(0, np.int64)

#: One ``ROW_PULL`` to send: its server, its arrays, and where each answered array lands.
PullRequest = tuple[int, list[WireArray], list[memoryview]]


def pull_requests(
    pulls: list[tuple[Entry, RowIds, np.ndarray]],
    waits: dict[Any, set[int]] | None = None,
) -> list[PullRequest]:
    """The ``ROW_PULL`` requests of a pull: per key with requested rows in a server's range,
    those ids, and where the rows it answers land (the slice of that key's output ``data``,
    C-contiguous, one row per id). One request per server that holds requested rows; more
    where the pull names a key more than once (several id arrays or outputs of one key, as
    MXNet allows), since a request names each key once. ``waits``: per key, servers asked
    for no row but for the key all the same (with no ids: the answer comes once the round
    of this worker's last push there is applied; see :meth:`RowCalls.pull`)."""
    requests: dict[int, list[tuple[set[Any], list[WireArray], list[memoryview]]]] = {}

    def ask(server: int, key: Any, ids: np.ndarray, landing: memoryview) -> None:
        chain = requests.setdefault(server, [])
        request = next((r for r in chain if key not in r[0]), None)
        if request is None:
            request = (set(), [], [])
            chain.append(request)
        keys, arrays, landings = request
        keys.add(key)
        arrays.append((key, ids, 0))
        landings.append(landing)

    asked: dict[Any, set[int]] = {}
    for entry, ids, data in pulls:
        for server, first, end in slices(entry, ids):
            if end > first:
                ask(
                    server,
                    entry.key,
                    ids[first:end],
                    byte_view(data[first:end]),
                )
                asked.setdefault(entry.key, set()).add(server)
    for key, servers in (waits or {}).items():
        for server in sorted(servers - asked.get(key, set())):
            ask(server, key, _NO_IDS, memoryview(bytearray()))
    return [
        (server, arrays, landings)
        for server, chain in requests.items()
        for _, arrays, landings in chain
    ]
