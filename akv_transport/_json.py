"""Strict JSON for what peers send: :func:`parse_json`, plain code with no I/O.

Guarantees: a text is decoded only if it is UTF-8, nests at most ``max_depth`` levels
(measured before decoding, in linear time and without recursion, so hostile nesting costs
one scan and never a deep recursion), holds only finite numbers and integers that fit in 64
bits (signed or unsigned). Anything else raises :class:`~akv_transport.errors.JSONError` (a
``ValueError``), and nothing else escapes.

What it does not refuse (callers check what they read): duplicate keys in an object (the
last one wins, as with :func:`json.loads`), any JSON value at the top level, texts of any
length (bound them before reading, as :func:`akv_transport.create_app` bounds bodies).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from akv_transport.errors import JSONError

__all__ = ["DEFAULT_JSON_MAX_DEPTH", "JSON_MAX_INT", "JSON_MIN_INT", "nesting", "parse_json"]

#: JSON nested deeper than this is refused (``{}`` and ``[]`` have depth 1).
DEFAULT_JSON_MAX_DEPTH = 32
#: JSON integers must lie in ``[JSON_MIN_INT, JSON_MAX_INT]`` (what int64 and uint64 hold).
JSON_MIN_INT = -(1 << 63)
JSON_MAX_INT = (1 << 64) - 1


def parse_json(
    text: str | bytes | bytearray | memoryview, *, max_depth: int = DEFAULT_JSON_MAX_DEPTH
) -> Any:
    """Decode JSON from a peer, strictly.

    Besides malformed text, it refuses (with :class:`~akv_transport.errors.JSONError`, a
    ``ValueError``): bytes that are not UTF-8; nesting deeper than ``max_depth`` (checked
    before decoding, in linear time, so the decoder never recurses deeper); ``NaN``,
    ``Infinity`` and numbers that overflow a float (``1e999``); integers outside
    ``[JSON_MIN_INT, JSON_MAX_INT]``. Nothing else escapes it.
    """
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONError(f"JSON text must be UTF-8: {exc}") from None
    # A text with fewer brackets than the bound cannot nest deeper: no scan for it.
    if text.count("[") + text.count("{") > max_depth:
        depth = nesting(text)
        if depth > max_depth:
            raise JSONError(f"JSON nested {depth} levels deep; at most {max_depth} are accepted")
    try:
        return _DECODER.decode(text)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError(f"JSON nested too deeply; at most {max_depth} are accepted") from None
    except (ValueError, OverflowError) as exc:
        raise JSONError(f"not valid JSON: {exc}") from None


def nesting(text: str) -> int:
    """How deeply JSON ``text`` nests, in linear time and without recursion.

    Exact for valid JSON; for other text, some number (the decoder refuses it anyway).
    Inside a string, escaped backslashes go first, then escaped quotes: what remains of
    each string lies between two plain quotes, so the text outside strings is every other
    piece between quotes.
    """
    plain = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", "".join(plain.split('"')[::2]))
    return max(itertools.accumulate(map(_BRACKETS.__getitem__, brackets)), default=0)


def _refuse_constant(name: str) -> Any:
    raise JSONError(f"{name} is not a number: JSON numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONError(f"the number {text[:40]} is out of range: JSON numbers must be finite")
    return value


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= 20 else None  # 20 characters hold any 64-bit integer
    if value is None or not JSON_MIN_INT <= value <= JSON_MAX_INT:
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} digits)"
        raise JSONError(f"the integer {shown} does not fit in 64 bits")
    return value


_DECODER = json.JSONDecoder(
    parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_refuse_constant
)
_BRACKETS = {"[": 1, "{": 1, "]": -1, "}": -1}
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
