"""Which store a type name means, and the options :func:`akv.create` takes (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from akv import jit, limits
from akv.cluster.config import int_setting
from akv.errors import InvalidArgumentError, UnknownStoreTypeError

__all__ = ["STORE_TYPES", "StoreType", "check_options", "env_int", "store_type"]

# Every name MXNet 1.9.1 documents or its tests use, with what it means here: where values
# are aggregated ("local", or a distributed mode) and whether aggregation is asked of the
# devices. MXNet decides by substring ("dist", "_async", "device"); akv lists the names, so
# that a typo is an error instead of a silent local store.
_MEANINGS: dict[str, tuple[str, bool]] = {
    "local": ("local", False),
    "local_allreduce_cpu": ("local", False),
    "local_update_cpu": ("local", False),
    "local_allreduce_device": ("local", True),
    "device": ("local", True),
    "nccl": ("local", True),
    "dist_sync": ("dist_sync", False),
    "dist_async": ("dist_async", False),
    "dist_sync_device": ("dist_sync", True),
    "dist_async_device": ("dist_async", True),
    "dist_device_sync": ("dist_sync", True),
    "dist_device_async": ("dist_async", True),
}
#: Store types ``create`` accepts (case-insensitive).
STORE_TYPES = tuple(_MEANINGS)


@dataclass(frozen=True)
class StoreType:
    """What a store type name means.

    ``name``: as the user gave it (``kv.type`` reports it). ``mode``: ``"local"``,
    ``"dist_sync"`` or ``"dist_async"``. ``device``: aggregation on the devices was asked
    for (``device``, ``nccl``, ``*_device``); with host values it changes nothing, as in
    MXNet with CPU contexts.
    """

    name: str
    mode: str
    device: bool

    @property
    def distributed(self) -> bool:
        """Whether workers talk to parameter servers."""
        return self.mode != "local"


def store_type(name: object) -> StoreType:
    """The meaning of a store type name (see ``STORE_TYPES``).

    Raises
    ------
    InvalidArgumentError
        ``name`` is not a str.
    UnknownStoreTypeError
        Any other name (MXNet silently makes a local store).
    """
    if not isinstance(name, str):
        raise InvalidArgumentError(f"store type must be a str, got {type(name).__name__}")
    meaning = _MEANINGS.get(name.lower())
    if meaning is None:
        raise UnknownStoreTypeError(
            f"unknown store type {name!r}; akv knows: {', '.join(STORE_TYPES)}"
        )
    return StoreType(name, *meaning)


def is_store_type(name: str) -> bool:
    """Whether ``name`` (any case) is one of akv's own store types."""
    return name.lower() in _MEANINGS


def env_int(name: str, default: int, minimum: int) -> int:
    """``name`` from the environment (read at each store's creation), or ``default``."""
    text = os.environ.get(name)
    return default if text is None else int_setting(text, name, minimum, "a whole number")


_OPTIONS = ("slots", "environ", "inline_max_bytes", "devices", "staleness")


def check_options(kind: StoreType, options: dict[str, Any]) -> int:
    """Check ``create``'s options for a ``kind`` store; return its engine's slots."""
    jit.enabled()  # a malformed AKV_JIT fails here, not in a round
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown store option(s) {unknown}; known: {', '.join(_OPTIONS)}"
        )
    if not kind.distributed:
        default = env_int("AKV_ENGINE_SLOTS", limits.ENGINE_SLOTS, 1)
    else:
        default = env_int("AKV_DIST_SLOTS", limits.DIST_ENGINE_SLOTS, 1)
    slots = options.get("slots", default)
    if not isinstance(slots, int) or slots < 1:
        raise InvalidArgumentError(f"slots must be an int >= 1, got {slots!r}")
    inline = options.get("inline_max_bytes")
    if inline is not None and (not isinstance(inline, int) or inline < 0):
        raise InvalidArgumentError(f"inline_max_bytes must be an int >= 0, got {inline!r}")
    staleness = options.get("staleness")
    if staleness is not None:
        if kind.mode != "dist_async":
            raise InvalidArgumentError(
                f"staleness= bounds dist_async's pushes; {kind.name!r} is not a dist_async store"
            )
        if type(staleness) is not int or staleness < 0:
            raise InvalidArgumentError(f"staleness must be an int >= 0, got {staleness!r}")
    devices = options.get("devices")
    if devices is not None:
        if not kind.device or kind.distributed:
            raise InvalidArgumentError(
                f"devices= is an option of the local device stores (device, "
                f"local_allreduce_device, nccl), not of {kind.name!r}"
            )
        if (
            not isinstance(devices, (list, tuple))
            or not devices
            or not all(type(d) is int and d >= 0 for d in devices)
        ):
            raise InvalidArgumentError(
                f"devices must be a non-empty list of GPU numbers (ints >= 0), got {devices!r}"
            )
    return slots
