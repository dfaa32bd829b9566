"""Whole jobs in separate processes through akv-launch, each bounded in time.

Every process a test starts is ended by the launcher (by PID), and the launcher itself
runs in a process group that the test kills if it outlives its timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests import profiling
from tests.akv.cluster.cluster import (
    FAST_TIMEOUTS,
    ROOT,
    TRAIN_ACCURACY_BAND,
    free_port,
    job_env,
    launch,
    launch_shm_on_and_off,
)

JOBS = ROOT / "tests" / "akv" / "cluster" / "jobs"
round_timeline = profiling.load("round_timeline")
step_ab = profiling.load("step_ab")
pytestmark = pytest.mark.timeout(180)


def results(stdout: str) -> list[dict]:
    lines = [line.split("] ", 1)[1] for line in stdout.splitlines() if line.startswith("[worker")]
    return sorted(
        (json.loads(line) for line in lines if line.startswith("{")), key=lambda r: r["rank"]
    )


def values(stdout: str) -> list[dict]:
    """The workers' JSON lines without ``shm`` (whether every link shared memory)."""
    return [{k: v for k, v in r.items() if k != "shm"} for r in results(stdout)]


def semantics_job(workers: int, servers: int, store_type: str) -> list[dict]:
    """What the workers of ``jobs/semantics.py`` saw, the same with shared memory on and off."""
    args = ["-n", str(workers), "-s", str(servers), "--"]
    runs = launch_shm_on_and_off([*args, sys.executable, str(JOBS / "semantics.py"), store_type])
    for shm, done in runs.items():
        assert {r["shm"] for r in results(done.stdout)} == {shm == "1"}, done.stdout
    assert values(runs["1"].stdout) == values(runs["0"].stdout)
    return values(runs["1"].stdout)


@pytest.mark.parametrize(
    ("workers", "servers", "store_type"),
    [(2, 1, "dist_sync"), (3, 2, "dist_sync"), (2, 2, "dist_sync_device")],
)
def test_dist_sync_semantics_across_processes(workers, servers, store_type):
    seen = semantics_job(workers, servers, store_type)
    total = sum(range(1, workers + 1))
    assert [r["rank"] for r in seen] == list(range(workers))
    for r in seen:
        assert (r["num_workers"], r["type"]) == (workers, store_type)
        assert (r["init"], r["sum"], r["second"], r["pushpull"]) == (
            10.0,
            total,
            total,
            100.0 * total,
        )
        assert r["parts"] == servers  # 1.2M elements > 1e6: split over every server
        assert r["sgd"] == pytest.approx(0.85)


@pytest.mark.parametrize("store_type", ["dist_async", "dist_device_async"])
def test_dist_async_semantics_across_processes(store_type):
    seen = semantics_job(2, 2, store_type)
    assert [r["rank"] for r in seen] == [0, 1]
    for r in seen:
        assert r["type"] == store_type
        assert r["init"] == 10.0
        assert r["sgd"] == pytest.approx(0.8)  # both pushes applied, each on arrival


#: What examples/train_dist.py prints per epoch and at the end (the times left out).
EPOCH = re.compile(r"^\[worker (\d)\] worker \d epoch +(\d+)/\d+ \S+ (loss .*)$", re.M)
FINAL = re.compile(r"^\[worker (\d)\] worker \d: loss ([0-9.]+) -> ([0-9.]+) in .*?, (.*)$", re.M)


def test_the_training_example_runs_and_the_loss_falls():
    runs = launch_shm_on_and_off(
        ["-n", "2", "-s", "1", "--", sys.executable, "examples/train_dist.py", "--epochs", "4"]
    )
    done = runs["1"]
    finals = FINAL.findall(done.stdout)
    assert len(finals) == 2, done.stdout
    for _, first, last, rest in finals:
        assert float(last) < float(first)
        accuracy = float(rest.rpartition("test accuracy ")[2])
        assert TRAIN_ACCURACY_BAND[0] <= accuracy <= TRAIN_ACCURACY_BAND[1], rest
    assert "epoch  4/4 [########################]" in done.stdout
    # Exactly the same losses and accuracies, epoch by epoch, with shared memory on and off.
    for pattern in (EPOCH, FINAL):
        assert sorted(pattern.findall(done.stdout)) == sorted(pattern.findall(runs["0"].stdout))
    assert len(EPOCH.findall(done.stdout)) == 8


def test_the_restore_memory_script_measures_a_restore_of_its_own_checkpoint():
    done = subprocess.run(
        [sys.executable, "docs/profiling/restore_memory.py", "--rows", "30000", "--width", "4"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.fullmatch(
        r"30000 rows of 4 float32 with adam: checkpoint \d+ MiB; restore: RSS (\d+) -> (\d+) "
        r"MiB, peak (\d+) MiB: \d+ MiB above the start for \d+ MiB held \([0-9.]+x\)\n",
        done.stdout,
    )
    assert found, done.stdout
    before, after, peak = map(int, found.groups())
    assert before <= after <= peak


def test_the_small_round_profiling_script_times_rounds_that_sum_both_workers():
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, "docs/profiling/small_round.py"],
        env={"AKV_PROFILE_ROUNDS": "20"},
    )
    assert done.returncode == 0, done.stdout + done.stderr  # it checks the sums itself
    lines = re.findall(
        r"^\[worker 0\] round (\d+) us, calling thread CPU (\d+) us, process CPU (\d+) us$",
        done.stdout,
        re.M,
    )
    assert len(lines) == 3, done.stdout
    for wall, caller, process in lines:
        assert int(wall) > 0 and int(caller) <= int(process)


def test_the_round_timeline_script_reports_each_span_of_the_rounds():
    # docs/profiling/round_timeline.py runs its own job (its workers check the sums) and
    # merges the stamps of the server and both workers.
    done = subprocess.run(
        [sys.executable, "docs/profiling/round_timeline.py", "16", "40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(re.findall(r"^round of [\d.]+ us$", done.stdout, re.M)) == 3, done.stdout
    for event in ("W0:push<", "W0:write<", "S:recv<", "S:write<", "W1:recv>", "W0:pull>"):
        assert event in done.stdout, event
    assert "medians over the middle half of 39 rounds (us):" in done.stdout, done.stdout
    spans = dict(re.findall(r"^  ([a-z, ]+): ([\d.]+)$", done.stdout, re.M))
    assert set(spans) == {
        "round",
        "push call",
        "push to wire",
        "server, last frame in to first answer out",
        "answer in to pull return",
        "server busy",
    }, done.stdout
    assert 0 < float(spans["push call"]) < float(spans["round"])
    assert float(spans["server busy"]) > 0


def test_the_step_ab_script_alternates_the_push_buffers_in_blocks():
    # docs/profiling/step_ab.py: 400 steps are 4 blocks, the first 2 warm-up; over TCP
    # every row push of worker 0 takes a push buffer in "on" blocks and copies in "off".
    done = launch(
        [
            "-n",
            "2",
            "-s",
            "1",
            "--",
            sys.executable,
            "docs/profiling/step_ab.py",
            "push-buffers",
            "400",
        ],
        env={"AKV_SHM": "0"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = re.search(
        r"push-buffers on ([\d.]+) ms, off ([\d.]+) ms; on/off median ([\d.]+), mean "
        r"[\d.]+ \(1 pairs of blocks\); rows pushed: \{'in push buffers': (\d+), "
        r"'copied': (\d+)\}",
        done.stdout,
    )
    assert line is not None, done.stdout
    on, off, ratio, placed, copied = line.groups()
    assert float(ratio) == pytest.approx(float(on) / float(off), abs=0.002)
    assert (int(placed), int(copied)) == (200, 200)  # one server: one push each step


def test_step_ab_summarizes_neighbouring_blocks():
    # Blocks of 100 steps, the first 10 of each left out, blocks 0 and 1 warm-up.
    times = [9.0] * 200 + ([0.001] * 100 + [0.002] * 100) * 2 + [0.003] * 100
    line = step_ab.summary("x", times)
    assert line == (
        "x on 1.000 ms, off 2.000 ms; on/off median 0.500, mean 0.500 (2 pairs of blocks)"
    )


def test_the_round_timeline_counts_a_write_inside_a_receive_once():
    window = [
        (0, "S:recv<"),
        (10, "S:write<"),  # the answer, written while the frame is handled
        (15, "S:write>"),
        (30, "S:recv>"),
        (40, "W0:recv<"),  # another process: not the server's time
        (50, "S:flush<"),
        (55, "S:flush>"),
        (60, "S:write>"),  # began before the window: not counted
        (70, "S:recv<"),  # not over within the window: not counted
    ]
    assert round_timeline._busy(window, "S:") == 30 + 5


def test_the_round_timeline_takes_the_answer_after_the_closing_frame_not_a_late_one():
    events = [
        (0, "W0:pull>"),
        (5, "S:write<"),  # the previous round's answer to worker 1, written late
        (8, "S:write>"),
        (10, "W0:push<"),
        (40, "W0:push>"),
        (100, "W0:write<"),
        (110, "W0:write>"),
        (120, "S:recv<"),
        (150, "S:recv>"),
        (300, "S:recv<"),  # worker 1's push closes the round
        (400, "S:write<"),
        (410, "W0:recv<"),
        (450, "W0:recv>"),
        (460, "S:write>"),
        (480, "S:recv>"),
        (500, "W0:pull>"),
    ]
    spans = round_timeline._intervals(events)
    # (The stamps are in ns, the spans in us.)
    assert [len(values) for values in spans.values()] == [1] * 6
    assert {name: values[0] for name, values in spans.items()} == pytest.approx(
        {
            "round": 0.5,
            "push call": 0.03,
            "push to wire": 0.06,
            "server, last frame in to first answer out": 0.1,
            "answer in to pull return": 0.09,
            "server busy": 0.003 + 0.03 + 0.18,
        }
    )


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_the_minimal_round_script_times_rounds_that_sum_both_workers(kind):
    # akv's architecture without akv's layers (docs/profiling/minimal_round.py): it checks
    # the sums itself, and ends its server and workers by PID.
    done = subprocess.run(
        [sys.executable, "docs/profiling/minimal_round.py", "20", kind],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = re.findall(r"^round (\d+) us, process CPU (\d+) us$", done.stdout, re.M)
    assert len(lines) == 1, done.stdout  # worker 0 only
    assert int(lines[0][0]) > 0


def test_a_worker_that_dies_fails_the_job_naming_its_rank():
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "faults.py"), "die"], timeout=90
    )
    assert done.returncode == 3
    assert "worker 1" in done.stderr and "exited with code 3" in done.stderr


def test_a_worker_that_hangs_is_found_by_heartbeats_and_named():
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "faults.py"), "hang"], timeout=90
    )
    assert done.returncode != 0
    assert "rank 0 got PeerLostError" in done.stdout
    assert "worker 1" in done.stdout.split("rank 0 got PeerLostError")[1].splitlines()[0]


def test_a_server_that_dies_fails_the_job_and_the_worker_names_it():
    done = launch(
        ["-n", "1", "-s", "1", "--", sys.executable, str(JOBS / "faults.py"), "kill-server"],
        timeout=90,
    )
    assert done.returncode == 128 + signal.SIGKILL  # the server's death decides the code
    output = done.stdout + done.stderr
    # The worker names the dead server by rank and address before the job stops: the
    # launcher gives workers time to report a server's death (REPORT_GRACE_S).
    assert re.search(
        r"\[worker 0\] .*worker 0: the job failed: server 0 \(pid \d+ on 127\.0\.0\.1\)", output
    ), output
    assert "[worker 0] rank 0 got PeerLostError" in output
    assert "server 0" in output and "exited with signal SIGKILL" in output
    assert "waiting up to 5 s for the workers to report it" in output


def test_a_killed_worker_is_named_by_the_launcher():
    """The launcher stops the job at a worker's death and names it (the survivor's own
    message, which may not get printed before the stop, is checked in test_store.py)."""
    done = launch(
        ["-n", "2", "-s", "2", "--", sys.executable, str(JOBS / "faults.py"), "kill-worker"],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 128 + signal.SIGKILL, output
    assert re.search(r"akv-launch: worker 1 \(pid \d+\) exited with signal SIGKILL", output)
    for line in re.findall(r"rank 0 got PeerLostError after [\d.]+ s: (.*)", output):
        assert re.match(r"the job failed: worker 1 ", line), line  # when it got printed
    # The launcher saw it die and told the scheduler: the verdict names it, not a process
    # that the launcher stopped afterwards.
    verdict = re.search(r"akv-launch: the scheduler's verdict: the job failed: (.*)", output)
    assert verdict is not None, output
    assert re.match(
        r"worker 1 \(pid \d+ on 127\.0\.0\.1\) exited with signal SIGKILL \(seen by akv-launch\)$",
        verdict.group(1),
    ), verdict.group(1)


def test_a_hanging_server_is_blamed_by_the_workers_and_the_launcher():
    done = launch(
        ["-n", "2", "-s", "2", "--", sys.executable, str(JOBS / "faults.py"), "stop-server"],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    blamed = re.findall(r"rank \d got PeerLostError after [\d.]+ s: (.*)", output)
    assert blamed, output
    for message in blamed:
        assert re.match(r"the job failed: server 1 ", message), message
    verdict = re.search(r"akv-launch: the scheduler's verdict: the job failed: (.*)", output)
    assert verdict is not None, output
    assert verdict.group(1).startswith("server 1 (pid"), verdict.group(1)


def test_a_server_stopped_by_sigterm_once_every_worker_finished_ends_the_job_well():
    """Its data is final then (a cluster manager tearing the job down): the server stops as
    it would have and exits 0, whether the signal comes before its stop or during it.
    Before, it exited 143, and the launcher failed the job ("server 0 (pid N) exited with
    code 143 while 2 workers still ran"): a signal before the stop always did, one during
    the stop in a CI run."""
    done = launch(
        [
            *("-n", "2", "-s", "1", "--env", "AKV_HEARTBEAT_INTERVAL_S=3"),
            *("--env", "AKV_HEARTBEAT_TIMEOUT_S=20", "--"),
            *(sys.executable, str(JOBS / "term_at_end.py")),
        ],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"\[server 0\] .*akv-server got SIGTERM: stopping", output), output
    assert re.search(r"akv-launch: server 0 \(pid \d+\) exited with code 0", output), output
    assert "the job ended well: 2 workers and 1 server finished" in output, output


def test_a_server_stopped_by_sigterm_says_so_and_the_workers_name_it():
    done = launch(
        ["-n", "1", "-s", "1", "--", sys.executable, str(JOBS / "faults.py"), "term-server"],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 128 + signal.SIGTERM, output
    assert re.search(r"\[server 0\] .*akv-server got SIGTERM: stopping", output), output
    got = re.search(r"rank 0 got PeerLostError after [\d.]+ s: (.*)", output)
    assert got is not None, output
    assert "server 0" in got.group(1) and "stopped by a signal" in got.group(1), got.group(1)
    assert "server 0" in output and "exited with code 143" in output


def test_a_misconfigured_environment_fails_at_once_with_a_clear_message():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "DMLC_"))}
    env.update(
        {
            "DMLC_ROLE": "worker",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "1",
        }
    )
    done = subprocess.run(
        [sys.executable, "-c", "import akv; akv.create('dist_sync')"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode != 0
    assert "ConfigError: DMLC_NUM_SERVER (or AKV_NUM_SERVERS) is not set" in done.stderr
    env["DMLC_NUM_SERVER"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "akv.cluster.server"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "AKV_TOKEN is not set" in done.stderr


def test_an_mxnet_style_script_serves_every_role_by_dmlc_role():
    """tools/launch.py runs one command for every role; so can akv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "DMLC_"))}
    env.update(
        {
            f"DMLC_{k}": v
            for k, v in {"PS_ROOT_URI": "127.0.0.1", "NUM_WORKER": "1", "NUM_SERVER": "1"}.items()
        }
    )
    env.update(FAST_TIMEOUTS)
    port = free_port()
    env.update({"DMLC_PS_ROOT_PORT": str(port), "AKV_TOKEN": job_env(1, 1, port)["AKV_TOKEN"]})
    script = [sys.executable, str(JOBS / "mxnet_style.py")]
    processes = [
        subprocess.Popen(
            script,
            env={**env, "DMLC_ROLE": role},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("scheduler", "server", "worker")
    ]
    try:
        outputs = [p.communicate(timeout=90) for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert [p.returncode for p in processes] == [0, 0, 0], outputs
    assert "pulled [1.0, 1.0]" in outputs[2][0]


def test_the_sparse_steps_script_times_the_row_sparse_step():
    # docs/profiling/sparse_steps.py: the step of `akv bench sparse` alone, for profilers.
    script = str(ROOT / "docs" / "profiling" / "sparse_steps.py")
    done = launch(["-n", "2", "-s", "1", "--", sys.executable, script, "10"])
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(
        r"\[worker 0\] step median ([\d.]+) ms, p10 ([\d.]+), p90 ([\d.]+)", done.stdout
    )
    assert found is not None, done.stdout
    median, p10, p90 = map(float, found.groups())
    assert 0 < p10 <= median <= p90, found.group(0)
    assert "[worker 1] step median" not in done.stdout  # worker 0 alone reports
