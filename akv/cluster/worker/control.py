"""A worker's calls that speak to every server at once and carry no values of their own:
``set_optimizer``, ``save_optimizer_states`` and ``load_optimizer_states`` of a distributed
store, as engine tasks on the loop (the states file's split and merge:
:mod:`akv.cluster.worker.states_file`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from akv import optimizer as _optimizer
from akv.cluster.config import Timeouts
from akv.cluster.protocol import Op
from akv.cluster.worker.link import ServerLink
from akv.cluster.worker.states_file import send_states_file, write_states_file
from akv.keys import Entry
from akv_engine import Engine, Task
from akv_transport import Message

__all__ = ["ControlCalls"]


class ControlCalls:
    """The optimizer and its states, for one worker's distributed store.

    ``links`` gives the server links (known once the store joined the job). Each call is one
    engine task; those on states are ordered after the earlier calls on their keys.
    """

    def __init__(
        self, engine: Engine, links: Callable[[], Sequence[ServerLink]], timeouts: Timeouts
    ) -> None:
        self._engine = engine
        self._links = links
        self._timeouts = timeouts

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
