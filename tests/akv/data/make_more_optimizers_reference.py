"""Make ``more_optimizers_reference.json``: MXNet 1.9.1's ccSGD, Test, LBSGD and SGLD's
deterministic drift, several steps each, with the inputs they were given.

Run by hand, with MXNet in a venv of its own (never by the tests, which keep only the
numbers)::

    python -m venv /work/mxvenv
    /work/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    /work/mxvenv/bin/python tests/akv/data/make_more_optimizers_reference.py

Each case builds one MXNet optimizer (``mx.optimizer.create(name, **params)``, so MXNet's
defaults apply to every parameter a case does not name) and drives it through
``mx.optimizer.get_updater`` (the path a KVStore takes): for each step, one call per index,
index 0 first, each gradient a new NDArray. Several indexes of different shapes share the
optimizer. The inputs are seeded float32 standard normals (weights) and twice that
(gradients), saved with the outputs as the shortest decimals that read back as the same
float32. After each step the case records every weight and, for ``test``, every state.

* LBSGD: each warm-up strategy (``linear``, ``power2``, ``sqrt``, ``lars``), with and
  without momentum, ``batch_scale`` 1 and 3, over 7 steps (with ``batch_scale=3`` the
  weights change at steps 3 and 6 only), ``warmup_epochs=1, updates_per_epoch=4`` so that
  the warm-up multiplier changes within the steps; also ``begin_epoch=1`` (the macro-batch
  count starts at 4), ``wd``/``rescale_grad``/``clip_gradient`` with a factor schedule (its
  learning rate is read before the update is counted), and float16 weights with
  ``multi_precision``.
* ``sgld_drift``: MXNet's SGLD with its noise replaced by zeros (``normal`` in
  ``mxnet.optimizer.optimizer`` patched to return zeros of the weight's shape and dtype), so
  the weights are the update's deterministic part ``w += -lr/2 * (g + wd*w)`` as MXNet's
  NDArray operations round it.
"""

from __future__ import annotations

import json
import pathlib

import mxnet as mx
import mxnet.optimizer.optimizer as mx_optimizer_module
import numpy as np

SEED = 20261207
STEPS = 7
OUT = pathlib.Path(__file__).with_name("more_optimizers_reference.json")

SHAPES = [[7], [3, 4], [2, 3, 2]]
# LBSGD's 'lars' sums squares with NumPy (pairwise above 8 elements): 130 elements.
LARS_SHAPES = [[7], [10, 13], [2, 3, 2]]
EXTRA = {"wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 1.5}
WARMUP = {"warmup_epochs": 1, "updates_per_epoch": 4}
FACTOR = {"name": "FactorScheduler", "params": {"step": 2, "factor": 0.5, "base_lr": 0.1}}


def lbsgd_cases() -> dict:
    cases = {}
    for strategy in ("linear", "power2", "sqrt", "lars"):
        for momentum in (0.0, 0.9):
            for batch_scale in (1, 3):
                label = f"lbsgd_{strategy}_m{momentum:g}_b{batch_scale}"
                params = {
                    "learning_rate": 0.1,
                    "momentum": momentum,
                    "warmup_strategy": strategy,
                    "batch_scale": batch_scale,
                    **WARMUP,
                }
                shapes = LARS_SHAPES if strategy == "lars" else SHAPES
                cases[label] = ("lbsgd", params, shapes, None, "float32")
    cases["lbsgd_begin_epoch"] = (
        "lbsgd",
        {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 3, "begin_epoch": 1, **WARMUP},
        SHAPES,
        None,
        "float32",
    )
    cases["lbsgd_extra_scheduled"] = (
        "lbsgd",
        {"momentum": 0.9, "warmup_strategy": "sqrt", "batch_scale": 2, **WARMUP, **EXTRA},
        SHAPES,
        FACTOR,
        "float32",
    )
    cases["lbsgd_lars_extra"] = (
        "lbsgd",
        {"learning_rate": 0.1, "warmup_strategy": "lars", "batch_scale": 2, **EXTRA},
        LARS_SHAPES,
        None,
        "float32",
    )
    cases["lbsgd_float16_multi_precision"] = (
        "lbsgd",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "warmup_strategy": "lars",
            "batch_scale": 3,
            "multi_precision": True,
        },
        LARS_SHAPES,
        None,
        "float16",
    )
    return cases


# label: (registered name, params, shapes, lr scheduler or None, dtype)
CASES = {
    "ccsgd": ("ccsgd", {}, SHAPES, None, "float32"),
    "ccsgd_momentum_extra": (
        "ccsgd",
        {"learning_rate": 0.1, "momentum": 0.9, **EXTRA},
        SHAPES,
        None,
        "float32",
    ),
    "test": ("test", {}, SHAPES, None, "float32"),
    "test_extra": ("test", {"learning_rate": 0.1, **EXTRA}, SHAPES, None, "float32"),
    "sgld_drift": ("sgld", {}, SHAPES, None, "float32"),
    "sgld_drift_extra": ("sgld", {"learning_rate": 0.1, **EXTRA}, SHAPES, None, "float32"),
    **lbsgd_cases(),
}


def exact(values: np.ndarray) -> list[float]:
    """Values (float32 or float16, both exact in float32) as the shortest decimals that read
    back as the same float32."""
    return [float(repr(v)) for v in np.asarray(values, np.float32).ravel()]


def no_noise(loc=0, scale=1, shape=None, dtype=None, ctx=None, **kwargs):
    return mx.nd.zeros(shape, ctx=ctx, dtype=dtype)


def build(name: str, params: dict, scheduler: dict | None) -> mx.optimizer.Optimizer:
    params = dict(params)
    if scheduler is not None:
        params["lr_scheduler"] = getattr(mx.lr_scheduler, scheduler["name"])(**scheduler["params"])
    return mx.optimizer.create(name, **params)


def run_case(rng: np.random.Generator, label: str) -> dict:
    name, params, shapes, scheduler, dtype = CASES[label]
    initial = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    grads = [
        [(2 * rng.standard_normal(shape)).astype(dtype) for shape in shapes] for _ in range(STEPS)
    ]
    updater = mx.optimizer.get_updater(build(name, params, scheduler))
    weights = [mx.nd.array(w, dtype=dtype) for w in initial]
    after, states = [], []
    for step_grads in grads:
        for index, (weight, grad) in enumerate(zip(weights, step_grads, strict=True)):
            updater(index, mx.nd.array(grad, dtype=dtype), weight)
        after.append([exact(w.asnumpy()) for w in weights])
        if name == "test":
            states.append([exact(updater.states[i].asnumpy()) for i in range(len(shapes))])
    case = {
        "name": name,
        "params": params,
        "lr_scheduler": scheduler,
        "shapes": shapes,
        "dtype": dtype,
        "initial": [exact(w) for w in initial],
        "grads": [[exact(g) for g in step] for step in grads],
        "weights": after,
    }
    if states:
        case["states"] = states
    return case


def main() -> None:
    mx_optimizer_module.normal = no_noise  # SGLD's noise source (see the docstring)
    rng = np.random.default_rng(SEED)
    cases = {label: run_case(rng, label) for label in CASES}
    serial = {
        "made_by": (
            f"tests/akv/data/make_more_optimizers_reference.py with mxnet {mx.__version__}, "
            f"numpy {np.__version__}"
        ),
        "cases": cases,
    }
    OUT.write_text(json.dumps(serial, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
