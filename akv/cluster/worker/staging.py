"""Where a worker's pushed values wait until sent, and where GPU pull outputs land first.

At a push's call, :class:`Staging` takes the values: each key's values summed into a
staging buffer (regions of the shared arenas of the streams to the key's servers, one per
part, each sent from there without another copy; else a buffer of the key's own), or a single
C-contiguous array borrowed as it is when the caller waits for the servers. GPU values
(in every distributed store type) are summed on their GPU at the call and copied into a
pinned buffer by a GPU task that the send follows (:mod:`akv.pinned`); a pull's GPU
outputs land in a pinned buffer per key, copied to their GPUs by GPU tasks that follow the
pull.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from akv.arrays import Array, has_gpu, is_gpu, record_on_callers
from akv.cluster.worker.requests import compress_parts
from akv.compression import Residuals
from akv.errors import CompressionError
from akv.keys import Entry, Parted, Staged, merge_into
from akv.pinned import GPU, from_pinned, stage_to_pinned
from akv_engine import Engine, GPUWork, Var, Waitable, gather, then
from akv_transport import SharedMemory, StreamProtocol

__all__ = ["Staging", "land_in_pinned"]

_NONE: dict[int, np.ndarray] = {}

#: A staged push: what to send per key, and how to give the staging buffers back.
StagedPush = tuple[list[tuple[Entry, Staged]], Callable[[], None]]


class Staging:
    """The staging of one worker's pushes (see the module docstring).

    ``stream_of(server)`` is the stream to ``server`` when it may hold a push's staging
    buffer (it shares memory, and its server keeps no copies for a restart: those are kept
    past the answer); ``gpu_ready(entry)`` readies a key for GPU values.
    """

    def __init__(
        self,
        engine: Engine,
        stream_of: Callable[[int], StreamProtocol | None],
        gpu_ready: Callable[[Entry], None],
    ) -> None:
        self._engine = engine
        self._stream_of = stream_of
        self._gpu_ready = gpu_ready
        #: With gradient compression: the residuals (staged values are then compressed).
        self.residuals: Residuals | None = None

    def stage(
        self, values: list[tuple[Entry, list[Array]]], borrow: bool, priority: int
    ) -> StagedPush:
        """What to send per key, and how to give the staging buffers back afterwards.

        ``borrow`` (the caller waits until the servers acknowledged): a key's single
        C-contiguous array is sent as it is, without a copy; otherwise the values are
        summed into a staging buffer now.
        """
        if self.residuals is not None:
            return self._compressed(self.residuals, values)
        staged: list[tuple[Entry, Staged]] = []
        owned = []
        reserved: list[tuple[SharedMemory, np.ndarray]] = []
        pinned = self._reduce_on_gpus(values, priority) if has_gpu(values) else _NONE
        for entry, arrays in values:
            buffer = pinned.get(id(entry))
            if buffer is not None:
                staged.append((entry, buffer))
                owned.append((entry, buffer))
            elif borrow and len(arrays) == 1 and arrays[0].flags.c_contiguous:
                staged.append((entry, arrays[0]))
            else:
                regions = self._arena_buffers(entry, arrays)
                if regions is not None:
                    staged.append((entry, _merge_parts(entry, regions, arrays)))
                    reserved.extend(regions)
                    continue
                buffer = merge_into(entry.take_buffer(), arrays)
                staged.append((entry, buffer))
                owned.append((entry, buffer))

        def give_back() -> None:
            for entry, buffer in owned:
                entry.give_buffer(buffer)
            for shared, region in reserved:
                shared.give_back(region)

        return staged, give_back

    def _compressed(
        self, residuals: Residuals, values: list[tuple[Entry, list[Array]]]
    ) -> StagedPush:
        """Each key's values summed, then compressed part by part with this worker's
        residuals, now (in call order: a residual follows the pushes of its key).

        Raises
        ------
        CompressionError
            A GPU value (compressed pushes of GPU values are not supported yet), before
            anything changed.
        """
        for entry, arrays in values:
            if any(is_gpu(array) for array in arrays):
                raise CompressionError(
                    f"push to key {entry.key!r}: a compressed push of GPU values is not "
                    "supported yet in a distributed store; push host (NumPy) values"
                )
        staged: list[tuple[Entry, Staged]] = []
        for entry, arrays in values:
            dense = merge_into(entry.take_buffer(), arrays)
            staged.append((entry, compress_parts(residuals, entry, dense)))
            entry.give_buffer(dense)
        return staged, _nothing

    def _arena_buffers(
        self, entry: Entry, arrays: list[Array]
    ) -> list[tuple[SharedMemory, np.ndarray]] | None:
        """A staging buffer for each part of ``entry`` (the key's shape for a key of one
        part, else flat) in the arena of the stream to the part's server, when every
        part's stream has a free region; None otherwise (nothing is taken then). A split
        key's values must be C-contiguous (a part is then a range of each of them)."""
        if len(entry.parts) > 1 and not all(array.flags.c_contiguous for array in arrays):
            return None
        taken: list[tuple[SharedMemory, np.ndarray]] = []
        for part in entry.parts:
            protocol = self._stream_of(part.server)
            shared = None if protocol is None else protocol.shared
            view = None if shared is None else shared.take(part.size * entry.dtype.itemsize)
            if shared is None or view is None:
                for holder, region in taken:
                    holder.give_back(region)
                return None
            taken.append((shared, np.frombuffer(view, entry.dtype)))
        if len(taken) == 1:
            shared, region = taken[0]
            return [(shared, region.reshape(entry.shape))]
        return taken

    def _reduce_on_gpus(
        self, values: list[tuple[Entry, list[Array]]], priority: int
    ) -> dict[int, np.ndarray]:
        """Each key's GPU values summed on the GPU at the call and copied into a pinned
        buffer by a GPU task that the send follows (:func:`akv.pinned.stage_to_pinned`).
        Returns ``id(entry) -> pinned``."""
        return stage_to_pinned(self._engine, values, priority, self._gpu_ready)

    def land_on_gpus(
        self,
        task: Waitable,
        landing: Var,
        landed: list[tuple[Entry, np.ndarray, list[Array]]],
        result: Any,
        priority: int,
    ) -> Waitable:
        """After the pull ``task`` (which wrote ``landing``), copy each pinned buffer of
        ``landed`` to its GPU outputs (GPU tasks on copy streams, which read the keys too:
        work issued later on a key waits for them, as it waits for the pull); the buffers
        go back to their keys once copied. The waitable's result is ``result``."""
        by_device: dict[int, list[tuple[Array, list[Array]]]] = {}
        for _, buffer, outs in landed:
            for out in outs:
                by_device.setdefault(int(out.device.id), []).append((buffer, [out]))
        landed_vars = [entry.var for entry, _, _ in landed]
        copies = [
            self._engine.push(
                GPUWork(from_pinned, device=device, kind="copy"),
                items,
                record_on_callers(out for _, outs in items for out in outs),
                reads=[landing, *landed_vars],
                priority=priority,
                executor=GPU,
                name="land",
            )
            for device, items in by_device.items()
        ]

        def give_back_landed(_: object) -> Any:
            for entry, buffer, _outs in landed:
                entry.give_buffer(buffer)
            return result

        return then(gather([task, *copies]), give_back_landed)


def land_in_pinned(
    targets: Sequence[tuple[Entry, list[Array]]],
) -> tuple[list[tuple[Entry, list[Array]]], list[tuple[Entry, np.ndarray, list[Array]]]]:
    """Pull targets with each key's GPU outputs replaced by one pinned host buffer, and the
    ``(entry, pinned buffer, GPU outputs)`` to copy once the answers landed."""
    host_targets = []
    landed = []
    for entry, outs in targets:
        gpu_outs = [out for out in outs if is_gpu(out)]
        if not gpu_outs:
            host_targets.append((entry, outs))
            continue
        buffer = entry.take_buffer()
        host_targets.append((entry, [buffer, *(out for out in outs if not is_gpu(out))]))
        landed.append((entry, buffer, gpu_outs))
    return host_targets, landed


def _merge_parts(
    entry: Entry, regions: list[tuple[SharedMemory, np.ndarray]], arrays: list[Array]
) -> Staged:
    """The sum of ``arrays`` written into the staging ``regions`` of ``entry``'s parts:
    the key's array (one part), or its :class:`~akv.keys.Parted` parts."""
    if len(regions) == 1:
        return cast(np.ndarray, merge_into(regions[0][1], arrays))
    flat = [array.reshape(-1) for array in arrays]  # views: the arrays are C-contiguous
    return Parted(
        tuple(
            merge_into(region, [array[part.start : part.stop] for array in flat])
            for part, (_, region) in zip(entry.parts, regions, strict=True)
        )
    )


def _nothing() -> None:
    """Nothing to give back: compressed values are arrays of their own."""
