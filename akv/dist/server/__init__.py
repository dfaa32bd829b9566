"""The parameter server (``akv-server``, ``python -m akv.dist.server``)."""

from akv.dist.server.service import ParameterServer, main

__all__ = ["ParameterServer", "main"]
