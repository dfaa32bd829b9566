"""``akv bench fusion``: the size it states for ResNet-18's parameters."""

from __future__ import annotations

from pathlib import Path

import akv.bench.fusion as fusion
from akv.bench.steps import elements, resnet18_shapes

ROOT = Path(__file__).resolve().parents[2]


def test_the_stated_size_of_resnet18s_parameters_is_their_float32_bytes():
    shapes = [shape for _, shape in resnet18_shapes()]
    assert elements(shapes) == 11_689_512
    size = f"{elements(shapes) * 4 / 2**20:.1f} MiB"
    assert size == "44.6 MiB"
    assert f"{size} of float32" in (fusion.__doc__ or "")
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert f"ResNet-18's 62 parameter arrays ({size})" in docs
