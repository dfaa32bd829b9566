"""akv: an asyncio-native parameter server with MXNet's KVStore semantics.

>>> import akv, numpy as np
>>> with akv.create("local") as kv:
...     kv.init(3, np.ones((2, 3), np.float32))
...     kv.push(3, [np.ones((2, 3), np.float32)] * 4)
...     print(kv.pull(3)[0, 0])
4.0

Public names: :func:`create` / :class:`KVStore` (blocking), :func:`create_async` /
:class:`AsyncKVStore` (awaitable), :mod:`akv.optimizer`, :class:`RowSparseArray` (the
rows of a large array that are present, such as an embedding's gradient), and the errors,
all subclasses of :class:`AKVError`; :class:`KVStoreBase` for custom stores.
"""

from akv import optimizer
from akv.custom import KVStoreBase
from akv.errors import (
    AKVError,
    AuthenticationError,
    BarrierTimeoutError,
    BenchmarkError,
    CapabilityError,
    CheckpointError,
    ClosedError,
    CompressionError,
    ConfigError,
    ConnectTimeoutError,
    DoublePushError,
    DTypeMismatchError,
    DuplicateInitError,
    GPUUnavailableError,
    ImmutableOutputError,
    InvalidArgumentError,
    JobFailedError,
    KeyNotInitializedError,
    LaunchError,
    MembershipError,
    MixedKeyKindsError,
    NoJobError,
    OptimizerError,
    OptimizerNotSetError,
    PeerLostError,
    ReentrantCallError,
    RoleError,
    RoundTimeoutError,
    RowIdError,
    ServerError,
    ShapeMismatchError,
    StateFileError,
    StateFormatError,
    StorageTypeError,
    UnknownStoreTypeError,
    UnsupportedDTypeError,
    WaitTimeoutError,
)
from akv.factory import create, create_async
from akv.kinds import STORE_TYPES, StoreType, store_type
from akv.sparse import RowSparseArray
from akv.store import AsyncKVStore, KVStore

__version__ = "0.1.0"

__all__ = [
    "STORE_TYPES",
    "AKVError",
    "AsyncKVStore",
    "AuthenticationError",
    "BarrierTimeoutError",
    "BenchmarkError",
    "CapabilityError",
    "CheckpointError",
    "ClosedError",
    "CompressionError",
    "ConfigError",
    "ConnectTimeoutError",
    "DTypeMismatchError",
    "DoublePushError",
    "DuplicateInitError",
    "GPUUnavailableError",
    "ImmutableOutputError",
    "InvalidArgumentError",
    "JobFailedError",
    "KVStore",
    "KVStoreBase",
    "KeyNotInitializedError",
    "LaunchError",
    "MembershipError",
    "MixedKeyKindsError",
    "NoJobError",
    "OptimizerError",
    "OptimizerNotSetError",
    "PeerLostError",
    "ReentrantCallError",
    "RoleError",
    "RoundTimeoutError",
    "RowIdError",
    "RowSparseArray",
    "ServerError",
    "ShapeMismatchError",
    "StateFileError",
    "StateFormatError",
    "StorageTypeError",
    "StoreType",
    "UnknownStoreTypeError",
    "UnsupportedDTypeError",
    "WaitTimeoutError",
    "__version__",
    "create",
    "create_async",
    "optimizer",
    "store_type",
]
