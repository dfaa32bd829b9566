"""The optimizer base class, the registry and the checks of an update's arguments (the
element-wise machinery the updates run on is :mod:`akv.optimizer._kernels`)."""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, SimpleNamespace
from typing import Any, ClassVar, Literal, TypeAlias, overload

import numpy as np

from akv import jit
from akv.errors import (
    InvalidArgumentError,
    OptimizerError,
)
from akv.optimizer import lr_scheduler as _lr_scheduler
from akv.optimizer._kernels import check_update_arrays, is_array, rows_fit

Index = int | str
"""A weight's index: the store's key, an ``int`` or a ``str`` as the caller gave it."""

State: TypeAlias = np.ndarray | tuple["State", ...] | list["State"] | None
"""An optimizer state: ``None``, an array, or a tuple or list of states. For a weight on a
GPU the arrays are CuPy arrays on the weight's device."""

DEFAULT_LEARNING_RATE = 0.01
"""The learning rate of an optimizer given neither ``learning_rate`` nor a scheduler."""

DECAYED_NAME_SUFFIXES = ("_weight", "_gamma")
"""With ``param_idx2name``, only names with these endings keep weight decay by default
(MXNet 1.9.1's rule); every other name gets a weight-decay multiplier of 0."""

_UNSUPPORTED = {
    "sym": "MXNet Symbol objects do not exist in akv; use set_lr_mult/set_wd_mult",
    "param_dict": "Gluon Parameter objects do not exist in akv; use set_lr_mult/set_wd_mult",
}

_REGISTRY: dict[str, type[Optimizer]] = {}


def register(cls: type[Optimizer]) -> type[Optimizer]:
    """Class decorator: make an optimizer creatable by :func:`create` and :func:`from_config`.

    The registry name is the lower-cased class name (``"sgd"`` for ``SGD``); names are
    case-insensitive. A config names the optimizer by this name, so a name must mean one
    class everywhere: registering a different class under a taken name raises
    :class:`~akv.errors.OptimizerError` (MXNet warns and replaces); registering the same class
    again is a no-op.
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise OptimizerError(f"register: {cls!r} is not a subclass of Optimizer")
    name = cls.__name__.lower()
    existing = _REGISTRY.get(name, cls)
    if existing is not cls:
        raise OptimizerError(
            f"register: the name {name!r} already belongs to "
            f"{existing.__module__}.{existing.__qualname__}"
        )
    _REGISTRY[name] = cls
    return cls


def create(name: str, **kwargs: Any) -> Optimizer:
    """Build the optimizer registered as ``name`` (case-insensitive) with ``kwargs``.

    Raises
    ------
    OptimizerError
        Unknown name, unknown parameter, or a bad parameter value.
    """
    if not isinstance(name, str):
        raise OptimizerError(f"optimizer name must be a str, got {name!r}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise OptimizerError(f"unknown optimizer {name!r} (known: {', '.join(sorted(_REGISTRY))})")
    return cls(**kwargs)


def from_config(config: Mapping[str, Any]) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.get_config`'s description.

    The result has the same class, hyper-parameters, scheduler, ``idx2name`` and learning
    rate and weight-decay multipliers; update counts are not part of a config (they travel
    with the states, see :mod:`akv.optimizer` ``encode_states``).

    Raises
    ------
    OptimizerError
        The description is malformed or holds an unknown name or a bad value.
    """
    if not isinstance(config, Mapping):
        raise OptimizerError(f"optimizer config must be a dict, got {type(config).__name__}")
    unknown = set(config) - {"name", "params", "lr_scheduler", "lr_mult", "wd_mult"}
    if unknown:
        raise OptimizerError(f"optimizer config has unknown entries {sorted(unknown)}")
    if "name" not in config:
        raise OptimizerError("optimizer config has no 'name'")
    params = config.get("params", {})
    if not isinstance(params, Mapping):
        raise OptimizerError(f"optimizer config 'params' must be a dict, got {params!r}")
    params = dict(params)
    if "lr_scheduler" in params:
        raise OptimizerError("optimizer config: the scheduler belongs in 'lr_scheduler'")
    if "param_idx2name" in params:
        params["param_idx2name"] = _pairs_to_dict("param_idx2name", params["param_idx2name"])
    scheduler = config.get("lr_scheduler")
    if scheduler is not None:
        params["lr_scheduler"] = _lr_scheduler.from_config(scheduler)
    optimizer = create(config["name"], **params)
    optimizer.set_lr_mult(_pairs_to_dict("lr_mult", config.get("lr_mult", [])))
    optimizer.set_wd_mult(_pairs_to_dict("wd_mult", config.get("wd_mult", [])))
    return optimizer


def _pairs_to_dict(what: str, pairs: object) -> dict[Any, Any]:
    # JSON objects only have string keys, so mappings whose keys may be ints travel as
    # lists of [key, value] pairs.
    if isinstance(pairs, Mapping):
        return dict(pairs)
    if not isinstance(pairs, (list, tuple)) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs
    ):
        raise OptimizerError(f"optimizer config: {what} must be a list of [key, value] pairs")
    return {_check_index(what, key): value for key, value in pairs}


def _dict_to_pairs(mapping: Mapping[Any, Any]) -> list[list[Any]]:
    return [[key, value] for key, value in mapping.items()]


def _check_index(what: str, index: object) -> Index:
    if isinstance(index, bool) or not isinstance(index, (numbers.Integral, str)):
        raise OptimizerError(f"{what}: index {index!r} is neither an int nor a str")
    return index if isinstance(index, str) else int(index)


class Optimizer:
    """Base class of akv's optimizers, with MXNet 1.9.1's parameters and behaviour.

    An optimizer turns a gradient into an in-place change of a weight. The store calls it
    through :class:`~akv.optimizer.Updater`, which keeps one state per weight; call
    :meth:`create_state_multi_precision` once per weight and
    :meth:`update_multi_precision` per gradient to drive it directly.

    Parameters
    ----------
    rescale_grad : float, default 1.0
        Every gradient is multiplied by this first (often ``1 / batch_size``).
    param_idx2name : dict of int to str, optional
        Names of the indexes. Learning-rate and weight-decay multipliers can then be given
        by name, and every name that ends neither in ``_weight`` nor in ``_gamma``
        (biases, ``_beta``, running statistics...) gets no weight decay by default.
    wd : float, default 0.0
        Weight decay (L2 regularisation) coefficient, ``>= 0``.
    clip_gradient : float, optional
        Clip each gradient element into ``[-clip_gradient, clip_gradient]`` (after
        rescaling). ``None`` (default) or ``0`` turn clipping off, as in MXNet.
    learning_rate : float, optional
        The learning rate, ``>= 0``. ``None`` means the scheduler's rate, or 0.01 without a
        scheduler. Given together with a scheduler, it replaces the scheduler's
        ``base_lr`` (with a warning, as MXNet; see :mod:`akv.optimizer.lr_scheduler` for
        what that changes).
    lr_scheduler : LRScheduler, optional
        Makes the learning rate a function of :attr:`num_update`.
    begin_num_update : int, default 0
        The update count each index starts from.
    multi_precision : bool, default False
        For float16 weights, keep a float32 master copy in the state, apply the update to it
        in float32 and round the result into the weight.

    Raises
    ------
    OptimizerError
        An unknown parameter or a bad value; the message names the optimizer and the
        parameter.

    Notes
    -----
    MXNet's ``sym`` and ``param_dict`` (a Symbol and Gluon Parameters, which supplied
    multipliers) are not supported: akv has neither; use :meth:`set_lr_mult` and
    :meth:`set_wd_mult`.

    Row-sparse gradients (of a row-sparse key, :class:`akv.RowSparseArray`) are applied
    by :meth:`update_rows` to the gathered rows; :meth:`row_sparse_update` says how: MXNet's
    lazy update (only the gradient's rows change, their states too) for the optimizers
    that have one in MXNet (SGD and Adam with ``lazy_update=True``, NAG without momentum,
    LBSGD with ``batch_scale=1``, AdaGrad, FTRL, GroupAdaGrad), else
    the standard update of every stored row, absent gradient rows counting as zeros.

    A subclass either overrides :meth:`update` as in MXNet (using ``_update_count``,
    ``_get_lr`` and ``_get_wd``), or implements ``_step(index, weight, grad, state, lr, wd)``
    and lets :meth:`update` validate, count and look up the rates. To be describable by
    :meth:`get_config` it lists its own constructor parameters in ``_CONFIG_PARAMS``.
    """

    _CONFIG_PARAMS: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(constructor parameter, attribute) pairs of a subclass's own parameters."""

    _BASE_CONFIG_PARAMS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("rescale_grad", "rescale_grad"),
        ("param_idx2name", "idx2name"),
        ("wd", "wd"),
        ("clip_gradient", "clip_gradient"),
        ("learning_rate", "lr"),
        ("begin_num_update", "begin_num_update"),
        ("multi_precision", "multi_precision"),
    )

    _LAZY_ROWS: ClassVar[bool] = False
    """Whether MXNet has a lazy row-sparse update of this optimizer (then used when the
    optimizer's ``lazy_update`` is true, or it has no such parameter)."""

    _MASTER_COPY_FIRST: ClassVar[bool] = True
    """Multi-precision state layout: ``(master, state)``, or ``(state, master)`` if False
    (MXNet's SGD and NAG)."""

    _DECAYED_NAME_SUFFIXES: ClassVar[tuple[str, ...]] = DECAYED_NAME_SUFFIXES
    """With ``param_idx2name``, the name endings that keep weight decay by default."""

    _SHARED_STATE: ClassVar[tuple[str, ...]] = ()
    """Attributes that hold what :meth:`shared_state` returns."""

    def __init__(
        self,
        rescale_grad: float = 1.0,
        param_idx2name: Mapping[int, str] | None = None,
        wd: float = 0.0,
        clip_gradient: float | None = None,
        learning_rate: float | None = None,
        lr_scheduler: _lr_scheduler.LRScheduler | None = None,
        begin_num_update: int = 0,
        multi_precision: bool = False,
        **unknown: Any,
    ) -> None:
        self._reject_unknown(unknown)
        self.rescale_grad = self._real("rescale_grad", rescale_grad)
        self.wd = self._real("wd", wd, minimum=0.0)
        self.clip_gradient = self._real("clip_gradient", clip_gradient, minimum=0.0, none=True)
        self.begin_num_update = self._integer("begin_num_update", begin_num_update)
        self.multi_precision = self._boolean("multi_precision", multi_precision)
        if lr_scheduler is not None and not isinstance(lr_scheduler, _lr_scheduler.LRScheduler):
            raise OptimizerError(
                f"{self._name}: lr_scheduler must be an LRScheduler, got {lr_scheduler!r}"
            )
        learning_rate = self._real("learning_rate", learning_rate, minimum=0.0, none=True)
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and learning_rate is None:
            learning_rate = DEFAULT_LEARNING_RATE
        if (
            lr_scheduler is not None
            and learning_rate is not None
            and lr_scheduler.base_lr != learning_rate
        ):
            warnings.warn(
                f"{self._name}: learning_rate {learning_rate} replaces the scheduler's "
                f"base_lr {lr_scheduler.base_lr}",
                UserWarning,
                stacklevel=3,
            )
            lr_scheduler.base_lr = learning_rate
        self.lr = learning_rate
        if param_idx2name is None:
            param_idx2name = {}
        if not isinstance(param_idx2name, Mapping) or not all(
            isinstance(name, str) for name in param_idx2name.values()
        ):
            raise OptimizerError(
                f"{self._name}: param_idx2name must be a dict of indexes to str names"
            )
        self.idx2name = {
            _check_index(f"{self._name}: param_idx2name", index): name
            for index, name in param_idx2name.items()
        }
        self.num_update = self.begin_num_update
        self._index_update_count: dict[Index, int] = {}
        # Guards the shared state (see shared_state): a store may update keys on threads.
        self._shared_lock = threading.Lock()
        self.lr_mult: dict[Index, float] = {}
        self.wd_mult: dict[Index, float] = {}
        self.set_lr_mult({})
        self.set_wd_mult({})

    # -- parameters -------------------------------------------------------------------------

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _reject_unknown(self, unknown: Mapping[str, Any]) -> None:
        for name in unknown:
            if name in _UNSUPPORTED:
                raise OptimizerError(f"{self._name}: parameter {name!r}: {_UNSUPPORTED[name]}")
        if unknown:
            known = sorted(
                {p for p, _ in self._BASE_CONFIG_PARAMS}
                | {p for p, _ in self._CONFIG_PARAMS}
                | {"lr_scheduler"}
            )
            raise OptimizerError(
                f"{self._name}: unknown parameter(s) {', '.join(map(repr, sorted(unknown)))} "
                f"(known: {', '.join(known)})"
            )

    @overload
    def _real(
        self,
        name: str,
        value: object,
        minimum: float | None = None,
        below: float | None = None,
        none: Literal[False] = False,
        positive: bool = False,
    ) -> float: ...

    @overload
    def _real(
        self,
        name: str,
        value: object,
        minimum: float | None = None,
        below: float | None = None,
        *,
        none: bool,
        positive: bool = False,
    ) -> float | None: ...

    def _real(
        self,
        name: str,
        value: object,
        minimum: float | None = None,
        below: float | None = None,
        none: bool = False,
        positive: bool = False,
    ) -> float | None:
        """Check a numeric parameter: finite, ``>= minimum``, ``< below``, ``> 0`` if
        ``positive``; ``None`` allowed if ``none``."""
        if value is None and none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise OptimizerError(f"{self._name}: {name} must be a number, got {value!r}")
        result = float(value)
        if not math.isfinite(result):
            raise OptimizerError(f"{self._name}: {name} must be finite, got {value!r}")
        if positive and result <= 0.0:
            raise OptimizerError(f"{self._name}: {name} must be > 0, got {value!r}")
        if minimum is not None and result < minimum:
            raise OptimizerError(f"{self._name}: {name} must be >= {minimum}, got {value!r}")
        if below is not None and result >= below:
            raise OptimizerError(f"{self._name}: {name} must be < {below}, got {value!r}")
        return result

    def _fraction(self, name: str, value: object) -> float:
        """Check a decay rate in ``[0, 1)``."""
        return self._real(name, value, minimum=0.0, below=1.0)

    def _integer(self, name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise OptimizerError(f"{self._name}: {name} must be an int >= 0, got {value!r}")
        return int(value)

    def _boolean(self, name: str, value: object) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise OptimizerError(f"{self._name}: {name} must be a bool, got {value!r}")
        return bool(value)

    def get_config(self) -> dict[str, Any]:
        """A JSON-serialisable description from which :func:`from_config` rebuilds an equal
        optimizer.

        Returns
        -------
        dict
            ``{"name": registry name, "params": {constructor parameter: current value},
            "lr_scheduler": scheduler config or None, "lr_mult": [[index, mult], ...],
            "wd_mult": [[index, mult], ...]}``. ``param_idx2name`` is a list of
            ``[index, name]`` pairs, because JSON object keys are always strings.
        """
        params = {
            name: getattr(self, attribute)
            for name, attribute in (*self._BASE_CONFIG_PARAMS, *self._CONFIG_PARAMS)
        }
        params["param_idx2name"] = _dict_to_pairs(self.idx2name)
        scheduler = self.lr_scheduler.get_config() if self.lr_scheduler is not None else None
        return {
            "name": self._name.lower(),
            "params": params,
            "lr_scheduler": scheduler,
            "lr_mult": _dict_to_pairs(self.lr_mult),
            "wd_mult": _dict_to_pairs(self.wd_mult),
        }

    def __repr__(self) -> str:
        own = ", ".join(f"{p}={getattr(self, a)!r}" for p, a in self._CONFIG_PARAMS)
        return f"{self._name}({own})" if own else f"{self._name}()"

    # -- learning rate, multipliers and counts ----------------------------------------------

    @property
    def learning_rate(self) -> float:
        """The current learning rate: the scheduler's at :attr:`num_update`, or ``lr``."""
        return self._base_lr()

    def _base_lr(self) -> float:
        """The learning rate before multipliers.

        ``lr`` is None only when a scheduler was given without ``learning_rate``.
        """
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)
        if self.lr is None:
            raise OptimizerError(f"{self._name}: lr is None and there is no lr_scheduler")
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate of an optimizer without a scheduler.

        Raises
        ------
        OptimizerError
            The optimizer has a scheduler (MXNet raises ``UserWarning``), or ``lr`` is
            negative.
        """
        if self.lr_scheduler is not None:
            raise OptimizerError(
                f"{self._name}: set_learning_rate is not possible with an lr_scheduler; "
                "change the scheduler instead"
            )
        self.lr = self._real("learning_rate", lr, minimum=0.0)

    def set_lr_mult(self, args_lr_mult: Mapping[Index, float]) -> None:
        """Replace the learning-rate multipliers.

        Keys are indexes, or names from ``param_idx2name``; an index's own entry wins over
        its name's. Indexes without an entry use 1.
        """
        self.lr_mult = self._multipliers("lr_mult", args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Mapping[Index, float]) -> None:
        """Replace the weight-decay multipliers.

        Keys are indexes or names as in :meth:`set_lr_mult`. Before ``args_wd_mult`` is
        applied, every name in ``param_idx2name`` that ends neither in ``_weight`` nor in
        ``_gamma`` gets 0 (MXNet's default: no decay of biases, ``_beta``...; LARS decays
        only ``_weight``, as MXNet's).
        """
        defaults: dict[Index, float] = {
            name: 0.0
            for name in self.idx2name.values()
            if not name.endswith(self._DECAYED_NAME_SUFFIXES)
        }
        defaults.update(self._multipliers("wd_mult", args_wd_mult))
        self.wd_mult = defaults

    def _multipliers(self, what: str, mapping: Mapping[Index, float]) -> dict[Index, float]:
        if not isinstance(mapping, Mapping):
            raise OptimizerError(f"{self._name}: {what} must be a dict, got {mapping!r}")
        result: dict[Index, float] = {}
        for key, value in mapping.items():
            result[_check_index(f"{self._name}: {what}", key)] = self._real(
                f"{what}[{key!r}]", value, minimum=0.0
            )
        return result

    @property
    def index_update_counts(self) -> Mapping[Index, int]:
        """Updates applied per index so far (read-only view; starts at ``begin_num_update``)."""
        return MappingProxyType(self._index_update_count)

    def restore_update_counts(self, counts: Mapping[Index, int], num_update: int) -> None:
        """Replace the per-index update counts and :attr:`num_update` (after a reload).

        Raises
        ------
        OptimizerError
            A count or ``num_update`` is not an int ``>= 0``.
        """
        restored = {
            _check_index(f"{self._name}: update counts", index): self._integer(
                f"update count of {index!r}", count
            )
            for index, count in counts.items()
        }
        self.num_update = self._integer("num_update", num_update)
        self._index_update_count = restored

    def shared_state(self) -> dict[str, float | None]:
        """What the optimizer keeps for all its indexes together, besides the update
        counts: nothing for most; Nadam's momentum schedule and LARS's last learning rate.

        Saved with the states (``"shared_state"`` of akv's state format), so that a
        reloaded optimizer continues exactly; :meth:`restore_shared_state` sets it back.
        """
        return {name: getattr(self, name) for name in self._SHARED_STATE}

    def restore_shared_state(self, values: Mapping[str, float | None]) -> None:
        """Set what :meth:`shared_state` returned (after a reload); names not given keep
        their value.

        Raises
        ------
        OptimizerError
            A name this optimizer does not keep, or a value that is neither a finite number
            nor ``None``; nothing changes then.
        """
        unknown = sorted(set(values) - set(self._SHARED_STATE))
        if unknown:
            kept = ", ".join(self._SHARED_STATE) or "nothing"
            raise OptimizerError(
                f"{self._name}: shared state {unknown} is not kept by this optimizer "
                f"(it keeps {kept})"
            )
        checked = {
            name: self._real(f"shared state {name!r}", value, none=True)
            for name, value in values.items()
        }
        for name, value in checked.items():
            setattr(self, name, value)

    def _update_count(self, index: Index | Sequence[Index]) -> None:
        """Count one update of ``index`` (or of each index in a list)."""
        for idx in index if isinstance(index, (list, tuple)) else (index,):
            count = self._index_update_count.get(idx, self.begin_num_update) + 1
            self._index_update_count[idx] = count
            self.num_update = max(count, self.num_update)

    def _get_lr(self, index: Index) -> float:
        """The learning rate of ``index``: current rate times its multiplier."""
        lr = self._base_lr()
        if index in self.lr_mult:
            return lr * self.lr_mult[index]
        if index in self.idx2name:
            return lr * self.lr_mult.get(self.idx2name[index], 1.0)
        return lr

    def _get_wd(self, index: Index) -> float:
        """The weight decay of ``index``: ``wd`` times its multiplier."""
        if index in self.wd_mult:
            return self.wd * self.wd_mult[index]
        if index in self.idx2name:
            return self.wd * self.wd_mult.get(self.idx2name[index], 1.0)
        return self.wd

    # -- states and updates -----------------------------------------------------------------

    def create_state(self, index: Index, weight: np.ndarray) -> State:
        """The auxiliary state (momentum, moments...) of a new weight; ``None`` if none.

        State arrays are new zero-filled C-contiguous arrays of the weight's shape and dtype.
        """
        return None

    def create_state_multi_precision(self, index: Index, weight: np.ndarray) -> State:
        """:meth:`create_state`, plus a float32 master copy of a float16 weight when
        ``multi_precision`` is set (warns about float16 accumulation when it is not)."""
        if weight.dtype == np.float16:
            if self.multi_precision:
                master = weight.astype(np.float32)
                state = self.create_state(index, master)
                return (master, state) if self._MASTER_COPY_FIRST else (state, master)
            warnings.warn(
                f"{self._name}: accumulating in float16 can lead to poor accuracy or slow "
                "convergence; consider multi_precision=True",
                UserWarning,
                stacklevel=2,
            )
        return self.create_state(index, weight)

    def update(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """Apply one gradient to ``weight`` in place and advance ``state`` in place.

        Counts the update of ``index`` (which advances :attr:`num_update` and, with it, the
        scheduler) before the learning rate is looked up. ``grad`` is not modified.

        Raises
        ------
        InvalidArgumentError
            ``weight`` is not a writeable floating-point NumPy array.
        ShapeMismatchError, DTypeMismatchError
            ``grad`` does not have the weight's shape or dtype.
        """
        grad = check_update_arrays(index, weight, grad)
        self._update_count(index)
        self._step(index, weight, grad, state, self._get_lr(index), self._get_wd(index))

    def row_sparse_update(self, index: Index) -> Literal["lazy", "standard"]:
        """How a row-sparse gradient of ``index`` is applied.

        ``"lazy"`` (MXNet's ``lazy_update``): only the gradient's rows are updated, weight
        and states; rows it does not list keep their weight and state (no weight decay, no
        momentum decay). ``"standard"``: every stored row is updated, a row the gradient
        does not list as with a zero gradient (MXNet's dense update of the whole weight).
        Either way :meth:`update_rows` applies it.

        Raises
        ------
        OptimizerError
            The optimizer cannot apply a row-sparse gradient of ``index``.
        """
        return "lazy" if self._LAZY_ROWS and getattr(self, "lazy_update", True) else "standard"

    def row_sparse_update_for(self, index: Index, dtype: np.dtype) -> Literal["lazy", "standard"]:
        """:meth:`row_sparse_update` for rows of ``dtype`` (what the updater asks): the
        same, but where the dtype decides (:class:`SGD`'s float16 rows with
        ``multi_precision``). An override of :meth:`row_sparse_update` applies here too."""
        return self.row_sparse_update(index)

    def update_rows(self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State) -> None:
        """Apply a row-sparse gradient to gathered rows: ``weight``, ``grad`` and the state
        arrays hold the same rows, in the same order (the rows :meth:`row_sparse_update`
        says to update). Counts one update of ``index``; otherwise as
        :meth:`update_multi_precision`."""
        self.update_multi_precision(index, weight, grad, state)

    def row_states_in_place(self, index: Index, dtype: np.dtype) -> int | None:
        """How many state arrays (each zero for a new row) :meth:`update_rows_in_place`
        keeps for rows of ``dtype``; None where it has no such update, and the caller
        gathers the rows for :meth:`update_rows`. None here; SGD and Adam have one."""
        return None

    def update_rows_in_place(
        self,
        index: Index,
        table: np.ndarray,
        slots: np.ndarray,
        grad: np.ndarray,
        states: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    ) -> bool:
        """Apply a lazy row-sparse gradient in place: row ``slots[i]`` (unique) of the 2-D
        ``table`` with ``grad[i]``, and of each ``(state_rows, state_slots)`` of ``states``
        row ``state_slots[i]``; bit for bit :meth:`update_rows` on gathered rows. Counts
        one update. False, changing nothing, where the arrays do not fit (``rows_fit``)."""
        return False

    def _row_kernels_apply(self, own: type, dtype: np.dtype) -> bool:
        """Whether :mod:`akv.jit`'s kernels of ``own`` apply: to an ``own`` itself (not a
        subclass, whose update may differ), without gradient clipping, on float32 or
        float64 rows, with the kernels available."""
        return (
            type(self) is own
            and not self.clip_gradient
            and np.dtype(dtype) in jit.DTYPES
            and jit.kernels() is not None
        )

    def _kernels_for(
        self,
        index: Index,
        table: np.ndarray,
        slots: np.ndarray,
        grad: np.ndarray,
        states: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> SimpleNamespace | None:
        """:mod:`akv.jit`'s kernels where :meth:`update_rows_in_place` can take these
        arrays (:func:`rows_fit` of the states it keeps), else None."""
        count = self.row_states_in_place(index, table.dtype)
        if count is None or not rows_fit(count, table, slots, grad, states):
            return None
        return jit.kernels()

    def _step(
        self,
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
        lr: float,
        wd: float,
    ) -> None:
        raise OptimizerError(
            f"{self._name} applies no update: use one of akv.optimizer's optimizers (SGD, "
            "Adam, ...), or subclass Optimizer and override _step (or update)"
        )

    def _state_array(self, index: Index, state: State) -> np.ndarray:
        """``state`` as the one array that :meth:`create_state` made it.

        Raises
        ------
        InvalidArgumentError
            ``state`` is not an array.
        """
        if is_array(state):
            return state
        raise InvalidArgumentError(
            f"{self._name}: index {index!r}: the state must be an array (as create_state "
            f"makes it), got {_describe_state(state)}"
        )

    def _state_arrays(self, index: Index, state: State, count: int) -> tuple[np.ndarray, ...]:
        """``state`` as the tuple or list of ``count`` arrays that :meth:`create_state` made.

        Raises
        ------
        InvalidArgumentError
            ``state`` is anything else.
        """
        if isinstance(state, (tuple, list)) and len(state) == count:
            arrays = tuple(member for member in state if is_array(member))
            if len(arrays) == count:
                return arrays
        raise InvalidArgumentError(
            f"{self._name}: index {index!r}: the state must be {count} arrays (as create_state "
            f"makes it), got {_describe_state(state)}"
        )

    def update_multi_precision(
        self, index: Index, weight: np.ndarray, grad: np.ndarray, state: State
    ) -> None:
        """:meth:`update`, through the float32 master copy for float16 weights when
        ``multi_precision`` is set: the gradient is cast to float32, the master copy and
        the state are updated, and the master copy is rounded into ``weight``."""
        self._through_master_copy(self.update, index, weight, grad, state)

    def _through_master_copy(
        self,
        update: Callable[[Index, np.ndarray, np.ndarray, State], None],
        index: Index,
        weight: np.ndarray,
        grad: np.ndarray,
        state: State,
    ) -> None:
        """``update(index, weight, grad, state)``, through the float32 master copy for
        float16 weights when ``multi_precision`` is set (see
        :meth:`update_multi_precision`)."""
        if not (self.multi_precision and weight.dtype == np.float16):
            update(index, weight, grad, state)
            return
        grad = check_update_arrays(index, weight, grad)
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise InvalidArgumentError(
                f"{self._name}: index {index!r}: a multi-precision state is a pair of the "
                f"master copy and the state, got {type(state).__name__}"
            )
        master, inner = state if self._MASTER_COPY_FIRST else (state[1], state[0])
        if not is_array(master):
            raise InvalidArgumentError(
                f"{self._name}: index {index!r}: the master copy of a multi-precision state "
                f"must be a numpy.ndarray, got {type(master).__name__}"
            )
        update(index, master, grad.astype(np.float32), inner)
        np.copyto(weight, master, casting="same_kind")


def _describe_state(state: State) -> str:
    if isinstance(state, (tuple, list)):
        members = ", ".join(type(member).__name__ for member in state)
        return f"a {type(state).__name__} of ({members})"
    return f"a {type(state).__name__}"
