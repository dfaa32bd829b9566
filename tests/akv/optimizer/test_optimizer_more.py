"""FTML, Adamax, Nadam, DCASGD, LARS and GroupAdaGrad against MXNet 1.9.1's own numbers, and
AdamW against torch.optim.AdamW.

``../data/optimizer_reference.json`` holds seeded float32 inputs and the weights MXNet 1.9.1's
``get_updater`` left after each of four steps, several indexes of different shapes sharing
one optimizer (as a store's keys do), with and without ``wd``, ``rescale_grad`` and
``clip_gradient``; GroupAdaGrad also with row-sparse gradients; and each optimizer's MXNet
defaults. ``../data/make_optimizer_reference.py`` made it (its docstring says how; DCASGD
with momentum, which fails in MXNet, is MXNet's operations with the failing line fixed).
MXNet is not needed here.

Tolerance: none. akv evaluates each update in MXNet's float32 order (the kernels' order, or
the order of the NDArray operations of MXNet's Python optimizers, with their double-computed
scalars), so every weight is MXNet's bit for bit. CPU only: there is no GPU on the machines
these tests were written on; on a GPU the same kernels run through CuPy.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest

import akv
from akv import optimizer as opt
from akv.errors import OptimizerError
from akv.rows import RowTable

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent.parent / "data" / "optimizer_reference.json").read_text()
)
CASES = REFERENCE["cases"]


def build(case: dict) -> opt.Optimizer:
    params = dict(case["params"])
    if "param_idx2name" in params:
        params["param_idx2name"] = {int(index): name for index, name in params["param_idx2name"]}
    scheduler = case.get("lr_scheduler")
    if scheduler is not None:
        params["lr_scheduler"] = getattr(opt, scheduler["name"])(**scheduler["params"])
    with warnings.catch_warnings():
        # A learning rate given with a scheduler replaces its base_lr (MXNet warns too).
        warnings.simplefilter("ignore", UserWarning)
        return opt.create(case["name"], **params)


def arrays(values: list[list[float]], shapes: list[list[int]]) -> list[np.ndarray]:
    return [np.array(v, np.float32).reshape(shape) for v, shape in zip(values, shapes, strict=True)]


def test_the_reference_was_made_by_mxnet_1_9_1():
    assert "mxnet 1.9.1" in REFERENCE["made_by"]
    assert {case["name"] for case in CASES.values()} == {
        "ftml",
        "adamax",
        "nadam",
        "dcasgd",
        "lars",
        "groupadagrad",
    }
    assert "raises ValueError" in CASES["dcasgd_momentum"]["note"]


@pytest.mark.parametrize("label", sorted(CASES))
def test_each_step_leaves_the_weights_mxnet_leaves(label):
    case = CASES[label]
    updater = opt.get_updater(build(case))
    shapes = case["shapes"]
    weights = arrays(case["initial"], shapes)
    for step, (grads, expected) in enumerate(zip(case["grads"], case["weights"], strict=True)):
        for index, grad in enumerate(arrays(grads, shapes)):
            updater(index, grad, weights[index])
        for index, (got, want) in enumerate(zip(weights, arrays(expected, shapes), strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"{label}, step {step + 1}, {index}")


def test_group_adagrad_row_sparse_steps_are_mxnets_lazy_update():
    case = REFERENCE["groupadagrad_rows"]
    shape = tuple(case["shape"])
    table = RowTable(shape, np.float32)
    table.scatter(np.arange(shape[0]), np.array(case["initial"], np.float32).reshape(shape))
    updater = opt.get_updater(build(case))
    for ids, grad, expected in zip(case["rows"], case["grads"], case["weights"], strict=True):
        data = np.array(grad, np.float32).reshape(len(ids), shape[1])
        updater.update_rows(0, table, akv.RowSparseArray(data, ids, shape))
        np.testing.assert_array_equal(
            table.gather(np.arange(shape[0])), np.array(expected, np.float32).reshape(shape)
        )


@pytest.mark.parametrize("name", sorted(REFERENCE["defaults"]))
def test_defaults_are_mxnets(name):
    optimizer = opt.create(name)
    for attribute, value in REFERENCE["defaults"][name].items():
        assert getattr(optimizer, attribute) == value, attribute


def test_dcasgd_with_momentum_keeps_the_momentum_and_the_previous_weight():
    """mom = 0.5 * mom - lr * (g + lamda * g * g * (w - previous)); previous = w; w += mom."""
    optimizer = opt.DCASGD(learning_rate=0.5, momentum=0.5, lamda=0.25)
    updater = opt.get_updater(optimizer)
    weight = np.array([1.0], np.float32)
    updater(0, np.array([2.0], np.float32), weight)  # mom = -1, previous = 1, w = 0
    updater(0, np.array([2.0], np.float32), weight)  # mom = -0.5 - 0.5 * (2 - 1) = -1
    assert weight.tolist() == [-1.0]
    mom, previous = updater.states[0]
    assert mom.tolist() == [-1.0] and previous.tolist() == [0.0]
    assert opt.DCASGD().create_state(0, weight)[0] is None


def test_nadam_multiplies_one_momentum_schedule_for_every_index_as_mxnet():
    nadam = opt.Nadam()
    updater = opt.get_updater(nadam)
    for index in (0, 1):
        updater(index, np.ones(2, np.float32), np.ones(2, np.float32))
    one = 0.9 * (1.0 - 0.5 * 0.96**0.004)
    assert nadam.m_schedule == pytest.approx(one * one, rel=1e-15)
    assert nadam.shared_state() == {"m_schedule": nadam.m_schedule}


def test_lars_keeps_the_plain_rate_for_biases_and_batch_norm_parameters():
    """Only the name's ending counts (``str(index)`` without a name), and only ``_weight``
    names keep weight decay by default."""
    names = {0: "fc_weight", 1: "fc_bias", 2: "bn_gamma", 3: "bn_beta", 4: "other"}
    lars = opt.LARS(learning_rate=1.0, eta=0.5, param_idx2name=names, wd=0.1)
    assert {index: lars._get_wd(index) for index in names} == {
        0: 0.1,
        1: 0.0,
        2: 0.0,
        3: 0.0,
        4: 0.0,
    }
    moved = {}
    for index in names:
        weight = np.full(4, 3.0, np.float32)
        lars.update(index, weight, np.ones(4, np.float32), None)
        moved[index] = float(3.0 - weight[0])
    # |w| = 6, |g| = 2: rate 0.5 * 6 / (2 + wd * 6) for LARS names, 1 for the others.
    assert moved[1] == moved[2] == moved[3] == 1.0
    assert moved[0] == pytest.approx(0.5 * 6 / 2.6 * (1 + 0.1 * 3 / 1), rel=1e-6)
    assert moved[4] == pytest.approx(0.5 * 6 / 2, rel=1e-6)


def test_lars_momentum_follows_the_learning_rate_change():
    """momentum_correction: the momentum is scaled by lr / previous lr (any index's)."""
    scheduler = opt.MultiFactorScheduler(step=[1], factor=0.5, base_lr=1.0)
    lars = opt.LARS(momentum=0.5, eta=1.0, lr_scheduler=scheduler)
    updater = opt.get_updater(lars)
    weight = np.ones(1, np.float32)
    updater(0, np.ones(1, np.float32), weight)  # lr 1, rate 1: mom = -1, w = 0
    assert lars.shared_state() == {"cur_lr": 1.0}
    updater(0, np.ones(1, np.float32), weight)  # w = 0: plain lr 0.5; mom = 0.25 * -1 - 0.5
    assert (weight.tolist(), lars.last_lr, lars.cur_lr) == ([-0.75], 1.0, 0.5)


def test_group_adagrad_needs_two_dimensional_weights_and_no_weight_decay():
    with pytest.raises(OptimizerError, match=r"GroupAdaGrad: index 0: the weight must be 2-D"):
        opt.get_updater(opt.GroupAdaGrad())(0, np.ones(3, np.float32), np.ones(3, np.float32))
    updater = opt.get_updater(opt.GroupAdaGrad(wd=0.1))
    weight = np.ones((2, 2), np.float32)
    with pytest.raises(OptimizerError, match="weight decay is not supported"):
        updater(0, np.ones((2, 2), np.float32), weight)
    assert weight.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert updater.optimizer.index_update_counts == {}


def test_group_adagrad_keeps_one_history_value_per_row():
    optimizer = opt.GroupAdaGrad(learning_rate=1.0, eps=1.0)
    updater = opt.get_updater(optimizer)
    weight = np.zeros((2, 2), np.float32)
    updater(0, np.array([[3.0, 1.0], [0.0, 0.0]], np.float32), weight)
    # history = mean(g**2) = 5: w = -g / sqrt(5 + 1)
    np.testing.assert_allclose(updater.states[0], [[5.0], [0.0]])
    np.testing.assert_allclose(weight, [[-3 / 6**0.5, -1 / 6**0.5], [0.0, 0.0]], rtol=1e-6)


def test_group_adagrad_history_of_an_overflowing_row_is_inf_as_mxnets():
    """MXNet's mean drops its compensation once a sum overflows: the row's history is inf
    and its weight does not move. The numbers are MXNet 1.9.1's for these inputs (run by
    hand)."""
    updater = opt.get_updater(opt.GroupAdaGrad(learning_rate=0.1))
    weight = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], np.float32)
    with np.errstate(over="ignore"):
        updater(0, np.array([[1e19, 2e19, 1.0], [1.0, 2.0, 3.0]], np.float32), weight)
    assert updater.states[0].ravel().tolist() == [np.inf, np.float32(4.6666665)]
    np.testing.assert_array_equal(
        weight, np.array([[1.0, 2.0, 3.0], [0.95370907, 0.9074181, 0.86112714]], np.float32)
    )


# -- AdamW -----------------------------------------------------------------------------------

TORCH_CASES = [
    # shape, lr, wd, epsilon, steps
    ((7,), 0.001, 0.0, 1e-6, 6),
    ((30, 40), 0.01, 0.01, 1e-8, 10),
    ((300,), 0.1, 0.1, 1e-6, 10),
]


@pytest.mark.parametrize(("shape", "lr", "wd", "epsilon", "steps"), TORCH_CASES)
def test_adamw_is_torchs_adamw(shape, lr, wd, epsilon, steps):
    """Within 2.5e-7 over ten steps (weights of order 1, steps up to 0.1): torch's CPU kernels
    compute the moving averages with fused multiply-adds (``lerp_``, ``addcmul_``), which NumPy
    has no ufunc for, so the last bit of a value differs now and then. Measured when written:
    at most 1.5e-7."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    initial = rng.standard_normal(shape).astype(np.float32)
    parameter = torch.nn.Parameter(torch.tensor(initial))
    reference = torch.optim.AdamW(
        [parameter], lr=lr, betas=(0.9, 0.999), eps=epsilon, weight_decay=wd
    )
    updater = opt.get_updater(opt.AdamW(learning_rate=lr, epsilon=epsilon, wd=wd))
    weight = initial.copy()
    for _ in range(steps):
        grad = (2 * rng.standard_normal(shape)).astype(np.float32)
        parameter.grad = torch.tensor(grad)
        reference.step()
        updater(0, grad, weight)
        np.testing.assert_allclose(weight, parameter.detach().numpy(), rtol=0, atol=2.5e-7)


def test_adamw_formula_by_hand():
    """w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w): at t = 1, m_hat = g, v_hat = g**2."""
    weight = np.array([2.0], np.float32)
    opt.get_updater(opt.AdamW(learning_rate=0.1, wd=0.5, epsilon=1.0))(
        0, np.array([3.0], np.float32), weight
    )
    assert weight[0] == pytest.approx(2.0 - 0.1 * (3.0 / (3.0 + 1.0) + 0.5 * 2.0), rel=1e-6)


def test_adamw_defaults_are_mxnet_2s():
    adamw = opt.AdamW()
    assert (adamw.lr, adamw.beta1, adamw.beta2, adamw.epsilon, adamw.correct_bias) == (
        0.001,
        0.9,
        0.999,
        1e-6,
        True,
    )


# -- Nadam's shared state ------------------------------------------------------------------


def test_nadams_momentum_schedule_travels_with_the_states():
    nadam = opt.get_updater(opt.Nadam())
    nadam(0, np.ones(3, np.float32), np.ones(3, np.float32))
    data = nadam.dump_states()
    assert opt.decode_states(data).shared_state == {"m_schedule": nadam.optimizer.m_schedule}
    restored = opt.get_updater(opt.Nadam())
    restored.load_states(data)
    assert restored.optimizer.m_schedule == nadam.optimizer.m_schedule
