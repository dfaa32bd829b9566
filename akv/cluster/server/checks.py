"""Which request frames a server takes: the checks of a frame's header against the keys
the server holds, made before any payload is given memory or anything is counted, so that
a refused frame costs its header and nothing proportional to the payload it declares.

Plain functions that change nothing and do no I/O:
:meth:`~akv.cluster.server.state.ServerState.header_arrived` calls :func:`check_frame`
(and ``admit`` :func:`check_admission`, for a worker's stream or single frame),
and the state looks its keys and its optimizer up with :func:`entry_of` and
:func:`require_updater`, which raise the errors a worker is answered with.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from akv import optimizer as _optimizer
from akv.args import Key
from akv.cluster.protocol import DIST_STORE_TYPES, Op, op_label
from akv.cluster.server.inits import declared_shapes, restored_key_differs
from akv.cluster.server.instructions import Peer, ServerEntry
from akv.compression import Compression, compressed_nbytes, parse_wire
from akv.errors import (
    CompressionError,
    DuplicateInitError,
    InvalidArgumentError,
    KeyNotInitializedError,
    MembershipError,
    OptimizerNotSetError,
    PeerLostError,
)
from akv_transport import ArrayInfo, FrameHeader, parse_json

__all__ = [
    "CHANGING_OPS",
    "NO_ARRAY_OPS",
    "REQUEST_OPS",
    "check_admission",
    "check_compressed",
    "check_frame",
    "entry_of",
    "optimizer_request",
    "require_updater",
    "save_states_request",
]

#: The ops a worker may send a server.
REQUEST_OPS = frozenset(op for op in Op if op not in (Op.REPLY, Op.DURABLE))
#: The requests that may change keys, rounds or the optimizer (what a checkpoint holds).
CHANGING_OPS = frozenset(
    {Op.INIT, Op.PUSH, Op.PUSHPULL, Op.SET_OPTIMIZER, Op.LOAD_STATES, Op.ROW_INIT, Op.ROW_PUSH}
)
#: The requests that carry no arrays (their meaning is in ``text``).
NO_ARRAY_OPS = frozenset(
    {Op.INIT_CHECK, Op.SET_OPTIMIZER, Op.SAVE_STATES, Op.CLOSE, Op.CHECKPOINT, Op.REPLAY_BARRIER}
)


def check_admission(
    worker: int,
    store_type: str,
    stream: bool,
    staleness: int | None,
    *,
    num_workers: int,
    job: tuple[str | None, int | None],
    failure: str | None,
    stopping: bool,
    name: str,
    restored: str = "",
    bound_set: bool = True,
) -> None:
    """Whether server ``name`` takes a stream (``stream``) or single frame of ``worker``
    opening a ``store_type`` store with bound ``staleness``; ``job``: the job's store type
    (None before the first worker) and staleness bound, ``failure``: why the job failed,
    if it did; ``stopping``: the server stops; ``restored``: the checkpoint the server was
    restored from (the job's store type is then the checkpoint's), if any; ``bound_set``: a
    stream fixed the staleness bound already (a checkpoint does not keep it). Raises what
    :meth:`~akv.cluster.server.state.ServerState.admit` documents, but for the checks of
    a worker's session and checkpoint note.
    """
    job_type, job_staleness = job
    if store_type not in DIST_STORE_TYPES:
        raise InvalidArgumentError(f"unknown store type {store_type!r}")
    if not 0 <= worker < num_workers:
        raise MembershipError(f"worker rank {worker} is out of range for {num_workers} workers")
    if job_type is not None and store_type != job_type:
        why = (
            f"{name} was restored from {restored}, written by a {job_type} job: start a job "
            "of another store type with another --checkpoint-dir"
            if restored
            else f"this job's workers use {job_type}: every worker must create the same store type"
        )
        raise MembershipError(f"worker {worker} opened a {store_type} store, but {why}")
    if staleness is not None and store_type != "dist_async":
        raise MembershipError(f"worker {worker}: staleness bounds dist_async only")
    if stream and staleness != job_staleness and bound_set and (job_type or staleness is None):
        bound = "none" if job_staleness is None else job_staleness
        raise MembershipError(
            f"worker {worker} opened its store with staleness {staleness}, but this "
            f"job's workers use {bound}: every worker must give the same bound"
        )
    if stream and failure is not None:
        raise MembershipError(f"{name} takes no stream: the job failed: {failure}")
    if stream and stopping:
        raise PeerLostError(f"{name} takes no stream: it is stopping")


def check_frame(
    peer: Peer,
    header: FrameHeader,
    entries: Mapping[Key, ServerEntry],
    updater: _optimizer.Updater | None,
    server: str,
    row_keys: Container[Key] = (),
) -> None:
    """Raise the error that refuses a frame whose header does not fit its op.

    A known op; arrays that fit it (keys present, of one kind, none named twice; a pull,
    and a request without arrays, declare no payload); each pushed key initialized, with
    its shape and dtype, so that no declared size exceeds the key's; an init only of keys
    not held yet, unless it is the init that made them, resent; a load_states only with an
    optimizer set. ``entries`` are the dense keys the server holds, ``row_keys`` its
    row-sparse ones (a dense init of one is refused too), ``updater`` its optimizer's,
    ``server`` its name in messages.
    """
    op, arrays = header.op, header.arrays
    label = op_label(op)
    if op not in REQUEST_OPS:
        raise InvalidArgumentError(
            f"unknown op {op} from worker {peer.worker} ({len(arrays)} arrays, "
            f"{header.payload_len} payload bytes): {server} refuses it"
        )
    if op in NO_ARRAY_OPS:
        if arrays:
            raise InvalidArgumentError(
                f"{label} carries no arrays, but worker {peer.worker} sent {len(arrays)} "
                f"({header.payload_len} payload bytes)"
            )
        return
    if op == Op.LOAD_STATES:
        if len(arrays) != 1 or arrays[0].key is not None or arrays[0].dtype != np.uint8:
            raise InvalidArgumentError(
                f"load_states carries one uint8 array without a key, got {len(arrays)} "
                f"arrays ({', '.join(f'{a.key!r} {a.dtype}' for a in arrays[:3])})"
            )
        require_updater(updater, "load_optimizer_states", server)
        return
    kinds = set()
    seen: set[Key] = set()
    declared = declared_shapes(header.text) if op == Op.INIT else {}
    for index, info in enumerate(arrays):
        key = info.key
        if key is None:
            raise InvalidArgumentError(
                f"{label} from worker {peer.worker}: array {index} carries no key"
            )
        if key in seen:
            raise InvalidArgumentError(
                f"{label} names key {key!r} twice in one request (worker {peer.worker})"
            )
        seen.add(key)
        kinds.add(type(key))
        if len(kinds) > 1:
            raise InvalidArgumentError(
                f"{label} from worker {peer.worker} mixes int and str keys (key {key!r}): "
                "a job's keys are all int or all str"
            )
        if op == Op.INIT:
            if key in row_keys:
                raise DuplicateInitError(
                    f"init key {key!r}: {server} already holds it as a row-sparse key", key=key
                )
            held = entries.get(key)
            shape = declared.get(key)
            if held is not None and not _resent_init(peer, header.seq, held, info, shape):
                if held.made_by is None:
                    raise restored_key_differs(
                        key,
                        _described(held.shape, held.dtype, held.declared),
                        _described(tuple(info.shape), info.dtype, shape),
                    )
                raise DuplicateInitError(f"init key {key!r}: {server} already holds it", key=key)
        elif op == Op.PULL:
            entry_of(entries, key, "pull from")
            if info.nbytes:
                raise InvalidArgumentError(
                    f"pull of key {key!r} from worker {peer.worker} declares "
                    f"{info.nbytes} payload bytes: a pull carries none"
                )
        elif header.text:  # a compressed push: the key's bytes compressed
            check_compressed(entry_of(entries, key, "push to"), info, parse_wire(header.text))
        else:
            entry_of(entries, key, "push to").check(info, "push to")


def check_compressed(entry: ServerEntry, info: ArrayInfo, compression: Compression) -> None:
    """A compressed push of ``entry`` is float32 values compressed: uint8 bytes, as many as
    :func:`~akv.compression.compressed_nbytes` says.

    Raises
    ------
    CompressionError
    """
    compression.check_key(entry.key, entry.dtype)
    nbytes = compressed_nbytes(compression, entry.size)
    if info.dtype != np.uint8 or tuple(info.shape) != (nbytes,):
        raise CompressionError(
            f"push to key {entry.key!r}: a {compression.type} push of {entry.size} values is "
            f"{nbytes} uint8 bytes, got {info.dtype} of shape {tuple(info.shape)}"
        )


def entry_of(entries: Mapping[Key, ServerEntry], key: Key | None, what: str) -> ServerEntry:
    """The key ``key`` of ``entries``; :class:`~akv.errors.KeyNotInitializedError` (naming
    ``what`` was asked of it) when there is none. The worker that gets the error adds which
    server answered it (:func:`akv.cluster.protocol.error_from_status`)."""
    entry = entries.get(key) if key is not None else None
    if entry is None:
        raise KeyNotInitializedError(f"{what} key {key!r}: the key was never initialized", key=key)
    return entry


def require_updater(
    updater: _optimizer.Updater | None, what: str, server: str
) -> _optimizer.Updater:
    """``updater``; :class:`~akv.errors.OptimizerNotSetError` when no optimizer is set."""
    if updater is None:
        raise OptimizerNotSetError(
            f"{what}: no optimizer is set on {server} (call set_optimizer first)"
        )
    return updater


def optimizer_request(text: str) -> tuple[_optimizer.Optimizer, dict[str, Any]]:
    """The optimizer a ``SET_OPTIMIZER`` request's text configures, and that configuration.

    Raises
    ------
    InvalidArgumentError, OptimizerError
        Not a JSON object, or not an optimizer akv has.
    """
    try:
        config = parse_json(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"optimizer configuration is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError("optimizer configuration must be a JSON object")
    return _optimizer.from_config(config), config


def save_states_request(text: str) -> bool:
    """Whether a ``SAVE_STATES`` request asks for the optimizer's configuration too.

    Raises
    ------
    InvalidArgumentError
        Not a JSON object.
    """
    try:
        request = parse_json(text or "{}")
        return bool(request.get("dump_optimizer", False))
    except (ValueError, AttributeError) as exc:
        raise InvalidArgumentError(f"malformed save_states request: {exc}") from None


def _resent_init(
    peer: Peer,
    seq: int,
    entry: ServerEntry,
    info: ArrayInfo,
    declared: tuple[int, ...] | None,
) -> bool:
    """Whether an init of ``entry``'s key is the one that made it, sent again after a
    reconnect (or to a server restored from a checkpoint), with the same shape and dtype
    (and for a key split over the servers, ``declared``, the same declared shape, where
    both know it)."""
    resent = entry.made_by is None or (bool(peer.session) and entry.made_by == (peer.session, seq))
    same = entry.shape == tuple(info.shape) and entry.dtype == info.dtype
    if entry.declared is not None and declared is not None:
        same = same and entry.declared == declared
    return resent and same


def _described(shape: tuple[int, ...], dtype: object, declared: tuple[int, ...] | None) -> str:
    """A key's shape and dtype in a message: a split key's declared shape, where known."""
    if declared is None:
        return f"{shape} {dtype}"
    return f"{declared} {dtype} (split over the servers: this server's part {shape})"
