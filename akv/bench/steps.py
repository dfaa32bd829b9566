"""A training step's communication: ResNet-18's parameters, pushed and pulled as MXNet does.

``akv bench dist`` times these steps, and ``docs/mxnet-comparison/dist_worker.py`` times the
same calls against MXNet 1.9.1. That script runs in MXNet's own environment, where akv is not
installed, and loads this file by its path, so this module imports nothing but the standard
library. The step functions take any store with MXNet's ``push(key, value, priority=)`` and
``pull(key, out=)``: akv's blocking ``KVStore`` and MXNet's ``KVStore`` alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "RESNET18_ARRAYS",
    "RESNET18_PARAMETERS",
    "Shape",
    "StepStore",
    "elements",
    "list_step",
    "per_key_step",
    "resnet18_shapes",
]

Shape = tuple[int, ...]

#: How many arrays and float32 elements ResNet-18 (1000 classes) has: what
#: :func:`resnet18_shapes` must give, and the figures torchvision reports.
RESNET18_ARRAYS = 62
RESNET18_PARAMETERS = 11_689_512


def resnet18_shapes(
    base_channels: int = 64, num_classes: int = 1000, in_channels: int = 3
) -> list[tuple[str, Shape]]:
    """ResNet-18's trainable parameters, in forward order: ``(name, shape)``.

    conv1 (7x7) with its batch norm; four stages of two basic blocks with ``base_channels``
    times 1, 2, 4 and 8 channels (each block: two 3x3 convolutions, each with its batch
    norm's gamma and beta; the first block of stages 2-4 adds a 1x1 downsample convolution
    with its batch norm); then the fully connected layer's weight and bias. Convolutions have
    no bias, as in torchvision and Gluon. The defaults give ResNet-18 itself: 62 arrays,
    11,689,512 floats (44.6 MiB of float32); smaller ``base_channels`` and ``num_classes``
    give the same 62 arrays, smaller, for tests.
    """
    shapes: list[tuple[str, Shape]] = [
        ("conv1.weight", (base_channels, in_channels, 7, 7)),
        *_batch_norm("bn1", base_channels),
    ]
    channels = base_channels
    for stage in range(4):
        out_channels = base_channels << stage
        for block in range(2):
            prefix = f"layer{stage + 1}.{block}"
            block_in = channels if block == 0 else out_channels
            shapes.append((f"{prefix}.conv1.weight", (out_channels, block_in, 3, 3)))
            shapes.extend(_batch_norm(f"{prefix}.bn1", out_channels))
            shapes.append((f"{prefix}.conv2.weight", (out_channels, out_channels, 3, 3)))
            shapes.extend(_batch_norm(f"{prefix}.bn2", out_channels))
            if block == 0 and stage > 0:
                shapes.append((f"{prefix}.downsample.weight", (out_channels, channels, 1, 1)))
                shapes.extend(_batch_norm(f"{prefix}.downsample.bn", out_channels))
        channels = out_channels
    shapes.append(("fc.weight", (num_classes, channels)))
    shapes.append(("fc.bias", (num_classes,)))
    return shapes


def _batch_norm(prefix: str, channels: int) -> list[tuple[str, Shape]]:
    return [(f"{prefix}.gamma", (channels,)), (f"{prefix}.beta", (channels,))]


def elements(shapes: Sequence[Shape]) -> int:
    """How many elements the arrays of ``shapes`` hold together."""
    return sum(math.prod(shape) for shape in shapes)


class StepStore(Protocol):
    """What a step calls: MXNet's blocking ``push`` and ``pull`` (akv's ``KVStore``)."""

    def push(self, key: Any, value: Any, priority: int = 0) -> Any: ...

    def pull(self, key: Any, out: Any = None, priority: int = 0) -> Any: ...


def per_key_step(
    kv: StepStore, keys: Sequence[Any], grads: Sequence[Any], weights: Sequence[Any]
) -> None:
    """One step with a call per array, as MXNet's Module makes them.

    Each gradient is pushed as backward produces it: the last layer first, array ``i`` with
    ``priority=-i`` (so that, where work piles up, the first layers, which the next forward
    needs first, go first). Then each weight is pulled into ``weights[i]``, first layer first.
    """
    for index in reversed(range(len(keys))):
        kv.push(keys[index], grads[index], priority=-index)
    for index in range(len(keys)):
        kv.pull(keys[index], out=weights[index])


def list_step(
    kv: StepStore, keys: Sequence[Any], grads: Sequence[Any], weights: Sequence[Any]
) -> None:
    """One step with one list push of every gradient and one list pull of every weight."""
    kv.push(list(keys), list(grads))
    kv.pull(list(keys), out=list(weights))
