"""Work on the caller's CUDA stream: the reduce at the call, and a key's order across streams.

**The reduce.** :func:`reduce_on_stream` sums a key's values into a buffer on its merge GPU,
on the caller's current stream there, in one kernel per chunk (:func:`akv.fused.sum_into`).
Values on other GPUs are copied to the merge GPU by peer copies on a side stream of the merge
GPU, chunk by chunk (:data:`PEER_CHUNK_BYTES`), and the sum of each chunk waits (on the GPU)
for that chunk's copies only: the copies of chunk ``k + 1`` overlap the sum of chunk ``k``
(MXNet's CommDevice copies every source to the merge GPU first, then sums). The values are
summed in the order given, as NumPy sums them.

**A key's order.** Work enqueued straight on a caller's stream (no engine task) leaves events
in the key's entry (``entry.gpu_after``): the end of its latest write, and of the reads since.
Work on the key from another stream waits for them on the GPU first (:func:`follow`; a read
waits for the write only), engine tasks on the key wait for them in their stream
(:func:`pending`), and host code that reads what such work writes waits on the host
(:func:`settle`). Work on the same stream needs no wait: the stream orders it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from akv.arrays import Array, cupy_module, device_of
from akv.fused import sum_into
from akv.keys import Entry

__all__ = [
    "MAX_PENDING_READS",
    "PEER_CHUNK_BYTES",
    "chunk_slices",
    "follow",
    "note_read",
    "note_write",
    "pending",
    "reduce_at_call",
    "reduce_on_stream",
    "settle",
    "side_stream",
    "stream_key",
]

#: Bytes per peer copy of the pipelined reduce (each chunk's sum waits for its copies only).
PEER_CHUNK_BYTES = 16 << 20
#: Read events a key keeps before it drops those that have happened.
MAX_PENDING_READS = 8


def chunk_slices(size: int, itemsize: int, chunk_bytes: int | None = None) -> list[slice]:
    """Consecutive slices of at most ``chunk_bytes`` (default :data:`PEER_CHUNK_BYTES`; at
    least one element each) covering ``range(size)``; one empty slice for an empty array."""
    if chunk_bytes is None:
        chunk_bytes = PEER_CHUNK_BYTES
    step = max(1, chunk_bytes // max(itemsize, 1))
    return [slice(start, min(size, start + step)) for start in range(0, size, step)] or [
        slice(0, 0)
    ]


def stream_key(device: int, stream: Any) -> tuple[int, int]:
    """What tells streams apart: (device, handle). The device is the caller's: CuPy's null
    stream object serves every device (its ``device_id`` is -1)."""
    return device, int(stream.ptr)


# ------------------------------------------------------------------------------ the reduce

_side_streams: dict[tuple[int, str], Any] = {}


def side_stream(device: int, purpose: str) -> Any:
    """A non-blocking stream of ``device`` for one ``purpose`` ("peer": the reduce's peer
    copies; "copy": staging copies to and from pinned memory), made once per process."""
    stream = _side_streams.get((device, purpose))
    if stream is None:
        cupy = cupy_module()
        with cupy.cuda.Device(device):
            made = cupy.cuda.Stream(non_blocking=True)
        stream = _side_streams.setdefault((device, purpose), made)
    return stream


def reduce_on_stream(device: int, arrays: Sequence[Array], buffer: Array) -> Array:
    """Sum ``arrays`` (CuPy arrays on any GPU, or host arrays) into ``buffer`` on GPU
    ``device``, on the caller's current stream there; return ``buffer``.

    Enqueued on the caller's stream, the sum reads the values after the caller's queued work
    on each of their GPUs, and work the caller queues later on those GPUs waits for the
    reads: once the call returns, the caller may change its arrays. Host values are copied
    to the GPU at the call.
    """
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        sources: list[Array] = []
        peers: list[int] = []
        for array in arrays:
            where = device_of(array)
            if where is None:
                copy = cupy.empty(array.shape, array.dtype)
                copy.set(np.ascontiguousarray(array))  # pageable: staged at the call
                array = copy
            elif where != device:
                peers.append(len(sources))
            sources.append(array)
        if not peers:
            return sum_into(buffer, sources)
        _reduce_with_peers(cupy, device, sources, peers, buffer)
    return buffer


def _reduce_with_peers(
    cupy: Any, device: int, sources: list[Array], peers: list[int], buffer: Array
) -> None:
    stream = cupy.cuda.get_current_stream()
    side = side_stream(device, "peer")
    side.wait_event(_recorded(cupy, stream))  # the landing memory comes from stream's pool
    origins: dict[int, Any] = {}
    flats: list[Array] = []
    landings: list[tuple[Array, Array]] = []  # (flat peer source, flat landing)
    for index, array in enumerate(sources):
        if index not in peers:
            flats.append(cupy.ascontiguousarray(array).reshape(-1))
            continue
        where = device_of(array)
        assert where is not None
        with cupy.cuda.Device(where):
            source = cupy.ascontiguousarray(array).reshape(-1)
            origin = origins.setdefault(where, cupy.cuda.get_current_stream())
            side.wait_event(_recorded(cupy, origin))
        landing = cupy.empty(source.shape, source.dtype)
        landings.append((source, landing))
        flats.append(landing)
    total = buffer.reshape(-1)
    copied = None
    for chunk in chunk_slices(total.size, total.itemsize):
        with side:
            for source, landing in landings:
                cupy.copyto(landing[chunk], source[chunk])  # a peer copy on the side stream
        copied = _recorded(cupy, side)
        stream.wait_event(copied)
        sum_into(total[chunk], [flat[chunk] for flat in flats])
    for where, origin in origins.items():
        with cupy.cuda.Device(where):
            origin.wait_event(copied)  # later work there may overwrite the sources


def reduce_at_call(device: int, arrays: list[Array], buffer: Array) -> tuple[Array, Any]:
    """Sum ``arrays`` into ``buffer`` (on GPU ``device``) on the caller's current stream there;
    return the buffer and an event recorded after the sum.

    Enqueued on the caller's stream, the sum reads the arrays after the caller's own queued
    work and before anything the caller queues later: once the call returns, the caller may
    change its arrays. A task that uses the buffer waits for the event on the GPU. One
    kernel per chunk reads every value once (:func:`akv.gpu_stream.reduce_on_stream`).
    """
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        reduce_on_stream(device, arrays, buffer)
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
    return buffer, event


def _recorded(cupy: Any, stream: Any) -> Any:
    """An event recorded on ``stream`` (of the current device) for other streams to wait on."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def _blocking_event(device: int, stream: Any) -> Any:
    """An event recorded on ``stream`` (of ``device``) that a host may wait on (it sleeps
    while it waits)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        event = cupy.cuda.Event(block=True, disable_timing=True)
        event.record(stream)
    return event


# ------------------------------------------------------------------------------ a key's order


def follow(entry: Entry, stream: Any, writing: bool) -> None:
    """Make later work on ``stream`` (of the key's GPU) wait (on the GPU) for the key's work
    on other streams: all of it before a write, its latest write before a read."""
    assert entry.device is not None
    here = stream_key(entry.device, stream)
    events = entry.gpu_after if writing else entry.gpu_after[:1]
    for where, event in events:
        if event is not None and where != here:
            stream.wait_event(event)


def note_write(entry: Entry, stream: Any) -> Any:
    """Record the end of a write of the key enqueued on ``stream`` (of the key's GPU, after
    :func:`follow`, so it follows everything before); return the event (blocking sync)."""
    assert entry.device is not None
    event = _blocking_event(entry.device, stream)
    entry.gpu_after = [(stream_key(entry.device, stream), event)]
    return event


def note_read(entry: Entry, stream: Any) -> Any:
    """Record the end of a read of the key enqueued on ``stream`` (of the key's GPU);
    return the event (blocking sync). A later write waits for it."""
    assert entry.device is not None
    event = _blocking_event(entry.device, stream)
    after = entry.gpu_after
    if not after:
        # No write is pending: a read needs no order before the next read, and the first
        # place is the write's.
        after.append(((-1, -1), None))
    after.append((stream_key(entry.device, stream), event))
    if len(after) > MAX_PENDING_READS:
        after[1:] = [(where, ev) for where, ev in after[1:] if not ev.done]
    return event


def pending(entry: Entry) -> list[Any]:
    """The events of the key's work enqueued outside engine tasks (see the module
    docstring); an engine task on the key waits for them (``ctx.after``)."""
    return [event for _, event in entry.gpu_after if event is not None]


def settle(entries: Iterator[Entry] | Sequence[Entry]) -> None:
    """Wait on the host for the keys' work enqueued outside engine tasks (before host code
    reads what it writes: optimizer states, for one)."""
    for entry in entries:
        for _, event in entry.gpu_after:
            if event is not None:
                event.synchronize()
