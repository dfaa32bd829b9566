"""engine: a dependency engine for asyncio programs.

Tasks declare the :class:`Var` s they read and write; the engine runs them in an order
that respects those declarations (MXNet's versioned-var rules), by priority through a
bounded number of slots, on the loop (coroutines), on worker threads (plain functions),
inline, or on an executor registered for other hardware (:class:`GPUExecutor` runs
functions on CUDA streams). See :class:`Engine`.

This package never imports ``akv`` or ``akv_transport``.
"""

from akv_engine._engine import (
    DEFAULT_SLOTS,
    Engine,
    EngineClosedError,
    EngineError,
    EngineLoopClosedError,
    EngineStatistics,
)
from akv_engine._executors import (
    CallbackExecutor,
    DoneCallback,
    Executor,
    LoopExecutor,
    ThreadExecutor,
)
from akv_engine._gpu import (
    CudaDriver,
    CupyDriver,
    GPUContext,
    GPUExecutor,
    GPUStatistics,
    GPUWork,
    gpu_available,
)
from akv_engine._graph import to_dot
from akv_engine._loop import LoopThread, new_event_loop, uvloop_available
from akv_engine._task import Completed, Failure, Task, Waitable, gather, then
from akv_engine._var import Var

__all__ = [
    "DEFAULT_SLOTS",
    "CallbackExecutor",
    "Completed",
    "CudaDriver",
    "CupyDriver",
    "DoneCallback",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineLoopClosedError",
    "EngineStatistics",
    "Executor",
    "Failure",
    "GPUContext",
    "GPUExecutor",
    "GPUStatistics",
    "GPUWork",
    "LoopExecutor",
    "LoopThread",
    "Task",
    "ThreadExecutor",
    "Var",
    "Waitable",
    "gather",
    "gpu_available",
    "new_event_loop",
    "then",
    "to_dot",
    "uvloop_available",
]
