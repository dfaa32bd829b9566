"""akv.torch.Embedding: a table in the store that trains as torch's sparse embedding does.

The reference everywhere is ``torch.nn.Embedding(sparse=True)`` with ``torch.optim.SGD``,
started from the same table. Where the semantics differ (momentum on rows a batch leaves
out: MXNet's lazy update), the reference is MXNet's formula, written out in NumPy.
"""

from __future__ import annotations

import copy
import io
import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import akv
from akv import (
    DTypeMismatchError,
    DuplicateInitError,
    InvalidArgumentError,
    RowIdError,
    RowSparseArray,
    ShapeMismatchError,
    StorageTypeError,
    UnsupportedDTypeError,
)

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
akv_torch = pytest.importorskip("akv.torch")
Embedding = akv_torch.Embedding

ROWS, DIM, LR = 12, 4, 0.1


@pytest.fixture(params=["local", "device"])
def kv(request):
    store = akv.create(request.param)
    yield store
    store.close()


def reference_table(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Embedding(ROWS, DIM, sparse=True)


def batches(steps: int, *, high: int = ROWS, size: tuple[int, ...] = (3, 5), seed: int = 1):
    """Random id tensors (with repeats: ``size`` ids drawn from ``high``) and the weights
    of a loss that makes each occurrence's gradient different."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, high, size, generator=generator),
            torch.randn(*size, DIM, generator=generator),
        )
        for _ in range(steps)
    ]


def loss_of(out, weights):
    return (out * weights).sum() + (out**2).sum()


def table_of(emb):
    return emb.rows(torch.arange(ROWS))


def train(emb, reference, torch_opt, data):
    for ids, weights in data:
        torch_opt.zero_grad()
        loss_of(reference(ids), weights).backward()
        torch_opt.step()
        loss_of(emb(ids), weights).backward()


# ---------------------------------------------------------------- as torch's sparse embedding


def test_sgd_trains_as_torch_sparse_embedding_with_repeated_ids(kv):
    reference = reference_table()
    emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR))
    torch.testing.assert_close(table_of(emb), reference.weight.detach(), rtol=0, atol=0)
    train(emb, reference, torch.optim.SGD(reference.parameters(), lr=LR), batches(6))
    # torch adds each occurrence's -lr*g in turn; akv sums the occurrences first (one row
    # of the row-sparse gradient per id): float32 rounding apart, no more.
    torch.testing.assert_close(table_of(emb), reference.weight.detach(), rtol=1e-6, atol=1e-6)


def test_the_pushed_gradient_is_torchs_sparse_gradient_coalesced(kv):
    """Without an optimizer a push replaces the rows, so the table shows what was pushed:
    bit for bit what nn.Embedding(sparse=True) leaves in .grad, coalesced (repeats summed).
    (The weights after SGD differ by float32 rounding only because torch's sparse add_
    fuses -lr*g + w into one rounding, where MXNet's SGD rounds twice.)"""
    reference = reference_table()
    emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
    for ids, weights in batches(3):
        # A loss whose gradient does not depend on the rows (which the push replaced).
        reference.zero_grad()
        (reference(ids) * weights).sum().backward()
        (emb(ids) * weights).sum().backward()
        assert torch.equal(table_of(emb), reference.weight.grad.to_dense())


@pytest.mark.parametrize("lazy_update", [True, False], ids=["lazy", "standard"])
def test_momentum_equals_torchs_when_every_batch_touches_every_row(kv, lazy_update):
    reference = reference_table()
    emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR, momentum=0.9, lazy_update=lazy_update))
    generator = torch.Generator().manual_seed(3)
    data = [
        (
            torch.cat([torch.arange(ROWS), torch.randint(0, ROWS, (7,), generator=generator)]),
            torch.randn(ROWS + 7, DIM, generator=generator),
        )
        for _ in range(5)
    ]
    torch_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    train(emb, reference, torch_opt, data)
    torch.testing.assert_close(table_of(emb), reference.weight.detach(), rtol=1e-6, atol=1e-6)


def test_standard_momentum_equals_torchs_sparse_momentum_whatever_the_rows():
    """torch's momentum buffer of a sparse gradient keeps every row it ever saw and decays
    (and applies) all of them each step: MXNet's standard (not lazy) update, where a row
    never pushed stays where it is."""
    reference = reference_table()
    with akv.create("local") as kv:
        emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR, momentum=0.9, lazy_update=False))
        torch_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
        train(emb, reference, torch_opt, batches(6, high=ROWS // 2))
        torch.testing.assert_close(table_of(emb), reference.weight.detach(), rtol=1e-6, atol=1e-6)


def test_lazy_momentum_moves_only_the_batchs_rows_as_mxnet():
    """The default (lazy) update: a row a batch leaves out keeps its weight and its
    momentum (torch would move it by its momentum); checked against MXNet's formula."""
    momentum, wd = 0.9, 0.01
    reference = reference_table()
    weight = reference.weight.detach().numpy().astype(np.float64)
    mom = np.zeros_like(weight)
    data = batches(6, high=ROWS // 2)
    with akv.create("local") as kv:
        emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR, momentum=momentum, wd=wd))
        for ids, weights in data:
            out = emb(ids)
            loss_of(out, weights).backward()
            # MXNet's sgd_mom_update on the rows of the (summed) gradient only.
            grad = np.zeros_like(weight)
            np.add.at(
                grad, ids.numpy().ravel(), (weights + 2 * out.detach()).numpy().reshape(-1, DIM)
            )
            rows = np.unique(ids.numpy())
            mom[rows] = momentum * mom[rows] - LR * wd * weight[rows] - LR * grad[rows]
            weight[rows] += mom[rows]
        np.testing.assert_allclose(table_of(emb).numpy(), weight, rtol=1e-5, atol=1e-6)
        untouched = sorted(set(range(ROWS)) - {int(i) for ids, _ in data for i in ids.ravel()})
        assert untouched  # the batches left these rows out: they never moved
        assert torch.equal(table_of(emb)[untouched], reference.weight.detach()[untouched])


def test_rows_the_batches_never_touch_never_change(kv):
    reference = reference_table()
    emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR, momentum=0.9, wd=0.1))
    for ids, weights in batches(4, high=5):
        loss_of(emb(ids), weights).backward()
    after = table_of(emb)
    assert torch.equal(after[5:], reference.weight.detach()[5:])
    assert not torch.equal(after[:5], reference.weight.detach()[:5])


def torch_twin():
    """torch's sparse embedding under a linear layer (seeded), and a copy of that layer."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Embedding(ROWS, DIM, sparse=True), torch.nn.Linear(DIM, 1)
    )
    head = torch.nn.Linear(DIM, 1)
    head.load_state_dict(reference[1].state_dict())
    return reference, head


def on_the_store(kv, reference, head):
    """The same model with its table in ``kv`` (starting from the reference's rows)."""
    return torch.nn.Sequential(Embedding(kv, "emb", ROWS, DIM, init=reference[0].weight), head)


def test_the_gradient_reaches_the_layers_above_too(kv):
    """An embedding under a linear layer: both train as the torch model (the linear layer
    with torch's SGD, the table with the store's)."""
    reference, head = torch_twin()
    model = on_the_store(kv, reference, head)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR))
    torch_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    head_opt = torch.optim.SGD(model.parameters(), lr=LR)
    assert list(model.parameters()) == list(head.parameters())  # the table is the store's
    for ids, _ in batches(5):
        for net, opt in ((reference, torch_opt), (model, head_opt)):
            opt.zero_grad()
            net(ids).square().mean().backward()
            opt.step()
    torch.testing.assert_close(table_of(model[0]), reference[0].weight.detach())
    torch.testing.assert_close(head.weight, reference[1].weight)
    torch.testing.assert_close(head.bias, reference[1].bias)


def test_a_compiled_model_runs_the_table_eagerly_and_trains_as_torch():
    """torch.compile breaks the graph at the Embedding (its pull and push are store calls):
    traced, dynamo went into the store's internals and raised InternalTorchDynamoError."""
    reference, head = torch_twin()
    with akv.create("local") as kv:
        model = on_the_store(kv, reference, head)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR))
        compiled = torch.compile(model, backend="eager")
        torch_opt = torch.optim.SGD(reference[0].parameters(), lr=LR)
        for ids, _ in batches(2):
            compiled(ids).square().mean().backward()
            torch_opt.zero_grad()
            reference(ids).square().mean().backward()
            torch_opt.step()
        torch.testing.assert_close(table_of(model[0]), reference[0].weight.detach())
        torch.testing.assert_close(compiled(torch.tensor([1, 2])), reference(torch.tensor([1, 2])))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.trace is deprecated
@pytest.mark.parametrize("trace", ["jit.trace", "export"])
def test_tracing_the_table_is_refused_saying_why(kv, trace):
    """torch.jit.trace kept the traced call's rows as constants: the traced model gave
    those rows for any other ids (and never pushed), with only torch's generic warnings."""
    emb = Embedding(kv, "emb", ROWS, DIM, init=torch.ones(ROWS, DIM))
    model = torch.nn.Sequential(emb, torch.nn.Linear(DIM, 1))
    tracer = torch.jit.trace if trace == "jit.trace" else torch.export.export
    with pytest.raises(InvalidArgumentError, match=r"cannot be traced .* or exported") as caught:
        tracer(model, (torch.tensor([1, 2]),))
    assert str(caught.value).startswith("Embedding key 'emb': forward: ")


def test_with_a_distributed_optimizer_on_the_same_store():
    """The layers above trained by DistributedOptimizer: one store, one akv optimizer."""
    reference, head = torch_twin()
    with akv.create("local") as kv:
        model = on_the_store(kv, reference, head)
        opt = akv_torch.DistributedOptimizer(
            model.named_parameters(), kv, akv.optimizer.SGD(learning_rate=LR)
        )
        assert kv.keys() == ["emb", "1.weight", "1.bias"]
        torch_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        for ids, _ in batches(5):
            torch_opt.zero_grad()
            reference(ids).square().mean().backward()
            torch_opt.step()
            opt.zero_grad()
            model(ids).square().mean().backward()
            opt.step()
        torch.testing.assert_close(table_of(model[0]), reference[0].weight.detach())
        torch.testing.assert_close(head.weight, reference[1].weight, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- forward, backward, rows


@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3), (2, 0, 4), (2, 1, 3)])
def test_the_output_has_the_ids_shape_plus_the_row(kv, shape):
    table = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM)
    emb = Embedding(kv, "emb", ROWS, DIM, init=table)
    ids = torch.randint(0, ROWS, shape)
    out = emb(ids)
    assert out.shape == (*shape, DIM) and out.dtype == torch.float32
    assert torch.equal(out, table[ids])
    assert torch.equal(emb.rows(ids), table[ids])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_any_integer_ids(kv, dtype):
    table = torch.randn(ROWS, DIM)
    emb = Embedding(kv, "emb", ROWS, DIM, init=table)
    ids = torch.tensor([[3, 1], [3, 0]], dtype=dtype)
    assert torch.equal(emb(ids), table[ids.long()])


@pytest.mark.parametrize(
    ("dtype", "rows", "ids"),
    [(torch.int8, 1000, [1, 2]), (torch.uint8, 300, [50]), (torch.int16, 70000, [5000])],
)
def test_small_integer_ids_of_a_table_beyond_their_range(dtype, rows, ids):
    # The bound was compared in the ids' own dtype, where it wraps: int8 id 1 was "outside
    # [0, 1000)" (found by a review).
    with akv.create("local") as kv:
        emb = Embedding(kv, "emb", rows, 2)
        chosen = torch.tensor(ids, dtype=dtype)
        assert torch.equal(emb(chosen), torch.zeros(len(ids), 2))
        with pytest.raises(RowIdError, match=rf"id -1 at ids\[1\] is outside \[0, {rows}\)"):
            emb(torch.tensor([0, -1], dtype=torch.int8))


def test_no_init_reads_as_zeros_and_a_push_writes_only_its_rows():
    with akv.create("local") as kv:
        emb = Embedding(kv, 7, ROWS, DIM)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        assert torch.equal(table_of(emb), torch.zeros(ROWS, DIM))
        emb(torch.tensor([2, 2, 5])).sum().backward()
        expected = torch.zeros(ROWS, DIM)
        expected[2], expected[5] = -2.0, -1.0  # the repeated id's gradient summed
        assert torch.equal(table_of(emb), expected)


def test_each_backward_pushes_once_and_nothing_without_grad():
    with akv.create("local") as kv:
        emb = Embedding(kv, "emb", ROWS, DIM)
        kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
        ids = torch.tensor([1, 1, 4])
        with torch.no_grad():
            assert not emb(ids).requires_grad
        emb(ids)  # a forward without backward pushes nothing
        emb.rows(ids)
        assert torch.equal(table_of(emb), torch.zeros(ROWS, DIM))
        out = emb(ids)
        out.sum().backward(retain_graph=True)
        assert table_of(emb)[1, 0] == -2.0
        out.sum().backward()  # each backward through the output pushes its gradient
        assert table_of(emb)[1, 0] == -4.0 and table_of(emb)[4, 0] == -2.0


def test_a_frozen_table_pushes_nothing_as_torchs_frozen_embedding(kv):
    """requires_grad_(False) froze nothing (the module has no parameters): the backward
    through the frozen table still pushed, and the optimizer moved its rows."""
    reference = reference_table()
    emb = Embedding(kv, "emb", ROWS, DIM, init=reference.weight)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR))
    head = torch.nn.Linear(DIM, 1)
    ids = torch.tensor([1, 1, 4])
    for table in (reference, emb):
        assert table.requires_grad_(False) is table
        out = table(ids)
        assert not out.requires_grad
        head(out).sum().backward()  # reaches the head only
    assert reference.weight.grad is None
    assert torch.equal(table_of(emb), reference.weight.detach())
    assert "requires_grad=False" in repr(emb)
    emb.requires_grad_()
    emb(ids).sum().backward()
    assert table_of(emb)[1, 0] == reference.weight[1, 0] - 2 * LR
    with pytest.raises(InvalidArgumentError, match="requires_grad_ takes a bool, got 0"):
        emb.requires_grad_(0)


def test_an_output_used_twice_pushes_the_summed_gradient_once(kv):
    emb = Embedding(kv, "emb", ROWS, DIM)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0, momentum=0.5))
    out = emb(torch.tensor([3]))
    (out.sum() + 2 * out.sum()).backward()
    # One push of gradient 3: with momentum, two pushes of 1 and 2 would give -3.5.
    assert table_of(emb)[3, 0] == -3.0


def test_without_an_optimizer_a_push_replaces_the_rows():
    """The store's meaning of a push (MXNet's): set the optimizer before training."""
    with akv.create("local") as kv:
        emb = Embedding(kv, "emb", ROWS, DIM, init=torch.ones(ROWS, DIM))
        emb(torch.tensor([0, 0])).sum().backward()
        expected = torch.zeros(ROWS, DIM)
        expected[0] = 2.0
        assert torch.equal(table_of(emb), expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.numpy(),
        lambda t: RowSparseArray.from_dense(t.numpy()),
        lambda t: t.to_sparse(1),
    ],
    ids=["numpy", "RowSparseArray", "torch sparse"],
)
def test_init_takes_dense_and_row_sparse_tables(kv, make):
    table = torch.zeros(ROWS, DIM, dtype=torch.float64)
    table[[1, 9]] = torch.randn(2, DIM, dtype=torch.float64)
    emb = Embedding(kv, "emb", ROWS, DIM, init=make(table), dtype=torch.float64)
    assert emb.dtype == torch.float64
    assert torch.equal(table_of(emb), table)


def test_float16_tables(kv):
    table = torch.randn(ROWS, DIM).half()
    emb = Embedding(kv, "emb", ROWS, DIM, init=table, dtype=torch.float16)
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=LR, multi_precision=True))
    out = emb(torch.tensor([0, 3]))
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert torch.equal(table_of(emb)[1:3], table[1:3])
    assert not torch.equal(table_of(emb)[0], table[0])


def test_the_module_has_no_parameters_and_says_what_it_is(kv):
    emb = Embedding(kv, "emb", ROWS, DIM)
    assert list(emb.parameters()) == [] and emb.state_dict() == {}
    assert (emb.kv, emb.key, emb.num_embeddings, emb.embedding_dim) == (kv, "emb", ROWS, DIM)
    assert repr(emb) == "Embedding(key='emb', 12, 4, dtype=torch.float32)"


def test_moves_and_dtype_conversions_leave_the_rows_as_the_store_keeps_them(kv):
    """The rows' dtype is the store key's: .half() or .double() of a model holding the module
    converts the other layers and warns that the table's rows stay as they are (refusing
    would leave the layers before it converted, the others not); a device move is a no-op
    (the output is on the ids' device)."""
    emb = Embedding(kv, "emb", ROWS, DIM, init=torch.ones(ROWS, DIM))
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), emb, torch.nn.Linear(DIM, 1))
    assert emb.to("cpu") is emb and emb.float() is emb
    for call, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.double(), torch.float64)):
        with pytest.warns(UserWarning, match=f"rows stay torch.float32 .* to {dtype}"):
            call(model)
        assert model[0].weight.dtype == model[2].weight.dtype == dtype  # all the others
        assert emb(torch.tensor([1])).dtype == torch.float32


@pytest.mark.parametrize(
    "copy_it",
    [copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_the_module_refuses_to_be_pickled_saying_what_to_save(kv, copy_it):
    model = torch.nn.Sequential(Embedding(kv, "emb", ROWS, DIM), torch.nn.Linear(DIM, 1))
    for module in (model[0], model):
        with pytest.raises(InvalidArgumentError, match=r"Embedding key 'emb': the module cannot"):
            copy_it(module)
    torch.save(model.state_dict(), io.BytesIO())  # the other layers are saved this way


def test_a_shallow_copy_is_another_module_on_the_same_key(kv):
    emb = Embedding(kv, "emb", ROWS, DIM, init=torch.ones(ROWS, DIM))
    twin = copy.copy(emb)
    assert twin is not emb and (twin.kv, twin.key) == (kv, "emb")
    assert torch.equal(twin(torch.tensor([2])), emb(torch.tensor([2])))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        (torch.tensor([[1, 2], [12, 3]]), RowIdError, r"id 12 at ids\[1, 0\] is outside \[0, 12\)"),
        (torch.tensor([0, -1]), RowIdError, r"id -1 at ids\[1\] is outside"),
        (torch.tensor(40), RowIdError, r"id 40 at ids is outside"),
        (
            torch.tensor([1.0]),
            InvalidArgumentError,
            r"ids must be integers \(int64, int32, int16, int8 or uint8\), got a tensor of "
            "dtype torch.float32",
        ),
        (torch.tensor([True]), InvalidArgumentError, "dtype torch.bool"),
        # torch itself has no unique or comparison kernels for these.
        (torch.tensor([1], dtype=torch.uint16), InvalidArgumentError, "dtype torch.uint16"),
        (torch.tensor([1], dtype=torch.uint64), InvalidArgumentError, "dtype torch.uint64"),
        (
            [1, 2],
            InvalidArgumentError,
            "ids must be a torch tensor of integers, got builtins.list",
        ),
        (torch.tensor([1]).to_sparse(), InvalidArgumentError, "ids must be a dense tensor"),
        # torch.unique has no meta kernel (NotImplementedError): no values to pull.
        (torch.tensor([1], device="meta"), InvalidArgumentError, "ids are on the meta device"),
    ],
)
def test_bad_ids_are_refused_naming_the_key(kv, ids, error, match):
    emb = Embedding(kv, "emb", ROWS, DIM, init=torch.ones(ROWS, DIM))
    kv.set_optimizer(akv.optimizer.SGD(learning_rate=1.0))
    for name, call in (("forward", emb), ("rows", emb.rows)):
        with pytest.raises(error, match=match) as caught:
            call(ids)
        assert str(caught.value).startswith(f"Embedding key 'emb': {name}: ")
    assert torch.equal(table_of(emb), torch.ones(ROWS, DIM))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_embeddings": 0}, InvalidArgumentError, "num_embeddings must be an int >= 1, got 0"),
        (
            {"embedding_dim": 2.0},
            InvalidArgumentError,
            "embedding_dim must be an int >= 1, got 2.0",
        ),
        ({"dtype": torch.int64}, InvalidArgumentError, "dtype must be a floating torch.dtype"),
        ({"dtype": np.float32}, InvalidArgumentError, "dtype must be a floating torch.dtype"),
        ({"dtype": torch.bfloat16}, UnsupportedDTypeError, "dtype torch.bfloat16 has no NumPy"),
        (
            {"init": torch.ones(3, DIM)},
            ShapeMismatchError,
            r"init of shape \(3, 4\) does not match the table's shape \(12, 4\)",
        ),
        (
            {"init": np.ones((ROWS, DIM))},
            DTypeMismatchError,
            "init of dtype float64 does not match the table's dtype float32",
        ),
        ({"init": RowSparseArray.zeros((ROWS, 5))}, ShapeMismatchError, r"init of shape \(12, 5\)"),
        ({"init": "table"}, InvalidArgumentError, "init: expected a NumPy array or .*, got str"),
        ({"init": torch.ones(ROWS, DIM).to_sparse(2)}, StorageTypeError, "2 sparse dimensions"),
        ({"init": torch.ones(ROWS, DIM, device="meta")}, InvalidArgumentError, "meta device"),
    ],
)
def test_bad_arguments_are_refused_before_the_key_is_initialized(kv, kwargs, error, match):
    args = {"num_embeddings": ROWS, "embedding_dim": DIM, **kwargs}
    with pytest.raises(error, match=match) as caught:
        Embedding(kv, "emb", **args)
    assert str(caught.value).startswith("Embedding key 'emb': ")
    assert kv.keys() == []


def test_a_key_already_in_the_store_is_refused(kv):
    kv.init("emb", RowSparseArray.zeros((ROWS, DIM)))
    with pytest.raises(DuplicateInitError, match="'emb'"):
        Embedding(kv, "emb", ROWS, DIM)


async def test_an_async_store_is_refused():
    """forward() waits for its rows: on an AsyncKVStore that would block its event loop."""
    async with await akv.create_async("local") as store:
        with pytest.raises(InvalidArgumentError, match=r"got an AsyncKVStore .* forward"):
            Embedding(store, "emb", ROWS, DIM)
        assert store.keys() == []
    with pytest.raises(InvalidArgumentError, match=r"kv must be an akv\.KVStore"):
        Embedding(object(), "emb", ROWS, DIM)


def test_a_closed_store_fails_the_forward():
    kv = akv.create("local")
    emb = Embedding(kv, "emb", ROWS, DIM)
    kv.close()
    with pytest.raises(akv.ClosedError):
        emb(torch.tensor([1]))


# ---------------------------------------------------------------- several workers


@pytest.mark.timeout(90)
def test_two_dist_sync_workers_train_one_table_split_over_two_servers():
    """Each worker pushes its batch's gradient; the servers sum them per round. Equal to
    one torch table trained on both workers' batches (the gradients summed)."""
    from tests.akv.cluster.cluster import Cluster

    reference = reference_table()
    start = reference.weight.detach().clone()
    data = [batches(4, seed=10 + rank) for rank in range(2)]

    def worker(env):
        with akv.create("dist_sync", environ=env) as store:
            rank = store.rank
            # Every worker passes its own table: rank 0's is kept.
            emb = Embedding(store, "emb", ROWS, DIM, init=start if rank == 0 else start + 1)
            store.set_optimizer(akv.optimizer.SGD(learning_rate=LR))
            for ids, weights in data[rank]:
                loss_of(emb(ids), weights).backward()
            store.barrier()
            return table_of(emb)

    with Cluster(num_workers=2, num_servers=2) as cluster, ThreadPoolExecutor(2) as pool:
        tables = list(pool.map(worker, [cluster.worker_env(rank) for rank in range(2)]))
    assert torch.equal(tables[0], tables[1])
    torch_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for (ids0, weights0), (ids1, weights1) in zip(*data, strict=True):
        torch_opt.zero_grad()
        (loss_of(reference(ids0), weights0) + loss_of(reference(ids1), weights1)).backward()
        torch_opt.step()
    torch.testing.assert_close(tables[0], reference.weight.detach(), rtol=1e-6, atol=1e-6)
