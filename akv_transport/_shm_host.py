"""Which processes share a machine closely enough to share memory.

Two processes are co-located iff their :func:`host_identity` strings are equal. An IP
address does not say it (containers, NAT, several interfaces, ``127.0.0.1`` everywhere); the
identity is made of:

* the kernel's boot id (``/proc/sys/kernel/random/boot_id``): one machine, one boot (a
  machine that rebooted, or a VM cloned from it, is another host);
* the IPC namespace (``/proc/self/ns/ipc``): containers with separate IPC namespaces are
  kept apart, as shared memory between them is not what their owners asked for;
* the mount namespace (``/proc/self/ns/mnt``): a peer in another mount namespace may not see
  the listener's socket file at all (a private ``/tmp``), so it is not co-located either;
* the host name, for people who read it.

When any of these cannot be read (no ``/proc``: not Linux, or a sandbox), the identity is
unique to the process: no peer is co-located with it and the shared-memory path stays off.
That costs speed, never correctness (TCP always works), whereas a guess could pair two
machines that merely share a host name.
"""

from __future__ import annotations

import os
import socket
import uuid

__all__ = ["host_identity", "identity_from"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NAMESPACES = ("ipc", "mnt")


def host_identity() -> str:
    """This process's host identity: equal for two processes iff they may share memory.

    Stable for the life of the process (each call reads the same facts again; none of them
    changes unless the process moves to another namespace).
    """
    boot_id = _read_proc(_BOOT_ID)
    namespaces = {name: _read_proc(f"/proc/self/ns/{name}") for name in _NAMESPACES}
    return identity_from(boot_id, namespaces, socket.gethostname())


def identity_from(boot_id: str | None, namespaces: dict[str, str | None], hostname: str) -> str:
    """The identity made of these facts (None: unknown), with no I/O.

    With every fact known: ``"boot=<id> ipc=ipc:[<inode>] mnt=mnt:[<inode>] host=<name>"``.
    With one unknown: ``"unknown pid=<pid> nonce=<random> host=<name>"``, equal to no other.
    """
    facts = [("boot", boot_id)] + [(name, namespaces.get(name)) for name in _NAMESPACES]
    if any(not value for _, value in facts):
        return f"unknown pid={os.getpid()} nonce={_NONCE} host={hostname}"
    return " ".join(f"{name}={value}" for name, value in facts) + f" host={hostname}"


def _read_proc(path: str) -> str | None:
    """A ``/proc`` fact: a symbolic link's target, or a file's stripped text; None when it
    cannot be read."""
    try:
        if path.startswith("/proc/self/ns/"):
            return os.readlink(path)
        with open(path, encoding="ascii") as file:
            return file.read(256).strip() or None
    except (OSError, ValueError):
        return None


#: What keeps an unknown identity unique even between processes with one pid (namespaces).
_NONCE = uuid.uuid4().hex
