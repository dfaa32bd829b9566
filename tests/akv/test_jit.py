"""akv.jit: the compiled row kernels compute what NumPy computes, bit for bit, and akv works
(in NumPy) without them: numba missing, unusable, or ``AKV_JIT=0``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import akv
from akv import jit
from akv import optimizer as opt
from akv.errors import ConfigError
from akv.local_rows import sum_rows
from akv.rows import RowTable
from akv.sparse import RowSparseArray

pytest.importorskip("numba", reason="numba has no wheel for this platform")

ROWS = 50


@pytest.fixture
def fresh_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    """akv.jit as before its first use, restored afterwards."""
    monkeypatch.setattr(jit, "_kernels", None)
    monkeypatch.setattr(jit, "_failed", False)
    monkeypatch.setattr(jit, "_loading", None)


def _bits(array: np.ndarray) -> np.ndarray:
    """The array's bytes, so that -0.0 and 0.0, and NaN payloads, compare as they are."""
    return np.ascontiguousarray(array).view(np.uint8)


def _values(rng: np.random.Generator, dtype: str, row_shape: tuple[int, ...], count: int):
    values = []
    for _ in range(count):
        ids = np.unique(rng.integers(0, ROWS, rng.integers(0, 30)))
        data = rng.standard_normal((ids.size, *row_shape)).astype(dtype)
        if data.size:
            # Values whose bits a sloppy sum would change: a negative zero (0.0 + -0.0 is
            # +0.0), an infinity and a NaN.
            data.reshape(-1)[: min(3, data.size)] = [-0.0, np.inf, np.nan][: min(3, data.size)]
        value = RowSparseArray(data, ids, (ROWS, *row_shape))
        value.data.flags.writeable = len(values) % 2 == 0  # read-only rows are summed too
        values.append(value)
    return values


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("row_shape", [(), (7,), (2, 3)])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_compiled_sum_of_row_pushes_is_numpys_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: str, row_shape: tuple[int, ...], count: int
) -> None:
    for seed in range(5):
        values = _values(np.random.default_rng(seed), dtype, row_shape, count)
        monkeypatch.setenv("AKV_JIT", "1")
        compiled = sum_rows(values)
        monkeypatch.setenv("AKV_JIT", "0")
        plain = sum_rows(values)
        np.testing.assert_array_equal(compiled.indices, plain.indices)
        assert compiled.data.dtype == plain.data.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(_bits(compiled.data), _bits(plain.data))


def _rounds(monkeypatch: pytest.MonkeyPatch, jit_on: str, optimizer: opt.Optimizer, dtype: str):
    """Four rounds of lazy row updates by ``optimizer``; the table's rows, the update
    count and the states as save_optimizer_states writes them."""
    monkeypatch.setenv("AKV_JIT", jit_on)
    if jit_on == "1":  # every round in place: the gathered update is never called

        def gathered(*args: object) -> None:
            pytest.fail("the rows were gathered, not updated in place")

        monkeypatch.setattr(optimizer, "update_rows", gathered)
    rng = np.random.default_rng(7)
    updater = opt.get_updater(optimizer)
    table = RowTable((ROWS, 4), np.dtype(dtype))
    table.scatter(np.array([1, 5, 9]), rng.standard_normal((3, 4)).astype(dtype))
    for _ in range(4):
        ids = np.unique(rng.integers(0, ROWS, 12))
        grad = RowSparseArray(rng.standard_normal((ids.size, 4)).astype(dtype), ids, (ROWS, 4))
        updater.update_rows("emb", table, grad)
    stored = np.sort(table.ids())
    return stored, table.gather(stored), optimizer.num_update, updater.dump_states()


IN_PLACE = [
    ("SGD", {"learning_rate": 0.1}),
    ("SGD", {"learning_rate": 0.37, "wd": 0.013, "rescale_grad": 0.5}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    ("SGD", {"learning_rate": 0.37, "momentum": 0.5, "wd": 0.013, "rescale_grad": 0.5}),
    ("Adam", {"learning_rate": 0.01}),
    ("Adam", {"learning_rate": 0.3, "wd": 0.02, "rescale_grad": 0.25, "beta1": 0.8}),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    ("name", "settings"), IN_PLACE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(IN_PLACE)]
)
def test_an_update_in_place_is_the_gathered_update_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: str, name: str, settings: dict[str, float]
) -> None:
    def make() -> opt.Optimizer:
        optimizer = getattr(opt, name)(**settings)
        assert optimizer.row_states_in_place(0, np.dtype(dtype)) is not None
        return optimizer

    ids, rows, count, states = _rounds(monkeypatch, "1", make(), dtype)
    plain_ids, plain_rows, plain_count, plain_states = _rounds(monkeypatch, "0", make(), dtype)
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_array_equal(_bits(rows), _bits(plain_rows))
    assert count == plain_count == 4
    assert states == plain_states  # the momentum, Adam's moments: the same rows and bits


def test_only_sgd_and_adam_update_in_place_and_not_with_clipping_or_a_narrow_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AKV_JIT", "1")
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert opt.SGD().row_states_in_place(0, f32) == 0
    assert opt.SGD(momentum=0.9).row_states_in_place(0, f32) == 1
    assert opt.Adam().row_states_in_place(0, f32) == 2
    assert opt.SGD(clip_gradient=1.0).row_states_in_place(0, f32) is None
    assert opt.Adam(clip_gradient=1.0).row_states_in_place(0, f32) is None
    assert opt.SGD().row_states_in_place(0, f16) is None
    assert opt.AdaGrad().row_states_in_place(0, f32) is None
    assert opt.AdamW().row_states_in_place(0, f32) is None
    monkeypatch.setenv("AKV_JIT", "0")
    assert opt.SGD().row_states_in_place(0, f32) is None

    # Arrays that do not fit change and count nothing.
    monkeypatch.setenv("AKV_JIT", "1")
    sgd, table = opt.SGD(momentum=0.9), np.ones((3, 4), np.float32)
    mom = (np.zeros((3, 4), np.float32), np.array([0, 1], np.int64))
    slots, grad = np.array([0, 2], np.int64), np.ones((2, 4), np.float32)
    for args in [
        (table, slots, grad, []),  # the momentum missing
        (table, slots, grad.astype(np.float64), [mom]),
        (table, slots.astype(np.int32), grad, [mom]),
        (table, slots, np.ones((3, 4), np.float32), [mom]),
    ]:
        assert not sgd.update_rows_in_place(0, *args)
    np.testing.assert_array_equal(table, 1.0)
    assert sgd.num_update == 0


def test_a_subclass_of_sgd_updates_rows_with_its_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AKV_JIT", "1")

    class Doubling(opt.SGD):
        def update_rows(self, index, weight, grad, state) -> None:
            self._update_count(index)
            weight += 2 * grad

    optimizer = Doubling()
    assert optimizer.row_states_in_place(0, np.dtype(np.float32)) is None
    table = RowTable((ROWS, 2), np.float32)
    grad = RowSparseArray(np.ones((2, 2), np.float32), np.array([3, 4]), (ROWS, 2))
    opt.get_updater(optimizer).update_rows("emb", table, grad)
    np.testing.assert_array_equal(table.gather([3, 4]), 2.0)


def test_an_in_place_update_is_sgds_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AKV_JIT", "1")
    table = np.full((3, 2), 2.0, np.float32)
    grad = np.array([[1.0, -1.0], [4.0, 0.0]], np.float32)
    assert opt.SGD(learning_rate=0.5, wd=0.1).update_rows_in_place(
        0, table, np.array([2, 0], np.int64), grad
    )
    # (1 - lr*wd) * w - lr * g, row 2 with grad[0] and row 0 with grad[1]; row 1 untouched.
    np.testing.assert_allclose(table, [[-0.1, 1.9], [2.0, 2.0], [1.4, 2.4]], rtol=1e-6)


def test_without_numba_the_rows_are_summed_and_updated_in_numpy(
    monkeypatch: pytest.MonkeyPatch, fresh_jit: None
) -> None:
    monkeypatch.setenv("AKV_JIT", "1")
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    assert not jit.available()
    values = _values(np.random.default_rng(3), "float32", (4,), 2)
    total = sum_rows(values)
    dense = values[0].to_dense() + values[1].to_dense()
    np.testing.assert_array_equal(total.to_dense(), dense)
    assert not opt.SGD().update_rows_in_place(
        0, np.ones((3, 4), np.float32), np.array([1], np.int64), np.ones((1, 4), np.float32)
    )


def test_a_numba_that_cannot_compile_here_is_turned_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, fresh_jit: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AKV_JIT", "1")

    def broken() -> None:
        raise RuntimeError("cannot cache function 'merge_rows': no locator available")

    monkeypatch.setattr(jit, "_compile", broken)
    with caplog.at_level(logging.WARNING, logger="akv"):
        assert jit.kernels() is None
        assert jit.kernels() is None  # tried once
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == [
        "akv: numba's compiled row kernels are off, NumPy does their work: RuntimeError: "
        "cannot cache function 'merge_rows': no locator available"
    ]


def test_akv_jit_0_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AKV_JIT", "1")
    assert jit.available()
    monkeypatch.setenv("AKV_JIT", "0")
    assert not jit.available()


def test_a_malformed_akv_jit_is_refused_when_a_store_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AKV_JIT", "yes")
    with pytest.raises(ConfigError, match=r"AKV_JIT='yes': set it to 1 \(on\) or 0 \(off\)"):
        akv.create("local")


def test_describe_says_which_kernels_run_and_why(
    monkeypatch: pytest.MonkeyPatch, fresh_jit: None
) -> None:
    import numba

    monkeypatch.setenv("AKV_JIT", "1")
    assert jit.describe() == f"compiled (numba {numba.__version__})"
    monkeypatch.setenv("AKV_JIT", "0")
    assert jit.describe() == "NumPy (AKV_JIT=0)"
    monkeypatch.setenv("AKV_JIT", "1")
    monkeypatch.setattr(jit, "_kernels", None)
    monkeypatch.setitem(sys.modules, "numba", None)
    assert jit.describe() == "NumPy (numba is not installed or cannot compile here)"


def test_kernels_made_on_a_thread_never_keep_the_caller_waiting(
    monkeypatch: pytest.MonkeyPatch, fresh_jit: None
) -> None:
    """:func:`jit.load_soon` (a server, when a row-sparse key is made) returns at once and
    makes the kernels once, on a thread of their own; :func:`jit.settled` says when."""
    monkeypatch.setenv("AKV_JIT", "1")
    made = jit._compile()  # the real kernels, made beforehand
    gate, compiles = threading.Event(), []

    def slow_compile():
        compiles.append(threading.current_thread().name)
        assert gate.wait(10)
        return made

    monkeypatch.setattr(jit, "_compile", slow_compile)
    assert not jit.settled()
    jit.load_soon()
    jit.load_soon()  # started once
    assert not jit.settled()  # returned while it compiles
    gate.set()
    jit._loading.join(10)
    assert jit.settled() and jit.kernels() is made and compiles == ["akv-jit"]


def test_the_kernels_are_cached_in_the_users_cache_not_beside_akvs_source(tmp_path) -> None:
    """numba's default cache is beside the source: in a non-editable install that is
    site-packages/akv, where pip knows none of the files, and a later install leaves a
    folder holding only them, which hides akv (found following the README)."""
    source = Path(jit.__file__).parent / "__pycache__"
    before = {p.name: p.stat().st_mtime_ns for p in source.glob("*.nb*")}
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "AKV_JIT": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    code = "from akv import jit; assert jit.kernels() is not None"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert list((tmp_path / "akv" / "numba").glob("*/*.nbi")), "no kernel cached there"
    after = {p.name: p.stat().st_mtime_ns for p in source.glob("*.nb*")}
    assert after == before  # nothing written beside the source


def test_making_the_kernels_leaves_numbas_cache_setting_as_it_was() -> None:
    from numba.core import config

    previous = config.CACHE_DIR
    assert jit._compile() is not None
    assert previous == config.CACHE_DIR  # the user's own functions cache where they did


def test_the_kernel_cache_is_numbas_setting_else_the_users_cache(tmp_path) -> None:
    given = str(tmp_path / "given")
    assert jit.cache_dir({"NUMBA_CACHE_DIR": given}) == given
    xdg = tmp_path / "xdg"
    assert jit.cache_dir({"XDG_CACHE_HOME": str(xdg)}) == str(xdg / "akv" / "numba")
    assert (xdg / "akv" / "numba").is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert jit.cache_dir({"XDG_CACHE_HOME": str(blocked)}) is None  # numba's default then
