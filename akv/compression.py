"""Gradient compression: MXNet's 2-bit (1.9.1) and 1-bit (2.0) quantization with a residual.

A sender keeps a residual per key (per worker in the distributed stores, per position of a
pushed list in a local store, as MXNet keeps one per device) and sends each push quantized;
the receiver decodes and sums as usual. Per value, with threshold ``t``:

* **2bit** (MXNet 1.9.1, ``gradient_compression-inl.h``): ``r += g``; at or above ``t`` it
  sends ``+t`` and ``r -= t``; at or below ``-t`` it sends ``-t`` and ``r += t``; else 0.
  Sixteen values per 32-bit word: byte ``b`` holds values ``4b .. 4b+3``, value ``4b+j`` in
  the two bits ``0xC0 >> 2j`` (``11``: ``+t``, ``10``: ``-t``, ``00``: 0).
* **1bit** (MXNet 2.0): ``r += g``; above ``t`` it sends ``+1`` and ``r -= 1``, else ``-1``
  and ``r += 1``. The decoded magnitude is 1, not ``t``. Thirty-two values per word: byte
  ``b`` holds values ``8b .. 8b+7``, value ``8b+j`` in bit ``0x80 >> j``.

A compressed array is ``ceil(n / 16)`` (2bit) or ``ceil(n / 32)`` (1bit) words, as bytes
(``uint8``), unused trailing bits 0. float32 only, as MXNet. Pure: NumPy (or CuPy, through
NumPy's dispatch, for arrays on a GPU), no I/O.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from akv.arrays import cupy_module, is_cupy
from akv.errors import CompressionError

__all__ = [
    "Compression",
    "Residuals",
    "compressed_nbytes",
    "decode",
    "encode",
    "parse_compression",
    "parse_wire",
]

#: How many values one 32-bit word holds, by type.
VALUES_PER_WORD = {"2bit": 16, "1bit": 32}
#: MXNet's default threshold.
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True, slots=True)
class Compression:
    """A compression type and its threshold (see the module docstring)."""

    type: Literal["2bit", "1bit"]
    threshold: float

    def config(self) -> dict[str, Any]:
        """As :func:`parse_compression` takes it."""
        return {"type": self.type, "threshold": self.threshold}

    @property
    def wire(self) -> str:
        """How a compressed push frame says it is one (its text): ``"2bit 0.5"``."""
        return f"{self.type} {self.threshold!r}"

    def check_key(self, key: object, dtype: np.dtype) -> None:
        """Raise unless a key of ``dtype`` can be compressed (float32, as MXNet).

        Raises
        ------
        CompressionError
        """
        if dtype != np.float32:
            raise CompressionError(
                f"push to key {key!r}: gradient compression ({self.type}) takes float32 "
                f"values only (as MXNet), the key is {dtype}"
            )


def parse_wire(text: str) -> Compression:
    """The compression a push frame's text names (:attr:`Compression.wire`).

    Raises
    ------
    CompressionError
        Not ``"<type> <threshold>"`` with a type and threshold :func:`parse_compression` takes.
    """
    fields = text.split(" ")
    if len(fields) != 2:
        raise CompressionError(f"malformed compression {text[:64]!r} in a push frame")
    return parse_compression({"type": fields[0], "threshold": fields[1]})


class Residuals:
    """A sender's residuals: one float32 array per (key, slot) (the slot: a part of a key
    split over servers, or a position of a pushed list), made at zero on first use where
    the gradient lives."""

    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self._arrays: dict[tuple[object, int], Any] = {}

    def encode(self, key: object, slot: int, grad: Any) -> Any:
        """``grad`` quantized with the residual of ``(key, slot)`` (:func:`encode`)."""
        residual = self._arrays.get((key, slot))
        if residual is None:
            xp: Any = cupy_module() if is_cupy(grad) else np
            residual = self._arrays[(key, slot)] = xp.zeros(grad.size, np.float32)
        return encode(self.compression, grad, residual)

    def round_trip(self, key: object, slot: int, grad: Any) -> Any:
        """What the receiver sums of ``grad``: encoded, then decoded (a local store's push),
        a new float32 array of ``grad``'s shape."""
        data = self.encode(key, slot, grad)
        return decode(self.compression, data, grad.size).reshape(grad.shape)


def parse_compression(params: object) -> Compression:
    """The compression ``params`` ask for: ``{"type": "2bit" | "1bit", "threshold": t}``
    (``threshold`` defaults to 0.5, as MXNet's; any float for 1bit, above 0 for 2bit).

    Raises
    ------
    CompressionError
        Not a mapping, an unknown type or key, or a bad threshold.
    """
    if not isinstance(params, Mapping):
        raise CompressionError(
            f"set_gradient_compression takes a dict such as {{'type': '2bit', 'threshold': 0.5}}, "
            f"got {type(params).__name__}"
        )
    unknown = sorted(set(map(str, params)) - {"type", "threshold"})
    if unknown:
        raise CompressionError(f"set_gradient_compression: unknown parameter(s) {unknown}")
    kind = params.get("type")
    if kind not in VALUES_PER_WORD:
        raise CompressionError(f"set_gradient_compression: type {kind!r} is not one of 2bit, 1bit")
    threshold = params.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, str):
        try:
            threshold = float(threshold)  # MXNet stringifies its parameters
        except ValueError:
            threshold = None
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, numbers.Real)
        or not math.isfinite(threshold)
    ):
        raise CompressionError(
            f"set_gradient_compression: threshold must be a finite number, got {threshold!r}"
        )
    if kind == "2bit" and threshold <= 0:
        raise CompressionError(
            f"set_gradient_compression: 2bit needs a threshold above 0, got {threshold}"
        )
    return Compression(kind, float(threshold))


def compressed_nbytes(compression: Compression, size: int) -> int:
    """Bytes of ``size`` values compressed: whole 32-bit words."""
    return 4 * -(-size // VALUES_PER_WORD[compression.type])


#: Values one step of the host codes works on: their arrays stay in the CPU's cache, so
#: each value's bytes cross memory about once (gradient and residual read, residual written).
CHUNK = 1 << 16


def encode(compression: Compression, grad: Any, residual: Any) -> Any:
    """``grad`` (float32, any shape) quantized with ``residual`` (float32, its size; updated
    in place) as ``uint8`` bytes (:func:`compressed_nbytes`), where ``grad`` lives."""
    flat_grad = grad.reshape(-1)
    flat = residual.reshape(-1)
    size = flat.size
    out_bytes = compressed_nbytes(compression, size)
    if is_cupy(grad):
        return _encode_chunk(compression, cupy_module(), flat_grad, flat, out_bytes)
    out = np.zeros(out_bytes, np.uint8)
    per_byte = 4 if compression.type == "2bit" else 8
    for start in range(0, size, CHUNK):
        stop = min(size, start + CHUNK)
        packed = _encode_chunk(compression, np, flat_grad[start:stop], flat[start:stop], 0)
        out[start // per_byte : start // per_byte + packed.size] = packed
    return out


def _spread_table() -> np.ndarray:
    """``SPREAD[b]``: the 8 bits of byte ``b`` moved to the even bits of a 16-bit word (bit
    ``i`` to bit ``2i``), so that two packed bit planes interleave into 2-bit codes."""
    table = np.zeros(256, np.uint16)
    for bit in range(8):
        table |= ((np.arange(256) >> bit) & 1).astype(np.uint16) << (2 * bit)
    return table


SPREAD = _spread_table()


def _encode_chunk(compression: Compression, xp: Any, grad: Any, residual: Any, nbytes: int) -> Any:
    """One piece of :func:`encode` (starting at a multiple of 8 values): its packed bytes,
    padded with zeros to ``nbytes`` when that is larger. Arithmetic, not ``where=`` (NumPy's
    masked ufuncs are 20 times slower)."""
    xp.add(residual, grad, out=residual)
    t = np.float32(compression.threshold)
    work = xp.empty(residual.size, np.float32)
    if compression.type == "2bit":
        up = residual >= t
        down = residual <= -t
        xp.multiply(up, t, out=work)
        xp.subtract(residual, work, out=residual)
        xp.multiply(down, t, out=work)
        xp.add(residual, work, out=residual)
        # Two bit planes, 8 values a byte; interleaved: each value's code is (sent, up):
        # 11 +t, 10 -t, 00 nothing; four codes a byte, the first the most significant.
        sent = xp.packbits(up | down)
        ups = xp.packbits(up)
        table = SPREAD if xp is np else xp.asarray(SPREAD)
        words = (table[sent] << 1) | table[ups]
        packed = words.astype(">u2").view(np.uint8)
        packed = packed[: -(-residual.size // 4)]
    else:
        up = residual > t
        xp.multiply(up, np.float32(2), out=work)
        xp.subtract(work, np.float32(1), out=work)  # +1 sent, or -1
        xp.subtract(residual, work, out=residual)
        packed = xp.packbits(up)
    if packed.size >= nbytes:
        return packed
    out = xp.zeros(nbytes, np.uint8)
    out[: packed.size] = packed
    return out


def decode(compression: Compression, data: Any, size: int, out: Any | None = None) -> Any:
    """The ``size`` float32 values that :func:`encode` packed into ``data`` (1-D ``uint8``
    of :func:`compressed_nbytes` bytes), into ``out`` (``size`` float32 values, any shape)
    or a new 1-D array, where ``data`` lives."""
    gpu = is_cupy(data)
    xp: Any = cupy_module() if gpu else np
    target = xp.empty(size, np.float32) if out is None else out.reshape(-1)
    per_byte = 4 if compression.type == "2bit" else 8
    step = size if gpu else CHUNK
    for start in range(0, size, step):
        stop = min(size, start + step)
        piece = data[start // per_byte : -(-stop // per_byte)]
        bits = xp.unpackbits(piece)
        if compression.type == "2bit":
            t = np.float32(compression.threshold)
            sent, up = bits[0::2][: stop - start], bits[1::2][: stop - start]
            values = target[start:stop]
            xp.multiply(up, t + t, out=values)  # 11: +t; 10: -t; 00 (and 01): 0
            xp.subtract(values, t, out=values)
            xp.multiply(values, sent, out=values)
            xp.add(values, np.float32(0), out=values)  # -0.0 (not sent, -t times 0) to 0.0
        else:
            values = target[start:stop]
            xp.multiply(bits[: stop - start], np.float32(2), out=values)
            xp.subtract(values, np.float32(1), out=values)
    return target if out is None else out
