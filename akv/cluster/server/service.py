"""A parameter server's I/O: the HTTP app, the workers' streams, the engine, the scheduler.

Run it with ``akv-server`` (or ``python -m akv.cluster.server``: :mod:`.command`),
configured by the environment or by flags (see ``docs/distributed.md``); akv-launch starts
servers for you.

Every decision is :class:`~akv.cluster.server.state.ServerState`'s: this module feeds it
events (a header or a whole frame arrived, a stream ended, array work finished, the clock
ticked, the scheduler reported a failure) and carries out the instructions it returns.
Array work (merging, applying, answering pulls) runs as engine tasks on each key's var, so
that per key a merge, the apply of its round and the pulls that read the result never
overlap and keep their order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from akv import jit
from akv.cluster.config import Config, format_address
from akv.cluster.membership import Membership
from akv.cluster.metrics import observe
from akv.cluster.protocol import (
    CLIENT_HEADER,
    COUNTED,
    DURABLE_HEADER,
    JOB_FAILED_EXIT,
    OK,
    REPLAY_HEADER,
    STALENESS_HEADER,
    STOPPING_STATUS,
    Op,
    format_note,
    parse_client_header,
    parse_note,
    parse_replay,
    parse_staleness,
    status_of,
)
from akv.cluster.roles import listen, stopped_by_signal
from akv.cluster.server.buffers import Landing
from akv.cluster.server.checkpointing import (
    Checkpoints,
    Copied,
    copy_plan,
)
from akv.cluster.server.instructions import (
    Checkpoint,
    CheckpointPlan,
    CloseStream,
    Durable,
    FailJob,
    InstallOptimizer,
    Instruction,
    Land,
    LandRows,
    LoadStates,
    Peer,
    PullTicket,
    Reply,
    ReplyError,
    RowEntry,
    RowPullTicket,
    SaveStates,
    SendRows,
    SendValues,
    ServerEntry,
    StaleCheckpointError,
)
from akv.cluster.server.links import Link, OneShotLink, StreamLink
from akv.cluster.server.metrics import ServerMetrics
from akv.cluster.server.report import heartbeat_report, unclosed_rounds
from akv.cluster.server.row_keys import gather_rows, land_rows
from akv.cluster.server.state import ServerState
from akv.cluster.server.updates import land, split_add
from akv.errors import (
    AKVError,
    InvalidArgumentError,
    MembershipError,
    PeerLostError,
)
from akv.limits import (
    DRAIN_S,
    ROUND_CHECK_INTERVAL_S,
    SERVER_ENGINE_SLOTS,
    STAGED_REPLY_MIN_BYTES,
    STARTUP_MARGIN_S,
)
from akv_engine import Engine
from akv_transport import (
    FrameError,
    LocalSite,
    Message,
    RequestError,
    SharedMemory,
    StreamProtocol,
    TransportError,
    app_instance,
    byte_view,
    create_app,
    decode_frame,
    encode_frame,
    frame_bytes,
    remove_leftovers,
    serve_local,
    stream_route,
)

__all__ = ["ParameterServer"]

log = logging.getLogger("akv.cluster.server")


class ParameterServer:
    """One server of a job (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine = Engine(slots=SERVER_ENGINE_SLOTS, name="akv-server")
        directory = config.checkpoint_dir
        checkpoints = directory is not None
        self.membership = Membership(config, "server", uuid.uuid4().hex, restartable=checkpoints)
        self.state = ServerState(
            "server ?",
            config.num_workers,
            config.timeouts.connect_s,
            self.engine.new_var,
            reconnect_s=config.timeouts.reconnect_s,
            checkpoints=checkpoints,
            silent_reconnect_s=config.timeouts.silent_reconnect_s,
            server_id=self.membership.node_id,
        )
        #: Writes this server's checkpoints (None: it writes none).
        self.checkpoints: Checkpoints | None = None
        if directory is not None:
            assert config.rank is not None  # from_env: checkpoints need a fixed rank
            self.checkpoints = Checkpoints(
                self.state,
                self,
                directory=Path(directory),
                rank=config.rank,
                num_workers=config.num_workers,
                interval_s=config.checkpoint_interval_s,
                num_servers=config.num_servers,
                accept_mixed_restore=config.accept_mixed_restore,
            )
        self.metrics = ServerMetrics(self)
        self.links: dict[int, Link] = {}
        #: The port this server listens on, and the ``(host, port)`` the scheduler gives the
        #: workers for it (``AKV_ADVERTISE``; by default the bound host and port).
        self.port = 0
        self.advertised = (config.host, 0)
        self._loop_thread = threading.get_ident()
        self._runner: web.AppRunner | None = None
        #: The private Unix socket for workers on this host (None: TCP only).
        self._local: LocalSite | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Adds the second half of a large sum (:meth:`_add`); its thread starts on first use.
        self._adder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="akv-add")
        #: Stopped by a signal with a checkpoint written: a restart takes its rank over.
        self._awaits_restart = False
        self._every_worker_left = asyncio.Event()
        self._stopping: asyncio.Future[None] | None = None

    @property
    def rank(self) -> int | None:
        """This server's rank (None until the scheduler gave it one)."""
        return self.membership.rank

    @property
    def name(self) -> str:
        """``"server <rank>"``, as messages name it."""
        return self.state.name

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The HTTP application: the stream route, one-frame requests, a status page, the
        metrics and the health probes (:mod:`akv.cluster.health`)."""
        app = create_app(self.config.token, max_body_bytes=self.config.max_body_bytes)
        self.membership.instance = app_instance(app)  # (workers sign their streams for it)
        stream_route(app, self._open_stream)
        app.router.add_post("/v1/frame", self._one_frame)
        app.router.add_get("/v1/status", self._status)
        observe(app, self.metrics.process, self.metrics.readiness)
        return app

    async def start(self) -> int:
        """Listen, register with the scheduler (which gives the workers the advertised
        address); return the bound port."""
        self._loop_thread = threading.get_ident()
        config = self.config
        self._runner, self.port = await listen(
            self.app(),
            config,
            config.host,
            config.port,
            setting="AKV_PORT",
            advice="give each server of a host its own port (or 0 for any free one)",
        )
        self.advertised = config.advertised(self.port)
        if config.shm:
            remove_leftovers()  # of servers on this host killed by SIGKILL
            self._local = await serve_local(
                self._runner,
                config.token,
                arena_bytes=config.shm_arena_bytes,
                idle_timeout_s=config.timeouts.idle_s,
            )
            self.membership.local = {"host": config.host_id, "path": self._local.path}
            # Sums kept where the local streams send from: answered without a copy.
            self.state.value_regions = self._local.book
        if self.checkpoints is not None:
            self.checkpoints.restore()  # before registering: workers resend what it lacks
            self.membership.restored = self.checkpoints.restored
        deadline = time.monotonic() + config.timeouts.connect_s
        joined = await self.membership.register(self.port, deadline)
        if self.checkpoints is not None:
            self.checkpoints.joined(restart=joined.get("restart") is True)
        self.state.name = f"server {self.rank}"
        # A restarted server waits for no worker that closed its store to come back.
        finished = joined.get("finished")
        if isinstance(finished, list) and all(type(rank) is int for rank in finished):
            self.execute(self.state.workers_finished(finished))
        bound, advertised = format_address(config.host, self.port), format_address(*self.advertised)
        also = "" if advertised == bound else f", advertised as {advertised}"
        log.info("%s listening on %s%s", self.name, bound, also)
        return self.port

    async def run(self) -> int:
        """Serve until the scheduler says stop; return 0, or :data:`JOB_FAILED_EXIT` when
        the job failed (or never assembled: see :meth:`_await_job`)."""
        if self._runner is None:
            await self.start()
        gave_up = asyncio.Event()
        background = [
            self._spawn(self._tick(), "the round deadline check"),
            self._spawn(self._await_job(gave_up), "waiting for the job to assemble"),
        ]
        if self.checkpoints is not None:
            timer = self.checkpoints.every_interval()
            background.append(self._spawn(timer, "the checkpoint timer"))
        try:
            loop = asyncio.get_running_loop()
            report = lambda: heartbeat_report(self.state, loop.time())  # noqa: E731
            stopped = await self.membership.heartbeats(
                self._job_failed, gave_up.is_set, report, self._every_worker_left
            )
            ok = stopped and self.state.failure is None and not gave_up.is_set()
            if self.checkpoints is not None:  # a failed job too: a new one starts from it
                await self.checkpoints.final()
        except asyncio.CancelledError as exc:
            for task in background:  # (no interval checkpoint competes with the final one)
                task.cancel()
            if not (stopped_by_signal(exc) and await self._stopped_by_signal()):
                raise
            ok = True  # a signal once every worker finished fails nothing
        finally:
            for task in background:
                task.cancel()
            try:
                await self.stop()
            except asyncio.CancelledError as exc:  # a signal as it stops: the stop goes on
                if not stopped_by_signal(exc):
                    raise
                await self.stop()
        if ok:
            unclosed = unclosed_rounds(self.state)
            if unclosed is not None:  # (uneven pushes: MXNet drops them without a word)
                log.warning("%s: %s", self.name, unclosed)
            log.info("%s: the job ended well; stopping", self.name)
        return 0 if ok else JOB_FAILED_EXIT

    async def _stopped_by_signal(self) -> bool:
        """SIGTERM or Ctrl-C: the work in flight gets :data:`DRAIN_S` to finish, and a final
        checkpoint is written (when this server writes them). True when the job had ended
        well (the scheduler says stop); else it is told, and the job fails naming this
        server and why (or, one that writes checkpoints, waits for its restart)."""
        with contextlib.suppress(asyncio.TimeoutError, TransportError, AKVError):
            await asyncio.wait_for(self.engine.wait_all(), DRAIN_S)
        if self.checkpoints is not None:
            await self.checkpoints.final()
        ended = self.state.failure is None and await self.membership.job_ended(DRAIN_S)
        if self.checkpoints is not None:
            self._awaits_restart = not ended  # no goodbye: the scheduler waits for its restart
        if ended or self.checkpoints is not None:
            return ended
        rank = self.rank if self.rank is not None else -1
        where = format_address(*self.advertised)
        detail = f"at {where} was stopped by a signal (SIGTERM or Ctrl-C)"
        with contextlib.suppress(asyncio.TimeoutError, TransportError, AKVError, ValueError):
            # Reported by itself: the scheduler names it as stopping, not as lost.
            report = self.membership.report_lost(self.membership.node_id, "server", rank, detail)
            await asyncio.wait_for(report, DRAIN_S)
        return False

    async def _await_job(self, gave_up: asyncio.Event) -> None:
        """Wait until every worker and server joined the job. The scheduler fails a job
        that has not assembled within the connect timeout plus ``STARTUP_MARGIN_S``,
        naming the ranks that never registered, and this server hears it; should the
        scheduler not say so, this server gives up a margin later by itself. Either way
        the job fails here (logged) and :meth:`run` returns 1."""
        wait_s = self.config.timeouts.connect_s + 2 * STARTUP_MARGIN_S
        try:
            await self.membership.register(self.port, time.monotonic() + wait_s, whole_job=True)
        except AKVError as exc:
            self._job_failed(f"{self.name} gave up waiting for the job to assemble: {exc}")
            gave_up.set()

    async def stop(self) -> None:
        """Close every stream, the engine and the listener; tell the scheduler. Idempotent:
        a call while another runs waits for it (which goes on if its caller is cancelled)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self.state.stopping = True
        for link in list(self.links.values()):
            if isinstance(link, StreamLink):
                link.protocol.close()
        if not self._awaits_restart and self.membership.registered:
            with contextlib.suppress(TransportError, AKVError):  # it may be gone already
                await self.membership.finish()
        for task in list(self._tasks):  # before the client closes: none asks it again
            task.cancel()
        await self.membership.close()
        await self.engine.aclose()
        self._adder.shutdown(wait=False)
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self._local is not None:
            await self._local.close()
            self._local = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ROUND_CHECK_INTERVAL_S)
            self.execute(self.state.tick(loop.time(), self.config.timeouts.round_s))

    def _job_failed(self, reason: str) -> None:
        self.execute(self.state.job_failed(reason))

    def _spawn(self, coroutine: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run ``coroutine`` in the background, kept until it ends; if it fails, the job
        fails with its error."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)

        def finished(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if task.cancelled() or task.exception() is None:
                return
            exc = task.exception()
            log.error("%s: %s failed: %r", self.name, what, exc)
            self._job_failed(f"{what} failed on {self.name}: {exc!r}")

        task.add_done_callback(finished)
        return task

    async def _status(self, request: web.Request) -> web.Response:
        status = {"rank": self.rank, **self.state.status()}
        status["engine"] = self.engine.statistics().__dict__
        return web.json_response(status)

    # ------------------------------------------------------------ peers

    def _admit(self, request: web.Request, stream: bool) -> Peer:
        """The peer the state admits for ``request``, once what its admission asks (closing
        a stream it replaces) is done; refused with the HTTP status of the reason."""
        try:
            worker, store_type, session = parse_client_header(
                request.headers.get(CLIENT_HEADER, "")
            )
            durable = request.headers.get(DURABLE_HEADER)
            note = parse_note(durable) if durable is not None else None
            staleness = parse_staleness(request.headers.get(STALENESS_HEADER))
            replay = parse_replay(request.headers.get(REPLAY_HEADER))
            peer, instructions = self.state.admit(
                worker, store_type, stream, session, note, staleness, replay
            )
        except InvalidArgumentError as exc:
            raise RequestError(400, str(exc)) from None
        except StaleCheckpointError as exc:
            self.execute(exc.instructions)  # the job fails, named by this server
            if self.checkpoints is not None:
                self.checkpoints.mark_lost(str(exc))
            raise RequestError(409, str(exc)) from None
        except MembershipError as exc:
            raise RequestError(409, str(exc)) from None
        except PeerLostError as exc:  # stopping: a restarted server may take the stream
            raise RequestError(STOPPING_STATUS, str(exc)) from None
        self.execute(instructions)
        return peer

    def _open_stream(self, request: web.Request) -> StreamProtocol:
        peer = self._admit(request, stream=True)
        link = StreamLink(self, peer)
        self.links[peer.id] = link
        if self.checkpoints is not None:
            self.checkpoints.tell(peer)
        return link.protocol

    async def _one_frame(self, request: web.Request) -> web.Response:
        """``POST /v1/frame``: one request frame in the body; the reply frame is the answer.

        A body that is not exactly one valid frame gets 400, one above the body limit 413.
        """
        peer = self._admit(request, stream=False)
        body = await request.read()
        try:
            header, buffers = decode_frame(body, max_payload_bytes=self.config.max_body_bytes)
        except FrameError as exc:
            raise RequestError(400, f"not a valid frame: {exc}") from None
        link = OneShotLink()
        self.links[peer.id] = link
        try:
            landing = self.state.header_arrived(peer, header)
            for buffer, target in zip(buffers, landing.buffers, strict=True):
                if target is not None:
                    byte_view(target)[:] = buffer
            self.message(peer, Message(header, tuple(buffers)), landing)
            reply = await asyncio.wait_for(link.reply, self.config.timeouts.request_s)
        except asyncio.TimeoutError:
            raise RequestError(504, "no answer in time") from None
        finally:
            del self.links[peer.id]
        return web.Response(body=reply, content_type="application/octet-stream")

    def message(self, peer: Peer, message: Message, landing: Landing) -> None:
        """A whole frame arrived from ``peer``: let the state decide, then do it."""
        header = message.header
        self.metrics.requests.add(header.op, header.payload_len)
        now = asyncio.get_running_loop().time()
        instructions = self.state.message_completed(peer, header, message.buffers, landing, now)
        if landing.lent is not None:  # no task reads them (a refused or resent push)
            landing.lent.give_back()
        if header.op == Op.ROW_INIT and not jit.settled():
            # Answered once the row kernels are made (on a thread: a first compile takes
            # seconds), so that the key's rounds use them; the loop goes on meanwhile.
            self._spawn(self._after_kernels(instructions), "making the row kernels")
            return
        self.execute(instructions)

    async def _after_kernels(self, instructions: Sequence[Instruction]) -> None:
        await asyncio.to_thread(jit.kernels)
        self.execute(instructions)

    def lost(self, peer: Peer, exc: BaseException | None) -> None:
        """``peer``'s stream ended."""
        self.links.pop(peer.id, None)
        self.execute(self.state.peer_lost(peer, exc, asyncio.get_running_loop().time()))
        if len(self.state.left) == self.state.num_workers:
            self._every_worker_left.set()  # the next heartbeat now: it hears stop at once

    # ------------------------------------------------------------ carrying out instructions

    def execute(self, instructions: Sequence[Instruction]) -> None:
        """Carry out what the state decided, in order."""
        for instruction in instructions:
            if isinstance(instruction, Reply):
                if instruction.counted:
                    # Not waited for by a caller (the value follows): sent with what this
                    # loop turn writes next, one write for a burst of counted pushes.
                    self.send_soon(instruction)
                else:
                    self.send_to(instruction.peer, encode_frame(Op.REPLY, instruction.seq, aux=OK))
            elif isinstance(instruction, ReplyError):
                self._reply_error(instruction)
            elif isinstance(instruction, Land):
                self.metrics.landed(len(instruction.closing), instruction.waited_s)
                self.engine.push(
                    self._land,
                    instruction,
                    writes=[entry.var for entry in instruction.entries],
                    executor="inline" if instruction.inline else "thread",
                    name="push",
                )
            elif isinstance(instruction, SendValues):
                self._send_values(instruction)
            elif isinstance(instruction, LandRows):
                self.metrics.landed(len(instruction.closing), instruction.waited_s)
                self.engine.push(
                    self._land_rows,
                    instruction,
                    writes=[entry.var for entry in instruction.entries],
                    executor="inline" if instruction.inline else "thread",
                    name="push",
                )
            elif isinstance(instruction, SendRows):
                self.engine.push(
                    self._send_rows,
                    instruction.ticket,
                    reads=[entry.var for entry, _ in instruction.ticket.pulls],
                    executor="inline" if instruction.inline else "thread",
                    no_skip=True,
                    name="send",
                )
            elif isinstance(instruction, (InstallOptimizer, SaveStates, LoadStates)):
                keys = [entry.var for entry in instruction.entries]
                saves = isinstance(instruction, SaveStates)  # reads the keys' states only
                self.engine.push(
                    self._optimizer_work,
                    instruction,
                    reads=keys if saves else (),
                    writes=() if saves else keys,
                    executor="loop",
                    name=instruction.call,
                )
            elif isinstance(instruction, Checkpoint):
                assert self.checkpoints is not None  # the state asks only then
                self._spawn(self.checkpoints.on_request(instruction), "a checkpoint")
            elif isinstance(instruction, FailJob):
                self._fail_job(instruction)
            elif isinstance(instruction, CloseStream):
                link = self.links.pop(instruction.peer.id, None)
                if isinstance(link, StreamLink):
                    link.protocol.close()
            elif isinstance(instruction, Durable):
                note = instruction.note
                frame = encode_frame(Op.DURABLE, 0, aux=note.seq, text=format_note(note))
                self.send_to(instruction.peer, frame)

    def copy_values(self, plan: CheckpointPlan, directory: Path) -> Awaitable[Copied]:
        """A checkpoint's copy of ``plan``'s keys: an engine task that reads every one of
        them (after every earlier write; holding them only while it copies)."""
        reads = [entry.var for entry, _, _, _ in (*plan.entries, *plan.row_entries)]
        task: Awaitable[Copied] = self.engine.push(
            copy_plan, plan, directory, reads=reads, executor="thread", name="checkpoint"
        )
        return task

    def send_to(self, peer: Peer, buffers: list[Any]) -> None:
        """Send ``buffers`` on ``peer``'s stream (dropped when it is gone: the worker resends)."""
        link = self.links.get(peer.id)
        if link is not None and not link.closing:
            link.send(buffers)

    def send_soon(self, reply: Reply) -> None:
        """Send the interim ``reply`` (a push counted) on its peer's stream with the next
        frame written there, at the latest at the end of this loop turn."""
        link = self.links.get(reply.peer.id)
        if link is not None and not link.closing:
            link.send_soon(frame_bytes(Op.REPLY, reply.seq, aux=OK, flags=COUNTED))

    def _reply_error(self, instruction: ReplyError) -> None:
        if instruction.cause is not None:
            log.error("%s: %s", self.name, instruction.error, exc_info=instruction.cause)
        error = instruction.error
        frame = encode_frame(Op.REPLY, instruction.seq, aux=status_of(error), text=str(error))
        self.send_to(instruction.peer, frame)

    def _answer_failed(self, ticket: PullTicket | RowPullTicket, what: str, exc: Exception) -> None:
        """Answer ``ticket``'s pull with the error that making its answer raised (logged
        with its traceback), instead of leaving the worker to wait for its deadline."""
        self._on_loop(self._reply_error, ReplyError.of(ticket.peer, ticket.seq, what, exc))

    def _fail_job(self, instruction: FailJob) -> None:
        if instruction.blames_itself:
            log.error("%s", instruction.reason)
            rank = self.rank if self.rank is not None else -1
            node = self.membership.node_id
            report = self.membership.report_lost(node, "server", rank, instruction.detail)
            self._spawn(report, "telling the scheduler why this server fails the job")
            return
        if instruction.lost_worker is None:
            log.error("%s: %s", self.name, instruction.reason)
            return
        worker = instruction.lost_worker
        log.error("worker %d vanished: %s", worker, instruction.detail)
        report = self.membership.report_lost(self.name, "worker", worker, instruction.detail)
        self._spawn(report, f"telling the scheduler that worker {worker} vanished")

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` on the server's loop: now if this is its thread, else soon."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self.engine.loop.call_soon_threadsafe(fn, *args)

    def _add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        split_add(self._adder, a, b, out)

    def _land(self, work: Land) -> None:
        try:
            done, failed, to_give_back = land(work, self.state.updater, self._add)
        finally:
            if work.lent is not None:
                self._on_loop(work.lent.give_back)
        for lent in to_give_back:
            self._on_loop(lent.give_back)
        self._on_loop(self._landed, done, failed, work.reply)

    def _land_rows(self, work: LandRows) -> None:
        try:
            done, failed = land_rows(work, self.state.updater)
        finally:
            for lent in work.lent:
                self._on_loop(lent.give_back)
        self._on_loop(self._landed, done, failed, work.reply)

    def _send_rows(self, ticket: RowPullTicket) -> None:
        """Answer a row pull with a copy of the rows it asks for: gathered into regions of
        the stream's shared memory where it has one (sent from there), else into arrays."""
        link = self.links.get(ticket.peer.id)
        shared = link.protocol.shared if isinstance(link, StreamLink) else None
        placed: list[np.ndarray] = []
        try:
            arrays, placed = gather_rows(ticket, None if shared is None else shared.take)
            frame = encode_frame(Op.REPLY, ticket.seq, arrays, aux=OK)
        except Exception as exc:
            if shared is not None:
                for region in placed:
                    shared.give_back(region)
            self._answer_failed(ticket, "row_sparse_pull", exc)
            return
        if placed:
            assert shared is not None
            self._on_loop(self._send_from_arena, ticket.peer, frame, shared, placed)
        else:
            self._on_loop(self.send_to, ticket.peer, frame)

    def _landed(
        self,
        done: list[tuple[ServerEntry, int]] | list[tuple[RowEntry, int]],
        failed: list[tuple[ServerEntry, int, Exception]] | list[tuple[RowEntry, int, Exception]],
        reply: Reply | None = None,
    ) -> None:
        self.execute(self.state.rounds_applied(done))
        if reply is not None:
            self.execute([self.state.push_applied(reply, failed)])
        for entry, round_no, exc in failed:
            log.error(
                "%s: the update of key %r (round %d) failed: %r",
                self.name,
                entry.key,
                round_no,
                exc,
            )
            self.execute(self.state.update_failed(entry, round_no, exc))

    def _send_values(self, instruction: SendValues) -> None:
        ticket = instruction.ticket
        reads = [entry.var for entry in ticket.entries]
        shared = self._arena_for(ticket)
        if shared is not None:
            self.engine.push(
                self._send_staged,
                ticket,
                shared,
                reads=reads,
                executor="thread",
                no_skip=True,
                name="send",
            )
        elif instruction.copy:
            self.engine.push(
                self._send_copy,
                instruction.ticket,
                reads=reads,
                executor="inline",
                no_skip=True,
                name="send",
            )
        else:
            self.engine.push(
                self._send_held,
                instruction.ticket,
                reads=reads,
                executor="callback",
                no_skip=True,
                name="send",
            )

    def _send_copy(self, ticket: PullTicket) -> None:
        """Answer a small pull with a copy of the values (no need to hold them until sent)."""
        arrays = [(e.key, e.value, e.rounds.applied_round) for e in ticket.entries]
        try:
            frame = [frame_bytes(Op.REPLY, ticket.seq, arrays, aux=OK)]
        except Exception as exc:
            self._answer_failed(ticket, "pull", exc)
            return
        self._on_loop(self.send_to, ticket.peer, frame)

    def _arena_for(self, ticket: PullTicket) -> SharedMemory | None:
        """The shared memory of the stream to answer ``ticket`` on, when the answer is large
        enough to be staged there by a thread (:meth:`_send_staged`); else None."""
        link = self.links.get(ticket.peer.id)
        shared = link.protocol.shared if isinstance(link, StreamLink) else None
        if shared is None or shared.book is None:
            return None
        if sum(entry.nbytes for entry in ticket.entries) < STAGED_REPLY_MIN_BYTES:
            return None
        book = shared.book
        if any(book.holds(entry.value) for entry in ticket.entries):
            return None  # sent from where it lies, while the keys are held (_send_held)
        return shared

    def _send_staged(self, ticket: PullTicket, shared: SharedMemory) -> None:
        """On an engine thread, holding the keys for reading: copy the values into regions
        of the stream's arena (or, where none is free, into buffers of their own), then
        send the answer from there on the loop."""
        arrays = []
        staged: list[np.ndarray] = []
        try:
            for entry in ticket.entries:
                view = shared.take(entry.nbytes)
                if view is None:
                    array = entry.value.copy()
                else:
                    array = np.frombuffer(view, entry.dtype).reshape(entry.shape)
                    staged.append(array)
                    np.copyto(array, entry.value)
                arrays.append((entry.key, array, entry.rounds.applied_round))
            frame = encode_frame(Op.REPLY, ticket.seq, arrays, aux=OK)
        except Exception as exc:
            for region in staged:
                shared.give_back(region)
            self._answer_failed(ticket, "pull", exc)
            return
        self._on_loop(self._send_from_arena, ticket.peer, frame, shared, staged)

    def _send_from_arena(
        self, peer: Peer, frame: list[Any], shared: SharedMemory, staged: list[np.ndarray]
    ) -> None:
        """Send ``frame``, whose payloads lie in regions of ``shared`` taken for it, and
        give the regions back once written: free once the worker gave them back too."""

        def give_back(_: BaseException | None = None) -> None:
            for region in staged:
                shared.give_back(region)

        link = self.links.get(peer.id)
        if link is None or link.closing:
            give_back()
            return
        link.send(frame)
        link.when_drained(give_back)

    def _send_held(self, ticket: PullTicket, done: Callable[[Any, Any], None]) -> None:
        """Answer a pull from the stored arrays themselves (no copy), holding their vars for
        reading (this task runs until ``done``) until the kernel has taken every byte."""
        link = self.links.get(ticket.peer.id)
        if link is None or link.closing:
            done(None, None)
            return
        arrays = [(e.key, e.value, e.rounds.applied_round) for e in ticket.entries]
        try:
            frame = encode_frame(Op.REPLY, ticket.seq, arrays, aux=OK)
        except Exception as exc:
            self._answer_failed(ticket, "pull", exc)
            done(None, None)
            return
        link.send(frame)
        link.when_drained(lambda _: done(None, None))  # a lost stream ends the task as well

    async def _optimizer_work(self, work: InstallOptimizer | SaveStates | LoadStates) -> None:
        """Install an optimizer, or save or load its states (on a thread), then answer."""
        saved: bytes | None = None
        try:
            if isinstance(work, InstallOptimizer):
                self.state.install_optimizer(work.optimizer, work.config)
            elif isinstance(work, SaveStates):
                saved = await asyncio.to_thread(work.updater.dump_states, work.dump)
            else:
                await asyncio.to_thread(work.updater.load_states, work.data)
        except Exception as exc:
            self.execute([ReplyError.of(work.peer, work.seq, work.call, exc)])
            return
        if saved is None:
            self.execute([Reply(work.peer, work.seq)])
        else:
            arrays = [(None, np.frombuffer(saved, np.uint8), 0)]
            self.send_to(work.peer, encode_frame(Op.REPLY, work.seq, arrays, aux=OK))
