"""A worker that checks MXNet's dist semantics and prints what it saw as one JSON line."""

import hashlib
import json
import sys

import numpy as np

import akv


def main(store_type: str) -> None:
    sync = akv.store_type(store_type).mode == "dist_sync"
    with akv.create(store_type) as kv:
        r = kv.rank + 1
        seen = {"rank": kv.rank, "num_workers": kv.num_workers, "type": kv.type}
        kv.init(3, np.full((2, 3), 10.0 * r, np.float32))
        seen["init"] = float(kv.pull(3)[0, 0])
        if sync:
            kv.push(3, np.full((2, 3), r, np.float32))
            seen["sum"] = float(kv.pull(3)[0, 0])
            kv.push(3, np.full((2, 3), r, np.float32))
            seen["second"] = float(kv.pull(3)[0, 0])
            kv.init([11, 12], [np.zeros(3, np.float32)] * 2)
            seen["pushpull"] = float(kv.pushpull(11, np.full(3, 100.0 * r, np.float32))[0])
        kv.init(20, np.ones(1_200_000, np.float32))  # above the big-array bound: split
        seen["parts"] = len(kv.placement(20)[20])
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.1))
        if sync:
            kv.push(20, np.full(1_200_000, 1.5 / kv.num_workers, np.float32))
            seen["sgd"] = float(kv.pull(20)[-1])
        else:
            kv.barrier()
            kv.push(20, np.full(1_200_000, 1.0, np.float32))
            kv.barrier()
            seen["sgd"] = float(kv.pull(20)[0])
        pulled = kv.pull(20)
        seen["checksum"] = hashlib.sha256(pulled.tobytes()).hexdigest()
        seen["shm"] = all(link.shares_memory for link in kv._inner._backend.links)
        print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
