"""Data-parallel training with a dist_sync store: an MLP on scikit-learn's digits.

Run it with the launcher (one scheduler, the servers and the workers on this machine):

    akv-launch -n 2 -s 1 -- python examples/train_dist.py

On a Ray cluster: ``akv-launch --launcher ray -n 2 -s 1 -- python examples/train_dist.py``,
or, from Python, ``akv.ray.launch(train, num_workers=2, num_servers=1)`` (docs/ray.md).

Every worker trains on its own shard of the training set. Each step it computes the
gradients of its minibatch, pushes them (the servers sum the workers' gradients and apply
SGD with momentum to the weights they hold) and pulls the new weights. The loss falls the
same way on every worker, because every worker pulls the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import akv

HIDDEN = 64
CLASSES = 10
BAR_WIDTH = 24


def load(rank: int, num_workers: int, seed: int = 0):
    from sklearn.datasets import load_digits  # the dataset ships with scikit-learn

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
    shard = split // num_workers  # every worker gets as many images: as many steps
    mine = slice(rank * shard, (rank + 1) * shard)
    return x_train[mine], y_train[mine], x_test, y_test


def init_params(features: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(features, HIDDEN)) / np.sqrt(features)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(CLASSES, np.float32),
    }


def forward_backward(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    logits = hidden @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(probs[np.arange(len(y)), y] + 1e-9)))
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1  # summed over the batch: rescale_grad averages
    d_hidden = (d_logits @ p["w2"].T) * (1 - hidden**2)
    grads = {
        "w1": (x.T @ d_hidden).astype(np.float32),
        "b1": d_hidden.sum(axis=0).astype(np.float32),
        "w2": (hidden.T @ d_logits).astype(np.float32),
        "b2": d_logits.sum(axis=0).astype(np.float32),
    }
    return loss, grads


def accuracy(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    return float(np.mean(np.argmax(hidden @ p["w2"] + p["b2"], axis=1) == y))


def bar(done: int, total: int) -> str:
    filled = BAR_WIDTH * done // total
    return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"


def train(
    epochs: int = 15, batch: int = 32, lr: float = 0.1, store: str = "dist_sync"
) -> dict[str, float]:
    """Train this worker's part of the job (the store's configuration comes from the
    environment, as akv-launch and ``akv.ray.launch`` set it); print each epoch, and return
    the worker's rank, its first and last epoch's loss and the final test accuracy."""
    with akv.create(store) as kv:
        rank, workers = kv.rank, kv.num_workers
        x, y, x_test, y_test = load(rank, workers)
        params = init_params(x.shape[1])
        names = sorted(params)
        kv.init(names, [params[n] for n in names])  # rank 0's values win
        kv.set_optimizer(
            akv.optimizer.SGD(
                learning_rate=lr,
                momentum=0.9,
                wd=1e-4,
                rescale_grad=1.0 / (batch * workers),
            )
        )
        kv.pull(names, out=[params[n] for n in names])
        steps = len(x) // batch  # the same on every worker (dist_sync needs that)
        print(
            f"worker {rank}/{workers}: {len(x)} training images, {steps} steps per epoch, "
            f"placement {kv.placement()}",
            flush=True,
        )
        start = time.perf_counter()
        first_loss = last_loss = float("nan")
        for epoch in range(1, epochs + 1):
            order = np.random.default_rng(epoch).permutation(len(x))
            losses = []
            for step in range(steps):
                chosen = order[step * batch : (step + 1) * batch]
                loss, grads = forward_backward(params, x[chosen], y[chosen])
                kv.push(names, [grads[n] for n in names])
                kv.pull(names, out=[params[n] for n in names])
                losses.append(loss)
            last_loss = float(np.mean(losses))
            first_loss = last_loss if epoch == 1 else first_loss
            print(
                f"worker {rank} epoch {epoch:2d}/{epochs} {bar(epoch, epochs)} "
                f"loss {last_loss:.4f}  test accuracy {accuracy(params, x_test, y_test):.3f}",
                flush=True,
            )
        elapsed = time.perf_counter() - start
        final = accuracy(params, x_test, y_test)
        print(
            f"worker {rank}: loss {first_loss:.4f} -> {last_loss:.4f} in {elapsed:.1f} s, "
            f"test accuracy {final:.3f}",
            flush=True,
        )
    return {"rank": rank, "first_loss": first_loss, "last_loss": last_loss, "accuracy": final}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--store", default="dist_sync")
    args = parser.parse_args(argv)
    result = train(args.epochs, args.batch, args.lr, args.store)
    return 0 if result["last_loss"] < result["first_loss"] else 1


if __name__ == "__main__":
    sys.exit(main())
