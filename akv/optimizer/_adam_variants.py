"""Adam's relatives: Adamax, Nadam and FTML (MXNet 1.9.1), and AdamW (MXNet 2.0).

Adamax and Nadam are Python code in MXNet 1.9.1: each NDArray operation rounds to float32,
with its scalar rounded to float32 first, and scalars such as ``1. - beta1`` are computed in
double before that. akv evaluates them in the same order, on the same float32 scalars, so
its weights are MXNet's bit for bit; FTML follows the order of MXNet's ``ftml_update``
kernel, whose scalars are float32 throughout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from akv.optimizer._adaptive import (
    MomentEstimates,
    decayed_gradient,
    moving_average,
    moving_square_average,
)
from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    register,
)
from akv.optimizer._kernels import (
    rescaled_clipped,
    run_chunked,
    zeros_like,
)

__all__ = ["FTML", "AdamW", "Adamax", "Nadam"]


def _square_average(average: np.ndarray, value: np.ndarray, decay: float, work: np.ndarray) -> None:
    """``average = decay * average + ((1 - decay) * value) * value``, in place, with
    ``1 - decay`` computed in double: MXNet's Python Nadam (``(1. - beta2) * grad * grad``)
    and torch's ``addcmul``."""
    np.multiply(average, decay, out=average)
    np.multiply(value, 1.0 - decay, out=work)
    np.multiply(work, value, out=work)
    np.add(average, work, out=average)


@register
class Adamax(Optimizer):
    """AdaMax (Kingma and Ba, section 7), MXNet's ``Adamax``::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        m = beta1 * m + (1 - beta1) * g
        u = maximum(beta2 * u, abs(g))
        weight -= lr / (1 - beta1**t) * m / u

    Parameters
    ----------
    learning_rate : float, default 0.002
    beta1, beta2 : float, default 0.9, 0.999
        In ``[0, 1)``.
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(m, u)``. As in MXNet, an element whose gradient has been zero at every
    update so far divides 0 by 0.
    """

    _CONFIG_PARAMS = (("beta1", "beta1"), ("beta2", "beta2"))

    def __init__(
        self,
        learning_rate: float | None = 0.002,
        beta1: float = 0.9,
        beta2: float = 0.999,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = self._fraction("beta1", beta1)
        self.beta2 = self._fraction("beta2", beta2)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return (zeros_like(weight), zeros_like(weight))

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        t = self._index_update_count[index]
        lr /= 1.0 - self.beta1**t
        rescale, clip, beta1, beta2 = self.rescale_grad, self.clip_gradient, self.beta1, self.beta2

        def kernel(
            w: np.ndarray, g: np.ndarray, m: np.ndarray, u: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            decayed, work = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_average(m, g, beta1, work, keep=1.0 - beta1)
            np.multiply(u, beta2, out=u)
            np.abs(g, out=work)
            np.maximum(u, work, out=u)
            np.multiply(m, lr, out=work)
            np.divide(work, u, out=work)
            np.subtract(w, work, out=w)

        m, u = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (m, u), num_scratch=2)


@register
class Nadam(MomentEstimates):
    """Nesterov Adam (Dozat), MXNet's ``Nadam``.

    At the ``t``-th update of a weight, with ``g = clip(rescale_grad * grad + wd * weight,
    clip_gradient)``::

        mu_t = beta1 * (1 - 0.5 * 0.96**(t * schedule_decay))
        mu_next = beta1 * (1 - 0.5 * 0.96**((t + 1) * schedule_decay))
        m_schedule = m_schedule * mu_t
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_bar = (1 - mu_t) * g / (1 - m_schedule) + mu_next * m / (1 - m_schedule * mu_next)
        weight -= lr * m_bar / (sqrt(v / (1 - beta2**t)) + epsilon)

    ``m_schedule`` starts at 1 and, as in MXNet, belongs to the optimizer, not to a weight:
    every update of every index multiplies it, so an index's update depends on how many
    updates of other indexes came before it (in MXNet: the order of the updater's calls; in
    a store that updates several keys at once on worker threads, the order they happen to
    run in). It is the optimizer's shared state, saved with the states.

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float, default 0.9, 0.999
        In ``[0, 1)``.
    epsilon : float, default 1e-8
        ``> 0``.
    schedule_decay : float, default 0.004
        Decay of the momentum schedule, ``>= 0``.
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(m, v)``.
    """

    _CONFIG_PARAMS = (*MomentEstimates._CONFIG_PARAMS, ("schedule_decay", "schedule_decay"))
    _SHARED_STATE = ("m_schedule",)

    def __init__(
        self,
        learning_rate: float | None = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        schedule_decay: float = 0.004,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.schedule_decay = self._real("schedule_decay", schedule_decay, minimum=0.0)
        self.m_schedule = 1.0

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        t = self._index_update_count[index]
        beta1, beta2, epsilon = self.beta1, self.beta2, self.epsilon
        momentum_t = beta1 * (1.0 - 0.5 * 0.96 ** (t * self.schedule_decay))
        momentum_next = beta1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * self.schedule_decay))
        with self._shared_lock:
            m_schedule = self.m_schedule = self.m_schedule * momentum_t
        m_schedule_next = m_schedule * momentum_next
        # Every scalar as MXNet's Python computes it, in double.
        grad_scale = 1.0 - m_schedule
        mean_scale = 1.0 - m_schedule_next
        var_scale = 1.0 - beta2**t
        rescale, clip = self.rescale_grad, self.clip_gradient

        def kernel(
            w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            decayed, step, work = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_average(m, g, beta1, work, keep=1.0 - beta1)
            _square_average(v, g, beta2, work)
            np.divide(g, grad_scale, out=step)
            np.multiply(step, 1.0 - momentum_t, out=step)
            np.divide(m, mean_scale, out=work)
            np.multiply(work, momentum_next, out=work)
            np.add(step, work, out=step)
            np.divide(v, var_scale, out=work)
            np.sqrt(work, out=work)
            np.add(work, epsilon, out=work)
            np.multiply(step, lr, out=step)
            np.divide(step, work, out=step)
            np.subtract(w, step, out=w)

        m, v = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (m, v), num_scratch=3)


@register
class FTML(Optimizer):
    """FTML, Follow the Moving Leader (Zheng and Kwok), MXNet's ``ftml_update``.

    At the ``t``-th update of a weight::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        v = beta2 * v + (1 - beta2) * g**2
        d_t = (1 - beta1**t) / lr * (sqrt(v / (1 - beta2**t)) + epsilon)
        z = beta1 * z + (1 - beta1) * g - (d_t - beta1 * d) * weight
        d = d_t
        weight = -z / d_t

    Parameters
    ----------
    beta1 : float, default 0.6
    beta2 : float, default 0.999
        In ``[0, 1)``.
    epsilon : float, default 1e-8
        ``> 0``.
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01, ``> 0``
        in practice: the update divides by it).

    Notes
    -----
    The state is ``(d, v, z)``. The weight's new value depends on ``z`` and ``d`` only, so a
    zero row of a row-sparse weight with a zero state stays zero.
    """

    _CONFIG_PARAMS = (("beta1", "beta1"), ("beta2", "beta2"), ("epsilon", "epsilon"))

    def __init__(
        self, beta1: float = 0.6, beta2: float = 0.999, epsilon: float = 1e-8, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.beta1 = self._fraction("beta1", beta1)
        self.beta2 = self._fraction("beta2", beta2)
        self.epsilon = self._real("epsilon", epsilon, positive=True)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return (zeros_like(weight), zeros_like(weight), zeros_like(weight))

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        # The kernel's scalars: float32 parameters, powers and quotients (powf).
        kind = weight.dtype.type
        t = kind(self._index_update_count[index])
        beta1, beta2, epsilon = self.beta1, self.beta2, self.epsilon
        d_scale = float((kind(1.0) - kind(beta1) ** t) / kind(lr))
        var_scale = float(kind(1.0) - kind(beta2) ** t)
        rescale, clip = self.rescale_grad, self.clip_gradient

        def kernel(
            w: np.ndarray,
            g: np.ndarray,
            d: np.ndarray,
            v: np.ndarray,
            z: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            decayed, work, d_t = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_square_average(v, g, beta2, work)
            np.divide(v, var_scale, out=d_t)
            np.sqrt(d_t, out=d_t)
            np.add(d_t, epsilon, out=d_t)
            np.multiply(d_t, d_scale, out=d_t)
            moving_average(z, g, beta1, work)
            np.multiply(d, beta1, out=d)
            np.subtract(d_t, d, out=work)
            np.multiply(work, w, out=work)
            np.subtract(z, work, out=z)
            np.copyto(d, d_t)
            np.divide(z, d_t, out=w)
            np.negative(w, out=w)

        d, v, z = self._state_arrays(index, state, 3)
        run_chunked(kernel, weight, grad, (d, v, z), num_scratch=3)


@register
class AdamW(MomentEstimates):
    """AdamW, Adam with decoupled weight decay (Loshchilov and Hutter), with MXNet 2.0's
    parameters: at the ``t``-th update of a weight, with ``g = clip(rescale_grad * grad,
    clip_gradient)``::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t); v_hat = v / (1 - beta2**t)   # if correct_bias
        weight -= lr * (m_hat / (sqrt(v_hat) + epsilon) + wd * weight)

    (``m_hat = m``, ``v_hat = v`` without ``correct_bias``). This is
    ``torch.optim.AdamW``'s update: with ``rescale_grad=1``, no clipping and the same
    ``epsilon``, akv's weights are torch's within float32 rounding (torch's CPU kernels
    fuse multiply-adds, so not bit for bit).

    MXNet 2.0's ``AdamW`` documents this formula, but its kernels fold the bias correction
    into the learning rate (``eta = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``, then
    ``weight -= eta * (m / (sqrt(v) + epsilon) + wd * weight)``), which scales the weight
    decay by the bias correction too and moves epsilon inside it; akv keeps the documented
    formula, which is torch's. MXNet 1.9.1 has no AdamW optimizer.

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float, default 0.9, 0.999
        In ``[0, 1)``.
    epsilon : float, default 1e-6
        ``> 0`` (MXNet 2.0's default; torch's is 1e-8).
    correct_bias : bool, default True
    **kwargs
        The other parameters of :class:`Optimizer`; ``wd`` is the decoupled decay.

    Notes
    -----
    The state is ``(mean, var)``.
    """

    _CONFIG_PARAMS = (*MomentEstimates._CONFIG_PARAMS, ("correct_bias", "correct_bias"))

    def __init__(
        self,
        learning_rate: float | None = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        correct_bias: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.correct_bias = self._boolean("correct_bias", correct_bias)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        t = self._index_update_count[index]
        step_size, root_scale = lr, 1.0
        if self.correct_bias:
            step_size = lr / (1.0 - self.beta1**t)
            root_scale = math.sqrt(1.0 - self.beta2**t)
        decay = 1.0 - lr * wd
        rescale, clip = self.rescale_grad, self.clip_gradient
        beta1, beta2, epsilon = self.beta1, self.beta2, self.epsilon

        # torch's order and scalars (1 - beta in double): weight *= 1 - lr*wd; mean +=
        # (1 - beta1) * (g - mean) (lerp); var as addcmul; weight += (-step * mean) /
        # (sqrt(var) / root + epsilon) (addcdiv).
        def kernel(
            w: np.ndarray,
            g: np.ndarray,
            mean: np.ndarray,
            var: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            clipped, work = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            if wd:
                np.multiply(w, decay, out=w)
            np.subtract(g, mean, out=work)
            np.multiply(work, 1.0 - beta1, out=work)
            np.add(mean, work, out=mean)
            _square_average(var, g, beta2, work)
            np.sqrt(var, out=work)
            np.divide(work, root_scale, out=work)
            np.add(work, epsilon, out=work)
            np.multiply(mean, -step_size, out=clipped)
            np.divide(clipped, work, out=work)
            np.add(w, work, out=w)

        mean, var = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (mean, var), num_scratch=2)
