"""``akv bench dist``: which floors each row is measured against (no job, no sockets: the
floors and the job's times are stand-ins)."""

from __future__ import annotations

import contextlib

import akv.bench.dist as dist
from akv.bench.dist import ROUND_FLOOR, Case

ECHO_S, ROUND_S = 1e-4, 3e-4


class _Echo(contextlib.AbstractContextManager):
    def __exit__(self, *exc: object) -> None:
        return None


class _Round(_Echo):
    pass


def test_a_pull_row_has_no_summing_round_floor_and_says_so(monkeypatch):
    """A pull waits for no other worker and sums nothing: a raw round of two clients and a
    summing server is not its work. Its only floor is the echo; its label says so."""
    monkeypatch.setattr(dist, "RawEcho", _Echo)
    monkeypatch.setattr(dist, "RawRound", _Round)
    monkeypatch.setattr(
        dist,
        "round_trip",
        lambda peer, nbytes, iterations, rounds: ROUND_S if isinstance(peer, _Round) else ECHO_S,
    )
    small = ((16,),)
    cases = [Case("a push+pull", "key", small, 10), Case("a pull", "pull", small, 10)]
    monkeypatch.setattr(
        dist, "_job", lambda count, cases, rounds, scale, shm: {c.name: [2e-4] for c in cases}
    )
    table = dist.measure(cases, rounds=1, scale=1.0, servers=(1,), transports=("TCP",))
    push_pull, pull = table.rows
    assert push_pull.name == "a push+pull, 1 server, TCP"
    assert push_pull.second_floor_s == ROUND_S and push_pull.second_floor == ROUND_FLOOR
    assert push_pull.floor == "raw socket echo of 64 B"
    assert pull.name == "a pull, 1 server, TCP"
    assert pull.floor_s == ECHO_S
    assert pull.second_floor_s is None and pull.second_floor == ""
    assert pull.floor == "raw socket echo of 64 B (a pull: no round floor)"
    assert "none in the pull rows" in "\n".join(table.notes)
