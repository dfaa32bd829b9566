"""The array work of a server's rounds: merging pushes and applying rounds.

Plain functions on NumPy arrays, no I/O: the service runs them inside engine tasks that
write the keys involved, so that per key they never overlap with each other or with the
pulls that read the result.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from akv import optimizer as _optimizer
from akv.cluster.server.buffers import Lent, give_back, own
from akv.cluster.server.instructions import Land, RowEntry, ServerEntry
from akv.compression import decode
from akv.limits import SPLIT_ADD_MIN_BYTES

__all__ = ["Add", "land", "updater_with"]

#: ``add(a, b, out)``: ``out = a + b`` (the arrays are C-contiguous, of one shape and
#: dtype; ``out`` may be ``a``).
Add = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def updater_with(
    updater: _optimizer.Updater | None,
    optimizer: _optimizer.Optimizer,
    config: dict[str, Any],
    entries: Sequence[ServerEntry | RowEntry],
) -> _optimizer.Updater:
    """The updater that applies ``optimizer`` (of ``config``) from now on: ``updater``
    itself, keeping its states (those that still fit the keys' ``entries``: see
    :meth:`~akv.optimizer.Updater.reconfigure`), update counts and shared state, where it
    holds the same optimizer (new hyper-parameters); else a new one."""
    if updater is None or not _optimizer.keeps_states(updater, optimizer):
        return _optimizer.get_updater(optimizer)
    weights = {e.key: e.rows if isinstance(e, RowEntry) else e.private_value() for e in entries}
    updater.reconfigure(optimizer, weights)
    return updater


def _add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.add(a, b, out=out)


def land(
    work: Land, updater: _optimizer.Updater | None, add: Add = _add
) -> tuple[list[tuple[ServerEntry, int]], list[tuple[ServerEntry, int, Exception]], list[Lent]]:
    """Merge ``work``'s pushes into their rounds (summed with ``add``), then apply the
    rounds it closes.

    Without ``updater`` a round's sum becomes the stored value (assignment); with one,
    ``updater(key, summed, stored)`` changes the stored value in place. Returns the
    (key, round) pairs applied, the (key, round, exception) of those whose update raised
    (the stored value of those is as the updater left it), and the payloads read in place
    that a round's sum no longer holds (the caller gives them back: :meth:`Lent.give_back`).
    """
    to_give_back: list[Lent] = []
    for raw, target in work.decodes:
        assert work.compression is not None  # set with decodes
        decode(work.compression, raw, target.size, out=target)
    _merge(work.merges, to_give_back, updater is None, add)
    done: list[tuple[ServerEntry, int]] = []
    failed: list[tuple[ServerEntry, int, Exception]] = []
    for entry, buffer, round_no in work.closing:
        received = entry.merged if buffer is None else buffer
        entry.merged = None
        assert received is not None  # a closing sync round always has a merge buffer
        try:
            if updater is None:
                entry.replace_value(own(entry, received, stored=True))
            else:
                # Reads ``received`` only; changes the stored value in place.
                updater(entry.key, received, entry.private_value())
                give_back(entry, received)
        except Exception as exc:
            failed.append((entry, round_no, exc))
        else:
            done.append((entry, round_no))
        finally:
            _give_back_borrowed(entry, to_give_back)
    return done, failed, to_give_back


def _merge(
    items: Sequence[tuple[ServerEntry, np.ndarray, bool, Lent | None]],
    to_give_back: list[Lent],
    stored: bool,
    add: Add,
) -> None:
    """Start each round's sum with its first push, or add a later push to it (straight
    out of the sender's shared memory when it was read in place).

    A first push that comes with what lent it is the sum as it lies (read-only, in the
    sender's shared memory): the second push makes a buffer of the key's own the sum of
    both in one pass, instead of a copy of the first and then an addition. ``stored``: the
    sums become the stored values (no updater), so that buffer is taken where answers are
    sent from without a copy (:meth:`ServerEntry.take_sum_buffer`).
    """
    for entry, buffer, first, keeps in items:
        if first:
            entry.merged = buffer if keeps is not None else own(entry, buffer, stored)
            entry.borrowed = keeps
            continue
        merged = entry.merged
        assert merged is not None  # the round's first push started it
        if entry.borrowed is not None:
            total = entry.take_sum_buffer() if stored else entry.take_buffer()
            add(merged, buffer, total)
            entry.merged = total
            _give_back_borrowed(entry, to_give_back)
        else:
            add(merged, buffer, merged)
        give_back(entry, buffer)


def _give_back_borrowed(entry: ServerEntry, to_give_back: list[Lent]) -> None:
    """The key's round no longer reads a payload in place: note what lent it, to be
    given back."""
    if entry.borrowed is not None:
        to_give_back.append(entry.borrowed)
        entry.borrowed = None


def split_add(
    helper: concurrent.futures.Executor, a: np.ndarray, b: np.ndarray, out: np.ndarray
) -> None:
    """``out = a + b`` (``out`` may be ``a``); from :data:`SPLIT_ADD_MIN_BYTES` on, the
    second half is added by ``helper`` meanwhile (NumPy lets go of the GIL while it adds)."""
    contiguous = a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous
    if out.nbytes < SPLIT_ADD_MIN_BYTES or not contiguous:
        np.add(a, b, out=out)
        return
    a, b, whole = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    half = len(whole) // 2
    second = helper.submit(np.add, a[half:], b[half:], whole[half:])
    np.add(a[:half], b[:half], out=whole[:half])
    second.result()
