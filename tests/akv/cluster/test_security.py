"""Secure by default: tokens, body limits, garbage, bind addresses, TLS."""

from __future__ import annotations

import asyncio
import os
import socket

import aiohttp
import numpy as np
import pytest

from akv.cluster import protocol as proto
from akv_transport import frame_bytes
from tests.akv.cluster.cluster import Cluster
from tests.tls import make_certificates

pytestmark = pytest.mark.timeout(60)


def server_url(cluster: Cluster, index: int = 0) -> str:
    return f"http://127.0.0.1:{cluster.servers[index].port}"


def scheduler_url(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.scheduler.port}"


async def post(url: str, token: str | None, *, data: bytes = b"", headers=None, json=None):
    all_headers = dict(headers or {})
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=None if json is not None else data, json=json, headers=all_headers
        ) as response,
    ):
        return response.status, await response.read()


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", ""])
async def test_a_wrong_or_missing_token_gets_401_and_changes_nothing(token):
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        await kv.init("w", np.ones(4, np.float32))
        nodes_before = set(cluster.scheduler.roster.nodes)
        status, body = await post(
            scheduler_url(cluster) + "/v1/register",
            token,
            json={"node_id": "intruder", "role": "worker", "host": "x", "port": 0},
        )
        assert status == 401 and b"missing or wrong token" in body
        assert set(cluster.scheduler.roster.nodes) == nodes_before

        push = frame_bytes(proto.Op.PUSH, 1, [("w", np.full(4, 99.0, np.float32), 0)])
        status, _ = await post(
            server_url(cluster) + "/v1/frame",
            token,
            data=push,
            headers={proto.CLIENT_HEADER: "0 dist_sync"},
        )
        assert status == 401
        async with aiohttp.ClientSession() as session:
            headers = {
                "Connection": "Upgrade",
                "Upgrade": "akv-stream/1",
                proto.CLIENT_HEADER: "0 dist_sync",
            }
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            async with session.get(server_url(cluster) + "/v1/stream", headers=headers) as response:
                assert response.status == 401
        np.testing.assert_array_equal(await kv.pull("w"), np.ones(4, np.float32))
        await kv.close()


async def test_the_right_token_can_use_the_frame_route():
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        await kv.init(7, np.arange(3, dtype=np.int64))
        pull = frame_bytes(proto.Op.PULL, 5, [(7, np.empty(0, np.int64), 0)])
        status, body = await post(
            server_url(cluster) + "/v1/frame",
            cluster.env["AKV_TOKEN"],
            data=pull,
            headers={proto.CLIENT_HEADER: "0 dist_sync"},
        )
        assert status == 200
        from akv_transport import decode_frame

        header, buffers = decode_frame(body)
        assert (header.op, header.seq, header.aux) == (proto.Op.REPLY, 5, proto.OK)
        np.testing.assert_array_equal(np.frombuffer(buffers[0], np.int64), [0, 1, 2])
        await kv.close()


async def test_an_oversized_body_gets_413():
    with Cluster(1, 1, AKV_MAX_BODY_BYTES="4096") as cluster:
        token = cluster.env["AKV_TOKEN"]
        big = frame_bytes(proto.Op.PUSH, 1, [("w", np.zeros(4096, np.float32), 0)])
        status, body = await post(
            server_url(cluster) + "/v1/frame",
            token,
            data=big,
            headers={proto.CLIENT_HEADER: "0 dist_sync"},
        )
        assert status == 413 and b"exceeds the limit of 4096 bytes" in body
        status, _ = await post(scheduler_url(cluster) + "/v1/heartbeat", token, data=b"x" * 5000)
        assert status == 413


async def test_a_garbage_frame_gets_400_and_the_server_keeps_serving():
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        await kv.init(1, np.ones(2, np.float32))
        token = cluster.env["AKV_TOKEN"]
        for garbage in (b"hello", b"AKV\x01" + os.urandom(60), b"\x00" * 64):
            status, body = await post(
                server_url(cluster) + "/v1/frame",
                token,
                data=garbage,
                headers={proto.CLIENT_HEADER: "0 dist_sync"},
            )
            assert status == 400 and b"not a valid frame" in body
        status, body = await post(scheduler_url(cluster) + "/v1/barrier", token, data=b"{not json")
        assert status == 400
        np.testing.assert_array_equal(await kv.pull(1), np.ones(2, np.float32))
        await kv.close()


async def test_garbage_on_a_stream_closes_only_that_stream():
    with Cluster(1, 1) as cluster:
        (kv,) = await cluster.workers()
        await kv.init(1, np.ones(2, np.float32))
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.servers[0].port)
        writer.write(
            b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
            b"Upgrade: akv-stream/1\r\nAuthorization: Bearer "
            + cluster.env["AKV_TOKEN"].encode()
            + b"\r\nX-AKV-Client: 0 dist_sync\r\n\r\n"
        )
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer.startswith(b"HTTP/1.1 409")  # worker 0 is connected already
        writer.close()
        np.testing.assert_array_equal(await kv.pull(1), np.ones(2, np.float32))
        link = kv._backend.links[0]
        link.protocol.transport.write(b"AKV\x01" + b"\xff" * 60)  # a corrupt frame
        # The server drops that stream; the worker opens a new one and the job goes on.
        np.testing.assert_array_equal(
            await asyncio.wait_for(kv.pull(1), 10), np.ones(2, np.float32)
        )
        assert link.reconnects == 1
        assert cluster.servers[0].state.failure is None
        await kv.close()


async def test_servers_and_the_scheduler_listen_on_127_0_0_1_by_default():
    with Cluster(1, 1) as cluster:
        for port in (cluster.servers[0].port, cluster.scheduler.port):
            other = _non_loopback_address()
            if other is not None:
                with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
                    pass
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        assert cluster.servers[0].config.host == "127.0.0.1"


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.fixture
def certificates(tmp_path):
    made = make_certificates(tmp_path)
    return {"AKV_TLS_CA": made["ca"], "AKV_TLS_CERT": made["cert"], "AKV_TLS_KEY": made["key"]}


async def test_a_job_runs_over_tls(certificates):
    with Cluster(2, 1, **certificates) as cluster:
        stores = await cluster.workers()

        async def body(kv):
            await kv.init(0, np.zeros(8, np.float32))
            await kv.push(0, np.full(8, kv.rank + 1.0, np.float32))
            return await kv.pull(0)

        for pulled in await asyncio.gather(*(body(kv) for kv in stores)):
            np.testing.assert_array_equal(pulled, np.full(8, 3.0, np.float32))
        # Plain HTTP to the TLS port does not get an answer from the service.
        with pytest.raises(aiohttp.ClientError):
            await post(server_url(cluster) + "/v1/status", cluster.env["AKV_TOKEN"])
        await asyncio.gather(*(kv.close() for kv in stores))
