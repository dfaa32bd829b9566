"""transport: the wire between akv's workers, servers and scheduler.

* :mod:`akv_transport.frame`: a versioned binary frame for a batch of arrays, as plain
  encode/decode functions (no I/O), every field validated on decode.
* :class:`FrameReader`: a sans-IO stream parser that lands large payloads straight in the
  buffers they belong to.
* :func:`create_app` / :func:`serve` / :class:`HttpClient`: aiohttp for the control plane
  (routing, token authentication in constant time, routes without it for health probes
  (:func:`public_route`), body limits, status codes:
  :mod:`akv_transport._http_server`, :mod:`akv_transport._http_client`), bounds on what a hostile
  peer may hold (idle and slow connections time out; connections without the token are
  capped per address and in all, apart from the authenticated ones, which they never
  displace: :mod:`akv_transport._http_guard`, deciding with :mod:`akv_transport._admission`), logs
  that never show the token (:mod:`akv_transport._http_log`), TLS (:mod:`akv_transport._tls`).
* :func:`parse_json`: the strict JSON decoder for whatever peers send (no I/O:
  :mod:`akv_transport._json`).
* :func:`stream_route` / :func:`open_stream` / :class:`StreamProtocol`: an authenticated
  HTTP Upgrade to a framed stream for bulk arrays (zero-copy sends, receives into
  preallocated buffers), kept alive and cut when silent (:class:`KeepAlive`,
  :mod:`akv_transport._liveness`).
* :func:`serve_local` / ``open_stream(local_path=...)``: the same streams between processes
  on one host over a private Unix socket, with large payloads through shared memory
  (:mod:`akv_transport._shm_stream`); :func:`remove_leftovers` removes what a killed process
  left in the file system.
* :mod:`akv_transport.shm`: shared memory between processes on one host: :class:`Arena` (a
  sealed memfd), :func:`send_fds` / :func:`recv_fds`, an authenticated private Unix socket
  (:class:`ShmListener`, :func:`connect_shm`, :class:`ShmConnection`), :func:`host_identity`.

This package never imports ``akv`` or ``akv_engine``.
"""

from akv_transport._http_client import HttpClient
from akv_transport._http_log import CLIENT_MISTAKE_LOG_INTERVAL_S
from akv_transport._http_server import (
    DEFAULT_HOST,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_PROBATION,
    DEFAULT_MAX_STRANGERS,
    DEFAULT_MAX_STRANGERS_PER_PEER,
    DEFAULT_PROBATION_S,
    RequestError,
    app_instance,
    create_app,
    public_route,
    serve,
    serve_local,
    stream_route,
)
from akv_transport._json import DEFAULT_JSON_MAX_DEPTH, parse_json
from akv_transport._liveness import DEFAULT_KEEPALIVE_INTERVAL_S, DEFAULT_SILENT_S, KeepAlive
from akv_transport._reader import (
    DISCARD,
    Destination,
    Discard,
    FrameReader,
    InPlace,
    Message,
    ReaderStatistics,
)
from akv_transport._shm_stream import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_MIN_SHARED_BYTES,
    ArenaBook,
    LocalSite,
    SharedMemory,
    remove_leftovers,
)
from akv_transport._stream import UPGRADE_PROTOCOL, StreamProtocol
from akv_transport._stream_open import open_stream
from akv_transport._tls import client_ssl_context, server_ssl_context
from akv_transport.errors import (
    AuthError,
    FrameError,
    JSONError,
    PayloadTooLargeError,
    RemoteError,
    StreamEndedError,
    StreamSilentError,
    TransportError,
    UnprovenPeerError,
    UntrustedPeerError,
)
from akv_transport.frame import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DTYPE_CODES,
    ArrayInfo,
    FrameHeader,
    as_array,
    byte_view,
    decode_frame,
    decode_header,
    decode_prefix,
    encode_frame,
    frame_bytes,
)
from akv_transport.shm import (
    Arena,
    ShmConnection,
    ShmListener,
    ShmMessage,
    connect_shm,
    host_identity,
    recv_fds,
    send_fds,
)

__all__ = [
    "CLIENT_MISTAKE_LOG_INTERVAL_S",
    "DEFAULT_ARENA_BYTES",
    "DEFAULT_HOST",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_JSON_MAX_DEPTH",
    "DEFAULT_KEEPALIVE_INTERVAL_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_PROBATION",
    "DEFAULT_MAX_STRANGERS",
    "DEFAULT_MAX_STRANGERS_PER_PEER",
    "DEFAULT_MIN_SHARED_BYTES",
    "DEFAULT_PROBATION_S",
    "DEFAULT_SILENT_S",
    "DISCARD",
    "DTYPE_CODES",
    "UPGRADE_PROTOCOL",
    "Arena",
    "ArenaBook",
    "ArrayInfo",
    "AuthError",
    "Destination",
    "Discard",
    "FrameError",
    "FrameHeader",
    "FrameReader",
    "HttpClient",
    "InPlace",
    "JSONError",
    "KeepAlive",
    "LocalSite",
    "Message",
    "PayloadTooLargeError",
    "ReaderStatistics",
    "RemoteError",
    "RequestError",
    "SharedMemory",
    "ShmConnection",
    "ShmListener",
    "ShmMessage",
    "StreamEndedError",
    "StreamProtocol",
    "StreamSilentError",
    "TransportError",
    "UnprovenPeerError",
    "UntrustedPeerError",
    "app_instance",
    "as_array",
    "byte_view",
    "client_ssl_context",
    "connect_shm",
    "create_app",
    "decode_frame",
    "decode_header",
    "decode_prefix",
    "encode_frame",
    "frame_bytes",
    "host_identity",
    "open_stream",
    "parse_json",
    "public_route",
    "recv_fds",
    "remove_leftovers",
    "send_fds",
    "serve",
    "serve_local",
    "server_ssl_context",
    "stream_route",
]
