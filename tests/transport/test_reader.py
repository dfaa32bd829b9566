"""FrameReader: a stream of frames in, messages out, large payloads received in place."""

from __future__ import annotations

import random
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv_transport._reader import DISCARD, FrameReader, Message
from akv_transport.errors import FrameError, StreamEndedError
from akv_transport.frame import (
    DTYPE_CODES,
    KEEPALIVE_FRAME,
    MAGIC,
    VERSION_KEEPALIVE,
    ArrayInfo,
    FrameHeader,
    as_array,
    encode_frame,
    encode_header,
    frame_bytes,
)

# ---------------------------------------------------------------------- helpers


def fresh(header: FrameHeader) -> list[memoryview | None]:
    return [None] * len(header.arrays)


def feed(reader: FrameReader, stream: bytes, rng: random.Random) -> list[Message]:
    """Deliver ``stream`` as a BufferedProtocol would: random-sized writes into get_buffer()."""
    messages: list[Message] = []
    view = memoryview(stream)
    while view:
        buffer = reader.get_buffer(-1)
        assert len(buffer) > 0
        count = min(rng.randint(1, len(buffer)), len(view))
        buffer[:count] = view[:count]
        view = view[count:]
        messages.extend(reader.buffer_updated(count))
    return messages


def assert_delivered(message: Message, frame_args: tuple) -> None:
    """``message`` is the frame that ``frame_args`` (op, seq, arrays, fields) encode."""
    op, seq, arrays, fields = frame_args
    header = message.header
    assert (header.op, header.seq, header.text) == (op, seq, fields.get("text", ""))
    assert (header.flags, header.aux) == (fields.get("flags", 0), fields.get("aux", 0))
    assert len(message.buffers) == len(arrays)
    for (key, array, tag), info, buffer in zip(arrays, header.arrays, message.buffers, strict=True):
        assert (info.key, info.tag, info.shape, info.dtype) == (key, tag, array.shape, array.dtype)
        assert buffer.format == "B" and buffer.nbytes == array.nbytes
        assert as_array(info, buffer).tobytes() == array.tobytes()


def encode_all(messages: list[tuple]) -> bytes:
    return b"".join(frame_bytes(op, seq, arrays, **fields) for op, seq, arrays, fields in messages)


def some_messages() -> list[tuple]:
    rng = np.random.default_rng(0)
    return [
        (1, 0, [(0, rng.random((3, 4)).astype(np.float32), 1)], {}),
        (2, 1, [], {"text": "no arrays", "aux": -3}),
        (3, 2, [("w", np.zeros((0, 5)), 0), (None, np.arange(7, dtype=np.int8), 2)], {}),
        (4, 3, [(9, rng.random(50_000), 0)], {"flags": 5}),
        (5, 4, [(1, np.array(True), 0), (2, np.array(3 + 4j, dtype=np.complex64), 0)], {}),
    ]


# ---------------------------------------------------------------------- streams of messages


@pytest.mark.parametrize("seed", range(5))
def test_messages_arrive_intact_and_in_order_whatever_the_chunking(seed):
    messages = some_messages() * 3
    reader = FrameReader(fresh, scratch_bytes=4096, direct_threshold_bytes=1024)
    received = feed(reader, encode_all(messages), random.Random(seed))
    assert len(received) == len(messages)
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)
    assert reader.idle
    reader.eof()


@pytest.mark.parametrize("seed", range(5))
def test_keepalives_between_messages_are_counted_and_never_delivered(seed):
    messages = some_messages()
    stream = KEEPALIVE_FRAME.join(
        [b"", *(frame_bytes(op, seq, arrays, **fields) for op, seq, arrays, fields in messages)]
    )
    reader = FrameReader(fresh, scratch_bytes=4096, direct_threshold_bytes=1024)
    received = feed(reader, stream + KEEPALIVE_FRAME, random.Random(seed))
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)
    assert reader.statistics().keepalives == len(messages) + 1
    assert reader.idle  # a keepalive ends cleanly where it ends
    reader.eof()


@pytest.mark.parametrize(("header_len", "payload_len"), [(1, 0), (0, 8), (16, 16)])
def test_a_keepalive_with_a_header_or_a_payload_breaks_the_stream(header_len, payload_len):
    reader = FrameReader(fresh)
    bad = MAGIC + bytes([VERSION_KEEPALIVE]) + struct.pack("<IQ", header_len, payload_len)
    reader.get_buffer(-1)[:16] = bad
    with pytest.raises(FrameError, match="keepalive: header_len"):
        reader.buffer_updated(16)


def test_many_small_messages_come_out_of_one_buffer_updated():
    messages = [(1, seq, [(seq, np.full(4, seq, np.int32), 0)], {}) for seq in range(50)]
    stream = encode_all(messages)
    reader = FrameReader(fresh)
    buffer = reader.get_buffer(-1)
    buffer[: len(stream)] = stream
    received = reader.buffer_updated(len(stream))
    assert [message.header.seq for message in received] == list(range(50))
    assert reader.statistics().messages == 50


def test_a_message_is_not_delivered_before_its_last_byte():
    stream = frame_bytes(1, 0, [(0, np.arange(10, dtype=np.uint8), 0)])
    reader = FrameReader(fresh)
    buffer = reader.get_buffer(-1)
    buffer[: len(stream) - 1] = stream[:-1]
    assert reader.buffer_updated(len(stream) - 1) == []
    assert not reader.idle
    buffer = reader.get_buffer(-1)
    buffer[:1] = stream[-1:]
    (message,) = reader.buffer_updated(1)
    assert bytes(message.buffers[0]) == bytes(range(10))
    assert reader.idle


def test_zero_array_and_zero_length_array_messages_are_delivered():
    messages = [
        (1, 0, [], {}),
        (2, 1, [(0, np.zeros(0, np.float32), 0), (1, np.zeros((2, 0), np.int64), 0)], {}),
        (3, 2, [], {"text": "é"}),
    ]
    calls = []

    def destinations(header):
        calls.append(header.seq)
        return fresh(header)

    reader = FrameReader(destinations)
    received = feed(reader, encode_all(messages), random.Random(1))
    assert calls == [0, 1, 2]
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)


def test_feeding_one_byte_at_a_time_works():
    messages = some_messages()[:3]
    reader = FrameReader(fresh, scratch_bytes=16)
    received = []
    for byte in encode_all(messages):
        reader.get_buffer(-1)[:1] = bytes([byte])
        received.extend(reader.buffer_updated(1))
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)


def test_get_buffer_may_be_called_again_before_buffer_updated():
    stream = frame_bytes(1, 0, [(0, np.arange(3.0), 0)])
    reader = FrameReader(fresh)
    reader.get_buffer(-1)
    buffer = reader.get_buffer(100)
    buffer[: len(stream)] = stream
    (message,) = reader.buffer_updated(len(stream))
    assert message.header.arrays[0].shape == (3,)


# ---------------------------------------------------------------------- destinations


def test_a_large_array_is_received_straight_into_its_destination(monkeypatch):
    source = np.random.default_rng(1).random((512, 1024))  # 4 MiB
    target = np.empty_like(source)
    messages = [(7, 1, [("w", source, 3)], {})]
    handed_out = []

    def destinations(header):
        return [memoryview(target).cast("B")]

    reader = FrameReader(destinations)
    original = reader.get_buffer

    def spying_get_buffer(sizehint):
        buffer = original(sizehint)
        handed_out.append(buffer)
        return buffer

    monkeypatch.setattr(reader, "get_buffer", spying_get_buffer)
    (message,) = feed(reader, encode_all(messages), random.Random(2))
    np.testing.assert_array_equal(target, source)
    assert np.shares_memory(np.frombuffer(message.buffers[0], np.uint8), target)
    assert any(np.shares_memory(np.frombuffer(b, np.uint8), target) for b in handed_out)
    stats = reader.statistics()
    assert stats.payload_bytes_direct + stats.payload_bytes_copied == source.nbytes
    assert stats.payload_bytes_direct > 0.9 * source.nbytes


def test_direct_buffers_never_reach_past_the_array():
    first, second = np.arange(100_000, dtype=np.uint8), np.arange(70_000, dtype=np.uint16)
    targets = [bytearray(first.nbytes), bytearray(second.nbytes)]
    stream = frame_bytes(1, 0, [(0, first, 0), (1, second, 0)]) + frame_bytes(2, 1)
    reader = FrameReader(lambda header: [memoryview(t) for t in targets] if header.arrays else [])
    received = []
    view = memoryview(stream)
    while view:
        buffer = reader.get_buffer(-1)
        count = min(len(buffer), len(view))  # always fill the whole buffer
        buffer[:count] = view[:count]
        view = view[count:]
        received.extend(reader.buffer_updated(count))
    assert [message.header.op for message in received] == [1, 2]
    assert bytes(targets[0]) == first.tobytes() and bytes(targets[1]) == second.tobytes()


def test_a_none_destination_gets_a_fresh_writable_buffer():
    stream = frame_bytes(1, 0, [(0, np.arange(4, dtype=np.int32), 0)]) * 2
    reader = FrameReader(fresh)
    first, second = feed(reader, stream, random.Random(3))
    assert not first.buffers[0].readonly
    assert not np.shares_memory(
        np.frombuffer(first.buffers[0], np.uint8), np.frombuffer(second.buffers[0], np.uint8)
    )


def test_destinations_may_be_arrays_and_bytearrays_of_the_right_size():
    target = np.zeros((2, 3), np.float32)
    scratch = bytearray(8)
    stream = frame_bytes(1, 0, [(0, np.ones((2, 3), np.float32), 0), (1, np.arange(1.0), 0)])
    # Beyond the memoryviews that Destinations names: any writable buffer of the right size.
    reader = FrameReader(lambda header: [target, scratch])
    (message,) = feed(reader, stream, random.Random(4))
    assert (target == 1).all()
    assert [buffer.format for buffer in message.buffers] == ["B", "B"]


def test_a_destination_of_the_wrong_length_raises():
    stream = frame_bytes(1, 0, [("w", np.zeros(4, np.float32), 0)])
    reader = FrameReader(lambda header: [memoryview(bytearray(15))])
    with pytest.raises(FrameError, match=r"array 0 \(key 'w'\) holds 15 bytes, the frame says 16"):
        feed(reader, stream, random.Random(5))


@pytest.mark.parametrize(
    ("destinations", "match"),
    [
        ([], r"returned 0 buffers for a frame of 1 arrays"),
        ([None, None], r"returned 2 buffers for a frame of 1 arrays"),
        ([memoryview(bytes(16))], r"destination of array 0 \(key 0\) is read-only"),
        ([memoryview(bytearray(32))[::2]], r"destination of array 0 \(key 0\) is not contiguous"),
        ([16], r"destination of array 0 \(key 0\) is a int, not a writable buffer or None"),
    ],
)
def test_unusable_destinations_raise(destinations, match):
    stream = frame_bytes(1, 0, [(0, np.zeros(4, np.float32), 0)])
    reader = FrameReader(lambda header: destinations)
    with pytest.raises(FrameError, match=match):
        feed(reader, stream, random.Random(6))


def test_an_error_in_destinations_propagates_and_breaks_the_reader():
    def destinations(header):
        raise LookupError("no such request")

    reader = FrameReader(destinations)
    with pytest.raises(LookupError, match="no such request"):
        feed(reader, frame_bytes(1, 0), random.Random(7))
    with pytest.raises(FrameError, match=r"broken by an earlier error: .*no such request"):
        reader.get_buffer(-1)


# ---------------------------------------------------------------------- headers


def test_headers_bigger_than_the_scratch_buffer_are_received():
    messages = [
        (1, 0, [("k" * 5000, np.arange(3.0), 0)], {"text": "t" * 3000}),
        (2, 1, [(0, np.arange(2), 0)], {}),
        (3, 2, [(i, np.zeros(1, np.uint8), i) for i in range(300)], {}),
    ]
    reader = FrameReader(fresh, scratch_bytes=64)
    received = feed(reader, encode_all(messages), random.Random(8))
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)


# ---------------------------------------------------------------------- the stream's end


def test_eof_between_messages_is_clean():
    reader = FrameReader(fresh)
    reader.eof()
    feed(reader, frame_bytes(1, 0), random.Random(9))
    assert reader.idle
    reader.eof()


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (5, r"stream ended inside a frame: 5 of 16 prefix bytes received"),
        (20, r"stream ended inside a frame: 4 of \d+ header bytes received"),
        (-3, r"stream ended inside a frame: 37 of 40 payload bytes received \(array 0 of 1\)"),
    ],
)
def test_eof_in_the_middle_of_a_message_raises(cut, match):
    stream = frame_bytes(1, 0, [(0, np.arange(10, dtype=np.float32), 0)])
    reader = FrameReader(fresh)
    feed(reader, stream[:cut], random.Random(10))
    assert not reader.idle
    with pytest.raises(StreamEndedError, match=match):  # a FrameError: a truncation
        reader.eof()


def test_eof_inside_a_large_header_or_direct_payload_says_where():
    reader = FrameReader(fresh, scratch_bytes=32)
    feed(reader, frame_bytes(1, 0, text="x" * 100)[:50], random.Random(11))
    with pytest.raises(FrameError, match=r"34 of 128 header bytes received"):
        reader.eof()
    reader = FrameReader(fresh, direct_threshold_bytes=100)
    stream = frame_bytes(1, 0, [(0, np.zeros(10, np.uint8), 0), (1, np.zeros(1000, np.uint8), 0)])
    feed(reader, stream[:-500], random.Random(12))
    with pytest.raises(FrameError, match=r"510 of 1010 payload bytes received \(array 1 of 2\)"):
        reader.eof()


# ---------------------------------------------------------------------- errors


def test_garbage_raises_and_the_reader_stays_broken():
    reader = FrameReader(fresh)
    buffer = reader.get_buffer(-1)
    buffer[:16] = b"GET / HTTP/1.1\r\n"
    with pytest.raises(FrameError, match=r"magic b'GET' is not b'AKV'"):
        reader.buffer_updated(16)
    with pytest.raises(FrameError, match=r"broken by an earlier error: .*magic"):
        reader.get_buffer(-1)
    with pytest.raises(FrameError, match=r"broken"):
        reader.buffer_updated(1)
    with pytest.raises(FrameError, match=r"broken"):
        reader.eof()


def test_a_payload_over_the_limit_raises():
    stream = frame_bytes(1, 0, [(0, np.zeros(100, np.uint8), 0)])
    reader = FrameReader(fresh, max_payload_bytes=99)
    with pytest.raises(FrameError, match=r"payload_len 100 exceeds max_payload_bytes 99"):
        feed(reader, stream, random.Random(13))


def test_a_garbled_header_raises():
    stream = bytearray(frame_bytes(1, 0, [(0, np.zeros(3, np.float32), 0)]))
    stream[16 + 28 + 3] = 1  # the descriptor's reserved byte
    reader = FrameReader(fresh)
    with pytest.raises(FrameError, match=r"reserved byte 1 of array 0 is not 0"):
        feed(reader, bytes(stream), random.Random(14))


def test_buffer_updated_beyond_the_buffer_is_refused_and_changes_nothing():
    reader = FrameReader(fresh, scratch_bytes=64)
    reader.get_buffer(-1)
    with pytest.raises(ValueError, match=r"buffer_updated\(65\) but the last buffer"):
        reader.buffer_updated(65)
    (message,) = feed(reader, frame_bytes(4, 0), random.Random(15))
    assert message.header.op == 4


def test_buffer_updated_without_a_buffer_is_refused():
    with pytest.raises(ValueError, match=r"holds 0 bytes"):
        FrameReader(fresh).buffer_updated(1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"scratch_bytes": 15}, r"scratch_bytes 15 is below PREFIX_BYTES 16"),
        ({"direct_threshold_bytes": 0}, r"direct_threshold_bytes 0 is below 1"),
        ({"max_payload_bytes": -1}, r"max_payload_bytes -1 is negative"),
    ],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        FrameReader(fresh, **options)


# ---------------------------------------------------------------------- properties

SHAPES = st.lists(st.integers(0, 40), max_size=3).map(tuple)


@st.composite
def message_lists(draw):
    messages = []
    for seq in range(draw(st.integers(1, 6))):
        arrays = []
        for index in range(draw(st.integers(0, 3))):
            dtype = draw(st.sampled_from(list(DTYPE_CODES)))
            shape = draw(SHAPES)
            array = (
                (np.arange(int(np.prod(shape)), dtype=np.int64) * (seq + 3) % 251)
                .astype(dtype)
                .reshape(shape)
            )
            key = draw(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=5)))
            arrays.append((key, array, index))
        text = draw(st.text(max_size=40))
        messages.append((draw(st.integers(0, 2**16 - 1)), seq, arrays, {"text": text}))
    return messages


PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(
    message_lists(),
    st.integers(0, 2**32),
    st.sampled_from([16, 100, 4096]),
    st.sampled_from([1, 64, 1000]),
    st.booleans(),
)
def test_random_messages_in_random_chunks_arrive_intact(
    messages, seed, scratch_bytes, threshold, own_destinations
):
    def destinations(header):
        if not own_destinations:
            return fresh(header)
        return [memoryview(bytearray(info.nbytes)) for info in header.arrays]

    reader = FrameReader(
        destinations, scratch_bytes=scratch_bytes, direct_threshold_bytes=threshold
    )
    received = feed(reader, encode_all(messages), random.Random(seed))
    assert len(received) == len(messages)
    for message, args in zip(received, messages, strict=True):
        assert_delivered(message, args)
    assert reader.idle
    stats = reader.statistics()
    total = sum(array.nbytes for _, _, arrays, _ in messages for _, array, _ in arrays)
    assert stats.payload_bytes_direct + stats.payload_bytes_copied == total


@PROPERTY
@given(message_lists(), st.data(), st.integers(0, 2**32))
def test_corrupted_streams_yield_messages_or_frame_error(messages, data, seed):
    stream = bytearray(encode_all(messages))
    index = data.draw(st.integers(0, len(stream) - 1))
    stream[index] = data.draw(st.integers(0, 255))
    reader = FrameReader(fresh, scratch_bytes=64, direct_threshold_bytes=64)
    try:
        received = feed(reader, bytes(stream), random.Random(seed))
        reader.eof()
    except FrameError:
        return
    for message in received:
        for info, buffer in zip(message.header.arrays, message.buffers, strict=True):
            assert as_array(info, buffer).shape == info.shape


@PROPERTY
@given(st.binary(max_size=300), st.integers(0, 2**32))
def test_random_garbage_streams_yield_messages_or_frame_error(garbage, seed):
    reader = FrameReader(fresh, scratch_bytes=32)
    try:
        feed(reader, b"AKV\x01" + garbage, random.Random(seed))
        reader.eof()
    except FrameError:
        pass


def test_encode_frame_buffers_written_in_sequence_form_the_stream():
    arrays = [(0, np.arange(100_000, dtype=np.float32), 0), (1, np.arange(3), 0)]
    stream = b"".join(bytes(buffer) for buffer in encode_frame(1, 2, arrays))
    (message,) = feed(FrameReader(fresh), stream, random.Random(16))
    assert_delivered(message, (1, 2, arrays, {}))


# ---------------------------------------------------------------------- discarded payloads

GIB = 1 << 30


def huge_header(nbytes: int, key: object = "ghost", op: int = 3, seq: int = 7) -> bytes:
    """The prefix and header of a frame declaring one uint8 array of ``nbytes`` (no payload)."""
    info = ArrayInfo(key, np.dtype("u1"), (nbytes,), nbytes)
    return encode_header(FrameHeader(op, 0, seq, 0, (info,), "", nbytes))


def pour(reader: FrameReader, nbytes: int) -> tuple[list[Message], int]:
    """Deliver ``nbytes`` as the kernel would, into whatever buffer get_buffer gives;
    return the messages and the largest buffer handed out."""
    messages: list[Message] = []
    largest = 0
    while nbytes:
        buffer = reader.get_buffer(-1)
        largest = max(largest, len(buffer))
        count = min(len(buffer), nbytes)  # what the bytes are does not matter here
        nbytes -= count
        messages.extend(reader.buffer_updated(count))
    return messages, largest


def test_a_discarded_gib_payload_passes_through_without_being_allocated():
    after = (1, 8, [(0, np.arange(5, dtype=np.float32), 0)], {})
    reader = FrameReader(
        lambda header: [DISCARD] if header.seq == 7 else [None] * len(header.arrays)
    )
    tracemalloc.start()
    try:
        messages = feed(reader, huge_header(GIB), random.Random(20))
        assert messages == []
        poured, largest = pour(reader, GIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"discarding a declared GiB allocated {peak} bytes"
    assert largest <= 256 << 10  # never more than the scratch buffer at once
    (refused,) = poured
    assert refused.header.payload_len == GIB and refused.buffers == (memoryview(b""),)
    assert reader.statistics().payload_bytes_discarded == GIB
    assert reader.statistics().payload_bytes_direct == 0
    # The stream is still in step: the next frame arrives intact.
    (message,) = feed(reader, encode_all([after]), random.Random(21))
    assert_delivered(message, after)
    assert reader.idle


@pytest.mark.parametrize("seed", range(4))
def test_discarded_arrays_are_dropped_and_the_others_received_whatever_the_chunking(seed):
    rng = np.random.default_rng(seed)
    arrays = [
        (key, rng.random(size).astype(np.float32), 0)
        for key, size in enumerate((3, 70_000, 0, 9, 50_000))
    ]
    drop = {1, 3}
    frames = [(1, 0, arrays, {}), (2, 1, arrays[:1], {"text": "after"})]

    def destinations(header: FrameHeader) -> list:
        if header.seq == 0:
            return [DISCARD if index in drop else None for index in range(len(header.arrays))]
        return [None] * len(header.arrays)

    reader = FrameReader(destinations, scratch_bytes=4096, direct_threshold_bytes=1024)
    first, second = feed(reader, encode_all(frames), random.Random(seed))
    for index, (_, array, _) in enumerate(arrays):
        buffer = first.buffers[index]
        if index in drop:
            assert len(buffer) == 0
        else:
            assert bytes(buffer) == array.tobytes()
    assert_delivered(second, frames[1])
    stats = reader.statistics()
    assert stats.payload_bytes_discarded == sum(arrays[i][1].nbytes for i in drop)
    assert reader.idle


def test_a_discarded_payload_cut_short_says_where_at_eof():
    reader = FrameReader(lambda header: [DISCARD])
    feed(reader, huge_header(1000) + bytes(400), random.Random(22))
    with pytest.raises(FrameError, match=r"400 of 1000 payload bytes received"):
        reader.eof()
