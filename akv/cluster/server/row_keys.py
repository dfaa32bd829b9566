"""A server's row-sparse keys: which row frames it takes, what a row push, pull and init
decide, and the array work they lead to.

Every server holds every row-sparse key, each the rows of its range
(:func:`~akv.cluster.placement.row_parts`); only rows that were written are stored
(:class:`~akv.rows.RowTable`), so a table declared as 10^9 rows costs the rows touched.
Rounds are the dense keys' (:class:`~akv.cluster.server.rounds.KeyRounds`): in
``dist_sync`` a round takes one push per worker (a worker with no row in this server's range
still sends an empty push, so that the round closes), and its pushes are summed (the union
of their rows) and applied once it closes; in ``dist_async`` each push is applied as it
comes. A row pull is answered once the puller's last push to the key is applied. Applying a
sum without an optimizer makes the stored rows that sum (every other row reads as zero
again, as MXNet); with one, :meth:`akv.optimizer.Updater.update_rows` updates the sum's rows
(MXNet's lazy update) or every stored row, by the optimizer's rule.

:class:`RowKeys` decides, without I/O and without touching an array's values (it keeps the
pushes of an open round as they arrived); :func:`land_rows` and :func:`gather_rows` are the
array work the service runs in engine tasks that write (or read) the keys involved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import numpy as np

from akv import jit
from akv import optimizer as _optimizer
from akv.args import Key
from akv.cluster.protocol import Op, RowMeta, decode_row_meta, op_label
from akv.cluster.server.buffers import Lent
from akv.cluster.server.checkpoint_header import RowRecord, SpilledArray
from akv.cluster.server.inits import restored_key_differs
from akv.cluster.server.instructions import (
    Instruction,
    LandRows,
    Peer,
    Reply,
    RowEntry,
    RowPullTicket,
    ServerEntry,
)
from akv.cluster.server.rounds import longest_wait, untold_errors
from akv.errors import (
    DTypeMismatchError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    RowIdError,
    ShapeMismatchError,
    StorageTypeError,
)
from akv.keys import VarFactory
from akv.local_rows import apply_row_push, sum_rows
from akv.rows import RowTable
from akv.sparse import RowSparseArray
from akv_transport import ArrayInfo, FrameHeader

__all__ = ["ROW_OPS", "RowKeys", "gather_rows", "land_rows", "shaped"]

#: The ops on row-sparse keys.
ROW_OPS = frozenset({Op.ROW_INIT, Op.ROW_PUSH, Op.ROW_PULL})

_IDS = np.dtype("<i8")


class RowKeys:
    """The row-sparse keys of one server and what their requests decide (see the module
    docstring). ``name`` names the server in messages."""

    def __init__(self, name: str, num_workers: int, new_var: VarFactory) -> None:
        self.name = name
        self.num_workers = num_workers
        self._new_var = new_var
        self.entries: dict[Key, RowEntry] = {}

    # ------------------------------------------------------------ frames

    def landing(
        self, peer: Peer, header: FrameHeader, dense: Mapping[Key, ServerEntry], checkpoints: bool
    ) -> list[np.ndarray]:
        """Check a row frame's header (before anything is allocated or counted) and give
        each of its arrays a fresh buffer of its declared size.

        Raises
        ------
        AKVError
            The error the request is answered with: a malformed frame, a key not
            initialized (or dense), rows of the wrong width or dtype, a key held already
            (init), or a server that writes checkpoints (which hold no rows yet).
        """
        op, arrays = header.op, header.arrays
        label = op_label(op)
        if op == Op.ROW_INIT:
            metas = decode_row_meta(header.text)
            _check_pairs(peer, label, arrays, [meta[0] for meta in metas])
            for meta, index in zip(metas, range(0, len(arrays), 2), strict=True):
                self._check_init(peer, header.seq, meta, dense)
                _check_rows(meta[0], arrays[index], arrays[index + 1], meta[1], meta[2], label)
        elif op == Op.ROW_PUSH:
            keys = [info.key for info in arrays[::2]]
            _check_pairs(peer, label, arrays, keys)
            for index in range(0, len(arrays), 2):
                entry = self.entry(arrays[index].key, label, dense)
                dtype = str(entry.dtype)
                _check_rows(entry.key, arrays[index], arrays[index + 1], entry.shape, dtype, label)
        else:
            seen: set[object] = set()
            for info in arrays:
                entry = self.entry(info.key, label, dense)
                if info.key in seen:
                    raise InvalidArgumentError(f"{label} names key {info.key!r} twice")
                seen.add(info.key)
                _check_ids_info(entry.key, info, label)
        # An empty array as 1-D: a memoryview of an N-D one with a zero in its shape
        # cannot be cast to bytes (see :func:`shaped`).
        return [np.empty(info.shape if info.nbytes else 0, info.dtype) for info in arrays]

    def entry(self, key: object, what: str, dense: Mapping[Key, ServerEntry]) -> RowEntry:
        """The row-sparse key ``key``.

        Raises
        ------
        StorageTypeError
            ``key`` is a dense key.
        KeyNotInitializedError
            There is no such key.
        """
        entry = self.entries.get(cast(Key, key))
        if entry is not None:
            return entry
        if key in dense:
            raise StorageTypeError(
                f"{what} key {key!r}: the key is dense on {self.name}, the request is for a "
                "row-sparse key"
            )
        raise KeyNotInitializedError(f"{what} key {key!r}: the key was never initialized", key=key)

    def _check_init(
        self, peer: Peer, seq: int, meta: RowMeta, dense: Mapping[Key, ServerEntry]
    ) -> None:
        key, shape, dtype, first, end = meta
        held_dense = dense.get(key)
        if held_dense is not None and held_dense.made_by is None:  # restored, another model
            raise restored_key_differs(
                key,
                f"a dense {held_dense.shape} {held_dense.dtype} key",
                f"a row-sparse {shape} {dtype} key",
            )
        if held_dense is not None:
            raise DuplicateInitError(f"init key {key!r}: {self.name} already holds it", key=key)
        held = self.entries.get(key)
        if held is None:
            return
        # made_by None: restored from a checkpoint, so any init of it is a resent one.
        resent = held.made_by is None or (
            held.made_by == (peer.session, seq) and bool(peer.session)
        )
        same = (
            held.shape == shape
            and str(held.dtype) == dtype
            and (held.first, held.end)
            == (
                first,
                end,
            )
        )
        if held.made_by is None and not same:
            raise restored_key_differs(
                key,
                f"{held.shape} {held.rows.dtype} rows {held.first}-{held.end}",
                f"{shape} {dtype} rows {first}-{end}",
            )
        if not (resent and same):
            raise DuplicateInitError(f"init key {key!r}: {self.name} already holds it", key=key)

    # ------------------------------------------------------------ requests

    def init(
        self, peer: Peer, header: FrameHeader, buffers: Sequence[np.ndarray], sync: bool
    ) -> list[RowEntry]:
        """Make the keys of a checked ``ROW_INIT`` (a resent one's keys are held already)
        with their rows; returns the keys made.

        Raises
        ------
        RowIdError
            A row id outside the server's range of its key (nothing is made).
        """
        metas = decode_row_meta(header.text)
        made_by = (peer.session, header.seq) if peer.session else ("", -1)
        fresh = []
        for (key, shape, dtype, first, end), index in zip(
            metas, range(0, len(buffers), 2), strict=True
        ):
            if key in self.entries:
                continue
            ids = buffers[index]
            _check_range(key, ids, first, end, self.name, "init")
            entry = RowEntry(
                key,
                shape,
                np.dtype(dtype),
                (first, end),
                self._new_var,
                sync,
                self.num_workers,
                made_by,
            )
            fresh.append((entry, ids, buffers[index + 1]))
        for entry, ids, rows in fresh:
            entry.rows.scatter(*_sorted_summed(ids, rows, entry))
            self.entries[entry.key] = entry
        return [entry for entry, _, _ in fresh]

    def push(
        self,
        peer: Peer,
        header: FrameHeader,
        buffers: Sequence[np.ndarray],
        now: float,
        lent: Lent | None = None,
    ) -> tuple[list[Instruction], int]:
        """Count a checked ``ROW_PUSH`` (all its keys or none); returns what to do and how
        many resent pushes it held (answered without being counted again). ``lent``: the
        buffers are read in place (:meth:`Landing.lend`); each push counted takes a share
        of it, which the round's :class:`LandRows` gives back.

        Raises
        ------
        RowIdError, DoublePushError
            Nothing is counted.
        """
        worker = peer.worker
        seq = header.seq if peer.stream else 0
        items = []
        duplicates = 0
        for index in range(0, len(buffers), 2):
            info = header.arrays[index]
            entry = self.entries[info.key]  # type: ignore[index]  # checked at the header
            ids = buffers[index]
            _check_range(entry.key, ids, entry.first, entry.end, self.name, "push to")
            if entry.rounds.is_duplicate(worker, info.tag):
                duplicates += 1
                continue
            entry.rounds.check_push(worker)
            items.append((entry, info.tag, ids, buffers[index + 1]))
        closing = []
        waited: float | None = None
        for entry, tag, ids, rows in items:
            decision = entry.rounds.accept_push(worker, now, tag, seq)
            if lent is not None:
                lent.take()
            entry.pending.append((ids, rows, lent))
            if decision.closes:
                closing.append((entry, decision.round, tuple(entry.pending)))
                entry.pending = []
                waited = longest_wait(waited, decision)
        reply = Reply(peer, header.seq)
        if not closing:
            return [reply], duplicates
        entries = tuple(entry for entry, _, _ in closing)
        if items and not items[0][0].rounds.sync:  # dist_async: answered once applied
            return [LandRows(entries, tuple(closing), reply)], duplicates
        return [reply, LandRows(entries, tuple(closing), waited_s=waited)], duplicates

    def pull(self, peer: Peer, header: FrameHeader, buffers: Sequence[np.ndarray]) -> RowPullTicket:
        """A checked ``ROW_PULL``'s ticket, parked on each key whose round the puller's
        last push went into until it is applied (``remaining`` counts them).

        Raises
        ------
        RowIdError, ServerError
            Nothing is parked.
        """
        pulls = []
        for info, ids in zip(header.arrays, buffers, strict=True):
            entry = self.entries[info.key]  # type: ignore[index]  # checked at the header
            _check_range(entry.key, ids, entry.first, entry.end, self.name, "row_sparse_pull of")
            entry.rounds.check_pull(entry.rounds.last_push_round(peer.worker))
            pulls.append((entry, ids))
        ticket = RowPullTicket(peer, header.seq, pulls)
        for entry, _ in pulls:
            if not entry.rounds.pull(entry.rounds.last_push_round(peer.worker), ticket):
                ticket.remaining += 1
        return ticket

    def restore(self, records: Sequence[RowRecord], sync: bool) -> None:
        """Start from a checkpoint's row-sparse keys (made by no init of this process).
        The row kernels are made here, before the server serves: no init of these keys
        will come to wait for them (see :func:`akv.jit.load_soon`)."""
        if records:
            jit.kernels()
        for record in records:
            rows = record.rows
            assert not isinstance(rows, SpilledArray), "a restore reads its rows"
            entry = RowEntry(
                record.key,
                record.shape,
                rows.dtype,
                (record.first, record.end),
                self._new_var,
                sync,
                self.num_workers,
                None,
            )
            if isinstance(rows, RowTable):  # read into a table of its own: taken as it is
                entry.rows = rows
            else:
                entry.rows.scatter(record.ids, rows)
            untold = untold_errors(record.untold, self.name)
            entry.rounds.restore(record.closed_round, record.tags, record.last_round, untold)
            self.entries[record.key] = entry

    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        for key, entry in self.entries.items():
            assert entry.key == key and entry.rounds.key == key, key
            ids = entry.rows.ids()
            assert not ids.size or (entry.first <= ids[0] and ids[-1] < entry.end), key
            assert len(entry.pending) == len(entry.rounds.open_seqs()), key


def shaped(header: FrameHeader, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The buffers of :meth:`RowKeys.landing` with their declared shapes."""
    return [buffer.reshape(info.shape) for info, buffer in zip(header.arrays, buffers, strict=True)]


def land_rows(
    work: LandRows, updater: _optimizer.Updater | None
) -> tuple[list[tuple[RowEntry, int]], list[tuple[RowEntry, int, Exception]]]:
    """Sum and apply each closed round of ``work`` (see :class:`LandRows`); returns the
    (key, round) pairs applied and the (key, round, exception) of those whose update
    raised (an optimizer refuses before it changes anything)."""
    done: list[tuple[RowEntry, int]] = []
    failed: list[tuple[RowEntry, int, Exception]] = []
    for entry, round_no, pushes in work.closing:
        try:
            grads = []
            for ids, rows, _ in pushes:
                unique_ids, summed = _sorted_summed(ids, rows, entry)
                grads.append(RowSparseArray._trusted(summed, unique_ids, entry.shape))
            apply_row_push(updater, [(entry, sum_rows(grads))])
        except Exception as exc:
            failed.append((entry, round_no, exc))
        else:
            done.append((entry, round_no))
    return done, failed


def gather_rows(
    ticket: RowPullTicket, region: Callable[[int], memoryview | None] | None = None
) -> tuple[list[tuple[Key, np.ndarray, int]], list[np.ndarray]]:
    """The arrays of a row pull's answer: per key, the rows asked for (zeros for rows not
    stored), tagged with the round applied; and those of them gathered straight into a
    memory ``region(nbytes)`` gave (a region of the shared memory the answer goes through:
    no copy into it when sent). ``region`` None, or a region None: a new array."""
    arrays = []
    placed = []
    for entry, ids in ticket.pulls:
        shape = (ids.size, *entry.shape[1:])
        nbytes = math.prod(shape) * entry.dtype.itemsize
        view = None if region is None else region(nbytes)
        if view is None:
            rows = entry.rows.gather(ids)
        else:
            rows = entry.rows.gather(ids, out=np.frombuffer(view, entry.dtype).reshape(shape))
            placed.append(rows)
        arrays.append((entry.key, rows, entry.rounds.applied_round))
    return arrays, placed


# ---------------------------------------------------------------------- checks


def _check_pairs(
    peer: Peer, label: str, arrays: Sequence[ArrayInfo], keys: Sequence[object]
) -> None:
    """Each key has two arrays (ids, rows), in order, and no key comes twice."""
    if len(arrays) != 2 * len(keys):
        raise InvalidArgumentError(
            f"{label} from worker {peer.worker}: {len(arrays)} arrays for {len(keys)} keys "
            "(each key carries its row ids and its rows)"
        )
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"{label} from worker {peer.worker} names a key twice")
    for index, key in enumerate(keys):
        if key is None or arrays[2 * index].key != key or arrays[2 * index + 1].key != key:
            raise InvalidArgumentError(
                f"{label} from worker {peer.worker}: arrays {2 * index} and {2 * index + 1} "
                f"are not the row ids and rows of key {key!r}"
            )


def _check_ids_info(key: object, info: ArrayInfo, label: str) -> None:
    if info.dtype != _IDS or len(info.shape) != 1:
        raise InvalidArgumentError(
            f"{label} key {key!r}: row ids must be a 1-D int64 array, got {info.dtype} of "
            f"shape {info.shape}"
        )


def _check_rows(
    key: object,
    ids: ArrayInfo,
    rows: ArrayInfo,
    shape: tuple[int, ...],
    dtype: str,
    label: str,
) -> None:
    _check_ids_info(key, ids, label)
    expected = (ids.shape[0], *shape[1:])
    if tuple(rows.shape) != expected:
        raise ShapeMismatchError(
            f"{label} key {key!r}: rows of shape {rows.shape}, expected {expected} for "
            f"{ids.shape[0]} row ids of a key of shape {shape}",
            key=key,
            expected=expected,
            got=rows.shape,
        )
    if str(rows.dtype) != dtype:
        raise DTypeMismatchError(
            f"{label} key {key!r}: rows of dtype {rows.dtype}, the key has dtype {dtype}",
            key=key,
            expected=dtype,
            got=rows.dtype,
        )


def _check_range(key: Key, ids: np.ndarray, first: int, end: int, server: str, what: str) -> None:
    if ids.size and (ids.min() < first or ids.max() >= end):
        bad = int(ids[np.argmax((ids < first) | (ids >= end))])
        raise RowIdError(
            f"{what} key {key!r}: row id {bad} is outside the rows [{first}, {end}) that "
            f"{server} holds"
        )


def _sorted_summed(
    ids: np.ndarray, rows: np.ndarray, entry: RowEntry
) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` sorted and unique with their rows (repeated ids' rows summed), as a
    :class:`RowSparseArray` holds them (a worker sends them so; a server checks)."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return ids, rows
    value = RowSparseArray(rows, ids, entry.shape)
    return value.indices, value.data
