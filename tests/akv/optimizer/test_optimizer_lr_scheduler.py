"""Learning-rate schedulers: MXNet 1.9.1's values at given update counts, warm-up, configs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from akv.errors import OptimizerError
from akv.optimizer import SGD, get_updater, lr_scheduler
from akv.optimizer.lr_scheduler import (
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    PolyScheduler,
)


def test_factor_scheduler_decays_after_each_full_step():
    scheduler = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    assert [scheduler(n) for n in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_factor_scheduler_stops_at_stop_factor_lr():
    scheduler = FactorScheduler(step=1, factor=0.5, base_lr=1.0, stop_factor_lr=0.2)
    assert [scheduler(n) for n in (1, 2, 3, 4, 10)] == [1.0, 0.5, 0.25, 0.2, 0.2]


def test_linear_warmup_rises_to_base_lr_then_the_schedule_takes_over():
    scheduler = FactorScheduler(
        step=2, factor=0.5, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2
    )
    # warm-up: 0.2 + 0.8 * n / 4; after it decays count from update 0: (4 - 1) // 2 = 1
    assert [scheduler(n) for n in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.5, 0.25])


def test_constant_warmup_stays_at_warmup_begin_lr():
    scheduler = MultiFactorScheduler(
        step=[5], base_lr=1.0, warmup_steps=3, warmup_begin_lr=0.1, warmup_mode="constant"
    )
    assert [scheduler(n) for n in range(4)] == [0.1, 0.1, 0.1, 1.0]


def test_multi_factor_scheduler_decays_after_each_listed_step():
    scheduler = MultiFactorScheduler(step=[2, 5], factor=0.1, base_lr=1.0)
    values = [scheduler(n) for n in (1, 2, 3, 5, 6, 100)]
    assert values == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_poly_scheduler_follows_the_polynomial_to_final_lr():
    scheduler = PolyScheduler(max_update=10, base_lr=1.0, pwr=2, final_lr=0.1)
    # 0.1 + 0.9 * (1 - n / 10) ** 2
    assert scheduler(0) == pytest.approx(1.0)
    assert scheduler(5) == pytest.approx(0.1 + 0.9 * 0.25)
    assert scheduler(10) == pytest.approx(0.1)
    assert scheduler(25) == pytest.approx(0.1)


def test_poly_scheduler_decays_over_the_updates_after_warmup():
    scheduler = PolyScheduler(max_update=10, base_lr=1.0, pwr=1, warmup_steps=2)
    # warm-up from 0: n / 2; then 1 - (n - 2) / 8
    assert [scheduler(n) for n in (0, 1, 2, 6, 10)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])


def test_cosine_scheduler_follows_half_a_cosine_to_final_lr():
    scheduler = CosineScheduler(max_update=10, base_lr=1.0, final_lr=0.1)
    assert scheduler(0) == pytest.approx(1.0)
    assert scheduler(5) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2)
    assert scheduler(10) == pytest.approx(0.1)
    assert scheduler(11) == pytest.approx(0.1)


def test_cosine_scheduler_with_linear_warmup():
    scheduler = CosineScheduler(max_update=12, base_lr=1.0, warmup_steps=2, warmup_begin_lr=0.5)
    assert scheduler(1) == pytest.approx(0.75)
    assert scheduler(7) == pytest.approx((1 + math.cos(math.pi * 5 / 10)) / 2)


def test_schedulers_answer_the_same_whatever_was_asked_before():
    for make in (
        lambda: FactorScheduler(step=3, factor=0.7, base_lr=1.0),
        lambda: MultiFactorScheduler(step=[2, 4], factor=0.5),
        lambda: PolyScheduler(max_update=8),
        lambda: CosineScheduler(max_update=8),
    ):
        used = make()
        for n in (20, 9, 1):
            used(n)
        assert [used(n) for n in range(12)] == [make()(n) for n in range(12)]


def test_optimizer_learning_rate_follows_the_scheduler_per_update():
    optimizer = SGD(lr_scheduler=FactorScheduler(step=1, factor=0.5, base_lr=1.0))
    weight = np.zeros(1, np.float32)
    updater = get_updater(optimizer)
    history = []
    for _ in range(3):
        updater(0, np.ones(1, np.float32), weight)
        history.append(float(weight[0]))
    # the k-th update uses scheduler(k): 1, 0.5, 0.25
    assert history == pytest.approx([-1.0, -1.5, -1.75])
    assert optimizer.learning_rate == pytest.approx(0.25)


def test_optimizer_learning_rate_replaces_base_lr_but_not_the_warmup_end():
    scheduler = FactorScheduler(step=1, factor=0.5, base_lr=1.0, warmup_steps=2)
    with pytest.warns(UserWarning, match="replaces the scheduler's base_lr"):
        SGD(learning_rate=0.4, lr_scheduler=scheduler)
    assert scheduler.base_lr == 0.4
    assert scheduler(1) == pytest.approx(0.5)  # warm-up still towards 1.0, as in MXNet
    assert scheduler(3) == pytest.approx(0.4 * 0.25)


def test_poly_and_cosine_keep_decaying_from_their_constructed_base_lr():
    for scheduler in (PolyScheduler(max_update=10, base_lr=1.0), CosineScheduler(10, 1.0)):
        with pytest.warns(UserWarning):
            SGD(learning_rate=0.1, lr_scheduler=scheduler)
        assert scheduler(0) == pytest.approx(1.0)


def test_the_base_scheduler_is_constant_after_its_warmup():
    scheduler = LRScheduler(base_lr=0.4, warmup_steps=4, warmup_begin_lr=0.0)
    assert [scheduler(n) for n in (0, 2, 4, 100)] == pytest.approx([0.0, 0.2, 0.4, 0.4])


@pytest.mark.parametrize(
    "scheduler",
    [
        FactorScheduler(step=3, factor=0.5, stop_factor_lr=1e-3, base_lr=0.2, warmup_steps=2),
        MultiFactorScheduler(step=[3, 7], factor=0.3, warmup_mode="constant", warmup_steps=1),
        PolyScheduler(max_update=50, base_lr=0.3, pwr=3, final_lr=0.01, warmup_begin_lr=0.1),
        CosineScheduler(max_update=40, base_lr=0.5, final_lr=0.05, warmup_steps=4),
    ],
    ids=lambda s: type(s).__name__,
)
def test_scheduler_config_survives_json_and_rebuilds_an_equal_scheduler(scheduler):
    rebuilt = lr_scheduler.from_config(json.loads(json.dumps(scheduler.get_config())))
    assert type(rebuilt) is type(scheduler)
    assert rebuilt.get_config() == scheduler.get_config()
    assert [rebuilt(n) for n in range(60)] == [scheduler(n) for n in range(60)]


def test_scheduler_config_keeps_a_base_lr_set_by_an_optimizer():
    scheduler = FactorScheduler(step=1, factor=0.5, base_lr=1.0, warmup_steps=2)
    scheduler.base_lr = 0.4
    rebuilt = lr_scheduler.from_config(scheduler.get_config())
    assert (rebuilt.base_lr, rebuilt.warmup_final_lr) == (0.4, 1.0)
    assert [rebuilt(n) for n in range(6)] == [scheduler(n) for n in range(6)]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FactorScheduler(step=0), "step must be >= 1"),
        (lambda: FactorScheduler(step=2, factor=1.5), "factor must be in"),
        (lambda: FactorScheduler(step=2.5), "step must be an int"),
        (lambda: MultiFactorScheduler(step=[3, 2]), "increasing"),
        (lambda: MultiFactorScheduler(step=[]), "non-empty"),
        (lambda: PolyScheduler(max_update=0), "max_update must be >= 1"),
        (lambda: PolyScheduler(max_update=5, warmup_steps=5), "must be below max_update"),
        (lambda: CosineScheduler(max_update=10, final_lr=-1), "final_lr must be >= 0"),
        (lambda: LRScheduler(base_lr=-0.1), "base_lr must be >= 0"),
        (lambda: LRScheduler(warmup_steps=-1), "warmup_steps must be >= 0"),
        (lambda: LRScheduler(base_lr=0.1, warmup_begin_lr=0.2), "exceeds base_lr"),
        (lambda: LRScheduler(warmup_mode="cubic"), "warmup_mode"),
        (lambda: LRScheduler(base_lr="0.1"), "must be a number"),
    ],
)
def test_bad_scheduler_parameters_raise_optimizer_error_naming_them(make, message):
    with pytest.raises(OptimizerError, match=message):
        make()


def test_warmup_lr_outside_the_warmup_is_an_error():
    with pytest.raises(OptimizerError, match="outside the warm-up"):
        LRScheduler(warmup_steps=2).get_warmup_lr(2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"params": {}}, "must be a dict with a 'name'"),
        ({"name": "StepScheduler", "params": {}}, "unknown scheduler 'StepScheduler'"),
        ({"name": "FactorScheduler", "params": []}, "'params' must be a dict"),
        ({"name": "FactorScheduler", "params": {"step": 2, "gamma": 1}}, "gamma"),
        ({"name": "FactorScheduler", "params": {}}, "step"),
    ],
)
def test_bad_scheduler_configs_raise_optimizer_error(config, message):
    with pytest.raises(OptimizerError, match=message):
        lr_scheduler.from_config(config)


def test_registering_a_second_scheduler_under_a_taken_name_is_an_error():
    class FactorScheduler(LRScheduler):  # same name as the built-in
        pass

    with pytest.raises(OptimizerError, match="already registered"):
        lr_scheduler.register(FactorScheduler)
