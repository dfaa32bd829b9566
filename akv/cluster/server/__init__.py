"""The parameter server (``akv-server``, ``python -m akv.cluster.server``)."""

from akv.cluster.server.command import main
from akv.cluster.server.service import ParameterServer

__all__ = ["ParameterServer", "main"]
