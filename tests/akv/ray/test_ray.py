"""Jobs on a local Ray instance: ``akv.ray.launch`` and ``akv-launch --launcher ray``.

One Ray instance (``ray.init(num_cpus=4)``: logical CPUs, on any machine; a job with the
default resources, two workers and one server, takes 3.01 of them) serves every test of the
module and is shut down at its end. After each job, no actor of it may be left
(``ray.util.list_named_actors``: akv names every actor ``akv-<job>-<role>[-<rank>]``).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

ray = pytest.importorskip(
    "ray", reason="the Ray tests need Ray: pip install -e '.[test]' (or 'akvstore[ray]')"
)

import akv  # noqa: E402
import akv.ray  # noqa: E402
from akv.launch.args import parse_args  # noqa: E402
from akv.launch.command import launch as akv_launch  # noqa: E402
from tests.akv.cluster.cluster import FAST_TIMEOUTS, ROOT, TRAIN_ACCURACY_BAND  # noqa: E402
from tests.akv.launch.support import alive  # noqa: E402
from tests.akv.ray import jobs  # noqa: E402
from tests.test_docs import blocks, run  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: examples/train_dist.py prints this last.
FINAL = re.compile(
    r"^\[worker (\d)\] worker \d: loss ([0-9.]+) -> ([0-9.]+) in .*, test accuracy ([0-9.]+)$", re.M
)


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[str]:
    """A local Ray instance for the module; its address."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def akv_actors() -> list[str]:
    return [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("akv-")
    ]


def in_band(accuracy: float) -> bool:
    return TRAIN_ACCURACY_BAND[0] <= accuracy <= TRAIN_ACCURACY_BAND[1]


def test_the_training_example_runs_under_akv_ray_launch_as_docs_ray_md_shows():
    namespace, printed = run(blocks("ray.md")[0], "docs/ray.md")
    results = namespace["results"]
    assert [result["rank"] for result in results] == [0, 1]
    for result in results:
        assert result["last_loss"] < result["first_loss"]
        assert in_band(result["accuracy"]), result
    assert results[0]["accuracy"] == results[1]["accuracy"]  # both pulled the same weights
    assert printed == [str([result["accuracy"] for result in results])]
    assert akv_actors() == []


def test_the_training_example_runs_under_akv_launch_with_the_ray_launcher(ray_instance):
    # The command as a user types it, on the module's Ray instance (--ray-address).
    fast = [f"{name}={value}" for name, value in FAST_TIMEOUTS.items()]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "akv.launch", "--launcher", "ray"),
            *("--ray-address", ray_instance),
            *("-n", "2", "-s", "1", "--grace-s", "5", "--env", *fast, "--"),
            *(sys.executable, "examples/train_dist.py", "--epochs", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    finals = FINAL.findall(done.stdout)
    assert sorted(rank for rank, *_ in finals) == ["0", "1"], output
    for _, first, last, accuracy in finals:
        assert float(last) < float(first)
        assert in_band(float(accuracy)), output
    assert re.search(r"\[scheduler\] .*akv-scheduler listening on 127\.0\.0\.1:(\d+)", output)
    for rank in (0, 1):
        assert re.search(rf"akv-launch: worker {rank} \(pid \d+\) exited with code 0", output)
    # What akv-launch says of a local job, it says of a job on Ray: the status page (the
    # scheduler's own address), who joined, and the closing table of every process.
    port = re.search(r"akv-scheduler listening on 127\.0\.0\.1:(\d+)", output).group(1)
    assert f"akv-launch: the job's status page: http://127.0.0.1:{port}/status (" in output
    assert re.search(r"akv-launch: every process joined: 1 server and 2 workers, in ", output)
    assert table(done.stderr) == [
        ["role", "rank", "exit", "run", "time", "restarts"],
        ["scheduler", "-", "0", "0"],
        ["server", "0", "0", "0"],
        ["worker", "0", "0", "0"],
        ["worker", "1", "0", "0"],
    ]
    assert akv_actors() == []


def table(messages: str, name: str = "akv-launch") -> list[list[str]]:
    """The closing table in the launcher's ``messages`` (lines ``{name}: ...``): each
    line's words, run times left out (``1.2 s``)."""
    lines = messages.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}: role "))
    rows = []
    for line in lines[start:]:
        if not line.startswith(f"{name}: "):
            break
        text = re.sub(r"\s\d+\.\d s\b|\s\d+ min \d\d s\b", "", line.removeprefix(f"{name}: "))
        rows.append(text.split())
        if len(rows) == 5:
            break
    return rows


def test_a_worker_exception_fails_the_launch_with_its_traceback_and_no_actor_survives(capsys):
    with pytest.raises(akv.JobFailedError) as caught:
        akv.ray.launch(jobs.fail_on_rank_1, num_workers=2, num_servers=1)
    # The driver told the scheduler (the worker never joined), under its own name.
    verdict = "akv.ray: the scheduler's verdict: the job failed: worker 1 raised ValueError"
    messages = capsys.readouterr().err
    assert verdict in messages and "(seen by akv.ray.launch)" in messages, messages
    error = caught.value
    assert (error.role, error.rank) == ("worker", 1)
    assert "worker 1 raised ValueError: rank 1 fails on purpose" in str(error)
    assert error.remote_traceback is not None
    assert 'raise ValueError("rank 1 fails on purpose")' in error.remote_traceback
    assert "jobs.py" in error.remote_traceback
    assert akv_actors() == []


def test_a_worker_raising_with_its_store_open_fails_the_others_at_once(tmp_path):
    # The actor outlives the function: the store it left open leaves the job as failed,
    # as at a process's exit, so worker 0's barrier fails naming worker 1 (it waited there
    # until the driver stopped the job).
    report = tmp_path / "rank0.txt"
    with pytest.raises(akv.JobFailedError) as caught:
        akv.ray.launch(
            jobs.fail_with_a_store_open, num_workers=2, num_servers=1, args=(str(report),)
        )
    assert (caught.value.role, caught.value.rank) == ("worker", 1)
    outcome = report.read_text()
    assert "worker 1" in outcome and "left the job" in outcome, outcome
    assert "ValueError: rank 1 fails with its store open" in outcome, outcome
    assert akv_actors() == []


def test_a_server_killed_by_pid_restarts_from_its_checkpoint_and_the_job_completes(
    tmp_path, capsys
):
    rounds = 30
    results = akv.ray.launch(
        jobs.sum_through_a_restart,
        num_workers=2,
        num_servers=1,
        kwargs={"rounds": rounds, "kill_at": 10},
        env=FAST_TIMEOUTS,
        checkpoint_dir=str(tmp_path),
        max_restarts=1,
    )
    for result in results:
        assert result["values"] == [-3.0 * rounds]  # every push counted once: none lost
    killed, after = results[0]["killed"], results[0]["servers"]
    assert len(killed) == 1 and after != killed and not alive(killed[0])
    assert (tmp_path / "server-0.akvckpt").exists()
    messages = capsys.readouterr().err
    assert re.search(
        r"akv\.ray: server 0 \(pid \d+\) exited with signal SIGKILL; restarting it from its "
        r"checkpoint \(restart 1 of 1\)",
        messages,
    ), messages
    assert re.search(r"akv\.ray: server 0 \(pid \d+\) started again by Ray", messages), messages
    assert re.search(r"\[server 0\] .*server 0 restored checkpoint \d+", messages), messages
    page = re.search(
        r"^akv\.ray: the job's status page: http://127\.0\.0\.1:\d+/status (.*)$", messages, re.M
    )
    assert page is not None, messages
    if "AKV_TOKEN" not in os.environ:  # the token was made for the job: the line says so
        assert "export AKV_TOKEN before akv.ray.launch to know it" in page.group(1)
    assert ["server", "0", "0", "1"] in table(messages, "akv.ray"), messages
    assert akv_actors() == []


def test_a_failing_command_fails_akv_launch_naming_its_rank(tmp_path):
    fails_on_rank_1 = (
        "import os, sys; rank = os.environ['AKV_RANK']; print('rank', rank); "
        "sys.exit(3 if rank == '1' else 0)"
    )
    options = parse_args(
        [
            *("--launcher", "ray", "-n", "2", "-s", "1", "--log-dir", str(tmp_path / "logs")),
            *("--", sys.executable, "-c", fails_on_rank_1),
        ]
    )
    out, err = io.BytesIO(), io.BytesIO()
    code = akv_launch(options, stdout=out, stderr=err)
    messages = err.getvalue().decode()
    assert code == 3, messages
    assert re.search(r"akv-launch: worker 1 \(pid \d+\) exited with code 3", messages), messages
    assert "[worker 1] rank 1\n" in out.getvalue().decode()
    # The launcher told the scheduler (the workers never joined, so it saw nothing itself),
    # and its verdict names worker 1, after the closing table.
    assert ["worker", "1", "3", "0"] in table(messages), messages
    assert messages.rstrip().endswith(
        "akv-launch: the scheduler's verdict: the job failed: worker 1 exited with code 3 "
        "(seen by akv-launch)"
    ), messages
    log = tmp_path / "logs" / "worker-1.log"
    assert log.read_text() == "[worker 1] rank 1\n"
    assert log.stat().st_mode & 0o777 == 0o600
    assert akv_actors() == []


def test_a_command_that_raises_ends_akv_launch_with_its_traceback(tmp_path):
    raises_on_rank_1 = (
        "import os\n"
        "if os.environ['AKV_RANK'] == '1':\n"
        "    raise ValueError('rank 1 fails on purpose')"
    )
    options = parse_args(
        ["--launcher", "ray", "-n", "2", "-s", "1", "--", sys.executable, "-c", raises_on_rank_1]
    )
    err = io.BytesIO()
    code = akv_launch(options, stdout=io.BytesIO(), stderr=err)
    messages = err.getvalue().decode()
    assert code == 1, messages
    assert ["worker", "1", "1", "0"] in table(messages), messages
    # Last, where a person looks first: the failing worker's traceback, from its stderr.
    traceback = messages[messages.rindex("akv-launch: worker 1's traceback:") :].splitlines()
    assert traceback[1] == "    Traceback (most recent call last):", messages
    assert traceback[-1] == "    ValueError: rank 1 fails on purpose", messages
    assert akv_actors() == []
