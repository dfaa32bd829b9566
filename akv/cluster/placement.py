"""Where each key lives: which server holds it, or which part of it, in a distributed store.

The choice depends only on the key itself, its size and the number of servers: never on
the order in which keys were initialized, and the same for ``str`` keys on every worker
(MXNet maps ``str`` keys to ints in init order, and its ``(key * 9973) % servers`` overflows
for large int keys). Arrays with at least ``bound`` elements are split into one contiguous
part per server so they travel to all servers in parallel.

A row-sparse key is split by rows over every server, whatever its size (:func:`row_parts`):
server ``i`` holds rows ``[rows * i // S, rows * (i + 1) // S)``, so a push or a pull of a
few rows reaches only the servers that hold them, and a huge table's touched rows spread
over all of them.
"""

from __future__ import annotations

import hashlib

from akv.keys import Part

__all__ = ["Part", "place", "row_parts", "server_of"]


def server_of(key: int | str, num_servers: int) -> int:
    """The server that holds the whole of a small ``key``: a stable 64-bit hash, mod servers."""
    data = b"s:" + key.encode() if isinstance(key, str) else b"i:%d" % key
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_servers


def place(key: int | str, size: int, num_servers: int, bound: int) -> tuple[Part, ...]:
    """The parts of ``key`` (``size`` elements) over ``num_servers`` servers.

    One part on :func:`server_of` when ``size < bound`` or there is one server; otherwise
    ``num_servers`` contiguous parts of near-equal size, part ``i`` on server ``i``.
    """
    if num_servers == 1 or size < bound:
        return (Part(server_of(key, num_servers), 0, size),)
    edges = [size * i // num_servers for i in range(num_servers + 1)]
    return tuple(Part(i, edges[i], edges[i + 1]) for i in range(num_servers))


def row_parts(rows: int, num_servers: int) -> tuple[Part, ...]:
    """The row ranges of a row-sparse key of ``rows`` rows: part ``i`` (its ``start`` and
    ``stop`` count rows, not elements) on server ``i``; a range may be empty."""
    edges = [rows * i // num_servers for i in range(num_servers + 1)]
    return tuple(Part(i, edges[i], edges[i + 1]) for i in range(num_servers))
