"""docs/bench/plot.py draws the charts of docs/benchmarks.md from the committed JSON, and
reads what `akv bench --json` and docs/mxnet-comparison/side_by_side.py write."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from akv.bench._report import Row, Table

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
DATA = sorted((BENCH / "data").glob("*.json"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib", reason="needs matplotlib: pip install -e '.[docs]'")
_spec = importlib.util.spec_from_file_location("plot", BENCH / "plot.py")
assert _spec is not None and _spec.loader is not None
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)


def _plot(out: Path, *inputs: Path) -> list[Path]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert plot.main(["--out", str(out), *map(str, inputs)]) == 0
    return [Path(line) for line in printed.getvalue().split()]


def test_the_committed_json_draws_a_chart_each(tmp_path):
    assert DATA, "docs/bench/data/ holds no JSON"
    written = _plot(tmp_path)
    assert sorted(path.name for path in written) == sorted(f"{p.stem}.png" for p in DATA)
    for path in written:
        assert path.read_bytes().startswith(PNG_MAGIC)


def test_every_chart_is_committed_and_shown_on_the_benchmarks_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for data in DATA:
        assert (BENCH / f"{data.stem}.png").is_file(), f"{data.stem}.png is not committed"
        assert f"](bench/{data.stem}.png)" in page, f"benchmarks.md does not show {data.stem}"


def test_it_reads_what_akv_bench_and_side_by_side_write(tmp_path):
    table = Table("akv bench test")
    table.add(Row("push+pull 4 MiB", 2e-4, 1e-4, "2 x np.copyto", reference_s=4.5e-4))
    table.add(Row("1000 small keys", 5e-3, 1e-3, "np.copyto", unit_ops=1000))
    bench = tmp_path / "bench.json"
    table.write(io.StringIO(), str(bench))
    # side_by_side.py's last line: microseconds per call, one value per run.
    side = tmp_path / "side.json"
    side.write_text(json.dumps({"akv": {"small pull": [451, 460]}, "mxnet": {"small pull": [878]}}))
    written = _plot(tmp_path / "charts", bench, side)
    assert [path.name for path in written] == ["bench.png", "side.png"]


def test_it_refuses_json_of_another_kind(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"something": "else"}))
    with pytest.raises(SystemExit) as exited:
        plot.main(["--out", str(tmp_path), str(other)])
    assert exited.value.code == 2
    assert "neither akv bench's JSON nor side_by_side.py's" in capsys.readouterr().err
