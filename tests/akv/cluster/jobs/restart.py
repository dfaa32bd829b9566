"""A dist_sync training run for the restart test: ``restart.py clean|kill|term DIR``.

Every worker pushes gradients that depend on its rank and the round to three keys (one
split over both servers) under SGD with momentum, and pulls the weights, for ``ROUNDS``
rounds; it prints a digest of the final weights (their bytes' SHA-256) as JSON. With
``kill``, worker 0 sends SIGKILL to server 1 at round ``KILL_AT``; run under
``akv-launch --checkpoint-dir DIR --max-restarts 1`` the server is restarted from its
checkpoint and the weights must come out the same. With ``term`` it sends SIGTERM instead:
the server drains and writes a final checkpoint before it exits. With ``kill_twice`` it
kills server 1 again ``AGAIN_AFTER`` rounds after the first kill (``--max-restarts 2``):
the second restart must hold the pushes resent to the first. A row-sparse key (``emb``,
rows over both servers) is pushed and pulled each round too.

``restart.py rollback|delete DIR`` (``DIR``: the launcher's ``--checkpoint-dir``) break the
restart on purpose: with ``rollback`` worker 0 keeps a copy of server 1's checkpoint at
round ``STASH_AT``, waits for a newer one, then stops server 1, puts the old copy back and
kills it; with ``delete`` it stops server 1, deletes its checkpoint and kills it. Either
way the restarted server lacks pushes it had declared durable: the job must fail naming
it, the file and the rounds, and no worker may print weights.
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from scheduler_view import server_pids

import akv

MODE = sys.argv[1]
ROUNDS = 40
KILL_AT = 17
AGAIN_AFTER = 6
ROWS = 500  # of "emb": rows [0, 250) on server 0, [250, 500) on server 1
STASH_AT = 5
SPLIT = 4096  # above AKV_BIGARRAY_BOUND=1024: split over both servers
BROKEN = ("rollback", "delete")


def checkpoint_file() -> Path:
    return Path(sys.argv[2]) / "server-1.akvckpt"


def break_the_restart(stash: bytes) -> None:
    """Stop server 1 (it writes no more checkpoints), roll its checkpoint back to ``stash``
    or delete it, and kill it: the launcher restarts it from what is left."""
    pid = server_pids()[1]
    os.kill(pid, signal.SIGSTOP)
    path = checkpoint_file()
    if MODE == "rollback":
        Path(f"{path}.old").write_bytes(stash)
        os.replace(f"{path}.old", path)
    else:
        path.unlink()
    os.kill(pid, signal.SIGKILL)


stash = b""

with akv.create("dist_sync") as kv:
    kv.init("w", np.zeros(256, np.float32))
    kv.init("split", np.zeros(SPLIT, np.float32))
    kv.init("bias", np.zeros(3, np.float64))
    kv.init("emb", akv.RowSparseArray.zeros((ROWS, 4), np.float32))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.05, momentum=0.9))
    kills = {"kill": (KILL_AT,), "term": (KILL_AT,), "kill_twice": (KILL_AT, KILL_AT + AGAIN_AFTER)}
    for step in range(ROUNDS):
        if kv.rank == 0 and step in kills.get(MODE, ()):
            os.kill(server_pids()[1], signal.SIGTERM if MODE == "term" else signal.SIGKILL)
        if MODE in BROKEN and kv.rank == 0:
            if step == STASH_AT:
                deadline = time.monotonic() + 30
                while not checkpoint_file().exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                stash = checkpoint_file().read_bytes()
            # Rounds go slower from there, so that checkpoints newer than the copy are
            # written (and declared durable) before the break.
            if step > STASH_AT:
                time.sleep(0.1)
            if step >= KILL_AT and checkpoint_file().read_bytes() != stash:
                break_the_restart(stash)
                MODE = "broken"
        scale = np.float32((kv.rank + 1) * (step % 5 + 1))
        kv.push("w", np.linspace(-1, 1, 256, dtype=np.float32) * scale)
        kv.push("split", np.arange(SPLIT, dtype=np.float32) * scale / 1000)
        kv.push("bias", np.array([kv.rank, step, 1.0]))
        ids = np.unique(np.random.default_rng(100 * step + kv.rank).integers(0, ROWS, 40))
        rows = np.outer(ids % 7 - 3, np.ones(4, np.float32)).astype(np.float32) * scale
        kv.push("emb", akv.RowSparseArray(rows, ids, (ROWS, 4)))
        for key in ("w", "split", "bias"):
            kv.pull(key)
        kv.row_sparse_pull("emb", row_ids=ids)
        time.sleep(0.01)  # a few checkpoints (every 0.2 s) happen during the run
    final = {
        key: hashlib.sha256(kv.pull(key).tobytes()).hexdigest() for key in ("w", "split", "bias")
    }
    table = kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data
    final["emb"] = hashlib.sha256(table.tobytes()).hexdigest()
    print(json.dumps({"rank": kv.rank, "first": float(kv.pull("w")[0]), **final}), flush=True)
