"""``akv bench device``: byte counts and floors, a clean exit without a GPU, the rows on one."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import akv
import akv.bench.device as device
import akv.cli
from akv.bench import Table, configure
from akv.bench.device import (
    GIB,
    MIB,
    DeviceRow,
    Sizes,
    adam_floor_bytes,
    bytes_per_second,
    copy_bytes,
    floor_seconds,
    reduce_floor_bytes,
    sgd_floor_bytes,
    sizes,
)
from akv_engine import gpu_available

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 120
GPU_RUN_TIMEOUT_S = 600


@pytest.fixture
def restore_bench_settings():
    yield
    configure(quick=False)


def test_a_copy_reads_and_writes_its_bytes():
    assert copy_bytes(GIB) == 2 * GIB


def test_the_reduce_floor_counts_every_source_the_sum_and_the_pull():
    # read 4 sources, write the sum; then the pull reads the sum and writes the output
    assert reduce_floor_bytes(4, 64 * MIB) == (4 + 1) * 64 * MIB + 2 * 64 * MIB
    assert reduce_floor_bytes(4, 64 * MIB) == 7 * 64 * MIB
    assert reduce_floor_bytes(1, 100) == 400


def test_the_sgd_floor_reads_weight_and_gradient_and_writes_the_weight():
    assert sgd_floor_bytes(64 * MIB) == 3 * 64 * MIB


def test_the_adam_floor_reads_four_arrays_and_writes_three():
    assert adam_floor_bytes(64 * MIB) == (4 + 3) * 64 * MIB


def test_a_floor_is_the_bytes_at_the_copy_bandwidth():
    d2d_bytes_per_s = bytes_per_second(copy_bytes(GIB), 0.5e-3)  # 1 GiB copied in 0.5 ms
    assert d2d_bytes_per_s == pytest.approx(2 * GIB / 0.5e-3)
    floor = floor_seconds(reduce_floor_bytes(4, 64 * MIB), d2d_bytes_per_s)
    assert floor == pytest.approx(7 * 64 * MIB / (2 * GIB) * 0.5e-3)


def test_rates_and_floors_of_zero_are_infinite_not_errors():
    assert bytes_per_second(100, 0.0) == float("inf")
    assert floor_seconds(100, 0.0) == float("inf")


def test_full_runs_use_buffers_of_a_gib_and_quick_runs_smaller_ones():
    full, quick = sizes(quick=False), sizes(quick=True)
    assert full.bandwidth_bytes >= GIB and full.array_bytes == 64 * MIB and not full.quick
    assert quick.bandwidth_bytes < full.bandwidth_bytes and quick.array_bytes < full.array_bytes
    assert quick.quick


def test_device_rows_write_their_bandwidth_and_target_to_json(tmp_path):
    table = Table("device")
    table.add(
        DeviceRow(
            "reduce",
            2e-3,
            1e-3,
            "bytes at D2D speed",
            bytes_moved=1000,
            gb_per_s=0.5,
            floor_gb_per_s=1.0,
            target="within 1.5x",
            met=False,
        )
    )
    report = tmp_path / "table.json"
    printed = io.StringIO()
    table.write(printed, json_path=str(report))
    (row,) = json.loads(report.read_text())["rows"]
    assert row["ratio"] == pytest.approx(2.0)
    assert row["gb_per_s"] == 0.5 and row["floor_gb_per_s"] == 1.0
    assert row["target"] == "within 1.5x" and row["met"] is False
    assert "reduce" in printed.getvalue()


def test_run_without_cupy_raises_a_benchmark_error_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(device, "cupy_module", lambda: None)
    with pytest.raises(
        akv.BenchmarkError, match=r"CuPy and a CUDA GPU.*not installed.*akvstore\[gpu\]"
    ):
        device.run()


def test_run_without_a_gpu_raises_a_benchmark_error(monkeypatch):
    monkeypatch.setattr(device, "cupy_module", lambda: object())
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    with pytest.raises(akv.BenchmarkError, match="sees no CUDA GPU"):
        device.run()


def test_the_cli_reports_a_suites_akv_error_in_one_line(
    monkeypatch, capsys, restore_bench_settings
):
    def fail() -> Table:
        raise akv.BenchmarkError("no GPU here")

    monkeypatch.setattr(device, "run", fail)
    assert akv.cli.main(["bench", "device", "--quick"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "akv bench: no GPU here\n"
    assert captured.out == ""


def test_the_device_suite_is_registered():
    assert akv.cli.BENCHMARKS["device"] == "akv.bench.device"


def test_the_module_imports_without_importing_cupy():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, akv.bench.device; assert 'cupy' not in sys.modules, 'cupy imported'",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: the suite would run")
def test_akv_bench_device_without_a_gpu_exits_1_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "akv", "bench", "device", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("akv bench: ")
    assert "CuPy" in lines[0] and "GPU" in lines[0]
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- every row, on a fake GPU

EXPECTED_ROWS = (
    "reduce 4 x",
    "SGD update",
    "Adam update",
    "small key",
    "H2D",
    "D2H",
    "akv push",
    "akv pull",
    "akv CuPy to a host key and back",
    "engine GPU task, chained",
    "engine GPU task, completion=host_func",
    "engine GPU task, completion=waiter",
)


def test_every_row_runs_on_the_fake_gpu(fake_cupy, monkeypatch, tmp_path):
    """The suite's code, run end to end on the fake CuPy with tiny buffers and one short
    round per measurement: it checks that each row is measured, named and checked, not
    any speed (the fake's times are the host's)."""
    monkeypatch.setattr(device, "sizes", lambda quick: Sizes(1 << 20, 64 << 10, quick=True))
    monkeypatch.setattr(device, "CHAIN_TASKS", 4)
    monkeypatch.setitem(device._SETTINGS, "rounds", 1)
    monkeypatch.setitem(device._SETTINGS, "min_round_s", 1e-4)
    table = device.run()
    names = [row.name for row in table.rows]
    for prefix in EXPECTED_ROWS:
        assert any(name.startswith(prefix) for name in names), (prefix, names)
    for row in table.rows:
        assert row.akv_s > 0 and row.floor_s > 0, row
    report = tmp_path / "device.json"
    table.write(io.StringIO(), json_path=str(report))
    assert {row["name"] for row in json.loads(report.read_text())["rows"]} == set(names)


# ---------------------------------------------------------------- on a real GPU


@pytest.mark.gpu
@pytest.mark.timeout(GPU_RUN_TIMEOUT_S + 60)
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_akv_bench_device_quick_reports_every_row_with_positive_times(tmp_path):
    report = tmp_path / "device.json"
    result = subprocess.run(
        [sys.executable, "-m", "akv", "bench", "device", "--quick", "--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GPU_RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "floor" in result.stdout and "ratio" in result.stdout
    rows = json.loads(report.read_text())["rows"]
    for prefix in EXPECTED_ROWS:
        assert any(row["name"].startswith(prefix) for row in rows), (prefix, result.stdout)
    for row in rows:
        assert row["akv_s"] > 0 and row["floor_s"] > 0, row
        assert row["ratio"] == pytest.approx(row["akv_s"] / row["floor_s"])
        if row["bytes_moved"]:
            assert row["gb_per_s"] > 0 and row["floor_gb_per_s"] > 0, row


def test_every_timed_call_returns_with_its_gpu_work_done(fake_cupy, monkeypatch):
    """Host wall-clock times mean something only when a call's GPU work is finished by
    the time it returns: a push that merely queues its update on the caller's stream
    would be timed as the cost of queuing. On the fake CuPy (lazy streams), no work may
    be left pending by any call that :func:`akv.bench.compare` times (the streams are run
    to their end before each call, so only the call's own work counts)."""
    monkeypatch.setattr(device, "sizes", lambda quick: Sizes(1 << 20, 64 << 10, quick=True))
    monkeypatch.setattr(device, "CHAIN_TASKS", 4)
    monkeypatch.setitem(device._SETTINGS, "rounds", 1)
    monkeypatch.setitem(device._SETTINGS, "min_round_s", 1e-4)
    real_compare = device.compare
    timed: list[str] = []
    left_pending: list[tuple[str, int]] = []

    def checked(fn):
        name = getattr(fn, "__qualname__", repr(fn))

        def call():
            fake_cupy.synchronize_all()
            fn()
            if fake_cupy.pending():
                left_pending.append((name, fake_cupy.pending()))

        return call

    def checking_compare(*fns, **kwargs):
        timed.extend(getattr(fn, "__qualname__", repr(fn)) for fn in fns)
        return real_compare(*(checked(fn) for fn in fns), **kwargs)

    monkeypatch.setattr(device, "compare", checking_compare)
    device.run()
    assert any(name.startswith("_update_row") for name in timed), timed
    assert left_pending == [], sorted(set(left_pending))


def test_the_small_key_floor_makes_as_many_device_copies_as_the_push_and_pull(
    fake_cupy, monkeypatch
):
    """akv's push and pull of a small key are two device copies (into the stored value,
    then into ``out``): the floor must be two copies too, not one."""
    monkeypatch.setitem(device._SETTINGS, "rounds", 1)
    monkeypatch.setitem(device._SETTINGS, "min_round_s", 1e-4)
    real_compare = device.compare
    copies: list[int] = []

    def counting(fn):
        def call():
            fake_cupy.synchronize_all()
            before = fake_cupy.counts["kernel"]
            fn()
            copies.append(fake_cupy.counts["kernel"] - before)

        return call

    def floor_counting_compare(push_pull, floor, **kwargs):
        counting(floor)()
        floor_copies = copies.pop()
        assert floor_copies == 2, floor_copies
        return real_compare(push_pull, floor, **kwargs)

    monkeypatch.setattr(device, "compare", floor_counting_compare)
    table = Table("device")
    device._small_key_row(table, fake_cupy)
    (row,) = table.rows
    assert row.floor.startswith("2 cupy.copyto"), row.floor
