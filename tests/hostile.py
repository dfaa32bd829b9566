"""What the hostile-peer tests share (``tests/transport/test_http_hostile.py``,
``tests/akv/cluster/test_hostile_http.py`` and ``tests/akv/cluster/test_flood.py``).

The limiter that logs a peer's mistake at most once a minute is process-wide, so a test that
counts such lines starts with :func:`forget_logged_mistakes`; this is the one place the tests
outside ``akv_transport``'s own reach into its private modules for it.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

from akv_transport._http_log import MISTAKES


def forget_logged_mistakes() -> None:
    """Every peer's next mistake is logged again, as in a fresh process."""
    MISTAKES.clear()


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closed the connection (it sends nothing first)."""
    started_at = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:
        data = b""
    assert data == b"", data[:200]
    return time.monotonic() - started_at


class Flood:
    """``count`` idle TCP connections to ``127.0.0.1:port`` from ``source`` (any address of
    127.0.0.0/8), held open by a thread of their own as an attacker without the token would:
    one the server closes is opened again after ``reopen_s``. A context manager: every
    socket is closed (and the thread ended) on leaving it.

    ``opened`` counts the connections made, ``closed`` those the server closed.
    """

    def __init__(
        self, port: int, count: int = 80, *, source: str = "127.0.0.1", reopen_s: float = 0.0
    ) -> None:
        self.port = port
        self.count = count
        self.source = source
        self.reopen_s = reopen_s
        self.opened = 0
        self.closed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the flood's thread did not stop"

    def wait(self, *, opened: int = 0, closed: int = 0, timeout_s: float = 20.0) -> None:
        """Block until at least ``opened`` connections were made and ``closed`` closed by
        the server (from a coroutine: ``await asyncio.to_thread(flood.wait, ...)``)."""
        deadline = time.monotonic() + timeout_s
        while self.opened < opened or self.closed < closed:
            assert time.monotonic() < deadline, (
                f"the flood opened {self.opened} of {opened}, saw {self.closed} of {closed} closed"
            )
            time.sleep(0.01)

    def _connect(self) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.settimeout(2.0)
            sock.bind((self.source, 0))
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        self.opened += 1
        return sock

    def _hold(self) -> None:
        sockets: list[socket.socket | None] = [None] * self.count
        due = [0.0] * self.count
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for slot in range(self.count):
                    if sockets[slot] is None and now >= due[slot]:
                        sockets[slot] = self._connect()
                        if sockets[slot] is None:  # not even accepted by the kernel
                            due[slot] = now + max(self.reopen_s, 0.05)
                live = [sock for sock in sockets if sock is not None]
                readable = select.select(live, [], [], 0.05)[0] if live else []
                for sock in readable:
                    try:
                        data = sock.recv(4096)
                    except OSError:
                        data = b""
                    if not data:  # the server closed it: open another
                        slot = sockets.index(sock)
                        sock.close()
                        sockets[slot] = None
                        due[slot] = time.monotonic() + self.reopen_s
                        self.closed += 1
                if not live:
                    time.sleep(0.05)
        finally:
            for sock in sockets:
                if sock is not None:
                    sock.close()
