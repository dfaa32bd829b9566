"""The job's configuration from the environment (:mod:`akv.cluster.config`): pure, no I/O."""

from __future__ import annotations

import logging

import pytest

from akv.cluster import config as _config
from akv.errors import ConfigError
from akv_transport import KeepAlive

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
        ({"AKV_PULL_AHEAD": "yes"}, r"AKV_PULL_AHEAD='yes': set it to 1 \(on\) or 0 \(off\)"),
        ({"AKV_SCHED_BATCH": "on"}, r"AKV_SCHED_BATCH='on': set it to 1 \(on\) or 0 \(off\)"),
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


def test_the_network_thread_is_batch_scheduled_unless_akv_sched_batch_is_0():
    assert _config.from_env(env()).sched_batch
    assert _config.from_env(env(AKV_SCHED_BATCH="1")).sched_batch
    assert not _config.from_env(env(AKV_SCHED_BATCH="0")).sched_batch


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


def test_the_streams_liveness_is_configurable_and_must_leave_an_idle_peer_time():
    assert _config.from_env(env()).timeouts.keepalive == KeepAlive(5.0, 20.0)
    config = _config.from_env(env(AKV_STREAM_KEEPALIVE_S="1", AKV_STREAM_SILENT_S="4"))
    assert config.timeouts.keepalive == KeepAlive(1.0, 4.0)
    with pytest.raises(ConfigError, match="AKV_STREAM_SILENT_S=3 must be at least twice"):
        _config.from_env(env(AKV_STREAM_KEEPALIVE_S="2", AKV_STREAM_SILENT_S="3"))
    with pytest.raises(ConfigError, match="AKV_STREAM_SILENT_S"):
        _config.from_env(env(AKV_STREAM_SILENT_S="0"))


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


# ------------------------------------------------------------------ advertised addresses


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("10.0.0.2:9000", ("10.0.0.2", 9000)),
        ("10.0.0.2", ("10.0.0.2", None)),
        ("node-1.example.com:1", ("node-1.example.com", 1)),
        ("gateway", ("gateway", None)),
        ("[::1]:9000", ("::1", 9000)),
        ("[fd00::2]", ("fd00::2", None)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ],
)
def test_parse_address_takes_host_host_port_and_bracketed_ipv6(text, address):
    assert _config.parse_address(text, "AKV_ADVERTISE") == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("::1", r"AKV_ADVERTISE='::1': an IPv6 address goes in brackets, as in \[::1\]"),
        ("fd00::2:9000", "an IPv6 address goes in brackets"),
        ("[nope]:9000", r"'nope' in brackets is not an IPv6 address"),
        ("[::1]9000", r"is not \[IPv6\] or \[IPv6\]:PORT"),
        ("[::1]:", r"'' is not a TCP port \(1-65535\)"),
        ("host:", r"AKV_ADVERTISE='host:': '' is not a TCP port"),
        ("host:0", r"'0' is not a TCP port \(1-65535\)"),
        ("host:65536", r"'65536' is not a TCP port"),
        ("host:http", r"'http' is not a TCP port"),
        (":9000", r"AKV_ADVERTISE=':9000' is not a host name or IP address"),
        ("two words", r"is not a host name or IP address; set it to HOST, HOST:PORT"),
        ("-oProxy", r"is not a host name or IP address"),
        ("0.0.0.0:9000", r"AKV_ADVERTISE='0.0.0.0:9000' is a wildcard address"),
        ("[::]", r"is a wildcard address, which no worker can connect to"),
    ],
)
def test_a_bad_address_names_the_variable_and_the_forms(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        _config.parse_address(text, "AKV_ADVERTISE")
    assert "AKV_ADVERTISE=" in str(info.value)


def test_format_address_brackets_ipv6():
    assert _config.format_address("10.0.0.2", 9000) == "10.0.0.2:9000"
    assert _config.format_address("::1", 9000) == "[::1]:9000"


def test_is_wildcard_knows_every_spelling_of_every_interface():
    assert all(map(_config.is_wildcard, ["0.0.0.0", "::", "[::]", " 0.0.0.0 ", "0:0::0"]))
    assert not any(map(_config.is_wildcard, ["127.0.0.1", "::1", "localhost", "", "0"]))


def server_env(**extra: str) -> dict[str, str]:
    return env(DMLC_ROLE="server", **extra)


def test_a_server_advertises_its_bound_address_by_default_with_the_port_it_bound():
    config = _config.from_env(server_env(AKV_HOST="10.0.0.2", AKV_PORT="0"))
    assert (config.advertise_host, config.advertise_port) == (None, None)
    assert config.advertised(41234) == ("10.0.0.2", 41234)


def test_akv_advertise_sets_the_host_and_port_or_the_host_alone():
    config = _config.from_env(server_env(AKV_PORT="9000", AKV_ADVERTISE="203.0.113.7:19000"))
    assert (config.host, config.port) == ("127.0.0.1", 9000)
    assert config.advertised(9000) == ("203.0.113.7", 19000)
    host_only = _config.from_env(server_env(AKV_ADVERTISE="gateway"))
    assert host_only.advertised(41234) == ("gateway", 41234)
    ipv6 = _config.from_env(server_env(AKV_ADVERTISE="[fd00::2]:9000"))
    assert ipv6.advertised(1) == ("fd00::2", 9000)


def test_an_empty_akv_advertise_means_the_bound_address():
    config = _config.from_env(server_env(AKV_ADVERTISE="  "))
    assert config.advertised(5) == ("127.0.0.1", 5)


def test_a_bad_akv_advertise_is_refused_for_every_role():
    for role in ("worker", "server", "scheduler"):
        with pytest.raises(ConfigError, match="AKV_ADVERTISE='::1': an IPv6 address goes"):
            _config.from_env(env(DMLC_ROLE=role, AKV_ADVERTISE="::1"))


@pytest.mark.parametrize(
    ("bound", "name"),
    [
        ({"AKV_HOST": "0.0.0.0"}, "AKV_HOST='0.0.0.0'"),
        ({"DMLC_NODE_HOST": "::"}, "DMLC_NODE_HOST='::'"),
    ],
)
def test_a_server_that_binds_a_wildcard_without_akv_advertise_is_refused(bound, name):
    with pytest.raises(ConfigError) as info:
        _config.from_env(server_env(**bound))
    message = str(info.value)
    assert message.startswith(
        "AKV_ADVERTISE is not set, and this server binds the wildcard address " + name
    )
    assert "set AKV_ADVERTISE to the address the workers reach this server at" in message


def test_a_server_that_binds_a_wildcard_with_akv_advertise_advertises_that():
    config = _config.from_env(server_env(AKV_HOST="0.0.0.0", AKV_ADVERTISE="10.0.0.2"))
    assert (config.host, config.advertised(4000)) == ("0.0.0.0", ("10.0.0.2", 4000))


def test_only_a_server_is_refused_a_wildcard_bind():
    # A worker binds nothing; the scheduler listens on AKV_SCHEDULER_HOST.
    for role in ("worker", "scheduler"):
        assert _config.from_env(env(DMLC_ROLE=role, AKV_HOST="0.0.0.0")).host == "0.0.0.0"


def test_a_server_config_made_in_code_never_advertises_a_wildcard():
    config = _config.Config(
        role="server",
        scheduler_host="127.0.0.1",
        scheduler_port=1,
        num_workers=1,
        num_servers=1,
        token=TOKEN,
        host="::",
    )
    with pytest.raises(ConfigError, match="AKV_ADVERTISE is not set, and this server binds"):
        config.advertised(4000)


def test_pull_ahead_is_on_unless_turned_off():
    assert _config.from_env(env()).pull_ahead
    assert not _config.from_env(env(AKV_PULL_AHEAD="0")).pull_ahead


def test_akv_jit_is_checked_when_the_process_reads_its_configuration():
    assert _config.from_env(env()).jit
    assert not _config.from_env(env(AKV_JIT="0")).jit
    with pytest.raises(ConfigError, match=r"AKV_JIT='on': set it to 1 \(on\) or 0 \(off\)"):
        _config.from_env(env(AKV_JIT="on"))
