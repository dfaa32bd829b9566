"""The updater: the callable a key-value store applies to each pushed gradient."""

from __future__ import annotations

import math
from typing import BinaryIO, Literal

import numpy as np

from akv.arrays import copy_into, is_cupy
from akv.errors import InvalidArgumentError, OptimizerError, StateFormatError
from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    from_config,
)
from akv.optimizer._kernels import (
    check_update_arrays,
    is_array,
    zeros_like,
)
from akv.optimizer._states import RowStates, StoredRows, decode_states, encode_states
from akv.rows import RowTable
from akv.sparse import RowSparseArray

__all__ = ["Updater", "get_updater", "keeps_states"]


class Updater:
    """Apply an optimizer to weights identified by index, keeping one state per index.

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer; :meth:`load_states` may replace it.

    Attributes
    ----------
    optimizer : Optimizer
    states : dict
        Index to state, created on an index's first update.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise InvalidArgumentError(
                f"Updater needs an akv Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.states: dict[Index, State] = {}
        #: Row-sparse keys' states: one row table per array of the state's structure.
        self.row_states: dict[Index, list[RowTable]] = {}
        # Loaded states not yet compared with their weight (the weight is only known at
        # the index's next update).
        self._unchecked: set[Index] = set()
        # Loaded row states not yet compared with the optimizer's (made ones fit it).
        self._unchecked_rows: set[Index] = set()

    def __call__(self, index: Index, grad: np.ndarray, weight: np.ndarray) -> None:
        """Apply ``grad`` to ``weight`` in place.

        On the first update of ``index`` its state is created from ``weight`` (with a
        float32 master copy for float16 weights under ``multi_precision``). ``grad`` is not
        modified. The index is used exactly as given (``int`` or ``str``).

        Raises
        ------
        InvalidArgumentError
            ``index`` is neither an int nor a str, or ``weight`` is not a writeable
            floating-point array.
        ShapeMismatchError, DTypeMismatchError
            ``grad`` does not match ``weight``.
        StateFormatError
            A state loaded by :meth:`load_states` does not fit ``weight``, or was saved for
            a row-sparse key.
        """
        if isinstance(index, bool) or not isinstance(index, (int, str)):
            raise InvalidArgumentError(f"updater index {index!r} is neither an int nor a str")
        check_update_arrays(index, weight, grad)
        if index in self.row_states:
            raise _other_kind(index, "row-sparse", "dense")
        if index not in self.states:
            self.states[index] = self.optimizer.create_state_multi_precision(index, weight)
        elif index in self._unchecked:
            expected = self.optimizer.create_state_multi_precision(index, weight)
            _check_state_fits(index, self.states[index], expected, "state")
            self.states[index] = _placed_like(self.states[index], expected)
            self._unchecked.discard(index)
        self.optimizer.update_multi_precision(index, weight, grad, self.states[index])

    def reconfigure(
        self, optimizer: Optimizer, weights: dict[Index, np.ndarray | RowTable]
    ) -> None:
        """Apply ``optimizer``, a new configuration of this updater's optimizer, from now
        on, keeping the update counts, the shared state and each index's state where it
        still fits: a state the new configuration makes otherwise (momentum turned on or
        off, say), made for the index's weight in ``weights`` (a row-sparse key's rows: its
        table), is made anew, as for a new index (at once for a dense key; at its next
        update for a row-sparse one), and its update count starts again (Adam's bias
        correction with it); :attr:`Optimizer.num_update` goes on."""
        current = self.optimizer
        optimizer.restore_shared_state(current.shared_state())
        self.optimizer = optimizer
        remade: set[Index] = set()
        for index, state in list(self.states.items()):
            weight = weights.get(index)
            if not is_array(weight):
                continue
            expected = optimizer.create_state_multi_precision(index, weight)
            if _fits(index, state, expected) or (
                # A loaded state that fits neither configuration: its next update says so.
                index in self._unchecked
                and not _fits(index, state, current.create_state_multi_precision(index, weight))
            ):
                continue
            self.states[index] = expected
            self._unchecked.discard(index)
            remade.add(index)
        for index, tables in list(self.row_states.items()):
            table = weights.get(index)
            if not isinstance(table, RowTable):
                continue
            held = [(t.row_shape, t.dtype) for t in tables]
            made = _row_leaves(optimizer, index, table)
            if held == made or (
                index in self._unchecked_rows and held != _row_leaves(current, index, table)
            ):
                continue
            del self.row_states[index]
            self._unchecked_rows.discard(index)
            remade.add(index)
        counts = current.index_update_counts
        kept = {index: count for index, count in counts.items() if index not in remade}
        optimizer.restore_update_counts(kept, current.num_update)

    def update_rows(self, index: Index, table: RowTable, grad: RowSparseArray) -> None:
        """Apply the row-sparse gradient ``grad`` to the rows of ``table`` (a row-sparse
        key's stored rows) with their states, in place.

        With a lazy optimizer (MXNet's ``lazy_update``, the default of SGD and Adam) only
        the gradient's rows change, weight and states; with a standard one every stored
        row does, absent gradient rows counting as zeros (rows never stored stay zero: the
        optimizers akv has keep a zero weight with a zero state at zero, but for Adamax,
        whose dense update divides 0 by 0 there, as MXNet's). A row's state
        starts as ``create_state`` makes it for the row. One update of ``index`` is
        counted.

        Raises
        ------
        OptimizerError, InvalidArgumentError, StateFormatError
            :meth:`check_rows`' refusals (nothing changes).
        """
        optimizer = self.optimizer
        how = self.check_rows(index, table)  # refuses before anything changes
        if how == "lazy":
            ids, grad_rows = grad.indices, grad.data
        else:
            ids = np.union1d(table.ids(), grad.indices)
            grad_rows = np.zeros((len(ids), *table.row_shape), table.dtype)
            grad_rows[np.searchsorted(ids, grad.indices)] = grad.data
        tables = self.row_states.get(index)
        if tables is not None and index in self._unchecked_rows:
            # Loaded states are checked before anything changes, once.
            probe = optimizer.create_state_multi_precision(index, table.gather(ids[:1]))
            _check_row_states_fit(index, tables, _leaves(probe), table.shape)
            self._unchecked_rows.discard(index)
        # A row's state starts as create_state makes it from the row's weight (a float32
        # master copy is the weight, not zeros); a row updated before resumes its state.
        slots = table.rows_for(ids)  # new rows are stored as zeros first
        if how == "lazy" and self._update_in_place(index, table, ids, slots, grad_rows, tables):
            return
        weight_rows = np.take(table.rows, slots, axis=0)  # ~20% faster than rows[slots]
        state_rows = optimizer.create_state_multi_precision(index, weight_rows)
        leaves = _leaves(state_rows)
        if tables is None:
            tables = [RowTable((table.shape[0], *leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        else:
            resumed = tables[0].stored(ids) if tables else np.zeros(0, bool)
            for leaf, leaf_table in zip(leaves, tables, strict=True):
                leaf[resumed] = leaf_table.gather(ids[resumed])
        optimizer.update_rows(index, weight_rows, grad_rows, state_rows)
        table.rows[slots] = weight_rows
        for leaf, leaf_table in zip(leaves, tables, strict=True):
            leaf_table.scatter(ids, leaf)
        self.row_states[index] = tables

    def check_rows(self, index: Index, table: RowTable) -> Literal["lazy", "standard"]:
        """How :meth:`update_rows` would apply a row-sparse gradient of ``index`` to the
        rows of ``table`` (:meth:`Optimizer.row_sparse_update`), or its refusal; changes
        nothing (a push of several keys is checked for every key before any is updated,
        and an update refused here stores no row).

        Raises
        ------
        OptimizerError
            The optimizer has no row-sparse update of ``index``, or refuses rows of this
            shape (``create_state``: GroupAdaGrad's rows are 1-D).
        InvalidArgumentError
            The rows are not floating-point.
        StateFormatError
            The states loaded for ``index`` were saved for a dense key.
        """
        how = self.optimizer.row_sparse_update_for(index, table.dtype)
        if index in self.states:
            raise _other_kind(index, "dense", "row-sparse")
        # What the update itself would refuse, asked of no rows (nothing is counted).
        probe = np.zeros((0, *table.row_shape), table.dtype)
        check_update_arrays(index, probe, probe)
        self.optimizer.create_state(index, probe)  # (the float16 warning comes once, later)
        return how

    def _update_in_place(
        self,
        index: Index,
        table: RowTable,
        ids: np.ndarray,
        slots: np.ndarray,
        grad_rows: np.ndarray,
        tables: list[RowTable] | None,
    ) -> bool:
        """A lazy row update straight on the stored rows and states, where the optimizer
        has one (:meth:`Optimizer.row_states_in_place`); whether it was made. A new row's
        state rows are stored as zeros, as such an optimizer's ``create_state`` makes
        them."""
        optimizer = self.optimizer
        width = math.prod(table.row_shape)
        count = optimizer.row_states_in_place(index, table.dtype)
        if count is None or not width or not len(ids):
            return False
        if tables is None:
            tables = [RowTable(table.shape, table.dtype) for _ in range(count)]
        if len(tables) != count or any(
            state.dtype != table.dtype or state.shape != table.shape for state in tables
        ):
            return False
        state_slots = [state.rows_for(ids) for state in tables]  # new rows: zeros
        states = [
            (state.rows.reshape(len(state), width), where)
            for state, where in zip(tables, state_slots, strict=True)
        ]
        rows = table.rows.reshape(len(table), width)
        if not optimizer.update_rows_in_place(
            index, rows, slots, grad_rows.reshape(-1, width), states
        ):
            return False
        self.row_states[index] = tables
        return True

    def dump_states(self, dump_optimizer: bool = False, file: BinaryIO | None = None) -> bytes:
        """Encode the states, the update counts and, if ``dump_optimizer``, the optimizer's
        config, in akv's portable format (see ``encode_states``; no pickle); into ``file``
        (a seekable binary file: ``b""`` is returned) when given.

        Raises
        ------
        MixedKeyKindsError
            The updater has seen both int and str indexes.
        """
        states: dict[Index, State | RowStates] = dict(self.states)
        for index, tables in self.row_states.items():
            states[index] = _row_states(tables)
        return encode_states(
            states,
            index_update_counts=self.optimizer.index_update_counts,
            num_update=self.optimizer.num_update,
            optimizer_config=self.optimizer.get_config() if dump_optimizer else None,
            shared_state=self.optimizer.shared_state(),
            file=file,
        )

    def load_states(self, data: bytes | BinaryIO) -> None:
        """Replace the states, update counts and the optimizer's shared state
        (:meth:`Optimizer.shared_state`) with those encoded in ``data`` (or in the seekable
        binary file ``data``, read from its start). Row-sparse states are read straight
        into their tables.

        If ``data`` holds an optimizer config, the optimizer is replaced by one rebuilt from
        it. Nothing changes when an error is raised. After a load, the next update of every
        index is the one the dumping updater would have made. Each loaded state is checked
        against its weight at that index's next update.

        Raises
        ------
        StateFormatError
            ``data`` is not in akv's format, its optimizer config cannot be rebuilt, or its
            shared state is not one the optimizer keeps.
        """
        saved = decode_states(data, row_tables=True)
        optimizer = self.optimizer
        if saved.optimizer_config is not None:
            try:
                optimizer = from_config(saved.optimizer_config)
            except OptimizerError as exc:
                raise StateFormatError(
                    f"optimizer states: the saved optimizer config cannot be rebuilt: {exc}"
                ) from exc
        dense: dict[Index, State] = {}
        rows: dict[Index, list[RowTable]] = {}
        for index, state in saved.states.items():
            if isinstance(state, RowStates):
                rows[index] = _row_tables(state)
            else:
                dense[index] = state
        try:
            optimizer.restore_shared_state(saved.shared_state)
        except OptimizerError as exc:
            raise StateFormatError(f"optimizer states do not fit the optimizer: {exc}") from exc
        optimizer.restore_update_counts(saved.index_update_counts, saved.num_update)
        self.optimizer = optimizer
        self.states = dense
        self.row_states = rows
        self._unchecked = set(dense)
        self._unchecked_rows = set(rows)


def get_updater(optimizer: Optimizer) -> Updater:
    """An :class:`Updater` for ``optimizer`` (MXNet's ``get_updater``)."""
    return Updater(optimizer)


def keeps_states(updater: Updater | None, optimizer: Optimizer) -> bool:
    """Whether a store's ``set_optimizer(optimizer)`` goes on with ``updater`` (the same
    optimizer, new hyper-parameters: :meth:`Updater.reconfigure` keeps the states that
    still fit, the update counts and the shared state) rather than with a new one (another
    optimizer, or none before). Every store decides so, local and distributed alike."""
    if updater is None:
        return False
    return bool(updater.optimizer.get_config()["name"] == optimizer.get_config()["name"])


def _check_state_fits(index: Index, state: State, expected: State, path: str) -> None:
    def mismatch(detail: str) -> StateFormatError:
        return StateFormatError(
            f"loaded state of index {index!r} does not fit its weight: {path}: {detail}"
        )

    if expected is None or state is None:
        if expected is not state:
            raise mismatch(f"expected {_describe(expected)}, got {_describe(state)}")
        return
    if is_array(expected):
        if not is_array(state):
            raise mismatch(f"expected an array, got {_describe(state)}")
        if state.shape != expected.shape or state.dtype != expected.dtype:
            raise mismatch(
                f"expected shape {expected.shape} dtype {expected.dtype}, "
                f"got shape {state.shape} dtype {state.dtype}"
            )
        return
    if not isinstance(state, (tuple, list)) or len(state) != len(expected):
        raise mismatch(f"expected {_describe(expected)}, got {_describe(state)}")
    for i, (member, expected_member) in enumerate(zip(state, expected, strict=True)):
        _check_state_fits(index, member, expected_member, f"{path}[{i}]")


def _fits(index: Index, state: State, expected: State) -> bool:
    try:
        _check_state_fits(index, state, expected, "state")
    except StateFormatError:
        return False
    return True


def _row_leaves(
    optimizer: Optimizer, index: Index, table: RowTable
) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The row shape and dtype of each array of the state ``optimizer`` makes for a row of
    ``table``."""
    probe = np.zeros((1, *table.row_shape), table.dtype)
    leaves = _leaves(optimizer.create_state_multi_precision(index, probe))
    return [(leaf.shape[1:], leaf.dtype) for leaf in leaves]


def _other_kind(index: Index, saved: str, key: str) -> StateFormatError:
    """The error of states loaded for a key of the other storage type: using them would drop
    them silently (a dense update reads no row states, a row update no dense ones)."""
    return StateFormatError(
        f"loaded state of index {index!r} was saved for a {saved} key, but the key is {key} "
        f"here: load states saved from a {key} key"
    )


def _placed_like(state: State, expected: State) -> State:
    """``state`` (loaded into host memory) moved to where ``expected``'s arrays live."""
    if state is None or expected is None:
        return state
    if isinstance(state, (tuple, list)):
        assert isinstance(expected, (tuple, list))
        placed = [_placed_like(s, e) for s, e in zip(state, expected, strict=True)]
        return tuple(placed) if isinstance(state, tuple) else placed
    if isinstance(state, np.ndarray) and is_array(expected) and is_cupy(expected):
        target = zeros_like(expected)
        copy_into(target, state)
        return target
    return state


def _row_states(tables: list[RowTable]) -> RowStates:
    """Row tables of one key's state leaves (one set of ids) as saved: the rows stay in
    their tables until the encoder writes them (:class:`StoredRows`)."""
    if not tables:
        return RowStates((0,), np.zeros(0, np.int64), ())
    ids = tables[0].ids()
    return RowStates(tables[0].shape, ids, tuple(StoredRows(table, ids) for table in tables))


def _row_tables(state: RowStates) -> list[RowTable]:
    """The inverse of :func:`_row_states` (leaves decoded as tables are taken as they are)."""
    tables = []
    for leaf in state.leaves:
        if isinstance(leaf, RowTable):
            tables.append(leaf)
            continue
        assert isinstance(leaf, np.ndarray), "decoded states hold arrays or tables"
        table = RowTable((state.shape[0], *leaf.shape[1:]), leaf.dtype)
        table.scatter(state.ids, leaf)
        tables.append(table)
    return tables


def _check_row_states_fit(
    index: Index, tables: list[RowTable], leaves: list[np.ndarray], shape: tuple[int, ...]
) -> None:
    """Raise unless loaded row states have the structure the optimizer makes for rows of
    a weight of ``shape``."""
    made = [(leaf.shape[1:], leaf.dtype) for leaf in leaves]
    held = [(table.row_shape, table.dtype) for table in tables]
    if made != held or any(table.shape[0] != shape[0] for table in tables):
        raise StateFormatError(
            f"loaded row-sparse state of index {index!r} does not fit its weight of shape "
            f"{shape}: the optimizer makes rows {made}, the state holds {held}"
        )


def _leaves(state: State) -> list[np.ndarray]:
    """The arrays of a state's structure, in order."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [leaf for member in state for leaf in _leaves(member)]
    return [state]


def _describe(state: State) -> str:
    if state is None:
        return "no state"
    if is_array(state):
        return f"an array of shape {state.shape}"
    if isinstance(state, (tuple, list)):
        return f"a {type(state).__name__} of {len(state)}"
    return f"a {type(state).__name__}"
