"""A server's buffers and who owns them: the keys' own buffers, regions of shared memory
the stored values may live in, and the pushes read in place in a sender's shared memory.

Three owners meet here. A key owns its stored value, its open round's sum and its spare
buffers (:class:`RegionEntry`, the buffer half of
:class:`~akv.cluster.server.instructions.ServerEntry`); with :class:`ValueRegions`, the sums
that become stored values are taken from regions that local workers read answers from
without a copy. A sender owns the payloads the server reads in place in its shared memory
(:class:`Landing` decides which, :class:`Lent` counts who still reads them). :func:`own`
and :func:`give_back` move an array between the two: copied into a buffer of the key where
it must be kept, returned to the key only when it is the key's.

One pair of verbs for who holds what, as in :mod:`akv_transport`'s shared memory: ``take``
and ``give_back`` (a region of :class:`ValueRegions`, a share of what is :class:`Lent`, a
buffer of a key). No I/O: the service hands these objects its streams' memory and
callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from akv.args import Key
from akv.errors import AKVError
from akv.keys import Entry, VarFactory

__all__ = [
    "VALUES_KEEP_FREE",
    "Landing",
    "Lent",
    "RegionEntry",
    "ValueRegions",
    "give_back",
    "own",
]

#: Stored values leave this fraction (1/N) of the regions' memory free.
VALUES_KEEP_FREE = 4


class ValueRegions(Protocol):
    """Memory that answers can be sent from without a copy (regions of the arena a
    server's local streams share, :class:`akv_transport.ArenaBook`): thread-safe."""

    @property
    def nbytes(self) -> int:
        """The size of the memory the regions are taken from."""
        ...

    def take(self, nbytes: int, keep_free: int = 0) -> memoryview | None:
        """A writable region of ``nbytes``, the caller's until :meth:`give_back`; None
        when there is no room, or it would leave less than ``keep_free`` bytes free (or
        ``nbytes`` is too small to be worth it)."""
        ...

    def fits(self, nbytes: int, keep_free: int = 0) -> bool:
        """Whether ``nbytes`` more would leave ``keep_free`` bytes free now."""
        ...

    def give_back(self, view: np.ndarray) -> None:
        """Give a region :meth:`take` returned back (peers still reading it keep it until
        they gave it back too)."""
        ...


class RegionEntry(Entry):
    """A key's buffers on a server: its stored value, its open round's sum, and where
    they come from.

    With :attr:`regions`, the sums that become the stored value without an updater live in
    them, so that answers to local workers are sent without a copy. Peers may read a
    stored value there until they give it back, after a newer value replaced it: such a
    value is never changed in place (:meth:`private_value` moves it out first).
    """

    __slots__ = ("_in_regions", "_private_sums", "borrowed", "merged", "regions")

    def __init__(self, key: Key, value: np.ndarray, new_var: VarFactory) -> None:
        super().__init__(key, tuple(value.shape), value.dtype, new_var(f"key {key!r}"))
        self.value: np.ndarray = value
        self.merged: np.ndarray | None = None
        #: When the open round's sum is still its first push, read in place where it lies
        #: in the sender's shared memory (``merged`` is then read-only): what lent it.
        self.borrowed: Lent | None = None
        self.regions: ValueRegions | None = None
        #: The buffers this key took from :attr:`regions` and has not given back (the
        #: stored value and the open round's sum, at most).
        self._in_regions: list[np.ndarray] = []
        #: A sum found no room in :attr:`regions` and took a buffer of the key's own.
        self._private_sums = False

    def take_sum_buffer(self) -> np.ndarray:
        """A buffer for a round's sum that will become the stored value: in
        :attr:`regions` where there is room (leaving a quarter of them free), else as
        :meth:`take_buffer`."""
        regions = self.regions
        if regions is not None:
            # Stored values never take the last quarter: answers not kept there (keys
            # past it, values an updater changes) are copied into regions of their own.
            view = regions.take(self.nbytes, keep_free=regions.nbytes // VALUES_KEEP_FREE)
            if view is not None:
                buffer: np.ndarray = np.frombuffer(view, self.dtype).reshape(self.shape)
                self._in_regions.append(buffer)
                return buffer
            self._private_sums = True
        return cast(np.ndarray, self.take_buffer())

    def give_buffer(self, buffer: Any) -> None:
        """As :meth:`Entry.give_buffer`; a buffer taken from :attr:`regions` is given back
        to them instead (free once no peer reads it)."""
        if self._in_regions and self._out_of_regions(buffer):
            assert self.regions is not None  # it came from them
            self.regions.give_back(buffer)
        else:
            super().give_buffer(buffer)

    def replace_value(self, value: np.ndarray) -> None:
        """Make ``value`` the stored value; the old one goes back to :attr:`regions` (free
        once no peer reads it) or becomes a spare buffer of the key, unless it is a buffer
        of the key's own that the key will not need: ``value`` lies in the regions, and
        they have room for the next round's sum beside it (no sum of the key ever found
        none).

        A key whose sums become stored values in the regions is pushed by local workers
        whose pushes are read in place, so a spare only stands in as a push's buffer until
        its payload is lent (``Landing.lend``), which an untouched ``np.empty`` does
        without memory. Kept, the old value (the init's, written) would hold as much
        memory as the stored value for the whole job. Where the regions cannot hold two
        values of the key, every other round's sum is a buffer of the key's own: then it
        is kept, for them.
        """
        old = self.value
        self.value = value
        regions = self.regions
        if (
            regions is not None
            and not self._private_sums
            and self._is_in_regions(value)
            and not self._is_in_regions(old)
            and regions.fits(self.nbytes, keep_free=regions.nbytes // VALUES_KEEP_FREE)
        ):
            return
        self.give_buffer(old)

    def _is_in_regions(self, buffer: np.ndarray) -> bool:
        return any(array is buffer for array in self._in_regions)

    def private_value(self) -> np.ndarray:
        """The stored value, moved into a buffer of the key's own first if it lies in
        :attr:`regions` (peers may be reading it there): call before changing it in
        place."""
        value = self.value
        if self._in_regions and self._out_of_regions(value):
            assert self.regions is not None  # it came from them
            private = cast(np.ndarray, self.take_buffer())
            np.copyto(private, value)
            self.regions.give_back(value)
            self.value = private
        return self.value

    def _out_of_regions(self, buffer: object) -> bool:
        """Forget ``buffer`` as taken from :attr:`regions`; False when it was not."""
        taken = self._in_regions
        for index, array in enumerate(taken):
            if array is buffer:
                del taken[index]
                return True
        return False


@dataclass
class Landing:
    """What to do with a frame's arrays, decided when its header arrived: the key each
    payload belongs to and the buffer it is received into (None: not received, its bytes
    are read and dropped), or the error that refuses the whole frame (then every buffer is
    None: a refused frame is given no memory)."""

    entries: list[RegionEntry | None] = field(default_factory=list)
    buffers: list[np.ndarray | None] = field(default_factory=list)
    error: AKVError | None = None
    #: The payloads are only read (merged, or applied by the updater), so they may be read
    #: in place where they lie in the sender's shared memory (push and pushpull).
    read_in_place: bool = False
    #: The payloads read in place (see :meth:`lend`); None when none are. The
    #: :class:`~akv.cluster.server.instructions.Land` that reads them takes it over.
    lent: Lent | None = None

    def lend(self, payloads: Sequence[memoryview], give_back: Callable[[], None]) -> None:
        """Read the read-only ``payloads`` (those that lie in the sender's shared memory)
        in place of their buffers, which go back to their keys; ``give_back`` gives that
        memory back to the sender once nothing reads it any more (:class:`Lent`).

        A payload read in place is a read-only array: :func:`own` copies it into a buffer
        of its key where it has to be kept. A buffer of no key (a row push's) is replaced
        by the payload with its dtype and shape.
        """
        for index, payload in enumerate(payloads):
            entry, buffer = self.entries[index], self.buffers[index]
            if not payload.readonly or buffer is None:
                continue
            if entry is not None:
                entry.give_buffer(buffer)
                self.buffers[index] = np.frombuffer(payload, entry.dtype).reshape(entry.shape)
            else:
                self.buffers[index] = np.frombuffer(payload, buffer.dtype).reshape(buffer.shape)
        self.lent = Lent(give_back)

    def give_back_buffers(self) -> None:
        """Return each buffer to its key (a frame answered with an error uses none)."""
        for entry, buffer in zip(self.entries, self.buffers, strict=True):
            if entry is not None and buffer is not None:
                give_back(entry, buffer)


class Lent:
    """One frame's payloads read in place in the sender's shared memory, given back to
    the sender once the last holder gave its share back. The first holder is whoever
    received the frame; a round's sum that starts as one of the payloads takes a share too
    (:meth:`take`), until a later push makes the sum a buffer of the key's own. Called on
    the server's loop only."""

    __slots__ = ("_give_back", "_holders")

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._holders = 1

    def take(self) -> None:
        """One more holder (call while holding a share already)."""
        self._holders += 1

    def give_back(self) -> None:
        """A holder is done; the last one gives the payloads back to the sender."""
        self._holders -= 1
        if self._holders == 0:
            self._give_back()


def own(entry: RegionEntry, array: np.ndarray, stored: bool = False) -> np.ndarray:
    """``array`` where the key may keep it: a buffer of its own already, or a copy of a
    payload read in place (read-only: it lies in a sender's shared memory); ``stored``:
    the copy becomes the stored value (:meth:`RegionEntry.take_sum_buffer`)."""
    if array.flags.writeable:
        return array
    copy: np.ndarray = entry.take_sum_buffer() if stored else entry.take_buffer()
    np.copyto(copy, array)
    return copy


def give_back(entry: RegionEntry, array: np.ndarray) -> None:
    """Return a buffer to its key, unless it is a payload read in place (not the key's)."""
    if array.flags.writeable:
        entry.give_buffer(array)
