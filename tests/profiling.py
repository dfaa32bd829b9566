"""The scripts of docs/profiling, loaded as modules so that tests can call their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

PROFILING = Path(__file__).resolve().parents[1] / "docs" / "profiling"


def load(name: str) -> ModuleType:
    """``docs/profiling/{name}.py``, executed once as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, PROFILING / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
