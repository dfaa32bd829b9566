"""What akv-scheduler and akv-server share: flags, configuration, TLS, logging, the loop."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence

from akv.dist import config as _config
from akv.errors import ConfigError
from engine import new_event_loop
from transport import HttpClient, client_ssl_context, server_ssl_context

__all__ = [
    "client_ssl",
    "config_from_args",
    "role_parser",
    "run_role",
    "scheduler_client",
    "server_ssl",
    "setup_logging",
]


def client_ssl(config: _config.Config) -> ssl.SSLContext | None:
    """TLS for connecting to the job's servers and scheduler, or None without TLS."""
    if not config.tls:
        return None
    return client_ssl_context(config.tls_ca, config.tls_cert, config.tls_key)  # type: ignore[arg-type]


def server_ssl(config: _config.Config) -> ssl.SSLContext | None:
    """TLS for serving, when this process has a certificate and key."""
    if not (config.tls_cert and config.tls_key):
        return None
    return server_ssl_context(config.tls_cert, config.tls_key, config.tls_ca)


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


FLAG_TO_ENV = {
    "scheduler_host": "AKV_SCHEDULER_HOST",
    "scheduler_port": "AKV_SCHEDULER_PORT",
    "num_workers": "AKV_NUM_WORKERS",
    "num_servers": "AKV_NUM_SERVERS",
    "host": "AKV_HOST",
    "port": "AKV_PORT",
}


def role_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Flags shared by akv-scheduler and akv-server; each overrides its variable."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--scheduler-host", help="the scheduler's address (AKV_SCHEDULER_HOST)")
    parser.add_argument("--scheduler-port", type=int, help="its port (AKV_SCHEDULER_PORT)")
    parser.add_argument("--num-workers", type=int, help="workers in the job (AKV_NUM_WORKERS)")
    parser.add_argument("--num-servers", type=int, help="servers in the job (AKV_NUM_SERVERS)")
    parser.add_argument("--host", help="address a server binds and advertises (AKV_HOST)")
    parser.add_argument("--port", type=int, help="port a server listens on, 0: any (AKV_PORT)")
    parser.add_argument("--token-file", help="read AKV_TOKEN from this file")
    return parser


def config_from_args(
    role: str, args: argparse.Namespace, environ: dict[str, str] | None = None
) -> _config.Config:
    """The configuration from the environment with the flags laid over it."""
    env = dict(os.environ if environ is None else environ)
    for flag, name in FLAG_TO_ENV.items():
        value = getattr(args, flag, None)
        if value is not None:
            env[name] = str(value)
            mxnet = dict(_config.TWIN_VARIABLES).get(name)
            if mxnet:
                env.pop(mxnet, None)
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                env["AKV_TOKEN"] = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file!r}: {exc}") from None
    return _config.from_env(env, role=role)


def setup_logging(prefix: str) -> None:
    """Log lines on stderr, named by the process's role."""
    logging.basicConfig(
        level=os.environ.get("AKV_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {prefix} %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def run_role(
    role: str,
    argv: Sequence[str] | None,
    description: str,
    serve: Callable[[_config.Config], Awaitable[int]],
) -> int:
    """Parse flags, read the configuration, and run ``serve(config)`` on a new loop.

    Returns ``serve``'s exit status, or 2 (with a message naming the variable) when the
    configuration is wrong.
    """
    prog = f"akv-{role}"
    args = role_parser(prog, description).parse_args(argv)
    setup_logging(prog)
    try:
        config = config_from_args(role, args)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        return loop.run_until_complete(serve(config))
    finally:
        loop.close()
