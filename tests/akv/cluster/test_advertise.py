"""A server that binds one address and advertises another (``AKV_ADVERTISE``/``--advertise``).

Every job here runs on 127.0.0.1. Each server binds a port of its own choosing and
advertises the port of a small TCP forwarding proxy of the test's (asyncio, on a loop
thread of its own), so the workers can reach the servers only through the proxies: the
sums come out right only if the scheduler handed out the advertised addresses. The
scheduler records both addresses; messages name the advertised one. Every wait is bounded,
every socket and proxy is closed, and the one subprocess is ended by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import akv
from akv.cluster import config as _config
from akv.cluster.scheduler.service import Scheduler
from akv.cluster.server.service import ParameterServer
from akv.errors import ConnectTimeoutError
from akv_engine import LoopThread
from akv_transport import HttpClient
from tests.akv.cluster.cluster import ROOT, Cluster, free_port

pytestmark = pytest.mark.timeout(90)
KEY_ELEMENTS = 16  # with AKV_BIGARRAY_BOUND=8: split over both servers


class Proxy:
    """Forwards every connection to 127.0.0.1:``port`` to 127.0.0.1:``target``.

    It listens on a port the system chose (so no other process has it), counts the
    connections it forwarded and the bytes in each direction.
    """

    def __init__(self, thread: LoopThread) -> None:
        self.thread = thread
        self.target: int | None = None
        self.port = 0
        self.connections = 0
        self.bytes = {"to server": 0, "to worker": 0}
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> int:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self.thread.run(listen(), timeout=10)
        return self.port

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._writers.add(writer)
        try:
            assert self.target is not None, "the proxy got a connection before its target"
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.target), 10
            )
        except (OSError, asyncio.TimeoutError, AssertionError):
            writer.close()
            return
        self._writers.add(up_writer)
        self.connections += 1
        connection = self._new_connection()
        ends = (writer, up_writer)
        pipes = [
            asyncio.ensure_future(self._pipe(reader, up_writer, "to server", connection, ends)),
            asyncio.ensure_future(self._pipe(up_reader, writer, "to worker", connection, ends)),
        ]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)

    #: How much one read of a pipe takes at most.
    read_bytes = 1 << 16

    def _new_connection(self) -> Any:
        """What a subclass keeps per forwarded connection (both directions share it)."""
        return None

    def _forward(self, data: bytes, direction: str, connection: Any) -> tuple[bytes, bool]:
        """What of ``data`` to forward, and whether to cut the connection after it (a
        subclass's hook; this proxy forwards everything)."""
        return data, False

    async def _pipe(self, reader, writer, direction: str, connection: Any, ends) -> None:
        try:
            while data := await reader.read(self.read_bytes):
                self.bytes[direction] += len(data)
                forward, cut = self._forward(data, direction, connection)
                if forward:
                    writer.write(forward)
                if cut:
                    for end in ends:
                        end.transport.abort()
                    return
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await asyncio.wait_for(self._server.wait_closed(), 10)

        self.thread.run(stop(), timeout=20)


@contextlib.contextmanager
def proxies(count: int, make: Callable[[LoopThread], Proxy] = Proxy):
    """``count`` proxies (made by ``make``) on a loop thread of their own; all closed at the
    end."""
    thread = LoopThread(name="test-proxies")
    made: list[Proxy] = []
    try:
        for _ in range(count):
            proxy = make(thread)
            made.append(proxy)
            proxy.start()
        yield made
    finally:
        try:
            for proxy in made:
                proxy.close()
        finally:
            thread.close()


class AdvertisedCluster(Cluster):
    """:class:`~tests.akv.cluster.cluster.Cluster` whose server ``r`` binds any free port and
    advertises ``127.0.0.1:<proxy r's port>``; each proxy forwards to its server's port."""

    def __init__(self, num_workers: int, behind: list[Proxy], **extra: str) -> None:
        # The proxies stand for the network between hosts: the workers must not take the
        # servers' Unix sockets, which bypass them.
        extra.setdefault("AKV_SHM", "0")
        super().__init__(num_workers, len(behind), **extra)
        self.behind = behind

    async def _start(self) -> None:
        self.scheduler = Scheduler(_config.from_env({**self.env, "AKV_ROLE": "scheduler"}))
        await self.scheduler.start()
        self._tasks.append(asyncio.ensure_future(self.scheduler.run()))
        for rank, proxy in enumerate(self.behind):
            env = {
                **self.env,
                "AKV_ROLE": "server",
                "AKV_RANK": str(rank),
                "AKV_PORT": "0",
                "AKV_ADVERTISE": f"127.0.0.1:{proxy.port}",
            }
            server = ParameterServer(_config.from_env(env))
            self.servers.append(server)
            await server.start()
            proxy.target = server.port
            self._tasks.append(asyncio.ensure_future(server.run()))


async def scheduler_status(cluster: Cluster) -> dict:
    client = HttpClient(
        f"http://127.0.0.1:{cluster.env['AKV_SCHEDULER_PORT']}", cluster.env["AKV_TOKEN"]
    )
    try:
        return await client.json("GET", "/v1/status")
    finally:
        await client.close()


async def sums(stores) -> list[tuple[float, list[float]]]:
    """Every worker pushes rank + 1 to a small key and to a key split over the servers."""

    async def body(kv):
        r = kv.rank + 1
        await kv.init("small", np.zeros(4, np.float32))
        await kv.init("split", np.zeros(KEY_ELEMENTS, np.float32))
        await kv.push("small", np.full(4, r, np.float32))
        await kv.push("split", np.arange(KEY_ELEMENTS, dtype=np.float32) * r)
        small = await kv.pull("small")
        split = await kv.pull("split")
        return kv.rank, float(small[0]), split.tolist(), kv.placement()["split"]

    results = sorted(await asyncio.gather(*(body(kv) for kv in stores)))
    return [result[1:] for result in results]


async def test_workers_reach_every_server_only_through_its_advertised_address():
    with proxies(2) as behind, AdvertisedCluster(2, behind, AKV_BIGARRAY_BOUND="8") as cluster:
        bound = [server.port for server in cluster.servers]
        assert all(bound) and not {p.port for p in behind} & set(bound)
        for server, proxy in zip(cluster.servers, behind, strict=True):
            assert server.advertised == ("127.0.0.1", proxy.port)

        stores = await cluster.workers()
        try:
            results = await sums(stores)
            # Each worker signs its streams for the instance the address book names.
            named = [server.membership.instance for server in cluster.servers]
            assert all(named) and len(set(named)) == 2
            for kv in stores:
                assert [link.instance for link in kv._backend.links] == named
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))

        total = 1 + 2
        expected_split = (np.arange(KEY_ELEMENTS) * total).tolist()
        for small, split, parts in results:
            assert small == total
            assert split == expected_split
            assert [server for server, _, _ in parts] == [0, 1]  # both servers hold a part
        # Each worker opened its stream to each server through that server's proxy.
        for proxy in behind:
            assert proxy.connections == 2
            assert proxy.bytes["to server"] > 0 and proxy.bytes["to worker"] > 0


async def test_the_scheduler_records_and_shows_both_addresses():
    with proxies(1) as behind, AdvertisedCluster(1, behind) as cluster:
        stores = await cluster.workers()
        try:
            status = await scheduler_status(cluster)
        finally:
            await asyncio.gather(*(kv.close() for kv in stores))
        server = cluster.servers[0]
        node = cluster.scheduler.roster.servers()[0]
        assert (node.host, node.port) == ("127.0.0.1", behind[0].port)
        assert (node.bound_host, node.bound_port) == ("127.0.0.1", server.port)
        shown = {(n["role"], n["rank"]): n for n in status["nodes"]}
        assert shown[("server", 0)]["host"] == "127.0.0.1"
        assert shown[("server", 0)]["port"] == behind[0].port
        assert shown[("server", 0)]["bound_host"] == "127.0.0.1"
        assert shown[("server", 0)]["bound_port"] == server.port
        # A worker advertises nothing of its own: one address, shown once.
        assert "bound_port" not in shown[("worker", 0)]


async def test_a_server_without_advertise_advertises_its_bound_port():
    with Cluster(1, 1) as cluster:
        server = cluster.servers[0]
        assert server.advertised == ("127.0.0.1", server.port)
        node = cluster.scheduler.roster.servers()[0]
        assert (node.host, node.port, node.bound_host, node.bound_port) == (
            "127.0.0.1",
            server.port,
            "127.0.0.1",
            server.port,
        )


async def test_a_worker_that_cannot_reach_the_advertised_address_names_it():
    with proxies(1) as behind, AdvertisedCluster(1, behind) as cluster:
        behind[0].close()  # the advertised port now refuses; the bound one still listens
        environ = {**cluster.worker_env(0), "AKV_CONNECT_TIMEOUT_S": "1"}
        with pytest.raises(ConnectTimeoutError) as info:
            await asyncio.wait_for(akv.create_async("dist_sync", environ=environ), 30)
        message = str(info.value)
        assert f"could not reach server 0 at 127.0.0.1:{behind[0].port}" in message
        assert f":{cluster.servers[0].port}" not in message


def _wait_for_servers(cluster: Cluster, count: int, timeout_s: float) -> list:
    async def servers() -> list:
        return cluster.scheduler.roster.servers()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        registered = cluster.thread.run(servers(), timeout=10)
        if len(registered) == count:
            return registered
        time.sleep(0.05)
    raise AssertionError(f"no server registered within {timeout_s} s")


class SchedulerOnly(Cluster):
    """A scheduler on a loop thread, for servers started as processes of their own."""

    async def _start(self) -> None:
        self.scheduler = Scheduler(_config.from_env({**self.env, "AKV_ROLE": "scheduler"}))
        await self.scheduler.start()
        self._tasks.append(asyncio.ensure_future(self.scheduler.run()))


async def test_akv_server_advertise_flag_through_a_proxy_in_a_job_of_processes():
    with proxies(1) as behind, SchedulerOnly(2, 1, AKV_SHM="0") as cluster:
        env = (
            {k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "DMLC_"))}
            | cluster.env
            | {"PYTHONPATH": str(ROOT), "AKV_ADVERTISE": "10.255.255.1:1"}
        )
        bound = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "akv.cluster.server",
                "--port",
                str(bound),
                "--advertise",  # wins over AKV_ADVERTISE, which nothing could reach
                f"127.0.0.1:{behind[0].port}",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            (node,) = await asyncio.to_thread(_wait_for_servers, cluster, 1, 30)
            assert (node.host, node.port) == ("127.0.0.1", behind[0].port)
            assert (node.bound_port, node.pid) == (bound, server.pid)
            behind[0].target = bound
            stores = await cluster.workers()
            try:
                results = await sums(stores)
            finally:
                await asyncio.gather(*(kv.close() for kv in stores))
            for small, split, _ in results:
                assert small == 3.0
                assert split == (np.arange(KEY_ELEMENTS) * 3.0).tolist()
            assert behind[0].connections == 2
            _, err = await asyncio.to_thread(server.communicate, timeout=30)
            assert server.returncode == 0, err
            assert (
                f"server 0 listening on 127.0.0.1:{bound}, advertised as 127.0.0.1:{behind[0].port}"
            ) in err
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.communicate(timeout=10)
