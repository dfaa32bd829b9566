"""The errors akv raises.

Every error akv raises on purpose is an :class:`AKVError`. The subclasses exist so that a
caller can catch one reason; each message names what was involved (the key, both shapes or
dtypes, the rank, the server) so that it can be acted on without a debugger.

Several subclasses also derive from the built-in exception a Python user would expect
(``TypeError`` for a value of the wrong kind, ``ValueError`` for a wrong shape, ``KeyError``
is deliberately *not* used because it quotes its message).
"""

from __future__ import annotations

__all__ = [
    "AKVError",
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
    "ServerError",
    "ShapeMismatchError",
    "StateFileError",
    "StateFormatError",
    "StorageTypeError",
    "UnknownStoreTypeError",
    "UnsupportedDTypeError",
    "WaitTimeoutError",
]


class AKVError(Exception):
    """Base class of every error akv raises on purpose."""


class InvalidArgumentError(AKVError, TypeError):
    """An argument has the wrong kind or form (not an array, lists of different lengths...)."""


class UnknownStoreTypeError(AKVError, ValueError):
    """``create()`` was given a store type name akv does not know."""


class KeyNotInitializedError(AKVError):
    """A push or pull named a key that was never initialized with ``init``."""

    def __init__(self, message: str, key: object = None) -> None:
        super().__init__(message)
        self.key = key


class DuplicateInitError(AKVError):
    """``init`` (or ``broadcast``) was called twice for the same key."""

    def __init__(self, message: str, key: object = None) -> None:
        super().__init__(message)
        self.key = key


class MixedKeyKindsError(AKVError, TypeError):
    """A store keyed by ``int`` was given a ``str`` key, or the other way round."""


class _Mismatch(AKVError):
    """A value does not fit its key: ``key``, and what was ``expected`` and what was ``got``."""

    def __init__(
        self, message: str, key: object = None, expected: object = None, got: object = None
    ) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.got = got


class ShapeMismatchError(_Mismatch, ValueError):
    """A value's shape differs from the shape the key was initialized with."""


class DTypeMismatchError(_Mismatch, TypeError):
    """A value's dtype differs from the key's dtype; akv never casts silently."""


class UnsupportedDTypeError(InvalidArgumentError):
    """A value's dtype cannot be held where it would have to live (bfloat16 without
    ``ml_dtypes``, bfloat16 on a GPU through CuPy, a dtype the wire cannot carry). The
    message names the key, the dtype and what to do instead."""


class ImmutableOutputError(InvalidArgumentError):
    """A pull was given an output that cannot be written in place (a JAX array)."""


class GPUUnavailableError(AKVError, RuntimeError):
    """A GPU array was given, or GPU work asked for, where CuPy or a GPU is missing."""


class ReentrantCallError(AKVError, RuntimeError):
    """A store method was called from inside that store's own updater (it would deadlock)."""


class ClosedError(AKVError, RuntimeError):
    """The store was used after ``close()``."""


class WaitTimeoutError(AKVError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class OptimizerError(AKVError, ValueError):
    """An optimizer or learning-rate scheduler was given a bad name or parameter."""


class OptimizerNotSetError(AKVError, RuntimeError):
    """An optimizer-state call (save or load) came before any ``set_optimizer``."""


class StateFormatError(AKVError, ValueError):
    """A saved optimizer-state file is not in akv's format, or does not fit the store."""


class StateFileError(AKVError, OSError):
    """An optimizer-state file could not be read or written; names the path and the cause."""


class CheckpointError(AKVError, OSError):
    """A server checkpoint could not be written, or is unreadable; names the path and the cause."""


class ConfigError(AKVError, ValueError):
    """The distributed configuration (environment or flags) is missing, malformed or wrong."""


class NoJobError(ConfigError):
    """A distributed store was created in a process that no job describes: none of the
    job's variables is set (the script was run without ``akv-launch``). The message says to
    run it with ``akv-launch`` or which variables to set."""


class RoleError(ConfigError):
    """A call that needs a worker ran in a process whose role is server or scheduler."""


class ConnectTimeoutError(WaitTimeoutError):
    """The scheduler or the servers could not be reached in time; says what is still missing."""


class BarrierTimeoutError(WaitTimeoutError):
    """Not every worker reached a barrier in time; ``missing`` lists the ranks that did not."""

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class RoundTimeoutError(WaitTimeoutError):
    """A sync round did not get every worker's push in time; names the key and the ranks."""


class DoublePushError(AKVError):
    """A worker pushed a key again in dist_sync before the round it pushed into was complete."""


class PeerLostError(AKVError, ConnectionError):
    """A worker, server or the scheduler of the job died or stopped answering; names it."""


class AuthenticationError(AKVError, PermissionError):
    """A server or the scheduler refused the job's token (HTTP 401)."""


class ServerError(AKVError):
    """A server or the scheduler could not carry out a request; ``server`` names it."""

    def __init__(self, message: str, server: str = "") -> None:
        super().__init__(message)
        self.server = server


class MembershipError(AKVError, ValueError):
    """The scheduler refused a registration, heartbeat or barrier: an unknown node, a role
    or rank that does not fit the job, a rank already taken. Names the node and the rank."""


class BenchmarkError(AKVError, RuntimeError):
    """A benchmark could not run to the end (its job failed); carries the job's output."""


class LaunchError(AKVError, ValueError):
    """akv-launch cannot go ahead: a bad flag, host file, environment or scheduler address.

    The message names the flag, file line or variable and says what to do.
    """


class CapabilityError(AKVError, ValueError):
    """A store was asked about a capability akv does not know, or for one it lacks (an
    optimizer method of a custom store without an optimizer); the message names the store."""


class CompressionError(InvalidArgumentError):
    """Gradient compression that cannot be: bad parameters, set after the first push, or a
    value it cannot compress (not float32, row-sparse); the message names the key."""


class RowIdError(InvalidArgumentError, IndexError):
    """A row id of a row-sparse value is negative or not below the number of rows; the
    message names the first such id, its position and the shape."""


class StorageTypeError(InvalidArgumentError):
    """A dense value was given where a row-sparse one is required, or the reverse; the
    message names the argument and what it was."""


class JobFailedError(AKVError, RuntimeError):
    """A job started by :func:`akv.ray.launch` failed: ``role`` and ``rank`` name the
    process it is blamed on (``rank`` is None for the scheduler), and ``remote_traceback``
    is the traceback of a worker's exception, as it was formatted where it was raised
    (None when the process left none: a server that died, a worker's process that was
    killed)."""

    def __init__(
        self, message: str, *, role: str, rank: int | None, remote_traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes survive pickling (multiprocessing, Ray).
        return (_job_failed, (str(self), self.role, self.rank, self.remote_traceback))


def _job_failed(
    message: str, role: str, rank: int | None, remote_traceback: str | None
) -> JobFailedError:
    return JobFailedError(message, role=role, rank=rank, remote_traceback=remote_traceback)
