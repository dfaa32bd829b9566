"""The scheduler's decisions: who is in the job, barriers, liveness, and when it ends.

Plain code without I/O; the clock is passed in. The HTTP handlers of
:mod:`akv.cluster.scheduler.service` only translate requests into these calls and the
answers (small frozen records) back.

* **Registration.** Every node registers with an id of its own making (retries are
  idempotent) and, optionally, the rank it wants (from ``AKV_RANK`` or an MPI/SLURM rank);
  others get the lowest free rank of their role. The address book is complete once
  ``num_workers`` workers and ``num_servers`` servers registered; a job not complete by
  its deadline fails, naming the ranks that never registered (:meth:`Roster.check_assembly`).
* **Barriers.** A worker's ``n``-th barrier call joins barrier ``n`` (the worker counts, so
  a retried request is harmless); it is passed when every worker joined it.
* **Liveness.** Each node heartbeats. A node silent for longer than the timeout, or one a
  server saw disconnect without closing, fails the job; from then on registrations and
  barriers are refused with the reason, which names the node, and heartbeats carry it.
* **The end.** A worker that closed its store says so; when every worker has, servers are
  told to stop; once every server stopped (or the job failed) the scheduler lingers a
  little, so that every node hears the news, and exits.

A request that does not fit the job (an unknown node, a role or rank that does not fit,
a rank already taken, a barrier out of order) raises :class:`MembershipError`; one that
comes after the job failed raises :class:`PeerLostError` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from akv.cluster.protocol import LAUNCHER_REPORTER
from akv.errors import MembershipError, PeerLostError
from akv.limits import HEARTBEAT_INTERVAL_S, RESTART_WINDOW_S, SCHEDULER_LINGER_S

__all__ = [
    "BarrierState",
    "HeartbeatAnswer",
    "Node",
    "NodeStatus",
    "Registration",
    "Roster",
    "RosterStatistics",
    "ServerAddress",
]

#: The roles that register with the scheduler.
MEMBER_ROLES = ("worker", "server")


@dataclass
class Node:
    """One registered process.

    ``host`` and ``port`` are its advertised address: what workers are given and what
    messages name. ``bound_host`` and ``bound_port`` are what it listens on (None when
    made: the advertised ones).
    """

    node_id: str
    role: str
    rank: int
    host: str
    port: int
    pid: int
    last_seen: float
    finished: bool = False
    dead: bool = False
    bound_host: str | None = None
    bound_port: int | None = None
    #: A server that writes checkpoints: when it goes silent the job waits for its
    #: restart, which takes its rank over.
    restartable: bool = False
    #: A server's way in for workers on its host: (host identity, Unix socket path).
    local: tuple[str, str] | None = None
    #: A server's instance (``akv_transport``'s, drawn as it starts): workers sign their
    #: streams for it, so that a process on a gone server's address cannot pass them on.
    instance: str | None = None
    #: A server restored from a checkpoint: its file, and the rounds applied of the keys
    #: other servers hold parts of (split and row-sparse keys).
    restored: Restored | None = None
    #: A server that took its rank over from an earlier process of it (a restart).
    restarted: bool = False

    def __post_init__(self) -> None:
        if self.bound_host is None:
            self.bound_host = self.host
        if self.bound_port is None:
            self.bound_port = self.port

    def describe(self) -> str:
        """``"worker 1 (pid 4121 on 10.0.0.2)"``: how messages name the node."""
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host})"


#: A restored server's checkpoint file, and ``(key, rounds applied)`` of its keys that other
#: servers hold parts of.
Restored = tuple[str, tuple[tuple[int | str, int], ...]]


def mixed_restores(servers: list[Node]) -> str | None:
    """Why the servers' restored checkpoints are not of one point in time, or None.

    Every push of a key split over the servers, or of a row-sparse key, reaches every
    server that holds a part of it, so the parts of a job's consistent end agree on the
    rounds applied. Servers that restored files written at different moments (a job that
    failed with a server killed, or its launcher killed, then started again on its
    directory) do not: the new job would train on keys whose parts mix rounds.
    """
    seen: dict[int | str, tuple[int, Node]] = {}
    for node in servers:
        if node.restored is None:
            continue
        for key, rounds in node.restored[1]:
            first = seen.setdefault(key, (rounds, node))
            if first[0] != rounds:
                other = first[1]
                assert other.restored is not None
                return (
                    f"the servers restored checkpoints of different points in time: key "
                    f"{key!r} (split over the servers, or row-sparse) had {first[0]} rounds "
                    f"applied in server {other.rank}'s {other.restored[0]} and {rounds} in "
                    f"server {node.rank}'s {node.restored[0]} (a job that failed and was "
                    "started again on its --checkpoint-dir?): its parts would mix rounds. "
                    "Put back checkpoint files of one moment, or start the job with another "
                    "--checkpoint-dir"
                )
    return None


@dataclass(frozen=True)
class ServerAddress:
    """Where workers reach one server."""

    rank: int
    host: str
    port: int
    #: It writes checkpoints: when it dies it may be restarted (workers keep trying).
    restartable: bool = False
    #: (host identity, Unix socket path): workers with that host identity may open their
    #: stream there and share memory (None: TCP only).
    local: tuple[str, str] | None = None
    #: The instance workers sign their streams for (None: learned at the first contact).
    instance: str | None = None


@dataclass(frozen=True)
class Registration:
    """What a registered node is told: its rank and, once every node registered, the
    address book (``servers``, by rank); until then ``servers`` is None and ``waiting``
    says what is missing. ``finished``: the workers that closed their stores."""

    rank: int
    servers: tuple[ServerAddress, ...] | None
    waiting: str = ""
    #: The workers that closed their stores already (a restarted server waits for none of
    #: them to come back).
    finished: tuple[int, ...] = ()


@dataclass(frozen=True)
class BarrierState:
    """A barrier: the worker ranks that have not joined it yet (none: it is passed)."""

    number: int
    missing: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return not self.missing


@dataclass(frozen=True)
class HeartbeatAnswer:
    """What a heartbeat is told: why the job failed (None: it did not), and whether the
    servers should stop."""

    failure: str | None
    stop: bool


@dataclass(frozen=True)
class NodeStatus:
    """A node as :meth:`Roster.statistics` reports it: ``host`` and ``port`` advertised,
    ``bound_host`` and ``bound_port`` listened on (None when made: the advertised ones)."""

    role: str
    rank: int
    host: str
    port: int
    pid: int
    finished: bool
    dead: bool
    bound_host: str | None = None
    bound_port: int | None = None

    def __post_init__(self) -> None:
        if self.bound_host is None:
            object.__setattr__(self, "bound_host", self.host)
        if self.bound_port is None:
            object.__setattr__(self, "bound_port", self.port)


@dataclass(frozen=True)
class RosterStatistics:
    """The roster at one moment, for people and monitoring (``GET /v1/status``)."""

    failure: str | None
    complete: bool
    nodes: tuple[NodeStatus, ...]


@dataclass
class _Barrier:
    arrived: set[int] = field(default_factory=set)


class Roster:
    """The scheduler's state (see the module docstring).

    Parameters
    ----------
    num_workers, num_servers:
        The job's size.
    heartbeat_timeout_s:
        A node silent for longer than this is dead (``AKV_HEARTBEAT_TIMEOUT_S``).
    heartbeat_interval_s:
        How often nodes heartbeat (``AKV_HEARTBEAT_INTERVAL_S``): after a failure the
        scheduler stays up for two intervals (at least ``SCHEDULER_LINGER_S``), so that
        every node's next heartbeat hears the reason.
    restart_s:
        How long a silent server that writes checkpoints has, beyond the heartbeat
        timeout, to be restarted before the job fails (``AKV_RESTART_WINDOW_S``).
    """

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        heartbeat_timeout_s: float,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        restart_s: float = RESTART_WINDOW_S,
        *,
        accept_mixed_restore: bool = False,
    ) -> None:
        self.num_workers = num_workers
        #: Restored checkpoints of different moments are logged, and the job goes on.
        self.accept_mixed_restore = accept_mixed_restore
        #: Why the restored checkpoints were of different moments, when that was accepted.
        self.mixed_restore: str | None = None
        self.num_servers = num_servers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.restart_s = restart_s
        #: How many times a server was restarted (its rank taken over), by rank.
        self.restarts: dict[int, int] = {}
        self.nodes: dict[str, Node] = {}
        self.failure: str | None = None
        self._barriers: dict[int, _Barrier] = {}
        #: Whether the servers' restored checkpoints were compared (once the job was whole).
        self._restores_checked = False
        self._barrier_calls: dict[int, int] = {}
        self._ended_at: float | None = None

    # ------------------------------------------------------------ registration

    def register(
        self,
        node_id: str,
        role: str,
        host: str,
        port: int,
        pid: int,
        now: float,
        rank: int | None = None,
        *,
        bound_host: str | None = None,
        bound_port: int | None = None,
        restartable: bool = False,
        local: tuple[str, str] | None = None,
        instance: str | None = None,
        restored: Restored | None = None,
    ) -> Node:
        """Add a node (or return it again for a retry).

        ``host`` and ``port`` are the address it advertises (what workers are given for a
        server, and what messages name); ``bound_host`` and ``bound_port`` what it listens
        on (default: the advertised ones).

        A ``restartable`` server (one that writes checkpoints) asking for the rank of
        another restartable server takes it over: it holds that rank's checkpoint
        directory locked, so the server before it is gone (killed, even if its heartbeats
        are not overdue yet). The workers find it at its new address; when every worker
        finished already, its heartbeats tell it to stop.

        The registration that completes the job (its first: not a restart's) fails it when
        the servers' ``restored`` checkpoints are not of one point in time
        (:func:`mixed_restores`).

        Raises
        ------
        MembershipError
            The role is not ``worker`` or ``server``; the rank is out of range or taken;
            every rank of the role is taken.
        PeerLostError
            The job failed already.
        """
        self.refuse_if_failed()
        known = self.nodes.get(node_id)
        if known is not None:
            known.last_seen = now
            return known
        restarted = False
        if role not in MEMBER_ROLES:
            raise MembershipError(f"cannot register role {role!r}: only workers and servers join")
        taken = {n.rank for n in self.nodes.values() if n.role == role}
        limit = self._count(role)
        if rank is None:
            free = [r for r in range(limit) if r not in taken]
            if not free:
                raise MembershipError(
                    f"a {role} from {host} (pid {pid}) tried to join, but all {limit} "
                    f"{role} ranks are taken: is a process of another job using this "
                    "scheduler, or were too many started?"
                )
            rank = free[0]
        elif not 0 <= rank < limit:
            raise MembershipError(
                f"a {role} from {host} (pid {pid}) asked for {role} rank {rank}, which is "
                f"out of range 0..{limit - 1}"
            )
        elif rank in taken:
            holder = next(n for n in self.nodes.values() if n.role == role and n.rank == rank)
            # (Also of a server that finished: killed as it stopped while a worker's process
            # still ran, it is restarted; it is told to stop at once, and exits 0.)
            takeover = role == "server" and restartable and holder.restartable
            if not takeover:
                raise MembershipError(
                    f"{role} rank {rank} is already taken by {holder.describe()}; a {role} "
                    f"from {host} (pid {pid}) asked for it too"
                )
            del self.nodes[holder.node_id]  # a restart: the server before it is gone
            self.restarts[rank] = self.restarts.get(rank, 0) + 1
            restarted = True
        node = Node(
            node_id,
            role,
            rank,
            host,
            port,
            pid,
            now,
            bound_host=bound_host,
            bound_port=bound_port,
            restartable=restartable and role == "server",
            local=local if role == "server" else None,
            instance=instance if role == "server" else None,
            restored=restored if role == "server" else None,
            restarted=restarted,
        )
        self.nodes[node_id] = node
        if not self._restores_checked and self.complete():
            self._restores_checked = True  # (a restarted server restores where its job is)
            mixed = mixed_restores(self.servers())
            if mixed is not None and self.accept_mixed_restore:
                self.mixed_restore = mixed  # the service logs it
            elif mixed is not None:
                self.fail(f"{mixed} (or set AKV_ACCEPT_MIXED_RESTORE=1 to go on with them)")
        return node

    def registration(self, node_id: str) -> Registration:
        """What a registered node is told now (see :class:`Registration`).

        Raises :class:`MembershipError` for an unknown node and :class:`PeerLostError`
        once the job failed.
        """
        self.refuse_if_failed()
        node = self.node(node_id)
        finished = tuple(
            sorted(n.rank for n in self.nodes.values() if n.role == "worker" and n.finished)
        )
        if not self.complete():
            return Registration(node.rank, None, self.missing(), finished)
        return Registration(node.rank, tuple(self.server_addresses()), finished=finished)

    def registration_settled(self) -> bool:
        """True once a waiting registration can be answered: every node registered, or
        the job failed."""
        return self.complete() or self.failure is not None

    def complete(self) -> bool:
        """True once every worker and server registered."""
        roles = [n.role for n in self.nodes.values()]
        return (
            roles.count("worker") == self.num_workers and roles.count("server") == self.num_servers
        )

    def missing(self) -> str:
        """What registration still waits for, in words."""
        workers = self._ranks("worker")
        servers = self._ranks("server")
        return (
            f"{self.num_workers - len(workers)} of {self.num_workers} workers and "
            f"{self.num_servers - len(servers)} of {self.num_servers} servers have not "
            f"registered yet (registered: workers {workers}, servers {servers})"
        )

    def unregistered(self, role: str) -> list[int]:
        """The ranks of ``role`` that no node holds yet."""
        taken = set(self._ranks(role))
        return [r for r in range(self._count(role)) if r not in taken]

    def check_assembly(self, now: float, deadline: float) -> str | None:
        """Fail the job when it is not complete at ``deadline`` (a reading of the clock
        that ``now`` comes from; the scheduler's start plus the connect timeout and a
        margin), naming the ranks that never registered. Returns the failure this call
        caused, or None (the job is complete, failed already, or still has time)."""
        if now <= deadline or self.failure is not None or self.complete():
            return None
        ranks = [(role, self.unregistered(role)) for role in MEMBER_ROLES]
        absent = " and ".join(f"{role}s {missing}" for role, missing in ranks if missing)
        self.fail(
            f"the job did not assemble in time: {absent} never registered "
            f"(registered: workers {self._ranks('worker')}, servers {self._ranks('server')}); "
            "every process must join within AKV_CONNECT_TIMEOUT_S of the scheduler's start"
        )
        return self.failure

    def servers(self) -> list[Node]:
        """The servers, by rank."""
        return sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank)

    def node(self, node_id: str) -> Node:
        """A registered node; :class:`MembershipError` for an unknown id."""
        node = self.nodes.get(node_id)
        if node is None:
            raise MembershipError(f"unknown node id {node_id!r}: register first")
        return node

    # ------------------------------------------------------------ barriers

    def arrive(self, node_id: str, number: int, now: float) -> BarrierState:
        """A worker joins its ``number``-th barrier (1, 2, ...); repeating a call is harmless,
        and a call counts as a sign of life. Returns the barrier's state.

        Raises
        ------
        MembershipError
            The node is unknown or not a worker, or ``number`` is neither the worker's
            last barrier nor the next one.
        PeerLostError
            The job failed already.
        """
        self.refuse_if_failed()
        node = self.node(node_id)
        node.last_seen = now
        if node.role != "worker":
            raise MembershipError(f"{node.describe()} called a barrier; only workers do")
        previous = self._barrier_calls.get(node.rank, 0)
        if number not in (previous, previous + 1):
            raise MembershipError(
                f"worker {node.rank} joined barrier {number} but its last one was {previous}"
            )
        self._barrier_calls[node.rank] = number
        self._barriers.setdefault(number, _Barrier()).arrived.add(node.rank)
        return self.barrier(number)

    def barrier(self, number: int) -> BarrierState:
        """Barrier ``number`` now; :class:`PeerLostError` once the job failed."""
        self.refuse_if_failed()
        return BarrierState(number, tuple(self.barrier_missing(number)))

    def barrier_settled(self, number: int) -> bool:
        """True once a waiting barrier call can be answered: passed, or the job failed."""
        return self.passed(number) or self.failure is not None

    def passed(self, number: int) -> bool:
        """True once every worker joined barrier ``number``."""
        barrier = self._barriers.get(number)
        return barrier is not None and len(barrier.arrived) == self.num_workers

    def barrier_missing(self, number: int) -> list[int]:
        """The worker ranks that have not joined barrier ``number``."""
        barrier = self._barriers.get(number)
        arrived = barrier.arrived if barrier else set()
        return [r for r in range(self.num_workers) if r not in arrived]

    # ------------------------------------------------------------ liveness and the end

    def heartbeat(self, node_id: str, now: float) -> HeartbeatAnswer:
        """Note that a node is alive; tell it whether the job failed and whether servers
        should stop. Raises :class:`MembershipError` for an unknown node."""
        self.node(node_id).last_seen = now
        return HeartbeatAnswer(self.failure, self.servers_should_stop())

    def fail(self, reason: str) -> bool:
        """Fail the job; the first reason is kept. Returns True when this call failed it."""
        if self.failure is not None:
            return False
        self.failure = reason
        return True

    def check(self, now: float) -> list[Node]:
        """Find nodes silent for longer than the timeout; they fail the job. Returns them.

        A restartable server has :attr:`restart_s` more to be restarted (its restart
        registers and takes its rank over) before it fails the job.
        """
        dead = []
        for node in self.nodes.values():
            if node.finished or node.dead:
                continue
            silent = now - node.last_seen
            if node.restartable and silent > self.heartbeat_timeout_s:
                if silent > self.heartbeat_timeout_s + self.restart_s:
                    node.dead = True
                    dead.append(node)
                    self.fail(
                        f"{node.describe()} sent no heartbeat for {silent:.1f} s and was not "
                        f"restarted from its checkpoint within {self.restart_s:g} s "
                        "(AKV_RESTART_WINDOW_S)"
                    )
                continue
            if silent > self.heartbeat_timeout_s:
                node.dead = True
                dead.append(node)
                self.fail(
                    f"{node.describe()} sent no heartbeat for {silent:.1f} s "
                    f"(timeout {self.heartbeat_timeout_s:g} s): it died or hangs"
                )
        return dead

    def lost(
        self, reporter: str, role: str, rank: int, detail: str, *, itself: bool = False
    ) -> str | None:
        """A node saw a peer disconnect without closing, a node reports that it stops
        (``reporter`` is its own node id: a server stopped by a signal, a worker whose code
        failed; or ``itself``: a node that fails before it registered, such as a server
        whose checkpoint cannot be used), or the launcher saw a process exit (``reporter``
        is :data:`LAUNCHER_REPORTER`): fail the job naming it.

        Returns the failure this report caused, or None (the peer had finished, or the
        job had failed already).
        """
        peer = next((n for n in self.nodes.values() if n.role == role and n.rank == rank), None)
        if peer is not None and peer.finished:
            return None
        name = peer.describe() if peer else f"{role} {rank}"
        if peer is not None:
            peer.dead = True
        if itself or reporter == LAUNCHER_REPORTER or (peer and peer.node_id == reporter):
            reason = f"{name} {detail}"
        else:
            # A worker reports by its node id (a session's random hex): named as a node.
            seen_by = self.nodes[reporter].describe() if reporter in self.nodes else reporter
            reason = f"{name} disconnected from {seen_by} without closing: {detail}"
        if self.fail(reason):
            return self.failure
        return None

    def finish(self, node_id: str) -> bool:
        """A node closed cleanly (a worker its store, a server its service). Returns
        whether the servers should stop now. :class:`MembershipError` for an unknown node."""
        self.node(node_id).finished = True
        return self.servers_should_stop()

    def servers_should_stop(self) -> bool:
        """True once every worker finished (or the job failed)."""
        if self.failure is not None:
            return True
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        return len(workers) == self.num_workers and all(n.finished for n in workers)

    def done(self) -> bool:
        """True once every server stopped after the workers finished."""
        servers = self.servers()
        return (
            self.servers_should_stop()
            and len(servers) == self.num_servers
            and all(n.finished or n.dead for n in servers)
        )

    def exit_status(self, now: float) -> int | None:
        """The scheduler's exit status once it should exit (0: the job ended well, 1: it
        failed), or None while it should keep serving.

        The first call that sees the job over notes the time; the scheduler exits after
        lingering :meth:`linger_s` beyond it, so that the nodes' last requests are answered.
        """
        if not (self.done() or self.failure is not None):
            return None
        if self._ended_at is None:
            self._ended_at = now
            return None
        if now - self._ended_at <= self.linger_s():
            return None
        return 1 if self.failure is not None else 0

    @property
    def ended_well(self) -> bool:
        """Whether :meth:`exit_status` saw the job end well (it returns 0 at its next call)."""
        return self._ended_at is not None and self.failure is None

    def linger_s(self) -> float:
        """How long the scheduler stays up once the job is over: nothing after a good end,
        two heartbeat intervals (at least ``SCHEDULER_LINGER_S``) after a failure."""
        if self.failure is None:
            return 0.0
        return max(SCHEDULER_LINGER_S, 2 * self.heartbeat_interval_s)

    # ------------------------------------------------------------ for people and tests

    def server_addresses(self) -> list[ServerAddress]:
        """Where each registered server is now, by rank (a restart changes it)."""
        return [
            ServerAddress(s.rank, s.host, s.port, s.restartable, s.local, s.instance)
            for s in self.servers()
        ]

    def statistics(self) -> RosterStatistics:
        """The roster now, as a frozen record (nodes by role, then rank)."""
        nodes = tuple(
            NodeStatus(
                n.role,
                n.rank,
                n.host,
                n.port,
                n.pid,
                n.finished,
                n.dead,
                bound_host=n.bound_host,
                bound_port=n.bound_port,
            )
            for n in sorted(self.nodes.values(), key=lambda n: (n.role, n.rank))
        )
        return RosterStatistics(self.failure, self.complete(), nodes)

    def validate_state(self) -> None:
        """Check the roster's invariants; raise :class:`AssertionError` naming a broken one.

        Every node's role is a member role and its rank is in range and its own; no role
        has more nodes than the job's size; every barrier arrival is a worker's rank.
        """
        for role in MEMBER_ROLES:
            ranks = self._ranks(role)
            if len(ranks) != len(set(ranks)):
                raise AssertionError(f"two {role}s hold the same rank: {ranks}")
            if any(not 0 <= r < self._count(role) for r in ranks):
                raise AssertionError(f"a {role} rank is out of range: {ranks}")
        if any(n.role not in MEMBER_ROLES for n in self.nodes.values()):
            raise AssertionError("a node has a role that does not register")
        worker_ranks = set(self._ranks("worker"))
        for number, barrier in self._barriers.items():
            if not barrier.arrived <= worker_ranks:
                raise AssertionError(f"barrier {number} counts ranks no worker holds")

    # ------------------------------------------------------------ helpers

    def _count(self, role: str) -> int:
        return self.num_workers if role == "worker" else self.num_servers

    def _ranks(self, role: str) -> list[int]:
        return sorted(n.rank for n in self.nodes.values() if n.role == role)

    def refuse_if_failed(self) -> None:
        """Raise :class:`PeerLostError` with the reason once the job failed."""
        if self.failure is not None:
            raise PeerLostError(f"the job failed: {self.failure}")
