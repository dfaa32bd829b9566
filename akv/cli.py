"""The ``akv`` command: ``akv --version``, ``akv [--log-level LEVEL] bench {local,engine,
dist,device,soak,compression,sparse,fusion} [--quick] [--json PATH] [suite options]``;
``akv --help`` says what each does, and names the job's other commands.

A suite with options of its own (``sparse``) has an ``options_parser()``; the arguments the
``bench`` command does not know go to its ``run``. Any other suite refuses them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import akv
from akv.bench import configure
from akv.cluster.config import parse_log_level
from akv.errors import AKVError, ConfigError

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


DESCRIPTION = """\
akv: an asyncio-native parameter server (MXNet's KVStore for today's Python).

This command measures akv: `akv bench SUITE` runs one suite of benchmarks and prints a
table of akv's times next to a floor measured in the same run, and the targets each row
is held to (--json PATH also writes it as JSON). Suites:
  local        the local store against NumPy doing the same copies and adds
  engine       scheduling through the engine against plain Python
  dist         dist_sync with 2 workers and 1, then 2 servers, on this machine
  soak         many dist_sync rounds (4 workers, 2 servers), checked and timed
  device       the device store on a GPU (needs CuPy and a GPU)
  compression  gradient compression's codes, and a compressed round against a dense one
  sparse       an embedding table on the servers against akv's dense rounds
  fusion       a ResNet-18 step through akv.torch: a key per parameter against buckets

The other commands of a job:
  akv-launch     start a job (scheduler, servers, workers running your command) and
                 supervise it
  akv-scheduler  run a job's scheduler yourself
  akv-server     run one of its parameter servers yourself
Each takes --help, --version and --log-level."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="akv", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"akv {akv.__version__}")
    parser.add_argument(
        "--log-level",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING (the default here), ERROR or CRITICAL, any case: akv's "
        "log lines at that level and above reach stderr (AKV_LOG_LEVEL, which the "
        "processes a benchmark starts inherit)",
    )
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
        "(akv bench sparse --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``akv`` command line; return the exit status.

    A suite that cannot run (an :class:`akv.AKVError`, such as ``akv bench device`` without
    CuPy or a GPU) prints ``akv bench: <message>`` to stderr, without a traceback, and
    returns 1.
    """
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    suite_help = _suite_help(argv)
    if suite_help is not None:
        print(suite_help, end="")
        return 0
    args, extra = parser.parse_known_args(argv)
    if args.log_level is not None:
        try:
            level = parse_log_level(args.log_level, "--log-level")
        except ConfigError as exc:
            parser.error(str(exc))
        os.environ["AKV_LOG_LEVEL"] = args.log_level.strip()
        logging.basicConfig(level=level, format="%(asctime)s akv %(levelname)s %(message)s")
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
    configure(quick=args.quick)
    try:
        table = module.run(extra) if options is not None else module.run()
    except AKVError as exc:
        print(f"akv bench: {exc}", file=sys.stderr)
        return 1
    table.write(sys.stdout, json_path=args.json)
    return 0


def _suite_help(argv: list[str]) -> str | None:
    """The help of ``akv bench SUITE --help`` (or ``-h``) for a suite with options of its own
    (its options, then the common ones), or None when ``argv`` asks for no such help."""
    if "bench" not in argv:
        return None
    rest = argv[argv.index("bench") + 1 :]
    # (--help-sparse: its first spelling)
    asks = {"-h", "--help", f"--help-{rest[0]}"} if rest else set()
    if not rest or rest[0] not in BENCHMARKS or not asks & set(rest[1:]):
        return None
    options = getattr(importlib.import_module(BENCHMARKS[rest[0]]), "options_parser", None)
    if options is None:
        return None
    common = (
        "also: --quick (short rounds), --json PATH (the table as JSON too); see akv bench --help"
    )
    return f"{options().format_help()}\n{common}\n"


if __name__ == "__main__":
    sys.exit(main())
