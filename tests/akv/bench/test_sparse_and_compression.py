"""``akv bench sparse`` and ``akv bench compression`` at a tiny size: the jobs run, the rows
and ratios are computed against floors of the same run (no timed assertion)."""

from __future__ import annotations

import numpy as np

from akv.bench import configure
from akv.bench.compression import codec_rows, round_rows
from akv.bench.dist import MIB
from akv.bench.sparse import ROWS, draw_ids, memory_growth, step_rows
from akv.cli import BENCHMARKS


def test_the_commands_are_listed():
    assert BENCHMARKS["sparse"] == "akv.bench.sparse"
    assert BENCHMARKS["compression"] == "akv.bench.compression"
    assert BENCHMARKS["fusion"] == "akv.bench.fusion"


def test_a_batch_is_zipf_like_ids_of_the_table():
    ids = draw_ids(np.random.default_rng(0))
    assert ids.size == 8192 and ids.min() >= 0 and ids.max() < ROWS
    unique = np.unique(ids).size
    assert 500 < unique < 6000  # a few hot rows, a long tail


def test_a_tiny_sparse_job_reports_the_step_against_the_dense_floor():
    configure(quick=True)
    try:
        rows = step_rows(steps=3, rows=1000, servers=(1,), transports=(("TCP", "0"),))
    finally:
        configure(quick=False)
    assert [row.name for row in rows] == ["sparse step, 1 server, TCP"]
    for row in rows:
        assert row.akv_s > 0 and row.floor_s > 0 and row.ratio == row.akv_s / row.floor_s
        assert row.reference_s is None  # MXNet's number is for the 10^6-row table only
        assert "dense push+pull of" in row.floor


def test_the_memory_of_touched_rows_is_measured_against_their_bytes():
    grown, stored, elapsed = memory_growth(20_000)
    assert stored == 20_000 * 64 * 4 and elapsed > 0
    assert grown >= 0


def test_the_codes_and_a_tiny_compressed_round_are_measured(monkeypatch):
    import akv.bench.compression as compression

    configure(quick=True)
    try:
        rows, costs = codec_rows(MIB // 4)
        monkeypatch.setattr(compression, "TYPES", ("2bit",))  # one compressed job: enough
        rounds = round_rows(64 * 1024, rounds=1, scale=0.25)
    finally:
        configure(quick=False)
    assert [row.name for row in rows] == [
        "2bit encode 0.25 MiB",
        "2bit decode 0.25 MiB",
        "1bit encode 0.25 MiB",
        "1bit decode 0.25 MiB",
    ]
    assert set(costs) == {"2bit", "1bit"} and all(cost > 0 for cost in costs.values())
    assert [row.name.split(" ")[3] for row in rounds] == ["dense,", "2bit,"]
    dense = rounds[0].akv_s
    assert all(row.floor_s == dense for row in rounds)


def test_a_tiny_fusion_job_reports_fused_steps_against_the_unfused_one(monkeypatch):
    import pytest

    pytest.importorskip("torch")
    import akv.bench.fusion as fusion

    monkeypatch.setattr(fusion, "BUCKETS", (None, 16 * MIB))
    configure(quick=True)
    try:
        table = fusion.run()
    finally:
        configure(quick=False)
    unfused, fused = table.rows
    assert "62 keys" in unfused.name and unfused.ratio == 1.0
    assert "buckets of 16 MiB" in fused.name and fused.floor_s == unfused.akv_s
