"""A server's optimizer requests (``SET_OPTIMIZER``, ``SAVE_STATES``, ``LOAD_STATES``), as
a part of :class:`~akv.cluster.server.state.ServerState` without I/O.

Each waits, as a pull does, for the rounds its sender pushed into to be applied
(:meth:`OptimizerRequests._after_own_rounds`): a save holds them, and a load or a new
optimizer follows them. A new optimizer or a load resent on a new stream after a cut is
not applied twice (:meth:`OptimizerRequests._resent`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from akv import optimizer as _optimizer
from akv.cluster.server.checks import optimizer_request, require_updater, save_states_request
from akv.cluster.server.instructions import (
    InstallOptimizer,
    Instruction,
    LoadStates,
    Peer,
    PullTicket,
    Reply,
    RowEntry,
    RowPullTicket,
    SaveStates,
    ServerEntry,
    StatesTicket,
)
from akv.cluster.server.updates import updater_with

__all__ = ["OptimizerRequests"]


class OptimizerRequests:
    """The optimizer's part of the server state (mixed into ``ServerState``, which gives
    the attributes and the two methods declared here)."""

    name: str
    updater: _optimizer.Updater | None
    optimizer_config: dict[str, Any] | None
    #: The configuration in force once every new optimizer asked for so far is installed
    #: (some may wait for rounds).
    requested_config: dict[str, Any] | None

    if TYPE_CHECKING:  # ServerState's

        def _all_keys(self) -> tuple[ServerEntry | RowEntry, ...]: ...

        def _ready(
            self, ticket: PullTicket | RowPullTicket | StatesTicket
        ) -> list[Instruction]: ...

    def _resent(self, peer: Peer, seq: int) -> list[Instruction]:
        """A new optimizer or a states load this worker sent before its stream was cut, and
        sent again (its pushes are known by their numbers): not applied again; answered
        now, or by the ticket it still waits with (given the new stream)."""
        for entry in self._all_keys():
            for ticket in entry.rounds.waiting_tickets():
                if isinstance(ticket, StatesTicket) and (ticket.peer.worker, ticket.seq) == (
                    peer.worker,
                    seq,
                ):
                    ticket.peer, ticket.work = peer, replace(ticket.work, peer=peer)
                    return []
        return [Reply(peer, seq)]

    def _set_optimizer(self, peer: Peer, seq: int, text: str) -> list[Instruction]:
        optimizer, config = optimizer_request(text)
        if (self.requested_config or self.optimizer_config) == config:
            return [Reply(peer, seq)]  # every worker sends it; the same again changes nothing
        self.requested_config = config
        # Not before the rounds its sender pushed into are applied (as its pull waited for
        # them): a restarted server gets it resent right behind those pushes, maybe before
        # another worker's push closes the round, which the old optimizer must apply.
        return self._after_own_rounds(
            InstallOptimizer(peer, seq, optimizer, config, self._all_keys())
        )

    def install_optimizer(self, optimizer: _optimizer.Optimizer, config: dict[str, Any]) -> None:
        """Use ``optimizer`` from now on (the service calls this once every earlier write
        finished); see :func:`~akv.cluster.server.updates.updater_with`."""
        self.updater = updater_with(self.updater, optimizer, config, self._all_keys())
        self.optimizer_config = config

    def _require_updater(self, what: str) -> _optimizer.Updater:
        return require_updater(self.updater, what, self.name)

    def _save_states(self, peer: Peer, seq: int, text: str) -> list[Instruction]:
        dump = save_states_request(text)
        updater = self._require_updater("save_optimizer_states")
        return self._after_own_rounds(SaveStates(peer, seq, updater, dump, self._all_keys()))

    def _load_states(self, peer: Peer, seq: int, data: bytes) -> list[Instruction]:
        updater = self._require_updater("load_optimizer_states")
        return self._after_own_rounds(LoadStates(peer, seq, updater, data, self._all_keys()))

    def _after_own_rounds(
        self, work: InstallOptimizer | SaveStates | LoadStates
    ) -> list[Instruction]:
        """``work`` now, or once the round of its sender's last push of each key is applied
        (as a pull waits: a save holds, and a load or a new optimizer follows, every push
        sent before it)."""
        ticket = StatesTicket(work.peer, work.seq, work)
        for entry in self._all_keys():
            rounds = entry.rounds
            if not rounds.pull(rounds.last_push_round(work.peer.worker), ticket):
                ticket.remaining += 1
        return [] if ticket.remaining else self._ready(ticket)
