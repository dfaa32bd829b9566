"""transport: the wire between akv's workers, servers and scheduler.

* :mod:`transport.frame`: a versioned binary frame for a batch of arrays, as plain
  encode/decode functions (no I/O), every field validated on decode.
* :class:`FrameReader`: a sans-IO stream parser that lands large payloads straight in the
  buffers they belong to.
* :func:`create_app` / :func:`serve` / :class:`HttpClient`: aiohttp for the control plane
  (routing, token authentication in constant time, body limits, TLS, status codes).
* :func:`stream_route` / :func:`open_stream` / :class:`StreamProtocol`: an authenticated
  HTTP Upgrade to a framed stream for bulk arrays (zero-copy sends, receives into
  preallocated buffers).

This package never imports ``akv`` or ``engine``.
"""

from transport._http import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    HttpClient,
    RequestError,
    client_ssl_context,
    create_app,
    serve,
    server_ssl_context,
    stream_route,
)
from transport._reader import FrameReader, Message, ReaderStatistics
from transport._stream import UPGRADE_PROTOCOL, StreamProtocol, open_stream
from transport.errors import (
    AuthError,
    FrameError,
    PayloadTooLargeError,
    RemoteError,
    TransportError,
)
from transport.frame import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DTYPE_CODES,
    ArrayInfo,
    FrameHeader,
    as_array,
    decode_frame,
    decode_header,
    decode_prefix,
    encode_frame,
    frame_bytes,
)

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DTYPE_CODES",
    "UPGRADE_PROTOCOL",
    "ArrayInfo",
    "AuthError",
    "FrameError",
    "FrameHeader",
    "FrameReader",
    "HttpClient",
    "Message",
    "PayloadTooLargeError",
    "ReaderStatistics",
    "RemoteError",
    "RequestError",
    "StreamProtocol",
    "TransportError",
    "as_array",
    "client_ssl_context",
    "create_app",
    "decode_frame",
    "decode_header",
    "decode_prefix",
    "encode_frame",
    "frame_bytes",
    "open_stream",
    "serve",
    "server_ssl_context",
    "stream_route",
]
