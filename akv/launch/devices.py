"""Which GPUs each worker of a machine sees (``--gpus-per-worker``), decided without I/O.

:func:`visible_devices` reads what this machine offers (the launcher's own
``CUDA_VISIBLE_DEVICES``, else what ``nvidia-smi -L`` printed: the launcher runs it), and
:func:`worker_devices` gives each local worker its ``CUDA_VISIBLE_DEVICES``, in
``LOCAL_RANK`` order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from akv.errors import LaunchError
from akv.launch.args import ALL_GPUS, GPU_VARIABLE

__all__ = ["parse_nvidia_smi", "visible_devices", "worker_devices"]

_GPU_LINE = re.compile(r"^GPU (\d+):", re.M)


def parse_nvidia_smi(output: str) -> list[str]:
    """The device numbers in ``nvidia-smi -L``'s output (``GPU 0: NVIDIA H100 ... (UUID:
    GPU-...)``, one line per GPU; MIG lines below a GPU are not GPUs of their own)."""
    return _GPU_LINE.findall(output)


def visible_devices(environ: Mapping[str, str], nvidia_smi_output: str | None) -> list[str]:
    """The devices this machine gives its processes: the entries of ``environ``'s
    ``CUDA_VISIBLE_DEVICES`` when it is set (numbers or UUIDs; empty: none), else the GPUs
    ``nvidia-smi -L`` listed (``None``: it is not installed, or failed: none)."""
    listed = environ.get(GPU_VARIABLE)
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    return parse_nvidia_smi(nvidia_smi_output or "")


def worker_devices(
    devices: Sequence[str] | None, local_workers: int, per_worker: int | str | None
) -> list[str | None]:
    """Each local worker's ``CUDA_VISIBLE_DEVICES`` (by local rank), or ``None`` where
    akv-launch sets none (the worker inherits the launcher's).

    ``per_worker``: ``None`` shares ``devices`` out evenly (``len // local_workers`` each;
    with fewer devices than workers, one each in turn, so that workers share them; no
    device: nothing is set). A number ``N`` gives worker ``i`` devices ``i*N .. i*N+N-1``
    of ``devices`` (0: an empty list, no GPU); with ``devices`` unknown (``None``: another
    machine's) they are numbered from 0. :data:`~akv.launch.args.ALL_GPUS`: nothing is set.

    Raises :class:`LaunchError` when ``N`` per worker needs more devices than there are.
    """
    if per_worker == ALL_GPUS:
        return [None] * local_workers
    if per_worker is None:
        if not devices:
            return [None] * local_workers
        if len(devices) < local_workers:
            return [devices[i % len(devices)] for i in range(local_workers)]
        share = len(devices) // local_workers
        return [",".join(devices[i * share : (i + 1) * share]) for i in range(local_workers)]
    count = int(per_worker)
    known = list(devices) if devices is not None else [str(i) for i in range(count * local_workers)]
    if count * local_workers > len(known):
        raise LaunchError(
            f"--gpus-per-worker {count} for {local_workers} workers on this machine needs "
            f"{count * local_workers} GPUs; it has {len(known)} ({', '.join(known) or 'none'}): "
            "give fewer per worker, or run fewer workers here"
        )
    return [",".join(known[i * count : (i + 1) * count]) for i in range(local_workers)]
