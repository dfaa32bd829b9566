"""Requests authenticated without sending the token, and answers that prove their sender.

A request carries ``Authorization: AKV-HMAC-SHA256 i=<instance>, t=<time>, n=<nonce>,
m=<mac>``: an HMAC-SHA256, keyed with the job's token, of the method, the path, the time
and a random nonce, bound to the *instance* of the process it is meant for (a random id
each :class:`Verifier` draws when it is made, that is, each time a server or scheduler
starts). The token itself never crosses the wire, so a process that takes a gone server's
port learns nothing it can use: what it received names an instance no process will ever
have again. A :class:`Verifier` accepts a request once: its time must be within
:data:`MAX_SKEW_S` of the verifier's clock and its nonce new in that window.

The answer to an accepted request carries ``AKV-Proof``, an HMAC of the request's MAC and
the answer's status, which only a holder of the token can compute: a client refuses an
answer without it (:func:`check_proof`), so a process posing as a gone server cannot feed
a worker values. A request for the wrong instance (a client's first request to a process,
or a request to a process that restarted) gets ``401`` with ``AKV-Instance`` naming the
right one, which the client adopts and asks again (:class:`Instances`).

Plain functions and small classes without I/O; the HTTP server, the HTTP client and the
stream's upgrade use them. Without TLS the bytes of requests and answers are still plain
text, and not protected against a peer that changes them in flight: this protects the
token and the peers' identity, TLS the traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "INSTANCE_HEADER",
    "INSTANCE_PROOF_HEADER",
    "MAX_SKEW_S",
    "PROOF_HEADER",
    "SCHEME",
    "Instances",
    "Signed",
    "Verdict",
    "Verifier",
    "check_instance",
    "check_proof",
    "instance_proof",
    "peer_of",
    "proof",
    "sign",
]

SCHEME = "AKV-HMAC-SHA256"
#: The answer header naming the instance a request must be signed for.
INSTANCE_HEADER = "AKV-Instance"
#: The answer header proving that its sender holds the token.
PROOF_HEADER = "AKV-Proof"
#: A ``401``'s header proving that the instance it names is named by a holder of the token,
#: for the request whose MAC it covers (a client adopts no instance without it).
INSTANCE_PROOF_HEADER = "AKV-Instance-Proof"
#: A request's time may be this far from the verifier's clock, either way (seconds): the
#: hosts of a job must keep their clocks this close (NTP does).
MAX_SKEW_S = 120.0
#: Nonces a verifier remembers at most (twice the skew's worth): past this, requests are
#: refused until old ones expire (about 8,000 requests a second, sustained).
MAX_NONCES = 1 << 21

_VERSION = b"akv-auth-1"
_HEX = frozenset("0123456789abcdef")


def _mac(key: bytes, *parts: str) -> str:
    message = b"\n".join([_VERSION, *(part.encode("utf-8", "surrogateescape") for part in parts)])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _key(token: str | bytes) -> bytes:
    return token.encode("utf-8", "surrogateescape") if isinstance(token, str) else token


@dataclass(frozen=True)
class Signed:
    """A request's ``Authorization`` value and its MAC (what the answer's proof covers)."""

    header: str
    mac: str


def sign(
    token: str | bytes,
    method: str,
    path: str,
    instance: str,
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> Signed:
    """Sign a request of ``method`` on ``path`` (without its query) for ``instance`` ("" when
    it is not known yet: the answer is then a ``401`` naming it)."""
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(16) if nonce is None else nonce
    mac = _mac(_key(token), "request", instance, stamp, nonce, method.upper(), path)
    return Signed(f"{SCHEME} i={instance}, t={stamp}, n={nonce}, m={mac}", mac)


def proof(token: str | bytes, mac: str, status: int) -> str:
    """The ``AKV-Proof`` of an answer of ``status`` to the request whose MAC is ``mac``."""
    return _mac(_key(token), "answer", mac, str(status))


def check_proof(token: str | bytes, mac: str, status: int, header: str | None) -> bool:
    """Whether ``header`` (an answer's ``AKV-Proof``, None when absent) proves that the
    answer's sender holds the token."""
    return _matches(header, proof(token, mac, status))


def instance_proof(token: str | bytes, mac: str, instance: str) -> str:
    """The ``AKV-Instance-Proof`` of a ``401`` naming ``instance``, to the request whose MAC
    is ``mac`` (a right MAC the refusing process did not accept: for another instance, out of
    time, replayed)."""
    return _mac(_key(token), "instance", mac, instance)


def check_instance(token: str | bytes, mac: str, named: str | None, header: str | None) -> bool:
    """Whether a ``401`` naming ``named`` was sent by a holder of the token (``header``: its
    ``AKV-Instance-Proof``, for the request whose MAC is ``mac``)."""
    if not named or len(named) > 64 or not set(named) <= _HEX:
        return False
    return _matches(header, instance_proof(token, mac, named))


def _matches(header: str | None, expected: str) -> bool:
    if not header:
        return False
    return hmac.compare_digest(header.strip().encode("ascii", "replace"), expected.encode())


def _fields(header: str) -> dict[str, str] | None:
    scheme, _, rest = header.strip().partition(" ")
    if scheme != SCHEME:
        return None
    fields: dict[str, str] = {}
    for item in rest.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name in fields:
            return None
        fields[name] = value
    return fields if set(fields) == {"i", "t", "n", "m"} else None


def is_signed(header: str) -> bool:
    """Whether an ``Authorization`` value uses this scheme (else: a Bearer token, or none)."""
    return header.strip().startswith(SCHEME + " ")


@dataclass(frozen=True)
class Verdict:
    """What a :class:`Verifier` made of a request: ``mac`` when accepted, else ``reason``
    (and ``instance`` when the request named another instance, or none)."""

    mac: str | None
    reason: str = ""
    wrong_instance: bool = False
    #: The request's MAC when it is right (accepted or not: a replay, out of time, for
    #: another instance): what a refusal's :func:`instance_proof` covers.
    claimed: str = ""


class Verifier:
    """Checks signed requests for one process (its instance drawn at creation).

    Accepts each request once: its MAC right for this instance, its time within
    ``max_skew_s`` of ``clock()`` (the wall clock: the sender's time is its wall clock), its
    nonce not seen in the ``2 * max_skew_s`` of ``monotonic()`` before. Nonces are
    forgotten by the monotonic clock, so a wall clock stepped forward and back does not
    make a request seen before new again; one stepped back by more than that window
    after it does. No I/O.
    """

    def __init__(
        self,
        token: str | bytes,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        max_skew_s: float = MAX_SKEW_S,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self.instance = secrets.token_hex(16)
        self._key = _key(token)
        self._clock = clock
        self._monotonic = monotonic
        self._skew = max_skew_s
        self._max_nonces = max_nonces
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()

    def check(self, header: str, method: str, path: str) -> Verdict:
        fields = _fields(header)
        if fields is None:
            return Verdict(None, f"a malformed {SCHEME} header")
        instance, stamp, nonce, mac = fields["i"], fields["t"], fields["n"], fields["m"]
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
            return Verdict(None, "a malformed time")
        if not (16 <= len(nonce) <= 64 and set(nonce) <= _HEX):
            return Verdict(None, "a malformed nonce or MAC")
        if not (len(mac) == 64 and set(mac) <= _HEX):
            return Verdict(None, "a malformed nonce or MAC")
        expected = _mac(self._key, "request", instance, stamp, nonce, method.upper(), path)
        if not hmac.compare_digest(mac.encode("ascii", "replace"), expected.encode()):
            return Verdict(None, "missing or wrong token")
        if not hmac.compare_digest(instance.encode("ascii", "replace"), self.instance.encode()):
            return Verdict(None, "signed for another instance of this process", True, mac)
        now = self._clock()
        off = int(stamp) - now
        if not math.isfinite(off) or abs(off) > self._skew:
            return Verdict(
                None,
                f"the request's time is {off:+.0f} s off this process's clock (at most "
                f"{self._skew:g} s either way: keep the job's hosts' clocks in sync)",
                claimed=mac,
            )
        since = self._monotonic()
        self._forget(since)
        if nonce in self._seen:
            return Verdict(None, "a request replayed", claimed=mac)
        if len(self._seen) >= self._max_nonces:
            return Verdict(None, "too many requests in the replay window; retry later", claimed=mac)
        self._seen.add(nonce)
        self._expiry.append((since + 2 * self._skew, nonce))
        return Verdict(mac, claimed=mac)

    def _forget(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] < now:
            self._seen.discard(expiry.popleft()[1])


class Instances:
    """The instance each peer (an address, ``host:port``) was last known by, for a client's
    requests.

    An instance is adopted only from a ``401`` that proves it (:func:`instance_proof`, for
    the request it refuses: so a process without the token cannot name one), and never for
    a peer when another peer is known by it: a process that took a gone server's port and
    passes a request on to another process of the job (which names its own instance, and
    proves it) would otherwise get the client to sign requests that process accepts.
    """

    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    def get(self, peer: str) -> str:
        return self._known.get(peer, "")

    def learn(
        self,
        peer: str,
        named: str | None,
        used: str,
        *,
        token: str | bytes,
        mac: str,
        named_proof: str | None,
    ) -> bool:
        """Adopt ``named`` (a ``401``'s ``AKV-Instance``, proven by ``named_proof``, its
        ``AKV-Instance-Proof``, for the request whose MAC is ``mac``) for ``peer``; whether
        a request signed for ``used`` is worth asking again (the instance named is another,
        proven, and no other peer's)."""
        if not named or named == used or not check_instance(token, mac, named, named_proof):
            return False
        if any(instance == named and other != peer for other, instance in self._known.items()):
            return False
        self._known[peer] = named
        return True


def peer_of(url: object) -> str:
    """The peer key (``host:port``, ``[v6]:port``) of a ``yarl.URL``, as streams name it."""
    host, port = getattr(url, "host", None) or "", getattr(url, "port", None)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: The instances this process's clients know, shared by the HTTP client and the streams.
INSTANCES = Instances()
