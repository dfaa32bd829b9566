"""``akv bench device``: the device store on a GPU, against floors measured in the same run.

Every floor comes from this run on this GPU, never from a data sheet:

* the **bytes-moved floor** of the reduce, SGD and Adam rows is the bytes the operation must
  read and write, divided by the bandwidth of a device-to-device copy (``cudaMemcpyAsync`` of
  1 GiB or more, timed with CUDA events on one stream, counting the bytes read and written);
  the same work written in plain CuPy (``+``, one ``ElementwiseKernel`` per update) is timed
  beside it;
* the **staging** rows time host-to-device and device-to-host copies from pageable memory and
  through akv's host store (one way, and there and back) against the same copies from pinned
  memory (``cupyx.empty_pinned``), timed with CUDA events;
* the **small-key** and **engine** rows compare wall-clock latencies with plain CuPy copies
  (two, as the push's and the pull's) or adds followed by a stream synchronize (the
  chained engine row: a chain of tasks on one var against as many plain adds and one
  synchronize).

akv's own times are host wall-clock per call, up to the end of its GPU work: a push to a
device key that nothing else uses queues its work on the caller's CUDA stream and returns,
so the update rows synchronize that stream after each push (and time their plain CuPy
update the same way, with a synchronize of its stream). Each time is the median of several
rounds (:func:`akv.bench.configure`: fewer rounds and smaller buffers with ``--quick``, a
smoke run rather than a measurement).

CuPy is imported only inside :func:`run`: this module imports on a machine without it, and
:func:`run` raises :class:`akv.BenchmarkError` there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import akv
from akv.arrays import cupy_module
from akv.bench._report import _SETTINGS, Row, Table, _plan, compare
from akv.errors import BenchmarkError
from akv_engine import Engine, GPUExecutor, gpu_available

__all__ = [
    "DeviceRow",
    "Sizes",
    "adam_floor_bytes",
    "bytes_per_second",
    "copy_bytes",
    "floor_seconds",
    "reduce_floor_bytes",
    "require_gpu",
    "run",
    "sgd_floor_bytes",
    "sizes",
]

MIB = 1 << 20
GIB = 1 << 30
GB = 1e9

#: The targets (issue #28).
REDUCE_TARGET_RATIO = 1.5
SGD_TARGET_RATIO = 2.0
ADAM_TARGET_RATIO = 2.0
SMALL_KEY_TARGET_S = 60e-6
#: A round trip through a host store at 80% of the pinned copies' speed, or better.
ROUND_TRIP_TARGET_RATIO = 1 / 0.8
CHAINED_TASK_TARGET_S = 40e-6
#: Tasks per chain in the chained engine row.
CHAIN_TASKS = 64
#: What pinned copies reach each way on PCIe Gen5 x16 hosts (nvbandwidth on H100 machines):
#: a third-party figure quoted beside this run's own pinned measurement, never a floor.
PINNED_EXPECTED_GB_PER_S = 55.0

NUM_REDUCE_ARRAYS = 4
SMALL_KEY_FLOATS = 4
SGD_LEARNING_RATE = 0.01
#: Rounds per measurement in full mode (``akv.bench.configure(quick=False)``).
FULL_MODE_ROUNDS = 5
#: How long a GPU task may take in the engine rows before the run is declared stuck.
TASK_TIMEOUT_S = 60.0

# cudaMemcpyKind
_H2D, _D2H, _D2D = 1, 2, 3

INSTALL_HINT = "pip install 'akvstore[gpu]' (CuPy's wheel for CUDA 12: cupy-cuda12x)"


@dataclass(frozen=True)
class Sizes:
    """How large the buffers of each benchmark are."""

    #: The device-to-device floor and the staging rows (1 GiB or more in full mode, so that
    #: the copies are not served by the GPU's L2 cache).
    bandwidth_bytes: int
    #: Each array of the reduce and SGD rows.
    array_bytes: int
    #: Whether this is a smoke run (``--quick``).
    quick: bool


def sizes(quick: bool) -> Sizes:
    """The buffer sizes of a full run (1 GiB, 64 MiB) or of a quick one (256 MiB, 16 MiB)."""
    if quick:
        return Sizes(bandwidth_bytes=256 * MIB, array_bytes=16 * MIB, quick=True)
    return Sizes(bandwidth_bytes=GIB, array_bytes=64 * MIB, quick=False)


def copy_bytes(nbytes: int) -> int:
    """Bytes a copy of ``nbytes`` moves through memory: it reads them and writes them."""
    return 2 * nbytes


def reduce_floor_bytes(num_arrays: int, nbytes: int) -> int:
    """Bytes that summing ``num_arrays`` arrays of ``nbytes`` each, then pulling, must move.

    The reduce reads every source and writes the sum once (``num_arrays + 1`` times
    ``nbytes``); the pull reads the sum and writes the output (2 times ``nbytes``).
    """
    return (num_arrays + 1) * nbytes + 2 * nbytes


def sgd_floor_bytes(nbytes: int) -> int:
    """Bytes an SGD update of an ``nbytes`` weight must move: read w and g, write w."""
    return 3 * nbytes


def adam_floor_bytes(nbytes: int) -> int:
    """Bytes an Adam update of an ``nbytes`` weight must move: read w, g, mean and var,
    write w, mean and var."""
    return 7 * nbytes


def bytes_per_second(nbytes: int, seconds: float) -> float:
    """``nbytes / seconds``; infinite when ``seconds`` is not positive."""
    return nbytes / seconds if seconds > 0 else float("inf")


def floor_seconds(nbytes: int, bytes_per_s: float) -> float:
    """The time ``nbytes`` take at ``bytes_per_s``; infinite when the rate is not positive."""
    return nbytes / bytes_per_s if bytes_per_s > 0 else float("inf")


@dataclass
class DeviceRow(Row):
    """A :class:`Row` with what a GPU row adds; the JSON carries these fields too.

    ``gb_per_s`` is ``bytes_moved / akv_s`` and ``floor_gb_per_s`` the bandwidth the floor
    was measured at (both in 10^9 bytes per second; None where bytes make no sense).
    ``cupy_s``: the same work written directly in CuPy, timed with CUDA events (the update
    rows: host wall-clock with a synchronize, as their pushes; None where there is none).
    ``target``: the issue's target for the row; ``met``: whether this run met it (None
    where the target is not a number to compare with).
    """

    bytes_moved: int = 0
    gb_per_s: float | None = None
    floor_gb_per_s: float | None = None
    cupy_s: float | None = None
    target: str = ""
    met: bool | None = None


def require_gpu() -> Any:
    """The ``cupy`` module, when CuPy imports and sees at least one GPU.

    Raises
    ------
    BenchmarkError
        CuPy is not installed, or it sees no GPU.
    """
    cupy = cupy_module()
    if cupy is None:
        reason = "CuPy is not installed"
    elif not gpu_available():
        reason = "CuPy sees no CUDA GPU"
    else:
        return cupy
    raise BenchmarkError(
        f"the device benchmarks need CuPy and a CUDA GPU, and {reason}: {INSTALL_HINT}"
    )


def run() -> Table:
    """Measure the device store on GPU 0 against floors measured in this run; the table.

    Raises
    ------
    BenchmarkError
        Without CuPy or a GPU (before anything is measured), or when a store computes a
        wrong result.
    """
    cupy = require_gpu()
    plan = sizes(quick=_SETTINGS["rounds"] < FULL_MODE_ROUNDS)
    with cupy.cuda.Device(0):
        table = Table(f"akv bench device ({_device_name(cupy)}, float32; times per call)")
        stream = cupy.cuda.Stream(non_blocking=True)
        d2d_s = _d2d_copy_seconds(cupy, stream, plan.bandwidth_bytes)
        d2d_bytes_per_s = bytes_per_second(copy_bytes(plan.bandwidth_bytes), d2d_s)
        _free(cupy)
        _reduce_row(table, cupy, stream, plan, d2d_bytes_per_s)
        _free(cupy)
        _sgd_row(table, cupy, stream, plan, d2d_bytes_per_s)
        _free(cupy)
        _adam_row(table, cupy, stream, plan, d2d_bytes_per_s)
        _free(cupy)
        _small_key_row(table, cupy)
        _free(cupy)
        staging_note = _staging_rows(table, cupy, stream, plan)
        _free(cupy)
        _completion_rows(table, cupy)
        _free(cupy)
    _add_notes(table, plan, d2d_s, d2d_bytes_per_s, staging_note)
    return table


# ---------------------------------------------------------------------------- timing


def _event_compare(cupy: Any, stream: Any, *fns: Callable[[], object]) -> list[float]:
    """Median seconds per call of the GPU work each function enqueues on ``stream``.

    Timed with CUDA events recorded on ``stream`` around each round, in alternating rounds
    (the plan of :func:`akv.bench.compare`), after two warm-up calls each.
    """
    _settle(cupy)
    for fn in fns:
        fn()
        fn()
    stream.synchronize()
    start, end = cupy.cuda.Event(block=True), cupy.cuda.Event(block=True)
    plan = _plan(len(fns), _SETTINGS["rounds"], _SETTINGS["min_round_s"])
    index, calls = next(plan)
    try:
        while True:
            fn = fns[index]
            start.record(stream)
            for _ in range(calls):
                fn()
            end.record(stream)
            end.synchronize()
            elapsed_s = float(cupy.cuda.get_elapsed_time(start, end)) / 1e3
            index, calls = plan.send(elapsed_s)
    except StopIteration as done:
        medians: list[float] = done.value
        return medians


def _memcpy(cupy: Any, stream: Any, dst: int, src: int, nbytes: int, kind: int) -> None:
    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


def _d2d_copy_seconds(cupy: Any, stream: Any, nbytes: int) -> float:
    """Seconds per device-to-device copy of ``nbytes`` (events on ``stream``)."""
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    src_ptr, dst_ptr = src.data.ptr, dst.data.ptr

    def copy() -> None:
        _memcpy(cupy, stream, dst_ptr, src_ptr, nbytes, _D2D)

    (seconds,) = _event_compare(cupy, stream, copy)
    return seconds


# ---------------------------------------------------------------------------- rows


def _reduce_row(table: Table, cupy: Any, stream: Any, plan: Sizes, d2d_bytes_per_s: float) -> None:
    nbytes = plan.array_bytes
    count = nbytes // 4
    parts = [cupy.full(count, i + 1, dtype=cupy.float32) for i in range(NUM_REDUCE_ARRAYS)]
    out = cupy.zeros(count, dtype=cupy.float32)
    expected = float(sum(range(1, NUM_REDUCE_ARRAYS + 1)))
    name = f"reduce {NUM_REDUCE_ARRAYS} x {_size(nbytes)} + pull"
    _settle(cupy)
    with akv.create("device") as kv:
        kv.init("reduce", cupy.zeros(count, dtype=cupy.float32))

        def push_pull() -> None:
            kv.push("reduce", parts)
            kv.pull("reduce", out=out)

        push_pull()
        _check(cupy, name, out, expected)
        (akv_s,) = compare(push_pull)

    merge = cupy.empty_like(out)
    reference_out = cupy.empty_like(out)

    def cupy_reduce() -> None:
        with stream:
            cupy.add(parts[0], parts[1], out=merge)
            for part in parts[2:]:
                cupy.add(merge, part, out=merge)
        _memcpy(cupy, stream, reference_out.data.ptr, merge.data.ptr, nbytes, _D2D)

    (cupy_s,) = _event_compare(cupy, stream, cupy_reduce)
    moved = reduce_floor_bytes(NUM_REDUCE_ARRAYS, nbytes)
    table.add(
        _bandwidth_row(
            name,
            akv_s,
            moved,
            d2d_bytes_per_s,
            f"{_size(moved)} at D2D copy speed",
            target=f"within {REDUCE_TARGET_RATIO}x of the floor",
            cupy_s=cupy_s,
            max_ratio=REDUCE_TARGET_RATIO,
        )
    )


def _sgd_row(table: Table, cupy: Any, stream: Any, plan: Sizes, d2d_bytes_per_s: float) -> None:
    kernel = cupy.ElementwiseKernel("T g, T lr", "T w", "w -= lr * g", "akv_bench_sgd")
    _update_row(
        table,
        cupy,
        stream,
        plan,
        d2d_bytes_per_s,
        "SGD",
        akv.optimizer.SGD(learning_rate=SGD_LEARNING_RATE),
        lambda grad, weight: kernel(grad, cupy.float32(SGD_LEARNING_RATE), weight),
        sgd_floor_bytes,
        SGD_TARGET_RATIO,
    )


def _adam_row(table: Table, cupy: Any, stream: Any, plan: Sizes, d2d_bytes_per_s: float) -> None:
    kernel = cupy.ElementwiseKernel(
        "T g, T lr, T beta1, T beta2, T eps",
        "T w, T m, T v",
        "m = beta1 * m + (1 - beta1) * g; v = beta2 * v + (1 - beta2) * g * g; "
        "w -= lr * m / (sqrt(v) + eps)",
        "akv_bench_adam",
    )
    f32 = cupy.float32
    scalars = (f32(SGD_LEARNING_RATE), f32(0.9), f32(0.999), f32(1e-8))
    states: list[Any] = []

    def adam(grad: Any, weight: Any) -> None:
        if not states:
            states.extend((cupy.zeros_like(weight), cupy.zeros_like(weight)))
        kernel(grad, *scalars, weight, *states)

    _update_row(
        table,
        cupy,
        stream,
        plan,
        d2d_bytes_per_s,
        "Adam",
        akv.optimizer.Adam(learning_rate=SGD_LEARNING_RATE),
        adam,
        adam_floor_bytes,
        ADAM_TARGET_RATIO,
    )


def _update_row(
    table: Table,
    cupy: Any,
    stream: Any,
    plan: Sizes,
    d2d_bytes_per_s: float,
    what: str,
    optimizer: akv.optimizer.Optimizer,
    plain: Callable[[Any, Any], None],
    floor_bytes: Callable[[int], int],
    max_ratio: float,
) -> None:
    """A push of one gradient into a device store with ``optimizer``, against the bytes
    the update must move and against ``plain(grad, weight)``, the update in plain CuPy.

    Each push is followed by a synchronize of the caller's stream (the push queues the
    update there and returns), and the plain update by one of its stream: both are host
    wall-clock times of the finished update, in alternating rounds."""
    nbytes = plan.array_bytes
    count = nbytes // 4
    grad = cupy.full(count, 1e-3, dtype=cupy.float32)
    weight = cupy.ones(count, dtype=cupy.float32)
    current = cupy.cuda.get_current_stream()
    with akv.create("device") as kv:
        kv.init(0, cupy.ones(count, dtype=cupy.float32))
        kv.set_optimizer(optimizer)
        _settle(cupy)

        def push() -> None:
            # A push to a key nothing else uses queues the update on the caller's stream
            # and returns: wait for it, so that the time is the update's, not the queuing.
            kv.push(0, grad)
            current.synchronize()

        def cupy_update() -> None:
            with stream:
                plain(grad, weight)
            stream.synchronize()

        # Both timed alike: host wall-clock up to the end of the GPU work, alternating rounds.
        akv_s, cupy_s = compare(push, cupy_update)
    moved = floor_bytes(nbytes)
    table.add(
        _bandwidth_row(
            f"{what} update {_size(nbytes)} (push)",
            akv_s,
            moved,
            d2d_bytes_per_s,
            f"{_size(moved)} at D2D copy speed",
            target=f"within {max_ratio}x of the floor",
            cupy_s=cupy_s,
            max_ratio=max_ratio,
        )
    )


def _small_key_row(table: Table, cupy: Any) -> None:
    value = cupy.ones(SMALL_KEY_FLOATS, dtype=cupy.float32)
    out = cupy.zeros_like(value)
    stored = cupy.zeros_like(value)
    copy_out = cupy.zeros_like(value)
    current = cupy.cuda.get_current_stream()
    name = f"small key ({SMALL_KEY_FLOATS} floats) push+pull"
    _settle(cupy)
    with akv.create("device") as kv:
        kv.init("small", cupy.zeros_like(value))

        def push_pull() -> None:
            kv.push("small", value)
            kv.pull("small", out=out)

        push_pull()
        _check(cupy, name, out, 1.0)

        def cupy_copies() -> None:
            # The same device copies as akv's push and pull: into the stored value, out.
            cupy.copyto(stored, value)
            cupy.copyto(copy_out, stored)
            current.synchronize()

        akv_s, floor_s = compare(push_pull, cupy_copies)
    table.add(
        DeviceRow(
            name,
            akv_s,
            floor_s,
            "2 cupy.copyto (push, pull) + synchronize",
            target=f"under {SMALL_KEY_TARGET_S * 1e6:.0f} us (the akv time itself)",
            met=akv_s < SMALL_KEY_TARGET_S,
        )
    )


def _staging_rows(table: Table, cupy: Any, stream: Any, plan: Sizes) -> str:
    """Add the staging rows; return a note with the pinned copies' bandwidth."""
    import cupyx

    nbytes = plan.bandwidth_bytes
    size = _size(nbytes)
    device_buffer = cupy.ones(nbytes, dtype=cupy.uint8)
    pinned = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    pinned.fill(1)
    pageable = np.ones(nbytes, dtype=np.uint8)  # written, so its pages exist before timing
    device_ptr = device_buffer.data.ptr

    def to_device(host: np.ndarray) -> Callable[[], None]:
        host_ptr = host.ctypes.data
        return lambda: _memcpy(cupy, stream, device_ptr, host_ptr, nbytes, _H2D)

    def to_host(host: np.ndarray) -> Callable[[], None]:
        host_ptr = host.ctypes.data
        return lambda: _memcpy(cupy, stream, host_ptr, device_ptr, nbytes, _D2H)

    pinned_h2d, pageable_h2d, pinned_d2h, pageable_d2h = _event_compare(
        cupy, stream, to_device(pinned), to_device(pageable), to_host(pinned), to_host(pageable)
    )
    del pinned, pageable
    target = f"pinned speed (about {PINNED_EXPECTED_GB_PER_S:.0f} GB/s each way on PCIe Gen5)"
    for direction, pageable_s, pinned_s in (
        ("H2D", pageable_h2d, pinned_h2d),
        ("D2H", pageable_d2h, pinned_d2h),
    ):
        table.add(
            _bandwidth_row(
                f"{direction} {size}, pageable host memory (raw)",
                pageable_s,
                nbytes,
                bytes_per_second(nbytes, pinned_s),
                f"pinned {direction} (cupyx.empty_pinned)",
                target="-",
            )
        )

    # akv's staging path: a host store given a CuPy value, pulled into a CuPy output.
    count = nbytes // 4
    value = cupy.ones(count, dtype=cupy.float32)
    out = cupy.zeros(count, dtype=cupy.float32)
    _settle(cupy)
    with akv.create("local") as kv:
        kv.init("staged", np.zeros(count, dtype=np.float32))
        (push_s,) = compare(lambda: kv.push("staged", value))
        (pull_s,) = compare(lambda: kv.pull("staged", out=out))

        def there_and_back() -> None:
            kv.push("staged", value)
            kv.pull("staged", out=out)

        (round_trip_s,) = compare(there_and_back)
    _check(cupy, f"pull {size} from a host store", out, 1.0)
    table.add(
        _bandwidth_row(
            f"akv push {size} CuPy to a host key (D2H)",
            push_s,
            nbytes,
            bytes_per_second(nbytes, pinned_d2h),
            "pinned D2H (cupyx.empty_pinned)",
            target=target,
        )
    )
    table.add(
        _bandwidth_row(
            f"akv pull {size} host key into CuPy (H2D)",
            pull_s,
            nbytes,
            bytes_per_second(nbytes, pinned_h2d),
            "pinned H2D (cupyx.empty_pinned)",
            target=target,
        )
    )
    table.add(
        _bandwidth_row(
            f"akv CuPy to a host key and back, {size}",
            round_trip_s,
            2 * nbytes,
            bytes_per_second(2 * nbytes, pinned_d2h + pinned_h2d),
            "pinned D2H + pinned H2D",
            target="at least 80% of the pinned copies' speed",
            max_ratio=ROUND_TRIP_TARGET_RATIO,
        )
    )
    return (
        f"Pinned floors: {size} H2D in {_seconds(pinned_h2d)} = "
        f"{bytes_per_second(nbytes, pinned_h2d) / GB:.1f} GB/s, D2H in {_seconds(pinned_d2h)} = "
        f"{bytes_per_second(nbytes, pinned_d2h) / GB:.1f} GB/s (each way; about "
        f"{PINNED_EXPECTED_GB_PER_S:.0f} GB/s is expected on PCIe Gen5 x16, a third-party "
        "figure). akv's staging rows go through a host ('local') store: a push copies the "
        "value into a pinned buffer of the key, which becomes the stored value; a pull "
        "copies from it."
    )


def _completion_rows(table: Table, cupy: Any) -> None:
    """A tiny GPU task through the engine, with each completion strategy of GPUExecutor."""
    current = cupy.cuda.get_current_stream()
    direct_buffer = cupy.zeros(SMALL_KEY_FLOATS, dtype=cupy.float32)

    def direct() -> None:
        cupy.add(direct_buffer, 1, out=direct_buffer)
        current.synchronize()

    _chained_row(table, cupy, current)
    for completion in ("host_func", "waiter"):
        eng = Engine()
        try:
            eng.register_executor("gpu", GPUExecutor(completion=completion))
            var = eng.new_var()
            buffer = cupy.zeros(SMALL_KEY_FLOATS, dtype=cupy.float32)

            def tiny(ctx: Any, buffer: Any = buffer) -> None:
                cupy.add(buffer, 1, out=buffer)

            def via_engine(eng: Engine = eng, var: Any = var) -> None:
                eng.push(tiny, writes=(var,), executor="gpu").result(TASK_TIMEOUT_S)

            akv_s, floor_s = compare(via_engine, direct)
        finally:
            eng.close(timeout=TASK_TIMEOUT_S)
        table.add(
            DeviceRow(
                f"engine GPU task, completion={completion}",
                akv_s,
                floor_s,
                "cupy.add + synchronize",
                target="- (compares the two strategies)",
            )
        )


def _chained_row(table: Table, cupy: Any, current: Any) -> None:
    """A chain of tiny GPU tasks on one var (each starts once the previous completed),
    per task, against as many plain adds and one synchronize."""
    direct_buffer = cupy.zeros(SMALL_KEY_FLOATS, dtype=cupy.float32)

    def direct() -> None:
        for _ in range(CHAIN_TASKS):
            cupy.add(direct_buffer, 1, out=direct_buffer)
        current.synchronize()

    eng = Engine()
    try:
        eng.register_executor("gpu", GPUExecutor())
        var = eng.new_var()
        buffer = cupy.zeros(SMALL_KEY_FLOATS, dtype=cupy.float32)

        def tiny(ctx: Any) -> None:
            cupy.add(buffer, 1, out=buffer)

        def chain() -> None:
            last = None
            for _ in range(CHAIN_TASKS):
                last = eng.push(tiny, writes=(var,), executor="gpu")
            assert last is not None
            last.result(TASK_TIMEOUT_S)

        chain_s, direct_s = compare(chain, direct)
    finally:
        eng.close(timeout=TASK_TIMEOUT_S)
    per_task_s = chain_s / CHAIN_TASKS
    table.add(
        DeviceRow(
            f"engine GPU task, chained ({CHAIN_TASKS} on one var, per task)",
            per_task_s,
            direct_s / CHAIN_TASKS,
            "cupy.add per launch (one synchronize per chain)",
            target=f"under {CHAINED_TASK_TARGET_S * 1e6:.0f} us per task",
            met=per_task_s < CHAINED_TASK_TARGET_S,
        )
    )


# ---------------------------------------------------------------------------- helpers


def _bandwidth_row(
    name: str,
    akv_s: float,
    moved: int,
    floor_bytes_per_s: float,
    floor: str,
    *,
    target: str,
    cupy_s: float | None = None,
    max_ratio: float | None = None,
) -> DeviceRow:
    row = DeviceRow(
        name,
        akv_s,
        floor_seconds(moved, floor_bytes_per_s),
        floor,
        bytes_moved=moved,
        gb_per_s=bytes_per_second(moved, akv_s) / GB,
        floor_gb_per_s=floor_bytes_per_s / GB,
        cupy_s=cupy_s,
        target=target,
    )
    if max_ratio is not None:
        row.met = row.ratio <= max_ratio
    return row


def _add_notes(
    table: Table, plan: Sizes, d2d_s: float, d2d_bytes_per_s: float, staging_note: str
) -> None:
    notes = table.notes
    notes.append("")
    if plan.quick:
        notes.append("QUICK MODE: smaller buffers and 2 rounds: a smoke run, not a measurement.")
    notes.append(
        f"D2D floor: cudaMemcpyAsync of {_size(plan.bandwidth_bytes)} in "
        f"{_seconds(d2d_s)} = {d2d_bytes_per_s / GB:.0f} GB/s counting bytes read and written "
        "(CUDA events on one stream, median of rounds)."
    )
    notes.append(staging_note)
    notes.append(
        "akv times are wall-clock per call up to the end of its GPU work (the update rows "
        "synchronize the caller's stream after each push, which only queues the update, and "
        "time their plain CuPy update the same way); bandwidth floors and the other plain "
        "CuPy times are CUDA-event times. The raw pageable rows time a pageable copy in the "
        "akv column against a pinned one."
    )
    for row in table.rows:
        if not isinstance(row, DeviceRow):
            continue
        parts = [f"- {row.name}:"]
        if row.gb_per_s is not None and row.floor_gb_per_s is not None:
            parts.append(
                f"{row.gb_per_s:.1f} GB/s of {_size(row.bytes_moved)} (floor at "
                f"{row.floor_gb_per_s:.1f} GB/s);"
            )
        if row.cupy_s is not None:
            parts.append(f"plain CuPy {_seconds(row.cupy_s)};")
        verdict = {True: " (met)", False: " (NOT met)", None: ""}[row.met]
        parts.append(f"target: {row.target}{verdict}")
        notes.append(" ".join(parts))


def _check(cupy: Any, what: str, out: Any, expected: float) -> None:
    got, last = float(cupy.asnumpy(out[0])), float(cupy.asnumpy(out[-1]))
    if got != expected or last != expected:
        raise BenchmarkError(f"{what}: the output holds {got} and {last}, expected {expected}")


def _settle(cupy: Any) -> None:
    """Wait for all work on the device: inputs made on the default stream are complete, and
    nothing left over runs into the next timing."""
    cupy.cuda.runtime.deviceSynchronize()


def _free(cupy: Any) -> None:
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _device_name(cupy: Any) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(0).get("name", "GPU 0")
    return name.decode() if isinstance(name, bytes) else str(name)


def _size(nbytes: int) -> str:
    if nbytes >= GIB and nbytes % GIB == 0:
        return f"{nbytes // GIB} GiB"
    return f"{nbytes // MIB} MiB"


def _seconds(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
