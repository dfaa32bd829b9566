"""Version 1 of akv's frame: a batch of arrays behind a small header, with no I/O at all.

A message on a stream is a 16-byte prefix, a header and a payload::

    prefix, 16 bytes: magic b"AKV" | version u8 (1) | header_len u32 | payload_len u64
    header, header_len bytes:
      fixed part:     op u16 | flags u16 | count u32 | seq u64 | aux i64 | text_len u32
      count descriptors, each:
                      key_kind u8 (0 none, 1 int, 2 str) | dtype code u8 | ndim u8 | reserved u8 (0)
                      key_len u32 (bytes of a str key; 0 otherwise)
                      key: i64 if int | key_len bytes of UTF-8 if str | nothing if none
                      tag i64 | nbytes u64 | shape: ndim x u64
      text:           text_len bytes of UTF-8 (may be empty)
    payload, payload_len bytes: the arrays' bytes concatenated in descriptor order

Two more kinds of message share the prefix, only between peers that share memory
(:mod:`akv_transport._shm_stream`); the version byte tells them apart:

* version 2, a frame whose payload lies in the sender's arena: prefix and header as above,
  then, instead of the payload, one ``offset u64`` per array that has bytes (in descriptor
  order; at most :data:`MAX_ARENA_ARRAYS`): where that array's bytes start in the arena;
* version 3, a release: ``header_len`` 0 and a payload of ``payload_len / 8`` offsets (u64)
  of the receiver's arena that the sender of the release has read and gives back. A
  release on a stream that shares no memory is a protocol error.

And one more on every stream:

* version 4, a keepalive: ``header_len`` 0 and ``payload_len`` 0, nothing but the prefix:
  proof that the sender lives, sent by an end that has written nothing for a while
  (:mod:`akv_transport._liveness`).

The version byte is the transport's; the ``op`` field is the application's. Control
messages (releases, keepalives) are told apart by their version and carry no header, so
they never reach the application and can never collide with its ops, whatever they are.

Every integer is little-endian, and so is every array. ``op``, ``flags``, ``seq``, ``aux`` and
each array's ``tag`` are opaque here: the application gives them meaning. Encoding and decoding
validate every field and raise :class:`~akv_transport.errors.FrameError` for anything out of range,
so a peer's bytes can never raise anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from akv_transport.errors import FrameError

__all__ = [
    "ARENA_REF_BYTES",
    "CODE_DTYPES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DTYPE_CODES",
    "HEADER_FIXED_BYTES",
    "KEEPALIVE_FRAME",
    "MAGIC",
    "MAX_ARENA_ARRAYS",
    "MAX_ARRAYS",
    "MAX_HEADER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_NDIM",
    "MAX_RELEASE_OFFSETS",
    "MAX_TEXT_BYTES",
    "PREFIX_BYTES",
    "VERSION",
    "VERSION_ARENA",
    "VERSION_KEEPALIVE",
    "VERSION_RELEASE",
    "ArrayInfo",
    "FrameHeader",
    "as_array",
    "byte_view",
    "decode_any_prefix",
    "decode_frame",
    "decode_header",
    "decode_prefix",
    "decode_release",
    "descriptor_bytes",
    "encode_frame",
    "encode_header",
    "encode_release",
    "frame_bytes",
    "to_arena_prefix",
]

#: The first three bytes of every frame.
MAGIC = b"AKV"
#: The frame version this module speaks; a peer speaking another one is refused.
VERSION = 1
#: The prefix version of a frame whose payload lies in the sender's arena.
VERSION_ARENA = 2
#: The prefix version of a release of arena regions.
VERSION_RELEASE = 3
#: The prefix version of a keepalive (a prefix alone).
VERSION_KEEPALIVE = 4
#: Bytes of each array's arena offset after the header of a :data:`VERSION_ARENA` frame.
ARENA_REF_BYTES = 8
#: Most arrays with bytes that a :data:`VERSION_ARENA` frame may have.
MAX_ARENA_ARRAYS = 4096
#: Most offsets one release may give back.
MAX_RELEASE_OFFSETS = 8192
#: Size of the prefix (magic, version, header_len, payload_len).
PREFIX_BYTES = 16
#: Largest header accepted (descriptors and text included).
MAX_HEADER_BYTES = 16 << 20
#: Largest number of arrays in one frame.
MAX_ARRAYS = 1 << 20
#: Largest number of dimensions of one array.
MAX_NDIM = 32
#: Largest UTF-8 encoding of one str key.
MAX_KEY_BYTES = 64 << 10
#: Largest UTF-8 encoding of a frame's text.
MAX_TEXT_BYTES = 8 << 20
#: Default largest payload a receiver accepts; receivers pass their own ``max_payload_bytes``.
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30

#: Wire code of each dtype (MXNet's codes for 0 to 6), all little-endian.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype("<f4"): 0,
    np.dtype("<f8"): 1,
    np.dtype("<f2"): 2,
    np.dtype("u1"): 3,
    np.dtype("<i4"): 4,
    np.dtype("i1"): 5,
    np.dtype("<i8"): 6,
    np.dtype("?"): 7,
    np.dtype("<i2"): 8,
    np.dtype("<u2"): 9,
    np.dtype("<u4"): 10,
    np.dtype("<u8"): 11,
    np.dtype("<c8"): 12,
    np.dtype("<c16"): 13,
}
#: The dtype of each wire code: the reverse of :data:`DTYPE_CODES`.
CODE_DTYPES: dict[int, np.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

KEY_NONE, KEY_INT, KEY_STR = 0, 1, 2

U16_MAX = (1 << 16) - 1
U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
# NumPy refuses arrays whose non-zero dimensions multiply (times the itemsize) past this.
MAX_ARRAY_BYTES = (1 << 63) - 1

_PREFIX = struct.Struct("<3sBIQ")
#: A whole keepalive message: its prefix, with no header and no payload.
KEEPALIVE_FRAME = _PREFIX.pack(MAGIC, VERSION_KEEPALIVE, 0, 0)
_ARENA_PREFIX_START = MAGIC + bytes([VERSION_ARENA])
_FIXED = struct.Struct("<HHIQqI")
_FIXED_BYTES = _FIXED.size
#: A header's bytes before its descriptors (and its text after them).
HEADER_FIXED_BYTES = _FIXED_BYTES
_DESCRIPTOR = struct.Struct("<BBBBI")
_INT_KEY_TAG_NBYTES = struct.Struct("<qqQ")
_TAG_NBYTES = struct.Struct("<qQ")
# A descriptor with no key and no shape: the least a declared array can take.
_MIN_DESCRIPTOR_BYTES = _DESCRIPTOR.size + _TAG_NBYTES.size
_SHAPES = [struct.Struct(f"<{ndim}Q") for ndim in range(MAX_NDIM + 1)]
# Whole descriptors (or all of one after its str key) in one pack, by ndim.
_INT_DESCRIPTORS = [struct.Struct(f"<BBBBIqqQ{ndim}Q") for ndim in range(MAX_NDIM + 1)]
_NONE_DESCRIPTORS = [struct.Struct(f"<BBBBIqQ{ndim}Q") for ndim in range(MAX_NDIM + 1)]
_STR_TAILS = [struct.Struct(f"<qQ{ndim}Q") for ndim in range(MAX_NDIM + 1)]


class ArrayInfo(NamedTuple):
    """What a frame says about one array: its key, dtype, shape, size and tag.

    ``nbytes`` always equals ``prod(shape) * dtype.itemsize`` in a decoded header.
    (Immutable; a NamedTuple because headers are built per message on the hot path.)
    """

    key: int | str | None
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    tag: int = 0


class FrameHeader(NamedTuple):
    """A decoded header: the frame's fields and its arrays, in payload order.

    ``payload_len`` always equals the sum of the arrays' ``nbytes`` in a decoded header.
    """

    op: int
    flags: int
    seq: int
    aux: int
    arrays: tuple[ArrayInfo, ...]
    text: str
    payload_len: int


# A NamedTuple made from all its fields without the Python-level ``__new__`` that
# NamedTuple adds (decoding makes two per message).
_new_tuple = tuple.__new__

# ---------------------------------------------------------------------- encoding


def encode_frame(
    op: int,
    seq: int,
    arrays: Sequence[tuple[int | str | None, np.ndarray, int]] = (),
    *,
    flags: int = 0,
    aux: int = 0,
    text: str = "",
) -> list[bytes | memoryview]:
    """Encode one frame as the buffers to write, in order.

    Parameters
    ----------
    op, seq
        The operation (u16) and sequence number (u64), opaque to the transport.
    arrays
        ``(key, array, tag)`` triples: a key that is an int (i64, not a bool), a str
        (at most :data:`MAX_KEY_BYTES` of UTF-8) or None, a C-contiguous little-endian
        array of a dtype in :data:`DTYPE_CODES`, and an i64 tag.
    flags, aux, text
        A u16, an i64 and a str of at most :data:`MAX_TEXT_BYTES` of UTF-8.

    Returns
    -------
    list of bytes or memoryview
        One ``bytes`` holding prefix and header, then one ``memoryview`` (format ``"B"``) per
        non-empty array, in order. The array data is not copied: the views share memory with
        the arrays, which must not change until the buffers have been written.

    Raises
    ------
    FrameError
        When any value cannot be encoded; the message names the field and the value.
    """
    infos = []
    non_empty = []
    payload_len = 0
    for index, item in enumerate(arrays):
        try:
            key, array, tag = item
        except (TypeError, ValueError):
            raise FrameError(
                f"encode: array {index} is {type(item).__name__}, not a (key, array, tag) triple"
            ) from None
        if not isinstance(array, np.ndarray):
            raise FrameError(
                f"encode: array {index} (key {key!r}) is a {type(array).__name__}, "
                "not a numpy.ndarray"
            )
        if not array.flags.c_contiguous:
            raise FrameError(
                f"encode: array {index} (key {key!r}) is not C-contiguous; "
                "pass numpy.ascontiguousarray(array)"
            )
        nbytes = array.nbytes
        infos.append((key, array.dtype, array.shape, nbytes, tag))
        if nbytes:
            non_empty.append(array)
            payload_len += nbytes
    buffers: list[bytes | memoryview] = [
        _encode_header(op, flags, seq, aux, infos, text, payload_len, from_array=True)
    ]
    if non_empty:
        # Only now that every dtype is known to have a code can each array export its buffer.
        buffers += [array.data.cast("B") for array in non_empty]
    return buffers


def frame_bytes(
    op: int,
    seq: int,
    arrays: Sequence[tuple[int | str | None, np.ndarray, int]] = (),
    *,
    flags: int = 0,
    aux: int = 0,
    text: str = "",
) -> bytes:
    """Encode one frame as a single ``bytes`` (a copy): :func:`encode_frame`, joined.

    Meant for tests and small messages; the arguments and errors are those of
    :func:`encode_frame`.
    """
    return b"".join(encode_frame(op, seq, arrays, flags=flags, aux=aux, text=text))


def encode_header(header: FrameHeader) -> bytes:
    """Encode the prefix and header of a frame whose payload follows separately.

    Every field is validated as :func:`decode_header` would, so that what this returns
    decodes back to ``header``.

    Raises
    ------
    FrameError
        When a field is out of range, ``nbytes`` does not match an array's shape and dtype, or
        ``payload_len`` is not the sum of the arrays' ``nbytes``.
    """
    _check_int("payload_len", header.payload_len, 0, U64_MAX)
    if len(header.arrays) > MAX_ARRAYS:
        raise FrameError(f"encode: {len(header.arrays)} arrays exceed MAX_ARRAYS {MAX_ARRAYS}")
    arrays = [(info.key, info.dtype, info.shape, info.nbytes, info.tag) for info in header.arrays]
    return _encode_header(
        header.op, header.flags, header.seq, header.aux, arrays, header.text, header.payload_len
    )


def _encode_header(
    op: int,
    flags: int,
    seq: int,
    aux: int,
    arrays: Sequence[tuple[int | str | None, np.dtype, tuple[int, ...], int, int]],
    text_str: str,
    payload_len: int,
    from_array: bool = False,
) -> bytes:
    """Validate and encode prefix and header from ``(key, dtype, shape, nbytes, tag)`` tuples.

    ``from_array``: the tuples were read off NumPy arrays (shape and nbytes agree).
    """
    if type(op) is not int or not 0 <= op <= U16_MAX:
        _check_int("op", op, 0, U16_MAX)
    if type(flags) is not int or not 0 <= flags <= U16_MAX:
        _check_int("flags", flags, 0, U16_MAX)
    if type(seq) is not int or not 0 <= seq <= U64_MAX:
        _check_int("seq", seq, 0, U64_MAX)
    if type(aux) is not int or not I64_MIN <= aux <= I64_MAX:
        _check_int("aux", aux, I64_MIN, I64_MAX)
    if not isinstance(text_str, str):
        raise FrameError(f"encode: text is a {type(text_str).__name__}, not a str")
    text = _utf8(text_str, "text") if text_str else b""
    if len(text) > MAX_TEXT_BYTES:
        raise FrameError(
            f"encode: text of {len(text)} bytes exceeds MAX_TEXT_BYTES {MAX_TEXT_BYTES}"
        )
    count = len(arrays)
    if count > MAX_ARRAYS:
        raise FrameError(f"encode: {count} arrays exceed MAX_ARRAYS {MAX_ARRAYS}")

    parts = [_FIXED.pack(op, flags, count, seq, aux, len(text))]
    total = 0
    for index, (key, dtype, shape, nbytes, tag) in enumerate(arrays):
        parts.append(_encode_descriptor(index, key, dtype, shape, nbytes, tag, from_array))
        total += nbytes
    parts.append(text)
    if payload_len != total:
        raise FrameError(
            f"encode: payload_len {payload_len} is not the arrays' total of {total} bytes"
        )
    header = b"".join(parts)
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(
            f"encode: header of {len(header)} bytes exceeds MAX_HEADER_BYTES {MAX_HEADER_BYTES}"
        )
    return _PREFIX.pack(MAGIC, VERSION, len(header), payload_len) + header


def _encode_descriptor(
    index: int,
    key: object,
    dtype: np.dtype,
    shape: tuple[int, ...],
    nbytes: int,
    tag: int,
    from_array: bool,
) -> bytes:
    """One array's descriptor. ``from_array``: shape and nbytes come from a NumPy array,
    so they agree by construction and need no second check."""
    try:
        code = DTYPE_CODES[dtype]
    except (KeyError, TypeError):
        raise FrameError(f"encode: {_where(index, key)}: {_dtype_problem(dtype)}") from None
    if type(shape) is not tuple:
        raise FrameError(f"encode: {_where(index, key)}: shape {shape!r} is not a tuple")
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise FrameError(f"encode: {_where(index, key)}: ndim {ndim} exceeds MAX_NDIM {MAX_NDIM}")
    if type(tag) is not int or not I64_MIN <= tag <= I64_MAX:
        _check_int(f"{_where(index, key)}: tag", tag, I64_MIN, I64_MAX)
    if not from_array:
        # Each check falls back to _check_int for its message.
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= U64_MAX:
                _check_int(f"{_where(index, key)}: dimension of shape {shape}", dim, 0, U64_MAX)
        if type(nbytes) is not int or not 0 <= nbytes <= U64_MAX:
            _check_int(f"{_where(index, key)}: nbytes", nbytes, 0, U64_MAX)
        expected = _array_bytes(shape, dtype.itemsize)
        if expected is None:
            raise FrameError(
                f"encode: {_where(index, key)}: shape {shape} of {dtype} exceeds "
                f"{MAX_ARRAY_BYTES} bytes"
            )
        if expected != nbytes:
            raise FrameError(
                f"encode: {_where(index, key)}: nbytes {nbytes} does not match shape {shape} "
                f"of {dtype} ({expected} bytes)"
            )
    if type(key) is int or (isinstance(key, int) and not isinstance(key, bool)):
        if not I64_MIN <= key <= I64_MAX:
            _check_int(f"array {index}: key", key, I64_MIN, I64_MAX)
        return _INT_DESCRIPTORS[ndim].pack(KEY_INT, code, ndim, 0, 0, key, tag, nbytes, *shape)
    if key is None:
        return _NONE_DESCRIPTORS[ndim].pack(KEY_NONE, code, ndim, 0, 0, tag, nbytes, *shape)
    if isinstance(key, str):
        key_bytes = _utf8(key, f"array {index}: key")
        if len(key_bytes) > MAX_KEY_BYTES:
            raise FrameError(
                f"encode: {_where(index, key)}: key of {len(key_bytes)} bytes exceeds "
                f"MAX_KEY_BYTES {MAX_KEY_BYTES}"
            )
        head = _DESCRIPTOR.pack(KEY_STR, code, ndim, 0, len(key_bytes))
        return head + key_bytes + _STR_TAILS[ndim].pack(tag, nbytes, *shape)
    raise FrameError(
        f"encode: array {index}: key {key!r} is a {type(key).__name__}; "
        "a key is an int, a str or None"
    )


def descriptor_bytes(key: int | str | None, ndim: int) -> int:
    """How many header bytes the descriptor of one array of ``ndim`` dimensions and ``key``
    takes (as :func:`encode_frame` writes it; a str key counts its UTF-8 bytes): with
    :data:`HEADER_FIXED_BYTES`, what a caller needs to know whether a request fits
    :data:`MAX_HEADER_BYTES` before it builds one."""
    if isinstance(key, str):
        return _DESCRIPTOR.size + len(key.encode("utf-8", "surrogatepass")) + _STR_TAILS[ndim].size
    if key is None:
        return _NONE_DESCRIPTORS[ndim].size
    return _INT_DESCRIPTORS[ndim].size


def _where(index: int, key: object) -> str:
    return f"array {index} (key {key!r})"


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"encode: {name} {value!r} is a {type(value).__name__}, not an int")
    if not low <= value <= high:
        raise FrameError(f"encode: {name} {value} is outside [{low}, {high}]")


def _utf8(text: str, name: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FrameError(f"encode: {name} {text!r} is not valid UTF-8 text ({exc.reason})") from exc


def _dtype_problem(dtype: object) -> str:
    if not isinstance(dtype, np.dtype):
        return f"dtype {dtype!r} is a {type(dtype).__name__}, not a numpy.dtype"
    try:
        little = dtype.newbyteorder("<")
    except (TypeError, ValueError):
        little = dtype
    if little != dtype and little in DTYPE_CODES:
        return (
            f"dtype {dtype.str} is big-endian; arrays travel little-endian "
            "(convert with array.astype(array.dtype.newbyteorder('<')))"
        )
    known = ", ".join(str(known) for known in DTYPE_CODES)
    return f"dtype {dtype} has no wire code (known: {known})"


def _array_bytes(shape: tuple[int, ...], itemsize: int) -> int | None:
    """Bytes of an array of ``shape``, or None when NumPy could not hold such an array."""
    total = itemsize
    nonzero = itemsize
    for dim in shape:
        total *= dim
        if dim:
            nonzero *= dim
            if nonzero > MAX_ARRAY_BYTES:
                return None
    return total


# ---------------------------------------------------------------------- decoding


def decode_prefix(
    data: bytes | bytearray | memoryview, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[int, int]:
    """Decode the 16-byte prefix that starts every frame.

    Parameters
    ----------
    data
        At least :data:`PREFIX_BYTES` bytes; only the first 16 are read.
    max_payload_bytes
        The largest payload this receiver accepts.

    Returns
    -------
    (header_len, payload_len)
        How many header bytes, then payload bytes, follow the prefix.

    Raises
    ------
    FrameError
        When the data is short, the magic or version is not this module's, the header would
        exceed :data:`MAX_HEADER_BYTES` or the payload ``max_payload_bytes``.
    """
    version, header_len, payload_len = decode_any_prefix(data, max_payload_bytes=max_payload_bytes)
    if version != VERSION:
        raise FrameError(f"frame version {version}, this side speaks {VERSION}")
    return header_len, payload_len


def decode_any_prefix(
    data: bytes | bytearray | memoryview, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[int, int, int]:
    """Decode a prefix of any of the four kinds; return ``(version, header_len,
    payload_len)``.

    Raises :class:`FrameError` as :func:`decode_prefix` does, for an unknown version, for
    a release whose header is not empty or whose payload is not a whole number of at
    most :data:`MAX_RELEASE_OFFSETS` offsets, and for a keepalive with a header or a
    payload.
    """
    if len(data) < PREFIX_BYTES:
        raise FrameError(f"frame prefix: {len(data)} bytes, need {PREFIX_BYTES}")
    magic, version, header_len, payload_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(
            f"frame prefix: magic {magic!r} is not {MAGIC!r} (not an akv frame stream?)"
        )
    if version not in (VERSION, VERSION_ARENA, VERSION_RELEASE, VERSION_KEEPALIVE):
        raise FrameError(f"frame version {version}, this side speaks {VERSION}")
    if version == VERSION_KEEPALIVE and (header_len or payload_len):
        raise FrameError(
            f"keepalive: header_len {header_len} and payload_len {payload_len} are not 0"
        )
    if version == VERSION_RELEASE and (
        header_len or payload_len % ARENA_REF_BYTES or payload_len > 8 * MAX_RELEASE_OFFSETS
    ):
        raise FrameError(
            f"release: header_len {header_len} and payload_len {payload_len} are not an empty "
            f"header and at most {MAX_RELEASE_OFFSETS} offsets"
        )
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(
            f"frame prefix: header_len {header_len} exceeds MAX_HEADER_BYTES {MAX_HEADER_BYTES}"
        )
    if payload_len > max_payload_bytes:
        raise FrameError(
            f"frame prefix: payload_len {payload_len} exceeds max_payload_bytes {max_payload_bytes}"
        )
    return version, header_len, payload_len


def to_arena_prefix(head: bytes | memoryview, offsets: Sequence[int]) -> list[bytes | memoryview]:
    """The buffers that send the frame whose prefix and header are ``head`` (as
    :func:`encode_frame` returns them) with the bytes of its arrays at ``offsets`` of the
    sender's arena (one per array that has bytes, in order)."""
    return [
        _ARENA_PREFIX_START + bytes(head[4:PREFIX_BYTES]),
        head[PREFIX_BYTES:],
        struct.pack(f"<{len(offsets)}Q", *offsets),
    ]


def encode_release(offsets: Sequence[int]) -> bytes:
    """A release handing back ``offsets`` (at most :data:`MAX_RELEASE_OFFSETS`) of the
    receiver's arena."""
    if not 0 < len(offsets) <= MAX_RELEASE_OFFSETS:
        raise FrameError(f"release: {len(offsets)} offsets, not 1 to {MAX_RELEASE_OFFSETS}")
    return _PREFIX.pack(MAGIC, VERSION_RELEASE, 0, 8 * len(offsets)) + struct.pack(
        f"<{len(offsets)}Q", *offsets
    )


def decode_release(data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """The offsets of a release's payload (a whole number of u64, checked by the prefix)."""
    return struct.unpack(f"<{len(data) // 8}Q", data)


def decode_header(data: bytes | bytearray | memoryview, payload_len: int) -> FrameHeader:
    """Decode and validate a header: exactly the ``header_len`` bytes after the prefix.

    Parameters
    ----------
    data
        The header, no more and no less.
    payload_len
        The prefix's ``payload_len``, which the arrays' sizes must add up to.

    Returns
    -------
    FrameHeader
        Whose every array has a known dtype, at most :data:`MAX_NDIM` dimensions, an ``nbytes``
        that equals its shape times its itemsize (and that NumPy can hold), and whose sizes add
        up to ``payload_len``.

    Raises
    ------
    FrameError
        For any field out of range, a truncated header or trailing bytes; never another
        exception, whatever ``data`` holds.
    """
    size = len(data)
    if size > MAX_HEADER_BYTES:
        raise FrameError(f"frame header: {size} bytes exceed MAX_HEADER_BYTES {MAX_HEADER_BYTES}")
    if size < _FIXED_BYTES:
        raise FrameError(f"frame header: {size} bytes, shorter than its fixed {_FIXED_BYTES}")
    op, flags, count, seq, aux, text_len = _FIXED.unpack_from(data)
    if count > MAX_ARRAYS:
        raise FrameError(f"frame header: count {count} exceeds MAX_ARRAYS {MAX_ARRAYS}")
    if text_len > MAX_TEXT_BYTES:
        raise FrameError(
            f"frame header: text_len {text_len} exceeds MAX_TEXT_BYTES {MAX_TEXT_BYTES}"
        )
    offset = _FIXED_BYTES
    if offset + count * _MIN_DESCRIPTOR_BYTES + text_len > size:
        raise FrameError(
            f"frame header: {size} bytes cannot hold {count} arrays and {text_len} bytes of text"
        )
    view = memoryview(data)
    arrays = []
    total = 0
    for index in range(count):
        info, offset = _decode_descriptor(view, offset, size, index)
        arrays.append(info)
        total += info.nbytes
    end = offset + text_len
    if end > size:
        raise FrameError(
            f"frame header: text of {text_len} bytes is truncated at {size - offset} bytes"
        )
    if end != size:
        raise FrameError(f"frame header: {size - end} trailing bytes after the text")
    try:
        text = str(view[offset:end], "utf-8") if text_len else ""
    except UnicodeDecodeError as exc:
        raise FrameError(f"frame header: text is not valid UTF-8 ({exc.reason})") from None
    if total != payload_len:
        raise FrameError(
            f"frame header: arrays hold {total} bytes but payload_len is {payload_len}"
        )
    return _new_tuple(FrameHeader, (op, flags, seq, aux, tuple(arrays), text, payload_len))


def _decode_descriptor(
    view: memoryview, offset: int, size: int, index: int
) -> tuple[ArrayInfo, int]:
    if offset + _DESCRIPTOR.size > size:
        raise FrameError(f"frame header: descriptor of array {index} is truncated")
    key_kind, code, ndim, reserved, key_len = _DESCRIPTOR.unpack_from(view, offset)
    offset += _DESCRIPTOR.size
    if reserved:
        raise FrameError(f"frame header: reserved byte {reserved} of array {index} is not 0")
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise FrameError(f"frame header: dtype code {code} of array {index} is unknown")
    if ndim > MAX_NDIM:
        raise FrameError(f"frame header: ndim {ndim} of array {index} exceeds MAX_NDIM {MAX_NDIM}")
    key: int | str | None
    if key_kind == KEY_INT:
        if key_len:
            raise FrameError(f"frame header: key_len {key_len} of int key of array {index}")
        end = offset + _INT_KEY_TAG_NBYTES.size
        if end > size:
            raise FrameError(f"frame header: int key of array {index} is truncated")
        key, tag, nbytes = _INT_KEY_TAG_NBYTES.unpack_from(view, offset)
        offset = end
    else:
        if key_kind == KEY_STR:
            if key_len > MAX_KEY_BYTES:
                raise FrameError(
                    f"frame header: key_len {key_len} of array {index} exceeds MAX_KEY_BYTES "
                    f"{MAX_KEY_BYTES}"
                )
            end = offset + key_len
            if end > size:
                raise FrameError(f"frame header: str key of array {index} is truncated")
            try:
                key = str(view[offset:end], "utf-8")
            except UnicodeDecodeError as exc:
                raise FrameError(
                    f"frame header: key of array {index} is not valid UTF-8 ({exc.reason})"
                ) from None
            offset = end
        elif key_kind == KEY_NONE:
            if key_len:
                raise FrameError(f"frame header: key_len {key_len} of keyless array {index}")
            key = None
        else:
            raise FrameError(f"frame header: key_kind {key_kind} of array {index} is unknown")
        end = offset + _TAG_NBYTES.size
        if end > size:
            raise FrameError(f"frame header: tag and nbytes of array {index} are truncated")
        tag, nbytes = _TAG_NBYTES.unpack_from(view, offset)
        offset = end
    shape_struct = _SHAPES[ndim]
    end = offset + shape_struct.size
    if end > size:
        raise FrameError(f"frame header: shape of array {index} (ndim {ndim}) is truncated")
    shape = shape_struct.unpack_from(view, offset)
    expected = _array_bytes(shape, dtype.itemsize)
    if expected is None:
        raise FrameError(
            f"frame header: shape {shape} of {dtype} of array {index} exceeds "
            f"{MAX_ARRAY_BYTES} bytes"
        )
    if expected != nbytes:
        raise FrameError(
            f"frame header: nbytes {nbytes} of array {index} does not match shape {shape} of "
            f"{dtype} ({expected} bytes)"
        )
    return _new_tuple(ArrayInfo, (key, dtype, shape, nbytes, tag)), end


def decode_frame(
    data: bytes | bytearray | memoryview, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[FrameHeader, tuple[memoryview, ...]]:
    """Decode one whole frame held in memory (an HTTP body, a test's bytes).

    Returns
    -------
    (header, buffers)
        The header and one ``memoryview`` per array (format ``"B"``, exactly ``nbytes``) that
        shares memory with ``data``: nothing is copied. See :func:`as_array`.

    Raises
    ------
    FrameError
        As :func:`decode_prefix` and :func:`decode_header` do, or when ``data`` is not exactly
        one frame long.
    """
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    header_len, payload_len = decode_prefix(view, max_payload_bytes=max_payload_bytes)
    frame_len = PREFIX_BYTES + header_len + payload_len
    if len(view) != frame_len:
        raise FrameError(f"frame: {len(view)} bytes, but its prefix announces {frame_len}")
    header = decode_header(view[PREFIX_BYTES : PREFIX_BYTES + header_len], payload_len)
    offset = PREFIX_BYTES + header_len
    buffers = []
    for info in header.arrays:
        buffers.append(view[offset : offset + info.nbytes])
        offset += info.nbytes
    return header, tuple(buffers)


def byte_view(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as flat bytes, without copying, writable exactly when
    the array is: an empty array's too (``memoryview(array).cast("B")`` refuses a zero in
    the shape: an array of no columns would be refused as a frame's payload or
    destination). ``TypeError`` for an array that is not C-contiguous."""
    if array.size:
        return array.data.cast("B")
    return array.reshape(-1).view(np.uint8).data


def as_array(info: ArrayInfo, buffer: bytes | bytearray | memoryview) -> np.ndarray:
    """View a received buffer as the array ``info`` describes, without copying.

    The array shares memory with ``buffer`` and is writable exactly when ``buffer`` is.

    Raises
    ------
    FrameError
        When ``buffer`` does not hold exactly ``info.nbytes`` bytes.
    """
    view = memoryview(buffer)
    if view.nbytes != info.nbytes:
        raise FrameError(
            f"array of key {info.key!r}: buffer of {view.nbytes} bytes, expected {info.nbytes}"
        )
    return np.frombuffer(view, dtype=info.dtype).reshape(info.shape)
