"""The worker side of ``dist_sync`` and ``dist_async`` stores: store calls to engine tasks,
and the worker's state's instructions carried out.

A worker registers with the scheduler (:class:`~akv.cluster.membership.Membership`, which
gives it its rank and the servers' addresses), opens one stream to every server
(:class:`~akv.cluster.worker.link.ServerLink`), and from then on turns each store call into
one engine task. When the task's turn comes (after the earlier work on its keys), it
becomes an event for the worker's state (:class:`~akv.cluster.worker.state.WorkerState`),
which decides everything about the requests: how a push goes (strict, pipelined and held
for a pull to ride on, or asking for the value after its round), which pull needs no
request, what a reply means, what is resent after a cut, when the job failed. This module
carries out what it returns (:meth:`DistBackend.handle`): frames written, engine tasks
completed, buffers given back, streams opened again, the scheduler asked who failed.

Values are staged at the call (:mod:`akv.cluster.worker.staging`, GPU values included) and
pulled values are received straight into the caller's output arrays. Heartbeats run on a
thread of their own (:mod:`akv.cluster.worker.job`); when the scheduler reports the job
failed, or a server's stream breaks for good, every waiting call fails with an error naming
the process involved.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.arrays import Array, has_gpu, is_gpu
from akv.backend import caller_events
from akv.cluster.config import Config
from akv.cluster.membership import Membership
from akv.cluster.placement import place
from akv.cluster.protocol import Op
from akv.cluster.roles import default_worker_logging
from akv.cluster.worker.activity import Activity
from akv.cluster.worker.calls import Answer, Done, PullCall, PushCall, give_back_if_skipped
from akv.cluster.worker.control import ControlCalls
from akv.cluster.worker.events import (
    AcksWanted,
    BarrierPassed,
    Closing,
    Event,
    JobFailed,
    PullIssued,
    PushIssued,
    Tick,
    TurnEnded,
    ValueRead,
)
from akv.cluster.worker.instructions import (
    Blame,
    CopyOut,
    Finish,
    GiveBack,
    GiveBuffer,
    Instruction,
    Reconnect,
    Send,
    SendHeldSoon,
    Unstage,
)
from akv.cluster.worker.job import Heartbeat, pass_barrier, report_failure, who_failed
from akv.cluster.worker.link import ServerLink, local_address, server_instance, server_name
from akv.cluster.worker.metrics import WorkerMetrics
from akv.cluster.worker.requests import check_wire_key
from akv.cluster.worker.row_calls import RowCalls
from akv.cluster.worker.staging import Staging, land_in_pinned
from akv.cluster.worker.state import WorkerState
from akv.compression import Compression, Residuals
from akv.device import register_gpu_executor
from akv.errors import (
    AKVError,
    ClosedError,
    InvalidArgumentError,
    PeerLostError,
    ServerError,
)
from akv.exits import describe, off_loop
from akv.keys import Entry, Staged
from akv.limits import (
    BLAME_TIMEOUT_S,
    GOODBYE_TIMEOUT_S,
    REPORT_FAILURE_S,
    SWEEP_INTERVAL_S,
)
from akv.sparse import RowIds, RowSparseArray
from akv_engine import Completed, Engine, GPUExecutor, Task, Waitable
from akv_transport import (
    StreamProtocol,
)

__all__ = ["DistBackend"]

log = logging.getLogger("akv.cluster")


class DistBackend:
    """Runs a worker's store calls against the job's servers (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        store_type: str,
        config: Config,
        device: bool = False,
        gpu_executor: Callable[[], GPUExecutor] = GPUExecutor,
    ) -> None:
        """``device``: a ``*_device`` store. Every type takes GPU values as they are and
        stages them through pinned host memory (:mod:`akv.pinned`: summed on their GPU at
        the call, copied once by a GPU task the send follows); a ``*_device`` store also
        waits for that work in a push of the blocking face, and asks no pulls ahead.
        ``gpu_executor`` makes the engine's GPU executor."""
        self._engine = engine
        self.type = store_type
        self.config = config
        self.num_workers = config.num_workers
        self.membership = Membership(config, "worker", uuid.uuid4().hex)
        self.links: list[ServerLink] = []
        #: The worker's decisions (made once it knows the servers, at :meth:`connect`).
        self.state = WorkerState([], request_s=config.timeouts.request_s)
        self._read_state()
        self.keeps_gpu_arrays = True
        self._device = device
        # GPU values are reduced on their GPUs by work that follows the call: wait for it.
        self.returns_pushes_early = not config.strict_push and not device
        self.stages_rows = True
        self._gpu_executor = gpu_executor
        self._gpu_registered = False
        self._staging = Staging(engine, self._stream_for_staging, self._gpu_ready)
        self._heartbeat: Heartbeat | None = None
        #: The calls so far, which heartbeats report (the scheduler's status page).
        self.activity = Activity()
        self._barriers = 0
        self._joined = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._blames: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Set once the store broke (``fail``, the one way to the state's failure): see
        #: ``pass_barrier``.
        self._broken = asyncio.Event()
        # Instructions met while carrying out others wait for them (see ``handle``).
        self._executing = False
        self._queued: list[Instruction] = []
        self._rows = RowCalls(
            engine,
            lambda: self.links,
            config.timeouts,
            self._stream_for_staging,
            sync=store_type.startswith("dist_sync"),
            strict=config.strict_push,
        )
        self._control = ControlCalls(engine, lambda: self.links, config.timeouts)
        self.metrics: WorkerMetrics | None = None  # AKV_METRICS_PORT: served from connect()
        #: How the other instructions are carried out (see ``_carry_out``).
        self._carriers: dict[type[Instruction], Callable[[Any], None]] = {
            GiveBuffer: self._give_buffer,
            GiveBack: self._give_back,
            SendHeldSoon: self._send_held_soon,
            Reconnect: self._reconnect,
            Blame: self._blame,
        }

    @property
    def rank(self) -> int:
        """This worker's rank (-1 until it joined the job)."""
        rank = self.membership.rank
        return -1 if rank is None or not self._joined else rank

    @property
    def broken(self) -> AKVError | None:
        """The error that broke the store (every later call raises it), or None; a
        :class:`ClosedError` once the event loop the store was made on has closed."""
        loop = self._loop
        if self.state.failure is None and loop is not None and loop.is_closed():
            return ClosedError(
                f"this {self.type} store was made on an event loop that has closed (an "
                "asyncio.run() that returned), which held its connections: make the store "
                "in the loop that uses it, or with akv.create() (a loop thread of its own)"
            )
        return self.state.failure

    # ------------------------------------------------------------ joining the job

    async def connect(self) -> None:
        """Register, learn the servers, open a stream to each; all within the connect timeout.

        Raises
        ------
        ConnectTimeoutError
            Naming what was still missing when the deadline passed.
        AuthenticationError
            When the scheduler or a server refused the token.
        ServerError
            When a server refused the stream.
        PeerLostError
            When the job failed meanwhile (heard by the heartbeats, which start at the
            registration).
        """
        config = self.config
        default_worker_logging(config.log_level)  # "worker waiting: ..." reaches stderr
        self._loop = asyncio.get_running_loop()
        self.metrics = await WorkerMetrics.serve(self, self._engine)
        deadline = time.monotonic() + config.timeouts.connect_s
        answer = await self.membership.register(0, deadline)
        rank = int(answer["rank"])
        servers = answer["servers"]
        restartable = [bool(s.get("restartable", False)) for s in servers]
        self.state = WorkerState(
            [
                (server_name(s["rank"], s["host"], s["port"]), r)
                for s, r in zip(servers, restartable, strict=True)
            ],
            strict_push=config.strict_push,
            pull_ahead=config.pull_ahead and self.type == "dist_sync" and not self._device,
            request_s=config.timeouts.request_s,
            round_s=config.timeouts.round_s,
            retain_bytes=config.retain_bytes,
            ordered_replays=self.type == "dist_async",
        )
        self._read_state()
        self.links = [
            ServerLink(
                index,
                s["rank"],
                s["host"],
                s["port"],
                self.state.links[index],
                self.handle,
                locate=self.membership.server_address,
                restartable=restartable[index],
                local=local_address(s),
                instance=server_instance(s),
                metrics=self.metrics,
            )
            for index, s in enumerate(servers)
        ]
        # Heartbeats from now on: the scheduler counts a registered worker silent for the
        # heartbeat timeout as dead, and opening the streams may take longer (a server
        # killed meanwhile is waited for until its restart listens).
        self._heartbeat = Heartbeat(self.membership, self._failed_from_thread, self.activity.report)
        self._heartbeat.start()
        for link in self.links:
            opener = (self.config, rank, self.type, self.membership.node_id)
            await link.join(opener, deadline, lambda: self.broken, self._broken)
        self._joined = True
        self._sweeper = self._loop.create_task(self._sweep())
        self._sweeper.add_done_callback(self._sweeper_ended)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.handle(Tick(loop.time()))

    def _sweeper_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(PeerLostError(f"the request deadline check failed: {task.exception()!r}"))

    def _failed_from_thread(self, reason: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.fail, PeerLostError(reason))

    def fail(self, error: AKVError, quiet: bool = False) -> None:
        """The job failed: every waiting request and every later call raises ``error``
        (logged, unless ``quiet``: this worker's own code failed, and says so itself)."""
        if self.state.failure is None and not quiet:
            rank = self.membership.rank  # (also while it joins)
            log.error("worker %s: %s", "?" if rank is None else rank, error)
        self.handle(JobFailed(error))
        self._broken.set()  # (ends a barrier's wait on a scheduler that stopped answering)

    # ------------------------------------------------------------ carrying out

    def handle(self, event: Event) -> None:
        """Feed ``event`` to the worker's state and carry out what it says, in order (on
        the loop). Work an instruction starts may feed events at once (a call completed
        lets the next one on its key start): what those say waits until these are done,
        so that what is written keeps the order it was decided in."""
        instructions = self.state.handle(event)
        if self._executing:
            self._queued.extend(instructions)
            return
        self._executing = True
        try:
            links = self.links
            for instruction in instructions:  # (``_carry_out``, inline: once per message)
                if type(instruction) is Send:
                    links[instruction.server].send(instruction)
                elif type(instruction) is Finish:
                    instruction.call.finish(instruction.error, instruction.reply)
                else:
                    self._carry_out(instruction)
            while self._queued:
                queued, self._queued = self._queued, []
                for instruction in queued:
                    self._carry_out(instruction)
        finally:
            self._executing = False

    def _carry_out(self, instruction: Instruction) -> None:
        # The instructions of every call first, without a lookup.
        if type(instruction) is Send:
            self.links[instruction.server].send(instruction)
        elif type(instruction) is Finish:
            instruction.call.finish(instruction.error, instruction.reply)
        elif type(instruction) is Unstage:
            instruction.call.unstage()
        elif type(instruction) is CopyOut:
            instruction.call.copy_out(instruction.copies)
        else:
            self._carriers[type(instruction)](instruction)

    def _give_buffer(self, instruction: GiveBuffer) -> None:
        instruction.entry.give_buffer(instruction.buffer)

    def _give_back(self, instruction: GiveBack) -> None:
        instruction.stream.give_back(instruction.offsets)

    def _send_held_soon(self, instruction: SendHeldSoon) -> None:
        assert self._loop is not None
        self._loop.call_soon(self._turn_ended, instruction.server)

    def _reconnect(self, instruction: Reconnect) -> None:
        self.links[instruction.server].reconnect(instruction.delay_s)

    def _turn_ended(self, server: int) -> None:
        assert self._loop is not None
        self.handle(TurnEnded(server, self._loop.time()))

    def _blame(self, blame: Blame) -> None:
        """Ask the scheduler who failed first (within ``BLAME_TIMEOUT_S``), then fail the
        job naming that process."""
        if self._loop is None:
            self.fail(blame.error)
            return
        link = self.links[blame.server]
        verdict = who_failed(self.membership, link.name, link.rank, blame.error, blame.cut)
        task = self._loop.create_task(self._fail_with(verdict, blame.error))
        self._blames.add(task)
        task.add_done_callback(self._blames.discard)

    async def _fail_with(self, verdict: Coroutine[Any, Any, AKVError], seen: AKVError) -> None:
        """Fail with the scheduler's verdict, or with ``seen`` (what this worker saw) when
        the scheduler knows of no failure: that is then told to it, so that the job's
        verdict says why, not only that this worker exited."""
        failure = await verdict
        first = self.state.failure is None
        self.fail(failure)
        if first and failure is seen and self.rank >= 0:
            await report_failure(self.membership, self.rank, str(seen), left=False)

    def _stream_for_staging(self, server: int) -> StreamProtocol | None:
        """The stream to ``server`` when a push's staging buffer may be a region of its
        arena: it shares memory, and its server keeps no copies for a restart (those are
        kept past the answer)."""
        if not self.links:
            return None
        link = self.links[server]
        return None if link.restartable else link.protocol

    # ------------------------------------------------------------ keys

    def new_entry(self, key: Key, array: np.ndarray) -> Entry:
        """A key's entry: its engine var and where its parts live."""
        check_wire_key(key, array.dtype)
        parts = place(key, int(array.size), len(self.links), self.config.bigarray_bound)
        var = self._engine.new_var(f"key {key!r}")
        entry = Entry(key, tuple(array.shape), array.dtype, var, parts)
        if is_gpu(array):
            self._gpu_ready(entry)
        return entry

    def _gpu_ready(self, entry: Entry) -> None:
        """A GPU value or output for ``entry``: its staging buffers are page-locked from now
        on, and the engine has a GPU executor (registered on first use: a key initialized
        from host memory may be pushed GPU values later)."""
        entry.use_pinned()
        if not self._gpu_registered:
            register_gpu_executor(self._engine, self._gpu_executor)
            self._gpu_registered = True

    def _read_state(self) -> None:
        # What every call looks at first on the caller's thread, one lookup away: the
        # errors kept for later calls, and the values asked ahead (see WorkerState).
        self._late = self.state.late.by_key
        self._asked = self.state.ahead.values

    def _check(self) -> None:
        if self.state.failure is not None:
            raise self.state.failure

    def _raise_late(self, calls: list[tuple[Entry, Any]]) -> None:
        """Raise the error of an earlier pipelined push of one of the keys of ``calls``
        (a call's ``(entry, arrays)``), once."""
        if self._late:
            late = self.state.take_late([entry.key for entry, _ in calls])
            if late is not None:
                raise late

    def _raise_late_rows(self, keys: list[Key]) -> None:
        """Raise the error of an earlier push of one of ``keys`` (row-sparse: its answers
        are kept by :class:`RowCalls`), once."""
        late = self._rows.take_failed(keys)
        if late is not None:
            raise late

    # ------------------------------------------------------------ the work

    def init(self, entries: list[Entry], arrays: list[np.ndarray]) -> Task:
        """Rank 0 sends the initial values; the others check theirs agree and wait for them
        (:meth:`ControlCalls.init`)."""
        self._check()
        return self._control.init(entries, arrays, self.rank)

    def set_updater(self, updater: object) -> None:
        """Refuse: in a distributed store the servers apply updates (use set_optimizer)."""
        raise InvalidArgumentError(
            f"set_updater has no effect on a {self.type} store: the servers apply the updates; "
            "use set_optimizer (MXNet silently ignores the updater here)"
        )

    def push(
        self, values: list[tuple[Entry, list[np.ndarray]]], priority: int, borrow: bool
    ) -> Task:
        """Send summed values to the servers that hold each key (or each part).

        Pipelined (the default): the values are copied into staging buffers at the call,
        and the task is done once the requests are handed to the links, without waiting
        for the servers' acknowledgements (a later pull of the key goes out after them on
        the same ordered streams, so it sees them). An error a server reports later is
        raised by the next call on one of the keys, by :meth:`barrier` and by
        :meth:`close`. With ``AKV_STRICT_PUSH=1`` the task is done once every server
        acknowledged. The worker's state decides how the push goes (see
        :meth:`WorkerState._push <akv.cluster.worker.state.WorkerState>`).
        """
        self._check()
        self._raise_late(values)
        self.activity.pushed(entry.key for entry, _ in values)
        pipelined = not self.config.strict_push
        staged, give_back = self._staging.stage(values, borrow and not pipelined, priority)
        task = self._engine.push(
            self._start_push,
            staged,
            give_back,
            writes=[e.var for e, _ in staged],
            priority=priority,
            executor="callback",
            name="push",
        )
        task.on_done(give_back_if_skipped(give_back))
        return task

    def _start_push(
        self, staged: list[tuple[Entry, Staged]], give_back: Callable[[], None], done: Done
    ) -> None:
        assert self._loop is not None
        self.handle(PushIssued(PushCall(done, give_back), staged, self._loop.time()))

    async def acknowledged(self) -> None:
        """Wait until every pipelined push so far was acknowledged (or failed: requests
        have deadlines, so this ends). A push sent as a pushpull is acknowledged once
        counted, not once its round is applied (which may need other workers' calls after
        a barrier)."""
        if self.state.unacked:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.handle(AcksWanted(Answer(future)))
            await future

    def pull(
        self, targets: list[tuple[Entry, list[np.ndarray]]], result: Any, priority: int
    ) -> Waitable:
        """Fetch each key's value (in dist_sync: after the round of this worker's last push)."""
        self._check()
        self._raise_late(targets)
        self.activity.pulled(len(targets))
        if len(targets) == 1 and self._asked:
            done = self._pull_arrived(targets[0], result)
            if done is not None:
                return done
        return self._schedule_pull(targets, result, None, _nothing, priority)

    def _pull_arrived(self, target: tuple[Entry, list[np.ndarray]], result: Any) -> Waitable | None:
        """A pull of one key whose value, asked for with this worker's last push of it,
        has arrived: copied out on the calling thread now, with no task and no hop to the
        loop thread. None when it cannot be (not arrived yet, the key busy, an output that
        is not a NumPy array)."""
        entry, outs = target
        value = self._asked.get(entry.key)
        if value is None or not value.readable(entry):
            return None
        if any(type(out) is not np.ndarray for out in outs):
            return None
        done = self._engine.run_now(
            self._copy_arrived, entry, outs, result, reads=(entry.var,), name="pull"
        )
        if isinstance(done, Completed) and done.result() is _NOT_ARRIVED:
            return None
        return done

    def _copy_arrived(self, entry: Entry, outs: list[np.ndarray], result: Any) -> Any:
        # The key's var is held: no push or pull of the key runs meanwhile, so its value
        # asked ahead stays as it is (the loop changes it only in those, or on arrival,
        # which came before).
        value = self.state.ahead.take(entry)
        if value is None:
            return _NOT_ARRIVED
        try:
            source = value.value()
            for out in outs:
                np.copyto(out, source)
        finally:
            if value.stale:  # read once, from the server's memory: it goes back, on the loop
                self._engine.loop.call_soon_threadsafe(self.handle, ValueRead(value))
        return result

    def pushpull(
        self,
        values: list[tuple[Entry, list[np.ndarray]]],
        targets: list[tuple[Entry, list[np.ndarray]]],
        result: Any,
        priority: int,
        borrow: bool,
    ) -> Waitable:
        """Push, then pull the result, in one request per server."""
        self._check()
        self._raise_late(values)
        self.activity.pushed(entry.key for entry, _ in values)
        self.activity.pulled(len(targets))
        staged, give_back = self._staging.stage(values, borrow, priority)
        return self._schedule_pull(targets, result, staged, give_back, priority)

    def _schedule_pull(
        self,
        targets: list[tuple[Entry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[Entry, Staged]] | None,
        give_back: Callable[[], None],
        priority: int,
    ) -> Waitable:
        """A pull reads the keys; a pushpull (with ``staged`` values) writes them.

        GPU outputs are landed in pinned buffers and copied to their GPUs by GPU tasks
        (on copy streams) that follow the pull. The callers checked that the store is not
        broken.
        """
        landed: list[tuple[Entry, np.ndarray, list[Array]]] = []
        if has_gpu(targets):
            for target, arrays in targets:
                if any(is_gpu(array) for array in arrays):
                    self._gpu_ready(target)
            targets, landed = land_in_pinned(targets)
        key_vars = [e.var for e, _ in targets]
        landing = [self._engine.new_var("landing")] if landed else []
        task = self._engine.push(
            self._start_pull,
            targets,
            result,
            staged,
            give_back,
            # GPU outputs of a host store are written on the loop thread: after the work
            # the caller queued on them (on its own streams) before the call.
            caller_events(targets),
            reads=key_vars if staged is None else (),
            writes=(key_vars if staged is not None else []) + landing,
            priority=priority,
            executor="callback",
            name="pull" if staged is None else "pushpull",
        )
        if staged is not None:  # a pull stages nothing
            task.on_done(give_back_if_skipped(give_back))
        if not landed:
            return task
        return self._staging.land_on_gpus(task, landing[0], landed, result, priority)

    def _start_pull(
        self,
        targets: list[tuple[Entry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[Entry, Staged]] | None,
        give_back: Callable[[], None],
        after: list[Any],
        done: Done,
    ) -> None:
        assert self._loop is not None
        call = PullCall(done, result, give_back, after)
        self.handle(PullIssued(call, targets, staged, self._loop.time()))

    def set_compression(self, compression: Compression) -> bool:
        """Compress every later push (each part with this worker's residual, at the call);
        the servers decode them. True: this backend sends compressed values."""
        self._staging.residuals = Residuals(compression)
        self.state.compress(compression)
        return True

    # ------------------------------------------------------------ row-sparse keys

    def new_row_entry(self, key: Key, shape: tuple[int, ...], dtype: np.dtype) -> Entry:
        """A row-sparse key's entry (:meth:`RowCalls.new_entry`)."""
        check_wire_key(key, dtype)
        return self._rows.new_entry(key, shape, dtype)

    def init_rows(self, entries: list[Entry], values: list[RowSparseArray]) -> Task:
        """Rank 0 sends each server its rows of every key; the others check theirs agree."""
        self._check()
        return self._rows.init(entries, values, self.rank)

    def push_rows(self, values: list[tuple[Entry, RowSparseArray]], priority: int) -> Task:
        """Send each server the rows of its range (:meth:`RowCalls.push`)."""
        self._check()
        self._raise_late_rows([entry.key for entry, _ in values])
        self.activity.pushed(entry.key for entry, _ in values)
        return self._rows.push(values, priority)

    def pull_rows(
        self, pulls: list[tuple[Entry, RowIds, RowSparseArray]], result: object, priority: int
    ) -> Task:
        """Ask the servers that hold requested rows for them (:meth:`RowCalls.pull`)."""
        self._check()
        keys = [entry.key for entry, _, _ in pulls]
        self._raise_late_rows(keys)
        # Keys, as a dense pull counts them: not each array of ids or output of one.
        self.activity.pulled(len(set(keys)))
        return self._rows.pull(pulls, result, priority)

    def barrier(self) -> Task:
        """Wait until every worker called barrier as often as this one (with a deadline).

        First this worker's pipelined pushes sent before it are acknowledged, so that once
        the barrier is passed every worker's earlier pushes have reached the servers (a
        pull after it sees them, in dist_async too). Raises the error of a pipelined push
        nobody was told of yet."""
        self._check()
        late = self.state.take_any_late()
        if late is not None:
            raise late
        return self._engine.push(self._acked_barrier, executor="loop", name="barrier")

    async def _acked_barrier(self) -> None:
        await self.acknowledged()
        late = self.state.take_any_late() or await self._rows.settle()
        if late is not None:
            raise late  # before it is numbered: the next barrier takes its number
        self._barriers += 1
        await pass_barrier(self.membership, self._barriers, self._check, self._broken)
        self.handle(BarrierPassed())

    def set_optimizer(self, optimizer: _optimizer.Optimizer, entries: list[Entry]) -> Task:
        """Send the optimizer's name and hyper-parameters (JSON) to every server, after the
        earlier calls on ``entries``."""
        self._check()
        return self._control.set_optimizer(optimizer, entries)

    def save_states(self, entries: list[Entry], path: Path, dump_optimizer: bool) -> Task:
        """Gather every server's optimizer states into one file (after earlier pushes)."""
        self._check()
        return self._control.save_states(entries, path, dump_optimizer)

    def load_states(self, entries: list[Entry], path: Path) -> Task:
        """Send each server its share of a states file (after earlier pushes, before later)."""
        self._check()
        return self._control.load_states(entries, path)

    # ------------------------------------------------------------ leaving

    async def abandon(self, reason: str) -> None:
        """The caller's code failed (``reason``): tell the scheduler that this worker
        failed, so that the job fails at once naming it (within
        :data:`~akv.limits.REPORT_FAILURE_S`; should the scheduler not answer, the
        servers still see this worker's streams end without a goodbye), then fail every
        request in flight. :meth:`close` follows, without the barrier and without goodbyes.
        """
        # Also while it joins (its registration sent, the job not assembled yet, its streams
        # opening): not when the scheduler refused it (the rank is another process's).
        rank = self.membership.rank
        if self.membership.refused or rank is None or self._closed:
            return
        if self.state.failure is None:
            await report_failure(self.membership, rank, reason)
        self.fail(PeerLostError(f"worker {rank} left the job: {reason}"), quiet=True)

    async def close(self, barrier_before_exit: bool) -> None:
        """Leave the job: barrier (if asked), say goodbye to each server and the scheduler.

        A store that never finished joining only releases what it holds.
        """
        if self._closed:
            return
        self._closed = True
        joined = self.rank >= 0 and self._heartbeat is not None
        late: AKVError | None = None
        try:
            if not joined:
                return
            if self.broken is None:  # a failed job answers nothing more: nothing to wait for
                await self.acknowledged()  # nothing pushed is dropped: every push is answered
            late = self.state.take_any_late() or await self._rows.settle()
            if barrier_before_exit and self.broken is None:
                self._barriers += 1
                await pass_barrier(self.membership, self._barriers, self._check, self._broken)
            if self.broken is None:
                goodbyes = await asyncio.gather(
                    *(
                        link.request(Op.CLOSE, timeout_s=self._goodbye_s(link))
                        for link in self.links
                        if link.lost is None or link.reconnecting
                    ),
                    return_exceptions=True,
                )
                for goodbye in goodbyes:
                    if isinstance(goodbye, ServerError):
                        # A server's update of a round this worker pushed into failed and
                        # no pull told it yet: raised once the goodbyes are said.
                        late = late or goodbye
                    elif isinstance(goodbye, BaseException):
                        raise goodbye
                if late is None:
                    await self.membership.finish()
                else:  # the job fails naming why (not "stopped" once this process exits 1)
                    await report_failure(self.membership, self.rank, describe(late, "its close"))
        finally:
            if self._sweeper is not None:
                self._sweeper.cancel()
            if self.links:
                self.handle(Closing())
            for link in self.links:
                link.close()
            if self._heartbeat is not None:
                await off_loop(self._heartbeat.stop)
            if self._blames:  # failures still being told to the scheduler (_fail_with)
                await asyncio.wait(set(self._blames), timeout=BLAME_TIMEOUT_S + REPORT_FAILURE_S)
            await self.membership.close()
            if self.metrics is not None:
                await self.metrics.stop()
        if late is not None:
            raise late

    def _goodbye_s(self, link: ServerLink) -> float:
        """How long a goodbye to ``link``'s server may take. One that writes checkpoints
        answers once one holds this worker's changes; one cut meanwhile (a restart) gets the
        goodbye after the kept requests, on its new stream: a request's deadline."""
        return self.config.timeouts.request_s if link.restartable else GOODBYE_TIMEOUT_S


#: What :meth:`DistBackend._copy_arrived` returns when the value was not there after all.
_NOT_ARRIVED = object()


def _nothing() -> None:
    return None
