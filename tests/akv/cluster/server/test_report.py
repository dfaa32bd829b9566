"""What a server's heartbeats report (``heartbeat_report``), from a state played without
sockets."""

from __future__ import annotations

import numpy as np

from akv.cluster.scheduler.status import ServerReport, parse_report
from akv.cluster.server.report import KEY_TEXT_CHARS, heartbeat_report, unclosed_rounds
from tests.akv.cluster.server.players import OK, Players


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def test_an_idle_server_reports_its_keys_and_bytes_and_no_wait():
    players = Players(2)
    assert players.reply(0, players.init(0, {"w": f32(0, 0), "v": np.zeros(10, np.float64)})) == OK
    assert heartbeat_report(players.state, now=5.0) == {
        "keys": 2,
        "bytes": 2 * 4 + 10 * 8,
        "rounds": 0,
        "waiting": None,
    }


def test_an_open_round_names_the_workers_it_waits_for_and_since_when():
    players = Players(3)
    assert players.reply(0, players.init(0, {"a": f32(0), "b": f32(0)})) == OK
    players.now = 10.0
    players.push(0, {"a": f32(1)})
    players.now = 12.0
    players.push(1, {"b": f32(1)})
    players.push(2, {"b": f32(1)})
    report = heartbeat_report(players.state, now=13.5)
    assert report["waiting"] == {
        "key": "'a'",  # the oldest open round
        "round": 1,
        "waiting_s": 3.5,
        "open": 2,
        "workers": [0, 1, 2],  # a waits for 1 and 2, b for 0
    }
    players.push(1, {"a": f32(1)})
    players.push(2, {"a": f32(1)})
    players.push(0, {"b": f32(1)})
    report = heartbeat_report(players.state, now=14.0)
    assert report["rounds"] == 1 and report["waiting"] is None


def test_row_sparse_keys_count_their_stored_rows_and_rounds():
    players = Players(2)
    assert players.reply(0, players.row_init(0, "emb", (1000, 2), (0, 1000))) == OK
    players.row_push(0, "emb", [5, 7], np.ones((2, 2), np.float32), tag=1)
    report = heartbeat_report(players.state, now=1.0)
    assert report["keys"] == 1
    assert report["waiting"]["workers"] == [1]
    players.row_push(1, "emb", [7], np.ones((1, 2), np.float32), tag=1)
    report = heartbeat_report(players.state, now=2.0)
    assert report["rounds"] == 1 and report["waiting"] is None
    assert report["bytes"] == players.state.rows.entries["emb"].rows.nbytes > 0


def test_a_long_key_is_cut_and_the_scheduler_takes_the_report():
    players = Players(2)
    key = "k" * 500
    assert players.reply(0, players.init(0, {key: f32(0)})) == OK
    players.push(1, {key: f32(1)})
    report = heartbeat_report(players.state, now=1.0)
    assert len(report["waiting"]["key"]) == KEY_TEXT_CHARS
    parsed = parse_report("server", report, num_workers=2)
    assert isinstance(parsed, ServerReport) and parsed.waiting is not None
    assert parsed.waiting.workers == (0,)


def test_the_rounds_never_closed_are_named_dense_and_row_sparse_the_first_few_only():
    players = Players(3)
    assert players.reply(0, players.init(0, {f"k{i}": f32(0) for i in range(7)})) == OK
    assert players.reply(0, players.row_init(0, "emb", (10, 2), (0, 10))) == OK
    assert unclosed_rounds(players.state) is None
    players.push(0, {"k0": f32(1)})
    players.push(2, {"k0": f32(1)})
    players.row_push(1, "emb", [5], np.ones((1, 2), np.float32), tag=1)
    assert unclosed_rounds(players.state) == (
        "the job ended with 2 dist_sync round(s) never closed, whose pushes are not applied "
        "(a round is applied once every worker pushed it): round 1 of key 'k0' (pushed by "
        "workers [0, 2], not by [1]); round 1 of key 'emb' (pushed by workers [1], not by "
        "[0, 2])"
    )
    for i in range(1, 7):
        players.push(0, {f"k{i}": f32(1)})
    said = unclosed_rounds(players.state, listed=5)
    assert said is not None and said.endswith("; and 3 more")
    assert said.startswith("the job ended with 8 dist_sync round(s)") and said.count("round 1") == 5
