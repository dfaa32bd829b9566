"""Health probes: ``GET /healthz`` and ``GET /readyz``, answered without the token.

* ``/healthz``: 200 with the body ``ok`` whenever the process answers at all (its loop
  runs). Nothing else is in it: anyone who reaches the port may ask.
* ``/readyz``: 200 ``ready`` once the process has joined its job, else 503 with one short
  line saying what it waits for (never an address, a key or a failure's text). What
  joined means for each role is decided by the functions below (no I/O):

  - the scheduler (:func:`scheduler_readiness`): as soon as it listens. The job's nodes
    join through it, so a probe that held it back until the job assembled would keep them
    from reaching it behind a Kubernetes Service (which sends traffic to ready pods
    only); whether the job assembled is in its metrics (``akv_job_assembled``).
  - a server (:func:`server_readiness`): once the scheduler gave it its rank (it is
    registered, and workers learn its address), until it stops.
  - a worker with ``AKV_METRICS_PORT`` (:func:`worker_readiness`): once its store has
    registered and opened its stream to every server, until the job fails (the listener
    closes with the store).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from akv_transport import public_route

__all__ = [
    "HEALTHZ_PATH",
    "READYZ_PATH",
    "Readiness",
    "health_routes",
    "scheduler_readiness",
    "server_readiness",
    "worker_readiness",
]

HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"

#: Says why the process is not ready (None: it is).
Readiness = Callable[[], str | None]


def scheduler_readiness() -> str | None:
    """A scheduler that answers is ready (see the module docstring)."""
    return None


def server_readiness(registered: bool, stopping: bool) -> str | None:
    """Why a server is not ready (``registered``: the scheduler gave it its rank;
    ``stopping``: it stops), or None."""
    if stopping:
        return "stopping"
    if not registered:
        return "not registered with the scheduler yet"
    return None


def worker_readiness(joined: bool, failed: bool) -> str | None:
    """Why a worker is not ready (``joined``: registered, with a stream to every server;
    ``failed``: its job failed), or None."""
    if failed:
        return "the job failed"
    if not joined:
        return "joining the job"
    return None


def health_routes(app: web.Application, readiness: Readiness) -> None:
    """Add ``/healthz`` and ``/readyz`` to ``app`` (made by :func:`akv_transport.create_app`),
    both without the token; ``readiness()`` decides ``/readyz``'s answer at each request."""

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        why = readiness()
        if why is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {why}\n")

    public_route(app, HEALTHZ_PATH, healthz)
    public_route(app, READYZ_PATH, readyz)
