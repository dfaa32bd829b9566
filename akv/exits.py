"""How a worker leaves a distributed store when its own code fails, or a signal stops it.

A worker that raises inside ``with akv.create("dist_sync") as kv:`` must not wait at the
exit barrier for a round the others can never finish: the store skips the barrier and tells
the scheduler that this worker failed and why (:func:`describe`), so every other process of
the job fails within seconds naming it. This module holds the pieces of that path that are
about the process rather than the store:

* :func:`describe`: the one-line reason sent to the scheduler (the exception's type and
  message, or the signal);
* :class:`Terminated` and :func:`sigterm_raises`: SIGTERM becomes an exception in the main
  thread (as Ctrl-C is ``KeyboardInterrupt``), so that ``with`` blocks and ``finally``
  clauses run and the store leaves the job as for any other failure;
* :func:`second_signal_exits`: while the store leaves after a failure, a second Ctrl-C or
  SIGTERM ends the process at once.

* :func:`close_at_exit`: a blocking store the program never closed is closed when the
  interpreter exits, as MXNet's KVStore is by its destructor: with the exit barrier after a
  normal end, or leaving as after a failure when an exception ended the program (recorded
  by a :func:`sys.excepthook` that chains to the one it replaced) or ``sys.exit`` with a
  failing status did (recorded by a ``sys.exit`` that calls the one it replaced: Python
  hands ``SystemExit`` to no hook, and an exit handler learns no exit status);
* :func:`off_loop`: a blocking call awaited from a store's close, which may run while the
  interpreter exits (where :func:`asyncio.to_thread` is refused).

Signal handlers are only ever installed from the main thread, and only over the default
handlers: a program that set its own keeps it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, NoReturn, Protocol, TypeVar

__all__ = [
    "MAX_REASON_CHARS",
    "NOTED_EXIT",
    "Closable",
    "Terminated",
    "close_at_exit",
    "close_open_stores",
    "closed",
    "describe",
    "off_loop",
    "second_signal_exits",
    "sigterm_raises",
]

T = TypeVar("T")

#: The longest reason a worker sends the scheduler (longer messages are cut, with "...").
MAX_REASON_CHARS = 500


class Terminated(SystemExit):
    """The process got SIGTERM while a distributed store was open (exit status 143).

    A :class:`SystemExit`: ``except Exception`` in user code does not catch it, and the
    interpreter exits with its code once it propagates."""

    def __init__(self, signo: int = signal.SIGTERM) -> None:
        super().__init__(128 + signo)
        self.signo = signo

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signo).name}"


def describe(exc: BaseException, raiser: str = "its code") -> str:
    """Why a worker leaves its store, in one line that follows "left the job: ": ``its
    code raised ValueError: boom``, ``it was interrupted (Ctrl-C)``, ``it was stopped by
    SIGTERM``, ``its code exited with status 4``, ``its task was cancelled``; at most
    :data:`MAX_REASON_CHARS`. ``raiser``: what raised an exception (``its close``)."""
    if isinstance(exc, KeyboardInterrupt):
        text = "it was interrupted (Ctrl-C)"
    elif isinstance(exc, Terminated):
        text = f"it was {exc}"
    elif isinstance(exc, SystemExit):
        text = f"its code exited with status {exc.code!r}"
    elif type(exc).__name__ == "CancelledError":
        text = "its task was cancelled (Ctrl-C under asyncio.run cancels the main task)"
    else:
        message = " ".join(str(exc).split())
        name = type(exc).__name__
        text = f"{raiser} raised {name}: {message}" if message else f"{raiser} raised {name}"
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 3] + "..."
    return text


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signo: int, frame: FrameType | None) -> None:
    exc = Terminated(signo)
    _AT_EXIT.uncaught = exc  # a SystemExit: sys.excepthook never sees it
    raise exc


class _SigtermHolder:
    """Counts the open stores that asked for :func:`sigterm_raises` (the handler stays
    while any is open)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.previous: Any = None


_HOLDER = _SigtermHolder()


def sigterm_raises() -> bool:
    """From now on, SIGTERM raises :class:`Terminated` in the main thread, unless the
    program installed a handler of its own (or this is not the main thread). Returns
    whether this call holds the handler; give it back with :func:`sigterm_released`."""
    if not _on_main_thread():
        return False
    with _HOLDER.lock:
        if _HOLDER.count == 0:
            current = signal.getsignal(signal.SIGTERM)
            if current is not signal.SIG_DFL:
                return False
            signal.signal(signal.SIGTERM, _raise_terminated)
            _HOLDER.previous = current
        _HOLDER.count += 1
        return True


def sigterm_released() -> None:
    """Give back what :func:`sigterm_raises` took (the last one restores the default)."""
    if not _on_main_thread():
        return
    with _HOLDER.lock:
        if _HOLDER.count == 0:
            return
        _HOLDER.count -= 1
        if _HOLDER.count == 0 and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, _HOLDER.previous)


def _exit_now(signo: int, frame: FrameType | None) -> None:
    os._exit(128 + signo)


@contextlib.contextmanager
def second_signal_exits() -> Iterator[bool]:
    """Within the block (a store leaving after a failure), Ctrl-C or SIGTERM ends the
    process at once with 128+N: the first signal, if any, already started the leaving.
    The previous handlers come back after it. Only on the main thread; elsewhere a no-op.
    Yields whether the handlers were installed."""
    if not _on_main_thread():
        yield False
        return
    previous = {signo: signal.getsignal(signo) for signo in (signal.SIGINT, signal.SIGTERM)}
    for signo in previous:
        signal.signal(signo, _exit_now)
    try:
        yield True
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler if handler is not None else signal.SIG_DFL)


class Closable(Protocol):
    """What :func:`close_at_exit` needs of a store."""

    def close(self) -> None: ...

    def _leave_failed(self, exc: BaseException) -> None: ...


class _AtExit:
    """The stores to close when the interpreter exits, and the exception that ended the
    program, if one did (seen by the chained :func:`sys.excepthook`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Held strongly: an open store runs a loop thread whether the program still holds
        #: it or not, and must be closed all the same.
        self.stores: set[Any] = set()
        self.installed = False
        self.uncaught: BaseException | None = None
        self.previous_hook = sys.excepthook
        self.previous_exit = sys.exit

    def install(self) -> None:
        with self.lock:
            if self.installed:
                return
            self.installed = True
            self.previous_hook = sys.excepthook
            sys.excepthook = self.excepthook
            self.previous_exit = sys.exit
            sys.exit = self.exit
            atexit.register(self.close_all)

    def exit(self, status: str | int | None = None) -> NoReturn:
        """``sys.exit``, noting a failing status given on the main thread: the stores left
        open at the interpreter's exit leave as after a failure then, naming it, instead of
        waiting at the exit barrier for workers that wait for this one. A status of 0 or
        None is a normal end. The note holds until a store is used again
        (:data:`NOTED_EXIT`): a program that caught the ``SystemExit`` (argparse in a
        ``try``, IPython) and went on to use its store did not end by it."""
        if status not in (None, 0) and _on_main_thread():
            NOTED_EXIT.exit = SystemExit(status)
        self.previous_exit(status)

    def excepthook(
        self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        self.uncaught = exc
        self.previous_hook(kind, exc, tb)

    def close_all(self) -> None:
        self.close(self.uncaught or NOTED_EXIT.exit)

    def close(self, failure: BaseException | None) -> None:
        for store in list(self.stores):
            with contextlib.suppress(Exception):  # the exit goes on: say nothing more
                if failure is not None:
                    store._leave_failed(failure)
                else:
                    store.close()


class _NotedExit:
    """The failing ``sys.exit`` last noted (:meth:`_AtExit.exit`), cleared by every store
    call (``NOTED_EXIT.exit = None``: one store of an attribute)."""

    __slots__ = ("exit",)

    def __init__(self) -> None:
        self.exit: SystemExit | None = None


#: See :class:`_NotedExit`.
NOTED_EXIT = _NotedExit()
_AT_EXIT = _AtExit()


def close_at_exit(store: Closable) -> None:
    """Close ``store`` when the interpreter exits, if the program has not by then (see the
    module docstring); a store forgets itself when closed (:func:`closed`)."""
    _AT_EXIT.install()
    _AT_EXIT.stores.add(store)


def close_open_stores(failure: BaseException | None) -> None:
    """Close every store still open, as at the interpreter's exit: leaving as after a
    failure when ``failure`` is given, else with the exit barrier. For a process that
    outlives the code that opened them (a Ray actor whose function returned or raised)."""
    _AT_EXIT.close(failure)


def closed(store: Closable) -> None:
    """``store`` was closed: nothing to do for it at exit."""
    _AT_EXIT.stores.discard(store)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own, awaited (its exception raised here).

    :func:`asyncio.to_thread` without the loop's default executor: once the interpreter has
    begun to exit, that executor takes no new work (``RuntimeError``), so a store closed by
    :func:`close_at_exit` would leave its threads running into the interpreter's
    finalization, where they may crash the process."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(result)
        else:
            done.set_exception(exc)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:
            result, exc = None, error
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="akv-off-loop", daemon=True).start()
    return await done
