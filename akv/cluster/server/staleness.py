"""dist_async with bounded staleness: pushes that would run too far ahead wait (pure).

With a bound ``k`` (``create("dist_async", staleness=k)``), a worker's push of a key is
taken only while that worker is at most ``k`` pushes of the key ahead of the slowest worker
(counted by the push numbers the server counted: :meth:`KeyRounds.lead`); otherwise the
whole frame waits, and so does every later push or pull frame of that worker (so that a pull
still sees the worker's earlier pushes, and frames keep their order). Each counted push may
let waiting frames go, oldest first. ``k = 0`` makes lock-step rounds with asynchronous
application; no bound is plain dist_async. A frame that waits longer than the round
deadline fails with :class:`~akv.errors.RoundTimeoutError` naming the slow workers. This is
the stale synchronous parallel model of Petuum and Angel, with one number.

:class:`Waiting` keeps the frames; :class:`~akv.cluster.server.state.ServerState` asks it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from akv.cluster.protocol import Op
from akv.cluster.server.buffers import Landing
from akv.cluster.server.instructions import Peer
from akv_transport import FrameHeader

__all__ = ["Ahead", "Parked", "Waiting"]

#: ``ahead(worker, key, tag)``: how many pushes of ``key`` the worker is ahead of the
#: slowest worker, or -1 when its push numbered ``tag`` was counted already.
Ahead = Callable[[int, object, int], int]


@dataclass(eq=False, slots=True)
class Parked:
    """A frame that waits: who sent it, its header and landing, and since when."""

    peer: Peer
    header: FrameHeader
    landing: Landing
    since: float


class Waiting:
    """The frames that wait, in arrival order per worker (``bound``: the staleness ``k``)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._queues: dict[int, deque[Parked]] = {}

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __iter__(self) -> Iterator[Parked]:
        for queue in self._queues.values():
            yield from queue

    def must_wait(self, peer: Peer, header: FrameHeader, ahead: Ahead) -> bool:
        """Whether a frame must wait: its worker has frames waiting, or it is a push that
        :meth:`blocked` holds."""
        return self.has(peer.worker) or self.blocked(peer, header, ahead)

    def blocked(self, peer: Peer, header: FrameHeader, ahead: Ahead) -> bool:
        """Whether a push frame names a key its worker is more than ``bound`` pushes ahead
        on (``ahead(worker, key, tag)``: that lead, or -1 for a push counted already)."""
        if header.op in (Op.PULL, Op.ROW_PULL):
            return False
        worker = peer.worker
        return any(ahead(worker, info.key, info.tag) > self.bound for info in header.arrays)

    def has(self, worker: int) -> bool:
        """Whether ``worker`` has frames waiting (then its next frames wait behind them)."""
        return bool(self._queues.get(worker))

    def park(self, parked: Parked) -> None:
        """``parked`` waits behind its worker's earlier frames."""
        self._queues.setdefault(parked.peer.worker, deque()).append(parked)

    def pop_ready(self, blocked: Callable[[Parked], bool]) -> Parked | None:
        """The first frame at the head of a worker's queue that may go now (a pull, or a
        push that ``blocked`` lets go), taken out; None when none may."""
        for worker, queue in self._queues.items():
            if queue and not blocked(queue[0]):
                parked = queue.popleft()
                if not queue:
                    del self._queues[worker]
                return parked
        return None

    def pop_overdue(self, now: float, timeout_s: float) -> Parked | None:
        """A frame at the head of a worker's queue that waited longer than ``timeout_s``,
        taken out; None when none did."""
        for worker, queue in self._queues.items():
            if queue and now - queue[0].since > timeout_s:
                parked = queue.popleft()
                if not queue:
                    del self._queues[worker]
                return parked
        return None

    def take(self, keep: Callable[[Parked], bool] = lambda _: False) -> list[Parked]:
        """Take out every frame ``keep`` does not keep (all, by default)."""
        taken = [parked for parked in self if not keep(parked)]
        for worker in list(self._queues):
            queue = deque(parked for parked in self._queues[worker] if keep(parked))
            if queue:
                self._queues[worker] = queue
            else:
                del self._queues[worker]
        return taken
