"""A worker's calls that speak to every server at once outside the pipelined pushes and
pulls: ``init`` of dense keys, ``set_optimizer``, ``save_optimizer_states`` and
``load_optimizer_states`` of a distributed store, as engine tasks on the loop (the states
file's split and merge: :mod:`akv.cluster.worker.states_file`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.arrays import to_host
from akv.cluster.config import Timeouts
from akv.cluster.protocol import Op, encode_meta, split_dtype
from akv.cluster.worker.link import ServerLink
from akv.cluster.worker.requests import WireArray, by_server
from akv.cluster.worker.states_file import send_states_file, write_states_file
from akv.keys import Entry, Part
from akv.limits import INIT_CHECK_MARGIN_S
from akv_engine import Engine, Task
from akv_transport import Message

__all__ = ["ControlCalls"]


class ControlCalls:
    """Dense keys' inits, the optimizer and its states, for one worker's distributed store.

    ``links`` gives the server links (known once the store joined the job). Each call is one
    engine task; those on states are ordered after the earlier calls on their keys.
    """

    def __init__(
        self, engine: Engine, links: Callable[[], Sequence[ServerLink]], timeouts: Timeouts
    ) -> None:
        self._engine = engine
        self._links = links
        self._timeouts = timeouts

    def init(self, entries: list[Entry], arrays: list[np.ndarray], rank: int) -> Task:
        """Rank 0 sends each server its parts of the initial values (copied now); every
        other worker checks with the servers that its init agrees (shape, dtype) and waits
        for rank 0's."""
        writes = [e.var for e in entries]
        if rank == 0:
            copies = [np.ascontiguousarray(to_host(a)).copy() for a in arrays]
            return self._engine.push(
                self._init_values, entries, copies, writes=writes, executor="loop", name="init"
            )
        return self._engine.push(
            self._init_check, entries, writes=writes, executor="loop", name="init"
        )

    async def _init_values(self, entries: list[Entry], copies: list[np.ndarray]) -> None:
        batches = by_server(zip(entries, copies, strict=True), _part_of)
        timeout = self._timeouts.request_s
        # Each server is told the declared shape of the keys split over the servers (its
        # part is a flat slice), so that init checks and new jobs compare shapes, not sizes.
        split = [(e.key, e.shape, str(e.dtype)) for e in entries if len(e.parts) > 1]
        text = encode_meta(split) if split else ""
        links = self._links()
        await asyncio.gather(
            *(
                links[server].request(Op.INIT, arrays, text=text, timeout_s=timeout)
                for server, arrays in batches.items()
            )
        )

    async def _init_check(self, entries: list[Entry]) -> None:
        metas = by_server(((e, None) for e in entries), _meta_of)
        timeout = self._timeouts.connect_s + INIT_CHECK_MARGIN_S
        links = self._links()
        await asyncio.gather(
            *(
                links[server].request(Op.INIT_CHECK, text=encode_meta(items), timeout_s=timeout)
                for server, items in metas.items()
            )
        )

    def set_optimizer(self, optimizer: _optimizer.Optimizer, entries: list[Entry]) -> Task:
        """Send the optimizer's name and hyper-parameters (JSON) to every server, once the
        earlier pushes to ``entries`` are sent (the servers apply them under the optimizer
        they were pushed under), before later ones."""
        text = json.dumps(optimizer.get_config())
        return self._engine.push(
            self._to_all,
            Op.SET_OPTIMIZER,
            text,
            writes=[e.var for e in entries],
            executor="loop",
            name="set_optimizer",
        )

    def save_states(self, entries: list[Entry], path: Path, dump_optimizer: bool) -> Task:
        """Gather every server's optimizer states into one file (after earlier pushes)."""
        return self._engine.push(
            self._save_states,
            entries,
            path,
            dump_optimizer,
            reads=[e.var for e in entries],
            executor="loop",
            name="save_optimizer_states",
        )

    def load_states(self, entries: list[Entry], path: Path) -> Task:
        """Send each server its share of a states file (after earlier pushes, before later)."""
        return self._engine.push(
            self._load_states,
            entries,
            path,
            writes=[e.var for e in entries],
            executor="loop",
            name="load_optimizer_states",
        )

    async def _to_all(self, op: Op, text: str) -> list[Message]:
        timeout = self._timeouts.request_s
        return await asyncio.gather(
            *(link.request(op, text=text, timeout_s=timeout) for link in self._links())
        )

    async def _save_states(self, entries: list[Entry], path: Path, dump: bool) -> None:
        replies = await self._to_all(Op.SAVE_STATES, json.dumps({"dump_optimizer": dump}))
        await write_states_file(replies, entries, path)

    async def _load_states(self, entries: list[Entry], path: Path) -> None:
        await send_states_file(self._links(), entries, path, self._timeouts.request_s)


def _part_of(entry: Entry, part: Part, array: np.ndarray) -> WireArray:
    """A key's part of an init."""
    return (entry.key, entry.wire_view(array, part), entry.pushes)


def _meta_of(entry: Entry, part: Part, _: None) -> tuple[Key, tuple[int, ...], str]:
    if len(entry.parts) == 1:
        return (entry.key, entry.shape, str(entry.dtype))
    return (entry.key, (part.size,), split_dtype(entry.dtype, entry.shape))
