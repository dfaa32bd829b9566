"""Row-sparse values: the rows of a large array that are present, such as an embedding's
gradient (issue #25).

A :class:`RowSparseArray` of shape ``(rows, *row_shape)`` lists some of its rows: ``indices``
(sorted, unique int64 row ids) and ``data`` (one row of shape ``row_shape`` per id); every
row not listed is zero. It is MXNet's ``row_sparse`` storage type, and what
``torch.nn.Embedding(sparse=True)`` produces as a gradient (a sparse COO tensor with one
sparse dimension), which :meth:`RowSparseArray.from_torch` and :func:`as_row_sparse` convert.

A RowSparseArray holds host memory (NumPy) only: GPU arrays are refused, and a CUDA torch
tensor is copied to the host. torch is never imported here: a value can only be a torch
tensor if the caller imported torch (akv looks it up in ``sys.modules``).
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from akv.arrays import is_gpu, read, to_host
from akv.errors import (
    InvalidArgumentError,
    RowIdError,
    ShapeMismatchError,
    StorageTypeError,
    UnsupportedDTypeError,
)
from akv_transport import DTYPE_CODES

__all__ = [
    "RowSparseArray",
    "as_row_sparse",
    "check_dense",
    "check_dtype",
    "check_row_ids",
    "check_shape",
    "host_rows",
    "host_tensor",
    "is_row_sparse",
]

#: Row ids: 1-D, int64, each in ``[0, rows)``.
RowIds = npt.NDArray[np.int64]

_INT64_MAX = np.iinfo(np.int64).max


class RowSparseArray:
    """An array of shape ``(rows, *row_shape)`` of which only the rows ``indices`` are stored.

    Parameters
    ----------
    data
        The listed rows: a NumPy array (or a CPU torch tensor, or anything else
        :func:`akv.arrays.read` views in host memory) of shape ``(len(indices), *shape[1:])``.
        GPU arrays are refused: a RowSparseArray holds host memory only.
    indices
        The row id of each row of ``data``: 1-D integers (anything ``np.asarray`` takes),
        each in ``[0, shape[0])``, in any order, repeats allowed.
    shape
        The shape of the whole (dense) array; ``shape[0]`` is its number of rows.

    Notes
    -----
    The constructor sorts the rows by id and sums the rows of a repeated id (in the order
    given; for bool, a logical or), once: afterwards :attr:`indices` is sorted and unique.
    The array owns its memory: ``data`` and ``indices`` are copied, never kept as views of
    the arguments. :attr:`indices` is read-only (it must stay sorted); :attr:`data` may be
    written in place.

    ``==`` is Python's identity comparison, as for any object (an element-wise one would be
    ambiguous between stored rows and absent ones): :meth:`equals` compares values.

    Raises
    ------
    InvalidArgumentError
        ``shape`` is not a sequence of non-negative ints with at least one dimension,
        ``indices`` are not 1-D integers, or ``data`` is not a host array.
    RowIdError
        A row id is negative or not below ``shape[0]`` (names the first, and its position).
    ShapeMismatchError
        ``data`` does not have shape ``(len(indices), *shape[1:])``.
    UnsupportedDTypeError
        ``data``'s dtype is not one akv stores (:data:`akv_transport.DTYPE_CODES`).
    StorageTypeError
        ``data`` is itself sparse (a torch sparse tensor).
    """

    __slots__ = ("_data", "_indices", "_shape")

    def __init__(self, data: object, indices: npt.ArrayLike, shape: Sequence[int] | int) -> None:
        what = "RowSparseArray"
        full = check_shape(shape, what)
        array = host_rows(data, f"{what} data")
        check_dtype(array.dtype, what)
        ids = check_row_ids(indices, full[0], f"{what} indices")
        expected = (ids.size, *full[1:])
        if array.shape != expected:
            raise ShapeMismatchError(
                f"{what}: data of shape {array.shape} does not fit shape {full} with "
                f"{ids.size} indices: expected data of shape {expected} (one row of shape "
                f"{full[1:]} per index)",
                expected=expected,
                got=array.shape,
            )
        ids, array = _sorted_rows(ids, array)
        self._set(array, ids, full)

    def _set(self, data: np.ndarray, indices: RowIds, shape: tuple[int, ...]) -> None:
        indices.flags.writeable = False
        self._data = data
        self._indices = indices
        self._shape = shape

    @classmethod
    def _trusted(cls, data: np.ndarray, indices: RowIds, shape: tuple[int, ...]) -> RowSparseArray:
        """An array from parts already checked: ``indices`` sorted, unique, in range; both
        owned by the new array."""
        self = cls.__new__(cls)
        self._set(data, indices, shape)
        return self

    # ------------------------------------------------------------ constructors

    @classmethod
    def zeros(cls, shape: Sequence[int] | int, dtype: npt.DTypeLike = np.float32) -> RowSparseArray:
        """An all-zero array of ``shape``: no rows listed (``nnz == 0``), nothing allocated
        by the number of rows.

        Raises
        ------
        InvalidArgumentError, UnsupportedDTypeError
        """
        what = "RowSparseArray.zeros"
        full = check_shape(shape, what)
        try:
            kind = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidArgumentError(f"{what}: {dtype!r} is not a dtype") from exc
        check_dtype(kind, what)
        return cls._trusted(np.zeros((0, *full[1:]), kind), np.zeros(0, np.int64), full)

    @classmethod
    def from_dense(cls, array: object) -> RowSparseArray:
        """The rows of ``array`` (at least 1-D, in host memory) that hold a nonzero element.

        A row of only zeros (``-0.0`` included) is left out; a row holding NaN is kept. The
        result owns copies of the rows.

        Raises
        ------
        InvalidArgumentError, UnsupportedDTypeError, StorageTypeError
        """
        what = "RowSparseArray.from_dense"
        dense = host_rows(array, what)
        if dense.ndim == 0:
            raise InvalidArgumentError(
                f"{what}: a 0-d array has no rows; give an array of at least 1 dimension"
            )
        check_dtype(dense.dtype, what)
        rows = dense.shape[0]
        flat = dense.reshape(rows, math.prod(dense.shape[1:]))  # -1 fails for 0 rows
        present = flat.any(axis=1) if flat.shape[1] else np.zeros(rows, bool)
        ids = np.flatnonzero(present).astype(np.int64, copy=False)
        return cls._trusted(np.ascontiguousarray(dense[ids]), ids, tuple(dense.shape))

    @classmethod
    def from_torch(cls, tensor: object) -> RowSparseArray:
        """The rows of a torch sparse COO tensor with one sparse dimension (the rows) and any
        dense trailing dimensions: what ``nn.Embedding(sparse=True)`` leaves in ``.grad``.

        An uncoalesced tensor is coalesced (repeated rows summed); a CUDA tensor is copied
        to the host. The result does not share memory with the tensor.

        Raises
        ------
        StorageTypeError
            ``tensor`` is not a sparse COO tensor, or has more than one sparse dimension.
        InvalidArgumentError, UnsupportedDTypeError, RowIdError
        """
        return _from_torch(tensor, "RowSparseArray.from_torch")

    # ------------------------------------------------------------ what it holds

    @property
    def data(self) -> np.ndarray:
        """The listed rows, C-contiguous, of shape ``(nnz, *shape[1:])``, in id order."""
        return self._data

    @property
    def indices(self) -> RowIds:
        """The listed row ids: int64, sorted, unique, read-only."""
        return self._indices

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole array."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the rows."""
        return self._data.dtype

    @property
    def nnz(self) -> int:
        """How many rows are listed (MXNet's and torch's name)."""
        return int(self._indices.size)

    @property
    def nbytes(self) -> int:
        """Bytes held: the listed rows and their ids."""
        return int(self._data.nbytes + self._indices.nbytes)

    def to_dense(self) -> np.ndarray:
        """A new dense NumPy array of :attr:`shape` (zeros where no row is listed).

        It allocates every row: for a huge ``shape[0]``, read :attr:`data` instead."""
        dense = np.zeros(self._shape, self.dtype)
        dense[self._indices] = self._data
        return dense

    def equals(self, other: object) -> bool:
        """Whether ``other`` is a RowSparseArray of the same shape, dtype, ids and rows
        (element by element; NaN equals nothing)."""
        return (
            isinstance(other, RowSparseArray)
            and self._shape == other._shape
            and self.dtype == other.dtype
            and np.array_equal(self._indices, other._indices)
            and np.array_equal(self._data, other._data)
        )

    def __repr__(self) -> str:
        ids = np.array2string(self._indices, threshold=8, edgeitems=3, separator=", ")
        return (
            f"RowSparseArray(shape={self._shape}, dtype={self.dtype}, nnz={self.nnz}, "
            f"indices={ids})"
        )


def is_row_sparse(value: object) -> bool:
    """Whether ``value`` is row-sparse: a RowSparseArray, or a torch tensor of a sparse
    layout (without importing torch)."""
    if isinstance(value, RowSparseArray):
        return True
    layout = _torch_layout(value)
    return layout is not None and layout != "strided"


def as_row_sparse(value: object, name: str) -> RowSparseArray:
    """``value`` as a RowSparseArray: itself, or a torch sparse COO tensor converted
    (:meth:`RowSparseArray.from_torch`).

    ``name`` says what ``value`` is (``"push to key 'emb'"``); error messages start with it.

    Raises
    ------
    StorageTypeError
        ``value`` is dense (any array or tensor that is not row-sparse), or not an array.
    """
    if isinstance(value, RowSparseArray):
        return value
    layout = _torch_layout(value)
    if layout is not None and layout != "strided":
        return _from_torch(value, name)
    raise StorageTypeError(
        f"{name}: expected a row-sparse value (an akv.RowSparseArray or a torch sparse COO "
        f"tensor), got {_describe(value)}; convert a dense array with "
        "akv.RowSparseArray.from_dense"
    )


def check_dense(value: object, name: str) -> None:
    """Refuse a row-sparse value where a dense one is required.

    ``name`` says what ``value`` is; the message starts with it. Anything else passes (the
    dense checks come later).

    Raises
    ------
    StorageTypeError
        ``value`` is a RowSparseArray or a torch tensor of a sparse layout.
    """
    if isinstance(value, RowSparseArray):
        raise StorageTypeError(
            f"{name}: expected a dense array, got {value!r}; convert it with .to_dense(), "
            "or use a row-sparse key"
        )
    layout = _torch_layout(value)
    if layout is not None and layout != "strided":
        raise StorageTypeError(
            f"{name}: expected a dense array, got a torch tensor of layout torch.{layout} "
            f"and shape {tuple(getattr(value, 'shape', ()))}; convert it with .to_dense(), or "
            "use a row-sparse key"
        )


# ---------------------------------------------------------------- checks shared with rows.py


def check_shape(shape: object, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints: an int, or a sequence of at least one non-negative int.

    Raises
    ------
    InvalidArgumentError
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not shape:
        raise InvalidArgumentError(
            f"{what}: shape must be a non-empty tuple of ints (rows first), got {shape!r}"
        )
    dims = []
    for dim in shape:
        if isinstance(dim, bool):
            raise InvalidArgumentError(f"{what}: shape {shape!r} holds a bool")
        try:
            size = operator.index(dim)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"{what}: shape {shape!r} holds {dim!r}, a {type(dim).__name__}, not an int"
            ) from exc
        if size < 0:
            raise InvalidArgumentError(f"{what}: shape {tuple(shape)} has a negative dimension")
        if size > _INT64_MAX:  # row ids are int64: a row past it could not be named
            raise InvalidArgumentError(
                f"{what}: shape {tuple(shape)} has a dimension past 2**63 - 1, the most "
                "rows int64 row ids can name"
            )
        dims.append(size)
    return tuple(dims)


def check_dtype(dtype: np.dtype, what: str) -> None:
    """Refuse a dtype akv cannot store and send (the dense values' rule: the wire's dtypes).

    Raises
    ------
    UnsupportedDTypeError
    """
    if dtype not in DTYPE_CODES:
        known = ", ".join(str(known) for known in DTYPE_CODES)
        raise UnsupportedDTypeError(
            f"{what}: dtype {dtype} is not one akv stores ({known}); convert the value "
            "first (bfloat16: to float32)"
        )


def check_row_ids(ids: npt.ArrayLike, rows: int | None, what: str) -> RowIds:
    """``ids`` as 1-D int64 row ids, each in ``[0, rows)`` (``rows=None``: any id >= 0 that
    fits in int64). May return a view of ``ids``.

    Raises
    ------
    InvalidArgumentError
        ``ids`` are not 1-D integers (an empty list is fine).
    RowIdError
        An id is out of range; names the first one and its position.
    """
    if hasattr(ids, "__cuda_array_interface__"):
        # On a GPU (CuPy, a torch CUDA tensor), as MXNet takes ids of any context: copied
        # to the host, where rows are looked up (ids are few; the copy waits for the GPU).
        try:
            gpu, _ = read(ids, None, what)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{what}: row ids must be 1-D integers: {exc}") from exc
        ids = to_host(gpu)
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: torch's refusals
        raise InvalidArgumentError(f"{what}: row ids must be 1-D integers: {exc}") from exc
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"{what}: row ids must be 1-D, got an array of shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        if array.size == 0 and array.dtype.kind in "fbO":
            return np.zeros(0, np.int64)
        raise InvalidArgumentError(f"{what}: row ids must be integers, got dtype {array.dtype}")
    if array.size:
        low, high = array.min(), array.max()
        limit = _INT64_MAX + 1 if rows is None else rows
        if low < 0 or high >= limit:
            bad = (array < 0) | (array >= limit)
            position = int(np.argmax(bad))
            bound = f"[0, {rows})" if rows is not None else "[0, 2**63)"
            raise RowIdError(
                f"{what}: row id {array[position]} at position {position} is outside {bound}"
                + (f" (shape[0] is {rows})" if rows is not None else "")
            )
    return array.astype(np.int64, copy=False)


def host_rows(value: object, what: str) -> np.ndarray:
    """``value`` viewed as a NumPy array in host memory (no copy where possible).

    Raises
    ------
    InvalidArgumentError
        Not an array, or a GPU array.
    StorageTypeError
        A sparse torch tensor.
    """
    if type(value) is np.ndarray:
        return value
    layout = _torch_layout(value)
    if layout is not None and layout != "strided":
        raise StorageTypeError(
            f"{what}: expected a dense array, got a torch tensor of layout torch.{layout}"
        )
    try:
        array, _ = read(value, None, what)
    except UnsupportedDTypeError:
        raise
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"{what}: expected a NumPy array or a torch or JAX CPU tensor, got "
            f"{type(value).__name__}"
        ) from exc
    if is_gpu(array):
        raise InvalidArgumentError(
            f"{what} is on a GPU ({type(value).__name__}); row-sparse arrays hold host "
            "(NumPy) memory only: copy it to the host first"
        )
    return np.asarray(array)


def host_tensor(tensor: Any, what: str) -> Any:
    """A torch tensor detached and in host memory: itself on the CPU, a copy from a GPU.

    Raises
    ------
    InvalidArgumentError
        The tensor is on the meta device (it holds no values to copy).
    """
    tensor = tensor.detach()
    if tensor.device.type == "meta":  # no values: torch's .cpu() of it raises, untyped
        raise InvalidArgumentError(
            f"{what}: the torch tensor of shape {tuple(tensor.shape)} is on the meta device, "
            "which holds no values; give one on the CPU or a GPU"
        )
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


# ---------------------------------------------------------------- helpers


def _sorted_rows(ids: RowIds, rows: np.ndarray) -> tuple[RowIds, np.ndarray]:
    """``ids`` sorted and unique, and ``rows`` in that order with repeats summed: new
    arrays, never views of the arguments."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return np.array(ids, np.int64), np.array(rows, order="C")
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    starts = np.empty(ids.size, bool)
    starts[0] = True
    np.not_equal(ids[1:], ids[:-1], out=starts[1:])
    first = np.flatnonzero(starts)
    ordered = rows[order]
    if first.size == ids.size:
        return ids, np.ascontiguousarray(ordered)
    # One pass over the rows in id order: each run of one id summed in the order given.
    summed = np.add.reduceat(ordered, first, axis=0, dtype=rows.dtype)
    return ids[first], np.ascontiguousarray(summed)


def _torch_layout(value: object) -> str | None:
    """The layout name of a torch tensor (``"strided"``, ``"sparse_coo"``...), or None
    when ``value`` is not one (without importing torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    return str(value.layout).removeprefix("torch.")


def _from_torch(tensor: Any, what: str) -> RowSparseArray:
    layout = _torch_layout(tensor)
    if layout is None:
        raise StorageTypeError(
            f"{what}: expected a torch sparse COO tensor, got {_describe(tensor)}"
        )
    if layout != "sparse_coo":
        hint = "; convert it with RowSparseArray.from_dense" if layout == "strided" else ""
        raise StorageTypeError(
            f"{what}: expected a torch sparse COO tensor, got a torch tensor of layout "
            f"torch.{layout} and shape {tuple(tensor.shape)}{hint}"
        )
    sparse_dims = int(tensor.sparse_dim())
    if sparse_dims != 1:
        raise StorageTypeError(
            f"{what}: the sparse COO tensor of shape {tuple(tensor.shape)} has {sparse_dims} "
            "sparse dimensions; a row-sparse value has exactly one (the rows), then dense ones"
        )
    tensor = host_tensor(tensor, what)
    if not tensor.is_coalesced():
        tensor = tensor.coalesce()
    ids = tensor.indices()[0].numpy()
    values = host_rows(tensor.values(), f"{what} values")
    check_dtype(values.dtype, what)
    shape = tuple(tensor.shape)
    # Checked here so that the error names what the tensor is (a push to a key...).
    check_row_ids(ids, shape[0], f"{what}: the coalesced sparse tensor's indices")
    return RowSparseArray(values, ids, shape)


def _describe(value: object) -> str:
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple):
        return f"a dense {name} of shape {tuple(shape)} and dtype {getattr(value, 'dtype', '?')}"
    return f"a {name}"
