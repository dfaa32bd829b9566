"""A stream's liveness, as a clock without I/O: when to send a keepalive, when to cut.

Both ends of a framed stream run one :class:`LivenessClock`. An end that has written
nothing for :attr:`KeepAlive.interval_s` sends a keepalive frame (16 bytes:
:func:`akv_transport.frame.encode_keepalive`), so a live peer is never silent for longer than
that, whether it is idle, computing between rounds or only receiving. An end that has
received nothing at all (not a keepalive, not a byte of a payload) for
:attr:`KeepAlive.silent_s` calls the stream silent and cuts it, as a reset would:
a proxy that holds the connection open and forwards nothing, a peer whose host vanished,
a NAT that dropped the mapping. Any byte received counts as life, so a large payload that
crawls keeps its stream alive however long it takes; and a peer whose loop is blocked
(a long computation holding it) is cut only after ``silent_s - interval_s`` of it.

The asyncio side (:class:`~akv_transport.StreamProtocol`) notes what it received and wrote
(:meth:`LivenessClock.received`, :meth:`LivenessClock.sent`) and calls
:meth:`LivenessClock.poll` from one timer, re-armed at :attr:`LivenessClock.next_check`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = [
    "CONFIRM_S",
    "DEFAULT_KEEPALIVE_INTERVAL_S",
    "DEFAULT_SILENT_S",
    "Due",
    "KeepAlive",
    "LivenessClock",
]

#: An end that has written nothing for this long sends a keepalive (seconds).
DEFAULT_KEEPALIVE_INTERVAL_S = 5.0
#: An end that has received nothing for this long cuts the stream as silent (seconds): four
#: keepalive intervals, so that a live peer whose loop is blocked for up to 15 s (a long
#: computation, a swapping host) is not cut, while a dead path is found within 20 s.
DEFAULT_SILENT_S = 20.0
#: A stream found silent is checked once more this much later (seconds) before it is cut:
#: after this process's own loop was blocked, bytes that arrived meanwhile wait in the
#: socket, and an event loop may run due timers before it reads them (uvloop does).
CONFIRM_S = 0.1


@dataclass(frozen=True)
class KeepAlive:
    """How an end of a stream keeps it alive and judges it silent.

    Raises :class:`ValueError` unless both are finite and positive and ``silent_s`` is at
    least twice ``interval_s`` (a live peer's keepalives must arrive well within it).
    """

    #: Seconds without writing anything after which a keepalive is sent.
    interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    #: Seconds without receiving anything after which the stream is cut as silent.
    silent_s: float = DEFAULT_SILENT_S

    def __post_init__(self) -> None:
        for name in ("interval_s", "silent_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"KeepAlive: {name} must be positive seconds, not {value!r}")
        if self.silent_s < 2 * self.interval_s:
            raise ValueError(
                f"KeepAlive: silent_s {self.silent_s:g} must be at least twice interval_s "
                f"{self.interval_s:g}, or a live but idle peer would be cut"
            )


class Due(enum.Enum):
    """What :meth:`LivenessClock.poll` asks of the stream."""

    NOTHING = "nothing"
    #: Write a keepalive frame (then call :meth:`LivenessClock.sent`).
    KEEPALIVE = "keepalive"
    #: Cut the stream: nothing was received for ``silent_s``, confirmed after
    #: :data:`CONFIRM_S`.
    CUT = "cut"


class LivenessClock:
    """The liveness of one end of a stream, from the times it received and wrote.

    ``now`` is any monotonic clock in seconds (the loop's). ``sending`` False: the end
    may not write frames yet (a client waiting for the server's upgrade answer), so only
    silence is judged.
    """

    def __init__(self, keepalive: KeepAlive, now: float, *, sending: bool = True) -> None:
        self.keepalive = keepalive
        self.sending = sending
        self.last_received = now
        self.last_sent = now
        #: When a poll first found the stream silent (None: it was not, or it heard since).
        self._suspected: float | None = None

    def received(self, now: float) -> None:
        """Bytes arrived (any: a keepalive, a header, part of a payload)."""
        self.last_received = now
        self._suspected = None

    def sent(self, now: float) -> None:
        """A frame was written."""
        self.last_sent = now

    def silence(self, now: float) -> float:
        """Seconds since anything arrived."""
        return now - self.last_received

    def poll(self, now: float) -> Due:
        """What is due at ``now``: a cut (silent for ``silent_s``, and still silent
        :data:`CONFIRM_S` after that was first seen), a keepalive (nothing written for
        ``interval_s``), or nothing."""
        if now - self.last_received >= self.keepalive.silent_s:
            if self._suspected is None:
                self._suspected = now
            elif now - self._suspected >= CONFIRM_S:
                return Due.CUT
        if self.sending and now - self.last_sent >= self.keepalive.interval_s:
            return Due.KEEPALIVE
        return Due.NOTHING

    @property
    def next_check(self) -> float:
        """When :meth:`poll` may next have something to do (on the same clock)."""
        if self._suspected is not None:
            return self._suspected + CONFIRM_S
        due = self.last_received + self.keepalive.silent_s
        if self.sending:
            due = min(due, self.last_sent + self.keepalive.interval_s)
        return due
