"""The job's configuration from the environment (:mod:`akv.dist.config`): pure, no I/O."""

from __future__ import annotations

import logging

import pytest

from akv.dist import config as _config
from akv.errors import ConfigError

TOKEN = "t" * 32


def env(**extra: str) -> dict[str, str]:
    base = {
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "9091",
        "DMLC_NUM_WORKER": "2",
        "DMLC_NUM_SERVER": "1",
        "AKV_TOKEN": TOKEN,
    }
    base.update(extra)
    return {k: v for k, v in base.items() if v != "<unset>"}


def test_mxnet_variables_configure_a_worker():
    config = _config.from_env(env())
    assert (config.role, config.scheduler_host, config.scheduler_port) == (
        "worker",
        "127.0.0.1",
        9091,
    )
    assert (config.num_workers, config.num_servers, config.rank) == (2, 1, None)
    assert config.scheduler_url == "http://127.0.0.1:9091"
    assert TOKEN not in repr(config)


def test_akv_twins_work_alone_and_agreeing_with_mxnet_names():
    config = _config.from_env(env(DMLC_NUM_WORKER="<unset>", AKV_NUM_WORKERS="3"))
    assert config.num_workers == 3
    assert _config.from_env(env(AKV_NUM_WORKERS="2")).num_workers == 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"DMLC_ROLE": "<unset>"}, r"DMLC_ROLE \(or AKV_ROLE\) is not set: set it to worker"),
        ({"DMLC_ROLE": "boss"}, r"is 'boss': set it to worker, server or scheduler"),
        ({"DMLC_PS_ROOT_URI": "<unset>"}, r"DMLC_PS_ROOT_URI \(or AKV_SCHEDULER_HOST\) is not set"),
        ({"DMLC_PS_ROOT_PORT": "http"}, r"DMLC_PS_ROOT_PORT='http' is not an integer"),
        ({"DMLC_PS_ROOT_PORT": "70000"}, r"is not a TCP port"),
        ({"DMLC_NUM_WORKER": "0"}, r"DMLC_NUM_WORKER=0 must be at least 1"),
        ({"DMLC_NUM_SERVER": "<unset>"}, r"DMLC_NUM_SERVER \(or AKV_NUM_SERVERS\) is not set"),
        ({"AKV_NUM_WORKERS": "3"}, r"AKV_NUM_WORKERS='3' contradicts DMLC_NUM_WORKER='2'"),
        ({"AKV_TOKEN": "<unset>"}, r"AKV_TOKEN is not set: .*akv-launch sets AKV_TOKEN"),
        ({"AKV_TOKEN": "short"}, r"AKV_TOKEN is too short"),
        ({"AKV_RANK": "2"}, r"rank 2 \(from AKV_RANK\) is out of range for 2 workers"),
        ({"AKV_TLS_CERT": "c.pem"}, r"AKV_TLS_CERT and AKV_TLS_KEY go together"),
        ({"AKV_ROUND_TIMEOUT_S": "-1"}, r"AKV_ROUND_TIMEOUT_S='-1' must be a positive number"),
        (
            {"MXNET_KVSTORE_BIGARRAY_BOUND": "many"},
            r"MXNET_KVSTORE_BIGARRAY_BOUND='many' is not a number of elements",
        ),
        # The variable named is the one that was read, whichever of the twins it is.
        (
            {"DMLC_PS_ROOT_PORT": "<unset>", "AKV_SCHEDULER_PORT": "0"},
            r"AKV_SCHEDULER_PORT=0 must be at least 1",
        ),
        (
            {"DMLC_NUM_SERVER": "<unset>", "AKV_NUM_SERVERS": "x"},
            r"AKV_NUM_SERVERS='x' is not an integer",
        ),
        ({"AKV_BIGARRAY_BOUND": "inf"}, r"AKV_BIGARRAY_BOUND='inf' is not a number of elements"),
        ({"AKV_PORT": "70000"}, r"AKV_PORT=70000 is out of range: set it to a TCP port"),
        (
            {"AKV_LOG_LEVEL": "verbose"},
            r"AKV_LOG_LEVEL='verbose' is not a log level: set it to DEBUG",
        ),
    ],
)
def test_bad_configuration_names_the_variable(changes, message):
    with pytest.raises(ConfigError, match=message):
        _config.from_env(env(**changes))


def test_rank_comes_from_mpi_or_slurm_when_akv_rank_is_absent():
    assert _config.from_env(env(OMPI_COMM_WORLD_RANK="1")).rank == 1
    assert _config.from_env(env(SLURM_PROCID="0")).rank == 0
    assert _config.from_env(env(AKV_RANK="0", PMI_RANK="1")).rank == 0


def test_a_schedulers_rank_variables_are_ignored():
    assert _config.from_env(env(DMLC_ROLE="scheduler", AKV_RANK="7")).rank is None


def test_bigarray_bound_reads_mxnets_variable_and_timeouts_are_configurable():
    config = _config.from_env(env(MXNET_KVSTORE_BIGARRAY_BOUND="1e3", AKV_BARRIER_TIMEOUT_S="2.5"))
    assert config.bigarray_bound == 1000
    assert config.timeouts.barrier_s == 2.5


def test_an_empty_node_host_means_the_default():
    assert _config.from_env(env(AKV_HOST="")).host == "127.0.0.1"
    assert _config.from_env(env(DMLC_NODE_HOST="10.0.0.2")).host == "10.0.0.2"


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("<unset>", logging.INFO),
        ("debug", logging.DEBUG),
        ("Warning", logging.WARNING),
        (" ERROR ", logging.ERROR),
        ("CRITICAL", logging.CRITICAL),
        ("15", 15),
    ],
)
def test_log_level_takes_a_level_name_in_any_case_or_a_number(value, level):
    assert _config.from_env(env(AKV_LOG_LEVEL=value)).log_level == level


def test_every_twin_pair_is_an_akv_name_and_an_mxnet_name():
    akv_names = [akv for akv, _ in _config.TWIN_VARIABLES]
    assert len(set(akv_names)) == len(akv_names)
    for akv, mxnet in _config.TWIN_VARIABLES:
        assert akv.startswith("AKV_") and mxnet.startswith("DMLC_")
