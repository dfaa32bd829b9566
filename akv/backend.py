"""What a store's backend does: the one seam between the store faces and where values live.

:class:`~akv.store.AsyncKVStore` checks every argument, then hands checked work to its
backend, which schedules it as engine tasks on the keys' vars and returns them. The local
backend (:mod:`akv.local`) holds values in this process; the distributed one
(:mod:`akv.cluster.worker`) sends them to the job's servers. A new store type (a GPU store,
say) is a new class that satisfies :class:`Backend`, chosen in :mod:`akv.store`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.arrays import is_gpu, record_on_callers
from akv.compression import Compression
from akv.errors import AKVError
from akv.keys import Entry
from akv.sparse import RowIds, RowSparseArray
from akv_engine import Waitable

__all__ = ["Backend", "KeyArrays", "Updater", "caller_events"]

#: ``updater(key, received, stored)``: changes ``stored`` in place.
Updater = Callable[[Key, np.ndarray, np.ndarray], None]
#: Each key's entry with the arrays given for it (pushed values, or pull outputs).
KeyArrays = list[tuple[Entry, list[np.ndarray]]]


class Backend(Protocol):
    """The work behind one store.

    Every method that returns a :class:`~akv_engine.Waitable` (an engine task, or several
    gathered) has scheduled its work on the keys' vars before it returns, so that per key
    the work keeps call order. Values are checked by the store first: shapes and dtypes
    match their keys, keys exist. ``borrow`` means the caller waits for the task, so its
    arrays may be read while the task runs instead of being copied first.
    """

    #: This worker's rank and how many workers share the store.
    @property
    def rank(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def broken(self) -> AKVError | None:
        """The error that broke the store (every later call raises it), or None."""
        ...

    #: Whether values given on a GPU are handed over as they are (the backend moves them
    #: itself); when False the store copies them to the host first.
    keeps_gpu_arrays: bool

    #: Whether a push's task only sends values it took at the call (pipelined): the
    #: blocking face then returns without waiting for it, and errors surface at the next
    #: call on the key, ``barrier()`` or ``close()``.
    returns_pushes_early: bool

    #: Whether ``push_rows`` copies at the call what it keeps of the rows (into memory it
    #: sends from): the store then hands it a single pushed value as given, uncopied.
    stages_rows: bool

    def new_entry(self, key: Key, array: np.ndarray) -> Entry:
        """A new key's entry (its var, and where its parts live), for a value like ``array``."""
        ...

    def set_compression(self, compression: Compression) -> bool:
        """Compress the pushes this backend sends from now on (:mod:`akv.compression`);
        False when it sends none (a local store: the store then encodes and decodes each
        pushed value itself, at the call)."""
        ...

    def new_row_entry(self, key: Key, shape: tuple[int, ...], dtype: np.dtype) -> Entry:
        """A new row-sparse key's entry (``entry.rows`` set: where a local store keeps its
        rows; a distributed store's stays empty, its parts are row ranges).

        Raises
        ------
        InvalidArgumentError, UnsupportedDTypeError
        """
        ...

    def set_updater(self, updater: Updater | None) -> None:
        """Use ``updater`` for later pushes (None: assignment)."""
        ...

    def set_optimizer(self, optimizer: _optimizer.Optimizer, entries: list[Entry]) -> Waitable:
        """Apply ``optimizer`` to the pushes issued from now on, where the weights live
        (ordered after the earlier calls on ``entries``, every key of the store)."""
        ...

    def init(self, entries: list[Entry], arrays: list[np.ndarray]) -> Waitable:
        """Store the first value of each new key."""
        ...

    def push(self, values: KeyArrays, priority: int, borrow: bool) -> Waitable:
        """Sum each key's values and apply the sum."""
        ...

    def pull(self, targets: KeyArrays, result: object, priority: int) -> Waitable:
        """Copy each key's value into its outputs; the task's result is ``result``."""
        ...

    def pushpull(
        self,
        values: KeyArrays,
        targets: KeyArrays,
        result: object,
        priority: int,
        borrow: bool,
    ) -> Waitable:
        """A push, then a pull that sees it."""
        ...

    def init_rows(self, entries: list[Entry], values: list[RowSparseArray]) -> Waitable:
        """Store the first rows of each new row-sparse key (``entry.rows`` is set).

        Raises
        ------
        StorageTypeError
            The backend holds no row-sparse keys.
        """
        ...

    def push_rows(self, values: list[tuple[Entry, RowSparseArray]], priority: int) -> Waitable:
        """Apply each row-sparse key's summed push (see :mod:`akv.local_rows`)."""
        ...

    def pull_rows(
        self, pulls: list[tuple[Entry, RowIds, RowSparseArray]], result: object, priority: int
    ) -> Waitable:
        """Fill each array with its key's requested rows; the task's result is ``result``."""
        ...

    def barrier(self) -> Waitable:
        """Wait for every worker."""
        ...

    def save_states(self, entries: list[Entry], path: Path, dump_optimizer: bool) -> Waitable:
        """Write the optimizer's states after earlier pushes."""
        ...

    def load_states(self, entries: list[Entry], path: Path) -> Waitable:
        """Load optimizer states after earlier pushes and before later ones."""
        ...

    async def abandon(self, reason: str) -> None:
        """The caller's code failed with the store open (``reason``: why, one line): tell
        the peers at once and fail the work in flight instead of waiting for it.
        :meth:`close` (without the barrier) follows."""
        ...

    async def close(self, barrier_before_exit: bool) -> None:
        """Leave: release what the backend holds (peers, threads)."""
        ...


_NO_EVENTS: list[Any] = []


def caller_events(targets: KeyArrays) -> list[Any]:
    """Events recorded now on the caller's current streams of the GPUs that pull outputs
    live on; a backend writes GPU outputs after them (its copy may run on another thread,
    whose current stream is not the caller's). Host outputs cost a type check each."""
    for _, outs in targets:
        for out in outs:
            if type(out) is not np.ndarray and is_gpu(out):
                return record_on_callers(o for _, os in targets for o in os)
    return _NO_EVENTS
