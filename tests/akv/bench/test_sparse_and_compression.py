"""``akv bench sparse`` and ``akv bench compression`` at a tiny size: the jobs run, the rows
and ratios are computed against floors of the same run (no timed assertion)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from akv import jit
from akv.bench import configure
from akv.bench.compression import codec_rows, round_rows
from akv.bench.dist import MIB
from akv.bench.sparse import ROWS, draw_ids, memory_growth, options_parser, run
from akv.cli import BENCHMARKS, main


def test_the_commands_are_listed():
    assert BENCHMARKS["sparse"] == "akv.bench.sparse"
    assert BENCHMARKS["compression"] == "akv.bench.compression"
    assert BENCHMARKS["fusion"] == "akv.bench.fusion"


def test_a_batch_is_zipf_like_ids_of_the_table():
    ids = draw_ids(np.random.default_rng(0))
    assert ids.size == 8192 and ids.min() >= 0 and ids.max() < ROWS
    unique = np.unique(ids).size
    assert 500 < unique < 6000  # a few hot rows, a long tail


def test_a_tiny_sparse_run_reports_the_step_against_both_dense_floors():
    """The command at a tiny size (3 steps, a 1000-row table, 1 server, one transport: TCP,
    so that the smoke test starts as few jobs as it can; a memory row of 20,000 rows in the
    local store and over 2 servers): the rows, both floors' ratios, the spreads and the
    memory ratios are there."""
    configure(quick=True)
    try:
        table = run(
            [
                "--servers", "1", "--shm", "off", "--steps", "3", "--rows", "1000",
                "--memory", "20000",
            ]
        )  # fmt: skip
    finally:
        configure(quick=False)
    assert [row.name for row in table.rows] == ["sparse step, 1 server, TCP"]
    for row in table.rows:
        assert row.akv_s > 0 and row.floor_s > 0 and row.ratio == row.akv_s / row.floor_s
        assert row.second_floor_s is not None and row.second_floor_s > 0
        assert row.second_ratio == row.akv_s / row.second_floor_s
        assert row.akv_p90_s is not None and row.akv_p90_s >= row.akv_s
        assert row.floor == "dense push+pull of 8192 x 64 float32"
        assert re.fullmatch(r"dense push\+pull of the step's \d+ x 64 float32", row.second_floor)
        assert row.reference_s is None  # MXNet's number is for the 10^6-row table only
    notes = "\n".join(table.notes)
    for row in table.rows:
        assert f"{row.name}: p10-p90: step " in notes
    local = re.search(r"Memory, local store: .*ratio (\d+\.\d+)", notes)
    dist = re.search(
        r"Memory, dist_sync over 2 servers, 20,000 rows .*together ratio (\d+\.\d+)", notes
    )
    assert local is not None and dist is not None
    assert "server 0 " in notes and "server 1 " in notes
    assert float(dist.group(1)) > 0  # the servers grew as the rows came
    assert f"Row sums and updates: {jit.describe()} (AKV_JIT)." in table.notes


def test_the_sparse_options_are_parsed_and_refused_where_a_suite_has_none(capsys):
    options = options_parser().parse_args(["--servers", "2", "--shm", "off", "--memory", "0"])
    assert options.servers == [2] and options.shm == ["off"] and options.memory == [0]
    assert options.steps is None and options.rows == ROWS
    with pytest.raises(SystemExit):
        main(["bench", "local", "--servers", "1"])
    assert "takes no options of its own" in capsys.readouterr().err
    for asked in (["--help"], ["-h"], ["--quick", "--help"], ["--help-sparse"]):
        assert main(["bench", "sparse", *asked]) == 0, asked
        help_text = capsys.readouterr().out
        assert help_text.startswith("usage: akv bench sparse"), asked
        assert "--memory-stores" in help_text and "also: --quick" in help_text[-200:]


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
