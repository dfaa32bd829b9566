"""docs/deployment.md's "by hand" recipe works as written: its commands, run on 127.0.0.1.

Each command of the recipe runs in a shell of its own after the recipe's ``export`` lines,
with the hosts, the port and the token's path swapped for local ones. Every process is
bounded in time and ended by its own process group id if it overstays.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.akv.cluster.cluster import FAST_TIMEOUTS, ROOT, free_port

DOC = ROOT / "docs" / "deployment.md"
SECTION = "## By hand, on three hosts"
WORKER_S = 90
ROLE_S = 30
pytestmark = pytest.mark.timeout(WORKER_S + ROLE_S + 60)

TRAIN = """
import json

import numpy as np

import akv

with akv.create("dist_sync") as kv:
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.full(4, kv.rank + 1, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull("w", out=out)
    print(json.dumps({"rank": kv.rank, "sum": float(out[0])}), flush=True)
"""


def recipe() -> tuple[list[str], list[str]]:
    """The recipe's ``export`` lines, and its commands (one process each), as written."""
    section = DOC.read_text().split(SECTION, 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert match, f"{DOC} has no bash block under {SECTION!r}"
    exports, commands = [], []
    for line in match.group(1).splitlines():
        code = line.split("#", 1)[0].strip()
        if code:
            (exports if code.startswith("export ") else commands).append(code)
    return exports, commands


def test_every_worker_command_of_the_recipe_sets_the_role():
    _, commands = recipe()
    workers = [c for c in commands if not c.startswith(("akv-scheduler", "akv-server"))]
    assert workers, commands
    for command in workers:
        assert re.match(r"(\w+=\S+ )*(AKV|DMLC)_ROLE=worker ", command), command


def localize(line: str, port: int, token_file: Path) -> str:
    """The recipe's line on 127.0.0.1, with a free port and a token file of the test's."""
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        line = line.replace(host, "127.0.0.1")
    line = line.replace("AKV_SCHEDULER_PORT=9091", f"AKV_SCHEDULER_PORT={port}")
    return line.replace("/run/secrets/akv-token", str(token_file))


def test_the_recipe_runs_a_job_to_its_end_on_one_host(tmp_path):
    bin_dir = Path(sys.executable).parent
    if not all((bin_dir / name).exists() for name in ("akv-scheduler", "akv-server")):
        # The recipe's commands are the ones `pip install` makes (the test command does).
        pytest.skip(f"akv is not installed beside {sys.executable}: pip install -e .")
    exports, commands = recipe()
    text = "\n".join(exports + commands)
    for written in ("10.0.0.1", "AKV_SCHEDULER_PORT=9091", "/run/secrets/akv-token"):
        assert written in text, f"the recipe changed: update this test ({written!r} is gone)"
    token_file = tmp_path / "akv-token"
    token_file.write_text(secrets.token_hex(32) + "\n")
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "DMLC_"))}
    env.update(FAST_TIMEOUTS)
    # The recipe's `python`, `akv-scheduler` and `akv-server` are this interpreter's.
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    prelude = "\n".join(localize(line, port, token_file) for line in exports)
    processes: list[tuple[str, subprocess.Popen, Path]] = []
    try:
        for number, command in enumerate(commands):
            script = f"set -e\n{prelude}\n{localize(command, port, token_file)}\n"
            log = tmp_path / f"process-{number}.log"
            with log.open("w") as output:
                process = subprocess.Popen(
                    ["bash", "-c", script],
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=tmp_path,
                    start_new_session=True,
                )
            processes.append((command, process, log))
        workers = [p for p in processes if "train.py" in p[0]]
        others = [p for p in processes if "train.py" not in p[0]]
        codes = {}
        for group, limit_s in ((workers, WORKER_S), (others, ROLE_S)):
            for command, process, _ in group:
                try:
                    codes[command] = process.wait(timeout=limit_s)
                except subprocess.TimeoutExpired:
                    codes[command] = f"still running after {limit_s} s"
        logs = "\n".join(f"--- {c}\n{log.read_text()}" for c, _, log in processes)
        assert all(code == 0 for code in codes.values()), f"{codes}\n{logs}"
    finally:
        for _, process, _ in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
    results = sorted(
        (
            json.loads(line)
            for _, _, log in workers
            for line in log.read_text().splitlines()
            if line.startswith("{")
        ),
        key=lambda result: result["rank"],
    )
    assert results == [{"rank": 0, "sum": 3.0}, {"rank": 1, "sum": 3.0}], logs
    scheduler_log = next(log for c, _, log in processes if c.startswith("akv-scheduler"))
    assert f"listening on 127.0.0.1:{port}" in scheduler_log.read_text()
