"""Make tests/akv/data/compression_reference.json with MXNet 1.9.1 (run by hand, never by
the tests): 2bit gradient compression of random pushes from several senders.

    python -m venv /work/mxvenv && /work/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    /work/mxvenv/bin/python tests/akv/data/make_compression_reference.py

MXNet 1.9.1 refuses compression in its ``local`` store, so the numbers come from its
``device`` store on CPU contexts, one context per sender (a residual per device, as akv keeps
one per position of a pushed list). Without an optimizer the stored value after each push
is the sum of the senders' decoded values, which each pull returns. Inputs are seeded
float32 values; outputs are the pulls after each push.
"""

from __future__ import annotations

import json
from pathlib import Path

import mxnet as mx
import numpy as np

SENDERS = 3
SHAPE = (5, 7)  # 35 values: three 16-value words, the last one partly padding
STEPS = 6
THRESHOLD = 0.5


def main() -> None:
    rng = np.random.default_rng(25)
    grads = (rng.standard_normal((STEPS, SENDERS, *SHAPE)) * 0.4).astype(np.float32)
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
    kv.init(3, mx.nd.zeros(SHAPE))
    pulled = []
    for step in range(STEPS):
        values = [mx.nd.array(grads[step, s], ctx=mx.cpu(s)) for s in range(SENDERS)]
        kv.push(3, values)
        out = mx.nd.zeros(SHAPE)
        kv.pull(3, out=out)
        pulled.append(out.asnumpy().tolist())
    reference = {
        "made_by": "MXNet " + mx.__version__ + ", device store on CPU contexts, "
        "tests/akv/data/make_compression_reference.py",
        "threshold": THRESHOLD,
        "shape": list(SHAPE),
        "grads": grads.tolist(),
        "pulled": pulled,
    }
    path = Path(__file__).with_name("compression_reference.json")
    path.write_text(json.dumps(reference, separators=(",", ":")))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
