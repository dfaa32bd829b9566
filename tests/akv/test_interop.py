"""Framework tensors in every store: PyTorch and JAX arrays in, out, and in place."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import akv
from akv.arrays import NUMPY, copy_into, read, write_view

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'akvstore[interop]')"
)

HOST_TYPES = ["local", "device", "local_update_cpu"]


@pytest.fixture(params=HOST_TYPES)
def kv(request):
    store = akv.create(request.param)
    yield store
    store.close()


def test_a_parameter_that_requires_grad_is_read_without_ceremony(kv):
    weight = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    kv.init("w", weight)
    kv.push("w", torch.nn.Parameter(torch.ones(2, 3)))
    np.testing.assert_array_equal(kv.pull("w").numpy(), np.ones((2, 3), np.float32))


def test_pull_into_a_parameter_keeps_its_storage_and_its_grad_flag(kv):
    kv.init(0, torch.full((3, 4), 7.0))
    param = torch.nn.Parameter(torch.zeros(3, 4))
    before = param.data_ptr()
    result = kv.pull(0, out=param)
    assert result is param
    assert param.data_ptr() == before
    assert param.requires_grad
    assert torch.equal(param.detach(), torch.full((3, 4), 7.0))


def test_pull_without_out_returns_the_kind_the_key_was_initialized_with(kv):
    kv.init(["t", "n"], [torch.ones(2, dtype=torch.float64), np.ones(2)])
    pulled_t, pulled_n = kv.pull(["t", "n"])
    assert isinstance(pulled_t, torch.Tensor) and pulled_t.dtype is torch.float64
    assert type(pulled_n) is np.ndarray
    one = kv.pull("t")
    assert isinstance(one, torch.Tensor) and one.device.type == "cpu"
    single_list = kv.pull(["t"])
    assert isinstance(single_list, list) and isinstance(single_list[0], torch.Tensor)


def test_non_contiguous_tensors_in_and_out(kv):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    kv.init(0, base.t())  # a (4, 3) view with strides (1, 4)
    out = torch.zeros(3, 4).t()
    assert not out.is_contiguous()
    kv.pull(0, out=out)
    assert torch.equal(out, base.t())
    kv.push(0, [base.t(), base.t()])
    kv.pull(0, out=out)
    assert torch.equal(out, 2 * base.t())


def test_a_pull_into_a_view_that_cannot_hold_its_values_is_refused(kv):
    # A lazily conjugated view (its storage holds the conjugate) was written through a
    # copy, and an expanded tensor (elements sharing memory) got the last row everywhere;
    # both returned normally (found by a review). torch's copy_ refuses the second too.
    kv.init("c", torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    base = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(akv.InvalidArgumentError, match="lazily conjugated or negated torch view"):
        kv.pull("c", out=base.conj())
    kv.init("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))
    expanded = torch.zeros(3).expand(2, 3)
    with pytest.raises(akv.InvalidArgumentError, match=r"share memory \(a stride of 0"):
        kv.pull("w", out=expanded)
    shared = np.lib.stride_tricks.as_strided(np.zeros(3, np.float32), (2, 3), (0, 4))
    with pytest.raises(akv.InvalidArgumentError, match="share memory"):
        kv.pull("w", out=shared)
    assert torch.equal(base, torch.zeros(2, dtype=torch.complex64))
    assert torch.equal(expanded, torch.zeros(2, 3))


def test_float16_tensors(kv):
    kv.init(0, torch.ones(5, dtype=torch.float16))
    kv.push(0, [torch.full((5,), 0.5, dtype=torch.float16)] * 3)
    pulled = kv.pull(0)
    assert pulled.dtype is torch.float16
    assert torch.equal(pulled, torch.full((5,), 1.5, dtype=torch.float16))


def test_bfloat16_tensors_are_summed_as_bfloat16(kv):
    pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    kv.init(0, torch.zeros(4, dtype=torch.bfloat16))
    kv.push(0, [torch.full((4,), 1.5, dtype=torch.bfloat16)] * 2)
    pulled = kv.pull(0)
    assert pulled.dtype is torch.bfloat16
    assert torch.equal(pulled, torch.full((4,), 3.0, dtype=torch.bfloat16))
    out = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.bfloat16))[1]
    kv.pull(0, out=out)
    assert torch.equal(out.detach(), pulled)


def test_bfloat16_without_ml_dtypes_is_refused_by_name(kv, monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    with pytest.raises(akv.UnsupportedDTypeError, match=r"bfloat16.*ml_dtypes") as info:
        kv.init(0, torch.zeros(4, dtype=torch.bfloat16))
    assert isinstance(info.value, akv.InvalidArgumentError)
    assert kv.keys() == []


def test_the_store_copies_tensors_it_is_given_and_never_aliases_its_value(kv):
    value = torch.ones(3)
    kv.init(0, value)
    value.fill_(5.0)
    first = kv.pull(0)
    first.fill_(9.0)
    assert torch.equal(kv.pull(0), torch.ones(3))


def test_mismatched_tensors_name_both_shapes_and_both_dtypes(kv):
    kv.init(0, torch.zeros(2, 3))
    with pytest.raises(akv.ShapeMismatchError, match=r"\(3, 2\).*\(2, 3\)"):
        kv.push(0, torch.zeros(3, 2))
    with pytest.raises(akv.DTypeMismatchError, match=r"float64.*float32"):
        kv.push(0, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(akv.DTypeMismatchError, match=r"float16.*float32"):
        kv.pull(0, out=torch.zeros(2, 3, dtype=torch.float16))
    np.testing.assert_array_equal(kv.pull(0).numpy(), np.zeros((2, 3), np.float32))


def test_tensors_numpy_arrays_and_jax_arrays_mix_in_one_push(kv):
    kv.init(0, np.zeros(3, np.float32))
    kv.push(0, [torch.ones(3), np.ones(3, np.float32)])
    assert type(kv.pull(0)) is np.ndarray
    np.testing.assert_array_equal(kv.pull(0), np.full(3, 2.0, np.float32))


def test_an_optimizer_updates_a_torch_key(kv):
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=0.5))
    weight = torch.nn.Parameter(torch.ones(4))
    kv.init(0, weight)
    kv.push(0, torch.full((4,), 2.0))
    kv.pull(0, out=weight)
    assert torch.allclose(weight.detach(), torch.zeros(4))


def test_pushpull_into_the_tensor_pushed(kv):
    kv.init(0, torch.zeros(3))
    grad = torch.ones(3)
    assert kv.pushpull(0, grad) is grad
    assert torch.equal(grad, torch.ones(3))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_tensor_dtype_numpy_lacks_is_an_argument_error(kv):
    with pytest.raises(akv.InvalidArgumentError, match=r"complex32|ComplexHalf|torch tensor"):
        kv.init(0, torch.zeros(2, dtype=torch.complex32))
    assert kv.keys() == []


def test_a_lazily_negated_view_is_read_by_value(kv):
    base = torch.ones(3)
    kv.init(0, torch._neg_view(base))
    assert torch.equal(kv.pull(0), -torch.ones(3))


async def test_the_async_store_returns_tensors_too():
    async with await akv.create_async("local") as kv:
        kv.init(0, torch.ones(2))
        pulled = await kv.pull(0)
        assert isinstance(pulled, torch.Tensor)
        param = torch.nn.Parameter(torch.zeros(2))
        assert await kv.pull(0, out=param) is param
        assert torch.equal(param.detach(), torch.ones(2))


# ---------------------------------------------------------------------------- JAX


@pytest.fixture
def jnp():
    pytest.importorskip("jax", reason="jax is not installed (pip install 'akvstore[interop]')")
    import jax.numpy as jnp

    return jnp


def test_jax_keys_pull_as_jax_arrays(kv, jnp):
    import jax

    kv.init("j", jnp.arange(4, dtype=jnp.float32))
    kv.push("j", [jnp.ones(4, dtype=jnp.float32), jnp.ones(4, dtype=jnp.float32)])
    pulled = kv.pull("j")
    assert isinstance(pulled, jax.Array)
    np.testing.assert_array_equal(np.asarray(pulled), np.full(4, 2.0, np.float32))
    both = kv.pull(["j", "j"])
    assert all(isinstance(array, jax.Array) for array in both)


def test_jax_outputs_are_refused_as_immutable(kv, jnp):
    kv.init(0, jnp.zeros(3))
    with pytest.raises(akv.ImmutableOutputError, match="immutable"):
        kv.pull(0, out=jnp.zeros(3))
    out = np.empty(3, np.float32)
    assert kv.pull(0, out=out) is out


def test_jax_bfloat16(kv, jnp):
    import jax

    # On the host: JAX's default device is a GPU where it has one (see the next test).
    with jax.default_device(jax.devices("cpu")[0]):
        kv.init(0, jnp.ones(3, dtype=jnp.bfloat16))
        kv.push(0, [jnp.ones(3, dtype=jnp.bfloat16)] * 3)
    pulled = kv.pull(0)
    assert isinstance(pulled, jax.Array) and pulled.dtype == jnp.bfloat16
    assert {device.platform for device in pulled.devices()} == {"cpu"}
    np.testing.assert_array_equal(np.asarray(pulled, np.float32), np.full(3, 3.0, np.float32))


@pytest.mark.gpu
def test_jax_bfloat16_on_a_gpu_is_a_typed_error(kv, jnp):
    """CuPy has no bfloat16: a bfloat16 JAX array on a GPU is refused at the call, naming
    the key and what to do, and the store is unchanged."""
    import jax

    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU here")
    kv.init(0, np.zeros(3, np.float32))
    value = jax.device_put(jnp.ones(3, dtype=jnp.bfloat16), gpu)
    with pytest.raises(akv.UnsupportedDTypeError, match=r"key 0 is a bfloat16 JAX array on a GPU"):
        kv.push(0, value)
    assert kv.pull(0).tolist() == [0.0] * 3


async def test_a_failed_pull_of_a_jax_key_fails_its_awaitable(jnp):
    async with await akv.create_async("local") as kv:
        kv.init(0, jnp.ones(2))
        kv.set_updater(_raising_updater)
        kv.push(0, jnp.ones(2))
        with pytest.raises(RuntimeError, match="updater broke"):
            await kv.pull(0)


def _raising_updater(key, recv, stored):
    raise RuntimeError("updater broke")


# ---------------------------------------------------------------------------- the views


def test_read_views_cpu_tensors_without_copying():
    tensor = torch.zeros(4)
    array, origin = read(tensor, 0, "push value")
    assert array.ctypes.data == tensor.data_ptr()
    assert origin.name == "torch"
    _, origin = read(np.zeros(2), 0, "push value")
    assert origin is NUMPY


def test_write_view_shares_the_tensors_memory():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    view = write_view(param, 0)
    view[...] = 3.0
    assert torch.equal(param.detach(), torch.full((2, 2), 3.0))


def test_a_gpu_array_without_cupy_is_a_typed_error(monkeypatch):
    if akv.arrays.cupy_module() is not None:
        pytest.skip("CuPy is installed: the GPU path is tested by the GPU tests")

    class CudaThing:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            raise AssertionError("never read without CuPy")

    with pytest.raises(akv.GPUUnavailableError, match=r"key 5.*akvstore\[gpu\]"):
        read(CudaThing(), 5, "push value")


def test_copy_into_host_arrays_keeps_strides():
    dst = np.zeros((4, 3)).T
    copy_into(dst, np.ones((3, 4)))
    assert (dst == 1).all()
