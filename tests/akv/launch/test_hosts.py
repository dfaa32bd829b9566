"""Host files (their forms and the messages for bad ones) and placing processes on hosts."""

from __future__ import annotations

import pytest

from akv.errors import LaunchError
from akv.launch.command import main
from akv.launch.hosts import Host, assign_hosts, load_hostfile, parse_hostfile


def test_hostfile_takes_host_host_port_and_slots_lines_with_comments():
    text = "# cluster\n\nnode1\nnode2:2222  # ssh port\n10.0.0.3 slots=4\n"
    assert parse_hostfile(text) == [
        Host("node1"),
        Host("node2", port=2222),
        Host("10.0.0.3", slots=4),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1\nnode2 extra\n", "hosts line 2: 'node2 extra': expected `host`"),
        ("node1:99999\n", "hosts line 1: 'node1:99999': '99999' is not a TCP port"),
        ("node1 slots=0\n", "hosts line 1: 'node1 slots=0': slots must be"),
        ("-oProxyCommand=x\n", "is not a host name"),
        ("# only a comment\n\n", "hosts has no hosts"),
    ],
)
def test_unparsable_hostfile_names_the_line_and_its_content(text, message):
    with pytest.raises(LaunchError) as info:
        parse_hostfile(text, "hosts")
    assert message in str(info.value)


def test_a_hostfile_is_read_from_its_path_and_named_in_messages(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("n1 slots=2\n")
    assert load_hostfile(str(path)) == [Host("n1", slots=2)]
    path.write_text("n1 n2\n")
    with pytest.raises(LaunchError, match=f"hostfile {path} line 1: 'n1 n2'"):
        load_hostfile(str(path))


def test_missing_or_empty_hostfile_fails_before_anything_starts(tmp_path, capsys):
    missing = tmp_path / "nope"
    argv = ["-n", "1", "--launcher", "ssh", "--scheduler-host", "127.0.0.1", "-H"]
    assert main([*argv, str(missing), "--", "x"]) == 2
    assert f"hostfile {missing} does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    assert main([*argv, str(empty), "--", "x"]) == 2
    assert f"hostfile {empty} has no hosts" in capsys.readouterr().err


def test_placement_is_round_robin_and_respects_slots():
    a, b = Host("a"), Host("b", slots=2)
    assert [h.name for h in assign_hosts([a, b], 5)] == ["a", "b", "b", "a", "b"]
    assert [h.name for h in assign_hosts([Host("a"), Host("c")], 3)] == ["a", "c", "a"]


def test_placing_processes_on_no_hosts_is_refused():
    with pytest.raises(LaunchError, match="no hosts to place 2 processes on"):
        assign_hosts([], 2)
    assert assign_hosts([], 0) == []
