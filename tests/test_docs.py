"""The docs' complete examples run and do what their comments say.

The README's examples are tested in tests/test_readme.py, with :func:`run` from here. Here:
the examples in docs/ that are whole programs (the rest are fragments of a training loop
or of a job under akv-launch, which the job tests run in full).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
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


def test_the_row_sparse_example_updates_only_the_pushed_rows_as_its_comment_says():
    block = blocks("sparse.md")[0]
    comment = re.search(r"print\(rows.indices, rows.data\[:, 0\]\)  # (.*)", block)
    assert comment is not None
    _, printed = run(block, "sparse.md")
    assert printed == [comment.group(1)]


def test_the_custom_store_example_sums_as_its_comment_says():
    (block,) = [b for b in blocks("api.md") if "KVStoreBase.register" in b]
    comment = re.search(r"print\(out\)  # (.*)", block)
    assert comment is not None
    try:
        namespace, printed = run(block, "api.md")
        assert isinstance(namespace["kv"], akv.KVStoreBase)
        assert printed == [comment.group(1)]
    finally:
        akv.KVStoreBase.kv_registry.pop("sumstore", None)


def test_the_compression_example_sends_as_its_comments_say():
    block = blocks("compression.md")[0]
    comments = re.findall(r"print\(kv.pull\(\"w\"\)\)  # (.*)", block)
    _, printed = run(block, "compression.md")
    assert printed == comments and len(comments) == 2


def test_the_embedding_example_of_torch_md_prints_what_its_comment_says():
    pytest.importorskip("torch")
    (block,) = [b for b in blocks("torch.md") if "akv.torch.Embedding(kv" in b and "print" in b]
    comment = re.search(r"\.tolist\(\)\)  # (.*)", block)
    assert comment is not None
    _, printed = run(block, "torch.md")
    assert printed == [comment.group(1)]


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


def section(path: Path, title: str) -> str:
    """The text of the ``## title`` section of a Markdown file, up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", path.read_text(), re.M | re.S)
    assert match is not None, f"{path.name} has no section '## {title}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``text``, as lists of stripped cells."""
    match = re.search(r"^\|.*\n(?:\|.*\n?)*", text, re.M)
    assert match is not None, "no table"
    lines = match.group(0).splitlines()
    assert len(lines) > 2 and set(lines[1]) <= set("|-: "), "no table"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then the rest
    by ``getattr`` (a class, then its method)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            found: object = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # a module that exists failed to import something else
            continue
        for attribute in parts[end:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(f"no module in {path!r}")


def test_every_answer_of_where_is_it_decided_names_a_function_that_exists():
    rows = table_rows(section(DOCS / "architecture.md", "Where is it decided"))
    assert len(rows) >= 25
    questions = [row[0] for row in rows]
    assert len(set(questions)) == len(questions), "a question is asked twice"
    for row in rows:
        assert len(row) == 3 and all(row), f"not a row of question, where, how: {row}"
        question, where, _ = row
        paths = re.findall(r"`([^`]+)`", where)
        assert paths, f"{question!r}: no path in `where`"
        for path in paths:
            assert re.fullmatch(r"(akv|akv_engine|akv_transport)(\.\w+)+", path), (
                f"{question!r}: {path!r} is not a fully qualified dotted path"
            )
            try:
                found = resolve(path)
            except (ImportError, AttributeError) as exc:
                pytest.fail(f"{question!r}: {path} does not resolve: {exc!r}")
            assert callable(found) or isinstance(found, property), (
                f"{question!r}: {path} is not a function, method or class"
            )


GUIDE = DOCS / "migrating-from-mxnet.md"
#: Every method and property of MXNet 1.9.1's KVStore (python/mxnet/kvstore/kvstore.py and
#: base.py, the private ones that scripts call included), and what MXNet has only in its C API.
MXNET_METHODS = [
    "init",
    "push",
    "pull",
    "pushpull",
    "row_sparse_pull",
    "broadcast",
    "set_optimizer",
    "_set_updater",
    "set_gradient_compression",
    "save_optimizer_states",
    "load_optimizer_states",
    "_barrier",
    "_send_command_to_servers",
    "is_capable",
    "type",
    "rank",
    "num_workers",
    "register",
    "kv_registry",
    "OPTIMIZER",
    "set_barrier_before_exit",
    "num_dead_node",
]


def _mentioned(text: str, name: str) -> bool:
    return re.search(rf"`(?:[\w.]+\.)?{re.escape(name)}\b", text) is not None


@pytest.mark.parametrize("face", [akv.KVStore, akv.AsyncKVStore], ids=lambda c: c.__name__)
def test_the_migration_guide_names_every_public_method_of_the_stores(face):
    methods = section(GUIDE, "Methods")
    missing = [
        name for name in dir(face) if not name.startswith("_") and not _mentioned(methods, name)
    ]
    assert not missing, f"docs/migrating-from-mxnet.md's Methods leave out {missing}"


def test_the_migration_guide_names_every_method_of_mxnets_kvstore():
    first_column = [row[0] for row in table_rows(section(GUIDE, "Methods"))]
    missing = [
        name for name in MXNET_METHODS if not any(_mentioned(cell, name) for cell in first_column)
    ]
    assert not missing, missing


def test_the_migration_guide_names_every_store_type():
    types = section(GUIDE, "Store types")
    assert [name for name in akv.STORE_TYPES if not _mentioned(types, name)] == []


def test_the_migration_guide_names_every_mxnet_variable_akv_mentions():
    # The variables akv reads or names in its messages and docstrings: in its strings.
    strings = [
        node.value
        for top in ("akv", "akv_engine", "akv_transport")
        for path in (DOCS.parent / top).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    names = {name for text in strings for name in re.findall(r"\b(?:DMLC|MXNET|PS)_[A-Z_]+", text)}
    assert {"DMLC_ROLE", "MXNET_KVSTORE_BIGARRAY_BOUND"} <= names
    variables = section(GUIDE, "Environment variables")
    assert [name for name in sorted(names) if not _mentioned(variables, name)] == []


def test_the_api_pages_error_table_names_every_error_akv_raises():
    """Every subclass of ``akv.AKVError`` in ``akv.errors`` has a row of its own, or a
    place in a row that names several, in docs/api.md's table of errors."""
    import akv.errors

    table = section(DOCS / "api.md", "Errors")
    errors = [
        name
        for name, value in vars(akv.errors).items()
        if isinstance(value, type)
        and issubclass(value, akv.AKVError)
        and not name.startswith("_")
        and value is not akv.AKVError
    ]
    missing = [name for name in errors if not re.search(rf"^\|[^|]*`{name}`", table, re.M)]
    assert not missing, f"docs/api.md's table of errors leaves out {missing}"


def test_deployments_flag_table_names_every_flag_of_akv_scheduler_and_akv_server():
    from akv.cluster.roles import role_parser

    text = (DOCS / "deployment.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `--"))
    flags = {
        option
        for role in ("scheduler", "server")
        for action in role_parser(role, "")._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    missing = sorted(flag for flag in flags if f"`{flag}`" not in table)
    assert not missing, f"docs/deployment.md's table of flags leaves out {missing}"
