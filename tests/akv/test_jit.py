"""akv.jit: the compiled row kernels compute what NumPy computes, bit for bit, and akv works
(in NumPy) without them: numba missing, unusable, or ``AKV_JIT=0``."""

from __future__ import annotations

import logging
import sys

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


def _sgd_rounds(monkeypatch: pytest.MonkeyPatch, jit_on: str, dtype: str, **settings: float):
    """Three rounds of lazy SGD row updates; the table's rows and the update counts."""
    monkeypatch.setenv("AKV_JIT", jit_on)
    rng = np.random.default_rng(7)
    optimizer = opt.SGD(**settings)
    updater = opt.get_updater(optimizer)
    table = RowTable((ROWS, 4), np.dtype(dtype))
    table.scatter(np.array([1, 5, 9]), rng.standard_normal((3, 4)).astype(dtype))
    for _ in range(3):
        ids = np.unique(rng.integers(0, ROWS, 12))
        grad = RowSparseArray(rng.standard_normal((ids.size, 4)).astype(dtype), ids, (ROWS, 4))
        updater.update_rows("emb", table, grad)
    stored = np.sort(table.ids())
    return stored, table.gather(stored), optimizer.num_update, updater.row_states["emb"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "settings",
    [
        {"learning_rate": 0.1},
        {"learning_rate": 0.37, "wd": 0.013, "rescale_grad": 0.5},
    ],
    ids=["plain", "weight-decay-rescaled"],
)
def test_sgds_update_in_place_is_the_gathered_update_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: str, settings: dict[str, float]
) -> None:
    ids, rows, count, states = _sgd_rounds(monkeypatch, "1", dtype, **settings)
    plain_ids, plain_rows, plain_count, plain_states = _sgd_rounds(
        monkeypatch, "0", dtype, **settings
    )
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_array_equal(_bits(rows), _bits(plain_rows))
    assert count == plain_count == 3
    assert states == plain_states == []


def test_sgd_updates_in_place_only_without_momentum_clipping_or_a_narrow_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AKV_JIT", "1")
    slots = np.array([0, 2], np.int64)

    def in_place(optimizer: opt.Optimizer, dtype: str = "float32") -> bool:
        table = np.ones((3, 4), dtype)
        before = table.copy()
        done = optimizer.update_rows_in_place(0, table, slots, np.ones((2, 4), dtype))
        if not done:  # nothing changed, nothing counted
            np.testing.assert_array_equal(table, before)
            assert optimizer.num_update == 0
        return done

    assert in_place(opt.SGD(learning_rate=0.5))
    assert not in_place(opt.SGD(momentum=0.9))
    assert not in_place(opt.SGD(clip_gradient=1.0))
    assert not in_place(opt.SGD(), "float16")
    assert not in_place(opt.Adam())  # stateful: the caller gathers the rows
    monkeypatch.setenv("AKV_JIT", "0")
    assert not in_place(opt.SGD())


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
