"""The project's shape: public names, the layering rule, packaging, the command line, style."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import akv
import akv.errors
import engine
import transport

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"engine": {"akv", "transport"}, "transport": {"akv", "engine"}}


@pytest.mark.parametrize("package", [akv, engine, transport])
def test_every_public_name_exists(package):
    assert package.__all__, f"{package.__name__} exports nothing"
    for name in package.__all__:
        assert hasattr(package, name), f"{package.__name__}.{name} is listed but missing"


def test_every_akv_error_derives_from_the_base():
    for name in akv.errors.__all__:
        cls = getattr(akv.errors, name)
        assert issubclass(cls, akv.AKVError), name
        assert getattr(akv, name) is cls, f"akv.{name} is not re-exported"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_engine_and_transport_import_neither_akv_nor_each_other(package):
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN[package], f"{path} imports {name}"


def test_version_option():
    result = subprocess.run(
        [sys.executable, "-m", "akv", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"akv {akv.__version__}"


@pytest.mark.parametrize("suite", ["engine", "local"])
def test_bench_prints_a_table_with_a_floor_and_writes_json(tmp_path, suite):
    report = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "akv", "bench", suite, "--quick", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "floor" in result.stdout and "ratio" in result.stdout
    rows = json.loads(report.read_text())["rows"]
    assert rows
    for row in rows:
        assert row["akv_s"] > 0 and row["floor_s"] > 0
        assert row["ratio"] == pytest.approx(row["akv_s"] / row["floor_s"])


def test_a_plain_wheel_carries_every_package_and_py_typed(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("akv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("akv", "engine", "transport"):
        assert f"{package}/__init__.py" in names
        assert f"{package}/py.typed" in names
    assert "akv/optimizer/__init__.py" in names
    assert "akv/bench/local.py" in names
    for module in ("dist/worker", "dist/server", "dist/scheduler", "launch"):
        assert f"akv/{module}/__init__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for line in (
        "akv = akv.cli:main",
        "akv-launch = akv.launch:main",
        "akv-server = akv.dist.server:main",
        "akv-scheduler = akv.dist.scheduler:main",
    ):
        assert line in scripts


def test_types_are_checked():
    # No paths: mypy checks the `files` of pyproject's [tool.mypy], at the strictness set there.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_ruff_clean():
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fmt.returncode == 0, fmt.stdout
