"""Real akv jobs through akv-launch: the status page's address, who has joined while the
job assembles, the per-process summary, what each worker gets (its ranks, its GPU), and
the per-node mode with one launcher per node."""

from __future__ import annotations

import io
import os
import re
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from akv.cluster import config as _config
from akv.errors import LaunchError
from akv.launch.args import LaunchOptions, parse_args
from akv.launch.command import launch
from akv.launch.watch import AssemblyWatch
from tests.akv.cluster.cluster import FAST_TIMEOUTS, free_port
from tests.akv.launch.support import SUMMARY_HEADER, TOKEN

pytestmark = pytest.mark.timeout(60)

WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import akv
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    print("vars", " ".join(f"{n}={os.environ.get(n)}" for n in names))
    gate = os.environ.get("TEST_GATE")
    if gate and os.environ["AKV_RANK"] == "1":  # joins once the launcher said it waits
        deadline = time.monotonic() + 20
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                sys.exit(7)
            time.sleep(0.05)
    with akv.create("dist_sync") as kv:
        kv.init(0, np.zeros(2, np.float32))
        time.sleep(1.5)  # the launcher asks who has joined every 0.5 s: let it see the job
    """
)
NVIDIA_SMI = (
    "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-a)'\necho 'GPU 1: Fake GPU (UUID: GPU-b)'\n"
)


class Gate(io.BytesIO):
    """The launcher's stderr; creates ``path`` when a write holds ``trigger``."""

    def __init__(self, path: Path, trigger: bytes) -> None:
        super().__init__()
        self.path, self.trigger = path, trigger

    def write(self, data) -> int:  # type: ignore[override]
        if self.trigger in bytes(data):
            self.path.touch()
        return super().write(data)


def environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST_TIMEOUTS, "AKV_TOKEN": TOKEN, **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_the_launcher_says_who_has_joined_and_sums_up_every_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    gate = tmp_path / "gate"
    env = environ(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TEST_GATE=str(gate))
    out, err = io.BytesIO(), Gate(gate, b"waiting for worker 1")
    options = LaunchOptions(2, 1, (sys.executable, str(script)), grace_s=10)
    code = launch(options, env, stdout=out, stderr=err, terminate_grace_s=1.0)
    text = err.getvalue().decode()
    assert code == 0, text + out.getvalue().decode()
    port = re.search(
        r"akv-launch: the job's status page: http://127\.0\.0\.1:(\d+)/status \(it asks for "
        r"the job's token\)\n",  # exported: the user knows it
        text,
    )
    assert port is not None, text
    assert "akv-launch: 1/2 workers joined; waiting for worker 1\n" in text
    assert re.search(r"akv-launch: every process joined: 1 server and 2 workers, in [\d.]+ s", text)
    assert TOKEN not in text
    table = text[text.index(SUMMARY_HEADER) :].splitlines()
    assert table[0].split() == ["akv-launch:", "role", "rank", "exit", "run", "time", "restarts"]
    rows = [line.split() for line in table[1:]]
    assert [(row[1], row[2], row[3], row[-1]) for row in rows] == [
        ("scheduler", "-", "0", "0"),
        ("server", "0", "0", "0"),
        ("worker", "0", "0", "0"),
        ("worker", "1", "0", "0"),
    ]
    printed = sorted(re.findall(r"\[worker \d\] vars (.*)", out.getvalue().decode()))
    master = f"MASTER_ADDR=127.0.0.1 MASTER_PORT={int(port.group(1)) + 1}"
    assert printed == [
        f"RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 {master} CUDA_VISIBLE_DEVICES=0",
        f"RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 {master} CUDA_VISIBLE_DEVICES=1",
    ]


def test_the_per_node_mode_runs_one_job_from_a_launcher_on_each_node(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    scheduler = f"127.0.0.1:{free_port()}"

    def node(rank: int) -> list[str]:
        return ["--nnodes", "2", "--node-rank", str(rank), "--scheduler", scheduler]

    command = ["--nproc-per-node", "1", sys.executable, str(script)]
    results: dict[int, tuple[int, str, str]] = {}

    def run(rank: int) -> None:
        out, err = io.BytesIO(), io.BytesIO()
        options = parse_args([*node(rank), *command])
        code = launch(options, environ(tmp_path), stdout=out, stderr=err, terminate_grace_s=1.0)
        results[rank] = (code, out.getvalue().decode(), err.getvalue().decode())

    other = threading.Thread(target=run, args=(1,))
    other.start()
    run(0)
    other.join(30)
    assert sorted(results) == [0, 1]
    for rank, (code, out, err) in results.items():
        assert code == 0, f"node {rank}:\n{out}\n{err}"
        assert "every process joined: 2 servers and 2 workers" in err
    summaries = {rank: err[err.index(SUMMARY_HEADER) :] for rank, (_, _, err) in results.items()}
    roles = {
        rank: re.findall(r"akv-launch: (\w+) +(\S+) +0 ", text) for rank, text in summaries.items()
    }
    assert roles == {
        0: [("scheduler", "-"), ("server", "0"), ("worker", "0")],
        1: [("server", "1"), ("worker", "1")],
    }
    assert "[worker 1] vars RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1" in results[1][1]


def test_the_per_node_mode_needs_the_same_token_on_every_node(tmp_path):
    options = parse_args(["--nnodes", "1", "--scheduler", "127.0.0.1:1", "-n", "1", "x"])
    env = environ(tmp_path)
    del env["AKV_TOKEN"]
    with pytest.raises(LaunchError, match="needs the same AKV_TOKEN: generate one with"):
        launch(options, env, stdout=io.BytesIO(), stderr=io.BytesIO())


def test_above_info_the_watch_prints_only_the_status_pages_address():
    config = _config.from_env(
        {
            "AKV_SCHEDULER_HOST": "127.0.0.1",
            "AKV_SCHEDULER_PORT": str(free_port()),
            "AKV_NUM_WORKERS": "1",
            "AKV_NUM_SERVERS": "1",
            "AKV_TOKEN": TOKEN,
        },
        role="scheduler",
    )
    said: list[str] = []
    for token_made in (False, True):
        watch = AssemblyWatch(config, progress=False, token_made=token_made)
        watch.start(said.append)
        watch.stop()
    page = f"the job's status page: http://127.0.0.1:{config.scheduler_port}/status"
    assert said == [
        f"{page} (it asks for the job's token)",
        # A token the launcher made is never printed: the line says how to know one.
        f"{page} (it asks for the job's token, made for this job only: export AKV_TOKEN "
        "before akv-launch to know it)",
    ]


QUITTER = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["AKV_RANK"] == "1":
        sys.exit(3)  # before it joins
    time.sleep(3)  # past the progress lines' delay, the job failed meanwhile
    """
)


def test_who_has_joined_is_no_longer_said_once_a_process_exited(tmp_path):
    # A process's exit ends what who-has-joined can tell: the launcher said "waiting for
    # worker 1" after worker 1 had failed, or joined and died (found by a review).
    script = tmp_path / "quitter.py"
    script.write_text(QUITTER)
    err = io.BytesIO()
    options = LaunchOptions(2, 1, (sys.executable, str(script)), grace_s=10)
    code = launch(options, environ(tmp_path), stdout=io.BytesIO(), stderr=err)
    text = err.getvalue().decode()
    assert code == 3, text
    after = text[text.index("akv-launch: worker 1 (pid") :]
    assert " joined" not in after, text
