"""Turning what callers pass (keys, arrays, lists, lists of lists) into one canonical form.

Pure functions, no I/O: every store method goes through them before anything is
scheduled, so a bad argument raises at the call that caused it and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import numpy as np

from akv.errors import InvalidArgumentError, MixedKeyKindsError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "Key",
    "as_input_array",
    "as_output_array",
    "check_one_kind",
    "group",
    "key_kind",
    "normalize_key",
    "pairs",
]

Key = int | str

_KIND_NAMES = {int: "int", str: "str"}


def normalize_key(key: object) -> Key:
    """Return ``key`` as an ``int`` or ``str``; NumPy integers become ``int``.

    Raises
    ------
    InvalidArgumentError
        For any other type (``bool`` included: ``True`` is not a key).
    """
    if type(key) is int or type(key) is str:
        return key
    if isinstance(key, np.integer):
        return int(key)
    if isinstance(key, str):
        return str(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return int(key)
    raise InvalidArgumentError(f"keys must be int or str, got {key!r} of type {type(key).__name__}")


def key_kind(key: Key) -> type:
    """``int`` or ``str``."""
    return int if type(key) is int else str


def check_one_kind(keys: Sequence[Key], store_kind: type | None) -> type:
    """The one kind of ``keys``; raise when they mix kinds or differ from the store's."""
    kind = key_kind(keys[0])
    for key in keys:
        if key_kind(key) is not kind:
            raise MixedKeyKindsError(
                f"keys in one call must all be int or all be str, got {list(keys)!r}"
            )
    if store_kind is not None and kind is not store_kind:
        raise MixedKeyKindsError(
            f"this store is keyed by {_KIND_NAMES[store_kind]}, got "
            f"{_KIND_NAMES[kind]} key {keys[0]!r} (one kind of key per store)"
        )
    return kind


def as_input_array(value: object, key: Key, what: str) -> np.ndarray:
    """View ``value`` as a NumPy array without copying when possible.

    Accepts NumPy arrays and anything NumPy can view: the array interface, the buffer
    protocol, DLPack (PyTorch and JAX CPU arrays).
    """
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        return np.asarray(value)
    if (
        isinstance(value, (list, tuple, dict, str, bytes, int, float, complex, bool))
        or value is None
    ):
        raise InvalidArgumentError(
            f"{what} for key {key!r}: expected an array, got {type(value).__name__}"
        )
    try:
        if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
            return np.asarray(value)
        if hasattr(value, "__dlpack__"):
            return np.from_dlpack(value)
        # Only trying tells whether it exports a buffer: memoryview raises TypeError if not.
        return np.asarray(memoryview(cast("Buffer", value)))
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"{what} for key {key!r}: cannot view {type(value).__name__} as an array: {exc}"
        ) from exc


def as_output_array(out: object, key: Key) -> np.ndarray:
    """A writable NumPy view of ``out`` that shares its memory (pull writes into it).

    Raises
    ------
    InvalidArgumentError
        When ``out`` is not an array, or is read-only.
    """
    if type(out) is np.ndarray:
        array = out
    else:
        array = as_input_array(out, key, "pull output")
    if not array.flags.writeable:
        raise InvalidArgumentError(
            f"pull output for key {key!r} is read-only ({type(out).__name__}); "
            "pass a writable array"
        )
    return array


def _is_list(value: object) -> TypeGuard[list[Any] | tuple[Any, ...]]:
    return isinstance(value, (list, tuple))


def pairs(keys: object, values: object, what: str) -> list[tuple[Key, list[Any]]]:
    """Pair keys with values, in call order: ``[(key, [value, ...]), ...]``.

    ``keys`` is one key or a list of keys. With one key, ``values`` is one value or a list
    of values. With a list of keys, ``values`` is a list of the same length whose items are
    a value or a list of values. Keys must all be of one kind. The values are untouched.
    """
    if not _is_list(keys):
        key = normalize_key(keys)
        if _is_list(values):
            items = list(values)
            if not items:
                raise InvalidArgumentError(f"{what} for key {key!r}: empty list of values")
            return [(key, items)]
        return [(key, [values])]
    key_list = [normalize_key(k) for k in keys]
    if not key_list:
        raise InvalidArgumentError(f"{what}: empty list of keys")
    check_one_kind(key_list, None)
    if not _is_list(values) or len(values) != len(key_list):
        got = len(values) if _is_list(values) else "a single value"
        raise InvalidArgumentError(
            f"{what}: {len(key_list)} keys need a list of {len(key_list)} values, got {got}"
        )
    result = []
    for key, value in zip(key_list, values, strict=True):
        if _is_list(value):
            if not value:
                raise InvalidArgumentError(f"{what} for key {key!r}: empty list of values")
            result.append((key, list(value)))
        else:
            result.append((key, [value]))
    return result


def group(keys: object, values: object, what: str) -> dict[Key, list[Any]]:
    """Like :func:`pairs`, with a key repeated in the call collecting all its values.

    The result maps each key to its values, in order of first appearance (a push sums
    them; a pull writes the value into each).
    """
    if (type(keys) is int or type(keys) is str) and type(values) is np.ndarray:
        return {keys: [values]}  # the common call, kept cheap
    grouped: dict[Key, list[Any]] = {}
    for key, values_of_key in pairs(keys, values, what):
        bucket = grouped.get(key)
        if bucket is None:
            grouped[key] = values_of_key
        else:
            bucket.extend(values_of_key)
    return grouped
