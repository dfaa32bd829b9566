"""What akv.optimizer exports."""

from __future__ import annotations

import akv.optimizer
from akv.optimizer import lr_scheduler


def test_every_public_name_exists():
    for module in (akv.optimizer, lr_scheduler):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name} is listed but missing"


def test_schedulers_are_exported_from_the_optimizer_package_too():
    for name in lr_scheduler.__all__:
        if name[0].isupper():
            assert getattr(akv.optimizer, name) is getattr(lr_scheduler, name)


def test_ftrl_is_exported_under_its_upper_case_name():
    assert akv.optimizer.create("ftrl").__class__ is akv.optimizer.FTRL
