"""A recommendation model whose embedding tables live in an akv store: matrix factorization
of clicks, with user and item tables as ``akv.torch.Embedding``.

Run it alone (a ``local`` store in this process):

    python examples/recommend.py

or with the launcher (a ``dist_sync`` store: the tables are split by rows over the servers,
every worker trains on its own shard of the clicks):

    akv-launch -n 2 -s 2 -- python examples/recommend.py

The data set is generated: users and items with hidden taste vectors, and (user, item,
clicked) triples whose ids follow a Zipf-like law (a few hot users and items, a long tail),
as the traffic of a real recommender does. The model scores a pair with the dot product of
the two rows and a learned scale and bias (``torch.nn.Linear(1, 1)``); the loss is the
logistic loss of the click. Each step pulls only the rows of the batch's ids and pushes
their gradient; the store's optimizer (akv's Adam, lazy: only the pushed rows and their
moments change) updates them where the tables live. The dense head is trained through
``akv.torch.DistributedOptimizer`` on the same store, with the same optimizer. Each worker
prints its training loss every ``--every`` steps and, at the end, the loss on held-out clicks
before and after training; it exits 0 when that fell.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

import akv
import akv.torch

USERS, ITEMS, DIM = 10_000, 50_000, 16
TASTE_DIM = 4  # the hidden tastes that make the clicks
AFFINITY_SCALE = 5.0  # how sharply tastes decide a click
TEST_SIZE = 8192
ZIPF_EXPONENT = 1.1


def launched() -> bool:
    """Whether akv-launch started this process (it sets the role of every process)."""
    return "AKV_ROLE" in os.environ or "DMLC_ROLE" in os.environ


def zipf_ids(rng: np.random.Generator, order: np.ndarray, size: int) -> np.ndarray:
    """``size`` ids of ``order`` (a popularity order, shuffled so that hot ids are spread
    over the table), the ``k``-th drawn with weight ``1 / (k + 1) ** s``."""
    weights = 1.0 / np.arange(1, len(order) + 1) ** ZIPF_EXPONENT
    return order[rng.choice(len(order), size=size, p=weights / weights.sum())]


def clicks(size: int, draw: int) -> tuple[torch.Tensor, ...]:
    """``size`` (user, item, clicked, probability of the click) rows of one world of tastes
    (the same in every draw): a click is likelier the closer the tastes. ``draw`` seeds the
    rows, so that the held-out rows do not depend on how many the training draws."""
    world = np.random.default_rng(0)
    user_taste = world.normal(size=(USERS, TASTE_DIM)) / np.sqrt(TASTE_DIM)
    item_taste = world.normal(size=(ITEMS, TASTE_DIM)) / np.sqrt(TASTE_DIM)
    popular_users, popular_items = world.permutation(USERS), world.permutation(ITEMS)
    rng = np.random.default_rng(draw)
    users, items = zipf_ids(rng, popular_users, size), zipf_ids(rng, popular_items, size)
    affinity = AFFINITY_SCALE * np.einsum("ij,ij->i", user_taste[users], item_taste[items])
    chance = 1.0 / (1.0 + np.exp(-affinity))
    clicked = rng.random(size) < chance
    return (
        torch.from_numpy(users),
        torch.from_numpy(items),
        torch.from_numpy(clicked.astype(np.float32)),
        torch.from_numpy(chance.astype(np.float32)),
    )


class MatrixFactorization(torch.nn.Module):
    def __init__(self, kv: akv.KVStore, seed: int = 1) -> None:
        super().__init__()
        # Small random rows to start from (zeros would give both tables zero gradients).
        generator = torch.Generator().manual_seed(seed)
        self.users = akv.torch.Embedding(
            kv, "users", USERS, DIM, init=0.1 * torch.randn(USERS, DIM, generator=generator)
        )
        self.items = akv.torch.Embedding(
            kv, "items", ITEMS, DIM, init=0.1 * torch.randn(ITEMS, DIM, generator=generator)
        )
        self.head = torch.nn.Linear(1, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (self.users(users) * self.items(items)).sum(dim=-1, keepdim=True)
        return self.head(dot).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps per worker")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument(
        "--store",
        default=None,
        help="the store type (default: dist_sync under akv-launch, else local)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    store = args.store or ("dist_sync" if launched() else "local")
    torch.set_num_threads(1)  # several workers may share this machine's cores

    with akv.create(store) as kv:
        rank, workers = kv.rank, kv.num_workers
        users, items, clicked, _ = clicks(args.steps * args.batch * workers, draw=1)
        test = clicks(TEST_SIZE, draw=2)  # held out: the same for any number of workers
        model = MatrixFactorization(kv)  # every worker inits; rank 0's rows are kept
        opt = akv.torch.DistributedOptimizer(
            model.named_parameters(),  # the head only: the tables are the store's keys
            kv,
            akv.optimizer.Adam(learning_rate=args.lr, rescale_grad=1.0 / workers),
        )
        print(f"worker {rank}/{workers}: store {store}, keys {kv.keys()}", flush=True)
        held_out_before = held_out_loss(model, *test[:3])
        start = time.perf_counter()
        first = last = None
        window: list[float] = []
        for step in range(args.steps):
            at = (step * workers + rank) * args.batch  # this worker's batch of the step
            batch = slice(at, at + args.batch)
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(
                model(users[batch], items[batch]), clicked[batch]
            )
            loss.backward()  # pushes the tables' row gradients (and the head's)
            opt.step()  # the head's new weights; the tables' rows are pulled by forward
            window.append(loss.item())
            if (step + 1) % args.every == 0 or step + 1 == args.steps:
                last = float(np.mean(window))
                first = last if first is None else first
                window = []
                print(f"worker {rank} step {step + 1:4d}/{args.steps} loss {last:.4f}", flush=True)
        elapsed = time.perf_counter() - start
        held_out = held_out_loss(model, *test[:3])
        floor = F.binary_cross_entropy(test[3], test[3]).item()
        print(
            f"worker {rank}: loss {first:.4f} -> {last:.4f}, held-out loss "
            f"{held_out_before:.4f} -> {held_out:.4f} (the clicks' own entropy: {floor:.4f}), "
            f"{args.steps / elapsed:.1f} steps/s",
            flush=True,
        )
    return 0 if held_out < held_out_before else 1  # it learned: the held-out loss fell


def held_out_loss(
    model: MatrixFactorization, users: torch.Tensor, items: torch.Tensor, clicked: torch.Tensor
) -> float:
    """The loss on clicks no worker trains on (pulls their rows, pushes nothing)."""
    with torch.no_grad():
        return F.binary_cross_entropy_with_logits(model(users, items), clicked).item()


if __name__ == "__main__":
    sys.exit(main())
