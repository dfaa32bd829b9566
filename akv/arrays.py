"""Arrays of every library akv takes (NumPy, CuPy, PyTorch, JAX), seen as NumPy or CuPy arrays.

A store reads and writes only two kinds of array: ``numpy.ndarray`` for values in host
memory and ``cupy.ndarray`` for values on a GPU. This module turns what callers pass into
one of them, as views of the caller's memory wherever the library allows it:

* NumPy and CuPy arrays are used as they are.
* PyTorch tensors are read through ``detach()`` (a Parameter, or a tensor that requires
  grad, needs no ceremony): a CPU tensor becomes a NumPy view of its storage, strides and
  all; a CUDA tensor becomes a CuPy view through DLPack. bfloat16 CPU tensors are viewed as
  ``ml_dtypes.bfloat16`` NumPy arrays (no copy) when ``ml_dtypes`` is installed.
* JAX arrays are read as NumPy views (CPU) or through DLPack (GPU). They are immutable, so
  they cannot be pull outputs.
* Anything else with ``__dlpack__``, ``__array__``, ``__array_interface__`` or the buffer
  protocol is viewed by NumPy (or by CuPy when DLPack says it lives on a GPU).

Which library a key's first value came from is its :class:`Origin`: a pull without ``out``
returns an array of that kind (a tensor on the same device for a torch key, a JAX array for
a JAX key). Framework modules are looked up in ``sys.modules``: a value can only be a torch
tensor if torch was imported, so akv never imports torch, JAX or CuPy to look at a NumPy
array.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from akv.errors import (
    AKVError,
    GPUUnavailableError,
    ImmutableOutputError,
    InvalidArgumentError,
    UnsupportedDTypeError,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "NUMPY",
    "Array",
    "Origin",
    "bfloat16",
    "copy_into",
    "cupy_module",
    "device_of",
    "finisher",
    "has_gpu",
    "is_cupy",
    "is_gpu",
    "is_pinned",
    "pinned_empty",
    "read",
    "record_on_callers",
    "to_host",
    "write_view",
]

#: A NumPy array, or a CuPy array on a GPU (no type stubs exist for CuPy).
Array = Any

# DLPack device types (dlpack.h: kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)

_REFUSED = (list, tuple, dict, str, bytes, int, float, complex, bool)
_NUMBERS = (int, float, complex, bool)


def cupy_module() -> Any:
    """The ``cupy`` module, or None when it is not installed (imported on first use)."""
    module = sys.modules.get("cupy")
    if module is not None:
        return module
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


def _require_cupy(key: object, what: str) -> Any:
    cupy = cupy_module()
    if cupy is None:
        raise GPUUnavailableError(
            f"{what} for key {key!r} is on a GPU, and CuPy is not installed: "
            "pip install 'akvstore[gpu]' (or move it to the CPU first)"
        )
    return cupy


#: The arrays :func:`pinned_empty` made, by id, while they live.
_pinned: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def pinned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A NumPy array in page-locked host memory (copies to and from a GPU run at full speed
    and asynchronously); needs CuPy."""
    import cupyx

    array = cast(np.ndarray, cupyx.empty_pinned(shape, dtype))
    _pinned[id(array)] = array
    return array


def is_pinned(array: object) -> bool:
    """Whether ``array`` is one that :func:`pinned_empty` made (not a view of one)."""
    return _pinned.get(id(array)) is array


def bfloat16(key: object, what: str) -> np.dtype:
    """NumPy's bfloat16 dtype (from ``ml_dtypes``).

    Raises
    ------
    UnsupportedDTypeError
        ``ml_dtypes`` is not installed.
    """
    try:
        import ml_dtypes
    except ImportError as exc:
        raise UnsupportedDTypeError(
            f"{what} for key {key!r} is bfloat16, which NumPy holds only with ml_dtypes: "
            "pip install 'akvstore[torch]' (or ml_dtypes), or convert it to float32 first"
        ) from exc
    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


def check_numeric(dtype: np.dtype, key: object, what: str) -> None:
    """Refuse a dtype no store can sum or update (strings, objects, dates, records), in
    every store alike (a distributed one could not send it either).

    Raises
    ------
    UnsupportedDTypeError
    """
    if dtype.kind in "biufc" or dtype.name == "bfloat16":
        return
    if dtype.type.__module__.startswith("ml_dtypes") and dtype.name.startswith("float"):
        return  # (ml_dtypes' float8 types...)
    raise UnsupportedDTypeError(
        f"{what} for key {key!r}: dtype {dtype} is not a number type, which a store sums "
        "and updates; convert the value to one first"
    )


def is_cupy(value: object) -> bool:
    """Whether ``value`` is a CuPy array (without importing CuPy)."""
    return _framework(value, "cupy", "ndarray")


def is_gpu(array: Array) -> bool:
    """Whether ``array`` (as returned by :func:`read`) lives on a GPU."""
    return type(array) is not np.ndarray and not isinstance(array, np.ndarray)


def has_gpu(items: Iterable[tuple[Any, Sequence[Array]]]) -> bool:
    """Whether any array of ``items`` (``(key or entry, arrays)`` pairs) is on a GPU; one
    type check per NumPy array."""
    return any(type(a) is not np.ndarray and is_gpu(a) for _, arrays in items for a in arrays)


def device_of(array: Array) -> int | None:
    """The GPU ``array`` lives on, or None for host memory."""
    if not is_gpu(array):
        return None
    return int(array.device.id)


def to_host(array: Array) -> np.ndarray:
    """``array`` in host memory: itself when it is there, else a copy (synchronous)."""
    if not is_gpu(array):
        return cast(np.ndarray, array)
    return cast(np.ndarray, array.get())


def copy_into(dst: Array, src: Array, after: Sequence[Any] = ()) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype), wherever each of them lives.

    Host to host is ``np.copyto``; between a GPU and the host CuPy copies (synchronously,
    for pageable host memory); GPU to GPU is a copy on the current stream of ``dst``'s device.
    A GPU ``dst`` is written after the events ``after`` (see :func:`record_on_callers`).
    """
    if type(dst) is np.ndarray and type(src) is np.ndarray:
        np.copyto(dst, src)
        return
    if not is_gpu(dst):
        if is_gpu(src):
            np.copyto(dst, src.get())
        else:
            np.copyto(dst, src)
        return
    cupy = cupy_module()
    with cupy.cuda.Device(dst.device.id):
        for event in after:
            cupy.cuda.get_current_stream().wait_event(event)
        if not is_gpu(src):
            if dst.flags.c_contiguous:
                dst.set(np.ascontiguousarray(src))
            else:
                cupy.copyto(dst, cupy.asarray(src))
            # From pageable memory the copy call returns once the source is staged, not
            # once ``dst`` is written: wait, so that the copy is done when this returns.
            cupy.cuda.get_current_stream().synchronize()
        else:
            cupy.copyto(dst, src)


def record_on_callers(arrays: Iterable[Array]) -> list[Any]:
    """Events recorded now on the calling thread's current stream of each GPU that ``arrays``
    live on. A task that writes the arrays (pull outputs) waits for them (``ctx.after``): it
    writes after the work the caller queued on them before the call (a fill, a kernel that
    still reads them, the reuse of freed memory by CuPy's pool)."""
    cupy = cupy_module()
    events: dict[int, Any] = {}
    for array in arrays:
        device = device_of(array)
        if device is not None and device not in events:
            with cupy.cuda.Device(device):
                events[device] = event = cupy.cuda.Event(disable_timing=True)
                event.record()
    return list(events.values())


class Origin:
    """The library (and device) a key's first value came from.

    :meth:`new` makes a pull output of that kind: the object handed to the caller and a
    writable NumPy or CuPy view of it for the store to fill. :meth:`finish` turns the filled
    object into what the caller gets (only JAX needs this: its arrays are immutable, so the
    store fills a NumPy array and makes the JAX array from it).
    """

    name = "numpy"
    needs_finish = False

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, Array]:
        """An uninitialized output and its writable view."""
        array = np.empty(shape, dtype)
        return array, array

    def finish(self, filled: object) -> object:
        """What the caller gets for the filled output."""
        return filled

    def __repr__(self) -> str:
        return f"<Origin {self.name}>"


#: NumPy arrays, and everything viewed through ``__array__`` or the buffer protocol.
NUMPY = Origin()


class _CupyOrigin(Origin):
    name = "cupy"

    def __init__(self, device: int) -> None:
        self.device = device

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, Array]:
        cupy = cupy_module()
        with cupy.cuda.Device(self.device):
            array = cupy.empty(shape, dtype)
        return array, array


class _TorchOrigin(Origin):
    name = "torch"

    def __init__(self, device: Any) -> None:
        self.device = device

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, Array]:
        torch = sys.modules["torch"]
        if self.device.type == "cpu":
            if dtype.name == "bfloat16":
                raw = np.empty(shape, np.int16)
                return torch.from_numpy(raw).view(torch.bfloat16), raw.view(dtype)
            array = np.empty(shape, dtype)
            return torch.from_numpy(array), array
        probe = torch.from_numpy(np.empty(0, dtype))  # NumPy's dtype, in torch's names
        tensor = torch.empty(shape, dtype=probe.dtype, device=self.device)
        return tensor, cupy_module().from_dlpack(tensor)


class _JaxOrigin(Origin):
    name = "jax"
    needs_finish = True

    def __init__(self, device: Any) -> None:
        self.device = device

    def finish(self, filled: object) -> object:
        jax = sys.modules["jax"]
        return jax.device_put(filled, self.device)


def _framework(value: object, name: str, attribute: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and isinstance(value, getattr(module, attribute))


def _torch_view(tensor: Any, key: object, what: str) -> tuple[Array, Origin]:
    """A view of a torch tensor's storage: NumPy for CPU, CuPy for CUDA."""
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        # A lazily conjugated or negated view: its storage does not hold its values.
        tensor = tensor.resolve_conj().resolve_neg()
    torch = sys.modules["torch"]
    try:
        if tensor.device.type == "cpu":
            if tensor.dtype is torch.bfloat16:
                array = tensor.view(torch.int16).numpy().view(bfloat16(key, what))
            else:
                array = tensor.numpy()
        elif tensor.device.type == "cuda":
            if tensor.dtype is torch.bfloat16:
                raise UnsupportedDTypeError(
                    f"{what} for key {key!r} is a bfloat16 CUDA tensor, and CuPy has no "
                    "bfloat16: convert it to float32 or float16 first, or use a CPU tensor"
                )
            array = _require_cupy(key, what).from_dlpack(tensor)
        else:
            raise InvalidArgumentError(
                f"{what} for key {key!r}: torch tensors on {tensor.device} are not supported "
                "(only CPU and CUDA)"
            )
    except AKVError:
        raise
    except (TypeError, RuntimeError, BufferError) as exc:
        raise InvalidArgumentError(
            f"{what} for key {key!r}: cannot view a {tensor.dtype} torch tensor on "
            f"{tensor.device} as an array: {exc}"
        ) from exc
    return array, _TorchOrigin(tensor.device)


def _jax_view(value: Any, key: object, what: str) -> tuple[Array, Origin]:
    device = next(iter(value.devices()))
    if value.__dlpack_device__()[0] in _DLPACK_CUDA:
        if value.dtype.name == "bfloat16":
            raise UnsupportedDTypeError(
                f"{what} for key {key!r} is a bfloat16 JAX array on a GPU, and CuPy has no "
                "bfloat16: convert it to float32 or float16 first"
            )
        return _require_cupy(key, what).from_dlpack(value), _JaxOrigin(device)
    return np.asarray(value), _JaxOrigin(device)


def read(value: object, key: object, what: str) -> tuple[Array, Origin]:
    """View ``value`` as a NumPy or CuPy array (no copy where the library allows it).

    Returns the view and the value's :class:`Origin`. The view may be read-only and may be
    strided; it must not be kept past the call that received it (the store copies).

    Raises
    ------
    InvalidArgumentError
        ``value`` is not an array (a list, a number, None...) or cannot be viewed as one.
    UnsupportedDTypeError
        bfloat16 where it cannot be held (see :func:`bfloat16`).
    GPUUnavailableError
        A GPU array without CuPy installed.
    """
    if type(value) is np.ndarray:
        return value, NUMPY
    if isinstance(value, np.ndarray):
        return np.asarray(value), NUMPY
    if isinstance(value, _NUMBERS):
        raise InvalidArgumentError(
            f"{what} for key {key!r}: expected an array, got {type(value).__name__} "
            f"{value!r}: pass an array (np.asarray(...))"
        )
    if isinstance(value, _REFUSED) or value is None:
        raise InvalidArgumentError(
            f"{what} for key {key!r}: expected an array, got {type(value).__name__}"
        )
    if _framework(value, "torch", "Tensor"):
        return _torch_view(value, key, what)
    if _framework(value, "jax", "Array"):
        return _jax_view(value, key, what)
    if _framework(value, "cupy", "ndarray"):
        return value, _CupyOrigin(int(cast(Any, value).device.id))
    try:
        dlpack_device = getattr(value, "__dlpack_device__", None)
        if dlpack_device is not None and dlpack_device()[0] in _DLPACK_CUDA:
            array = _require_cupy(key, what).from_dlpack(value)
            return array, _CupyOrigin(int(array.device.id))
        if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
            return np.asarray(value), NUMPY
        if hasattr(value, "__dlpack__"):
            return np.from_dlpack(value), NUMPY
        # Only trying tells whether it exports a buffer: memoryview raises TypeError if not.
        return np.asarray(memoryview(cast("Buffer", value))), NUMPY
    except AKVError:
        raise
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"{what} for key {key!r}: cannot view {type(value).__name__} as an array: {exc}"
        ) from exc


def write_view(out: object, key: object) -> Array:
    """A writable NumPy or CuPy view that shares ``out``'s memory (a pull writes into it).

    A torch tensor keeps its storage (``data_ptr()`` unchanged), also a Parameter that
    requires grad and a non-contiguous one.

    Raises
    ------
    ImmutableOutputError
        ``out`` is a JAX array.
    InvalidArgumentError
        ``out`` is not an array, or is read-only.
    """
    if type(out) is np.ndarray:
        array: Array = out
    elif _framework(out, "jax", "Array"):
        raise ImmutableOutputError(
            f"pull output for key {key!r} is a JAX array, and JAX arrays are immutable: "
            "pull without out= to get a new JAX array, or pass a NumPy array or torch tensor"
        )
    else:
        if _framework(out, "torch", "Tensor") and (
            cast(Any, out).is_conj() or cast(Any, out).is_neg()
        ):
            # Its storage does not hold its values: a view of it would be a copy.
            raise InvalidArgumentError(
                f"pull output for key {key!r} is a lazily conjugated or negated torch view, "
                "whose storage does not hold its values: pull into the tensor it views, or "
                "into out.resolve_conj() (a copy), and copy from there"
            )
        array = read(out, key, "pull output")[0]
    if not is_gpu(array) and not array.flags.writeable:
        raise InvalidArgumentError(
            f"pull output for key {key!r} is read-only ({type(out).__name__}); "
            "pass a writable array"
        )
    if not array.flags.c_contiguous and any(
        step == 0 and size > 1 for step, size in zip(array.strides, array.shape, strict=True)
    ):
        raise InvalidArgumentError(
            f"pull output for key {key!r} has elements that share memory (a stride of 0: an "
            f"expanded or broadcast view, shape {tuple(array.shape)}, strides "
            f"{tuple(array.strides)}): pull into an array with one place per element"
        )
    return array


def finisher(origins: list[Origin], one: bool) -> Callable[[object], object] | None:
    """What turns a pull's filled outputs (``one`` output, or a list as long as ``origins``)
    into what the caller gets, or None when they are given as they are."""
    if not any(origin.needs_finish for origin in origins):
        return None
    if one:
        return origins[0].finish

    def finish(outputs: object) -> object:
        return [
            origin.finish(output)
            for origin, output in zip(origins, cast(list[object], outputs), strict=True)
        ]

    return finish
