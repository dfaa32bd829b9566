"""ccSGD, SGLD, Test and LBSGD: MXNet 1.9.1's numbers, SGLD's noise, configs, saved states
and row-sparse keys.

``../data/more_optimizers_reference.json`` holds seeded float32 (and one float16) inputs and
the weights MXNet 1.9.1's ``get_updater`` left after each of seven steps, three indexes of
different shapes sharing one optimizer: ccSGD, Test (with its states), LBSGD (every warm-up
strategy, with and without momentum, ``batch_scale`` 1 and 3, ``begin_epoch``, a schedule,
``wd``/``rescale_grad``/``clip_gradient``, float16 with ``multi_precision``) and SGLD with its
noise replaced by zeros. ``../data/make_more_optimizers_reference.py`` made it (its docstring
says how). MXNet is not needed here.

Tolerance: none where MXNet's numbers are replayed (akv evaluates each update in MXNet's
float32 order). SGLD's noise cannot be MXNet's (another generator): its drift is checked
exactly with the noise source replaced or seeded, and the noise's mean and standard
deviation statistically, with bounds 10 standard errors wide (a chance failure has a
probability below 1e-20).
"""

from __future__ import annotations

import json
import math
import pathlib
import warnings

import numpy as np
import pytest

import akv
from akv import optimizer as opt
from akv.errors import InvalidArgumentError, OptimizerError
from akv.rows import RowTable

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent.parent / "data" / "more_optimizers_reference.json").read_text()
)
CASES = REFERENCE["cases"]
NAMES = ("ccsgd", "sgld", "test", "lbsgd")


class ZeroNoise:
    """A noise source for SGLD that draws zeros (MXNet's numbers were made the same way)."""

    def standard_normal(self, size, dtype):
        return np.zeros(size, dtype)


def build(case: dict) -> opt.Optimizer:
    params = dict(case["params"])
    scheduler = case.get("lr_scheduler")
    if scheduler is not None:
        params["lr_scheduler"] = getattr(opt, scheduler["name"])(**scheduler["params"])
    optimizer = opt.create(case["name"], **params)
    if isinstance(optimizer, opt.SGLD):
        optimizer.random = ZeroNoise()
    return optimizer


def arrays(values: list[list[float]], shapes: list[list[int]], dtype: str) -> list[np.ndarray]:
    return [np.array(v, dtype).reshape(shape) for v, shape in zip(values, shapes, strict=True)]


def test_the_reference_was_made_by_mxnet_1_9_1():
    assert "mxnet 1.9.1" in REFERENCE["made_by"]
    assert {case["name"] for case in CASES.values()} == set(NAMES)
    strategies = {
        (params.get("warmup_strategy"), params.get("momentum", 0) > 0, params["batch_scale"])
        for params in (case["params"] for case in CASES.values() if case["name"] == "lbsgd")
    }
    for strategy in ("linear", "power2", "sqrt", "lars"):
        for momentum in (False, True):
            for batch_scale in (1, 3):
                assert (strategy, momentum, batch_scale) in strategies


@pytest.mark.parametrize("label", sorted(CASES))
def test_each_step_leaves_the_weights_mxnet_leaves(label):
    case = CASES[label]
    dtype, shapes = case["dtype"], case["shapes"]
    updater = opt.get_updater(build(case))
    weights = arrays(case["initial"], shapes, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float16 runs with multi_precision: no warning
        for step, (grads, expected) in enumerate(zip(case["grads"], case["weights"], strict=True)):
            for index, grad in enumerate(arrays(grads, shapes, dtype)):
                updater(index, grad, weights[index])
            for index, want in enumerate(arrays(expected, shapes, dtype)):
                np.testing.assert_array_equal(
                    weights[index], want, err_msg=f"{label}, step {step + 1}, index {index}"
                )
            if "states" in case:
                states = arrays(case["states"][step], shapes, dtype)
                for index, want in enumerate(states):
                    np.testing.assert_array_equal(updater.states[index], want)


def test_ccsgd_is_sgd():
    rng = np.random.default_rng(1)
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "rescale_grad": 0.5}
    made = {name: opt.get_updater(opt.create(name, **params)) for name in ("sgd", "ccsgd")}
    weights = {name: np.ones((4, 3), np.float32) for name in made}
    for _ in range(3):
        grad = rng.standard_normal((4, 3)).astype(np.float32)
        for name, updater in made.items():
            updater(0, grad, weights[name])
    np.testing.assert_array_equal(weights["ccsgd"], weights["sgd"])
    assert isinstance(made["ccsgd"].optimizer, opt.SGD)
    assert made["ccsgd"].optimizer.row_sparse_update(0) == "lazy"


def test_ccsgd_row_update_is_sgds():
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}
    tables = {name: RowTable((6, 2), np.float32) for name in ("sgd", "ccsgd")}
    updaters = {name: opt.get_updater(opt.create(name, **params)) for name in tables}
    for ids in ([1, 3], [3, 5], [1]):
        grad = akv.RowSparseArray(np.full((len(ids), 2), 0.5, np.float32), ids, (6, 2))
        for name, updater in updaters.items():
            updater.update_rows(0, tables[name], grad)
    ids = tables["sgd"].ids()
    np.testing.assert_array_equal(tables["ccsgd"].ids(), ids)
    np.testing.assert_array_equal(tables["ccsgd"].gather(ids), tables["sgd"].gather(ids))


# -- SGLD ---------------------------------------------------------------------------------------


def test_sgld_drift_plus_the_seeded_noise():
    """With a seed, the noise is ``default_rng(seed).standard_normal`` times ``sqrt(lr)``
    (float32), added after MXNet's drift."""
    case = CASES["sgld_drift_extra"]
    shapes, lr = case["shapes"], case["params"]["learning_rate"]
    weights = arrays(case["initial"], shapes, "float32")
    drifted = arrays(case["weights"][0], shapes, "float32")  # MXNet, after one step
    updater = opt.get_updater(opt.create("sgld", seed=7, **case["params"]))
    for index, grad in enumerate(arrays(case["grads"][0], shapes, "float32")):
        updater(index, grad, weights[index])
    rng = np.random.default_rng(7)
    for index, shape in enumerate(shapes):
        noise = rng.standard_normal(shape, dtype=np.float32) * np.float32(math.sqrt(lr))
        np.testing.assert_array_equal(weights[index], drifted[index] + noise)


def test_sgld_with_one_seed_draws_the_same_noise():
    results = []
    for _ in range(2):
        weight = np.zeros(100, np.float32)
        opt.get_updater(opt.SGLD(seed=3))(0, np.zeros(100, np.float32), weight)
        results.append(weight)
    np.testing.assert_array_equal(results[0], results[1])
    assert np.count_nonzero(results[0]) == 100


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sgld_noise_has_mean_zero_and_std_sqrt_lr(dtype):
    size, lr = 1_000_000, 0.04
    weight = np.zeros(size, dtype)
    opt.get_updater(opt.SGLD(learning_rate=lr))(0, np.zeros(size, dtype), weight)
    assert weight.dtype == dtype
    std = math.sqrt(lr)
    # Standard errors of the mean (std/sqrt(n)) and of the sample std (std/sqrt(2n)).
    assert abs(float(weight.mean(dtype=np.float64))) < 10 * std / math.sqrt(size)
    assert abs(float(weight.std(dtype=np.float64)) - std) < 10 * std / math.sqrt(2 * size)


def test_sgld_refuses_a_row_sparse_key_and_changes_nothing():
    table = RowTable((4, 2), np.float32)
    table.scatter([1], np.ones((1, 2), np.float32))
    updater = opt.get_updater(opt.SGLD())
    grad = akv.RowSparseArray(np.ones((1, 2), np.float32), [1], (4, 2))
    with pytest.raises(OptimizerError, match=r"SGLD: index 0: no row-sparse update"):
        updater.update_rows(0, table, grad)
    np.testing.assert_array_equal(table.gather([1]), np.ones((1, 2)))
    assert updater.optimizer.index_update_counts == {}


# -- Test ---------------------------------------------------------------------------------------


def test_test_optimizer_adds_the_rescaled_gradient_and_keeps_a_copy():
    optimizer = opt.Test(rescale_grad=0.5, learning_rate=3.0, wd=1.0, clip_gradient=0.1)
    weight = np.array([1.0, 2.0], np.float32)
    state = optimizer.create_state(0, weight)
    np.testing.assert_array_equal(state, [0.0, 0.0])
    optimizer.update(0, weight, np.array([4.0, -8.0], np.float32), state)
    np.testing.assert_array_equal(weight, [3.0, -2.0])
    np.testing.assert_array_equal(state, weight)
    assert state is not weight
    assert optimizer.index_update_counts == {0: 1}  # MXNet's Test counts nothing


def test_test_optimizer_row_update_is_standard():
    table = RowTable((4, 1), np.float32)
    table.scatter([0], np.ones((1, 1), np.float32))
    updater = opt.get_updater(opt.Test())
    assert updater.optimizer.row_sparse_update(0) == "standard"
    updater.update_rows(0, table, akv.RowSparseArray(np.ones((1, 1), np.float32), [2], (4, 1)))
    assert table.gather([0, 2]).ravel().tolist() == [1.0, 1.0]
    (copy,) = updater.row_states[0]
    assert copy.gather([0, 2]).ravel().tolist() == [1.0, 1.0]


# -- LBSGD --------------------------------------------------------------------------------------


def test_lbsgd_leaves_the_weight_and_momentum_alone_within_a_macro_batch():
    optimizer = opt.LBSGD(learning_rate=1.0, momentum=0.5, batch_scale=3, warmup_epochs=0)
    weight = np.zeros(2, np.float32)
    mom, accumulated = state = optimizer.create_state(0, weight)
    for grad in ([1.0, 2.0], [2.0, 4.0]):
        optimizer.update(0, weight, np.array(grad, np.float32), state)
        np.testing.assert_array_equal(weight, [0.0, 0.0])
        np.testing.assert_array_equal(mom, [0.0, 0.0])
    np.testing.assert_array_equal(accumulated, [3.0, 6.0])
    optimizer.update(0, weight, np.array([3.0, 6.0], np.float32), state)
    # mean gradient (2, 4), lr 1 * batch_scale 3 (warm-up over): mom = -(6, 12)
    np.testing.assert_array_equal(mom, [-6.0, -12.0])
    np.testing.assert_array_equal(weight, [-6.0, -12.0])
    np.testing.assert_array_equal(accumulated, [0.0, 0.0])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"warmup_strategy": "cosine"}, r"warmup_strategy must be one of"),
        ({"batch_scale": 0}, r"batch_scale must be an int >= 1"),
        ({"batch_scale": 2.5}, r"batch_scale must be an int >= 0"),
        ({"momentum": 1.0}, r"momentum"),
        ({"warmup_epochs": -1}, r"warmup_epochs"),
    ],
)
def test_lbsgd_refuses_bad_parameters(params, message):
    with pytest.raises(OptimizerError, match=message):
        opt.LBSGD(**params)


def test_lbsgd_refuses_a_state_of_another_shape():
    optimizer = opt.LBSGD(batch_scale=2)
    weight = np.zeros(2, np.float32)
    with pytest.raises(InvalidArgumentError, match=r"accumulated gradient"):
        optimizer.update(0, weight, weight.copy(), None)


def _lbsgd_steps(updater: opt.Updater, weights: list[np.ndarray], grads: list) -> None:
    for step in grads:
        for index, grad in enumerate(step):
            updater(index, grad, weights[index])


@pytest.mark.parametrize("strategy", ["sqrt", "lars"])
def test_lbsgd_saved_states_continue_exactly(strategy):
    """Saved in the middle of a macro-batch, reloaded into a new updater, LBSGD finishes it
    as the uninterrupted one does: the accumulated gradient and the count are saved."""
    rng = np.random.default_rng(2)
    shapes = [(5,), (3, 4)]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(9)]
    params = {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 3, "wd": 0.01}
    params.update(warmup_strategy=strategy, warmup_epochs=1, updates_per_epoch=8)
    updater = opt.get_updater(opt.LBSGD(**params))
    weights = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    _lbsgd_steps(updater, weights, grads[:4])
    data = updater.dump_states(dump_optimizer=True)
    mom, accumulated = opt.decode_states(data).states[0]
    assert np.count_nonzero(mom) == mom.size
    np.testing.assert_array_equal(accumulated, grads[3][0])  # step 4: one into a macro-batch
    restored = opt.get_updater(opt.SGD())
    restored.load_states(data)
    assert isinstance(restored.optimizer, opt.LBSGD)
    copies = [w.copy() for w in weights]
    _lbsgd_steps(updater, weights, grads[4:])
    _lbsgd_steps(restored, copies, grads[4:])
    for got, want in zip(copies, weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_lbsgd_row_update_is_the_dense_update_of_every_row():
    """Standard: rows never stored have a zero weight and accumulate zeros, so the row
    update (with 'lars', whose norms cover the stored rows) is the dense one."""
    params = {"learning_rate": 0.5, "momentum": 0.9, "batch_scale": 3, "wd": 0.1}
    params["warmup_strategy"] = "lars"
    rng = np.random.default_rng(3)
    table = RowTable((8, 2), np.float32)
    dense = np.zeros((8, 2), np.float32)
    table.scatter([1, 6], np.ones((2, 2), np.float32))
    dense[[1, 6]] = 1.0
    updater = opt.get_updater(opt.LBSGD(**params))
    assert updater.optimizer.row_sparse_update(0) == "standard"
    reference = opt.LBSGD(**params)
    state = reference.create_state(0, dense)
    for ids in ([1, 2], [2, 5], [0], [6], [1, 3], [4]):
        data = rng.standard_normal((len(ids), 2)).astype(np.float32)
        grad = akv.RowSparseArray(data, ids, (8, 2))
        updater.update_rows(0, table, grad)
        reference.update(0, dense, grad.to_dense(), state)
        got = akv.RowSparseArray.to_dense(table.to_sparse())
        np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(dense[[1, 6]], np.ones((2, 2)))


# -- all four -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_create_by_name_case_insensitively(name):
    made = opt.create(name.upper())
    assert type(made).__name__.lower() == name
    assert opt.create(name).get_config()["name"] == name


PARAMS = {
    "ccsgd": {"momentum": 0.5, "lazy_update": False},
    "sgld": {"seed": 11},
    "test": {"rescale_grad": 0.25},
    "lbsgd": {
        "momentum": 0.9,
        "warmup_strategy": "power2",
        "warmup_epochs": 2,
        "batch_scale": 4,
        "updates_per_epoch": 10,
        "begin_epoch": 1,
        "num_epochs": 20,
    },
}


@pytest.mark.parametrize("name", NAMES)
def test_get_config_round_trips(name):
    optimizer = opt.create(name, learning_rate=0.2, param_idx2name={0: "fc_w"}, **PARAMS[name])
    config = json.loads(json.dumps(optimizer.get_config()))
    params = dict(config["params"])
    params["param_idx2name"] = dict(params["param_idx2name"])
    assert opt.create(config["name"], **params).get_config() == config
    assert opt.from_config(config).get_config() == config
    for key, value in PARAMS[name].items():
        assert config["params"][key] == value
