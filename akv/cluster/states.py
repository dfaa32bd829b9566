"""Optimizer states of a distributed store: one file, however the keys are spread.

Each server holds the states of the keys (or key parts) it stores. Saving gathers every
server's states into akv's ordinary state format (the same file a local store writes: a
split key's state arrays are put back together and take the key's shape); loading cuts
such a file into each server's share. So a file saved by a local store can be loaded into a
distributed one, and the other way round. A row-sparse key's states
(:class:`~akv.optimizer.RowStates`) are joined and cut by rows: each server holds the rows of
its range (``Layout``'s pieces then count rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from akv.errors import StateFormatError
from akv.optimizer import RowStates, decode_states, encode_states

__all__ = ["Layout", "merge_server_states", "split_server_states"]

#: key -> (the key's shape, [(server, first element, end element), ...])
Layout = Mapping[Any, tuple[tuple[int, ...], Sequence[tuple[int, int, int]]]]


def _join(trees: list[Any], shape: tuple[int, ...], size: int) -> Any:
    """Put one key's per-part state trees back together."""
    first = trees[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        joined = [_join([t[i] for t in trees], shape, size) for i in range(len(first))]
        return tuple(joined) if isinstance(first, tuple) else joined
    if sum(np.asarray(t).size for t in trees) == size:
        return np.concatenate([np.asarray(t).reshape(-1) for t in trees]).reshape(shape)
    return first  # not element-wise (a scalar): the parts agree on it


def _cut(tree: Any, shape: tuple[int, ...], size: int, start: int, stop: int) -> Any:
    """One part's slice of a key's state tree."""
    if tree is None:
        return None
    if isinstance(tree, (tuple, list)):
        cut = [_cut(t, shape, size, start, stop) for t in tree]
        return tuple(cut) if isinstance(tree, tuple) else cut
    array = np.asarray(tree)
    if array.size == size:
        return np.ascontiguousarray(array.reshape(-1)[start:stop])
    return array


def merge_server_states(
    parts: Sequence[bytes | memoryview], layout: Layout, file: BinaryIO | None = None
) -> bytes:
    """One states file from the servers' files (``parts[i]`` from server ``i``): its bytes,
    or written to ``file`` (then ``b""``). A row-sparse key's states from several servers
    are joined as they are written, never into arrays of their own."""
    saved = [decode_states(part) for part in parts]
    states: dict[Any, Any] = {}
    counts: dict[Any, int] = {}
    for key, (shape, pieces) in layout.items():
        size = int(np.prod(shape, dtype=np.int64))
        trees = [saved[server].states.get(key) for server, _, _ in pieces]
        if all(tree is None for tree in trees) and not any(
            key in saved[server].states for server, _, _ in pieces
        ):
            continue  # never updated: no state yet
        rows = [tree for tree in trees if isinstance(tree, RowStates)]
        if rows:
            states[key] = RowStates.join(rows)
        elif len(pieces) == 1:
            states[key] = trees[0]
        else:
            states[key] = _join(trees, shape, size)
        key_counts = [saved[server].index_update_counts.get(key, 0) for server, _, _ in pieces]
        counts[key] = max(key_counts)
    config = next((s.optimizer_config for s in saved if s.optimizer_config is not None), None)
    # What an optimizer keeps for all its keys together is each server's own (as each
    # MXNet server's optimizer keeps its own); the file holds the first server's.
    shared = next((s.shared_state for s in saved if s.shared_state), {})
    return encode_states(
        states,
        index_update_counts=counts,
        num_update=max((s.num_update for s in saved), default=0),
        optimizer_config=config,
        shared_state=shared,
        file=file,
    )


def split_server_states(data: bytes | BinaryIO, num_servers: int, layout: Layout) -> list[bytes]:
    """Each server's share of a states file.

    Raises
    ------
    StateFormatError
        When the file is not akv's format, or holds a key this store does not have.
    """
    saved = decode_states(data)
    shares: list[dict[Any, Any]] = [{} for _ in range(num_servers)]
    counts: list[dict[Any, int]] = [{} for _ in range(num_servers)]
    for key, tree in saved.states.items():
        if key not in layout:
            raise StateFormatError(
                f"optimizer states: key {key!r} in the file is not initialized in this store"
            )
        shape, pieces = layout[key]
        size = int(np.prod(shape, dtype=np.int64))
        for server, start, stop in pieces:
            if isinstance(tree, RowStates):
                shares[server][key] = tree.rows(start, stop)
            else:
                shares[server][key] = (
                    tree if len(pieces) == 1 else _cut(tree, shape, size, start, stop)
                )
            counts[server][key] = saved.index_update_counts.get(key, 0)
    return [
        encode_states(
            shares[i],
            index_update_counts=counts[i],
            num_update=saved.num_update,
            optimizer_config=saved.optimizer_config,
            shared_state=saved.shared_state,
        )
        for i in range(num_servers)
    ]
