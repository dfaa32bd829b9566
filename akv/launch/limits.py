"""Every limit of akv-launch, named once, with its unit.

The store's, servers' and scheduler's limits are in :mod:`akv.limits`; these are the
launcher's own. Only ``DEFAULT_GRACE_S`` has a flag (``--grace-s``); no environment variable
overrides any of them. Nothing here does I/O.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_GRACE_S",
    "ENDED_GRACE_S",
    "MAX_LINE_BYTES",
    "MPI_VERSION_TIMEOUT_S",
    "NVIDIA_SMI_TIMEOUT_S",
    "OUTPUT_SETTLE_S",
    "POLL_INTERVAL_S",
    "PROGRESS_DELAY_S",
    "PROGRESS_POLL_S",
    "REPORT_EXIT_S",
    "REPORT_GRACE_S",
    "STATUS_REQUEST_TIMEOUT_S",
    "TERMINATE_GRACE_S",
    "TOKEN_BYTES",
    "TRACEBACK_MAX_LINES",
]

#: How long the scheduler and servers get to stop on their own once every worker exited 0,
#: before they are terminated (seconds; ``--grace-s``).
DEFAULT_GRACE_S = 15.0
#: When the scheduler or a server fails while workers run, how long the workers get to
#: notice, say which process failed, and exit on their own before the job is stopped
#: (seconds). akv's workers notice a dead server at once (its stream ends) and a dead
#: scheduler within AKV_HEARTBEAT_TIMEOUT_S.
REPORT_GRACE_S = 5.0
#: How long the processes still running when the job ended well (every worker exited, the
#: scheduler exited 0) get to stop, when one is a restarted server (seconds): a server ends
#: its own stop within moments, and a restart with no job left to register with would
#: wait out its connect timeout (or ``--grace-s``).
ENDED_GRACE_S = 2.0
#: How long akv-launch waits for the scheduler to take its report of a process that failed.
REPORT_EXIT_S = 2.0
#: How long a process group gets between SIGTERM and SIGKILL when the job is stopped, here
#: and in the ``ssh`` launcher's remote script (seconds).
TERMINATE_GRACE_S = 5.0
#: After a process exits, how long its last output lines may take to arrive before the
#: launcher reports the exit anyway (a grandchild may hold the pipe open) (seconds).
OUTPUT_SETTLE_S = 0.5
#: Longest piece of a child's output printed as one line; longer lines are split (bytes).
MAX_LINE_BYTES = 64 << 10
#: How many lines of a process's latest traceback the job's summary shows (the last ones).
TRACEBACK_MAX_LINES = 60
#: How often the supervisor looks at the clock and at process groups while it waits
#: (seconds).
POLL_INTERVAL_S = 0.05
#: While a job assembles, how often akv-launch asks the scheduler who has joined (seconds).
PROGRESS_POLL_S = 0.5
#: How long after the start akv-launch begins to print who has joined (a job that assembles
#: sooner prints only that every process joined) (seconds).
PROGRESS_DELAY_S = 1.0
#: How long one of those questions may take (seconds).
STATUS_REQUEST_TIMEOUT_S = 2.0
#: How long ``nvidia-smi -L`` may take (seconds).
NVIDIA_SMI_TIMEOUT_S = 10.0
#: How long ``mpirun --version`` may take (seconds).
MPI_VERSION_TIMEOUT_S = 10.0
#: Random bytes in a job token (``secrets.token_hex`` gives twice as many hex characters).
TOKEN_BYTES = 32
