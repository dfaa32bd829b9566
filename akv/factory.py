"""Opening a store: :func:`create` (blocking) and :func:`create_async`, from a store type
name, its options and, for the distributed types, the job the environment describes."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal, overload

from akv import limits
from akv.cluster.config import Config, from_env
from akv.custom import KVStoreBase
from akv.errors import InvalidArgumentError, RoleError
from akv.exits import close_at_exit, sigterm_raises
from akv.kinds import StoreType, check_options, env_int, store_type
from akv.store import AsyncKVStore, KVStore
from akv_engine import LoopThread

__all__ = ["create", "create_async"]


def _custom(name: object) -> type[KVStoreBase] | None:
    """The custom store registered under ``name`` (any case), if any."""
    return KVStoreBase.kv_registry.get(name.lower()) if isinstance(name, str) else None


def _dist_config(
    kind: StoreType, environ: object, blocking: bool, staleness: int | None = None
) -> Config | None:
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
        if kind.mode != "dist_async" and config.staleness is not None:
            raise InvalidArgumentError(
                f"AKV_STALENESS bounds dist_async's pushes; {kind.name!r} is not a dist_async "
                "store (unset it)"
            )
        return config if staleness is None else replace(config, staleness=staleness)
    command = "akv-server" if config.role == "server" else "akv-scheduler"
    if not blocking:
        raise RoleError(
            f"create_async({kind.name!r}) was called in a process whose role is "
            f"{config.role} (DMLC_ROLE/AKV_ROLE): run `{command}` for that role, or use "
            "the blocking akv.create, which serves the role and exits"
        )
    from akv.cluster.roles import serve_role
    from akv.cluster.scheduler.service import run_scheduler
    from akv.cluster.server.command import run_server

    sys.exit(
        serve_role(config.role, config, run_server if config.role == "server" else run_scheduler)
    )


async def create_async(name: str = "local", **options: Any) -> AsyncKVStore:
    """Create an :class:`AsyncKVStore` bound to the running event loop.

    Parameters
    ----------
    name : str
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

    Other Parameters
    ----------------
    slots : int
        How many engine tasks may run at once (default ``AKV_ENGINE_SLOTS`` for a local
        store, ``AKV_DIST_SLOTS`` requests in flight for a distributed one).
    environ : Mapping[str, str]
        For distributed types, the variables to read instead of ``os.environ`` (to join a
        job from a program that configures itself, or several jobs from one process).
    devices : Sequence[int]
        For the local device stores, the GPUs keys may be placed on (default: every GPU an
        init value came from so far).
    staleness : int
        For ``dist_async``: a worker's push of a key is taken only while that worker is at
        most this many pushes of the key ahead of the slowest worker (so the pushes taken
        lead by at most one more; 0 gives lock-step rounds); else it waits (default
        ``AKV_STALENESS``, else no bound; see ``docs/distributed.md``). Every worker must
        give the same bound.
    inline_max_bytes : int
        Work on at most this many bytes runs on the calling thread, bigger work on the
        engine's worker threads (default ``AKV_INLINE_MAX_BYTES``, 16 MiB). The blocking
        store runs all array work on the calling thread unless this is given.
    """
    if _custom(name) is not None:
        raise InvalidArgumentError(
            f"create_async({name!r}): {name!r} is a custom store, which has the blocking "
            "interface only (akv.KVStoreBase): make it with akv.create"
        )
    kind = store_type(name)
    slots = check_options(kind, options)
    inline = options.get("inline_max_bytes")
    if inline is None:
        inline = env_int("AKV_INLINE_MAX_BYTES", limits.INLINE_MAX_BYTES, 0)
    config = _dist_config(kind, options.get("environ"), False, options.get("staleness"))
    store = await AsyncKVStore._open(kind, slots, inline, config, options.get("devices"))
    # SIGTERM leaves the job as an exception does, telling the scheduler why.
    store._holds_sigterm = config is not None and sigterm_raises()
    return store


#: akv's own store type names (``STORE_TYPES``), for :func:`create`'s return type.
BuiltinName = Literal[
    "local",
    "local_allreduce_cpu",
    "local_update_cpu",
    "local_allreduce_device",
    "device",
    "nccl",
    "dist_sync",
    "dist_async",
    "dist_sync_device",
    "dist_async_device",
    "dist_device_sync",
    "dist_device_async",
]


@overload
def create(name: BuiltinName = "local", **options: Any) -> KVStore: ...


@overload
def create(name: str, **options: Any) -> KVStoreBase: ...


def create(name: str = "local", **options: Any) -> KVStoreBase:
    """Create a blocking :class:`KVStore` (its own event loop runs on a private thread), or
    the custom store registered under ``name`` (:meth:`KVStoreBase.register`, looked up
    first, as MXNet does; made without arguments).

    Takes the same arguments as :func:`create_async`; usable from any thread, also one
    that runs an event loop of its own (Jupyter).

    Raises
    ------
    InvalidArgumentError
        Options given for a custom store.
    """
    custom = _custom(name)
    if custom is not None:
        if options:
            raise InvalidArgumentError(
                f"create({name!r}): a custom store is made without options, got "
                f"{', '.join(sorted(options))}"
            )
        return custom()
    kind = store_type(name)
    slots = check_options(kind, options)
    config = _dist_config(kind, options.get("environ"), True, options.get("staleness"))
    # A worker's network thread: batch scheduling (see Config.sched_batch).
    loop_thread = LoopThread(name="akv-store-loop", batch=config is not None and config.sched_batch)
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
