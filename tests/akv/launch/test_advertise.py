"""Advertised addresses in akv-launch: host file ``advertise=`` lines and
``--scheduler-advertise``, as plans (pure) and as the ``--dry-run`` text.

The ``mpi``/``slurm`` servers' start-up script is also run here by ``/bin/sh``, with a fake
``hostname`` first on ``PATH``, to show what each node's server gets.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace

import pytest

from akv.errors import LaunchError
from akv.launch.args import OWNED_VARIABLES, LaunchOptions, parse_args, scheduler_address
from akv.launch.command import main
from akv.launch.hosts import Host, parse_hostfile
from akv.launch.plans import JobContext, plan
from tests.akv.launch.support import ENV, TOKEN

HOSTS_TEXT = """\
# two plain hosts and two behind other addresses
n1
n2:2222 slots=2
n3 advertise=10.1.0.3 slots=2  # options in any order
n4 advertise=[fd00::4]
"""


def context(**changes) -> JobContext:
    facts = JobContext(
        environ=ENV, token=TOKEN, cwd="/w", python="/py", scheduler_port=4242, scheduler_fd=7
    )
    return replace(facts, **changes)


# ------------------------------------------------------------------ host files


def test_hostfile_lines_take_an_advertised_address():
    assert parse_hostfile(HOSTS_TEXT) == [
        Host("n1"),
        Host("n2", port=2222, slots=2),
        Host("n3", slots=2, advertise="10.1.0.3"),
        Host("n4", advertise="[fd00::4]"),
    ]
    assert parse_hostfile("n5:22 advertise=gw.example.com") == [
        Host("n5", port=22, advertise="gw.example.com")
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("n1 advertise=10.1.0.3:9000", "advertise=10.1.0.3:9000 has a port: give a host alone"),
        ("n1 advertise=", "advertise='' is not a host name or IP address"),
        ("n1 advertise=0.0.0.0", "advertise='0.0.0.0' is a wildcard address"),
        ("n1 advertise=[::]", "is a wildcard address"),
        ("n1 advertise=fd00::4", "an IPv6 address goes in brackets"),
        ("n1 advertise=a advertise=b", "expected `host`, `host:port` or `host slots=N`"),
        ("n1 slots=1 slots=2", "optionally followed by `advertise=ADDR`"),
        ("n1 advertize=10.1.0.3", "expected `host`"),
        ("n1 10.1.0.3", "expected `host`"),
    ],
)
def test_a_bad_advertise_option_names_the_line(line, message):
    with pytest.raises(LaunchError) as info:
        parse_hostfile(f"n0\n{line}\n", "hosts")
    assert str(info.value).startswith(f"hosts line 2: {line!r}: ")
    assert message in str(info.value)


# ------------------------------------------------------------------ ssh


def _ssh_plan(**changes):
    options = LaunchOptions(
        2, 4, ("python3", "t.py"), launcher="ssh", hostfile="h", scheduler_host="10.0.0.1"
    )
    hosts = parse_hostfile("n1\nn3 advertise=10.1.0.3\nn4 advertise=[fd00::4]\n")
    return plan(replace(options, **changes), context(hosts=hosts))


def test_ssh_servers_on_an_advertise_host_bind_every_interface_and_advertise_it():
    _, s0, s1, s2, s3, w0, w1 = _ssh_plan()
    assert [(s.label, s.host) for s in (s0, s1, s2, s3, w0, w1)] == [
        ("server 0", "n1"),
        ("server 1", "n3"),
        ("server 2", "n4"),
        ("server 3", "n1"),
        ("worker 0", "n3"),
        ("worker 1", "n4"),
    ]
    for server in (s0, s3):  # as before: bound and advertised under the host file name
        assert server.job_env["AKV_HOST"] == server.job_env["DMLC_NODE_HOST"] == "n1"
        assert "AKV_ADVERTISE" not in server.job_env
    assert s1.job_env["AKV_HOST"] == s1.job_env["DMLC_NODE_HOST"] == "0.0.0.0"
    assert s1.job_env["AKV_ADVERTISE"] == "10.1.0.3"
    assert "  export AKV_ADVERTISE=10.1.0.3\n" in s1.stdin
    assert "  export AKV_HOST=0.0.0.0\n" in s1.stdin
    assert s2.job_env["AKV_HOST"] == "::"
    assert s2.job_env["AKV_ADVERTISE"] == "[fd00::4]"
    assert "  export AKV_ADVERTISE='[fd00::4]'\n" in s2.stdin
    for worker in (w0, w1):  # nothing connects to a worker
        assert "AKV_ADVERTISE" not in worker.job_env and "AKV_HOST" not in worker.job_env
    for spec in (s0, s1, s2, s3, w0, w1):
        assert "AKV_ADVERTISE" not in spec.env  # ssh's own environment: never


def test_the_dry_run_shows_the_advertised_addresses(tmp_path, capfdbinary, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTS_TEXT)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here: a dry run needs none
    argv = ["-n", "1", "-s", "3", "--launcher", "ssh", "-H", str(hostfile)]
    argv += ["--scheduler-host", "0.0.0.0", "--scheduler-advertise", "gw.example.com"]
    assert main([*argv, "--dry-run", "--", "python3", "t.py"]) == 0
    out = capfdbinary.readouterr().out.decode()
    blocks = re.split(r"\n(?=# (?:scheduler|server|worker))", out)
    scheduler = next(b for b in blocks if b.startswith("# scheduler"))
    assert "AKV_SCHEDULER_HOST=0.0.0.0 DMLC_PS_ROOT_URI=0.0.0.0" in scheduler
    server2 = next(b for b in blocks if b.startswith("# server 2 on n3"))
    assert "  export AKV_ADVERTISE=10.1.0.3\n" in server2
    assert "  export AKV_SCHEDULER_HOST=gw.example.com\n" in server2
    assert "  export DMLC_PS_ROOT_URI=gw.example.com\n" in server2
    worker = next(b for b in blocks if b.startswith("# worker 0"))
    assert "  export AKV_SCHEDULER_HOST=gw.example.com\n" in worker
    assert "AKV_ADVERTISE" not in worker


def test_a_bad_advertise_line_stops_the_launch_before_anything_starts(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1\nn2 advertise=n2:9000\n")
    argv = ["-n", "1", "--launcher", "ssh", "--scheduler-host", "127.0.0.1", "-H"]
    assert main([*argv, str(hostfile), "--", "x"]) == 2
    err = capsys.readouterr().err
    assert (
        f"hostfile {hostfile} line 2: 'n2 advertise=n2:9000': advertise=n2:9000 has a port" in err
    )


# ------------------------------------------------------------------ mpi and slurm

HOSTS = [Host("n1", slots=2), Host("n3", advertise="10.1.0.3"), Host("n4", advertise="[fd00::4]")]


def _group_plan(launcher: str, flavour: str = "openmpi", hosts=HOSTS):
    options = LaunchOptions(
        2, 3, ("python3", "t.py"), launcher=launcher, hostfile="hosts", scheduler_host="h0"
    )
    return plan(options, context(hosts=hosts, mpi_flavour=flavour))


def _wrapper(argv: tuple[str, ...]) -> tuple[str, ...]:
    start = argv.index("/bin/sh")
    return argv[start : start + 4]


def test_open_mpi_gets_a_host_list_when_the_host_file_has_advertise_lines():
    _, servers, workers = _group_plan("mpi")
    for group in (servers, workers):
        assert "--hostfile" not in group.argv  # Open MPI's host file syntax has no advertise=
        at = group.argv.index("-H")
        assert group.argv[at + 1] == "n1:2,n3,n4"
    plain = _group_plan("mpi", hosts=[Host("n1", slots=2)])
    assert "--hostfile" in plain[1].argv


@pytest.mark.parametrize(
    ("launcher", "flavour"), [("mpi", "openmpi"), ("mpi", "mpich"), ("slurm", "openmpi")]
)
def test_group_servers_look_their_node_up_in_the_advertise_lines(launcher, flavour):
    _, servers, workers = _group_plan(launcher, flavour)
    shell, dash_c, script, name = _wrapper(servers.argv)
    assert (shell, dash_c, name) == ("/bin/sh", "-c", "akv-server")
    assert "n3) AKV_HOST=0.0.0.0; AKV_ADVERTISE=10.1.0.3; export AKV_ADVERTISE;;" in script
    assert "n4) AKV_HOST=::; AKV_ADVERTISE='[fd00::4]'; export AKV_ADVERTISE;;" in script
    assert "n1)" not in script
    assert "/bin/sh" not in workers.argv
    for group in (servers, workers):
        assert "AKV_ADVERTISE" not in group.env


@pytest.mark.parametrize(
    ("node", "seen"),
    [
        ("n1", "n1 n1 unset"),
        ("n3", "0.0.0.0 0.0.0.0 10.1.0.3"),
        ("n4", ":: :: [fd00::4]"),
        ("n3.example.com", "n3.example.com n3.example.com unset"),  # the name must match
    ],
)
def test_the_server_start_script_gives_each_node_its_addresses(tmp_path, node, seen):
    _, servers, _ = _group_plan("slurm")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hostname = bin_dir / "hostname"
    hostname.write_text(f"#!/bin/sh\necho {node}\n")
    hostname.chmod(0o755)
    show = 'echo "$AKV_HOST $DMLC_NODE_HOST ${AKV_ADVERTISE-unset}"'
    done = subprocess.run(
        [*_wrapper(servers.argv), "/bin/sh", "-c", show],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "AKV_ADVERTISE": "stale"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, seen + "\n", "")


# ------------------------------------------------------------------ --scheduler-advertise


def test_scheduler_advertise_is_what_the_other_processes_are_told():
    options = parse_args(
        [
            *("-n", "1", "-s", "1", "--launcher", "slurm", "--scheduler-host", "0.0.0.0"),
            *("--scheduler-advertise", "gw.example.com", "python3", "t.py"),
        ]
    )
    assert options.scheduler_advertise == "gw.example.com"
    scheduler, servers, workers = plan(options, context())
    assert scheduler.env["AKV_SCHEDULER_HOST"] == scheduler.env["DMLC_PS_ROOT_URI"] == "0.0.0.0"
    for group in (servers, workers):
        assert group.env["AKV_SCHEDULER_HOST"] == group.env["DMLC_PS_ROOT_URI"] == "gw.example.com"
        assert group.env["AKV_SCHEDULER_PORT"] == "4242"  # the port the launcher bound


def test_scheduler_address_defaults_to_the_listening_host_and_takes_ipv6_in_brackets():
    ssh = LaunchOptions(1, 1, ("x",), launcher="ssh", hostfile="h", scheduler_host="10.0.0.1")
    assert scheduler_address(ssh) == "10.0.0.1"
    assert scheduler_address(replace(ssh, scheduler_advertise="[fd00::1]")) == "fd00::1"
    assert scheduler_address(LaunchOptions(1, 1, ("x",))) == "127.0.0.1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--launcher", "mpi", "--scheduler-host", "0.0.0.0"],
            "--scheduler-host 0.0.0.0 is a wildcard address: the scheduler can listen there, "
            "but no other process can connect to it; also pass --scheduler-advertise HOST",
        ),
        (["--launcher", "slurm", "--scheduler-host", "::"], "--scheduler-host :: is a wildcard"),
        (
            ["--launcher", "mpi", "--scheduler-host", "h0", "--scheduler-advertise", "gw:9000"],
            "--scheduler-advertise gw:9000: give a host alone; akv-launch chooses the "
            "scheduler's port",
        ),
        (
            ["--launcher", "mpi", "--scheduler-host", "h0", "--scheduler-advertise", "0.0.0.0"],
            "--scheduler-advertise='0.0.0.0' is a wildcard address",
        ),
        (
            ["--launcher", "mpi", "--scheduler-host", "h0", "--scheduler-advertise", "::1"],
            "--scheduler-advertise='::1': an IPv6 address goes in brackets",
        ),
        (
            ["--scheduler-advertise", "gw"],
            "--scheduler-advertise is for the ssh, mpi and slurm launchers",
        ),
    ],
)
def test_bad_scheduler_addresses_are_refused_naming_the_flag(argv, message):
    with pytest.raises(LaunchError) as info:
        parse_args(["-n", "1", *argv, "--", "x"])
    assert message in str(info.value)


def test_akv_advertise_belongs_to_the_launcher():
    assert "AKV_ADVERTISE" in OWNED_VARIABLES
    with pytest.raises(LaunchError, match=r"--env AKV_ADVERTISE=\.\.\.: akv-launch sets"):
        parse_args(["-n", "1", "--env", "AKV_ADVERTISE=10.0.0.1", "--", "x"])
    # An AKV_ADVERTISE in the launcher's environment does not leak into the job.
    specs = plan(LaunchOptions(1, 1, ("x",)), context(environ={**ENV, "AKV_ADVERTISE": "h"}))
    assert all("AKV_ADVERTISE" not in spec.env for spec in specs)
