"""``cupy.ElementwiseKernel`` for the fake CuPy (``tests/fakecupy.py``): the operation runs
with NumPy, as a kernel queued on the current stream.

What it runs is a small subset of CUDA C, the one akv's kernels are written in
(``akv/fused.py``): statements separated by ``;``, each a declaration ``T name = expr`` or
an assignment ``name = expr`` (also ``+=``, ``-=``, ``*=``, ``/=``), where an expression uses
names, integer literals, ``+ - * /``, comparisons, parentheses and calls of the device
functions in :data:`DEVICE_FUNCTIONS`. Anything else raises ``NotImplementedError`` when the
kernel is made, so a kernel the fake cannot run never passes a test by accident.

Every assignment converts to the target's type, as C does; scalars passed for typed
parameters become NumPy scalars of that type. So a kernel computes, element by element, with
NumPy's rounding of each operation in the declared types: the same numbers as a sequence of
whole-array NumPy calls in the same order (a GPU may differ by the rounding of fused
multiply-adds).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from tests import fakecupy as _fake

__all__ = ["DEVICE_FUNCTIONS", "ElementwiseKernel"]

#: The device functions a fake kernel may call: CUDA's, and those of akv's preamble
#: (``akv.fused.PREAMBLE``), with NumPy's meaning (a test checks that the fake knows all of
#: the preamble's).
DEVICE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": np.sqrt,
    "fabs": np.abs,
    "akv_sqrt": np.sqrt,
    "akv_abs": np.abs,
    "akv_sign": np.sign,
    "akv_clip": np.clip,
    "akv_max": np.maximum,
    "akv_min": np.minimum,
    "akv_gt": np.greater,
}

_CONCRETE = {
    "bool": np.bool_,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "float": np.float32,
    "double": np.float64,
}
_NAME = r"[A-Za-z_]\w*"
_DECLARATION = re.compile(rf"^(?P<type>{_NAME})\s+(?P<name>{_NAME})\s*=\s*(?P<expr>.+)$", re.S)
_ASSIGNMENT = re.compile(rf"^(?P<name>{_NAME})\s*(?P<op>[-+*/]?)=\s*(?P<expr>[^=].*)$", re.S)
_EXPRESSION = re.compile(r"^[\w\s+\-*/(),<>=!.]*$")


def _parameters(text: str) -> list[tuple[str, str]]:
    """``"T a, float32 b"`` as ``[("T", "a"), ("float32", "b")]``."""
    params = []
    for part in text.split(","):
        words = part.split()
        if not words:
            continue
        if words[0] == "raw" or len(words) != 2:
            raise NotImplementedError(f"fake ElementwiseKernel: parameter {part.strip()!r}")
        params.append((words[0], words[1]))
    return params


class ElementwiseKernel:
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name, ...)`` (see the
    module docstring for what ``operation`` may hold)."""

    def __init__(
        self,
        in_params: str,
        out_params: str,
        operation: str,
        name: str = "kernel",
        reduce_dims: bool = True,
        preamble: str = "",
        no_return: bool = False,
        return_tuple: bool = False,
        **kwargs: Any,
    ) -> None:
        self.in_params = _parameters(in_params)
        self.out_params = _parameters(out_params)
        self.operation = operation
        self.name = name
        self.preamble = preamble
        self.no_return = no_return
        self.return_tuple = return_tuple
        declared = {name: kind for kind, name in (*self.in_params, *self.out_params)}
        self._types = dict(declared)
        self._program = compile(self._translate(declared), f"<fake kernel {name}>", "exec")

    def _translate(self, declared: dict[str, str]) -> str:
        lines = []
        for statement in self.operation.split(";"):
            statement = statement.strip()
            if not statement:
                continue
            declaration = _DECLARATION.match(statement)
            if declaration is not None and declaration["type"] not in declared:
                kind, name, expr, op = (
                    declaration["type"],
                    declaration["name"],
                    declaration["expr"],
                    "",
                )
                if kind not in _CONCRETE and kind not in declared.values():
                    raise NotImplementedError(f"fake ElementwiseKernel: type {kind!r}")
                declared[name] = kind
            else:
                assignment = _ASSIGNMENT.match(statement)
                if assignment is None or assignment["name"] not in declared:
                    raise NotImplementedError(
                        f"fake ElementwiseKernel {self.name}: cannot run {statement!r}"
                    )
                name, op, expr = assignment["name"], assignment["op"], assignment["expr"]
            if not _EXPRESSION.match(expr) or "?" in expr:
                raise NotImplementedError(
                    f"fake ElementwiseKernel {self.name}: cannot run {statement!r}"
                )
            for word in re.findall(_NAME, expr):
                if word not in declared and word not in DEVICE_FUNCTIONS:
                    raise NotImplementedError(
                        f"fake ElementwiseKernel {self.name}: unknown name {word!r}"
                    )
            value = f"{name} {op} ({expr})" if op else f"({expr})"
            lines.append(f"{name} = _cast({declared[name]!r}, {value})")
        self._types = declared
        return "\n".join(lines)

    def __call__(self, *args: Any, size: int | None = None, **kwargs: Any) -> Any:
        _fake._api()
        if kwargs:
            raise NotImplementedError(f"fake ElementwiseKernel: options {sorted(kwargs)}")
        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"Wrong number of arguments for {self.name!r}")
        for arg in args:
            if isinstance(arg, np.ndarray):
                raise TypeError(f"Unsupported type {np.ndarray}")
        arrays = [arg for arg in args if isinstance(arg, _fake.ndarray)]
        if not arrays:
            raise TypeError(f"{self.name}: at least one argument must be a cupy.ndarray")
        bound: dict[str, np.dtype] = {}
        for (kind, _), arg in zip((*self.in_params, *self.out_params), args, strict=False):
            generic = kind not in _CONCRETE and isinstance(arg, _fake.ndarray)
            if generic and bound.setdefault(kind, arg.dtype) != arg.dtype:
                raise TypeError(f"{self.name}: {kind} is both {bound[kind]} and {arg.dtype}")
        shape = np.broadcast_shapes(*(a.shape for a in arrays))

        def dtype_of(kind: str) -> np.dtype:
            if kind in _CONCRETE:
                return np.dtype(_CONCRETE[kind])
            if kind not in bound:
                raise TypeError(f"{self.name}: type {kind} is not bound by an array")
            return bound[kind]

        outs = list(args[n_in:])
        if not outs:
            outs = [_fake.ndarray(shape, dtype_of(kind)) for kind, _ in self.out_params]
        for out in outs:
            if not isinstance(out, _fake.ndarray) or out.shape != shape:
                raise ValueError(f"{self.name}: an output must be a cupy.ndarray of shape {shape}")
        _fake._check_here([*arrays, *outs])
        kinds = {kind: dtype_of(kind) for kind in set(self._types.values())}
        param_types = {name: kinds[kind] for name, kind in self._types.items()}
        inputs = list(args[:n_in])
        program = self._program
        in_params, out_params = self.in_params, self.out_params

        def cast(kind: str, value: Any) -> Any:
            return np.asarray(value).astype(kinds[kind], copy=False)

        def run() -> None:
            space: dict[str, Any] = {"__builtins__": {}, "_cast": cast}
            space.update(DEVICE_FUNCTIONS)
            for (_, name), value in zip(in_params, inputs, strict=True):
                if isinstance(value, _fake.ndarray):
                    space[name] = value._a
                else:
                    space[name] = param_types[name].type(value)
            for (_, name), out in zip(out_params, outs, strict=True):
                space[name] = np.array(out._a)
            exec(program, space)
            for (_, name), out in zip(out_params, outs, strict=True):
                np.copyto(out._a, np.broadcast_to(space[name], shape), casting="unsafe")

        states = tuple({id(a._block.state): a._block.state for a in (*arrays, *outs)}.values())
        _fake.counts["elementwise"] += 1
        _fake.get_current_stream()._enqueue("kernel", run, states=states, label=self.name)
        if self.no_return:
            return None
        if len(outs) == 1 and not self.return_tuple:
            return outs[0]
        return tuple(outs)

    def __repr__(self) -> str:
        return f"<fake ElementwiseKernel {self.name}>"
