"""A parameter server: holds its share of the keys, merges pushes, runs the optimizer.

Run it with ``akv-server`` (or ``python -m akv.server``), configured by the environment
or by flags (see ``docs/distributed.md``); akv-launch starts servers for you.

Each worker opens one framed stream to each server (an authenticated HTTP Upgrade, see
:mod:`transport`). Frames are received straight into the server's own buffers; the
decisions about rounds are :class:`~akv.dist.server.rounds.KeyRounds`'; the work on arrays (merging,
applying, sending) runs as engine tasks on each key's var, so that per key a merge, the
apply of its round and the pulls that read the result never overlap and keep their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from akv.dist import config as _config
from akv.dist import protocol as proto
from akv import optimizer as _optimizer
from akv.keys import Entry
from akv.dist.roles import run_role, scheduler_client, server_ssl
from akv.dist.server.rounds import KeyRounds
from akv.limits import (
    CONNECT_RETRY_S,
    GOODBYE_TIMEOUT_S,
    INLINE_MAX_BYTES,
    MAX_PAYLOAD_BYTES,
    ROUND_CHECK_INTERVAL_S,
    SERVER_ENGINE_SLOTS,
    SMALL_REPLY_BYTES,
)
from akv.errors import (
    AKVError,
    ConnectTimeoutError,
    DTypeMismatchError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    PeerLostError,
    RoundTimeoutError,
    ServerError,
    ShapeMismatchError,
    WaitTimeoutError,
)
from engine import Engine
from transport import (
    FrameError,
    FrameHeader,
    Message,
    RequestError,
    StreamProtocol,
    TransportError,
    create_app,
    decode_frame,
    encode_frame,
    frame_bytes,
    serve,
    stream_route,
)

__all__ = ["ParameterServer", "main"]

log = logging.getLogger("akv.dist.server")


class ServerEntry(Entry):
    """A key (or this server's part of a split key) as the server holds it."""

    __slots__ = ("merged", "rounds")

    def __init__(self, key: Any, value: np.ndarray, var: Any, rounds: KeyRounds) -> None:
        super().__init__(key, tuple(value.shape), value.dtype, var)
        self.value = value
        self.merged: np.ndarray | None = None
        self.rounds = rounds


@dataclass
class _Pull:
    """A pull (or the pull half of a pushpull) waiting for rounds to be applied."""

    link: _WorkerLink
    seq: int
    entries: list[ServerEntry]
    remaining: int = 0
    answered: bool = False


@dataclass
class _InitWait:
    link: _WorkerLink
    seq: int
    items: list[tuple[Any, tuple[int, ...], str]]
    deadline: float


@dataclass
class _Plan:
    """What to do with a frame's arrays, decided when its header arrived."""

    entries: list[ServerEntry | None] = field(default_factory=list)
    buffers: list[np.ndarray | None] = field(default_factory=list)
    error: AKVError | None = None


class ParameterServer:
    """One server of a job (see the module docstring)."""

    def __init__(self, config: _config.Config) -> None:
        self.config = config
        self.node_id = uuid.uuid4().hex
        self.rank: int | None = config.rank
        self.name = "server ?"
        self.engine = Engine(slots=SERVER_ENGINE_SLOTS, name="akv-server")
        self._loop_thread = threading.get_ident()
        self.entries: dict[Any, ServerEntry] = {}
        self.store_type: str | None = None
        self.updater: _optimizer.Updater | None = None
        self.optimizer_config: dict[str, Any] | None = None
        self.failure: str | None = None
        self.links: set[_WorkerLink] = set()
        self._init_waits: list[_InitWait] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.scheduler = scheduler_client(config, config.timeouts.request_s)
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The HTTP application: the stream route and a status page."""
        app = create_app(self.config.token, max_body_bytes=self.config.max_body_bytes)
        stream_route(app, self._open_link)
        app.router.add_post("/v1/frame", self._one_frame)
        app.router.add_get("/v1/status", self._status)
        return app

    async def start(self) -> int:
        """Listen, register with the scheduler; return the port."""
        config = self.config
        ssl_context = server_ssl(config)
        self._runner, self.port = await serve(
            self.app(), config.host, config.port, ssl_context=ssl_context
        )
        await self._register()
        log.info("%s listening on %s:%d", self.name, config.host, self.port)
        return self.port

    async def _register(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.timeouts.connect_s
        body = {
            "node_id": self.node_id,
            "role": "server",
            "rank": self.rank,
            "host": config.host,
            "port": self.port,
            "pid": os.getpid(),
            "wait": False,  # a server needs only its rank, not the whole address book
        }
        last_note = ""
        while True:
            try:
                answer = await self.scheduler.json("POST", "/v1/register", body)
            except TransportError as exc:
                answer, note = (
                    None,
                    f"the scheduler at {config.scheduler_url} is not reachable ({exc})",
                )
            else:
                note = answer.get("waiting", "")
            if answer is not None and "rank" in answer:
                # A server needs only its rank: workers find it through the address book.
                self.rank = int(answer["rank"])
                self.name = f"server {self.rank}"
                return
            if time.monotonic() > deadline:
                raise ConnectTimeoutError(
                    f"server gave up joining the job after {config.timeouts.connect_s:g} s: {note}"
                )
            if note != last_note:
                log.info("server waiting: %s", note)
                last_note = note
            await asyncio.sleep(CONNECT_RETRY_S if answer is None else 0.0)

    async def run(self) -> int:
        """Serve until the scheduler says stop; return 0, or 1 when the job failed."""
        if self._runner is None:
            await self.start()
        interval = self.config.timeouts.heartbeat_interval_s
        silent_since = time.monotonic()
        next_round_check = time.monotonic()
        try:
            while True:
                try:
                    answer = await self.scheduler.json(
                        "POST",
                        "/v1/heartbeat",
                        {"node_id": self.node_id},
                        timeout_s=max(interval * 5, 5.0),
                    )
                    silent_since = time.monotonic()
                except (TransportError, AKVError) as exc:
                    if time.monotonic() - silent_since > self.config.timeouts.heartbeat_timeout_s:
                        self._fail(
                            f"the scheduler at {self.config.scheduler_url} stopped "
                            f"answering ({exc})"
                        )
                        return 1
                    answer = {}
                if answer.get("failure") and self.failure is None:
                    self._fail(answer["failure"])
                if answer.get("stop"):
                    return 1 if self.failure else 0
                now = time.monotonic()
                if now >= next_round_check:
                    self._check_overdue(now)
                    next_round_check = now + ROUND_CHECK_INTERVAL_S
                await asyncio.sleep(min(interval, ROUND_CHECK_INTERVAL_S))
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Close every stream, the engine and the listener; tell the scheduler. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for link in list(self.links):
            link.protocol.close()
        with contextlib.suppress(TransportError, AKVError):  # it may be gone already
            await self.scheduler.json(
                "POST", "/v1/finish", {"node_id": self.node_id}, timeout_s=GOODBYE_TIMEOUT_S
            )
        await self.scheduler.close()
        await self.engine.aclose()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _fail(self, reason: str) -> None:
        """The job failed: answer every waiting pull with the reason."""
        if self.failure is None:
            self.failure = reason
            log.error("%s: the job failed: %s", self.name, reason)
        error = PeerLostError(reason)
        for entry in self.entries.values():
            for ticket in entry.rounds.take_waiting():
                self._fail_ticket(ticket, error)  # type: ignore[arg-type]
        for wait in self._init_waits:
            self._reply_error(wait.link, wait.seq, error)
        self._init_waits.clear()

    def _check_overdue(self, now: float) -> None:
        timeout = self.config.timeouts.round_s
        for entry in self.entries.values():
            rounds = entry.rounds
            if rounds.waiting_tickets() and rounds.overdue(now, timeout):
                error = RoundTimeoutError(
                    f"round {rounds.open_round} of key {entry.key!r} waited {timeout:g} s for "
                    f"pushes from workers {rounds.missing()}"
                )
                for ticket in rounds.take_waiting():
                    self._fail_ticket(ticket, error)  # type: ignore[arg-type]
        still = []
        for wait in self._init_waits:
            if now > wait.deadline:
                missing = [k for k, _, _ in wait.items if k not in self.entries]
                self._reply_error(
                    wait.link,
                    wait.seq,
                    WaitTimeoutError(
                        f"keys {missing} were not initialized by worker 0 within "
                        f"{self.config.timeouts.connect_s:g} s"
                    ),
                )
            else:
                still.append(wait)
        self._init_waits = still

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "rank": self.rank,
                "keys": len(self.entries),
                "store_type": self.store_type,
                "workers_connected": sorted(link.worker for link in self.links),
                "failure": self.failure,
                "engine": self.engine.statistics().__dict__,
            }
        )

    # ------------------------------------------------------------ streams

    def _client(self, request: web.Request) -> int:
        """The worker rank a request comes from (its store type must match the job's)."""
        client = request.headers.get(proto.CLIENT_HEADER, "")
        try:
            rank_text, store_type = client.split()
            worker = int(rank_text)
        except ValueError:
            raise RequestError(
                400, f"{proto.CLIENT_HEADER} must be '<rank> <store type>'"
            ) from None
        if not 0 <= worker < self.config.num_workers:
            raise RequestError(
                409, f"worker rank {worker} is out of range for {self.config.num_workers} workers"
            )
        if store_type not in ("dist_sync", "dist_async"):
            raise RequestError(400, f"unknown store type {store_type!r}")
        if self.store_type is None:
            self.store_type = store_type
        elif store_type != self.store_type:
            raise RequestError(
                409,
                f"worker {worker} opened a {store_type} store, but this "
                f"job's workers use {self.store_type}: every worker must "
                "create the same store type",
            )
        return worker

    async def _one_frame(self, request: web.Request) -> web.Response:
        """``POST /v1/frame``: one request frame in the body; the reply frame is the answer.

        A body that is not exactly one valid frame gets 400, one above the body limit 413.
        """
        worker = self._client(request)
        body = await request.read()
        try:
            header, buffers = decode_frame(body, max_payload_bytes=self.config.max_body_bytes)
        except FrameError as exc:
            raise RequestError(400, f"not a valid frame: {exc}") from None
        link = _OneShot(worker)
        plan = self.plan(link, header)  # type: ignore[arg-type]
        for buffer, target in zip(buffers, plan.buffers, strict=True):
            if target is not None:
                memoryview(target).cast("B")[:] = buffer
        self.handle(link, Message(header, tuple(buffers)), plan)  # type: ignore[arg-type]
        try:
            reply = await asyncio.wait_for(link.reply, self.config.timeouts.request_s)
        except asyncio.TimeoutError:
            raise RequestError(504, "no answer in time") from None
        return web.Response(body=reply, content_type="application/octet-stream")

    def _open_link(self, request: web.Request) -> StreamProtocol:
        worker = self._client(request)
        if any(link.worker == worker for link in self.links):
            raise RequestError(409, f"worker {worker} is already connected to {self.name}")
        link = _WorkerLink(self, worker)
        self.links.add(link)
        return link.protocol

    @property
    def sync(self) -> bool:
        return self.store_type != "dist_async"

    def _executor(self, entries: list[ServerEntry]) -> str:
        total = sum(entry.nbytes for entry in entries)
        return "inline" if total <= INLINE_MAX_BYTES else "thread"

    def _reply(self, link: _WorkerLink, seq: int, arrays: Sequence[Any] = ()) -> None:
        link.send(encode_frame(proto.REPLY, seq, arrays, aux=proto.OK))

    def _reply_error(self, link: _WorkerLink, seq: int, error: BaseException) -> None:
        text = str(error) if isinstance(error, AKVError) else f"{type(error).__name__}: {error}"
        link.send(encode_frame(proto.REPLY, seq, aux=proto.status_of(error), text=text))

    # -- deciding where payloads go (called when a header has arrived)

    def plan(self, link: _WorkerLink, header: FrameHeader) -> _Plan:
        plan = _Plan()
        if header.op == proto.INIT:
            for info in header.arrays:
                if info.key in self.entries:
                    plan.error = DuplicateInitError(
                        f"init key {info.key!r}: {self.name} already holds it", key=info.key
                    )
                plan.entries.append(None)
                plan.buffers.append(np.empty(info.shape, info.dtype))
            return plan
        if header.op in (proto.PUSH, proto.PUSHPULL):
            for info in header.arrays:
                entry = self.entries.get(info.key)
                buffer = None
                if entry is None:
                    plan.error = plan.error or KeyNotInitializedError(
                        f"push to key {info.key!r}: the key was never initialized", key=info.key
                    )
                elif info.shape != entry.shape:
                    plan.error = plan.error or ShapeMismatchError(
                        f"push to key {info.key!r}: shape {info.shape} does not match the "
                        f"stored shape {entry.shape} on {self.name}",
                        key=info.key,
                    )
                elif info.dtype != entry.dtype:
                    plan.error = plan.error or DTypeMismatchError(
                        f"push to key {info.key!r}: dtype {info.dtype} does not match the "
                        f"stored dtype {entry.dtype} on {self.name}",
                        key=info.key,
                    )
                else:
                    buffer = entry.take_buffer()
                plan.entries.append(entry)
                plan.buffers.append(buffer)
            return plan
        plan.entries = [None] * len(header.arrays)
        plan.buffers = [None] * len(header.arrays)
        return plan

    # -- acting on complete messages (called in arrival order, on the loop)

    def handle(self, link: _WorkerLink, message: Message, plan: _Plan | None) -> None:
        header = message.header
        try:
            if plan is not None and plan.error is not None:
                raise plan.error
            op = header.op
            if op in (proto.PUSH, proto.PUSHPULL):
                assert plan is not None
                self._push(link, header, plan)
            elif op == proto.PULL:
                self._pull(
                    link, header.seq, [self._entry(i.key, "pull from") for i in header.arrays]
                )
            elif op == proto.INIT:
                assert plan is not None
                self._init(link, header, plan)
            elif op == proto.INIT_CHECK:
                self._init_check(link, header.seq, proto.decode_meta(header.text))
            elif op == proto.SET_OPTIMIZER:
                self._set_optimizer(link, header.seq, header.text)
            elif op == proto.SAVE_STATES:
                self._save_states(link, header.seq, header.text)
            elif op == proto.LOAD_STATES:
                self._load_states(link, header.seq, bytes(message.buffers[0]))
            elif op == proto.CLOSE:
                link.goodbye = True
                self._reply(link, header.seq)
            else:
                raise InvalidArgumentError(f"unknown op {op}")
        except Exception as exc:
            if plan is not None:
                for entry, buffer in zip(plan.entries, plan.buffers, strict=True):
                    if entry is not None and buffer is not None:
                        entry.give_buffer(buffer)
            if not isinstance(exc, AKVError):
                log.exception("%s: request %s failed", self.name, proto.OP_NAMES.get(header.op))
                exc = ServerError(f"{type(exc).__name__}: {exc}")
            self._reply_error(link, header.seq, exc)

    def _entry(self, key: Any, what: str) -> ServerEntry:
        entry = self.entries.get(key)
        if entry is None:
            raise KeyNotInitializedError(
                f"{what} key {key!r}: the key was never initialized (on {self.name})", key=key
            )
        return entry

    def _init(self, link: _WorkerLink, header: FrameHeader, plan: _Plan) -> None:
        for info, buffer in zip(header.arrays, plan.buffers, strict=True):
            rounds = KeyRounds(info.key, self.config.num_workers, self.sync)
            self.entries[info.key] = ServerEntry(
                info.key, buffer, self.engine.new_var(f"key {info.key!r}"), rounds
            )  # type: ignore[arg-type]
        self._reply(link, header.seq)
        self._release_init_waits()

    def _init_check(
        self, link: _WorkerLink, seq: int, items: list[tuple[Any, tuple[int, ...], str]]
    ) -> None:
        for key, shape, dtype in items:
            entry = self.entries.get(key)
            if entry is None:
                continue
            if entry.shape != shape or str(entry.dtype) != dtype:
                raise ShapeMismatchError(
                    f"init key {key!r} on worker {link.worker}: shape {shape} and dtype {dtype} "
                    f"differ from worker 0's {entry.shape} {entry.dtype}",
                    key=key,
                )
        deadline = time.monotonic() + self.config.timeouts.connect_s
        self._init_waits.append(_InitWait(link, seq, items, deadline))
        self._release_init_waits()

    def _release_init_waits(self) -> None:
        still = []
        for wait in self._init_waits:
            if all(key in self.entries for key, _, _ in wait.items):
                try:
                    self._init_check_done(wait)
                except AKVError as exc:
                    self._reply_error(wait.link, wait.seq, exc)
            else:
                still.append(wait)
        self._init_waits = still

    def _init_check_done(self, wait: _InitWait) -> None:
        for key, shape, dtype in wait.items:
            entry = self.entries[key]
            if entry.shape != shape or str(entry.dtype) != dtype:
                raise ShapeMismatchError(
                    f"init key {key!r} on worker {wait.link.worker}: shape {shape} and dtype "
                    f"{dtype} differ from worker 0's {entry.shape} {entry.dtype}",
                    key=key,
                )
        self._reply(wait.link, wait.seq)

    def _push(self, link: _WorkerLink, header: FrameHeader, plan: _Plan) -> None:
        """Count a frame's pushes, then merge (and apply) them in one engine task each."""
        entries: list[ServerEntry] = plan.entries  # type: ignore[assignment]
        worker = link.worker
        for entry in entries:
            entry.rounds.check_push(worker)  # all or nothing: a refused frame changes nothing
        now = time.monotonic()
        merges = []
        closing = []
        for entry, buffer in zip(entries, plan.buffers, strict=True):
            decision = entry.rounds.accept_push(worker, now)
            if self.sync:
                merges.append((entry, buffer, decision.first))
                if decision.closes:
                    closing.append((entry, None, decision.round))
            else:
                closing.append((entry, buffer, decision.round))
        self.engine.push(
            self._land,
            merges,
            closing,
            writes=[e.var for e in entries],
            executor=self._executor(entries),
            name="push",
        )
        if header.op == proto.PUSHPULL:
            self._pull(link, header.seq, entries)
        else:
            self._reply(link, header.seq)

    def _land(
        self,
        merges: list[tuple[ServerEntry, np.ndarray, bool]],
        closing: list[tuple[ServerEntry, np.ndarray | None, int]],
    ) -> None:
        """A frame's pushes: merge them into their rounds, then apply the rounds they close."""
        if merges:
            _merge(merges)
        if closing:
            self._apply(closing)

    def _apply(self, items: list[tuple[ServerEntry, np.ndarray | None, int]]) -> None:
        """Apply rounds' sums (sync: the merge buffers; async: the pushed buffers)."""
        updater = self.updater
        done = []
        for entry, buffer, round_no in items:
            received = entry.merged if buffer is None else buffer
            entry.merged = None
            try:
                if updater is None:
                    old = entry.value
                    entry.value = received
                    entry.give_buffer(old)  # type: ignore[arg-type]
                else:
                    updater(entry.key, received, entry.value)
                    entry.give_buffer(received)  # type: ignore[arg-type]
            except Exception as exc:
                self.on_loop(self._apply_failed, entry, round_no, exc)
            else:
                done.append((entry, round_no))
        if done:
            self.on_loop(self._applied, done)

    def _applied(self, done: list[tuple[ServerEntry, int]]) -> None:
        for entry, round_no in done:
            for ticket in entry.rounds.applied(round_no):
                ticket.remaining -= 1  # type: ignore[attr-defined]
                if ticket.remaining == 0:  # type: ignore[attr-defined]
                    self._send_values(ticket)  # type: ignore[arg-type]

    def _apply_failed(self, entry: ServerEntry, round_no: int, exc: Exception) -> None:
        log.error(
            "%s: the update of key %r (round %d) failed: %r", self.name, entry.key, round_no, exc
        )
        error = ServerError(
            f"the update of key {entry.key!r} in round {round_no} failed on "
            f"{self.name}: {type(exc).__name__}: {exc}"
        )
        for ticket in entry.rounds.applied(round_no):
            self._fail_ticket(ticket, error)  # type: ignore[arg-type]

    def _pull(self, link: _WorkerLink, seq: int, entries: list[ServerEntry]) -> None:
        ticket = _Pull(link, seq, entries)
        for entry in entries:
            if not entry.rounds.pull(entry.rounds.last_push_round(link.worker), ticket):
                ticket.remaining += 1
        if ticket.remaining == 0:
            self._send_values(ticket)

    def _fail_ticket(self, ticket: _Pull, error: AKVError) -> None:
        if not ticket.answered:
            ticket.answered = True
            self._reply_error(ticket.link, ticket.seq, error)

    def _send_values(self, ticket: _Pull) -> None:
        if ticket.answered:
            return
        ticket.answered = True
        reads = [e.var for e in ticket.entries]
        if sum(e.nbytes for e in ticket.entries) <= SMALL_REPLY_BYTES:
            self.engine.push(
                self._send_copy, ticket, reads=reads, executor="inline", no_skip=True, name="send"
            )
        else:
            self.engine.push(
                _send_held, ticket, reads=reads, executor="callback", no_skip=True, name="send"
            )

    def _send_copy(self, ticket: _Pull) -> None:
        """Answer a small pull with a copy of the values (no need to hold them until sent)."""
        arrays = [(e.key, e.value, e.rounds.applied_round) for e in ticket.entries]
        self.on_loop(ticket.link.send, [frame_bytes(proto.REPLY, ticket.seq, arrays, aux=proto.OK)])

    def on_loop(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the server's loop: now if this is its thread, else soon."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self.engine.loop.call_soon_threadsafe(fn, *args)

    # -- control

    def _set_optimizer(self, link: _WorkerLink, seq: int, text: str) -> None:
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"optimizer configuration is not JSON: {exc}") from None
        optimizer = _optimizer.from_config(config)
        if self.optimizer_config == config:
            self._reply(link, seq)  # every worker sends it; the same one again changes nothing
            return
        vars_ = [e.var for e in self.entries.values()]

        def install() -> None:
            previous = self.updater
            if previous is not None and previous.optimizer.get_config()["name"] == config.get(
                "name"
            ):
                # The same optimizer with new hyper-parameters: states and counts carry on.
                current = previous.optimizer
                optimizer.restore_update_counts(current.index_update_counts, current.num_update)
                previous.optimizer = optimizer
            else:
                self.updater = _optimizer.get_updater(optimizer)
            self.optimizer_config = config

        self._after(
            self.engine.push(install, writes=vars_, executor="inline", name="set_optimizer"),
            link,
            seq,
        )

    def _save_states(self, link: _WorkerLink, seq: int, text: str) -> None:
        try:
            dump = bool(json.loads(text or "{}").get("dump_optimizer", False))
        except (ValueError, AttributeError) as exc:
            raise InvalidArgumentError(f"malformed save_states request: {exc}") from None
        if self.updater is None:
            raise AKVError(f"save_optimizer_states: no optimizer is set on {self.name}")
        updater = self.updater

        def dump_states() -> np.ndarray:
            return np.frombuffer(updater.dump_states(dump), np.uint8)

        task = self.engine.push(
            dump_states, reads=[e.var for e in self.entries.values()], name="save_states"
        )
        self._after(task, link, seq, with_result=True)

    def _load_states(self, link: _WorkerLink, seq: int, data: bytes) -> None:
        if self.updater is None:
            raise AKVError(f"load_optimizer_states: no optimizer is set on {self.name}")
        updater = self.updater
        task = self.engine.push(
            updater.load_states,
            data,
            writes=[e.var for e in self.entries.values()],
            name="load_states",
        )
        self._after(task, link, seq)

    def _after(self, task: Any, link: _WorkerLink, seq: int, with_result: bool = False) -> None:
        """Answer ``seq`` when ``task`` completes (with its result array, if asked)."""

        async def answer() -> None:
            try:
                result = await task
            except Exception as exc:
                self._reply_error(
                    link,
                    seq,
                    exc
                    if isinstance(exc, AKVError)
                    else ServerError(f"{type(exc).__name__}: {exc}"),
                )
                return
            self._reply(link, seq, [(None, result, 0)] if with_result else ())

        asyncio.get_running_loop().create_task(answer())

    def link_lost(self, link: _WorkerLink, exc: BaseException | None) -> None:
        self.links.discard(link)
        if link.goodbye or self._stopping:
            return
        detail = (
            f"its stream to {self.name} ended ({exc!r})"
            if exc
            else f"its stream to {self.name} ended without a goodbye"
        )
        log.error("worker %d vanished: %s", link.worker, detail)
        self._fail(
            f"worker {link.worker} disconnected from {self.name} without closing its "
            f"store: {detail}"
        )

        async def report() -> None:
            try:
                await self.scheduler.json(
                    "POST",
                    "/v1/lost",
                    {
                        "reporter": self.name,
                        "role": "worker",
                        "rank": link.worker,
                        "detail": detail,
                    },
                )
            except (TransportError, AKVError) as error:
                log.error("could not tell the scheduler: %s", error)

        asyncio.get_running_loop().create_task(report())


def _merge(items: list[tuple[ServerEntry, np.ndarray, bool]]) -> None:
    """Start each round's sum with its first push, or add a later push to it."""
    for entry, buffer, first in items:
        if first:
            entry.merged = buffer
        else:
            np.add(entry.merged, buffer, out=entry.merged)
            entry.give_buffer(buffer)


def _send_held(ticket: _Pull, done: Any) -> None:
    """Answer a pull from the stored arrays themselves (no copy), holding their vars for
    reading (this task runs until ``done``) until the kernel has taken every byte."""
    link = ticket.link
    if link.closing:
        done(None, None)
        return
    arrays = [(e.key, e.value, e.rounds.applied_round) for e in ticket.entries]
    link.send(encode_frame(proto.REPLY, ticket.seq, arrays, aux=proto.OK))
    link.when_drained(lambda _: done(None, None))  # a lost stream ends the task as well


class _WorkerLink:
    """One worker's stream to this server."""

    def __init__(self, server: ParameterServer, worker: int) -> None:
        self.server = server
        self.worker = worker
        self.goodbye = False
        self._plans: dict[int, _Plan] = {}
        self.protocol = StreamProtocol(
            self._destinations,
            self._on_message,
            self._on_lost,
            max_payload_bytes=MAX_PAYLOAD_BYTES,
        )

    @property
    def closing(self) -> bool:
        return self.protocol.closing

    def when_drained(self, callback: Any) -> None:
        self.protocol.when_drained(callback)

    def _destinations(self, header: FrameHeader) -> list[memoryview | None]:
        plan = self.server.plan(self, header)
        self._plans[header.seq] = plan
        return [None if b is None else memoryview(b).cast("B") for b in plan.buffers]

    def _on_message(self, message: Message) -> None:
        plan = self._plans.pop(message.header.seq, None)
        self.server.handle(self, message, plan)

    def _on_lost(self, exc: BaseException | None) -> None:
        self.server.link_lost(self, exc)

    def send(self, buffers: list[Any]) -> None:
        if not self.protocol.closing:
            self.protocol.write(buffers)


class _OneShot:
    """A single frame that came in an HTTP body (``POST /v1/frame``); the reply goes back
    as the response body."""

    goodbye = True  # nothing to notice when it ends
    closing = False

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def send(self, buffers: list[Any]) -> None:
        if not self.reply.done():
            self.reply.set_result(b"".join(bytes(b) for b in buffers))

    def when_drained(self, callback: Any) -> None:
        callback(None)


# ---------------------------------------------------------------------- command line


async def run_server(config: _config.Config) -> int:
    """Run one server until the job ends; return the exit status."""
    server = ParameterServer(config)
    try:
        await server.start()
    except AKVError as exc:
        log.error("%s", exc)
        await server.stop()
        return 1
    return await server.run()


def main(argv: Sequence[str] | None = None) -> int:
    """``akv-server``: run one parameter server; exit 0 when the job ended well."""
    return run_role("server", argv, "Run one parameter server of an akv job.", run_server)


