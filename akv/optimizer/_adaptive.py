"""Optimizers with per-element adaptive steps: Adam, AdaGrad, RMSProp, AdaDelta, FTRL, LAMB.

Formulas are MXNet 1.9.1's (the fused operators its Python classes call, or the Python code
where the class computes the update itself). Unlike MXNet, where some of these states are
always float32, every state array here has the weight's dtype (the same for float32 weights
and for float16 weights with ``multi_precision``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from akv.errors import OptimizerError
from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    register,
)
from akv.optimizer._kernels import (
    complement,
    rescaled_clipped,
    run_chunked,
    zeros_like,
)

__all__ = ["FTRL", "LAMB", "AdaDelta", "AdaGrad", "Adam", "MomentEstimates", "RMSProp"]


def decayed_gradient(
    grad: np.ndarray,
    weight: np.ndarray,
    out: np.ndarray,
    work: np.ndarray,
    rescale_grad: float,
    wd: float,
    clip_gradient: float | None,
) -> np.ndarray:
    """``clip(rescale_grad * grad + wd * weight, clip_gradient)``, in ``out`` unless it is
    ``grad`` itself (then only to be read)."""
    if not wd:
        return rescaled_clipped(grad, out, rescale_grad, clip_gradient)
    np.multiply(weight, wd, out=out)
    if rescale_grad != 1.0:
        np.multiply(grad, rescale_grad, out=work)
        grad = work
    np.add(out, grad, out=out)
    return rescaled_clipped(out, out, 1.0, clip_gradient)


def moving_average(
    average: np.ndarray,
    value: np.ndarray,
    decay: float,
    work: np.ndarray,
    keep: float | None = None,
) -> None:
    """``average = decay * average + keep * value``, in place; ``keep`` is ``1 - decay``
    computed in the array's dtype unless given (MXNet's Python optimizers compute it in
    double: ``(1. - beta1) * grad``)."""
    np.multiply(average, decay, out=average)
    np.multiply(value, complement(decay, average.dtype) if keep is None else keep, out=work)
    np.add(average, work, out=average)


def moving_square_average(
    average: np.ndarray,
    value: np.ndarray,
    decay: float,
    work: np.ndarray,
    keep: float | None = None,
) -> None:
    """``average = decay * average + keep * value**2``, in place, ``keep`` as in
    :func:`moving_average`."""
    np.multiply(average, decay, out=average)
    np.multiply(value, value, out=work)
    np.multiply(work, complement(decay, average.dtype) if keep is None else keep, out=work)
    np.add(average, work, out=average)


class MomentEstimates(Optimizer):
    """What Adam's family shares: the decay rates ``beta1`` and ``beta2`` of the moment
    estimates (in ``[0, 1)``), ``epsilon`` (``> 0``) and the state ``(mean, var)``, zero
    arrays of the weight's shape. A base for Adam, LAMB, Nadam and AdamW, not an optimizer
    of its own (not registered)."""

    _CONFIG_PARAMS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("beta1", "beta1"),
        ("beta2", "beta2"),
        ("epsilon", "epsilon"),
    )

    def __init__(
        self,
        learning_rate: float | None,
        beta1: float,
        beta2: float,
        epsilon: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = self._fraction("beta1", beta1)
        self.beta2 = self._fraction("beta2", beta2)
        self.epsilon = self._real("epsilon", epsilon, positive=True)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        return (zeros_like(weight), zeros_like(weight))


@register
class Adam(MomentEstimates):
    """Adam (Kingma and Ba), MXNet's ``adam_update`` with the bias correction folded into the
    learning rate.

    At the ``t``-th update of a weight (``t`` counted per index)::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        weight -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * mean / (sqrt(var) + epsilon)

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float, default 0.9, 0.999
        Decay rates of the moment estimates, in ``[0, 1)``.
    epsilon : float, default 1e-8
        ``> 0``.
    lazy_update : bool, default True
        For row-sparse gradients: update only the gradient's rows and their moments
        (MXNet's lazy update), else every stored row, an absent row's gradient being
        ``wd * weight``. Dense gradients update every element either way.
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(mean, var)``.
    """

    _CONFIG_PARAMS = (*MomentEstimates._CONFIG_PARAMS, ("lazy_update", "lazy_update"))
    _LAZY_ROWS = True

    def __init__(
        self,
        learning_rate: float | None = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        lazy_update: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.lazy_update = self._boolean("lazy_update", lazy_update)

    def _corrected_lr(self, index: Index, lr: float) -> float:
        """The learning rate with the bias correction of the index's update count."""
        t = self._index_update_count[index]
        return lr * (math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t))

    def row_states_in_place(self, index: Index, dtype: np.dtype) -> int | None:
        """As :meth:`Optimizer.row_states_in_place`: the mean and the variance; not for a
        subclass (its update may differ) nor with gradient clipping."""
        if not self._row_kernels_apply(Adam, dtype):
            return None
        return 2

    def update_rows_in_place(
        self,
        index: Index,
        table: np.ndarray,
        slots: np.ndarray,
        grad: np.ndarray,
        states: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    ) -> bool:
        """As :meth:`Optimizer.update_rows_in_place`: each row, its mean and its variance
        read and written once, in the order of :meth:`update_rows`."""
        compiled = self._kernels_for(index, table, slots, grad, states)
        if compiled is None:
            return False
        self._update_count(index)
        lr = self._corrected_lr(index, self._get_lr(index))
        wd = self._get_wd(index)
        real, dtype = table.dtype.type, table.dtype
        (mean, mean_slots), (var, var_slots) = states
        compiled.adam_rows(
            table,
            slots,
            grad,
            mean,
            mean_slots,
            var,
            var_slots,
            real(self.rescale_grad),
            self.rescale_grad != 1.0,
            real(wd),
            bool(wd),
            real(self.beta1),
            real(complement(self.beta1, dtype)),
            real(self.beta2),
            real(complement(self.beta2, dtype)),
            real(self.epsilon),
            real(-lr),
        )
        return True

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        lr = self._corrected_lr(index, lr)
        rescale, clip = self.rescale_grad, self.clip_gradient
        beta1, beta2, epsilon = self.beta1, self.beta2, self.epsilon

        def kernel(
            w: np.ndarray,
            g: np.ndarray,
            mean: np.ndarray,
            var: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            decayed, work = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_average(mean, g, beta1, work)
            moving_square_average(var, g, beta2, work)
            np.sqrt(var, out=work)
            np.add(work, epsilon, out=work)
            np.divide(mean, work, out=work)
            np.multiply(work, -lr, out=work)
            np.add(w, work, out=w)

        mean, var = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (mean, var), num_scratch=2)


@register
class AdaGrad(Optimizer):
    """AdaGrad (Duchi et al.), as MXNet's Python implementation::

        g = clip(rescale_grad * grad, clip_gradient)
        history += g**2
        weight -= lr * (g / sqrt(history + eps) + wd * weight)

    Parameters
    ----------
    eps : float, default 1e-7
        Added to the history under the square root, ``> 0`` (kept as ``float_stable_eps``,
        MXNet's attribute name).
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    The state is the ``history`` array.
    """

    _CONFIG_PARAMS = (("eps", "float_stable_eps"),)
    _LAZY_ROWS = True

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """Lazy (MXNet's row-sparse AdaGrad updates only the gradient's rows), which, as
        in MXNet, needs no weight decay.

        Raises
        ------
        OptimizerError
            ``index`` has a weight decay.
        """
        wd = self._get_wd(index)
        if wd:
            raise OptimizerError(
                f"AdaGrad: index {index!r}: a row-sparse update needs wd=0 (as MXNet's "
                f"row-sparse AdaGrad), got wd={wd}; set wd=0 or its wd_mult to 0"
            )
        return "lazy"

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = self._real("eps", eps, positive=True)

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
        rescale, clip, eps = self.rescale_grad, self.clip_gradient, self.float_stable_eps

        def kernel(
            w: np.ndarray, g: np.ndarray, history: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            clipped, work, decay = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            np.multiply(g, g, out=work)
            np.add(history, work, out=history)
            np.add(history, eps, out=work)
            np.sqrt(work, out=work)
            np.divide(g, work, out=work)
            if wd:
                np.multiply(w, wd, out=decay)
                np.add(work, decay, out=work)
            np.multiply(work, -lr, out=work)
            np.add(w, work, out=w)

        run_chunked(kernel, weight, grad, (self._state_array(index, state),), num_scratch=3)


@register
class RMSProp(Optimizer):
    """RMSProp, both of MXNet's variants.

    With ``g = clip(rescale_grad * grad + wd * weight, clip_gradient)``, non-centered
    (Tieleman and Hinton, ``rmsprop_update``)::

        n = (1 - gamma1) * g**2 + gamma1 * n
        weight -= lr * g / sqrt(n + epsilon)

    centered (Graves, ``rmspropalex_update``)::

        n = (1 - gamma1) * g**2 + gamma1 * n
        mean = (1 - gamma1) * g + gamma1 * mean
        delta = gamma2 * delta - lr * g / sqrt(n - mean**2 + epsilon)
        weight += delta

    and then, if ``clip_weights`` is set, the weight is clipped into
    ``[-clip_weights, clip_weights]``.

    Parameters
    ----------
    learning_rate : float, default 0.001
    gamma1 : float, default 0.9
        Decay of the moving averages, in ``[0, 1)``.
    gamma2 : float, default 0.9
        Momentum of the centered variant, in ``[0, 1)``.
    epsilon : float, default 1e-8
        ``> 0``.
    centered : bool, default False
    clip_weights : float, optional
        ``None`` or 0 (off), or the bound, ``> 0``.
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(n,)``, or ``(n, mean, delta)`` when centered.
    """

    _CONFIG_PARAMS = (
        ("gamma1", "gamma1"),
        ("gamma2", "gamma2"),
        ("epsilon", "epsilon"),
        ("centered", "centered"),
        ("clip_weights", "clip_weights"),
    )

    def __init__(
        self,
        learning_rate: float | None = 0.001,
        gamma1: float = 0.9,
        gamma2: float = 0.9,
        epsilon: float = 1e-8,
        centered: bool = False,
        clip_weights: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = self._fraction("gamma1", gamma1)
        self.gamma2 = self._fraction("gamma2", gamma2)
        self.epsilon = self._real("epsilon", epsilon, positive=True)
        self.centered = self._boolean("centered", centered)
        self.clip_weights = self._real("clip_weights", clip_weights, minimum=0.0, none=True)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        if self.centered:
            return (zeros_like(weight), zeros_like(weight), zeros_like(weight))
        return (zeros_like(weight),)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        rescale, clip, clip_weights = self.rescale_grad, self.clip_gradient, self.clip_weights
        gamma1, gamma2, epsilon = self.gamma1, self.gamma2, self.epsilon

        def plain(w: np.ndarray, g: np.ndarray, n: np.ndarray, buffers: list[np.ndarray]) -> None:
            decayed, work = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_square_average(n, g, gamma1, work)
            np.add(n, epsilon, out=work)
            np.sqrt(work, out=work)
            np.divide(g, work, out=work)
            np.multiply(work, -lr, out=work)
            np.add(w, work, out=w)
            if clip_weights:
                np.clip(w, -clip_weights, clip_weights, out=w)

        def centered(
            w: np.ndarray,
            g: np.ndarray,
            n: np.ndarray,
            mean: np.ndarray,
            delta: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            decayed, work = buffers
            g = decayed_gradient(g, w, decayed, work, rescale, wd, clip)
            moving_square_average(n, g, gamma1, work)
            moving_average(mean, g, gamma1, work)
            np.multiply(mean, mean, out=work)
            np.subtract(n, work, out=work)
            np.add(work, epsilon, out=work)
            np.sqrt(work, out=work)
            np.divide(g, work, out=work)
            np.multiply(work, lr, out=work)
            np.multiply(delta, gamma2, out=delta)
            np.subtract(delta, work, out=delta)
            np.add(w, delta, out=w)
            if clip_weights:
                np.clip(w, -clip_weights, clip_weights, out=w)

        kernel = centered if self.centered else plain
        states = self._state_arrays(index, state, 3 if self.centered else 1)
        run_chunked(kernel, weight, grad, states, num_scratch=2)


@register
class AdaDelta(Optimizer):
    """AdaDelta (Zeiler), as MXNet's Python implementation (no learning rate)::

        g = clip(rescale_grad * grad, clip_gradient)
        acc_g = rho * acc_g + (1 - rho) * g**2
        delta = sqrt(acc_delta + epsilon) / sqrt(acc_g + epsilon) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta**2
        weight -= delta + wd * weight

    Unlike MXNet's, the caller's gradient is not modified.

    Parameters
    ----------
    rho : float, default 0.9
        Decay rate, in ``[0, 1)``.
    epsilon : float, default 1e-5
        ``> 0``.
    **kwargs
        The parameters of :class:`Optimizer`; ``learning_rate`` and schedulers have no
        effect.

    Notes
    -----
    The state is ``(acc_g, acc_delta)``.
    """

    _CONFIG_PARAMS = (("rho", "rho"), ("epsilon", "epsilon"))

    def __init__(self, rho: float = 0.90, epsilon: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rho = self._fraction("rho", rho)
        self.epsilon = self._real("epsilon", epsilon, positive=True)

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
        rescale, clip, rho, epsilon = self.rescale_grad, self.clip_gradient, self.rho, self.epsilon

        def kernel(
            w: np.ndarray,
            g: np.ndarray,
            acc_g: np.ndarray,
            acc_delta: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            clipped, delta, work = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            moving_square_average(acc_g, g, rho, work)
            np.add(acc_delta, epsilon, out=delta)
            np.sqrt(delta, out=delta)
            np.add(acc_g, epsilon, out=work)
            np.sqrt(work, out=work)
            np.divide(delta, work, out=delta)
            np.multiply(delta, g, out=delta)
            moving_square_average(acc_delta, delta, rho, work)
            if wd:
                np.multiply(w, wd, out=work)
                np.add(delta, work, out=delta)
            np.subtract(w, delta, out=w)

        acc_g, acc_delta = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (acc_g, acc_delta), num_scratch=3)


@register
class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al.), MXNet's ``Ftrl`` and ``ftrl_update``::

        g = clip(rescale_grad * grad, clip_gradient)
        z += g - (sqrt(n + g**2) - sqrt(n)) * weight / lr
        n += g**2
        weight = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd) * (abs(z) > lamda1)

    Registered as ``"ftrl"`` (MXNet's class name is ``Ftrl``).

    Parameters
    ----------
    lamda1 : float, default 0.01
        L1 regularisation, ``>= 0``.
    learning_rate : float, default 0.1
        ``> 0``. As in MXNet, a scheduler given with it keeps its own ``base_lr``.
    beta : float, default 1
        Per-coordinate learning-rate parameter, ``>= 0``.
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(z, n)``.
    """

    _CONFIG_PARAMS = (("lamda1", "lamda1"), ("beta", "beta"))
    _LAZY_ROWS = True

    def __init__(
        self, lamda1: float = 0.01, learning_rate: float = 0.1, beta: float = 1, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.lamda1 = self._real("lamda1", lamda1, minimum=0.0)
        self.beta = self._real("beta", beta, minimum=0.0)
        self.lr = self._real("learning_rate", learning_rate, positive=True)

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
        rescale, clip, lamda1, beta = self.rescale_grad, self.clip_gradient, self.lamda1, self.beta

        def kernel(
            w: np.ndarray, g: np.ndarray, z: np.ndarray, n: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            clipped, square, work, other = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            np.multiply(g, g, out=square)
            np.add(n, square, out=work)
            np.sqrt(work, out=work)
            np.sqrt(n, out=other)
            np.subtract(work, other, out=work)
            np.multiply(work, w, out=work)
            np.divide(work, lr, out=work)
            np.add(z, g, out=z)
            np.subtract(z, work, out=z)
            np.add(n, square, out=n)
            np.sqrt(n, out=work)
            np.add(work, beta, out=work)
            np.divide(work, lr, out=work)
            np.add(work, wd, out=work)
            np.sign(z, out=other)
            np.multiply(other, lamda1, out=other)
            np.subtract(other, z, out=other)
            np.divide(other, work, out=other)
            np.abs(z, out=work)
            np.greater(work, lamda1, out=work)  # the mask, as 0.0 and 1.0
            np.multiply(other, work, out=w)

        z, n = self._state_arrays(index, state, 2)
        run_chunked(kernel, weight, grad, (z, n), num_scratch=4)


@register
class LAMB(MomentEstimates):
    """LAMB (You et al.), MXNet's ``lamb_update_phase1`` and ``lamb_update_phase2``.

    At the ``t``-th update of a weight::

        g = clip(rescale_grad * grad, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        if bias_correction:
            r = mean / (1 - beta1**t) / (sqrt(var / (1 - beta2**t)) + epsilon) + wd * weight
        else:
            r = mean / (sqrt(var) + epsilon) + wd * weight
        r1 = norm(weight), raised to lower_bound and lowered to upper_bound where set
        r2 = norm(r)
        weight -= lr * (r1 / r2 if r1 > 0 and r2 > 0 else 1) * r

    with ``norm(weight)`` taken before the update.

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float, default 0.9, 0.999
        In ``[0, 1)``.
    epsilon : float, default 1e-6
        ``> 0``.
    lower_bound, upper_bound : float, optional
        Bounds of the weight norm; ``None`` or 0 mean unset (as MXNet).
    bias_correction : bool, default True
    **kwargs
        The other parameters of :class:`Optimizer`.

    Notes
    -----
    The state is ``(mean, var)``. The update needs one temporary array of the weight's size
    (``r``), because its step size depends on the norm of all of it.
    """

    _CONFIG_PARAMS = (
        *MomentEstimates._CONFIG_PARAMS,
        ("lower_bound", "lower_bound"),
        ("upper_bound", "upper_bound"),
        ("bias_correction", "bias_correction"),
    )

    def __init__(
        self,
        learning_rate: float | None = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        lower_bound: float | None = None,
        upper_bound: float | None = None,
        bias_correction: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.lower_bound = self._real("lower_bound", lower_bound, minimum=0.0, none=True)
        self.upper_bound = self._real("upper_bound", upper_bound, minimum=0.0, none=True)
        if self.lower_bound and self.upper_bound and self.lower_bound > self.upper_bound:
            raise OptimizerError(
                f"LAMB: lower_bound {self.lower_bound} exceeds upper_bound {self.upper_bound}"
            )
        self.bias_correction = self._boolean("bias_correction", bias_correction)

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
        rescale, clip = self.rescale_grad, self.clip_gradient
        beta1, beta2, epsilon = self.beta1, self.beta2, self.epsilon
        if self.bias_correction:
            # In the weight's dtype, as MXNet's kernel, so that the rounding of 1 - beta2
            # in the moving average cancels against that of 1 - beta2**t.
            kind = weight.dtype.type
            mean_correction = float(kind(1.0) - kind(beta1) ** kind(t))
            var_correction = float(kind(1.0) - kind(beta2) ** kind(t))
        else:
            mean_correction = var_correction = 1.0
        ratio = zeros_like(weight)
        sums = [0.0, 0.0]  # squared norms of the weight and of the ratio

        def phase1(
            w: np.ndarray,
            g: np.ndarray,
            mean: np.ndarray,
            var: np.ndarray,
            r: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            clipped, work = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            moving_average(mean, g, beta1, work)
            moving_square_average(var, g, beta2, work)
            np.divide(var, var_correction, out=work)
            np.sqrt(work, out=work)
            np.add(work, epsilon, out=work)
            np.divide(mean, mean_correction, out=r)
            np.divide(r, work, out=r)
            if wd:
                np.multiply(w, wd, out=work)
                np.add(r, work, out=r)
            sums[0] += _squared_norm(w)
            sums[1] += _squared_norm(r)

        mean, var = self._state_arrays(index, state, 2)
        run_chunked(phase1, weight, grad, (mean, var, ratio), num_scratch=2)
        weight_norm, ratio_norm = math.sqrt(sums[0]), math.sqrt(sums[1])
        if self.lower_bound:
            weight_norm = max(weight_norm, self.lower_bound)
        if self.upper_bound:
            weight_norm = min(weight_norm, self.upper_bound)
        if weight_norm > 0.0 and ratio_norm > 0.0:
            lr *= weight_norm / ratio_norm

        def phase2(w: np.ndarray, r: np.ndarray, buffers: list[np.ndarray]) -> None:
            np.multiply(r, -lr, out=r)
            np.add(w, r, out=w)

        # The ratio is this call's own temporary, so phase 2 may scale it in place.
        run_chunked(phase2, weight, ratio, (), num_scratch=0)


def _squared_norm(values: np.ndarray) -> float:
    if values.dtype == np.float16:
        values = values.astype(np.float32)
    return float(np.dot(values, values))
