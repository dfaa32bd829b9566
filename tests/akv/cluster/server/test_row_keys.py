"""A server's row-sparse keys, decided without sockets (:class:`RowKeys` inside
:class:`ServerState`, played by tests/akv/cluster/server/players.py): rounds, exactly-once
pushes, parked pulls, refusals, and the status counters."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from akv import optimizer
from akv.cluster.protocol import Op
from akv.cluster.server import instructions
from akv.cluster.server.checkpoint_header import RowRecord
from akv.cluster.server.instructions import RowPullTicket, SendRows
from akv.errors import (
    DoublePushError,
    DuplicateInitError,
    InvalidArgumentError,
    PeerLostError,
    RoundTimeoutError,
    RowIdError,
    ServerError,
    ShapeMismatchError,
    StorageTypeError,
)
from tests.akv.cluster.server.players import OK, Players

SHAPE = (10**9, 2)
RANGE = (500, 1000)  # this server's rows


def started(store_type: str = "dist_sync") -> Players:
    players = Players(2, store_type)
    assert players.reply(0, players.row_init(0, "emb", SHAPE, RANGE)) == OK
    return players


def ones(count: int, value: float = 1.0) -> np.ndarray:
    return np.full((count, SHAPE[1]), value, np.float32)


def test_a_round_sums_every_workers_rows_and_a_pull_waits_for_it():
    players = started()
    players.row_push(0, "emb", [500, 700], ones(2), tag=1)
    pull = players.row_pull(0, "emb", [500, 600, 700, 999])
    assert players.waiting(0, pull)  # the round still waits for worker 1
    players.row_push(1, "emb", [700, 999], ones(2, 2.0), tag=1)
    rows = players.reply(0, pull)["emb"]
    np.testing.assert_array_equal(rows[:, 0], [1, 0, 3, 2])
    assert players.state.status()["row_sparse_keys"] == 1


@pytest.mark.parametrize("region_min_bytes", [None, 64, 10**6])
def test_a_pull_is_gathered_into_a_shared_region_when_one_is_given(region_min_bytes):
    players = started()
    players.region_min_bytes = region_min_bytes
    players.row_push(0, "emb", [500, 700], ones(2), tag=1)
    players.row_push(1, "emb", [700, 999], ones(2, 2.0), tag=1)
    big = players.row_pull(0, "emb", [500, 600, 700, 995, 996, 997, 998, 999])  # 64 bytes
    small = players.row_pull(1, "emb", [700])
    expected = [1, 0, 3, 0, 0, 0, 0, 2]
    np.testing.assert_array_equal(players.reply(0, big)["emb"][:, 0], expected)
    np.testing.assert_array_equal(players.reply(1, small)["emb"], ones(1, 3.0))
    if region_min_bytes == 64:  # only the answer of 64 bytes: gathered into its region
        assert [array.shape for array in players.placed] == [(8, 2)]
        assert np.shares_memory(players.placed[0], np.asarray(players.regions[0]))
        np.testing.assert_array_equal(players.placed[0][:, 0], expected)
    else:
        assert players.placed == [] and players.regions == []


def test_a_resent_push_is_answered_and_not_counted_again():
    players = started()
    seq = players.row_push(0, "emb", [500], ones(1), tag=1)
    players.row_push(0, "emb", [500], ones(1), tag=1, seq=seq)  # resent after a cut
    assert players.reply(0, seq) == OK
    assert players.state.duplicates == 1
    assert players.state.status()["duplicate_pushes"] == 1
    players.row_push(1, "emb", [500], ones(1), tag=1)
    entry = players.state.rows.entries["emb"]
    assert entry.rounds.closed_round == 1
    np.testing.assert_array_equal(entry.rows.gather([500]), ones(1, 2.0))


def test_a_second_push_in_one_round_is_refused_and_changes_nothing():
    players = started()
    players.row_push(0, "emb", [500], ones(1), tag=1)
    seq = players.row_push(0, "emb", [501], ones(1), tag=2)
    assert isinstance(players.reply(0, seq), DoublePushError)
    assert players.state.rows.entries["emb"].pending[0][0].tolist() == [500]


def test_sync_row_pushes_are_read_in_place_and_given_back_once_their_round_landed():
    players = started()
    players.lend = True
    players.hold_updates = True
    first = players.row_push(0, "emb", [500, 700], ones(2), tag=1)
    # Answered once counted; its rows wait for the round where they lie, in worker 0's
    # memory (not copied), and that memory stays the server's.
    assert players.reply(0, first) == OK and players.given_back == []
    ids, rows, lent = players.state.rows.entries["emb"].pending[0]
    assert lent is not None and not ids.flags.writeable and not rows.flags.writeable
    second = players.row_push(1, "emb", [700, 999], ones(2, 2.0), tag=1)
    assert players.reply(1, second) == OK
    assert players.given_back == []  # closed, not landed yet: both are still read
    players.finish_updates()
    assert sorted(players.given_back) == [(0, first), (1, second)]
    entry = players.state.rows.entries["emb"]
    np.testing.assert_array_equal(entry.rows.gather([500, 700, 999])[:, 0], [1, 3, 2])
    assert entry.rows.rows.flags.writeable and not np.shares_memory(entry.rows.rows, rows)


def test_a_frame_of_row_pushes_read_in_place_is_given_back_once_each_key_landed():
    players = started()
    assert players.reply(0, players.row_init(0, "other", SHAPE, RANGE)) == OK
    players.lend = True
    ids, rows = np.array([500], np.int64), ones(1)
    both = players.send(
        0,
        Op.ROW_PUSH,
        [("emb", ids), ("emb", rows), ("other", ids), ("other", rows)],
        tags=[1, 1, 1, 1],
    )
    players.row_push(1, "emb", [500], ones(1), tag=1)
    assert (0, both) not in players.given_back  # "other"'s round still reads it
    players.row_push(1, "other", [500], ones(1), tag=1)
    assert (0, both) in players.given_back
    assert len(players.given_back) == 3


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_a_resent_or_refused_row_push_read_in_place_is_given_back_at_once(store_type):
    players = started(store_type)
    players.lend = True
    first = players.row_push(0, "emb", [500], ones(1), tag=1)
    players.given_back.clear()
    players.row_push(0, "emb", [500], ones(1), tag=1, seq=first)  # resent: counted before
    assert players.given_back == [(0, first)]
    refused = players.row_push(0, "emb", [1000], ones(1), tag=2)  # outside the range
    assert isinstance(players.reply(0, refused), RowIdError)
    assert players.given_back == [(0, first), (0, refused)]


def test_async_row_pushes_read_in_place_are_given_back_once_applied():
    players = started("dist_async")
    players.lend = True
    players.hold_updates = True
    seq = players.row_push(0, "emb", [500], ones(1, 3.0), tag=1)
    assert players.given_back == [] and players.waiting(0, seq)  # answered once applied
    players.finish_updates()
    assert players.given_back == [(0, seq)] and players.reply(0, seq) == OK
    entry = players.state.rows.entries["emb"]
    np.testing.assert_array_equal(entry.rows.gather([500]), ones(1, 3.0))


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([499], RowIdError, r"row id 499 is outside the rows \[500, 1000\) that server 0"),
        ([1000], RowIdError, "row id 1000"),
    ],
)
def test_rows_outside_the_servers_range_are_refused(ids, error, message):
    players = started()
    seq = players.row_push(0, "emb", ids, ones(1), tag=1)
    assert isinstance(players.reply(0, seq), error)
    assert re.search(message, str(players.reply(0, seq)))
    pull = players.row_pull(0, "emb", ids)
    assert isinstance(players.reply(0, pull), RowIdError)
    assert players.state.rows.entries["emb"].rounds.open_seqs() == {}


def test_a_row_request_for_a_dense_key_and_malformed_frames_are_refused():
    players = started()
    players.init(0, {"w": np.zeros(3, np.float32)})
    seq = players.row_pull(0, "w", [1])
    assert isinstance(players.reply(0, seq), StorageTypeError)
    ids = np.array([500], np.int64)
    lone = players.send(0, Op.ROW_PUSH, [("emb", ids)], tags=[1])
    assert isinstance(players.reply(0, lone), InvalidArgumentError)
    wide = players.send(
        0, Op.ROW_PUSH, [("emb", ids), ("emb", np.ones((1, 3), np.float32))], tags=[1, 1]
    )
    assert "expected (1, 2)" in str(players.reply(0, wide))


def test_a_dense_init_of_a_row_sparse_key_is_refused_and_the_key_keeps_training():
    """A dense INIT naming a row-sparse key was taken: the server held both, and every
    later row push failed with a StateFormatError about states never loaded."""
    players = started()
    seq = players.init(0, {"emb": np.zeros(4, np.float32)})
    refused = players.reply(0, seq)
    assert isinstance(refused, DuplicateInitError), refused
    assert "already holds it as a row-sparse key" in str(refused)
    assert "emb" not in players.state.entries
    for worker in (0, 1):
        players.row_push(worker, "emb", [600], ones(1), tag=1)
    pull = players.row_pull(0, "emb", [600])
    np.testing.assert_array_equal(players.reply(0, pull)["emb"], ones(1, 2.0))  # no optimizer


def test_dist_async_applies_each_push_before_answering_it():
    players = started("dist_async")
    players.hold_updates = True
    seq = players.row_push(0, "emb", [600], ones(1), tag=1)
    assert players.waiting(0, seq)
    players.finish_updates()
    assert players.reply(0, seq) == OK
    rows = players.reply(1, players.row_pull(1, "emb", [600]))["emb"]
    np.testing.assert_array_equal(rows, ones(1))


def test_parked_pulls_fail_when_their_round_times_out_or_the_job_fails():
    players = started()
    players.row_push(0, "emb", [500], ones(1), tag=1)
    late = players.row_pull(0, "emb", [500])
    players.tick(100.0, round_timeout_s=10.0)
    assert isinstance(players.reply(0, late), RoundTimeoutError)
    again = players.row_pull(0, "emb", [500])
    players.run(players.state.job_failed("worker 1 died"))
    assert isinstance(players.reply(0, again), PeerLostError)


def test_small_row_rounds_and_answers_run_on_the_loop_and_large_ones_on_a_thread(monkeypatch):
    players = started()
    players.hold_updates = True
    players.row_push(0, "emb", [500, 700], ones(2), tag=1)
    players.row_push(1, "emb", [700], ones(1), tag=1)
    (land,) = players.held
    entry = players.state.rows.entries["emb"]
    pull = SendRows(RowPullTicket(players.peers[0], 1, [(entry, np.arange(500, 504))]))
    assert land.inline and pull.inline  # 24 and 32 bytes
    monkeypatch.setattr(instructions, "INLINE_MAX_BYTES", 24)
    assert land.inline and not pull.inline
    monkeypatch.setattr(instructions, "INLINE_MAX_BYTES", 23)
    assert not land.inline


def test_a_failed_row_update_is_told_to_each_worker_by_its_next_row_pull():
    """A dist_sync row push is answered once counted; its round's update then raises (AdaGrad
    refuses weight decay for rows): each worker's next row pull of the key gets the error,
    once, and the rows stay as they were."""
    players = started()
    players.row_push(0, "emb", [500], ones(1), tag=1)
    players.row_push(1, "emb", [500], ones(1), tag=1)  # the round: rows [500] = 2
    text = json.dumps(optimizer.AdaGrad(learning_rate=0.1, wd=0.1).get_config())
    for worker in range(2):
        assert players.reply(worker, players.send(worker, Op.SET_OPTIMIZER, text=text)) == OK
    for worker in range(2):
        assert (
            players.reply(worker, players.row_push(worker, "emb", [500, 600], ones(2), tag=2)) == OK
        )
    for worker in range(2):
        failed = players.reply(worker, players.row_pull(worker, "emb", [500]))
        assert isinstance(failed, ServerError), failed
        assert "key 'emb' in round 2 failed on server 0: OptimizerError" in str(failed)
    for worker in range(2):  # told once; nothing of round 2 landed
        rows = players.reply(worker, players.row_pull(worker, "emb", [500, 600]))["emb"]
        np.testing.assert_array_equal(rows[:, 0], [2, 0])
    assert players.unexpected == []


def test_a_row_init_that_declares_a_restored_key_otherwise_names_both():
    players = Players(2)
    ids, rows = np.array([600], np.int64), ones(1, 5.0)
    record = RowRecord("emb", SHAPE, *RANGE, ids, rows, 0, {}, {})
    players.state.rows.restore([record], sync=True)
    seq = players.row_init(0, "emb", (10**8, 2), (50_000_000, 100_000_000))
    refused = players.reply(0, seq)
    assert isinstance(refused, ShapeMismatchError), refused
    assert (
        "restored it from its checkpoint as (1000000000, 2) float32 rows 500-1000, and this "
        "job declares (100000000, 2) float32 rows 50000000-100000000" in str(refused)
    )
    assert players.reply(0, players.row_init(0, "emb", SHAPE, RANGE)) == OK  # resumes
    pull = players.row_pull(0, "emb", [600])
    np.testing.assert_array_equal(players.reply(0, pull)["emb"], rows)
