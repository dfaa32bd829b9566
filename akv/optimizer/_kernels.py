"""The optimizers' element-wise machinery: kernels run over aligned chunks of a weight, its
gradient and states (:func:`run_chunked`; one fused CUDA kernel on a GPU), per-thread scratch
buffers, and scalar parameters rounded as MXNet's kernels round them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import numpy as np

from akv.arrays import cupy_module, is_cupy
from akv.errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from akv.fused import fused_update

if TYPE_CHECKING:
    from akv.optimizer._base import Index

CHUNK_ELEMENTS = 1 << 17
"""Elements per pass of the element-wise kernels (512 KiB of float32). An update makes
several passes over its arrays (up to a dozen for Adam); made chunk by chunk, the chunks of
the weight, gradient, states and scratch buffers stay in cache between passes instead of
streaming through memory each time. Measured on a 2-core EPYC (1 MiB L2 per core, 32 MiB
L3): for a 64 MiB array chunked passes take about 0.6 of the time of whole-array passes;
64K to 512K elements perform alike, smaller chunks pay per-call overhead."""


_local = threading.local()


def scratch(dtype: np.dtype, count: int) -> list[np.ndarray]:
    """``count`` buffers of :data:`CHUNK_ELEMENTS` elements, owned by the calling thread and
    reused by every update it runs (threads never share them)."""
    cache: dict[np.dtype, list[np.ndarray]] | None = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    buffers = cache.setdefault(np.dtype(dtype), [])
    while len(buffers) < count:
        buffers.append(np.empty(CHUNK_ELEMENTS, dtype))
    return buffers[:count]


def complement(decay: float, dtype: np.dtype) -> float:
    """``1 - decay`` computed in ``dtype``, as MXNet's kernels compute it (``1.f - beta2``).

    For ``beta2 = 0.999`` the float32 result is 1.3e-5 away (relatively) from the exact
    0.001, which moves Adam's steps by about 6e-6 of their size; computing it MXNet's way
    keeps akv's weights within float32 rounding of MXNet's.
    """
    kind = np.dtype(dtype).type
    return float(kind(1.0) - kind(decay))


def product(dtype: np.dtype, *factors: float) -> float:
    """The product of scalar parameters rounded step by step to ``dtype``, as MXNet's kernels
    form ``lr * wd`` from float32 parameters."""
    kind = np.dtype(dtype).type
    result = kind(1.0)
    for factor in factors:
        result = kind(result * kind(factor))
    return float(result)


def zeros_like(weight: np.ndarray) -> np.ndarray:
    """A new C-contiguous zero array with the weight's shape and dtype, where it lives."""
    if isinstance(weight, np.ndarray):
        return np.zeros(weight.shape, weight.dtype)
    gpu = cast(Any, weight)
    with gpu.device:
        return cast(np.ndarray, cupy_module().zeros(gpu.shape, gpu.dtype))


Kernel = Callable[..., None]


def run_chunked(
    kernel: Kernel,
    weight: np.ndarray,
    grad: np.ndarray,
    states: Sequence[np.ndarray],
    num_scratch: int,
) -> None:
    """Call ``kernel(w, g, *states, buffers)`` on aligned 1-D chunks of the arrays.

    The kernel updates ``w`` and the state chunks in place and may use the scratch
    ``buffers`` (of the weight's dtype, as long as the chunk) freely. Arrays that are not
    C-contiguous are processed through contiguous copies that are written back.

    On a GPU (CuPy arrays) the kernel is traced into one fused CUDA kernel
    (:func:`akv.fused.fused_update`: one pass over the arrays, one launch). A kernel that
    cannot be fused runs as one chunk, the whole arrays: its NumPy calls dispatch to CuPy
    (NumPy's ``__array_ufunc__`` and ``__array_function__`` protocols), so the same kernel,
    written once, runs there, with scratch buffers from CuPy's pool.
    """
    on_host = isinstance(weight, np.ndarray)
    if not on_host and fused_update(kernel, weight, grad, states, num_scratch):
        return
    xp: Any = np if on_host else cupy_module()
    with contextlib.nullcontext() if on_host else cast(Any, weight).device:
        for_write = [weight, *states]
        flats = []
        write_back = []
        for array in for_write:
            if array.flags.c_contiguous:
                flats.append(array.reshape(-1))
            else:
                flat = xp.ascontiguousarray(array).reshape(-1)
                flats.append(flat)
                write_back.append((array, flat))
        flat_grad = xp.ascontiguousarray(grad).reshape(-1)
        size = flat_grad.size
        if on_host:
            buffers, chunks = scratch(weight.dtype, num_scratch), chunk_slices(size)
        else:
            buffers = [xp.empty(size, weight.dtype) for _ in range(num_scratch)]
            chunks = iter([slice(0, size)])
        for chunk in chunks:
            length = chunk.stop - chunk.start
            kernel(
                flats[0][chunk],
                flat_grad[chunk],
                *(flat[chunk] for flat in flats[1:]),
                [buffer[:length] for buffer in buffers],
            )
        for array, flat in write_back:
            xp.copyto(array, flat.reshape(array.shape))


def chunk_slices(size: int) -> Iterator[slice]:
    """Consecutive slices of at most :data:`CHUNK_ELEMENTS` covering ``range(size)``."""
    for start in range(0, size, CHUNK_ELEMENTS):
        yield slice(start, min(size, start + CHUNK_ELEMENTS))


def rescaled_clipped(
    grad: np.ndarray, out: np.ndarray, rescale_grad: float, clip_gradient: float | None
) -> np.ndarray:
    """``clip(rescale_grad * grad, clip_gradient)`` in ``out``, or ``grad`` itself when that
    is the identity (the result is then only to be read)."""
    if rescale_grad != 1.0:
        np.multiply(grad, rescale_grad, out=out)
        grad = out
    if clip_gradient:
        np.clip(grad, -clip_gradient, clip_gradient, out=out)
        grad = out
    return grad


def rows_fit(
    count: int,
    table: np.ndarray,
    slots: np.ndarray,
    grad: np.ndarray,
    states: Sequence[tuple[np.ndarray, np.ndarray]],
) -> bool:
    """Whether a compiled row update (:mod:`akv.jit`) can take these arrays: ``count``
    states, the table, gradient and state rows 2-D C-contiguous host arrays of the table's
    dtype and width (the table writable), the slots int64, one gradient row per slot."""
    if len(states) != count:
        return False
    width = table.shape[1] if table.ndim == 2 else -1
    for array in [table, grad, *(rows for rows, _ in states)]:
        if not (
            isinstance(array, np.ndarray)
            and array.ndim == 2
            and array.shape[1] == width
            and array.dtype == table.dtype
            and array.flags.c_contiguous
        ):
            return False
    for ids in [slots, *(state_slots for _, state_slots in states)]:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.shape != slots.shape:
            return False
    return grad.shape[0] == slots.size and bool(table.flags.writeable)


def is_array(value: object) -> TypeGuard[np.ndarray]:
    """Whether ``value`` is a NumPy array, or a CuPy array (typed as NumPy's: CuPy has no
    stubs, and the optimizers use only what both have)."""
    return isinstance(value, np.ndarray) or is_cupy(value)


def check_update_arrays(index: Index, weight: object, grad: object) -> np.ndarray:
    """Check a weight and its gradient; return the gradient as an array.

    The weight is a NumPy array, or a CuPy array whose gradient is on the same GPU.
    """
    if not is_array(weight):
        raise InvalidArgumentError(
            f"update of index {index!r}: the weight must be a numpy.ndarray (or a "
            f"cupy.ndarray), got {type(weight).__name__}"
        )
    if weight.dtype.kind != "f":
        raise InvalidArgumentError(
            f"update of index {index!r}: akv's optimizers update float16, float32 and "
            f"float64 weights, got {weight.dtype}"
        )
    if isinstance(weight, np.ndarray):
        if not weight.flags.writeable:
            raise InvalidArgumentError(f"update of index {index!r}: the weight is read-only")
        grad = np.asarray(grad)
    elif not is_cupy(grad) or cast(Any, grad).device != cast(Any, weight).device:
        raise InvalidArgumentError(
            f"update of index {index!r}: the weight is on GPU {cast(Any, weight).device.id}, "
            f"and its gradient must be a cupy.ndarray there too, got {type(grad).__name__}"
        )
    assert is_array(grad)
    if grad.shape != weight.shape:
        raise ShapeMismatchError(
            f"update of index {index!r}: gradient shape {grad.shape} does not match the "
            f"weight shape {weight.shape}",
            key=index,
            expected=weight.shape,
            got=grad.shape,
        )
    if grad.dtype != weight.dtype:
        raise DTypeMismatchError(
            f"update of index {index!r}: gradient dtype {grad.dtype} does not match the "
            f"weight dtype {weight.dtype}",
            key=index,
            expected=weight.dtype,
            got=grad.dtype,
        )
    return grad
