"""Every limit of akv's stores, servers and scheduler, named once, with its unit.

A limit that a user may change names the environment variable that overrides it; the
variable is read where the limit is used: when a store is created (``AKV_INLINE_MAX_BYTES``,
``AKV_ENGINE_SLOTS``, ``AKV_DIST_SLOTS``) or when a distributed process reads its
configuration (:func:`akv.cluster.config.from_env`, every other variable). The launcher's own
limits live in :mod:`akv.launch.limits`. Nothing here does I/O.
"""

from __future__ import annotations

import os

# ---------------------------------------------------------------- the store faces

#: Array work on at most this many bytes runs inline on the caller's thread of an
#: AsyncKVStore (and on a server's loop); bigger work runs on the engine's worker threads.
#: A thread hop costs about as much as copying 3 MB, so below 16 MiB (under 2 ms of
#: copying) inline wins. ``AKV_INLINE_MAX_BYTES``.
INLINE_MAX_BYTES = 16 << 20
#: Engine slots (tasks running at once) of a local store. ``AKV_ENGINE_SLOTS``.
ENGINE_SLOTS = max(4, os.cpu_count() or 1)
#: Engine slots of a distributed store: requests in flight at once (bounds the bytes queued
#: on the network, so that priority decides what goes first). A dist_sync pull holds its
#: slot while it waits for the other workers' pushes, so keep it above the number of pulls
#: a program leaves in flight without awaiting them. ``AKV_DIST_SLOTS``.
DIST_ENGINE_SLOTS = 64
#: Pushes a worker leaves unacknowledged (pipelined) before a push waits for its own
#: acknowledgement: each holds its staging copy until then.
MAX_UNACKED_PUSHES = 256
#: In dist_sync, a value larger than this that would travel on a TCP stream is not asked
#: for ahead with its push (``AKV_PULL_AHEAD``): copying it from the key's buffer into the
#: pull's output costs more than the round trip it saves. On a shared-memory stream the
#: value waits in the server's arena and the pull copies it once, at any size.
AHEAD_COPY_MAX_BYTES = 1 << 20

# ---------------------------------------------------------------- deadlines (seconds)

#: How long a node keeps trying to reach the scheduler and the others, and how long a
#: worker's init waits for rank 0's values. ``AKV_CONNECT_TIMEOUT_S``.
CONNECT_TIMEOUT_S = 60.0
#: How long a barrier waits for every worker. ``AKV_BARRIER_TIMEOUT_S``.
BARRIER_TIMEOUT_S = 300.0
#: How long a sync round (and a pull waiting for it) waits for every worker's push.
#: ``AKV_ROUND_TIMEOUT_S``.
ROUND_TIMEOUT_S = 300.0
#: How long one request to a server or the scheduler may take. ``AKV_REQUEST_TIMEOUT_S``.
REQUEST_TIMEOUT_S = 300.0
#: How often every node tells the scheduler it is alive. ``AKV_HEARTBEAT_INTERVAL_S``.
HEARTBEAT_INTERVAL_S = 1.0
#: After how long without a heartbeat a node counts as dead. ``AKV_HEARTBEAT_TIMEOUT_S``.
HEARTBEAT_TIMEOUT_S = 10.0
#: How long a worker whose stream to a server was cut asks the scheduler who failed,
#: before it fails the job naming that server.
BLAME_TIMEOUT_S = 2.0
#: How long a server waits for a worker whose stream was cut to reconnect before it
#: reports the worker lost (the worker itself keeps reconnecting, with backoff, until its
#: requests' deadline). ``AKV_RECONNECT_GRACE_S``.
RECONNECT_GRACE_S = 5.0
#: A stream's end that has written nothing for this long sends a keepalive (a 16-byte
#: frame), so that a live peer is never silent for longer. ``AKV_STREAM_KEEPALIVE_S``.
STREAM_KEEPALIVE_S = 5.0
#: A stream that received nothing at all (not a keepalive, not a byte of a payload) for
#: this long is cut as silent, as a reset would cut it: the worker opens it again and
#: resends. Four keepalive intervals: a live peer whose loop is blocked for up to 15 s is
#: not cut, and a path that holds the connection but carries nothing is found within 20 s
#: instead of at a 300 s request deadline. The servers' settings govern each stream (the
#: workers adopt them). ``AKV_STREAM_SILENT_S``.
STREAM_SILENT_S = 20.0
#: A worker's first wait before reconnecting a cut stream, and the longest wait between
#: attempts (the wait doubles after each failed attempt).
RECONNECT_FIRST_S = 0.02
RECONNECT_MAX_S = 1.0
#: How many attempts in a row to open a cut stream again a worker makes when each one
#: connects and then hears nothing (no answer to its upgrade before its deadline), before
#: it names the server unreachable instead of trying for the whole request window: a
#: server that answers nobody for that long is gone (its heartbeats stop too). Not for a
#: server that writes checkpoints: its restart is awaited for the window.
RECONNECT_SILENT_ATTEMPTS = 3
#: How long the scheduler waits for a dead server that writes checkpoints to come back
#: (restarted with the same rank and checkpoint directory) before the job fails.
#: ``AKV_RESTART_WINDOW_S``.
RESTART_WINDOW_S = 60.0
#: How often a server with a checkpoint directory writes a checkpoint (when anything
#: changed since the last one). ``AKV_CHECKPOINT_INTERVAL_S``.
CHECKPOINT_INTERVAL_S = 30.0
#: How long a stopping server may take to write its final checkpoint.
FINAL_CHECKPOINT_S = 60.0
#: How often that worker asks again while the scheduler knows no failure yet.
VERDICT_POLL_S = 0.1
#: After SIGTERM or Ctrl-C, how long a server lets its work in flight finish and a
#: scheduler keeps answering (so that every node hears why the job failed).
DRAIN_S = 2.0
#: A heartbeat request's own deadline: this many heartbeat intervals, at least
#: :data:`MIN_HEARTBEAT_REQUEST_S`.
HEARTBEAT_REQUEST_INTERVALS = 5
MIN_HEARTBEAT_REQUEST_S = 5.0
#: How much longer than the connect timeout a worker's init waits for a server's answer
#: (the server itself answers at the connect timeout).
INIT_CHECK_MARGIN_S = 5.0
#: How long a leaving node waits for each goodbye (to a server, to the scheduler).
GOODBYE_TIMEOUT_S = 10.0
#: How long a worker whose code failed waits for the scheduler to take its report.
REPORT_FAILURE_S = 5.0
#: How long a store that leaves after its caller's code failed may take in all (the
#: report, failing the work in flight, closing the streams); past it the caller's
#: exception propagates anyway.
LEAVE_FAILED_S = 20.0
#: How long the worker's heartbeat thread may take to stop, beyond one interval.
HEARTBEAT_STOP_S = 6.0

# ---------------------------------------------------------------- polling (seconds)

#: How long a node waits between attempts while the job assembles.
CONNECT_RETRY_S = 0.2
#: How often a worker checks its outstanding requests against their deadlines.
SWEEP_INTERVAL_S = 0.25
#: How often a server looks for rounds and init waits that waited too long.
ROUND_CHECK_INTERVAL_S = 0.5
#: How long the scheduler holds a register or barrier request before it answers
#: "still waiting".
SCHEDULER_POLL_S = 2.0
#: How often the scheduler looks for silent nodes (and sooner when a node finished or was
#: lost: whether the job is over).
SCHEDULER_CHECK_INTERVAL_S = 0.5
#: Once the job ended well, how long the scheduler still answers (the last nodes' goodbyes)
#: before it exits.
SCHEDULER_END_CHECK_S = 0.05
#: After the job failed or ended, how long the scheduler stays up so every node hears it.
SCHEDULER_LINGER_S = 3.0

# ---------------------------------------------------------------- sizes

#: Arrays with at least this many elements are split over all servers (MXNet's
#: ``MXNET_KVSTORE_BIGARRAY_BOUND``). ``AKV_BIGARRAY_BOUND``.
BIGARRAY_BOUND = 1_000_000
#: Largest HTTP request body a server or the scheduler accepts (bytes); 413 past it.
#: ``AKV_MAX_BODY_BYTES``.
MAX_BODY_BYTES = 64 << 20
#: Largest frame payload a stream accepts (bytes).
MAX_PAYLOAD_BYTES = 16 << 30
#: Pull answers up to this many bytes are copied and sent at once; bigger ones are sent
#: from the stored arrays themselves, held for reading until the kernel took the bytes.
SMALL_REPLY_BYTES = 64 << 10
#: A pull answer of at least this many bytes to a worker that shares memory with its server
#: is copied into the stream's arena by a thread of the server's engine: the answers of a
#: round to several workers are copied at once, and the loop is not held meanwhile.
STAGED_REPLY_MIN_BYTES = 8 << 20
#: A server's sum of at least this many bytes is split in two halves added at once, by the
#: engine thread and a helper thread (the workers wait for it: their cores are free). On
#: the 2-core machine a 64 MiB round gained ~5%; a 4 MiB one lost more to the thread hop.
SPLIT_ADD_MIN_BYTES = 16 << 20
#: Engine slots of a server.
SERVER_ENGINE_SLOTS = max(4, os.cpu_count() or 1)
#: A worker keeps each push to a server that writes checkpoints until a checkpoint holds
#: it; once it keeps more than this many bytes for one server, it asks that server for a
#: checkpoint now (so what it keeps is about this much, plus what is pushed while one
#: checkpoint is written). ``AKV_RETAIN_BYTES``.
RETAIN_BYTES = 256 << 20
#: Each side's shared-memory arena on a stream between processes on one host
#: (``AKV_SHM_ARENA_BYTES``): its pages take memory only once used, and a region is taken
#: from the lowest free offset, so a stream holds about what it had in flight at most.
SHM_ARENA_BYTES = 1 << 30
#: The shortest token a job accepts (characters). ``AKV_TOKEN`` sets the token.
MIN_TOKEN_CHARS = 16
#: How much longer than the connect timeout the scheduler (from its start) and a server
#: (from when it serves; twice this) wait for every worker and server to join before the
#: job fails, naming the ranks that never registered.
STARTUP_MARGIN_S = 2.0

# ---------------------------------------------------------------- connections

#: A connection to a server or the scheduler that has not sent a whole HTTP request header
#: this long after it opened (or after its last answer, when kept alive), or whose request
#: body sent nothing this long, is closed (seconds). A worker's upgraded stream is never
#: closed for being idle. ``AKV_IDLE_TIMEOUT_S``.
IDLE_TIMEOUT_S = 10.0
#: Authenticated connections (a request on them carried the job's token) one IP address may
#: hold open at once to a server or the scheduler, streams included: a bound on a buggy
#: process of the job (about 3 per process on a host). A new connection from an address
#: that holds this many is closed as soon as it is accepted; connections without the token
#: never count against it. It also caps :data:`MAX_STRANGERS_PER_PEER` (before issue #24 it
#: bounded every connection of an address together, at 64). ``AKV_MAX_CONNECTIONS_PER_PEER``.
MAX_CONNECTIONS_PER_PEER = 256
#: Connections that have not (yet) sent a request with the token, per IP address, each for
#: the idle timeout at most. A new connection that finds them all taken is on probation:
#: closed unless it sends a request with the token within half a second (a job's own
#: connection sends one at once; ``akv_transport.DEFAULT_PROBATION_S``).
#: ``AKV_MAX_STRANGERS_PER_PEER``.
MAX_STRANGERS_PER_PEER = 64
#: The same, all addresses together: bounds the descriptors strangers hold whatever
#: addresses they come from. ``AKV_MAX_STRANGERS``.
MAX_STRANGERS = 256
