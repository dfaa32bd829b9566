"""The status page's HTML: the job (from :func:`~akv.cluster.scheduler.status.job_status`)
and the login form.

Pure: dicts in, text out. Every value from the job (hosts, keys, the failure's reason) is
escaped; the pages hold no script (their answers forbid any, see
:data:`akv.cluster.scheduler.status_page.PAGE_HEADERS`) and reload themselves with a
``<meta http-equiv="refresh">``. Elements carry ``id`` and ``data-*`` attributes (the job's
state, each node's role, rank and state, the workers the round waits for) for tools and
tests that read the page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

__all__ = ["render_login", "render_status"]

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
table { border-collapse: collapse; } th, td { padding: .25em .7em; text-align: left; }
th { border-bottom: 2px solid #999; } td { border-bottom: 1px solid #ddd; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; } .running, .finished, .ended { color: #176117; }
.late, .restarting, .joined, .assembling, .stopping, .waiting { color: #9a5b00; }
.dead, .failed, .error { color: #b00020; } .not-joined { color: #777; }
.box { padding: .6em .9em; border-left: 4px solid #ccc; background: #f6f6f6; }
.box.failed { border-color: #b00020; } .box.waiting { border-color: #9a5b00; }
form.inline { display: inline; } .muted { color: #666; }
"""

#: The node table's columns: heading, the row's field, and how a value is written.
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("role", "role", "text"),
    ("rank", "rank", "number"),
    ("address", "address", "text"),
    ("pid", "pid", "number"),
    ("state", "state", "state"),
    ("last heartbeat", "heartbeat_age_s", "age"),
    ("restarts", "restarts", "number"),
    ("keys", "keys", "number"),
    ("bytes", "bytes", "bytes"),
    ("rounds", "rounds", "number"),
    ("pushes", "pushes", "number"),
    ("pulls", "pulls", "number"),
    ("behind", "behind", "number"),
    ("waits for", "waiting", "waiting"),
)


def render_status(view: Mapping[str, Any], refresh_s: int) -> str:
    """The job's page, reloading itself every ``refresh_s`` seconds."""
    job = view["job"]
    state = str(job["state"])
    workers, servers = int(job["workers"]), int(job["servers"])
    body = [
        f'<h1>akv job <span id="job-state" class="state {_css(state)}"'
        f' data-state="{_attr(state)}">{escape(state)}</span></h1>',
        f'<div class="muted">{_plural(workers, "worker")}, {_plural(servers, "server")};'
        f" {_plural(int(job['restarts']), 'server restart')}. This page reloads every"
        f' {refresh_s} s. <a href="/status.json">JSON</a>'
        ' <form class="inline" method="post" action="/logout">'
        '<button type="submit">Log out</button></form></div>',
        _round(view.get("round")),
        _failure(view.get("failure")),
        "<h2>Processes</h2>",
        _table(view["nodes"]),
    ]
    return _page(f"akv job: {state}", "\n".join(body), refresh_s)


def render_login(message: str | None = None) -> str:
    """The login form: it posts the job's token to ``/login``."""
    note = "" if message is None else f'<p id="login-error" class="error">{escape(message)}</p>'
    body = (
        "<h1>akv job status</h1>"
        f"{note}"
        '<form method="post" action="/login">'
        '<p><label for="token">The job\'s token (<code>AKV_TOKEN</code>)</label><br>'
        '<input id="token" name="token" type="password" autocomplete="current-password"'
        ' required autofocus size="40"></p>'
        '<p><button id="login" type="submit">Log in</button></p>'
        "</form>"
        '<p class="muted">The page keeps a session cookie, never the token.</p>'
    )
    return _page("akv job status: log in", body, None)


# ---------------------------------------------------------------------- parts


def _page(title: str, body: str, refresh_s: int | None) -> str:
    refresh = "" if refresh_s is None else f'<meta http-equiv="refresh" content="{refresh_s}">'
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{refresh}<title>{escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def _round(wait: Mapping[str, Any] | None) -> str:
    if wait is None:
        return (
            '<p id="round" class="box" data-waiting-for="">'
            "No round is waiting: every open round has all its pushes.</p>"
        )
    ranks = [int(rank) for rank in wait["waiting_for"]]
    whom = _workers(ranks) or "no worker (its pushes are in)"
    return (
        f'<p id="round" class="box waiting" data-waiting-for="{_attr(" ".join(map(str, ranks)))}">'
        f"The current round waits for <strong>{escape(whom)}</strong> for"
        f" {_seconds(wait['waiting_s'])} (round {int(wait['round'])} of key"
        f" <code>{escape(str(wait['key']))}</code> on server {int(wait['server'])}).</p>"
    )


def _failure(failure: Mapping[str, Any] | None) -> str:
    if failure is None:
        return ""
    who = failure.get("blamed")
    if who is None:
        blame = "no single process"
    elif who["rank"] is None:
        blame = str(who["role"])
    else:
        blame = f"{who['role']} {int(who['rank'])}"
    return (
        f'<div id="failure" class="box failed" data-blamed="{_attr(blame)}">'
        f"<strong>The job failed.</strong> It blames {escape(blame)}:"
        f"<pre>{escape(str(failure['reason']))}</pre></div>"
    )


def _table(nodes: Sequence[Mapping[str, Any]]) -> str:
    head = "".join(f"<th>{escape(heading)}</th>" for heading, _, _ in _COLUMNS)
    rows = []
    for node in nodes:
        rank = "" if node["rank"] is None else str(int(node["rank"]))
        cells = "".join(_cell(kind, node.get(field)) for _, field, kind in _COLUMNS)
        rows.append(
            f'<tr data-role="{_attr(str(node["role"]))}" data-rank="{rank}"'
            f' data-state="{_attr(str(node["state"]))}">{cells}</tr>'
        )
    return f'<table id="nodes"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _cell(kind: str, value: Any) -> str:
    if value is None:
        return '<td class="muted">-</td>'
    if kind == "number":
        return f'<td class="n">{int(value)}</td>'
    if kind == "bytes":
        return f'<td class="n" title="{int(value)} bytes">{_bytes(int(value))}</td>'
    if kind == "age":
        return f'<td class="n">{_seconds(value)} ago</td>'
    if kind == "state":
        return f'<td class="state {_css(str(value))}">{escape(str(value))}</td>'
    if kind == "waiting":
        workers = _workers([int(rank) for rank in value["workers"]]) or "no worker"
        return (
            f"<td>{escape(workers)} for {_seconds(value['waiting_s'])}"
            f" ({_plural(int(value['open']), 'open round')})</td>"
        )
    return f"<td>{escape(str(value))}</td>"


def _seconds(value: Any) -> str:
    return f"{float(value):.1f} s"


def _bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _workers(ranks: Sequence[int]) -> str:
    return ", ".join(f"worker {rank}" for rank in ranks)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _css(state: str) -> str:
    """A state as a CSS class (``not joined`` -> ``not-joined``)."""
    return _attr(state.replace(" ", "-"))


def _attr(text: str) -> str:
    return escape(text, quote=True)
