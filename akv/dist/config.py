"""Distributed configuration from the environment, validated up front.

MXNet's names come first so existing launch scripts work (``DMLC_ROLE``,
``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``);
each has an ``AKV_*`` twin. Both may be set only when they agree. A missing or bad
setting raises :class:`ConfigError` naming the variable and saying what to set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from akv.errors import ConfigError
from akv.limits import (
    BARRIER_TIMEOUT_S,
    BIGARRAY_BOUND,
    CONNECT_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_BODY_BYTES,
    MIN_TOKEN_CHARS,
    REQUEST_TIMEOUT_S,
    ROUND_TIMEOUT_S,
)

__all__ = ["ROLES", "TWIN_VARIABLES", "Config", "Timeouts", "from_env"]

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
_RANK_SOURCES = ("AKV_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_TIMEOUTS = {
    "connect_s": ("AKV_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S),
    "barrier_s": ("AKV_BARRIER_TIMEOUT_S", BARRIER_TIMEOUT_S),
    "round_s": ("AKV_ROUND_TIMEOUT_S", ROUND_TIMEOUT_S),
    "request_s": ("AKV_REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S),
    "heartbeat_interval_s": ("AKV_HEARTBEAT_INTERVAL_S", HEARTBEAT_INTERVAL_S),
    "heartbeat_timeout_s": ("AKV_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S),
}
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
    host: str = "127.0.0.1"
    port: int = 0
    scheduler_fd: int | None = None
    bigarray_bound: int = BIGARRAY_BOUND
    max_body_bytes: int = MAX_BODY_BYTES
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)

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


def _pick(
    environ: Mapping[str, str], names: tuple[str, str | None], required: bool, what: str
) -> str | None:
    akv_name, mxnet_name = names
    akv_value = environ.get(akv_name)
    mxnet_value = environ.get(mxnet_name) if mxnet_name else None
    if akv_value is not None and mxnet_value is not None and akv_value != mxnet_value:
        raise ConfigError(
            f"{akv_name}={akv_value!r} contradicts {mxnet_name}={mxnet_value!r}: set one of "
            f"them, or both to the same {what}"
        )
    value = akv_value if akv_value is not None else mxnet_value
    if value is None and required:
        either = f"{mxnet_name} (or {akv_name})" if mxnet_name else akv_name
        raise ConfigError(f"{either} is not set: set it to {what}")
    return value


def _int(value: str, name: str, minimum: int, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: set it to {what}") from None
    if number < minimum:
        raise ConfigError(f"{name}={number} must be at least {minimum}: set it to {what}")
    return number


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


def from_env(environ: Mapping[str, str] | None = None, *, role: str | None = None) -> Config:
    """Read and check the job's configuration (``os.environ`` by default).

    ``role`` overrides ``AKV_ROLE``/``DMLC_ROLE`` (the ``akv-server`` entry point knows its
    role). Raises :class:`ConfigError` on the first missing, malformed or contradictory
    setting, naming the variable and what to set.
    """
    env = os.environ if environ is None else environ
    if role is None:
        role = _pick(env, _ROLE, True, "worker, server or scheduler")
    if role not in ROLES:
        raise ConfigError(
            f"DMLC_ROLE (or AKV_ROLE) is {role!r}: set it to worker, server or scheduler"
        )
    host = _pick(env, _HOST, True, "the scheduler's host name or IP address")
    port_text = _pick(env, _PORT, True, "the scheduler's TCP port")
    port = _int(port_text, _PORT[1], 1, "the scheduler's TCP port (1-65535)")  # type: ignore[arg-type]
    if port > 65535:
        raise ConfigError(f"{_PORT[1]}={port} is not a TCP port: set it to 1-65535")
    workers = _int(
        _pick(env, _WORKERS, True, "the number of workers"),
        _WORKERS[1],
        1,  # type: ignore[arg-type]
        "the number of workers",
    )
    servers = _int(
        _pick(env, _SERVERS, True, "the number of servers"),
        _SERVERS[1],
        1,  # type: ignore[arg-type]
        "the number of servers",
    )
    token = env.get("AKV_TOKEN")
    if not token:
        raise ConfigError(f"AKV_TOKEN is not set: {TOKEN_HINT}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"AKV_TOKEN is too short ({len(token)} characters, at least "
            f"{MIN_TOKEN_CHARS}): {TOKEN_HINT}"
        )
    rank = None
    if role != "scheduler":
        for name in _RANK_SOURCES:
            if env.get(name) is not None:
                rank = _int(env[name], name, 0, f"this {role}'s rank")
                break
        limit = workers if role == "worker" else servers
        if rank is not None and rank >= limit:
            raise ConfigError(
                f"rank {rank} (from {name}) is out of range for {limit} "
                f"{role}s: ranks go from 0 to {limit - 1}"
            )
    bound_text = _pick(env, _BOUND, False, "a number of elements")
    bound = BIGARRAY_BOUND
    if bound_text is not None:
        try:
            bound = int(float(bound_text))
        except ValueError:
            raise ConfigError(f"{_BOUND[0]}={bound_text!r} is not a number of elements") from None
        if bound < 1:
            raise ConfigError(f"{_BOUND[0]}={bound_text!r} must be at least 1")
    node_host = _pick(env, _NODE_HOST, False, "the address this server binds") or "127.0.0.1"
    server_port = _int(env.get("AKV_PORT", "0"), "AKV_PORT", 0, "a TCP port or 0 for any")
    fd_text = env.get("AKV_SCHEDULER_FD")
    scheduler_fd = _int(fd_text, "AKV_SCHEDULER_FD", 0, "an inherited socket") if fd_text else None
    max_body = _int(
        env.get("AKV_MAX_BODY_BYTES", str(MAX_BODY_BYTES)),
        "AKV_MAX_BODY_BYTES",
        1,
        "a number of bytes",
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
    return Config(
        role=role,
        scheduler_host=host,  # type: ignore[arg-type]
        scheduler_port=port,
        num_workers=workers,
        num_servers=servers,
        token=token,
        rank=rank,
        host=node_host,
        port=server_port,
        scheduler_fd=scheduler_fd,
        bigarray_bound=bound,
        max_body_bytes=max_body,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=tls_ca,
        timeouts=timeouts,
    )
