"""The worker side of ``dist_sync`` and ``dist_async`` stores.

A worker registers with the scheduler (which gives it its rank and the servers'
addresses), opens one framed stream to every server, and from then on turns each store
call into one engine task whose coroutine sends one request per server involved (many
keys in one call travel in one request per server; a split key's parts travel to all
servers at once) and waits for the answers. Pulled values are received straight into the
caller's output arrays. A thread of its own sends heartbeats, so a busy event loop is never
mistaken for a dead worker; when the scheduler reports the job failed, or a server's
stream breaks, every waiting call fails with an error naming the process involved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from akv.dist import config as _config
from akv.dist import protocol as proto
from akv import optimizer as _optimizer
from akv.dist.states import merge_server_states, split_server_states
from akv.keys import Entry, merge_into
from akv.dist.placement import Part, place
from akv.limits import (
    CONNECT_RETRY_S,
    GOODBYE_TIMEOUT_S,
    HEARTBEAT_REQUEST_INTERVALS,
    HEARTBEAT_STOP_S,
    MAX_PAYLOAD_BYTES,
    MIN_HEARTBEAT_REQUEST_S,
    SWEEP_INTERVAL_S,
)
from akv.dist.roles import client_ssl, scheduler_client
from akv.errors import (
    AKVError,
    AuthenticationError,
    BarrierTimeoutError,
    ConnectTimeoutError,
    InvalidArgumentError,
    PeerLostError,
    ServerError,
)
from engine import Engine, LoopThread, Task
from transport import (
    AuthError,
    FrameHeader,
    HttpClient,
    Message,
    RemoteError,
    StreamProtocol,
    TransportError,
    encode_frame,
    open_stream,
)

__all__ = ["DistBackend", "DistEntry"]

log = logging.getLogger("akv.dist")

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

class DistEntry(Entry):
    """A key as a worker knows it: where its parts live."""

    __slots__ = ("parts",)

    def __init__(
        self, key: Any, shape: tuple[int, ...], dtype: np.dtype, var: Any, parts: tuple[Part, ...]
    ) -> None:
        super().__init__(key, shape, dtype, var)
        self.parts = parts

    def wire_view(self, array: np.ndarray, part: Part) -> np.ndarray:
        """The piece of ``array`` (C-contiguous, the key's shape) that ``part`` covers."""
        if len(self.parts) == 1:
            return array
        return array.reshape(-1)[part.start : part.stop]


#: What a request's sender is told: ``on_reply(message, None)`` or ``on_reply(None, error)``.
OnReply = Callable[["Message | None", "AKVError | None"], None]


class _Request:
    __slots__ = ("deadline", "destinations", "on_reply", "op", "sizes")

    def __init__(
        self, on_reply: OnReply, destinations: list[memoryview | None], op: int, deadline: float
    ) -> None:
        self.on_reply = on_reply
        self.destinations = destinations
        self.sizes = [None if d is None else d.nbytes for d in destinations]
        self.op = op
        self.deadline = deadline


class _ServerLink:
    """The stream from this worker to one server, with requests matched to replies."""

    def __init__(
        self, rank: int, host: str, port: int, on_lost: Callable[[AKVError], None]
    ) -> None:
        self.rank = rank
        self._report_lost = on_lost
        self.name = f"server {rank} at {host}:{port}"
        self.host = host
        self.port = port
        self.protocol: StreamProtocol | None = None
        self._pending: dict[int, _Request] = {}
        self._seq = 0
        self.lost: AKVError | None = None
        self.closing = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def open(self, config: _config.Config, worker: int, store_type: str) -> None:
        self.loop = asyncio.get_running_loop()
        ssl_context = client_ssl(config)
        self.protocol = await open_stream(
            self.host,
            self.port,
            config.token,
            self._destinations,
            self._on_message,
            self._on_lost,
            ssl_context=ssl_context,
            timeout_s=config.timeouts.connect_s,
            max_payload_bytes=MAX_PAYLOAD_BYTES,
            client_id=f"{worker} {store_type}",
        )

    def _destinations(self, header: FrameHeader) -> list[memoryview | None]:
        request = self._pending.get(header.seq)
        if request is None or header.aux != proto.OK or len(header.arrays) != len(request.sizes):
            return [None] * len(header.arrays)
        if any(
            size is not None and size != info.nbytes
            for size, info in zip(request.sizes, header.arrays, strict=True)
        ):
            return [None] * len(header.arrays)
        return request.destinations

    def _on_message(self, message: Message) -> None:
        request = self._pending.pop(message.header.seq, None)
        if request is None:
            return
        status = message.header.aux
        if status != proto.OK:
            error = proto.error_from_status(status, message.header.text, self.name)
            request.on_reply(None, error)
            if isinstance(error, PeerLostError):  # the job failed: nothing more will work
                self._report_lost(error)
        elif request.sizes and (got := [i.nbytes for i in message.header.arrays]) != request.sizes:
            request.on_reply(
                None,
                ServerError(
                    f"{self.name} answered with arrays of {got} bytes, expected {request.sizes}",
                    server=self.name,
                ),
            )
        else:
            request.on_reply(message, None)

    def _on_lost(self, exc: BaseException | None) -> None:
        detail = f": {exc!r}" if exc else ""
        self.lost = PeerLostError(f"{self.name} closed the connection{detail} (did it die?)")
        self.fail_all(self.lost)
        if not self.closing:
            self._report_lost(self.lost)

    def fail_all(self, error: AKVError) -> None:
        pending, self._pending = self._pending, {}
        for request in pending.values():
            request.on_reply(None, error)

    def sweep(self, now: float) -> None:
        """Fail the requests whose deadline passed (one timer for all, not one per request)."""
        late = [seq for seq, request in self._pending.items() if request.deadline < now]
        for seq in late:
            request = self._pending.pop(seq)
            request.on_reply(
                None,
                ServerError(
                    f"{self.name} did not answer a {proto.OP_NAMES.get(request.op, request.op)} "
                    "request in time (AKV_REQUEST_TIMEOUT_S)",
                    server=self.name,
                ),
            )

    def send(
        self,
        op: int,
        arrays: Sequence[tuple[Any, np.ndarray, int]],
        on_reply: OnReply,
        *,
        text: str = "",
        destinations: list[memoryview | None] | None = None,
        timeout_s: float,
    ) -> None:
        """Send one request now; ``on_reply`` gets the reply or the error, exactly once.

        With ``destinations``, the reply's arrays are received straight into them. The
        deadline is enforced by :meth:`sweep`, which the backend runs periodically.
        """
        if self.lost is not None:
            on_reply(None, self.lost)
            return
        assert self.protocol is not None
        self._seq += 1
        seq = self._seq
        self._pending[seq] = _Request(
            on_reply, destinations or [], op, self.loop.time() + timeout_s
        )
        try:
            self.protocol.write(encode_frame(op, seq, arrays, text=text))
        except TransportError as exc:
            del self._pending[seq]
            on_reply(None, PeerLostError(f"{self.name}: cannot send ({exc})"))

    async def request(
        self,
        op: int,
        arrays: Sequence[tuple[Any, np.ndarray, int]] = (),
        *,
        text: str = "",
        timeout_s: float,
    ) -> Message:
        """:meth:`send` and wait for the reply (for the less frequent control requests)."""
        future: asyncio.Future[Message] = self.loop.create_future()

        def on_reply(message: Message | None, error: AKVError | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(message)  # type: ignore[arg-type]

        self.send(op, arrays, on_reply, text=text, timeout_s=timeout_s)
        return await future

    def close(self) -> None:
        self.closing = True
        if self.protocol is not None:
            self.protocol.close()


class _Heartbeat:
    """Tells the scheduler every interval that this worker lives, from a thread of its own."""

    def __init__(self, config: _config.Config, node_id: str, on_failure: Any) -> None:
        self._config = config
        self._node_id = node_id
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="akv-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        loop_thread = LoopThread(name="akv-heartbeat-loop")
        try:
            loop_thread.run(self._beat())
        except Exception as exc:  # reported, never swallowed: the store fails with it
            self._on_failure(f"the heartbeat to the scheduler failed: {exc!r}")
        finally:
            loop_thread.close()

    async def _beat(self) -> None:
        config = self._config
        client = scheduler_client(
            config,
            max(
                MIN_HEARTBEAT_REQUEST_S,
                config.timeouts.heartbeat_interval_s * HEARTBEAT_REQUEST_INTERVALS,
            ),
            retries=0,
        )
        answered = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    answer = await client.json("POST", "/v1/heartbeat", {"node_id": self._node_id})
                    answered = time.monotonic()
                    if answer.get("failure"):
                        self._on_failure(answer["failure"])
                        return
                except (TransportError, ValueError) as exc:
                    silent = time.monotonic() - answered
                    if silent > config.timeouts.heartbeat_timeout_s:
                        self._on_failure(
                            f"the scheduler at {config.scheduler_url} has not "
                            f"answered for {silent:.1f} s ({exc})"
                        )
                        return
                await asyncio.sleep(config.timeouts.heartbeat_interval_s)
        finally:
            await client.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._config.timeouts.heartbeat_interval_s + HEARTBEAT_STOP_S)


class DistBackend:
    """Runs a worker's store calls against the job's servers."""

    def __init__(self, engine: Engine, store_type: str, config: _config.Config) -> None:
        self._engine = engine
        self.type = store_type
        self.config = config
        self.num_workers = config.num_workers
        self.rank = -1
        self.node_id = uuid.uuid4().hex
        self.links: list[_ServerLink] = []
        self.broken: AKVError | None = None
        self._scheduler: HttpClient | None = None
        self._heartbeat: _Heartbeat | None = None
        self._barriers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------ joining the job

    async def connect(self) -> None:
        """Register, learn the servers, open a stream to each; all within the connect timeout.

        Raises
        ------
        ConnectTimeoutError
            Naming what was still missing when the deadline passed.
        AuthenticationError
            When the scheduler or a server refused the token.
        """
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._scheduler = scheduler_client(config, config.timeouts.request_s)
        deadline = time.monotonic() + config.timeouts.connect_s
        servers = await self._register(deadline)
        self.links = [_ServerLink(s["rank"], s["host"], s["port"], self.fail) for s in servers]
        for link in self.links:
            while True:
                try:
                    await link.open(config, self.rank, self.type)
                    break
                except AuthError as exc:
                    raise AuthenticationError(
                        f"{link.name} refused this job's token: {exc}"
                    ) from exc
                except RemoteError as exc:
                    raise ServerError(
                        f"{link.name} refused the stream: {exc}", server=link.name
                    ) from exc
                except TransportError as exc:
                    if time.monotonic() > deadline:
                        raise ConnectTimeoutError(
                            f"worker {self.rank} could not reach {link.name} within "
                            f"{config.timeouts.connect_s:g} s: {exc}"
                        ) from exc
                    await asyncio.sleep(CONNECT_RETRY_S)
        self._heartbeat = _Heartbeat(config, self.node_id, self._failed_from_thread)
        self._heartbeat.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = loop.time()
            for link in self.links:
                link.sweep(now)

    async def _register(self, deadline: float) -> list[dict[str, Any]]:
        config = self.config
        assert self._scheduler is not None
        body = {
            "node_id": self.node_id,
            "role": "worker",
            "rank": config.rank,
            "host": config.host,
            "port": 0,
            "pid": os.getpid(),
        }
        last_note = ""
        while True:
            try:
                answer = await self._scheduler.json("POST", "/v1/register", body)
            except AuthError as exc:
                raise AuthenticationError(f"the scheduler refused this job's token: {exc}") from exc
            except RemoteError as exc:
                raise _scheduler_error(exc) from exc
            except TransportError as exc:
                answer, note = (
                    None,
                    (f"the scheduler at {config.scheduler_url} is not reachable ({exc})"),
                )
            else:
                note = answer.get("waiting", "")
                self.rank = int(answer["rank"])
                body["rank"] = self.rank
                if "servers" in answer:
                    return list(answer["servers"])
            if time.monotonic() > deadline:
                raise ConnectTimeoutError(
                    f"worker gave up joining the job after {config.timeouts.connect_s:g} s: {note}"
                )
            if note != last_note:
                log.info("worker waiting: %s", note)
                last_note = note
            if answer is None:
                await asyncio.sleep(CONNECT_RETRY_S)

    def _failed_from_thread(self, reason: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.fail, PeerLostError(reason))

    def fail(self, error: AKVError) -> None:
        """The job failed: every waiting request and every later call raises ``error``."""
        if self.broken is None:
            self.broken = error
            log.error("worker %d: %s", self.rank, error)
        for link in self.links:
            link.fail_all(error)

    # ------------------------------------------------------------ keys

    def new_entry(self, key: Any, array: np.ndarray) -> DistEntry:
        if isinstance(key, int) and not INT64_MIN <= key <= INT64_MAX:
            raise InvalidArgumentError(
                f"init key {key}: int keys of a distributed store must fit in 64 bits"
            )
        parts = place(key, int(array.size), len(self.links), self.config.bigarray_bound)
        return DistEntry(
            key, tuple(array.shape), array.dtype, self._engine.new_var(f"key {key!r}"), parts
        )

    def placement(self, entries: list[DistEntry]) -> dict[Any, list[tuple[int, int, int]]]:
        """Each key's parts as (server rank, first element, end element)."""
        return {e.key: [(p.server, p.start, p.stop) for p in e.parts] for e in entries}

    def _timeout(self) -> float:
        return self.config.timeouts.request_s

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    # ------------------------------------------------------------ the work

    def init(self, entries: list[DistEntry], arrays: list[np.ndarray], executor: str) -> Task:
        """Rank 0 sends the initial values; the others check theirs agree and wait for them."""
        self._check()
        if self.rank == 0:
            copies = [np.ascontiguousarray(a).copy() for a in arrays]
            return self._engine.push(
                self._init_values,
                entries,
                copies,
                writes=[e.var for e in entries],
                executor="loop",
                name="init",
            )
        return self._engine.push(
            self._init_check, entries, writes=[e.var for e in entries], executor="loop", name="init"
        )

    async def _init_values(self, entries: list[DistEntry], copies: list[np.ndarray]) -> None:
        batches: dict[int, list[tuple[Any, np.ndarray, int]]] = {}
        for entry, copy in zip(entries, copies, strict=True):
            for part in entry.parts:
                batches.setdefault(part.server, []).append(
                    (entry.key, entry.wire_view(copy, part), 0)
                )
        await self._each(proto.INIT, batches)

    async def _init_check(self, entries: list[DistEntry]) -> None:
        metas: dict[int, list[tuple[Any, tuple[int, ...], str]]] = {}
        for entry in entries:
            for part in entry.parts:
                shape = entry.shape if len(entry.parts) == 1 else (part.size,)
                metas.setdefault(part.server, []).append((entry.key, shape, str(entry.dtype)))
        await asyncio.gather(
            *(
                self.links[server].request(
                    proto.INIT_CHECK,
                    text=proto.encode_meta(items),
                    timeout_s=self.config.timeouts.connect_s + 5,
                )
                for server, items in metas.items()
            )
        )

    async def _each(
        self, op: int, batches: dict[int, list[tuple[Any, np.ndarray, int]]]
    ) -> list[Message]:
        return await asyncio.gather(
            *(
                self.links[server].request(op, arrays, timeout_s=self._timeout())
                for server, arrays in batches.items()
            )
        )

    def set_updater(self, updater: Any) -> None:
        """Refuse: in a distributed store the servers apply updates (use set_optimizer)."""
        raise InvalidArgumentError(
            f"set_updater has no effect on a {self.type} store: the servers apply the updates; "
            "use set_optimizer (MXNet silently ignores the updater here)"
        )

    @staticmethod
    def _stage(
        values: list[tuple[DistEntry, list[np.ndarray]]], borrow: bool
    ) -> tuple[list[tuple[DistEntry, np.ndarray]], Callable[[], None]]:
        """What to send per key, and how to give the staging buffers back afterwards.

        ``borrow`` (the caller waits until the servers acknowledged): a key's single
        C-contiguous array is sent as it is, without a copy; otherwise the values are
        summed into a staging buffer now.
        """
        staged = []
        owned = []
        for entry, arrays in values:
            if borrow and len(arrays) == 1 and arrays[0].flags.c_contiguous:
                staged.append((entry, arrays[0]))
            else:
                buffer = merge_into(entry.take_buffer(), arrays)
                staged.append((entry, buffer))
                owned.append((entry, buffer))

        def release() -> None:
            for entry, buffer in owned:
                entry.give_buffer(buffer)

        return staged, release

    def push(
        self,
        values: list[tuple[DistEntry, list[np.ndarray]]],
        priority: int,
        executor: str,
        borrow: bool,
    ) -> Task:
        """Send summed values to the servers that hold each key (or each part)."""
        self._check()
        staged, release = self._stage(values, borrow)
        return self._engine.push(
            self._start_push,
            staged,
            release,
            writes=[e.var for e, _ in staged],
            priority=priority,
            executor="callback",
            name="push",
        )

    def _start_push(
        self, staged: list[tuple[DistEntry, np.ndarray]], release: Callable[[], None], done: Any
    ) -> None:
        batches: dict[int, list[tuple[Any, np.ndarray, int]]] = {}
        for entry, buffer in staged:
            for part in entry.parts:
                batches.setdefault(part.server, []).append(
                    (entry.key, entry.wire_view(buffer, part), 0)
                )

        gather = _Gather(len(batches), release, done)
        timeout = self._timeout()
        for server, arrays in batches.items():
            self.links[server].send(proto.PUSH, arrays, gather.reply, timeout_s=timeout)

    def pull(
        self,
        targets: list[tuple[DistEntry, list[np.ndarray]]],
        result: Any,
        priority: int,
        executor: str,
    ) -> Task:
        """Fetch each key's value (in dist_sync: after the round of this worker's last push)."""
        return self._schedule_pull(targets, result, None, _nothing, priority)

    def pushpull(
        self,
        values: list[tuple[DistEntry, list[np.ndarray]]],
        targets: list[tuple[DistEntry, list[np.ndarray]]],
        result: Any,
        priority: int,
        executor: str,
        borrow: bool,
    ) -> Task:
        """Push, then pull the result, in one request per server."""
        self._check()
        staged, release = self._stage(values, borrow)
        return self._schedule_pull(targets, result, staged, release, priority)

    def _schedule_pull(
        self,
        targets: list[tuple[DistEntry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[DistEntry, np.ndarray]] | None,
        release: Callable[[], None],
        priority: int,
    ) -> Task:
        """A pull reads the keys; a pushpull (with ``staged`` values) writes them."""
        self._check()
        key_vars = [e.var for e, _ in targets]
        return self._engine.push(
            self._start_pull,
            targets,
            result,
            staged,
            release,
            reads=key_vars if staged is None else (),
            writes=key_vars if staged is not None else (),
            priority=priority,
            executor="callback",
            name="pull" if staged is None else "pushpull",
        )

    def _start_pull(
        self,
        targets: list[tuple[DistEntry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[DistEntry, np.ndarray]] | None,
        release: Callable[[], None],
        done: Any,
    ) -> None:
        requests: dict[int, tuple[list[tuple[Any, np.ndarray, int]], list[memoryview]]] = {}
        landing: list[tuple[np.ndarray, list[np.ndarray], DistEntry]] = []
        pushed = {id(e): b for e, b in staged} if staged is not None else {}
        for entry, outs in targets:
            first = outs[0]
            receive = first if first.flags.c_contiguous else entry.take_buffer()
            landing.append((receive, outs, entry))
            for part in entry.parts:
                arrays, views = requests.setdefault(part.server, ([], []))
                if staged is not None:
                    arrays.append((entry.key, entry.wire_view(pushed[id(entry)], part), 0))
                else:
                    arrays.append((entry.key, np.empty(0, entry.dtype), 0))
                views.append(memoryview(entry.wire_view(receive, part)).cast("B"))

        def finish() -> Any:
            release()
            # The answers landed in ``receive`` (sizes checked); fill the other outputs.
            for receive, outs, entry in landing:
                for out in outs:
                    if out is not receive:
                        np.copyto(out, receive)
                if receive is not outs[0]:
                    entry.give_buffer(receive)
            return result

        gather = _Gather(len(requests), finish, done)
        op = proto.PULL if staged is None else proto.PUSHPULL
        timeout = self._timeout()
        for server, (arrays, views) in requests.items():
            self.links[server].send(op, arrays, gather.reply, destinations=views, timeout_s=timeout)

    def barrier(self) -> Task:
        """Wait until every worker called barrier as often as this one (with a deadline)."""
        self._check()
        self._barriers += 1
        return self._engine.push(self._barrier, self._barriers, executor="loop", name="barrier")

    async def _barrier(self, number: int) -> None:
        assert self._scheduler is not None
        deadline = time.monotonic() + self.config.timeouts.barrier_s
        while True:
            self._check()
            try:
                answer = await self._scheduler.json(
                    "POST", "/v1/barrier", {"node_id": self.node_id, "number": number}
                )
            except RemoteError as exc:
                raise _scheduler_error(exc) from exc
            except TransportError as exc:
                raise PeerLostError(f"the scheduler did not answer a barrier: {exc}") from exc
            if "passed" in answer:
                return
            if time.monotonic() > deadline:
                missing = tuple(answer.get("waiting", ()))
                raise BarrierTimeoutError(
                    f"barrier {number} timed out after {self.config.timeouts.barrier_s:g} s: "
                    f"workers {list(missing)} never arrived",
                    missing=missing,
                )

    def set_optimizer(self, optimizer: _optimizer.Optimizer) -> Task:
        """Send the optimizer's name and hyper-parameters (JSON) to every server."""
        self._check()
        text = json.dumps(optimizer.get_config())
        return self._engine.push(
            self._to_all, proto.SET_OPTIMIZER, text, executor="loop", name="set_optimizer"
        )

    async def _to_all(self, op: int, text: str) -> list[Message]:
        return await asyncio.gather(
            *(link.request(op, text=text, timeout_s=self._timeout()) for link in self.links)
        )

    def save_states(self, entries: list[DistEntry], path: Path, dump_optimizer: bool) -> Task:
        """Gather every server's optimizer states into one file (after earlier pushes)."""
        self._check()
        return self._engine.push(
            self._save_states,
            entries,
            path,
            dump_optimizer,
            reads=[e.var for e in entries],
            executor="loop",
            name="save_optimizer_states",
        )

    async def _save_states(self, entries: list[DistEntry], path: Path, dump: bool) -> None:
        text = json.dumps({"dump_optimizer": dump})
        replies = await self._to_all(proto.SAVE_STATES, text)
        parts = [bytes(reply.buffers[0]) for reply in replies]
        data = merge_server_states(
            parts,
            {e.key: (e.shape, [(p.server, p.start, p.stop) for p in e.parts]) for e in entries},
        )
        await asyncio.to_thread(path.write_bytes, data)

    def load_states(self, entries: list[DistEntry], path: Path) -> Task:
        """Send each server its share of a states file (after earlier pushes, before later)."""
        self._check()
        return self._engine.push(
            self._load_states,
            entries,
            path,
            writes=[e.var for e in entries],
            executor="loop",
            name="load_optimizer_states",
        )

    async def _load_states(self, entries: list[DistEntry], path: Path) -> None:
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise AKVError(f"load_optimizer_states: cannot read {str(path)!r}: {exc}") from exc
        shares = split_server_states(
            data,
            len(self.links),
            {e.key: (e.shape, [(p.server, p.start, p.stop) for p in e.parts]) for e in entries},
        )
        await asyncio.gather(
            *(
                link.request(
                    proto.LOAD_STATES,
                    [(None, np.frombuffer(share, np.uint8), 0)],
                    timeout_s=self._timeout(),
                )
                for link, share in zip(self.links, shares, strict=True)
            )
        )

    # ------------------------------------------------------------ leaving

    async def close(self, barrier_before_exit: bool) -> None:
        """Leave the job: barrier (if asked), say goodbye to each server and the scheduler.

        A store that never finished joining only releases what it holds.
        """
        if self._closed:
            return
        self._closed = True
        joined = self.rank >= 0 and bool(self.links) and self._heartbeat is not None
        try:
            if not joined:
                return
            if barrier_before_exit and self.broken is None:
                self._barriers += 1
                await self._barrier(self._barriers)
            if self.broken is None:
                await asyncio.gather(
                    *(
                        link.request(proto.CLOSE, timeout_s=GOODBYE_TIMEOUT_S)
                        for link in self.links
                        if link.lost is None
                    )
                )
                if self._scheduler is not None:
                    await self._scheduler.json("POST", "/v1/finish", {"node_id": self.node_id})
        finally:
            if self._sweeper is not None:
                self._sweeper.cancel()
            for link in self.links:
                link.close()
            if self._heartbeat is not None:
                await asyncio.to_thread(self._heartbeat.stop)
            if self._scheduler is not None:
                await self._scheduler.close()


class _Gather:
    """Waits for the replies of one call's requests (one per server), then reports once.

    ``finish()`` runs when the last reply is in, whatever happened (the buffers the
    requests sent may be reused from then on); its result is reported unless a request
    failed, in which case the first error is.
    """

    __slots__ = ("_done", "_error", "_finish", "_remaining")

    def __init__(self, count: int, finish: Callable[[], Any], done: Any) -> None:
        self._remaining = count
        self._finish = finish
        self._done = done
        self._error: BaseException | None = None

    def reply(self, message: Message | None, error: BaseException | None) -> None:
        if error is not None and self._error is None:
            self._error = error
        self._remaining -= 1
        if self._remaining:
            return
        try:
            result = self._finish()
        except Exception as exc:
            self._error = self._error or exc
        if self._error is not None:
            self._done(None, self._error)
        else:
            self._done(result, None)


def _nothing() -> None:
    return None


def _scheduler_error(exc: RemoteError) -> AKVError:
    if exc.status == 409:
        return PeerLostError(f"the scheduler refused: {exc}")
    return ServerError(f"the scheduler: {exc}", server="scheduler")
