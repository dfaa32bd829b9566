"""Where keys live: stable placement, big arrays split over every server."""

from __future__ import annotations

from akv.cluster.placement import Part, place, server_of


def test_placement_is_stable_and_independent_of_order():
    assert server_of("conv1_weight", 4) == server_of("conv1_weight", 4)
    assert [server_of(k, 3) for k in range(6)] == [server_of(k, 3) for k in range(6)]
    # Pinned values: the hash must not change between releases (workers must agree).
    assert [server_of(k, 7) for k in (0, 1, 2, "w", "conv1_weight")] == [5, 2, 3, 3, 6]
    assert server_of(10**30, 5) in range(5)  # no overflow for big int keys (MXNet's 9973 bug)


def test_placement_spreads_keys_over_servers():
    used = {server_of(k, 4) for k in range(64)}
    assert used == {0, 1, 2, 3}


def test_small_arrays_live_on_one_server_big_ones_on_all():
    assert place(3, 999, 2, 1000) == (Part(server_of(3, 2), 0, 999),)
    assert place(3, 1000, 2, 1000) == (Part(0, 0, 500), Part(1, 500, 1000))
    parts = place("x", 10, 3, 5)
    assert [p.size for p in parts] == [3, 3, 4]
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 6), (6, 10)]
    assert place("x", 10**7, 1, 5) == (Part(0, 0, 10**7),)


# ------------------------------------------------------------------ sync rounds
