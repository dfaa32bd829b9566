"""A client sends the job's token only to an shm listener of its own user
(:mod:`akv_transport._shm_trust`).

The attack: a server's socket directory in the shared temporary directory is removed when
the server stops (or when its restart cleans up after a SIGKILL), and another local user
makes one of the same name, with a socket in it, while a worker still tries the old path.
Each test stands in for that user: a socket the client may reach, not made by
:class:`ShmListener`, which must never receive a byte.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the shm socket is Linux only", allow_module_level=True)

from akv_transport import TransportError, UntrustedPeerError, _shm_trust
from akv_transport.shm import ShmListener, connect_shm

TOKEN = "the-jobs-token-0123456789abcdef"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")


@pytest.fixture
def impostor(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    """A directory with a listening socket in it, as another user would make it: the
    directory is 0700 and this user's until a test changes that."""
    directory = tmp_path / "akv-shm-1234-abcdef"
    directory.mkdir(mode=0o700)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(directory / "socket"))
    listening.listen()
    listening.setblocking(False)
    with listening:
        yield directory, listening


def reached(listening: socket.socket) -> bytes | None:
    """What a client sent the impostor's socket: None when nobody connected."""
    try:
        peer, _ = listening.accept()
    except BlockingIOError:
        return None
    with peer:
        peer.settimeout(2)
        try:
            return peer.recv(4096)
        except TimeoutError:
            return b""


async def test_a_socket_in_a_directory_open_to_others_gets_no_token(impostor):
    directory, listening = impostor
    directory.chmod(0o755)
    with pytest.raises(UntrustedPeerError, match=r"open to other users \(mode 755\)"):
        await connect_shm(str(directory / "socket"), TOKEN, timeout_s=5)
    assert reached(listening) is None


@as_root
@pytest.mark.parametrize(("owned", "where"), [(".", "directory"), ("socket", "socket")])
async def test_a_directory_or_socket_of_another_user_gets_no_token(impostor, owned, where):
    directory, listening = impostor
    os.chown(directory / owned, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(UntrustedPeerError, match=rf"shm {where} .* belongs to uid {NOBODY}, not"):
        await connect_shm(str(directory / "socket"), TOKEN, timeout_s=5)
    assert reached(listening) is None


async def test_what_is_not_a_socket_gets_no_token(tmp_path):
    directory = tmp_path / "akv-shm-1-x"
    directory.mkdir(mode=0o700)
    (directory / "socket").write_bytes(b"")
    with pytest.raises(UntrustedPeerError, match="is not a socket"):
        await connect_shm(str(directory / "socket"), TOKEN, timeout_s=5)


LISTENS_AS_NOBODY = """
import os, socket, sys
listening = socket.socket(fileno=int(sys.argv[1]))
os.setgid(65534)
os.setuid(65534)
listening.listen()  # the peer's credentials are those of the process that listens
print("listening", flush=True)
peer, _ = listening.accept()
peer.settimeout(5)
try:
    data = peer.recv(4096)
except TimeoutError:
    data = b""
print("received", len(data), flush=True)
"""


@as_root
async def test_a_listener_running_as_another_user_gets_no_token(tmp_path):
    # The path is this user's (made and bound here); the process that listens on it is not:
    # only the peer's credentials (SO_PEERCRED) can tell.
    directory = tmp_path / "akv-shm-1-x"
    directory.mkdir(mode=0o700)
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(directory / "socket"))
    child = subprocess.Popen(
        [sys.executable, "-c", LISTENS_AS_NOBODY, str(bound.fileno())],
        pass_fds=(bound.fileno(),),
        stdout=subprocess.PIPE,
        text=True,
    )
    bound.close()
    try:
        assert child.stdout is not None
        assert await asyncio.to_thread(child.stdout.readline) == "listening\n"
        with pytest.raises(UntrustedPeerError, match=rf"of uid {NOBODY}, not of this user"):
            await connect_shm(str(directory / "socket"), TOKEN, timeout_s=5)
        output, _ = await asyncio.to_thread(child.communicate, timeout=20)
        assert output == "received 0\n"  # it was connected to, and sent nothing
    finally:
        child.kill()
        child.wait(10)


def test_a_peer_is_refused_unless_it_runs_as_this_user(monkeypatch):
    # The comparison itself, where the test cannot change users: a socket pair's peer is
    # this process; another effective uid makes it someone else's.
    left, right = socket.socketpair()
    with left, right:
        _shm_trust.check_peer(left, "pair")
        monkeypatch.setattr(_shm_trust.os, "geteuid", lambda: os.getuid() + 1)
        with pytest.raises(UntrustedPeerError, match=r"is process \d+ of uid"):
            _shm_trust.check_peer(left, "pair")


async def test_a_listener_of_this_user_is_reached_and_a_path_gone_is_a_transport_error(tmp_path):
    async with ShmListener(TOKEN, parent_directory=str(tmp_path)) as listener:
        client = await connect_shm(listener.path, TOKEN, timeout_s=5)
        server = await asyncio.wait_for(listener.accept(), 10)
        client.close()
        server.close()
        path = listener.path
    with pytest.raises(TransportError, match="cannot connect") as caught:
        await connect_shm(path, TOKEN, timeout_s=5)
    assert not isinstance(caught.value, UntrustedPeerError)
