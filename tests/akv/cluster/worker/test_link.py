"""A worker's link to one server, without a job: the first stream's retries (``join``)."""

from __future__ import annotations

import asyncio
import socket
import time
import types

import pytest

from akv.cluster.config import from_env
from akv.cluster.worker.link import ServerLink
from akv.errors import ConnectTimeoutError, PeerLostError

pytestmark = pytest.mark.timeout(60)

CONFIG = from_env(
    {
        "AKV_TOKEN": "t" * 32,
        "AKV_NUM_WORKERS": "1",
        "AKV_NUM_SERVERS": "1",
        "AKV_SCHEDULER_HOST": "127.0.0.1",
        "AKV_SCHEDULER_PORT": "9",
    },
    role="worker",
)


class _State:
    """What ``join`` reads of the link's state: a first stream, not a reconnect."""

    durable_note = ""
    reconnecting = False
    table = types.SimpleNamespace(destinations=None)

    def __init__(self, name: str) -> None:
        self.name = name

    def rename(self, name: str) -> None:
        self.name = name


def _link(port: int, **options) -> ServerLink:
    """A link to server 0 at ``127.0.0.1:port``, as a worker makes it (``options``:
    ``ServerLink``'s keywords)."""
    state = _State(f"server 0 at 127.0.0.1:{port}")
    return ServerLink(0, 0, "127.0.0.1", port, state, lambda event: None, **options)


async def _join_refused(locate, failure=lambda: None, deadline_s: float = 1.0, broken=None):
    """``join`` a restartable server whose port refuses connections (bound, not listening);
    return the error and the seconds it took."""
    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        link = _link(port, locate=locate, restartable=True)
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            opener = (CONFIG, 0, "dist_sync", "session")
            await link.join(opener, started + deadline_s, failure, broken)
    return info.value, time.monotonic() - started


async def test_a_hung_scheduler_does_not_hold_a_first_stream_past_its_deadline():
    """Between retries a restartable server's address is asked of the scheduler; a lookup
    that hangs (a scheduler that stopped answering) is cut at the connect deadline. Before,
    it held the join for the lookup's own timeout (8 s here; 300 s by default)."""

    async def hung(rank: int) -> None:
        await asyncio.sleep(8)

    error, took_s = await _join_refused(hung)
    assert isinstance(error, ConnectTimeoutError), error
    assert took_s < 6, took_s  # the lookup alone would take 8 s


async def test_a_job_failed_during_a_lookup_ends_it_at_once_not_at_the_deadline():
    """The job fails (the heartbeat's finding: ``broken`` set) while a lookup hangs: the
    join raises the failure at once. Before, the lookup held it to the deadline (30 s)."""
    failed = PeerLostError("the job failed: the scheduler has not answered")
    broken = asyncio.Event()
    state: list[PeerLostError] = []

    async def hung(rank: int) -> None:
        asyncio.get_running_loop().call_later(0.5, lambda: (state.append(failed), broken.set()))
        await asyncio.sleep(60)

    error, took_s = await _join_refused(
        hung, failure=lambda: state[0] if state else None, deadline_s=30, broken=broken
    )
    assert error is failed
    assert took_s < 10, took_s


async def test_a_job_failed_during_the_retry_pause_skips_the_lookup_and_ends_the_retries():
    looked: list[int] = []

    async def locate(rank: int) -> None:
        looked.append(rank)

    failed = PeerLostError("the job failed: the scheduler has not answered")
    asked: list[int] = []

    def failure() -> PeerLostError | None:  # none at the first refusal, then failed
        asked.append(1)
        return None if len(asked) == 1 else failed

    error, _ = await _join_refused(locate, failure=failure, deadline_s=30)
    assert error is failed
    assert looked == []  # no lookup once the job failed


async def test_a_server_socket_open_to_others_gets_no_token_and_a_warning(tmp_path, caplog):
    # Another local user's socket where the server's was (the server is gone): the worker
    # neither connects to it nor stays quiet about it; it tries TCP, which refuses here.
    directory = tmp_path / "akv-shm-1-x"
    directory.mkdir(mode=0o755)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as impostor:
        impostor.bind(str(directory / "socket"))
        impostor.listen()
        impostor.setblocking(False)
        with socket.socket() as refusing:
            refusing.bind(("127.0.0.1", 0))
            port = refusing.getsockname()[1]
            link = _link(port, local=(CONFIG.host_id, str(directory / "socket")))
            with pytest.raises(ConnectTimeoutError), caplog.at_level("INFO", "akv.cluster"):
                opener = (CONFIG, 0, "dist_sync", "session")
                await link.join(opener, time.monotonic() + 1, lambda: None)
        with pytest.raises(BlockingIOError):
            impostor.accept()  # never connected to
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warnings and "open to other users (mode 755)" in warnings[0].getMessage()
    assert "trying TCP" in warnings[0].getMessage()
