"""What is read of a server's state from outside its decisions: the invariants that tests
check after every event (:func:`check_invariants`) and the status page (:func:`status`).

Both read a :class:`~akv.cluster.server.state.ServerState` (its private parts too: they
are the state's own views, kept apart so that the decisions read alone) and change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from akv.cluster.protocol import DIST_STORE_TYPES
from akv.cluster.server.instructions import PullTicket, StatesTicket

if TYPE_CHECKING:
    from akv.cluster.server.state import ServerState

__all__ = ["check_invariants", "status"]


def check_invariants(state: ServerState) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``state``."""
    assert state.store_type in (None, *DIST_STORE_TYPES), state.store_type
    assert not state.entries or state.store_type is not None, "keys before any worker"
    workers = [peer.worker for peer in state.peers.values()]
    assert len(workers) == len(set(workers)), f"two streams of one worker: {workers}"
    parked: dict[int, int] = {}
    tickets: dict[int, PullTicket | StatesTicket] = {}
    for key, entry in state.entries.items():
        rounds = entry.rounds
        assert entry.key == key and rounds.key == key, key
        assert rounds.sync == state.sync, f"key {key!r} has the wrong round kind"
        assert 0 <= rounds.applied_round <= rounds.closed_round, (key, rounds.applied_round)
        assert entry.value.shape == entry.shape and entry.value.dtype == entry.dtype, key
        for round_no, ticket in rounds.waiting_rounds():
            assert rounds.applied_round < round_no <= rounds.open_round, (key, round_no)
            assert not ticket.answered, f"answered ticket still parked on {key!r}"
            parked[id(ticket)] = parked.get(id(ticket), 0) + 1
            tickets[id(ticket)] = ticket
        if not rounds.sync:
            assert not rounds.waiting_tickets(), f"async key {key!r} parks pulls"
    for ticket_id, count in parked.items():
        assert tickets[ticket_id].remaining == count, "ticket count differs from parking"
    state.rows.validate()
    state._init_waits.validate(state._held())
    if state._held_answers:
        assert not state.sync and state.lineage.answers_held, "answers held for nothing"
        assert not any(t.answered for t in state._held_answers), "a held pull was answered"
    if state.failure is not None:
        assert not parked and not state._init_waits, "waits left after the job failed"
        assert not state._held_answers, "held answers left after the job failed"


def status(state: ServerState) -> dict[str, Any]:
    """What the status page shows of ``state`` (JSON-ready)."""
    return {
        "keys": len(state.entries) + len(state.rows.entries),
        "row_sparse_keys": len(state.rows.entries),
        "store_type": state.store_type,
        "workers_connected": state.workers_connected(),
        "failure": state.failure,
        "optimizer": None if state.optimizer_config is None else state.optimizer_config["name"],
        "checkpoints": state.checkpoints,
        "workers_reconnecting": sorted(state._absent),
        "duplicate_pushes": state.duplicates,
    }
