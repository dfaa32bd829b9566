"""What the HTTP server's logs say about peers: little, rarely, and never a secret.

* :data:`MISTAKES` rations the lines about a client's mistakes (malformed requests,
  connections closed for idling or past the per-address limit): at most one per
  :data:`CLIENT_MISTAKE_LOG_INTERVAL_S` per peer address and kind, so that a flood cannot
  fill the log; :func:`log_mistake` logs through it.
* :func:`install_log_filter` puts a filter on aiohttp's loggers: a client's malformed
  request becomes one short line (no traceback, no request bytes), and whatever follows
  ``Authorization`` or ``Bearer`` in any other line or traceback becomes ``<redacted>``.

Every line goes to the ``akv_transport.http`` logger or to aiohttp's own.
"""

from __future__ import annotations

import logging
import re
import time

from aiohttp import web
from aiohttp.http import HttpProcessingError

__all__ = [
    "CLIENT_MISTAKES",
    "CLIENT_MISTAKE_LOG_INTERVAL_S",
    "MISTAKES",
    "install_log_filter",
    "log",
    "log_mistake",
]

log = logging.getLogger("akv_transport.http")

#: A client's mistakes (malformed requests, connections refused or timed out) are logged
#: at most once per this many seconds per peer address.
CLIENT_MISTAKE_LOG_INTERVAL_S = 60.0
#: What aiohttp raises for a request it cannot parse: the client's mistake, never ours.
CLIENT_MISTAKES: tuple[type[BaseException], ...] = (HttpProcessingError, web.RequestPayloadError)


class PerPeer:
    """Whether to log a peer's mistake of one kind now: at most once per ``interval_s``
    per address and kind, remembering at most :attr:`MAX_PEERS` of them (past that,
    nothing new is logged until old ones expire: a flood from many addresses cannot fill
    the log either)."""

    MAX_PEERS = 4096

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._pruned = 0.0

    def allow(self, peer: str, kind: str) -> bool:
        now = time.monotonic()
        key = (peer, kind)
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        if last is None and len(self._last) >= self.MAX_PEERS:
            if now - self._pruned < 1.0:
                return False
            self._pruned = now
            self._last = {p: t for p, t in self._last.items() if now - t < self.interval_s}
            if len(self._last) >= self.MAX_PEERS:
                return False
        self._last[key] = now
        return True

    def clear(self) -> None:
        self._last.clear()


#: The process's one limiter (aiohttp's loggers, which it also serves, are process-wide).
MISTAKES = PerPeer(CLIENT_MISTAKE_LOG_INTERVAL_S)


def log_mistake(level: int, peer: str, kind: str, message: str, *args: object) -> None:
    """Log ``message % args`` about a mistake of ``kind`` by ``peer``, saying how long
    further ones are not logged; unless :data:`MISTAKES` logged one such lately."""
    if MISTAKES.allow(peer, kind):
        log.log(
            level,
            message + " (further ones from it are not logged for %g s)",
            *args,
            MISTAKES.interval_s,
        )


def install_log_filter() -> None:
    """Put the filter described above on aiohttp's loggers (once)."""
    for name in _AIOHTTP_LOGGERS:
        logging.getLogger(name).addFilter(_LOG_FILTER)


#: aiohttp's loggers (on the server side, ``aiohttp.server`` logs malformed requests).
_AIOHTTP_LOGGERS = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)
#: A credential, and whatever follows it on its line.
_SECRET = re.compile(r"(authorization|bearer)[^\r\n]*", re.IGNORECASE)


def _redact(text: str) -> str:
    return _SECRET.sub(lambda match: f"{match.group(1)} <redacted>", text)


class _AiohttpLogFilter(logging.Filter):
    """On aiohttp's loggers: a client's malformed request becomes one short line (no
    traceback, no request bytes, at most once per peer per interval), and whatever
    follows ``Authorization`` or ``Bearer`` in any other line or traceback is redacted."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CLIENT_MISTAKES):
            args = record.args
            peer = str(args[0]) if isinstance(args, tuple) and args else "?"
            if not MISTAKES.allow(peer, "malformed"):
                return False
            record.msg = (
                "answered a malformed HTTP request from %s with 400 (%s; further ones from "
                "it are not logged for %g s)"
            )
            record.args = (peer, type(exc).__name__, MISTAKES.interval_s)
            record.exc_info = None
            record.exc_text = None
            record.stack_info = None
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken record: logging reports it itself
            return True
        redacted = _redact(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        if record.exc_info is not None and record.exc_info[0] is not None:
            record.exc_text = _redact(self._formatter.formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = _redact(record.stack_info)
        return True


_LOG_FILTER = _AiohttpLogFilter()
