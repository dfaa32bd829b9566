"""Whether an shm listener is this user's, checked before a client sends it the job's token.

A listener's socket lives in a directory that :func:`tempfile.mkdtemp` made (mode 0700,
owned by the server's user) in the system's temporary directory, which every local user
can list and write. Once the server is gone (stopped, or killed and cleaned up), the name is
free: another local user could make a directory of that name, with a socket in it that
takes whatever token a worker still trying the old path sends. So a client checks, before it
sends anything, that the directory and the socket are this user's and that the directory is
open to no one else (then no one else could have put the socket there, nor swap it), and
once connected, that the process on the other end runs as this user (``SO_PEERCRED``, where
the system has it).
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from akv_transport.errors import UntrustedPeerError

__all__ = ["check_listener_path", "check_peer"]

#: ``struct ucred`` (Linux): pid_t pid, uid_t uid, gid_t gid.
_UCRED = struct.Struct("iII")


def check_listener_path(path: str) -> None:
    """Refuse the socket at ``path`` unless it and its directory are this user's and the
    directory is open to no one else.

    Raises :class:`UntrustedPeerError` naming the path, its owner and mode; ``OSError``
    when the path cannot be read (no listener there).
    """
    uid = os.geteuid()
    directory = os.path.dirname(path) or "."
    folder, sock = os.lstat(directory), os.lstat(path)
    for where, name, info in (("directory", directory, folder), ("socket", path, sock)):
        if info.st_uid != uid:
            raise UntrustedPeerError(
                f"the shm {where} {name!r} belongs to uid {info.st_uid}, not to this user "
                f"(uid {uid}): the job's token is not sent to it"
            )
    if not stat.S_ISDIR(folder.st_mode) or folder.st_mode & 0o077:
        raise UntrustedPeerError(
            f"the shm directory {directory!r} is open to other users (mode "
            f"{stat.S_IMODE(folder.st_mode):o}), or not a directory: the job's token is not "
            "sent to a socket in it"
        )
    if not stat.S_ISSOCK(sock.st_mode):
        raise UntrustedPeerError(f"{path!r} is not a socket: the job's token is not sent to it")


def check_peer(sock: socket.socket, path: str) -> None:
    """Refuse the connected Unix socket ``sock`` (to ``path``) unless the process on the
    other end runs as this user; nothing to check where the system lacks ``SO_PEERCRED``
    (the path's check stands alone there)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return
    pid, peer_uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    if peer_uid != os.geteuid():
        raise UntrustedPeerError(
            f"the shm listener at {path!r} is process {pid} of uid {peer_uid}, not of this "
            f"user (uid {os.geteuid()}): the job's token is not sent to it"
        )
