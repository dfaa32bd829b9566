"""A server's state and its checkpoints: what a checkpoint holds now (:func:`plan`), and a
state started from one (:func:`restore`).

Both work on a :class:`~akv.cluster.server.state.ServerState` (its private parts too, as
:mod:`akv.cluster.server.views` does), kept apart from the state's decisions about frames.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.cluster.server.checkpoint_header import RowRecord
from akv.cluster.server.checks import CHANGING_OPS
from akv.cluster.server.instructions import (
    CheckpointPlan,
    RowEntry,
    SaveStates,
    ServerEntry,
    StatesTicket,
)
from akv.cluster.server.rounds import untold_errors

if TYPE_CHECKING:
    from akv.cluster.server.state import ServerState

__all__ = ["plan", "restore"]


def plan(state: ServerState) -> CheckpointPlan:
    """What a checkpoint asked for now holds (see :class:`CheckpointPlan`): every key's
    value after its closed rounds (read by a task that follows every write issued so
    far), and per worker the number below which its requests are all in it: the first of
    its changes taken in and not in the values (a push in an open round, a frame parked
    by bounded staleness, a states load waiting for rounds), else the one after its latest
    change."""
    entries = []
    row_entries = []
    pending: dict[int, int] = {}
    for entry in state._all_keys():
        closed_round, tags, last = entry.rounds.durable()
        if isinstance(entry, RowEntry):
            row_entries.append((entry, closed_round, tags, last))
        else:
            entries.append((entry, closed_round, tags, last))
        for worker, seq in entry.rounds.open_seqs().items():
            if seq:
                pending[worker] = min(pending.get(worker, seq), seq)
    for worker, seq in _unapplied(state):
        pending[worker] = min(pending.get(worker, seq), seq)
    durable = {
        worker: pending.get(worker, received + 1) for worker, received in state._received.items()
    }
    return CheckpointPlan(
        tuple(entries),
        durable,
        state.store_type,
        state.optimizer_config,
        state.updater,
        tuple(row_entries),
        # The restored sessions of workers this process has not seen yet stay with their
        # push numbers (else such a worker of a later job would be taken for this one's).
        {**state._restored_sessions, **state._sessions},
    )


def _unapplied(state: ServerState) -> Iterator[tuple[int, int]]:
    """(worker, request number) of each change taken in whose effect waits: a push parked by
    bounded staleness, and a states load or a new optimizer waiting for rounds to be applied
    (a checkpoint written now holds neither)."""
    if state.waiting is not None:
        for parked in state.waiting:
            if parked.header.op in CHANGING_OPS:
                yield parked.peer.worker, parked.header.seq
    for entry in state._all_keys():
        for ticket in entry.rounds.waiting_tickets():
            if isinstance(ticket, StatesTicket) and not isinstance(ticket.work, SaveStates):
                yield ticket.peer.worker, ticket.seq


def restore(
    state: ServerState,
    store_type: str,
    keys: Sequence[tuple[Key, np.ndarray, int, dict[int, int], dict[int, int], dict[int, str]]],
    optimizer_config: dict[str, Any] | None,
    optimizer_states: bytes | BinaryIO | None,
    durable_seqs: dict[int, int],
    row_keys: Sequence[RowRecord] = (),
    sessions: dict[int, str] | None = None,
    declared: Mapping[Key, tuple[int, ...]] | None = None,
) -> None:
    """Start from a checkpoint: the keys (key, value, closed round, each worker's last
    push number, last push round, and failed rounds' errors not told yet), the optimizer
    and its states (encoded: bytes, or a file to read them from), and the request numbers
    the checkpoint holds. Workers resend what it does not hold. ``sessions``:
    the workers' sessions when it was written; a worker that comes with another one is
    of a new job started from the checkpoint (workers are never restarted within a
    job), whose pushes are numbered from 1 again (see :meth:`ServerState.admit`).
    ``declared``: the declared shapes of keys split over the servers.

    Raises
    ------
    OptimizerError, StateFormatError
        The optimizer configuration or states cannot be loaded.
    """
    state.store_type = store_type
    for key, value, closed_round, tags, last, untold in keys:
        shape = None if declared is None else declared.get(key)
        entry = ServerEntry(key, value, state._new_var, state.sync, state.num_workers, None, shape)
        entry.rounds.restore(closed_round, tags, last, untold_errors(untold, state.name))
        entry.regions = state.value_regions
        state.entries[key] = entry
    state.rows.restore(row_keys, state.sync)
    if optimizer_config is not None:
        state.updater = _optimizer.get_updater(_optimizer.from_config(optimizer_config))
        state.optimizer_config = optimizer_config
        if optimizer_states:
            state.updater.load_states(optimizer_states)
    state._received = {worker: seq - 1 for worker, seq in durable_seqs.items()}
    state._restored_sessions = dict(sessions or {})
