"""What akv's frames mean between a worker and a server (op codes, flags, status codes).

Every request frame carries a sequence number chosen by the worker; the server answers
each request with one ``REPLY`` frame of the same ``seq`` whose ``aux`` is a status code
(0 = done) and whose ``text`` holds the error message when it is not. Errors raised on a
server reach the worker as the same :mod:`akv.errors` class.

Ops (arrays carry the key; ``tag`` as noted):

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
"""

from __future__ import annotations

import json

from akv import errors

__all__ = ["OP_NAMES", "error_from_status", "status_of"]

INIT = 1
INIT_CHECK = 2
PUSH = 3
PULL = 4
PUSHPULL = 5
CLOSE = 6
SET_OPTIMIZER = 7
SAVE_STATES = 8
LOAD_STATES = 9
REPLY = 100
OP_NAMES = {
    INIT: "init",
    INIT_CHECK: "init_check",
    PUSH: "push",
    PULL: "pull",
    PUSHPULL: "pushpull",
    CLOSE: "close",
    SET_OPTIMIZER: "set_optimizer",
    SAVE_STATES: "save_states",
    LOAD_STATES: "load_states",
    REPLY: "reply",
}

OK = 0
_STATUS_CLASSES: dict[int, type[errors.AKVError]] = {
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
}
_CODES = {cls: code for code, cls in _STATUS_CLASSES.items()}
INTERNAL = 11

#: Header a worker sends when it opens a stream: ``"<rank> <store type>"``.
CLIENT_HEADER = "X-AKV-Client"


def status_of(exc: BaseException) -> int:
    """The status code for an exception raised while serving a request."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return INTERNAL


def error_from_status(status: int, text: str, server: str) -> errors.AKVError:
    """The error a worker raises for a non-zero status from ``server``."""
    cls = _STATUS_CLASSES.get(status, errors.ServerError)
    if cls is errors.ServerError:
        return errors.ServerError(f"{server}: {text}", server=server)
    return cls(f"{text} (on {server})")


def encode_meta(items: list[tuple[object, tuple[int, ...], str]]) -> str:
    """``INIT_CHECK``'s text: the keys with their (part) shapes and dtypes."""
    return json.dumps([[key, list(shape), dtype] for key, shape, dtype in items])


def decode_meta(text: str) -> list[tuple[int | str, tuple[int, ...], str]]:
    """The inverse of :func:`encode_meta`; raises ``InvalidArgumentError`` when malformed."""
    try:
        items = json.loads(text)
        return [(key, tuple(int(n) for n in shape), str(dtype)) for key, shape, dtype in items]
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgumentError(f"malformed init_check request: {exc}") from None
