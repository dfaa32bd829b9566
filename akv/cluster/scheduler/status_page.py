"""The scheduler's status page over HTTP: ``/status``, ``/status.json``, ``/login``, ``/logout``.

What the page shows is decided in :mod:`akv.cluster.scheduler.status` and written in
:mod:`akv.cluster.scheduler.status_html`; logins are :class:`~akv.cluster.scheduler.sessions.
Sessions`. This module only routes requests and checks who may see the page:

* a request with an ``Authorization`` header is judged by the job's token check of every
  route (:func:`akv_transport.create_app`'s, constant-time): the page, or 401;
* else a request with the cookie of a login (:data:`COOKIE`: a random session id, never
  the token; ``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the job uses TLS) gets the
  page;
* else ``/status`` redirects to ``/login`` (303) and ``/status.json`` answers 401.

``/login`` shows a form that posts the token; the right one (compared in constant time)
opens a session and redirects to ``/status``. ``/logout`` (POST) ends it.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from akv.cluster.scheduler.sessions import SESSION_S, Sessions
from akv.cluster.scheduler.status_html import render_login, render_status

__all__ = [
    "COOKIE",
    "LOGIN_PATH",
    "LOGOUT_PATH",
    "MAX_LOGIN_BYTES",
    "PAGE_HEADERS",
    "REFRESH_S",
    "STATUS_JSON_PATH",
    "STATUS_PATH",
    "StatusPage",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATUS_PATH = "/status"
STATUS_JSON_PATH = "/status.json"
LOGIN_PATH = "/login"
LOGOUT_PATH = "/logout"
#: The login's cookie: a session id.
COOKIE = "akv_session"
#: How often the page reloads itself (seconds).
REFRESH_S = 2
#: A login form's body is refused (413) past this many bytes.
MAX_LOGIN_BYTES = 4096
#: ... and past this many fields (400).
MAX_LOGIN_FIELDS = 8
#: Sent with every answer of these routes: nothing cached, no script runs, no other site
#: frames the page or learns where it was.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class StatusPage:
    """The page's routes and their access check, for one scheduler.

    ``view()`` is the job now (:func:`~akv.cluster.scheduler.status.job_status`);
    ``secure``: the job uses TLS, so the cookie is sent over TLS only.
    """

    def __init__(
        self, token: str, view: Callable[[], dict[str, Any]], *, secure: bool = False
    ) -> None:
        self._token = token.encode("utf-8", "surrogateescape")
        self._view = view
        self._secure = secure
        self.sessions = Sessions()

    def install(self, app: web.Application) -> None:
        """Add the routes to ``app`` (made by :func:`akv_transport.create_app`) and put the
        access check before its token check."""
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(STATUS_JSON_PATH, self._status_json)
        app.router.add_get(LOGIN_PATH, self._login_form)
        app.router.add_post(LOGIN_PATH, self._login)
        app.router.add_post(LOGOUT_PATH, self._logout)
        app.middlewares.insert(0, self._access)

    @web.middleware
    async def _access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path not in (STATUS_PATH, STATUS_JSON_PATH, LOGIN_PATH, LOGOUT_PATH):
            return await handler(request)
        if "Authorization" in request.headers:
            answer = await handler(request)  # the job's token check, then the route
        elif path in (LOGIN_PATH, LOGOUT_PATH) or self._logged_in(request):
            route: Handler = request.match_info.handler
            answer = await route(request)
        elif path == STATUS_PATH:
            answer = web.Response(status=303, headers={"Location": LOGIN_PATH})
        else:
            error = f"log in at {LOGIN_PATH}, or send the job's token as a Bearer header"
            answer = web.json_response({"error": error}, status=401)
        answer.headers.update(PAGE_HEADERS)
        return answer

    # ------------------------------------------------------------ routes

    async def _status(self, request: web.Request) -> web.StreamResponse:
        page = render_status(self._view(), REFRESH_S)
        return web.Response(text=page, content_type="text/html")

    async def _status_json(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self._view(), dumps=_dumps)

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        if self._logged_in(request):
            return web.Response(status=303, headers={"Location": STATUS_PATH})
        return web.Response(text=render_login(), content_type="text/html")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        length = request.content_length
        if length is None or length > MAX_LOGIN_BYTES:  # a form's length is known
            return web.Response(status=413, text=f"a login is at most {MAX_LOGIN_BYTES} bytes")
        body = await request.read()
        try:
            fields = parse_qs(body.decode("ascii", "replace"), max_num_fields=MAX_LOGIN_FIELDS)
        except ValueError:
            return web.Response(status=400, text="a login form has one field: token")
        given = (fields.get("token") or [""])[0].encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._token):
            page = render_login("That is not this job's token.")
            return web.Response(status=401, text=page, content_type="text/html")
        session = self.sessions.open(time.monotonic())
        answer = web.Response(status=303, headers={"Location": STATUS_PATH})
        self._set_cookie(answer, session, SESSION_S)
        return answer

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        session = request.cookies.get(COOKIE)
        if session is not None:
            self.sessions.close(session)
        answer = web.Response(status=303, headers={"Location": LOGIN_PATH})
        self._set_cookie(answer, "", 0)
        return answer

    def _set_cookie(self, answer: web.Response, value: str, max_age: int) -> None:
        answer.set_cookie(
            COOKIE,
            value,
            max_age=max_age,
            path="/",
            secure=self._secure,
            httponly=True,
            samesite="Strict",
        )

    def _logged_in(self, request: web.Request) -> bool:
        session = request.cookies.get(COOKIE)
        return session is not None and self.sessions.valid(session, time.monotonic())


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False)
