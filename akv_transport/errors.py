"""The errors the transport raises.

Every error the transport raises on purpose is a :class:`TransportError`. Subclasses exist so
that a caller can catch one reason; each message names the field and the value that was wrong.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "FrameError",
    "JSONError",
    "PayloadTooLargeError",
    "RemoteError",
    "StreamEndedError",
    "StreamSilentError",
    "TransportError",
    "UnprovenPeerError",
    "UntrustedPeerError",
]


class TransportError(Exception):
    """Base class of every error the transport raises on purpose."""


class FrameError(TransportError, ValueError):
    """A frame is truncated, oversized or garbled, or cannot be encoded.

    The message says which field held which value, for example
    ``"frame header: ndim 40 of array 2 exceeds MAX_NDIM 32"``. A connection that produced one
    cannot be trusted to be in step any more and should be closed.
    """


class StreamEndedError(FrameError):
    """The stream ended inside a frame (the peer, or the path to it, cut it): a truncation,
    not a frame this side refused."""


class StreamSilentError(TransportError):
    """A stream received nothing for its ``silent_s`` (:mod:`akv_transport._liveness`) and
    was cut: the path to the peer holds the connection but carries nothing (a proxy that
    black-holes it, a host that vanished), or the peer's loop is blocked for that long.
    Handle it as a reset: open the stream again."""


class JSONError(TransportError, ValueError):
    """A JSON text is malformed, or outside what :func:`akv_transport.parse_json` accepts
    (nested too deeply, a non-finite number, an integer beyond 64 bits, not UTF-8)."""


class AuthError(TransportError, PermissionError):
    """The peer refused the job's token (HTTP 401)."""


class UntrustedPeerError(TransportError):
    """A local listener is not this user's (its socket, its directory, or the process on
    the other end belongs to another user, or the directory is open to others): the job's
    token was not sent to it. Another local user may be posing as a server that is gone."""


class UnprovenPeerError(UntrustedPeerError):
    """A peer answered without proving that it holds the job's token (no valid
    ``AKV-Proof``): its answer was not used. Another process may be posing as a process of
    the job that is gone (it took its port), or it runs an akv without answer proofs."""


class RemoteError(TransportError):
    """The peer answered with an HTTP error status (``status``) and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PayloadTooLargeError(RemoteError):
    """The peer refused a request body as too large (HTTP 413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)
