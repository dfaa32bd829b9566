"""The README's examples run and print what their comments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_docs import python_blocks, run

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = python_blocks(README)
LOCAL_BLOCKS = [block for block in BLOCKS if "dist_sync" not in block]


def expected_lines(block: str) -> list[str]:
    return [
        line.split("# ", 1)[1].strip()
        for line in block.splitlines()
        if "print(" in line and "# " in line
    ]


def test_the_readme_has_examples_of_both_faces():
    assert len(LOCAL_BLOCKS) >= 2
    assert any("akv.create(" in b for b in LOCAL_BLOCKS)
    assert any("create_async" in b for b in LOCAL_BLOCKS)


@pytest.mark.parametrize("block", LOCAL_BLOCKS, ids=lambda b: b.splitlines()[0][:40])
def test_a_readme_example_prints_what_it_says(block):
    _, printed = run(block, "README.md")
    assert [line.strip() for line in printed] == expected_lines(block)
