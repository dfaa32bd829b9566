"""The worker's side of ``dist_sync``/``dist_async`` stores."""

from akv.cluster.worker.backend import DistBackend

__all__ = ["DistBackend"]
