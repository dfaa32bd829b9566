"""A worker's share of ``save_optimizer_states`` and ``load_optimizer_states`` on a
distributed store: one states file, split among the servers by the keys' layouts
(:mod:`akv.cluster.states` decides the split and the merge)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from akv.cluster.protocol import Op
from akv.cluster.states import merge_server_states, split_server_states
from akv.cluster.worker.link import ServerLink
from akv.keys import Entry
from akv.optimizer._files import read_encoded, write_encoded
from akv_transport import Message

__all__ = ["send_states_file", "write_states_file"]


async def write_states_file(replies: Sequence[Message], entries: list[Entry], path: Path) -> None:
    """Merge every server's answer to ``SAVE_STATES`` into one file at ``path``.

    Raises
    ------
    StateFileError
        The file cannot be written.
    """
    parts = [memoryview(reply.buffers[0]).cast("B") for reply in replies]
    layout = {e.key: e.layout() for e in entries}

    def encode(file: BinaryIO) -> None:
        merge_server_states(parts, layout, file)

    await asyncio.to_thread(write_encoded, path, encode, "save_optimizer_states")


async def send_states_file(
    links: Sequence[ServerLink], entries: list[Entry], path: Path, timeout_s: float
) -> None:
    """Read the states file at ``path`` and send each server its share (``LOAD_STATES``).

    Raises
    ------
    StateFileError
        The file cannot be read, or does not fit the keys.
    """
    layout = {e.key: e.layout() for e in entries}

    def split(data: bytes | BinaryIO) -> list[bytes]:
        return split_server_states(data, len(links), layout)

    shares = await asyncio.to_thread(read_encoded, path, split, "load_optimizer_states")
    await asyncio.gather(
        *(
            link.request(
                Op.LOAD_STATES, [(None, np.frombuffer(share, np.uint8), 0)], timeout_s=timeout_s
            )
            for link, share in zip(links, shares, strict=True)
        )
    )
