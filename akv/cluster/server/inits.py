"""Other workers' inits waiting for rank 0's values (pure, no I/O).

In a distributed store only rank 0's init values are kept; every other worker's ``init``
sends an ``INIT_CHECK`` (its keys with their shapes and dtypes) that is answered once rank
0's values of all those keys are held (durably, on a server that writes checkpoints), with
an error when the shapes or dtypes differ, or when rank 0 does not come within the init
timeout. :class:`InitWaits` keeps those waits for :class:`~akv.cluster.server.state.ServerState`.
"""

from __future__ import annotations

from collections.abc import Mapping

from akv.args import Key
from akv.cluster.protocol import decode_meta, unsplit_dtype
from akv.cluster.server.instructions import (
    InitWait,
    Instruction,
    Peer,
    Reply,
    ReplyError,
    RowEntry,
    ServerEntry,
)
from akv.errors import (
    AKVError,
    InvalidArgumentError,
    PeerLostError,
    ShapeMismatchError,
    WaitTimeoutError,
)

__all__ = ["InitWaits", "check_init_agrees", "declared_shapes", "restored_key_differs"]

#: An init check's keys: (key, shape, dtype name; ``"<dtype> row_sparse"`` for a
#: row-sparse key).
Items = list[tuple[Key, tuple[int, ...], str]]
#: A key held: dense or row-sparse.
Held = ServerEntry | RowEntry


def restored_key_differs(
    key: Key, held: str, given: str, worker: int | None = None
) -> ShapeMismatchError:
    """The error of an init (by ``worker``, if named) that declares ``key`` as ``given``
    (shape and dtype, in words) where the server restored it from its checkpoint as
    ``held``: a new job on an old job's checkpoint directory, with another model."""
    who = "this job" if worker is None else f"worker {worker}"
    return ShapeMismatchError(
        f"init key {key!r}: the server restored it from its checkpoint as {held}, and "
        f"{who} declares {given}: a job started on a checkpoint directory resumes the keys "
        "saved there (start a job with another model on another --checkpoint-dir)",
        key=key,
    )


def check_init_agrees(
    peer: Peer, key: Key, shape: tuple[int, ...], dtype: str, entry: Held
) -> None:
    """Raise :class:`~akv.errors.ShapeMismatchError` when worker ``peer``'s init of ``key``
    differs from rank 0's (held in ``entry``), or from what the server restored."""
    if entry.shape == shape and entry.init_dtype == dtype:
        return
    # Restored from a checkpoint that kept no declared shapes (and rank 0's init has not
    # told one yet): the dtype is all there is to compare.
    unknown = isinstance(entry, ServerEntry) and entry.made_by is None and entry.declared is None
    if unknown and entry.shape == shape and unsplit_dtype(dtype) == entry.init_dtype:
        return
    if entry.made_by is None:
        raise restored_key_differs(
            key, f"{entry.shape} {entry.init_dtype}", f"{shape} {dtype}", peer.worker
        )
    raise ShapeMismatchError(
        f"init key {key!r} on worker {peer.worker}: shape {shape} and dtype {dtype} "
        f"differ from worker 0's {entry.shape} {entry.init_dtype}",
        key=key,
    )


class InitWaits:
    """The init checks waiting for rank 0's values (``timeout_s``: how long each may)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waits: list[InitWait] = []

    def __len__(self) -> int:
        return len(self.waits)

    def add(
        self, peer: Peer, seq: int, items: Items, now: float, entries: Mapping[Key, Held]
    ) -> list[Instruction]:
        """Worker ``peer``'s init check ``seq`` of ``items`` arrived: refused at once when a
        key it names is held with another shape or dtype, else kept until rank 0's values
        are; returns the answers due now."""
        for key, shape, dtype in items:
            entry = entries.get(key)
            if entry is not None:
                check_init_agrees(peer, key, shape, dtype, entry)
        self.waits.append(InitWait(peer, seq, items, now + self.timeout_s))
        return self.release(entries)

    def release(self, entries: Mapping[Key, Held]) -> list[Instruction]:
        """Answer the checks whose keys are all held durably (an error where they differ)."""
        out: list[Instruction] = []
        still = []
        for wait in self.waits:
            if not all(key in entries and entries[key].durable for key, _, _ in wait.items):
                still.append(wait)
                continue
            try:
                for key, shape, dtype in wait.items:
                    check_init_agrees(wait.peer, key, shape, dtype, entries[key])
            except AKVError as exc:
                out.append(ReplyError(wait.peer, wait.seq, exc))
            else:
                out.append(Reply(wait.peer, wait.seq))
        self.waits = still
        return out

    def overdue(self, now: float, entries: Mapping[Key, Held]) -> list[Instruction]:
        """Fail the checks that waited past their deadline, naming the keys rank 0 never
        initialized."""
        out: list[Instruction] = []
        still = []
        for wait in self.waits:
            if now <= wait.deadline:
                still.append(wait)
                continue
            missing = [k for k, _, _ in wait.items if k not in entries]
            error = WaitTimeoutError(
                f"keys {missing} were not initialized by worker 0 within {self.timeout_s:g} s"
            )
            out.append(ReplyError(wait.peer, wait.seq, error))
        self.waits = still
        return out

    def fail_all(self, error: PeerLostError) -> list[Instruction]:
        """Fail every waiting check with ``error`` (the job failed)."""
        out: list[Instruction] = [ReplyError(w.peer, w.seq, error) for w in self.waits]
        self.waits = []
        return out

    def validate(self, entries: Mapping[Key, Held]) -> None:
        """No wait is left whose keys are all held (it would have been released)."""
        for wait in self.waits:
            assert not all(k in entries and entries[k].durable for k, _, _ in wait.items), (
                "init wait not released"
            )


def declared_shapes(text: str) -> dict[Key, tuple[int, ...]]:
    """The declared shapes an ``INIT``'s text names, of the keys split over the servers
    (none: no text).

    Raises
    ------
    InvalidArgumentError
        A malformed text (:func:`~akv.cluster.protocol.decode_meta`).
    """
    declared = {key: shape for key, shape, _ in decode_meta(text)} if text else {}
    for key, shape in declared.items():
        if any(size < 0 for size in shape):
            raise InvalidArgumentError(f"init key {key!r} declares the shape {shape}")
    return declared
