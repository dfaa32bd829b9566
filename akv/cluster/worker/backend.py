"""The worker side of ``dist_sync`` and ``dist_async`` stores: store calls to engine tasks.

A worker registers with the scheduler (:class:`~akv.cluster.membership.Membership`, which
gives it its rank and the servers' addresses), opens one stream to every server
(:class:`~akv.cluster.worker.link.ServerLink`), and from then on turns each store call into
one engine task that sends one request per server involved (many keys in one call travel
in one request per server, :func:`~akv.cluster.worker.requests.by_server`; a split key's
parts travel to all servers at once) and completes when every answer is in. Pulled values
are received straight into the caller's output arrays. Heartbeats run on a thread of their
own, so a busy event loop is never mistaken for a dead worker; when the scheduler reports
the job failed, or a server's stream breaks, every waiting call fails with an error naming
the process involved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.arrays import (
    Array,
    copy_into,
    cupy_module,
    device_of,
    is_gpu,
    record_on_callers,
    to_host,
)
from akv.backend import caller_events
from akv.cluster.config import Config
from akv.cluster.membership import Membership, scheduler_refusal
from akv.cluster.placement import place
from akv.cluster.protocol import Op, encode_meta
from akv.cluster.roles import default_worker_logging
from akv.cluster.states import merge_server_states, split_server_states
from akv.cluster.worker.link import ServerLink, local_address
from akv.cluster.worker.requests import Landing, by_server
from akv.device import GPU, from_pinned, reduce_at_call, register_gpu_executor, to_pinned
from akv.errors import (
    AKVError,
    AuthenticationError,
    BarrierTimeoutError,
    ConnectTimeoutError,
    InvalidArgumentError,
    PeerLostError,
    ServerError,
    StateFileError,
    UnsupportedDTypeError,
)
from akv.keys import Entry, Part, merge_into
from akv.limits import (
    AHEAD_COPY_MAX_BYTES,
    BLAME_TIMEOUT_S,
    CONNECT_RETRY_S,
    GOODBYE_TIMEOUT_S,
    HEARTBEAT_STOP_S,
    INIT_CHECK_MARGIN_S,
    MAX_UNACKED_PUSHES,
    REPORT_FAILURE_S,
    SWEEP_INTERVAL_S,
)
from engine import (
    Completed,
    Engine,
    GPUExecutor,
    GPUWork,
    LoopThread,
    Task,
    Var,
    Waitable,
    gather,
    then,
)
from transport import (
    DTYPE_CODES,
    AuthError,
    InPlace,
    Message,
    RemoteError,
    SharedMemory,
    TransportError,
)

__all__ = ["DistBackend"]

log = logging.getLogger("akv.cluster")

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: What a pull sends of a key: no values (one empty array per dtype, shared: it has no bytes
#: to change).
_NO_VALUES = {dtype: np.empty(0, dtype) for dtype in DTYPE_CODES}
# The ops of the frequent requests, looked up once (an enum member lookup is not free).
_PUSH, _PULL, _PUSHPULL = Op.PUSH, Op.PULL, Op.PUSHPULL

#: What an engine task of the ``callback`` executor is given to report its end.
Done = Callable[[Any, BaseException | None], None]
#: One array of a request: (key, the array or its part, tag).
WireArray = tuple[Key | None, np.ndarray, int]


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
        """``device``: a ``*_device`` store, which reduces GPU values on their GPU and
        stages them through pinned host memory (otherwise the store hands this backend
        host values only). ``gpu_executor`` makes the engine's GPU executor."""
        self._engine = engine
        self.type = store_type
        self.config = config
        self.num_workers = config.num_workers
        self.membership = Membership(config, "worker", uuid.uuid4().hex)
        self.links: list[ServerLink] = []
        self.broken: AKVError | None = None
        self.keeps_gpu_arrays = device
        # GPU values are reduced on their GPUs by work that follows the call: wait for it.
        self.returns_pushes_early = not config.strict_push and not device
        self._gpu_executor = gpu_executor
        self._gpu_registered = False
        self._heartbeat: _Heartbeat | None = None
        self._barriers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._blames: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Pipelined pushes not acknowledged yet, who waits for none to be left, and the
        #: errors of those that failed, by key, until a call reports them.
        self._unacked = 0
        self._acks_waiters: list[asyncio.Future[None]] = []
        self._late: dict[Key, AKVError] = {}
        #: dist_sync: each key's value after the round of this worker's latest push, asked
        #: for with the push (``AKV_PULL_AHEAD``); GPU-staging stores do not.
        self._ahead: dict[Key, _Ahead] = {}
        self._pulls_ahead = config.pull_ahead and store_type == "dist_sync" and not device

    @property
    def rank(self) -> int:
        """This worker's rank (-1 until it joined the job)."""
        rank = self.membership.rank
        return -1 if rank is None or not self.links else rank

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
        default_worker_logging(config.log_level)  # "worker waiting: ..." reaches stderr
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + config.timeouts.connect_s
        answer = await self.membership.register(0, deadline)
        rank = int(answer["rank"])
        links = [
            ServerLink(
                s["rank"],
                s["host"],
                s["port"],
                self._trouble,
                locate=self.membership.server_address,
                restartable=bool(s.get("restartable", False)),
                local=local_address(s),
            )
            for s in answer["servers"]
        ]
        for link in links:
            await self._open(link, rank, deadline)
        self.links = links
        self._heartbeat = _Heartbeat(self.membership, self._failed_from_thread)
        self._heartbeat.start()
        self._sweeper = self._loop.create_task(self._sweep())
        self._sweeper.add_done_callback(self._sweeper_ended)

    async def _open(self, link: ServerLink, rank: int, deadline: float) -> None:
        while True:
            try:
                await link.open(self.config, rank, self.type, self.membership.node_id)
                return
            except AuthError as exc:
                raise AuthenticationError(f"{link.name} refused this job's token: {exc}") from exc
            except RemoteError as exc:
                raise ServerError(
                    f"{link.name} refused the stream: {exc}", server=link.name
                ) from exc
            except TransportError as exc:
                if time.monotonic() > deadline:
                    raise ConnectTimeoutError(
                        f"worker {rank} could not reach {link.name} within "
                        f"{self.config.timeouts.connect_s:g} s: {exc}"
                    ) from exc
                await asyncio.sleep(CONNECT_RETRY_S)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = loop.time()
            for link in self.links:
                link.sweep(now)

    def _sweeper_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(PeerLostError(f"the request deadline check failed: {task.exception()!r}"))

    def _failed_from_thread(self, reason: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.fail, PeerLostError(reason))

    def _trouble(self, link: ServerLink, error: AKVError, cut: bool) -> None:
        """A server's stream was cut (``cut``), or the server answered that the job failed:
        ask the scheduler who failed first (within :data:`BLAME_TIMEOUT_S`), then fail the
        job naming that process. The server is often not the culprit: servers close their
        streams and refuse requests once they learn that the job failed (a worker died,
        another server hangs)."""
        if self.broken is not None or self._loop is None:
            self.fail(self.broken or error)
            return
        task = self._loop.create_task(self._blame(link, error, cut))
        self._blames.add(task)
        task.add_done_callback(self._blames.discard)

    async def _blame(self, link: ServerLink, error: AKVError, cut: bool) -> None:
        failure = await self.membership.verdict(
            "server", link.rank, str(error), cut, BLAME_TIMEOUT_S
        )
        if failure is None:
            self.fail(error)
            return
        seen = "cutting its connection" if cut else "refusing a request"
        self.fail(PeerLostError(f"the job failed: {failure} (seen as {link.name} {seen})"))

    def fail(self, error: AKVError, quiet: bool = False) -> None:
        """The job failed: every waiting request and every later call raises ``error``
        (logged, unless ``quiet``: this worker's own code failed, and says so itself)."""
        if self.broken is None:
            self.broken = error
            if not quiet:
                log.error("worker %d: %s", self.rank, error)
        for link in self.links:
            link.fail_all(self.broken)

    # ------------------------------------------------------------ keys

    def new_entry(self, key: Key, array: np.ndarray) -> Entry:
        """A key's entry: its engine var and where its parts live."""
        if isinstance(key, int) and not INT64_MIN <= key <= INT64_MAX:
            raise InvalidArgumentError(
                f"init key {key}: int keys of a distributed store must fit in 64 bits"
            )
        if array.dtype not in DTYPE_CODES:
            known = ", ".join(str(dtype) for dtype in DTYPE_CODES)
            raise UnsupportedDTypeError(
                f"init key {key!r}: dtype {array.dtype} cannot travel to the servers (the "
                f"wire carries {known}); convert the value first (bfloat16: to float32)"
            )
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
        entry.pinned = True
        if not self._gpu_registered:
            register_gpu_executor(self._engine, self._gpu_executor)
            self._gpu_registered = True

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    # ------------------------------------------------------------ the work

    def init(self, entries: list[Entry], arrays: list[np.ndarray]) -> Task:
        """Rank 0 sends the initial values; the others check theirs agree and wait for them."""
        self._check()
        writes = [e.var for e in entries]
        if self.rank == 0:
            copies = [np.ascontiguousarray(to_host(a)).copy() for a in arrays]
            return self._engine.push(
                self._init_values, entries, copies, writes=writes, executor="loop", name="init"
            )
        return self._engine.push(
            self._init_check, entries, writes=writes, executor="loop", name="init"
        )

    async def _init_values(self, entries: list[Entry], copies: list[np.ndarray]) -> None:
        batches = by_server(zip(entries, copies, strict=True), _part_of)
        await self._each(Op.INIT, batches)

    async def _init_check(self, entries: list[Entry]) -> None:
        metas = by_server(((e, None) for e in entries), _meta_of)
        timeout = self.config.timeouts.connect_s + INIT_CHECK_MARGIN_S
        await asyncio.gather(
            *(
                self.links[server].request(
                    Op.INIT_CHECK, text=encode_meta(items), timeout_s=timeout
                )
                for server, items in metas.items()
            )
        )

    async def _each(self, op: Op, batches: dict[int, list[WireArray]]) -> list[Message]:
        timeout = self.config.timeouts.request_s
        return await asyncio.gather(
            *(
                self.links[server].request(op, arrays, timeout_s=timeout)
                for server, arrays in batches.items()
            )
        )

    def set_updater(self, updater: object) -> None:
        """Refuse: in a distributed store the servers apply updates (use set_optimizer)."""
        raise InvalidArgumentError(
            f"set_updater has no effect on a {self.type} store: the servers apply the updates; "
            "use set_optimizer (MXNet silently ignores the updater here)"
        )

    def _stage(
        self, values: list[tuple[Entry, list[Array]]], borrow: bool, priority: int
    ) -> tuple[list[tuple[Entry, np.ndarray]], Callable[[], None]]:
        """What to send per key, and how to give the staging buffers back afterwards.

        ``borrow`` (the caller waits until the servers acknowledged): a key's single
        C-contiguous array is sent as it is, without a copy; otherwise the values are
        summed into a staging buffer now: for a key held by one server whose stream shares
        memory, a region of that stream's arena (sent from there without another copy),
        else a buffer of the key's own. GPU values (``*_device`` stores) are summed on
        their GPU now and copied into a pinned buffer by a GPU task that the send follows.
        """
        staged = []
        owned = []
        reserved: list[tuple[SharedMemory, np.ndarray]] = []
        pinned = self._reduce_on_gpus(values, priority) if self.keeps_gpu_arrays else {}
        for entry, arrays in values:
            buffer = pinned.get(id(entry))
            if buffer is not None:
                staged.append((entry, buffer))
                owned.append((entry, buffer))
            elif borrow and len(arrays) == 1 and arrays[0].flags.c_contiguous:
                staged.append((entry, arrays[0]))
            else:
                region = self._arena_buffer(entry)
                if region is not None:
                    merge_into(region[1], arrays)
                    staged.append((entry, region[1]))
                    reserved.append(region)
                    continue
                buffer = merge_into(entry.take_buffer(), arrays)
                staged.append((entry, buffer))
                owned.append((entry, buffer))

        def give_back() -> None:
            for entry, buffer in owned:
                entry.give_buffer(buffer)
            for shared, region in reserved:
                shared.give_back(region)

        return staged, give_back

    def _arena_buffer(self, entry: Entry) -> tuple[SharedMemory, np.ndarray] | None:
        """A staging buffer for ``entry`` in the arena of the stream to the one server that
        holds it, when that stream shares memory and its server keeps no copies for a
        restart (those are kept past the answer); None otherwise."""
        if len(entry.parts) != 1 or not self.links:
            return None
        link = self.links[entry.parts[0].server]
        protocol = link.protocol
        if link.restartable or protocol is None or protocol.shared is None:
            return None
        view = protocol.shared.take(entry.nbytes)
        if view is None:
            return None
        return protocol.shared, np.frombuffer(view, entry.dtype).reshape(entry.shape)

    def _reduce_on_gpus(
        self, values: list[tuple[Entry, list[Array]]], priority: int
    ) -> dict[int, np.ndarray]:
        """Sum each key's GPU values on the GPU (at the call, on the caller's stream), and
        schedule their copies into pinned buffers (a GPU task per device, on a copy stream,
        writing the keys' vars so that the sends follow). Returns ``id(entry) -> pinned``."""
        by_device: dict[int, list[tuple[Array, np.ndarray, Any]]] = {}
        vars_of: dict[int, list[Var]] = {}
        pinned: dict[int, np.ndarray] = {}
        for entry, arrays in values:
            device = next((d for a in arrays if (d := device_of(a)) is not None), None)
            if device is None:
                continue
            self._gpu_ready(entry)
            cupy = cupy_module()
            with cupy.cuda.Device(device):
                summed, event = reduce_at_call(device, arrays, cupy.empty(entry.shape, entry.dtype))
            pinned[id(entry)] = buffer = entry.take_buffer()
            by_device.setdefault(device, []).append((summed, buffer, event))
            vars_of.setdefault(device, []).append(entry.var)
        for device, staged in by_device.items():
            self._engine.push(
                GPUWork(to_pinned, device=device, kind="copy"),
                staged,
                writes=vars_of[device],
                priority=priority,
                executor=GPU,
                name="stage",
            )
        return pinned

    def push(
        self, values: list[tuple[Entry, list[np.ndarray]]], priority: int, borrow: bool
    ) -> Task:
        """Send summed values to the servers that hold each key (or each part).

        Pipelined (the default): the values are copied into staging buffers at the call,
        and the task is done once the requests are handed to the links, without waiting
        for the servers' acknowledgements (a later pull of the key goes out after them on
        the same ordered streams, so it sees them). A link writes them at the end of the
        loop turn, or with a pull of the same keys made in that turn as one pushpull
        request (one answer instead of two). An error a server reports later is raised by
        the next call on one of the keys, by :meth:`barrier` and by :meth:`close`.
        With ``AKV_STRICT_PUSH=1`` the task is done once every server acknowledged.
        """
        self._check()
        self._raise_late(values)
        pipelined = not self.config.strict_push
        staged, give_back = self._stage(values, borrow and not pipelined, priority)
        return self._engine.push(
            self._start_push,
            staged,
            give_back,
            pipelined,
            writes=[e.var for e, _ in staged],
            priority=priority,
            executor="callback",
            name="push",
        )

    def _start_push(
        self,
        staged: list[tuple[Entry, np.ndarray]],
        give_back: Callable[[], None],
        pipelined: bool,
        done: Done,
    ) -> None:
        for entry, _ in staged:
            entry.pushes += 1  # in call order: pushes of a key run one after another
        batches = by_server(staged, _part_of)
        timeout = self.config.timeouts.request_s
        if not pipelined:
            replies = _Gather(len(batches), give_back, done)
            for server, arrays in batches.items():
                self.links[server].send(_PUSH, arrays, replies.reply, timeout_s=timeout)
            return
        waits = self._unacked >= MAX_UNACKED_PUSHES  # then it waits: memory stays bounded
        self._unacked += 1
        answers = _PushAnswers(self, [entry.key for entry, _ in staged], done if waits else None)
        if self._pulls_ahead and all(self._worth_asking_ahead(entry) for entry, _ in staged):
            self._push_ahead(staged, give_back, answers, timeout)
        else:
            # Held by the link until the end of the turn: a pull of the keys may go with
            # it, and then the server says when it counted the push (see ``_Counted``).
            replies = _Gather(len(batches), give_back, _ignored)
            counted = _Gather(len(batches), _nothing, answers.acknowledged)
            for server, arrays in batches.items():
                heard = _Counted(counted.reply, replies.reply)
                self.links[server].send(
                    _PUSH,
                    arrays,
                    heard.answered,
                    timeout_s=timeout,
                    hold=True,
                    on_counted=heard.counted,
                )
        if not waits:
            done(None, None)

    def _push_ahead(
        self,
        staged: list[tuple[Entry, np.ndarray]],
        give_back: Callable[[], None],
        answers: _PushAnswers,
        timeout: float,
    ) -> None:
        """Send a pipelined dist_sync push as a pushpull whose answer (the value after the
        round) is kept for the first pull of each key until its next push: in a buffer of
        the key, or where it lies in the server's shared memory (a single-part key on a
        stream that shares memory: read from there by the pull, then given back).

        Each server also says at once that it counted the push (``COUNTED``): that is the
        push's acknowledgement, which barrier and close wait for. An error in the answer
        goes to a pull waiting for the value, or else to the next call on the keys. The
        answer waits for the round (the other workers' pushes), which a server fails after
        ``AKV_ROUND_TIMEOUT_S``: the request's deadline is that much longer than
        ``AKV_REQUEST_TIMEOUT_S``, so that a round slower than a request may take is not
        taken for a lost answer.
        """
        aheads = []
        for entry, _ in staged:
            ahead = _Ahead(entry, entry.pushes)
            self._drop_ahead(entry)
            self._ahead[entry.key] = ahead
            aheads.append(ahead)
        keys = [ahead.entry.key for ahead in aheads]

        def answered(result: Any, error: BaseException | None) -> None:
            # A pull waiting for the value raises what the push met, naming the push (a
            # lost stream or a failed job as it is: every call raises that).
            late: AKVError | None = None
            if isinstance(error, PeerLostError):
                late = error
            elif error is not None:
                late = _late_error(error, keys)
            taken = False
            for ahead in aheads:
                taken |= ahead.arrive(late)
                if late is not None or ahead.stale:
                    self._drop_ahead(ahead.entry, ahead)
            answers.answer_told(late, taken)

        by_id = {
            id(entry): (array, ahead) for (entry, array), ahead in zip(staged, aheads, strict=True)
        }
        requests = by_server(staged, partial(_ahead_piece, by_id))
        replies = _Gather(len(requests), give_back, answered)
        counted = _Gather(len(requests), _nothing, answers.acknowledged)
        for server, pieces in requests.items():
            link = self.links[server]
            arrays, views, lendable = zip(*pieces, strict=True)
            heard = _Counted(counted.reply, replies.reply)
            on_reply: Callable[[Message | None, AKVError | None], None] = heard.answered
            destinations: list[Landing] = list(views)
            if link.shares_memory:
                destinations = [
                    InPlace(view) if ahead is not None else view
                    for view, ahead in zip(views, lendable, strict=True)
                ]
                on_reply = partial(_lend_answers, heard.answered, link, lendable)
            link.send(
                _PUSHPULL,
                arrays,
                on_reply,
                destinations=destinations,
                # Its answer waits for the round, which the server fails after round_s.
                timeout_s=timeout + self.config.timeouts.round_s,
                on_counted=heard.counted,
            )

    def _worth_asking_ahead(self, entry: Entry) -> bool:
        """Whether a push of ``entry`` asks for the value after its round (see
        :data:`~akv.limits.AHEAD_COPY_MAX_BYTES`)."""
        return entry.nbytes <= AHEAD_COPY_MAX_BYTES or (
            len(entry.parts) == 1 and self.links[entry.parts[0].server].shares_memory
        )

    def _drop_ahead(self, entry: Entry, ahead: _Ahead | None = None) -> None:
        """Forget the key's value asked for ahead (``ahead``: that one, whether it is still
        the key's or not); what holds it goes back once it arrived and no pull reads it."""
        current = self._ahead.get(entry.key)
        if ahead is None:
            ahead = current
        if ahead is None:
            return
        if current is ahead:
            del self._ahead[entry.key]
        ahead.stale = True
        ahead.give_back_when_unread()

    def _answered(self) -> None:
        """A pipelined push was acknowledged (or failed)."""
        self._unacked -= 1
        if self._unacked:
            return
        waiters, self._acks_waiters = self._acks_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _raise_late(self, calls: Iterable[tuple[Entry, object]]) -> None:
        """Raise the error of an earlier pipelined push of one of the keys of ``calls``
        (a call's ``(entry, arrays)``), once."""
        if not self._late:
            return
        for entry, _ in calls:
            late = self._late.get(entry.key)
            if late is not None:
                self._forget_late(late)
                raise late

    def _take_late(self) -> AKVError | None:
        """The first error of a pipelined push nobody was told yet (then forgotten)."""
        if not self._late:
            return None
        late = next(iter(self._late.values()))
        self._forget_late(late)
        return late

    def _forget_late(self, late: AKVError) -> None:
        for key in [key for key, error in self._late.items() if error is late]:
            del self._late[key]

    async def _acks(self) -> None:
        """Wait until every pipelined push was acknowledged (or failed: requests have
        deadlines, so this ends). A push sent as a pushpull is acknowledged once counted,
        not once its round is applied (which may need other workers' calls after a
        barrier)."""
        if self._unacked:
            waiter = asyncio.get_running_loop().create_future()
            self._acks_waiters.append(waiter)
            await waiter

    def pull(
        self, targets: list[tuple[Entry, list[np.ndarray]]], result: Any, priority: int
    ) -> Waitable:
        """Fetch each key's value (in dist_sync: after the round of this worker's last push)."""
        self._check()
        self._raise_late(targets)
        if len(targets) == 1 and self._ahead:
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
        if not _arrived(self._ahead.get(entry.key), entry):
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
        # asked ahead stays as it is (the loop thread changes it only in those, or on
        # arrival, which came before).
        value = self._ahead.get(entry.key)
        if not _arrived(value, entry):
            return _NOT_ARRIVED
        source = value.value()
        for out in outs:
            np.copyto(out, source)
        if value.lent is not None:  # read once: its memory goes back, on the loop
            del self._ahead[entry.key]
            value.stale = True
            self._engine.loop.call_soon_threadsafe(value.give_back_when_unread)
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
        staged, give_back = self._stage(values, borrow, priority)
        return self._schedule_pull(targets, result, staged, give_back, priority)

    def _schedule_pull(
        self,
        targets: list[tuple[Entry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[Entry, np.ndarray]] | None,
        give_back: Callable[[], None],
        priority: int,
    ) -> Waitable:
        """A pull reads the keys; a pushpull (with ``staged`` values) writes them.

        In a ``*_device`` store, GPU outputs are landed in pinned buffers and copied to
        their GPUs by GPU tasks (on copy streams) that follow the pull. The callers
        checked that the store is not broken.
        """
        landed: list[tuple[Entry, np.ndarray, list[Array]]] = []
        if self.keeps_gpu_arrays:
            for target, arrays in targets:
                if any(is_gpu(array) for array in arrays):
                    self._gpu_ready(target)
            targets, landed = _land_in_pinned(targets)
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
        if not landed:
            return task
        by_device: dict[int, list[tuple[Array, list[Array]]]] = {}
        for _, buffer, outs in landed:
            for out in outs:
                by_device.setdefault(int(out.device.id), []).append((buffer, [out]))
        # The copies read the keys too: work issued later on a key (a push, then another pull
        # into the same outputs) waits for them, as it waits for the pull.
        landed_vars = [entry.var for entry, _, _ in landed]
        copies = [
            self._engine.push(
                GPUWork(from_pinned, device=device, kind="copy"),
                items,
                record_on_callers(out for _, outs in items for out in outs),
                reads=landing + landed_vars,
                priority=priority,
                executor=GPU,
                name="land",
            )
            for device, items in by_device.items()
        ]

        def give_back_landed(_: object) -> Any:
            for entry, buffer, _outs in landed:
                entry.give_buffer(buffer)
            return result

        return then(gather([task, *copies]), give_back_landed)

    def _start_pull(
        self,
        targets: list[tuple[Entry, list[np.ndarray]]],
        result: Any,
        staged: list[tuple[Entry, np.ndarray]] | None,
        give_back: Callable[[], None],
        after: list[Any],
        done: Done,
    ) -> None:
        piece: Callable[[Entry, Part, np.ndarray], tuple[WireArray, memoryview]]
        ahead: list[tuple[_Ahead, list[np.ndarray]]] = []
        if staged is None:
            piece = _pull_piece
            if self._ahead:
                targets, ahead = self._answered_ahead(targets)
        else:
            for entry, _ in staged:
                entry.pushes += 1
            piece = partial(_pushpull_piece, {id(e): b for e, b in staged})
        # Where each key's answer lands: its first output when that can take it as it is.
        landing: list[tuple[Entry, np.ndarray]] = []
        for entry, outs in targets:
            first = outs[0]
            host = type(first) is np.ndarray or not is_gpu(first)
            receive = first if host and first.flags.c_contiguous else entry.take_buffer()
            landing.append((entry, receive))
        requests = by_server(landing, piece)

        def finish() -> Any:
            give_back()
            # The answers landed in ``receive`` (sizes checked); fill the other outputs.
            for (entry, receive), (_, outs) in zip(landing, targets, strict=True):
                for out in outs:
                    if out is not receive:
                        copy_into(out, receive, after)
                if receive is not outs[0]:
                    entry.give_buffer(receive)
            for value, outs in ahead:
                if value.error is None:
                    source = value.value()
                    for out in outs:
                        copy_into(out, source, after)
                    if value.lent is not None:  # read once: its memory goes back
                        self._drop_ahead(value.entry, value)
                value.readers -= 1
                value.give_back_when_unread()
            return result

        replies = _Gather(len(requests) + len(ahead), finish, done)
        for value, _ in ahead:
            value.when_arrived(replies.reply)
        op = _PULL if staged is None else _PUSHPULL
        timeout = self.config.timeouts.request_s
        for server, pieces in requests.items():
            arrays, views = zip(*pieces, strict=True)
            self.links[server].send(
                op, arrays, replies.reply, destinations=list(views), timeout_s=timeout
            )

    def _answered_ahead(
        self, targets: list[tuple[Entry, list[np.ndarray]]]
    ) -> tuple[list[tuple[Entry, list[np.ndarray]]], list[tuple[_Ahead, list[np.ndarray]]]]:
        """Split a pull's targets into those to ask the servers for and those answered by
        the value asked for with the key's latest push (dist_sync: it cannot change before
        this worker pushes the key again)."""
        ask = []
        ahead = []
        for entry, outs in targets:
            value = self._ahead.get(entry.key)
            if value is not None and value.pushes == entry.pushes:
                value.readers += 1
                ahead.append((value, outs))
            else:
                if value is not None:  # a later push went another way (strict, pushpull)
                    self._drop_ahead(entry)
                ask.append((entry, outs))
        return ask, ahead

    def barrier(self) -> Task:
        """Wait until every worker called barrier as often as this one (with a deadline).

        First this worker's pipelined pushes sent before it are acknowledged, so that once
        the barrier is passed every worker's earlier pushes have reached the servers (a
        pull after it sees them, in dist_async too). Raises the error of a pipelined push
        nobody was told of yet."""
        self._check()
        late = self._take_late()
        if late is not None:
            raise late
        return self._engine.push(self._acked_barrier, executor="loop", name="barrier")

    async def _acked_barrier(self) -> None:
        await self._acks()
        late = self._take_late()
        if late is not None:
            raise late  # before it is numbered: the next barrier takes its number
        self._barriers += 1
        await self._barrier(self._barriers)

    async def _barrier(self, number: int) -> None:
        deadline = time.monotonic() + self.config.timeouts.barrier_s
        body = {"node_id": self.membership.node_id, "number": number}
        while True:
            self._check()
            try:
                answer = await self.membership.client.json("POST", "/v1/barrier", body)
            except RemoteError as exc:
                raise scheduler_refusal(exc) from exc
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
            self._to_all, Op.SET_OPTIMIZER, text, executor="loop", name="set_optimizer"
        )

    async def _to_all(self, op: Op, text: str) -> list[Message]:
        timeout = self.config.timeouts.request_s
        return await asyncio.gather(
            *(link.request(op, text=text, timeout_s=timeout) for link in self.links)
        )

    def save_states(self, entries: list[Entry], path: Path, dump_optimizer: bool) -> Task:
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

    async def _save_states(self, entries: list[Entry], path: Path, dump: bool) -> None:
        replies = await self._to_all(Op.SAVE_STATES, json.dumps({"dump_optimizer": dump}))
        parts = [bytes(reply.buffers[0]) for reply in replies]
        data = merge_server_states(parts, {e.key: e.layout() for e in entries})
        try:
            await asyncio.to_thread(path.write_bytes, data)
        except OSError as exc:
            raise StateFileError(
                f"save_optimizer_states: cannot write {str(path)!r}: {exc}"
            ) from exc

    def load_states(self, entries: list[Entry], path: Path) -> Task:
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

    async def _load_states(self, entries: list[Entry], path: Path) -> None:
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise StateFileError(
                f"load_optimizer_states: cannot read {str(path)!r}: {exc}"
            ) from exc
        shares = split_server_states(data, len(self.links), {e.key: e.layout() for e in entries})
        timeout = self.config.timeouts.request_s
        await asyncio.gather(
            *(
                link.request(
                    Op.LOAD_STATES, [(None, np.frombuffer(share, np.uint8), 0)], timeout_s=timeout
                )
                for link, share in zip(self.links, shares, strict=True)
            )
        )

    # ------------------------------------------------------------ leaving

    async def abandon(self, reason: str) -> None:
        """The caller's code failed (``reason``): tell the scheduler that this worker
        failed, so that the job fails at once naming it (within
        :data:`~akv.limits.REPORT_FAILURE_S`; should the scheduler not answer, the
        servers still see this worker's streams end without a goodbye), then fail every
        request in flight. :meth:`close` follows, without the barrier and without goodbyes.
        """
        if self.rank < 0 or self._closed:
            return
        rank = self.rank
        if self.broken is None:
            detail = f"left the job: {reason}"
            try:
                await asyncio.wait_for(
                    self.membership.report_lost(self.membership.node_id, "worker", rank, detail),
                    REPORT_FAILURE_S,
                )
            except (asyncio.TimeoutError, TransportError, AKVError, ValueError) as exc:
                log.warning(
                    "worker %d: the scheduler did not take its failure report: %r", rank, exc
                )
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
                await self._acks()  # nothing pushed is dropped: every push is answered first
            late = self._take_late()
            if barrier_before_exit and self.broken is None:
                self._barriers += 1
                await self._barrier(self._barriers)
            if self.broken is None:
                await asyncio.gather(
                    *(
                        link.request(Op.CLOSE, timeout_s=GOODBYE_TIMEOUT_S)
                        for link in self.links
                        if link.lost is None
                    )
                )
                await self.membership.finish()
        finally:
            if self._sweeper is not None:
                self._sweeper.cancel()
            for link in self.links:
                link.close()
            if self._heartbeat is not None:
                await asyncio.to_thread(self._heartbeat.stop)
            await self.membership.close()
        if late is not None:
            raise late


class _Heartbeat:
    """Runs :meth:`Membership.heartbeats` on a thread and loop of its own."""

    def __init__(self, membership: Membership, on_failure: Callable[[str], None]) -> None:
        self._membership = membership
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="akv-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        loop_thread = LoopThread(name="akv-heartbeat-loop")
        try:
            loop_thread.run(self._membership.heartbeats(self._on_failure, self._stop.is_set))
        except Exception as exc:  # reported, never swallowed: the store fails with it
            self._on_failure(f"the heartbeat to the scheduler failed: {exc!r}")
        finally:
            loop_thread.close()

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most one interval and a margin)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            interval = self._membership.config.timeouts.heartbeat_interval_s
            self._thread.join(interval + HEARTBEAT_STOP_S)


def _land_in_pinned(
    targets: list[tuple[Entry, list[Array]]],
) -> tuple[list[tuple[Entry, list[Array]]], list[tuple[Entry, np.ndarray, list[Array]]]]:
    """Pull targets with each key's GPU outputs replaced by one pinned host buffer, and the
    ``(entry, pinned buffer, GPU outputs)`` to copy once the answers landed."""
    host_targets = []
    landed = []
    for entry, outs in targets:
        gpu_outs = [out for out in outs if is_gpu(out)]
        if not gpu_outs:
            host_targets.append((entry, outs))
            continue
        buffer = entry.take_buffer()
        host_targets.append((entry, [buffer, *(out for out in outs if not is_gpu(out))]))
        landed.append((entry, buffer, gpu_outs))
    return host_targets, landed


class _Gather:
    """Waits for the replies of one call's requests (one per server), then reports once.

    ``finish()`` runs when the last reply is in, whatever happened (the buffers the
    requests sent may be reused from then on); its result is reported unless a request
    failed, in which case the first error is.
    """

    __slots__ = ("_done", "_error", "_finish", "_remaining")

    def __init__(self, count: int, finish: Callable[[], Any], done: Done) -> None:
        self._remaining = count
        self._finish = finish
        self._done = done
        self._error: BaseException | None = None
        if count == 0:
            self._complete()

    def reply(self, message: Message | None, error: BaseException | None) -> None:
        if error is not None and self._error is None:
            self._error = error
        self._remaining -= 1
        if not self._remaining:
            self._complete()

    def _complete(self) -> None:
        try:
            result = self._finish()
        except Exception as exc:
            self._error = self._error or exc
        if self._error is not None:
            self._done(None, self._error)
        else:
            self._done(result, None)


class _Ahead:
    """A key's value after the round of one of this worker's pushes, asked for with it.

    ``pushes`` is the key's push count it belongs to. Once ``arrived``, ``error`` is what
    the request failed with, else :meth:`value` is the value: in ``buffer`` (a buffer of
    the key), or ``lent`` where it lies in the server's shared memory until given back.
    ``stale``: forgotten by the key (a later push, a failure, a read of lent memory);
    ``readers``: pulls reading it now. Its memory goes back once it is stale, arrived and
    unread.
    """

    __slots__ = (
        "_give_back",
        "_given_back",
        "_waiters",
        "arrived",
        "buffer",
        "entry",
        "error",
        "lent",
        "pushes",
        "readers",
        "stale",
    )

    def __init__(self, entry: Entry, pushes: int) -> None:
        self.entry = entry
        self.buffer: np.ndarray = entry.take_buffer()
        self.pushes = pushes
        self.arrived = False
        self.error: BaseException | None = None
        self.lent: np.ndarray | None = None
        self.stale = False
        self.readers = 0
        self._give_back: Callable[[], None] | None = None
        self._given_back = False
        self._waiters: list[Callable[[Message | None, BaseException | None], None]] = []

    def when_arrived(self, waiter: Callable[[Message | None, BaseException | None], None]) -> None:
        """``waiter(None, error)`` once it arrived (now, if it has)."""
        if self.arrived:
            waiter(None, self.error)
        else:
            self._waiters.append(waiter)

    def lend(self, view: memoryview, give_back: Callable[[], None]) -> None:
        """The value arrived where it lies in the server's shared memory (read-only
        ``view``); ``give_back()`` gives that memory back."""
        entry = self.entry
        self.lent = np.frombuffer(view, entry.dtype).reshape(entry.shape)
        self._give_back = give_back

    def arrive(self, error: BaseException | None) -> bool:
        """It arrived (or failed with ``error``); True when a waiter was told of the error."""
        self.arrived = True
        self.error = error
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter(None, error)
        return error is not None and bool(waiters)

    def value(self) -> np.ndarray:
        """The value (once arrived without an error)."""
        return self.buffer if self.lent is None else self.lent

    def give_back_when_unread(self) -> None:
        """Give its memory back if it is stale, arrived and unread (once)."""
        if self._given_back or not (self.stale and self.arrived) or self.readers:
            return
        self._given_back = True
        self.entry.give_buffer(self.buffer)
        if self._give_back is not None:
            self._give_back()
        self.lent = None


#: What :meth:`DistBackend._copy_arrived` returns when the value was not there after all.
_NOT_ARRIVED = object()


def _arrived(value: _Ahead | None, entry: Entry) -> TypeGuard[_Ahead]:
    """Whether ``value`` is the key's value after its latest push, arrived without an
    error, and nobody else reads it now."""
    return (
        value is not None
        and value.arrived
        and value.error is None
        and value.pushes == entry.pushes
        and not value.stale
        and not value.readers
    )


def _lend_answers(
    reply: Callable[[Message | None, AKVError | None], None],
    link: ServerLink,
    aheads: Sequence[_Ahead | None],
    message: Message | None,
    error: AKVError | None,
) -> None:
    """A pushpull's answer asked for ahead: the values that lie in the server's shared
    memory are kept there for their pulls (each given back on its own), then ``reply``."""
    if message is not None and message.borrowed and link.protocol is not None:
        give_back = link.protocol.give_back
        offsets = iter(message.borrowed)
        for ahead, view in zip(aheads, message.buffers, strict=True):
            if view.readonly and ahead is not None:
                ahead.lend(view, partial(give_back, [next(offsets)]))
    reply(message, error)


class _Counted:
    """One server's answers to a push: its answer (to ``answer``) and, when the push went
    as a pushpull (asked ahead, or with a pull the link sent along), the interim
    ``COUNTED`` answer before it. The first of the two acknowledges the push there
    (``acknowledge``)."""

    __slots__ = ("_acknowledge", "_answer", "_heard")

    def __init__(
        self,
        acknowledge: Callable[[Message | None, BaseException | None], None],
        answer: Callable[[Message | None, BaseException | None], None],
    ) -> None:
        self._acknowledge = acknowledge
        self._answer = answer
        self._heard = False

    def counted(self) -> None:
        if not self._heard:
            self._heard = True
            self._acknowledge(None, None)

    def answered(self, message: Message | None, error: AKVError | None) -> None:
        self._answer(message, error)
        if not self._heard:  # refused, lost, or resent without asking: the answer says
            self._heard = True
            self._acknowledge(None, error)


class _PushAnswers:
    """What a pipelined push's answers report to: an error is kept for the next call on
    one of ``keys`` (and barrier and close); ``done`` is told too when the push waited for
    them (past ``MAX_UNACKED_PUSHES``)."""

    __slots__ = ("_backend", "_done", "_keys", "_late", "_told")

    def __init__(self, backend: DistBackend, keys: list[Key], done: Done | None) -> None:
        self._backend = backend
        self._keys = keys
        self._done = done
        #: The error kept for the keys, and whether a pull raised the push's error itself.
        self._late: AKVError | None = None
        self._told = False

    def answer_told(self, late: AKVError | None, taken: bool) -> None:
        """The value asked with the push arrived, or failed with ``late``, which a pull
        waiting for it raised (``taken``): then it is not kept for a later call too; if
        nobody raised it and the push was acknowledged already, it is kept now."""
        backend = self._backend
        if taken:
            self._told = True
            if self._late is not None:
                backend._forget_late(self._late)
        elif late is not None and self._late is None:
            for key in self._keys:
                backend._late.setdefault(key, late)

    def acknowledged(self, result: Any, error: BaseException | None) -> None:
        backend = self._backend
        if error is not None and not self._told:
            late = self._late = _late_error(error, self._keys)
            for key in self._keys:
                backend._late.setdefault(key, late)
        if self._done is not None:
            self._done(result, error)
        backend._answered()


def _late_error(error: BaseException, keys: list[Key]) -> AKVError:
    """The error a later call raises for a pipelined push of ``keys`` that failed: the
    same class, naming the push (the server's error is its cause)."""
    named = ", ".join(repr(key) for key in keys[:8]) + (", ..." if len(keys) > 8 else "")
    text = f"an earlier push of key {named} failed: {error}"
    cls = type(error) if isinstance(error, AKVError) else ServerError
    try:
        late = cls(text)
    except TypeError:
        late = ServerError(text)
    late.__cause__ = error
    return late


def _part_of(entry: Entry, part: Part, array: np.ndarray) -> WireArray:
    """A key's part of a push (numbered: the key's pushes so far) or of an init."""
    return (entry.key, entry.wire_view(array, part), entry.pushes)


def _pull_piece(entry: Entry, part: Part, receive: np.ndarray) -> tuple[WireArray, memoryview]:
    """A pull's request for a key's part (no values), and where its answer lands."""
    return (entry.key, _NO_VALUES[entry.dtype], 0), entry.wire_view(receive, part).data.cast("B")


def _pushpull_piece(
    pushed: dict[int, np.ndarray], entry: Entry, part: Part, receive: np.ndarray
) -> tuple[WireArray, memoryview]:
    """A pushpull's request for a key's part (``pushed``: ``id(entry)`` -> the values,
    numbered with the key's pushes so far), and where its answer lands."""
    sent = entry.wire_view(pushed[id(entry)], part)
    return (entry.key, sent, entry.pushes), entry.wire_view(receive, part).data.cast("B")


def _ahead_piece(
    staged: dict[int, tuple[np.ndarray, _Ahead]], entry: Entry, part: Part, _: np.ndarray
) -> tuple[WireArray, memoryview, _Ahead | None]:
    """A push's request for a key's part that asks for the value after its round too
    (``staged``: ``id(entry)`` -> the values and the :class:`_Ahead` they land in), where
    its answer lands, and the ahead when the answer may stay where it lies in shared memory
    (a key in one part)."""
    values, ahead = staged[id(entry)]
    view = entry.wire_view(ahead.buffer, part).data.cast("B")
    lendable = ahead if len(entry.parts) == 1 else None
    return (entry.key, entry.wire_view(values, part), entry.pushes), view, lendable


def _meta_of(entry: Entry, part: Part, _: None) -> tuple[Key, tuple[int, ...], str]:
    shape = entry.shape if len(entry.parts) == 1 else (part.size,)
    return (entry.key, shape, str(entry.dtype))


def _ignored(result: Any, error: BaseException | None) -> None:
    """A push's answer once its acknowledgement was reported (see ``_Counted``)."""


def _nothing() -> None:
    return None
