"""Distributed configuration from the environment, validated up front.

MXNet's names come first so existing launch scripts work (``DMLC_ROLE``,
``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``);
each has an ``AKV_*`` twin. Both may be set only when they agree. A missing or bad
setting raises :class:`ConfigError` naming the variable and saying what to set.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from akv import jit
from akv.errors import ConfigError, NoJobError
from akv.limits import (
    BARRIER_TIMEOUT_S,
    BIGARRAY_BOUND,
    CHECKPOINT_INTERVAL_S,
    CONNECT_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS_PER_PEER,
    MAX_STRANGERS,
    MAX_STRANGERS_PER_PEER,
    MIN_TOKEN_CHARS,
    RECONNECT_GRACE_S,
    REQUEST_TIMEOUT_S,
    RESTART_WINDOW_S,
    RETAIN_BYTES,
    ROUND_TIMEOUT_S,
    SHM_ARENA_BYTES,
    STREAM_KEEPALIVE_S,
    STREAM_SILENT_S,
)
from akv_transport import KeepAlive, host_identity

__all__ = [
    "ADDRESS_FORMS",
    "ADVERTISE_VARIABLE",
    "CHECKPOINT_DIR_VARIABLE",
    "JOB_VARIABLES",
    "LOG_LEVELS",
    "RANK_FROM_CHOICES",
    "RANK_FROM_VARIABLE",
    "RANK_SOURCES",
    "ROLES",
    "TWIN_VARIABLES",
    "Config",
    "Timeouts",
    "format_address",
    "from_env",
    "hostname_ordinal",
    "int_setting",
    "is_wildcard",
    "parse_address",
    "parse_log_level",
]

#: The address a server binds and advertises unless AKV_HOST/DMLC_NODE_HOST says otherwise.
DEFAULT_NODE_HOST = "127.0.0.1"
#: The address a server gives the scheduler for the workers, when it is not the bound one.
ADVERTISE_VARIABLE = "AKV_ADVERTISE"
#: The forms an advertised address takes, for messages.
ADDRESS_FORMS = "HOST, HOST:PORT, [IPv6] or [IPv6]:PORT (e.g. 10.0.0.2:9000 or [::1]:9000)"
_ADDRESS_HOST = re.compile(r"[A-Za-z0-9_.\-]+\Z")
_BRACKETED = re.compile(r"\[([^\[\]]+)\](?::([^:]*))?\Z")

ROLES = ("worker", "server", "scheduler")

# Each setting's akv name and its MXNet twin (None: akv's alone). The one table of them:
# the launcher sets both of each pair, and a process accepts either (both only if equal).
_ROLE = ("AKV_ROLE", "DMLC_ROLE")
_HOST = ("AKV_SCHEDULER_HOST", "DMLC_PS_ROOT_URI")
_PORT = ("AKV_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT")
_WORKERS = ("AKV_NUM_WORKERS", "DMLC_NUM_WORKER")
_SERVERS = ("AKV_NUM_SERVERS", "DMLC_NUM_SERVER")
_NODE_HOST = ("AKV_HOST", "DMLC_NODE_HOST")
_BOUND = ("AKV_BIGARRAY_BOUND", "MXNET_KVSTORE_BIGARRAY_BOUND")
#: The variable pairs the launcher sets: akv's name and MXNet's twin (always equal).
TWIN_VARIABLES: tuple[tuple[str, str], ...] = (_ROLE, _HOST, _PORT, _WORKERS, _SERVERS, _NODE_HOST)
#: The names ``AKV_LOG_LEVEL`` accepts (in any case); a number (``logging``'s) works too.
LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
#: The variables a worker's or server's rank is read from, the first one set wins: akv's
#: own, then the rank that MPI, Slurm or a Kubernetes Indexed Job (its completion index)
#: gives each process.
RANK_SOURCES = (
    "AKV_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "JOB_COMPLETION_INDEX",
)
#: Where else the rank may come from: ``AKV_RANK_FROM=hostname-ordinal`` takes the number
#: after the host name's last ``-`` (a Kubernetes StatefulSet pod's ordinal: the pod
#: ``akv-server-2`` is rank 2). It replaces :data:`RANK_SOURCES`, and ``AKV_RANK`` with it
#: is an error.
RANK_FROM_VARIABLE = "AKV_RANK_FROM"
RANK_FROM_CHOICES = ("hostname-ordinal",)
#: The variables that say a process belongs to a job (akv's name and MXNet's twin each):
#: when none is set, a worker's store says to run the script with akv-launch.
JOB_VARIABLES: tuple[tuple[str, str], ...] = (_ROLE, _HOST, _PORT, _WORKERS, _SERVERS)
_ORDINAL = re.compile(r"[A-Za-z0-9.\-]*-(\d+)\Z")
_TIMEOUTS = {
    "connect_s": ("AKV_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S),
    "barrier_s": ("AKV_BARRIER_TIMEOUT_S", BARRIER_TIMEOUT_S),
    "round_s": ("AKV_ROUND_TIMEOUT_S", ROUND_TIMEOUT_S),
    "request_s": ("AKV_REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S),
    "heartbeat_interval_s": ("AKV_HEARTBEAT_INTERVAL_S", HEARTBEAT_INTERVAL_S),
    "heartbeat_timeout_s": ("AKV_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S),
    "idle_s": ("AKV_IDLE_TIMEOUT_S", IDLE_TIMEOUT_S),
    "reconnect_s": ("AKV_RECONNECT_GRACE_S", RECONNECT_GRACE_S),
    "restart_s": ("AKV_RESTART_WINDOW_S", RESTART_WINDOW_S),
    "keepalive_s": ("AKV_STREAM_KEEPALIVE_S", STREAM_KEEPALIVE_S),
    "silent_s": ("AKV_STREAM_SILENT_S", STREAM_SILENT_S),
}
#: The directory a server writes its checkpoints to (none: it writes none).
CHECKPOINT_DIR_VARIABLE = "AKV_CHECKPOINT_DIR"
NO_JOB_HINT = (
    "run the script with akv-launch, which starts the job's scheduler and servers and sets "
    "them (e.g. `akv-launch -n 2 -s 1 python train.py`), or set them and AKV_TOKEN for every "
    "process yourself (docs/deployment.md); a store for this process alone is "
    "akv.create('local')"
)
TOKEN_HINT = (
    "every request carries the job's token: akv-launch sets AKV_TOKEN for you; to start "
    "the processes yourself, generate one with "
    "`python -c 'import secrets; print(secrets.token_hex(32))'` and give the same value "
    "to every process of the job"
)


@dataclass(frozen=True)
class Timeouts:
    """Every wait's deadline, in seconds (see the ``*_TIMEOUT_S`` constants)."""

    connect_s: float = CONNECT_TIMEOUT_S
    barrier_s: float = BARRIER_TIMEOUT_S
    round_s: float = ROUND_TIMEOUT_S
    request_s: float = REQUEST_TIMEOUT_S
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    #: A connection without a whole request header this long is closed (servers, scheduler).
    idle_s: float = IDLE_TIMEOUT_S
    #: How long a server waits for a cut worker to reconnect before reporting it lost.
    reconnect_s: float = RECONNECT_GRACE_S
    #: How long the scheduler waits for a dead server with checkpoints to be restarted.
    restart_s: float = RESTART_WINDOW_S
    #: A stream end that wrote nothing this long sends a keepalive; one that received
    #: nothing for ``silent_s`` cuts the stream as silent.
    keepalive_s: float = STREAM_KEEPALIVE_S
    silent_s: float = STREAM_SILENT_S

    @property
    def silent_reconnect_s(self) -> float:
        """How long a server waits for a worker whose stream it cut as silent, before it
        reports the worker lost: the worker's own cut may come up to ``AKV_STREAM_SILENT_S``
        later, it then tries to reconnect for ``AKV_REQUEST_TIMEOUT_S``, its last attempt
        may take ``AKV_CONNECT_TIMEOUT_S``, and then the usual grace. A silent stream is no
        sign that the worker died (a dead or hanging worker stops its heartbeats, and the
        scheduler names it first); a live worker that cannot reach this server within its
        window names this server itself, and this report is only the last resort."""
        return self.silent_s + self.request_s + self.connect_s + self.reconnect_s

    @property
    def keepalive(self) -> KeepAlive:
        """The liveness of the workers' streams (the servers' settings govern them)."""
        return KeepAlive(self.keepalive_s, self.silent_s)


@dataclass(frozen=True)
class Config:
    """One process's view of the job."""

    role: str
    scheduler_host: str
    scheduler_port: int
    num_workers: int
    num_servers: int
    token: str = field(repr=False)
    rank: int | None = None
    host: str = DEFAULT_NODE_HOST
    port: int = 0
    #: The address given to the scheduler for the workers (``AKV_ADVERTISE``); None: the
    #: bound host, and the bound port (see :meth:`advertised`).
    advertise_host: str | None = None
    advertise_port: int | None = None
    scheduler_fd: int | None = None
    bigarray_bound: int = BIGARRAY_BOUND
    max_body_bytes: int = MAX_BODY_BYTES
    #: Authenticated connections one address may hold to this process's listener
    #: (``AKV_MAX_CONNECTIONS_PER_PEER``), connections without the token one address may
    #: (``AKV_MAX_STRANGERS_PER_PEER``) and all together (``AKV_MAX_STRANGERS``).
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    max_strangers_per_peer: int = MAX_STRANGERS_PER_PEER
    max_strangers: int = MAX_STRANGERS
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    log_level: int = logging.INFO
    #: A server's checkpoint directory (``AKV_CHECKPOINT_DIR``; None: no checkpoints), and
    #: how often it writes one (``AKV_CHECKPOINT_INTERVAL_S``).
    checkpoint_dir: str | None = None
    checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S
    #: A worker's bound on the pushes it keeps for one server until they are durable
    #: (``AKV_RETAIN_BYTES``).
    retain_bytes: int = RETAIN_BYTES
    #: A push waits for the servers' acknowledgement before it is done (``AKV_STRICT_PUSH``
    #: = 1; for debugging: by default pushes are pipelined).
    strict_push: bool = False
    #: The blocking store's network thread runs under ``SCHED_BATCH`` on Linux
    #: (``AKV_SCHED_BATCH`` = 1, the default): woken by a server's answer, it does not
    #: preempt the process running on that CPU (on a host with fewer cores than busy
    #: threads, that is often the server, with more answers to send).
    sched_batch: bool = True
    #: dist_async's bound on how many pushes of a key a worker may be ahead of the slowest
    #: worker (``AKV_STALENESS``, or ``create(..., staleness=k)``; None: no bound).
    staleness: int | None = None
    #: In dist_sync, a pipelined push asks for the key's value after its round too, and the
    #: pulls of the key until the next push are answered from that value without a request
    #: (``AKV_PULL_AHEAD``, 1 by default; 0: a pull asks the servers).
    pull_ahead: bool = True
    #: The scheduler lets a new job go on whose servers restored checkpoint files of
    #: different moments (``AKV_ACCEPT_MIXED_RESTORE``, 0 by default: it fails the job;
    #: see :func:`~akv.cluster.scheduler.roster.mixed_restores`).
    accept_mixed_restore: bool = False
    #: Compiled row kernels where numba imports (``AKV_JIT``, 1 by default; 0: NumPy only;
    #: read by :mod:`akv.jit` itself, checked here when the process starts).
    jit: bool = True
    #: Streams to a server on this host go through its private Unix socket, and payloads
    #: through shared memory (``AKV_SHM``, 1 by default; 0: TCP only).
    shm: bool = True
    #: Each side's arena on such a stream (``AKV_SHM_ARENA_BYTES``; 0: the Unix socket
    #: without shared memory).
    shm_arena_bytes: int = SHM_ARENA_BYTES
    #: This process's host identity (``AKV_HOST_ID``, by default
    #: :func:`akv_transport.host_identity`): processes share memory only when theirs are equal.
    host_id: str = field(default_factory=host_identity)
    #: A worker serves ``/metrics`` and the health probes on this port of ``host``
    #: (``AKV_METRICS_PORT``; 0: any free port, logged; None: it serves none).
    metrics_port: int | None = None

    @property
    def scheduler_url(self) -> str:
        """``http(s)://host:port`` of the scheduler."""
        scheme = "https" if self.tls_ca or self.tls_cert else "http"
        host = f"[{self.scheduler_host}]" if ":" in self.scheduler_host else self.scheduler_host
        return f"{scheme}://{host}:{self.scheduler_port}"

    @property
    def tls(self) -> bool:
        """Whether the job speaks TLS."""
        return bool(self.tls_ca or self.tls_cert)

    def advertised(self, bound_port: int) -> tuple[str, int]:
        """``(host, port)`` this node gives the scheduler, which gives it to the workers:
        ``AKV_ADVERTISE``'s host and port, each defaulting to the bound one (``host``, and
        ``bound_port``: the port actually bound, so ``AKV_PORT=0`` advertises the port the
        system chose).

        Raises :class:`ConfigError` for a server that would advertise a wildcard address
        (it binds ``0.0.0.0`` or ``::`` and has no ``AKV_ADVERTISE``): workers cannot
        connect to it.
        """
        if self.advertise_host is None and self.role == "server":
            _refuse_wildcard_bind("AKV_HOST", self.host)
        host = self.host if self.advertise_host is None else self.advertise_host
        port = bound_port if self.advertise_port is None else self.advertise_port
        return host, port


def _pick(
    environ: Mapping[str, str], names: tuple[str, str | None], what: str
) -> tuple[str, str] | None:
    """The variable of a pair that is set and its value (None: neither is set)."""
    akv_name, mxnet_name = names
    akv_value = environ.get(akv_name)
    mxnet_value = environ.get(mxnet_name) if mxnet_name else None
    if akv_value is not None and mxnet_value is not None and akv_value != mxnet_value:
        raise ConfigError(
            f"{akv_name}={akv_value!r} contradicts {mxnet_name}={mxnet_value!r}: set one of "
            f"them, or both to the same {what}"
        )
    if akv_value is not None:
        return akv_name, akv_value
    if mxnet_name is not None and mxnet_value is not None:
        return mxnet_name, mxnet_value
    return None


def _require(
    environ: Mapping[str, str], names: tuple[str, str | None], what: str
) -> tuple[str, str]:
    """As :func:`_pick`, but a variable that neither name sets is an error."""
    picked = _pick(environ, names, what)
    if picked is None:
        akv_name, mxnet_name = names
        either = f"{mxnet_name} (or {akv_name})" if mxnet_name else akv_name
        raise ConfigError(f"{either} is not set: set it to {what}")
    return picked


def int_setting(value: str, name: str, minimum: int, what: str, maximum: int | None = None) -> int:
    """``value`` of variable ``name`` as an int in ``[minimum, maximum]``; a
    :class:`ConfigError` naming the variable and ``what`` to set it to otherwise."""
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: set it to {what}") from None
    if number < minimum:
        raise ConfigError(f"{name}={number} must be at least {minimum}: set it to {what}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name}={number} is out of range: set it to {what}")
    return number


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is a wildcard address (``0.0.0.0``, ``::``, ``[::]``): one that binds
    every interface and that no peer can connect to."""
    try:
        return ipaddress.ip_address(host.strip().removeprefix("[").removesuffix("]")).is_unspecified
    except ValueError:
        return False


def parse_address(text: str, name: str) -> tuple[str, int | None]:
    """An advertised address ``text`` (given by ``name``, a variable or a flag) as
    ``(host, port)``; ``port`` is None when ``text`` gives a host alone.

    Forms: ``HOST`` (a host name or IPv4 address), ``HOST:PORT``, ``[IPv6]`` and
    ``[IPv6]:PORT`` (the host comes back without brackets). Raises :class:`ConfigError`
    naming ``name`` and the forms for anything else: an empty host or port, a port outside
    1-65535, an IPv6 address without brackets, and a wildcard (``0.0.0.0``, ``[::]``),
    which no worker can connect to.
    """
    what = f"set it to {ADDRESS_FORMS}"
    bracketed = _BRACKETED.match(text)
    port_text: str | None
    if bracketed is not None:
        host, port_text = bracketed.group(1), bracketed.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(
                f"{name}={text!r}: {host!r} in brackets is not an IPv6 address; {what}"
            ) from None
    elif text.startswith("["):
        raise ConfigError(f"{name}={text!r} is not [IPv6] or [IPv6]:PORT; {what}")
    elif text.count(":") > 1:
        raise ConfigError(
            f"{name}={text!r}: an IPv6 address goes in brackets, as in [::1] or [::1]:9000; {what}"
        )
    else:
        host, colon, after = text.partition(":")
        port_text = after if colon else None
        if not _ADDRESS_HOST.match(host) or host.startswith("-"):
            raise ConfigError(f"{name}={text!r} is not a host name or IP address; {what}")
    if is_wildcard(host):
        raise ConfigError(
            f"{name}={text!r} is a wildcard address, which no worker can connect to: set it "
            "to the address the workers reach this process at"
        )
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"{name}={text!r}: {port_text!r} is not a TCP port (1-65535); {what}")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:9000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _refuse_wildcard_bind(name: str, host: str) -> None:
    """A server that binds the wildcard ``host`` (from variable ``name``) without an
    advertised address: a :class:`ConfigError` saying to set ``AKV_ADVERTISE``."""
    if is_wildcard(host):
        raise ConfigError(
            f"{ADVERTISE_VARIABLE} is not set, and this server binds the wildcard address "
            f"{name}={host!r}, which no worker can connect to: set {ADVERTISE_VARIABLE} to "
            f"the address the workers reach this server at ({ADDRESS_FORMS})"
        )


def hostname_ordinal(hostname: str) -> int | None:
    """The number after the last ``-`` of ``hostname``'s first label (``akv-server-2`` and
    ``akv-server-2.akv-servers.default.svc`` give 2: a StatefulSet pod's ordinal), or None
    when it has none."""
    match = _ORDINAL.match(hostname.split(".")[0])
    return int(match.group(1)) if match else None


def _rank(env: Mapping[str, str], role: str, limit: int) -> int | None:
    """A worker's or server's rank (None: the scheduler gives the lowest free one), from
    :data:`RANK_FROM_VARIABLE` or else the first of :data:`RANK_SOURCES` that is set; one
    of ``limit`` ranks."""
    rule = env.get(RANK_FROM_VARIABLE, "").strip()
    if rule:
        if rule not in RANK_FROM_CHOICES:
            raise ConfigError(
                f"{RANK_FROM_VARIABLE}={rule!r}: set it to {' or '.join(RANK_FROM_CHOICES)} "
                "(or unset it, and set AKV_RANK)"
            )
        if env.get("AKV_RANK") is not None:
            raise ConfigError(
                f"AKV_RANK and {RANK_FROM_VARIABLE} are both set: set one of them (AKV_RANK "
                "for a fixed rank, AKV_RANK_FROM=hostname-ordinal for a StatefulSet's pods)"
            )
        hostname = env.get("HOSTNAME") or platform.node()
        rank = hostname_ordinal(hostname)
        if rank is None:
            raise ConfigError(
                f"{RANK_FROM_VARIABLE}=hostname-ordinal, but the host name {hostname!r} does "
                "not end in -N (a StatefulSet pod's name does, as akv-server-2): set AKV_RANK "
                "instead"
            )
        source = f"{RANK_FROM_VARIABLE}=hostname-ordinal, host name {hostname!r}"
    else:
        source = next((name for name in RANK_SOURCES if env.get(name) is not None), "")
        if not source:
            return None
        rank = int_setting(env[source], source, 0, f"this {role}'s rank")
    if rank >= limit:
        raise ConfigError(
            f"rank {rank} (from {source}) is out of range for {limit} "
            f"{role}s: ranks go from 0 to {limit - 1}"
        )
    return rank


def parse_log_level(text: str, name: str = "AKV_LOG_LEVEL") -> int:
    """``text`` (a name of :data:`LOG_LEVELS` in any case, or a number) as a ``logging``
    level; a :class:`ConfigError` naming ``name`` (a variable or a flag) otherwise."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    level = LOG_LEVELS.get(text.upper())
    if level is None:
        raise ConfigError(
            f"{name}={text!r} is not a log level: set it to "
            f"{', '.join(list(LOG_LEVELS)[:-1])} or {list(LOG_LEVELS)[-1]} (any case), "
            "or to a number"
        )
    return level


def _log_level(environ: Mapping[str, str]) -> int:
    value = environ.get("AKV_LOG_LEVEL")
    if value is None or not value.strip():
        return logging.INFO
    return parse_log_level(value)


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    value = environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


def _flag(environ: Mapping[str, str], name: str, default: bool = False) -> bool:
    """A 0/1 setting (unset: ``default``)."""
    value = environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"{name}={value!r}: set it to 1 (on) or 0 (off)")
    return value == "1"


def from_env(environ: Mapping[str, str] | None = None, *, role: str | None = None) -> Config:
    """Read and check the job's configuration (``os.environ`` by default).

    ``role`` overrides ``AKV_ROLE``/``DMLC_ROLE`` (the ``akv-server`` entry point knows its
    role). Raises :class:`ConfigError` on the first missing, malformed or contradictory
    setting, naming the variable that was read and what to set. ``AKV_LOG_LEVEL`` (a name
    of :data:`LOG_LEVELS` in any case, or a number; default INFO) becomes ``log_level``.
    """
    env = os.environ if environ is None else environ
    if role is None:
        if not any(_pick(env, names, "value") for names in JOB_VARIABLES):
            names = ", ".join(f"{mxnet} (or {akv})" for akv, mxnet in JOB_VARIABLES)
            raise NoJobError(
                f"no distributed job is set up here: none of {names} is set; {NO_JOB_HINT}"
            )
        role = _require(env, _ROLE, "worker, server or scheduler")[1]
    if role not in ROLES:
        raise ConfigError(
            f"DMLC_ROLE (or AKV_ROLE) is {role!r}: set it to worker, server or scheduler"
        )
    host = _require(env, _HOST, "the scheduler's host name or IP address")[1]
    port_name, port_text = _require(env, _PORT, "the scheduler's TCP port")
    port = int_setting(port_text, port_name, 1, "the scheduler's TCP port (1-65535)")
    if port > 65535:
        raise ConfigError(f"{port_name}={port} is not a TCP port: set it to 1-65535")
    workers_name, workers_text = _require(env, _WORKERS, "the number of workers")
    workers = int_setting(workers_text, workers_name, 1, "the number of workers")
    servers_name, servers_text = _require(env, _SERVERS, "the number of servers")
    servers = int_setting(servers_text, servers_name, 1, "the number of servers")
    token = env.get("AKV_TOKEN")
    if not token:
        raise ConfigError(f"AKV_TOKEN is not set: {TOKEN_HINT}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"AKV_TOKEN is too short ({len(token)} characters, at least "
            f"{MIN_TOKEN_CHARS}): {TOKEN_HINT}"
        )
    rank = (
        None if role == "scheduler" else _rank(env, role, workers if role == "worker" else servers)
    )
    bound = BIGARRAY_BOUND
    picked_bound = _pick(env, _BOUND, "a number of elements")
    if picked_bound is not None:
        bound_name, bound_text = picked_bound
        try:
            bound = int(float(bound_text))
        except (ValueError, OverflowError):
            raise ConfigError(f"{bound_name}={bound_text!r} is not a number of elements") from None
        if bound < 1:
            raise ConfigError(f"{bound_name}={bound_text!r} must be at least 1")
    picked_host = _pick(env, _NODE_HOST, "the address this server binds")
    node_host = (picked_host[1] if picked_host else "") or DEFAULT_NODE_HOST
    server_port = int_setting(
        env.get("AKV_PORT", "0"), "AKV_PORT", 0, "a TCP port (1-65535) or 0 for any", 65535
    )
    advertise_text = env.get(ADVERTISE_VARIABLE, "").strip()
    advertise_host: str | None = None
    advertise_port: int | None = None
    if advertise_text:
        advertise_host, advertise_port = parse_address(advertise_text, ADVERTISE_VARIABLE)
    elif role == "server":
        _refuse_wildcard_bind(picked_host[0] if picked_host else "AKV_HOST", node_host)
    fd_text = env.get("AKV_SCHEDULER_FD")
    scheduler_fd = (
        int_setting(fd_text, "AKV_SCHEDULER_FD", 0, "an inherited socket") if fd_text else None
    )
    max_body = int_setting(
        env.get("AKV_MAX_BODY_BYTES", str(MAX_BODY_BYTES)),
        "AKV_MAX_BODY_BYTES",
        1,
        "a number of bytes",
    )
    max_connections, max_strangers_per_peer, max_strangers = (
        int_setting(env.get(name, str(default)), name, 1, "a number of connections")
        for name, default in [
            ("AKV_MAX_CONNECTIONS_PER_PEER", MAX_CONNECTIONS_PER_PEER),
            ("AKV_MAX_STRANGERS_PER_PEER", MAX_STRANGERS_PER_PEER),
            ("AKV_MAX_STRANGERS", MAX_STRANGERS),
        ]
    )
    tls_cert, tls_key, tls_ca = (
        env.get("AKV_TLS_CERT"),
        env.get("AKV_TLS_KEY"),
        env.get("AKV_TLS_CA"),
    )
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError(
            "AKV_TLS_CERT and AKV_TLS_KEY go together: set both (this node's "
            "certificate and its private key) or neither"
        )
    if tls_cert and not tls_ca:
        raise ConfigError(
            "AKV_TLS_CERT is set but AKV_TLS_CA is not: set AKV_TLS_CA to the "
            "CA bundle that signed the job's certificates"
        )
    timeouts = Timeouts(
        **{key: _seconds(env, name, default) for key, (name, default) in _TIMEOUTS.items()}
    )
    if timeouts.silent_s < 2 * timeouts.keepalive_s:
        raise ConfigError(
            f"AKV_STREAM_SILENT_S={timeouts.silent_s:g} must be at least twice "
            f"AKV_STREAM_KEEPALIVE_S={timeouts.keepalive_s:g}: a live but idle peer sends "
            "a keepalive only that often, and would be cut"
        )
    log_level = _log_level(env)
    checkpoint_dir = env.get(CHECKPOINT_DIR_VARIABLE, "").strip() or None
    if checkpoint_dir is not None and role == "server" and rank is None:
        raise ConfigError(
            f"{CHECKPOINT_DIR_VARIABLE} is set but AKV_RANK is not: a server that writes "
            "checkpoints needs a fixed rank, by which its restart finds its checkpoint "
            "(akv-launch sets AKV_RANK)"
        )
    checkpoint_interval_s = _seconds(env, "AKV_CHECKPOINT_INTERVAL_S", CHECKPOINT_INTERVAL_S)
    retain_bytes = int_setting(
        env.get("AKV_RETAIN_BYTES", str(RETAIN_BYTES)), "AKV_RETAIN_BYTES", 1, "a number of bytes"
    )
    return Config(
        role=role,
        scheduler_host=host,
        scheduler_port=port,
        num_workers=workers,
        num_servers=servers,
        token=token,
        rank=rank,
        host=node_host,
        port=server_port,
        advertise_host=advertise_host,
        advertise_port=advertise_port,
        scheduler_fd=scheduler_fd,
        bigarray_bound=bound,
        max_body_bytes=max_body,
        max_connections_per_peer=max_connections,
        max_strangers_per_peer=max_strangers_per_peer,
        max_strangers=max_strangers,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=tls_ca,
        timeouts=timeouts,
        log_level=log_level,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval_s=checkpoint_interval_s,
        retain_bytes=retain_bytes,
        strict_push=_flag(env, "AKV_STRICT_PUSH"),
        sched_batch=_flag(env, "AKV_SCHED_BATCH", default=True),
        staleness=(
            int_setting(env["AKV_STALENESS"], "AKV_STALENESS", 0, "a number of pushes")
            if env.get("AKV_STALENESS", "").strip()
            else None
        ),
        pull_ahead=_flag(env, "AKV_PULL_AHEAD", default=True),
        accept_mixed_restore=_flag(env, "AKV_ACCEPT_MIXED_RESTORE"),
        shm=_flag(env, "AKV_SHM", default=True),
        jit=jit.enabled(env),
        shm_arena_bytes=int_setting(
            env.get("AKV_SHM_ARENA_BYTES", str(SHM_ARENA_BYTES)),
            "AKV_SHM_ARENA_BYTES",
            0,
            "a number of bytes",
        ),
        host_id=env.get("AKV_HOST_ID", "").strip() or host_identity(),
        metrics_port=(
            int_setting(
                env["AKV_METRICS_PORT"],
                "AKV_METRICS_PORT",
                0,
                "a TCP port (1-65535) or 0 for any",
                65535,
            )
            if env.get("AKV_METRICS_PORT", "").strip()
            else None
        ),
    )
