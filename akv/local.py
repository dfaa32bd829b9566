"""The ``local`` store's backend: values in host memory, updates where they live.

Each key's stored array is written only by engine tasks that hold the key's var for
writing, and read only by tasks that hold it for reading, so the engine's per-var order is
the store's per-key order.

A call on one key whose var is free, with work small enough to run inline (or a push
without an updater, whatever its size), runs during the call with no engine Task
(``Engine.run_now``): a push is summed straight into the stored array, a pull copied out,
and the call returns an already completed waitable. Otherwise the work is queued: a push
from the async face is then summed into a staging buffer before the call returns (the
caller may change its arrays at once); without an updater that buffer *becomes* the stored
array (no second copy) and the old stored array becomes the next staging buffer. A push
from the blocking face, whose caller waits, is summed straight into the stored array.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from akv import jit
from akv import optimizer as _optimizer
from akv.args import Key
from akv.arrays import Array, copy_into, has_gpu, is_gpu, to_host
from akv.backend import KeyArrays, Updater, caller_events
from akv.compression import Compression
from akv.errors import AKVError, OptimizerNotSetError
from akv.keys import Entry, merge_into
from akv.local_rows import RowPull, RowPush, apply_row_push, check_updater, pull_rows, store_rows
from akv.optimizer._files import read_encoded, write_encoded
from akv.pinned import gpu_only, pinned_now, register_gpu_executor
from akv.rows import RowTable
from akv.sparse import RowSparseArray
from akv_engine import Engine, GPUExecutor, Task, Waitable

__all__ = ["LocalBackend", "UpdaterGuard"]


class UpdaterGuard(threading.local):
    """Marks the threads that are running one of a store's updaters right now."""

    store: object = None

    def run(
        self, store: object, updater: Updater, key: Key, recv: np.ndarray, stored: np.ndarray
    ) -> None:
        previous = self.store
        self.store = store
        try:
            updater(key, recv, stored)
        finally:
            self.store = previous


GUARD = UpdaterGuard()


def _commit(entry: Entry, staged: np.ndarray) -> None:
    old = entry.value
    entry.value = staged
    if old is not None:
        entry.give_buffer(old)


def _update(store: object, updater: Updater, entry: Entry, staged: np.ndarray) -> None:
    assert entry.value is not None  # set by init, which every push is ordered after
    try:
        GUARD.run(store, updater, entry.key, staged, entry.value)
    finally:
        entry.give_buffer(staged)


def _land(
    store: object,
    updater: Updater | None,
    pushed: list[tuple[Entry, list[np.ndarray], np.ndarray | None]],
) -> None:
    """Apply one push call, key by key.

    Each key comes with its values and either a staging buffer holding their sum (made
    at the call) or None: then the caller waits, and its arrays are read here directly.
    """
    for index, (entry, arrays, staged) in enumerate(pushed):
        try:
            if updater is None:
                if staged is not None:
                    _commit(entry, staged)
                else:
                    assert entry.value is not None  # set by init, ordered before
                    merge_into(entry.value, arrays)
            else:
                recv = staged if staged is not None else merge_into(entry.take_buffer(), arrays)
                _update(store, updater, entry, recv)
        except BaseException:
            for later, _, later_staged in pushed[index + 1 :]:
                if later_staged is not None:
                    later.give_buffer(later_staged)
            raise


def _staged(entry: Entry, arrays: list[Array]) -> np.ndarray:
    """A key's values summed into a staging buffer of the key, now: GPU values alone on
    their GPU, then copied into a pinned buffer (:func:`akv.pinned.pinned_now`); otherwise
    on the host (GPU values among them copied there first)."""
    if all(type(array) is np.ndarray for array in arrays):  # the common case
        staged: np.ndarray = merge_into(entry.take_buffer(), arrays)
        return staged
    if gpu_only(arrays):
        return pinned_now(entry, arrays)
    staged = merge_into(entry.take_buffer(), [to_host(array) for array in arrays])
    return staged


def _land_now(store: object, updater: Updater | None, entry: Entry, arrays: list[Array]) -> None:
    """Apply one key's push that runs during the call: the caller's arrays are read here,
    as when the caller waits (no staging copy)."""
    assert entry.value is not None  # set by init, which every push is ordered after
    if updater is None:
        if len(arrays) == 1:
            np.copyto(entry.value, arrays[0])  # the common case, without a call more
        else:
            merge_into(entry.value, arrays)
    else:
        _update(store, updater, entry, merge_into(entry.take_buffer(), arrays))


def _copy_out(entry: Entry, outs: list[Array], result: object, after: list[Any]) -> object:
    stored = entry.value
    assert stored is not None  # set by init, which every pull is ordered after
    for out in outs:
        if type(out) is np.ndarray and type(stored) is np.ndarray:
            np.copyto(out, stored)  # the common case, without a call more
        else:
            copy_into(out, stored, after)
    return result


def _pull_many(targets: KeyArrays, result: object, after: list[Any]) -> object:
    for entry, outs in targets:
        _copy_out(entry, outs, None, after)
    return result


def _copy_of(entry: Entry, array: np.ndarray) -> np.ndarray:
    """A new array of ``entry``'s shape and dtype holding ``array``."""
    value = np.empty(entry.shape, entry.dtype)
    np.copyto(value, array)
    return value


def _store_values(entries: list[Entry], values: list[np.ndarray]) -> None:
    """Store each initial value (the store's own: copied at the call)."""
    for entry, value in zip(entries, values, strict=True):
        entry.value = value


def _nothing() -> None:
    return None


_NO_EVENTS: list[Any] = []


class LocalBackend:
    """Holds the values of a ``local`` store and schedules the work on them."""

    rank = 0
    num_workers = 1
    broken: AKVError | None = None
    #: GPU values are staged through pinned buffers here (see the module docstring).
    keeps_gpu_arrays = True
    returns_pushes_early = False
    stages_rows = False

    def __init__(
        self,
        engine: Engine,
        store: object,
        inline_max_bytes: int | None,
        executor: Callable[[], GPUExecutor] = GPUExecutor,
    ) -> None:
        """``store``: the store whose updater calls are guarded against re-entry.
        ``inline_max_bytes``: work on at most this many bytes runs on the calling thread,
        bigger work on the engine's threads (None: always on the calling thread).
        ``executor`` makes the engine's GPU executor when one is needed (a seam for tests)."""
        self._engine = engine
        self._store = store
        self._inline_max_bytes = inline_max_bytes
        self.type = "local"
        self.updater: Updater | None = None
        self._optimizer_updater: _optimizer.Updater | None = None
        #: Written by a set_optimizer that reconfigures the updater, read by every init: a
        #: key made after the call is pushed to only once the new configuration is in.
        self._optimizer_var = engine.new_var("optimizer")
        self._reconfiguring: Task | None = None
        self._make_executor = executor
        self._gpu_executor: GPUExecutor | None = None

    def _gpu_ready(self) -> GPUExecutor:
        """The engine's GPU executor, registered on first use."""
        if self._gpu_executor is None:
            self._gpu_executor = register_gpu_executor(self._engine, self._make_executor)
        return self._gpu_executor

    def _executor(self, items: KeyArrays) -> str:
        """Inline for work on few bytes (the keys' sizes), else the worker threads."""
        limit = self._inline_max_bytes
        if limit is None:
            return "inline"
        total = 0
        for entry, _ in items:
            total += entry.nbytes
            if total > limit:
                return "thread"
        return "inline"

    def new_entry(self, key: Key, array: np.ndarray) -> Entry:
        """A key's entry, with an engine var of its own."""
        return Entry(key, tuple(array.shape), array.dtype, self._engine.new_var(f"key {key!r}"))

    def set_compression(self, compression: Compression) -> bool:
        """Nothing is sent: the store encodes and decodes pushed values itself."""
        return False

    def new_row_entry(self, key: Key, shape: tuple[int, ...], dtype: np.dtype) -> Entry:
        """A row-sparse key's entry: its rows are kept in ``entry.rows``."""
        entry = Entry(key, shape, dtype, self._engine.new_var(f"key {key!r}"))
        entry.rows = RowTable(shape, dtype)
        jit.kernels()  # loaded (once a process) with the key, not in its first push
        return entry

    def set_updater(self, updater: Updater | None) -> None:
        """Use ``updater`` for pushes issued from now on."""
        self.updater = updater
        self._optimizer_updater = None

    def set_optimizer(self, optimizer: _optimizer.Optimizer, entries: list[Entry]) -> Task:
        """Apply ``optimizer`` to the pushes issued from now on (each push takes the updater
        in use at its call). A new configuration of the optimizer in use goes on with its
        updater (:func:`~akv.optimizer.keeps_states`), reconfigured once the earlier pushes
        to ``entries`` are applied, before later ones (also to keys made after the call:
        their init waits for it); another starts a new updater (per-key state made at first
        use)."""
        current = self._optimizer_updater
        if self.updater is current and _optimizer.keeps_states(current, optimizer):
            assert current is not None  # (keeps_states: there is one)

            def reconfigure() -> None:
                self._settle(entries)
                held = ((e.key, e.value if e.rows is None else e.rows) for e in entries)
                current.reconfigure(optimizer, {key: w for key, w in held if w is not None})

            # Reads: after the earlier pushes, before the later ones, and whatever those
            # failed (no_skip): their failure stays theirs, not the new keys' inits'.
            self._reconfiguring = self._engine.push(
                reconfigure,
                reads=[entry.var for entry in entries],
                writes=[self._optimizer_var],
                name="set_optimizer",
                no_skip=True,
            )
            return self._reconfiguring
        updater = _optimizer.get_updater(optimizer)
        self.updater = updater
        self._optimizer_updater = updater
        return self.barrier()

    def init(self, entries: list[Entry], arrays: list[np.ndarray]) -> Waitable:
        """Copy the initial values at the call (the store keeps no reference to the
        caller's arrays, which the caller may change once this returns); a GPU value is
        copied into a pinned buffer, which is stored."""
        owned = [type(a) is not np.ndarray and is_gpu(a) for a in arrays]
        arrays = [
            pinned_now(entry, [array]) if gpu else _copy_of(entry, array)
            for entry, array, gpu in zip(entries, arrays, owned, strict=True)
        ]
        return self._engine.push(
            _store_values,
            entries,
            arrays,
            reads=[self._optimizer_var],
            writes=[entry.var for entry in entries],
            executor="inline",
            name="init",
        )

    def push(self, values: KeyArrays, priority: int, borrow: bool) -> Waitable:
        """Apply checked values: ``updater(key, summed, stored)``, or replace the stored value.

        A push of one free key runs now (see the module's docstring). Otherwise,
        ``borrow``: the caller waits until this is done, so its arrays are read in the task
        (no staging copy, one buffer fewer); otherwise they are summed into staging buffers
        now, before the call returns.
        """
        updater = self.updater
        if has_gpu(values):
            borrow = False  # GPU values are staged at the call (through pinned buffers)
        elif len(values) == 1 and (updater is None or self._executor(values) == "inline"):
            # One key, free and small enough: applied now, so the values need no staging.
            entry, arrays = values[0]
            done = self._engine.run_now(
                _land_now, self._store, updater, entry, arrays, writes=(entry.var,), name="push"
            )
            if done is not None:
                return done
        pushed = [
            (entry, arrays, None if borrow else _staged(entry, arrays)) for entry, arrays in values
        ]
        if updater is None and not borrow:
            executor = "inline"  # committing staged buffers is a swap of references
        else:
            executor = self._executor(values)
        return self._engine.push(
            _land,
            self._store,
            updater,
            pushed,
            writes=[entry.var for entry, _ in values],
            priority=priority,
            executor=executor,
            name="push",
        )

    def pull(self, targets: KeyArrays, result: object, priority: int) -> Waitable:
        """Copy each key's stored value into each of its outputs; the task returns ``result``.

        GPU outputs are written after the work the caller queued on them before the call.
        """
        if len(targets) == 1:  # the common call, kept cheap
            entry, outs = targets[0]
            limit = self._inline_max_bytes
            executor = "inline" if limit is None or entry.nbytes <= limit else "thread"
            # One host output has no GPU work queued on it to wait for.
            host = len(outs) == 1 and type(outs[0]) is np.ndarray
            after = _NO_EVENTS if host else caller_events(targets)
            if executor == "inline":  # a free key is copied out now, with no Task
                done = self._engine.run_now(
                    _copy_out, entry, outs, result, after, reads=(entry.var,), name="pull"
                )
                if done is not None:
                    return done
            return self._engine.push(
                _copy_out,
                entry,
                outs,
                result,
                after,
                reads=(entry.var,),
                priority=priority,
                executor=executor,
                name="pull",
            )
        executor = self._executor(targets)
        after = caller_events(targets)
        return self._engine.push(
            _pull_many,
            targets,
            result,
            after,
            reads=[entry.var for entry, _ in targets],
            priority=priority,
            executor=executor,
            name="pull",
        )

    def pushpull(
        self, values: KeyArrays, targets: KeyArrays, result: object, priority: int, borrow: bool
    ) -> Waitable:
        """A push, then a pull ordered after it."""
        self.push(values, priority, borrow)
        return self.pull(targets, result, priority)

    def init_rows(self, entries: list[Entry], values: list[RowSparseArray]) -> Waitable:
        """Store each new row-sparse key's listed rows, read at the call (one key's into
        its table now; several keys' copied now and stored by a task)."""
        reconfiguring = self._reconfiguring
        if len(entries) == 1 and (reconfiguring is None or reconfiguring.done()):
            done = self._engine.run_now(
                store_rows, entries, values, writes=(entries[0].var,), name="init"
            )
            if done is not None:
                return done
        values = [RowSparseArray._trusted(v.data.copy(), v.indices.copy(), v.shape) for v in values]
        return self._engine.push(
            store_rows,
            entries,
            values,
            reads=[self._optimizer_var],
            writes=[entry.var for entry in entries],
            executor=self._rows_executor(sum(value.nbytes for value in values)),
            name="init",
        )

    def push_rows(self, values: list[RowPush], priority: int) -> Waitable:
        """Replace each key's rows with the sum pushed, or update the rows it lists with the
        store's optimizer (:mod:`akv.local_rows`)."""
        updater = None
        for entry, _ in values:
            updater = check_updater(self.updater, entry)
        return self._engine.push(
            apply_row_push,
            updater,
            values,
            writes=[entry.var for entry, _ in values],
            priority=priority,
            executor=self._rows_executor(sum(value.nbytes for _, value in values)),
            name="push",
        )

    def pull_rows(self, pulls: list[RowPull], result: object, priority: int) -> Waitable:
        """Fill each array with its key's requested rows (absent ones read as zeros)."""
        nbytes = sum(len(ids) * entry.nbytes // max(entry.shape[0], 1) for entry, ids, _ in pulls)
        return self._engine.push(
            pull_rows,
            pulls,
            result,
            reads=[entry.var for entry, _, _ in pulls],
            priority=priority,
            executor=self._rows_executor(nbytes),
            name="row_sparse_pull",
        )

    def _rows_executor(self, nbytes: int) -> str:
        """Inline for row work on few bytes, else the worker threads."""
        limit = self._inline_max_bytes
        return "inline" if limit is None or nbytes <= limit else "thread"

    def barrier(self) -> Task:
        """Nothing to wait for: a local store has one worker."""
        return self._engine.push(_nothing, executor="inline", name="barrier")

    def _require_optimizer(self, what: str) -> _optimizer.Updater:
        if self._optimizer_updater is None:
            raise OptimizerNotSetError(f"{what} needs an optimizer: call set_optimizer first")
        return self._optimizer_updater

    def _settle(self, entries: list[Entry]) -> None:
        """Wait for the keys' work that the engine does not see (none here: a subclass that
        enqueues GPU work outside tasks waits for it), before host code reads their states."""

    def save_states(self, entries: list[Entry], path: Path, dump_optimizer: bool) -> Task:
        """Write the optimizer's states once every earlier push to ``entries`` is applied."""
        updater = self._require_optimizer("save_optimizer_states")

        def write() -> None:
            self._settle(entries)

            def encode(file: BinaryIO) -> None:
                updater.dump_states(dump_optimizer, file=file)

            write_encoded(path, encode, "save_optimizer_states")

        return self._engine.push(
            write, reads=[entry.var for entry in entries], name="save_optimizer_states"
        )

    def load_states(self, entries: list[Entry], path: Path) -> Task:
        """Load optimizer states after earlier pushes to ``entries`` and before later ones."""
        updater = self._require_optimizer("load_optimizer_states")

        def read() -> None:
            self._settle(entries)
            read_encoded(path, updater.load_states, "load_optimizer_states")

        return self._engine.push(
            read, writes=[entry.var for entry in entries], name="load_optimizer_states"
        )

    async def abandon(self, reason: str) -> None:
        """Nothing to tell: a local store has no peers (its work in flight finishes)."""

    async def close(self, barrier_before_exit: bool) -> None:
        """Nothing to leave: a local store has no peers."""
