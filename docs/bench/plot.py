"""Draw the benchmark charts of docs/benchmarks.md from JSON (needs matplotlib: the docs extra).

Usage (from anywhere)::

    python docs/bench/plot.py [--out DIR] [JSON ...]

Without arguments it reads every ``docs/bench/data/*.json`` and writes ``docs/bench/NAME.png``
for each ``NAME.json``. Two kinds of input:

- what ``akv bench SUITE --json PATH`` writes (``{"title", "rows": [...], "notes"}``): one
  bar per operation for akv's time over its floor measured in the same run (1 = as fast as
  the floor), and, where a row carries MXNet 1.9.1's time (``reference_s``), how many times
  faster akv is;
- what ``docs/mxnet-comparison/side_by_side.py`` prints last (``{"akv": {operation: [one
  value per run]}, "mxnet": {...}}``, microseconds per call), optionally with ``title``,
  ``unit`` and ``higher_is_better`` (for rates such as keys/s): akv's and MXNet's medians
  side by side, with their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import ScalarFormatter

HERE = Path(__file__).resolve().parent
#: Colours that stay apart for the common kinds of colour blindness (Okabe and Ito).
AKV_COLOUR, MXNET_COLOUR, FLOOR_COLOUR = "#0072B2", "#E69F00", "#555555"
WIDTH_IN, ROW_IN, DPI = 10.0, 0.42, 100
#: Values spread wider than this share a chart on a log axis.
SPREAD_FOR_LOG = 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, help="JSON files (default: data/*.json)")
    parser.add_argument("--out", type=Path, default=HERE, help="where the PNGs go")
    args = parser.parse_args(argv)
    inputs = args.inputs or sorted((HERE / "data").glob("*.json"))
    if not inputs:
        parser.error("no JSON input")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in inputs:
        data = json.loads(path.read_text())
        target = args.out / f"{path.stem}.png"
        if "rows" in data:
            bench_chart(data, target)
        elif "akv" in data and "mxnet" in data:
            side_by_side_chart(data, target)
        else:
            parser.error(f"{path}: neither akv bench's JSON nor side_by_side.py's")
        print(target)
    return 0


def bench_chart(data: dict[str, Any], target: Path) -> None:
    """``akv bench --json``: akv / floor per operation, and the speedup over MXNet."""
    rows = data["rows"]
    names = [row["name"] for row in rows]
    with_mxnet = any(row.get("reference_s") for row in rows)
    figure, axes = plt.subplots(
        1,
        2 if with_mxnet else 1,
        figsize=(WIDTH_IN, 1.2 + ROW_IN * len(rows)),
        sharey=True,
        squeeze=False,
    )
    ratios = [row["akv_s"] / row["floor_s"] for row in rows]
    _bars(axes[0][0], names, ratios, AKV_COLOUR, "{:.2f}")
    axes[0][0].axvline(1.0, color=FLOOR_COLOUR, linewidth=1)
    axes[0][0].set_xscale("log")
    axes[0][0].xaxis.set_major_formatter(ScalarFormatter())
    axes[0][0].set_xlabel("akv time / floor time in the same run\n(1: as fast as the floor)")
    if with_mxnet:
        speedups = [
            row["reference_s"] / row["akv_s"] if row.get("reference_s") else None for row in rows
        ]
        _bars(axes[0][1], names, speedups, MXNET_COLOUR, "{:.2f}x")
        axes[0][1].axvline(1.0, color=FLOOR_COLOUR, linewidth=1)
        axes[0][1].set_xlabel("MXNet 1.9.1 time / akv time\n(above 1: akv is faster)")
    axes[0][0].invert_yaxis()  # the first row on top (the axes share it)
    figure.suptitle(data.get("title", target.stem), fontsize=11)
    _save(figure, target)


def side_by_side_chart(data: dict[str, Any], target: Path) -> None:
    """``side_by_side.py``: akv's and MXNet's medians per operation, with their ratio."""
    unit = data.get("unit", "us")
    higher_is_better = bool(data.get("higher_is_better", False))
    names = [name for name in data["akv"] if name in data["mxnet"]]
    ours = [statistics.median(data["akv"][name]) for name in names]
    theirs = [statistics.median(data["mxnet"][name]) for name in names]
    figure, axis = plt.subplots(figsize=(WIDTH_IN, 1.6 + 2 * ROW_IN * len(names)))
    positions = list(range(len(names)))
    height = 0.38
    axis.barh([p - height / 2 for p in positions], ours, height, color=AKV_COLOUR, label="akv")
    axis.barh(
        [p + height / 2 for p in positions], theirs, height, color=MXNET_COLOUR, label="MXNet 1.9.1"
    )
    for position, akv_value, mxnet_value in zip(positions, ours, theirs, strict=True):
        faster = akv_value / mxnet_value if higher_is_better else mxnet_value / akv_value
        axis.annotate(
            f"akv {faster:.2f}x {'faster' if faster >= 1 else 'as fast'}",
            (max(akv_value, mxnet_value), position),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    axis.set_yticks(positions, names)
    axis.invert_yaxis()
    if max(ours + theirs) > SPREAD_FOR_LOG * min(ours + theirs):
        axis.set_xscale("log")
    axis.set_xlabel(f"{unit} ({'higher' if higher_is_better else 'lower'} is better; median)")
    axis.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    axis.margins(x=0.3)
    figure.suptitle(data.get("title", target.stem), fontsize=11)
    _save(figure, target)


def _bars(axis: Any, names: list[str], values: list[float | None], colour: str, label: str) -> None:
    positions = list(range(len(names)))
    axis.barh(positions, [value or 0.0 for value in values], color=colour)
    for position, value in zip(positions, values, strict=True):
        text = "-" if value is None else label.format(value)
        axis.annotate(
            text,
            (value or 0.0, position),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    axis.set_yticks(positions, names)
    axis.margins(x=0.2)


def _save(figure: Any, target: Path) -> None:
    figure.tight_layout()
    # No software version in the file, so a redraw with the same numbers changes nothing
    # that a newer matplotlib does not also change.
    figure.savefig(target, dpi=DPI, metadata={"Software": None})
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
