"""Gradient-descent optimizers: SGD, NAG, Signum, DCASGD and LARS (MXNet 1.9.1 formulas)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    register,
)
from akv.optimizer._kernels import (
    check_update_arrays,
    chunk_slices,
    complement,
    product,
    rescaled_clipped,
    run_chunked,
    scratch,
    zeros_like,
)

__all__ = ["DCASGD", "LARS", "NAG", "SGD", "Signum"]


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

    def row_sparse_update_for(self, index: Index, dtype: np.dtype) -> Literal["lazy", "standard"]:
        """As :meth:`row_sparse_update` (lazy with ``lazy_update``: MXNet's row-sparse
        ``sgd_update`` and ``sgd_mom_update``), but standard for float16 rows with
        ``multi_precision``:
        MXNet's ``mp_sgd_update`` and ``mp_sgd_mom_update`` have no row-sparse form, and
        its dense fallback updates every row (weight decay and momentum on rows the
        gradient does not list)."""
        if self.multi_precision and np.dtype(dtype) == np.float16:
            return "standard"
        return self.row_sparse_update(index)

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

    def row_states_in_place(self, index: Index, dtype: np.dtype) -> int | None:
        """As :meth:`Optimizer.row_states_in_place`: none without momentum, the momentum
        with it; not for a subclass (its update may differ) nor with gradient clipping."""
        if not self._row_kernels_apply(SGD, dtype):
            return None
        return 0 if self.momentum == 0.0 else 1

    def update_rows_in_place(
        self,
        index: Index,
        table: np.ndarray,
        slots: np.ndarray,
        grad: np.ndarray,
        states: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    ) -> bool:
        """As :meth:`Optimizer.update_rows_in_place`, each row read and written once, in
        the order of :meth:`update_rows`: ``(1 - lr*wd) * weight - lr * g`` without
        momentum; ``mom = (momentum * mom - (lr*wd) * weight) - (lr*rescale_grad) * g``,
        ``weight += mom`` with it."""
        compiled = self._kernels_for(index, table, slots, grad, states)
        if compiled is None:
            return False
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        real = table.dtype.type
        step = real(product(table.dtype, lr, self.rescale_grad))
        if not states:
            keep = real(1.0) - real(product(table.dtype, lr, wd))
            compiled.sgd_rows(table, slots, grad, step, keep, bool(wd))
        else:
            (mom, mom_slots), decay = states[0], real(product(table.dtype, lr, wd))
            compiled.sgd_mom_rows(
                table, slots, grad, mom, mom_slots, real(self.momentum), decay, step, bool(wd)
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

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """Lazy without momentum, standard with it: MXNet's NAG without momentum calls
        ``sgd_update``, whose ``lazy_update`` (default true) updates only a row-sparse
        gradient's rows; ``nag_mom_update`` has no row-sparse form (MXNet runs it on dense
        copies: every row)."""
        return "lazy" if self.momentum == 0.0 else "standard"

    def row_sparse_update_for(self, index: Index, dtype: np.dtype) -> Literal["lazy", "standard"]:
        """As :meth:`row_sparse_update`, but standard for float16 rows with
        ``multi_precision``: MXNet's ``mp_sgd_update`` has no row-sparse form, and its dense
        fallback updates every row (as :meth:`SGD.row_sparse_update_for`)."""
        if self.multi_precision and np.dtype(dtype) == np.float16:
            return "standard"
        return self.row_sparse_update(index)

    def update_rows(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """As :meth:`Optimizer.update_rows`, as MXNet's NAG on a row-sparse key: its kernel
        has no row-sparse form, and the dense copies MXNet falls back to give it a weight
        apart from its output, so the momentum's weight-decay term reads the weight from
        before the step (on a dense key it reads the updated one; with
        ``multi_precision`` on float16 rows, the updated master copy either way)."""
        if self.multi_precision and weight.dtype == np.float16:
            super().update_rows(index, weight, grad, state)
            return
        grad = check_update_arrays(index, weight, grad)
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        self._step(index, weight, grad, state, lr, wd, decay_new_weight=False)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
        *,
        decay_new_weight: bool = True,
    ) -> None:
        """One step; the momentum's weight decay reads the updated weight with
        ``decay_new_weight`` (MXNet's dense kernel in place), else the one before."""
        if state is None:
            _sgd_step(self, weight, grad, lr, wd, decay_factor=True)
            return
        rescale, clip, momentum = self.rescale_grad, self.clip_gradient, self.momentum
        momentum_plus_one = float(weight.dtype.type(momentum) + weight.dtype.type(1.0))
        decay_new_weight = bool(wd) and decay_new_weight

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
            if decay_new_weight:
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


@register
class DCASGD(Optimizer):
    """Delay-compensated asynchronous SGD (Zheng et al.), MXNet's ``DCASGD``.

    With ``g = clip(rescale_grad * grad, clip_gradient)`` and ``previous`` the weight before
    the index's previous update (its initial value at the first)::

        step = -lr * (g + wd * weight + lamda * g * g * (weight - previous))
        mom = momentum * mom + step         # with momentum; without, mom = step
        previous = weight
        weight += mom

    MXNet 1.9.1's DCASGD fails with momentum: its ``update`` tests ``if mom:`` on the momentum
    array, which raises ``ValueError`` ("The truth value of an NDArray with multiple elements
    is ambiguous"). akv makes it work, as the code meant (``if mom is not None``): the
    momentum update above, checked against MXNet's own operations with that one line fixed.

    Parameters
    ----------
    momentum : float, default 0.0
        In ``[0, 1)``; 0 keeps no momentum.
    lamda : float, default 0.04
        Scale of the delay compensation, ``>= 0`` (MXNet's spelling).
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    The state is ``(mom or None, previous)``; ``previous`` starts as a copy of the weight.
    """

    _CONFIG_PARAMS = (("momentum", "momentum"), ("lamda", "lamda"))

    def __init__(self, momentum: float = 0.0, lamda: float = 0.04, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = self._fraction("momentum", momentum)
        self.lamda = self._real("lamda", lamda, minimum=0.0)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        previous = zeros_like(weight)
        previous[...] = weight
        return (zeros_like(weight) if self.momentum != 0.0 else None, previous)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        rescale, clip, momentum, lamda = (
            self.rescale_grad,
            self.clip_gradient,
            self.momentum,
            self.lamda,
        )

        # MXNet's order: -lr * ((g + wd*w) + ((lamda*g)*g) * (w - previous)).
        def step(
            w: np.ndarray, g: np.ndarray, previous: np.ndarray, buffers: list[np.ndarray]
        ) -> np.ndarray:
            clipped, total, work, difference = buffers
            g = rescaled_clipped(g, clipped, rescale, clip)
            np.multiply(g, lamda, out=work)
            np.multiply(work, g, out=work)
            np.subtract(w, previous, out=difference)
            np.multiply(work, difference, out=work)
            if wd:
                np.multiply(w, wd, out=total)
                np.add(g, total, out=total)
                np.add(total, work, out=total)
            else:
                np.add(g, work, out=total)
            np.multiply(total, -lr, out=total)
            np.copyto(previous, w)
            return total

        def plain(
            w: np.ndarray, g: np.ndarray, previous: np.ndarray, buffers: list[np.ndarray]
        ) -> None:
            np.add(w, step(w, g, previous, buffers), out=w)

        def with_momentum(
            w: np.ndarray,
            g: np.ndarray,
            mom: np.ndarray,
            previous: np.ndarray,
            buffers: list[np.ndarray],
        ) -> None:
            total = step(w, g, previous, buffers)
            np.multiply(mom, momentum, out=mom)
            np.add(mom, total, out=mom)
            np.add(w, mom, out=w)

        mom, previous = self._state_pair(index, state)
        if mom is None:
            run_chunked(plain, weight, grad, (previous,), num_scratch=4)
        else:
            run_chunked(with_momentum, weight, grad, (mom, previous), num_scratch=4)

    def _state_pair(self, index: Index, state: State) -> tuple[np.ndarray | None, np.ndarray]:
        if isinstance(state, (tuple, list)) and len(state) == 2 and state[0] is None:
            return None, self._state_array(index, state[1])
        mom, previous = self._state_arrays(index, state, 2)
        return mom, previous


LARS_EXCLUDED_SUFFIXES = ("gamma", "beta", "bias")
"""Names (from ``param_idx2name``, else ``str(index)``) with these endings keep the plain
learning rate under LARS (MXNet 1.9.1: batch-norm parameters and biases)."""


@register
class LARS(Optimizer):
    """LARS (You et al., layer-wise adaptive rate scaling), MXNet 1.9.1's ``LARS``.

    SGD (with momentum and weight decay, as :class:`SGD`), with each index's learning rate
    scaled by the ratio of the weight's norm to the gradient's::

        w_norm = norm(weight); g_norm = norm(grad) * rescale_grad     # before the update
        if w_norm > 0 and g_norm > 0:
            lr = lr * eta * w_norm / (g_norm + wd * w_norm + eps)

    except for indexes whose name ends in ``gamma``, ``beta`` or ``bias``. With
    ``momentum_correction`` and a learning rate that changed since the previous update (of
    any index), the momentum is scaled by ``lr / previous lr`` (Goyal et al.), MXNet's
    ``cur_lr / last_lr``.

    As MXNet's (its ``multi_sum_sq`` and ``multi_lars`` kernels), the squared norms are
    summed one float32 element at a time, in order, and the rate is computed in float32, so
    the weights are MXNet's bit for bit.

    Parameters
    ----------
    momentum : float, default 0.0
        In ``[0, 1)``; 0 keeps no state.
    lazy_update : bool, default True
        Kept for MXNet's interface. A row-sparse gradient gets the standard update (every
        stored row), whatever it says: MXNet's lazy LARS scales by the norm of the whole
        weight but updates only the gradient's rows, which akv does not reproduce.
    eta : float, default 0.001
        The LARS coefficient, ``>= 0``.
    eps : float, default 0
        Added to the denominator, ``>= 0``.
    momentum_correction : bool, default True
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01).

    Notes
    -----
    With ``param_idx2name``, only names ending in ``_weight`` keep weight decay by default
    (MXNet's LARS; other optimizers keep ``_gamma`` too). The multi-precision state is
    ``(momentum or None, float32 master copy)``; akv takes the norms of the float32 master
    copy and gradient (MXNet: of the float16 weight and gradient). The learning rate of the
    latest update is the optimizer's shared state (``cur_lr``, saved with the states). In a
    distributed store, a dense key split over the servers (``AKV_BIGARRAY_BOUND``) is scaled
    by the norms of each server's part, as MXNet's servers do with their parts.
    """

    _CONFIG_PARAMS = (
        ("momentum", "momentum"),
        ("lazy_update", "lazy_update"),
        ("eta", "eta"),
        ("eps", "eps"),
        ("momentum_correction", "momentum_correction"),
    )
    _MASTER_COPY_FIRST = False
    _DECAYED_NAME_SUFFIXES = ("_weight",)
    _SHARED_STATE = ("cur_lr",)

    def __init__(
        self,
        momentum: float = 0.0,
        lazy_update: bool = True,
        eta: float = 0.001,
        eps: float = 0,
        momentum_correction: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.momentum = self._fraction("momentum", momentum)
        self.lazy_update = self._boolean("lazy_update", lazy_update)
        self.eta = self._real("eta", eta, minimum=0.0)
        self.eps = self._real("eps", eps, minimum=0.0)
        self.momentum_correction = self._boolean("momentum_correction", momentum_correction)
        self.last_lr: float | None = None
        self.cur_lr: float | None = None

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
        current = self._base_lr()
        with self._shared_lock:
            last = current if self.cur_lr is None else self.cur_lr
            self.last_lr, self.cur_lr = last, current
        name = self.idx2name.get(index, str(index))
        if not name.endswith(LARS_EXCLUDED_SUFFIXES):
            lr = self._lars_rate(weight, grad, lr, wd)
        if state is None:
            _sgd_step(self, weight, grad, lr, wd, decay_factor=False)
            return
        momentum = self.momentum
        if self.momentum_correction and last != 0:
            momentum *= current / last
        _sgd_momentum_step(self, weight, grad, self._state_array(index, state), lr, wd, momentum)

    def _lars_rate(self, weight: np.ndarray, grad: np.ndarray, lr: float, wd: float) -> float:
        """MXNet's ``multi_lars``, in float32."""
        f32 = np.float32
        weight_norm = np.sqrt(sequential_sum_of_squares(weight))
        grad_sum = sequential_sum_of_squares(grad)
        if not (weight_norm > 0.0 and grad_sum > 0.0):
            return float(f32(lr))
        numerator = f32(lr) * f32(self.eta) * weight_norm
        denominator = np.sqrt(grad_sum) * f32(self.rescale_grad) + f32(wd) * weight_norm
        return float(numerator / (denominator + f32(self.eps)))


def sequential_sum_of_squares(values: np.ndarray) -> np.float32:
    """``x[0]**2 + x[1]**2 + ...`` accumulated one float32 addition at a time, in order, the
    squares in the array's dtype (MXNet's ``multi_sum_sq`` on a CPU). On a GPU, CuPy's scan
    adds in another order (as does MXNet's GPU kernel)."""
    flat = values.reshape(-1)
    if not isinstance(flat, np.ndarray):
        squares = np.multiply(flat, flat).astype(np.float32)
        return np.float32(float(np.cumsum(squares)[-1])) if squares.size else np.float32(0.0)
    total: np.float32 = np.float32(0.0)
    (buffer,) = scratch(np.dtype(np.float32), 1)
    for chunk in chunk_slices(flat.size):
        part = buffer[: chunk.stop - chunk.start]
        if flat.dtype == np.float32:
            np.multiply(flat[chunk], flat[chunk], out=part)
        else:
            np.copyto(part, np.multiply(flat[chunk], flat[chunk]), casting="unsafe")
        part[0] += total
        np.cumsum(part, out=part)
        total = np.float32(part[-1])
    return total
