"""What a worker has done so far, for its heartbeats (the job's status page).

Pure: plain counters that the worker's store calls feed and that the heartbeat thread
reads (:meth:`Activity.report`: integers only, so a read from another thread sees each as
it was at some moment, never a torn value). They are for people to read: calls made on one
store from several threads at once may miss a count, and nothing decides by them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

__all__ = ["Activity"]


class Activity:
    """A worker's pushes, pulls and rounds.

    ``pushes`` and ``pulls`` count keys (a call on three keys counts three; a pushpull
    counts one of each); ``rounds`` is how many times the worker's most pushed key was
    pushed: in ``dist_sync`` the rounds this worker has taken part in.
    """

    __slots__ = ("_per_key", "pulls", "pushes", "rounds")

    def __init__(self) -> None:
        self.pushes = 0
        self.pulls = 0
        self.rounds = 0
        self._per_key: dict[Hashable, int] = {}

    def pushed(self, keys: Iterable[Hashable]) -> None:
        """A push (or the push of a pushpull) of ``keys`` was issued."""
        for key in keys:
            count = self._per_key.get(key, 0) + 1
            self._per_key[key] = count
            self.pushes += 1
            if count > self.rounds:
                self.rounds = count

    def pulled(self, keys: int) -> None:
        """A pull (or the pull of a pushpull) of ``keys`` keys was issued."""
        self.pulls += keys

    def report(self) -> dict[str, Any]:
        """What a heartbeat carries: ``{"pushes", "pulls", "rounds"}``."""
        return {"pushes": self.pushes, "pulls": self.pulls, "rounds": self.rounds}
