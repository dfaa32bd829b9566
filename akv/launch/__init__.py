"""``akv-launch``: start one akv job and supervise it (``python -m akv.launch``)."""

from akv.launch.command import main

__all__ = ["main"]
