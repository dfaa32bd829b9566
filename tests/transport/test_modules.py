"""The transport package's own shape: its modules import each other without a cycle."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import akv_transport as transport

PACKAGE = Path(transport.__file__).parent


def _transport_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("akv_transport.")}


def test_transport_modules_import_each_other_without_a_cycle():
    graph = {
        f"akv_transport.{path.stem}": _transport_imports(path)
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"an import cycle inside transport: {exc.args[1]}") from None
    assert "akv_transport._json" in order and "akv_transport._http_server" in order
