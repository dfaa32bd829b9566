"""The project's shape: public names, the layering rule, packaging, the command line, style."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import zipfile
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")
import tomllib

import akv
import akv.errors
import akv_engine as engine
import akv_transport as transport

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "akv_engine": {"akv", "akv_transport"},
    "akv_transport": {"akv", "akv_engine"},
}


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


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


#: What a pure module (one that decides, see docs/architecture.md) must not import.
#: (The engine schedules work: a module that decides hands that to its caller.)
IO_MODULES = {
    "asyncio",
    "socket",
    "selectors",
    "subprocess",
    "threading",
    "aiohttp",
    "ssl",
    "akv_engine",
}
#: Private modules that do I/O (a pure module imports none, whatever it imports them for).
IO_PRIVATE_MODULES = (
    "akv_engine._loop",
    "akv_transport._http_client",
    "akv_transport._http_guard",
    "akv_transport._http_server",
    "akv_transport._stream",
)
PURE_EXCEPTIONS = {
    # A lock is no I/O: the key table is shared by the threads that call a blocking store;
    # an entry holds its engine var (a handle; the table never schedules anything).
    "akv.keys": {"threading", "akv_engine"},
    # The backend protocol returns engine tasks: it is the seam to the engine.
    "akv.backend": {"akv_engine"},
    # A lock (the optimizer's shared state) and a thread-local (each thread's scratch
    # buffers for updates) are no I/O either.
    "akv.optimizer._base": {"threading"},
    "akv.optimizer._kernels": {"threading"},
}
#: akv's pure modules: they decide and do no I/O (docs/architecture.md lists them too).
PURE_AKV_MODULES = [
    "akv.args",
    "akv.backend",
    "akv.errors",
    "akv.keys",
    "akv.limits",
    "akv.local_rows",
    "akv.compression",
    "akv.row_args",
    "akv.rows",
    "akv.sparse",
    "akv.optimizer",
    "akv.optimizer._adam_variants",
    "akv.optimizer._adaptive",
    "akv.optimizer._base",
    "akv.optimizer._contrib",
    "akv.optimizer._kernels",
    "akv.optimizer._sgd",
    "akv.optimizer._states",
    "akv.optimizer._updater",
    "akv.optimizer.lr_scheduler",
    "akv.cluster.config",
    "akv.cluster.placement",
    "akv.cluster.protocol",
    "akv.cluster.states",
    "akv.cluster.server.buffers",
    "akv.cluster.server.checkpoint_header",
    "akv.cluster.server.checks",
    "akv.cluster.server.dense_keys",
    "akv.cluster.server.durability",
    "akv.cluster.server.inits",
    "akv.cluster.server.instructions",
    "akv.cluster.server.rounds",
    "akv.cluster.server.row_keys",
    "akv.cluster.server.staleness",
    "akv.cluster.server.state",
    "akv.cluster.server.updates",
    "akv.cluster.server.views",
    "akv.cluster.worker.events",
    "akv.cluster.worker.instructions",
    "akv.cluster.worker.pipeline",
    "akv.cluster.worker.reconnect",
    "akv.cluster.worker.rows",
    "akv.cluster.worker.requests",
    "akv.cluster.worker.state",
    "akv.cluster.scheduler.metrics",
    "akv.cluster.scheduler.roster",
    "akv.cluster.scheduler.sessions",
    "akv.cluster.scheduler.status",
    "akv.cluster.scheduler.status_html",
    "akv.cluster.server.report",
    "akv.cluster.worker.activity",
    "akv.launch.args",
    "akv.launch.devices",
    "akv.launch.hosts",
    "akv.launch.limits",
    "akv.launch.plans",
    "akv.launch.report",
    "akv.launch.rules",
    "akv.launch.spec",
    "akv_transport.frame",
    "akv_transport._reader",
    "akv_transport._json",
    "akv_transport._admission",
    "akv_transport._auth",
]


def test_mypy_checks_everything_with_the_strict_flags():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    assert sorted(config["files"]) == ["akv", "akv_engine", "akv_transport"]
    for override in config.get("overrides", []):
        # Only packages without type information may be let off, and only for that.
        assert set(override) == {"module", "ignore_missing_imports"}, override


@pytest.mark.parametrize("module", PURE_AKV_MODULES)
def test_pure_modules_do_no_io(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    allowed = PURE_EXCEPTIONS.get(module, set())
    for name in _imports(path):
        top = name.split(".")[0]
        assert top not in IO_MODULES - allowed, f"{module} imports {name}"
        assert name not in IO_PRIVATE_MODULES, name


def test_the_pure_modules_include_the_servers_state_machine():
    assert {"akv.cluster.server.state", "akv.cluster.worker.requests", "akv.launch.rules"} <= set(
        PURE_AKV_MODULES
    )


def test_no_source_or_test_file_is_ignored_by_git():
    files = [
        str(path.relative_to(ROOT))
        for top in ("akv", "akv_engine", "akv_transport", "tests", "examples", "docs")
        for path in (ROOT / top).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    ]
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(files),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    if result.returncode == 128:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    assert result.stdout == "", f"ignored by .gitignore: {result.stdout}"


def test_every_test_file_is_collected():
    """Every test file is collected, or skipped whole with a reason (torch or JAX missing)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = result.stdout.splitlines()
    collected = {line.split("::")[0] for line in lines if "::" in line}
    skipped = {
        match.group(1)
        for line in lines
        if (match := re.match(r"SKIPPED \[\d+\] ([^:]+\.py):\d+: \S", line))
    }
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert on_disk - collected - skipped == set(), "test files pytest does not collect"


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
    if suite == "local":  # the ways of waiting for 1000 small calls issued without awaiting
        names = {row["name"] for row in rows}
        for way in ("gathered", "awaited", "wait_all"):
            assert f"async 1000 keys x 16 floats, issued+{way}" in names


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
    (wheel,) = tmp_path.glob("akvstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Nothing top-level that a user's own module (engine.py, transport.py) could shadow.
    tops = {name.split("/")[0] for name in names}
    assert tops == {"akv", "akv_engine", "akv_transport", f"akvstore-{akv.__version__}.dist-info"}
    for package in ("akv", "akv_engine", "akv_transport"):
        assert f"{package}/__init__.py" in names
        assert f"{package}/py.typed" in names
    assert "akv/optimizer/__init__.py" in names
    assert "akv/bench/local.py" in names
    for module in ("cluster/worker", "cluster/server", "cluster/scheduler", "launch"):
        assert f"akv/{module}/__init__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for line in (
        "akv = akv.cli:main",
        "akv-launch = akv.launch:main",
        "akv-server = akv.cluster.server:main",
        "akv-scheduler = akv.cluster.scheduler:main",
    ):
        assert line in scripts
    info = f"akvstore-{akv.__version__}.dist-info"
    assert "Apache License" in zipfile.ZipFile(wheel).read(f"{info}/licenses/LICENSE").decode()
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode().splitlines()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    urls = {line.split(": ", 1)[1].split(",")[0] for line in metadata if line.startswith("Proj")}
    assert urls == {"Homepage", "Documentation", "Source", "Issues"}
    classifiers = {line.split(": ", 1)[1] for line in metadata if line.startswith("Classifier")}
    assert "Programming Language :: Python :: 3.10" in classifiers
    assert {"Development Status", "Intended Audience", "Operating System"} <= {
        classifier.split(" :: ")[0] for classifier in classifiers
    }


@pytest.mark.timeout(360)  # the bound is mypy's own 300 s (a cold cache on a loaded machine)
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


#: Folder names that tools take for their own output and skip by default (ruff, pytest's
#: norecursedirs, .gitignore templates, code maps).
TOOL_OUTPUT_NAMES = {"dist", "build", "node_modules", "venv", "site-packages", "_build"}


def test_no_code_folder_has_a_name_tools_reserve():
    named = [
        path.relative_to(ROOT)
        for top in ("akv", "akv_engine", "akv_transport", "tests", "examples", "docs")
        for path in (ROOT / top).rglob("*")
        if path.is_dir() and path.name in TOOL_OUTPUT_NAMES
    ]
    assert not named, named


def test_ruff_sees_every_code_folder_with_its_defaults():
    """pyproject.toml keeps ruff's default exclusions: no folder of ours needs an override."""
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for path in ("akv/cluster/protocol.py", "tests/akv/cluster/test_store.py"):
        assert str(ROOT / path) in listed, path
    config = (ROOT / "pyproject.toml").read_text()
    assert "exclude" not in config and "norecursedirs" not in config


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


def _module_names() -> dict[str, Path]:
    names = {}
    for top in ("akv", "akv_engine", "akv_transport"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _runtime_imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The library modules ``module`` imports when it runs: at import time or inside its
    functions; ``if TYPE_CHECKING:`` blocks aside (annotations only)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def nearest(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                nearest(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                nearest(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def test_no_import_cycle_in_the_library():
    known = _module_names()
    graph = {name: _runtime_imports(path, name, known) for name, path in known.items()}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        raise AssertionError(f"an import cycle: {' -> '.join(exc.args[1])}") from None
    assert "akv.cluster.worker.backend" in graph["akv.store"]  # imports in functions count


def test_no_akv_code_sends_the_token_as_a_bearer_header():
    """akv's own requests are signed (akv_transport._auth): a Bearer header would send the
    token itself, in clear text without TLS (servers accept it only for other tools)."""
    sending = re.compile(r"""["']Bearer \{""")
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("akv", "akv_transport")
        for path in sorted((ROOT / package).rglob("*.py"))
        if sending.search(path.read_text())
    ]
    assert offenders == []
