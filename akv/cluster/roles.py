"""What akv-scheduler and akv-server share: flags, configuration, TLS, logging, the loop.

Each role takes only its own flags (:data:`ROLE_FLAGS`); a flag overrides its variable. A
flag of the other role is refused with a message that names the right one, and a
configuration error names the flag that would fix it. Both commands exit 2, with one line
on stderr and no traceback, when the configuration is wrong.

Workers are the user's own programs: :func:`default_worker_logging` lets akv's log lines
reach stderr there without touching a logging configuration the program made itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from aiohttp import web

from akv.cluster import config as _config
from akv.errors import ConfigError
from akv_engine import new_event_loop
from akv_transport import HttpClient, client_ssl_context, serve, server_ssl_context

__all__ = [
    "ROLE_FLAGS",
    "Flag",
    "client_ssl",
    "config_from_args",
    "default_worker_logging",
    "flag_hint",
    "listen",
    "listener_bounds",
    "role_parser",
    "run_role",
    "scheduler_client",
    "serve_role",
    "server_ssl",
    "setup_logging",
]

#: The exit status of akv-scheduler and akv-server when the configuration is wrong.
CONFIG_ERROR_EXIT = 2


def client_ssl(config: _config.Config) -> ssl.SSLContext | None:
    """TLS for connecting to the job's servers and scheduler, or None without TLS."""
    if not config.tls:
        return None
    if config.tls_ca is None:  # a Config made without from_env
        raise ConfigError(
            "AKV_TLS_CERT is set but AKV_TLS_CA is not: set AKV_TLS_CA to the CA bundle "
            "that signed the job's certificates"
        )
    with _tls_files(config):
        return client_ssl_context(config.tls_ca, config.tls_cert, config.tls_key)


def server_ssl(config: _config.Config) -> ssl.SSLContext | None:
    """TLS for serving, when this process has a certificate and key."""
    if not (config.tls_cert and config.tls_key):
        return None
    with _tls_files(config):
        return server_ssl_context(config.tls_cert, config.tls_key, config.tls_ca)


@contextlib.contextmanager
def _tls_files(config: _config.Config) -> Iterator[None]:
    """A TLS file that cannot be read or used is a :class:`ConfigError` naming the files."""
    try:
        yield
    except (OSError, ssl.SSLError) as exc:
        files = f"AKV_TLS_CERT={config.tls_cert!r}, AKV_TLS_KEY={config.tls_key!r}, "
        files += f"AKV_TLS_CA={config.tls_ca!r}"
        raise ConfigError(f"TLS ({files}): {exc}") from exc


def listener_bounds(config: _config.Config) -> dict[str, Any]:
    """What one peer may hold of this process's listener: :func:`akv_transport.serve`'s bounds,
    as configured (``AKV_IDLE_TIMEOUT_S``, ``AKV_MAX_CONNECTIONS_PER_PEER``,
    ``AKV_MAX_STRANGERS_PER_PEER``, ``AKV_MAX_STRANGERS``)."""
    return {
        "idle_timeout_s": config.timeouts.idle_s,
        "max_connections_per_peer": config.max_connections_per_peer,
        "max_strangers_per_peer": config.max_strangers_per_peer,
        "max_strangers": config.max_strangers,
    }


async def listen(
    app: web.Application,
    config: _config.Config,
    host: str,
    port: int,
    *,
    setting: str,
    advice: str,
    sock: socket.socket | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (or the inherited ``sock``) with this process's TLS and
    :func:`listener_bounds`; return its runner and the bound port.

    Raises
    ------
    ConfigError
        The address cannot be bound (the port taken by another process, or the host not
        this machine's), naming ``setting``, the address and the system's reason, then
        ``advice``.
    """
    context = server_ssl(config)  # (its own errors name the TLS files, not the port)
    try:
        bounds = listener_bounds(config)
        return await serve(app, host, port, ssl_context=context, sock=sock, **bounds)
    except OSError as exc:
        # The system's words: the loop's own strerror repeats the address.
        errno = None if isinstance(exc, socket.gaierror) else exc.errno  # (the resolver's)
        reason = os.strerror(errno) if errno else (exc.strerror or str(exc))
        raise ConfigError(
            f"{setting}={port}: cannot listen on {_config.format_address(host, port)}: "
            f"{reason}; {advice}"
        ) from exc


def scheduler_client(
    config: _config.Config, timeout_s: float, retries: int | None = None
) -> HttpClient:
    """An HTTP client for the job's scheduler (the token and TLS set up)."""
    options = {} if retries is None else {"retries": retries}
    return HttpClient(
        config.scheduler_url,
        config.token,
        ssl_context=client_ssl(config),
        timeout_s=timeout_s,
        **options,
    )


# ---------------------------------------------------------------------- flags


def _tcp_port(text: str) -> int:
    port = _number(text, "a TCP port")
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give 1-65535")
    return port


def _tcp_port_or_any(text: str) -> int:
    port = _number(text, "a TCP port")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give 1-65535, or 0 for any")
    return port


def _count(text: str) -> int:
    count = _number(text, "a number")
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count} is too few: give at least 1")
    return count


def _number(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


@dataclass(frozen=True)
class Flag:
    """A command-line flag that overrides the variable ``variable`` (akv's name)."""

    option: str
    variable: str
    help: str
    type: Callable[[str], Any] = str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def variables(self) -> tuple[str, ...]:
        """The variable and its MXNet twin, if it has one."""
        twin = dict(_config.TWIN_VARIABLES).get(self.variable)
        return (self.variable, twin) if twin else (self.variable,)


def _log_level(text: str) -> str:
    try:
        _config.parse_log_level(text, "--log-level")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


_LOG_LEVEL = Flag(
    "--log-level",
    "AKV_LOG_LEVEL",
    "DEBUG, INFO (the default), WARNING, ERROR or CRITICAL, any case (AKV_LOG_LEVEL)",
    _log_level,
)

_NUM_WORKERS = Flag(
    "--num-workers", "AKV_NUM_WORKERS", "workers in the job (AKV_NUM_WORKERS)", _count
)
_NUM_SERVERS = Flag(
    "--num-servers", "AKV_NUM_SERVERS", "servers in the job (AKV_NUM_SERVERS)", _count
)

#: Each role's flags. The scheduler listens on --scheduler-host/--scheduler-port; a server
#: connects there, binds --host/--port itself, and tells the scheduler --advertise (default:
#: the bound address) for the workers.
ROLE_FLAGS: dict[str, tuple[Flag, ...]] = {
    "scheduler": (
        Flag(
            "--scheduler-host",
            "AKV_SCHEDULER_HOST",
            "the address to listen on, which every node reaches (AKV_SCHEDULER_HOST)",
        ),
        Flag(
            "--scheduler-port",
            "AKV_SCHEDULER_PORT",
            "the port to listen on (AKV_SCHEDULER_PORT)",
            _tcp_port,
        ),
        _NUM_WORKERS,
        _NUM_SERVERS,
        _LOG_LEVEL,
    ),
    "server": (
        Flag(
            "--scheduler-host",
            "AKV_SCHEDULER_HOST",
            "the scheduler's address (AKV_SCHEDULER_HOST)",
        ),
        Flag("--scheduler-port", "AKV_SCHEDULER_PORT", "its port (AKV_SCHEDULER_PORT)", _tcp_port),
        _NUM_WORKERS,
        _NUM_SERVERS,
        Flag(
            "--host",
            "AKV_HOST",
            "the address this server binds, and advertises unless --advertise says otherwise "
            "(AKV_HOST)",
        ),
        Flag(
            "--port",
            "AKV_PORT",
            "the port this server listens on, 0: any free port (AKV_PORT)",
            _tcp_port_or_any,
        ),
        Flag(
            "--advertise",
            "AKV_ADVERTISE",
            "the address the scheduler gives workers for this server, when it is not the "
            "bound one (NAT, a published container port, a proxy): HOST, HOST:PORT or "
            "[IPv6]:PORT; a HOST alone keeps the bound port (AKV_ADVERTISE)",
        ),
        Flag(
            "--checkpoint-dir",
            "AKV_CHECKPOINT_DIR",
            "write checkpoints (values, optimizer states, rounds) to server-<rank>.akvckpt "
            "in this directory, and restore from it at start: a restarted server with the "
            "same rank and directory rejoins the job (AKV_CHECKPOINT_DIR; needs AKV_RANK)",
        ),
        Flag(
            "--checkpoint-interval-s",
            "AKV_CHECKPOINT_INTERVAL_S",
            "seconds between checkpoints (AKV_CHECKPOINT_INTERVAL_S, default 30)",
        ),
        _LOG_LEVEL,
    ),
}

#: Flags a role does not take, and what to use instead.
_NOT_FOR_ROLE: dict[str, dict[str, str]] = {
    "scheduler": {
        "--port": "the scheduler listens on --scheduler-port (AKV_SCHEDULER_PORT / "
        "DMLC_PS_ROOT_PORT)",
        "--host": "the scheduler listens on --scheduler-host (AKV_SCHEDULER_HOST / "
        "DMLC_PS_ROOT_URI)",
        "--advertise": "the scheduler advertises no address: every node reaches it at its "
        "own --scheduler-host and --scheduler-port (AKV_SCHEDULER_HOST / DMLC_PS_ROOT_URI, "
        "AKV_SCHEDULER_PORT / DMLC_PS_ROOT_PORT), which may differ from the address the "
        "scheduler listens on",
    },
}


class _Refuse(argparse.Action):
    """A flag of another role: refuse it, saying what to use instead (``const``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> NoReturn:
        parser.error(f"{parser.prog} has no {option_string}: {self.const}")


def role_parser(role: str, description: str) -> argparse.ArgumentParser:
    """The flags of ``akv-<role>`` (``role``: ``"scheduler"`` or ``"server"``).

    Each flag overrides its variable (see :data:`ROLE_FLAGS`); ``--token-file`` reads
    ``AKV_TOKEN`` from a file; ``--version`` prints ``akv-ROLE VERSION`` and exits 0. A
    flag that belongs to the other role is an error that names the right one.
    """
    if role not in ROLE_FLAGS:
        raise ValueError(f"no command-line role {role!r}: {', '.join(ROLE_FLAGS)}")
    # Python loads the package akv before this module of it; importing akv here would make
    # a cycle (akv.factory imports this module).
    version = sys.modules["akv"].__version__
    parser = argparse.ArgumentParser(prog=f"akv-{role}", description=description)
    parser.add_argument("--version", action="version", version=f"akv-{role} {version}")
    for flag in ROLE_FLAGS[role]:
        parser.add_argument(flag.option, dest=flag.dest, type=flag.type, help=flag.help)
    parser.add_argument("--token-file", help="read AKV_TOKEN from this file")
    for option, instead in _NOT_FOR_ROLE.get(role, {}).items():
        parser.add_argument(
            option, action=_Refuse, nargs="?", const=instead, help=argparse.SUPPRESS
        )
    return parser


def config_from_args(
    role: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> _config.Config:
    """The configuration from the environment with ``role``'s flags laid over it.

    A :class:`ConfigError` about a variable that one of the role's flags sets also names
    that flag.
    """
    env = dict(os.environ if environ is None else environ)
    flags = ROLE_FLAGS[role]
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is not None:
            for name in flag.variables:
                env.pop(name, None)
            env[flag.variable] = str(value)
    token_file = getattr(args, "token_file", None)
    if token_file:
        try:
            with open(token_file) as handle:
                env["AKV_TOKEN"] = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {token_file!r}: {exc}") from None
    try:
        return _config.from_env(env, role=role)
    except ConfigError as exc:
        hint = flag_hint(str(exc), flags)
        if hint is None:
            raise
        raise ConfigError(hint) from exc


def flag_hint(message: str, flags: Sequence[Flag]) -> str | None:
    """``message`` with the flag that sets the variable it names (first named wins), or
    None when it names none of ``flags``' variables."""
    best: tuple[int, Flag] | None = None
    for flag in flags:
        for name in flag.variables:
            at = _find_variable(message, name)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, flag)
    if best is None:
        return None
    return f"{message}; or pass {best[1].option}"


def _find_variable(message: str, name: str) -> int:
    """Where ``name`` occurs in ``message`` as a whole word (AKV_HOST is not in
    AKV_SCHEDULER_HOST), or -1."""
    found = re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message)
    return -1 if found is None else found.start()


# ---------------------------------------------------------------------- logging

#: The ``akv`` logger: every module's logger is below it.
AKV_LOGGER = "akv"


def setup_logging(prefix: str, level: int = logging.INFO) -> None:
    """Log lines on stderr, named by the process's role (a scheduler's or server's own
    process: it configures the root logger, unless something did already)."""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {prefix} %(levelname)s %(message)s",
        stream=sys.stderr,
    )


if TYPE_CHECKING:
    _StderrHandler = logging.StreamHandler[TextIO]
else:  # subscriptable at run time only from Python 3.11 on
    _StderrHandler = logging.StreamHandler


class _UntilConfigured(_StderrHandler):
    """Writes the ``akv`` logger's records to stderr while the program has configured no
    logging of its own; once the root logger has a handler it steps aside, and gives back
    the ``akv`` logger's level if it set it (``level_set``), so that records are neither
    written twice nor let through below the level the program chose."""

    def __init__(self, level_set: int | None) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(asctime)s akv %(levelname)s %(message)s"))
        self.level_set = level_set

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            logger = logging.getLogger(AKV_LOGGER)
            if self.level_set is not None and logger.level == self.level_set:
                logger.setLevel(logging.NOTSET)
            self.level_set = None
            return
        super().emit(record)


def default_worker_logging(level: int = logging.INFO) -> bool:
    """Let akv's log lines (``level`` and above) reach stderr in a worker, a program that
    may not have configured logging.

    Call it when a worker joins a job. When the root logger has no handler (the program
    configured nothing) and the ``akv`` logger neither, this adds a handler to the
    ``akv`` logger and sets its level, so that "worker waiting: ..." lines are seen. It
    never touches the root logger or another library's. If the program configures
    logging later, the handler steps aside at the next akv record and hands the level
    back: akv's records then go where the program says, at its level (that one record
    still passes at ``level``). Idempotent. Returns True when it added the handler.
    """
    logger = logging.getLogger(AKV_LOGGER)
    if logging.getLogger().handlers or logger.handlers:
        return False
    # A level the program gave the akv logger itself is the program's: keep it.
    owns_level = logger.level == logging.NOTSET
    logger.addHandler(_UntilConfigured(level if owns_level else None))
    if owns_level:
        logger.setLevel(level)
    return True


# ---------------------------------------------------------------------- the process


def run_role(
    role: str,
    argv: Sequence[str] | None,
    description: str,
    serve: Callable[[_config.Config], Awaitable[int]],
) -> int:
    """Parse ``role``'s flags, read the configuration, and run ``serve(config)`` on a new
    loop.

    Returns ``serve``'s exit status, or 2 (with one line on stderr naming the variable and
    the flag) when the configuration is wrong; a wrong flag exits 2 through argparse.
    """
    prog = f"akv-{role}"
    args = role_parser(role, description).parse_args(argv)
    try:
        config = config_from_args(role, args)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return serve_role(role, config, serve)


#: The message of the cancellation :func:`serve_role` makes on SIGTERM or Ctrl-C; a role's
#: ``run`` tells it apart from other cancellations with :func:`stopped_by_signal`.
SIGNAL_STOP = "akv: stopped by a signal"


def stopped_by_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is the cancellation of a SIGTERM or Ctrl-C (see :func:`serve_role`)."""
    return isinstance(exc, asyncio.CancelledError) and exc.args == (SIGNAL_STOP,)


def serve_role(
    role: str, config: _config.Config, serve: Callable[[_config.Config], Awaitable[int]]
) -> int:
    """Run ``serve(config)`` on a new event loop with ``role``'s logging set up; return its
    exit status, or :data:`CONFIG_ERROR_EXIT` (with one line on stderr) when it cannot start
    as configured (a port it cannot listen on). (:func:`run_role` after the flags; also what
    ``akv.create`` runs in a process whose role is server or scheduler.)"""
    setup_logging(f"akv-{role}", config.log_level)
    loop = new_event_loop()
    task = asyncio.ensure_future(serve(config), loop=loop)
    received: list[int] = []

    def on_signal(signo: int) -> None:
        # The first SIGTERM or Ctrl-C stops the role gracefully (it tells the job why and
        # finishes what it can within its deadline); a second one ends it at once.
        if received:
            os._exit(128 + signo)
        received.append(signo)
        logging.getLogger("akv").warning(
            "akv-%s got %s: stopping", role, signal.Signals(signo).name
        )
        task.cancel(SIGNAL_STOP)

    handled = []
    if threading.current_thread() is threading.main_thread():
        for signo in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signo, on_signal, signo)
            handled.append(signo)
    status: int | None = None
    try:
        status = loop.run_until_complete(task)
        return status
    except ConfigError as exc:  # found as it starts: a port it cannot listen on
        print(f"akv-{role}: {exc}", file=sys.stderr)
        status = CONFIG_ERROR_EXIT
        return status
    except asyncio.CancelledError:
        if not received:
            raise
        return 128 + received[0]
    finally:
        for signo in handled:
            loop.remove_signal_handler(signo)
            if status is not None:
                # The role ended and its process exits: a signal from now on (a job torn
                # down as it ends) is ignored, so that the process exits with the role's
                # status, not killed by it. (Python's exit resets a signal handled by a
                # function to the default, which kills: a CI run saw that; it keeps an
                # ignored one ignored.)
                signal.signal(signo, signal.SIG_IGN)
        loop.close()
