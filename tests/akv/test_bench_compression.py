"""``akv bench compression``: its floors leave the codec's buffers alone."""

from __future__ import annotations

import numpy as np

import akv.bench.compression as compression
from akv.bench.dist import MIB


def test_the_encode_floor_adds_into_a_buffer_of_its_own_not_the_encoders_residual(
    monkeypatch,
):
    """The floor of an encode row is a NumPy add of the gradient into a residual-sized
    buffer: into the encoder's own residual, it would grow that residual (the error
    feedback) between encodes, and change what is timed."""
    residuals: list[np.ndarray] = []
    real_encode, real_compare = compression.encode, compression.compare

    def recording_encode(c, grad, residual, *args, **kwargs):
        residuals.append(residual)
        return real_encode(c, grad, residual, *args, **kwargs)

    def checking_compare(timed, *floors, **kwargs):
        before = [residual.copy() for residual in residuals]
        for floor in floors:
            floor()
        for residual, was in zip(residuals, before, strict=True):
            assert np.array_equal(residual, was), "a floor wrote the encoder's residual"
        return real_compare(timed, *floors, **kwargs)

    monkeypatch.setattr(compression, "encode", recording_encode)
    monkeypatch.setattr(compression, "compare", checking_compare)
    monkeypatch.setitem(compression._SETTINGS, "rounds", 1)
    monkeypatch.setitem(compression._SETTINGS, "min_round_s", 1e-4)
    rows, _ = compression.codec_rows(MIB // 4)
    assert residuals and len(rows) == 2 * len(compression.TYPES)
