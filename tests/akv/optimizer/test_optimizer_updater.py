"""The Updater: ``updater(index, grad, weight)`` as a key-value store calls it."""

from __future__ import annotations

import numpy as np
import pytest

from akv.errors import InvalidArgumentError, ShapeMismatchError
from akv.optimizer import SGD, Adam, Updater, get_updater


def test_get_updater_returns_an_updater_of_that_optimizer():
    optimizer = SGD()
    updater = get_updater(optimizer)
    assert isinstance(updater, Updater) and updater.optimizer is optimizer


def test_the_weight_array_itself_is_updated():
    weight = np.ones(3, np.float32)
    same = weight
    get_updater(SGD(learning_rate=0.5))(0, np.ones(3, np.float32), weight)
    assert same is weight
    np.testing.assert_array_equal(weight, [0.5, 0.5, 0.5])


def test_a_state_is_created_on_the_first_update_of_each_index_and_kept():
    updater = get_updater(Adam())
    assert updater.states == {}
    weight = np.ones(2, np.float32)
    updater(3, np.ones(2, np.float32), weight)
    first = updater.states[3]
    updater(3, np.ones(2, np.float32), weight)
    assert updater.states[3] is first
    assert first[0].any()  # the mean moved


def test_int_and_str_indexes_are_kept_as_given():
    updater = get_updater(SGD(momentum=0.5))
    updater(1, np.ones(1, np.float32), np.ones(1, np.float32))
    updater("1", np.ones(1, np.float32), np.ones(1, np.float32))
    assert set(updater.states) == {1, "1"}
    assert dict(updater.optimizer.index_update_counts) == {1: 1, "1": 1}


@pytest.mark.parametrize("index", [1.0, b"key", None, True])
def test_an_index_that_is_neither_int_nor_str_is_an_invalid_argument(index):
    with pytest.raises(InvalidArgumentError, match="neither an int nor a str"):
        get_updater(SGD())(index, np.ones(1, np.float32), np.ones(1, np.float32))


def test_a_bad_update_creates_no_state():
    updater = get_updater(SGD(momentum=0.9))
    with pytest.raises(ShapeMismatchError):
        updater(0, np.ones(3, np.float32), np.ones(2, np.float32))
    assert updater.states == {}


def test_an_updater_needs_an_akv_optimizer():
    with pytest.raises(InvalidArgumentError, match="akv Optimizer"):
        Updater(object())
