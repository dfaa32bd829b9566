"""How much memory a server's restore from its checkpoint takes, against what it then holds.

Run it as a script; it makes the checkpoint first, with a job of its own::

    python docs/profiling/restore_memory.py --rows 2000000 --width 16 --optimizer adam

The job (``akv-launch -n 1 -s 1 --checkpoint-dir DIR``, run by this script) inits a
row-sparse key of ``4 x rows`` declared rows, sets the optimizer, and pushes ``rows`` rows
(every fourth id) in batches; the server writes its final checkpoint when the job ends.
Then a fresh process restores that checkpoint as a server does (``Checkpoints.restore``)
and prints its RSS before, its RSS after and its peak (``VmHWM``): the peak above the
start, over what the restored state holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH = 100_000


def job(rows: int, width: int, optimizer: str) -> None:
    """The job's only worker: the rows, pushed once each under ``optimizer``."""
    import numpy as np

    import akv

    with akv.create("dist_sync") as kv:
        shape = (4 * rows, width)
        kv.init("emb", akv.RowSparseArray.zeros(shape, np.float32))
        made = {"adam": akv.optimizer.Adam, "sgd": akv.optimizer.SGD}[optimizer]
        kv.set_optimizer(made(learning_rate=0.01))
        for first in range(0, rows, BATCH):
            ids = np.arange(first, min(first + BATCH, rows)) * 4
            grad = np.full((ids.size, width), 0.5, np.float32)
            kv.push("emb", akv.RowSparseArray(grad, ids, shape))
        kv.row_sparse_pull("emb", row_ids=[0])


def _rss() -> tuple[int, int]:
    """This process's RSS and peak RSS, in MiB."""
    text = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def restore(directory: Path) -> dict[str, int]:
    """Restore server 0's checkpoint in ``directory`` into a fresh state; the RSS figures."""
    from akv import jit
    from akv.cluster.server.checkpointing import Checkpoints
    from akv.cluster.server.state import ServerState
    from akv_engine import Var

    jit.kernels()  # as a server makes them before it restores
    numbers = itertools.count()
    state = ServerState("server 0", 1, 5.0, lambda name: Var(None, next(numbers), name))
    before, _ = _rss()
    checkpoints = Checkpoints(
        state,
        None,
        directory=directory,
        rank=0,
        num_workers=1,
        interval_s=3600.0,  # type: ignore[arg-type]
    )
    checkpoints.restore()
    after, peak = _rss()
    checkpoints.close()
    return {"before_mib": before, "after_mib": after, "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--restore", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.rows, args.width, args.optimizer)
        return
    if args.restore:
        print(json.dumps(restore(Path(args.restore))))
        return
    with tempfile.TemporaryDirectory() as directory:
        command = [
            *(sys.executable, "-m", "akv.launch", "-n", "1", "-s", "1"),
            *("--checkpoint-dir", directory, "--checkpoint-interval-s", "3600", "--"),
            *(sys.executable, __file__, "--job", "--rows", str(args.rows)),
            *("--width", str(args.width), "--optimizer", args.optimizer),
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=1800)
        size = (Path(directory) / "server-0.akvckpt").stat().st_size
        done = subprocess.run(
            [sys.executable, __file__, "--restore", directory],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    figures = json.loads(done.stdout)
    held = figures["after_mib"] - figures["before_mib"]
    above = figures["peak_mib"] - figures["before_mib"]
    print(
        f"{args.rows} rows of {args.width} float32 with {args.optimizer}: checkpoint "
        f"{size / 2**20:.0f} MiB; restore: RSS {figures['before_mib']} -> "
        f"{figures['after_mib']} MiB, peak {figures['peak_mib']} MiB: {above} MiB above the "
        f"start for {held} MiB held ({above / max(held, 1):.2f}x)"
    )


if __name__ == "__main__":
    main()
