"""``akv-launch``: start one akv job and supervise it (``python -m akv.launch``).

The package reads in the order a launch happens:

* :mod:`akv.launch.args`: the command line, parsed and checked (:class:`LaunchOptions`);
* :mod:`akv.launch.hosts`: host files and placing processes onto hosts;
* :mod:`akv.launch.plans`: the plan, one per launcher: the list of
  :class:`~akv.launch.spec.ProcessSpec` to start (pure);
* :mod:`akv.launch.rules`: the exit rules, which exit ends the job with which code (pure);
* :mod:`akv.launch.supervisor`: runs a plan and applies the rules (the I/O);
* :mod:`akv.launch.command`: :func:`main` and :func:`launch`, which tie them together.

Limits are in :mod:`akv.launch.limits`.
"""

from akv.launch.args import LaunchOptions
from akv.launch.command import launch, main

__all__ = ["LaunchOptions", "launch", "main"]
