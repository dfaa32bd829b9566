"""Gradient-descent optimizers: SGD, NAG and Signum (MXNet 1.9.1 formulas)."""

from __future__ import annotations

from typing import Any

import numpy as np

from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    check_update_arrays,
    complement,
    product,
    register,
    rescaled_clipped,
    run_chunked,
    zeros_like,
)

__all__ = ["NAG", "SGD", "Signum"]


def _sgd_step(
    optimizer: Optimizer,
    weight: np.ndarray,
    grad: np.ndarray,
    lr: float,
    wd: float,
    decay_factor: bool,
) -> None:
    """SGD without momentum, in MXNet's evaluation order.

    ``decay_factor=False`` is ``multi_sgd_update`` (MXNet's SGD):
    ``weight - ((lr*wd) * weight + lr * g)``; ``True`` is ``sgd_update`` (MXNet's NAG
    without momentum): ``(1 - lr*wd) * weight - lr * g``, with
    ``g = clip(rescale_grad * grad)``, the rescaling folded into ``lr`` when not clipping.
    """
    rescale, clip = optimizer.rescale_grad, optimizer.clip_gradient
    dtype = weight.dtype
    step = product(dtype, lr, 1.0 if clip else rescale)
    decay = product(dtype, lr, wd)
    keep = float(dtype.type(1.0) - dtype.type(decay))

    def kernel(w: np.ndarray, g: np.ndarray, buffers: list[np.ndarray]) -> None:
        buffer, decayed = buffers
        if clip:
            g = rescaled_clipped(g, buffer, rescale, clip)
        np.multiply(g, step, out=buffer)
        if wd and decay_factor:
            np.multiply(w, keep, out=w)
        elif wd:
            np.multiply(w, decay, out=decayed)
            np.add(decayed, buffer, out=buffer)
        np.subtract(w, buffer, out=w)

    run_chunked(kernel, weight, grad, (), num_scratch=2)


def _sgd_momentum_step(
    optimizer: Optimizer,
    weight: np.ndarray,
    grad: np.ndarray,
    mom: np.ndarray,
    lr: float,
    wd: float,
    momentum: float,
) -> None:
    """SGD with momentum in the order of MXNet's ``multi_sgd_mom_update``:
    ``mom = (momentum * mom - (lr*wd) * weight) - (lr*rescale_grad) * grad; weight += mom``,
    ``lr * clip(rescale_grad * grad)`` for the last term when clipping."""
    rescale, clip = optimizer.rescale_grad, optimizer.clip_gradient
    step = product(weight.dtype, lr, 1.0 if clip else rescale)
    decay = product(weight.dtype, lr, wd)

    def kernel(w: np.ndarray, g: np.ndarray, m: np.ndarray, buffers: list[np.ndarray]) -> None:
        buffer, decayed = buffers
        if clip:
            g = rescaled_clipped(g, buffer, rescale, clip)
        np.multiply(m, momentum, out=m)
        if wd:
            np.multiply(w, decay, out=decayed)
            np.subtract(m, decayed, out=m)
        np.multiply(g, step, out=buffer)
        np.subtract(m, buffer, out=m)
        np.add(w, m, out=w)

    run_chunked(kernel, weight, grad, (mom,), num_scratch=2)


@register
class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay.

    Without momentum (MXNet's ``sgd_update``)::

        weight = (1 - lr * wd) * weight - lr * clip(rescale_grad * grad, clip_gradient)

    With momentum (``sgd_mom_update``)::

        mom = momentum * mom - lr * wd * weight - lr * clip(rescale_grad * grad, clip_gradient)
        weight = weight + mom

    Parameters
    ----------
    momentum : float, default 0.0
        Momentum, in ``[0, 1)``; 0 keeps no state.
    lazy_update : bool, default True
        For row-sparse gradients: update only the gradient's rows (MXNet's lazy update),
        else every stored row. Dense gradients update every element either way.
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    The multi-precision state is ``(momentum or None, float32 master copy)``, as MXNet's.
    """

    _CONFIG_PARAMS = (("momentum", "momentum"), ("lazy_update", "lazy_update"))
    _MASTER_COPY_FIRST = False
    _LAZY_ROWS = True

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = self._fraction("momentum", momentum)
        self.lazy_update = self._boolean("lazy_update", lazy_update)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return zeros_like(weight) if self.momentum != 0.0 else None

    def update_rows(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """As :meth:`Optimizer.update_rows`; without momentum, in the evaluation order of
        MXNet's row-sparse kernel, ``(1 - lr*wd) * weight - lr * g``."""
        if state is not None or (self.multi_precision and weight.dtype == np.float16):
            self.update_multi_precision(index, weight, grad, state)
            return
        grad = check_update_arrays(index, weight, grad)
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        _sgd_step(self, weight, grad, lr, wd, decay_factor=True)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        if state is None:
            _sgd_step(self, weight, grad, lr, wd, decay_factor=False)
        else:
            mom = self._state_array(index, state)
            _sgd_momentum_step(self, weight, grad, mom, lr, wd, self.momentum)


@register
class NAG(Optimizer):
    """Nesterov accelerated gradient (MXNet's ``nag_mom_update``).

    With ``g = clip(rescale_grad * grad, clip_gradient)``::

        weight = weight + momentum**2 * mom - (1 + momentum) * lr * (g + wd * weight)
        mom = momentum * mom - lr * (g + wd * weight)     # weight: the *new* weight

    which is ``mom = momentum * mom - lr * (g + wd * weight); weight += momentum * mom -
    lr * (g + wd * weight)`` except that, as in MXNet 1.9.1, the weight-decay term of the
    momentum reads the already updated weight (MXNet's kernel writes the weight in place
    before it computes the momentum). akv reproduces this so that weights agree with MXNet
    step by step. Without momentum the update is SGD's.

    Parameters
    ----------
    momentum : float, default 0.0
        Momentum, in ``[0, 1)``; 0 keeps no state.
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    The multi-precision state is ``(momentum or None, float32 master copy)``, as MXNet's.
    """

    _CONFIG_PARAMS = (("momentum", "momentum"),)
    _MASTER_COPY_FIRST = False

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = self._fraction("momentum", momentum)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return zeros_like(weight) if self.momentum != 0.0 else None

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        if state is None:
            _sgd_step(self, weight, grad, lr, wd, decay_factor=True)
            return
        rescale, clip, momentum = self.rescale_grad, self.clip_gradient, self.momentum
        momentum_plus_one = float(weight.dtype.type(momentum) + weight.dtype.type(1.0))

        # MXNet's order: mom *= momentum; weight = (weight - mom) + (momentum + 1) *
        # (mom - lr * total); mom -= lr * (g + wd * new weight).
        def kernel(
            w: np.ndarray, g: np.ndarray, mom: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            clipped, total, work = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            if wd:
                np.multiply(w, wd, out=total)
                np.add(g, total, out=total)
            else:
                total = g
            np.multiply(mom, momentum, out=mom)
            np.multiply(total, lr, out=work)
            np.subtract(mom, work, out=work)
            np.multiply(work, momentum_plus_one, out=work)
            np.subtract(w, mom, out=w)
            np.add(w, work, out=w)
            if wd:
                np.multiply(w, wd, out=total)
                np.add(g, total, out=total)
            np.multiply(total, lr, out=work)
            np.subtract(mom, work, out=mom)

        run_chunked(kernel, weight, grad, (self._state_array(index, state),), num_scratch=3)


@register
class Signum(Optimizer):
    """Signum: steps of fixed size in the direction of the sign of the momentum.

    With momentum (MXNet's ``signum_update``), ``g = clip(rescale_grad * grad,
    clip_gradient)``::

        mom = momentum * mom - (1 - momentum) * (g + wd * weight)
        weight = (1 - lr * wd_lh) * weight + lr * sign(mom)

    Without momentum (``signsgd_update``)::

        weight = (1 - lr * (wd + wd_lh)) * weight - lr * sign(g)

    (MXNet 1.9.1 rejects ``wd_lh`` without momentum; akv applies it as shown.)

    Parameters
    ----------
    learning_rate : float, default 0.01
    momentum : float, default 0.9
        In ``[0, 1)``; 0 keeps no state.
    wd_lh : float, default 0.0
        Decoupled weight decay (Loshchilov and Hutter), ``>= 0``.
    **kwargs
        The other parameters of :class:`Optimizer`.
    """

    _CONFIG_PARAMS = (("momentum", "momentum"), ("wd_lh", "wd_lh"))

    def __init__(
        self,
        learning_rate: float | None = 0.01,
        momentum: float = 0.9,
        wd_lh: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = self._fraction("momentum", momentum)
        self.wd_lh = self._real("wd_lh", wd_lh, minimum=0.0)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return zeros_like(weight) if self.momentum != 0.0 else None

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        rescale, clip, momentum, wd_lh = (
            self.rescale_grad,
            self.clip_gradient,
            self.momentum,
            self.wd_lh,
        )
        if state is None:
            decay = 1.0 - lr * (wd + wd_lh)

            def sign_kernel(w: np.ndarray, g: np.ndarray, buffers: list[np.ndarray]) -> None:
                (work,) = buffers
                g = rescaled_clipped(g, work, rescale, None)
                np.sign(g, out=work)
                np.multiply(work, -lr, out=work)
                if decay != 1.0:
                    np.multiply(w, decay, out=w)
                np.add(w, work, out=w)

            # Clipping never changes a sign, so that pass is skipped.
            run_chunked(sign_kernel, weight, grad, (), num_scratch=1)
            return

        keep = complement(momentum, weight.dtype)

        def kernel(
            w: np.ndarray, g: np.ndarray, mom: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            clipped, work = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            np.multiply(mom, momentum, out=mom)
            if wd:
                np.multiply(w, keep * wd, out=work)
                np.subtract(mom, work, out=mom)
            np.multiply(g, keep, out=work)
            np.subtract(mom, work, out=mom)
            if wd_lh:
                np.multiply(w, 1.0 - lr * wd_lh, out=w)
            np.sign(mom, out=work)
            np.multiply(work, lr, out=work)
            np.add(w, work, out=w)

        run_chunked(kernel, weight, grad, (self._state_array(index, state),), num_scratch=2)
