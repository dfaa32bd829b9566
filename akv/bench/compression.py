"""``akv bench compression``: the codes against memory, and a compressed dist_sync round
against the dense one, in the same run.

Two parts:

- the codes, in this process: 2bit and 1bit encoding (quantize with the residual and pack)
  of a 64 MiB float32 gradient, against the memory floor of that work (NumPy adding the
  gradient into the residual: the gradient and the residual read once, the residual written
  once), and decoding against a copy of the decoded bytes (NumPy ``copyto``);
- the round: a 64 MiB push+pull of 2 workers and 1 server over TCP (``AKV_SHM=0``), dense,
  2bit and 1bit (jobs under akv-launch, as ``akv bench dist``), the compressed rounds
  against the dense one.

On loopback a compressed round may be slower than a dense one: the bytes it saves cost
little there. The notes give the crossover: the network speed below which compression wins,
from the measured costs (the bytes a worker's push no longer sends against the time its
codes take, its encoding and the server's decoding of both workers' pushes).
"""

from __future__ import annotations

import statistics

import numpy as np

from akv.bench._report import _SETTINGS, Row, Table, compare
from akv.bench.dist import MIB, _job, round_case
from akv.bench.soak import percentile
from akv.compression import Compression, compressed_nbytes, decode, encode

__all__ = ["codec_rows", "round_rows", "run"]

#: MXNet 1.9.1's 64 MiB dist_sync round, 2 workers (issue #26, measured 2026-12-04 on this
#: project's 2-core machine): 2bit 0.69-0.73 s (the middle here), dense 0.36 s.
MXNET_2BIT_ROUND_S = 0.71
TYPES = ("2bit", "1bit")


def codec_rows(nbytes: int) -> tuple[list[Row], dict[str, float]]:
    """The encoding and decoding rows of a gradient of ``nbytes`` (float32), and each
    type's codec seconds per round (one encode, two decodes: the server's, per worker)."""
    size = nbytes // 4
    grad = (np.random.default_rng(0).standard_normal(size) * 0.3).astype(np.float32)
    residual = np.zeros(size, np.float32)
    # The floor's own buffer: adding into the encoder's residual would change what it encodes.
    floor_residual = np.zeros(size, np.float32)
    out = np.empty(size, np.float32)
    rows = []
    costs = {}
    for kind in TYPES:
        compression = Compression(kind, 0.5)  # type: ignore[arg-type]
        data = encode(compression, grad, residual)

        def coding(c: Compression = compression) -> object:
            return encode(c, grad, residual)

        def decoding(c: Compression = compression, d: np.ndarray = data) -> object:
            return decode(c, d, size, out=out)

        coded, floor = compare(coding, lambda: np.add(floor_residual, grad, out=floor_residual))
        decoded, copy = compare(decoding, lambda: np.copyto(out, grad))
        mib = f"{nbytes / MIB:g} MiB"
        rows.append(Row(f"{kind} encode {mib}", coded, floor, "NumPy add into the residual"))
        rows.append(Row(f"{kind} decode {mib}", decoded, copy, "NumPy copyto of the values"))
        costs[kind] = coded + 2 * decoded
    return rows, costs


def round_rows(nbytes: int, rounds: int, scale: float) -> list[Row]:
    """A push+pull of one ``nbytes`` key, 2 workers, 1 server, TCP: dense, then each type,
    each compressed row against the dense one (the first row: against itself)."""
    case = round_case(nbytes, calls=4)
    dense = _job(1, [case], rounds, scale, shm="0")[case.name]
    dense_s = statistics.median(dense)
    rows = [
        Row(
            f"{case.name} dense, 1 server, TCP",
            dense_s,
            dense_s,
            "this dense round",
            akv_p90_s=percentile(dense, 0.9),
            reference_s=0.36 if nbytes == 64 * MIB else None,
        )
    ]
    for kind in TYPES:
        samples = _job(1, [case], rounds, scale, shm="0", compression=kind)[case.name]
        rows.append(
            Row(
                f"{case.name} {kind}, 1 server, TCP",
                statistics.median(samples),
                dense_s,
                "the dense round above",
                akv_p90_s=percentile(samples, 0.9),
                reference_s=MXNET_2BIT_ROUND_S if kind == "2bit" and nbytes == 64 * MIB else None,
            )
        )
    return rows


def run() -> Table:
    """Measure the codes and the rounds (a smaller gradient in quick mode)."""
    quick = _SETTINGS["rounds"] < 5
    nbytes = 4 * MIB if quick else 64 * MIB
    rounds, scale = (2, 0.5) if quick else (5, 1.0)
    table = Table("akv bench compression (2bit and 1bit gradient compression)")
    rows, costs = codec_rows(nbytes)
    for row in rows:
        table.add(row)
    for row in round_rows(nbytes, rounds, scale):
        table.add(row)
    for kind in TYPES:
        compression = Compression(kind, 0.5)  # type: ignore[arg-type]
        saved = nbytes - compressed_nbytes(compression, nbytes // 4)
        crossover = saved / costs[kind]
        table.notes.append(
            f"{kind}: a push sends {compressed_nbytes(compression, nbytes // 4):,} of "
            f"{nbytes:,} bytes; its codes take {costs[kind] * 1e3:.1f} ms per round (one "
            f"encode, two decodes), so it wins below about {crossover * 8 / 1e9:.2f} Gbit/s "
            f"({crossover / MIB:,.0f} MiB/s) per worker link."
        )
    table.notes.append(
        "Targets: the 64 MiB 2bit round at least 3x faster than MXNet's "
        f"({MXNET_2BIT_ROUND_S} s); encoding within 3x of its memory floor."
    )
    return table
