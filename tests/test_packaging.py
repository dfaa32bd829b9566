"""What installing akv gives a user: packages no module of theirs can shadow, install hints
that name the distribution (``akvstore``; the import name is ``akv``), extras that install."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "akvstore"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_akv_imports_and_runs_beside_a_users_engine_and_transport_modules(tmp_path):
    # torchvision's detection reference scripts ship an engine.py; a script beside it must
    # still get akv's own packages.
    for name in ("engine", "transport"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import akv

            with akv.create("local") as kv:
                kv.init("w", np.zeros(3, np.float32))
                kv.push("w", [np.ones(3, np.float32)] * 2)
                print(kv.pull("w").tolist())
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[2.0,", "2.0,", "2.0]"]


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    suffixes = {".py", ".md", ".toml", ".sh", ".yml", ".txt"}
    return [ROOT / name for name in listed.stdout.split("\0") if Path(name).suffix in suffixes]


def test_every_install_hint_names_the_distribution():
    # The distribution named "akv" on PyPI is an unrelated project (Azure Key Vault secrets).
    wrong = re.compile(r"pip install(?: +[^\s#&;|`)]+)*? +['\"]?akv(?:\[|['\"`]| |$)", re.M)
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in _tracked_text_files()
        for match in wrong.finditer(path.read_text(errors="replace"))
    ]
    assert not found, found
    assert _project()["name"] == DISTRIBUTION


def test_the_extras_name_installable_wheels():
    extras = _project()["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", requirement)[0] for requirement in extras[extra]}

    # CuPy's prebuilt CUDA 12 wheel; the plain "cupy" distribution builds from source.
    assert names("gpu") == {"cupy-cuda12x"}
    # The PyTorch helper without JAX.
    assert "torch" in names("torch") and "jax" not in names("torch")
    assert {"pytest", "ruff", "mypy", "hypothesis"} <= names("test")
    # The suite builds the docs site and the benchmark charts.
    assert f"{DISTRIBUTION}[docs]" in extras["test"]
    assert {"mkdocs-material", "mkdocstrings-python", "matplotlib"} <= names("docs")
