"""The status page's logins: random session ids that a cookie carries instead of the token.

Plain code without I/O; the clock is passed in. A session id is 32 random bytes
(``secrets``), unrelated to the job's token, so the cookie holds nothing that opens
anything but the status page of this scheduler process, for :data:`SESSION_S` at most.
"""

from __future__ import annotations

import hashlib
import secrets

__all__ = ["MAX_SESSIONS", "SESSION_S", "Sessions"]

#: How long a login lasts (seconds); the cookie's ``Max-Age`` too.
SESSION_S = 12 * 3600
#: Logins held at once; the oldest goes when another one comes.
MAX_SESSIONS = 64


class Sessions:
    """The logins of one scheduler process.

    Only each id's SHA-256 digest is kept and looked up: the lookup's timing depends on
    a digest the caller cannot steer, never on how much of a real id a guess matches
    (the role of a constant-time comparison), and a copy of the table opens nothing.
    """

    def __init__(self, lifetime_s: float = SESSION_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.lifetime_s = lifetime_s
        self.max_sessions = max_sessions
        #: Digest -> when the login ends, oldest login first.
        self._ends: dict[bytes, float] = {}

    def open(self, now: float) -> str:
        """A new login's session id (URL-safe text), valid until ``now + lifetime_s``."""
        self._ends = {digest: end for digest, end in self._ends.items() if end > now}
        while len(self._ends) >= self.max_sessions:
            del self._ends[next(iter(self._ends))]
        session_id = secrets.token_urlsafe(32)
        self._ends[_digest(session_id)] = now + self.lifetime_s
        return session_id

    def valid(self, session_id: str, now: float) -> bool:
        """True when ``session_id`` is a login of this process that has not ended."""
        end = self._ends.get(_digest(session_id))
        return end is not None and end > now

    def close(self, session_id: str) -> None:
        """End a login (a logout); an unknown id is ignored."""
        self._ends.pop(_digest(session_id), None)

    def __len__(self) -> int:
        return len(self._ends)


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).digest()
