"""A worker's next round after a restart must not run ahead of its resent one:
``runs_ahead.py``.

Run under ``akv-launch -n 2 -s 1 --checkpoint-dir DIR --max-restarts 1`` with a long
checkpoint interval. Both workers push and pull key ``a`` for 6 rounds; a new key at
round 4 makes a checkpoint of rounds 1-4. Worker 0 then kills the server. Each worker's
replay sends its round-5 push again, pulls ``a`` (answered once round 5 is complete) and
sends its round-6 push again. Worker 0's replay is slow: what it sends after its round-5
push waits 2 s (as if its event loop were busy), so worker 1's replay ends first.
Worker 1 pulls a key it never pushed (answered once both workers reconnected, so after
the kill) and does round 7 at once: its round-6 push waits on the restarted server for worker
0's, while worker 1's own pull of round 6 was answered by the server that died. Each
worker prints what it pulled after round 7 as JSON.

The hold delays only worker 0's frames: starving its process of the GIL instead (an
earlier version) held back its heartbeats too, past the test cluster's 3 s timeout.
"""

import asyncio
import json
import os
import signal
import time

import numpy as np
from scheduler_view import server_pids

import akv
from akv.cluster.protocol import Op
from akv.cluster.worker.link import ServerLink

ONE = np.ones(2, np.float32)
HOLD_S = 2.0


class Hold:
    """Worker 0's frames once it killed the server: on the new stream its first push goes
    at once, and what follows waits ``HOLD_S``, then goes in order."""

    armed = False
    waiting: list | None = None  # None: not holding yet


send = ServerLink.send


def send_late(link, request):
    if not Hold.armed or link.protocol is None or link.reconnects == 0:
        send(link, request)
    elif Hold.waiting is not None:
        Hold.waiting.append(request)
    else:
        assert request.op == Op.PUSH, request  # the round-5 push, sent again
        Hold.waiting = []
        asyncio.get_running_loop().call_later(HOLD_S, flush, link)
        send(link, request)


def flush(link):
    Hold.armed = False
    for request in Hold.waiting:
        send(link, request)


ServerLink.send = send_late


with akv.create("dist_sync") as kv:
    kv.init(["a", "x"], [np.zeros(2, np.float32)] * 2)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
    for step in range(1, 7):
        kv.push("a", ONE)
        kv.pull("a")
        if step == 4:
            kv.init("c", ONE)  # answered once a checkpoint holds it (rounds 1-4)
    if kv.rank == 0:
        Hold.armed = True
        os.kill(server_pids()[0], signal.SIGKILL)
    else:
        time.sleep(0.3)
        kv.pull("x")
    kv.push("a", ONE)
    print(json.dumps({"rank": kv.rank, "a": kv.pull("a").tolist()}), flush=True)
