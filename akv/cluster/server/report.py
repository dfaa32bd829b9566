"""What a server tells the scheduler with each heartbeat, for the job's status page.

Pure: :func:`heartbeat_report` reads a :class:`~akv.cluster.server.state.ServerState` and a
clock reading it is given, and changes nothing. The scheduler checks what it receives
(:func:`akv.cluster.scheduler.status.parse_report`) and shows it at ``/status``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from akv.cluster.server.instructions import RowEntry, ServerEntry
    from akv.cluster.server.state import ServerState

__all__ = ["KEY_TEXT_CHARS", "heartbeat_report", "unclosed_rounds"]

#: A key is named on the status page by its ``repr``, cut to this many characters.
KEY_TEXT_CHARS = 80


def heartbeat_report(state: ServerState, now: float) -> dict[str, Any]:
    """What ``state`` holds and waits for, JSON-ready (``now``: a reading of the clock the
    state's rounds were opened by, the server's loop clock).

    ``keys``: the keys (a split key's part counts once) dense and row-sparse; ``bytes``:
    their stored values (a row-sparse key: the rows stored and their index); ``rounds``:
    the highest round completed of any key; ``waiting``: None, or the rounds still open
    (dist_sync: a push of some workers came, others' did not): the oldest one's ``key``
    and ``round``, how long it has waited (``waiting_s``), ``open`` rounds in all, and the
    ``workers`` that any of them still waits for, by rank.

    Reads every key: O(keys) per call, once per heartbeat.
    """
    dense = state.entries.values()
    rows = state.rows.entries.values()
    stored = sum(int(entry.value.nbytes) for entry in dense)
    stored += sum(int(entry.rows.nbytes) for entry in rows)
    rounds = 0
    oldest: tuple[float, Any, int] | None = None
    waiting_for: set[int] = set()
    open_rounds = 0
    every_key = [(e.key, e.rounds) for e in dense] + [(e.key, e.rounds) for e in rows]
    for key, key_rounds in every_key:
        rounds = max(rounds, key_rounds.closed_round)
        opened_at = key_rounds.opened_at
        if opened_at is None:
            continue
        open_rounds += 1
        waiting_for.update(key_rounds.missing())
        if oldest is None or opened_at < oldest[0]:
            oldest = (opened_at, key, key_rounds.open_round)
    waiting = None
    if oldest is not None:
        opened_at, key, round_no = oldest
        waiting = {
            "key": repr(key)[:KEY_TEXT_CHARS],
            "round": round_no,
            "waiting_s": max(0.0, now - opened_at),
            "open": open_rounds,
            "workers": sorted(waiting_for),
        }
    return {
        "keys": len(state.entries) + len(state.rows.entries),
        "bytes": stored,
        "rounds": rounds,
        "waiting": waiting,
    }


def unclosed_rounds(state: ServerState, listed: int = 5) -> str | None:
    """What a server says of the dist_sync rounds still open when the job ends (pushes of
    some workers came, others' never did), whose pushes are never applied: the first
    ``listed`` of them by key and round, the workers that pushed and those it waited for;
    None when none is open."""
    every_key: list[ServerEntry | RowEntry] = [*state.entries.values()]
    every_key.extend(state.rows.entries.values())
    unclosed = [entry for entry in every_key if entry.rounds.open_seqs()]
    if not unclosed:
        return None
    lines = [
        f"round {entry.rounds.open_round} of key {repr(entry.key)[:KEY_TEXT_CHARS]} (pushed by "
        f"workers {sorted(entry.rounds.open_seqs())}, not by {entry.rounds.missing()})"
        for entry in unclosed[:listed]
    ]
    more = f"; and {len(unclosed) - listed} more" if len(unclosed) > listed else ""
    return (
        f"the job ended with {len(unclosed)} dist_sync round(s) never closed, whose pushes "
        f"are not applied (a round is applied once every worker pushed it): "
        f"{'; '.join(lines)}{more}"
    )
