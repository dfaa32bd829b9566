"""Make ``lazy_reference.json``: MXNet 1.9.1's local store, row-sparse pushes through its
optimizers (lazy and standard updates), the whole weight after each push.

Run by hand, with MXNet in a venv of its own (never by the tests, which keep only the
numbers)::

    python -m venv /work/mxvenv
    /work/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    /work/mxvenv/bin/python tests/akv/data/make_lazy_reference.py

The inputs are fixed (a seeded generator, values multiples of 1/4 so that they are exact in
float32) and saved with the outputs, so the test replays exactly what MXNet was given:

* a 10x4 float32 table whose initial value lists rows 1, 4, 7 and 8 (unsorted in the
  file); rows 0, 2, 3, 5, 6 and 9 are not listed (read as zero);
* three rounds of pushes to the key ``"emb"``: one gradient with repeated rows, a list of
  two gradients with overlapping rows (summed as MXNet sums a list, its "sparse
  aggregator"), one gradient naming a row three times; rows 3 and 6 are never pushed, row 8
  is stored but never pushed;
* cases: no optimizer (the stored rows become the pushed sum), SGD without and with
  momentum (``lazy_update`` True and False), Adam (both), AdaGrad (wd=0, lazy) and FTRL
  (lazy), with ``rescale_grad`` and ``clip_gradient`` set in most cases and some gradient
  entries beyond the clip;
* after each round, the whole weight as MXNet's ``row_sparse_pull`` of every row gives it.

What MXNet needs, and how it was given it:

* MXNet's optimizer kernels for a row_sparse weight demand that every row be present
  (``CheckAllRowsPresent``: "SGDUpdate for RowSparse weights is only implemented for
  RowSparse weights with all rows containing non-zeros"; the local store keeps the value
  given to ``init`` as it is). MXNet's own tests do the same: ``compare_optimizer``
  (``python/mxnet/test_utils.py:2396-2397`` at 1.9.1) makes row_sparse weights with
  ``rand_ndarray(shape, 'row_sparse', density=1)``. So MXNet's initial value lists every
  row, the rows akv's value does not list as explicit zeros. For every case here this is
  the same weight: an unlisted row reads as zero in akv, and a zero row with zero state stays
  zero under each standard update (SGD's decay and momentum, Adam's ``wd * weight``
  gradient).
* A row_sparse NDArray must have sorted, unique indices (``check_format`` refuses others and
  the kvstore then computes garbage). akv takes unsorted, repeated rows and sums them. So
  each gradient is given to MXNet split into parts, the k-th part holding the k-th
  occurrence of each row (sorted, unique), and pushed as a list: MXNet itself sums them,
  as it sums the values of a list push. A list push of two gradients becomes a list of
  their parts.
* MXNet's local store sizes a key's merge buffers at its first push of a list and reads past
  them when a later push lists more values (``src/kvstore/comm.h:175-186`` at 1.9.1: the
  copy buffers are made once, ``src.size()`` of them; the push then fails with a garbage
  shape, or worse). A list push stands for the same devices every time. So every push
  here lists as many values (the most parts any round needs), padded with empty
  row_sparse values, which add no row.
"""

from __future__ import annotations

import json
import pathlib

import mxnet as mx
import numpy as np

SHAPE = (10, 4)
KEY = "emb"
SEED = 20261204
OUT = pathlib.Path(__file__).with_name("lazy_reference.json")

INITIAL_ROWS = [7, 1, 8, 4]
# Each round: a list of gradients (one value, or a list pushed in one call), as row ids.
ROUNDS = [
    [[7, 2, 7, 0]],
    [[2, 5, 9], [5, 1, 2]],
    [[4, 9, 4, 4, 1]],
]

CLIP = {"rescale_grad": 0.5, "clip_gradient": 1.0}
CASES = {
    "none": None,
    "sgd_lazy": ("sgd", {"learning_rate": 0.1, "wd": 0.05, **CLIP}),
    "sgd_standard": ("sgd", {"learning_rate": 0.1, "wd": 0.05, "lazy_update": False, **CLIP}),
    "sgd_momentum_lazy": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05, **CLIP}),
    "sgd_momentum_standard": (
        "sgd",
        {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05, "lazy_update": False},
    ),
    "adam_lazy": ("adam", {"learning_rate": 0.01, "wd": 0.05, **CLIP}),
    "adam_standard": (
        "adam",
        {"learning_rate": 0.01, "wd": 0.05, "lazy_update": False, "rescale_grad": 0.5},
    ),
    "adagrad": ("adagrad", {"learning_rate": 0.1, "wd": 0.0, **CLIP}),
    "ftrl": ("ftrl", {"learning_rate": 0.1, "lamda1": 0.01, "beta": 1.0, "wd": 0.05, **CLIP}),
}


def quarters(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/4 in [-3, 3], exact in float32."""
    return (rng.integers(-12, 13, size=shape) / 4).astype(np.float32)


def make_inputs() -> dict:
    rng = np.random.default_rng(SEED)
    initial = {"indices": INITIAL_ROWS, "data": quarters(rng, (len(INITIAL_ROWS), SHAPE[1]))}
    rounds = [
        [{"indices": ids, "data": quarters(rng, (len(ids), SHAPE[1]))} for ids in grads]
        for grads in ROUNDS
    ]
    return {"shape": list(SHAPE), "key": KEY, "initial": initial, "rounds": rounds}


def parts(indices: list[int], data: np.ndarray) -> list[mx.nd.sparse.RowSparseNDArray]:
    """A gradient with unsorted, repeated rows as valid row_sparse parts summing to it: the
    k-th part holds the k-th occurrence of each row."""
    seen: dict[int, int] = {}
    by_part: list[dict[int, np.ndarray]] = []
    for row, values in zip(indices, data, strict=True):
        k = seen.get(row, 0)
        seen[row] = k + 1
        if k == len(by_part):
            by_part.append({})
        by_part[k][row] = values
    made = []
    for rows in by_part:
        ids = sorted(rows)
        value = mx.nd.sparse.row_sparse_array(
            (np.stack([rows[i] for i in ids]), np.array(ids, np.int64)),
            shape=SHAPE,
            dtype="float32",
        )
        value.check_format()
        made.append(value)
    return made


def whole(kv: mx.kv.KVStore) -> np.ndarray:
    out = mx.nd.sparse.zeros("row_sparse", SHAPE, dtype="float32")
    kv.row_sparse_pull(KEY, out=out, row_ids=mx.nd.arange(SHAPE[0], dtype="int64"))
    return out.asnumpy()


def run_case(case: tuple[str, dict] | None, inputs: dict) -> list[np.ndarray]:
    kv = mx.kv.create("local")
    if case is not None:
        name, params = case
        kv.set_optimizer(mx.optimizer.create(name, **params))
    initial = np.zeros(SHAPE, np.float32)
    initial[inputs["initial"]["indices"]] = inputs["initial"]["data"]
    # Every row listed (see the module's docstring).
    kv.init(
        KEY,
        mx.nd.sparse.row_sparse_array(
            (initial, np.arange(SHAPE[0], dtype=np.int64)), shape=SHAPE, dtype="float32"
        ),
    )
    pushes = [
        [part for g in grads for part in parts(g["indices"], g["data"])]
        for grads in inputs["rounds"]
    ]
    width = max(map(len, pushes))
    weights = []
    for values in pushes:
        # As many values in every push (see the module's docstring): empty ones add nothing.
        values += [mx.nd.sparse.zeros("row_sparse", SHAPE, dtype="float32")] * (width - len(values))
        kv.push(KEY, values)
        weights.append(whole(kv))
    return weights


def exact(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back as the same float32."""
    return [float(repr(v)) for v in np.asarray(values, np.float32).ravel()]


def main() -> None:
    inputs = make_inputs()
    cases = {}
    for label, case in CASES.items():
        weights = run_case(case, inputs)
        cases[label] = {
            "optimizer": None if case is None else {"name": case[0], "params": case[1]},
            "weights": [exact(w) for w in weights],
        }
    serial = {
        "made_by": (
            f"tests/akv/data/make_lazy_reference.py with mxnet {mx.__version__}, "
            f"numpy {np.__version__}"
        ),
        "shape": inputs["shape"],
        "key": inputs["key"],
        "initial": {
            "indices": inputs["initial"]["indices"],
            "data": exact(inputs["initial"]["data"]),
        },
        "rounds": [
            [{"indices": g["indices"], "data": exact(g["data"])} for g in grads]
            for grads in inputs["rounds"]
        ],
        "cases": cases,
    }
    OUT.write_text(json.dumps(serial, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
