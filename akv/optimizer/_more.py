"""MXNet 1.9.1's remaining registered optimizers: ccSGD (SGD under its deprecated name),
SGLD (Langevin dynamics), Test (MXNet's test optimizer) and LBSGD (large-batch SGD)."""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol, cast

import numpy as np

from akv.arrays import cupy_module
from akv.errors import InvalidArgumentError, OptimizerError
from akv.optimizer._base import Index, Optimizer, State, _describe_state, register
from akv.optimizer._kernels import (
    check_update_arrays,
    rescaled_clipped,
    run_chunked,
    zeros_like,
)
from akv.optimizer._sgd import SGD, _sgd_momentum_step, _sgd_step

__all__ = ["LBSGD", "SGLD", "Test", "ccSGD"]


@register
class ccSGD(SGD):
    """[Deprecated in MXNet] :class:`SGD` under another name, kept because MXNet 1.9.1
    registers it (``"ccsgd"``): the same parameters, update, states and row-sparse update
    (lazy with ``lazy_update``)."""

    def row_states_in_place(self, index: Index, dtype: np.dtype) -> int | None:
        """As :meth:`SGD.row_states_in_place`: ccSGD's update is SGD's, so SGD's compiled
        row kernels apply to it too."""
        if not self._row_kernels_apply(ccSGD, dtype):
            return None
        return 0 if self.momentum == 0.0 else 1


class NormalSource(Protocol):
    """Where :class:`SGLD` draws its noise: what it needs of a :class:`numpy.random.Generator`."""

    def standard_normal(self, size: tuple[int, ...], dtype: Any) -> np.ndarray: ...


@register
class SGLD(Optimizer):
    """Stochastic gradient Langevin dynamics (Welling and Teh), MXNet 1.9.1's ``SGLD``.

    With ``g = clip(rescale_grad * grad, clip_gradient)``::

        weight += -lr/2 * (g + wd * weight)
        weight += normal(0, sqrt(lr))          # one draw per element

    in the order of MXNet's NDArray operations (the drift is MXNet's bit for bit).

    Parameters
    ----------
    seed : int, optional
        Seed of the noise's generator (``numpy.random.default_rng(seed)``); ``None``
        (default) seeds it from the operating system. MXNet draws from its global generator
        (``mx.random.seed``), whose numbers akv cannot reproduce.
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    No state. The noise comes from :attr:`random` (``random.standard_normal(shape, dtype)``
    times ``sqrt(lr)``, in float32, or float64 for float64 weights; on a GPU it is drawn on
    the host and copied), which a test may replace. Its position is not saved with the
    states: a reloaded or rebuilt SGLD draws anew from its seed. Every server of a
    distributed store rebuilds it from the same config, so with a ``seed`` their keys get
    the same sequence of draws.
    """

    _CONFIG_PARAMS = (("seed", "seed"),)

    def __init__(self, seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = None if seed is None else self._integer("seed", seed)
        self.random: NormalSource = np.random.default_rng(self.seed)

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """Refused: SGLD adds noise to every element of the weight, so every row of a
        row-sparse key would have to be stored, also those no gradient names (MXNet 1.9.1's
        SGLD does that to a row-sparse weight: after one update every row holds noise); a
        lazy or standard update would leave the rows not stored without their noise, which
        is no longer SGLD's distribution.

        Raises
        ------
        OptimizerError
            Always.
        """
        raise OptimizerError(
            f"SGLD: index {index!r}: no row-sparse update (its noise goes to every row, also "
            "to the rows a row-sparse key does not store, which would make it dense); use a "
            "dense key"
        )

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        rescale, clip = self.rescale_grad, self.clip_gradient
        half_step = -lr / 2  # MXNet's -lr/2, a double rounded to the weight's dtype

        def kernel(
            w: np.ndarray, g: np.ndarray, noise: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            clipped, drift = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            if wd:
                np.multiply(w, wd, out=drift)
                np.add(g, drift, out=drift)
                np.multiply(drift, half_step, out=drift)
            else:
                np.multiply(g, half_step, out=drift)
            np.add(w, drift, out=w)
            np.add(w, noise, out=w)

        run_chunked(kernel, weight, grad, (self._noise(weight, math.sqrt(lr)),), num_scratch=2)

    def _noise(self, weight: np.ndarray, scale: float) -> np.ndarray:
        """``normal(0, scale)`` of the weight's shape and dtype, where the weight is."""
        dtype = np.float64 if weight.dtype == np.float64 else np.float32
        noise = self.random.standard_normal(weight.shape, dtype=dtype)
        np.multiply(noise, scale, out=noise)
        noise = noise.astype(weight.dtype, copy=False)
        if isinstance(weight, np.ndarray):
            return noise
        with cast(Any, weight).device:
            return cast(np.ndarray, cupy_module().asarray(noise))


@register
class Test(Optimizer):
    """MXNet 1.9.1's ``Test`` optimizer: ``weight += rescale_grad * grad``, and the state
    becomes a copy of the new weight. The learning rate, ``wd`` and ``clip_gradient`` are
    ignored, as in MXNet. It takes the parameters of :class:`Optimizer`.

    Notes
    -----
    The state starts as zeros of the weight's shape and dtype (MXNet: float32 zeros, the
    same for float32 weights). Unlike MXNet's, the update is counted (:attr:`num_update`
    advances as for every other optimizer; the update does not depend on it). A
    row-sparse gradient gets the standard update: every stored row, weight and state.
    """

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return zeros_like(weight)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        rescale = self.rescale_grad

        def kernel(
            w: np.ndarray, g: np.ndarray, copy: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            g = rescaled_clipped(g, buffers[0], rescale, None)
            np.add(w, g, out=w)
            np.copyto(copy, w)

        run_chunked(kernel, weight, grad, (self._state_array(index, state),), num_scratch=1)


LBSGD_WARMUP_STRATEGIES = ("linear", "power2", "sqrt", "lars")
"""LBSGD's ``warmup_strategy`` values: a warm-up of the learning-rate multiplier from 1 to
``batch_scale`` (the first three), or a LARS ratio per index (``'lars'``)."""

LBSGD_LARS_BOUNDS = (0.01, 100.0)
"""The bounds of LBSGD's LARS ratio (MXNet 1.9.1's)."""


@register
class LBSGD(Optimizer):
    """Large-batch SGD, MXNet 1.9.1's ``LBSGD``: SGD on gradients averaged over
    ``batch_scale`` updates, with a learning-rate multiplier.

    Each index accumulates its gradients. At the index's ``n``-th update, with
    ``k = begin_epoch * updates_per_epoch + n``, if ``k`` is a multiple of ``batch_scale``::

        grad = accumulated / batch_scale; accumulated = 0
        lr = lr * mult
        SGD's update of weight with grad and lr (MXNet's sgd_update, sgd_mom_update)

    and otherwise the weight (and momentum) stay as they are. The multiplier, with
    ``m = batch_scale`` and ``W = warmup_epochs * updates_per_epoch``, is ``m`` once
    ``k >= W`` (and 1 when ``W <= 1``), else ``1 + (m-1)*k/W`` (``'linear'``),
    ``1 + (m-1)*(k/W)**2`` (``'power2'``), ``1 + (m-1)*sqrt(k/W)`` (``'sqrt'``); with
    ``'lars'`` it is ``sqrt(|w|² / (|grad|² + wd*|w|² + 1e-18))`` bounded to
    ``[0.01, 100]``, of the weight before the update and the averaged gradient (before
    ``rescale_grad``). The learning rate is read before the update is counted (so a
    scheduler sees the previous count), as in MXNet's ``LBSGD``.

    Parameters
    ----------
    momentum : float, default 0.0
        In ``[0, 1)``; 0 keeps no momentum.
    warmup_strategy : {'linear', 'power2', 'sqrt', 'lars'}, default 'linear'
    warmup_epochs : int, default 5
    batch_scale : int, default 1
        Updates per macro-batch, ``>= 1``; 1 is SGD with the multiplier.
    updates_per_epoch : int, default 32
    begin_epoch : int, default 0
    num_epochs : int, default 60
        Kept for MXNet's interface (MXNet does not use it either).
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    The state is ``(momentum or None, accumulated gradient or None)`` (no accumulation
    with ``batch_scale=1``), with a float32 master copy first for float16 weights with
    ``multi_precision`` (``(master, state)``, as MXNet's). The accumulated gradient is part
    of the state, so that :meth:`~akv.optimizer.Updater.dump_states` saves it and a
    reloaded updater finishes the macro-batch (MXNet keeps it in a dict on the optimizer,
    which is not saved); the macro-batch position is the index's update count, saved
    with the states too. A row-sparse gradient gets the lazy update with ``batch_scale=1``
    and a strategy other than ``'lars'`` (MXNet's), else the standard update (every stored
    row; rows never stored have a zero weight and a zero accumulated gradient, so
    ``'lars'``'s norms are the whole weight's): see :meth:`row_sparse_update`.
    """

    _CONFIG_PARAMS = (
        ("momentum", "momentum"),
        ("warmup_strategy", "warmup_strategy"),
        ("warmup_epochs", "warmup_epochs"),
        ("batch_scale", "batch_scale"),
        ("updates_per_epoch", "updates_per_epoch"),
        ("begin_epoch", "begin_epoch"),
        ("num_epochs", "num_epochs"),
    )

    def __init__(
        self,
        momentum: float = 0.0,
        warmup_strategy: str = "linear",
        warmup_epochs: int = 5,
        batch_scale: int = 1,
        updates_per_epoch: int = 32,
        begin_epoch: int = 0,
        num_epochs: int = 60,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.momentum = self._fraction("momentum", momentum)
        if warmup_strategy not in LBSGD_WARMUP_STRATEGIES:
            raise OptimizerError(
                f"LBSGD: warmup_strategy must be one of {', '.join(LBSGD_WARMUP_STRATEGIES)}, "
                f"got {warmup_strategy!r}"
            )
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = self._integer("warmup_epochs", warmup_epochs)
        self.batch_scale = self._integer("batch_scale", batch_scale)
        if self.batch_scale < 1:
            raise OptimizerError(f"LBSGD: batch_scale must be an int >= 1, got {batch_scale!r}")
        self.updates_per_epoch = self._integer("updates_per_epoch", updates_per_epoch)
        self.begin_epoch = self._integer("begin_epoch", begin_epoch)
        self.num_epochs = self._integer("num_epochs", num_epochs)

    @property
    def init_updates(self) -> int:
        """The macro-batch count's start, ``begin_epoch * updates_per_epoch`` (MXNet's)."""
        return self.begin_epoch * self.updates_per_epoch

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        momentum = zeros_like(weight) if self.momentum != 0.0 else None
        accumulated = zeros_like(weight) if self.batch_scale > 1 else None
        return (momentum, accumulated)

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """Lazy with ``batch_scale=1`` and a warm-up strategy other than ``'lars'``:
        MXNet's LBSGD calls ``sgd_update`` and ``sgd_mom_update`` (its momentum row-sparse
        like the weight), lazy by default, so only a row-sparse gradient's rows change,
        weight and momentum. Standard otherwise: a macro-batch of several gradients updates
        the rows of their sum in MXNet, which the rows of the last gradient do not give, and
        ``'lars'`` scales by the norm of the whole weight (neither is MXNet's: see
        docs/optimizer.md). Float16 rows with ``multi_precision`` too: MXNet's LBSGD runs
        ``sgd_update`` or ``sgd_mom_update`` on the float32 master copy, lazily."""
        if self.batch_scale == 1 and self.warmup_strategy != "lars":
            return "lazy"
        return "standard"

    def update(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """As :meth:`Optimizer.update`, but the learning rate is read before the update is
        counted (MXNet's ``LBSGD``); the weight changes only at the end of a macro-batch."""
        grad = check_update_arrays(index, weight, grad)
        mom, accumulated = self._state_pair(index, state)
        lr, wd = self._get_lr(index), self._get_wd(index)
        self._update_count(index)
        count = self._index_update_count[index] - self.begin_num_update + self.init_updates
        if accumulated is not None:
            np.add(accumulated, grad, out=accumulated)
            if count % self.batch_scale:
                return
            np.divide(accumulated, self.batch_scale, out=accumulated)
            grad = accumulated
        if self.warmup_strategy == "lars":
            lr *= self._lars_ratio(weight, grad, wd)
        else:
            lr *= self._warmup_multiplier(count)
        if mom is None:
            _sgd_step(self, weight, grad, lr, wd, decay_factor=True)
        else:
            _sgd_momentum_step(self, weight, grad, mom, lr, wd, self.momentum)
        if accumulated is not None:
            accumulated[...] = 0

    def _warmup_multiplier(self, count: int) -> float:
        """MXNet's ``_get_lbmult``."""
        warmup = self.warmup_epochs * self.updates_per_epoch
        most = float(self.batch_scale)
        if count >= warmup:
            return most
        if warmup <= 1:
            return 1.0
        if self.warmup_strategy == "linear":
            return 1.0 + (most - 1) * count / warmup
        if self.warmup_strategy == "power2":
            return 1.0 + (most - 1) * (count * count) / (warmup * warmup)
        return 1.0 + (most - 1) * math.sqrt(float(count) / warmup)

    def _lars_ratio(self, weight: np.ndarray, grad: np.ndarray, wd: float) -> float:
        """MXNet's ``_get_lars``: squared norms summed by NumPy in the arrays' dtype (as
        MXNet's ``asnumpy().sum()``), the ratio in double."""
        weight_sum = float(np.multiply(weight, weight).reshape(-1).sum())
        grad_sum = float(np.multiply(grad, grad).reshape(-1).sum())
        ratio = math.sqrt(weight_sum / (grad_sum + wd * weight_sum + 1e-18))
        low, high = LBSGD_LARS_BOUNDS
        return min(max(ratio, low), high)

    def _state_pair(
        self, index: Index, state: State
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(momentum, accumulated)`` as :meth:`create_state` makes them."""
        expected = (self.momentum != 0.0, self.batch_scale > 1)
        if isinstance(state, (tuple, list)) and len(state) == 2:
            present = tuple(member is not None for member in state)
            if present == expected:
                arrays = [self._state_array(index, m) if m is not None else None for m in state]
                return arrays[0], arrays[1]
        held = " and ".join(
            name
            for name, kept in zip(("momentum", "accumulated gradient"), expected, strict=True)
            if kept
        )
        raise InvalidArgumentError(
            f"LBSGD: index {index!r}: the state must be a pair (momentum or None, accumulated "
            f"gradient or None) holding {held or 'no array'}, as create_state makes it; got "
            f"{_describe_state(state)}"
        )
