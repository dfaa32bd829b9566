"""akv.RowSparseArray: the row-sparse value type, its checks, and torch's sparse COO tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import akv
from akv.sparse import as_row_sparse, check_dense, check_row_ids

F32 = np.float32

# torch's notes on its own sparse support, not about akv.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning"),
]


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip(
        "torch", reason="torch is not installed (pip install 'akvstore[interop]')"
    )


def rows(count: int, width: int = 2, start: float = 1.0) -> np.ndarray:
    return (np.arange(count * width, dtype=F32) + start).reshape(count, width)


# ---------------------------------------------------------------- sorting and summing


def test_unsorted_indices_are_sorted_with_their_rows():
    value = akv.RowSparseArray(rows(3), [7, 2, 5], (10, 2))
    assert value.indices.tolist() == [2, 5, 7]
    assert value.data.tolist() == [[3, 4], [5, 6], [1, 2]]
    assert value.indices.dtype == np.int64


def test_repeated_rows_are_summed_once():
    value = akv.RowSparseArray(rows(5), [4, 1, 4, 1, 4], (6, 2))
    assert value.indices.tolist() == [1, 4]
    assert value.nnz == 2
    assert value.data.tolist() == [[3 + 7, 4 + 8], [1 + 5 + 9, 2 + 6 + 10]]


def test_repeated_bool_rows_are_ored():
    data = np.array([[True, False], [False, False], [False, True]])
    value = akv.RowSparseArray(data, [3, 3, 0], (4, 2))
    assert value.dtype == np.bool_
    assert value.data.tolist() == [[False, True], [True, False]]


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 19), max_size=40),
    width=st.integers(0, 3),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.complex64]),
)
def test_the_dense_form_is_the_sum_of_every_row_given(ids, width, dtype):
    data = np.arange(len(ids) * width).reshape(len(ids), width).astype(dtype) + 1
    expected = np.zeros((20, width), dtype)
    np.add.at(expected, np.asarray(ids, np.int64), data)
    value = akv.RowSparseArray(data, ids, (20, width))
    assert np.array_equal(value.to_dense(), expected)
    assert value.indices.tolist() == sorted(set(ids))
    assert value.data.dtype == dtype
    assert value.data.flags.c_contiguous


def test_the_array_owns_its_memory():
    data = rows(2)
    ids = np.array([1, 3])
    value = akv.RowSparseArray(data, ids, (4, 2))
    data[:] = -1
    ids[:] = 0
    assert value.indices.tolist() == [1, 3]
    assert value.data.tolist() == [[1, 2], [3, 4]]


def test_indices_are_read_only_and_data_writable():
    value = akv.RowSparseArray(rows(2), [0, 1], (2, 2))
    with pytest.raises(ValueError):
        value.indices[0] = 1
    value.data[0] = 0
    assert value.to_dense()[0].tolist() == [0, 0]


def test_indices_may_be_any_integer_sequence():
    for ids in ([2, 0], (2, 0), np.array([2, 0], np.uint8), np.array([2, 0], ">i4")):
        value = akv.RowSparseArray(rows(2), ids, (3, 2))
        assert value.indices.tolist() == [0, 2]
        assert value.indices.dtype == np.int64


def test_no_rows_from_an_empty_list():
    value = akv.RowSparseArray(np.zeros((0, 3), F32), [], (5, 3))
    assert value.nnz == 0
    assert value.to_dense().tolist() == np.zeros((5, 3)).tolist()


def test_rows_may_be_scalars_or_blocks():
    vector = akv.RowSparseArray(np.array([5.0, 6.0]), [3, 0], 4)
    assert vector.shape == (4,)
    assert vector.to_dense().tolist() == [6, 0, 0, 5]
    blocks = akv.RowSparseArray(np.ones((1, 2, 3), F32), [1], (2, 2, 3))
    assert blocks.to_dense()[1].sum() == 6
    assert akv.RowSparseArray(np.zeros((2, 0), F32), [1, 0], (3, 0)).indices.tolist() == [0, 1]


def test_the_first_and_last_rows_and_a_table_of_one_row():
    big = akv.RowSparseArray(rows(2), [10**9 - 1, 0], (10**9, 2))
    assert big.indices.tolist() == [0, 10**9 - 1]
    one = akv.RowSparseArray(rows(1), [0], (1, 2))
    assert one.to_dense().tolist() == [[1, 2]]


# ---------------------------------------------------------------- other constructors


def test_from_dense_keeps_the_nonzero_rows():
    dense = np.zeros((5, 3), F32)
    dense[1, 2] = 4
    dense[3] = -0.0
    dense[4, 0] = np.nan
    value = akv.RowSparseArray.from_dense(dense)
    assert value.indices.tolist() == [1, 4]
    assert value.shape == (5, 3)
    assert value.data[0].tolist() == [0, 0, 4]
    assert np.isnan(value.data[1, 0])
    dense[1, 2] = 9
    assert value.data[0, 2] == 4


def test_dense_round_trips():
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((50, 4)).astype(F32)
    dense[rng.random(50) < 0.7] = 0
    value = akv.RowSparseArray.from_dense(dense)
    assert np.array_equal(value.to_dense(), dense)
    assert akv.RowSparseArray.from_dense(value.to_dense()).equals(value)
    again = akv.RowSparseArray(value.data, value.indices, value.shape)
    assert again.equals(value)


def test_from_dense_of_zero_width_rows_lists_none():
    assert akv.RowSparseArray.from_dense(np.zeros((4, 0), F32)).nnz == 0


@pytest.mark.parametrize("shape", [(0,), (0, 4), (0, 2, 3)])
def test_from_dense_of_no_rows_is_empty(shape):
    value = akv.RowSparseArray.from_dense(np.zeros(shape, F32))
    assert (value.shape, value.nnz, value.data.shape) == (shape, 0, shape)


def test_the_largest_declared_table_has_an_exact_size_in_a_store():
    """A declared size past int64 (2**62 x 8 elements) is kept exact, not wrapped."""
    with akv.create("local") as kv:
        for rows_, width in ((2**62, 8), (2**63 - 1, 2)):
            key = f"k{width}"
            kv.init(key, akv.RowSparseArray.zeros((rows_, width), F32))
            assert kv.placement(key) == {key: [(0, 0, rows_ * width)]}
        kv.push("k2", akv.RowSparseArray(np.ones((1, 2), F32), [2**63 - 2], (2**63 - 1, 2)))
        assert kv.row_sparse_pull("k2", row_ids=[2**63 - 2]).data.tolist() == [[1.0, 1.0]]


def test_zeros_lists_no_row():
    value = akv.RowSparseArray.zeros((10**9, 8), np.float16)
    assert (value.nnz, value.shape, value.dtype) == (0, (10**9, 8), np.float16)
    assert value.data.shape == (0, 8)
    assert value.nbytes == 0
    assert akv.RowSparseArray.zeros(3).to_dense().tolist() == [0, 0, 0]


def test_no_array_equality_only_equals():
    first = akv.RowSparseArray(rows(2), [0, 1], (2, 2))
    second = akv.RowSparseArray(rows(2), [0, 1], (2, 2))
    assert akv.RowSparseArray.__eq__ is object.__eq__
    assert first != second
    assert first.equals(second)
    assert not first.equals(akv.RowSparseArray(rows(2), [0, 1], (3, 2)))
    assert not first.equals(akv.RowSparseArray(rows(2).astype(np.float64), [0, 1], (2, 2)))
    assert not first.equals(akv.RowSparseArray(rows(2, start=2), [0, 1], (2, 2)))
    assert not first.equals(first.to_dense())


def test_repr_names_shape_dtype_and_rows():
    text = repr(akv.RowSparseArray(rows(2), [4, 1], (5, 2)))
    assert text.startswith("RowSparseArray(shape=(5, 2), dtype=float32, nnz=2")
    assert "1, 4" in text
    assert "..." in repr(akv.RowSparseArray(rows(100), np.arange(100), (100, 2)))


# ---------------------------------------------------------------- validation


def test_a_negative_row_id_is_named_with_its_position():
    with pytest.raises(akv.RowIdError, match=r"row id -3 at position 2 is outside \[0, 10\)"):
        akv.RowSparseArray(rows(4), [1, 2, -3, -4], (10, 2))


def test_a_row_id_at_the_number_of_rows_is_refused():
    with pytest.raises(akv.RowIdError, match=r"row id 10 at position 1 .*shape\[0\] is 10"):
        akv.RowSparseArray(rows(2), [9, 10], (10, 2))


def test_row_id_errors_are_index_errors_and_invalid_arguments():
    assert issubclass(akv.RowIdError, IndexError)
    assert issubclass(akv.RowIdError, akv.InvalidArgumentError)
    assert issubclass(akv.StorageTypeError, akv.InvalidArgumentError)


def test_a_huge_unsigned_row_id_is_refused_not_wrapped():
    ids = np.array([1, 2**64 - 1], np.uint64)
    with pytest.raises(akv.RowIdError, match=str(2**64 - 1)):
        akv.RowSparseArray(rows(2), ids, (10, 2))
    with pytest.raises(akv.RowIdError, match="2\\*\\*63"):
        check_row_ids(ids, None, "test")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[0, 1]], r"1-D, got an array of shape \(1, 2\)"),
        (3, r"1-D, got an array of shape \(\)"),
        ([0.0, 1.0], "integers, got dtype float64"),
        ([True, False], "integers, got dtype bool"),
        (["a", "b"], "integers, got dtype <U1"),
    ],
)
def test_indices_must_be_1d_integers(ids, message):
    with pytest.raises(akv.InvalidArgumentError, match=message):
        akv.RowSparseArray(rows(2), ids, (4, 2))


@pytest.mark.parametrize(
    ("data", "shape", "message"),
    [
        (rows(2, width=3), (4, 2), r"data of shape \(2, 3\) does not fit shape \(4, 2\)"),
        (np.ones(2, F32), (4, 2), r"expected data of shape \(2, 2\)"),
        (np.ones((2, 2, 1), F32), (4, 2), r"shape \(2, 2, 1\)"),
        (rows(3), (4, 2), r"with 2 indices: expected data of shape \(2, 2\)"),
    ],
)
def test_data_must_hold_one_row_per_index(data, shape, message):
    with pytest.raises(akv.ShapeMismatchError, match=message) as info:
        akv.RowSparseArray(data, [0, 1], shape)
    assert info.value.got == data.shape
    assert info.value.expected == (2, *shape[1:])


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((), "non-empty tuple"),
        ("ab", "non-empty tuple"),
        (None, "non-empty tuple"),
        ((4, -2), r"\(4, -2\) has a negative dimension"),
        ((4.0, 2), "holds 4.0, a float, not an int"),
        ((True, 2), "holds a bool"),
        # Ids past int64 would be cast to negative ones (2**63 + 5 became -2**63 + 5).
        ((2**64, 2), r"\(18446744073709551616, 2\) has a dimension past 2\*\*63 - 1"),
        ((2**63, 2), "has a dimension past 2"),
    ],
)
def test_the_shape_must_be_non_negative_ints(shape, message):
    with pytest.raises(akv.InvalidArgumentError, match=message):
        akv.RowSparseArray(rows(2), [0, 1], shape)


def test_numpy_integers_make_a_shape():
    assert akv.RowSparseArray(rows(1), [0], (np.int64(3), np.int32(2))).shape == (3, 2)


@pytest.mark.parametrize("dtype", [object, ">f4", "U3", "M8[s]"])
def test_dtypes_akv_does_not_store_are_refused(dtype):
    data = np.zeros((1, 2), dtype)
    with pytest.raises(akv.UnsupportedDTypeError, match="is not one akv stores"):
        akv.RowSparseArray(data, [0], (2, 2))
    with pytest.raises(akv.UnsupportedDTypeError):
        akv.RowSparseArray.from_dense(data)
    with pytest.raises(akv.UnsupportedDTypeError):
        akv.RowSparseArray.zeros((2, 2), dtype)


def test_zeros_refuses_what_is_not_a_dtype():
    with pytest.raises(akv.InvalidArgumentError, match="is not a dtype"):
        akv.RowSparseArray.zeros((2, 2), "no such dtype")


@pytest.mark.parametrize("data", [[[1.0, 2.0]], 3.0, None])
def test_data_must_be_an_array(data):
    with pytest.raises(akv.InvalidArgumentError, match="expected a NumPy array"):
        akv.RowSparseArray(data, [0], (2, 2))


def test_from_dense_refuses_a_0d_array():
    with pytest.raises(akv.InvalidArgumentError, match="0-d array has no rows"):
        akv.RowSparseArray.from_dense(np.float32(1.0))


# ---------------------------------------------------------------- storage types


def test_as_row_sparse_keeps_a_row_sparse_array():
    value = akv.RowSparseArray(rows(1), [0], (2, 2))
    assert as_row_sparse(value, "push to key 'emb'") is value


@pytest.mark.parametrize("value", [np.ones((2, 2), F32), [1, 2], 3.0, None])
def test_as_row_sparse_refuses_dense_values_naming_them(value):
    with pytest.raises(akv.StorageTypeError, match=r"^push to key 'emb': expected a row-sparse"):
        as_row_sparse(value, "push to key 'emb'")


def test_as_row_sparse_says_what_the_dense_value_was():
    with pytest.raises(akv.StorageTypeError, match=r"numpy.ndarray of shape \(2, 3\) and dtype"):
        as_row_sparse(np.ones((2, 3), F32), "push to key 'emb'")


def test_check_dense_refuses_a_row_sparse_value():
    value = akv.RowSparseArray(rows(1), [0], (2, 2))
    with pytest.raises(akv.StorageTypeError, match=r"^init key 3: expected a dense array"):
        check_dense(value, "init key 3")
    check_dense(np.ones(2), "init key 3")


# ---------------------------------------------------------------- torch


def test_from_torch_reads_a_coalesced_coo_tensor(torch):
    tensor = torch.sparse_coo_tensor([[4, 1]], torch.tensor([[1.0, 2.0], [3.0, 4.0]]), (6, 2))
    value = akv.RowSparseArray.from_torch(tensor.coalesce())
    assert value.indices.tolist() == [1, 4]
    assert value.data.tolist() == [[3, 4], [1, 2]]
    assert value.shape == (6, 2)
    assert value.dtype == np.float32


def test_from_torch_sums_an_uncoalesced_tensor(torch):
    tensor = torch.sparse_coo_tensor(
        [[3, 0, 3]], torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.float64), (5, 1)
    )
    assert not tensor.is_coalesced()
    value = akv.RowSparseArray.from_torch(tensor)
    assert value.indices.tolist() == [0, 3]
    assert value.data.tolist() == [[2], [5]]
    assert np.array_equal(value.to_dense(), tensor.to_dense().numpy())


def test_from_torch_keeps_dense_trailing_dims(torch):
    values = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    tensor = torch.sparse_coo_tensor([[5, 2]], values, (7, 2, 3))
    value = akv.RowSparseArray.from_torch(tensor)
    assert value.shape == (7, 2, 3)
    assert np.array_equal(value.to_dense(), tensor.to_dense().numpy())


def test_an_embedding_gradient_converts(torch):
    embedding = torch.nn.Embedding(1000, 4, sparse=True)
    embedding(torch.tensor([[7, 3, 7], [999, 0, 3]])).sum().backward()
    grad = embedding.weight.grad
    value = as_row_sparse(grad, "push to key 'emb'")
    assert value.indices.tolist() == [0, 3, 7, 999]
    assert value.data[:, 0].tolist() == [1, 2, 2, 1]
    assert np.array_equal(value.to_dense(), grad.to_dense().numpy())
    value.data[:] = 0
    assert grad.to_dense().sum() == 4 * 6


def test_from_torch_does_not_share_memory(torch):
    values = torch.ones(2, 3)
    tensor = torch.sparse_coo_tensor([[0, 1]], values, (2, 3)).coalesce()
    value = akv.RowSparseArray.from_torch(tensor)
    value.data[:] = 5
    assert tensor.values().sum() == 6


def test_from_torch_refuses_a_dense_tensor(torch):
    with pytest.raises(akv.StorageTypeError, match=r"layout torch.strided .*from_dense"):
        akv.RowSparseArray.from_torch(torch.ones(2, 2))
    with pytest.raises(akv.StorageTypeError, match=r"got a dense torch.Tensor of shape \(2, 2\)"):
        as_row_sparse(torch.ones(2, 2), "push to key 'emb'")


def test_from_torch_refuses_what_is_no_tensor(torch):
    with pytest.raises(akv.StorageTypeError, match="expected a torch sparse COO tensor"):
        akv.RowSparseArray.from_torch(np.ones((2, 2)))


def test_from_torch_refuses_two_sparse_dims(torch):
    tensor = torch.sparse_coo_tensor([[0, 1], [1, 0]], torch.ones(2), (2, 2))
    with pytest.raises(akv.StorageTypeError, match="has 2 sparse dimensions"):
        akv.RowSparseArray.from_torch(tensor)


def test_from_torch_refuses_csr(torch):
    tensor = torch.ones(2, 2).to_sparse_csr()
    with pytest.raises(akv.StorageTypeError, match=r"layout torch.sparse_csr"):
        as_row_sparse(tensor, "push to key 'emb'")


def test_a_sparse_tensor_is_not_dense(torch):
    tensor = torch.sparse_coo_tensor([[0]], torch.ones(1, 2), (2, 2))
    with pytest.raises(akv.StorageTypeError, match=r"^pull out: expected a dense array"):
        check_dense(tensor, "pull out")
    with pytest.raises(akv.StorageTypeError, match="expected a dense array"):
        akv.RowSparseArray(tensor, [0], (2, 2))
    check_dense(torch.ones(2), "pull out")


def test_a_cpu_tensor_may_be_the_data(torch):
    value = akv.RowSparseArray(torch.ones(2, 3, requires_grad=True), [1, 0], (2, 3))
    assert value.to_dense().tolist() == [[1] * 3] * 2


def test_an_int_tensor_converts(torch):
    tensor = torch.sparse_coo_tensor([[1]], torch.tensor([[7]], dtype=torch.int32), (3, 1))
    value = akv.RowSparseArray.from_torch(tensor)
    assert value.dtype == np.int32
    assert value.to_dense().tolist() == [[0], [7], [0]]


def test_a_bfloat16_gradient_is_refused_with_what_to_do(torch):
    pytest.importorskip("ml_dtypes")
    tensor = torch.sparse_coo_tensor([[1]], torch.ones(1, 2, dtype=torch.bfloat16), (3, 2))
    with pytest.raises(akv.UnsupportedDTypeError, match=r"from_torch: dtype bfloat16 .*float32"):
        akv.RowSparseArray.from_torch(tensor)


def test_a_torch_row_id_out_of_range_is_refused(torch):
    tensor = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 2), (3, 2), check_invariants=False)
    with pytest.raises(akv.RowIdError, match=r"row id 3 at position 1 is outside \[0, 3\)"):
        akv.RowSparseArray.from_torch(tensor)


def test_a_torch_row_id_out_of_range_names_what_the_tensor_is(torch):
    tensor = torch.sparse_coo_tensor([[3, 1]], torch.ones(2, 2), (3, 2), check_invariants=False)
    with pytest.raises(akv.RowIdError, match=r"^push to key 'emb': .*row id 3 at position 1 "):
        as_row_sparse(tensor, "push to key 'emb'")
    with akv.create("local") as kv:
        kv.init("emb", akv.RowSparseArray.zeros((3, 2), np.float32))
        with pytest.raises(akv.RowIdError, match=r"^push to key 'emb': .*row id 3"):
            kv.push("emb", tensor)


def test_a_meta_tensor_is_refused_as_holding_no_values(torch):
    """torch's copy of a meta tensor raises NotImplementedError: akv says what is wrong."""
    tensor = torch.sparse_coo_tensor([[1]], torch.ones(1, 2), (3, 2)).to("meta")
    with pytest.raises(akv.InvalidArgumentError, match=r"^push to key 'emb': .* meta device"):
        as_row_sparse(tensor, "push to key 'emb'")


def test_torch_ids_numpy_cannot_read_are_an_invalid_argument(torch):
    """A tensor that requires grad (float, so never valid ids) makes NumPy's conversion raise
    torch's RuntimeError: refused as the other ids that are not 1-D integers are."""
    ids = torch.ones(1, requires_grad=True)
    with pytest.raises(akv.InvalidArgumentError, match=r"row ids must be 1-D integers.*grad"):
        akv.RowSparseArray(np.ones((1, 3), np.float32), ids, (5, 3))
    with akv.create("local") as kv:
        kv.init("emb", akv.RowSparseArray.zeros((5, 3), np.float32))
        with pytest.raises(akv.InvalidArgumentError, match="row ids must be 1-D integers"):
            kv.row_sparse_pull("emb", row_ids=ids)
