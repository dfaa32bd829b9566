"""Gradient compression (issue #26): MXNet 1.9.1's 2bit and MXNet 2.0's 1bit, bit for bit, in
the local, device and dist_sync stores, with the bytes on the wire counted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import akv
from akv.cluster.protocol import Op
from akv.compression import (
    Compression,
    Residuals,
    compressed_nbytes,
    decode,
    encode,
    parse_compression,
    parse_wire,
)
from akv.errors import CompressionError

REFERENCE = json.loads((Path(__file__).parent / "data" / "compression_reference.json").read_text())
TWO_BIT = Compression("2bit", 0.5)
ONE_BIT = Compression("1bit", 0.0)


def f32(values) -> np.ndarray:
    return np.asarray(values, np.float32)


# ---------------------------------------------------------------------- the codes


def test_2bit_packs_four_values_a_byte_most_significant_pair_first():
    residual = np.zeros(6, np.float32)
    data = encode(TWO_BIT, f32([0.5, -0.5, 0.2, 0.7, -0.9, 0.0]), residual)
    # 11 10 00 11 | 10 00 (padding 00 00) | then two zero bytes: one 32-bit word of 16 values
    assert data.tolist() == [0b11100011, 0b10000000, 0, 0]
    np.testing.assert_array_equal(decode(TWO_BIT, data, 6), [0.5, -0.5, 0, 0.5, -0.5, 0])
    np.testing.assert_allclose(residual, [0, 0, 0.2, 0.2, -0.4, 0], atol=1e-7)


def test_2bit_residuals_accumulate_as_mxnet_documents():
    """0.4 sends nothing; a further 0.1 sends 0.5; 0.2 nothing; 0.3 sends 0.5; -0.5 sends
    -0.5 (MXNet's own test)."""
    residual = np.zeros(3, np.float32)
    sent = [
        float(decode(TWO_BIT, encode(TWO_BIT, np.full(3, g, np.float32), residual), 3)[0])
        for g in (0.4, 0.1, 0.2, 0.3, -0.5)
    ]
    assert sent == [0.0, 0.5, 0.0, 0.5, -0.5]


def test_1bit_sends_plus_or_minus_one_a_bit_most_significant_first():
    residual = np.zeros(9, np.float32)
    grad = f32([0.1, -0.1, 2.0, 0.0, 1e-3, -5, 0.6, 0.4, 3])
    data = encode(ONE_BIT, grad, residual)
    assert data.tolist() == [0b10101011, 0b10000000, 0, 0]
    decoded = decode(ONE_BIT, data, 9)
    np.testing.assert_array_equal(decoded, np.where(grad > 0, 1, -1))
    np.testing.assert_allclose(residual, grad - decoded)


@pytest.mark.parametrize("compression", [TWO_BIT, Compression("2bit", 0.25), ONE_BIT])
def test_the_vectorized_codes_equal_a_loop_over_mxnets_definition(compression):
    rng = np.random.default_rng(1)
    size = 77
    residual = np.zeros(size, np.float32)
    expected_residual = np.zeros(size, np.float32)
    t = np.float32(compression.threshold)
    for _ in range(5):
        grad = (rng.standard_normal(size) * 0.4).astype(np.float32)
        got = decode(compression, encode(compression, grad, residual), size)
        want = np.zeros(size, np.float32)
        for i in range(size):
            expected_residual[i] += grad[i]
            r = expected_residual[i]
            if compression.type == "2bit":
                if r >= t:
                    want[i], expected_residual[i] = t, r - t
                elif r <= -t:
                    want[i], expected_residual[i] = -t, r + t
            elif r > t:
                want[i], expected_residual[i] = 1, r - 1
            else:
                want[i], expected_residual[i] = -1, r + 1
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(residual, expected_residual)


def test_compressed_sizes_are_whole_words():
    assert compressed_nbytes(TWO_BIT, 1) == 4 and compressed_nbytes(TWO_BIT, 16) == 4
    assert compressed_nbytes(TWO_BIT, 17) == 8 and compressed_nbytes(ONE_BIT, 32) == 4
    assert compressed_nbytes(ONE_BIT, 1 << 20) == (1 << 20) // 8


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"type": "3bit"}, "not one of 2bit, 1bit"),
        ({"type": "2bit", "threshold": 0}, "above 0"),
        ({"type": "2bit", "threshold": -1.0}, "above 0"),
        ({"type": "2bit", "threshold": float("nan")}, "finite number"),
        ({"type": "2bit", "threshold": True}, "finite number"),
        ({"type": "2bit", "threshold": "x"}, "finite number"),
        ({"type": "2bit", "ratio": 2}, r"unknown parameter\(s\) \['ratio'\]"),
        ("2bit", "takes a dict"),
    ],
)
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(CompressionError, match=message):
        parse_compression(params)


def test_parameters_as_mxnet_gives_them_and_as_a_frame_carries_them():
    assert parse_compression({"type": "2bit"}) == TWO_BIT  # MXNet's default threshold
    assert parse_compression({"type": "1bit", "threshold": "-0.25"}) == Compression("1bit", -0.25)
    assert parse_wire(Compression("2bit", 0.1).wire) == Compression("2bit", 0.1)
    with pytest.raises(CompressionError, match="malformed compression"):
        parse_wire("2bit")


# ---------------------------------------------------------------------- the stores


def mxnet_senders() -> tuple[np.ndarray, np.ndarray]:
    """MXNet's pushes (step, sender, shape) and what each pull after them gave."""
    return f32(REFERENCE["grads"]), f32(REFERENCE["pulled"])


@pytest.mark.parametrize("name", ["local", "device"])
def test_a_local_store_equals_mxnets_device_store_bit_for_bit(name):
    grads, pulled = mxnet_senders()
    with akv.create(name) as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": REFERENCE["threshold"]})
        kv.init(3, np.zeros(grads.shape[2:], np.float32))
        for step in range(grads.shape[0]):
            kv.push(3, list(grads[step]))  # one residual per position, as MXNet per device
            np.testing.assert_array_equal(kv.pull(3), pulled[step])


def test_a_local_pushpull_is_compressed_too():
    with akv.create("local") as kv:
        kv.set_gradient_compression({"type": "1bit", "threshold": 0.0})
        kv.init("w", np.zeros(4, np.float32))
        out = kv.pushpull("w", [f32([0.1, -0.1, 0, 2])] * 2)
        np.testing.assert_array_equal(out[0], [2, -2, -2, 2])


def test_what_compression_refuses_changes_nothing():
    with akv.create("local") as kv:
        kv.init("w", np.zeros(4, np.float32))
        kv.init("d", np.zeros(4, np.float64))
        kv.init("e", akv.RowSparseArray.zeros((10, 2)))
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
        with pytest.raises(CompressionError, match=r"key 'd'.*float32 values only"):
            kv.push("d", np.ones(4))
        with pytest.raises(CompressionError, match=r"key 'e'.*dense values only"):
            kv.push("e", akv.RowSparseArray(np.ones((1, 2), np.float32), [3], (10, 2)))
        kv.push("w", np.full(4, 0.6, np.float32))
        np.testing.assert_array_equal(kv.pull("w"), np.zeros(4))  # 0.6 < 1: nothing sent
        with pytest.raises(CompressionError, match="before the first push"):
            kv.set_gradient_compression({"type": "1bit"})
        kv.push("w", np.full(4, 0.6, np.float32))  # the residual is still 2bit's 0.6
        np.testing.assert_array_equal(kv.pull("w"), np.ones(4))


@pytest.mark.parametrize("call", ["push", "pushpull", "row push", "row push to an updater"])
def test_a_refused_push_leaves_compression_settable(call):
    """Compression is set before the first push: one the store refused was no push (also
    one its backend refused at the call: a row push to a store with a custom updater)."""
    with akv.create("local") as kv:
        kv.init("w", np.zeros(4, np.float32))
        kv.init("e", akv.RowSparseArray.zeros((10, 2)))
        with pytest.raises(akv.AKVError):
            if call == "push":
                kv.push("nope", np.ones(4, np.float32))
            elif call == "pushpull":
                kv.pushpull("w", np.ones(5, np.float32))
            elif call == "row push":
                kv.push("e", akv.RowSparseArray(np.ones((1, 2), np.float32), [30], (40, 2)))
            else:
                kv.set_updater(lambda key, recv, stored: None)
                kv.push("e", akv.RowSparseArray(np.ones((1, 2), np.float32), [3], (10, 2)))
        kv.set_updater(None)
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
        kv.push("w", np.full(4, 1.5, np.float32))
        np.testing.assert_array_equal(kv.pull("w"), np.ones(4))  # compressed: +threshold


# ---------------------------------------------------------------------- distributed


def simulate(compression: Compression, grads: np.ndarray) -> np.ndarray:
    """Each step's sum over the senders of their decoded pushes (a residual per sender)."""
    residuals = Residuals(compression)
    sums = []
    for step in grads:
        sums.append(
            sum(residuals.round_trip("k", sender, grad) for sender, grad in enumerate(step))
        )
    return np.stack(sums)


@pytest.mark.parametrize(
    ("workers", "servers", "compression", "shm"),
    [
        (3, 1, TWO_BIT, "0"),
        (2, 2, TWO_BIT, "0"),
        (2, 2, Compression("1bit", 0.1), "0"),
        (2, 1, TWO_BIT, "1"),
    ],
)
async def test_dist_sync_decodes_every_workers_push_and_sends_a_sixteenth(
    workers, servers, compression, shm
):
    """3 workers reproduce MXNet's three senders; the key is split over two servers in the
    others (each part compressed with its own residual, as a whole key would be). The
    server is given the compressed bytes: 1/16 (2bit) or 1/32 (1bit) of the dense bytes."""
    from tests.akv.cluster.cluster import Cluster, on_every_worker

    grads, pulled = mxnet_senders()
    if workers == 3 and compression == TWO_BIT:
        expected = pulled
    else:
        expected = simulate(compression, grads[:, :workers])
    shape = grads.shape[2:]
    size = int(np.prod(shape))
    with Cluster(workers, servers, AKV_BIGARRAY_BOUND="20", AKV_SHM=shm) as cluster:
        seen: list[int] = []
        for server in cluster.servers:
            arrived = server.state.header_arrived

            def counting(peer, header, arrived=arrived):
                if header.op in (Op.PUSH, Op.PUSHPULL):
                    seen.extend(info.nbytes for info in header.arrays)
                return arrived(peer, header)

            server.state.header_arrived = counting

        async def body(kv):
            kv.set_gradient_compression(compression.config())
            await kv.init(3, np.zeros(shape, np.float32))
            results = []
            for step in range(grads.shape[0]):
                await kv.push(3, grads[step, kv.rank])
                results.append(await kv.pull(3))
            return results, kv.placement()[3]

        ranks = await asyncio.wait_for(on_every_worker(cluster, "dist_sync", body), 60)
        for results, _ in ranks:
            np.testing.assert_array_equal(np.stack(results), expected)
        parts = [stop - start for _, start, stop in ranks[0][1]]
        assert len(parts) == servers
        per_push = sorted(compressed_nbytes(compression, n) for n in parts)
        assert sorted(seen) == sorted(per_push * workers * grads.shape[0])
        ratio = 16 if compression.type == "2bit" else 32
        assert sum(per_push) <= size * 4 // ratio + 4 * len(parts)


@pytest.mark.parametrize("compression", [TWO_BIT, ONE_BIT])
def test_the_codes_work_in_pieces_as_they_would_in_one(compression):
    """Host arrays are coded in pieces of CHUNK values (cache-sized); a size that is no
    multiple of it gives the bytes and the residual of one pass over the whole array."""
    from akv.compression import CHUNK, _encode_chunk

    size = 3 * CHUNK + 1001
    grad = (np.random.default_rng(3).standard_normal(size) * 0.4).astype(np.float32)
    pieces, whole = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for _ in range(2):
        got = encode(compression, grad, pieces)
        want = _encode_chunk(compression, np, grad, whole, compressed_nbytes(compression, size))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(pieces, whole)
    decoded = decode(compression, got, size)
    expected = decode(compression, got[: compressed_nbytes(compression, size)], size)
    np.testing.assert_array_equal(decoded, expected)
    assert set(np.unique(decoded)) <= {-1.0, 1.0, -0.5, 0.0, 0.5}


def test_values_not_sent_decode_as_positive_zero():
    data = encode(TWO_BIT, f32([0.1, -0.1]), np.zeros(2, np.float32))
    assert not np.signbit(decode(TWO_BIT, data, 2)).any()


@pytest.mark.parametrize("name", ["local", "device"])
@pytest.mark.parametrize("compression", [ONE_BIT, Compression("2bit", 0.3)])
def test_a_local_store_equals_the_simulation_of_its_senders(name, compression):
    """Each position of a pushed list is a sender with a residual of its own (MXNet's
    devices): the pulls equal a NumPy simulation of three senders, 1bit included."""
    grads, _ = mxnet_senders()
    expected = simulate(compression, grads)
    with akv.create(name) as kv:
        kv.set_gradient_compression(compression.config())
        kv.init(3, np.zeros(grads.shape[2:], np.float32))
        for step in range(grads.shape[0]):
            kv.push(3, list(grads[step]))
            np.testing.assert_array_equal(kv.pull(3), expected[step])


def test_a_refused_pushpull_leaves_the_residuals_as_they_were():
    # The out's shape is checked before the value is compressed: compressing first carried
    # the refused push's residual into the next push.
    with akv.create("local") as kv:
        kv.init(0, np.zeros(4, np.float32))
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        with pytest.raises(akv.ShapeMismatchError):
            kv.pushpull(0, f32([0.3] * 4), out=np.zeros(3, np.float32))
        kv.push(0, f32([0.3] * 4))  # below the threshold: sends zeros, keeps 0.3
        np.testing.assert_array_equal(kv.pull(0), np.zeros(4, np.float32))
