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
