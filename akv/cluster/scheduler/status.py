"""The job as the status page shows it: what nodes report, and what the page decides from it.

Plain code without I/O; the clock is passed in. Servers and workers send a small report
with each heartbeat (:func:`akv.cluster.server.report.heartbeat_report`,
:class:`akv.cluster.worker.activity.Activity`); the scheduler checks it
(:func:`parse_report`) and keeps the latest per node (:class:`Reports`).
:func:`job_status` joins them with the :class:`~akv.cluster.scheduler.roster.Roster` into
the JSON twin of ``/status`` (``/status.json``), deciding on the way:

* each node's state (:func:`node_state`): ``not joined``, ``joined``, ``running``,
  ``late`` (no heartbeat for :data:`LATE_HEARTBEATS` intervals), ``restarting`` (a server
  that writes checkpoints, silent past the heartbeat timeout), ``finished``, ``dead``;
* how many rounds each worker is behind the fastest (:func:`rounds_behind`);
* whom the current round waits for, and since how long (:func:`round_wait`);
* whom the job's failure blames (:func:`blamed`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from akv.cluster.config import format_address
from akv.cluster.scheduler.roster import MEMBER_ROLES, Node, Roster
from akv.cluster.server.report import KEY_TEXT_CHARS

__all__ = [
    "LATE_HEARTBEATS",
    "Heard",
    "Reports",
    "RoundWait",
    "ServerReport",
    "WaitingRound",
    "WorkerReport",
    "blamed",
    "job_status",
    "node_state",
    "parse_report",
    "round_wait",
    "rounds_behind",
]

#: A node whose last sign of life is older than this many heartbeat intervals is ``late``
#: (it missed two heartbeats at least: stopped, swapping, or its host overloaded).
LATE_HEARTBEATS = 3
#: The counts each role reports, in the order of its record's fields.
WORKER_COUNTS = ("pushes", "pulls", "rounds")
SERVER_COUNTS = ("keys", "bytes", "rounds")

_COUNT_MAX = (1 << 63) - 1
#: The failure's first words name the node it blames (the roster's wording:
#: ``Node.describe()`` or ``"<role> <rank>"``), or the scheduler itself.
_BLAMED = re.compile(r"(worker|server) (\d+)\b")
_SCHEDULER_BLAMED = "the scheduler "


@dataclass(frozen=True)
class WaitingRound:
    """A server's open rounds (dist_sync: some workers' pushes came, others' did not):
    the oldest one's ``key`` (its ``repr``) and ``round``, how long it had waited when
    reported, how many rounds are ``open``, and the ``workers`` any of them waits for."""

    key: str
    round: int
    waiting_s: float
    open: int
    workers: tuple[int, ...]


@dataclass(frozen=True)
class ServerReport:
    """What a server reported: its keys, their stored bytes, the highest round completed
    of any key, and its open rounds (None: none)."""

    keys: int
    bytes: int
    rounds: int
    waiting: WaitingRound | None = None


@dataclass(frozen=True)
class WorkerReport:
    """What a worker reported: keys pushed and pulled, and the pushes of its most pushed
    key (its rounds)."""

    pushes: int
    pulls: int
    rounds: int


Report = ServerReport | WorkerReport


@dataclass(frozen=True)
class Heard:
    """A node's latest report and when it came (a reading of the scheduler's clock)."""

    report: Report
    at: float


@dataclass(frozen=True)
class RoundWait:
    """Whom the job's current round waits for: the ``workers`` any server's open round
    still needs, and the oldest such round (on ``server``: its ``key`` and ``round``),
    waiting for ``waiting_s`` now."""

    workers: tuple[int, ...]
    waiting_s: float
    server: int
    key: str
    round: int


class Reports:
    """The latest report of each node, by node id."""

    def __init__(self) -> None:
        self._heard: dict[str, Heard] = {}

    def heard(self, node_id: str, report: Report, now: float) -> None:
        """Keep ``report`` as ``node_id``'s latest (it came at ``now``)."""
        self._heard[node_id] = Heard(report, now)

    def of(self, node_id: str) -> Heard | None:
        """``node_id``'s latest report, or None before its first."""
        return self._heard.get(node_id)


def parse_report(role: str, value: object, num_workers: int) -> Report:
    """A heartbeat's ``report`` from a node of ``role``, checked whole; fields not named
    here are never read.

    Raises
    ------
    ValueError
        Naming the field that is missing, of the wrong JSON type or out of range (a rank
        outside ``0 .. num_workers - 1``, a key text longer than ``KEY_TEXT_CHARS``).
    """
    fields = _object("report", value)
    if role == "worker":
        return WorkerReport(*(_count("report", fields, name) for name in WORKER_COUNTS))
    if role != "server":
        raise ValueError(f"a {role} sends no report")
    keys, stored, rounds = (_count("report", fields, name) for name in SERVER_COUNTS)
    waiting = fields.get("waiting")
    if waiting is None:
        return ServerReport(keys, stored, rounds)
    open_rounds = _object("report.waiting", waiting)
    key = open_rounds.get("key")
    if not isinstance(key, str) or len(key) > KEY_TEXT_CHARS:
        raise ValueError(f"report.waiting.key must be a string of at most {KEY_TEXT_CHARS}")
    waiting_s = open_rounds.get("waiting_s")
    if isinstance(waiting_s, bool) or not isinstance(waiting_s, (int, float)):
        raise ValueError("report.waiting.waiting_s must be a number")
    if not math.isfinite(waiting_s) or waiting_s < 0:
        raise ValueError(f"report.waiting.waiting_s {waiting_s} is not a duration")
    workers = open_rounds.get("workers")
    if not isinstance(workers, list) or len(workers) > num_workers:
        raise ValueError(f"report.waiting.workers must be a list of at most {num_workers}")
    for rank in workers:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_workers:
            raise ValueError(f"report.waiting.workers holds {rank!r}, not a worker rank")
    return ServerReport(
        keys,
        stored,
        rounds,
        WaitingRound(
            key,
            _count("report.waiting", open_rounds, "round"),
            float(waiting_s),
            _count("report.waiting", open_rounds, "open"),
            tuple(sorted(set(workers))),
        ),
    )


def node_state(
    node: Node,
    now: float,
    *,
    heartbeat_interval_s: float,
    heartbeat_timeout_s: float,
    assembled: bool,
) -> str:
    """A registered node's state (see the module docstring); ``assembled``: every node of
    the job registered."""
    if node.finished:
        return "finished"
    if node.dead:
        return "dead"
    silent = now - node.last_seen
    if node.restartable and silent > heartbeat_timeout_s:
        return "restarting"
    if silent > LATE_HEARTBEATS * heartbeat_interval_s:
        return "late"
    return "running" if assembled else "joined"


def rounds_behind(rounds: Mapping[int, int]) -> dict[int, int]:
    """How many rounds each worker (rank -> its rounds) is behind the fastest one."""
    fastest = max(rounds.values(), default=0)
    return {rank: fastest - count for rank, count in rounds.items()}


def round_wait(servers: Iterable[tuple[int, ServerReport, float]], now: float) -> RoundWait | None:
    """Whom the current round waits for, from each live server's ``(rank, report, when it
    came)``: the workers that any open round still needs, and the oldest open round (each
    report's wait grows by the time since it came). None when no round is open."""
    workers: set[int] = set()
    oldest: tuple[float, int, WaitingRound] | None = None
    for rank, report, at in servers:
        waiting = report.waiting
        if waiting is None:
            continue
        workers.update(waiting.workers)
        waited = waiting.waiting_s + max(0.0, now - at)
        if oldest is None or waited > oldest[0]:
            oldest = (waited, rank, waiting)
    if oldest is None:
        return None
    waited, rank, waiting = oldest
    return RoundWait(tuple(sorted(workers)), waited, rank, waiting.key, waiting.round)


def blamed(failure: str | None) -> dict[str, Any] | None:
    """Whom the job's failure blames: ``{"role", "rank"}`` of the node its reason names
    first (the scheduler: rank None), or None (no failure, or one that blames no single
    node, such as a job that did not assemble)."""
    if failure is None:
        return None
    if failure.startswith(_SCHEDULER_BLAMED):
        return {"role": "scheduler", "rank": None}
    match = _BLAMED.match(failure)
    if match is None:
        return None
    return {"role": match.group(1), "rank": int(match.group(2))}


def job_status(
    roster: Roster, reports: Reports, now: float, *, scheduler: tuple[str, int, int]
) -> dict[str, Any]:
    """The whole job, JSON-ready: what ``/status.json`` answers and ``/status`` shows
    (``scheduler``: its advertised host, port and pid). Fields: ``docs/status.md``."""
    assembled = roster.complete()
    nodes: list[dict[str, Any]] = [
        {
            "role": "scheduler",
            "rank": None,
            "address": format_address(*scheduler[:2]),
            "pid": scheduler[2],
            "state": "running",
            "heartbeat_age_s": None,
            "restarts": 0,
        }
    ]
    registered = {(n.role, n.rank): n for n in roster.nodes.values()}
    worker_rounds: dict[int, int] = {}
    live_servers: list[tuple[int, ServerReport, float]] = []
    for role in MEMBER_ROLES[::-1]:  # servers first, then workers
        size = roster.num_servers if role == "server" else roster.num_workers
        for rank in range(size):
            node = registered.get((role, rank))
            row = _node_row(roster, node, role, rank, now, assembled)
            heard = None if node is None else reports.of(node.node_id)
            report = None if heard is None else heard.report
            if isinstance(report, ServerReport) and heard is not None:
                row.update(keys=report.keys, bytes=report.bytes, rounds=report.rounds)
                row["waiting"] = _waiting_now(report.waiting, now - heard.at)
                if row["state"] not in ("dead", "finished"):
                    live_servers.append((rank, report, heard.at))
            elif isinstance(report, WorkerReport):
                row.update(pushes=report.pushes, pulls=report.pulls, rounds=report.rounds)
                worker_rounds[rank] = report.rounds
            nodes.append(row)
    behind = rounds_behind(worker_rounds)
    for row in nodes:
        if row["role"] == "worker":
            row["behind"] = behind.get(row["rank"])
    wait = round_wait(live_servers, now)
    return {
        "job": {
            "state": _job_state(roster),
            "workers": roster.num_workers,
            "servers": roster.num_servers,
            "assembled": assembled,
            "restarts": sum(roster.restarts.values()),
        },
        "round": None
        if wait is None
        else {
            "waiting_for": list(wait.workers),
            "waiting_s": round(wait.waiting_s, 3),
            "server": wait.server,
            "key": wait.key,
            "round": wait.round,
        },
        "failure": None
        if roster.failure is None
        else {"reason": roster.failure, "blamed": blamed(roster.failure)},
        "nodes": nodes,
    }


# ---------------------------------------------------------------------- helpers


def _node_row(
    roster: Roster, node: Node | None, role: str, rank: int, now: float, assembled: bool
) -> dict[str, Any]:
    """A node's row without its report: ``not joined`` when no process holds the rank."""
    restarts = roster.restarts.get(rank, 0) if role == "server" else 0
    empty: dict[str, Any] = dict.fromkeys(
        (*SERVER_COUNTS, "waiting") if role == "server" else WORKER_COUNTS
    )
    if node is None:
        row = {"role": role, "rank": rank, "address": None, "pid": None, "state": "not joined"}
        return {**row, "heartbeat_age_s": None, "restarts": restarts, **empty}
    row = {
        "role": role,
        "rank": rank,
        "address": format_address(node.host, node.port) if node.port else node.host,
        "pid": node.pid,
        "state": node_state(
            node,
            now,
            heartbeat_interval_s=roster.heartbeat_interval_s,
            heartbeat_timeout_s=roster.heartbeat_timeout_s,
            assembled=assembled,
        ),
        "heartbeat_age_s": round(max(0.0, now - node.last_seen), 3),
        "restarts": restarts,
        **empty,
    }
    if (node.bound_host, node.bound_port) != (node.host, node.port):
        assert node.bound_host is not None and node.bound_port is not None  # __post_init__
        row["bound"] = format_address(node.bound_host, node.bound_port)
    return row


def _waiting_now(waiting: WaitingRound | None, since_report_s: float) -> dict[str, Any] | None:
    if waiting is None:
        return None
    return {
        "key": waiting.key,
        "round": waiting.round,
        "waiting_s": round(waiting.waiting_s + max(0.0, since_report_s), 3),
        "open": waiting.open,
        "workers": list(waiting.workers),
    }


def _job_state(roster: Roster) -> str:
    if roster.failure is not None:
        return "failed"
    if roster.done():
        return "ended"
    if not roster.complete():
        return "assembling"
    return "stopping" if roster.servers_should_stop() else "running"


def _object(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not {type(value).__name__}")
    return value


def _count(where: str, fields: Mapping[str, Any], field: str) -> int:
    """``fields[field]``, a count (a ``ValueError`` naming ``where.field`` if not)."""
    name = f"{where}.{field}"
    value = fields.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {type(value).__name__}")
    if not 0 <= value <= _COUNT_MAX:
        raise ValueError(f"{name} {value} is out of range 0..{_COUNT_MAX}")
    return value
