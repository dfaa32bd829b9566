"""A worker's calls on row-sparse keys, as engine tasks: ``init``, ``push`` and
``row_sparse_pull`` of keys split by rows over every server (:mod:`akv.cluster.worker.rows`
decides what goes where).

Each call is one task on its keys' vars, so that per key the calls keep their order, and
each sends one request per server through the server links (resent after a reconnect,
with a deadline). A push is pipelined, as dense pushes are: its task ends once its requests
are sent (a pull sent after it follows it on each stream, and waits on the server for the
push's round); its answers are awaited by the next pull of its keys, by ``barrier`` and by
``close``, which raise a server's error. A pull ends once the rows landed in its outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from akv.cluster.config import Timeouts
from akv.cluster.placement import row_parts
from akv.cluster.protocol import Op
from akv.cluster.worker.calls import give_back_if_skipped
from akv.cluster.worker.link import ServerLink
from akv.cluster.worker.pipeline import late_error
from akv.cluster.worker.push_buffers import PushBuffers
from akv.cluster.worker.requests import WireArray
from akv.cluster.worker.rows import (
    init_check_text,
    init_requests,
    pull_requests,
    push_requests,
)
from akv.errors import AKVError
from akv.keys import Entry
from akv.limits import INIT_CHECK_MARGIN_S
from akv.rows import RowTable
from akv.sparse import RowIds, RowSparseArray
from akv_engine import Engine, Task
from akv_transport import Message, SharedMemory, StreamProtocol

__all__ = ["RowCalls"]

#: Who lent the memory a push's rows wait in.
Lender = SharedMemory | PushBuffers

#: Each server's request: its arrays and its text.
Requests = dict[int, tuple[list[WireArray], str]]


class RowCalls:
    """The row-sparse calls of one worker's distributed store.

    ``links`` gives the server links (known once the store joined the job).
    """

    def __init__(
        self,
        engine: Engine,
        links: Callable[[], Sequence[ServerLink]],
        timeouts: Timeouts,
        stream_of: Callable[[int], StreamProtocol | None] = lambda server: None,
        sync: bool = True,
        strict: bool = False,
    ) -> None:
        self._engine = engine
        self._sync = sync
        #: ``AKV_STRICT_PUSH``: a push's task ends once every server answered it, and
        #: raises a server's refusal itself.
        self._strict = strict
        #: dist_sync: per key, the servers pushed to since this worker last pulled from them.
        self._unpulled: dict[Any, set[int]] = {}
        self._links = links
        self._timeouts = timeouts
        self._stream_of = stream_of
        #: The answers of the pushes sent and not yet awaited, by key.
        self._unanswered: dict[Any, list[asyncio.Future[Message]]] = {}
        #: Each unanswered answer's push: the answers of all its servers (told once).
        self._push_of: dict[asyncio.Future[Message], tuple[asyncio.Future[Message], ...]] = {}
        #: Where pushed rows wait for their answers on streams without a shared arena.
        self.push_buffers = PushBuffers()

    def new_entry(self, key: Any, shape: tuple[int, ...], dtype: np.dtype) -> Entry:
        """A row-sparse key's entry: its parts are row ranges, one per server
        (:func:`~akv.cluster.placement.row_parts`); its table stays empty (the servers
        hold the rows; it marks the key row-sparse)."""
        var = self._engine.new_var(f"key {key!r}")
        entry = Entry(key, shape, dtype, var, row_parts(shape[0], len(self._links())))
        entry.rows = RowTable(shape, dtype)
        return entry

    def init(self, entries: list[Entry], values: list[RowSparseArray], rank: int) -> Task:
        """Rank 0 sends each server its rows of every key; every other worker checks with
        every server that its init agrees (shape, dtype, row-sparse) and waits for rank 0's."""
        writes = [entry.var for entry in entries]
        if rank == 0:
            return self._requests(Op.ROW_INIT, init_requests(entries, values), writes, "init")
        text = init_check_text(entries)
        timeout = self._timeouts.connect_s + INIT_CHECK_MARGIN_S
        requests: Requests = {server: ([], text) for server in range(len(self._links()))}
        return self._requests(Op.INIT_CHECK, requests, writes, "init", timeout_s=timeout)

    def push(self, values: list[tuple[Entry, RowSparseArray]], priority: int) -> Task:
        """Send each server the rows of its range (copied now), each key's push numbered
        (exactly once) by its task, in the order the pushes of a key run; done once the
        requests are sent (pipelined), or with ``strict`` (``AKV_STRICT_PUSH``) once every
        server answered, raising a server's refusal."""
        requests, placed = push_requests([(e, v, 0) for e, v in values], self._region)
        entries = [entry for entry, _ in values]
        task = self._engine.push(
            self._send_push,
            requests,
            entries,
            placed,
            writes=[entry.var for entry, _ in values],
            priority=priority,
            executor="loop",
            name="push",
        )
        if placed:
            task.on_done(give_back_if_skipped(partial(_give_back, placed)))
        return task

    def _region(self, server: int, nbytes: int) -> tuple[Lender, memoryview] | None:
        """Memory a push's rows to ``server`` wait in until answered, and who takes it back:
        a region of the shared arena of the stream to it where it takes them, else a
        reusable buffer of :attr:`push_buffers`; None when the server keeps copies past the
        answer (it writes checkpoints: see :meth:`DistBackend._stream_for_staging`) or
        the stream is down."""
        stream = self._stream_of(server)
        if stream is None:
            return None
        if stream.shared is not None:
            view = stream.shared.take(nbytes)
            if view is not None:
                return stream.shared, view
        return self.push_buffers, self.push_buffers.take(nbytes)

    async def _send_push(
        self,
        requests: dict[int, list[WireArray]],
        entries: list[Entry],
        placed: list[tuple[Lender, np.ndarray]],
    ) -> None:
        """Number a push (here, on the loop: a key's pushes run in the order of their
        numbers, whichever threads called them; a server takes a push numbered at or
        below one it counted for a resend) and send its requests now; their answers are
        awaited later (see the module). Rows placed in a stream's arena or a push buffer
        (``placed``) go back once every server answered (they are resent from there until
        then)."""
        numbers = {}
        for entry in entries:
            entry.pushes += 1
            numbers[entry.key] = entry.pushes
        keys = list(numbers)
        if self._sync:
            for key in keys:
                self._unpulled.setdefault(key, set()).update(requests)
        links = self._links()
        timeout = self._timeouts.request_s
        answers = [
            links[server].issue(
                Op.ROW_PUSH,
                [(key, array, numbers[key]) for key, array, _ in arrays],
                timeout_s=timeout,
            )
            for server, arrays in requests.items()
        ]
        for answer in answers:
            answer.add_done_callback(_retrieved)
        if placed:
            answered = asyncio.gather(*answers, return_exceptions=True)
            answered.add_done_callback(lambda _: _give_back(placed))
        push = tuple(answers)
        for answer in answers:
            self._push_of[answer] = push
        for key in keys:
            # Answers that came without an error need no settling: kept are those in
            # flight and the failed (so that pushes with no pull between stay bounded).
            kept = []
            for answer in self._unanswered.get(key, ()):
                if not _settled(answer):
                    kept.append(answer)
                else:
                    self._push_of.pop(answer, None)
            self._unanswered[key] = kept + answers
        if self._strict:
            error = await self.settle(keys)
            if error is not None:
                raise error

    def take_failed(self, keys: Sequence[Any]) -> AKVError | None:
        """The error of a push of one of ``keys`` that a server already refused (a
        ``DoublePushError``), named as an earlier push of its keys, once; None when none
        did. A call raises it at once instead of sending requests that would wait for a
        round the refused push never joined."""
        for key in keys:
            for answer in self._unanswered.get(key, ()):
                error = _outcome(answer) if answer.done() else None
                if isinstance(error, AKVError):
                    return late_error(error, self._forget(answer))
        return None

    def _forget(self, answer: asyncio.Future[Message]) -> list[Any]:
        """Drop ``answer``'s push, every server's answer of it, under every key (a push of
        several keys is kept under each: its error is told once); the keys it was kept for."""
        push = set(self._push_of.get(answer, (answer,)))
        keys = []
        for key, answers in list(self._unanswered.items()):
            kept = [a for a in answers if a not in push]
            if len(kept) < len(answers):
                keys.append(key)
                if kept:
                    self._unanswered[key] = kept
                else:
                    del self._unanswered[key]
        for dropped in push:
            self._push_of.pop(dropped, None)
        return keys

    async def settle(self, keys: list[Any] | None = None) -> AKVError | None:
        """Wait for the answers of the pushes sent so far (of ``keys``, or all); the first
        error a server answered with, if any (each error is told once)."""
        taken = set(self._unanswered) if keys is None else set(keys) & set(self._unanswered)
        answers = {id(a): a for key in taken for a in self._unanswered.pop(key)}
        if not answers:
            return None
        outcomes: list[object]
        try:
            if all(answer.done() for answer in answers.values()):
                outcomes = [_outcome(answer) for answer in answers.values()]
            else:
                outcomes = list(await asyncio.gather(*answers.values(), return_exceptions=True))
            for answer, outcome in zip(answers.values(), outcomes, strict=True):
                if isinstance(outcome, AKVError):
                    self._forget(answer)  # kept under the push's other keys too: told once
                    return outcome
                if isinstance(outcome, BaseException):
                    raise outcome
            return None
        finally:
            for answer in answers.values():
                self._push_of.pop(answer, None)

    def pull(
        self, pulls: list[tuple[Entry, RowIds, RowSparseArray]], result: object, priority: int
    ) -> Task:
        """Ask the servers that hold requested rows for them; each output is set to its ids
        and the rows that landed, and the task returns ``result``."""
        datas = [np.empty((len(ids), *entry.shape[1:]), entry.dtype) for entry, ids, _ in pulls]
        return self._engine.push(
            self._pull,
            pulls,
            datas,
            result,
            reads=[entry.var for entry, _, _ in pulls],
            priority=priority,
            executor="loop",
            name="row_sparse_pull",
        )

    async def _pull(
        self,
        pulls: list[tuple[Entry, RowIds, RowSparseArray]],
        datas: list[np.ndarray],
        result: object,
    ) -> object:
        keys = [entry.key for entry, _, _ in pulls]
        failed = self.take_failed(keys)
        if failed is not None:  # refused while this pull waited for its turn
            raise failed
        # dist_sync: a pull waits for the round of this worker's last push on every server
        # it went to, also those holding none of the rows asked for, so that a push after it
        # never reaches a server whose previous round still waits (a DoublePushError).
        # (Taken here, in the order the key's calls run, as the pushes' are noted.)
        waits = {key: self._unpulled[key] for key in keys if key in self._unpulled}
        wanted = pull_requests(
            [(entry, ids, data) for (entry, ids, _), data in zip(pulls, datas, strict=True)],
            waits,
        )
        for key in waits:  # (kept for the next pull when making the requests failed)
            del self._unpulled[key]
        links = self._links()
        timeout = self._timeouts.request_s
        answers = [
            links[server].issue(Op.ROW_PULL, arrays, timeout_s=timeout, destinations=landings)
            for server, arrays, landings in wanted
        ]
        # A push sent before this pull and refused after it was sent (a double push in
        # dist_sync) leaves the pull waiting on the server for a round the push never
        # joined, maybe for ever: the refusal ends the pull's wait instead.
        for key in keys:
            for push in self._unanswered.get(key, ()):
                if not push.done():
                    push.add_done_callback(partial(_end_on_refusal, answers))
        try:
            if len(answers) == 1:  # no gather: its callbacks cost the pull loop turns
                await answers[0]
            else:
                # Every server's answer first: a failed round on one server must not let a
                # later call (set_optimizer) reach another whose round still waits.
                outcomes = await asyncio.gather(*answers, return_exceptions=True)
                error = next((o for o in outcomes if isinstance(o, BaseException)), None)
                if error is not None:
                    raise error
        except AKVError:
            refused = self.take_failed(keys)
            if refused is None:
                raise
            for answer in answers:  # its answer, whenever it comes, is nobody's
                answer.add_done_callback(_retrieved)
            raise refused from None
        late = await self.settle(keys)
        if late is not None:
            raise late  # a push the pull follows failed: its rows may lack it
        for (entry, ids, out), data in zip(pulls, datas, strict=True):
            out._set(data, ids, entry.shape)
        return result

    def _requests(
        self,
        op: Op,
        requests: Requests,
        writes: list[Any],
        name: str,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> Task:
        """One request per server, as an engine task writing ``writes``."""
        return self._engine.push(
            self._send,
            op,
            requests,
            self._timeouts.request_s if timeout_s is None else timeout_s,
            writes=writes,
            priority=priority,
            executor="loop",
            name=name,
        )

    async def _send(self, op: Op, requests: Requests, timeout_s: float) -> None:
        links = self._links()
        await asyncio.gather(
            *(
                links[server].request(op, arrays, text=text, timeout_s=timeout_s)
                for server, (arrays, text) in requests.items()
            )
        )


def _outcome(answer: asyncio.Future[Message]) -> BaseException | None:
    """A settled answer's error (None for a reply), as ``gather(return_exceptions=True)``
    gives it."""
    return asyncio.CancelledError() if answer.cancelled() else answer.exception()


def _end_on_refusal(answers: list[asyncio.Future[Message]], push: asyncio.Future[Message]) -> None:
    """A push a pull followed was answered: if a server refused it, the pull's answers get
    the refusal (the pull raises the push's error, named as an earlier push of its keys)."""
    error = _outcome(push)
    if isinstance(error, AKVError):
        for answer in answers:
            if not answer.done():
                answer.set_exception(error)


def _give_back(placed: list[tuple[Lender, np.ndarray]]) -> None:
    """Give back the memory a push's rows waited in (an arena's region is free once no
    frame that carried it is unreleased)."""
    for lender, rows in placed:
        lender.give_back(rows)


def _retrieved(answer: asyncio.Future[Message]) -> None:
    """Mark a push's answer seen (its error is raised by whoever settles it)."""
    if not answer.cancelled():
        answer.exception()


def _settled(answer: asyncio.Future[Message]) -> bool:
    """Whether a push's answer came, without an error."""
    return answer.done() and not answer.cancelled() and answer.exception() is None
