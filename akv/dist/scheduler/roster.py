"""The scheduler's decisions: who is in the job, barriers, liveness, and when it ends.

Plain code without I/O; the clock is passed in. The HTTP handlers of
:mod:`akv.scheduler` only translate requests into these calls and the answers back.

* **Registration.** Every node registers with an id of its own making (retries are
  idempotent) and, optionally, the rank it wants (from ``AKV_RANK`` or an MPI/SLURM rank);
  others get the lowest free rank of their role. The address book is complete once
  ``num_workers`` workers and ``num_servers`` servers registered.
* **Barriers.** A worker's ``n``-th barrier call joins barrier ``n`` (the worker counts, so
  a retried request is harmless); it is passed when every worker joined it.
* **Liveness.** Each node heartbeats. A node silent for longer than the timeout, or one a
  server saw disconnect without closing, fails the job; from then on every answer carries
  the reason, which names the node.
* **The end.** A worker that closed its store says so; when every worker has, servers are
  told to stop; once every server stopped, the scheduler may exit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from akv.errors import ServerError

__all__ = ["Node", "Roster"]


@dataclass
class Node:
    """One registered process."""

    node_id: str
    role: str
    rank: int
    host: str
    port: int
    pid: int
    last_seen: float
    finished: bool = False
    dead: bool = False

    def describe(self) -> str:
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host})"


@dataclass
class _Barrier:
    arrived: set[int] = field(default_factory=set)
    opened_at: float = 0.0


class Roster:
    """The scheduler's state (see the module docstring)."""

    def __init__(self, num_workers: int, num_servers: int, heartbeat_timeout_s: float) -> None:
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.nodes: dict[str, Node] = {}
        self.failure: str | None = None
        self._barriers: dict[int, _Barrier] = {}
        self._barrier_calls: dict[int, int] = {}

    # ------------------------------------------------------------ registration

    def _count(self, role: str) -> int:
        return self.num_workers if role == "worker" else self.num_servers

    def register(
        self,
        node_id: str,
        role: str,
        host: str,
        port: int,
        pid: int,
        now: float,
        rank: int | None = None,
    ) -> Node:
        """Add a node (or return it again for a retry); raise when it cannot join."""
        known = self.nodes.get(node_id)
        if known is not None:
            known.last_seen = now
            return known
        if role not in ("worker", "server"):
            raise ServerError(f"cannot register role {role!r}: only workers and servers join")
        taken = {n.rank for n in self.nodes.values() if n.role == role}
        limit = self._count(role)
        if rank is None:
            free = [r for r in range(limit) if r not in taken]
            if not free:
                raise ServerError(
                    f"a {role} from {host} (pid {pid}) tried to join, but all {limit} "
                    f"{role} ranks are taken: is a process of another job using this "
                    "scheduler, or were too many started?"
                )
            rank = free[0]
        elif not 0 <= rank < limit:
            raise ServerError(f"{role} rank {rank} is out of range 0..{limit - 1}")
        elif rank in taken:
            holder = next(n for n in self.nodes.values() if n.role == role and n.rank == rank)
            raise ServerError(
                f"{role} rank {rank} is already taken by {holder.describe()}; a {role} from "
                f"{host} (pid {pid}) asked for it too"
            )
        node = Node(node_id, role, rank, host, port, pid, now)
        self.nodes[node_id] = node
        return node

    def complete(self) -> bool:
        """True once every worker and server registered."""
        roles = [n.role for n in self.nodes.values()]
        return (
            roles.count("worker") == self.num_workers and roles.count("server") == self.num_servers
        )

    def missing(self) -> str:
        """What registration still waits for, in words."""
        workers = sorted(n.rank for n in self.nodes.values() if n.role == "worker")
        servers = sorted(n.rank for n in self.nodes.values() if n.role == "server")
        return (
            f"{self.num_workers - len(workers)} of {self.num_workers} workers and "
            f"{self.num_servers - len(servers)} of {self.num_servers} servers have not "
            f"registered yet (registered: workers {workers}, servers {servers})"
        )

    def servers(self) -> list[Node]:
        """The servers, by rank."""
        return sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank)

    def node(self, node_id: str) -> Node:
        """A registered node; raise for an unknown id."""
        node = self.nodes.get(node_id)
        if node is None:
            raise ServerError(f"unknown node id {node_id!r}: register first")
        return node

    # ------------------------------------------------------------ barriers

    def arrive(self, node_id: str, number: int, now: float) -> None:
        """A worker joins its ``number``-th barrier (1, 2, ...); repeating a call is harmless."""
        node = self.node(node_id)
        if node.role != "worker":
            raise ServerError(f"{node.describe()} called a barrier; only workers do")
        previous = self._barrier_calls.get(node.rank, 0)
        if number not in (previous, previous + 1):
            raise ServerError(
                f"worker {node.rank} joined barrier {number} but its last one was {previous}"
            )
        self._barrier_calls[node.rank] = number
        barrier = self._barriers.setdefault(number, _Barrier(opened_at=now))
        barrier.arrived.add(node.rank)

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

    def heartbeat(self, node_id: str, now: float) -> Node:
        """Note that a node is alive."""
        node = self.node(node_id)
        node.last_seen = now
        return node

    def fail(self, reason: str) -> None:
        """Fail the job (the first reason is kept)."""
        if self.failure is None:
            self.failure = reason

    def check(self, now: float) -> list[Node]:
        """Find nodes silent for longer than the timeout; they fail the job. Returns them."""
        dead = []
        for node in self.nodes.values():
            if node.finished or node.dead:
                continue
            silent = now - node.last_seen
            if silent > self.heartbeat_timeout_s:
                node.dead = True
                dead.append(node)
                self.fail(
                    f"{node.describe()} sent no heartbeat for {silent:.1f} s "
                    f"(timeout {self.heartbeat_timeout_s:g} s): it died or hangs"
                )
        return dead

    def lost(self, reporter: str, role: str, rank: int, detail: str) -> None:
        """A node saw a peer disconnect without closing: fail the job naming it."""
        peer = next((n for n in self.nodes.values() if n.role == role and n.rank == rank), None)
        if peer is not None and peer.finished:
            return
        name = peer.describe() if peer else f"{role} {rank}"
        if peer is not None:
            peer.dead = True
        self.fail(f"{name} disconnected from {reporter} without closing: {detail}")

    def finish(self, node_id: str) -> None:
        """A node closed cleanly (a worker its store, a server its service)."""
        self.node(node_id).finished = True

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
