"""What akv's frames mean between a worker and a server: ops, status codes, the client header.

Every request frame carries a sequence number chosen by the worker; the server answers
each request with one :attr:`Op.REPLY` frame of the same ``seq`` whose ``aux`` is a status
code (:data:`OK` = done) and whose ``text`` holds the error message when it is not. Errors
raised on a server reach the worker as the same :mod:`akv.errors` class
(:func:`status_of` and :func:`error_from_status` are inverses on every class listed in
:data:`STATUS_CLASSES`).

Ops (arrays carry the key):

* ``INIT``: rank 0's initial values (the server's part of each key).
* ``INIT_CHECK``: another worker's ``init``; ``text`` is JSON ``[[key, shape, dtype], ...]``;
  answered once rank 0's values arrived (or with an error when shapes or dtypes differ).
* ``PUSH``: values to merge into the key's open round (``dist_sync``) or apply at once.
* ``PULL``: zero-length arrays naming the keys and their dtypes; answered with the values,
  once the round of the worker's last push to each key is applied (``dist_sync``).
* ``PUSHPULL``: a push, then a pull, in one request.
* ``CLOSE``: the worker closed its store; a disconnect without it means the worker died.
* ``SET_OPTIMIZER``: ``text`` is the optimizer's JSON configuration (a name and its
  hyper-parameters; never a pickle). The same name again keeps the per-key states.
* ``SAVE_STATES``: ``text`` is JSON ``{"dump_optimizer": bool}``; answered with one uint8
  array, the server's states in akv's state format (see ``docs/optimizer.md``).
* ``LOAD_STATES``: one uint8 array in that format, for this server's keys.
* ``CHECKPOINT``: write a checkpoint now (a server with a checkpoint directory); answered
  once it is durable. A worker asks when the pushes it keeps for the server grow past
  ``AKV_RETAIN_BYTES``.
* ``ROW_INIT``: rank 0's initial rows of row-sparse keys, for this server's row range of
  each; ``text`` is :func:`encode_row_meta` (each key's declared shape, dtype and range),
  and each key has two arrays: its row ids (int64, sorted, unique, in the range) and their
  rows. Every server holds every row-sparse key (its range may be empty).
* ``ROW_PUSH``: row-sparse values, each key's ids and rows (the ids array carries the
  push number as its ``tag``); summed into the key's round like ``PUSH``'s values.
* ``ROW_PULL``: each key's requested row ids (sorted, unique, in the range); answered with
  one array of rows per key, in order, once the puller's last push to it is applied.
* ``DURABLE`` (server to worker, ``seq`` 0, never answered): every request of this worker
  numbered below ``aux`` is held by a checkpoint; the worker drops the pushes it kept.
  ``text`` is the :class:`Note` (:func:`format_note`): which server process wrote which
  checkpoint (the rounds it holds); the worker sends the last note it acted on back in the
  :data:`DURABLE_HEADER` when it opens a stream, so that a server restarted from an older
  checkpoint (or none) sees what it lost before it answers anything.

Exactly once: every push array's ``tag`` is the worker's push number for that key (1, 2,
...; 0 for a sender that does not number its pushes). A server counts a worker's push to a
key only when its number is above the last one it counted, so a request resent after a
reconnect, or to a server restored from a checkpoint, is answered without being applied
twice.

Adding an op: a member here, a branch in
:meth:`akv.cluster.server.state.ServerState.message_completed`, and the worker call that sends
it (``docs/architecture.md``). Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from akv import errors
from akv_transport import parse_json

__all__ = [
    "CLIENT_HEADER",
    "COUNTED",
    "DIST_STORE_TYPES",
    "DURABLE_HEADER",
    "JOB_FAILED_EXIT",
    "JOB_FAILED_STATUS",
    "LAUNCHER_REPORTER",
    "MAX_SERVER_ID_CHARS",
    "OK",
    "REFUSED_STATUS",
    "REPLAY_HEADER",
    "STALENESS_HEADER",
    "STATUS_CLASSES",
    "STOPPING_STATUS",
    "Note",
    "Op",
    "client_header",
    "decode_meta",
    "decode_row_meta",
    "encode_meta",
    "encode_row_meta",
    "error_from_status",
    "format_note",
    "op_label",
    "parse_client_header",
    "parse_note",
    "parse_replay",
    "parse_replay_barrier",
    "parse_staleness",
    "replay_barrier_text",
    "split_dtype",
    "status_of",
    "unsplit_dtype",
]


class Op(IntEnum):
    """A frame's ``op`` field."""

    INIT = 1
    INIT_CHECK = 2
    PUSH = 3
    PULL = 4
    PUSHPULL = 5
    CLOSE = 6
    SET_OPTIMIZER = 7
    SAVE_STATES = 8
    LOAD_STATES = 9
    CHECKPOINT = 10
    ROW_INIT = 11
    ROW_PUSH = 12
    ROW_PULL = 13
    REPLAY_BARRIER = 14
    REPLY = 100
    DURABLE = 101


def op_label(op: int) -> str:
    """The name of ``op`` as messages print it (``push``, ``init_check``), also for a number
    no :class:`Op` has (``op 77``)."""
    try:
        return Op(op).name.lower()
    except ValueError:
        return f"op {op}"


#: ``aux`` of a reply that carries no error.
OK: Final = 0
#: ``flags`` of a pushpull request that asks to hear once its push is counted too, and of
#: that interim answer (a reply without arrays; the request's own answer follows).
COUNTED: Final = 1
#: The status code of each error class a server sends back; anything else is INTERNAL.
STATUS_CLASSES: Final[dict[int, type[errors.AKVError]]] = {
    1: errors.KeyNotInitializedError,
    2: errors.ShapeMismatchError,
    3: errors.DTypeMismatchError,
    4: errors.DoublePushError,
    5: errors.RoundTimeoutError,
    6: errors.PeerLostError,
    7: errors.OptimizerError,
    8: errors.StateFormatError,
    9: errors.DuplicateInitError,
    10: errors.InvalidArgumentError,
    11: errors.ServerError,
    12: errors.WaitTimeoutError,
    13: errors.OptimizerNotSetError,
    14: errors.RowIdError,
    15: errors.StorageTypeError,
}
INTERNAL: Final = 11
_CODES: Final[dict[type[BaseException], int]] = {cls: code for code, cls in STATUS_CLASSES.items()}

#: The ``reporter`` of a ``/v1/lost`` report that akv-launch sends when it saw one of its
#: processes exit with a failure (a worker killed by a signal tells nobody itself).
LAUNCHER_REPORTER: Final = "akv-launch"
#: The scheduler's HTTP status when it refuses a request because the job failed.
JOB_FAILED_STATUS: Final = 409
#: The exit status of an akv-server that ends because the job failed (the scheduler's
#: verdict, its own refusal of a stale restore, a job that never assembled): a launcher
#: restarts no server that exits so, since a restart cannot mend the job. A crash exits
#: otherwise (1, a signal), and is restarted while restarts are left.
JOB_FAILED_EXIT: Final = 3
#: A server's HTTP status when it refuses a stream because it stops (a restart may come).
STOPPING_STATUS: Final = 503
#: Its status when a registration, heartbeat or barrier does not fit the job (a rank
#: already taken, an unknown node, a barrier out of turn).
REFUSED_STATUS: Final = 422

#: Header a worker sends when it opens a stream: ``"<rank> <store type> [<session>]"``.
#: The session (the worker's node id) tells a server that a new stream comes from the same
#: worker process as a cut one.
CLIENT_HEADER: Final = "X-AKV-Client"
#: Header a ``dist_async`` worker sends when it opens a stream with a staleness bound: the
#: most pushes of a key it may be ahead of the slowest worker (a whole number from 0).
STALENESS_HEADER: Final = "X-AKV-Staleness"
#: Header a ``dist_async`` worker sends when it opens a stream again and will send
#: requests again on it: how many barriers it had passed before the first of them (its
#: replay's barrier, see :data:`Op.REPLAY_BARRIER`), a whole number from 0.
REPLAY_HEADER: Final = "X-AKV-Replay"
#: The store types whose workers talk to servers.
DIST_STORE_TYPES: Final = ("dist_sync", "dist_async")


def status_of(exc: BaseException) -> int:
    """The status code for an exception raised while serving a request (its nearest listed
    class; :data:`INTERNAL` for anything else)."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return INTERNAL


def error_from_status(status: int, text: str, server: str) -> errors.AKVError:
    """The error a worker raises for a non-zero status from ``server`` (named in it)."""
    cls = STATUS_CLASSES.get(status, errors.ServerError)
    if cls is errors.ServerError:
        return errors.ServerError(f"{server}: {text}", server=server)
    return cls(f"{text} (on {server})")


def client_header(rank: int, store_type: str, session: str = "") -> str:
    """The :data:`CLIENT_HEADER` value of worker ``rank`` opening a ``store_type`` store
    (``session``: its node id; empty for a sender without one)."""
    return f"{rank} {store_type} {session}".rstrip()


def parse_client_header(text: str) -> tuple[int, str, str]:
    """The worker rank, store type and session (``""`` if none) in a
    :data:`CLIENT_HEADER` value.

    Raises
    ------
    InvalidArgumentError
        When it is not ``"<rank> <store type> [<session>]"`` with a known distributed
        store type and a session of at most 64 letters, digits, ``-`` or ``_``.
    """
    fields = text.split()
    try:
        if len(fields) not in (2, 3):
            raise ValueError
        rank = int(fields[0])
    except ValueError:
        raise errors.InvalidArgumentError(
            f"{CLIENT_HEADER} must be '<rank> <store type> [<session>]', got {text[:64]!r}"
        ) from None
    store_type = fields[1]
    session = fields[2] if len(fields) == 3 else ""
    if store_type not in DIST_STORE_TYPES:
        raise errors.InvalidArgumentError(f"unknown store type {store_type[:64]!r}")
    if session and (len(session) > 64 or not session.replace("-", "").replace("_", "").isalnum()):
        raise errors.InvalidArgumentError(f"malformed session id {session[:64]!r}")
    return rank, store_type, session


def parse_staleness(text: str | None) -> int | None:
    """The bound a :data:`STALENESS_HEADER` value gives (None: no header).

    Raises
    ------
    InvalidArgumentError
        Not a whole number from 0 (at most 18 digits).
    """
    return _whole_number(text, STALENESS_HEADER)


def parse_replay(text: str | None) -> int | None:
    """The barriers a :data:`REPLAY_HEADER` value says its worker had passed (None: no
    header, the worker sends nothing again).

    Raises
    ------
    InvalidArgumentError
        Not a whole number from 0 (at most 18 digits).
    """
    return _whole_number(text, REPLAY_HEADER)


def _whole_number(text: str | None, header: str) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or len(text) > 18:
        raise errors.InvalidArgumentError(
            f"{header} must be a whole number from 0, got {text[:32]!r}"
        )
    return int(text)


def replay_barrier_text(barriers: int, last: bool) -> str:
    """A ``REPLAY_BARRIER`` request's text: the barriers its worker had passed before the
    requests it sends again after it, and whether it ends the replay (``last``)."""
    return f"{barriers} last" if last else str(barriers)


def parse_replay_barrier(text: str) -> tuple[int, bool]:
    """What :func:`replay_barrier_text` made: ``(barriers, last)``.

    Raises
    ------
    InvalidArgumentError
        Anything else.
    """
    fields = text.split()
    if not 1 <= len(fields) <= 2 or (len(fields) == 2 and fields[1] != "last"):
        raise errors.InvalidArgumentError(
            f"a replay barrier's text must be '<barriers> [last]', got {text[:64]!r}"
        )
    barriers = _whole_number(fields[0], "a replay barrier's count")
    assert barriers is not None
    return barriers, len(fields) == 2


def split_dtype(dtype: object, declared: tuple[int, ...]) -> str:
    """How an init check names the dtype of a part of a key split over the servers: with
    the shape the key was declared with (a part's own shape is a flat slice, the same for
    every shape of as many elements)."""
    return f"{dtype} split of {tuple(declared)}"


def unsplit_dtype(dtype: str) -> str:
    """The dtype an init check's :func:`split_dtype` names (any other one as it is)."""
    return dtype.split(" split of ", 1)[0]


def encode_meta(items: list[tuple[int | str, tuple[int, ...], str]]) -> str:
    """``INIT_CHECK``'s text: the keys with their (part) shapes and dtypes; an ``INIT``'s:
    the keys split over the servers with their declared shapes and dtypes."""
    return json.dumps([[key, list(shape), dtype] for key, shape, dtype in items])


def decode_meta(text: str) -> list[tuple[int | str, tuple[int, ...], str]]:
    """The inverse of :func:`encode_meta`.

    Raises
    ------
    InvalidArgumentError
        When ``text`` is not a list of ``[key, shape, dtype]`` with int or str keys, or
        not strict JSON (:func:`akv_transport.parse_json`: no NaN, no overflowing number, no
        nesting past its depth), never with a traceback of its own.
    """
    try:
        items = parse_json(text)
        decoded = [(key, tuple(int(n) for n in shape), str(dtype)) for key, shape, dtype in items]
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgumentError(f"malformed init_check request: {exc}") from None
    for key, _, _ in decoded:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise errors.InvalidArgumentError(
                f"malformed init_check request: key {key!r} is not an int or a str"
            )
    return decoded


#: A row-sparse key as ``ROW_INIT`` declares it: key, declared shape, dtype name, and the
#: server's row range ``[first, end)``.
RowMeta = tuple[int | str, tuple[int, ...], str, int, int]


def encode_row_meta(items: list[RowMeta]) -> str:
    """``ROW_INIT``'s text: each key's declared shape, dtype and this server's row range."""
    return json.dumps(
        [[key, list(shape), dtype, first, end] for key, shape, dtype, first, end in items]
    )


def decode_row_meta(text: str) -> list[RowMeta]:
    """The inverse of :func:`encode_row_meta`.

    Raises
    ------
    InvalidArgumentError
        Not a list of ``[key, shape, dtype, first, end]`` with an int or str key, a shape of
        at least one dimension from 0, and ``0 <= first <= end <= shape[0]``; or not
        strict JSON.
    """
    try:
        decoded = [
            (key, tuple(int(n) for n in shape), str(dtype), int(first), int(end))
            for key, shape, dtype, first, end in parse_json(text)
        ]
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgumentError(f"malformed row_init request: {exc}") from None
    for key, shape, _, first, end in decoded:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise errors.InvalidArgumentError(
                f"malformed row_init request: key {key!r} is not an int or a str"
            )
        if not shape or min(shape) < 0 or not 0 <= first <= end <= shape[0]:
            raise errors.InvalidArgumentError(
                f"malformed row_init request: key {key!r}: shape {shape} and row range "
                f"[{first}, {end})"
            )
    return decoded


#: The header a worker sends its last ``DURABLE`` note back in when it opens a stream.
DURABLE_HEADER = "X-AKV-Durable"
#: The longest server process id a note may carry (a session id: letters and digits).
MAX_SERVER_ID_CHARS = 64


@dataclass(frozen=True, slots=True)
class Note:
    """One ``DURABLE`` note: checkpoint ``checkpoint`` (rounds up to ``rounds``) of server
    process ``server`` holds every request of the worker numbered below ``seq``."""

    server: str
    checkpoint: int
    rounds: int
    seq: int


def format_note(note: Note) -> str:
    """A note as ``DURABLE`` frames and the ``X-AKV-Durable`` header carry it."""
    return f"{note.server} {note.checkpoint} {note.rounds} {note.seq}"


def parse_note(text: str) -> Note:
    """The inverse of :func:`format_note`.

    Raises
    ------
    InvalidArgumentError
        Not ``"<server> <checkpoint> <rounds> <seq>"`` with a server id of letters, digits,
        ``-`` or ``_`` and three whole numbers from 0.
    """
    fields = text.split()
    try:
        if len(fields) != 4:
            raise ValueError
        server = fields[0]
        checkpoint, rounds, seq = (int(field) for field in fields[1:])
        if min(checkpoint, rounds, seq) < 0 or len(server) > MAX_SERVER_ID_CHARS:
            raise ValueError
        if not server.replace("-", "").replace("_", "").isalnum():
            raise ValueError
    except ValueError:
        raise errors.InvalidArgumentError(
            f"{DURABLE_HEADER} must be '<server> <checkpoint> <rounds> <seq>', got {text[:80]!r}"
        ) from None
    return Note(server, checkpoint, rounds, seq)
