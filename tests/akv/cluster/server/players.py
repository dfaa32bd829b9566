"""A test helper that plays several workers against one :class:`ServerState`, no sockets.

Requests are encoded and decoded with the real frame code, fed to the state as the
service would (header, then the whole message), and the instructions it returns are
carried out at once, synchronously: array work with the same ``land`` function the service
runs, replies recorded per (worker, seq). ``hold_updates`` keeps array work queued until
:meth:`Players.finish_updates`, to look at the state between a push and its apply.
``lend`` hands push payloads over as a stream sharing memory does: read-only views read in
place, given back (noted in ``given_back``) once nothing reads them.
After every event the state's invariants are checked.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from akv.cluster.protocol import Note, Op, encode_row_meta
from akv.cluster.server.instructions import (
    Checkpoint,
    CloseStream,
    FailJob,
    InstallOptimizer,
    Instruction,
    Land,
    LandRows,
    LoadStates,
    Peer,
    Reply,
    ReplyError,
    SaveStates,
    SendRows,
    SendValues,
)
from akv.cluster.server.row_keys import gather_rows, land_rows
from akv.cluster.server.state import ServerState
from akv.cluster.server.updates import land
from akv_engine import Var
from akv_transport import decode_frame, frame_bytes

OK = "ok"


class Players:
    """``num_workers`` workers of a ``store_type`` job talking to one server state (one that
    writes checkpoints with ``checkpoints``)."""

    def __init__(
        self,
        num_workers: int = 2,
        store_type: str = "dist_sync",
        init_timeout_s: float = 5.0,
        checkpoints: bool = False,
        staleness: int | None = None,
    ) -> None:
        ids = itertools.count()
        self.staleness = staleness
        self.state = ServerState(
            "server 0",
            num_workers,
            init_timeout_s,
            lambda name: Var(None, next(ids), name),
            checkpoints=checkpoints,
        )
        self.store_type = store_type
        self.now = 0.0
        #: The streams the state told the service to close (a newer one replaced them).
        self.closed: list[Peer] = []
        self.replies: dict[tuple[int, int], Any] = {}
        #: Exceptions behind error answers that the state did not expect (logged with a
        #: traceback by the service): a client's mistake never adds one.
        self.unexpected: list[BaseException] = []
        self.failures: list[FailJob] = []
        #: Row answers of at least this many bytes are gathered into "shared memory"
        #: regions (``regions``; the arrays gathered there: ``placed``), as a server does
        #: for a worker on its host.
        self.region_min_bytes: int | None = 64
        self.regions: list[memoryview] = []
        self.placed: list[np.ndarray] = []
        self.checkpoints: list[Checkpoint] = []
        self.held: list[Land | LandRows] = []
        self.hold_updates = False
        self.lend = False
        #: (worker, seq) of each interim answer that a request's push was counted.
        self.counted: list[tuple[int, int]] = []
        #: (worker, seq) of each request whose lent payloads were given back, in order.
        self.given_back: list[tuple[int, int]] = []
        self._seq = itertools.count(1)
        self.peers: list[Peer] = [self._open(worker) for worker in range(num_workers)]

    # ---------------------------------------------------------------- requests

    def send(
        self,
        worker: int,
        op: Op,
        arrays: list[tuple[Any, np.ndarray]] | None = None,
        text: str = "",
        *,
        seq: int | None = None,
        tags: list[int] | None = None,
        flags: int = 0,
    ) -> int:
        """Worker ``worker`` sends one request (``seq``: sent again with that number;
        ``tags``: the push numbers of its arrays, 0 by default); returns its seq (look up
        :meth:`reply`)."""
        if seq is None:
            seq = next(self._seq)
        else:
            self.replies.pop((worker, seq), None)  # a resent request is answered again
        items = arrays or []
        wire = [
            (key, array, tag)
            for (key, array), tag in zip(items, tags or [0] * len(items), strict=True)
        ]
        data = frame_bytes(op, seq, wire, text=text, flags=flags)
        header, buffers = decode_frame(data)
        peer = self.peers[worker]
        landing = self.state.header_arrived(peer, header)
        if self.lend and landing.read_in_place:
            buffers = [memoryview(bytes(buffer)) for buffer in buffers]  # read-only
            landing.lend(buffers, lambda: self.given_back.append((worker, seq)))
        else:
            for buffer, target in zip(buffers, landing.buffers, strict=True):
                if target is not None:
                    memoryview(target).cast("B")[:] = buffer
        instructions = self.state.message_completed(peer, header, buffers, landing, self.now)
        if landing.lent is not None:  # as the service: nothing reads them any more
            landing.lent.give_back()
        self.run(instructions)
        return seq

    def init(self, worker: int, values: dict[Any, np.ndarray]) -> int:
        return self.send(worker, Op.INIT, list(values.items()))

    def push(
        self, worker: int, values: dict[Any, np.ndarray], tag: int = 0, seq: int | None = None
    ) -> int:
        """A push whose arrays all carry push number ``tag``."""
        return self.send(worker, Op.PUSH, list(values.items()), seq=seq, tags=[tag] * len(values))

    def row_init(self, worker: int, key: Any, shape: tuple[int, ...], rows: tuple[int, int]) -> int:
        """Rank ``worker``'s ``ROW_INIT`` of ``key`` (float32, this server's ``rows``), with
        no row stored."""
        text = encode_row_meta([(key, shape, "float32", *rows)])
        ids, data = np.zeros(0, np.int64), np.zeros((0, *shape[1:]), np.float32)
        return self.send(worker, Op.ROW_INIT, [(key, ids), (key, data)], text)

    def row_push(
        self,
        worker: int,
        key: Any,
        ids: list[int],
        data: np.ndarray,
        tag: int,
        seq: int | None = None,
    ) -> int:
        """A ``ROW_PUSH`` of ``key``'s rows ``ids``, push number ``tag``."""
        wire = [(key, np.asarray(ids, np.int64)), (key, np.asarray(data, np.float32))]
        return self.send(worker, Op.ROW_PUSH, wire, seq=seq, tags=[tag, tag])

    def row_pull(self, worker: int, key: Any, ids: list[int]) -> int:
        return self.send(worker, Op.ROW_PULL, [(key, np.asarray(ids, np.int64))])

    def pull(self, worker: int, keys: list[Any], dtype: Any = np.float32) -> int:
        return self.send(worker, Op.PULL, [(key, np.empty(0, dtype)) for key in keys])

    def reply(self, worker: int, seq: int) -> Any:
        """What request ``seq`` of ``worker`` got: ``"ok"``, an error, a ``{key: array}``
        of pulled values, or bytes (saved states); KeyError while it waits."""
        return self.replies[(worker, seq)]

    def waiting(self, worker: int, seq: int) -> bool:
        return (worker, seq) not in self.replies

    # ---------------------------------------------------------------- events

    def lose(self, worker: int, exc: BaseException | None = None) -> None:
        self.run(self.state.peer_lost(self.peers[worker], exc, self.now))

    def reconnect(self, worker: int, note: Note | None = None, replay: int | None = None) -> None:
        """Worker ``worker`` opens a new stream of its session (after a cut), having last
        been told ``note`` (a ``DURABLE`` note), to send requests again from after
        ``replay`` barriers (``X-AKV-Replay``; None: no header)."""
        self.peers[worker] = self._open(worker, note, replay)

    def _open(self, worker: int, note: Note | None = None, replay: int | None = None) -> Peer:
        peer, instructions = self.state.admit(
            worker,
            self.store_type,
            stream=True,
            session=f"session{worker}",
            note=note,
            staleness=self.staleness,
            replay=replay,
        )
        self.run(instructions)
        return peer

    def tick(self, now: float, round_timeout_s: float = 10.0) -> None:
        self.now = now
        self.run(self.state.tick(now, round_timeout_s))

    def checkpoint_written(self) -> None:
        """A checkpoint of everything so far was written: answer who asked for it."""
        asked, self.checkpoints = self.checkpoints, []
        self.run(self.state.checkpointed(self.state.checkpoint_plan()))
        for checkpoint in asked:
            self._answer(checkpoint.peer, checkpoint.seq, OK)

    def finish_updates(self) -> None:
        held, self.held = self.held, []
        for work in held:
            self._land(work)

    # ---------------------------------------------------------------- carrying out

    def run(self, instructions: list[Instruction]) -> None:
        for instruction in instructions:
            self._carry_out(instruction)
        self.state.validate()

    def _answer(self, peer: Peer, seq: int, what: Any) -> None:
        key = (peer.worker, seq)
        assert key not in self.replies, f"request {key} answered twice"
        self.replies[key] = what

    def _carry_out(self, instruction: Instruction) -> None:
        if isinstance(instruction, Reply) and instruction.counted:
            self.counted.append((instruction.peer.worker, instruction.seq))
        elif isinstance(instruction, Reply):
            self._answer(instruction.peer, instruction.seq, OK)
        elif isinstance(instruction, ReplyError):
            self._answer(instruction.peer, instruction.seq, instruction.error)
            if instruction.cause is not None:  # the service logs it with its traceback
                self.unexpected.append(instruction.cause)
        elif isinstance(instruction, (Land, LandRows)):
            if self.hold_updates:
                self.held.append(instruction)
            else:
                self._land(instruction)
        elif isinstance(instruction, SendRows):
            ticket = instruction.ticket
            arrays, placed = gather_rows(ticket, self._region)
            self.placed.extend(placed)
            rows = {key: rows.copy() for key, rows, _ in arrays}
            self._answer(ticket.peer, ticket.seq, rows)
        elif isinstance(instruction, SendValues):
            ticket = instruction.ticket
            values = {e.key: e.value.copy() for e in ticket.entries}
            self._answer(ticket.peer, ticket.seq, values)
        elif isinstance(instruction, InstallOptimizer):
            self.state.install_optimizer(instruction.optimizer, instruction.config)
            self._answer(instruction.peer, instruction.seq, OK)
        elif isinstance(instruction, SaveStates):
            data = instruction.updater.dump_states(instruction.dump)
            self._answer(instruction.peer, instruction.seq, data)
        elif isinstance(instruction, LoadStates):
            instruction.updater.load_states(instruction.data)
            self._answer(instruction.peer, instruction.seq, OK)
        elif isinstance(instruction, FailJob):
            self.failures.append(instruction)
        elif isinstance(instruction, Checkpoint):
            self.checkpoints.append(instruction)  # answered by :meth:`checkpoint_written`
        elif isinstance(instruction, CloseStream):
            self.closed.append(instruction.peer)
        else:  # pragma: no cover - a new instruction nobody taught this helper
            raise AssertionError(f"unknown instruction {instruction!r}")

    def _region(self, nbytes: int) -> memoryview | None:
        """A region of "shared memory" for an answer's rows (as ``SharedMemory.take``):
        for answers of at least :attr:`region_min_bytes` (None: never)."""
        if self.region_min_bytes is None or nbytes < self.region_min_bytes:
            return None
        region = memoryview(bytearray(nbytes))
        self.regions.append(region)
        return region

    def _land(self, work: Land | LandRows) -> None:
        if isinstance(work, LandRows):
            done, failed = land_rows(work, self.state.updater)
            for lent in work.lent:
                lent.give_back()
            self._landed(work, done, failed)
            return
        done, failed, to_give_back = land(work, self.state.updater)
        if work.lent is not None:
            work.lent.give_back()
        for lent in to_give_back:
            lent.give_back()
        self._landed(work, done, failed)

    def _landed(self, work: Land | LandRows, done: Any, failed: Any) -> None:
        self.run(self.state.rounds_applied(done))
        for entry, round_no, exc in failed:
            self.run(self.state.update_failed(entry, round_no, exc))
        if work.reply is not None:
            self.run([self.state.push_applied(work.reply, failed)])
