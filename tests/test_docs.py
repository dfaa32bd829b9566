"""The docs' complete examples run and do what their comments say.

The README's examples are tested in tests/test_readme.py, with :func:`run` from here. Here:
the examples in docs/ that are whole programs (the rest are fragments of a training loop
or of a job under akv-launch, which the job tests run in full).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import akv

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def blocks(name: str) -> list[str]:
    return python_blocks(DOCS / name)


def run(block: str, name: str) -> tuple[dict[str, Any], list[str]]:
    """Run ``block`` (compiled as file ``name``) as a program; its namespace and the lines
    it printed."""
    namespace: dict[str, Any] = {"__name__": "docs"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, name, "exec"), namespace)
    return namespace, out.getvalue().splitlines()


def test_the_first_example_of_getting_started_sums_then_applies_sgd():
    block = blocks("getting-started.md")[0]
    assert "# all 4.0" in block and "# all 3.9" in block
    _, printed = run(block, "getting-started.md")
    values = [float(v) for v in re.findall(r"\d+\.\d*", "\n".join(printed))]
    assert len(values) == 12  # two 2x3 arrays
    assert values[:6] == [4.0] * 6
    assert values[6:] == pytest.approx([3.9] * 6)


def test_the_errors_shown_in_getting_started_are_the_ones_raised():
    (block,) = [b for b in blocks("getting-started.md") if ">>>" in b]
    lines = block.strip().splitlines()
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    assert len(pairs) == 2
    with akv.create("local") as kv:
        kv.init("w", np.zeros((2, 3), np.float32))  # as the first example does
        for call, shown in pairs:
            assert call.startswith(">>> ")
            with pytest.raises(akv.AKVError) as caught:
                eval(call[4:], {"kv": kv, "np": np})
            error = caught.value
            assert f"{type(error).__module__}.{type(error).__name__}: {error}" == shown
            np.testing.assert_array_equal(kv.pull("w"), np.zeros((2, 3), np.float32))


def test_the_torch_example_of_getting_started_pulls_into_the_parameter_in_place():
    pytest.importorskip("torch")
    (block,) = [b for b in blocks("getting-started.md") if "import torch" in b]
    assert "weight is now [2, 2, 2, 2]" in block
    namespace, _ = run(block, "getting-started.md")
    assert namespace["weight"].tolist() == [2.0, 2.0, 2.0, 2.0]


def test_the_optimizer_example_updates_the_weight_as_its_comment_says():
    (block,) = blocks("optimizer.md")
    assert "# weight is now 0.89999" in block
    namespace, _ = run(block, "optimizer.md")
    np.testing.assert_allclose(namespace["weight"], np.full(4, 0.89999, np.float32), rtol=1e-6)
    assert isinstance(namespace["data"], bytes) and namespace["data"]
