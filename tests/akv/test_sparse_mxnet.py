"""Row-sparse pushes through akv's optimizers against MXNet 1.9.1's own numbers.

``data/lazy_reference.json`` holds fixed inputs (a 10x4 float32 table whose initial value
lists some rows; three rounds of row-sparse gradients with unsorted, repeated and
overlapping rows, one of them a list of two) and the whole weight MXNet's ``local`` store
gave after each round, for SGD with and without momentum, Adam (``lazy_update`` True and
False), AdaGrad, FTRL and no optimizer. ``data/make_lazy_reference.py`` made it; its
docstring says how MXNet was run and why (every row listed in MXNet's initial value, the
gradients split into sorted unique parts that MXNet sums itself). MXNet is not needed here.

Tolerance: float32 (rtol 1e-5, atol 1e-6). Measured when the file was made: SGD (with and
without momentum, lazy and standard), AdaGrad and no optimizer agree bit for bit; Adam and
FTRL differ in a few elements by at most 2e-9 (1.3e-6 relative, a unit or two in the last
place): akv computes with NumPy, one rounded float32 operation at a time, where MXNet's
fused kernels order ``sqrt``, division and the moment updates their own way.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import numpy as np
import pytest

import akv
from akv import RowSparseArray

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "lazy_reference.json").read_text())
SHAPE = tuple(REFERENCE["shape"])
KEY = REFERENCE["key"]


def as_rows(value: dict) -> RowSparseArray:
    """A value of the file (row ids as MXNet's input listed them, unsorted and repeated)."""
    data = np.array(value["data"], np.float32).reshape(len(value["indices"]), *SHAPE[1:])
    return RowSparseArray(data, value["indices"], SHAPE)


def test_the_reference_was_made_by_mxnet_1_9_1():
    assert "mxnet 1.9.1" in REFERENCE["made_by"]
    assert set(REFERENCE["cases"]) >= {
        "sgd_lazy",
        "sgd_standard",
        "sgd_momentum_lazy",
        "sgd_momentum_standard",
        "adam_lazy",
        "adam_standard",
        "adagrad",
        "ftrl",
    }


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_each_push_leaves_the_weight_mxnet_leaves(case, store):
    expected = REFERENCE["cases"][case]
    with akv.create(store) as kv:
        if expected["optimizer"] is not None:
            spec = expected["optimizer"]
            kv.set_optimizer(akv.optimizer.create(spec["name"], **spec["params"]))
        kv.init(KEY, as_rows(REFERENCE["initial"]))
        for step, (grads, weight) in enumerate(
            zip(REFERENCE["rounds"], expected["weights"], strict=True)
        ):
            values = [as_rows(g) for g in grads]
            kv.push(KEY, values if len(values) > 1 else values[0])
            got = kv.row_sparse_pull(KEY, row_ids=np.arange(SHAPE[0])).to_dense()
            np.testing.assert_allclose(
                got,
                np.array(weight, np.float32).reshape(SHAPE),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{case}, after push {step + 1}",
            )


# Two optimizers that MXNet 1.9.1 has no row-sparse kernel for: it runs their dense kernel on
# dense copies of the weight and the gradient (its "storage fallback"). The numbers were made
# with MXNet 1.9.1's local store and the same calls (mx.nd.sparse.row_sparse_array values,
# kv.row_sparse_pull of every row).


@pytest.mark.parametrize(
    ("momentum", "column"),
    [
        (0.0, [0.880859375, 0.8798828125, 0.97998046875]),
        (0.9, [0.7822265625, 0.87109375, 0.97119140625]),
    ],
)
def test_float16_sgd_with_multi_precision_updates_every_row_as_mxnet(momentum, column):
    # mp_sgd_update and mp_sgd_mom_update: row 2, never pushed, decays and moves too.
    optimizer = akv.optimizer.SGD(
        learning_rate=0.1, momentum=momentum, wd=0.1, multi_precision=True
    )
    with akv.create("local") as kv:
        kv.init(0, RowSparseArray(np.ones((3, 2), np.float16), [0, 1, 2], (3, 2)))
        kv.set_optimizer(optimizer)
        for row in (0, 1):
            kv.push(0, RowSparseArray(np.ones((1, 2), np.float16), [row], (3, 2)))
        got = kv.row_sparse_pull(0, row_ids=np.arange(3)).to_dense()
    np.testing.assert_array_equal(got, np.repeat(np.float16(column)[:, None], 2, axis=1))


def test_nag_on_a_row_sparse_key_reads_the_old_weight_in_its_momentum_as_mxnet():
    # nag_mom_update on dense copies: the momentum's weight decay reads the weight from before
    # the step, where on a dense key (in place) it reads the new one.
    rows = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    with akv.create("local") as kv:
        kv.init(0, RowSparseArray(rows, [0, 1], (2, 2)))
        kv.init(1, rows)
        kv.set_optimizer(akv.optimizer.NAG(learning_rate=0.1, momentum=0.9, wd=0.5))
        for _ in range(3):
            kv.push(0, RowSparseArray(np.ones((1, 2), np.float32), [0], (2, 2)))
            kv.push(1, np.array([[1.0, 1.0], [0.0, 0.0]], np.float32))
        sparse = kv.row_sparse_pull(0, row_ids=np.arange(2)).to_dense()
        dense = kv.pull(1)
    mxnet_sparse = [
        [-0.10561215877532959, 0.5258505344390869],
        [1.8943877220153809, 2.525850296020508],
    ]
    mxnet_dense = [
        [-0.06987869739532471, 0.5734952688217163],
        [1.9301214218139648, 2.5734949111938477],
    ]
    np.testing.assert_array_equal(sparse, np.float32(mxnet_sparse))
    np.testing.assert_array_equal(dense, np.float32(mxnet_dense))


@pytest.mark.parametrize(
    ("dtype", "multi_precision", "column"),
    [
        # sgd_update's lazy row update: row 2, never pushed, keeps its value.
        (np.float32, False, [0.8899999856948853, 0.8899999856948853, 1.0]),
        (np.float16, False, [0.89013671875, 0.89013671875, 1.0]),
        # mp_sgd_update has no row-sparse form: every row decays, as for SGD.
        (np.float16, True, [0.880859375, 0.8798828125, 0.97998046875]),
    ],
)
def test_nag_without_momentum_updates_only_the_pushed_rows_as_mxnet(dtype, multi_precision, column):
    # MXNet's NAG without momentum calls sgd_update, lazy by default on row-sparse values.
    optimizer = akv.optimizer.NAG(
        learning_rate=0.1, momentum=0.0, wd=0.1, multi_precision=multi_precision
    )
    # float16 without multi_precision warns, as MXNet's does, at the first update.
    fp16 = dtype == np.float16 and not multi_precision
    warns = pytest.warns(UserWarning, match="float16") if fp16 else contextlib.nullcontext()
    with akv.create("local") as kv, warns:
        kv.init(0, RowSparseArray(np.ones((3, 2), dtype), [0, 1, 2], (3, 2)))
        kv.set_optimizer(optimizer)
        for row in (0, 1):
            kv.push(0, RowSparseArray(np.ones((1, 2), dtype), [row], (3, 2)))
        got = kv.row_sparse_pull(0, row_ids=np.arange(3)).to_dense()
    np.testing.assert_array_equal(got, np.repeat(np.array(column, dtype)[:, None], 2, axis=1))


@pytest.mark.parametrize(
    ("dtype", "multi_precision", "momentum", "column"),
    [
        (np.float32, False, 0.0, [0.7810999751091003, 0.8899999856948853, 1.0]),
        (np.float32, False, 0.9, [0.6820999979972839, 0.8899999856948853, 1.0]),
        # On the float32 master copy, lazily too (sgd_mom_update, not mp_sgd_mom_update).
        (np.float16, True, 0.9, [0.68212890625, 0.89013671875, 1.0]),
    ],
)
def test_lbsgd_updates_only_the_pushed_rows_as_mxnet(dtype, multi_precision, momentum, column):
    # MXNet's LBSGD (batch_scale=1) calls sgd_update / sgd_mom_update with a row-sparse
    # momentum: lazy. Row 2 is never pushed; row 1's momentum does not decay after its push.
    optimizer = akv.optimizer.LBSGD(
        learning_rate=0.1, momentum=momentum, wd=0.1, multi_precision=multi_precision
    )
    with akv.create("local") as kv:
        kv.init(0, RowSparseArray(np.ones((3, 2), dtype), [0, 1, 2], (3, 2)))
        kv.set_optimizer(optimizer)
        for row in (0, 1, 0):
            kv.push(0, RowSparseArray(np.ones((1, 2), dtype), [row], (3, 2)))
        got = kv.row_sparse_pull(0, row_ids=np.arange(3)).to_dense()
    np.testing.assert_array_equal(got, np.repeat(np.array(column, dtype)[:, None], 2, axis=1))
