"""What runs inside the job's Ray actors, driven directly as plain objects (no cluster)."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip(
    "ray", reason="akv.ray needs Ray: pip install -e '.[test]' (or 'akvstore[ray]')"
)

from akv.ray.actors import FunctionWorker, Poll, ProcessActor
from tests.akv.launch.support import alive

TIMEOUT_S = 20.0


def until_exit(actor: ProcessActor) -> Poll:
    """Poll until the process exited; every line seen on the way, in the last poll."""
    lines = []
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        poll = actor.poll()
        lines += poll.lines
        if poll.returncode is not None:
            return Poll(poll.pid, lines, poll.returncode)
        time.sleep(0.02)
    raise AssertionError("the process did not exit")


def test_a_process_gets_the_job_variables_without_stale_ones_and_its_lines_come_back(
    monkeypatch,
):
    monkeypatch.setenv("AKV_CHECKPOINT_DIR", "/stale/from/the/node")
    code = (
        "import os, sys\n"
        "print(os.environ['AKV_RANK'], os.environ.get('AKV_CHECKPOINT_DIR'))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.stdout.write('no newline')\n"
        "sys.exit(3)"
    )
    actor = ProcessActor(["<ray-python>", "-c", code], {"AKV_RANK": "1"}, os.getcwd())
    poll = until_exit(actor)
    assert poll.returncode == 3
    assert sorted(poll.lines) == [(1, b"1 None\n"), (1, b"no newline\n"), (2, b"to stderr\n")]
    assert actor.poll().lines == []  # each line is handed over once


def test_a_server_gets_its_node_address():
    code = "import os; print(os.environ['AKV_HOST'], os.environ['DMLC_NODE_HOST'])"
    actor = ProcessActor([sys.executable, "-c", code], {}, node_host="10.1.2.3")
    assert until_exit(actor).lines == [(1, b"10.1.2.3 10.1.2.3\n")]


def test_stop_ends_the_process_group_with_what_it_started():
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)"
    )
    actor = ProcessActor([sys.executable, "-c", code], {})
    deadline = time.monotonic() + TIMEOUT_S
    lines: list[tuple[int, bytes]] = []
    while not lines and time.monotonic() < deadline:
        lines = actor.poll().lines
        time.sleep(0.02)
    grandchild = int(lines[0][1])
    poll = actor.stop(grace_s=2.0)
    assert poll.returncode == -15  # SIGTERM
    deadline = time.monotonic() + TIMEOUT_S
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(grandchild)


def test_a_command_that_cannot_start_is_reported_not_raised():
    actor = ProcessActor(["/nonexistent/program"], {})
    poll = actor.poll()
    assert poll.pid is None and poll.start_error is not None
    text, not_found = poll.start_error
    assert not_found and "/nonexistent/program" in text


@pytest.fixture
def own_environ(monkeypatch):
    """A copy of the environment for a :class:`FunctionWorker` to change."""
    monkeypatch.setattr(os, "environ", dict(os.environ))


def test_a_function_worker_sets_the_job_variables_and_returns_the_value(own_environ, monkeypatch):
    monkeypatch.setenv("AKV_CHECKPOINT_DIR", "/stale")
    monkeypatch.setenv("AKV_RANK", "7")
    worker = FunctionWorker({"AKV_RANK": "1", "AKV_TOKEN": "t" * 32})
    result = worker.run(lambda x, y: (x + y, os.environ.get("AKV_CHECKPOINT_DIR")), (1,), {"y": 2})
    assert result.value == (3, None) and result.error is None
    assert os.environ["AKV_RANK"] == "1"


def test_a_function_worker_returns_the_exception_with_its_traceback(own_environ):
    def fails() -> None:
        raise KeyError("missing on purpose")

    result = FunctionWorker({}).run(fails, (), {})
    assert result.error == "KeyError: 'missing on purpose'"
    assert result.traceback is not None
    assert 'raise KeyError("missing on purpose")' in result.traceback
    assert FunctionWorker({}).run(lambda: sys.exit(0), (), {}).error is None
    assert FunctionWorker({}).run(lambda: sys.exit(2), (), {}).error == "SystemExit: 2"
