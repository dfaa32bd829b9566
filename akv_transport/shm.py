"""Shared memory between processes on one host: the building blocks (Linux).

Nothing here knows what akv sends; it moves bytes and file descriptors.

* :class:`Arena`: a shared buffer backed by an anonymous memory file (``memfd``), sealed
  against resizing, with ``memoryview`` windows (:meth:`Arena.view`); it grows by
  replacement (:meth:`Arena.grow`) and is freed by the kernel when the last process holding
  it closes it or dies. It has no name in any file system (never ``/dev/shm``).
* :func:`send_fds` / :func:`recv_fds`: one message with descriptors over a blocking AF_UNIX
  stream socket; :class:`MessageParser` is the framing without I/O. Received descriptors are
  close-on-exec; every bound is checked, and what a refused message carried is closed.
* :class:`ShmListener` / :func:`connect_shm` / :class:`ShmConnection`: a Unix socket, 0600 in
  a private 0700 directory, that hands out a connection only after the job's token was
  checked (constant time), and the asyncio connection that carries messages and descriptors.
* :func:`host_identity`: equal for two processes iff they may share memory (same machine and
  boot, same IPC and mount namespaces); processes on different hosts never are.

``python -m akv_transport._shm_bench`` measures a small message's round trip over the Unix socket
and over TCP loopback, in one run (:func:`akv_transport._shm_bench.measure_round_trips`).

What the file system keeps: a listener's directory and socket while it is open, and nothing
after :meth:`ShmListener.close`. A process killed by SIGKILL leaves its listener's directory
(``{tempdir}/akv-shm-{pid}-*``) and socket, nothing else: memory and descriptors die with it;
:func:`akv_transport.remove_leftovers` removes such directories once their process is gone.
"""

from __future__ import annotations

from akv_transport._shm_arena import ARENA_NAME, MAX_ARENA_BYTES, Arena, next_arena_size
from akv_transport._shm_host import host_identity, identity_from
from akv_transport._shm_socket import (
    DEFAULT_MAX_PENDING_CONNECTIONS,
    DEFAULT_MAX_QUEUED_MESSAGES,
    HANDSHAKE_TIMEOUT_S,
    MAX_QUEUED_FDS,
    MAX_TOKEN_BYTES,
    RECV_BUFFER_BYTES,
    ShmConnection,
    ShmConnectionStatistics,
    ShmListener,
    ShmListenerStatistics,
    connect_shm,
)
from akv_transport._shm_wire import (
    DEFAULT_MAX_FDS_PER_MESSAGE,
    DEFAULT_MAX_MESSAGE_BYTES,
    HEADER_BYTES,
    MAX_FDS_PER_MESSAGE,
    MessageParser,
    ShmMessage,
    recv_fds,
    send_fds,
)

__all__ = [
    "ARENA_NAME",
    "DEFAULT_MAX_FDS_PER_MESSAGE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_PENDING_CONNECTIONS",
    "DEFAULT_MAX_QUEUED_MESSAGES",
    "HANDSHAKE_TIMEOUT_S",
    "HEADER_BYTES",
    "MAX_ARENA_BYTES",
    "MAX_FDS_PER_MESSAGE",
    "MAX_QUEUED_FDS",
    "MAX_TOKEN_BYTES",
    "RECV_BUFFER_BYTES",
    "Arena",
    "MessageParser",
    "ShmConnection",
    "ShmConnectionStatistics",
    "ShmListener",
    "ShmListenerStatistics",
    "ShmMessage",
    "connect_shm",
    "host_identity",
    "identity_from",
    "next_arena_size",
    "recv_fds",
    "send_fds",
]
