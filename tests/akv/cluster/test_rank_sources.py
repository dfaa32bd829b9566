"""Where a worker's or server's rank comes from (Kubernetes' pod ordinal and completion
index among them), and what a script run without a job is told."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import akv
from akv.cluster import config as _config
from akv.errors import ConfigError, NoJobError

ROOT = Path(__file__).resolve().parents[3]
JOB = {
    "AKV_ROLE": "server",
    "AKV_SCHEDULER_HOST": "akv-scheduler",
    "AKV_SCHEDULER_PORT": "9091",
    "AKV_NUM_WORKERS": "3",
    "AKV_NUM_SERVERS": "3",
    "AKV_TOKEN": "t" * 32,
}


@pytest.mark.parametrize(
    ("hostname", "rank"),
    [("akv-server-2", 2), ("akv-server-0.akv-servers.default.svc.cluster.local", 0)],
)
def test_a_statefulset_pods_ordinal_is_its_rank(hostname, rank):
    env = {**JOB, "AKV_RANK_FROM": "hostname-ordinal", "HOSTNAME": hostname}
    assert _config.from_env(env).rank == rank


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"HOSTNAME": "trainer"}, r"the host name 'trainer' does not end in -N .* set AKV_RANK"),
        ({"HOSTNAME": "akv-server-3"}, r"rank 3 \(from AKV_RANK_FROM=hostname-ordinal, host "),
        ({"HOSTNAME": "akv-server-1", "AKV_RANK": "1"}, r"AKV_RANK and AKV_RANK_FROM are both"),
        ({"AKV_RANK_FROM": "pod-name"}, r"AKV_RANK_FROM='pod-name': set it to hostname-ordinal"),
    ],
)
def test_a_rank_from_the_hostname_that_cannot_be_had_is_named(changes, message):
    env = {**JOB, "AKV_RANK_FROM": "hostname-ordinal", **changes}
    with pytest.raises(ConfigError, match=message):
        _config.from_env(env)


def test_an_indexed_jobs_completion_index_is_a_workers_rank_and_akv_rank_wins():
    env = {**JOB, "AKV_ROLE": "worker", "JOB_COMPLETION_INDEX": "2"}
    assert _config.from_env(env).rank == 2
    assert _config.from_env({**env, "AKV_RANK": "1"}).rank == 1
    with pytest.raises(ConfigError, match=r"rank 5 \(from JOB_COMPLETION_INDEX\) is out of"):
        _config.from_env({**env, "JOB_COMPLETION_INDEX": "5"})


def test_the_scheduler_takes_no_rank_from_its_hostname():
    env = {**JOB, "AKV_RANK_FROM": "hostname-ordinal", "HOSTNAME": "akv-scheduler-0"}
    assert _config.from_env(env, role="scheduler").rank is None


def test_a_dist_store_without_any_job_variable_says_to_use_akv_launch():
    with pytest.raises(NoJobError) as caught:
        akv.create("dist_sync", environ={"PATH": "/usr/bin", "AKV_TOKEN": "t" * 32})
    message = str(caught.value)
    assert "akv-launch -n 2 -s 1 python train.py" in message
    for akv_name, mxnet_name in _config.JOB_VARIABLES:
        assert akv_name in message and mxnet_name in message
    assert isinstance(caught.value, ConfigError)


def test_one_job_variable_is_enough_to_get_the_missing_ones_named_instead():
    with pytest.raises(ConfigError, match=r"DMLC_ROLE \(or AKV_ROLE\) is not set") as caught:
        _config.from_env({"AKV_NUM_WORKERS": "2"})
    assert not isinstance(caught.value, NoJobError)


def test_a_script_run_without_the_launcher_exits_with_one_line_naming_akv_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import akv\nakv.create('dist_sync')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        "akv.errors.NoJobError: no distributed job is set up here"
    )
    assert "run the script with akv-launch" in done.stderr
