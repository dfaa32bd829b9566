"""float16 weights with a float32 master copy (``multi_precision=True``)."""

from __future__ import annotations

import numpy as np
import pytest

from akv.errors import InvalidArgumentError
from akv.optimizer import NAG, SGD, Adam, get_updater


def test_small_steps_accumulate_in_the_master_copy_and_reach_the_float16_weight():
    # 1 - 1e-4 rounds back to 1 in float16 (spacing below 1 is 2**-11 ~ 4.9e-4)
    weight = np.ones(2, np.float16)
    updater = get_updater(SGD(learning_rate=1e-4, multi_precision=True))
    for _ in range(10):
        updater(0, np.ones(2, np.float16), weight)
    momentum, master = updater.states[0]
    assert momentum is None and master.dtype == np.float32
    np.testing.assert_allclose(master, [0.999, 0.999], rtol=1e-6)
    np.testing.assert_array_equal(weight, np.float16(0.999))


def test_without_multi_precision_float16_steps_round_away_and_a_warning_says_so():
    weight = np.ones(2, np.float16)
    updater = get_updater(SGD(learning_rate=1e-4))
    with pytest.warns(UserWarning, match="multi_precision=True"):
        updater(0, np.ones(2, np.float16), weight)
    for _ in range(9):
        updater(0, np.ones(2, np.float16), weight)
    np.testing.assert_array_equal(weight, [1.0, 1.0])


def test_sgd_and_nag_keep_state_then_master_as_mxnet():
    weight = np.ones(3, np.float16)
    for optimizer in (
        SGD(momentum=0.9, multi_precision=True),
        NAG(momentum=0.9, multi_precision=True),
    ):
        momentum, master = optimizer.create_state_multi_precision(0, weight)
        assert momentum.dtype == master.dtype == np.float32
        assert master.tolist() == [1.0, 1.0, 1.0]


def test_other_optimizers_keep_master_then_state():
    master, (mean, var) = Adam(multi_precision=True).create_state_multi_precision(
        0, np.ones(3, np.float16)
    )
    assert master.dtype == mean.dtype == var.dtype == np.float32


def test_sgd_momentum_in_multi_precision_matches_the_float32_formula():
    # the float32 example (0.899, 0.707201, 0.4338747), rounded to float16 each time
    weight = np.ones(1, np.float16)
    updater = get_updater(SGD(learning_rate=0.1, momentum=0.9, wd=0.01, multi_precision=True))
    history = []
    for _ in range(3):
        updater(0, np.ones(1, np.float16), weight)
        history.append(weight[0])
    assert history == [np.float16(0.899), np.float16(0.707201), np.float16(0.4338747)]
    np.testing.assert_allclose(updater.states[0][1], [0.4338747], rtol=1e-6)


def test_float32_weights_ignore_multi_precision():
    state = Adam(multi_precision=True).create_state_multi_precision(0, np.ones(2, np.float32))
    assert len(state) == 2 and state[0].dtype == np.float32 and state[0].shape == (2,)


def test_a_multi_precision_update_needs_the_master_copy_in_the_state():
    optimizer = Adam(multi_precision=True)
    weight = np.ones(2, np.float16)
    with pytest.raises(InvalidArgumentError, match="master copy"):
        optimizer.update_multi_precision(0, weight, np.ones(2, np.float16), None)
