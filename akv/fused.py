"""One pass over GPU memory per reduce and per optimizer update: CuPy ``ElementwiseKernel`` s.

A sum of N GPU arrays written as N - 1 calls of ``cupy.add`` reads the running sum back from
memory N - 2 times; an optimizer's update written as NumPy calls (``np.multiply(g, lr,
out=buffer)``...) makes a dozen passes over the weight, the gradient, the states and scratch
buffers. Memory bandwidth bounds both, so this module turns each into one kernel that reads
every input once and writes every output once:

* :func:`sum_into` sums up to :data:`MAX_SUM_ARITY` arrays in one kernel (more in one kernel
  per :data:`MAX_SUM_ARITY` - 1 further arrays), adding left to right as NumPy's sequence of
  adds does, so the sums are the same numbers.
* :func:`fused_update` *traces* an optimizer's element-wise kernel (the NumPy function that
  :func:`akv.optimizer._kernels.run_chunked` calls) by running it once on stand-in arrays that
  record each NumPy call, and generates the CUDA statements doing the same operations in the
  same order, one per element: the update as one kernel launch. Each statement rounds to
  the weight's dtype as the NumPy call does (a GPU may contract a multiply and an add into
  one rounding: the results then agree within float32 rounding, not bit for bit). Scalars
  (learning rate, decay...) become kernel arguments, so one compiled kernel serves every
  step; kernels are cached by their source.

A kernel that does anything other than element-wise arithmetic on its arrays (a norm, a
branch on values, an operation not listed in :data:`_UFUNCS`) cannot be traced:
:func:`fused_update` then returns False and the caller runs the NumPy calls as before.
Only float32 and float64 weights are fused (CuPy's float16 arithmetic is not NumPy's).

Nothing here imports CuPy at import time; the kernels are made on first use.
"""

from __future__ import annotations

import numbers
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from akv.arrays import Array, cupy_module

__all__ = [
    "FUSED_DTYPES",
    "MAX_SUM_ARITY",
    "PREAMBLE",
    "FusedKernel",
    "Untraceable",
    "fused_update",
    "sum_into",
    "trace_update",
]

#: The most arrays one sum kernel reads (more are summed by further kernels, each reading
#: the partial sum once more).
MAX_SUM_ARITY = 8

#: The weight dtypes whose updates are fused.
FUSED_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})

#: The device functions generated kernels call, with NumPy's meaning (NaN propagates through
#: ``akv_max``/``akv_min``/``akv_clip`` as through ``np.maximum``/``np.minimum``/``np.clip``).
PREAMBLE = r"""
template <typename T> __device__ T akv_sqrt(T x) { return sqrt(x); }
template <typename T> __device__ T akv_abs(T x) { return fabs(x); }
template <typename T> __device__ T akv_sign(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x);
}
template <typename T> __device__ T akv_clip(T x, T low, T high) {
  return x < low ? low : (x > high ? high : x);
}
template <typename T> __device__ T akv_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> __device__ T akv_min(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> __device__ T akv_gt(T a, T b) { return a > b ? T(1) : T(0); }
"""


class Untraceable(Exception):
    """Raised inside a traced kernel at an operation that has no fused form."""


# ------------------------------------------------------------------------------ kernels

_lock = threading.Lock()
_kernels: dict[tuple[str, str, str], Any] = {}


def _elementwise(in_params: str, out_params: str, body: str, prefix: str) -> Any:
    """The cached ``cupy.ElementwiseKernel`` with these parameters and body."""
    key = (in_params, out_params, body)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                name = f"{prefix}_{zlib.crc32(body.encode()):08x}"
                kernel = cupy_module().ElementwiseKernel(
                    in_params, out_params, body, name, preamble=PREAMBLE
                )
                _kernels[key] = kernel
    return kernel


def sum_into(buffer: Array, arrays: Sequence[Array]) -> Array:
    """Write the sum of ``arrays`` into ``buffer``, all CuPy arrays of one shape and dtype
    on ``buffer``'s GPU, on the current stream there; return ``buffer``.

    One kernel reads up to :data:`MAX_SUM_ARITY` arrays and writes the sum once (one value:
    a copy). The additions go left to right, as ``np.add(a0, a1)`` then ``np.add(sum, a2)``
    do, so the result is the same number.
    """
    cupy = cupy_module()
    with buffer.device:
        if len(arrays) == 1:
            cupy.copyto(buffer, arrays[0])
            return buffer
        first = list(arrays[:MAX_SUM_ARITY])
        _sum_kernel(len(first), accumulate=False)(*first, buffer)
        rest = list(arrays[MAX_SUM_ARITY:])
        while rest:
            group, rest = rest[: MAX_SUM_ARITY - 1], rest[MAX_SUM_ARITY - 1 :]
            _sum_kernel(len(group), accumulate=True)(*group, buffer)
    return buffer


def _sum_kernel(arity: int, accumulate: bool) -> Any:
    names = [f"a{i}" for i in range(arity)]
    terms = ["total", *names] if accumulate else names
    body = f"total = {' + '.join(terms)}"
    return _elementwise(", ".join(f"T {n}" for n in names), "T total", body, f"akv_sum{arity}")


# ------------------------------------------------------------------------------ tracing

#: NumPy ufuncs a traced kernel may call, as C expressions of their operands.
_UFUNCS: dict[Any, str] = {
    np.add: "{0} + {1}",
    np.subtract: "{0} - {1}",
    np.multiply: "{0} * {1}",
    np.divide: "{0} / {1}",
    np.negative: "-{0}",
    np.square: "{0} * {0}",
    np.sqrt: "akv_sqrt({0})",
    np.absolute: "akv_abs({0})",
    np.sign: "akv_sign({0})",
    np.maximum: "akv_max({0}, {1})",
    np.minimum: "akv_min({0}, {1})",
    np.greater: "akv_gt({0}, {1})",
}
#: Ufuncs whose result is a truth value: only into a float array (``out=``), as 0 or 1.
_PREDICATES = frozenset({np.greater})


class _Traced(np.lib.mixins.NDArrayOperatorsMixin):
    """A stand-in array: NumPy calls on it are recorded by its trace, nothing is computed."""

    __slots__ = ("name", "trace", "writable")

    def __init__(self, trace: _Trace, name: str, writable: bool) -> None:
        self.trace = trace
        self.name = name
        self.writable = writable

    dtype = property(lambda self: self.trace.dtype)
    shape = property(lambda self: self.trace.shape)
    ndim = property(lambda self: len(self.trace.shape))
    size = property(lambda self: int(np.prod(self.trace.shape, dtype=np.int64)))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.pop("out", None)
        if (
            method != "__call__"
            or ufunc not in _UFUNCS
            or any(value is not None for key, value in kwargs.items() if key != "casting")
        ):
            _refuse(f"np.{ufunc.__name__}.{method} with {sorted(kwargs)}")
        if isinstance(out, tuple):
            out = out[0] if len(out) == 1 else _refuse("several outputs")
        return self.trace.ufunc(ufunc, inputs, out)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return self.trace.function(func, args, kwargs)

    def __array__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("a conversion to a NumPy array")

    def __bool__(self) -> bool:
        _refuse("a branch on array values")

    def __float__(self) -> float:
        _refuse("a conversion to a number")

    def __getitem__(self, key: object) -> NoReturn:
        _refuse("indexing")

    def __len__(self) -> int:
        _refuse("len()")

    def reshape(self, *shape: object) -> NoReturn:
        _refuse("reshape")


def _refuse(what: str) -> NoReturn:
    raise Untraceable(f"{what} has no fused form")


class _Trace:
    """The statements recorded while a kernel runs on :class:`_Traced` arrays."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape
        self.statements: list[str] = []
        self.scalars: list[tuple[str, Any]] = []  # (C type, value) per scalar argument
        self.temps = 0

    def operand(self, value: Any) -> str:
        if isinstance(value, _Traced):
            if value.trace is not self:
                _refuse("an array of another trace")
            return value.name
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            _refuse(f"an operand of type {type(value).__name__}")
        name = f"p{len(self.scalars)}"
        # A Python number takes the array's dtype (NumPy's weak scalars); a NumPy scalar
        # keeps its own, as NumPy computes with it.
        kind = "T" if not isinstance(value, np.generic) or value.dtype == self.dtype else None
        self.scalars.append((kind or np.dtype(type(value)).name, value))
        return name

    def assign(self, out: Any, expression: str) -> _Traced:
        if out is None:
            name = f"t{self.temps}"
            self.temps += 1
            self.statements.append(f"T {name} = {expression}")
            return _Traced(self, name, True)
        if not isinstance(out, _Traced) or out.trace is not self or not out.writable:
            _refuse("an output that is not one of the kernel's writable arrays")
        self.statements.append(f"{out.name} = {expression}")
        return out

    def ufunc(self, ufunc: Any, inputs: tuple[Any, ...], out: Any) -> _Traced:
        if ufunc in _PREDICATES and out is None:
            _refuse("a truth-valued result")
        operands = [self.operand(value) for value in inputs]
        return self.assign(out, _UFUNCS[ufunc].format(*operands))

    def function(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is np.copyto and len(args) == 2 and kwargs.get("where", True) is True:
            return self.assign(args[0], self.operand(args[1]))
        if func is np.clip and len(args) == 3 and set(kwargs) <= {"out"}:
            value, low, high = (self.operand(arg) for arg in args)
            return self.assign(kwargs.get("out"), f"akv_clip({value}, {low}, {high})")
        _refuse(f"np.{getattr(func, '__name__', func)}")


class FusedKernel:
    """A traced update: the kernel's parameters and body, and the scalars of this call."""

    def __init__(self, trace: _Trace, num_states: int, num_scratch: int) -> None:
        scalars = ", ".join(f"{kind} p{i}" for i, (kind, _) in enumerate(trace.scalars))
        self.in_params = "T g" + (f", {scalars}" if scalars else "")
        self.out_params = ", ".join(["T w", *(f"T m{i}" for i in range(num_states))])
        declarations = [f"T b{i} = 0" for i in range(num_scratch)]
        self.body = ";\n".join([*declarations, *trace.statements]) + ";"
        self.scalars = [value for _, value in trace.scalars]
        self._kinds = [kind for kind, _ in trace.scalars]

    def arguments(self, dtype: np.dtype) -> list[Any]:
        """The scalar arguments, each as a NumPy scalar of its parameter's type."""
        return [
            (dtype.type if kind == "T" else np.dtype(kind).type)(value)
            for kind, value in zip(self._kinds, self.scalars, strict=True)
        ]


def trace_update(
    kernel: Callable[..., None],
    dtype: np.dtype,
    shape: tuple[int, ...],
    num_states: int,
    num_scratch: int,
) -> FusedKernel:
    """Trace ``kernel(w, g, *states, buffers)`` (``run_chunked``'s calling convention).

    Raises
    ------
    Untraceable
        The kernel does something that has no fused form.
    """
    trace = _Trace(np.dtype(dtype), shape)
    weight = _Traced(trace, "w", True)
    grad = _Traced(trace, "g", False)
    states = [_Traced(trace, f"m{i}", True) for i in range(num_states)]
    buffers = [_Traced(trace, f"b{i}", True) for i in range(num_scratch)]
    kernel(weight, grad, *states, buffers)
    return FusedKernel(trace, num_states, num_scratch)


def fused_update(
    kernel: Callable[..., None],
    weight: Array,
    grad: Array,
    states: Sequence[Array],
    num_scratch: int,
) -> bool:
    """Run ``kernel``'s update of the CuPy arrays ``weight`` and ``states`` as one kernel
    launch on the current stream of ``weight``'s GPU; False (and nothing done) when it
    cannot be fused: a dtype not in :data:`FUSED_DTYPES`, arrays of different shapes or
    dtypes, or a kernel that cannot be traced."""
    dtype = weight.dtype
    if dtype not in FUSED_DTYPES or grad.dtype != dtype or grad.shape != weight.shape:
        return False
    if any(s.dtype != dtype or s.shape != weight.shape for s in states):
        return False
    try:
        fused = trace_update(kernel, dtype, weight.shape, len(states), num_scratch)
    except Untraceable:
        return False
    elementwise = _elementwise(fused.in_params, fused.out_params, fused.body, "akv_update")
    with weight.device:
        elementwise(grad, *fused.arguments(dtype), weight, *states)
    return True
