"""SGD, NAG and Signum against values computed by hand from the documented formulas."""

from __future__ import annotations

import numpy as np
import pytest

from akv.errors import StateFormatError
from akv.optimizer import NAG, SGD, Signum, get_updater


def f32(values):
    return np.array(values, dtype=np.float32)


def run(optimizer, weight, grads, index=0):
    updater = get_updater(optimizer)
    weight = f32(weight)
    history = []
    for grad in grads:
        updater(index, f32(grad), weight)
        history.append(weight.copy())
    return history


def test_sgd_takes_a_learning_rate_step_then_a_second_for_a_bigger_push():
    first, second = run(SGD(learning_rate=0.1), [1.0], [[1.0], [2.0]])
    assert first == pytest.approx([0.9])
    assert second == pytest.approx([0.7])


def test_sgd_momentum_with_weight_decay_follows_mxnet_formula():
    # mom = 0.9 * mom - 0.1 * (g + 0.01 * w); w += mom
    history = run(SGD(learning_rate=0.1, momentum=0.9, wd=0.01), [1.0], [[1.0]] * 3)
    assert [h[0] for h in history] == pytest.approx([0.899, 0.707201, 0.4338747], rel=1e-6)


def test_default_sgd_moves_zeros_by_minus_point_zero_one():
    weight = np.zeros((2, 2), np.float32)
    get_updater(SGD())(3, np.ones((2, 2), np.float32), weight)
    np.testing.assert_allclose(weight, np.full((2, 2), -0.01), rtol=1e-6)


def test_sgd_rescales_then_clips_and_decays_the_weight():
    # w -= lr * (wd * w + clip(rescale * g, 0.3)), with g = [4, 0.2] -> clipped [0.3, 0.1]
    optimizer = SGD(learning_rate=0.5, rescale_grad=0.5, clip_gradient=0.3, wd=0.1)
    first, second = run(optimizer, [1.0, -2.0], [[4.0, 0.2]] * 2)
    w = [1.0, -2.0]
    expected = []
    for _ in range(2):
        w = [wi - 0.5 * (0.1 * wi + gc) for wi, gc in zip(w, [0.3, 0.1], strict=True)]
        expected.append(w)
    np.testing.assert_allclose(first, [0.8, -1.95], rtol=1e-6)
    np.testing.assert_allclose(second, expected[1], rtol=1e-6)
    np.testing.assert_allclose(second, [0.61, -1.9025], rtol=1e-6)


def test_sgd_rescale_applies_to_the_gradient_before_momentum():
    # mom = -lr * rescale * g = -0.1 * 0.5 * 2 = -0.1, then mom = 0.9 * -0.1 - 0.1 = -0.19
    history = run(SGD(learning_rate=0.1, momentum=0.9, rescale_grad=0.5), [0.0], [[2.0]] * 2)
    assert [h[0] for h in history] == pytest.approx([-0.1, -0.29], rel=1e-6)


def test_sgd_without_momentum_keeps_no_state():
    updater = get_updater(SGD(learning_rate=0.1))
    updater(0, f32([1.0]), f32([1.0]))
    assert updater.states == {0: None}


def test_sgd_momentum_state_is_a_zero_initialised_array_of_the_weight_shape():
    state = SGD(momentum=0.5).create_state(0, np.ones((3, 2), np.float32))
    assert state.shape == (3, 2) and state.dtype == np.float32 and not state.any()


def test_zero_clip_gradient_turns_clipping_off_as_in_mxnet():
    (weight,) = run(SGD(learning_rate=1.0, clip_gradient=0), [0.0], [[5.0]])
    assert weight == pytest.approx([-5.0])


def test_nag_two_steps_with_weight_decay():
    # MXNet's nag_mom_update: with total = g + wd * w,
    #   mom *= m; w = (w - mom) + (m + 1) * (mom - lr * total); mom -= lr * (g + wd * w_new)
    lr, m, wd = 0.1, 0.9, 0.1
    w, mom = 1.0, 0.0
    expected = []
    for g in (1.0, 1.0):
        total = g + wd * w
        mom = m * mom
        w = (w - mom) + (m + 1) * (mom - lr * total)
        mom = mom - lr * (g + wd * w)
        expected.append(w)
    history = run(NAG(learning_rate=lr, momentum=m, wd=wd), [1.0], [[1.0], [1.0]])
    assert [h[0] for h in history] == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx([0.791, 0.4985639], rel=1e-6)


def test_nag_clips_the_rescaled_gradient_but_not_the_weight_decay():
    # g = clip(0.5 * 3, 1) = 1; total = 1 + 0.1 * 1 = 1.1; w = 1 + 1.9 * (-0.11) = 0.791
    (weight,) = run(
        NAG(learning_rate=0.1, momentum=0.9, wd=0.1, clip_gradient=1.0, rescale_grad=0.5),
        [1.0],
        [[3.0]],
    )
    assert weight == pytest.approx([0.791], rel=1e-6)


def test_nag_without_momentum_is_sgd():
    history = run(NAG(learning_rate=0.1, wd=0.1), [1.0], [[1.0], [1.0]])
    # w = (1 - lr * wd) * w - lr * g
    assert [h[0] for h in history] == pytest.approx([0.89, 0.89 * 0.99 - 0.1], rel=1e-6)


def test_signum_steps_by_the_sign_of_the_momentum_with_decoupled_decay():
    # mom = 0.9 * mom - 0.1 * (g + wd * w); w = (1 - lr * wd_lh) * w + lr * sign(mom)
    lr, m, wd, wd_lh = 0.1, 0.9, 0.1, 0.2
    w, mom = [1.0, -1.0], [0.0, 0.0]
    grad = [0.5, 0.05]
    expected = []
    for _ in range(2):
        mom = [m * mi - (1 - m) * (gi + wd * wi) for mi, gi, wi in zip(mom, grad, w, strict=True)]
        w = [(1 - lr * wd_lh) * wi + lr * float(np.sign(mi)) for wi, mi in zip(w, mom, strict=True)]
        expected.append(w)
    history = run(Signum(learning_rate=lr, momentum=m, wd=wd, wd_lh=wd_lh), [1, -1], [grad] * 2)
    np.testing.assert_allclose(history, expected, rtol=1e-6)
    np.testing.assert_allclose(history[1], [0.7624, -0.7624], rtol=1e-6)


def test_signsgd_without_momentum_decays_then_steps_by_the_gradient_sign():
    # w = (1 - lr * wd) * w - lr * sign(g); sign(0) = 0
    history = run(Signum(learning_rate=0.1, momentum=0.0, wd=0.1), [1.0, -1.0], [[0.5, 0.0]] * 2)
    np.testing.assert_allclose(history[0], [0.89, -0.99], rtol=1e-6)
    np.testing.assert_allclose(history[1], [0.89 * 0.99 - 0.1, -0.99 * 0.99], rtol=1e-6)


def test_signum_defaults_are_mxnets():
    optimizer = Signum()
    assert (optimizer.learning_rate, optimizer.momentum, optimizer.wd_lh) == (0.01, 0.9, 0.0)


def test_a_new_configuration_keeps_a_state_that_fits_and_remakes_one_that_does_not():
    """``Updater.reconfigure`` (a distributed store's second ``set_optimizer`` of the same
    optimizer): a new learning rate keeps the momentum; momentum turned off drops it, and
    turned on again starts it from zeros, dense and row-sparse alike. Before, a row-sparse
    update after momentum was turned off or on raised (``zip()`` of the new state's arrays
    with the kept ones), and a dense key kept momentum off once it had been off."""
    from akv.rows import RowTable
    from akv.sparse import RowSparseArray

    weight = np.zeros(2, np.float32)
    table = RowTable((4, 2), np.float32)
    updater = get_updater(SGD(learning_rate=0.1, momentum=0.9))
    grad = np.ones(2, np.float32)
    rows = RowSparseArray(np.ones((2, 2), np.float32), np.array([1, 3]), (4, 2))
    phases = [(0.1, 0.9, 2), (0.2, 0.9, 1), (0.1, 0.0, 1), (0.1, 0.9, 2)]
    expected, momentum = 0.0, 0.0
    for number, (lr, mom, steps) in enumerate(phases):
        if number:
            updater.reconfigure(SGD(learning_rate=lr, momentum=mom), {"w": weight, "emb": table})
            if mom == 0.0 or phases[number - 1][1] == 0.0:
                momentum = 0.0  # another structure: made anew
        for _ in range(steps):
            updater("w", grad, weight)
            updater.update_rows("emb", table, rows)
            momentum = mom * momentum - lr
            expected += momentum if mom else -lr
    assert weight == pytest.approx([expected] * 2, abs=1e-6)
    assert table.gather(np.array([1, 3])) == pytest.approx(np.full((2, 2), expected), abs=1e-6)
    assert expected == pytest.approx(-0.1 - 0.19 - 0.371 - 0.1 - 0.1 - 0.19)


def test_a_new_configuration_remakes_a_loaded_state_of_the_old_one_and_keeps_a_wrong_one():
    """States loaded for momentum 0.9, then momentum turned off before any update: the
    loaded momentum goes (it fitted the old configuration). A loaded state that fits
    neither configuration (another shape) is still refused at its next update."""
    weight = np.zeros(2, np.float32)
    saved = get_updater(SGD(learning_rate=0.1, momentum=0.9))
    saved("w", np.ones(2, np.float32), weight)
    updater = get_updater(SGD(learning_rate=0.1, momentum=0.9))
    updater.load_states(saved.dump_states())
    updater.reconfigure(SGD(learning_rate=0.1, momentum=0.0), {"w": weight})
    updater("w", np.ones(2, np.float32), weight)
    assert weight == pytest.approx([-0.2, -0.2]) and updater.states["w"] is None
    wrong = np.zeros(3, np.float32)  # the states file is of a weight of 2
    updater = get_updater(SGD(learning_rate=0.1, momentum=0.9))
    updater.load_states(saved.dump_states())
    updater.reconfigure(SGD(learning_rate=0.1, momentum=0.0), {"w": wrong})
    with pytest.raises(StateFormatError, match="does not fit its weight"):
        updater("w", np.ones(3, np.float32), wrong)


def test_a_remade_state_counts_its_updates_from_the_first_again():
    """Adam on float16 weights, ``multi_precision`` turned on after three updates: the state
    is made anew (a float32 master copy joins it), and its update count starts again, so
    the next update is a fresh Adam's first (bias correction and all). Before, the kept
    count made it differ from a fresh one by up to 0.008 (a review)."""
    from akv.optimizer import Adam

    weight = np.linspace(-1, 1, 6).astype(np.float16)
    grad = np.linspace(0.5, -0.5, 6).astype(np.float16)
    updater = get_updater(Adam(learning_rate=0.1))
    with pytest.warns(UserWarning, match="consider multi_precision=True"):
        for _ in range(3):
            updater("w", grad, weight)
    assert updater.optimizer.num_update == 3
    fresh_weight = weight.copy()
    updater.reconfigure(Adam(learning_rate=0.1, multi_precision=True), {"w": weight})
    updater("w", grad, weight)
    fresh = get_updater(Adam(learning_rate=0.1, multi_precision=True))
    fresh("w", grad, fresh_weight)
    np.testing.assert_array_equal(weight, fresh_weight)
    assert updater.optimizer.num_update == 3  # (the lr schedule's count goes on)
    assert updater.optimizer.index_update_counts["w"] == 1
