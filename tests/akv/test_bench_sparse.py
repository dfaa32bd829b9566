"""``akv bench sparse``: its memory notes where a store holds no rows."""

from __future__ import annotations

import akv.bench.sparse as sparse


def test_memory_ratios_of_a_store_that_holds_no_rows_print_a_dash(monkeypatch):
    """One row touched over 2 servers: one server stores none of it (and a run may store
    none at all); its ratios are "-", not a ZeroDivisionError."""
    grown = {"VmRSS": 4096, "RssAnon": 4096, "RssShmem": 0, "seconds": 0.1}
    monkeypatch.setattr(
        sparse,
        "dist_memory",
        lambda count: {0: {**grown, "rows": 256}, 1: {**grown, "rows": 0}},
    )
    monkeypatch.setattr(sparse, "memory_growth", lambda count: (4096, 0, 0.1))
    table = sparse.run(["--steps", "0", "--memory", "1", "--memory-stores", "dist", "local"])
    notes = "\n".join(table.notes)
    assert "server 0 " in notes and "(ratio 16.00;" in notes
    assert "server 1 " in notes and "(ratio -;" in notes and "its own: ratio -)" in notes
    assert "together ratio 32.00 (own memory 32.00)" in notes
    assert "rows; ratio -; pushes" in notes  # the local store's

    monkeypatch.setattr(
        sparse, "dist_memory", lambda count: {0: {**grown, "rows": 0}, 1: {**grown, "rows": 0}}
    )
    notes = "\n".join(
        sparse.run(["--steps", "0", "--memory", "1", "--memory-stores", "dist"]).notes
    )
    assert "together ratio - (own memory -)" in notes
