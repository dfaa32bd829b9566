"""A worker for the status page's browser test: it pushes and pulls one key, round after
round, until a worker saw the file named by its argument. Each push carries that worker's
flag in the sum, so every worker stops after the same round."""

import sys
import time
from pathlib import Path

import numpy as np

import akv


def main(stop_file: Path) -> None:
    with akv.create("dist_sync") as kv:
        kv.init("w", np.zeros(2, np.float32))
        out = np.zeros(2, np.float32)
        while True:
            kv.push("w", np.array([1.0, float(stop_file.exists())], np.float32))
            kv.pull("w", out=out)
            if out[1] > 0:
                break
            time.sleep(0.05)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
