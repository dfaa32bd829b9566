"""Optimizer states of a distributed store: split over servers and merged back."""

from __future__ import annotations

import tempfile
import tracemalloc

import numpy as np
import pytest

from akv.cluster.states import merge_server_states, split_server_states
from akv.errors import StateFormatError
from akv.optimizer import RowStates, decode_states, encode_states

#: key "big" (shape (2, 3)) split over 2 servers; key 7 whole on server 1.
LAYOUT = {"big": ((2, 3), [(0, 0, 3), (1, 3, 6)]), "small": ((2,), [(1, 0, 2)])}


def saved_file() -> bytes:
    momentum = np.arange(6, dtype=np.float32).reshape(2, 3)
    states = {"big": (momentum, np.array(0.5, np.float32)), "small": np.ones(2, np.float32)}
    return encode_states(
        states,
        index_update_counts={"big": 4, "small": 2},
        num_update=4,
        optimizer_config={"name": "sgd", "learning_rate": 0.1},
    )


def test_a_file_split_over_servers_merges_back_to_the_same_states():
    shares = split_server_states(saved_file(), 2, LAYOUT)
    server0, server1 = (decode_states(share) for share in shares)
    np.testing.assert_array_equal(server0.states["big"][0], np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(server1.states["big"][0], np.arange(3, 6, dtype=np.float32))
    assert "small" not in server0.states and server1.index_update_counts["small"] == 2

    merged = decode_states(merge_server_states(shares, LAYOUT))
    original = decode_states(saved_file())
    np.testing.assert_array_equal(merged.states["big"][0], original.states["big"][0])
    assert merged.states["big"][0].shape == (2, 3)
    assert float(merged.states["big"][1]) == 0.5  # a scalar state is shared, not cut
    np.testing.assert_array_equal(merged.states["small"], original.states["small"])
    assert merged.index_update_counts == {"big": 4, "small": 2} and merged.num_update == 4
    assert merged.optimizer_config == {"name": "sgd", "learning_rate": 0.1}


def test_keys_never_updated_have_no_state_after_a_merge():
    empty = [encode_states({}), encode_states({})]
    assert decode_states(merge_server_states(empty, LAYOUT)).states == {}


def test_a_file_with_a_key_the_store_lacks_is_refused_naming_it():
    with pytest.raises(StateFormatError, match="'small'"):
        split_server_states(saved_file(), 2, {"big": LAYOUT["big"]})


def test_a_file_that_is_not_akvs_format_is_refused():
    with pytest.raises(StateFormatError):
        split_server_states(b"not a states file", 2, LAYOUT)


ROW_LAYOUT = {"emb": ((1000, 16), [(0, 0, 500), (1, 500, 1000)])}


def row_file(rows: int = 1000, width: int = 16) -> bytes:
    """Adam-like row states (two leaves) of rows every other id of a (rows, width) key."""
    ids = np.arange(0, rows, 2)
    leaves = tuple(
        (np.full((ids.size, width), v) + ids[:, None]).astype(np.float32) for v in (0.5, 2)
    )
    return encode_states(
        {"emb": RowStates((rows, width), ids, leaves)}, index_update_counts={"emb": 3}
    )


def test_row_states_split_over_servers_merge_back_to_the_same_bytes(tmp_path):
    """Each server's rows, merged (from bytes or from the frames' memory), give the file
    back byte for byte, returned or written to a file."""
    shares = split_server_states(row_file(), 2, ROW_LAYOUT)
    assert [decode_states(s).states["emb"].ids.size for s in shares] == [250, 250]
    assert merge_server_states(shares, ROW_LAYOUT) == row_file()
    views = [memoryview(bytearray(share)) for share in shares]
    with open(tmp_path / "merged", "w+b") as file:
        assert merge_server_states(views, ROW_LAYOUT, file) == b""
    assert (tmp_path / "merged").read_bytes() == row_file()


def test_a_merge_joins_row_states_as_it_writes_them():
    """The servers' row states are neither copied out of their frames nor joined into
    arrays of their own, nor encoded into memory: beyond the decoded parts (what the
    frames hold), a merge holds little (tracemalloc)."""
    rows, width = 400_000, 16  # two leaves of 12 MiB each on each server
    shares = [
        memoryview(bytearray(share))
        for share in split_server_states(
            row_file(rows, width),
            2,
            {"emb": ((rows, width), [(0, 0, rows // 2), (1, rows // 2, rows)])},
        )
    ]
    layout = {"emb": ((rows, width), [(0, 0, rows // 2), (1, rows // 2, rows)])}
    leaves_bytes = 2 * (rows // 2) * width * 4  # both leaves, every row stored
    tracemalloc.start()
    try:
        with tempfile.TemporaryFile() as file:
            merge_server_states(shares, layout, file)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * leaves_bytes, (peak, leaves_bytes)
