"""MXNet 1.9.1's contrib optimizers (``mxnet.optimizer.contrib``): GroupAdaGrad."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from akv.errors import OptimizerError
from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    register,
)
from akv.optimizer._kernels import (
    CHUNK_ELEMENTS,
    check_update_arrays,
    scratch,
    zeros_like,
)

__all__ = ["GroupAdaGrad"]

MIN_BLOCK_ROWS = 512
"""Rows GroupAdaGrad updates together at the least (more when they fit in a chunk)."""


@register
class GroupAdaGrad(Optimizer):
    """AdaGrad with one history value per row (MXNet's ``contrib.GroupAdaGrad``), for 2-D
    weights such as embedding tables::

        g = clip(rescale_grad * grad, clip_gradient)
        history += mean(g**2, axis=1, keepdims=True)
        weight -= lr * g / sqrt(history + eps)

    A row-sparse gradient gets MXNet's lazy update (``group_adagrad_update``): only its rows
    change, weight and history. As in MXNet, the row means are summed the way each MXNet
    path sums them: a dense gradient with MXNet's ``mean`` (compensated, Kahan, float32
    sums), a row-sparse one as its kernel does (a plain float32 sum, element by element),
    so both are MXNet's bit for bit.

    Parameters
    ----------
    eps : float, default 1e-5
        Added to the history under the square root, ``> 0`` (kept as
        ``float_stable_eps``, MXNet's attribute name).
    **kwargs
        The parameters of :class:`Optimizer` (``learning_rate`` default 0.01). Weight decay
        is not supported, as in MXNet: an update of an index whose ``wd`` is not 0 raises.

    Notes
    -----
    The state is the history, of shape ``(rows, 1)`` and the weight's dtype (MXNet's is
    float32). In a distributed store, a dense key of ``AKV_BIGARRAY_BOUND`` elements or more
    is split by elements, each server holding a 1-D part, which GroupAdaGrad refuses;
    row-sparse keys are split by rows and work.
    """

    _CONFIG_PARAMS = (("eps", "float_stable_eps"),)
    _LAZY_ROWS = True

    def __init__(self, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = self._real("eps", eps, positive=True)

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        """The history, ``(rows, 1)`` zeros.

        Raises
        ------
        OptimizerError
            The weight is not 2-D (MXNet asserts the same).
        """
        if weight.ndim != 2:
            raise OptimizerError(
                f"GroupAdaGrad: index {index!r}: the weight must be 2-D (rows of a table), "
                f"got shape {weight.shape}"
            )
        return zeros_like(weight[:, :1])

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """Lazy, as MXNet's.

        Raises
        ------
        OptimizerError
            ``index`` has a weight decay.
        """
        self._check_no_weight_decay(index)
        return "lazy"

    def update(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """As :meth:`Optimizer.update`; raises :class:`~akv.errors.OptimizerError`, before
        anything changes, when ``index`` has a weight decay."""
        self._check_no_weight_decay(index)
        super().update(index, weight, grad, state)

    def update_rows(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """As :meth:`Optimizer.update_rows`, with the row sums of MXNet's row-sparse
        kernel."""
        self._through_master_copy(self._update_gathered_rows, index, weight, grad, state)

    def _update_gathered_rows(
        self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State
    ) -> None:
        self._check_no_weight_decay(index)
        grad = check_update_arrays(index, weight, grad)
        self._update_count(index)
        history = self._state_array(index, state)
        self._group_step(weight, grad, history, self._get_lr(index), compensated=False)

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        history = self._state_array(index, state)
        self._group_step(weight, grad, history, lr, compensated=True)

    def _check_no_weight_decay(self, index: Index) -> None:
        wd = self._get_wd(index)
        if wd:
            raise OptimizerError(
                f"GroupAdaGrad: index {index!r}: weight decay is not supported (as in "
                f"MXNet), got wd={wd}; set wd=0 or its wd_mult to 0"
            )

    def _group_step(
        self,
        weight: np.ndarray,
        grad: np.ndarray,
        history: np.ndarray,
        lr: float,
        compensated: bool,
    ) -> None:
        """The update, a block of rows at a time (all rows at once on a GPU)."""
        if weight.ndim != 2 or history.shape != (weight.shape[0], 1):
            raise OptimizerError(
                f"GroupAdaGrad: a weight of shape {weight.shape} needs a history of shape "
                f"({weight.shape[0]}, 1), got {history.shape}"
            )
        rows, width = weight.shape
        dtype = weight.dtype
        on_host = isinstance(weight, np.ndarray)
        # The row sums loop over the columns, one call per column for a block's rows: long
        # rows get more rows than a chunk, so that the calls are few.
        block = max(MIN_BLOCK_ROWS, CHUNK_ELEMENTS // max(width, 1)) if on_host else rows
        for start in range(0, rows if width else 0, block):
            rows_here = slice(start, min(rows, start + block))
            w, g, h = weight[rows_here], grad[rows_here], history[rows_here]
            if on_host and w.size <= CHUNK_ELEMENTS:
                scaled, square = (buffer[: w.size].reshape(w.shape) for buffer in scratch(dtype, 2))
            else:
                scaled, square = np.empty_like(g), np.empty_like(g)
            # MXNet multiplies by rescale_grad even when it is 1 (which changes nothing).
            np.multiply(g, self.rescale_grad, out=scaled)
            if self.clip_gradient:
                np.clip(scaled, -self.clip_gradient, self.clip_gradient, out=scaled)
            np.multiply(scaled, scaled, out=square)
            mean = _row_sums(square, compensated)
            np.divide(mean, dtype.type(width), out=mean)
            np.add(h, mean, out=h)
            denominator = np.add(h, self.float_stable_eps)
            np.sqrt(denominator, out=denominator)
            np.multiply(scaled, lr, out=scaled)
            np.divide(scaled, denominator, out=scaled)
            np.subtract(w, scaled, out=w)


def _row_sums(values: np.ndarray, compensated: bool) -> np.ndarray:
    """Each row's sum, ``(rows, 1)``, added column by column in the values' dtype: with
    Kahan's compensation as MXNet's ``sum`` reducer (``mshadow::red::sum``), or plainly."""
    total = np.zeros_like(values[:, :1])
    if not compensated:
        for column in range(values.shape[1]):
            np.add(total, values[:, column : column + 1], out=total)
        return total
    residual = np.zeros_like(total)
    corrected, new_total = np.empty_like(total), np.empty_like(total)
    with np.errstate(invalid="ignore"):  # inf - inf after an overflow, mended below
        for column in range(values.shape[1]):
            np.subtract(values[:, column : column + 1], residual, out=corrected)
            np.add(total, corrected, out=new_total)
            np.subtract(new_total, total, out=residual)
            np.subtract(residual, corrected, out=residual)
            total, new_total = new_total, total
    # MXNet's reducer drops the compensation once the sum overflows, so an overflowed row
    # stays inf (here, inf - inf made it NaN); a row with a NaN value is NaN either way.
    lost = np.isnan(total)
    if bool(lost.any()):
        np.copyto(total, np.inf, where=lost & ~np.isnan(values).any(axis=1, keepdims=True))
    return total
