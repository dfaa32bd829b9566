"""What the server's state tells its metrics (akv/cluster/server/metrics.py): how long the
rounds a push closes waited for their last worker (``Land.waited_s``, ``LandRows.waited_s``)
and the reconnects it admitted, played with real frames and no sockets."""

from __future__ import annotations

import numpy as np

from akv.cluster.server.instructions import Land, LandRows
from tests.akv.cluster.server.players import OK, Players


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def holding(num_workers: int, store_type: str = "dist_sync") -> Players:
    """Players of a job with keys ``a`` and ``b``, whose push tasks are held (not run)."""
    players = Players(num_workers, store_type)
    assert players.reply(0, players.init(0, {"a": f32(0, 0), "b": f32(0, 0)})) == OK
    players.hold_updates = True
    return players


def test_the_push_that_closes_sync_rounds_carries_the_longest_wait_of_them():
    players = holding(2)
    players.now = 1.0
    players.push(0, {"a": f32(1, 1)})
    players.now = 2.0
    players.push(0, {"b": f32(1, 1)})
    players.now = 5.0
    players.push(1, {"a": f32(1, 1), "b": f32(1, 1)})
    first, second, closing = players.held
    assert isinstance(closing, Land) and len(closing.closing) == 2
    assert closing.waited_s == 4.0  # a's round opened at 1.0, b's at 2.0
    assert first.waited_s is None and second.waited_s is None  # they closed nothing


def test_async_pushes_carry_no_wait():
    players = holding(2, "dist_async")
    players.now = 3.0
    players.push(0, {"a": f32(1, 1)})
    (land,) = players.held
    assert isinstance(land, Land) and len(land.closing) == 1 and land.waited_s is None


def test_the_row_push_that_closes_a_sync_round_carries_its_wait():
    players = Players(2)
    assert players.reply(0, players.row_init(0, "e", (4, 2), (0, 4))) == OK
    players.hold_updates = True
    players.now = 1.0
    players.row_push(0, "e", [1], f32(1, 1).reshape(1, 2), tag=1)
    players.now = 1.75
    players.row_push(1, "e", [2], f32(2, 2).reshape(1, 2), tag=1)
    (work,) = players.held
    assert isinstance(work, LandRows) and work.waited_s == 0.75


def test_each_stream_a_session_opens_again_counts_as_a_reconnect():
    players = Players(2)
    assert players.state.reconnects == 0  # first streams are no reconnects
    players.lose(1, ConnectionResetError("cut"))
    players.reconnect(1)
    assert players.state.reconnects == 1
    players.reconnect(0)  # its old stream not seen ending yet: replaced, a reconnect too
    assert players.state.reconnects == 2
