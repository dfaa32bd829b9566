"""The Optimizer base: learning rates, multipliers, counts, registry, configs and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import akv.optimizer as opt
from akv.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    OptimizerError,
    ShapeMismatchError,
)
from akv.optimizer import (
    CHUNK_ELEMENTS,
    FTRL,
    LAMB,
    NAG,
    SGD,
    AdaDelta,
    AdaGrad,
    Adam,
    FactorScheduler,
    Optimizer,
    PolyScheduler,
    RMSProp,
    Signum,
    create,
    from_config,
    get_updater,
)

ALL_OPTIMIZERS = [
    SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
    NAG(learning_rate=0.1, momentum=0.9, wd=0.01),
    Signum(wd=0.01),
    Adam(wd=0.01),
    AdaGrad(wd=0.01),
    RMSProp(centered=True, wd=0.01),
    AdaDelta(wd=0.01),
    FTRL(wd=0.01),
    LAMB(wd=0.01),
    opt.FTML(beta1=0.5, wd=0.01),
    opt.Adamax(beta2=0.99, wd=0.01),
    opt.Nadam(schedule_decay=0.01, wd=0.01),
    opt.AdamW(correct_bias=False, wd=0.01),
    opt.DCASGD(momentum=0.9, lamda=0.1, wd=0.01),
    opt.LARS(momentum=0.9, eta=0.01, eps=1e-6, momentum_correction=False, lazy_update=False),
    opt.GroupAdaGrad(eps=1e-6),
]


def ids(optimizers):
    return [type(o).__name__ for o in optimizers]


def test_learning_rate_defaults_to_point_zero_one_without_a_scheduler():
    assert Optimizer().learning_rate == 0.01
    assert SGD().learning_rate == 0.01


def test_set_learning_rate_changes_the_rate():
    optimizer = SGD()
    optimizer.set_learning_rate(0.3)
    assert optimizer.learning_rate == 0.3


def test_set_learning_rate_with_a_scheduler_is_an_error():
    optimizer = SGD(lr_scheduler=FactorScheduler(step=10))
    with pytest.raises(OptimizerError, match="set_learning_rate"):
        optimizer.set_learning_rate(0.3)


def test_set_learning_rate_rejects_a_negative_rate():
    with pytest.raises(OptimizerError, match="learning_rate must be >= 0"):
        SGD().set_learning_rate(-1)


def test_lr_mult_by_index_and_by_name():
    optimizer = SGD(learning_rate=1.0, param_idx2name={0: "fc_weight", 1: "fc_bias"})
    optimizer.set_lr_mult({"fc_weight": 0.5, 1: 0.25})
    assert (optimizer._get_lr(0), optimizer._get_lr(1), optimizer._get_lr(2)) == (0.5, 0.25, 1.0)


def test_names_ending_otherwise_than_weight_or_gamma_get_no_weight_decay():
    names = {0: "fc_weight", 1: "fc_bias", 2: "bn_gamma", 3: "bn_beta", 4: "bn_moving_mean"}
    optimizer = SGD(wd=0.1, param_idx2name=names)
    assert [optimizer._get_wd(i) for i in range(5)] == [0.1, 0.0, 0.1, 0.0, 0.0]


def test_set_wd_mult_overrides_the_default_by_name_or_index():
    optimizer = SGD(wd=0.1, param_idx2name={0: "fc_bias", 1: "fc_weight"})
    optimizer.set_wd_mult({"fc_bias": 1.0, 1: 2.0})
    assert (optimizer._get_wd(0), optimizer._get_wd(1)) == (0.1, 0.2)


def test_a_bias_named_by_idx2name_is_not_decayed_in_an_update():
    updater = get_updater(SGD(learning_rate=0.1, wd=0.5, param_idx2name={7: "fc_bias"}))
    weight = np.ones(1, np.float32)
    updater(7, np.zeros(1, np.float32), weight)
    assert weight[0] == 1.0


def test_update_counts_start_at_begin_num_update_and_num_update_is_their_maximum():
    optimizer = SGD(begin_num_update=5)
    updater = get_updater(optimizer)
    weight, grad = np.zeros(2, np.float32), np.ones(2, np.float32)
    for index in (0, 0, 1):
        updater(index, grad, weight)
    assert dict(optimizer.index_update_counts) == {0: 7, 1: 6}
    assert optimizer.num_update == 7


def test_index_update_counts_is_read_only():
    with pytest.raises(TypeError):
        SGD().index_update_counts[0] = 1


def test_restore_update_counts_replaces_counts_and_num_update():
    optimizer = Adam()
    optimizer.restore_update_counts({"a": 3}, 4)
    assert (dict(optimizer.index_update_counts), optimizer.num_update) == ({"a": 3}, 4)


def test_create_is_case_insensitive_and_knows_every_mxnet_name():
    names = ["SGD", "nag", "Adam", "adagrad", "RMSProp", "adadelta", "signum", "Ftrl", "lamb"]
    classes = [SGD, NAG, Adam, AdaGrad, RMSProp, AdaDelta, Signum, FTRL, LAMB]
    for name, cls in zip(names, classes, strict=True):
        assert type(create(name)) is cls


def test_create_passes_parameters():
    optimizer = create("sgd", learning_rate=0.2, momentum=0.5)
    assert (optimizer.learning_rate, optimizer.momentum) == (0.2, 0.5)


def test_create_with_an_unknown_name_is_an_error_listing_the_known_ones():
    with pytest.raises(OptimizerError, match=r"unknown optimizer 'adamx' \(known: .*sgd"):
        create("adamx")


def test_an_unknown_parameter_is_an_error_naming_optimizer_and_parameter():
    with pytest.raises(OptimizerError, match=r"Adam: unknown parameter\(s\) 'beta3'"):
        create("adam", beta3=0.5)


@pytest.mark.parametrize("name", ["sym", "param_dict"])
def test_mxnet_symbol_and_gluon_parameters_are_rejected_with_a_reason(name):
    with pytest.raises(OptimizerError, match=f"SGD: parameter '{name}'"):
        SGD(**{name: object()})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(learning_rate=-0.1), "SGD: learning_rate must be >= 0"),
        (lambda: SGD(momentum=1.0), "SGD: momentum must be < 1"),
        (lambda: SGD(momentum=-0.1), "SGD: momentum must be >= 0"),
        (lambda: SGD(wd=-1), "SGD: wd must be >= 0"),
        (lambda: SGD(clip_gradient=-1), "SGD: clip_gradient must be >= 0"),
        (lambda: SGD(rescale_grad=float("nan")), "SGD: rescale_grad must be finite"),
        (lambda: SGD(learning_rate="0.1"), "SGD: learning_rate must be a number"),
        (lambda: SGD(lazy_update=1), "SGD: lazy_update must be a bool"),
        (lambda: SGD(begin_num_update=-1), "SGD: begin_num_update must be an int"),
        (lambda: SGD(lr_scheduler=0.1), "SGD: lr_scheduler must be an LRScheduler"),
        (lambda: SGD(param_idx2name={0: 1}), "SGD: param_idx2name"),
        (lambda: SGD(param_idx2name={1.5: "w"}), "neither an int nor a str"),
        (lambda: Adam(beta1=1.0), "Adam: beta1 must be < 1"),
        (lambda: Adam(beta2=-0.5), "Adam: beta2 must be >= 0"),
        (lambda: Adam(epsilon=0), "Adam: epsilon must be > 0"),
        (lambda: AdaGrad(eps=-1), "AdaGrad: eps must be > 0"),
        (lambda: RMSProp(gamma1=1.2), "RMSProp: gamma1 must be < 1"),
        (lambda: RMSProp(clip_weights=-1), "RMSProp: clip_weights must be >= 0"),
        (lambda: AdaDelta(rho=1), "AdaDelta: rho must be < 1"),
        (lambda: FTRL(learning_rate=0), "FTRL: learning_rate must be > 0"),
        (lambda: FTRL(lamda1=-1), "FTRL: lamda1 must be >= 0"),
        (lambda: LAMB(lower_bound=2, upper_bound=1), "LAMB: lower_bound 2.0 exceeds"),
        (lambda: Signum(wd_lh=-1), "Signum: wd_lh must be >= 0"),
    ],
)
def test_bad_values_raise_optimizer_error_naming_optimizer_and_parameter(make, message):
    with pytest.raises(OptimizerError, match=message):
        make()


def test_optimizer_error_is_a_value_error():
    with pytest.raises(ValueError):
        SGD(learning_rate=-1)


def test_bad_multipliers_are_errors():
    with pytest.raises(OptimizerError, match=r"lr_mult\[0\] must be >= 0"):
        SGD().set_lr_mult({0: -1})
    with pytest.raises(OptimizerError, match="wd_mult must be a dict"):
        SGD().set_wd_mult([1])


@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=ids(ALL_OPTIMIZERS))
def test_config_survives_json_and_rebuilds_an_equal_optimizer(optimizer):
    config = json.loads(json.dumps(optimizer.get_config()))
    rebuilt = from_config(config)
    assert type(rebuilt) is type(optimizer)
    assert rebuilt.get_config() == optimizer.get_config()


def test_config_keeps_scheduler_multipliers_and_int_keyed_names():
    optimizer = SGD(
        learning_rate=0.2,
        momentum=0.9,
        lr_scheduler=PolyScheduler(max_update=100, base_lr=0.2, warmup_steps=5),
        param_idx2name={0: "fc_weight", 1: "fc_bias"},
        clip_gradient=2.0,
        rescale_grad=0.25,
        multi_precision=True,
    )
    optimizer.set_lr_mult({0: 0.5, "fc_bias": 2.0})
    optimizer.set_wd_mult({0: 3.0})
    rebuilt = from_config(json.loads(json.dumps(optimizer.get_config())))
    assert rebuilt.idx2name == {0: "fc_weight", 1: "fc_bias"}
    assert rebuilt.lr_mult == {0: 0.5, "fc_bias": 2.0}
    assert rebuilt.wd_mult == optimizer.wd_mult == {"fc_bias": 0.0, 0: 3.0}
    assert isinstance(rebuilt.lr_scheduler, PolyScheduler)
    assert rebuilt.lr_scheduler is not optimizer.lr_scheduler
    assert [rebuilt.lr_scheduler(n) for n in range(110)] == [
        optimizer.lr_scheduler(n) for n in range(110)
    ]
    assert (rebuilt.clip_gradient, rebuilt.rescale_grad, rebuilt.multi_precision) == (
        2.0,
        0.25,
        True,
    )


def test_config_records_hyper_parameters_changed_after_construction():
    optimizer = Adam()
    optimizer.beta1 = 0.5
    assert from_config(optimizer.get_config()).beta1 == 0.5


def test_config_of_an_adam_with_a_scheduler_rebuilds_without_a_warning(recwarn):
    with pytest.warns(UserWarning):
        optimizer = Adam(lr_scheduler=FactorScheduler(step=2, base_lr=0.1))
    from_config(json.loads(json.dumps(optimizer.get_config())))
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([], "must be a dict"),
        ({"params": {}}, "has no 'name'"),
        ({"name": "sgd", "extra": 1}, "unknown entries"),
        ({"name": "sgd", "params": 3}, "'params' must be a dict"),
        ({"name": "sgd", "params": {"lr_scheduler": None}}, "belongs in 'lr_scheduler'"),
        ({"name": "sgd", "lr_mult": [[0]]}, "lr_mult must be a list of"),
        ({"name": "sgd", "lr_mult": [[None, 1.0]]}, "neither an int nor a str"),
        ({"name": "sgd", "lr_scheduler": {"name": "Nope"}}, "unknown scheduler"),
        ({"name": "nope"}, "unknown optimizer"),
        ({"name": 3}, "must be a str"),
    ],
)
def test_bad_configs_raise_optimizer_error(config, message):
    with pytest.raises(OptimizerError, match=message):
        from_config(config)


def test_register_makes_a_custom_optimizer_creatable_and_rebuildable():
    @opt.register
    class HalfStep(Optimizer):
        _CONFIG_PARAMS = (("scale", "scale"),)

        def __init__(self, scale=0.5, **kwargs):
            super().__init__(**kwargs)
            self.scale = self._real("scale", scale)

        def _step(self, index, weight, grad, state, lr, wd):
            weight -= self.scale * lr * grad

    optimizer = from_config(create("halfstep", scale=0.25, learning_rate=1.0).get_config())
    weight = np.ones(2, np.float32)
    get_updater(optimizer)(0, np.ones(2, np.float32), weight)
    np.testing.assert_array_equal(weight, [0.75, 0.75])


def test_registering_another_class_under_a_taken_name_is_an_error():
    class SGD(Optimizer):  # same name as the built-in
        pass

    with pytest.raises(OptimizerError, match="already belongs to"):
        opt.register(SGD)


def test_register_rejects_what_is_not_an_optimizer_class():
    with pytest.raises(OptimizerError, match="not a subclass of Optimizer"):
        opt.register(int)


def test_an_optimizer_without_an_update_says_so():
    with pytest.raises(OptimizerError, match="applies no update"):
        Optimizer().update(0, np.ones(1, np.float32), np.ones(1, np.float32), None)


@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=ids(ALL_OPTIMIZERS))
def test_update_leaves_the_gradient_untouched(optimizer):
    # 2-D for GroupAdaGrad; no zero gradient where the weight is zero (Adamax: 0 / 0).
    weight = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    grad = np.linspace(2, -2, 8, dtype=np.float32).reshape(2, 4)
    before = grad.copy()
    state = optimizer.create_state(0, weight)
    optimizer.update(0, weight, grad, state)
    np.testing.assert_array_equal(grad, before)


@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=ids(ALL_OPTIMIZERS))
def test_a_non_contiguous_weight_is_updated_in_place(optimizer):
    contiguous = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    grad = np.linspace(2, -2, 12, dtype=np.float32).reshape(3, 4)
    expected = contiguous.copy()
    config = optimizer.get_config()
    from_config(config).update(0, expected, grad, from_config(config).create_state(0, expected))
    backing = np.zeros((3, 8), np.float32)
    strided = backing[:, ::2]
    strided[...] = contiguous
    assert not strided.flags.c_contiguous
    from_config(config).update(0, strided, grad, from_config(config).create_state(0, strided))
    np.testing.assert_array_equal(backing[:, ::2], expected)
    assert not backing[:, 1::2].any()


def test_arrays_longer_than_a_chunk_get_the_same_update_everywhere():
    size = 2 * CHUNK_ELEMENTS + 5
    weight = np.ones(size, np.float32)
    updater = get_updater(SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    for _ in range(3):
        updater(0, np.ones(size, np.float32), weight)
    np.testing.assert_allclose(weight, np.full(size, 0.4338747), rtol=1e-6)


def test_a_gradient_of_another_shape_is_a_shape_mismatch():
    with pytest.raises(ShapeMismatchError, match=r"gradient shape \(3,\) does not match") as info:
        SGD().update(4, np.ones(2, np.float32), np.ones(3, np.float32), None)
    assert (info.value.key, info.value.expected, info.value.got) == (4, (2,), (3,))


def test_a_gradient_of_another_dtype_is_a_dtype_mismatch():
    with pytest.raises(DTypeMismatchError, match="gradient dtype float64"):
        SGD().update(0, np.ones(2, np.float32), np.ones(2), None)


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        ([1.0, 2.0], "must be a numpy.ndarray"),
        (np.ones(2, np.int32), "update float16, float32 and float64 weights, got int32"),
        (np.ones(2, np.float32).view(), "read-only"),
    ],
)
def test_a_weight_that_cannot_be_updated_in_place_is_an_invalid_argument(weight, message):
    if isinstance(weight, np.ndarray) and message == "read-only":
        weight.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match=message):
        SGD().update(0, weight, np.ones(2, np.float32), None)
