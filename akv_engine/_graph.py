"""The engine's pending graph as plain data, and its drawing in Graphviz DOT."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["to_dot"]

_STYLE = {
    "running": 'style="bold,filled" fillcolor="#c6e5ff"',
    "ready": 'style="filled" fillcolor="#fff3b0"',
    "waiting": 'style="dashed"',
}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(graph: Mapping[str, Sequence[str]], states: Mapping[str, str] | None = None) -> str:
    """Draw ``graph`` (task name -> names it waits on) as a DOT digraph.

    An edge ``a -> b`` means ``b`` waits on ``a``. ``states`` (task name -> state) styles
    the nodes: running bold, ready filled, waiting dashed.
    """
    states = states or {}
    lines = ["digraph engine {", "  rankdir=LR;", "  node [shape=box];"]
    for name in graph:
        state = states.get(name, "")
        label = _quote(name)[:-1] + (f"\\n{state}" if state else "") + '"'
        style = _STYLE.get(state, "")
        lines.append(f"  {_quote(name)} [label={label}{' ' + style if style else ''}];")
    for name, waits_on in graph.items():
        for blocker in waits_on:
            lines.append(f"  {_quote(blocker)} -> {_quote(name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
