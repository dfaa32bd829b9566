"""``akv bench dist``: dist_sync with 2 workers on 127.0.0.1, against floors measured in the run.

The command runs real jobs through akv-launch (2 workers, 1 and then 2 servers). Each
worker runs the same fixed sequence of cases (a sync round needs every worker's push), and
worker 0 reports its times: per call for single keys and list calls, per step for the
ResNet-18 steps (62 arrays pushed and pulled as MXNet's Module does, see
:mod:`akv.bench.steps`). Every row reports the median and the p90 over the rounds.

Two floors are measured in the same run, before the jobs:

- raw TCP: an echo of the case's bytes between two processes (it moves the bytes once each
  way, as a push and a pull do, but with no second worker, no server work and no framing);
- memcpy (for the 4 MiB and 64 MiB rounds and the steps, in the shared-memory rows): the
  copies and the sum one worker's round needs in memory, done by NumPy in this process:
  the push's copy into a staging buffer, the server's sum of the second worker's
  contribution, the pull's copy out;
- raw TCP round (in the TCP rows): the same round written on plain blocking sockets, with
  the same processes (two clients, one summing server with a thread per client, see
  :mod:`akv.bench._raw`): what the round's bytes cost on TCP without akv;
- raw shared-memory round (in the shared-memory rows of one key's rounds, "floor 3"): the
  memcpy floor's copies and sum made by the round's three processes through one shared
  arena, woken by pipes (:class:`~akv.bench._raw.RawShmRound`): what the round costs
  through shared memory without akv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

import akv
from akv.args import Key
from akv.bench._raw import RawEcho, RawRound, RawShmRound, round_trip
from akv.bench._report import _SETTINGS, Row, Table, time_per_call
from akv.bench.soak import percentile, run_launcher
from akv.bench.steps import Shape, elements, list_step, per_key_step, resnet18_shapes

__all__ = [
    "Case",
    "copy_sum_copy",
    "default_cases",
    "launch_job",
    "measure",
    "memcpy_round",
    "round_case",
    "run",
    "step_cases",
    "worker_main",
]

KIB = 1 << 10
MIB = 1 << 20
FLOAT32_BYTES = 4
#: MXNet 1.9.1 (ps-lite) on this project's 2-core machine, 2 workers, per worker (per call,
#: per step for the steps).
MXNET_S = {
    ("push+pull 4 MiB", 1): 14.1e-3,
    ("push+pull 4 MiB", 2): 15.1e-3,
    ("push+pull 64 MiB", 1): 466e-3,
    ("push+pull 64 MiB", 2): 353e-3,
    ("small key (16 floats) push+pull", 1): 771e-6,
    ("small key (16 floats) pull", 1): 405e-6,
    # Issue #10's side-by-side run (the middle of its ranges: 108-121 ms and 109-113 ms).
    ("ResNet-18 step, per-key calls", 1): 114e-3,
    ("ResNet-18 step, list calls", 1): 111e-3,
}
SMALL_KEYS = 1000
#: A step case times one step per round, and runs this many times the rounds of the other
#: cases, so that its median and p90 are over single steps.
STEP_ROUNDS_FACTOR = 4
#: Untimed calls of each case before its rounds.
WARMUP_CALLS = 2
JOB_TIMEOUT_S = 600
TCP_FLOOR = "raw socket echo of {nbytes} B"
MEMCPY_FLOOR = "NumPy copyto + add + copyto"
ROUND_FLOOR = "raw TCP round: 2 clients, summing server"
#: The floor label of a pull row: its only floor is the echo (a pull waits for no other
#: worker and sums nothing, so a summing round of two clients is not its work).
PULL_FLOOR = TCP_FLOOR + " (a pull: no round floor)"
SHM_ROUND_FLOOR = "raw shared-memory round: 2 clients, summing server"

#: What a case's call does, on every worker:
#: "key": push one key, then pull it; "pull": pull one key;
#: "list": one push of every key as a list, then one pull of the list;
#: "per-key": a training step with a call per key (:func:`akv.bench.steps.per_key_step`).
Kind = Literal["key", "pull", "list", "per-key"]


@dataclass(frozen=True)
class Case:
    """One timed workload: what each worker calls, on which float32 arrays, how often.

    ``calls`` calls make one timed round (the round's mean is one sample; scaled down in
    quick runs); ``rounds_factor`` multiplies the number of rounds. ``unit_ops`` > 1 reports
    the row as operations per second. ``memcpy_floor``: also measure the memcpy floor.
    """

    name: str
    kind: Kind
    shapes: tuple[Shape, ...]
    calls: int
    rounds_factor: int = 1
    unit_ops: int = 1
    memcpy_floor: bool = False

    @property
    def nbytes(self) -> int:
        """The bytes of every array of the case together: what one push moves."""
        return elements(self.shapes) * FLOAT32_BYTES

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        if data.get("kind") not in get_args(Kind):
            raise akv.BenchmarkError(
                f"benchmark case {data.get('name')!r}: unknown kind {data.get('kind')!r}, "
                f"expected one of {get_args(Kind)}"
            )
        shapes = tuple(tuple(int(n) for n in shape) for shape in data["shapes"])
        return cls(**{**data, "shapes": shapes})


def round_case(nbytes: int, calls: int) -> Case:
    """A push+pull of one key of ``nbytes``, with the memcpy floor."""
    return Case(
        f"push+pull {_size(nbytes)}",
        "key",
        ((nbytes // FLOAT32_BYTES,),),
        calls,
        memcpy_floor=True,
    )


def step_cases(shapes: Sequence[Shape], model: str = "ResNet-18") -> list[Case]:
    """The two training steps over ``shapes``, one step per round: with a call per array,
    and with one list call each way; both with the memcpy floor."""
    arrays = tuple(tuple(shape) for shape in shapes)
    kinds: list[tuple[str, Kind]] = [("per-key calls", "per-key"), ("list calls", "list")]
    return [
        Case(
            f"{model} step, {calls}",
            kind,
            arrays,
            calls=1,
            rounds_factor=STEP_ROUNDS_FACTOR,
            memcpy_floor=True,
        )
        for calls, kind in kinds
    ]


def default_cases() -> list[Case]:
    """What ``akv bench dist`` measures."""
    small: tuple[Shape, ...] = ((16,),)
    return [
        round_case(4 * MIB, calls=20),
        round_case(64 * MIB, calls=3),
        Case("small key (16 floats) push+pull", "key", small, 300),
        Case("small key (16 floats) pull", "pull", small, 300),
        Case(
            f"{SMALL_KEYS} keys x 16 floats, one list call",
            "list",
            small * SMALL_KEYS,
            10,
            unit_ops=SMALL_KEYS,
        ),
        *step_cases([shape for _, shape in resnet18_shapes()]),
    ]


def _has_shm_floor(case: Case) -> bool:
    """Whether ``case``'s shared-memory rows carry the raw shared-memory round (one key's
    push+pull rounds with the memcpy floor: the 4 MiB and 64 MiB rounds)."""
    return case.memcpy_floor and case.kind == "key"


def _size(nbytes: int) -> str:
    if nbytes >= MIB and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB and nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def memcpy_round(shapes: Sequence[Shape]) -> Callable[[], None]:
    """The memcpy floor of one worker's push+pull of ``shapes``: a call does
    :func:`copy_sum_copy` on each array, with buffers allocated and filled here."""
    buffers = [
        (
            np.ones(shape, np.float32),
            np.zeros(shape, np.float32),
            np.ones(shape, np.float32),
            np.zeros(shape, np.float32),
        )
        for shape in shapes
    ]

    def every_array() -> None:
        for grad, staging, total, out in buffers:
            copy_sum_copy(grad, staging, total, out)

    return every_array


def copy_sum_copy(
    grad: np.ndarray, staging: np.ndarray, total: np.ndarray, out: np.ndarray
) -> None:
    """What one array's push+pull must do in memory at least: the push takes the value
    (``np.copyto(staging, grad)``), the server adds the second worker's contribution
    (``np.add(total, staging, out=total)``), the pull writes the caller's output
    (``np.copyto(out, total)``)."""
    np.copyto(staging, grad)
    np.add(total, staging, out=total)
    np.copyto(out, total)


def _measure(
    kv: akv.KVStore, cases: Sequence[Case], rounds: int, scale: float
) -> dict[str, list[float]]:
    """Each case's seconds per call, one sample per round."""
    results: dict[str, list[float]] = {}
    for case in cases:
        calls = max(1, int(case.calls * scale))
        call = _operation(kv, case)
        for _ in range(WARMUP_CALLS):
            call()
        samples = []
        for _ in range(rounds * case.rounds_factor):
            kv.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples.append((time.perf_counter() - start) / calls)
        results[case.name] = samples
    return results


def _operation(kv: akv.KVStore, case: Case) -> Callable[[], None]:
    """Initialize the keys of ``case``; return the call that it times."""
    if case.kind in ("list", "per-key"):
        keys: list[Key] = [f"{case.name}/{i}" for i in range(len(case.shapes))]
        grads = [np.ones(shape, np.float32) for shape in case.shapes]
        weights = [np.zeros(shape, np.float32) for shape in case.shapes]
        kv.init(keys, grads)
        step = per_key_step if case.kind == "per-key" else list_step

        def many_keys() -> None:
            step(kv, keys, grads, weights)

        return many_keys
    (shape,) = case.shapes
    value = np.ones(shape, np.float32)
    out = np.zeros_like(value)
    name = case.name
    kv.init(name, value)
    if case.kind == "pull":

        def pull() -> None:
            kv.pull(name, out=out)

        return pull

    def push_pull() -> None:
        kv.push(name, value)
        kv.pull(name, out=out)

    return push_pull


def run() -> Table:
    """Measure dist_sync with 1 and 2 servers against the floors; return the table."""
    quick = _SETTINGS["rounds"] < 5
    rounds, scale = (2, 0.2) if quick else (5, 1.0)
    table = measure(default_cases(), rounds, scale)
    resnet18 = [shape for _, shape in resnet18_shapes()]
    table.notes.append(
        f"The ResNet-18 steps move its {len(resnet18)} arrays "
        f"({elements(resnet18) * FLOAT32_BYTES / MIB:.1f} MiB of float32) each way per step."
    )
    table.notes.append(
        "Targets: 4 MiB and 64 MiB push+pull 2x faster than MXNet, 2 servers "
        "faster than 1 for 64 MiB; small-key round trip 2x faster; many small keys in one "
        "request per server; the per-key step at least 2x MXNet and within 1.3x "
        "of the raw-TCP floor; the list step within 1.2x of it; 4 MiB and 64 MiB rounds "
        "within 2x of the memcpy floor with shared memory, within 1.2x of raw TCP without."
    )
    return table


#: The ways a job's streams can go: the label in the rows, and ``AKV_SHM``.
TRANSPORTS = {"shared memory": "1", "TCP": "0"}


def measure(
    cases: Sequence[Case],
    rounds: int,
    scale: float,
    servers: Sequence[int] = (1, 2),
    transports: Sequence[str] = tuple(TRANSPORTS),
) -> Table:
    """Measure the floors of ``cases``, then run them in a job per server count in
    ``servers`` and transport in ``transports`` (keys of :data:`TRANSPORTS`: workers and
    servers on this host share memory, or use TCP only); return a row per case, server
    count and transport.

    ``rounds`` timed rounds per case (times its ``rounds_factor``), each of ``case.calls *
    scale`` calls (at least one). The memcpy floors are timed as :func:`time_per_call`
    is configured (:func:`akv.bench.configure`).
    """
    table = Table(
        "akv bench dist (dist_sync, 2 workers on 127.0.0.1, times per call or per step of "
        "worker 0)",
        second_floor_heading="floor 2",
        third_floor_heading="floor 3",
    )
    tcp_floors: dict[int, float] = {}
    round_floors: dict[int, float] = {}
    for raw, floors, wanted in (
        (RawEcho, tcp_floors, True),
        (RawRound, round_floors, "TCP" in transports),
    ):
        if not wanted:
            continue
        with raw() as peer:
            for case in cases:
                if case.nbytes not in floors:
                    iterations = max(1, int(case.calls * scale))
                    floors[case.nbytes] = round_trip(
                        peer, case.nbytes, iterations, rounds * case.rounds_factor
                    )
    memcpy_floors: dict[tuple[Shape, ...], float] = {}
    for case in cases:
        if case.memcpy_floor and case.shapes not in memcpy_floors:
            memcpy_floors[case.shapes] = time_per_call(memcpy_round(case.shapes))
    shm_floors: dict[int, float] = {}
    shm_cases = [case for case in cases if _has_shm_floor(case)]
    if shm_cases and "shared memory" in transports:
        with RawShmRound(max(case.nbytes for case in shm_cases)) as raw_shm:
            for case in shm_cases:
                if case.nbytes not in shm_floors:
                    iterations = max(1, int(case.calls * scale))
                    shm_floors[case.nbytes] = round_trip(
                        raw_shm, case.nbytes, iterations, rounds * case.rounds_factor
                    )
    for count, transport in [(c, t) for c in servers for t in transports]:
        results = _job(count, cases, rounds, scale, TRANSPORTS[transport])
        for case in cases:
            samples = results.get(case.name)
            if not samples:
                raise akv.BenchmarkError(
                    f"the benchmark job with {count} server(s) reported no times for {case.name!r}"
                )
            if case.kind == "pull":
                second_s, second = None, ""  # waits for no other worker, sums nothing
            elif transport == "TCP":
                second_s, second = round_floors[case.nbytes], ROUND_FLOOR
            elif case.memcpy_floor:
                second_s, second = memcpy_floors[case.shapes], MEMCPY_FLOOR
            else:
                second_s, second = None, ""
            shm_row = transport != "TCP" and _has_shm_floor(case)
            third_s = shm_floors[case.nbytes] if shm_row else None
            table.add(
                Row(
                    f"{case.name}, {count} server{'s' if count > 1 else ''}, {transport}",
                    statistics.median(samples),
                    tcp_floors[case.nbytes],
                    (PULL_FLOOR if case.kind == "pull" else TCP_FLOOR).format(nbytes=case.nbytes),
                    unit_ops=case.unit_ops,
                    reference_s=MXNET_S.get((case.name, count)),
                    akv_p90_s=percentile(samples, 0.9),
                    second_floor_s=second_s,
                    second_floor=second,
                    third_floor_s=third_s,
                    third_floor=SHM_ROUND_FLOOR if third_s is not None else "",
                )
            )
    table.notes.append(
        f"Floors, measured in this run: 'floor' is a {TCP_FLOOR.format(nbytes='N')} between "
        "two processes (once each way); 'floor 2' is, in the shared-memory rows, one "
        f"worker's copies in memory ({MEMCPY_FLOOR}: the push's copy, the server's sum of "
        "the second worker's contribution, the pull's copy), in this process, and in the "
        f"TCP rows a {ROUND_FLOOR} (the same round on plain blocking sockets, a server "
        "thread per client, each adding half the sum; none in the pull rows: a pull waits "
        "for no other worker and sums nothing); 'floor 3', in the shared-memory rows "
        f"of one key's rounds, a {SHM_ROUND_FLOOR} (the memcpy floor's copies and sum made "
        "by three processes through one shared arena, woken by pipes). akv and akv p90: the "
        "median and the nearest-rank p90 over the rounds (over single steps for the "
        "steps). A step's per-key calls push each gradient last layer first with "
        "priority=-i, then pull each weight, as MXNet's Module does; its list calls make one "
        "push and one pull of all of them."
    )
    return table


def worker_main(argv: list[str] | None = None) -> int:
    """One worker of the benchmark job: measure, and let worker 0 write the results.

    Worker 0 writes ``{case name: [seconds per call, one per round]}`` as JSON to ``--out``.
    ``--cases`` names a JSON file with the cases (:meth:`Case.to_json`); without it the
    worker runs :func:`default_cases`.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--cases", help="a JSON file with the cases to run")
    parser.add_argument("--compression", choices=("2bit", "1bit"), help="compress the pushes")
    args = parser.parse_args(argv)
    cases = default_cases()
    if args.cases:
        cases = [Case.from_json(data) for data in json.loads(Path(args.cases).read_text())]
    with akv.create("dist_sync") as kv:
        if args.compression:
            kv.set_gradient_compression({"type": args.compression, "threshold": 0.5})
        results = _measure(kv, cases, args.rounds, args.scale)
        if kv.rank == 0:
            Path(args.out).write_text(json.dumps(results))
    return 0


def _job(
    num_servers: int,
    cases: Sequence[Case],
    rounds: int,
    scale: float,
    shm: str = "1",
    compression: str | None = None,
) -> dict[str, list[float]]:
    """Run ``cases`` in a job of 2 workers and ``num_servers`` servers (``shm``: AKV_SHM;
    ``compression``: the workers' gradient compression type); worker 0's times."""
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = os.path.join(tmp, "cases.json")
        Path(cases_path).write_text(json.dumps([case.to_json() for case in cases]))
        arguments = ["--rounds", str(rounds), "--scale", str(scale), "--cases", cases_path]
        if compression:
            arguments += ["--compression", compression]
        return launch_job("akv.bench.dist", arguments, num_servers, {"AKV_SHM": shm})


def launch_job(
    module: str, arguments: list[str], num_servers: int, env: dict[str, str]
) -> dict[str, Any]:
    """Run ``python -m module --out FILE *arguments`` as 2 workers under akv-launch with
    ``num_servers`` servers and ``env`` added to the environment; the JSON worker 0 wrote.

    Raises
    ------
    BenchmarkError
        The job failed, wrote nothing, or ran past ``JOB_TIMEOUT_S``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        command = [
            sys.executable,
            "-m",
            "akv.launch",
            "-n",
            "2",
            "-s",
            str(num_servers),
            "--",
            sys.executable,
            "-m",
            module,
            "--out",
            out,
            *arguments,
        ]
        completed = run_launcher(
            command,
            {**os.environ, **env},
            JOB_TIMEOUT_S,
            f"the benchmark job ({module}) with {num_servers} server(s) and {env}",
        )
        if completed.returncode != 0 or not os.path.exists(out):
            raise akv.BenchmarkError(
                f"the benchmark job ({module}) with {num_servers} server(s) and {env} failed "
                f"({completed.returncode}):\n{completed.stdout[-3000:]}\n"
                f"{completed.stderr[-3000:]}"
            )
        results: dict[str, Any] = json.loads(Path(out).read_text())
        return results


if __name__ == "__main__":
    sys.exit(worker_main())
