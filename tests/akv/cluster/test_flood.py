"""A local process without the token floods the scheduler and a server with idle
connections (issue #24): 80 from 127.0.0.1, the address every process of the job comes
from, held open (one the server closes is opened again at once). Started before the job
registers, or in the middle of a run, it must not keep the job's own connections out: the
job ends with exit 0 and the right weights, its barriers and ``close()`` answered.

The job's processes are started by hand, so that the test knows the scheduler's and the
server's ports before they register; workers stream over TCP (``AKV_SHM=0``), so that
their streams come from 127.0.0.1 too. Every process is ended by its PID at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from akv_transport._http_client import CLIENT_KEEPALIVE_S
from tests.akv.cluster.cluster import ROOT, free_port, job_env
from tests.hostile import Flood

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).parent / "jobs"
#: Idle connections in each flood: past the 64 places strangers have per address.
FLOOD = 80
NUM_WORKERS = 2
#: What a worker of flood_rounds.py ends with: 8 rounds of SGD (learning rate 0.1) on the
#: sum of the workers' pushes (1 + 2), from zeros.
WEIGHTS = np.full(4, -0.1 * 3 * 8, np.float32)
START_S = 30.0
JOB_S = 120.0


class Job:
    """A scheduler, a server and workers, each started by hand when the test says, with
    the ports chosen in advance; their output goes to files under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.scheduler_port = free_port()
        self.server_port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "DMLC_"))},
            **job_env(NUM_WORKERS, 1, self.scheduler_port, AKV_SHM="0"),
            "AKV_PORT": str(self.server_port),
        }
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self._outputs: dict[str, IO[str]] = {}

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen[str]:
        output = self._outputs[name] = open(self.directory / f"{name}.out", "w")  # noqa: SIM115
        process = subprocess.Popen(
            argv,
            env={**self.env, **env},
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def start_scheduler(self) -> None:
        self.start(
            "scheduler", [sys.executable, "-m", "akv.cluster.scheduler"], AKV_ROLE="scheduler"
        )
        self.wait_listening("scheduler", self.scheduler_port)

    def start_server(self) -> None:
        argv = [sys.executable, "-m", "akv.cluster.server"]
        self.start("server", argv, AKV_ROLE="server", AKV_RANK="0")
        self.wait_listening("server", self.server_port)

    def start_workers(self, *args: str) -> None:
        for rank in range(NUM_WORKERS):
            argv = [sys.executable, str(JOBS / "flood_rounds.py"), *args]
            self.start(f"worker{rank}", argv, AKV_ROLE="worker", AKV_RANK=str(rank))

    def wait_listening(self, name: str, port: int) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert self.processes[name].poll() is None, self.report()
                assert time.monotonic() < deadline, f"{name} is not listening\n{self.report()}"
                time.sleep(0.05)

    def wait_output(self, name: str, text: str) -> None:
        deadline = time.monotonic() + JOB_S
        while text not in self.output(name):
            assert self.processes[name].poll() is None, self.report()
            assert time.monotonic() < deadline, f"{name} never said {text!r}\n{self.report()}"
            time.sleep(0.05)

    def wait_all(self) -> dict[str, int]:
        """Every process's exit status, once all ended (within the job's deadline)."""
        deadline = time.monotonic() + JOB_S
        for name, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still runs\n{self.report()}") from None
        return {name: process.returncode for name, process in self.processes.items()}

    def output(self, name: str) -> str:
        return (self.directory / f"{name}.out").read_text()

    def report(self) -> str:
        return "\n".join(f"--- {name}\n{self.output(name)}" for name in self.processes)

    def weights(self) -> list[Any]:
        return [
            json.loads(self.output(f"worker{rank}").strip().splitlines()[-1])["weights"]
            for rank in range(NUM_WORKERS)
        ]

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: its group is its PID
            process.wait(30)
        for output in self._outputs.values():
            output.close()


def assert_ended_well(job: Job) -> None:
    statuses = job.wait_all()
    assert statuses == dict.fromkeys(statuses, 0), f"{statuses}\n{job.report()}"
    for weights in job.weights():
        np.testing.assert_allclose(weights, WEIGHTS, rtol=1e-6)


def test_a_flood_started_before_the_job_registers_does_not_keep_it_out(tmp_path):
    with Job(tmp_path) as job:
        job.start_scheduler()
        with Flood(job.scheduler_port, FLOOD) as on_scheduler:
            on_scheduler.wait(opened=FLOOD)
            job.start_server()
            with Flood(job.server_port, FLOOD) as on_server:
                on_server.wait(opened=FLOOD)
                job.start_workers()
                assert_ended_well(job)
                # The flood held its connections all along: those past the strangers'
                # places were closed, and opened again.
                assert on_scheduler.closed >= FLOOD - 64 and on_server.closed >= FLOOD - 64


def test_a_flood_started_during_a_run_fails_no_barrier(tmp_path):
    go = tmp_path / "go"
    with Job(tmp_path) as job:
        job.start_scheduler()
        job.start_server()
        job.start_workers(str(go))
        for rank in range(NUM_WORKERS):
            job.wait_output(f"worker{rank}", f"rank {rank} halfway")
        with Flood(job.scheduler_port, FLOOD) as on_scheduler, Flood(job.server_port, FLOOD):
            on_scheduler.wait(opened=FLOOD)
            # Long enough for the workers' kept-alive connections to the scheduler to close:
            # the barriers to come need new ones, which come while the flood holds on.
            time.sleep(CLIENT_KEEPALIVE_S + 1)
            go.touch()
            assert_ended_well(job)
