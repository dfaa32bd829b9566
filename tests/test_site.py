"""The documentation site (mkdocs.yml): it builds with ``--strict``, so a broken link, a
missing page or a docstring mkdocstrings cannot read fails; every public name it documents
has a docstring."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

#: The modules whose public names (``__all__``) the API reference documents. akv.torch is
#: imported only where torch is installed (the docs build reads its source without torch).
DOCUMENTED = [
    "akv",
    "akv.optimizer",
    "akv.optimizer.lr_scheduler",
    "akv.compression",
    "akv.custom",
    "akv.errors",
    "akv.torch",
    "akv.ray",
    "akv_engine",
]
NEEDS = {"akv.torch": "torch", "akv.ray": "ray"}


def _module(name: str) -> ModuleType:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} needs {NEEDS[name]}")
    return importlib.import_module(name)


def _documentable(value: object) -> bool:
    """Classes, functions and modules carry docstrings; constants and type aliases do not
    (their ``#:`` comments are for readers of the source)."""
    return inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value)


def _has_doc(value: object) -> bool:
    # A class's own docstring (not a base class's); a method's may come from the method it
    # overrides (inspect.getdoc's rule, which the site follows with griffe_inherited_docstrings).
    doc = vars(value).get("__doc__") if inspect.isclass(value) else inspect.getdoc(value)
    return bool(doc and doc.strip())


def _public_members(cls: type) -> list[str]:
    kinds = (staticmethod, classmethod, property)
    return [
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, kinds))
    ]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_public_name_and_method_has_a_docstring(name):
    module = _module(name)
    missing = [] if _has_doc(module) else [name]
    for export in module.__all__:
        value = getattr(module, export)
        if not _documentable(value):
            continue
        if not _has_doc(value):
            missing.append(f"{name}.{export}")
        if inspect.isclass(value):
            missing += [
                f"{name}.{export}.{member}"
                for member in _public_members(value)
                if not _has_doc(getattr(value, member))
            ]
    assert not missing, f"no docstring: {missing}"


def _directives() -> set[str]:
    return {
        match
        for page in REFERENCE.glob("*.md")
        for match in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)
    }


@pytest.mark.parametrize("name", DOCUMENTED)
def test_the_reference_shows_every_public_name(name):
    module = _module(name)
    shown = _directives()
    if name in shown:
        return
    missing = [
        export
        for export in module.__all__
        if _documentable(value := getattr(module, export))
        and f"{name}.{export}" not in shown
        and getattr(value, "__module__", None) not in shown
        and getattr(value, "__name__", None) not in shown
    ]
    assert not missing, f"docs/reference/*.md shows none of {name}'s {missing}"


def test_the_site_builds_strictly_with_the_reference_and_repository_links(tmp_path):
    for module, package in (
        ("mkdocs", "mkdocs"),
        ("material", "mkdocs-material"),
        ("mkdocstrings_handlers.python", "mkdocstrings-python"),
        ("griffe_inherited_docstrings", "griffe-inherited-docstrings"),
    ):
        pytest.importorskip(module, reason=f"needs {package}: pip install -e '.[docs]'")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    stores = (site / "reference" / "stores" / "index.html").read_text()
    for method in ("akv.KVStore.pushpull", "akv.AsyncKVStore.row_sparse_pull"):
        assert f'id="{method}"' in stores, method
    # A link to a file outside the site points at it in the repository.
    started = (site / "getting-started" / "index.html").read_text()
    assert "https://github.com/akv-dev/akv/blob/main/examples/quickstart.py" in started
