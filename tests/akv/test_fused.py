"""One pass per reduce and per update (``akv/fused.py``): the math against NumPy, one launch.

Each test runs on the fake CuPy (``tests/fakecupy.py``, whose ``ElementwiseKernel`` runs the
generated CUDA statements with NumPy, counting launches) and, marked ``gpu``, on a real GPU
where there is one. On the fake the fused results equal the NumPy path bit for bit (the same
operations, rounded the same way); on a GPU within float32 rounding (fused multiply-adds).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from akv import fused
from akv import optimizer as opt
from akv.keys import merge_into
from akv_engine import gpu_available
from tests import fakecupy, fakekernels

F32 = np.float32


@pytest.fixture(
    params=[
        "fake",
        pytest.param(
            "gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU"),
            ],
        ),
    ]
)
def xp(request: pytest.FixtureRequest) -> Any:
    """The fake CuPy (installed as ``cupy``), or the real one on a GPU machine."""
    if request.param == "gpu":
        import cupy

        return cupy
    return request.getfixturevalue("fake_cupy")


def is_fake(xp: Any) -> bool:
    return xp is fakecupy


def launches(xp: Any, work: Callable[[], object]) -> tuple[int, int]:
    """(stream submissions of kernels and copies, ElementwiseKernel launches) of ``work``;
    (0, 0) on a real GPU, where they are not counted."""
    if not is_fake(xp):
        work()
        return 0, 0
    fakecupy.synchronize_all()
    kernels, elementwise = fakecupy.counts["kernel"], fakecupy.counts["elementwise"]
    work()
    return fakecupy.counts["kernel"] - kernels, fakecupy.counts["elementwise"] - elementwise


def same(xp: Any, got: Any, want: np.ndarray) -> None:
    """Bit for bit on the fake; within float32 rounding on a GPU."""
    host = got.get()
    if is_fake(xp):
        np.testing.assert_array_equal(host, want)
    else:
        np.testing.assert_allclose(host, want, rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------------------- the sums


@pytest.mark.parametrize("count", [1, 2, 4, 8, 9, 16, 20])
def test_a_sum_is_one_kernel_per_eight_values_and_numpys_number(xp, count):
    rng = np.random.default_rng(count)
    values = [rng.standard_normal((64, 33)).astype(F32) for _ in range(count)]
    arrays = [xp.asarray(v) for v in values]
    buffer = xp.empty((64, 33), F32)
    submitted, elementwise = launches(xp, lambda: fused.sum_into(buffer, arrays))
    want = values[0].copy()
    for value in values[1:]:
        np.add(want, value, out=want)  # NumPy's left-to-right sum
    same(xp, buffer, want)
    if is_fake(xp):
        kernels = 1 + max(0, -(-(count - fused.MAX_SUM_ARITY) // (fused.MAX_SUM_ARITY - 1)))
        assert submitted == kernels
        assert elementwise == (0 if count == 1 else kernels)


def test_a_reduce_of_four_values_is_one_launch_through_merge_into(xp):
    arrays = [xp.full(1000, float(i), F32) for i in range(4)]
    buffer = xp.empty(1000, F32)
    submitted, elementwise = launches(xp, lambda: merge_into(buffer, arrays))
    assert buffer.get().tolist() == [6.0] * 1000
    if is_fake(xp):
        assert (submitted, elementwise) == (1, 1)


def test_sums_keep_the_dtype_strided_views_included(xp):
    ints = [xp.asarray(np.arange(12, dtype=np.int32).reshape(3, 4) * i) for i in range(3)]
    out = xp.empty((3, 4), np.int32)
    fused.sum_into(out, ints)
    assert out.get().tolist() == (np.arange(12).reshape(3, 4) * 3).tolist()
    base = xp.asarray(np.arange(24, dtype=F32).reshape(4, 6))
    strided = [base[:, ::2], base[:, 1::2]]
    out = xp.empty((4, 3), F32)
    fused.sum_into(out, strided)
    host = np.arange(24, dtype=F32).reshape(4, 6)
    same(xp, out, host[:, ::2] + host[:, 1::2])


# ---------------------------------------------------------------------------- the updates

OPTIMIZERS: dict[str, Callable[[], opt.Optimizer]] = {
    "sgd": lambda: opt.SGD(learning_rate=0.1, wd=1e-3),
    "sgd_clipped": lambda: opt.SGD(learning_rate=0.1, wd=1e-3, clip_gradient=0.5, rescale_grad=0.7),
    "sgd_momentum": lambda: opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
    "nag": lambda: opt.NAG(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5),
    "nag_plain": lambda: opt.NAG(learning_rate=0.1, wd=1e-3),
    "adam": lambda: opt.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=1.0),
    "adamw": lambda: opt.AdamW(wd=1e-2),
    "adagrad": lambda: opt.AdaGrad(learning_rate=0.1, wd=1e-3),
    "rmsprop": lambda: opt.RMSProp(learning_rate=0.01, clip_weights=0.5),
    "rmsprop_centered": lambda: opt.RMSProp(learning_rate=0.01, centered=True, wd=1e-3),
    "adadelta": lambda: opt.AdaDelta(wd=1e-3),
    "ftrl": lambda: opt.FTRL(learning_rate=0.1, wd=1e-3),
    "adamax": lambda: opt.Adamax(wd=1e-3),
    "nadam": lambda: opt.Nadam(rescale_grad=0.5),
    "ftml": lambda: opt.FTML(wd=1e-3, clip_gradient=1.0),
    "signum": lambda: opt.Signum(learning_rate=0.01, wd_lh=0.01, wd=1e-3),
    "signsgd": lambda: opt.Signum(learning_rate=0.01, momentum=0.0),
    "dcasgd": lambda: opt.DCASGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_fused_update_is_one_launch_and_the_numpy_paths_numbers(xp, name):
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((32, 16)).astype(F32)
    grads = [rng.standard_normal((32, 16)).astype(F32) for _ in range(3)]
    on_host, on_gpu = opt.get_updater(OPTIMIZERS[name]()), opt.get_updater(OPTIMIZERS[name]())
    host, gpu = weight.copy(), xp.asarray(weight)
    on_gpu(0, xp.asarray(grads[0]), gpu)  # makes the state (zero fills), then updates
    on_host(0, grads[0], host)
    for grad in grads[1:]:
        on_host(0, grad, host)
        gpu_grad = xp.asarray(grad)
        submitted, elementwise = launches(xp, lambda g=gpu_grad: on_gpu(0, g, gpu))
        if is_fake(xp):
            assert (submitted, elementwise) == (1, 1)
    same(xp, gpu, host)


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "ftrl"])
def test_lazy_row_sparse_updates_of_gathered_gpu_rows_are_fused(xp, name):
    optimizer, reference = OPTIMIZERS[name](), OPTIMIZERS[name]()
    if name == "adagrad":
        optimizer.wd = reference.wd = 0.0  # a row-sparse AdaGrad has no weight decay
    assert optimizer.row_sparse_update(0) == "lazy"
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, 8)).astype(F32)
    grad = rng.standard_normal((5, 8)).astype(F32)
    host_state = reference.create_state_multi_precision(0, rows)
    gpu_rows = xp.asarray(rows)
    gpu_state = optimizer.create_state_multi_precision(0, gpu_rows)
    reference.update_rows(0, rows, grad, host_state)
    gpu_grad = xp.asarray(grad)
    submitted, elementwise = launches(
        xp, lambda: optimizer.update_rows(0, gpu_rows, gpu_grad, gpu_state)
    )
    if is_fake(xp):
        assert (submitted, elementwise) == (1, 1)
    same(xp, gpu_rows, rows)


def test_strided_weights_are_updated_in_place_by_one_launch(xp):
    weight = np.arange(64, dtype=F32).reshape(8, 8) / 10
    grad = np.ones((8, 4), F32)
    gpu = xp.asarray(weight)
    view = gpu[:, ::2]
    optimizer = opt.Adam(learning_rate=0.1)
    state = optimizer.create_state(0, view)
    submitted, _ = launches(xp, lambda: optimizer.update(0, view, xp.asarray(grad), state))
    host = weight.copy()
    host_view = host[:, ::2]
    opt.Adam(learning_rate=0.1).update(0, host_view, grad, opt.Adam().create_state(0, host_view))
    same(xp, gpu, host)
    if is_fake(xp):
        assert submitted == 2  # the gradient's copy to the GPU, then the update


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (lambda: opt.LAMB(learning_rate=0.01), F32),  # its step size needs two norms
        (lambda: opt.SGD(learning_rate=0.1, momentum=0.5), np.float16),
    ],
    ids=["lamb", "float16"],
)
def test_what_cannot_be_fused_runs_the_numpy_calls(xp, make, dtype):
    optimizer, reference = make(), make()
    weight = np.linspace(-1, 1, 32).astype(dtype)
    grad = np.linspace(1, 2, 32).astype(dtype)
    gpu = xp.asarray(weight)
    gpu_state = optimizer.create_state(0, gpu)
    host_state = reference.create_state(0, weight)
    gpu_grad = xp.asarray(grad)
    _, elementwise = launches(xp, lambda: optimizer.update(0, gpu, gpu_grad, gpu_state))
    reference.update(0, weight, grad, host_state)
    assert elementwise == 0
    np.testing.assert_allclose(gpu.get(), weight, rtol=1e-6)


def test_a_kernel_is_made_once_and_reused_with_new_scalars(xp):
    optimizer = opt.SGD(learning_rate=0.1, momentum=0.9)
    weight, grad = xp.zeros(16, F32), xp.ones(16, F32)
    state = optimizer.create_state(0, weight)
    optimizer.update(0, weight, grad, state)
    made = len(fused._kernels)
    optimizer.set_learning_rate(0.2)
    optimizer.update(0, weight, grad, state)
    assert len(fused._kernels) == made  # the learning rate is an argument, not source


# ---------------------------------------------------------------------------- the tracing


def test_the_trace_turns_numpy_calls_into_statements_in_order():
    def kernel(w: Any, g: Any, m: Any, buffers: list[Any]) -> None:
        (work,) = buffers
        np.multiply(m, 0.9, out=m)
        np.clip(g, -1.0, 1.0, out=work)
        np.subtract(m, work, out=m)
        np.add(w, m, out=w)

    traced = fused.trace_update(kernel, np.dtype(F32), (4,), num_states=1, num_scratch=1)
    assert traced.in_params == "T g, T p0, T p1, T p2"
    assert traced.out_params == "T w, T m0"
    assert traced.body.split(";\n") == [
        "T b0 = 0",
        "m0 = m0 * p0",
        "b0 = akv_clip(g, p1, p2)",
        "m0 = m0 - b0",
        "w = w + m0;",
    ]
    assert traced.scalars == [0.9, -1.0, 1.0]
    assert [type(a) for a in traced.arguments(np.dtype(F32))] == [np.float32] * 3


@pytest.mark.parametrize(
    "body",
    [
        lambda w, g, buffers: np.dot(w, g),
        lambda w, g, buffers: np.add(w, g, out=g),  # writes the caller's gradient
        lambda w, g, buffers: np.add(w, 1.0, out=w) if float(w) else None,
        lambda w, g, buffers: np.cumsum(w, out=w),
        lambda w, g, buffers: np.add.reduce(w),
        lambda w, g, buffers: np.greater(w, g),  # a truth value, into no float array
    ],
    ids=["dot", "writes-gradient", "branch", "cumsum", "reduce", "truth-value"],
)
def test_what_has_no_fused_form_is_refused(body):
    with pytest.raises(fused.Untraceable):
        fused.trace_update(body, np.dtype(F32), (4,), num_states=0, num_scratch=0)


def test_numpy_scalars_keep_their_own_type_as_numpy_computes_with_them():
    def kernel(w: Any, g: Any, buffers: list[Any]) -> None:
        np.multiply(g, np.float64(0.1), out=w)

    traced = fused.trace_update(kernel, np.dtype(F32), (4,), num_states=0, num_scratch=0)
    assert traced.in_params == "T g, float64 p0"


def test_the_fake_knows_every_device_function_of_the_preamble():
    defined = set(re.findall(r"__device__ T (akv_\w+)\(", fused.PREAMBLE))
    assert defined and defined <= set(fakekernels.DEVICE_FUNCTIONS)


@pytest.mark.parametrize(
    "operation",
    ["out = a > 0 ? a : 0", "out = a && 1", "out = unknown(a)", "float x; out = a"],
)
def test_the_fake_kernel_refuses_what_it_cannot_run(operation):
    with pytest.raises(NotImplementedError):
        fakekernels.ElementwiseKernel("T a", "T out", operation, "k")
