"""Optimizers for akv's key-value store: MXNet 1.9.1's (and MXNet 2.0's AdamW), in pure
NumPy.

A store applies an optimizer through an :class:`Updater`, called as
``updater(key, grad, weight)``, which changes ``weight`` in place. Optimizers are described
by JSON-serialisable configs (:meth:`Optimizer.get_config`, :func:`from_config`) so that a
server in another process can rebuild them, and updater states travel in a portable,
pickle-free format (:meth:`Updater.dump_states`, :func:`encode_states`).

Example
-------
>>> import numpy as np
>>> from akv import optimizer
>>> updater = optimizer.get_updater(optimizer.create("sgd", learning_rate=0.1))
>>> weight = np.ones(3, np.float32)
>>> updater(0, np.ones(3, np.float32), weight)
>>> weight
array([0.9, 0.9, 0.9], dtype=float32)
"""

from akv.optimizer import lr_scheduler
from akv.optimizer._adam_variants import FTML, Adamax, AdamW, Nadam
from akv.optimizer._adaptive import FTRL, LAMB, AdaDelta, AdaGrad, Adam, RMSProp
from akv.optimizer._base import (
    Index,
    Optimizer,
    State,
    create,
    from_config,
    register,
)
from akv.optimizer._contrib import GroupAdaGrad
from akv.optimizer._kernels import (
    CHUNK_ELEMENTS,
)
from akv.optimizer._more import LBSGD, SGLD, Test, ccSGD
from akv.optimizer._sgd import DCASGD, LARS, NAG, SGD, Signum
from akv.optimizer._states import (
    STATE_FORMAT_NAME,
    STATE_FORMAT_VERSION,
    RowStates,
    SavedStates,
    decode_states,
    encode_states,
)
from akv.optimizer._updater import Updater, get_updater, keeps_states
from akv.optimizer.lr_scheduler import (
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    PolyScheduler,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "DCASGD",
    "FTML",
    "FTRL",
    "LAMB",
    "LARS",
    "LBSGD",
    "NAG",
    "SGD",
    "SGLD",
    "STATE_FORMAT_NAME",
    "STATE_FORMAT_VERSION",
    "AdaDelta",
    "AdaGrad",
    "Adam",
    "AdamW",
    "Adamax",
    "CosineScheduler",
    "FactorScheduler",
    "GroupAdaGrad",
    "Index",
    "LRScheduler",
    "MultiFactorScheduler",
    "Nadam",
    "Optimizer",
    "PolyScheduler",
    "RMSProp",
    "RowStates",
    "SavedStates",
    "Signum",
    "State",
    "Test",
    "Updater",
    "ccSGD",
    "create",
    "decode_states",
    "encode_states",
    "from_config",
    "get_updater",
    "keeps_states",
    "lr_scheduler",
    "register",
]
