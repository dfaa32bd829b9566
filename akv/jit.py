"""Compiled row kernels: the per-row loops of a row-sparse round in one pass each.

A round of row-sparse pushes on a server sums the pushes (a union of a few thousand
scattered rows) and updates the stored rows with the optimizer. In NumPy that is about
eight passes over the round's rows, each a fancy-indexed gather, scatter or element-wise
call on a fresh array, and on this memory-bound kind of work each pass costs about as much
as the arithmetic. Compiled with numba, two pushes are summed in one merge over their rows,
and SGD's update (with or without momentum) and Adam's read and write each stored row and
state row once (no gather and scatter); see ``docs/benchmarks.md`` for what that saves. A
:class:`~akv.rows.RowIndex` (the hash index of a table of more than 2^24 rows) probes with
one more kernel.

numba is installed with akv where it has wheels and used when it imports; without it
(:func:`available` False, or ``AKV_JIT=0``) the same work runs in NumPy. Both compute the
same numbers, bit for bit: the same float operations in the same order (no fused
multiply-add: numba does not contract without ``fastmath``), which the tests check.

The kernels are made when a process first needs them (the stores ask when a row-sparse key
is made), for float32 and float64, and cached on disk (numba's ``cache=True``): the first
time on a machine takes a few seconds (3 s measured on a busy 2-core machine), later
processes import numba and load them in 0.3-1.2 s (and about 125 MiB of RSS, 78 of them
shared library pages). A server makes them on a thread (:func:`load_soon`): its event loop
never stops for them, and it answers the key's init once they are made.

The cache is the user's (``$XDG_CACHE_HOME/akv/numba``, ``~/.cache/akv/numba``; numba's
``NUMBA_CACHE_DIR`` wins when set), not numba's default beside akv's source: in a
non-editable install that is site-packages, where pip does not know the files, and a later
install leaves a folder holding only them, which Python then imports as an empty ``akv``
that hides the installed one (found following the README: ``pip install .`` then ``pip
install -e .``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from akv.errors import ConfigError

__all__ = ["available", "describe", "enabled", "kernels", "load_soon", "made", "settled"]

#: The dtypes the kernels are compiled for (their signatures are given: other types are
#: refused, and the callers fall back to NumPy for them).
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_lock = threading.Lock()
_kernels: SimpleNamespace | None = None
_failed = False
_loading: threading.Thread | None = None
_start_lock = threading.Lock()


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``AKV_JIT`` (``os.environ`` by default): 1 or unset, use the compiled kernels where
    they import; 0, never.

    Raises
    ------
    ConfigError
        Any other value (checked when a store is created and when a server starts).
    """
    value = (os.environ if environ is None else environ).get("AKV_JIT", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"AKV_JIT={value!r}: set it to 1 (on) or 0 (off)")
    return value == "1"


def describe() -> str:
    """Which row kernels this process uses, for reports: ``compiled (numba X.Y)``, or
    ``NumPy`` and why."""
    if not enabled():
        return "NumPy (AKV_JIT=0)"
    if kernels() is None:
        return "NumPy (numba is not installed or cannot compile here)"
    import numba

    return f"compiled (numba {numba.__version__})"


def available() -> bool:
    """Whether the compiled kernels can be used: numba imports and ``AKV_JIT`` is not 0."""
    return kernels() is not None


def kernels() -> SimpleNamespace | None:
    """The compiled kernels (``merge_rows``, ``sgd_rows``, ``sgd_mom_rows``,
    ``adam_rows``, ``index_probe``), made on the first call; None without a usable numba or with
    ``AKV_JIT=0``."""
    global _kernels, _failed
    if not enabled():
        return None
    if _kernels is not None or _failed:
        return _kernels
    with _lock:
        if _kernels is None and not _failed:
            try:
                _kernels = _compile()
            except ImportError:
                _failed = True
            except Exception as exc:  # numba present but unusable here (no cache dir...)
                _failed = True
                logging.getLogger("akv").warning(
                    "akv: numba's compiled row kernels are off, NumPy does their work: %s: %s",
                    type(exc).__name__,
                    exc,
                )
    return _kernels


def made() -> SimpleNamespace | None:
    """The kernels if this process made them already (:func:`kernels`), else None; never
    makes them, so a caller on an event loop or a hot path never waits for a compile."""
    return _kernels


def load_soon() -> None:
    """Start making the kernels on a thread of their own (once), unless they are made,
    failed or off; returns at once. A server calls it when a row-sparse key is made: its
    event loop must not stop for the seconds a first compile takes (heartbeats, other
    workers' frames); it answers the key's init once :func:`settled`."""
    global _loading
    if _kernels is not None or _failed or not enabled():
        return
    with _start_lock:
        if _loading is None:
            _loading = threading.Thread(target=kernels, name="akv-jit", daemon=True)
            _loading.start()


def settled() -> bool:
    """Whether :func:`kernels` returns at once: made, failed, or off."""
    return _kernels is not None or _failed or not enabled()


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the kernels are cached (see the module), made if missing; None when it
    cannot be made (then numba's default)."""
    environ = os.environ if environ is None else environ
    given = environ.get("NUMBA_CACHE_DIR")
    if given:
        return given
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "akv", "numba")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _compile() -> SimpleNamespace:
    # Imported here: optional, and 0.1-0.3 s to import, paid only where rows are summed.
    from numba.core import config as numba_config

    config: Any = numba_config  # (its settings are made at import: no stubs know them)
    previous = config.CACHE_DIR
    config.CACHE_DIR = cache_dir() or previous  # read as each kernel is decorated
    try:
        return _kernels_made()
    finally:
        config.CACHE_DIR = previous


def _kernels_made() -> SimpleNamespace:
    import numba
    from numba import types

    # Signatures given: every kernel is compiled (or loaded from the cache) here, where a
    # failure turns them off, never in a round; a call with other types is a TypeError.
    def signatures(*args: Any, returns: Any = types.void) -> list[Any]:
        return [
            returns(*(arg(types.float32 if d == np.float32 else types.float64) for arg in args))
            for d in DTYPES
        ]

    def rows(real: Any) -> Any:
        return types.Array(real, 2, "C")

    def ids(real: Any) -> Any:
        return types.Array(types.int64, 1, "C")

    # Arrays only read: writable ones are accepted too.
    def rows_in(real: Any) -> Any:
        return types.Array(real, 2, "C", readonly=True)

    def ids_in(real: Any) -> Any:
        return types.Array(types.int64, 1, "C", readonly=True)

    def scalar(real: Any) -> Any:
        return real

    def flag(real: Any) -> Any:
        return types.boolean

    # error_model="numpy": a float division by zero gives inf or nan, as in NumPy (numba's
    # default raises ZeroDivisionError, and its check keeps loops from vectorizing).
    def jit(sigs: list[Any]) -> Any:
        return numba.njit(sigs, cache=True, nogil=True, boundscheck=False, error_model="numpy")

    table = types.Array(types.int64, 2, "C")
    return SimpleNamespace(
        index_probe=jit(
            [
                types.int64(
                    table,
                    ids_in(None),
                    ids(None),
                    types.uint64,
                    types.uint64,
                    types.int64,
                    types.int64,
                    types.int64,
                )
            ]
        )(_index_probe),
        merge_rows=jit(
            signatures(ids_in, rows_in, ids_in, rows_in, ids, rows, returns=types.int64)
        )(_merge_rows),
        sgd_rows=jit(signatures(rows, ids_in, rows_in, scalar, scalar, flag))(_sgd_rows),
        sgd_mom_rows=jit(
            signatures(rows, ids_in, rows_in, rows, ids_in, scalar, scalar, scalar, flag)
        )(_sgd_mom_rows),
        adam_rows=jit(
            signatures(
                rows,
                ids_in,
                rows_in,
                rows,
                ids_in,
                rows,
                ids_in,
                scalar,
                flag,
                scalar,
                flag,
                scalar,
                scalar,
                scalar,
                scalar,
                scalar,
                scalar,
            )
        )(_adam_rows),
    )


# The kernels, in the subset of Python that numba compiles (they run compiled only).

#: :func:`_index_probe`'s modes.
INDEX_FIND, INDEX_CLAIM, INDEX_PLACE = 0, 1, 2
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
_HALF = np.uint64(32)


def _index_probe(
    table: Any,
    ids: Any,
    slots: Any,
    multiplier: Any,
    shift: Any,
    mask: int,
    next_slot: int,
    mode: int,
) -> int:  # pragma: no cover - compiled
    """:class:`akv.rows.RowIndex`'s open addressing, one id after the other: ``table``
    holds an (id, slot) pair per position (-1: free), an id's probe starts at its home
    (the same hash as ``RowIndex._home``) and goes on to the next position until it meets
    the id or a free position.

    ``INDEX_FIND``: ``slots[i]`` is ``ids[i]``'s slot or -1; returns ``next_slot`` plus
    how many are -1 (given 0: the count).
    ``INDEX_CLAIM`` (room made for every id): each id whose ``slots[i]`` is -1 is placed
    at its free position with slot ``next_slot``, the next one, ... (an id repeated takes
    the slot of its first placing); returns the next free slot. ``INDEX_PLACE`` (ids
    unique and absent, room made): each id is placed with slot ``slots[i]``; returns 0.
    """
    for i in range(ids.size):
        if mode == INDEX_CLAIM and slots[i] >= 0:
            continue
        wanted = ids[i]
        hashed = np.uint64(wanted) * multiplier
        hashed ^= hashed >> _HALF
        hashed *= _FIBONACCI
        position = np.int64(hashed >> shift)
        while True:
            held = table[position, 0]
            if held == wanted:
                slots[i] = table[position, 1]
                break
            if held == -1:
                if mode == INDEX_FIND:
                    slots[i] = -1
                    next_slot += 1  # counts the missing ids
                else:
                    table[position, 0] = wanted
                    if mode == INDEX_CLAIM:
                        slots[i] = next_slot
                        next_slot += 1
                    table[position, 1] = slots[i]
                break
            position = (position + 1) & mask
    return 0 if mode == INDEX_PLACE else next_slot


def _merge_rows(
    ids_a: Any, rows_a: Any, ids_b: Any, rows_b: Any, ids: Any, rows: Any
) -> int:  # pragma: no cover - compiled
    """The sum of two row-sparse values (ids sorted and unique) into ``ids`` and ``rows``
    (room for both); returns how many rows it wrote. As NumPy adds them into zeros: a row
    of ``a`` alone is copied, of ``b`` alone added to 0.0 (-0.0 becomes 0.0), of both
    ``a + b``."""
    width = rows.shape[1]
    i = j = n = 0
    while i < ids_a.size or j < ids_b.size:
        if j == ids_b.size or (i < ids_a.size and ids_a[i] < ids_b[j]):
            ids[n] = ids_a[i]
            for k in range(width):
                rows[n, k] = rows_a[i, k]
            i += 1
        elif i == ids_a.size or ids_b[j] < ids_a[i]:
            ids[n] = ids_b[j]
            for k in range(width):
                rows[n, k] = 0.0 + rows_b[j, k]  # exact in float64, as NumPy's 0 + b
            j += 1
        else:
            ids[n] = ids_a[i]
            for k in range(width):
                rows[n, k] = rows_a[i, k] + rows_b[j, k]
            i += 1
            j += 1
        n += 1
    return n


def _sgd_rows(
    table: Any, slots: Any, grad: Any, step: Any, keep: Any, decay: bool
) -> None:  # pragma: no cover - compiled
    """SGD's ``sgd_update`` on rows ``slots`` (unique) of ``table``, in NumPy's order:
    ``w = w * keep`` (with ``decay``), then ``w - grad * step``."""
    width = grad.shape[1]
    for r in range(slots.size):
        s = slots[r]
        for k in range(width):
            w = table[s, k]
            if decay:
                w = w * keep
            table[s, k] = w - grad[r, k] * step


def _sgd_mom_rows(
    table: Any,
    slots: Any,
    grad: Any,
    mom: Any,
    mom_slots: Any,
    momentum: Any,
    decay: Any,
    step: Any,
    decays: bool,
) -> None:  # pragma: no cover - compiled
    """SGD with momentum on rows ``slots`` of ``table`` and ``mom_slots`` of ``mom``, in
    NumPy's order: ``m = m * momentum``, ``m = m - w * decay`` (with ``decays``),
    ``m = m - g * step``, ``w = w + m``."""
    width = grad.shape[1]
    for r in range(slots.size):
        s = slots[r]
        q = mom_slots[r]
        for k in range(width):
            m = mom[q, k] * momentum
            if decays:
                m = m - table[s, k] * decay
            m = m - grad[r, k] * step
            mom[q, k] = m
            table[s, k] = table[s, k] + m


def _adam_rows(
    table: Any,
    slots: Any,
    grad: Any,
    mean: Any,
    mean_slots: Any,
    var: Any,
    var_slots: Any,
    rescale: Any,
    rescales: bool,
    wd: Any,
    decays: bool,
    beta1: Any,
    keep1: Any,
    beta2: Any,
    keep2: Any,
    epsilon: Any,
    neg_lr: Any,
) -> None:  # pragma: no cover - compiled
    """Adam on rows ``slots`` of ``table`` with their mean and variance rows, in NumPy's
    order: ``g = w * wd + g * rescale``, ``mean = mean * beta1 + g * keep1``,
    ``var = var * beta2 + (g * g) * keep2``, ``w = w + (mean / (sqrt(var) + eps)) * -lr``
    (the bias correction folded into ``neg_lr``)."""
    width = grad.shape[1]
    for r in range(slots.size):
        s = slots[r]
        p = mean_slots[r]
        q = var_slots[r]
        for k in range(width):
            g = grad[r, k]
            if rescales:
                g = g * rescale
            w = table[s, k]
            if decays:
                g = w * wd + g
            m = mean[p, k] * beta1 + g * keep1
            v = var[q, k] * beta2 + (g * g) * keep2
            mean[p, k] = m
            var[q, k] = v
            table[s, k] = w + (m / (np.sqrt(v) + epsilon)) * neg_lr
