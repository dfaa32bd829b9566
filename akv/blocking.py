"""The blocking face of a store: :class:`KVStore`, a thin face over
:class:`~akv.store.AsyncKVStore` (one implementation behind both) that runs each call on
the store's private event-loop thread and blocks until its work is done."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from akv import limits
from akv import optimizer as _optimizer
from akv.args import Key
from akv.backend import Updater
from akv.custom import KVStoreBase
from akv.errors import AKVError, InvalidArgumentError, WaitTimeoutError
from akv.exits import Terminated, closed, describe, second_signal_exits, sigterm_released
from akv_engine import Engine, LoopThread, Waitable

if TYPE_CHECKING:
    from akv.store import AsyncKVStore

__all__ = ["KVStore"]


class KVStore(KVStoreBase):
    """A blocking key-value store (create it with :func:`akv.create`); an
    :class:`akv.KVStoreBase`, with the optimizer capability.

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
    def updates_on_push(self) -> bool:
        """See :attr:`AsyncKVStore.updates_on_push`."""
        return self._inner.updates_on_push

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

    def row_sparse_pull(
        self, key: Key | list[Key], out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> Any:
        """See :meth:`AsyncKVStore.row_sparse_pull`; returns ``out`` (or new
        :class:`~akv.RowSparseArray` objects)."""
        return self._wait(self._inner.row_sparse_pull(key, out, priority, row_ids))

    def broadcast(
        self, key: Key | list[Key], value: Any, out: Any = None, priority: int = 0
    ) -> Any:
        """See :meth:`AsyncKVStore.broadcast`; returns ``out`` (or new arrays)."""
        return self._wait(self._inner.broadcast(key, value, out, priority))

    def is_capable(self, capability: str) -> bool:
        """See :meth:`AsyncKVStore.is_capable`."""
        return self._inner.is_capable(capability)

    def set_updater(self, updater: Updater | None) -> None:
        """See :meth:`AsyncKVStore.set_updater`."""
        self._inner.set_updater(updater)

    def set_gradient_compression(self, compression_params: Mapping[str, Any]) -> None:
        """See :meth:`AsyncKVStore.set_gradient_compression`."""
        self._inner.set_gradient_compression(compression_params)

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
        self._inner._check_reentry()  # (the close itself runs on the loop's thread)
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
            with second_signal_exits() as exits, contextlib.suppress(AKVError, TimeoutError):
                signalled = isinstance(exc, (KeyboardInterrupt, Terminated))
                if exits and signalled and self.type.startswith("dist"):
                    # The leaving may wait (bounded) for the scheduler: say so, and how
                    # to cut it short.
                    logging.getLogger("akv").warning(
                        "akv: worker %d leaves the job: %s; a second Ctrl-C or SIGTERM "
                        "ends it at once",
                        self.rank,
                        describe(exc),
                    )
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise not_copyable(self)

    def __copy__(self) -> KVStore:
        return shallow_copy(self)


def not_copyable(store: object) -> InvalidArgumentError:
    """The error of pickling or deep-copying a store (both faces refuse it: ``pickle``,
    ``copy.deepcopy``; ``copy.copy`` shares the store, as it always did)."""
    return InvalidArgumentError(
        f"{store!r} cannot be pickled or deep-copied: a store is a live connection (its "
        "event loop, threads and, in a distributed store, its streams to the servers). "
        "Create a store in each process with akv.create(type)"
    )


_T = TypeVar("_T")


def shallow_copy(value: _T) -> _T:
    """``copy.copy`` of an object whose ``__reduce_ex__`` refuses: a new object sharing
    the attributes' values."""
    copied = object.__new__(type(value))
    copied.__dict__.update(value.__dict__)
    return copied


async def _await(make: Callable[[], Any]) -> Any:
    return await make()
