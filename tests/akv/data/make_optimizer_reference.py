"""Make ``optimizer_reference.json``: MXNet 1.9.1's FTML, Adamax, Nadam, DCASGD, LARS and
GroupAdaGrad, several steps each, with the inputs they were given.

Run by hand, with MXNet in a venv of its own (never by the tests, which keep only the
numbers)::

    python -m venv /work/mxvenv
    /work/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    /work/mxvenv/bin/python tests/akv/data/make_optimizer_reference.py

Each case builds one MXNet optimizer (``mx.optimizer.create(name, **params)``, so MXNet's
defaults apply to every parameter a case does not name) and drives it through
``mx.optimizer.get_updater``, the path a KVStore takes: for each step, one call per index,
index 0 first. Several indexes of different shapes share the optimizer, as the keys of a
store do, so what an optimizer keeps across indexes (Nadam's momentum schedule, LARS's last
learning rate) is exercised. The inputs are seeded float32 standard normals (weights) and
twice that (gradients), saved with the outputs as the shortest decimals that read back as
the same float32, so the tests replay exactly what MXNet was given.

* ``dcasgd_momentum``: MXNet 1.9.1's DCASGD with momentum fails (``if mom:`` on an NDArray of
  several elements raises ``ValueError``; checked below). Its numbers come from MXNet's own
  NDArray operations with that one line fixed (``if mom is not None:``), which is the update
  akv implements; the case says so in ``"note"``.
* ``groupadagrad_rows``: row-sparse gradients through MXNet's ``group_adagrad_update``
  (dense weight and history, ``row_sparse`` gradient: MXNet's lazy update, which changes only
  the gradient's rows), the whole weight after each step.
* LARS runs through MXNet's aggregated path (``multi_sum_sq``, ``multi_lars`` and
  ``preloaded_multi_sgd_*``), the one ``get_updater`` takes for dense weights.
"""

from __future__ import annotations

import json
import pathlib

import mxnet as mx
import numpy as np
from mxnet.optimizer.contrib import GroupAdaGrad  # registers "groupadagrad"

SEED = 20261205
STEPS = 4
OUT = pathlib.Path(__file__).with_name("optimizer_reference.json")

SHAPES = [[7], [3, 4], [2, 3, 2]]
# LARS's norms: 130 elements, so that a sum in another order (NumPy's pairwise sum) differs.
LARS_SHAPES = [[7], [10, 13], [2, 3, 2]]
# GroupAdaGrad: 2-D weights, with rows long enough (30, 20) that a plain sum and MXNet's
# compensated one differ.
MATRICES = [[3, 5], [6, 2], [4, 30]]
EXTRA = {"wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 1.5}
NAMES = [[0, "fc_weight"], [1, "fc_bias"], [2, "bn_gamma"]]
FACTOR = {"name": "FactorScheduler", "params": {"step": 2, "factor": 0.5, "base_lr": 0.1}}

# label: (registered name, params, shapes, lr scheduler or None)
CASES = {
    "ftml": ("ftml", {}, SHAPES, None),
    "ftml_extra": ("ftml", {"learning_rate": 0.05, "beta1": 0.5, **EXTRA}, SHAPES, None),
    "adamax": ("adamax", {}, SHAPES, None),
    "adamax_extra": ("adamax", {"learning_rate": 0.01, "beta1": 0.8, **EXTRA}, SHAPES, None),
    "nadam": ("nadam", {}, SHAPES, None),
    "nadam_extra": (
        "nadam",
        {"learning_rate": 0.01, "schedule_decay": 0.01, "epsilon": 1e-6, **EXTRA},
        SHAPES,
        None,
    ),
    "dcasgd": ("dcasgd", {}, SHAPES, None),
    "dcasgd_extra": ("dcasgd", {"learning_rate": 0.1, "lamda": 0.1, **EXTRA}, SHAPES, None),
    "dcasgd_momentum": (
        "dcasgd",
        {"learning_rate": 0.1, "momentum": 0.9, **EXTRA},
        SHAPES,
        None,
    ),
    "lars": ("lars", {}, LARS_SHAPES, None),
    "lars_momentum": (
        "lars",
        {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.01, "eps": 1e-4, **EXTRA},
        LARS_SHAPES,
        None,
    ),
    "lars_names_scheduled": (
        "lars",
        {"momentum": 0.9, "eta": 0.01, "wd": 0.01, "param_idx2name": NAMES},
        LARS_SHAPES,
        FACTOR,
    ),
    "groupadagrad": ("groupadagrad", {}, MATRICES, None),
    "groupadagrad_extra": (
        "groupadagrad",
        {"learning_rate": 0.1, "eps": 1e-3, "rescale_grad": 0.5, "clip_gradient": 1.5},
        MATRICES,
        None,
    ),
}

# The attributes of an optimizer built with no arguments (MXNet's defaults).
DEFAULTS = {
    "ftml": ["lr", "wd", "rescale_grad", "clip_gradient", "beta1", "beta2", "epsilon"],
    "adamax": ["lr", "wd", "rescale_grad", "clip_gradient", "beta1", "beta2"],
    "nadam": ["lr", "wd", "beta1", "beta2", "epsilon", "schedule_decay", "m_schedule"],
    "dcasgd": ["lr", "wd", "momentum", "lamda"],
    "lars": ["lr", "wd", "momentum", "lazy_update", "eta", "eps", "momentum_correction"],
    "groupadagrad": ["lr", "wd", "rescale_grad", "clip_gradient", "float_stable_eps"],
}

ROWS_SHAPE = [8, 20]
ROWS_STEPS = [[1, 4, 6], [0, 4], [2, 4, 6, 7]]
ROWS_PARAMS = {"learning_rate": 0.1, "rescale_grad": 0.5, "clip_gradient": 1.5}


class FixedDCASGD(mx.optimizer.DCASGD):
    """MXNet 1.9.1's DCASGD with ``if mom:`` read as ``if mom is not None:``."""

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        grad = grad * self.rescale_grad
        if self.clip_gradient is not None:
            grad = mx.nd.clip(grad, -self.clip_gradient, self.clip_gradient)
        mom, previous_weight = state
        mom[:] *= self.momentum
        mom[:] += -lr * (grad + wd * weight + self.lamda * grad * grad * (weight - previous_weight))
        previous_weight[:] = weight
        weight[:] += mom


def exact(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back as the same float32."""
    return [float(repr(v)) for v in np.asarray(values, np.float32).ravel()]


def build(name: str, params: dict, scheduler: dict | None) -> mx.optimizer.Optimizer:
    params = dict(params)
    if "param_idx2name" in params:
        params["param_idx2name"] = dict(params["param_idx2name"])
    if scheduler is not None:
        params["lr_scheduler"] = getattr(mx.lr_scheduler, scheduler["name"])(**scheduler["params"])
    if name == "dcasgd" and params.get("momentum"):
        return FixedDCASGD(**params)
    return mx.optimizer.create(name, **params)


def check_mxnet_dcasgd_momentum_fails() -> str:
    updater = mx.optimizer.get_updater(mx.optimizer.create("dcasgd", momentum=0.9))
    try:
        updater(0, mx.nd.ones((2, 2)), mx.nd.ones((2, 2)))
    except ValueError as exc:
        return f"ValueError: {exc}"
    raise AssertionError("MXNet's DCASGD with momentum was expected to fail")


def run_case(rng: np.random.Generator, label: str) -> dict:
    name, params, shapes, scheduler = CASES[label]
    initial = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    grads = [
        [(2 * rng.standard_normal(shape)).astype(np.float32) for shape in shapes]
        for _ in range(STEPS)
    ]
    updater = mx.optimizer.get_updater(build(name, params, scheduler))
    weights = [mx.nd.array(w, dtype="float32") for w in initial]
    after = []
    for step_grads in grads:
        for index, (weight, grad) in enumerate(zip(weights, step_grads, strict=True)):
            updater(index, mx.nd.array(grad, dtype="float32"), weight)
        after.append([exact(w.asnumpy()) for w in weights])
    case = {
        "name": name,
        "params": params,
        "lr_scheduler": scheduler,
        "shapes": shapes,
        "initial": [exact(w) for w in initial],
        "grads": [[exact(g) for g in step] for step in grads],
        "weights": after,
    }
    if label == "dcasgd_momentum":
        case["note"] = (
            "MXNet 1.9.1's DCASGD with momentum raises "
            + check_mxnet_dcasgd_momentum_fails()
            + "; these numbers are its NDArray operations with `if mom:` read as "
            "`if mom is not None:`"
        )
    return case


def run_rows(rng: np.random.Generator) -> dict:
    """GroupAdaGrad's lazy update of row-sparse gradients (dense weight and history)."""
    shape = tuple(ROWS_SHAPE)
    initial = rng.standard_normal(shape).astype(np.float32)
    grads = [
        (2 * rng.standard_normal((len(ids), shape[1]))).astype(np.float32) for ids in ROWS_STEPS
    ]
    updater = mx.optimizer.get_updater(mx.optimizer.create("groupadagrad", **ROWS_PARAMS))
    weight = mx.nd.array(initial, dtype="float32")
    after = []
    for ids, data in zip(ROWS_STEPS, grads, strict=True):
        grad = mx.nd.sparse.row_sparse_array(
            (data, np.array(ids, np.int64)), shape=shape, dtype="float32"
        )
        updater(0, grad, weight)
        after.append(exact(weight.asnumpy()))
    return {
        "name": "groupadagrad",
        "params": ROWS_PARAMS,
        "shape": list(shape),
        "initial": exact(initial),
        "rows": ROWS_STEPS,
        "grads": [exact(g) for g in grads],
        "weights": after,
    }


def defaults() -> dict:
    """Each optimizer's attributes as ``mx.optimizer.create(name)`` sets them."""
    made = {name: mx.optimizer.create(name) for name in DEFAULTS}
    return {name: {a: getattr(made[name], a) for a in DEFAULTS[name]} for name in DEFAULTS}


def main() -> None:
    assert GroupAdaGrad is mx.optimizer.Optimizer.opt_registry["groupadagrad"]
    rng = np.random.default_rng(SEED)
    cases = {label: run_case(rng, label) for label in CASES}
    serial = {
        "made_by": (
            f"tests/akv/data/make_optimizer_reference.py with mxnet {mx.__version__}, "
            f"numpy {np.__version__}"
        ),
        "defaults": defaults(),
        "cases": cases,
        "groupadagrad_rows": run_rows(rng),
    }
    OUT.write_text(json.dumps(serial, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
