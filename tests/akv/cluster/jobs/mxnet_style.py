"""An MXNet-style script: the same command starts every role (DMLC_ROLE decides)."""

import numpy as np

import akv

kv = akv.create("dist_sync")  # a server or scheduler serves here and exits
kv.init(1, np.zeros(2, np.float32))
kv.push(1, np.full(2, kv.rank + 1.0, np.float32))
print("pulled", kv.pull(1).tolist(), flush=True)
kv.close()
