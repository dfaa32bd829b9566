"""The ``akv`` command: ``akv --version``, ``akv bench {local,engine,dist,device,soak,
compression,sparse,fusion} [--quick] [--json PATH] [suite options]``.

A suite with options of its own (``sparse``) has an ``options_parser()``; the arguments the
``bench`` command does not know go to its ``run``. Any other suite refuses them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import akv
from akv.bench import configure
from akv.errors import AKVError

__all__ = ["main"]

BENCHMARKS = {
    "local": "akv.bench.local",
    "engine": "akv.bench.engine",
    "dist": "akv.bench.dist",
    "soak": "akv.bench.soak",
    "device": "akv.bench.device",
    "compression": "akv.bench.compression",
    "sparse": "akv.bench.sparse",
    "fusion": "akv.bench.fusion",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="akv", description="akv: an asyncio-native parameter server."
    )
    parser.add_argument("--version", action="version", version=f"akv {akv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = commands.add_parser(
        "bench", help="measure akv against a floor measured in the same run"
    )
    bench.add_argument("suite", choices=sorted(BENCHMARKS), help="what to measure")
    bench.add_argument("--quick", action="store_true", help="short rounds (a smoke run)")
    bench.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    bench.epilog = (
        "akv bench sparse takes options of its own: --servers N [N ...], --shm {on,off} "
        "[...], --steps N, --rows N, --memory N [N ...], --memory-stores {local,dist} [...] "
        "(akv bench sparse --help-sparse)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``akv`` command line; return the exit status.

    A suite that cannot run (an :class:`akv.AKVError`, such as ``akv bench device`` without
    CuPy or a GPU) prints ``akv bench: <message>`` to stderr, without a traceback, and
    returns 1.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 2
    module = importlib.import_module(BENCHMARKS[args.suite])
    options = getattr(module, "options_parser", None)
    if options is None and extra:
        parser.error(
            f"unrecognized arguments: {' '.join(extra)} (akv bench {args.suite} takes no "
            "options of its own)"
        )
    if options is not None and "--help-sparse" in extra:
        options().print_help()
        return 0
    configure(quick=args.quick)
    try:
        table = module.run(extra) if options is not None else module.run()
    except AKVError as exc:
        print(f"akv bench: {exc}", file=sys.stderr)
        return 1
    table.write(sys.stdout, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
