"""Test helpers: a whole job (scheduler, servers, workers) on 127.0.0.1, bounded in time.

:class:`Cluster` runs the scheduler and the servers on a private event-loop thread of the
test process and makes worker stores through ``akv.create_async(..., environ=...)``, so a
test can drive several workers from one coroutine. :func:`launch` runs a real job through
``akv-launch`` in subprocesses and returns its output; :func:`launch_shm_on_and_off` runs it
with shared memory on and off.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import akv
from akv.cluster import config as _config
from akv.cluster.scheduler.service import Scheduler
from akv.cluster.server.service import ParameterServer
from akv.cluster.worker.events import Closing
from akv_engine import LoopThread

ROOT = Path(__file__).resolve().parents[3]
FAST_TIMEOUTS = {
    "AKV_CONNECT_TIMEOUT_S": "20",
    "AKV_BARRIER_TIMEOUT_S": "20",
    "AKV_ROUND_TIMEOUT_S": "20",
    "AKV_REQUEST_TIMEOUT_S": "30",
    "AKV_HEARTBEAT_INTERVAL_S": "0.2",
    "AKV_HEARTBEAT_TIMEOUT_S": "3",
}


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for ``bind(0)`` and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process started later to listen on.

    It is drawn at random outside the kernel's ephemeral range. A port from that range
    (what ``bind(0)`` gives) may be taken, between this check and that process's bind, as
    the source port of any outgoing connection of the tests running beside it, and the
    process could not listen. Never the same port twice in one test process."""
    low, high = _ephemeral_range()
    candidates = range(10_000, low) if low - 10_000 >= 1_000 else range(high + 1, 65_536)
    draw = random.SystemRandom()
    for _ in range(1_000):
        port = draw.choice(candidates)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {candidates} after 1,000 draws")


def job_env(num_workers: int, num_servers: int, port: int, **extra: str) -> dict[str, str]:
    env = {
        "AKV_SCHEDULER_HOST": "127.0.0.1",
        "AKV_SCHEDULER_PORT": str(port),
        "AKV_NUM_WORKERS": str(num_workers),
        "AKV_NUM_SERVERS": str(num_servers),
        "AKV_TOKEN": secrets.token_hex(16),
        **FAST_TIMEOUTS,
    }
    env.update(extra)
    return env


class Cluster:
    """A scheduler and servers on a loop thread; workers made by :meth:`workers`."""

    def __init__(self, num_workers: int = 2, num_servers: int = 1, **extra: str) -> None:
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.env = job_env(num_workers, num_servers, free_port(), **extra)
        self.thread = LoopThread(name="test-cluster")
        self.scheduler: Scheduler | None = None
        self.servers: list[ParameterServer] = []
        self._tasks: list[Any] = []

    def __enter__(self) -> Cluster:
        self.thread.run(self._start(), timeout=30)
        return self

    async def _start(self) -> None:
        self.scheduler = Scheduler(_config.from_env({**self.env, "AKV_ROLE": "scheduler"}))
        await self.scheduler.start()
        self._tasks.append(asyncio.ensure_future(self.scheduler.run()))
        for rank in range(self.num_servers):
            env = {**self.env, "AKV_ROLE": "server", "AKV_RANK": str(rank)}
            server = ParameterServer(_config.from_env(env))
            self.servers.append(server)
            await server.start()
            self._tasks.append(asyncio.ensure_future(server.run()))

    def worker_env(self, rank: int) -> dict[str, str]:
        return {**self.env, "AKV_ROLE": "worker", "AKV_RANK": str(rank)}

    async def workers(self, store_type: str = "dist_sync") -> list[akv.AsyncKVStore]:
        """Every worker's store, created concurrently (they rendezvous)."""
        return list(
            await asyncio.gather(
                *(
                    akv.create_async(store_type, environ=self.worker_env(rank))
                    for rank in range(self.num_workers)
                )
            )
        )

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for server in self.servers:
                await server.stop()
            if self.scheduler is not None:
                await self.scheduler.stop()
            for task in self._tasks:
                task.cancel()
            outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
            for outcome in outcomes:  # a server or scheduler that crashed fails the test
                if isinstance(outcome, Exception):
                    raise outcome

        try:
            self.thread.run(stop(), timeout=30)
        finally:
            self.thread.close()


def launch(
    args: Sequence[str],
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``akv-launch ARGS`` (as ``python -m akv.launch``) and return what it printed.

    The launcher runs in a process group of its own; if it outlives ``timeout`` the whole
    group (the launcher and everything it started) is killed by its group id, and the test
    fails.
    """
    # A process that crashes in C code prints its threads' Python stacks (faulthandler).
    full_env = {**os.environ, **FAST_TIMEOUTS, "PYTHONFAULTHANDLER": "1", **(env or {})}
    full_env.pop("AKV_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "akv.launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"akv-launch {list(args)} ran past {timeout} s:\n{stdout}\n{stderr}"
        ) from exc
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def printed(done: subprocess.CompletedProcess[str], field: str | None = None) -> list[dict]:
    """The JSON objects a :func:`launch`-ed job's workers printed (``[worker N] {...}``
    lines), in order; only those holding ``field`` when given."""
    found = []
    for line in done.stdout.splitlines():
        if not line.startswith("[worker"):
            continue
        text = line.split("] ", 1)[1]
        if text.startswith("{"):
            value = json.loads(text)
            if field is None or field in value:
                found.append(value)
    return found


def launch_shm_on_and_off(
    args: Sequence[str],
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run ``akv-launch ARGS`` twice, with shared memory between co-located workers and
    servers (``AKV_SHM=1``, the default) and without it (``AKV_SHM=0``, TCP only), each as
    :func:`launch` runs it; fail unless both end with exit code 0.

    Returns both runs by their ``AKV_SHM`` value, for the test to check that they computed
    exactly the same values.
    """
    runs = {}
    for shm in ("1", "0"):
        done = launch(args, timeout=timeout, env={**(env or {}), "AKV_SHM": shm})
        assert done.returncode == 0, f"AKV_SHM={shm}:\n{done.stdout}\n{done.stderr}"
        runs[shm] = done
    return runs


async def each(stores: Sequence[akv.AsyncKVStore], body: Callable[[Any], Any]) -> list[Any]:
    """Run ``body(kv)`` on every worker at once; return their results by rank."""
    results = await asyncio.gather(*(body(kv) for kv in stores))
    return [r for _, r in sorted(zip([kv.rank for kv in stores], results, strict=True))]


async def close_all(stores: Sequence[akv.AsyncKVStore]) -> None:
    await asyncio.gather(*(kv.close() for kv in stores))


async def on_every_worker(
    cluster: Cluster, store_type: str, body: Callable[[Any], Any]
) -> list[Any]:
    """Open every worker's ``store_type`` store, run ``body(kv)`` on all of them at once,
    close them (also when one failed); return the results by rank."""
    stores = await cluster.workers(store_type)
    try:
        return await each(stores, body)
    finally:
        await close_all(stores)


def vanish(kv: akv.AsyncKVStore) -> None:
    """As if ``kv``'s process died: its heartbeats stop and its streams end without a
    goodbye, and it reports nothing and reconnects to nothing itself."""
    backend = kv._backend
    backend._heartbeat.stop()
    backend.handle(Closing())  # from now on its streams' ends are no loss to it
    for link in backend.links:
        link.protocol.abort()


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(0.02)


def server_books(cluster: Cluster) -> list[Any]:
    """The books of the arenas the servers' local streams send through (one per server)."""
    return [server._local.book for server in cluster.servers if server._local is not None]


def server_regions_in_use(cluster: Cluster) -> int:
    """Regions of the servers' shared memory that carry answers the workers have not handed
    back yet (the regions that hold stored values are not counted)."""
    in_use = 0
    for server in cluster.servers:
        book = server._local.book if server._local is not None else None
        if book is not None:
            stored = sum(book.holds(entry.value) for entry in server.state.entries.values())
            in_use += book.regions.regions - stored
    return in_use


#: The test accuracy every worker of ``examples/train_dist.py --epochs 4`` (2 workers, 1
#: server) reaches, under every launcher (akv-launch, ``akv.ray.launch``, ``akv-launch
#: --launcher ray``): the run is deterministic and gives 0.972 on each.
TRAIN_ACCURACY_BAND = (0.95, 1.0)
