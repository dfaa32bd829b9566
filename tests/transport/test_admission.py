"""Who may hold a connection to a listener (transport._admission, no I/O): strangers and
authenticated connections have budgets of their own, and strangers never take the place of
the job's connections (issue #24)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv_transport._admission import Admission, PeerCount, Standing

HOST = "127.0.0.1"
OTHER = "127.0.0.2"


def admission(
    authenticated: int | None = 8,
    strangers: int | None = 4,
    everyone: int | None = None,
    probation: int = 2,
) -> Admission[str]:
    return Admission(
        max_authenticated_per_peer=authenticated,
        max_strangers_per_peer=strangers,
        max_strangers=everyone,
        max_probation=probation,
    )


def fill(places: Admission[str], peer: str, count: int, prefix: str = "s") -> list[str]:
    """``count`` strangers of ``peer``, admitted as strangers."""
    keys = [f"{prefix}{peer}-{i}" for i in range(count)]
    for key in keys:
        assert places.admit(key, peer).standing is Standing.STRANGER
    return keys


def test_strangers_of_one_address_are_capped_and_the_next_is_on_probation():
    places = admission()
    fill(places, HOST, 4)
    decision = places.admit("late", HOST)
    assert decision.standing is Standing.PROBATION
    assert "its address holds 4 connections without the token" in decision.why
    assert decision.evicted == ()
    assert places.count(HOST) == PeerCount(strangers=4, probation=1, authenticated=0)


def test_without_probation_a_stranger_past_the_cap_is_refused_at_once():
    places = admission(probation=0)
    fill(places, HOST, 4)
    decision = places.admit("late", HOST)
    assert decision.standing is None
    assert "the most one address may" in decision.why
    assert places.standing("late") is None
    assert places.statistics().refused == 1


def test_a_connection_of_the_job_is_not_refused_when_strangers_fill_their_places():
    places = admission(probation=2)
    fill(places, HOST, 4)
    assert places.admit("job", HOST).standing is Standing.PROBATION
    assert places.authenticate("job")
    assert places.standing("job") is Standing.AUTHENTICATED
    assert places.count(HOST) == PeerCount(strangers=4, probation=0, authenticated=1)


def test_a_stranger_that_authenticates_moves_to_the_authenticated_budget():
    places = admission()
    (first, *_) = fill(places, HOST, 4)
    assert places.authenticate(first)
    assert places.count(HOST) == PeerCount(strangers=3, probation=0, authenticated=1)
    assert places.admit("new", HOST).standing is Standing.STRANGER  # its place is free again
    assert places.authenticate(first)  # again: nothing changes
    assert places.count(HOST).authenticated == 1


def test_authenticated_connections_never_use_the_strangers_places():
    places = admission(authenticated=8, strangers=2)
    for key in ("a", "b", "c", "d", "e", "f"):
        assert places.admit(key, HOST).standing is Standing.STRANGER
        assert places.authenticate(key)
    fill(places, HOST, 2)
    assert places.count(HOST) == PeerCount(strangers=2, probation=0, authenticated=6)


def test_authenticated_connections_have_a_bound_of_their_own():
    places = admission(authenticated=3, strangers=2)
    for key in ("a", "b", "c"):
        places.admit(key, HOST)
        assert places.authenticate(key)
    decision = places.admit("fourth", HOST)
    assert decision.standing is None
    assert "3 authenticated connections" in decision.why
    assert places.admit("elsewhere", OTHER).standing is Standing.STRANGER  # per address


def test_a_stranger_cannot_authenticate_past_the_bound_and_stays_a_stranger():
    places = admission(authenticated=2, strangers=2)
    places.admit("a", HOST)
    places.admit("b", HOST)  # both admitted while the budget had room
    places.admit("c", OTHER)
    assert places.authenticate("a")
    places.admit("d", HOST)
    assert places.authenticate("d")
    assert not places.authenticate("b")  # the budget is full: the caller closes it
    assert places.standing("b") is Standing.STRANGER
    assert places.authenticate("c")  # another address's budget


def test_the_strangers_cap_of_an_address_is_never_above_its_authenticated_bound():
    places = admission(authenticated=2, strangers=64, probation=0)
    fill(places, HOST, 2)
    assert places.admit("third", HOST).standing is None


def test_release_on_close_frees_the_place_and_is_idempotent():
    places = admission(probation=0)
    keys = fill(places, HOST, 4)
    places.release(keys[0])
    places.release(keys[0])
    places.release("never-counted")
    assert places.admit("again", HOST).standing is Standing.STRANGER
    assert places.authenticate("again")
    places.release("again")
    assert places.count(HOST) == PeerCount(strangers=3)
    assert places.statistics().authenticated == 0


def test_probation_places_are_capped_and_the_oldest_silent_one_makes_room():
    places = admission(probation=2)
    fill(places, HOST, 4)
    places.admit("p1", HOST)
    places.admit("p2", HOST)
    places.spoke("p1")  # it sent bytes: it goes after those that sent nothing
    decision = places.admit("p3", HOST)
    assert decision.standing is Standing.PROBATION
    assert decision.evicted == ("p2",)
    assert places.standing("p2") is None
    decision = places.admit("p4", HOST)
    assert decision.evicted == ("p3",)
    places.spoke("p4")
    assert places.admit("p5", HOST).evicted == ("p1",)  # all spoke: the oldest
    assert places.statistics().evicted == 3
    assert places.count(HOST).probation == 2


def test_an_authenticated_connection_is_never_evicted():
    places = admission(probation=1)
    fill(places, HOST, 4)
    places.admit("job", HOST)
    assert places.authenticate("job")
    for i in range(10):
        decision = places.admit(f"flood{i}", HOST)
        assert "job" not in decision.evicted
    assert places.standing("job") is Standing.AUTHENTICATED
    assert not places.authenticate("flood0")  # evicted: not counted any more


def test_the_global_cap_counts_strangers_of_every_address():
    places = admission(strangers=4, everyone=6, probation=1)
    fill(places, HOST, 4)
    fill(places, OTHER, 2)
    decision = places.admit("third", "127.0.0.3")
    assert decision.standing is Standing.PROBATION
    assert "the most all addresses may together" in decision.why
    places.release(f"s{HOST}-0")
    assert places.admit("fourth", "127.0.0.3").standing is Standing.STRANGER


def test_a_key_counted_twice_is_a_mistake():
    places = admission()
    places.admit("a", HOST)
    with pytest.raises(ValueError, match="counted already"):
        places.admit("a", HOST)


@pytest.mark.parametrize(
    "options",
    [{"authenticated": 0}, {"strangers": 0}, {"everyone": 0}, {"probation": -1}],
)
def test_nonsense_bounds_are_refused(options):
    with pytest.raises(ValueError, match="must be at least"):
        admission(**options)


events = st.lists(
    st.tuples(
        st.sampled_from(["admit", "authenticate", "spoke", "release"]),
        st.integers(0, 30),
        st.sampled_from([HOST, OTHER, "::1"]),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(events=events)
def test_any_sequence_keeps_the_counts_and_bounds(events):
    places = admission(authenticated=5, strangers=3, everyone=7, probation=2)
    live: dict[int, tuple[str, bool]] = {}  # key -> (peer, authenticated)
    for action, key, peer in events:
        if action == "admit" and key not in live:
            decision = places.admit(key, peer)
            for evicted in decision.evicted:
                assert not live.pop(evicted)[1], "an authenticated connection was evicted"
            if decision.standing is not None:
                live[key] = (peer, False)
        elif action == "authenticate" and key in live:
            if places.authenticate(key):
                live[key] = (live[key][0], True)
        elif action == "spoke":
            places.spoke(key)
        elif action == "release":
            places.release(key)
            live.pop(key, None)
        standings = {k: places.standing(k) for k in live}
        assert None not in standings.values()
        authenticated = Counter(p for k, (p, a) in live.items() if a)
        strangers = Counter(p for k, (p, a) in live.items() if standings[k] is Standing.STRANGER)
        for address in (HOST, OTHER, "::1"):
            count = places.count(address)
            assert count.authenticated == authenticated[address] <= 5
            assert count.strangers == strangers[address] <= 3
        stats = places.statistics()
        assert stats.strangers <= 7 and stats.probation <= 2
        assert stats.strangers + stats.probation + stats.authenticated == len(live)
