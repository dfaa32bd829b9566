"""The frame format: exact layout, round trips, and every validation error."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv_transport.errors import FrameError, TransportError
from akv_transport.frame import (
    CODE_DTYPES,
    DTYPE_CODES,
    HEADER_FIXED_BYTES,
    MAGIC,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_KEY_BYTES,
    MAX_NDIM,
    MAX_TEXT_BYTES,
    PREFIX_BYTES,
    VERSION,
    ArrayInfo,
    FrameHeader,
    as_array,
    byte_view,
    decode_frame,
    decode_header,
    decode_prefix,
    descriptor_bytes,
    encode_frame,
    encode_header,
    frame_bytes,
)

# ---------------------------------------------------------------------- helpers


def split(frame: bytes) -> tuple[bytes, int]:
    """The header bytes and payload_len of an encoded frame."""
    header_len, payload_len = decode_prefix(frame, max_payload_bytes=2**64)
    return frame[PREFIX_BYTES : PREFIX_BYTES + header_len], payload_len


def raw_header(
    descriptors: Sequence[bytes] = (),
    *,
    text: bytes = b"",
    count: int | None = None,
    text_len: int | None = None,
) -> bytes:
    """A header assembled by hand (independently of the encoder), valid or not."""
    count = len(descriptors) if count is None else count
    text_len = len(text) if text_len is None else text_len
    fixed = struct.pack("<HHIQqI", 1, 0, count, 0, 0, text_len)
    return fixed + b"".join(descriptors) + text


def raw_descriptor(
    *,
    key_kind: int = 1,
    code: int = 0,
    ndim: int | None = None,
    reserved: int = 0,
    key_len: int = 0,
    key: bytes = b"\x07" + bytes(7),
    tag: int = 0,
    nbytes: int | None = None,
    shape: tuple[int, ...] = (2,),
) -> bytes:
    ndim = len(shape) if ndim is None else ndim
    if nbytes is None:
        nbytes = int(np.prod(shape, dtype=object)) * 4
    return (
        struct.pack("<BBBBI", key_kind, code, ndim, reserved, key_len)
        + key
        + struct.pack("<qQ", tag, nbytes)
        + struct.pack(f"<{len(shape)}Q", *shape)
    )


def decode_whole(frame: bytes) -> FrameHeader:
    return decode_frame(frame)[0]


# ---------------------------------------------------------------------- the exact layout


def test_a_small_frame_has_exactly_the_documented_layout():
    frame = frame_bytes(
        0x0102,
        5,
        [
            (7, np.array([1, 2], dtype="<u2"), 9),
            ("k", np.array(1.0, dtype="<f4"), -1),
            (None, np.zeros((0,), dtype="i1"), 0),
        ],
        flags=0x0304,
        aux=-2,
        text="hi",
    )
    zero7 = b"\x00" * 7
    expected = (
        # prefix: magic, version, header_len 127, payload_len 8
        b"AKV\x01" + b"\x7f\x00\x00\x00" + b"\x08" + zero7
        # fixed part: op, flags, count 3, seq 5, aux -2, text_len 2
        + b"\x02\x01" + b"\x04\x03" + b"\x03\x00\x00\x00"
        + b"\x05" + zero7 + b"\xfe" + b"\xff" * 7 + b"\x02\x00\x00\x00"
        # array 0: int key, uint16 (9), ndim 1, reserved; key_len 0; key 7; tag 9; nbytes 4; (2,)
        + b"\x01\x09\x01\x00" + b"\x00\x00\x00\x00"
        + b"\x07" + zero7 + b"\x09" + zero7 + b"\x04" + zero7 + b"\x02" + zero7
        # array 1: str key, float32 (0), ndim 0; key_len 1; "k"; tag -1; nbytes 4; no shape
        + b"\x02\x00\x00\x00" + b"\x01\x00\x00\x00" + b"k" + b"\xff" * 8 + b"\x04" + zero7
        # array 2: no key, int8 (5), ndim 1; key_len 0; tag 0; nbytes 0; (0,)
        + b"\x00\x05\x01\x00" + b"\x00\x00\x00\x00" + b"\x00" * 8 + b"\x00" * 8 + b"\x00" * 8
        # text
        + b"hi"
        # payload: uint16 1, 2 and float32 1.0
        + b"\x01\x00\x02\x00" + b"\x00\x00\x80\x3f"
    )  # fmt: skip
    assert frame == expected


def test_the_named_limits_have_their_documented_values():
    assert (MAGIC, VERSION, PREFIX_BYTES) == (b"AKV", 1, 16)
    assert MAX_HEADER_BYTES == 16 << 20
    assert MAX_ARRAYS == 1 << 20
    assert MAX_NDIM == 32
    assert MAX_KEY_BYTES == 64 << 10
    assert MAX_TEXT_BYTES == 8 << 20


def test_dtype_codes_are_mxnets_then_ours():
    names = ["float32", "float64", "float16", "uint8", "int32", "int8", "int64", "bool",
             "int16", "uint16", "uint32", "uint64", "complex64", "complex128"]  # fmt: skip
    assert {np.dtype(name): code for code, name in enumerate(names)} == DTYPE_CODES
    assert all(CODE_DTYPES[code] == dtype for dtype, code in DTYPE_CODES.items())


def test_frame_error_is_a_transport_error_and_a_value_error():
    assert issubclass(FrameError, TransportError)
    assert issubclass(FrameError, ValueError)


# ---------------------------------------------------------------------- encode_frame's buffers


def test_encode_frame_returns_header_bytes_then_one_view_per_non_empty_array():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.zeros((0, 3), dtype=np.float64)
    c = np.array(5, dtype=np.int64)
    buffers = encode_frame(1, 2, [(0, a, 0), (1, b, 0), (2, c, 0)])
    assert type(buffers[0]) is bytes
    assert len(buffers) == 3
    views = buffers[1:]
    assert all(isinstance(view, memoryview) and view.format == "B" for view in views)
    assert [view.nbytes for view in views] == [a.nbytes, c.nbytes]


def test_encode_frame_does_not_copy_array_data():
    array = np.arange(1000, dtype=np.float64)
    view = encode_frame(1, 2, [(0, array, 0)])[1]
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), array)


def test_frame_bytes_is_the_join_of_encode_frame():
    arrays = [("w", np.arange(3, dtype=np.int32), 4)]
    assert frame_bytes(3, 4, arrays, text="x") == b"".join(encode_frame(3, 4, arrays, text="x"))


# ---------------------------------------------------------------------- round trips


def round_trip(arrays, **fields):
    frame = frame_bytes(fields.pop("op", 1), fields.pop("seq", 0), arrays, **fields)
    header, buffers = decode_frame(frame)
    pairs = zip(header.arrays, buffers, strict=True)
    return header, [as_array(info, buffer) for info, buffer in pairs]


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
def test_every_dtype_round_trips(dtype):
    array = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    header, (back,) = round_trip([(1, array, 0)])
    assert header.arrays[0].dtype == dtype
    assert back.dtype == dtype and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("key", [0, -1, 2**63 - 1, -(2**63), "", "weight", "键/ü/🙂", None])
def test_int_str_and_no_keys_round_trip(key):
    header, _ = round_trip([(key, np.zeros(2, np.float32), 0)])
    assert header.arrays[0].key == key
    assert type(header.arrays[0].key) is type(key)


def test_all_header_fields_round_trip_at_their_extremes():
    arrays = [(1, np.ones(1, np.uint8), 2**63 - 1), (2, np.ones(1, np.uint8), -(2**63))]
    frame = frame_bytes(
        2**16 - 1, 2**64 - 1, arrays, flags=2**16 - 1, aux=-(2**63), text="ошибка: ✗"
    )
    header = decode_whole(frame)
    assert (header.op, header.flags, header.seq, header.aux) == (
        2**16 - 1, 2**16 - 1, 2**64 - 1, -(2**63)
    )  # fmt: skip
    assert header.text == "ошибка: ✗"
    assert [info.tag for info in header.arrays] == [2**63 - 1, -(2**63)]
    assert header.payload_len == 2


def test_zero_dimensional_and_empty_arrays_round_trip():
    scalar = np.array(3.5, dtype=np.float64)
    empty = np.zeros((4, 0, 2), dtype=np.int16)
    header, (back_scalar, back_empty) = round_trip([(0, scalar, 0), (1, empty, 0)])
    assert back_scalar.shape == () and back_scalar == 3.5
    assert back_empty.shape == (4, 0, 2) and back_empty.dtype == np.int16
    assert [info.nbytes for info in header.arrays] == [8, 0]


def test_a_frame_without_arrays_round_trips():
    header, buffers = decode_frame(frame_bytes(7, 8, text="just text"))
    assert header == FrameHeader(7, 0, 8, 0, (), "just text", 0)
    assert buffers == ()


def test_max_ndim_and_huge_empty_shapes_round_trip():
    deep = np.zeros((1,) * MAX_NDIM, dtype=np.uint8)
    wide = np.zeros((0, 2**40), dtype=np.float32)
    _, (back_deep, back_wide) = round_trip([(0, deep, 0), (1, wide, 0)])
    assert back_deep.shape == deep.shape
    assert back_wide.shape == (0, 2**40)


def test_big_shapes_round_trip_through_the_header():
    info = ArrayInfo("big", np.dtype(np.float64), (2**20, 2**20, 2**10), 2**53, 0)
    header = FrameHeader(1, 0, 0, 0, (info,), "", 2**53)
    data, payload_len = split(encode_header(header))
    assert decode_header(data, payload_len) == header


def test_as_array_views_the_buffer_without_copying():
    info = ArrayInfo(0, np.dtype(np.int32), (2, 2), 16)
    buffer = bytearray(np.arange(4, dtype=np.int32).tobytes())
    array = as_array(info, buffer)
    array[0, 0] = 99
    assert np.frombuffer(buffer, dtype=np.int32)[0] == 99


@pytest.mark.parametrize("shape", [(2, 3), (), (3, 0), (0,)])
def test_byte_view_is_the_arrays_memory_also_when_it_holds_no_element(shape):
    """memoryview's cast refuses a zero in the shape: an array of no columns as a payload
    or a destination (a dense or row-sparse key of width 0) failed with a TypeError."""
    array = np.zeros(shape, np.float32)
    view = byte_view(array)
    assert view.format == "B" and view.nbytes == array.nbytes and not view.readonly
    if array.size:
        view[:4] = np.float32(7).tobytes()
        assert array.reshape(-1)[0] == 7
    array.flags.writeable = False
    assert byte_view(array).readonly
    with pytest.raises(TypeError):
        byte_view(np.zeros((4, 4))[:, ::2])  # not C-contiguous: no copy made instead


def test_decode_frame_returns_views_into_the_data():
    data = bytearray(frame_bytes(1, 0, [(0, np.arange(4, dtype=np.uint8), 0)]))
    _, (view,) = decode_frame(data)
    view[0] = 200
    assert data[-4] == 200


# ---------------------------------------------------------------------- encode errors

ONE = np.zeros(1, np.float32)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"op": -1}, r"op -1 is outside \[0, 65535\]"),
        ({"op": 2**16}, r"op 65536 is outside"),
        ({"op": 1.0}, r"op 1.0 is a float, not an int"),
        ({"seq": -1}, r"seq -1 is outside \[0, 18446744073709551615\]"),
        ({"seq": 2**64}, r"seq 18446744073709551616 is outside"),
        ({"flags": 2**16}, r"flags 65536 is outside"),
        ({"aux": 2**63}, r"aux 9223372036854775808 is outside"),
        ({"aux": True}, r"aux True is a bool, not an int"),
        ({"text": b"bytes"}, r"text is a bytes, not a str"),
        ({"text": "\ud800"}, r"text '\\ud800' is not valid UTF-8"),
    ],
)
def test_encode_refuses_out_of_range_fields(fields, match):
    arguments = {"op": 1, "seq": 0, **fields}
    with pytest.raises(FrameError, match=match):
        encode_frame(arguments.pop("op"), arguments.pop("seq"), **arguments)


def test_encode_refuses_text_over_max_text_bytes():
    with pytest.raises(FrameError, match=r"text of 8388609 bytes exceeds MAX_TEXT_BYTES"):
        encode_frame(1, 0, text="x" * (MAX_TEXT_BYTES + 1))


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (True, r"key True is a bool; a key is an int, a str or None"),
        (1.5, r"key 1.5 is a float"),
        (np.int64(3), r"key .*3\)? is a int64"),
        (2**63, r"key 9223372036854775808 is outside"),
        (-(2**63) - 1, r"key -9223372036854775809 is outside"),
        ("\udcff", r"key '\\udcff' is not valid UTF-8"),
        ("k" * (MAX_KEY_BYTES + 1), r"key of 65537 bytes exceeds MAX_KEY_BYTES 65536"),
    ],
)
def test_encode_refuses_bad_keys(key, match):
    with pytest.raises(FrameError, match=match):
        encode_frame(1, 0, [(key, ONE, 0)])


@pytest.mark.parametrize(
    ("tag", "match"), [(2**63, r"tag 9223372036854775808 is outside"), ("1", r"tag '1' is a str")]
)
def test_encode_refuses_bad_tags(tag, match):
    with pytest.raises(FrameError, match=match):
        encode_frame(1, 0, [(0, ONE, tag)])


def test_encode_refuses_non_contiguous_arrays_naming_the_key():
    strided = np.arange(10, dtype=np.float32)[::2]
    with pytest.raises(FrameError, match=r"array 0 \(key 'w'\) is not C-contiguous"):
        encode_frame(1, 0, [("w", strided, 0)])
    with pytest.raises(FrameError, match=r"key 3\) is not C-contiguous"):
        encode_frame(1, 0, [(3, np.zeros((3, 4)).T, 0)])


def test_encode_refuses_big_endian_dtypes():
    with pytest.raises(FrameError, match=r"dtype >f4 is big-endian; arrays travel little-endian"):
        encode_frame(1, 0, [(0, np.zeros(3, dtype=">f4"), 0)])


@pytest.mark.parametrize("dtype", ["O", "U3", "datetime64[s]", "V4", [("a", "<i4")]], ids=str)
def test_encode_refuses_dtypes_without_a_code(dtype):
    with pytest.raises(FrameError, match=r"array 0 \(key 0\): dtype .* has no wire code"):
        encode_frame(1, 0, [(0, np.zeros(2, dtype=dtype), 0)])


def test_encode_refuses_more_than_max_ndim_dimensions():
    deep = np.zeros((1,) * (MAX_NDIM + 1), dtype=np.uint8)
    with pytest.raises(FrameError, match=r"ndim 33 exceeds MAX_NDIM 32"):
        encode_frame(1, 0, [(0, deep, 0)])


def test_encode_refuses_what_is_not_an_ndarray_or_a_triple():
    with pytest.raises(FrameError, match=r"array 0 \(key 0\) is a list, not a numpy.ndarray"):
        encode_frame(1, 0, [(0, [1.0, 2.0], 0)])
    with pytest.raises(FrameError, match=r"array 0 is tuple, not a \(key, array, tag\) triple"):
        encode_frame(1, 0, [(0, ONE)])


def test_encode_refuses_headers_over_max_header_bytes():
    key = "k" * MAX_KEY_BYTES
    arrays = [(key, ONE, 0)] * (MAX_HEADER_BYTES // MAX_KEY_BYTES)
    with pytest.raises(FrameError, match=r"header of \d+ bytes exceeds MAX_HEADER_BYTES"):
        encode_frame(1, 0, arrays)


def test_encode_refuses_more_than_max_arrays():
    info = ArrayInfo(None, np.dtype(np.uint8), (0,), 0)
    header = FrameHeader(1, 0, 0, 0, (info,) * (MAX_ARRAYS + 1), "", 0)
    with pytest.raises(FrameError, match=r"1048577 arrays exceed MAX_ARRAYS 1048576"):
        encode_header(header)


def test_encode_header_refuses_inconsistent_sizes():
    info = ArrayInfo(0, np.dtype(np.float32), (2, 3), 20)
    with pytest.raises(FrameError, match=r"nbytes 20 does not match shape \(2, 3\) of float32"):
        encode_header(FrameHeader(1, 0, 0, 0, (info,), "", 20))
    info = ArrayInfo(0, np.dtype(np.float32), (2, 3), 24)
    with pytest.raises(FrameError, match=r"payload_len 25 is not the arrays' total of 24"):
        encode_header(FrameHeader(1, 0, 0, 0, (info,), "", 25))


def test_encode_header_refuses_shapes_numpy_cannot_hold():
    info = ArrayInfo(0, np.dtype(np.float32), (0, 2**62, 2**62), 0)
    with pytest.raises(
        FrameError,
        match=r"shape \(0, 4611686018427387904, 4611686018427387904\) "
        r"of float32 exceeds 9223372036854775807 bytes",
    ):
        encode_header(FrameHeader(1, 0, 0, 0, (info,), "", 0))


# ---------------------------------------------------------------------- decode_prefix errors

GOOD = frame_bytes(1, 2, [("a", np.arange(3, dtype=np.int32), 0)], text="t")


def test_decode_prefix_reads_header_and_payload_lengths():
    assert decode_prefix(GOOD) == (len(GOOD) - PREFIX_BYTES - 12, 12)


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (GOOD[:15], r"frame prefix: 15 bytes, need 16"),
        (b"XYZ" + GOOD[3:16], r"frame prefix: magic b'XYZ' is not b'AKV'"),
        (b"AKV\x02" + GOOD[4:16], r"frame version 2, this side speaks 1"),
        (
            b"AKV\x01" + struct.pack("<IQ", MAX_HEADER_BYTES + 1, 0),
            r"header_len 16777217 exceeds MAX_HEADER_BYTES 16777216",
        ),
    ],
)
def test_decode_prefix_refuses_bad_prefixes(prefix, match):
    with pytest.raises(FrameError, match=match):
        decode_prefix(prefix)


def test_decode_prefix_refuses_payloads_over_the_receivers_limit():
    with pytest.raises(FrameError, match=r"payload_len 12 exceeds max_payload_bytes 11"):
        decode_prefix(GOOD, max_payload_bytes=11)


# ---------------------------------------------------------------------- decode_header errors


@pytest.mark.parametrize(
    ("header", "payload_len", "match"),
    [
        (b"\x00" * 27, 0, r"27 bytes, shorter than its fixed 28"),
        (raw_header(count=MAX_ARRAYS + 1), 0, r"count 1048577 exceeds MAX_ARRAYS 1048576"),
        (raw_header(text_len=MAX_TEXT_BYTES + 1), 0, r"text_len 8388609 exceeds MAX_TEXT_BYTES"),
        (raw_header(count=2), 0, r"28 bytes cannot hold 2 arrays and 0 bytes of text"),
        (raw_header(text=b"ab", text_len=3), 0, r"cannot hold 0 arrays and 3 bytes of text"),
        (raw_header([raw_descriptor(reserved=1)]), 8, r"reserved byte 1 of array 0 is not 0"),
        (raw_header([raw_descriptor(code=14)]), 8, r"dtype code 14 of array 0 is unknown"),
        (raw_header([raw_descriptor(code=255)]), 8, r"dtype code 255 of array 0 is unknown"),
        (
            raw_header([raw_descriptor(ndim=40, shape=(1,) * 40)]),
            4,
            r"frame header: ndim 40 of array 0 exceeds MAX_NDIM 32",
        ),
        (raw_header([raw_descriptor(key_kind=3)]), 8, r"key_kind 3 of array 0 is unknown"),
        (raw_header([raw_descriptor(key_len=8)]), 8, r"key_len 8 of int key of array 0"),
        (
            raw_header([raw_descriptor(key_kind=0, key_len=1, key=b"")]),
            8,
            r"key_len 1 of keyless array 0",
        ),
        (
            raw_header([raw_descriptor(key_kind=2, key_len=MAX_KEY_BYTES + 1, key=b"")]),
            8,
            r"key_len 65537 of array 0 exceeds MAX_KEY_BYTES 65536",
        ),
        (
            raw_header([raw_descriptor(key_kind=2, key_len=2, key=b"\xff\xfe")]),
            8,
            r"key of array 0 is not valid UTF-8",
        ),
        (raw_header([raw_descriptor(nbytes=7)]), 7, r"nbytes 7 of array 0 does not match shape"),
        (
            raw_header([raw_descriptor(shape=(2**32, 2**32), nbytes=0)]),
            0,
            r"shape \(4294967296, 4294967296\) of float32 of array 0 exceeds",
        ),
        (
            raw_header([raw_descriptor(shape=(0, 2**63), nbytes=0)]),
            0,
            r"shape \(0, 9223372036854775808\) of float32 of array 0 exceeds",
        ),
        (raw_header([raw_descriptor()]), 9, r"arrays hold 8 bytes but payload_len is 9"),
        (raw_header(text=b"\xc3"), 0, r"text is not valid UTF-8"),
        (raw_header(text=b"ok") + b"\x00", 0, r"1 trailing bytes after the text"),
        (raw_header([raw_descriptor()]) + b"\x00" * 3, 8, r"3 trailing bytes after the text"),
    ],
)
def test_decode_header_refuses_bad_fields(header, payload_len, match):
    with pytest.raises(FrameError, match=match):
        decode_header(header, payload_len)


def test_hand_assembled_headers_are_valid_when_nothing_is_wrong():
    header = decode_header(raw_header([raw_descriptor()], text=b"ok"), 8)
    assert header.arrays == (ArrayInfo(7, np.dtype(np.float32), (2,), 8, 0),)
    assert header.text == "ok"


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (raw_descriptor()[:7], r"descriptor of array 0 is truncated"),
        (raw_descriptor()[:20], r"int key of array 0 is truncated"),
        (raw_descriptor(key_kind=2, key_len=30, key=b"abc"), r"str key of array 0 is truncated"),
        (raw_descriptor(key_kind=0, key=b"")[:20], r"tag and nbytes of array 0 are truncated"),
        (raw_descriptor(shape=(2, 3))[:-1], r"shape of array 0 \(ndim 2\) is truncated"),
    ],
)
def test_decode_header_refuses_truncated_descriptors(descriptor, match):
    # A long first descriptor gets the header past the quick check of its minimum size.
    header = raw_header([raw_descriptor(shape=(1, 1, 1, 1, 2)), descriptor])
    with pytest.raises(FrameError, match=match.replace("array 0", "array 1")):
        decode_header(header, 16)


def test_decode_header_refuses_truncated_text():
    header = raw_header([raw_descriptor(key_kind=2, key_len=30, key=b"k" * 30)], text=b"hello")
    with pytest.raises(FrameError, match=r"text of 5 bytes is truncated at 2 bytes"):
        decode_header(header[:-3], 8)


def test_decode_header_refuses_headers_over_max_header_bytes():
    with pytest.raises(FrameError, match=r"16777217 bytes exceed MAX_HEADER_BYTES"):
        decode_header(bytes(MAX_HEADER_BYTES + 1), 0)


def test_decode_frame_refuses_data_that_is_not_one_frame_long():
    with pytest.raises(FrameError, match=rf"frame: {len(GOOD) + 1} bytes, but its prefix"):
        decode_frame(GOOD + b"\x00")
    with pytest.raises(FrameError, match=rf"frame: {len(GOOD) - 1} bytes, but its prefix"):
        decode_frame(GOOD[:-1])


def test_as_array_refuses_buffers_of_the_wrong_size():
    info = ArrayInfo("w", np.dtype(np.float32), (2,), 8)
    with pytest.raises(FrameError, match=r"array of key 'w': buffer of 7 bytes, expected 8"):
        as_array(info, bytes(7))


# ---------------------------------------------------------------------- properties

KEYS = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=20),
)
SHAPES = st.lists(st.integers(0, 4), max_size=4).map(tuple)


@st.composite
def array_items(draw):
    dtype = draw(st.sampled_from(list(DTYPE_CODES)))
    shape = draw(SHAPES)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return draw(KEYS), array, draw(st.integers(-(2**63), 2**63 - 1))


@st.composite
def frames(draw):
    """Arguments of a valid frame, and its bytes."""
    fields = {
        "op": draw(st.integers(0, 2**16 - 1)),
        "seq": draw(st.integers(0, 2**64 - 1)),
        "flags": draw(st.integers(0, 2**16 - 1)),
        "aux": draw(st.integers(-(2**63), 2**63 - 1)),
        "text": draw(st.text(max_size=30)),
    }
    arrays = draw(st.lists(array_items(), max_size=5))
    frame = frame_bytes(fields["op"], fields["seq"], arrays, flags=fields["flags"],
                        aux=fields["aux"], text=fields["text"])  # fmt: skip
    return fields, arrays, frame


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(frames())
def test_random_valid_frames_round_trip(case):
    fields, arrays, frame = case
    header, buffers = decode_frame(frame)
    assert (header.op, header.seq, header.flags, header.aux, header.text) == (
        fields["op"], fields["seq"], fields["flags"], fields["aux"], fields["text"]
    )  # fmt: skip
    assert len(header.arrays) == len(arrays) == len(buffers)
    for (key, array, tag), info, buffer in zip(arrays, header.arrays, buffers, strict=True):
        assert (info.key, info.dtype, info.shape, info.nbytes, info.tag) == (
            key, array.dtype, array.shape, array.nbytes, tag
        )  # fmt: skip
        assert as_array(info, buffer).tobytes() == array.tobytes()
    assert encode_header(header) == frame[: PREFIX_BYTES + len(split(frame)[0])]


def decodes_or_refuses(frame: bytes) -> None:
    """Decode as a receiver would; anything but a valid header or a FrameError fails."""
    try:
        header_len, payload_len = decode_prefix(frame)
        header = decode_header(frame[PREFIX_BYTES : PREFIX_BYTES + header_len], payload_len)
    except FrameError:
        return
    assert isinstance(header, FrameHeader)
    assert sum(info.nbytes for info in header.arrays) == payload_len
    for info in header.arrays:
        assert as_array(info, bytes(info.nbytes)).shape == info.shape


@PROPERTY
@given(st.binary(max_size=200), st.integers(0, 2**64 - 1))
def test_random_garbage_headers_decode_or_raise_frame_error(data, payload_len):
    with contextlib.suppress(FrameError):
        decode_header(data, payload_len)


@PROPERTY
@given(
    st.integers(0, 4),
    st.binary(max_size=300),
    st.integers(0, 64),
)
def test_garbage_after_a_plausible_fixed_part_decodes_or_raises_frame_error(count, rest, text):
    data = struct.pack("<HHIQqI", 1, 0, count, 0, 0, text) + rest
    try:
        header = decode_header(data, 0)
    except FrameError:
        return
    assert len(header.arrays) == count


@PROPERTY
@given(st.binary(max_size=100))
def test_random_garbage_frames_decode_or_raise_frame_error(data):
    decodes_or_refuses(b"AKV\x01" + data)
    decodes_or_refuses(data)


@PROPERTY
@given(frames(), st.data())
def test_truncated_headers_always_raise_frame_error(case, data):
    _, _, frame = case
    header, payload_len = split(frame)
    cut = data.draw(st.integers(0, len(header) - 1))
    with pytest.raises(FrameError):
        decode_header(header[:cut], payload_len)
    with pytest.raises(FrameError):
        decode_frame(frame[: data.draw(st.integers(0, len(frame) - 1))])


@PROPERTY
@given(frames(), st.data())
def test_single_byte_corruptions_decode_or_raise_frame_error(case, data):
    _, _, frame = case
    index = data.draw(st.integers(0, len(frame) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != frame[index]))
    corrupted = frame[:index] + bytes([value]) + frame[index + 1 :]
    decodes_or_refuses(corrupted)


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=40)),
            st.integers(0, 4),
        ),
        max_size=8,
    ),
    st.text(max_size=20),
)
def test_descriptor_bytes_is_what_each_array_adds_to_the_header(arrays, text):
    # What a worker counts to refuse a request too big for one frame before it builds it.
    encoded = [(key, np.zeros((1,) * ndim, np.float32), 0) for key, ndim in arrays]
    header, _ = split(frame_bytes(1, 0, encoded, text=text))
    expected = (
        HEADER_FIXED_BYTES
        + len(text.encode())
        + sum(descriptor_bytes(key, ndim) for key, ndim in arrays)
    )
    assert len(header) == expected
