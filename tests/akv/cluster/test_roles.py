"""What akv-scheduler and akv-server share (:mod:`akv.cluster.roles`): flags, configuration
errors, logging."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from akv.cluster import config as _config
from akv.cluster.roles import (
    ROLE_FLAGS,
    client_ssl,
    config_from_args,
    flag_hint,
    role_parser,
)
from akv.cluster.scheduler import main as scheduler_main
from akv.errors import ConfigError
from tests.akv.cluster.cluster import ROOT

TOKEN = "t" * 32
JOB = {
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9091",
    "DMLC_NUM_WORKER": "2",
    "DMLC_NUM_SERVER": "1",
    "AKV_TOKEN": TOKEN,
}
# A flag spelled on its own, not as the tail of another (--port, not --scheduler-port).
FLAG = r"(?<![\w-]){}\b"


def run_python(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def run_role_command(role: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """``python -m akv.cluster.ROLE ARGS`` in a clean environment with ``JOB`` and
    ``extra`` (this checkout importable)."""
    return subprocess.run(
        [sys.executable, "-m", f"akv.cluster.{role}", *args],
        capture_output=True,
        text=True,
        env=clean_env(**{**JOB, "PYTHONPATH": str(ROOT), **extra}),
        cwd=ROOT,
        timeout=60,
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any job variable, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AKV_", "DMLC_", "MXNET_")) and k not in ("PYTHONWARNINGS",)
    }
    env.update(extra)
    return env


# ------------------------------------------------------------------ flags


def test_role_flags_override_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("f" * 32 + "\n")
    args = role_parser("server", "test").parse_args(
        [
            "--num-workers",
            "3",
            "--host",
            "10.1.2.3",
            "--port",
            "7000",
            "--token-file",
            str(token_file),
        ]
    )
    config = config_from_args("server", args, {**JOB, "DMLC_ROLE": "server"})
    assert (config.role, config.num_workers, config.host, config.port) == (
        "server",
        3,
        "10.1.2.3",
        7000,
    )
    assert config.token == "f" * 32
    missing = role_parser("server", "test").parse_args(["--token-file", "/no/such/file"])
    with pytest.raises(ConfigError, match="--token-file '/no/such/file'"):
        config_from_args("server", missing, JOB)


def test_a_flag_overrides_both_twin_variables_without_a_contradiction():
    args = role_parser("scheduler", "test").parse_args(["--num-workers", "4"])
    config = config_from_args("scheduler", args, {**JOB, "AKV_NUM_WORKERS": "2"})
    assert config.num_workers == 4


def test_the_scheduler_lists_only_its_own_flags():
    scheduler_help = role_parser("scheduler", "test").format_help()
    server_help = role_parser("server", "test").format_help()
    for option in ("--scheduler-host", "--scheduler-port", "--num-workers", "--token-file"):
        assert option in scheduler_help and option in server_help
    for option in ("--host", "--port"):
        assert not re.search(FLAG.format(option), scheduler_help), scheduler_help
        assert re.search(FLAG.format(option), server_help), server_help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--port", "9000"],
            "akv-scheduler has no --port: the scheduler listens on --scheduler-port "
            "(AKV_SCHEDULER_PORT / DMLC_PS_ROOT_PORT)",
        ),
        (["--port=9000"], "akv-scheduler has no --port: the scheduler listens on --scheduler-port"),
        (
            ["--host", "10.0.0.1"],
            "akv-scheduler has no --host: the scheduler listens on --scheduler-host",
        ),
    ],
)
def test_a_server_flag_given_to_the_scheduler_points_to_the_schedulers_own(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        scheduler_main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("role", "argv", "message"),
    [
        ("scheduler", ["--scheduler-port", "70000"], "70000 is not a TCP port: give 1-65535"),
        ("server", ["--port", "-1"], "-1 is not a TCP port: give 1-65535, or 0 for any"),
        ("server", ["--num-servers", "0"], "0 is too few: give at least 1"),
        ("server", ["--num-workers", "two"], "'two' is not a number"),
    ],
)
def test_a_flag_with_a_bad_value_is_refused_by_the_parser(role, argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        role_parser(role, "test").parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_role_parser_knows_only_the_roles_with_a_command():
    with pytest.raises(ValueError, match="no command-line role 'worker'"):
        role_parser("worker", "test")


# ------------------------------------------------------------------ configuration errors


def test_a_missing_scheduler_port_tells_the_scheduler_about_its_flag(monkeypatch, capsys):
    for name in list(os.environ):
        if name.startswith(("AKV_", "DMLC_")):
            monkeypatch.delenv(name)
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DMLC_PS_ROOT_PORT")
    assert scheduler_main([]) == 2
    err = capsys.readouterr().err
    assert err == (
        "akv-scheduler: DMLC_PS_ROOT_PORT (or AKV_SCHEDULER_PORT) is not set: set it to the "
        "scheduler's TCP port; or pass --scheduler-port\n"
    )


def test_a_hint_names_the_flag_of_the_variable_in_the_message_and_only_whole_names():
    flags = ROLE_FLAGS["server"]
    assert flag_hint("AKV_SCHEDULER_HOST='' is bad", flags) == (
        "AKV_SCHEDULER_HOST='' is bad; or pass --scheduler-host"
    )
    assert flag_hint("DMLC_NODE_HOST=x is bad", flags) == "DMLC_NODE_HOST=x is bad; or pass --host"
    assert flag_hint("AKV_PORT=70000 is out of range", flags).endswith("or pass --port")
    assert flag_hint("AKV_TOKEN is not set", flags) is None
    assert flag_hint("AKV_PORT=1", ROLE_FLAGS["scheduler"]) is None


def test_a_bad_log_level_is_one_line_and_exit_2_not_a_traceback():
    done = run_role_command("scheduler", DMLC_PS_ROOT_PORT="1", AKV_LOG_LEVEL="verbose")
    assert done.returncode == 2
    assert done.stderr == (
        "akv-scheduler: AKV_LOG_LEVEL='verbose' is not a log level: set it to DEBUG, INFO, "
        "WARNING, ERROR or CRITICAL (any case), or to a number; or pass --log-level\n"
    )


def test_tls_without_a_ca_is_a_config_error_for_a_client():
    config = _config.Config(
        role="worker",
        scheduler_host="127.0.0.1",
        scheduler_port=1,
        num_workers=1,
        num_servers=1,
        token=TOKEN,
        tls_cert="c.pem",
        tls_key="k.pem",
    )
    with pytest.raises(ConfigError, match="AKV_TLS_CA is not"):
        client_ssl(config)


# ------------------------------------------------------------------ a worker's logging

WORKER_LOG = """
    import logging
    from akv.cluster.roles import default_worker_logging
    {before}
    print(default_worker_logging({level}), flush=True)
    {after}
    logging.getLogger("akv.cluster").info("worker waiting: 1 of 1 servers")
    logging.getLogger("akv.cluster").debug("a debug line")
    logging.getLogger("other").warning("someone else's warning")
"""


def worker_log(before: str = "", after: str = "", level: str = "") -> subprocess.CompletedProcess:
    code = WORKER_LOG.format(before=before, after=after, level=level)
    return run_python(code, clean_env(PYTHONPATH=str(ROOT)))


def test_a_worker_that_configured_no_logging_sees_akvs_info_lines_on_stderr():
    done = worker_log()
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\n"
    lines = done.stderr.splitlines()
    assert [line.split(" akv ", 1)[1] for line in lines if " akv " in line] == [
        "INFO worker waiting: 1 of 1 servers"
    ]
    # Other loggers are left to Python's default (warnings and above, unformatted).
    assert "someone else's warning" in lines


def test_the_worker_log_level_is_the_one_given():
    done = worker_log(level="logging.DEBUG")
    assert "DEBUG a debug line" in done.stderr
    quiet = worker_log(level="logging.WARNING")
    assert "worker waiting" not in quiet.stderr


def test_a_worker_that_configured_logging_keeps_its_configuration():
    before = 'logging.basicConfig(level=logging.WARNING, format="USER %(name)s %(message)s")'
    done = worker_log(before=before)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"
    assert done.stderr.splitlines() == ["USER other someone else's warning"]


def test_logging_configured_after_joining_takes_over_without_doubled_lines():
    after = 'logging.basicConfig(level=logging.INFO, format="USER %(name)s %(message)s")'
    done = worker_log(after=after)
    assert done.stdout == "True\n"
    assert done.stderr.splitlines() == [
        "USER akv.cluster worker waiting: 1 of 1 servers",
        "USER other someone else's warning",
    ]


def test_a_level_the_program_chose_later_is_respected_from_the_next_akv_record_on():
    after = 'logging.basicConfig(level=logging.WARNING, format="USER %(name)s %(message)s")'
    done = worker_log(after=after + '\n    logging.getLogger("akv").info("first")')
    # The first akv record after the program configured logging still passes at akv's
    # level (it was let through before the handler could step aside); it hands the level
    # back, and from then on the program's WARNING holds.
    assert done.stderr.splitlines() == ["USER akv first", "USER other someone else's warning"]


def test_default_worker_logging_is_idempotent():
    done = worker_log(after="print(default_worker_logging(), flush=True)")
    assert done.stdout == "True\nFalse\n"
    assert done.stderr.count("worker waiting") == 1


# ------------------------------------------------------------------ --advertise

SERVER_JOB = {**JOB, "DMLC_ROLE": "server"}


def server_config(argv: list[str], environ: dict[str, str]) -> _config.Config:
    return config_from_args("server", role_parser("server", "test").parse_args(argv), environ)


def test_advertise_flag_sets_the_advertised_address():
    config = server_config(["--port", "9000", "--advertise", "[::1]:19000"], SERVER_JOB)
    assert config.advertised(9000) == ("::1", 19000)
    config = server_config(["--advertise", "gateway"], SERVER_JOB)
    assert config.advertised(41234) == ("gateway", 41234)


def test_advertise_flag_wins_over_the_variable():
    environ = {**SERVER_JOB, "AKV_ADVERTISE": "10.0.0.9:1"}
    assert server_config([], environ).advertised(7) == ("10.0.0.9", 1)
    assert server_config(["--advertise", "10.0.0.2:2"], environ).advertised(7) == ("10.0.0.2", 2)
    # A bad variable is no matter when the flag overrides it.
    bad = {**SERVER_JOB, "AKV_ADVERTISE": "::1"}
    assert server_config(["--advertise", "h"], bad).advertised(7) == ("h", 7)


def test_a_bad_advertise_names_the_variable_and_the_flag():
    with pytest.raises(ConfigError) as info:
        server_config(["--advertise", "host:0"], SERVER_JOB)
    message = str(info.value)
    assert message.startswith("AKV_ADVERTISE='host:0': '0' is not a TCP port (1-65535)")
    assert message.endswith("; or pass --advertise")


def test_a_wildcard_bind_without_advertise_points_to_the_advertise_flag():
    with pytest.raises(ConfigError) as info:
        server_config(["--host", "0.0.0.0"], SERVER_JOB)
    message = str(info.value)
    assert message.startswith("AKV_ADVERTISE is not set, and this server binds the wildcard")
    assert message.endswith("; or pass --advertise")
    config = server_config(["--host", "0.0.0.0", "--advertise", "10.0.0.2"], SERVER_JOB)
    assert config.advertised(4000) == ("10.0.0.2", 4000)


def test_only_the_server_lists_advertise_and_the_scheduler_explains_why(capsys):
    assert re.search(FLAG.format("--advertise"), role_parser("server", "t").format_help())
    assert not re.search(FLAG.format("--advertise"), role_parser("scheduler", "t").format_help())
    with pytest.raises(SystemExit) as exited:
        scheduler_main(["--advertise", "10.0.0.1"])
    assert exited.value.code == 2
    assert (
        "akv-scheduler has no --advertise: the scheduler advertises no address: every node "
        "reaches it at its own --scheduler-host and --scheduler-port"
    ) in capsys.readouterr().err


def test_akv_server_bound_to_a_wildcard_without_advertise_exits_2_with_one_line():
    done = run_role_command("server", "--host", "0.0.0.0")
    assert done.returncode == 2
    assert done.stderr.startswith(
        "akv-server: AKV_ADVERTISE is not set, and this server binds the wildcard address "
        "AKV_HOST='0.0.0.0', which no worker can connect to"
    )
    assert done.stderr.endswith("; or pass --advertise\n")
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("role", "flags", "setting", "exit_code"),
    [
        ("scheduler", ["--scheduler-port", "{port}"], "AKV_SCHEDULER_PORT", 2),
        ("server", ["--port", "{port}"], "AKV_PORT", 1),  # akv-launch may restart it
    ],
)
def test_a_port_another_process_holds_is_one_line_naming_it_not_a_traceback(
    role, flags, setting, exit_code
):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = (f.format(port=port) for f in flags)
        done = run_role_command(role, *args, AKV_CONNECT_TIMEOUT_S="5")
    assert done.returncode == exit_code, done.stderr
    assert f"{setting}={port}: cannot listen on 127.0.0.1:{port}: " in done.stderr
    assert "address already in use" in done.stderr.lower()
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


async def test_a_host_that_does_not_resolve_says_the_resolvers_words():
    from aiohttp import web

    from akv.cluster.roles import listen

    config = _config.from_env({**JOB, "AKV_ROLE": "server"})
    with pytest.raises(ConfigError) as info:
        await listen(web.Application(), config, "no-such-host.invalid", 0, setting="X", advice="a")
    message = str(info.value)
    assert message.startswith("X=0: cannot listen on no-such-host.invalid:0: "), message
    assert "Unknown error" not in message, message  # a resolver's errno is not the system's


@pytest.mark.parametrize(("role", "exit_code"), [("scheduler", 2), ("server", 1)])
def test_a_tls_file_that_cannot_be_read_is_named_not_taken_for_the_port(tmp_path, role, exit_code):
    missing = str(tmp_path / "missing.pem")
    tls = {"AKV_TLS_CERT": missing, "AKV_TLS_KEY": missing, "AKV_TLS_CA": missing}
    done = run_role_command(role, **tls)
    assert done.returncode == exit_code, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"TLS (AKV_TLS_CERT={missing!r}, AKV_TLS_KEY=" in done.stderr, done.stderr
    assert "No such file or directory" in done.stderr
    assert "cannot listen" not in done.stderr and "Traceback" not in done.stderr


def test_a_signal_after_the_role_ended_is_ignored_and_it_exits_with_the_roles_status():
    """A job torn down as it ends may send SIGTERM while a role's process is exiting: it
    exits with the role's status (a server's 0 after a job that ended well), not as killed
    by the signal, which the launcher counted as a failure. The signal is ignored from the
    role's end: Python's own exit resets a signal handled by a function to the default
    (a CI run saw a server killed there), not an ignored one."""
    script = textwrap.dedent(
        """
        import signal, sys, time
        from types import SimpleNamespace
        from akv.cluster.roles import serve_role

        async def serve(_):
            return 7

        status = serve_role("server", SimpleNamespace(log_level="INFO"), serve)
        print("ended", status, flush=True)
        print("ignored", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
        time.sleep(2)  # the interpreter's exit, as long as it may take
        sys.exit(status)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    ) as process:
        try:
            assert process.stdout.readline() == "ended 7\n"
            assert process.stdout.readline() == "ignored True\n"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 7
        finally:
            if process.poll() is None:
                process.kill()
