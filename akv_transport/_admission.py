"""Who may hold a connection to a listener: counting and deciding, no I/O.

A connection is a *stranger* until a request on it passed the token check; then it is
*authenticated* for as long as it stays open. The two never share a budget, so that
connections without the token cannot take the place of the job's own (issue #24):

* authenticated connections of one address: at most ``max_authenticated_per_peer``; a new
  connection from an address that holds that many is refused at once (it could only be one
  more), and strangers never count against it;
* strangers: at most ``max_strangers_per_peer`` per address and ``max_strangers`` in all;
  each may hold its place for the listener's idle timeout (the caller's timer);
* a new connection that finds the strangers' places taken is neither refused nor given
  anyone's place: it is *on probation*, one of at most ``max_probation`` (all addresses
  together), and its caller closes it unless it authenticates within a short deadline.
  When the probation places are taken too, the oldest probationer that has sent nothing
  (else the oldest) is closed to make room. A job's connection sends its request at once
  and authenticates within milliseconds, so however many idle connections strangers hold,
  it gets in; ``max_probation`` 0 refuses it instead, as a full address did before.

An authenticated connection is never closed to make room for anyone.
:class:`Admission` counts and decides; the asyncio protocol that holds the sockets and the
timers (:class:`akv_transport._http_guard.Guard`) carries its decisions out.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "Admission",
    "AdmissionStatistics",
    "Decision",
    "PeerCount",
    "Standing",
    "check_bound",
]

K = TypeVar("K")


class Standing(enum.Enum):
    """Where a connection stands."""

    #: Has not authenticated; holds a stranger's place, for the idle timeout at most.
    STRANGER = "stranger"
    #: Came when the strangers' places were taken: must authenticate within the deadline.
    PROBATION = "probation"
    #: A request on it passed the token check.
    AUTHENTICATED = "authenticated"


@dataclass(frozen=True)
class Decision(Generic[K]):
    """What :meth:`Admission.admit` decided for a new connection."""

    #: Its standing; None: refused (close it at once).
    standing: Standing | None
    #: Why it is refused or on probation ("" for a stranger), for the log.
    why: str = ""
    #: Probationers closed to make room for it (the caller closes their connections).
    evicted: tuple[K, ...] = ()


@dataclass(frozen=True)
class PeerCount:
    """The connections one address holds, by standing."""

    strangers: int = 0
    probation: int = 0
    authenticated: int = 0


@dataclass(frozen=True)
class AdmissionStatistics:
    """The connections a listener holds now, and what it refused and evicted so far."""

    strangers: int
    probation: int
    authenticated: int
    refused: int
    evicted: int


@dataclass
class _Entry:
    peer: str
    standing: Standing
    spoke: bool = False


class Admission(Generic[K]):
    """The connections of one listener, keyed by anything hashable (the protocol object of
    each connection), counted by address and standing (module docstring). None: no bound.

    ``max_strangers_per_peer`` is taken as at most ``max_authenticated_per_peer``: an
    address never holds more strangers than it could hold authenticated connections.
    """

    def __init__(
        self,
        *,
        max_authenticated_per_peer: int | None,
        max_strangers_per_peer: int | None,
        max_strangers: int | None,
        max_probation: int,
    ) -> None:
        check_bound("max_authenticated_per_peer", max_authenticated_per_peer)
        check_bound("max_strangers_per_peer", max_strangers_per_peer)
        check_bound("max_strangers", max_strangers)
        if max_probation < 0:
            raise ValueError(f"max_probation must be at least 0, not {max_probation}")
        self.max_authenticated_per_peer = max_authenticated_per_peer
        self.max_strangers_per_peer = _smaller(max_strangers_per_peer, max_authenticated_per_peer)
        self.max_strangers = max_strangers
        self.max_probation = max_probation
        self._entries: dict[K, _Entry] = {}
        self._probation: dict[K, None] = {}  # oldest first
        self._strangers: Counter[str] = Counter()
        self._authenticated: Counter[str] = Counter()
        self._refused = 0
        self._evicted = 0

    def admit(self, key: K, peer: str) -> Decision[K]:
        """Count a new connection of ``peer`` (an address) under ``key``: a stranger, on
        probation (possibly closing others, :attr:`Decision.evicted`), or refused (not
        counted)."""
        if key in self._entries:
            raise ValueError(f"connection {key!r} is counted already")
        authenticated = self._authenticated[peer]
        most = self.max_authenticated_per_peer
        if most is not None and authenticated >= most:
            self._refused += 1
            return Decision(
                None,
                f"its address holds {authenticated} authenticated connections already, the "
                "most one address may",
            )
        crowded = self._crowded(peer)
        if not crowded:
            self._entries[key] = _Entry(peer, Standing.STRANGER)
            self._strangers[peer] += 1
            return Decision(Standing.STRANGER)
        if self.max_probation == 0:
            self._refused += 1
            return Decision(None, crowded)
        evicted: tuple[K, ...] = ()
        if len(self._probation) >= self.max_probation:
            victim = self._victim()
            self._forget(victim)
            self._evicted += 1
            evicted = (victim,)
        self._entries[key] = _Entry(peer, Standing.PROBATION)
        self._probation[key] = None
        return Decision(Standing.PROBATION, crowded, evicted)

    def spoke(self, key: K) -> None:
        """The connection sent bytes: when probationers must make room, it goes after
        those that sent nothing."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.spoke = True

    def authenticate(self, key: K) -> bool:
        """A request on the connection passed the token check: it leaves the strangers'
        places (or probation) for its address's authenticated budget. False when that
        budget is full (it stays where it was; close it) or the connection is not counted
        (evicted, released)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.standing is Standing.AUTHENTICATED:
            return True
        most = self.max_authenticated_per_peer
        if most is not None and self._authenticated[entry.peer] >= most:
            return False
        self._leave(key, entry)
        entry.standing = Standing.AUTHENTICATED
        self._authenticated[entry.peer] += 1
        return True

    def release(self, key: K) -> None:
        """The connection closed (or stopped counting: an upgraded stream that ended).
        Idempotent; a no-op for one never counted, or evicted."""
        if key in self._entries:
            self._forget(key)

    def standing(self, key: K) -> Standing | None:
        """The connection's standing; None when it is not counted."""
        entry = self._entries.get(key)
        return entry.standing if entry is not None else None

    def count(self, peer: str) -> PeerCount:
        """What ``peer`` holds now."""
        on_probation = sum(self._entries[key].peer == peer for key in self._probation)
        return PeerCount(self._strangers[peer], on_probation, self._authenticated[peer])

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            strangers=self._strangers.total(),
            probation=len(self._probation),
            authenticated=self._authenticated.total(),
            refused=self._refused,
            evicted=self._evicted,
        )

    # ------------------------------------------------------------------ helpers

    def _crowded(self, peer: str) -> str:
        """Why a new stranger of ``peer`` gets no stranger's place ("" when it gets one)."""
        held = self._strangers[peer]
        if self.max_strangers_per_peer is not None and held >= self.max_strangers_per_peer:
            return (
                f"its address holds {held} connections without the token already, the most "
                "one address may"
            )
        total = self._strangers.total()
        if self.max_strangers is not None and total >= self.max_strangers:
            return (
                f"the listener holds {total} connections without the token already, the "
                "most all addresses may together"
            )
        return ""

    def _victim(self) -> K:
        """The probationer to close to make room: the oldest that sent nothing, else the
        oldest."""
        for key in self._probation:
            if not self._entries[key].spoke:
                return key
        return next(iter(self._probation))

    def _leave(self, key: K, entry: _Entry) -> None:
        if entry.standing is Standing.STRANGER:
            self._strangers[entry.peer] -= 1
            if not self._strangers[entry.peer]:
                del self._strangers[entry.peer]
        elif entry.standing is Standing.PROBATION:
            del self._probation[key]
        else:
            self._authenticated[entry.peer] -= 1
            if not self._authenticated[entry.peer]:
                del self._authenticated[entry.peer]

    def _forget(self, key: K) -> None:
        self._leave(key, self._entries.pop(key))


def check_bound(name: str, value: int | None) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is None (no bound) or at least 1."""
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1 or None, not {value}")


def _smaller(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
