"""Host files and placing processes onto hosts.

:func:`parse_hostfile` and :func:`assign_hosts` are pure; :func:`load_hostfile` only adds
reading the file. (This is process placement; key placement over servers is
:func:`akv.cluster.placement.place`.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from akv.cluster.config import parse_address
from akv.errors import ConfigError, LaunchError

__all__ = ["Host", "assign_hosts", "load_hostfile", "node_share", "parse_hostfile"]

_HOST_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")
_MAX_PORT = 65535


@dataclass(frozen=True)
class Host:
    """One line of a host file: ``host``, ``host:port`` (ssh port) or ``host slots=N``,
    optionally with ``advertise=ADDR``: the address the servers on this host advertise
    (a host name, an IPv4 address or ``[IPv6]``, kept as ``AKV_ADVERTISE`` takes it)."""

    name: str
    port: int | None = None
    slots: int | None = None
    advertise: str | None = None


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse host file ``text``: ``host``, ``host:port`` or ``host slots=N`` per line, each
    optionally followed by ``advertise=ADDR`` (``host:port slots=N advertise=ADDR`` too;
    the options in any order, each once).

    Blank lines and ``#`` comments are skipped. Raises :class:`LaunchError` naming
    ``source``, the line number and its content for a line of another form, or when no host
    is left.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        hosts.append(_parse_host_line(line, f"{source} line {number}: {raw.strip()!r}"))
    if not hosts:
        raise LaunchError(f"{source} has no hosts (only blank lines and comments)")
    return hosts


def load_hostfile(path: str) -> list[Host]:
    """Read and parse the host file at ``path`` (:class:`LaunchError` if unreadable)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise LaunchError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LaunchError(f"hostfile {path} cannot be read: {exc}") from exc
    return parse_hostfile(text, f"hostfile {path}")


def assign_hosts(hosts: Sequence[Host], count: int) -> list[Host]:
    """The host of each of ``count`` processes, in order: round-robin over ``hosts``.

    A host with ``slots=N`` takes at most N per round; hosts without ``slots`` take one.
    Once every slot is used the assignment wraps around (the hosts are oversubscribed).
    Raises :class:`LaunchError` if processes are to be placed and ``hosts`` is empty.
    """
    if count and not hosts:
        raise LaunchError(f"no hosts to place {count} processes on")
    cycle: list[Host] = []
    for turn in range(max((host.slots or 1 for host in hosts), default=0)):
        cycle.extend(host for host in hosts if turn < (host.slots or 1))
    return [cycle[i % len(cycle)] for i in range(count)]


def _parse_host_line(line: str, where: str) -> Host:
    words = line.split()
    expected = (
        "expected `host`, `host:port` or `host slots=N`, optionally followed by `advertise=ADDR`"
    )
    options: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("slots", "advertise") or key in options:
            raise LaunchError(f"{where}: {expected}")
        options[key] = value
    slots = None
    if "slots" in options:
        slots_text = options["slots"]
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise LaunchError(f"{where}: slots must be a whole number >= 1")
        slots = int(slots_text)
    advertise = _advertise(options["advertise"], where) if "advertise" in options else None
    name, sep, port_text = words[0].rpartition(":") if ":" in words[0] else (words[0], "", "")
    port = None
    if sep:
        if not port_text.isdigit() or not 1 <= int(port_text) <= _MAX_PORT:
            raise LaunchError(f"{where}: {port_text!r} is not a TCP port (1-{_MAX_PORT})")
        port = int(port_text)
    if not _HOST_NAME.match(name) or name.startswith("-"):
        raise LaunchError(f"{where}: {name!r} is not a host name or IPv4 address; {expected}")
    return Host(name, port, slots, advertise)


def _advertise(value: str, where: str) -> str:
    """An ``advertise=`` value: a host (name, IPv4 or ``[IPv6]``) without a port, as
    ``AKV_ADVERTISE`` takes it."""
    try:
        host, port = parse_address(value, "advertise")
    except ConfigError as exc:
        raise LaunchError(f"{where}: {exc}") from None
    if port is not None:
        raise LaunchError(
            f"{where}: advertise={value} has a port: give a host alone (each server on this "
            "host advertises the port it binds; to advertise another port, start the server "
            "yourself with akv-server --advertise HOST:PORT)"
        )
    return f"[{host}]" if ":" in host else host


def node_share(total: int, nodes: int, node: int) -> range:
    """The ranks that node ``node`` of ``nodes`` runs out of ``total`` (the per-node mode):
    a block of consecutive ranks per node, in node order; the first ``total % nodes`` nodes
    run one more than the others (7 over 3 nodes: 0-2, 3-4, 5-6)."""
    base, extra = divmod(total, nodes)
    start = node * base + min(node, extra)
    return range(start, start + base + (1 if node < extra else 0))
