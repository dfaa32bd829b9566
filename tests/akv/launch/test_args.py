"""The command line: where the worker command starts, the flags, and what is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

import akv
from akv.errors import AKVError, LaunchError
from akv.launch.args import LaunchOptions, parse_args, split_command, validate
from akv.launch.command import main
from akv.launch.limits import DEFAULT_GRACE_S


def test_command_after_double_dash_is_the_worker_command():
    options = parse_args(["-n", "2", "-s", "1", "--env", "A=1", "B=x=y", "--", "python", "-u"])
    assert options.command == ("python", "-u")
    assert options.env == {"A": "1", "B": "x=y"}
    assert (options.num_workers, options.num_servers, options.launcher) == (2, 1, "local")


def test_servers_default_to_the_number_of_workers_as_in_mxnet():
    assert parse_args(["-n", "3", "--", "x"]).num_servers == 3


# ------------------------------------------------------------------ the command without `--`


@pytest.mark.parametrize(
    ("argv", "options", "command", "separated"),
    [
        (["-n", "2", "python", "x"], ["-n", "2"], ["python", "x"], False),
        (["-n", "2", "--", "python", "x"], ["-n", "2"], ["python", "x"], True),
        (["-n", "2", "--", "--", "x"], ["-n", "2"], ["--", "x"], True),
        (["-n", "2", "--dry-run"], ["-n", "2", "--dry-run"], [], False),
        (["-n", "2", "-s", "--", "x"], ["-n", "2", "-s"], ["x"], True),
        (["--env", "A=1", "B=2", "env", "C=3"], ["--env", "A=1", "B=2"], ["env", "C=3"], False),
        (["--env", "A=1", "-n", "1", "x"], ["--env", "A=1", "-n", "1"], ["x"], False),
        (["-n", "1", "-", "x"], ["-n", "1"], ["-", "x"], False),
    ],
)
def test_split_command_cuts_the_line_where_the_command_starts(argv, options, command, separated):
    assert split_command(argv) == (options, command, separated)


def test_the_first_word_that_is_not_an_option_starts_the_command():
    options = parse_args(["-n", "2", "python", "train.py"])
    assert options.command == ("python", "train.py")
    assert (options.num_workers, options.num_servers) == (2, 2)


def test_every_word_after_the_command_starts_is_the_commands_even_launcher_flags():
    options = parse_args(["-n", "2", "python", "train.py", "--epochs", "3", "-n", "5"])
    assert options.num_workers == 2
    assert options.command == ("python", "train.py", "--epochs", "3", "-n", "5")


def test_a_double_dash_after_the_command_starts_belongs_to_the_command():
    options = parse_args(["-n", "1", "python", "train.py", "--", "--fast"])
    assert options.command == ("python", "train.py", "--", "--fast")


def test_a_help_or_version_flag_after_the_command_starts_is_the_commands():
    assert parse_args(["-n", "1", "python", "train.py", "-h"]).command[-1] == "-h"
    assert parse_args(["-n", "1", "train", "--version"]).command == ("train", "--version")


def test_options_that_take_a_value_are_not_mistaken_for_the_command(tmp_path):
    argv = [
        "-n", "2",
        "-s", "1",
        "--launcher", "ssh",
        "-H", "hosts",
        "--scheduler-host", "10.0.0.1",
        "--python", "py3",
        "--grace-s", "3",
        "--log-dir", "logs",
        "--env", "A=1", "B=2",
        "--dry-run",
        "python", "train.py",
    ]  # fmt: skip
    options = parse_args(argv)
    assert options == LaunchOptions(
        num_workers=2,
        num_servers=1,
        command=("python", "train.py"),
        launcher="ssh",
        hostfile="hosts",
        scheduler_host="10.0.0.1",
        python="py3",
        env={"A": "1", "B": "2"},
        dry_run=True,
        grace_s=3.0,
        log_dir="logs",
    )


def test_values_written_attached_to_their_option_are_not_the_command():
    argv = ["-n2", "-s1", "--launcher=mpi", "--scheduler-host=h0", "--env=A=1", "python", "x"]
    options = parse_args(argv)
    assert (options.num_workers, options.num_servers, options.launcher) == (2, 1, "mpi")
    assert (options.scheduler_host, options.env) == ("h0", {"A": "1"})
    assert options.command == ("python", "x")


def test_abbreviated_long_options_take_their_value():
    options = parse_args(["--num-w", "2", "--grace", "1", "--log-d", "d", "python", "x"])
    assert (options.num_workers, options.grace_s, options.log_dir) == (2, 1.0, "d")
    assert options.command == ("python", "x")


def test_env_takes_the_following_name_value_words_and_the_first_other_word_is_the_command():
    options = parse_args(["-n", "1", "--env", "A=1", "B=x=y", "python", "C=3"])
    assert options.env == {"A": "1", "B": "x=y"}
    assert options.command == ("python", "C=3")


def test_an_option_value_that_looks_like_a_number_below_zero_is_still_its_value():
    with pytest.raises(LaunchError, match="--grace-s is -1"):
        parse_args(["-n", "1", "--grace-s", "-1", "python", "x"])


def test_a_word_without_equals_right_after_env_is_its_value_and_refused():
    with pytest.raises(LaunchError, match="--env 'python' is not NAME=VALUE"):
        parse_args(["-n", "1", "--env", "python", "train.py"])


def test_an_unknown_option_before_the_command_is_refused():
    with pytest.raises(LaunchError, match="unrecognized arguments: --bogus"):
        parse_args(["-n", "1", "--bogus", "python", "x"])


def test_an_option_missing_its_value_before_double_dash_is_refused():
    with pytest.raises(LaunchError, match="-n/-np/--num-workers: expected one argument"):
        parse_args(["-n", "--", "python"])


# ------------------------------------------------------------------ refused command lines


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0", "--", "x"], "-n/--num-workers is 0"),
        (["-n", "1", "-s", "0", "--", "x"], "-s/--num-servers is 0"),
        (["-n", "1", "--"], "missing command after `--`"),
        (["-n", "1"], "missing command: give the worker command after the options"),
        (["-n", "1", "--dry-run", "--env", "A=1"], "missing command: give the worker command"),
        (["python", "train.py"], "missing -n/--num-workers WORKERS (or -np WORKERS, or --nproc"),
        (["-n", "1", "--launcher", "yarn", "--", "x"], "unknown launcher 'yarn'"),
        (["-n", "x", "--", "x"], "invalid int value: 'x'"),
        (["-n", "1", "--launcher", "mpi", "--", "x"], "needs --scheduler-host"),
        (["-n", "1", "--launcher", "ssh", "--scheduler-host", "a", "--", "x"], "needs -H"),
        (["-n", "1", "--env", "AKV_RANK=3", "--", "x"], "akv-launch sets AKV_RANK itself"),
        (["-n", "1", "--env", "AKV_TOKEN=s3cret", "--", "x"], "secret on the command line"),
        (["-n", "1", "--env", "1X=2", "--", "x"], "'1X' is not a variable name"),
        (["-n", "1", "--grace-s", "-1", "--", "x"], "--grace-s is -1"),
        (["-n", "1", "--log-dir", "", "--", "x"], "--log-dir is empty"),
        (["-n", "1", "--checkpoint-dir", "", "--", "x"], "--checkpoint-dir is empty"),
        (
            ["-n", "1", "--checkpoint-dir", "c", "--checkpoint-interval-s", "0", "--", "x"],
            "--checkpoint-interval-s is 0.0: give a number of seconds > 0",
        ),
        (
            ["-n", "1", "--checkpoint-dir", "c", "--checkpoint-interval-s", "inf", "--", "x"],
            "--checkpoint-interval-s is inf",
        ),
        (
            ["-n", "1", "--checkpoint-interval-s", "5", "--", "x"],
            "--checkpoint-interval-s needs --checkpoint-dir DIR",
        ),
        (
            ["-n", "1", "--checkpoint-dir", "c", "--max-restarts", "-1", "--", "x"],
            "--max-restarts is -1",
        ),
        (["-n", "1", "--max-restarts", "x", "--", "x"], "invalid int value: 'x'"),
        (
            ["-n", "1", "--env", "AKV_CHECKPOINT_DIR=/c", "--", "x"],
            "sets AKV_CHECKPOINT_DIR for the servers itself: pass --checkpoint-dir instead",
        ),
        (
            ["-n", "1", "--env", "AKV_CHECKPOINT_INTERVAL_S=3", "--", "x"],
            "pass --checkpoint-interval-s instead",
        ),
    ],
)
def test_bad_command_lines_exit_2_with_a_message_naming_the_problem(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("akv-launch: error: ")
    assert message in err


def test_launch_error_is_an_akv_error():
    with pytest.raises(AKVError):
        parse_args(["-n", "0", "--", "x"])


def test_options_built_in_code_are_checked_the_same_way():
    with pytest.raises(LaunchError, match="--scheduler-host is for the ssh, mpi and slurm"):
        validate(LaunchOptions(1, 1, ("x",), scheduler_host="h0"))
    assert LaunchOptions(1, 1, ("x",)).grace_s == DEFAULT_GRACE_S


# ------------------------------------------------------------------ checkpoints and restarts


def test_checkpoint_and_restart_flags_are_parsed():
    argv = ["-n", "2", "--checkpoint-dir", "ckpt", "--checkpoint-interval-s", "2.5"]
    options = parse_args([*argv, "--max-restarts", "3", "python", "train.py"])
    assert (options.checkpoint_dir, options.checkpoint_interval_s) == ("ckpt", 2.5)
    assert options.max_restarts == 3
    assert options.command == ("python", "train.py")  # each flag took exactly its value


def test_without_the_flags_nothing_is_checkpointed_or_restarted():
    options = parse_args(["-n", "1", "python", "x"])
    assert (options.checkpoint_dir, options.checkpoint_interval_s) == (None, None)
    assert options.max_restarts == 0


def test_restarts_without_a_checkpoint_directory_are_refused_saying_why():
    with pytest.raises(LaunchError) as caught:
        parse_args(["-n", "1", "--max-restarts", "2", "python", "x"])
    message = str(caught.value)
    assert message.startswith("--max-restarts 2 needs --checkpoint-dir DIR: ")
    assert "would start empty" in message


@pytest.mark.parametrize(("launcher", "tool"), [("mpi", "mpirun"), ("slurm", "srun")])
def test_restarts_are_refused_where_one_command_runs_every_server(launcher, tool):
    options = LaunchOptions(
        1, 2, ("x",), launcher=launcher, scheduler_host="h0", checkpoint_dir="c", max_restarts=1
    )
    with pytest.raises(LaunchError, match=rf"local, ssh and ray launchers: .* one `{tool}` runs"):
        validate(options)
    validate(replace(options, max_restarts=0))  # a checkpoint directory alone is fine there


def test_restarts_are_allowed_with_the_local_and_ssh_launchers():
    validate(LaunchOptions(1, 1, ("x",), checkpoint_dir="c", max_restarts=2))
    ssh = {"launcher": "ssh", "hostfile": "h", "scheduler_host": "10.0.0.1"}
    validate(LaunchOptions(1, 1, ("x",), checkpoint_dir="c", max_restarts=2, **ssh))


def test_help_says_the_checkpoint_directory_is_on_each_servers_host(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--checkpoint-dir DIR" in out
    assert "for ssh, mpi and slurm DIR is a path on each server's host" in out
    assert "--max-restarts N" in out and "--checkpoint-interval-s SECONDS" in out


# ------------------------------------------------------------------ --help and --version


def test_help_exits_0_and_describes_the_command_without_double_dash_and_log_dir(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--scheduler-host" in out
    assert "[--] CMD..." in out
    assert "DIR/worker-RANK.log" in out


def test_version_prints_the_akv_version_and_exits_0(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"akv-launch {akv.__version__}\n"


def test_version_wins_over_a_missing_command_and_worker_count(capsys):
    assert main(["-s", "2", "--version"]) == 0
    assert capsys.readouterr().out.strip() == f"akv-launch {akv.__version__}"
