"""Adam, AdaGrad, RMSProp, AdaDelta, FTRL and LAMB against hand-computed values.

Each expected value is computed element by element in plain float arithmetic following the
formula in the optimizer's docstring (MXNet 1.9.1's).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from akv.optimizer import FTRL, LAMB, AdaDelta, AdaGrad, Adam, RMSProp, get_updater

W0 = [1.0, -2.0, 0.5]
GRADS = [[3.0, 0.6, -0.2], [-1.0, 0.4, 0.1]]


def clip(x, bound):
    return max(-bound, min(bound, x))


def run(optimizer, weight=W0, grads=GRADS):
    updater = get_updater(optimizer)
    weight = np.array(weight, np.float32)
    history = []
    for grad in grads:
        updater(0, np.array(grad, np.float32), weight)
        history.append(weight.copy())
    return history


def per_element(step, weight=W0, grads=GRADS):
    """Apply ``step(w, g, state, t) -> w`` element by element; per-element state dicts."""
    states = [{} for _ in weight]
    current = list(weight)
    history = []
    for t, grad in enumerate(grads, start=1):
        current = [step(w, g, s, t) for w, g, s in zip(current, grad, states, strict=True)]
        history.append(current)
    return history


def test_adam_two_steps_with_weight_decay_clipping_and_rescaling():
    lr, b1, b2, eps, wd, c, r = 0.1, 0.9, 0.999, 1e-8, 0.1, 1.0, 0.5

    def step(w, g, s, t):
        g = clip(r * g + wd * w, c)
        s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * g
        s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * g * g
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        return w - lr_t * s["m"] / (math.sqrt(s["v"]) + eps)

    got = run(Adam(learning_rate=lr, wd=wd, clip_gradient=c, rescale_grad=r))
    np.testing.assert_allclose(got, per_element(step), rtol=1e-5, atol=1e-6)


def test_adam_first_step_moves_each_weight_by_about_the_learning_rate():
    (weight,) = run(Adam(learning_rate=0.01), grads=[[3.0, -0.5, 2.0]])
    np.testing.assert_allclose(weight, [0.99, -1.99, 0.49], rtol=1e-5)


def test_adam_defaults_are_mxnets():
    adam = Adam()
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.epsilon) == (0.001, 0.9, 0.999, 1e-8)


def test_adagrad_two_steps_with_weight_decay_and_clipping():
    lr, eps, wd, c, r = 0.1, 1e-7, 0.1, 1.0, 0.5

    def step(w, g, s, t):
        g = clip(r * g, c)
        s["h"] = s.get("h", 0.0) + g * g
        return w - lr * (g / math.sqrt(s["h"] + eps) + wd * w)

    got = run(AdaGrad(learning_rate=lr, wd=wd, clip_gradient=c, rescale_grad=r))
    np.testing.assert_allclose(got, per_element(step), rtol=1e-6, atol=1e-7)


def test_rmsprop_two_steps_with_weight_decay_and_clipping():
    lr, g1, eps, wd, c = 0.1, 0.9, 0.01, 0.1, 1.0

    def step(w, g, s, t):
        g = clip(0.5 * g + wd * w, c)
        s["n"] = (1 - g1) * g * g + g1 * s.get("n", 0.0)
        return w - lr * g / math.sqrt(s["n"] + eps)

    got = run(RMSProp(learning_rate=lr, wd=wd, clip_gradient=c, rescale_grad=0.5, epsilon=eps))
    np.testing.assert_allclose(got, per_element(step), rtol=1e-6, atol=1e-7)
    assert got[0][0] == pytest.approx(1 - 0.1 / math.sqrt(0.11), rel=1e-6)


def test_centered_rmsprop_two_steps_with_weight_decay_and_clipping():
    lr, g1, g2, eps, wd, c = 0.1, 0.9, 0.8, 0.01, 0.1, 1.0

    def step(w, g, s, t):
        g = clip(0.5 * g + wd * w, c)
        s["n"] = (1 - g1) * g * g + g1 * s.get("n", 0.0)
        s["mean"] = (1 - g1) * g + g1 * s.get("mean", 0.0)
        s["delta"] = g2 * s.get("delta", 0.0) - lr * g / math.sqrt(s["n"] - s["mean"] ** 2 + eps)
        return w + s["delta"]

    optimizer = RMSProp(
        learning_rate=lr,
        gamma1=g1,
        gamma2=g2,
        epsilon=eps,
        centered=True,
        wd=wd,
        clip_gradient=c,
        rescale_grad=0.5,
    )
    np.testing.assert_allclose(run(optimizer), per_element(step), rtol=1e-6, atol=1e-7)


def test_rmsprop_clips_weights_after_the_step():
    # w = -2 - 0.1 * 0.6 / sqrt(0.1 * 0.36 + 1e-8) = -2.316..., clipped to -1.5
    (weight,) = run(RMSProp(learning_rate=0.1, clip_weights=1.5), grads=[[0.0, 0.6, 0.0]])
    np.testing.assert_allclose(weight, [1.0, -1.5, 0.5], rtol=1e-6)


def test_rmsprop_state_is_one_array_or_three_when_centered():
    weight = np.ones(4, np.float32)
    assert len(RMSProp().create_state(0, weight)) == 1
    assert len(RMSProp(centered=True).create_state(0, weight)) == 3


def test_adadelta_two_steps_with_weight_decay_and_clipping():
    rho, eps, wd, c = 0.9, 0.01, 0.1, 1.0

    def step(w, g, s, t):
        g = clip(0.5 * g, c)
        s["acc_g"] = rho * s.get("acc_g", 0.0) + (1 - rho) * g * g
        delta = math.sqrt(s.get("acc_delta", 0.0) + eps) / math.sqrt(s["acc_g"] + eps) * g
        s["acc_delta"] = rho * s.get("acc_delta", 0.0) + (1 - rho) * delta * delta
        return w - (delta + wd * w)

    optimizer = AdaDelta(rho=rho, epsilon=eps, wd=wd, clip_gradient=c, rescale_grad=0.5)
    np.testing.assert_allclose(run(optimizer), per_element(step), rtol=1e-6, atol=1e-7)


def test_ftrl_two_steps_with_weight_decay_and_clipping():
    lr, l1, beta, wd, c = 0.1, 0.01, 1.0, 0.1, 1.0

    def step(w, g, s, t):
        g = clip(0.5 * g, c)
        z, n = s.get("z", 0.0), s.get("n", 0.0)
        z += g - (math.sqrt(n + g * g) - math.sqrt(n)) * w / lr
        n += g * g
        s["z"], s["n"] = z, n
        if abs(z) <= l1:
            return 0.0
        return (math.copysign(l1, z) - z) / ((beta + math.sqrt(n)) / lr + wd)

    optimizer = FTRL(
        learning_rate=lr, lamda1=l1, beta=beta, wd=wd, clip_gradient=c, rescale_grad=0.5
    )
    got = run(optimizer)
    np.testing.assert_allclose(got, per_element(step), rtol=1e-6, atol=1e-7)
    assert got[0][0] == pytest.approx((-0.01 + 9) / 20.1, rel=1e-6)


def test_ftrl_zeroes_weights_whose_accumulated_gradient_is_within_lamda1():
    # z = g - (|g| - 0) * w / lr with w = 0 is g itself; |0.001| <= 0.01 -> 0
    (weight,) = run(FTRL(), weight=[0.0, 0.0], grads=[[0.001, 1.0]])
    assert weight[0] == 0.0 and weight[1] != 0.0


def test_ftrl_defaults_are_mxnets():
    ftrl = FTRL()
    assert (ftrl.learning_rate, ftrl.lamda1, ftrl.beta) == (0.1, 0.01, 1.0)


def lamb_reference(lr, wd, clip_gradient=None, lower=None, upper=None, bias_correction=True):
    b1, b2, eps = 0.9, 0.999, 1e-6
    weight = list(W0)
    mean = [0.0] * len(weight)
    var = [0.0] * len(weight)
    history = []
    for t, grad in enumerate(GRADS, start=1):
        ratio = []
        for i, g in enumerate(grad):
            if clip_gradient:
                g = clip(g, clip_gradient)
            mean[i] = b1 * mean[i] + (1 - b1) * g
            var[i] = b2 * var[i] + (1 - b2) * g * g
            if bias_correction:
                m_hat, v_hat = mean[i] / (1 - b1**t), var[i] / (1 - b2**t)
            else:
                m_hat, v_hat = mean[i], var[i]
            ratio.append(m_hat / (math.sqrt(v_hat) + eps) + wd * weight[i])
        r1 = math.sqrt(sum(w * w for w in weight))
        if lower:
            r1 = max(r1, lower)
        if upper:
            r1 = min(r1, upper)
        r2 = math.sqrt(sum(r * r for r in ratio))
        step = lr * r1 / r2 if r1 > 0 and r2 > 0 else lr
        weight = [w - step * r for w, r in zip(weight, ratio, strict=True)]
        history.append(weight)
    return history


@pytest.mark.parametrize(
    "options",
    [
        {"wd": 0.1, "clip_gradient": 1.0},
        {"wd": 0.1, "bias_correction": False},
        {"wd": 0.0, "lower_bound": 5.0},
        {"wd": 0.01, "upper_bound": 0.5},
    ],
    ids=["wd+clip", "no-bias-correction", "lower-bound", "upper-bound"],
)
def test_lamb_two_steps_scale_the_step_by_the_norm_ratio(options):
    expected = lamb_reference(
        0.1,
        options["wd"],
        options.get("clip_gradient"),
        options.get("lower_bound"),
        options.get("upper_bound"),
        options.get("bias_correction", True),
    )
    np.testing.assert_allclose(run(LAMB(learning_rate=0.1, **options)), expected, rtol=1e-5)


def test_lamb_with_a_zero_weight_takes_a_plain_learning_rate_step():
    # r1 = 0, so the step is lr * ratio; first step ratio = sign(g) / (1 + 1e-6)
    (weight,) = run(LAMB(learning_rate=0.1), weight=[0.0, 0.0], grads=[[2.0, -3.0]])
    np.testing.assert_allclose(weight, [-0.1 / (1 + 1e-6), 0.1 / (1 + 1e-6)], rtol=1e-6)
