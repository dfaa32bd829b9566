"""The two faces of a store: :class:`AsyncKVStore` (awaitable) and :class:`KVStore` (blocking).

One implementation: ``AsyncKVStore`` checks every argument, merges pushed values into
staging buffers and hands the work to its backend as engine tasks; ``KVStore`` owns a
private event loop thread, builds an ``AsyncKVStore`` on it, and blocks on each call's task.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from akv import limits
from akv import optimizer as _optimizer
from akv.args import Key, group, normalize_key, pairs
from akv.arrays import Array, Origin, finisher, is_gpu, read, to_host, write_view
from akv.backend import Backend, KeyArrays, Updater
from akv.cluster.config import Config, from_env
from akv.device import DeviceBackend
from akv.errors import (
    AKVError,
    ClosedError,
    InvalidArgumentError,
    ReentrantCallError,
    RoleError,
    WaitTimeoutError,
)
from akv.exits import (
    close_at_exit,
    closed,
    describe,
    second_signal_exits,
    sigterm_raises,
    sigterm_released,
)
from akv.keys import Entry, KeyTable
from akv.kinds import STORE_TYPES, StoreType, check_options, env_int, store_type
from akv.local import GUARD, LocalBackend
from engine import Engine, LoopThread, Waitable, then

__all__ = [
    "STORE_TYPES",
    "AsyncKVStore",
    "KVStore",
    "StoreType",
    "create",
    "create_async",
    "store_type",
]


def _dist_config(kind: StoreType, environ: object, blocking: bool) -> Config | None:
    """The job's configuration for a distributed type.

    As with MXNet's launch scripts, the same command may start every role: in a process
    whose role is server or scheduler, the blocking :func:`create` serves that role and
    exits the process; :func:`create_async` raises :class:`~akv.errors.RoleError` (it
    runs inside the caller's event loop, which it must not end).
    """
    if not kind.distributed:
        return None
    if environ is not None and not isinstance(environ, Mapping):
        raise InvalidArgumentError(f"environ must be a mapping, got {type(environ).__name__}")
    config = from_env(environ)
    if config.role == "worker":
        return config
    command = "akv-server" if config.role == "server" else "akv-scheduler"
    if not blocking:
        raise RoleError(
            f"create_async({kind.name!r}) was called in a process whose role is "
            f"{config.role} (DMLC_ROLE/AKV_ROLE): run `{command}` for that role, or use "
            "the blocking akv.create, which serves the role and exits"
        )
    from akv.cluster.roles import serve_role
    from akv.cluster.scheduler.service import run_scheduler
    from akv.cluster.server.service import run_server

    sys.exit(
        serve_role(config.role, config, run_server if config.role == "server" else run_scheduler)
    )


async def create_async(name: str = "local", **options: Any) -> AsyncKVStore:
    """Create an :class:`AsyncKVStore` bound to the running event loop.

    Parameters
    ----------
    name:
        The store type (see ``STORE_TYPES`` and :func:`store_type`); case-insensitive, and
        reported by ``type`` as given. Unknown names raise
        :class:`~akv.errors.UnknownStoreTypeError` (MXNet silently makes a local store).
        ``local`` and its MXNet variants (``local_allreduce_cpu``, ``local_update_cpu``) keep
        values in host memory (GPU values given to them are copied to the host). ``device``
        (also ``local_allreduce_device``, ``nccl``) keeps keys initialized from GPU arrays
        on GPUs and reduces there, and keys initialized from host arrays as ``local`` does
        (see ``docs/gpu.md``). The ``dist_*`` names join the job the environment describes
        (see ``docs/distributed.md``) and return once every worker and server is
        reachable; their ``_device`` variants reduce GPU values on the GPU first and stage
        them through pinned host memory.
    slots:
        How many engine tasks may run at once (default ``AKV_ENGINE_SLOTS`` for a local
        store, ``AKV_DIST_SLOTS`` requests in flight for a distributed one).
    environ:
        For distributed types, the variables to read instead of ``os.environ`` (to join a
        job from a program that configures itself, or several jobs from one process).
    devices:
        For the local device stores, the GPUs keys may be placed on (default: every GPU an
        init value came from so far).
    inline_max_bytes:
        Work on at most this many bytes runs on the calling thread, bigger work on the
        engine's worker threads (default ``AKV_INLINE_MAX_BYTES``, 16 MiB). The blocking
        store runs all array work on the calling thread unless this is given.
    """
    kind = store_type(name)
    slots = check_options(kind, options)
    inline = options.get("inline_max_bytes")
    if inline is None:
        inline = env_int("AKV_INLINE_MAX_BYTES", limits.INLINE_MAX_BYTES, 0)
    config = _dist_config(kind, options.get("environ"), blocking=False)
    store = await AsyncKVStore._open(kind, slots, inline, config, options.get("devices"))
    # SIGTERM leaves the job as an exception does, telling the scheduler why.
    store._holds_sigterm = config is not None and sigterm_raises()
    return store


def create(name: str = "local", **options: Any) -> KVStore:
    """Create a blocking :class:`KVStore` (its own event loop runs on a private thread).

    Takes the same arguments as :func:`create_async`; usable from any thread, also one
    that runs an event loop of its own (Jupyter).
    """
    kind = store_type(name)
    slots = check_options(kind, options)
    config = _dist_config(kind, options.get("environ"), blocking=True)
    loop_thread = LoopThread(name="akv-store-loop")
    try:
        # The blocking face runs array work inline on the calling thread: it waits anyway.
        inline = options.get("inline_max_bytes")
        inner = loop_thread.run(
            AsyncKVStore._open(
                kind, slots, inline, config, options.get("devices"), caller_waits=True
            )
        )
    except BaseException:
        loop_thread.close()
        raise
    store = KVStore(inner, loop_thread)
    if config is not None:
        # SIGTERM leaves the job as an exception does, telling the scheduler why; a store
        # the program never closes is closed at exit (as MXNet's destructor does).
        store._holds_sigterm = sigterm_raises()
        close_at_exit(store)
    return store


class AsyncKVStore:
    """A key-value store for asyncio programs (create it with :func:`akv.create_async`).

    Every method that does work schedules it before returning and returns an awaitable
    (an :class:`engine.Waitable`); per key, work happens in call order whether or not the
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
        if config is None and kind.device:
            self._backend = DeviceBackend(self._engine, self, inline_max_bytes, devices)
        elif config is None:
            self._backend = LocalBackend(self._engine, self, inline_max_bytes)
        else:
            from akv.cluster.worker.backend import DistBackend

            self._backend = DistBackend(self._engine, kind.mode, config, device=kind.device)
            try:
                await self._backend.connect()
            except BaseException:
                await self._backend.close(barrier_before_exit=False)
                await self._engine.aclose()
                raise
        return self

    # ---------------------------------------------------------------- properties

    @property
    def type(self) -> str:
        """The store type name as it was given to ``create`` (MXNet reports it so too)."""
        return self._type

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
        items = []
        origins: dict[Key, Origin] = {}
        for k, values in pairs(key, value, "init"):
            if len(values) != 1:
                raise InvalidArgumentError(
                    f"init key {k!r}: takes one value per key, got {len(values)}"
                )
            array, origins[k] = read(values[0], k, "init value")
            items.append((k, self._placed(array)))
        backend = self._backend

        def new_entry(k: Key, array: Array) -> Entry:
            entry = backend.new_entry(k, array)
            entry.origin = origins[k]
            return entry

        entries = self._keys.add(items, new_entry)
        arrays = [array for _, array in items]
        return self._backend.init(entries, arrays)

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
        if type(value) is np.ndarray and (type(key) is int or type(key) is str):
            entry = self._keys.get(key, "push to")  # the common call, kept cheap
            if value.shape != entry.shape or value.dtype is not entry.dtype:
                entry.check(value, "push to")
            return self._backend.push([(entry, [value])], priority, self._caller_waits)
        values = self._values(group(key, value, "push"))
        return self._backend.push(values, priority, self._caller_waits)

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
        MixedKeyKindsError, InvalidArgumentError
        """
        self._check_usable()
        if out is not None:
            if (
                type(out) is np.ndarray
                and (type(key) is int or type(key) is str)
                and out.flags.writeable
            ):
                entry = self._keys.get(key, "pull from")  # the common call, kept cheap
                if out.shape != entry.shape or out.dtype is not entry.dtype:
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
        values = self._values(group(key, value, "pushpull"))
        result = value if out is None else out
        targets = self._targets(key, result)
        return self._backend.pushpull(values, targets, result, priority, self._caller_waits)

    def broadcast(self, key: Key | list[Key], value: Any, out: Any = None) -> Waitable:
        """Initialize ``key`` with ``value`` and pull it into ``out`` (MXNet: init + pull).

        Like ``init``, it can be called once per key.
        """
        self.init(key, value)
        return self.pull(key, out)

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
        return self._backend.set_optimizer(optimizer)

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

        Like MXNet's, it does not wait for pushes and pulls still in flight.
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

        Returns a scheduled future; awaiting it raises the first failure of work nobody
        awaited. Calling it again returns the same future.
        """
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._shutdown(None))
        return self._closing

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

    def _check_usable(self) -> None:
        if GUARD.store is self:
            raise ReentrantCallError(
                "a store method was called from inside that store's updater; the updater "
                "must only change `stored` in place"
            )
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
            arrays = []
            for value in values:
                if type(value) is np.ndarray:  # the common case, kept cheap
                    entry.check(value, "push to")
                    arrays.append(value)
                    continue
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
            arrays = []
            for o in outs:
                array = o if type(o) is np.ndarray and o.flags.writeable else write_view(o, k)
                entry.check(array, "pull into")
                arrays.append(array)
            targets.append((entry, arrays))
        return targets

    def _new_output(self, key: Any) -> tuple[object, Array, Origin]:
        """A new output for ``key``, of the kind of its first value: the object, a writable
        view of it, and the key's origin."""
        entry = self._keys.get(normalize_key(key), "pull from")
        obj, view = entry.origin.new(entry.shape, entry.dtype)
        return obj, view, entry.origin


class KVStore:
    """A blocking key-value store (create it with :func:`akv.create`).

    The same methods and meaning as :class:`AsyncKVStore`; each call returns once its
    work is done. Safe to use from several threads at once and from threads that run
    an event loop of their own. Network work runs on a private event-loop thread (uvloop
    when installed); array work of a local store runs on the calling thread.
    """

    def __init__(self, inner: AsyncKVStore, loop_thread: LoopThread) -> None:
        self._inner = inner
        self._loop_thread = loop_thread
        self._timeout: float | None = None
        #: Pipelined pushes this face returned from without waiting for their tasks
        #: (which only send what the call took); settled by the calls that need them done.
        self._unsettled: collections.deque[Waitable] = collections.deque()
        self._unsettled_lock = threading.Lock()
        #: This store made SIGTERM raise :class:`akv.exits.Terminated` (given back at close).
        self._holds_sigterm = False

    @property
    def type(self) -> str:
        """The store type name as it was given to ``create`` (MXNet reports it so too)."""
        return self._inner.type

    @property
    def rank(self) -> int:
        """This worker's rank (0 in a local store)."""
        return self._inner.rank

    @property
    def num_workers(self) -> int:
        """How many workers share the store (1 in a local store)."""
        return self._inner.num_workers

    @property
    def engine(self) -> Engine:
        """The store's dependency engine."""
        return self._inner.engine

    def keys(self) -> list[Key]:
        """The initialized keys, in initialization order."""
        return self._inner.keys()

    def _wait(self, waitable: Waitable) -> Any:
        try:
            return waitable.result(self._timeout)
        except TimeoutError as exc:
            if isinstance(exc, AKVError):
                raise
            raise WaitTimeoutError(str(exc)) from exc

    def _settle(self) -> None:
        """Wait for the pushes returned from early (raising the first that failed)."""
        while True:
            with self._unsettled_lock:
                if not self._unsettled:
                    return
                waitable = self._unsettled.popleft()
            self._wait(waitable)

    def init(self, key: Key | list[Key], value: Any) -> None:
        """See :meth:`AsyncKVStore.init`."""
        self._settle()
        self._wait(self._inner.init(key, value))

    def push(self, key: Key | list[Key], value: Any, priority: int = 0) -> None:
        """See :meth:`AsyncKVStore.push`.

        In a distributed store (pipelined pushes, the default) this returns once the values
        are taken, without waiting for the loop thread to send them; a failure to send is
        raised by the next call on the key, :meth:`barrier` or :meth:`close`.
        """
        waitable = self._inner.push(key, value, priority)
        if not self._inner._backend.returns_pushes_early or waitable.done():
            self._wait(waitable)
            return
        with self._unsettled_lock:
            unsettled = self._unsettled
            unsettled.append(waitable)
            # Those sent already are forgotten; a failed one stays for the next settle.
            while unsettled and unsettled[0].done() and not unsettled[0].failed():
                unsettled.popleft()
            full = len(unsettled) > limits.MAX_UNACKED_PUSHES
        if full:  # memory stays bounded: wait for the oldest
            self._settle()

    def pull(self, key: Key | list[Key], out: Any = None, priority: int = 0) -> Any:
        """See :meth:`AsyncKVStore.pull`; returns ``out`` (or the new arrays)."""
        return self._wait(self._inner.pull(key, out, priority))

    def pushpull(self, key: Key | list[Key], value: Any, out: Any = None, priority: int = 0) -> Any:
        """See :meth:`AsyncKVStore.pushpull`; returns ``out`` (``value`` when omitted)."""
        return self._wait(self._inner.pushpull(key, value, out, priority))

    def broadcast(self, key: Key | list[Key], value: Any, out: Any = None) -> Any:
        """See :meth:`AsyncKVStore.broadcast`; returns ``out`` (or new arrays)."""
        return self._wait(self._inner.broadcast(key, value, out))

    def set_updater(self, updater: Updater | None) -> None:
        """See :meth:`AsyncKVStore.set_updater`."""
        self._inner.set_updater(updater)

    def set_optimizer(self, optimizer: _optimizer.Optimizer) -> None:
        """See :meth:`AsyncKVStore.set_optimizer`."""
        self._settle()
        self._wait(self._inner.set_optimizer(optimizer))

    def save_optimizer_states(
        self, fname: str | os.PathLike[str], dump_optimizer: bool = False
    ) -> None:
        """See :meth:`AsyncKVStore.save_optimizer_states`."""
        self._settle()
        self._wait(self._inner.save_optimizer_states(fname, dump_optimizer))

    def load_optimizer_states(self, fname: str | os.PathLike[str]) -> None:
        """See :meth:`AsyncKVStore.load_optimizer_states`."""
        self._settle()
        self._wait(self._inner.load_optimizer_states(fname))

    def placement(
        self, key: Key | list[Key] | None = None
    ) -> dict[Key, list[tuple[int, int, int]]]:
        """See :meth:`AsyncKVStore.placement`."""
        return self._inner.placement(key)

    def barrier(self) -> None:
        """See :meth:`AsyncKVStore.barrier`."""
        self._settle()
        self._wait(self._inner.barrier())

    def wait_all(self) -> None:
        """See :meth:`AsyncKVStore.wait_all`. The calls of this face return once done,
        except a distributed store's pipelined pushes, which this waits for too."""
        self._settle()
        self._wait(self._inner.wait_all())

    def set_barrier_before_exit(self, barrier_before_exit: bool = True) -> None:
        """See :meth:`AsyncKVStore.set_barrier_before_exit`."""
        self._inner.set_barrier_before_exit(barrier_before_exit)

    def close(self) -> None:
        """Finish the work in flight, then release the engine and the event loop.

        Raises the first failure of work that no call reported. Idempotent. Interrupted
        (Ctrl-C, SIGTERM) while it waits, say at the exit barrier, it leaves as
        ``__exit__`` does after an exception, then raises the interruption.
        """
        if not self._loop_thread.running:
            return
        try:
            try:
                self._settle()
            finally:
                self._loop_thread.run(_await(self._inner.close), self._timeout)
        except (KeyboardInterrupt, SystemExit) as exc:
            self._leave_failed(exc)
            raise
        finally:
            self._release()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """A clean exit closes (with the exit barrier). After an exception (Ctrl-C and
        SIGTERM included) a distributed store skips the barrier and tells the scheduler
        at once that this worker failed, and why, so that every other process of the job
        fails within seconds naming it; that exception then propagates (an error of the
        work the leaving failed never replaces it). A second Ctrl-C or SIGTERM meanwhile
        ends the process at once."""
        if exc is None:
            self.close()
        else:
            self._leave_failed(exc)

    def _leave_failed(self, exc: BaseException) -> None:
        """:meth:`AsyncKVStore._leave_failed`, waited for (bounded), then release."""
        if not self._loop_thread.running:
            return
        try:
            with second_signal_exits(), contextlib.suppress(AKVError, TimeoutError):
                self._loop_thread.run(
                    _await(lambda: self._inner._leave_failed(exc)), limits.LEAVE_FAILED_S
                )
        finally:
            self._release()

    def _release(self) -> None:
        closed(self)
        self._loop_thread.close()
        if self._holds_sigterm:
            self._holds_sigterm = False
            sigterm_released()

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncKVStore", "KVStore", 1)


async def _await(make: Callable[[], Any]) -> Any:
    return await make()
