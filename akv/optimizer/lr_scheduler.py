"""Learning-rate schedulers with MXNet 1.9.1's parameters and values.

A scheduler maps ``num_update`` (the largest number of updates any weight has had) to a
learning rate. The optimizer calls it once per update, after counting that update, so the
first update of a fresh optimizer asks for ``scheduler(1)``.

Unlike MXNet's classes, which change ``base_lr`` as they go, these schedulers are functions
of ``num_update``: the answer for a given count does not depend on which counts were asked
before, so a scheduler rebuilt from :meth:`LRScheduler.get_config` in another process (or
after a reload) continues exactly where the old one was. For the increasing counts an
optimizer produces the values are MXNet's. The one difference: ``PolyScheduler`` and
``CosineScheduler`` return ``final_lr`` for every count past ``max_update`` (MXNet returns
whatever it computed last, which is ``base_lr`` when the first call is already past the end).

An optimizer given both ``learning_rate`` and a scheduler sets the scheduler's ``base_lr``
(MXNet does the same; note that Adam, RMSProp, LAMB and Signum have a default learning rate,
so they always do). As in MXNet, that changes the rate ``FactorScheduler`` and
``MultiFactorScheduler`` decay from, but not the end of the warm-up
(``warmup_final_lr``, fixed at construction), nor the start of the polynomial or cosine
decay (``base_lr_orig``).
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
from typing import Any, ClassVar

from akv.errors import OptimizerError

__all__ = [
    "CosineScheduler",
    "FactorScheduler",
    "LRScheduler",
    "MultiFactorScheduler",
    "PolyScheduler",
    "from_config",
    "register",
]

WARMUP_MODES = ("linear", "constant")

_REGISTRY: dict[str, type[LRScheduler]] = {}


def register(cls: type[LRScheduler]) -> type[LRScheduler]:
    """Make a scheduler class known to :func:`from_config` under its class name.

    Names are case-insensitive. Registering a second class under a name that is taken raises
    :class:`~akv.errors.OptimizerError`.
    """
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
        raise OptimizerError(f"register: {cls!r} is not a subclass of LRScheduler")
    name = cls.__name__.lower()
    if _REGISTRY.get(name, cls) is not cls:
        raise OptimizerError(f"register: a scheduler named {cls.__name__!r} is already registered")
    _REGISTRY[name] = cls
    return cls


def from_config(config: dict[str, Any]) -> LRScheduler:
    """Rebuild a scheduler from :meth:`LRScheduler.get_config`'s description.

    Raises
    ------
    OptimizerError
        The description is malformed, names an unknown scheduler, or holds a bad parameter.
    """
    if not isinstance(config, dict) or not isinstance(config.get("name"), str):
        raise OptimizerError(f"scheduler config must be a dict with a 'name', got {config!r}")
    params = config.get("params", {})
    if not isinstance(params, dict):
        raise OptimizerError(f"scheduler config 'params' must be a dict, got {params!r}")
    cls = _REGISTRY.get(config["name"].lower())
    if cls is None:
        known = ", ".join(sorted(c.__name__ for c in _REGISTRY.values()))
        raise OptimizerError(f"unknown scheduler {config['name']!r} (known: {known})")
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as exc:
        raise OptimizerError(f"{cls.__name__}: bad parameters {sorted(params)}: {exc}") from exc
    scheduler = cls(**params)
    if "base_lr" in config:
        scheduler.base_lr = _check_real(cls.__name__, "base_lr", config["base_lr"], minimum=0.0)
    return scheduler


def _check_int(owner: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptimizerError(f"{owner}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise OptimizerError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_real(owner: str, name: str, value: object, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptimizerError(f"{owner}: {name} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise OptimizerError(f"{owner}: {name} must be finite, got {value!r}")
    if minimum is not None and result < minimum:
        raise OptimizerError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return result


class LRScheduler:
    """Base class: a learning rate as a function of the number of updates.

    Parameters
    ----------
    base_lr : float, default 0.01
        The learning rate after warm-up (before any decay). ``>= 0``.
    warmup_steps : int, default 0
        Number of updates, counted from 0, during which the warm-up rate is used.
    warmup_begin_lr : float, default 0
        The rate at update 0 of the warm-up; must not exceed ``base_lr``.
    warmup_mode : {'linear', 'constant'}, default 'linear'
        ``'linear'`` rises in equal steps from ``warmup_begin_lr`` towards ``base_lr``;
        ``'constant'`` stays at ``warmup_begin_lr``.

    Raises
    ------
    OptimizerError
        A parameter has the wrong type or is out of range.

    Notes
    -----
    Used as it is, it is a constant schedule (after the warm-up). Subclasses override
    :meth:`__call__` and list their constructor parameters in
    ``_CONFIG_PARAMS`` (parameter name, attribute name) so that :meth:`get_config` can
    describe them; :func:`register` makes them rebuildable.
    """

    _CONFIG_PARAMS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("base_lr", "base_lr"),
        ("warmup_steps", "warmup_steps"),
        ("warmup_begin_lr", "warmup_begin_lr"),
        ("warmup_mode", "warmup_mode"),
    )

    def __init__(
        self,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        owner = type(self).__name__
        self.base_lr = _check_real(owner, "base_lr", base_lr, minimum=0.0)
        self.warmup_final_lr = self.base_lr
        self.warmup_steps = _check_int(owner, "warmup_steps", warmup_steps, minimum=0)
        self.warmup_begin_lr = _check_real(owner, "warmup_begin_lr", warmup_begin_lr, 0.0)
        if self.warmup_begin_lr > self.base_lr:
            raise OptimizerError(
                f"{owner}: warmup_begin_lr {self.warmup_begin_lr} exceeds base_lr {self.base_lr}"
            )
        if warmup_mode not in WARMUP_MODES:
            raise OptimizerError(
                f"{owner}: warmup_mode must be one of {WARMUP_MODES}, got {warmup_mode!r}"
            )
        self.warmup_mode = warmup_mode

    def get_warmup_lr(self, num_update: int) -> float:
        """The warm-up rate at ``num_update`` (which must be below ``warmup_steps``)."""
        if not 0 <= num_update < self.warmup_steps:
            raise OptimizerError(
                f"{type(self).__name__}: update {num_update} is outside the warm-up "
                f"[0, {self.warmup_steps})"
            )
        if self.warmup_mode == "constant":
            return self.warmup_begin_lr
        increase = (self.warmup_final_lr - self.warmup_begin_lr) * num_update / self.warmup_steps
        return self.warmup_begin_lr + increase

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates.

        The base scheduler keeps ``base_lr`` after the warm-up; subclasses decay it.
        """
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        return self.base_lr

    def get_config(self) -> dict[str, Any]:
        """A JSON-serialisable description that :func:`from_config` turns back into an equal
        scheduler.

        Returns
        -------
        dict
            ``{"name": class name, "params": {constructor parameter: value},
            "base_lr": current base_lr}``; ``params["base_lr"]`` is the value the scheduler
            was constructed with (``warmup_final_lr``), the top-level ``base_lr`` the value
            an optimizer may have set since.
        """
        params = {name: getattr(self, attribute) for name, attribute in self._CONFIG_PARAMS}
        params["base_lr"] = self.warmup_final_lr
        return {"name": type(self).__name__, "params": params, "base_lr": self.base_lr}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config()["params"].items())
        return f"{type(self).__name__}({params})"


@register
class FactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` every ``step`` updates, never going below
    ``stop_factor_lr``.

    After warm-up the rate at update ``n`` is ``base_lr`` multiplied by ``factor`` once for
    each ``k >= 1`` with ``n > k * step`` (so the first decay is at update ``step + 1``), each
    product raised to ``stop_factor_lr`` if it falls below it; as MXNet, the decays are
    counted from update 0, not from the end of the warm-up.

    Parameters
    ----------
    step : int
        Updates between decays, ``>= 1``.
    factor : float, default 1
        Decay factor, in ``(0, 1]``.
    stop_factor_lr : float, default 1e-8
        Floor of the decayed rate.
    base_lr, warmup_steps, warmup_begin_lr, warmup_mode
        As :class:`LRScheduler`.
    """

    _CONFIG_PARAMS = (
        ("step", "step"),
        ("factor", "factor"),
        ("stop_factor_lr", "stop_factor_lr"),
        *LRScheduler._CONFIG_PARAMS,
    )

    def __init__(
        self,
        step: int,
        factor: float = 1,
        stop_factor_lr: float = 1e-8,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step = _check_int("FactorScheduler", "step", step, minimum=1)
        self.factor = _check_real("FactorScheduler", "factor", factor)
        if not 0.0 < self.factor <= 1.0:
            raise OptimizerError(f"FactorScheduler: factor must be in (0, 1], got {factor!r}")
        self.stop_factor_lr = _check_real("FactorScheduler", "stop_factor_lr", stop_factor_lr, 0.0)
        # (base_lr, decays applied, rate). The decays are applied one by one, as MXNet does,
        # so the rounding matches; remembering the last result spares a long run redoing them.
        self._cached = (self.base_lr, 0, self.base_lr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        decays = max(0, (num_update - 1) // self.step)
        base_lr, done, lr = self._cached
        if base_lr != self.base_lr or decays < done:
            base_lr, done, lr = self.base_lr, 0, self.base_lr
        for _ in range(decays - done):
            lr = max(lr * self.factor, self.stop_factor_lr)
        self._cached = (base_lr, decays, lr)
        return lr


@register
class MultiFactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` after each update count listed in ``step``.

    After warm-up the rate at update ``n`` is ``base_lr`` times ``factor`` once for each
    ``s`` in ``step`` with ``n > s``.

    Parameters
    ----------
    step : list of int
        Strictly increasing update counts, each ``>= 1``.
    factor : float, default 1
        Decay factor, in ``(0, 1]``.
    base_lr, warmup_steps, warmup_begin_lr, warmup_mode
        As :class:`LRScheduler`.
    """

    _CONFIG_PARAMS = (("step", "step"), ("factor", "factor"), *LRScheduler._CONFIG_PARAMS)

    def __init__(
        self,
        step: list[int],
        factor: float = 1,
        base_lr: float = 0.01,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, (list, tuple)) or not step:
            raise OptimizerError(
                f"MultiFactorScheduler: step must be a non-empty list, got {step!r}"
            )
        steps = [_check_int("MultiFactorScheduler", "step", s, minimum=1) for s in step]
        if any(later <= earlier for earlier, later in itertools.pairwise(steps)):
            raise OptimizerError(f"MultiFactorScheduler: step must be increasing, got {step!r}")
        self.step = steps
        self.factor = _check_real("MultiFactorScheduler", "factor", factor)
        if not 0.0 < self.factor <= 1.0:
            raise OptimizerError(f"MultiFactorScheduler: factor must be in (0, 1], got {factor!r}")

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        lr = self.base_lr
        for boundary in self.step:
            if num_update <= boundary:
                break
            lr *= self.factor
        return lr


class _DecayToFinal(LRScheduler):
    """Shared checks of the schedulers that decay from ``base_lr`` to ``final_lr``."""

    def _check_decay(self, max_update: int, final_lr: float) -> None:
        owner = type(self).__name__
        # The decay starts from the constructed base_lr even if an optimizer sets base_lr
        # later (MXNet's behaviour).
        self.base_lr_orig = self.base_lr
        self.max_update = _check_int(owner, "max_update", max_update, minimum=1)
        if self.warmup_steps >= self.max_update:
            raise OptimizerError(
                f"{owner}: warmup_steps {self.warmup_steps} must be below max_update "
                f"{self.max_update}"
            )
        self.final_lr = _check_real(owner, "final_lr", final_lr, minimum=0.0)

    @property
    def max_steps(self) -> int:
        """Updates over which the rate decays: ``max_update - warmup_steps``."""
        return self.max_update - self.warmup_steps

    def _progress(self, num_update: int) -> float:
        return (num_update - self.warmup_steps) / self.max_steps


@register
class PolyScheduler(_DecayToFinal):
    """Polynomial decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates.

    After warm-up and up to ``max_update`` the rate is
    ``final_lr + (base_lr - final_lr) * (1 - (n - warmup_steps) / max_steps) ** pwr``;
    after ``max_update`` it is ``final_lr``.

    Parameters
    ----------
    max_update : int
        Update count at which ``final_lr`` is reached; above ``warmup_steps``.
    base_lr : float, default 0.01
    pwr : float, default 2
        Power of the decay (MXNet keeps it as the attribute ``power``).
    final_lr : float, default 0
    warmup_steps, warmup_begin_lr, warmup_mode
        As :class:`LRScheduler`.
    """

    _CONFIG_PARAMS = (
        ("max_update", "max_update"),
        ("pwr", "power"),
        ("final_lr", "final_lr"),
        *LRScheduler._CONFIG_PARAMS,
    )

    def __init__(
        self,
        max_update: int,
        base_lr: float = 0.01,
        pwr: float = 2,
        final_lr: float = 0,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._check_decay(max_update, final_lr)
        self.power = _check_real("PolyScheduler", "pwr", pwr, minimum=0.0)
        if isinstance(pwr, numbers.Integral):
            self.power = int(pwr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update > self.max_update:
            return self.final_lr
        # Real, not complex: the remaining fraction is in [0, 1] here.
        scale: float = pow(1 - self._progress(num_update), self.power)
        return self.final_lr + (self.base_lr_orig - self.final_lr) * scale


@register
class CosineScheduler(_DecayToFinal):
    """Cosine decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates.

    After warm-up and up to ``max_update`` the rate is
    ``final_lr + (base_lr - final_lr) * (1 + cos(pi * (n - warmup_steps) / max_steps)) / 2``;
    after ``max_update`` it is ``final_lr``.

    Parameters
    ----------
    max_update : int
        Update count at which ``final_lr`` is reached; above ``warmup_steps``.
    base_lr : float, default 0.01
    final_lr : float, default 0
    warmup_steps, warmup_begin_lr, warmup_mode
        As :class:`LRScheduler`.
    """

    _CONFIG_PARAMS = (
        ("max_update", "max_update"),
        ("final_lr", "final_lr"),
        *LRScheduler._CONFIG_PARAMS,
    )

    def __init__(
        self,
        max_update: int,
        base_lr: float = 0.01,
        final_lr: float = 0,
        warmup_steps: int = 0,
        warmup_begin_lr: float = 0,
        warmup_mode: str = "linear",
    ) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._check_decay(max_update, final_lr)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update > self.max_update:
            return self.final_lr
        cosine = (1 + math.cos(math.pi * self._progress(num_update))) / 2
        return self.final_lr + (self.base_lr_orig - self.final_lr) * cosine
