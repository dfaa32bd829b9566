"""Turning what callers pass (keys, arrays, lists, lists of lists) into one canonical form.

Pure functions, no I/O: every store method goes through them before anything is
scheduled, so a bad argument raises at the call that caused it and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np

from akv.errors import InvalidArgumentError, MixedKeyKindsError

__all__ = [
    "Key",
    "check_one_kind",
    "check_priority",
    "group",
    "key_kind",
    "normalize_key",
    "pairs",
]

Key = int | str

_KIND_NAMES = {int: "int", str: "str"}


def check_priority(priority: object, what: str) -> int:
    """``priority`` as an int (a NumPy integer too); a bool, a float or anything else is an
    :class:`~akv.errors.InvalidArgumentError` naming the call (MXNet takes an int)."""
    if isinstance(priority, (int, np.integer)) and not isinstance(priority, (bool, np.bool_)):
        return int(priority)
    raise InvalidArgumentError(f"{what}: priority must be an int, got {priority!r}")


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
            if all(isinstance(item, (int, float, complex)) for item in items):
                raise InvalidArgumentError(
                    f"{what} for key {key!r}: got a list of numbers ({len(items)}); a list given "
                    "for one key holds its arrays (one per device), not the numbers "
                    "of one array: pass np.asarray(...) of them"
                )
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
