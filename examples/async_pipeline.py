"""akv in an asyncio training pipeline: loading, computing, pushing and pulling overlap.

Run: python examples/async_pipeline.py

An async loader produces batches (standing in for reads from disk or the network), the
gradient is computed on a worker thread, and the push of step t's gradient and the pull of
the weights for step t+1 are scheduled without waiting: the store orders them per key, so
the pull always sees the push, while the loader keeps the next batch coming.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import akv

CLASSES = 4
FEATURES = 16
BATCH = 512
STEPS = 80
LOADER_LATENCY_S = 0.002


def make_task(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(FEATURES, CLASSES)).astype(np.float32)


async def loader(queue: asyncio.Queue, true_w: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        await asyncio.sleep(LOADER_LATENCY_S)  # I/O the loop overlaps with everything else
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        labels = np.argmax(x @ true_w, axis=1)
        await queue.put((x, labels))
    await queue.put(None)


def softmax_gradient(w: np.ndarray, x: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float]:
    logits = x @ w
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(probs[np.arange(len(labels)), labels] + 1e-9)))
    probs[np.arange(len(labels)), labels] -= 1
    return (x.T @ probs / len(labels)).astype(np.float32), loss


async def main() -> None:
    true_w = make_task()
    queue: asyncio.Queue = asyncio.Queue(maxsize=4)
    async with await akv.create_async("local") as kv:
        kv.init("w", np.zeros((FEATURES, CLASSES), np.float32))
        await kv.set_optimizer(akv.optimizer.Adam(learning_rate=0.05))
        weights = np.zeros((FEATURES, CLASSES), np.float32)
        next_weights = kv.pull("w", out=weights)
        load = asyncio.create_task(loader(queue, true_w))
        start = time.perf_counter()
        step = 0
        while (batch := await queue.get()) is not None:
            await next_weights  # the weights pulled after the previous push
            grad, loss = await asyncio.to_thread(softmax_gradient, weights.copy(), *batch)
            kv.push("w", grad)  # scheduled, not awaited
            next_weights = kv.pull("w", out=weights)  # ordered after that push
            if step % 20 == 0:
                print(f"step {step:3d}  loss {loss:.4f}")
            step += 1
        await next_weights
        await load
        x = np.random.default_rng(2).normal(size=(2000, FEATURES))
        labels = np.argmax(x @ true_w, axis=1)
        accuracy = float(np.mean(np.argmax(x @ weights, axis=1) == labels))
        print(
            f"{step} steps in {time.perf_counter() - start:.2f} s, held-out accuracy {accuracy:.3f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
