"""The two faces of a store: :class:`AsyncKVStore` (awaitable) and :class:`KVStore` (blocking,
in :mod:`akv.blocking`, re-exported here); :mod:`akv.factory` opens them.

One implementation: ``AsyncKVStore`` checks every argument, merges pushed values into
staging buffers and hands the work to its backend as engine tasks; ``KVStore`` owns a
private event loop thread, builds an ``AsyncKVStore`` on it, and blocks on each call's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key, check_priority, group, normalize_key, pairs
from akv.arrays import Array, Origin, check_numeric, finisher, is_gpu, read, to_host, write_view
from akv.backend import Backend, KeyArrays, Updater
from akv.blocking import KVStore, not_copyable, shallow_copy
from akv.cluster.config import Config
from akv.compression import Compression, Residuals, parse_compression
from akv.custom import check_capability
from akv.device import DeviceBackend
from akv.errors import (
    AKVError,
    ClosedError,
    CompressionError,
    InvalidArgumentError,
    ReentrantCallError,
    StorageTypeError,
)
from akv.exits import (
    NOTED_EXIT,
    describe,
    sigterm_released,
)
from akv.keys import Entry, KeyTable
from akv.kinds import StoreType
from akv.local import GUARD, LocalBackend
from akv.row_args import (
    dense_only,
    init_rows,
    no_row_pushpull,
    no_row_sparse_out,
    row_pulls,
    row_pushes,
    sparse_call,
)
from akv.sparse import RowSparseArray, check_dense
from akv_engine import Engine, Waitable, then

__all__ = ["AsyncKVStore", "KVStore"]


class AsyncKVStore:
    """A key-value store for asyncio programs (create it with :func:`akv.create_async`).

    Every method that does work schedules it before returning and returns an awaitable
    (an :class:`akv_engine.Waitable`); per key, work happens in call order whether or not the
    caller awaits. Argument errors raise at the call, before anything is scheduled.
    The store copies what it is given: after a call returns, changing the caller's arrays
    never changes the store, and a pull never hands out the stored array.
    """

    _engine: Engine
    _keys: KeyTable
    _type: str
    _backend: Backend
    _caller_waits: bool
    _barrier_before_exit: bool
    _closed: bool
    _closing: asyncio.Future[None] | None
    _abandoning: asyncio.Future[None] | None
    _holds_sigterm: bool
    _compression: Compression | None
    _residuals: Residuals | None
    _pushed: bool

    def __init__(self) -> None:
        raise TypeError("use `await akv.create_async(type)` to make an AsyncKVStore")

    @classmethod
    async def _open(
        cls,
        kind: StoreType,
        slots: int,
        inline_max_bytes: int | None,
        config: Config | None,
        devices: list[int] | None = None,
        caller_waits: bool = False,
    ) -> AsyncKVStore:
        self = object.__new__(cls)
        self._engine = Engine(slots=slots, name=f"akv-{kind.name}")
        self._keys = KeyTable()
        self._type = kind.name
        # The blocking face waits for every call, so a push may read the caller's arrays
        # while it runs instead of copying them first (the async face must copy at once).
        self._caller_waits = caller_waits
        self._barrier_before_exit = True
        self._closed = False
        self._closing = None
        self._abandoning = None
        self._holds_sigterm = False
        self._compression = None
        self._residuals = None
        self._pushed = False
        self._updates_on_push = False
        if config is None and kind.device:
            self._backend = DeviceBackend(self._engine, self, inline_max_bytes, devices)
        elif config is None:
            self._backend = LocalBackend(self._engine, self, inline_max_bytes)
        else:
            from akv.cluster.worker.backend import DistBackend

            self._backend = DistBackend(self._engine, kind.mode, config, device=kind.device)
            try:
                await self._backend.connect()
            except BaseException as exc:
                # Registered already, maybe: the job fails naming why (a refused stream, a
                # cancelled create), not a worker that went silent later.
                try:
                    with contextlib.suppress(Exception):
                        await self._backend.abandon(describe(exc, "akv.create"))
                finally:  # (also when cancelled again: the heartbeat thread is stopped)
                    try:
                        await self._backend.close(barrier_before_exit=False)
                    finally:
                        await self._engine.aclose()
                raise
        return self

    # ---------------------------------------------------------------- properties

    @property
    def type(self) -> str:
        """The store type name as it was given to ``create`` (MXNet reports it so too)."""
        return self._type

    @property
    def updates_on_push(self) -> bool:
        """Whether this process gave the store an optimizer (:meth:`set_optimizer`) or an
        updater (:meth:`set_updater`, not cleared since): a push then updates the stored
        value with the round's sum instead of replacing it. In a distributed store an
        optimizer that another worker set applies too; this says what this worker did."""
        return self._updates_on_push

    @property
    def rank(self) -> int:
        """This worker's rank (0 in a local store)."""
        return self._backend.rank

    @property
    def num_workers(self) -> int:
        """How many workers share the store (1 in a local store)."""
        return self._backend.num_workers

    @property
    def engine(self) -> Engine:
        """The store's dependency engine (for ``graph()``, ``statistics()``, ``to_dot()``)."""
        return self._engine

    def keys(self) -> list[Key]:
        """The initialized keys, in initialization order."""
        return self._keys.keys()

    # ---------------------------------------------------------------- the work

    def init(self, key: Key | list[Key], value: Any) -> Waitable:
        """Initialize keys with their first values (one value per key, copied).

        Raises
        ------
        DuplicateInitError, MixedKeyKindsError, InvalidArgumentError
        """
        self._check_usable()
        if sparse_call(key, value, "init"):
            return self._init_rows(key, value)
        return self._init_dense(key, value, "init")

    def _init_dense(self, key: Key | list[Key], value: Any, what: str) -> Waitable:
        """``init`` of dense keys (``what``: the call, which the errors name)."""
        items = []
        origins: dict[Key, Origin] = {}
        for k, values in pairs(key, value, what):
            if len(values) != 1:
                raise InvalidArgumentError(
                    f"{what} key {k!r}: takes one value per key, got {len(values)}"
                )
            check_dense(values[0], f"{what} key {k!r}")
            array, origins[k] = read(values[0], k, f"{what} value")
            check_numeric(array.dtype, k, f"{what} value")
            items.append((k, self._placed(array)))
        backend = self._backend

        def new_entry(k: Key, array: Array) -> Entry:
            entry = backend.new_entry(k, array)
            entry.origin = origins[k]
            return entry

        entries = self._keys.add(items, new_entry, what)
        arrays = [array for _, array in items]
        return self._forget_if_refused(entries, self._backend.init(entries, arrays))

    def _init_rows(self, key: Key | list[Key], value: Any) -> Waitable:
        """``init`` of row-sparse keys: each stores the rows its value lists."""
        backend = self._backend
        items = [(k, init_rows(k, values)) for k, values in pairs(key, value, "init")]

        def new_entry(k: Key, rows: RowSparseArray) -> Entry:
            return backend.new_row_entry(k, rows.shape, rows.dtype)

        entries = self._keys.add(items, new_entry, "init")
        return self._forget_if_refused(
            entries, backend.init_rows(entries, [rows for _, rows in items])
        )

    def _forget_if_refused(self, entries: list[Entry], init: Waitable) -> Waitable:
        """``init``'s keys are forgotten if it fails (a dist store's servers refuse a value
        of another shape, dtype or kind than rank 0's, after the call returned): the keys
        may be initialized again, and no later call takes the refused shape for theirs."""

        def forget(done: Waitable) -> None:
            error = done.exception()
            if error is not None:
                self._keys.discard(entries, f"{type(error).__name__}: {error}")
            for entry in entries:
                entry.init = None  # the task holds its arguments (the init's copies)

        for entry in entries:
            entry.init = init  # read by a new init of the key until forget() has run
        init.on_done(forget)
        return init

    def push(self, key: Key | list[Key], value: Any, priority: int = 0) -> Waitable:
        """Push values; the values given for one key (a list, or a repeated key) are summed.

        With an updater, ``updater(key, summed, stored)`` changes the stored value in place;
        without one, the stored value becomes the sum. The values are read before this
        returns. Higher ``priority`` work starts first when work piles up.

        Raises
        ------
        KeyNotInitializedError, ShapeMismatchError, DTypeMismatchError,
        MixedKeyKindsError, InvalidArgumentError
        """
        self._check_usable()
        if type(priority) is not int:
            priority = check_priority(priority, "push")
        if (
            type(value) is np.ndarray
            and (type(key) is int or type(key) is str)
            and self._compression is None
        ):
            entry = self._keys.get(key, "push to")  # the common call, kept cheap
            if (
                value.shape != entry.shape
                or value.dtype is not entry.dtype
                or entry.rows is not None
            ):
                dense_only(entry, "push to")
                entry.check(value, "push to")
            taken = self._backend.push([(entry, [value])], priority, self._caller_waits)
            self._pushed = True  # (once taken: a refused push leaves compression settable)
            return taken
        if sparse_call(key, value, "push to"):
            pushes = row_pushes(self._keys, key, value, copy=not self._backend.stages_rows)
            if self._compression is not None:
                raise CompressionError(
                    f"push to key {pushes[0][0].key!r}: gradient compression takes dense "
                    "values only (as MXNet); push row-sparse keys from a store without it"
                )
            taken = self._backend.push_rows(pushes, priority)
            self._pushed = True
            return taken
        values = self._compressed(self._values(group(key, value, "push")))
        taken = self._backend.push(values, priority, self._caller_waits)
        self._pushed = True
        return taken

    def set_gradient_compression(self, compression_params: Mapping[str, Any]) -> None:
        """Compress every later push: ``{"type": "2bit" | "1bit", "threshold": t}``
        (:mod:`akv.compression`: MXNet 1.9's 2bit and MXNet 2.0's 1bit, with a residual per
        key and sender). A distributed store's workers send compressed values and the
        servers decode them (pulls stay dense); a local store compresses and decodes each
        value of a pushed list (one residual per list position, as MXNet keeps one per
        device). float32 values only; ``pushpull`` is compressed too.

        Raises
        ------
        CompressionError
            Bad parameters, or a push happened already (as MXNet, it must be set first).
        """
        self._check_usable()
        compression = parse_compression(compression_params)
        if self._pushed:
            raise CompressionError(
                "set_gradient_compression must come before the first push (a residual "
                "starts with the first push of each key)"
            )
        self._compression = compression
        if not self._backend.set_compression(compression):
            self._residuals = Residuals(compression)

    def _compressed(self, values: KeyArrays) -> KeyArrays:
        """``values`` as a compressed push delivers them (checked: float32 keys); in a local
        store each value encoded and decoded here, at the call, in call order."""
        compression = self._compression
        if compression is None:
            return values
        for entry, _ in values:
            compression.check_key(entry.key, entry.dtype)
        residuals = self._residuals
        if residuals is None:
            return values  # the backend sends them compressed
        return [
            (entry, [residuals.round_trip(entry.key, slot, a) for slot, a in enumerate(arrays)])
            for entry, arrays in values
        ]

    def pull(self, key: Key | list[Key], out: Any = None, priority: int = 0) -> Waitable:
        """Copy each key's value into ``out`` (an array, or a list of arrays that all get it).

        Without ``out``, new arrays are made, of the kind each key was initialized with (a
        torch tensor on the same device for a torch key, a JAX array for a JAX key, else
        NumPy or CuPy); the awaitable's result is ``out`` (or those new arrays, shaped as
        ``key``). Outputs are written in place (a torch tensor keeps its storage). A pull
        sees every push issued before it.

        Raises
        ------
        KeyNotInitializedError, ShapeMismatchError, DTypeMismatchError,
        MixedKeyKindsError, InvalidArgumentError, StorageTypeError (a row-sparse key: use
        :meth:`row_sparse_pull`; or a row-sparse ``out``)
        """
        self._check_usable()
        if type(priority) is not int:
            priority = check_priority(priority, "pull")
        if out is not None:
            if (
                type(out) is np.ndarray
                and (type(key) is int or type(key) is str)
                and out.flags.writeable
                and out.flags.c_contiguous  # (others are checked: see write_view)
            ):
                entry = self._keys.get(key, "pull from")  # the common call, kept cheap
                if (
                    out.shape != entry.shape
                    or out.dtype is not entry.dtype
                    or entry.rows is not None
                ):
                    dense_only(entry, "pull from")
                    entry.check(out, "pull into")
                return self._backend.pull([(entry, [out])], out, priority)
            targets = self._targets(key, out)
            return self._backend.pull(targets, out, priority)
        keys = key if isinstance(key, (list, tuple)) else [key]
        one = keys is not key
        made = [self._new_output(k) for k in keys]
        result = made[0][0] if one else [obj for obj, _, _ in made]
        targets = self._targets(key, made[0][1] if one else [view for _, view, _ in made])
        task = self._backend.pull(targets, result, priority)
        finish = finisher([origin for _, _, origin in made], one)
        return task if finish is None else then(task, finish)

    def pushpull(
        self, key: Key | list[Key], value: Any, out: Any = None, priority: int = 0
    ) -> Waitable:
        """Push ``value``, then pull the result into ``out`` (into ``value`` when omitted)."""
        self._check_usable()
        if type(priority) is not int:
            priority = check_priority(priority, "pushpull")
        no_row_pushpull(self._keys, key)
        values = self._values(group(key, value, "pushpull"))
        result = value if out is None else out
        targets = self._targets(key, result)  # (checked before compression changes residuals)
        values = self._compressed(values)
        taken = self._backend.pushpull(values, targets, result, priority, self._caller_waits)
        self._pushed = True
        return taken

    def row_sparse_pull(
        self,
        key: Key | list[Key],
        out: Any = None,
        priority: int = 0,
        row_ids: Any = None,
    ) -> Waitable:
        """Copy the rows ``row_ids`` of row-sparse keys (sorted, unique; rows never stored
        read as zeros) into ``out`` (an :class:`~akv.RowSparseArray` per key, filled in
        place), or into new ones that are the awaitable's result. ``key`` and ``row_ids``
        pair as in MXNet: one key and one array of ids, lists of both, or one key with a
        list of id arrays (and as many outputs). A pull sees every push issued before it.

        Raises
        ------
        KeyNotInitializedError, StorageTypeError (a dense key, or a dense ``out``),
        RowIdError, ShapeMismatchError, DTypeMismatchError, InvalidArgumentError
        """
        self._check_usable()
        if type(priority) is not int:
            priority = check_priority(priority, "row_sparse_pull")
        pulls, result = row_pulls(self._keys, key, out, row_ids)
        return self._backend.pull_rows(pulls, result, priority)

    def broadcast(
        self, key: Key | list[Key], value: Any, out: Any = None, priority: int = 0
    ) -> Waitable:
        """Initialize ``key`` with ``value`` and pull it into ``out`` (MXNet: init + pull).

        Like ``init``, it can be called once per key. Dense values only: a row-sparse key
        is initialized with ``init`` and read with ``row_sparse_pull``.
        """
        if sparse_call(key, value, "broadcast"):
            raise StorageTypeError(
                f"broadcast key {key!r}: the value is row-sparse; init the key, then read its "
                "rows with row_sparse_pull(key, row_ids=...)"
            )
        self._check_usable()
        self._init_dense(key, value, "broadcast")
        return self.pull(key, out, priority)

    def is_capable(self, capability: str) -> bool:
        """Whether the store has ``capability``: ``"optimizer"`` (``KVStoreBase.OPTIMIZER``)
        is True for every akv store.

        Raises
        ------
        CapabilityError
            A capability akv does not know.
        """
        check_capability(capability, self.type)
        return True

    def set_updater(self, updater: Updater | None) -> None:
        """Use ``updater(key, recv, stored)`` for later pushes; it must change ``stored`` in place.

        ``key`` is passed as the caller gave it (str keys stay str). ``recv`` is a buffer
        the store reuses: valid only during the call. ``None`` restores plain assignment.
        An exception raised by the updater reaches the caller of the push. Distributed
        stores refuse it (their servers apply updates: use :meth:`set_optimizer`).
        """
        self._check_usable()
        if updater is not None and not callable(updater):
            raise InvalidArgumentError(f"updater must be callable, got {type(updater).__name__}")
        self._backend.set_updater(updater)
        self._updates_on_push = updater is not None

    def set_optimizer(self, optimizer: _optimizer.Optimizer) -> Waitable:
        """Apply ``optimizer`` to later pushes where the weights live.

        Locally, in this store; in a distributed store, on the servers, which receive its
        name and hyper-parameters (JSON, never a pickle) and keep the per-key state.
        """
        self._check_usable()
        if not isinstance(optimizer, _optimizer.Optimizer):
            raise InvalidArgumentError(
                f"set_optimizer takes an akv.optimizer.Optimizer, got {type(optimizer).__name__}"
            )
        done = self._backend.set_optimizer(optimizer, self._keys.entries())
        self._updates_on_push = True  # once asked (a refusal by the servers comes later)
        return done

    def save_optimizer_states(
        self, fname: str | os.PathLike[str], dump_optimizer: bool = False
    ) -> Waitable:
        """Write the optimizer's per-key state (and, if asked, its configuration) to a file.

        The file (see ``docs/optimizer.md``) holds no pickle; it is written once every push
        issued before the call has been applied. In a distributed store the servers' states
        are gathered into the same format (MXNet cannot save them at all).
        """
        self._check_usable()
        return self._backend.save_states(self._keys.entries(), Path(fname), dump_optimizer)

    def load_optimizer_states(self, fname: str | os.PathLike[str]) -> Waitable:
        """Load states saved by :meth:`save_optimizer_states` (after earlier pushes).

        Raises
        ------
        StateFormatError
            (from the awaitable) when the file is not akv's format or does not fit.
        """
        self._check_usable()
        return self._backend.load_states(self._keys.entries(), Path(fname))

    def placement(
        self, key: Key | list[Key] | None = None
    ) -> dict[Key, list[tuple[int, int, int]]]:
        """Where keys live: ``{key: [(server rank, first element, end element), ...]}``.

        A key below the big-array bound has one part; a bigger one a part on every server.
        """
        if key is None:
            entries = self._keys.entries()
        else:
            keys = key if isinstance(key, (list, tuple)) else [key]
            entries = [self._keys.get(normalize_key(k), "placement of") for k in keys]
        return {entry.key: entry.layout()[1] for entry in entries}

    def barrier(self) -> Waitable:
        """Wait for every worker to reach the barrier (at once in a local store).

        A distributed store first waits for the answers of this worker's pushes already
        sent, so that after the barrier every worker's sent pushes have reached the servers
        (applied, in dist_async). It waits for no other call: a push queued behind an
        unawaited call of its key (a pull, say) is sent once that call is done, maybe
        after the barrier (await that call, or :meth:`wait_all`, first).
        """
        self._check_usable()
        return self._backend.barrier()

    def wait_all(self) -> Waitable:
        """Wait for every call made on this store before this one (MXNet: ``mx.nd.waitall()``).

        It completes once each of those calls has, as if every call's own awaitable were
        awaited: the way to wait for many calls issued without awaiting them, with no list
        of awaitables and no ``asyncio.gather`` (which costs more per awaitable than a
        small local call does). It raises the first failure among those calls that no wait
        has raised yet, noting how many others failed; each failure is raised once. In a
        distributed store a pipelined push counts once its request is sent: an error a
        server reports about it later is raised by the next call on its key, by
        :meth:`barrier` and by :meth:`close`.
        """
        self._check_usable()
        return self._engine.wait_all()

    def set_barrier_before_exit(self, barrier_before_exit: bool = True) -> None:
        """Whether ``close()`` waits for every worker first (default True; local: no-op)."""
        self._barrier_before_exit = bool(barrier_before_exit)

    def close(self) -> asyncio.Future[None]:
        """Stop taking calls, finish the work in flight, release the engine.

        Returns a future of the close, scheduled once; awaiting it raises the first failure
        of work nobody awaited. Calling it again waits for the same close. Cancelling a wait
        (``asyncio.wait_for(kv.close(), t)`` timing out) leaves the close going on: a later
        ``close()`` waits for it (it raised ``CancelledError`` for ever).
        """
        self._check_reentry()
        broken = self._backend.broken
        if self._closing is None and isinstance(broken, ClosedError):
            self._closed = True  # (its loop has closed: nothing is left to say goodbye with)
            raise broken
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shutdown(None))
            self._closed = True
        return asyncio.shield(self._closing)

    def _leave_failed(self, exc: BaseException) -> asyncio.Future[None]:
        """Close because the caller's code failed with ``exc`` while the store was open.

        A distributed store skips the exit barrier, tells the scheduler at once that this
        worker failed (``exc``'s type and message, :func:`akv.exits.describe`), so that
        the job fails within seconds naming it, and fails its own work in flight instead of
        waiting for it. Also when a clean :meth:`close` is under way (Ctrl-C while it
        waits at the barrier): that close then ends too. Returns the closing future.
        """
        reason = describe(exc)
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._shutdown(reason))
        else:
            self._abandoning = asyncio.ensure_future(self._backend.abandon(reason))
        return self._closing

    async def __aenter__(self) -> AsyncKVStore:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """A clean exit closes (with the exit barrier); an exception (a cancellation
        too) leaves as :meth:`_leave_failed` says, and it is that exception which
        propagates, never an error of the work the leaving failed."""
        if exc is None:
            await self.close()
            return
        # The work in flight failed because this worker left: ``exc`` says why.
        with contextlib.suppress(AKVError, asyncio.CancelledError):
            await self._leave_failed(exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._keys)} keys"
        return f"<{type(self).__name__} {self._type!r} rank={self.rank} {state}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise not_copyable(self)

    def __copy__(self) -> AsyncKVStore:
        return shallow_copy(self)

    # ---------------------------------------------------------------- internals

    async def _shutdown(self, failure: str | None) -> None:
        self._closed = True
        try:
            if failure is not None:
                await self._backend.abandon(failure)
            await self._engine.wait_all()
        finally:
            try:
                barrier = self._barrier_before_exit and failure is None
                await self._backend.close(barrier)
            finally:
                await self._engine.aclose()
                if self._holds_sigterm:
                    self._holds_sigterm = False
                    sigterm_released()

    def _check_reentry(self) -> None:
        """Refuse a call from inside this store's own updater (it would wait for itself)."""
        if GUARD.store is self:
            raise ReentrantCallError(
                "a store method was called from inside that store's updater; the updater "
                "must only change `stored` in place"
            )

    def _check_usable(self) -> None:
        self._check_reentry()
        NOTED_EXIT.exit = None  # the program went on: a sys.exit it noted was caught
        if self._closed:
            raise ClosedError(f"the {self._type!r} store is closed")
        if self._backend.broken is not None:
            raise self._backend.broken

    def _values(self, grouped: dict[Key, list[Any]]) -> KeyArrays:
        """Check every pushed value against its key (nothing is scheduled before this)."""
        table = self._keys
        checked = []
        for key, values in grouped.items():
            entry = table.get(key, "push to")
            dense_only(entry, "push to")
            arrays = []
            for value in values:
                if type(value) is np.ndarray:  # the common case, kept cheap
                    entry.check(value, "push to")
                    arrays.append(value)
                    continue
                check_dense(value, f"push to key {key!r}")
                array = read(value, key, "push value")[0]
                entry.check(array, "push to")
                arrays.append(self._placed(array))
            checked.append((entry, arrays))
        return checked

    def _placed(self, array: Array) -> Array:
        """``array``, copied to the host when it is on a GPU and the backend holds host values."""
        if is_gpu(array) and not self._backend.keeps_gpu_arrays:
            return to_host(array)
        return array

    def _targets(self, key: Any, out: Any) -> KeyArrays:
        """Check the pull outputs: writable views of them, grouped by key."""
        table = self._keys
        targets = []
        for k, outs in group(key, out, "pull").items():
            entry = table.get(k, "pull from")
            dense_only(entry, "pull from")
            arrays = []
            for o in outs:
                no_row_sparse_out(entry, o)
                plain = type(o) is np.ndarray and o.flags.writeable and o.flags.c_contiguous
                array = o if plain else write_view(o, k)
                entry.check(array, "pull into")
                arrays.append(array)
            targets.append((entry, arrays))
        return targets

    def _new_output(self, key: Any) -> tuple[object, Array, Origin]:
        """A new output for ``key``, of the kind of its first value: the object, a writable
        view of it, and the key's origin."""
        entry = self._keys.get(normalize_key(key), "pull from")
        dense_only(entry, "pull from")
        obj, view = entry.origin.new(entry.shape, entry.dtype)
        return obj, view, entry.origin
