"""The worker state's invariants, checked after each event in tests
(:meth:`WorkerState.validate <akv.cluster.worker.state.WorkerState.validate>`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from akv.cluster.worker.pipeline import Gather, Pipelined
    from akv.cluster.worker.state import WorkerState

__all__ = ["check"]


def check(state: WorkerState) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``state``: each
    push's and call's counts of what it waits for, the acknowledgements, the values asked
    ahead, and each link's own (:meth:`~akv.cluster.worker.reconnect.Link.validate`)."""
    unacked: dict[int, int] = {}
    unanswered: dict[int, int] = {}
    pushes: dict[int, Pipelined] = {}
    waiting: dict[int, int] = {}
    calls: dict[int, Gather] = {}
    for link in state.links:
        requests = link.validate(state.failure is not None)
        for request in requests:
            push = request.push
            if push is not None:
                pushes[id(push)] = push
                unanswered[id(push)] = unanswered.get(id(push), 0) + 1
                if not request.acked:
                    unacked[id(push)] = unacked.get(id(push), 0) + 1
            if request.call is not None:
                calls[id(request.call)] = request.call
                waiting[id(request.call)] = waiting.get(id(request.call), 0) + 1
    for push_id, push in pushes.items():
        assert push.unanswered == unanswered[push_id], f"{push}: answers counted wrong"
        assert push.unacked == unacked.get(push_id, 0), f"{push}: acks counted wrong"
    assert state.unacked == len(unacked), f"unacked {state.unacked} != {len(unacked)} pushes"
    assert state.unacked or not state._acks_waiters, "waiting for acknowledgements of none"
    values = {id(value): value for push in pushes.values() for value in push.aheads or ()}
    for key, value in state.ahead.values.items():
        entry = value.entry
        assert entry.key == key and value.pushes == entry.pushes, f"stale ahead of {key!r}"
        assert not value.stale and not value.released, value
        values[id(value)] = value
    for value in values.values():
        assert value.readers >= 0 and not (value.arrived and value.waiters), value
        assert not value.released or value.lent is None, f"{value}: released, still lent"
        for call in value.waiters:
            calls[id(call)] = call
            waiting[id(call)] = waiting.get(id(call), 0) + 1
    for call_id, call in calls.items():
        assert call.remaining == waiting[call_id], f"{call}: waits for {waiting[call_id]}"
