"""A server's decisions about one key: rounds, their completion, and waiting pulls.

Plain code without I/O or arrays (the server does the merging and sending). Every
server holds one :class:`KeyRounds` per key it stores (per part, for a split key).

Meaning, in ``dist_sync``:

* round ``r`` of a key collects exactly one push from each of the ``num_workers`` workers,
  counted by worker rank, not by request: a worker pushing again before round ``r`` is
  complete gets :class:`~akv.errors.DoublePushError` and the round is not touched (MXNet
  counts requests, so a double push silently closes the round with the wrong sum);
* the first push of a round starts the round's merge buffer, later ones add to it; the
  push that completes the round closes it, and the server applies the sum (through the
  updater, or by assignment);
* a pull must see the round of the puller's latest push to the key (the server keeps
  track of it; a rejected push does not count) and is answered once that round has been
  applied, so a pull issued after a push sees the result of that push's round.

In ``dist_async`` every push is a round of its own, applied as it arrives; a pull is
answered at once with the value as it is.

Exactly once: each push carries the worker's number for it (its ``tag``: 1, 2, ... per key;
0 when the sender does not number its pushes). A push whose number is not above the last
one counted for that worker is a duplicate (a request resent after a reconnect, or to a
server restored from a checkpoint): :meth:`KeyRounds.is_duplicate` says so and it is
answered without being counted. :meth:`KeyRounds.durable` is what a checkpoint keeps of a
key's rounds, and :meth:`KeyRounds.restore` what a restored server starts from.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from akv.errors import DoublePushError, ServerError

#: What a parked pull is remembered by (the server's pull ticket).
T = TypeVar("T")

__all__ = ["KeyRounds", "PushDecision", "longest_wait", "untold_errors", "update_error"]


@dataclass(frozen=True, slots=True)
class PushDecision:
    """What the server does with an accepted push.

    ``first``: the push starts its round's merge buffer (else it is added to it).
    ``closes``: the push completes round ``round``, which must now be applied.
    ``waited_s``: for a push that completes a dist_sync round, how long the round waited
    for it, the last worker's push, since its first push (None otherwise).
    """

    first: bool
    closes: bool
    round: int
    waited_s: float | None = None


def longest_wait(waited: float | None, decision: PushDecision) -> float | None:
    """The longer of ``waited`` and what the round ``decision`` closes waited for its last
    push (None: neither is a wait); a frame's rounds report their longest."""
    if decision.waited_s is None:
        return waited
    return decision.waited_s if waited is None else max(waited, decision.waited_s)


class KeyRounds(Generic[T]):
    """The round bookkeeping of one key on one server; ``T`` is the type of the tickets of
    parked pulls."""

    __slots__ = (
        "_last",
        "_open",
        "_tags",
        "_untold",
        "_waiting",
        "applied_round",
        "closed_round",
        "key",
        "num_workers",
        "opened_at",
        "sync",
    )

    def __init__(self, key: Hashable, num_workers: int, sync: bool) -> None:
        self.key = key
        self.num_workers = num_workers
        self.sync = sync
        self.applied_round = 0
        self.closed_round = 0
        self.opened_at: float | None = None
        #: The open round's contributors (dist_sync): worker -> (its number and last round
        #: before this push, the push's request number).
        self._open: dict[int, tuple[int, int, int]] = {}
        self._last: dict[int, int] = {}
        self._tags: dict[int, int] = {}
        self._waiting: list[tuple[int, T]] = []
        #: dist_sync: the error of a failed round, by each worker that pushed into it and
        #: was not told yet (its next pull of the key is answered with it).
        self._untold: dict[int, ServerError] = {}

    @property
    def open_round(self) -> int:
        """The round that pushes go into now."""
        return self.closed_round + 1

    def missing(self) -> list[int]:
        """The workers whose push the open round still needs (sync; empty when none pushed)."""
        if not self._open:
            return []
        return [w for w in range(self.num_workers) if w not in self._open]

    def is_duplicate(self, worker: int, tag: int) -> bool:
        """True when ``worker``'s push number ``tag`` was counted already (0: unnumbered,
        never a duplicate)."""
        return 0 < tag <= self._tags.get(worker, 0)

    def lead(self, worker: int) -> tuple[int, list[int]]:
        """How many pushes of the key ``worker`` is ahead of the slowest worker (by the
        push numbers counted), and the slowest workers (bounded staleness)."""
        counts = [self._tags.get(w, 0) for w in range(self.num_workers)]
        low = min(counts)
        return counts[worker] - low, [w for w, count in enumerate(counts) if count == low]

    def check_push(self, worker: int) -> None:
        """Raise if ``worker`` may not push now (without changing anything).

        Raises
        ------
        DoublePushError
            When ``worker`` already pushed into the open round (dist_sync).
        """
        if not 0 <= worker < self.num_workers:
            raise ServerError(f"push to key {self.key!r} from unknown worker rank {worker}")
        if self.sync and worker in self._open:
            raise DoublePushError(
                f"worker {worker} pushed key {self.key!r} twice in round {self.open_round}; "
                f"the round still waits for workers {self.missing()} (in dist_sync each "
                "worker pushes a key once per round: pull before pushing again)"
            )

    def accept_push(self, worker: int, now: float, tag: int = 0, seq: int = 0) -> PushDecision:
        """Count push number ``tag`` from ``worker``, sent in request ``seq`` (``now``: a
        clock reading, for round timeouts). Check :meth:`is_duplicate` first.

        Raises
        ------
        DoublePushError
            As :meth:`check_push` (nothing changes then).
        """
        self.check_push(worker)
        previous_tag = self._tags.get(worker, 0)
        if tag:
            self._tags[worker] = tag
        if not self.sync:
            self.closed_round += 1
            self._last[worker] = self.closed_round
            return PushDecision(first=True, closes=True, round=self.closed_round)
        first = not self._open
        if first:
            self.opened_at = now
        self._open[worker] = (previous_tag, self._last.get(worker, 0), seq)
        self._last[worker] = self.open_round
        if len(self._open) < self.num_workers:
            return PushDecision(first=first, closes=False, round=self.open_round)
        self.closed_round += 1
        self._open.clear()
        waited_s = now - self.opened_at if self.opened_at is not None else 0.0
        self.opened_at = None
        return PushDecision(first=first, closes=True, round=self.closed_round, waited_s=waited_s)

    def open_seqs(self) -> dict[int, int]:
        """The request number of each push counted in the open round, by worker."""
        return {worker: seq for worker, (_, _, seq) in self._open.items()}

    def durable(self) -> tuple[int, dict[int, int], dict[int, int]]:
        """What a checkpoint of the key's value after :attr:`closed_round` keeps: that
        round, and each worker's last push number and last push round in it (the open
        round's pushes are not in the value: they are resent after a restore)."""
        tags = dict(self._tags)
        last = dict(self._last)
        for worker, (tag, round_no, _) in self._open.items():
            tags[worker] = tag
            last[worker] = round_no
        tags = {worker: tag for worker, tag in tags.items() if tag}
        last = {worker: round_no for worker, round_no in last.items() if round_no}
        return self.closed_round, tags, last

    def restore(
        self,
        closed_round: int,
        tags: dict[int, int],
        last: dict[int, int],
        untold: Mapping[int, ServerError] | None = None,
    ) -> None:
        """Start from a checkpoint (:meth:`durable`'s values, and :meth:`untold`'s errors),
        with no open round."""
        self.closed_round = self.applied_round = closed_round
        self._tags = dict(tags)
        self._last = dict(last)
        self._untold = dict(untold or {})
        self._open.clear()
        self.opened_at = None

    def untold(self) -> dict[int, str]:
        """The message of each failed round's error not told yet, by worker: what a
        checkpoint keeps of them. (Read by a checkpoint's copy, off the server's loop: one
        dict copy, which the GIL makes whole.)"""
        return {worker: str(error) for worker, error in dict(self._untold).items()}

    def forget_worker(self, worker: int) -> None:
        """Forget ``worker``'s push numbers and rounds (a worker of a new job started from a
        checkpoint: its pushes are numbered from 1 again). Only with no open round."""
        assert worker not in self._open, "a worker forgotten in an open round"
        self._tags.pop(worker, None)
        self._last.pop(worker, None)
        self._untold.pop(worker, None)

    def last_push_round(self, worker: int) -> int:
        """The round that ``worker``'s latest accepted push went into (0: none yet)."""
        return self._last.get(worker, 0)

    def check_pull(self, after_round: int) -> None:
        """Raise if a pull that must see ``after_round`` can never be answered.

        Raises
        ------
        ServerError
            When ``after_round`` is beyond the open round (pushes this server never got).
        """
        if after_round > self.open_round:
            raise ServerError(
                f"pull of key {self.key!r} asks for round {after_round}, but this server "
                f"has only seen pushes up to round {self.open_round}"
            )

    def pull(self, after_round: int, ticket: T) -> bool:
        """True when a pull that must see ``after_round`` can be answered now; else park
        ``ticket`` until that round is applied.

        Raises
        ------
        ServerError
            As :meth:`check_pull`.
        """
        self.check_pull(after_round)
        if not self.sync or after_round <= self.applied_round:
            return True
        self._waiting.append((after_round, ticket))
        return False

    def waiting_rounds(self) -> list[tuple[int, T]]:
        """Every parked pull: the round it waits for, and its ticket."""
        return list(self._waiting)

    def applied(self, round_no: int) -> list[T]:
        """Mark round ``round_no`` applied; return the tickets of the pulls it answers."""
        self.applied_round = max(self.applied_round, round_no)
        if not self._waiting:
            return []
        ready = [t for r, t in self._waiting if r <= self.applied_round]
        self._waiting = [(r, t) for r, t in self._waiting if r > self.applied_round]
        return ready

    def failed(self, round_no: int, error: ServerError, told: set[int]) -> None:
        """Applying round ``round_no`` raised ``error``; the workers in ``told`` heard of it
        (their pulls waited for the round). In dist_sync a round's pushes were answered once
        counted, so every other worker that pushed into it is told by its next pull of the
        key (:meth:`take_untold`): its push changed nothing, and no pull may read as if it
        had. In dist_async the failed push's own answer carries the error."""
        if not self.sync:
            return
        for worker, last in self._last.items():
            if last >= round_no and worker not in told:
                self._untold[worker] = error

    def take_untold(self, worker: int) -> ServerError | None:
        """The error of a failed round ``worker`` pushed into and was not told of yet (then
        it counts as told), or None."""
        return self._untold.pop(worker, None) if self._untold else None

    def waiting_tickets(self) -> list[T]:
        """Every parked pull's ticket."""
        return [ticket for _, ticket in self._waiting]

    def take_waiting(self) -> list[T]:
        """Remove and return every parked pull's ticket (to fail them)."""
        tickets = self.waiting_tickets()
        self._waiting.clear()
        return tickets

    def overdue(self, now: float, timeout_s: float) -> bool:
        """True when the open round has waited for its last pushes longer than ``timeout_s``."""
        return self.opened_at is not None and now - self.opened_at > timeout_s


def untold_errors(untold: Mapping[int, str], server: str) -> dict[int, ServerError]:
    """The failed rounds' errors a checkpoint kept (:meth:`KeyRounds.untold`) for workers
    not told of them yet, as ``server`` raises them."""
    return {worker: ServerError(message, server=server) for worker, message in untold.items()}


def update_error(key: Hashable, round_no: int, exc: BaseException, server: str) -> ServerError:
    """The error of round ``round_no`` of ``key``, whose update raised ``exc`` on
    ``server``: what every worker that pushed into it is told."""
    return ServerError(
        f"the update of key {key!r} in round {round_no} failed on {server}: "
        f"{type(exc).__name__}: {exc}",
        server=server,
    )
