"""The array work of a server's rounds: merging pushes and applying rounds.

Plain functions on NumPy arrays, no I/O: the service runs them inside engine tasks that
write the keys involved, so that per key they never overlap with each other or with the
pulls that read the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from akv import optimizer as _optimizer
from akv.dist.server.state import Land, ServerEntry, give_back, own

__all__ = ["land"]


def land(
    work: Land, updater: _optimizer.Updater | None
) -> tuple[list[tuple[ServerEntry, int]], list[tuple[ServerEntry, int, Exception]]]:
    """Merge ``work``'s pushes into their rounds, then apply the rounds it closes.

    Without ``updater`` a round's sum becomes the stored value (assignment); with one,
    ``updater(key, summed, stored)`` changes the stored value in place. Returns the
    (key, round) pairs applied and the (key, round, exception) of those whose update
    raised (the stored value of those is as the updater left it).
    """
    _merge(work.merges)
    done: list[tuple[ServerEntry, int]] = []
    failed: list[tuple[ServerEntry, int, Exception]] = []
    for entry, buffer, round_no in work.closing:
        received = entry.merged if buffer is None else buffer
        entry.merged = None
        assert received is not None  # a closing sync round always has a merge buffer
        try:
            if updater is None:
                old = entry.value
                entry.value = own(entry, received)
                entry.give_buffer(old)
            else:
                updater(entry.key, received, entry.value)  # reads ``received`` only
                give_back(entry, received)
        except Exception as exc:
            failed.append((entry, round_no, exc))
        else:
            done.append((entry, round_no))
    return done, failed


def _merge(items: Sequence[tuple[ServerEntry, np.ndarray, bool]]) -> None:
    """Start each round's sum with its first push, or add a later push to it (straight
    out of the sender's shared memory when it was read in place)."""
    for entry, buffer, first in items:
        if first:
            entry.merged = own(entry, buffer)
        else:
            assert entry.merged is not None  # the round's first push started it
            np.add(entry.merged, buffer, out=entry.merged)
            give_back(entry, buffer)
