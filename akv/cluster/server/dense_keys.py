"""A server's dense keys: where a frame's payloads land, and what a push, pull and init of
dense keys decide.

:class:`~akv.cluster.server.state.ServerState` holds the keys (its ``entries``) and calls
these functions once :func:`~akv.cluster.server.checks.check_frame` took the frame; they
return instructions (:mod:`akv.cluster.server.instructions`) and touch no array's values
(the service merges and applies in engine tasks). Row-sparse keys are
:mod:`akv.cluster.server.row_keys`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np

from akv.args import Key
from akv.cluster.protocol import COUNTED, Op
from akv.cluster.server.buffers import Landing, ValueRegions, give_back
from akv.cluster.server.inits import declared_shapes
from akv.cluster.server.instructions import (
    Checkpoint,
    Instruction,
    Land,
    Peer,
    PullTicket,
    Reply,
    ServerEntry,
)
from akv.cluster.server.rounds import longest_wait
from akv.compression import parse_wire
from akv.errors import DuplicateInitError, InvalidArgumentError
from akv.keys import VarFactory
from akv.limits import INLINE_MAX_BYTES
from akv_transport import FrameHeader

__all__ = ["count_push", "init_keys", "land", "pull_ticket"]


def land(
    header: FrameHeader, entries: Mapping[Key, ServerEntry], landing: Landing, parks: bool
) -> None:
    """Give the payloads of a checked frame on dense keys their buffers in ``landing``:
    push payloads buffers of their keys (never the stored values; compressed ones fresh
    bytes), init payloads fresh arrays of their declared size (none for keys held already:
    a resent init's), a load_states payload a fresh byte array. ``parks``: a push may wait
    for slower workers (bounded staleness), so it is not read in place."""
    arrays = header.arrays
    op = header.op
    if op == Op.INIT:  # a resent init's keys are held already: its payloads are dropped
        landing.buffers = [
            None if info.key in entries else np.empty(info.shape, info.dtype) for info in arrays
        ]
    elif op in (Op.PUSH, Op.PUSHPULL) and header.text:
        # Compressed: fresh bytes, decoded into buffers of the keys by the push's task.
        landing.buffers = [np.empty(info.nbytes, np.uint8) for info in arrays]
    elif op in (Op.PUSH, Op.PUSHPULL):
        # A push that may wait for slower workers keeps its payloads: no reading in
        # place of memory the sender waits to get back.
        landing.read_in_place = not parks
        for index, info in enumerate(arrays):
            entry = entries[cast("Key", info.key)]  # checked: initialized
            landing.entries[index] = entry
            landing.buffers[index] = entry.take_buffer()
    elif op == Op.LOAD_STATES:
        landing.buffers = [np.empty(info.nbytes, np.uint8) for info in arrays]


def count_push(
    peer: Peer,
    header: FrameHeader,
    landing: Landing,
    now: float,
    held: Mapping[Key, ServerEntry],
    sync: bool,
) -> tuple[list[Instruction], list[ServerEntry], int]:
    """Count a checked frame's pushes (all or nothing); returns what to do (a
    :class:`~akv.cluster.server.instructions.Land` that merges and applies them in one
    task, and the push's answer), the frame's keys (a pushpull's pull reads them), and how
    many pushes were resent ones.

    A push whose number was counted already (a resent request) is answered without being
    counted or merged again. ``sync``: rounds collect one push per worker (``dist_sync``).
    """
    # A landing without an error has a buffer for every array, and an entry for every
    # array unless the push is compressed (its bytes are no buffers of the keys).
    buffers = cast("list[np.ndarray]", landing.buffers)
    compression = parse_wire(header.text) if header.text else None
    if compression is None:
        entries = cast("list[ServerEntry]", landing.entries)
    else:
        entries = [held[cast("Key", info.key)] for info in header.arrays]
    tags = [info.tag for info in header.arrays]
    worker = peer.worker
    seq = header.seq if peer.stream else 0
    seen: set[Key] = set()
    fresh: list[bool] = []
    for entry, tag in zip(entries, tags, strict=True):
        if entry.key in seen:
            raise InvalidArgumentError(
                f"push names key {entry.key!r} twice in one request (worker {worker})"
            )
        seen.add(entry.key)
        fresh.append(not entry.rounds.is_duplicate(worker, tag))
        if fresh[-1]:
            entry.rounds.check_push(worker)
    merges = []
    closing: list[tuple[ServerEntry, np.ndarray | None, int]] = []
    counted = []
    decodes = []
    nbytes = 0
    waited: float | None = None
    for entry, buffer, tag, new in zip(entries, buffers, tags, fresh, strict=True):
        if not new:
            if compression is None:
                give_back(entry, buffer)
            continue
        if compression is not None:  # decoded by the push's task into a key buffer
            raw, buffer = buffer, entry.take_buffer()
            decodes.append((raw, buffer))
        decision = entry.rounds.accept_push(worker, now, tag, seq)
        counted.append(entry)
        nbytes += entry.nbytes
        if sync:
            # A first push read in place that leaves its round open is the sum as it
            # lies: the next push adds both into a buffer of the key's own in one pass.
            keeps = landing.lent if decision.first and not decision.closes else None
            if keeps is not None and buffer.flags.writeable:
                keeps = None  # not read in place: copied to start the sum as usual
            if keeps is not None:
                keeps.take()
            merges.append((entry, buffer, decision.first, keeps))
            if decision.closes:
                closing.append((entry, None, decision.round))
                waited = longest_wait(waited, decision)
        else:
            closing.append((entry, buffer, decision.round))
    out: list[Instruction] = []
    reply = Reply(peer, header.seq) if header.op == Op.PUSH else None
    # dist_async: a push is answered once applied, so that whoever hears of the answer
    # (a barrier) sees it; dist_sync: once counted (its round may wait for others).
    # Payloads read in place stay the server's until it gives them back, answered or
    # not (the sender frees that memory then).
    lent = landing.lent if counted else None
    after_land = reply if counted and not sync else None
    if counted:
        landing.lent = None  # the task lets go of them
        inline = nbytes <= INLINE_MAX_BYTES
        out.append(
            Land(
                tuple(counted),
                tuple(merges),
                tuple(closing),
                inline,
                after_land,
                lent,
                tuple(decodes),
                compression,
                waited,
            )
        )
    if header.op == Op.PUSHPULL:
        if header.flags & COUNTED and peer.stream:  # resent too: a second is ignored
            out.append(Reply(peer, header.seq, counted=True))
    elif after_land is None:
        out.append(cast("Reply", reply))
    return out, entries, fresh.count(False)


def pull_ticket(peer: Peer, seq: int, entries: list[ServerEntry]) -> PullTicket:
    """The ticket of a pull of ``entries`` by ``peer``: it waits (``remaining``) for each
    key whose round with the worker's last push is not applied yet.

    Raises whatever a key's rounds refuse the pull with, before it waits anywhere.
    """
    worker = peer.worker
    after = [entry.rounds.last_push_round(worker) for entry in entries]
    for entry, after_round in zip(entries, after, strict=True):
        entry.rounds.check_pull(after_round)  # refuse before parking anywhere
    ticket = PullTicket(peer, seq, entries)
    for entry, after_round in zip(entries, after, strict=True):
        if not entry.rounds.pull(after_round, ticket):
            ticket.remaining += 1
    return ticket


def init_keys(
    peer: Peer,
    header: FrameHeader,
    landing: Landing,
    held: dict[Key, ServerEntry],
    name: str,
    make: tuple[VarFactory, bool, int],
    checkpoints: bool,
    regions: ValueRegions | None,
) -> list[Instruction]:
    """Make the keys of an init frame in ``held`` (``make``: the new var, whether rounds
    are ``dist_sync``, the number of workers); returns its answer: a
    :class:`~akv.cluster.server.instructions.Checkpoint` with ``checkpoints`` (the keys
    are answered for once one holds them), else a reply.

    Raises
    ------
    InvalidArgumentError
        The frame names a key twice or carries none.
    DuplicateInitError
        Another init made a key since the frame's header arrived (``name``: the server).
    """
    keys = [info.key for info in header.arrays]
    if any(key is None for key in keys) or len(set(keys)) != len(keys):
        raise InvalidArgumentError(
            f"init from worker {peer.worker} names a key twice or carries no key"
        )
    # Keys given a buffer were free when the header arrived; one held now was made by
    # another init since. (Keys without a buffer are this init's own, resent.)
    taken = [
        info.key
        for info, buffer in zip(header.arrays, landing.buffers, strict=True)
        if buffer is not None and info.key in held
    ]
    if taken:
        raise DuplicateInitError(f"init key {taken[0]!r}: {name} already holds it", key=taken[0])
    made_by = (peer.session, header.seq) if peer.session else ("", -1)
    new_var, sync, num_workers = make
    declared = declared_shapes(header.text)
    for info, buffer in zip(header.arrays, landing.buffers, strict=True):
        assert info.key is not None  # checked above
        if buffer is None:
            restored = held.get(info.key)
            if restored is not None and restored.declared is None:  # (an old checkpoint's)
                restored.declared = declared.get(info.key)
            continue
        entry = ServerEntry(
            info.key, buffer, new_var, sync, num_workers, made_by, declared.get(info.key)
        )
        # With checkpoints, a new key is answered for (to its init, and to the other
        # workers' init checks) once a checkpoint holds it: a worker never pushes to a
        # key that a restarted server would not have.
        entry.durable = not checkpoints
        entry.regions = regions
        held[info.key] = entry
    return [Checkpoint(peer, header.seq) if checkpoints else Reply(peer, header.seq)]
