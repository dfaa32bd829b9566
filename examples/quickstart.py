"""akv quickstart: a blocking local store holds a model's weights and applies SGD to them.

Run: python examples/quickstart.py

Four "devices" each compute a gradient of a least-squares loss on their share of a batch;
pushing the four gradients sums them in the store, where the optimizer updates the
weights; pulling gives every device the new weights.
"""

from __future__ import annotations

import numpy as np

import akv

NUM_DEVICES = 4
STEPS = 60
BATCH = 256
FEATURES = 8


def main() -> None:
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=FEATURES).astype(np.float32)

    with akv.create("local") as kv:
        kv.init("w", np.zeros(FEATURES, np.float32))
        kv.set_optimizer(
            akv.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / BATCH)
        )
        weights = [np.zeros(FEATURES, np.float32) for _ in range(NUM_DEVICES)]

        for step in range(STEPS):
            x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
            y = x @ true_w + rng.normal(scale=0.01, size=BATCH).astype(np.float32)
            grads = []
            for device, (xs, ys) in enumerate(
                zip(np.array_split(x, NUM_DEVICES), np.array_split(y, NUM_DEVICES), strict=True)
            ):
                error = xs @ weights[device] - ys
                grads.append((2 * xs.T @ error).astype(np.float32))
            kv.push("w", grads)  # summed over the devices, then SGD on the store
            kv.pull("w", out=weights)  # every device gets the new weights
            if step % 10 == 0 or step == STEPS - 1:
                loss = float(np.mean((x @ weights[0] - y) ** 2))
                print(f"step {step:3d}  loss {loss:.5f}")

        print("distance to the true weights:", float(np.linalg.norm(weights[0] - true_w)))


if __name__ == "__main__":
    main()
