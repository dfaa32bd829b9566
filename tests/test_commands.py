"""What every akv command says about itself: --version, --log-level, `akv --help`, and
that `akv bench` speaks of targets, never of issue numbers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import akv
from akv.cli import BENCHMARKS, DESCRIPTION
from akv.cluster.roles import config_from_args, role_parser

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "akv": "akv",
    "akv-launch": "akv.launch",
    "akv-server": "akv.cluster.server",
    "akv-scheduler": "akv.cluster.scheduler",
}


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_name_and_akvs_version(command):
    done = run(COMMANDS[command], "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{command} {akv.__version__}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_a_log_level_and_refuses_a_wrong_one(command):
    assert "--log-level" in run(COMMANDS[command], "--help").stdout
    args = ["--log-level", "loud"] + (["-n", "1", "true"] if command == "akv-launch" else [])
    args += ["bench", "local"] if command == "akv" else []
    done = run(COMMANDS[command], *args)
    assert done.returncode == 2
    assert "--log-level='loud' is not a log level" in done.stderr


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_a_roles_log_level_flag_sets_its_level(role):
    env = {
        "AKV_SCHEDULER_HOST": "127.0.0.1",
        "AKV_SCHEDULER_PORT": "9091",
        "AKV_NUM_WORKERS": "1",
        "AKV_NUM_SERVERS": "1",
        "AKV_TOKEN": "t" * 32,
        "AKV_LOG_LEVEL": "ERROR",
    }
    args = role_parser(role, "").parse_args(["--log-level", "debug"])
    assert config_from_args(role, args, env).log_level == 10


def test_akv_help_says_what_akv_does_and_names_every_suite_and_command():
    done = run("akv", "--help")
    assert done.returncode == 0
    assert DESCRIPTION.splitlines()[0] in done.stdout
    for suite in BENCHMARKS:
        assert re.search(rf"^  {suite} +\S", done.stdout, re.M), suite
    for command in ("akv-launch", "akv-scheduler", "akv-server"):
        assert re.search(rf"^  {command} +\S", done.stdout, re.M), command


def _printed_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings: what it may print."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            docstrings.add(id(first.value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "akv" / "bench").glob("*.py")), ids=str)
def test_akv_bench_speaks_of_targets_not_of_issue_numbers(path):
    for text in _printed_strings(path):
        assert not re.search(r"\bissue\b|\bissue's\b|#\d", text, re.I), (path.name, text)
