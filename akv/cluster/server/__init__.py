"""The parameter server (``akv-server``, ``python -m akv.cluster.server``)."""

from akv.cluster.server.service import ParameterServer, main

__all__ = ["ParameterServer", "main"]
