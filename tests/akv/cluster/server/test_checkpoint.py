"""A server's checkpoint: what is written comes back, atomically, and nothing else does."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from akv.cluster.server import checkpoint
from akv.cluster.server.checkpoint import (
    MAGIC,
    KeyRecord,
    RowRecord,
    Snapshot,
    checkpoint_path,
    read_snapshot,
    remove_leftovers,
    write_snapshot,
)
from akv.errors import AKVError, CheckpointError
from akv.rows import RowTable
from akv_transport import DTYPE_CODES

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def snapshot(rank: int = 1, **changes: Any) -> Snapshot:
    """A small snapshot with every field set; ``changes`` replace fields."""
    fields: dict[str, Any] = {
        "rank": rank,
        "num_workers": 3,
        "store_type": "dist_sync",
        "generation": 7,
        "keys": [
            KeyRecord(3, np.arange(6, dtype=np.float32).reshape(2, 3), 4, {0: 4, 2: 5}, {0: 4}),
            KeyRecord(-1, np.array(2.5), 0, {}, {}),
            KeyRecord(I64_MAX, np.array([True, False]), 1, {1: 1}, {1: 1}),
        ],
        "optimizer_config": {"name": "sgd", "learning_rate": 0.1, "momentum": [0.9, None]},
        "optimizer_states": b"\x00opaque\xff",
        "durable_seqs": {0: 12, 1: 0, 2: 9},
    }
    fields.update(changes)
    return Snapshot(**fields)


def assert_same(got: Snapshot | None, expected: Snapshot) -> None:
    assert got is not None
    assert (
        got.rank,
        got.num_workers,
        got.store_type,
        got.generation,
        got.optimizer_config,
        got.optimizer_states,
        got.durable_seqs,
        got.sessions,
        got.num_servers,
    ) == (
        expected.rank,
        expected.num_workers,
        expected.store_type,
        expected.generation,
        expected.optimizer_config,
        expected.optimizer_states,
        expected.durable_seqs,
        expected.sessions,
        expected.num_servers,
    )
    assert [record.key for record in got.keys] == [record.key for record in expected.keys]
    for record, want in zip(got.keys, expected.keys, strict=True):
        assert type(record.key) is type(want.key)
        assert (record.closed_round, record.tags, record.last_round, record.declared) == (
            want.closed_round,
            want.tags,
            want.last_round,
            want.declared,
        )
        assert record.value.dtype == want.value.dtype
        assert record.value.shape == want.value.shape
        assert record.value.tobytes() == want.value.tobytes()
        assert all(type(rank) is int for rank in (*record.tags, *record.last_round))
    assert all(type(rank) is int for rank in got.durable_seqs)


def temporary_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("."))


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and the payload of a checkpoint file, as the format documents them."""
    assert data[:8] == MAGIC
    (header_nbytes,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16 : 16 + header_nbytes])
    return header, data[16 + header_nbytes : -4]


def forge(path: Path, header: object, payload: bytes) -> None:
    """Write a file with a valid checksum around ``header`` and ``payload``."""
    text = json.dumps(header).encode()
    body = MAGIC + struct.pack("<Q", len(text)) + text + payload
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))


# --- round trips ---------------------------------------------------------------------------

ALL_DTYPES = [
    KeyRecord(index, np.arange(5).astype(dtype).reshape(5, 1), index, {}, {})
    for index, dtype in enumerate(DTYPE_CODES)
]


@pytest.mark.parametrize(
    "written",
    [
        pytest.param(snapshot(), id="every-field"),
        pytest.param(snapshot(keys=ALL_DTYPES), id="every-dtype"),
        pytest.param(
            snapshot(
                keys=[
                    KeyRecord("weight", np.zeros((0, 3), np.float64), 0, {}, {}),
                    KeyRecord("", np.zeros(0, np.uint8), 0, {}, {}),
                    KeyRecord("bias \u00e9\ud800", np.array(7, np.int8), 2, {0: 1}, {0: 2}),
                    KeyRecord("0", np.ones((2, 1, 3), np.complex128), 1, {}, {}),
                ]
            ),
            id="str-keys-0d-and-empty",
        ),
        pytest.param(
            snapshot(
                keys=[
                    KeyRecord(I64_MIN, np.array([1.5], np.float16), 0, {}, {}),
                    KeyRecord(0, np.array(3, np.uint64), 0, {}, {}),
                    KeyRecord(1 << 40, np.array([[1, 2]], np.int16), 0, {}, {}),
                ]
            ),
            id="int-keys-negative-and-64-bit",
        ),
        pytest.param(snapshot(optimizer_config=None, optimizer_states=None), id="no-optimizer"),
        pytest.param(snapshot(sessions={0: "a" * 32, 2: ""}), id="worker-sessions"),
        pytest.param(snapshot(num_servers=3), id="num-servers"),
        pytest.param(snapshot(optimizer_config={}, optimizer_states=b""), id="empty-optimizer"),
        pytest.param(
            snapshot(keys=[], durable_seqs={}, store_type="", generation=0), id="empty-store"
        ),
    ],
)
def test_a_snapshot_comes_back_as_written(tmp_path, written):
    path = write_snapshot(tmp_path, written)
    assert path == checkpoint_path(tmp_path, written.rank) == tmp_path / "server-1.akvckpt"
    assert_same(read_snapshot(tmp_path, written.rank), written)


def test_the_arrays_read_back_are_writable_contiguous_and_own_their_memory(tmp_path):
    write_snapshot(tmp_path, snapshot())
    read = read_snapshot(tmp_path, 1)
    assert read is not None
    for record in read.keys:
        flags = record.value.flags
        assert flags.writeable and flags.c_contiguous and flags.owndata, record.key
        record.value[...] = 0


def test_int_and_str_keys_keep_their_kind(tmp_path):
    written = snapshot(
        keys=[
            KeyRecord(7, np.zeros(1, np.float32), 0, {}, {}),
            KeyRecord("7", np.ones(1, np.float32), 0, {}, {}),
        ]
    )
    write_snapshot(tmp_path, written)
    read = read_snapshot(tmp_path, 1)
    assert read is not None
    assert [(type(record.key), record.value[0]) for record in read.keys] == [(int, 0), (str, 1)]


def test_a_split_keys_declared_shape_comes_back_and_a_key_without_one_has_none(tmp_path):
    """A server's part of a key split over the servers keeps the shape the key was declared
    with (a new job's init is checked against it); files without the field read None."""
    part = KeyRecord("split", np.zeros(1024, np.float32), 2, {0: 2}, {0: 2}, declared=(32, 64))
    written = snapshot(keys=[part, KeyRecord("w", np.ones(3, np.float32), 0, {}, {})])
    path = write_snapshot(tmp_path, written)
    header, _ = split(path.read_bytes())
    assert header["keys"][0]["declared"] == [32, 64] and "declared" not in header["keys"][1]
    got = read_snapshot(tmp_path, 1)
    assert_same(got, written)
    assert [record.declared for record in got.keys] == [(32, 64), None]


def test_a_declared_shape_of_more_dimensions_than_kept_is_left_out(tmp_path):
    """NumPy allows 64 dimensions, a header keeps 32: such a split key's checkpoint is
    written all the same, without its declared shape (its restore compares the dtype)."""
    deep = (1,) * 33 + (2048,)
    part = KeyRecord("deep", np.zeros(1024, np.float32), 1, {0: 1}, {0: 1}, declared=deep)
    write_snapshot(tmp_path, snapshot(keys=[part]))
    got = read_snapshot(tmp_path, 1)
    assert got is not None and got.keys[0].declared is None


def test_round_bases_come_back_and_an_older_file_has_none(tmp_path):
    write_snapshot(tmp_path, snapshot(round_bases={"split": 4, 7: 0}))
    assert read_snapshot(tmp_path, 1).round_bases == {"split": 4, 7: 0}
    write_snapshot(tmp_path, snapshot())
    assert read_snapshot(tmp_path, 1).round_bases == {}


def test_a_later_write_replaces_the_earlier_one(tmp_path):
    write_snapshot(tmp_path, snapshot(generation=1))
    write_snapshot(tmp_path, snapshot(generation=2, keys=ALL_DTYPES))
    assert_same(read_snapshot(tmp_path, 1), snapshot(generation=2, keys=ALL_DTYPES))
    assert temporary_files(tmp_path) == []


def test_the_file_is_json_headed_with_a_crc32_trailer_as_documented(tmp_path):
    data = write_snapshot(tmp_path, snapshot()).read_bytes()
    header, payload = split(data)
    assert struct.unpack("<I", data[-4:])[0] == zlib.crc32(data[:-4])
    assert header["rank"] == 1 and header["durable_seqs"] == {"0": 12, "1": 0, "2": 9}
    first = header["keys"][0]
    assert (first["key"], first["kind"], first["dtype"], first["shape"]) == (
        3,
        "int",
        "<f4",
        [2, 3],
    )
    assert payload[first["offset"] : first["offset"] + first["nbytes"]] == (
        np.arange(6, dtype=np.float32).tobytes()
    )
    states = header["optimizer_states"]
    assert payload[states["offset"] :] == b"\x00opaque\xff"
    assert header["payload_nbytes"] == len(payload)


# --- files and directories -----------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_the_file_is_private_and_missing_directories_are_created_private(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_snapshot(tmp_path / "a" / "b" / "c", snapshot())
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_a_directory_in_the_way_of_a_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(CheckpointError, match="taken"):
        write_snapshot(tmp_path / "taken" / "ckpt", snapshot())


def test_the_file_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd: int) -> None:
        events.append("sync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "sync file")
        fsync(fd)

    def record_replace(source: Any, target: Any) -> None:
        events.append("replace")
        replace(source, target)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    write_snapshot(tmp_path, snapshot())
    assert events == ["sync file", "replace", "sync directory"]


def test_the_temporary_file_is_hidden_beside_the_checkpoint_and_unique(tmp_path, monkeypatch):
    sources: list[Path] = []
    replace = os.replace

    def record_replace(source: Any, target: Any) -> None:
        sources.append(Path(source))
        replace(source, target)

    monkeypatch.setattr(os, "replace", record_replace)
    write_snapshot(tmp_path, snapshot())
    write_snapshot(tmp_path, snapshot())
    first, second = sources
    assert first != second
    for source in sources:
        assert source.parent == tmp_path
        assert source.name.startswith(f".server-1.akvckpt.{os.getpid()}.")
        assert source.name.endswith(".tmp")


def test_a_directory_the_os_cannot_sync_is_skipped(tmp_path, monkeypatch):
    fsync = os.fsync

    def refuse_directories(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", refuse_directories)
    write_snapshot(tmp_path, snapshot())
    assert_same(read_snapshot(tmp_path, 1), snapshot())


def test_a_failed_directory_sync_says_the_checkpoint_is_in_place(tmp_path, monkeypatch):
    fsync = os.fsync

    def fail_directories(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fail_directories)
    with pytest.raises(CheckpointError, match=r"in place.*Input/output error"):
        write_snapshot(tmp_path, snapshot())


# --- crashes while writing -----------------------------------------------------------------


def fail_replace(monkeypatch):
    def boom(source: Any, target: Any) -> None:
        raise OSError(errno.EXDEV, "simulated crash in replace")

    monkeypatch.setattr(os, "replace", boom)


def fail_fsync(monkeypatch):
    def boom(fd: int) -> None:
        raise OSError(errno.EIO, "simulated crash in fsync")

    monkeypatch.setattr(os, "fsync", boom)


def fail_mid_write(monkeypatch):
    """The second piece written (the header) fails, as a full disk would."""
    calls = []
    crc32 = zlib.crc32

    def boom(data: Any, value: int = 0) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "simulated crash mid-write")
        return crc32(data, value)

    monkeypatch.setattr(checkpoint.zlib, "crc32", boom)


@pytest.mark.parametrize("failure", [fail_replace, fail_fsync, fail_mid_write])
def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(
    tmp_path, monkeypatch, failure
):
    write_snapshot(tmp_path, snapshot(generation=1))
    before = checkpoint_path(tmp_path, 1).read_bytes()
    with monkeypatch.context() as patch:
        failure(patch)
        with pytest.raises(CheckpointError, match=r"server-1\.akvckpt.*simulated crash") as info:
            write_snapshot(tmp_path, snapshot(generation=2, keys=ALL_DTYPES))
    assert isinstance(info.value.__cause__, OSError)
    assert temporary_files(tmp_path) == []
    assert checkpoint_path(tmp_path, 1).read_bytes() == before
    assert_same(read_snapshot(tmp_path, 1), snapshot(generation=1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ")
def test_a_file_size_limit_mid_payload_leaves_the_previous_checkpoint(tmp_path):
    """A full disk, as near as a test gets: the kernel refuses the write past 1 MiB."""
    import resource
    import signal

    write_snapshot(tmp_path, snapshot(generation=1))
    large = snapshot(generation=2, keys=[KeyRecord(0, np.ones(1 << 20, np.float64), 0, {}, {})])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointError, match=r"server-1\.akvckpt.*File too large") as info:
            write_snapshot(tmp_path, large)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert isinstance(info.value.__cause__, OSError)
    assert temporary_files(tmp_path) == []
    assert_same(read_snapshot(tmp_path, 1), snapshot(generation=1))


def test_an_interrupt_mid_write_removes_the_temporary_file_and_propagates(tmp_path, monkeypatch):
    def interrupt(source: Any, target: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(tmp_path, snapshot())
    assert temporary_files(tmp_path) == []


def test_leftover_temporary_files_of_a_rank_are_removed_and_reading_leaves_them(tmp_path):
    write_snapshot(tmp_path, snapshot())
    mine = [".server-1.akvckpt.123.abcd.tmp", ".server-1.akvckpt.9.ff.tmp"]
    others = [".server-12.akvckpt.123.abcd.tmp", ".server-2.akvckpt.1.a.tmp", "notes.tmp"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"half a checkpoint")
    assert_same(read_snapshot(tmp_path, 1), snapshot())  # a writer may be running: untouched
    assert len(list(tmp_path.iterdir())) == len(mine) + len(others) + 1
    remove_leftovers(tmp_path, 1)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*others, "server-1.akvckpt"])


def test_leftovers_are_removed_even_when_there_is_no_checkpoint(tmp_path):
    (tmp_path / ".server-4.akvckpt.1.a.tmp").write_bytes(b"x")
    remove_leftovers(tmp_path, 4)
    assert read_snapshot(tmp_path, 4) is None
    assert list(tmp_path.iterdir()) == []


# --- what the writer refuses ---------------------------------------------------------------


def one_key(value: Any = None, key: Any = 0, **fields: Any) -> list[KeyRecord]:
    record = KeyRecord(key, np.zeros(2, np.float32) if value is None else value, 0, {}, {})
    for name, field in fields.items():
        setattr(record, name, field)
    return [record]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"keys": one_key(np.zeros(2, ">f4"))}, "dtype >f4 is not one of"),
        ({"keys": one_key(np.array(["a"]))}, "dtype <U1"),
        ({"keys": one_key(np.array([None]))}, "dtype |O"),
        ({"keys": one_key(np.zeros((4, 4), np.float32)[:, ::2])}, "C-contiguous"),
        ({"keys": one_key([1.0, 2.0])}, "NumPy array, not list"),
        ({"keys": one_key(key=True)}, "an int or a str, not bool"),
        ({"keys": one_key(key=1 << 63)}, "int64"),
        ({"keys": one_key(key=1.5)}, "not float"),
        ({"keys": one_key() + one_key()}, "key 0 appears twice"),
        ({"keys": one_key(closed_round=-1)}, "closed_round is -1"),
        ({"keys": one_key(tags={"0": 1})}, "tags: worker rank '0'"),
        ({"keys": one_key(last_round={0: 1.0})}, r"last_round\[0\] must be an int"),
        ({"rank": -1}, "rank is -1"),
        ({"generation": None}, "generation must be an int"),
        ({"store_type": b"dist_sync"}, "store_type must be a str"),
        ({"durable_seqs": {True: 1}}, "worker rank True"),
        ({"optimizer_config": {"betas": (0.9, 0.99)}}, "unchanged"),
        ({"optimizer_config": {1: "lr"}}, "unchanged"),
        ({"optimizer_config": {"lr": float("nan")}}, "not JSON"),
        ({"optimizer_config": {"lr": {1, 2}}}, "not JSON"),
        ({"optimizer_config": ["sgd"]}, "dict or None"),
        ({"optimizer_states": bytearray(b"x")}, "bytes, spilled or None, not bytearray"),
    ],
)
def test_the_writer_refuses_what_it_could_not_give_back_and_touches_nothing(
    tmp_path, changes, message
):
    write_snapshot(tmp_path, snapshot(generation=1))
    before = checkpoint_path(tmp_path, 1).read_bytes()
    with pytest.raises(CheckpointError, match=message):
        write_snapshot(tmp_path, snapshot(**changes))
    assert checkpoint_path(tmp_path, 1).read_bytes() == before
    assert temporary_files(tmp_path) == []


def test_the_writer_refuses_a_config_nested_deeper_than_json_allows(tmp_path):
    config: dict[str, Any] = {}
    for _ in range(40):
        config = {"inner": config}
    with pytest.raises(CheckpointError, match="not JSON"):
        write_snapshot(tmp_path, snapshot(optimizer_config=config))
    assert not checkpoint_path(tmp_path, 1).exists()


# --- what the reader refuses ---------------------------------------------------------------


def test_no_checkpoint_reads_as_none(tmp_path):
    assert read_snapshot(tmp_path, 0) is None
    assert read_snapshot(tmp_path / "never" / "created", 0) is None
    write_snapshot(tmp_path, snapshot(rank=1))
    assert read_snapshot(tmp_path, 0) is None


def test_a_checkpoint_of_another_rank_is_refused(tmp_path):
    write_snapshot(tmp_path, snapshot(rank=1))
    os.rename(checkpoint_path(tmp_path, 1), checkpoint_path(tmp_path, 2))
    with pytest.raises(CheckpointError, match=r"server-2\.akvckpt.*server 1's keys, not server 2"):
        read_snapshot(tmp_path, 2)


def test_a_checkpoint_that_cannot_be_opened_is_a_checkpoint_error(tmp_path):
    checkpoint_path(tmp_path, 0).mkdir()
    with pytest.raises(CheckpointError, match=r"server-0\.akvckpt"):
        read_snapshot(tmp_path, 0)


@pytest.fixture
def small_file(tmp_path) -> bytes:
    written = snapshot(
        keys=[
            KeyRecord(3, np.arange(6, dtype=np.float32).reshape(2, 3), 4, {0: 4}, {0: 4}),
            KeyRecord("b", np.array([True, False, True]), 1, {1: 1}, {1: 1}),
        ]
    )
    return write_snapshot(tmp_path, written).read_bytes()


def test_a_file_cut_short_anywhere_is_a_checkpoint_error(tmp_path, small_file):
    path = checkpoint_path(tmp_path, 1)
    for length in range(len(small_file)):
        path.write_bytes(small_file[:length])
        with pytest.raises(CheckpointError, match=r"server-1\.akvckpt"):
            read_snapshot(tmp_path, 1)


def test_a_bigger_file_cut_at_every_seventh_byte_is_a_checkpoint_error(tmp_path):
    data = write_snapshot(tmp_path, snapshot(keys=ALL_DTYPES)).read_bytes()
    path = checkpoint_path(tmp_path, 1)
    for length in range(0, len(data), 7):
        path.write_bytes(data[:length])
        with pytest.raises(CheckpointError):
            read_snapshot(tmp_path, 1)


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_any_changed_byte_is_a_checkpoint_error(tmp_path, small_file, mask):
    path = checkpoint_path(tmp_path, 1)
    for index in range(len(small_file)):
        corrupt = bytearray(small_file)
        corrupt[index] ^= mask
        path.write_bytes(corrupt)
        with pytest.raises(CheckpointError, match=r"server-1\.akvckpt"):
            read_snapshot(tmp_path, 1)


def test_the_checksum_is_checked(tmp_path, small_file):
    path = checkpoint_path(tmp_path, 1)
    _, payload = split(small_file)
    corrupt = bytearray(small_file)
    corrupt[len(small_file) - 4 - len(payload)] ^= 0x01  # the first payload byte
    path.write_bytes(corrupt)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_snapshot(tmp_path, 1)


def changed(header: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``header`` with the field at ``path`` (dotted; list indexes as digits) set."""
    copy = json.loads(json.dumps(header))
    *parents, last = path.split(".")
    target: Any = copy
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    index: Any = int(last) if isinstance(target, list) else last
    if value is DELETE:
        del target[index]
    else:
        target[index] = value
    return copy


DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("keys.0.dtype", "|O", r"dtype '\|O' is not one of"),
        ("keys.0.dtype", ">f4", "dtype '>f4'"),
        ("keys.0.dtype", 0, "dtype 0"),
        ("keys.0.shape", [3], r"nbytes 24 does not fit shape \[3\]"),
        ("keys.0.shape", [-2, -3], "shape is -2"),
        ("keys.0.shape", [True, 6], "shape must be an int"),
        ("keys.0.shape", [1] * 33, "at most 32"),
        ("keys.0.shape", "2x3", "not a list"),
        ("keys.0.offset", 4, "offset 4, expected 0"),
        ("keys.0.nbytes", 1 << 40, "outside the payload"),
        ("keys.1.offset", 25, "offset 25, expected 24"),
        ("keys.0.kind", "float", "kind 'float'"),
        ("keys.0.key", "3", "must be an int, not str"),
        ("keys.1.key", 5, "key 5 of kind 'str'"),
        ("keys.1.key", 3, "key 3 of kind 'str'"),
        ("keys.0.key", 1 << 63, "outside"),
        ("keys.1.kind", "int", "must be an int, not str"),
        ("keys.0.tags", {"01": 1}, "'01' is not a worker rank"),
        ("keys.0.tags", {"-1": 1}, "'-1' is not a worker rank"),
        ("keys.0.tags", {"1" * 30: 1}, "is not a worker rank"),
        ("keys.0.tags", {"0": -1}, r"tags\[0\] is -1"),
        ("keys.0.last_round", {"0": 1.5}, "must be an int, not float"),
        ("keys.0.last_round", [], "not an object"),
        ("keys.0.closed_round", None, "closed_round must be an int"),
        ("keys.0.extra", 1, r"unknown \['extra'\]"),
        ("keys.0.tags", DELETE, r"missing \['tags'\]"),
        ("keys.0", [], "keys.0. is a list, not an object"),
        ("keys", {}, "keys is a dict, not a list"),
        ("generation", DELETE, r"missing \['generation'\]"),
        ("generation", -1, "generation is -1"),
        ("num_workers", "3", "num_workers must be an int"),
        ("rank", 2, "server 2's keys, not server 1's"),
        ("rank", "1", "rank must be an int"),
        ("store_type", 5, "store_type 5 is not a string"),
        ("optimizer_config", ["sgd"], "not an object or null"),
        ("optimizer_states.offset", 0, "optimizer_states: offset 0, expected"),
        ("optimizer_states.nbytes", 2, "take .* bytes; the payload has"),
        ("optimizer_states", None, "take .* bytes; the payload has"),
        ("optimizer_states", 9, "optimizer_states is a int, not an object"),
        ("payload_nbytes", 10, "the header gives the payload 10 bytes"),
        ("durable_seqs", {"x": 1}, "'x' is not a worker rank"),
        ("sessions", {"0": 5}, r"sessions\[0\] is not a session id"),
        ("sessions", {"0": "s" * 129}, r"sessions\[0\] is not a session id"),
        ("sessions", {"01": "s"}, "sessions: '01' is not a worker rank"),
        ("sessions", ["s"], "sessions is a list, not an object"),
        ("num_servers", "2", "num_servers must be an int"),
        ("num_servers", -1, "num_servers is -1"),
        ("extra", None, r"the header: fields missing \[\], unknown \['extra'\]"),
    ],
)
def test_a_header_that_does_not_fit_is_refused_even_with_a_valid_checksum(
    tmp_path, small_file, path, value, message
):
    header, payload = split(small_file)
    forge(checkpoint_path(tmp_path, 1), changed(header, path, value), payload)
    with pytest.raises(CheckpointError, match=message):
        read_snapshot(tmp_path, 1)


def test_the_forged_file_helper_makes_a_readable_file(tmp_path, small_file):
    """The forged cases above fail for their change, not for the forging."""
    header, payload = split(small_file)
    forge(checkpoint_path(tmp_path, 1), header, payload)
    assert read_snapshot(tmp_path, 1) is not None


def test_a_repeated_key_is_refused(tmp_path, small_file):
    header, payload = split(small_file)
    header = changed(header, "keys.1.key", 3)
    header = changed(header, "keys.1.kind", "int")
    forge(checkpoint_path(tmp_path, 1), header, payload)
    with pytest.raises(CheckpointError, match="key 3 appears twice"):
        read_snapshot(tmp_path, 1)


def test_a_bool_array_holding_other_bytes_is_refused(tmp_path, small_file):
    header, payload = split(small_file)
    offset = header["keys"][1]["offset"]
    payload = payload[:offset] + b"\x02" + payload[offset + 1 :]
    forge(checkpoint_path(tmp_path, 1), header, payload)
    with pytest.raises(CheckpointError, match="bool array holds a byte other than 0 and 1"):
        read_snapshot(tmp_path, 1)


@pytest.mark.parametrize(
    ("header_bytes", "message"),
    [
        (b"{", "not valid JSON"),
        (b'{"rank": NaN}', "NaN"),
        (b"\xff\xfe", "UTF-8"),
        (b"[" * 40 + b"]" * 40, "nested"),
        (b"[]", "the header is a list, not an object"),
    ],
)
def test_a_header_that_is_not_strict_json_is_refused(tmp_path, header_bytes, message):
    body = MAGIC + struct.pack("<Q", len(header_bytes)) + header_bytes
    checkpoint_path(tmp_path, 1).write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    with pytest.raises(CheckpointError, match=message):
        read_snapshot(tmp_path, 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated: 0 bytes"),
        (b"AKVCKPT2" + bytes(12), "not an akv checkpoint"),
        (b"\x80\x04\x95" + bytes(40), "not an akv checkpoint"),  # a pickle
        (MAGIC + struct.pack("<Q", 1 << 62) + bytes(4), "the header alone claims"),
        (MAGIC + struct.pack("<Q", 0) + bytes(4), "not valid JSON"),
    ],
)
def test_a_file_that_is_not_a_checkpoint_is_refused(tmp_path, data, message):
    checkpoint_path(tmp_path, 1).write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        read_snapshot(tmp_path, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.integers(0, 600),
    replacement=st.binary(max_size=40),
    cut=st.integers(0, 40),
    tail=st.binary(max_size=20),
)
def test_random_damage_is_a_checkpoint_error_or_nothing_changed(
    tmp_path_factory, start, replacement, cut, tail
):
    directory = tmp_path_factory.mktemp("damage")
    original = write_snapshot(directory, snapshot()).read_bytes()
    start = min(start, len(original))
    damaged = original[:start] + replacement + original[start + cut :] + tail
    checkpoint_path(directory, 1).write_bytes(damaged)
    if damaged == original:
        assert_same(read_snapshot(directory, 1), snapshot())
    else:
        with pytest.raises(CheckpointError):
            read_snapshot(directory, 1)


RANK_MAPS = st.dictionaries(st.integers(0, 64), st.integers(0, (1 << 64) - 1), max_size=4)
RECORDS = st.builds(
    KeyRecord,
    key=st.one_of(st.integers(I64_MIN, I64_MAX), st.text(max_size=8)),
    value=st.sampled_from(list(DTYPE_CODES)).flatmap(
        lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
    ),
    closed_round=st.integers(0, 1 << 40),
    tags=RANK_MAPS,
    last_round=RANK_MAPS,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(RECORDS, max_size=5, unique_by=lambda record: (type(record.key), record.key)),
    states=st.one_of(st.none(), st.binary(max_size=64)),
    config=st.one_of(
        st.none(),
        st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-9, 9), st.text(max_size=5))),
    ),
    seqs=RANK_MAPS,
)
def test_any_snapshot_comes_back_as_written(tmp_path_factory, records, states, config, seqs):
    written = snapshot(
        rank=5, keys=records, optimizer_states=states, optimizer_config=config, durable_seqs=seqs
    )
    directory = tmp_path_factory.mktemp("any")
    write_snapshot(directory, written)
    assert_same(read_snapshot(directory, 5), written)


# --- memory --------------------------------------------------------------------------------


def test_large_arrays_are_neither_copied_to_write_nor_to_read(tmp_path):
    large = np.ones(8 << 20, np.float32)  # 32 MiB
    written = snapshot(keys=[KeyRecord(0, large, 1, {}, {})])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        write_snapshot(tmp_path, written)
        write_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        read = read_snapshot(tmp_path, 1)
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert write_peak < large.nbytes // 4
    assert read_peak < large.nbytes * 5 // 4  # the array it returns, and little more
    assert_same(read, written)


def test_checkpoint_error_is_an_akv_error_and_an_os_error():
    assert issubclass(CheckpointError, AKVError)
    assert issubclass(CheckpointError, OSError)


# --- row-sparse keys ----------------------------------------------------------------------


def row_record(key: Any = "emb", ids: Any = (2, 7), first: int = 0, end: int = 10) -> RowRecord:
    ids = np.asarray(ids, np.int64)
    rows = np.arange(len(ids) * 3, dtype=np.float32).reshape(len(ids), 3)
    return RowRecord(key, (10**9, 3), first, end, ids, rows, 5, {0: 5}, {0: 5})


def test_row_sparse_keys_come_back_as_written_after_the_dense_ones(tmp_path):
    written = snapshot(row_keys=[row_record(), row_record(11, ids=[], first=5, end=9)])
    write_snapshot(tmp_path, written)
    got = read_snapshot(tmp_path, 1)
    assert_same(got, written)
    assert got is not None
    for record, want in zip(got.row_keys, written.row_keys, strict=True):
        assert (record.key, record.shape, record.first, record.end) == (
            want.key,
            want.shape,
            want.first,
            want.end,
        )
        assert (record.closed_round, record.tags, record.last_round) == (5, {0: 5}, {0: 5})
        np.testing.assert_array_equal(record.ids, want.ids)
        np.testing.assert_array_equal(record.rows, want.rows)
        assert record.rows.dtype == want.rows.dtype and record.rows.shape == want.rows.shape
    header, _ = split(checkpoint_path(tmp_path, 1).read_bytes())
    assert [entry["rows"] for entry in header["row_keys"]] == [2, 0]


def test_row_sparse_keys_can_be_read_straight_into_tables(tmp_path):
    written = snapshot(row_keys=[row_record(), row_record(11, ids=[], first=5, end=9)])
    write_snapshot(tmp_path, written)
    got = read_snapshot(tmp_path, 1, lean=True)
    assert got is not None
    for record, want in zip(got.row_keys, written.row_keys, strict=True):
        table = record.rows
        assert isinstance(table, RowTable)
        assert (table.shape, table.dtype) == (want.shape, want.rows.dtype)
        np.testing.assert_array_equal(table.ids(), want.ids)
        np.testing.assert_array_equal(table.gather(want.ids), want.rows)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bools_read_straight_into_a_table_are_checked(tmp_path):
    """A forged row key of bools holding 2 (its checksum made to fit) is refused read lean
    as read into arrays."""
    ids = np.array([2, 7], np.int64)
    rows = np.ones((2, 3), np.bool_)
    record = RowRecord("flags", (10, 3), 0, 10, ids, rows, 5, {0: 5}, {0: 5})
    write_snapshot(tmp_path, snapshot(keys=[], optimizer_states=None, row_keys=[record]))
    path = checkpoint_path(tmp_path, 1)
    header, payload = split(path.read_bytes())
    forge(path, header, payload[:-1] + b"\x02")
    for lean in (False, True):
        with pytest.raises(CheckpointError, match="flags"):
            read_snapshot(tmp_path, 1, lean=lean)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_lean_read_leaves_the_optimizer_states_in_the_file_once_checksummed(tmp_path):
    """Read lean, the states are a file of their own over the checkpoint's bytes (not held
    in memory), which the reader closes; a checksum that does not fit closes it too."""
    states = bytes(range(256)) * 1000
    write_snapshot(tmp_path, snapshot(optimizer_states=states))
    before = open_fds()
    got = read_snapshot(tmp_path, 1, lean=True)
    assert got is not None and not isinstance(got.optimizer_states, bytes)
    file = got.optimizer_states
    assert file.read() == states and file.seek(-256, 2) == len(states) - 256
    assert file.read(1000) == bytes(range(256)) and file.seek(0) == 0
    assert file.read(3) == b"\x00\x01\x02"
    file.close()
    assert open_fds() == before
    path = checkpoint_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a byte of the states
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_snapshot(tmp_path, 1, lean=True)
    assert open_fds() == before


@pytest.mark.parametrize("lean", [False, True])
def test_a_damaged_row_key_is_named_whether_read_into_tables_or_not(tmp_path, lean):
    """Ids a table would refuse are read as arrays: the checksum or the ids' check says
    what is wrong, not the table."""
    write_snapshot(tmp_path, snapshot(keys=[], optimizer_states=None, row_keys=[row_record()]))
    path = checkpoint_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    header, payload = split(bytes(data))
    unsorted = np.array([7, 2], np.int64).tobytes() + payload[16:]
    forge(path, header, unsorted)
    with pytest.raises(CheckpointError, match="not sorted, unique"):
        read_snapshot(tmp_path, 1, lean=lean)
    at = len(data) - 4 - len(payload) + 8  # the second id's first byte
    data[at] ^= 0xFF  # an id past the table's rows, and a checksum that no longer fits
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_snapshot(tmp_path, 1, lean=lean)


def test_failed_rounds_not_told_yet_come_back_and_files_without_them_read(tmp_path):
    told = {0: "the update of key 3 in round 4 failed on server 1: OptimizerError: no"}
    dense = KeyRecord(3, np.ones(2, np.float32), 4, {0: 4}, {0: 4}, dict(told))
    rows = row_record()
    rows.untold = {1: "round 5 failed"}
    write_snapshot(tmp_path, snapshot(keys=[dense], row_keys=[rows]))
    got = read_snapshot(tmp_path, 1)
    assert got is not None
    assert got.keys[0].untold == told and got.row_keys[0].untold == {1: "round 5 failed"}
    path = checkpoint_path(tmp_path, 1)
    header, payload = split(path.read_bytes())
    assert "untold" in header["keys"][0]
    for entry in (header["keys"][0], header["row_keys"][0]):
        del entry["untold"]  # as an older akv wrote it
    forge(path, header, payload)
    got = read_snapshot(tmp_path, 1)
    assert got is not None and got.keys[0].untold == {} and got.row_keys[0].untold == {}
    header["keys"][0]["untold"] = {"0": 7}
    forge(path, header, payload)
    with pytest.raises(CheckpointError, match=r"untold\[0\] is not an error message"):
        read_snapshot(tmp_path, 1)
    header["keys"][0]["untold"] = {"0": "x"}
    header["keys"][0]["extra"] = 1
    forge(path, header, payload)
    with pytest.raises(CheckpointError, match=r"unknown \['extra'\]"):
        read_snapshot(tmp_path, 1)


def test_a_snapshot_without_row_sparse_keys_has_no_row_keys_field(tmp_path):
    write_snapshot(tmp_path, snapshot())
    header, _ = split(checkpoint_path(tmp_path, 1).read_bytes())
    assert "row_keys" not in header


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (row_record(ids=[7, 2]), "not sorted, unique and in"),
        (row_record(ids=[2, 12]), r"not sorted, unique and in \[0, 10\)"),
        (row_record(end=10**9 + 1), "are not rows of shape"),
        (row_record(key=True), "an int or a str"),
    ],
)
def test_the_writer_refuses_row_records_it_could_not_give_back(tmp_path, record, message):
    with pytest.raises(CheckpointError, match=message):
        write_snapshot(tmp_path, snapshot(row_keys=[record]))
    assert not checkpoint_path(tmp_path, 1).exists()


def test_a_forged_row_key_is_refused_before_its_rows_are_allocated(tmp_path):
    write_snapshot(tmp_path, snapshot(keys=[], optimizer_states=None, row_keys=[row_record()]))
    path = checkpoint_path(tmp_path, 1)
    header, payload = split(path.read_bytes())
    header["row_keys"][0]["rows"] = 10**12  # declares 16 TB of rows
    forge(path, header, payload)
    with pytest.raises(CheckpointError, match=r"nbytes \d+ does not fit"):
        read_snapshot(tmp_path, 1)
    header["row_keys"][0]["rows"] = 2
    unsorted = np.array([7, 2], np.int64).tobytes() + payload[16:]
    forge(path, header, unsorted)
    with pytest.raises(CheckpointError, match="not sorted, unique"):
        read_snapshot(tmp_path, 1)
