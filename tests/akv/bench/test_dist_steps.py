"""``akv bench dist``'s step workloads and its floors (issue #10)."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import numpy as np
import pytest

import akv
import akv.bench.dist as dist
from akv.bench import configure
from akv.bench._raw import RawRound, RawShmRound, _recv_exactly, round_trip
from akv.bench.dist import (
    MXNET_S,
    STEP_ROUNDS_FACTOR,
    Case,
    _measure,
    _operation,
    copy_sum_copy,
    default_cases,
    measure,
    memcpy_round,
    round_case,
    step_cases,
)
from akv.bench.steps import (
    RESNET18_ARRAYS,
    RESNET18_PARAMETERS,
    elements,
    list_step,
    per_key_step,
    resnet18_shapes,
)
from akv.limits import SPLIT_ADD_MIN_BYTES

MIB = 1 << 20
#: A job of 2 workers and 1 server with tiny cases: about 5 s on the 2-core machine.
JOB_TEST_TIMEOUT_S = 60


@pytest.fixture
def quick_bench_settings():
    configure(quick=True)
    yield
    configure(quick=False)


def test_resnet18_has_62_arrays_and_11_689_512_floats():
    shapes = resnet18_shapes()
    assert len(shapes) == RESNET18_ARRAYS == 62
    total = elements([shape for _, shape in shapes])
    assert total == RESNET18_PARAMETERS == 11_689_512
    assert total * 4 / MIB == pytest.approx(44.6, abs=0.05)
    assert len({name for name, _ in shapes}) == 62


def test_resnet18_runs_from_conv1_to_fc_with_a_downsample_in_stages_2_to_4():
    shapes = dict(resnet18_shapes())
    names = list(shapes)
    assert names[:3] == ["conv1.weight", "bn1.gamma", "bn1.beta"]
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["fc.weight"] == (1000, 512) and shapes["fc.bias"] == (1000,)
    assert [n for n in names if n.endswith("downsample.weight")] == [
        "layer2.0.downsample.weight",
        "layer3.0.downsample.weight",
        "layer4.0.downsample.weight",
    ]
    assert shapes["layer2.0.downsample.weight"] == (128, 64, 1, 1)
    assert shapes["layer2.0.conv1.weight"] == (128, 64, 3, 3)
    assert shapes["layer4.1.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["layer4.1.bn2.beta"] == (512,)


def test_a_narrow_resnet18_keeps_its_62_arrays():
    shapes = resnet18_shapes(base_channels=4, num_classes=10)
    assert len(shapes) == 62
    assert dict(shapes)["fc.weight"] == (10, 32)


class RecordingStore:
    """The calls a step makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int | None]] = []

    def init(self, key: Any, value: Any) -> None:
        pass

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        self.calls.append(("push", key, priority))

    def pull(self, key: Any, out: Any = None, priority: int = 0) -> None:
        self.calls.append(("pull", key, None))


def test_a_per_key_step_pushes_the_last_layer_first_with_priority_minus_its_index():
    store = RecordingStore()
    keys = ["a", "b", "c"]
    per_key_step(store, keys, [0, 1, 2], [3, 4, 5])
    assert store.calls == [
        ("push", "c", -2),
        ("push", "b", -1),
        ("push", "a", 0),
        ("pull", "a", None),
        ("pull", "b", None),
        ("pull", "c", None),
    ]


def test_a_list_step_makes_one_push_and_one_pull_of_every_key():
    store = RecordingStore()
    list_step(store, ("a", "b"), [0, 1], [2, 3])
    assert store.calls == [("push", ["a", "b"], 0), ("pull", ["a", "b"], None)]


def test_a_step_through_a_store_leaves_every_weight_equal_to_its_gradient():
    shapes = [shape for _, shape in resnet18_shapes(base_channels=2, num_classes=3)]
    for step in (per_key_step, list_step):
        kv = akv.create("local")
        keys = list(range(len(shapes)))
        kv.init(keys, [np.zeros(shape, np.float32) for shape in shapes])
        grads = [np.full(shape, i, np.float32) for i, shape in enumerate(shapes)]
        weights = [np.full(shape, -1, np.float32) for shape in shapes]
        step(kv, keys, grads, weights)
        for grad, weight in zip(grads, weights, strict=True):
            np.testing.assert_array_equal(weight, grad)


def test_each_step_case_makes_the_calls_of_its_kind():
    per_key, listed = step_cases([(2, 3), (4,)], model="tiny")
    store = RecordingStore()
    _operation(store, per_key)()
    assert [(call, key) for call, key, _ in store.calls] == [
        ("push", "tiny step, per-key calls/1"),
        ("push", "tiny step, per-key calls/0"),
        ("pull", "tiny step, per-key calls/0"),
        ("pull", "tiny step, per-key calls/1"),
    ]
    store = RecordingStore()
    _operation(store, listed)()
    keys = ["tiny step, list calls/0", "tiny step, list calls/1"]
    assert store.calls == [("push", keys, 0), ("pull", keys, None)]


def test_the_memcpy_floor_copies_in_adds_and_copies_out():
    grad = np.array([1.0, 2.0, 3.0], np.float32)
    staging, out = np.zeros(3, np.float32), np.zeros(3, np.float32)
    total = np.full(3, 10.0, np.float32)
    copy_sum_copy(grad, staging, total, out)
    copy_sum_copy(grad, staging, total, out)
    np.testing.assert_array_equal(staging, grad)
    np.testing.assert_array_equal(total, [12.0, 14.0, 16.0])
    np.testing.assert_array_equal(out, total)


def test_the_memcpy_floor_of_a_step_covers_every_array(monkeypatch):
    touched: list[tuple[int, ...]] = []
    monkeypatch.setattr(dist, "copy_sum_copy", lambda grad, *_: touched.append(grad.shape))
    memcpy_round([(3,), (2, 2), (5, 1, 1)])()
    assert touched == [(3,), (2, 2), (5, 1, 1)]


def test_round_cases_are_named_by_size_and_keep_their_mxnet_reference():
    assert round_case(4 * MIB, 1).name == "push+pull 4 MiB"
    assert round_case(64 << 10, 1).name == "push+pull 64 KiB"
    names = {case.name for case in default_cases()}
    assert {name for name, _ in MXNET_S} <= names
    (four_mib,) = [case for case in default_cases() if case.name == "push+pull 4 MiB"]
    assert four_mib.nbytes == 4 * MIB and four_mib.memcpy_floor


def test_the_default_steps_are_resnet18_per_key_and_list():
    steps = {case.name: case for case in default_cases() if case.kind in ("per-key", "list")}
    per_key = steps["ResNet-18 step, per-key calls"]
    listed = steps["ResNet-18 step, list calls"]
    for case in (per_key, listed):
        assert len(case.shapes) == 62 and case.nbytes == RESNET18_PARAMETERS * 4
        assert case.memcpy_floor and case.calls == 1
    assert per_key.kind == "per-key" and listed.kind == "list"


def test_a_case_goes_to_the_workers_as_json_and_back():
    (case, _) = step_cases([(2, 3), (4,)], model="tiny")
    assert Case.from_json(json.loads(json.dumps(case.to_json()))) == case


def test_a_case_of_an_unknown_kind_is_refused_with_its_name():
    data = {**round_case(64, 1).to_json(), "kind": "broadcast"}
    with pytest.raises(akv.BenchmarkError, match=r"push\+pull 64 B.*'broadcast'"):
        Case.from_json(data)


def test_a_worker_times_a_sample_per_round_and_a_step_per_sample():
    cases = [round_case(1024, 3), *step_cases([(2, 3), (4,)], model="tiny")]
    with akv.create("local") as kv:
        results = _measure(kv, cases, rounds=2, scale=1.0)
    assert len(results["push+pull 1 KiB"]) == 2
    assert len(results["tiny step, per-key calls"]) == 2 * STEP_ROUNDS_FACTOR
    assert len(results["tiny step, list calls"]) == 2 * STEP_ROUNDS_FACTOR
    assert all(sample > 0 for samples in results.values() for sample in samples)


@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_tiny_run_reports_each_step_with_both_floors(quick_bench_settings, tmp_path):
    shapes = [shape for _, shape in resnet18_shapes(base_channels=4, num_classes=10)]
    cases = [round_case(64 << 10, 2), *step_cases(shapes)]
    table = measure(cases, rounds=1, scale=1.0, servers=(1,))

    names = [row.name for row in table.rows]
    assert names == [
        f"{case}, 1 server, {transport}"
        for transport in ("shared memory", "TCP")
        for case in (
            "push+pull 64 KiB",
            "ResNet-18 step, per-key calls",
            "ResNet-18 step, list calls",
        )
    ]
    for row in table.rows:
        assert row.akv_s > 0 and row.floor_s > 0
        assert row.akv_p90_s is not None and row.akv_p90_s >= row.akv_s
        assert row.second_floor_s is not None and row.second_floor_s > 0
        assert row.ratio == pytest.approx(row.akv_s / row.floor_s)
        assert row.second_ratio == pytest.approx(row.akv_s / row.second_floor_s)
        assert math.isfinite(row.ratio) and math.isfinite(row.second_ratio)
    step_bytes = elements(shapes) * 4
    assert table.rows[1].floor == f"raw socket echo of {step_bytes} B"
    assert table.rows[1].floor_s == table.rows[2].floor_s == table.rows[4].floor_s

    # The second floor: in memory through shared memory, a raw TCP round on TCP.
    assert [row.second_floor for row in table.rows] == [dist.MEMCPY_FLOOR] * 3 + [
        dist.ROUND_FLOOR
    ] * 3
    assert table.rows[3].second_floor_s != table.rows[0].second_floor_s
    # The third floor: the raw shared-memory round, in the shared-memory row of the key's
    # round only (the steps have none, nor does TCP).
    assert [row.third_floor for row in table.rows] == [dist.SHM_ROUND_FLOOR] + [""] * 5
    shm_row = table.rows[0]
    assert shm_row.third_floor_s is not None and shm_row.third_floor_s > 0
    assert shm_row.third_ratio == pytest.approx(shm_row.akv_s / shm_row.third_floor_s)
    assert all(row.third_floor_s is None and row.third_ratio is None for row in table.rows[1:])
    rendered = table.render()
    assert "floor 2" in rendered and "floor 3" in rendered and "akv p90" in rendered
    assert dist.SHM_ROUND_FLOOR in rendered
    report = tmp_path / "dist.json"
    with open(tmp_path / "dist.txt", "w") as stream:
        table.write(stream, json_path=str(report))
    rows = json.loads(report.read_text())["rows"]
    assert [row["name"] for row in rows] == names
    for row in rows:
        assert row["second_ratio"] == pytest.approx(row["akv_s"] / row["second_floor_s"])
    assert rows[0]["third_ratio"] == pytest.approx(rows[0]["akv_s"] / rows[0]["third_floor_s"])
    assert rows[1]["third_ratio"] is None


@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_the_raw_tcp_round_answers_each_client_the_sum_of_both():
    with RawRound() as raw:
        for nbytes in (64, 3 << 20):  # one segment, and many (the server reads in chunks)
            values = np.arange(nbytes // 4, dtype=np.float32)
            back = np.empty_like(values)
            raw.before(nbytes, 1)  # the second client sends float32 ones
            raw.sock.sendall(struct.pack("<Q", nbytes))
            raw.sock.sendall(values)
            _recv_exactly(raw.sock, memoryview(back).cast("B"))
            np.testing.assert_array_equal(back, values + 1)
        assert round_trip(raw, 4096, iterations=3, rounds=2) > 0
    assert raw.process.returncode == 0 and raw.peer.returncode == 0  # both left on their own


@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_the_raw_shared_memory_round_answers_each_client_the_sum_of_both():
    limit = 2 * SPLIT_ADD_MIN_BYTES
    with RawShmRound(limit) as raw:
        # One sum by the server alone, and one split with its helper thread.
        for nbytes in (64, limit):
            values = np.arange(nbytes // 4, dtype=np.float32)
            back = np.empty_like(values)
            raw.before(nbytes, 1)  # the second client sends float32 ones
            raw.exchange(
                struct.pack("<Q", nbytes), memoryview(values).cast("B"), memoryview(back).cast("B")
            )
            np.testing.assert_array_equal(back, values + 1)
        assert round_trip(raw, 4096, iterations=3, rounds=2) > 0
        with pytest.raises(ValueError, match="exceeds"):
            raw.before(limit + 4, 1)
    assert raw.process.returncode == 0 and raw.peer.returncode == 0  # both left on their own
    # The arena is a memfd: no file names it.
    assert not [name for name in os.listdir("/dev/shm") if "akv-bench" in name]


@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_raw_shared_memory_round_that_cannot_start_ends_what_it_started(monkeypatch):
    import akv.bench._raw as raw_module

    started = []
    real_popen = raw_module.subprocess.Popen

    def popen(args, **kwargs):
        if "shmpeer" in args:
            raise OSError("no second client today")
        started.append(real_popen(args, **kwargs))
        return started[-1]

    monkeypatch.setattr(raw_module.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="no second client"):
        RawShmRound(1 << 20)
    assert len(started) == 1 and started[0].returncode == 0  # the server left on its own
