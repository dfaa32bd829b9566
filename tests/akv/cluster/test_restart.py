"""A server killed in the middle of a dist_sync training run, restarted by akv-launch from
its checkpoint: the job ends well, with the weights of a run that lost nothing.

Each job runs under ``akv-launch`` in a process group of its own, bounded in time (see
:func:`tests.akv.cluster.cluster.launch`); the launcher ends every process it started.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from akv.cluster.server.checkpoint import read_snapshot
from tests.akv.cluster.cluster import launch, printed
from tests.akv.cluster.test_jobs import JOBS

pytestmark = pytest.mark.timeout(240)


def job(
    mode: str, checkpoints: str, shm: str = "1", restarts: int = 1
) -> subprocess.CompletedProcess[str]:
    """``jobs/restart.py MODE CHECKPOINTS`` under ``akv-launch`` with server checkpoints
    every 0.2 s and ``restarts`` restarts per server."""
    return launch(
        [
            "-n",
            "2",
            "-s",
            "2",
            "--checkpoint-dir",
            checkpoints,
            "--checkpoint-interval-s",
            "0.2",
            "--max-restarts",
            str(restarts),
            "--env",
            "AKV_BIGARRAY_BOUND=1024",
            "--",
            sys.executable,
            str(JOBS / "restart.py"),
            mode,
            checkpoints,
        ],
        timeout=150,
        env={"AKV_SHM": shm},
    )


def run(
    mode: str, checkpoints: str, shm: str = "1", restarts: int = 1
) -> tuple[int, str, list[dict]]:
    done = job(mode, checkpoints, shm, restarts)
    output = done.stdout + done.stderr
    finals = printed(done)
    return done.returncode, output, sorted(finals, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> list[dict]:
    code, output, clean = run("clean", str(tmp_path_factory.mktemp("clean")))
    assert code == 0, output
    assert len(clean) == 2
    return clean


# The clean run shares memory (the default); the restarted ones run with it and without
# (TCP only): the same weights either way.
@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize(
    ("mode", "signal_name", "status"),
    [("kill", "SIGKILL", "signal SIGKILL"), ("term", "SIGTERM", "code 143")],
)
def test_a_server_killed_or_stopped_is_restarted_from_its_checkpoint_with_exact_weights(
    clean_run, tmp_path, mode, signal_name, status, shm
):
    code, output, restarted = run(mode, str(tmp_path), shm)
    assert code == 0, output
    assert re.search(
        rf"akv-launch: server 1 \(pid \d+\) exited with {status}; restarting it from its "
        r"checkpoint \(restart 1 of 1\)",
        output,
    ), output
    assert re.search(r"\[server 1\] .*server 1 restored checkpoint \d+", output), output
    # The workers name where the restarted server listens now, not where it was.
    moved = re.search(
        r"stream to (server 1 at \S+) was cut .*reconnected to (server 1 at \S+),", output
    )
    assert moved is not None and moved[1] != moved[2], output
    if mode == "term":  # it drained and wrote a final checkpoint before it exited
        assert re.search(r"\[server 1\] .*got SIGTERM: stopping", output), output
        before_restart = output.split("restarting it from its checkpoint")[0]
        assert "server 1 wrote its final checkpoint" in before_restart, output
    assert len(restarted) == 2
    for got, expected in zip(restarted, clean_run, strict=True):
        assert got["first"] == expected["first"] != 0
        for key in ("w", "split", "bias", "emb"):
            assert got[key] == expected[key], f"worker {got['rank']}: {key} differs"
    assert (tmp_path / "server-1.akvckpt").stat().st_mode & 0o777 == 0o600


def test_a_server_killed_twice_is_restarted_twice_with_exact_weights(clean_run, tmp_path):
    """The second restart restores a checkpoint the first restored server wrote while the
    workers resent what the first lacked: it must hold every push it declared durable
    (a checkpoint written during a replay once declared pushes still to come durable, and
    the second restart lost them: wrong weights, exit 0)."""
    code, output, restarted = run("kill_twice", str(tmp_path), restarts=2)
    assert code == 0, output
    for number in (1, 2):
        assert re.search(
            rf"akv-launch: server 1 \(pid \d+\) exited with signal SIGKILL; restarting it "
            rf"from its checkpoint \(restart {number} of 2\)",
            output,
        ), output
    assert len(restarted) == 2
    for got, expected in zip(restarted, clean_run, strict=True):
        for key in ("w", "split", "bias", "emb"):
            assert got[key] == expected[key], f"worker {got['rank']}: {key} differs"


# A restart that cannot be exact: the job fails at once, naming the server, its file and
# the rounds, and no worker prints weights (nothing was answered from the older state).
@pytest.mark.parametrize(
    ("mode", "restored"),
    [
        ("rollback", r"restored checkpoint \d+ from \S+server-1\.akvckpt \(rounds up to \d+;"),
        ("delete", r"started without a checkpoint \(\S+server-1\.akvckpt is missing\)"),
    ],
)
def test_a_server_restarted_from_an_older_or_missing_checkpoint_fails_the_job(
    tmp_path, mode, restored
):
    done = job(mode, str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert re.search(r"akv-launch: server 1 \(pid \d+\) exited with signal SIGKILL", output)
    verdict = (
        rf"server 1 \(pid \d+ on \S+\) {restored}.* but before its restart it had declared "
        r"checkpoint \d+ \(rounds up to \d+\) durable to worker \d, which dropped its copies"
    )
    assert re.search(r"akv-launch: .*" + verdict, output), output  # the launcher's summary
    for rank in (0, 1):  # and every worker's error
        assert re.search(rf"\[worker {rank}\] .*" + verdict, output), output
    assert not re.search(r"^\[worker \d\] \{", done.stdout, re.M), output
    # Only the killed server is restarted: not server 0, which ends because the job failed.
    assert output.count("restarting it from its checkpoint") == 1, output
    # The refusing server writes no checkpoint of the state that lacks the lost pushes (a
    # new job on the directory would have started from it without a word).
    path = tmp_path / "server-1.akvckpt"
    if mode == "delete":
        assert not path.exists(), output
    else:
        number = re.search(r"restored checkpoint (\d+) from", output)
        assert number is not None and read_snapshot(tmp_path, 1).generation == int(number[1])
    # And the directory is marked: a new job on it (whose servers would restore files of
    # different points in time) is refused, naming the mark and what it says.
    assert (tmp_path / "server-1.lost").exists(), output
    again = job("clean", str(tmp_path))
    output = again.stdout + again.stderr
    assert again.returncode != 0, output
    assert re.search(r"could not use its checkpoint: \S+server-1\.lost says", output), output


def resume(directory, interval_s: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``jobs/resume.py ARGS`` under akv-launch, 2 workers and 2 servers, with checkpoints
    in ``directory`` every ``interval_s``."""
    return launch(
        [
            *("-n", "2", "-s", "2", "--checkpoint-dir", str(directory)),
            *("--checkpoint-interval-s", interval_s, "--", sys.executable),
            *(str(JOBS / "resume.py"), *args),
        ],
        timeout=150,
    )


def test_servers_of_a_failed_job_write_a_final_checkpoint_that_a_new_job_starts_from(tmp_path):
    """A worker fails after its rounds (no interval checkpoint in the job: 1 h): the servers
    still write a final checkpoint of what they applied, so the job started again goes on
    from there (it started from the inits' checkpoint: -5, not -11)."""
    failed = resume(tmp_path, "3600", "fail")
    assert failed.returncode != 0 and "worker 1 fails after its rounds" in failed.stderr
    done = resume(tmp_path, "3600")
    assert done.returncode == 0, done.stdout + done.stderr
    finals = printed(done)
    assert [(r["emb"], r["d"]) for r in finals] == [([-11.0], [-11.0])] * 2, done.stdout


def test_a_new_job_with_the_same_checkpoint_directory_adds_its_rounds_to_the_restored_values(
    tmp_path,
):
    """Start the job again: its servers restore the first job's values, and its workers'
    pushes (numbered from 1 again: new processes) are all counted on top of them. Before,
    the servers took the new job's first pushes for resends of the old job's, and dropped
    them without a word (both runs ended at -5)."""
    finals = []
    for _ in range(2):
        done = resume(tmp_path, "0.2")
        assert done.returncode == 0, done.stdout + done.stderr
        finals.append(printed(done))
    # 1 - 3 rounds x 2 workers, then 3 more rounds on top.
    assert [[(r["emb"], r["d"]) for r in run] for run in finals] == [
        [([-5.0], [-5.0])] * 2,
        [([-11.0], [-11.0])] * 2,
    ]


def end_kill(mode: str, directory) -> subprocess.CompletedProcess[str]:
    """``jobs/end_kill.py MODE`` under akv-launch, 2 workers and 2 servers writing
    checkpoints in ``directory`` (no interval checkpoint within the job)."""
    return launch(
        [
            *("-n", "2", "-s", "2", "--checkpoint-dir", str(directory)),
            *("--checkpoint-interval-s", "3600", "--max-restarts", "1"),
            *("--env", "AKV_BIGARRAY_BOUND=1024", "--", sys.executable),
            *(str(JOBS / "end_kill.py"), mode),
        ],
        timeout=120,
    )


def read_back(directory) -> list[dict]:
    """What a later job on ``directory`` restores (digests of every key, per worker)."""
    done = end_kill("read", directory)
    assert done.returncode == 0, done.stdout + done.stderr
    return sorted(printed(done, "w0"), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def left_clean(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("left")
    done = end_kill("none", directory)
    assert done.returncode == 0, done.stdout + done.stderr
    values = read_back(directory)
    assert len(values) == 2 and values[0]["w0"] != 0
    return values


@pytest.mark.parametrize("mode", ["at_close", "after_goodbye"])
def test_a_server_killed_as_the_workers_leave_keeps_what_they_pushed(left_clean, tmp_path, mode):
    """Server 1 is killed while the workers leave (``at_close``), or after one of them left
    (``after_goodbye``), and restarted from a checkpoint without their rounds. The workers
    resend to it before their goodbyes, and a goodbye is answered once a checkpoint holds
    the worker's pushes: a later job restores every round. Before, the job ended well and
    the later job restored none of server 1's rounds (``at_close``), or it failed after 10 s
    on a goodbye the restarted server could not answer (``after_goodbye``)."""
    done = end_kill(mode, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(
        r"akv-launch: server 1 \(pid \d+\) exited with signal SIGKILL; restarting it", output
    ), output
    assert read_back(tmp_path) == left_clean


@pytest.mark.parametrize(
    ("shm", "staleness"), [("1", None), ("0", None), ("1", "1")], ids=["shm", "tcp", "bounded"]
)
def test_a_restarted_dist_async_server_applies_the_resent_pushes_in_the_barriers_order(
    tmp_path, shm, staleness
):
    """Worker 0 lowers the learning rate between two barriers, and server 1 is killed after
    both workers pushed at each rate. Every push is sent again to its restart; the pushes
    before the rate change must take the old rate and those after it the new one, and a pull
    after the next barrier must see them all. Before, a replay sent a worker's pushes of both
    rates and its optimizer back to back: 3 of 3 runs ended well with wrong weights. With a
    staleness bound, the restarted server refused every worker (the bound was not restored)."""
    done = launch(
        [
            *("-n", "2", "-s", "2", "--checkpoint-dir", str(tmp_path)),
            *("--checkpoint-interval-s", "3600", "--max-restarts", "1"),
            *("--env", "AKV_BIGARRAY_BOUND=1024", "--", sys.executable),
            str(JOBS / "async_restart.py"),
        ],
        timeout=120,
        env={"AKV_SHM": shm, **({} if staleness is None else {"AKV_STALENESS": staleness})},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"server 1 \(pid \d+\) exited with signal SIGKILL; restarting it", output)
    finals = printed(done, "expected")
    assert len(finals) == 2, output
    for final in finals:
        for key in ("w", "emb"):
            assert final[key] == pytest.approx([final["expected"]] * 2, abs=1e-5), (final, output)


def test_a_workers_next_round_after_a_restart_waits_for_its_resent_one(tmp_path):
    """Worker 1's replay sent its round-6 pushes again; on the restarted server that round
    waits for worker 0's resends (held back 2 s after its round-5 push), while worker 1's
    own pulls of round 6 were answered before the kill. Its round-7 pushes wait for a pull
    of their keys first. Before, they met round 6 still open: a DoublePushError that
    failed the job (every run of this test)."""
    done = launch(
        [
            *("-n", "2", "-s", "1", "--checkpoint-dir", str(tmp_path)),
            *("--checkpoint-interval-s", "3600", "--max-restarts", "1", "--"),
            *(sys.executable, str(JOBS / "runs_ahead.py")),
        ],
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "restarting it from its checkpoint" in output, output
    finals = printed(done, "a")
    assert len(finals) == 2, output
    for final in finals:  # 7 rounds of two pushes of ones at 0.1
        assert final["a"] == pytest.approx([-1.4] * 2)


def test_a_server_killed_before_a_workers_first_stream_is_reached_at_its_restart(tmp_path):
    """Worker 0 kills server 1 after registering, just before it opens its first stream to
    it. Before, it retried the dead server's address until the scheduler, hearing no
    heartbeat from it (they started once every stream was open), failed the job naming
    worker 0 (every run of a review's script). Now a restartable server's address is
    asked again before each retry, and the heartbeats start at registration."""
    done = launch(
        [
            *("-n", "2", "-s", "2", "--checkpoint-dir", str(tmp_path), "--max-restarts", "1"),
            *("--env", "AKV_BIGARRAY_BOUND=1024", "--", sys.executable),
            str(JOBS / "first_stream_kill.py"),
        ],
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"server 1 \(pid \d+\) exited with signal SIGKILL; restarting it", output)
    finals = printed(done, "ends")
    assert sorted(final["rank"] for final in finals) == [0, 1], output
    for final in finals:  # no optimizer: each round's sum of two pushes of ones
        assert final["ends"] == [2.0, 2.0], output
    # Retrying the dead server's Unix socket says so once, not at every retry.
    tried = re.findall(r"\[(worker \d)\].* no stream through (\S+) ", output)
    assert len(tried) == len(set(tried)), output
