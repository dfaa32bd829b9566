"""``akv-launch --launcher ray`` without a Ray cluster: its flags, ``--dry-run``, and the
rule that only :mod:`akv.ray` imports Ray."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from akv.errors import LaunchError
from akv.launch.args import parse_args
from akv.launch.command import launch
from tests.akv.cluster.cluster import ROOT

COMMAND = ["--", "python", "train.py"]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_importing_akv_and_its_launcher_does_not_import_ray():
    done = run_python(
        "import sys, akv, akv.launch, akv.launch.command, akv.launch.ray_hook\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "print('ok')"
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_the_ray_launcher_without_ray_says_which_extra_to_install():
    # sys.modules["ray"] = None makes `import ray` fail, as where Ray is not installed.
    done = run_python(
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from akv.launch import main\n"
        "sys.exit(main(['--launcher', 'ray', '-n', '1', '-s', '1', '--', 'true']))"
    )
    assert done.returncode == 2, done.stderr
    assert "--launcher ray needs Ray" in done.stderr
    assert "pip install 'akvstore[ray]'" in done.stderr


def test_ray_address_is_only_for_the_ray_launcher():
    with pytest.raises(LaunchError, match="--ray-address is for --launcher ray"):
        parse_args(["-n", "1", "--ray-address", "10.0.0.1:6379", *COMMAND])
    options = parse_args(["--launcher", "ray", "-n", "2", "--ray-address", "h:6379", *COMMAND])
    assert (options.launcher, options.ray_address) == ("ray", "h:6379")


@pytest.mark.parametrize(
    "flags",
    [
        ["-H", "hosts.txt"],
        ["--scheduler-host", "10.0.0.1"],
        ["--python", "python3"],
    ],
)
def test_placement_flags_are_refused_under_ray(flags):
    with pytest.raises(LaunchError, match=r"is not for --launcher ray: Ray places every"):
        parse_args(["--launcher", "ray", "-n", "1", *flags, *COMMAND])


def test_server_restarts_are_allowed_under_ray_with_a_checkpoint_directory():
    options = parse_args(
        ["--launcher", "ray", "-n", "1", "--checkpoint-dir", "ck", "--max-restarts", "2", *COMMAND]
    )
    assert options.max_restarts == 2
    with pytest.raises(LaunchError, match="needs --checkpoint-dir"):
        parse_args(["--launcher", "ray", "-n", "1", "--max-restarts", "1", *COMMAND])


def test_dry_run_shows_every_actor_with_the_token_masked():
    out = io.BytesIO()
    options = parse_args(["--launcher", "ray", "--dry-run", "-n", "2", "-s", "1", *COMMAND])
    token = "ab" * 32
    assert launch(options, {"AKV_TOKEN": token}, stdout=out) == 0
    text = out.getvalue().decode()
    assert token not in text
    assert "AKV_TOKEN=<masked>" in text
    assert "# --launcher ray: each process runs in a Ray actor" in text
    assert "'<ray-python>' -m akv.cluster.scheduler" in text
    assert "'<ray-python>' -m akv.cluster.server" in text
    for label in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert f"# {label}\n" in text
    assert "AKV_ROLE=worker DMLC_ROLE=worker" in text
