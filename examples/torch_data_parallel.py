"""Data-parallel PyTorch training through akv: an MLP on scikit-learn's digits.

Run it with the launcher (one scheduler, the servers and the workers on this machine):

    akv-launch -n 2 -s 1 -- python examples/torch_data_parallel.py

It trains on the GPU where there is one (and CuPy, which akv reads CUDA tensors with), else
on the CPU; each worker on a GPU of its own: akv-launch gives each worker of a machine its
share of the GPUs (``CUDA_VISIBLE_DEVICES``, see ``--gpus-per-worker``), and where every
worker sees every GPU, ``LOCAL_RANK`` picks one. The store is ``dist_sync_device``: on a
GPU the gradients are summed there and staged through pinned memory; on the CPU it is
``dist_sync``. Every worker trains the same torch model on its own shard of the training
set. ``akv.torch.DistributedOptimizer`` makes every worker start from rank 0's weights,
pushes each gradient to the servers as soon as backward has computed it, and in ``step()``
pulls the weights the servers updated (SGD with momentum; the workers' gradients are
averaged through ``rescale_grad``). The workers end with the same weights: each prints a
checksum of them.

``--store local`` runs it as one process without the launcher.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import akv
import akv.arrays
import akv.torch

HIDDEN = 64
CLASSES = 10
BAR_WIDTH = 24


def load(rank: int, num_workers: int, device: str, seed: int = 0):
    from sklearn.datasets import load_digits  # the dataset ships with scikit-learn

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    shard = split // num_workers  # every worker gets as many images: as many steps
    mine = slice(rank * shard, (rank + 1) * shard)

    def tensors(a: np.ndarray, b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)

    return (*tensors(x[mine], y[mine]), *tensors(x[split:], y[split:]))


def bar(done: int, total: int) -> str:
    filled = BAR_WIDTH * done // total
    return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--store", default="dist_sync_device")
    args = parser.parse_args(argv)
    device = "cpu"
    if torch.cuda.is_available():
        if akv.arrays.cupy_module() is None:
            print("CUDA is here but CuPy is not (pip install 'akvstore[gpu]'): training on the CPU")
        else:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            device = f"cuda:{local_rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
    torch.set_num_threads(1)  # several workers share this machine's cores

    with akv.create(args.store) as kv:
        rank, workers = kv.rank, kv.num_workers
        x, y, x_test, y_test = load(rank, workers, device)
        torch.manual_seed(rank)  # each worker draws its own weights: rank 0's are kept
        model = nn.Sequential(
            nn.Linear(x.shape[1], HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)
        ).to(device)
        opt = akv.torch.DistributedOptimizer(
            model.named_parameters(),
            kv,
            akv.optimizer.SGD(
                learning_rate=args.lr, momentum=0.9, wd=1e-4, rescale_grad=1.0 / workers
            ),
        )
        steps = len(x) // args.batch  # the same on every worker (dist_sync needs that)
        where = device
        if device != "cpu":  # which of the machine's GPUs that is
            where += f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')})"
        print(
            f"worker {rank}/{workers} on {where}: {len(x)} training images, {steps} steps "
            f"per epoch, keys {opt.keys}",
            flush=True,
        )
        start = time.perf_counter()
        first_loss = last_loss = None
        for epoch in range(1, args.epochs + 1):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            total = torch.zeros((), device=device)
            for step in range(steps):
                batch = order[step * args.batch : (step + 1) * args.batch].to(device)
                opt.zero_grad()
                loss = F.cross_entropy(model(x[batch]), y[batch])
                loss.backward()  # each gradient is pushed as soon as it is ready
                opt.step()  # the servers' new weights, pulled into the parameters in place
                total += loss.detach()
            last_loss = total.item() / steps
            first_loss = last_loss if first_loss is None else first_loss
            print(
                f"worker {rank} epoch {epoch:2d}/{args.epochs} {bar(epoch, args.epochs)} "
                f"loss {last_loss:.4f}  test accuracy {accuracy(model, x_test, y_test):.3f}",
                flush=True,
            )
        elapsed = time.perf_counter() - start
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        print(
            f"worker {rank}: loss {first_loss:.4f} -> {last_loss:.4f} in {elapsed:.1f} s, "
            f"test accuracy {accuracy(model, x_test, y_test):.3f}, "
            f"weights checksum {checksum:.9f}",
            flush=True,
        )
        opt.close()
    return 0 if last_loss is not None and first_loss is not None and last_loss < first_loss else 1


if __name__ == "__main__":
    sys.exit(main())
