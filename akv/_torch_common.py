"""What the PyTorch helpers share (:mod:`akv.torch`): describing a value, and refusing a
store that is not the blocking one. Imports nothing of torch."""

from __future__ import annotations

from akv.errors import InvalidArgumentError
from akv.store import AsyncKVStore, KVStore

__all__ = ["blocking_store", "describe"]


def describe(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def blocking_store(kv: object, who: str, waits: str) -> None:
    """Refuse anything but a blocking :class:`~akv.KVStore` (``waits``: what of ``who``
    waits for the store, and so would block an AsyncKVStore's event loop).

    Raises
    ------
    InvalidArgumentError
    """
    if isinstance(kv, AsyncKVStore):
        raise InvalidArgumentError(
            f"{who}: kv must be a blocking store from akv.create(...), got an AsyncKVStore "
            f"(akv.create_async); {waits}, which would block the event loop the "
            "AsyncKVStore runs on"
        )
    if not isinstance(kv, KVStore):
        raise InvalidArgumentError(
            f"{who}: kv must be an akv.KVStore (from akv.create), got {describe(kv)}"
        )
