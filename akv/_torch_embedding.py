"""An embedding table that lives in an akv store: :class:`Embedding` (re-exported by
:mod:`akv.torch`, which is where users take it from)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import torch

from akv._torch_common import blocking_store, describe
from akv.args import Key
from akv.blocking import shallow_copy
from akv.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    RowIdError,
    ShapeMismatchError,
    UnsupportedDTypeError,
)
from akv.sparse import (
    RowSparseArray,
    as_row_sparse,
    check_dtype,
    host_rows,
    host_tensor,
    is_row_sparse,
)
from akv.store import KVStore

__all__ = ["Embedding"]


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _not_compiled(method: _Method) -> _Method:
    """``method``, run eagerly under ``torch.compile`` (dynamo cannot trace a store call)."""
    # torch leaves disable unannotated: typed here, where it is called.
    disable = cast(Callable[[_Method], _Method], torch.compiler.disable)
    return disable(method)


class Embedding(torch.nn.Module):
    """An embedding table that lives in an akv store, as a row-sparse key.

    Parameters
    ----------
    kv:
        A blocking store from :func:`akv.create` (``local``, ``device``, ``dist_sync``,
        ``dist_async`` or their variants). The key must not be initialized yet. Set the
        store's optimizer (``kv.set_optimizer``, or a :class:`DistributedOptimizer` on the
        same store) before the first backward: without one, a push *replaces* the table's
        rows with the gradient (MXNet's meaning of a push). The store stays the caller's.
    key:
        The store key of the table (an ``int`` or a ``str``, of the kind the store's other
        keys use).
    num_embeddings, embedding_dim:
        The table's shape ``(num_embeddings, embedding_dim)``: ints >= 1. Only the rows
        written are stored, so ``num_embeddings`` may far exceed memory.
    init:
        The table's first value. ``None`` (default): no row is stored and every row reads
        as zero (``torch.nn.Embedding`` draws N(0, 1) instead: pass such a table here to
        start from it). A dense tensor or array of the table's shape and dtype: every row
        is stored. An :class:`akv.RowSparseArray` (or a torch sparse COO tensor) of the
        table's shape and dtype: the rows it lists are stored, the others read as zero.
        In a distributed store every worker passes its own and rank 0's is kept.
    dtype:
        The rows' dtype: ``torch.float32`` (default), ``torch.float16`` or
        ``torch.float64``.

    Guarantees
    ----------
    * ``forward(ids)`` takes integer ids of any shape, each in ``[0, num_embeddings)``,
      and returns a tensor of shape ``ids.shape + (embedding_dim,)`` on ``ids``'s device.
      It pulls the batch's unique ids once (``row_sparse_pull``, which sees every earlier
      push) and gathers them.
    * With grad enabled, the rows pulled are a leaf that requires grad; the backward pass
      that reaches it pushes their gradient, repeated ids summed, as one row-sparse push
      of the unique ids, and the store's optimizer updates those rows (lazily, with
      :class:`akv.optimizer.SGD`: rows the batch does not touch never change). Each
      backward pass through a forward's output pushes once; nothing is pushed when
      grad is disabled (``torch.no_grad()``, inference) or the table is frozen
      (:meth:`requires_grad_`).
    * The module has no parameters and no state dict: the table is the store's. Read
      rows with :meth:`rows`.
    * Bad ids raise :class:`~akv.errors.InvalidArgumentError` (not an integer tensor) or
      :class:`~akv.errors.RowIdError` (an id out of range, with its position), naming
      the key; argument errors of the constructor raise before the key is initialized.
    """

    def __init__(
        self,
        kv: KVStore,
        key: Key,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init: object = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        what = f"Embedding key {key!r}"
        blocking_store(kv, what, "forward() waits for the rows it pulls")
        shape = (
            _positive(num_embeddings, "num_embeddings", what),
            _positive(embedding_dim, "embedding_dim", what),
        )
        table = _initial_table(init, shape, _numpy_dtype(dtype, what), what)
        kv.init(key, table)
        self._kv = kv
        self._key = key
        self._shape = shape
        self._dtype = dtype
        self._what = what
        self._trainable = True

    @property
    def kv(self) -> KVStore:
        """The store that holds the table."""
        return self._kv

    @property
    def key(self) -> Key:
        """The table's store key."""
        return self._key

    @property
    def num_embeddings(self) -> int:
        """The table's number of rows."""
        return self._shape[0]

    @property
    def embedding_dim(self) -> int:
        """The width of a row."""
        return self._shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype."""
        return self._dtype

    # torch.compile runs the store calls eagerly (a graph break): traced, dynamo descends into
    # the store's internals and fails there with an InternalTorchDynamoError.
    @_not_compiled
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``: shape ``ids.shape + (embedding_dim,)``, on ``ids``'s device.

        With grad enabled, backward pushes the gradient of the rows pulled (see the class).
        Under ``torch.compile`` this call runs eagerly, outside the compiled graph.

        Raises
        ------
        InvalidArgumentError, RowIdError
            Bad ids (naming the key); nothing is pulled.
        """
        unique, inverse = self._unique(ids, "forward")
        rows = self._pull(unique, ids.device)
        if torch.is_grad_enabled() and self._trainable:
            rows.requires_grad_()
            # torch leaves this method unannotated: typed here, where it is called.
            register = cast(Callable[..., Any], rows.register_hook)
            register(self._pusher(unique))
        return torch.nn.functional.embedding(inverse, rows)

    @_not_compiled
    @torch.no_grad()
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (as :meth:`forward` returns them), without grad.

        ``emb.rows(torch.arange(emb.num_embeddings))`` is the whole table (every row
        allocated: for a huge table, ask for the rows you need).

        Raises
        ------
        InvalidArgumentError, RowIdError
        """
        unique, inverse = self._unique(ids, "rows")
        return torch.nn.functional.embedding(inverse, self._pull(unique, ids.device))

    def requires_grad_(self, requires_grad: bool = True) -> Embedding:
        """Freeze the table (``False``: ``forward``'s rows do not require grad, so no backward
        pushes to it) or train it again (``True``, the default state), as
        ``torch.nn.Embedding.requires_grad_`` does for its weight. Returns the module.

        The module has no parameters, so a parent's ``model.requires_grad_(False)`` does not
        reach it: call this method on the Embedding itself.

        Raises
        ------
        InvalidArgumentError
            ``requires_grad`` is not a bool.
        """
        if not isinstance(requires_grad, bool):
            raise InvalidArgumentError(
                f"{self._what}: requires_grad_ takes a bool, got {requires_grad!r}"
            )
        self._trainable = requires_grad
        return self

    def extra_repr(self) -> str:
        frozen = "" if self._trainable else ", requires_grad=False"
        return f"key={self._key!r}, {self._shape[0]}, {self._shape[1]}, dtype={self._dtype}{frozen}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()``, ``.half()``, ``.double()``...: a device move changes nothing (the
        output is on the ids' device), nor does a dtype conversion, since the rows' dtype
        is the store key's; the latter warns, so that it is not silent (raising would leave
        the model's other layers half converted)."""
        try:
            converted = fn(torch.zeros((), dtype=self._dtype))
        except Exception:  # a move this machine cannot make: torch says so for the others
            converted = None
        if isinstance(converted, torch.Tensor) and converted.dtype != self._dtype:
            warnings.warn(
                f"{self._what}: the table's rows stay {self._dtype} (the store key's dtype): a "
                f"module conversion to {converted.dtype} changes neither them nor the output; "
                "make the Embedding with dtype=... for rows of another dtype",
                UserWarning,
                stacklevel=4,
            )
        # torch leaves _apply unannotated: typed here, where it is called.
        apply = cast(Callable[..., Any], super()._apply)
        return apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InvalidArgumentError(
            f"{self._what}: the module cannot be pickled or deep-copied (torch.save(module), "
            "copy.deepcopy): its table lives in the store, a live connection. Save the other "
            "layers with torch.save(model.state_dict()) (the table is not in it), and the "
            "table's rows from the store (emb.rows(ids), or the servers' checkpoints)"
        )

    def __copy__(self) -> Embedding:
        return shallow_copy(self)  # another module on the same store key, as before

    # ------------------------------------------------------------------ internals

    def _unique(self, ids: object, call: str) -> tuple[np.ndarray, torch.Tensor]:
        """The sorted unique ids (host int64) and, for each id, its index among them."""
        what = f"{self._what}: {call}"
        if not isinstance(ids, torch.Tensor):
            raise InvalidArgumentError(
                f"{what}: ids must be a torch tensor of integers, got {describe(ids)}"
            )
        if ids.dtype not in _ID_DTYPES:
            raise InvalidArgumentError(
                f"{what}: ids must be integers (int64, int32, int16, int8 or uint8), got a "
                f"tensor of dtype {ids.dtype} (convert them with ids.long())"
            )
        if ids.layout != torch.strided:
            raise InvalidArgumentError(
                f"{what}: ids must be a dense tensor, got layout {ids.layout}"
            )
        if _traced():
            # A trace would keep this call's rows as constants: wrong rows for other ids,
            # and no push (torch.jit.trace only warned that int() may make it incorrect).
            raise InvalidArgumentError(
                f"{what}: the Embedding cannot be traced (torch.jit.trace) or exported "
                "(torch.export): its rows come from the store at each call, and a trace "
                "would keep this call's rows as constants; trace the layers around it "
                "(torch.compile runs it eagerly)"
            )
        if ids.device.type == "meta":  # no values: torch.unique of them raises, untyped
            raise InvalidArgumentError(
                f"{what}: ids are on the meta device, which holds no values: give them on "
                "the CPU or a GPU"
            )
        unique, inverse = torch.unique(ids, return_inverse=True)
        # Compared as int64: a bound beyond the ids' own dtype (1000 rows, int8 ids) wraps.
        rows = self._shape[0]
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= rows):
            wide = ids.long()
            bad = ((wide < 0) | (wide >= rows)).nonzero()[0].tolist()
            position = f"ids[{', '.join(str(i) for i in bad)}]" if bad else "ids"
            raise RowIdError(
                f"{what}: id {int(ids[tuple(bad)])} at {position} is outside "
                f"[0, {self._shape[0]}) (num_embeddings is {self._shape[0]})"
            )
        return unique.cpu().numpy().astype(np.int64, copy=False), inverse

    def _pull(self, unique: np.ndarray, device: torch.device) -> torch.Tensor:
        """The stored rows of ``unique`` (sorted unique ids), as a new tensor on ``device``."""
        pulled: RowSparseArray = self._kv.row_sparse_pull(self._key, row_ids=unique)
        return torch.from_numpy(pulled.data).to(device)

    def _pusher(self, unique: np.ndarray) -> Callable[[torch.Tensor], None]:
        def push_gradient(grad: torch.Tensor) -> None:
            rows = grad.detach().cpu()
            self._kv.push(self._key, RowSparseArray(rows, unique, self._shape))

        return push_gradient


def _traced() -> bool:
    """Whether torch is tracing the call (``torch.jit.trace``, ``torch.export``) rather than
    running it; under ``torch.compile`` the methods are not traced (:func:`_not_compiled`)."""
    checks = (getattr(torch.jit, "is_tracing", None), getattr(torch.compiler, "is_compiling", None))
    return any(check is not None and cast(Callable[[], bool], check)() for check in checks)


def _positive(value: object, name: str, what: str) -> int:
    """``value`` as an int >= 1.

    Raises
    ------
    InvalidArgumentError
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{what}: {name} must be an int >= 1, got {value!r}")
    return value


#: The id dtypes taken: torch's unique and comparisons have no kernels for the wider
#: unsigned ones (uint16, uint32, uint64).
_ID_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _numpy_dtype(dtype: object, what: str) -> np.dtype:
    """The NumPy dtype of the rows of a table of torch ``dtype``.

    Raises
    ------
    InvalidArgumentError, UnsupportedDTypeError
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"{what}: dtype must be a floating torch.dtype (torch.float32, torch.float16 or "
            f"torch.float64), got {dtype!r}"
        )
    try:
        kind = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError as exc:  # bfloat16: NumPy has no such dtype
        raise UnsupportedDTypeError(
            f"{what}: dtype {dtype} has no NumPy twin, so akv cannot store it; use "
            "torch.float32 (and cast the output) instead"
        ) from exc
    check_dtype(kind, what)
    return kind


def _initial_table(
    init: object, shape: tuple[int, int], dtype: np.dtype, what: str
) -> RowSparseArray:
    """The row-sparse value ``init`` gives a table of ``shape`` and ``dtype`` (see
    :class:`Embedding`).

    Raises
    ------
    ShapeMismatchError, DTypeMismatchError, StorageTypeError, InvalidArgumentError,
    RowIdError
    """
    if init is None:
        return RowSparseArray.zeros(shape, dtype)
    dense: np.ndarray | None = None
    if is_row_sparse(init):
        table = as_row_sparse(init, f"{what}: init")
        given, given_dtype = table.shape, table.dtype
    else:
        if isinstance(init, torch.Tensor):
            init = host_tensor(init, f"{what}: init")
        dense = host_rows(init, f"{what}: init")
        given, given_dtype = tuple(dense.shape), dense.dtype
    if given != shape:
        raise ShapeMismatchError(
            f"{what}: init of shape {given} does not match the table's shape {shape} "
            "(num_embeddings, embedding_dim)",
            expected=shape,
            got=given,
        )
    if given_dtype != dtype:
        raise DTypeMismatchError(
            f"{what}: init of dtype {given_dtype} does not match the table's dtype {dtype} "
            "(akv never casts: convert it, or pass dtype=)",
            expected=dtype,
            got=given_dtype,
        )
    return table if dense is None else RowSparseArray(dense, np.arange(shape[0]), shape)
