"""A sans-IO parser of a stream of frames, shaped for :class:`asyncio.BufferedProtocol`.

The protocol's ``get_buffer`` returns :meth:`FrameReader.get_buffer` and its ``buffer_updated``
calls :meth:`FrameReader.buffer_updated`, which returns the messages completed so far. Small
frames are received into one reused scratch buffer and parsed many at a time; the payload of a
large array is received by the kernel straight into the buffer the application chose for it.
The payload of an array the application refuses (:data:`DISCARD`) is read through the scratch
buffer and dropped, so a header that declares a huge payload never makes the reader allocate
it.

Between peers that share memory (:mod:`akv_transport._shm_stream`) a frame's payload may lie in
the sender's arena instead: the reader copies it from :attr:`FrameReader.arena` into the
destinations and notes the region in :attr:`FrameReader.to_give_back` (the stream gives it
back by a release frame); the regions of this side's arena that the peer's release frames
give back are noted in :attr:`FrameReader.given_back`. A destination wrapped in
:class:`InPlace` is not written for such a frame: the message carries a read-only view of
the payload where it lies, and the application gives the region back itself
(:attr:`Message.borrowed`) once it has read it. A release on a stream that shares no memory
(:attr:`FrameReader.shared` False) is a :class:`~akv_transport.errors.FrameError`.

Keepalives (:mod:`akv_transport._liveness`) are consumed and counted, never delivered.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, TypeAlias

from akv_transport.errors import FrameError, StreamEndedError
from akv_transport.frame import (
    ARENA_REF_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_ARENA_ARRAYS,
    PREFIX_BYTES,
    VERSION_ARENA,
    VERSION_KEEPALIVE,
    VERSION_RELEASE,
    FrameHeader,
    decode_any_prefix,
    decode_header,
    decode_release,
)

__all__ = [
    "DEFAULT_DIRECT_THRESHOLD_BYTES",
    "DEFAULT_SCRATCH_BYTES",
    "DISCARD",
    "Destination",
    "Destinations",
    "Discard",
    "FrameReader",
    "Message",
    "ReaderStatistics",
]

#: Size of the buffer that small frames, headers and payload tails are received into.
DEFAULT_SCRATCH_BYTES = 256 << 10
#: An array whose outstanding payload is at least this big is received in place.
DEFAULT_DIRECT_THRESHOLD_BYTES = 64 << 10


class Discard(enum.Enum):
    """The type of :data:`DISCARD` (an enum, so that type checkers narrow ``is DISCARD``)."""

    DISCARD = "discard"

    def __repr__(self) -> str:
        return "akv_transport.DISCARD"


#: A destination that receives nothing: the array's payload is read through the scratch
#: buffer and dropped, whatever its declared size (nothing proportional to it is allocated).
DISCARD: Final = Discard.DISCARD


@dataclass(frozen=True, slots=True)
class InPlace:
    """A destination that is read in place when it can be.

    On the socket the payload is received into ``buffer`` (as a plain destination is).
    When the frame's payload lies in the peer's shared arena it is not copied: the message
    holds a read-only view of it there, its offset is in :attr:`Message.borrowed`, and the
    region stays the reader's until the application gives it back (see
    :meth:`~akv_transport.StreamProtocol.give_back`).
    """

    buffer: memoryview


#: Where one array of a frame is received: a writable buffer of exactly its ``nbytes``,
#: None (a fresh ``bytearray``), :data:`DISCARD`, or :class:`InPlace`.
Destination: TypeAlias = memoryview | Literal[Discard.DISCARD] | InPlace | None
#: The callback that chooses where each array of a frame is received.
Destinations: TypeAlias = Callable[[FrameHeader], Sequence[Destination]]

# What the reader is waiting for.
_PREFIX, _HEADER, _BIG_HEADER, _PAYLOAD, _ARENA_REF, _RELEASE = range(6)
# Which buffer get_buffer() handed out last.
_NOTHING, _SCRATCH, _DIRECT, _BIG = range(4)
# The buffer a discarded array is delivered with: empty, its bytes were dropped.
_DROPPED = memoryview(b"")


class Message(NamedTuple):
    """One received frame: its header and one buffer per array, in the header's order.

    Each buffer is a ``memoryview`` of format ``"B"`` holding exactly the array's ``nbytes``:
    the destination the application chose, or a fresh ``bytearray`` it owns from now on;
    an array whose destination was :data:`DISCARD` has an empty buffer (its bytes were
    dropped). An :class:`InPlace` array of a frame in the peer's arena has a read-only view
    of the arena, valid until its offset in ``borrowed`` is given back.
    """

    header: FrameHeader
    buffers: tuple[memoryview, ...]
    #: Offsets of the peer's arena that this message's in-place views lie at: the
    #: application gives them back once it has read them, and nothing else does.
    borrowed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """Counters of a :class:`FrameReader` since it was made.

    ``payload_bytes_direct`` were written by the caller (the kernel) straight into their
    destinations; ``payload_bytes_copied`` arrived in the scratch buffer and were copied there;
    ``payload_bytes_discarded`` arrived in the scratch buffer for a :data:`DISCARD`
    destination and were dropped; ``payload_bytes_shared`` came through the peer's arena
    (copied out, or lent in place).
    """

    messages: int
    payload_bytes_direct: int
    payload_bytes_copied: int
    payload_bytes_discarded: int = 0
    #: Payload bytes that came through the peer's arena (frames sent through shared memory).
    payload_bytes_shared: int = 0
    #: Of those, the bytes lent in place to :class:`InPlace` destinations (not copied).
    payload_bytes_lent: int = 0
    #: Keepalive frames received (consumed here, never delivered as messages).
    keepalives: int = 0


class FrameReader:
    """Parse a stream of frames into :class:`Message` objects, receiving payloads in place.

    Parameters
    ----------
    destinations
        Called once per frame, as soon as its header is decoded, with the
        :class:`~akv_transport.frame.FrameHeader`. Returns one entry per array: a writable,
        C-contiguous buffer (ideally a ``memoryview`` cast to ``"B"``) of exactly that array's
        ``nbytes`` to receive its payload into, None for a fresh ``bytearray`` of that size,
        or :data:`DISCARD` to read the payload and drop it (a frame the application refuses:
        its bytes pass through the scratch buffer, so nothing proportional to the declared
        size is allocated, and the stream stays in step). An exception it raises propagates
        out of :meth:`buffer_updated` and breaks the reader.
    max_payload_bytes
        The largest payload accepted in one frame.
    scratch_bytes
        Size of the reused buffer that prefixes, headers and small payloads are received into.
        Larger headers are accumulated in a buffer of their own (up to ``MAX_HEADER_BYTES``).
    direct_threshold_bytes
        When at least this many bytes of the current array are outstanding,
        :meth:`get_buffer` returns the rest of the array's destination itself.

    Notes
    -----
    Messages come out in stream order. Once any :class:`~akv_transport.errors.FrameError` has been
    raised the reader is broken and every later call raises one too: the stream is out of step
    and its connection must be closed. Messages completed earlier in the call that failed are
    dropped with it. The reader is not thread-safe; it belongs to one event loop.
    """

    def __init__(
        self,
        destinations: Destinations,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
        direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES,
    ) -> None:
        if max_payload_bytes < 0:
            raise ValueError(f"max_payload_bytes {max_payload_bytes} is negative")
        if scratch_bytes < PREFIX_BYTES:
            raise ValueError(f"scratch_bytes {scratch_bytes} is below PREFIX_BYTES {PREFIX_BYTES}")
        if direct_threshold_bytes < 1:
            raise ValueError(f"direct_threshold_bytes {direct_threshold_bytes} is below 1")
        self._destinations = destinations
        self._max_payload_bytes = max_payload_bytes
        self._direct_threshold_bytes = direct_threshold_bytes
        self._scratch = memoryview(bytearray(scratch_bytes))
        # Received bytes not parsed yet are self._scratch[self._start:self._end].
        self._start = 0
        self._end = 0
        self._state = _PREFIX
        self._handed = _NOTHING
        self._handed_len = 0
        self._header_len = 0
        self._payload_len = 0
        self._big_header: memoryview | None = None
        self._big_filled = 0
        self._header: FrameHeader | None = None
        self._buffers: list[memoryview] = []
        # Each array's payload size, and which arrays are dropped (their buffer is empty).
        self._sizes: list[int] = []
        self._discards: list[bool] = []
        # Which arrays were asked for in place; and the arena offsets the message lends.
        self._in_place: list[bool] = []
        self._borrowed: list[int] = []
        self._discarding = False
        self._index = 0
        self._current: memoryview = self._scratch[:0]
        self._offset = 0
        self._remaining = 0
        self._broken: FrameError | None = None
        self._messages = 0
        self._direct_bytes = 0
        self._copied_bytes = 0
        self._discarded_bytes = 0
        self._shared_bytes = 0
        self._lent_bytes = 0
        self._keepalives = 0
        self._arena_frame = False
        self._arena_arrays = 0
        #: The peer's arena (its frames of version 2 have their payload there); None: the
        #: peer may send none.
        self.arena: memoryview | None = None
        #: Whether the stream shares memory with the peer, so that it may send releases
        #: (of this side's arena: even when the peer shares no arena of its own).
        self.shared = False
        #: Offsets of the peer's arena whose payload was copied out: to give back.
        self.to_give_back: list[int] = []
        #: Offsets of this side's arena that the peer gave back (by release frames).
        self.given_back: list[int] = []

    # -------------------------------------------------------------- the protocol's face

    def get_buffer(self, sizehint: int) -> memoryview:
        """Return the (non-empty) buffer that the next received bytes must be written into.

        ``sizehint`` is accepted for :class:`asyncio.BufferedProtocol` and ignored. Calling
        again without :meth:`buffer_updated` in between is allowed and supersedes the earlier
        buffer. While a large array's payload is outstanding the buffer is a slice of its
        destination, never longer than what the array still needs; a discarded array's
        payload is always received into the scratch buffer.

        Raises
        ------
        FrameError
            When the reader is broken.
        """
        if self._broken is not None:
            self._raise_broken()
        if (
            self._state == _PAYLOAD
            and self._remaining >= self._direct_threshold_bytes
            and not self._discarding
        ):
            # The scratch buffer is empty here: parsing consumes all of it in this state.
            self._handed = _DIRECT
            self._handed_len = self._remaining
            return self._current[self._offset :]
        if self._state == _BIG_HEADER:
            assert self._big_header is not None
            self._handed = _BIG
            self._handed_len = self._header_len - self._big_filled
            return self._big_header[self._big_filled :]
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = end = 0
        elif start:
            # Only an incomplete prefix or header (which fits in scratch) is left: move it
            # to the front so that the rest of it fits behind.
            end -= start
            self._scratch[:end] = self._scratch[start : self._end]
            self._start, self._end = 0, end
        self._handed = _SCRATCH
        self._handed_len = len(self._scratch) - end
        return self._scratch[end:]

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """Account for ``nbytes`` written into the last buffer; return the completed messages.

        Raises
        ------
        FrameError
            When the stream holds an invalid frame, ``destinations`` returned an unusable
            buffer, or the reader was broken before.
        ValueError
            When ``nbytes`` does not fit the buffer last returned by :meth:`get_buffer` (a bug of
            the caller; the reader is left as it was).
        """
        if self._broken is not None:
            self._raise_broken()
        handed = self._handed
        if not 0 <= nbytes <= self._handed_len:
            raise ValueError(
                f"buffer_updated({nbytes}) but the last buffer handed out holds "
                f"{self._handed_len} bytes"
            )
        self._handed = _NOTHING
        self._handed_len = 0
        if not nbytes:
            return []
        messages: list[Message] = []
        try:
            if handed == _SCRATCH:
                self._end += nbytes
                self._parse(messages)
            elif handed == _DIRECT:
                self._direct_bytes += nbytes
                self._offset += nbytes
                self._remaining -= nbytes
                if not self._remaining:
                    self._next_array(messages)
            else:
                self._big_filled += nbytes
                if self._big_filled == self._header_len:
                    assert self._big_header is not None
                    header = decode_header(self._big_header, self._payload_len)
                    self._big_header = None
                    self._begin_payload(header, messages)
        except FrameError as exc:
            self._broken = exc
            raise
        except BaseException as exc:
            self._broken = FrameError(f"frame reader: stopped by {exc!r}")
            raise
        return messages

    def eof(self) -> None:
        """Note that the stream ended.

        Raises
        ------
        FrameError
            When the stream ended inside a frame (saying where), or the reader was broken.
        """
        if self._broken is not None:
            self._raise_broken()
        if self.idle:
            return
        self._broken = StreamEndedError(f"stream ended inside a frame: {self._progress()}")
        raise self._broken

    @property
    def idle(self) -> bool:
        """True when no part of a message is buffered: the stream may end here cleanly."""
        return self._state == _PREFIX and self._start == self._end

    def statistics(self) -> ReaderStatistics:
        """Return the reader's counters (messages, payload bytes received direct or copied)."""
        return ReaderStatistics(
            self._messages,
            self._direct_bytes,
            self._copied_bytes,
            self._discarded_bytes,
            self._shared_bytes,
            self._lent_bytes,
            self._keepalives,
        )

    # -------------------------------------------------------------- parsing

    def _parse(self, messages: list[Message]) -> None:
        """Consume the received bytes in scratch, as far as they go."""
        view = self._scratch
        start, end = self._start, self._end
        while start < end:
            state = self._state
            if state == _PAYLOAD:
                count = min(end - start, self._remaining)
                offset = self._offset
                if self._discarding:
                    self._discarded_bytes += count
                else:
                    self._current[offset : offset + count] = view[start : start + count]
                    self._copied_bytes += count
                start += count
                self._offset = offset + count
                self._remaining -= count
                if not self._remaining:
                    self._next_array(messages)
            elif state == _PREFIX:
                if end - start < PREFIX_BYTES:
                    break
                version, header_len, payload_len = decode_any_prefix(
                    view[start : start + PREFIX_BYTES], max_payload_bytes=self._max_payload_bytes
                )
                start += PREFIX_BYTES
                self._header_len, self._payload_len = header_len, payload_len
                if version == VERSION_KEEPALIVE:
                    self._keepalives += 1
                    continue
                if version == VERSION_RELEASE:
                    if not self.shared:
                        raise FrameError(
                            "a release frame arrived on a stream that shares no memory "
                            "(there is nothing to give back)"
                        )
                    self._state = _RELEASE
                    continue
                if version == VERSION_ARENA and self.arena is None:
                    raise FrameError("a frame's payload is in an arena, but the peer shared none")
                self._arena_frame = version == VERSION_ARENA
                if header_len > len(view):
                    # Too big for scratch even once compacted: it gets a buffer of its own,
                    # and what arrived so far (less than all of it) moves there.
                    count = end - start
                    big = memoryview(bytearray(header_len))
                    big[:count] = view[start:end]
                    start = end
                    self._big_header, self._big_filled = big, count
                    self._state = _BIG_HEADER
                else:
                    self._state = _HEADER
            elif state == _ARENA_REF:
                count = ARENA_REF_BYTES * self._arena_arrays
                if end - start < count:
                    break
                offsets = struct.unpack_from(f"<{self._arena_arrays}Q", view, start)
                start += count
                self._copy_from_arena(offsets, messages)
            elif state == _RELEASE:
                count = self._payload_len
                if end - start < count:
                    break
                self.given_back.extend(decode_release(view[start : start + count]))
                start += count
                self._state = _PREFIX
            else:  # _HEADER: _BIG_HEADER never has bytes in scratch
                header_len = self._header_len
                if end - start < header_len:
                    break
                header = decode_header(view[start : start + header_len], self._payload_len)
                start += header_len
                self._begin_payload(header, messages)
        self._start, self._end = start, end

    def _begin_payload(self, header: FrameHeader, messages: list[Message]) -> None:
        """Ask for the header's destinations and start receiving its payload."""
        arrays = header.arrays
        destinations = self._destinations(header)
        if len(destinations) != len(arrays):
            raise FrameError(
                f"frame reader: destinations() returned {len(destinations)} buffers for a frame "
                f"of {len(arrays)} arrays"
            )
        buffers = []
        discards = []
        in_place = []
        for index, (info, destination) in enumerate(zip(arrays, destinations, strict=True)):
            lent = False
            if isinstance(destination, InPlace):
                lent, destination = True, destination.buffer
            if destination is DISCARD:
                buffers.append(_DROPPED)
            elif destination is None:
                buffers.append(memoryview(bytearray(info.nbytes)))
            else:
                buffers.append(_as_destination(destination, index, info.key, info.nbytes))
            discards.append(destination is DISCARD)
            in_place.append(lent)
        self._header = header
        self._buffers = buffers
        self._sizes = [info.nbytes for info in arrays]
        self._discards = discards
        self._in_place = in_place
        self._index = -1
        if self._arena_frame:
            self._arena_arrays = sum(1 for size in self._sizes if size)
            if self._arena_arrays > MAX_ARENA_ARRAYS:
                raise FrameError(
                    f"a frame in the peer's arena has {self._arena_arrays} arrays with bytes; "
                    f"at most {MAX_ARENA_ARRAYS} may be"
                )
            self._state = _ARENA_REF
            return
        self._state = _PAYLOAD
        self._next_array(messages)

    def _copy_from_arena(self, offsets: tuple[int, ...], messages: list[Message]) -> None:
        """Copy each array with bytes from its offset of the peer's arena into its
        destination (or lend an :class:`InPlace` one a view of it), and complete the
        frame."""
        arena = self.arena
        assert arena is not None  # checked at the prefix
        sizes = [size for size in self._sizes if size]
        for offset, size in zip(offsets, sizes, strict=True):
            if offset + size > len(arena):
                raise FrameError(
                    f"an array of {size} bytes at offset {offset} is outside the peer's arena "
                    f"of {len(arena)} bytes"
                )
        it = iter(offsets)
        buffers = self._buffers
        for index, (size, discard) in enumerate(zip(self._sizes, self._discards, strict=True)):
            if not size:
                continue
            offset = next(it)
            if self._in_place[index]:
                buffers[index] = arena[offset : offset + size].toreadonly()
                self._borrowed.append(offset)
                self._lent_bytes += size
                continue
            if not discard:
                buffers[index][:] = arena[offset : offset + size]
            self.to_give_back.append(offset)
        self._shared_bytes += self._payload_len
        self._index = len(self._buffers)
        self._arena_frame = False
        self._next_array(messages)

    def _next_array(self, messages: list[Message]) -> None:
        """Move to the next array with bytes to receive, or complete the message."""
        buffers = self._buffers
        sizes = self._sizes
        index = self._index + 1
        while index < len(buffers):
            size = sizes[index]
            if size:
                self._index = index
                self._current = buffers[index]
                self._discarding = self._discards[index]
                self._offset = 0
                self._remaining = size
                return
            index += 1
        assert self._header is not None
        borrowed = self._borrowed
        messages.append(Message(self._header, tuple(buffers), tuple(borrowed)))
        self._messages += 1
        self._header = None
        self._buffers = []
        self._sizes = []
        self._discards = []
        if borrowed:
            self._borrowed = []
        self._discarding = False
        self._current = self._scratch[:0]
        self._state = _PREFIX

    def _progress(self) -> str:
        """Where in its frame the stream is, for error messages."""
        held = self._end - self._start
        if self._state == _PREFIX:
            return f"{held} of {PREFIX_BYTES} prefix bytes received"
        if self._state == _HEADER:
            return f"{held} of {self._header_len} header bytes received"
        if self._state == _ARENA_REF:
            return f"{held} of {ARENA_REF_BYTES * self._arena_arrays} arena offset bytes received"
        if self._state == _RELEASE:
            return f"{held} of {self._payload_len} release bytes received"
        if self._state == _BIG_HEADER:
            return f"{self._big_filled} of {self._header_len} header bytes received"
        done = sum(self._sizes[: self._index]) + self._offset
        return (
            f"{done} of {self._payload_len} payload bytes received "
            f"(array {self._index} of {len(self._buffers)})"
        )

    def _raise_broken(self) -> None:
        raise FrameError(f"frame reader is broken by an earlier error: {self._broken}")


def _as_destination(destination: memoryview, index: int, key: object, nbytes: int) -> memoryview:
    """Check that a destination can receive ``nbytes``; return it as a ``"B"`` memoryview.

    Any object with a writable buffer works (a NumPy array, a ``bytearray``); anything else
    is refused here, whatever its static type.
    """
    where = f"frame reader: destination of array {index} (key {key!r})"
    try:
        view = memoryview(destination)
    except TypeError:
        raise FrameError(
            f"{where} is a {type(destination).__name__}, not a writable buffer or None"
        ) from None
    if view.readonly:
        raise FrameError(f"{where} is read-only")
    if not view.c_contiguous:
        raise FrameError(f"{where} is not contiguous")
    if view.nbytes != nbytes:
        raise FrameError(f"{where} holds {view.nbytes} bytes, the frame says {nbytes}")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B") if nbytes else memoryview(bytearray())
    return view
