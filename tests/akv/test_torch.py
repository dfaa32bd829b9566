"""akv.torch.DistributedOptimizer: torch's SGD step for step, MXNet's meaning across workers."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import akv
from akv import ClosedError, DoublePushError, DuplicateInitError, InvalidArgumentError

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
DistributedOptimizer = pytest.importorskip("akv.torch").DistributedOptimizer
F = torch.nn.functional

FEATURES, HIDDEN, CLASSES, BATCH = 8, 16, 4, 12
# MXNet's SGD and torch's differ in the order of float32 operations only.
RTOL, ATOL = 1e-5, 1e-6


def mlp(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def batches(steps: int, size: int = BATCH, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (size,), generator=generator),
        )
        for _ in range(steps)
    ]


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_same_weights(model, reference):
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(
            got.detach().numpy(), want.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=name
        )


@pytest.fixture
def kv():
    store = akv.create("local")
    yield store
    store.close()


# ---------------------------------------------------------------- one worker = torch's SGD


@pytest.mark.parametrize("named", [True, False], ids=["named_parameters", "parameters"])
@pytest.mark.parametrize(("momentum", "wd"), [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-2), (0.9, 1e-3)])
def test_one_worker_steps_as_torch_sgd(kv, named, momentum, wd):
    model, reference = mlp(), mlp()
    params = model.named_parameters() if named else model.parameters()
    opt = DistributedOptimizer(
        params, kv, akv.optimizer.SGD(learning_rate=0.1, momentum=momentum, wd=wd)
    )
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)
    assert opt.keys == (["0.weight", "0.bias", "2.weight", "2.bias"] if named else [0, 1, 2, 3])
    assert kv.keys() == opt.keys
    pointers = [p.data_ptr() for p in model.parameters()]
    losses = []
    for x, y in batches(6):
        losses.append(train_step(model, opt, x, y))
        train_step(reference, torch_opt, x, y)
        assert_same_weights(model, reference)
    assert [p.data_ptr() for p in model.parameters()] == pointers  # updated in place
    assert losses[-1] < losses[0]


def test_gradient_accumulation_matches_torch(kv):
    model, reference = mlp(), mlp()
    opt = DistributedOptimizer(
        model.parameters(),
        kv,
        akv.optimizer.SGD(learning_rate=0.05, momentum=0.9),
        backward_passes_per_step=2,
    )
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    data = batches(6)
    for step in range(3):
        opt.zero_grad()
        torch_opt.zero_grad()
        for x, y in data[2 * step : 2 * step + 2]:
            F.cross_entropy(model(x), y).backward()
            F.cross_entropy(reference(x), y).backward()
        opt.step()
        torch_opt.step()
        assert_same_weights(model, reference)


def test_frozen_parameters_are_skipped_and_keep_their_positions(kv):
    model = mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    assert opt.keys == [1, 2, 3]
    assert kv.keys() == [1, 2, 3]
    assert opt.params == [model[0].bias, model[2].weight, model[2].bias]
    before = model[0].bias.detach().clone()
    for x, y in batches(2):
        train_step(model, opt, x, y)
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[0].bias.detach(), before)


def test_a_parameter_without_gradient_is_left_alone_as_torch_does(kv):
    model, unused = mlp(), torch.nn.Parameter(torch.ones(3))
    named = [*model.named_parameters(), ("unused", unused)]
    opt = DistributedOptimizer(named, kv, akv.optimizer.SGD(learning_rate=0.1, wd=0.5))
    for x, y in batches(2):
        train_step(model, opt, x, y)
    assert torch.equal(unused.detach(), torch.ones(3))  # with wd, a zero-grad push would decay


def test_a_gradient_set_by_hand_is_pushed_by_step(kv):
    weight = torch.nn.Parameter(torch.ones(4))
    opt = DistributedOptimizer([weight], kv, akv.optimizer.SGD(learning_rate=0.5))
    weight.grad = torch.full((4,), 2.0)
    opt.step()
    assert torch.equal(weight.detach(), torch.zeros(4))


def test_each_gradient_is_pushed_when_ready_with_priority_minus_index(kv):
    model = mlp()
    opt = DistributedOptimizer(model.named_parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    inner, pushed, during_backward = kv._inner, [], []
    original_push = inner.push

    def recording_push(key, value, priority=0):
        pushed.append((key, priority))
        during_backward.append(backward_running[0])
        return original_push(key, value, priority)

    inner.push = recording_push
    backward_running = [False]
    x, y = batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    backward_running[0] = True
    loss.backward()
    backward_running[0] = False
    assert {key: priority for key, priority in pushed} == {
        "0.weight": 0,
        "0.bias": -1,
        "2.weight": -2,
        "2.bias": -3,
    }
    assert pushed[0][0].startswith("2.")  # the last layer's gradient is ready first
    assert all(during_backward)
    opt.step()


def test_zero_grad_as_torch(kv):
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    grad = model[0].weight.grad
    opt.zero_grad(set_to_none=False)
    assert model[0].weight.grad is grad and not grad.any()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_step_returns_the_closure_loss(kv):
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert opt.step(closure).item() < first.item()


def test_a_graph_older_than_the_step_fails_at_backward_as_with_torch(kv):
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    x, y = batches(1)[0]
    old = F.cross_entropy(model(x), y)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        old.backward()


def test_a_second_backward_before_step_is_refused(kv):
    model = mlp()
    DistributedOptimizer(model.named_parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(DoublePushError, match=r"parameter '2\.bias' was ready 2 times"):
        F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("bucket_bytes", [None, 1 << 20], ids=["a key each", "one bucket"])
def test_a_sparse_gradient_is_refused_naming_akv_torch_embedding_and_nothing_is_pushed(
    kv, bucket_bytes
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    before = model[0].weight.detach().clone()
    opt = DistributedOptimizer(
        model.named_parameters(),
        kv,
        torch.optim.SGD(model.parameters(), lr=0.1),
        bucket_bytes=bucket_bytes,
    )
    loss = model(torch.tensor([1, 2, 2])).sum()
    with pytest.raises(akv.StorageTypeError, match=r"parameter '0\.weight'.*akv\.torch\.Embedding"):
        loss.backward()
        opt.step()  # (bucketed: the dense gradients' hooks push; step meets the sparse one)
    with pytest.raises(akv.StorageTypeError, match=r"akv\.torch\.Embedding"):
        opt.step()
    torch.testing.assert_close(model[0].weight.detach(), before)


def test_close_removes_the_hooks(kv, monkeypatch):
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    params = list(model.parameters())
    assert all(p._post_accumulate_grad_hooks for p in params)  # torch's own record
    opt.close()
    assert not any(p._post_accumulate_grad_hooks for p in params)
    pushed = []
    monkeypatch.setattr(kv._inner, "push", lambda *args, **kwargs: pushed.append(args))
    keys = kv.keys()
    stored = [kv.pull(key).clone() for key in keys]
    x, y = batches(1)[0]
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()  # no hook: no push, no DoublePushError
    assert pushed == []
    assert all(torch.equal(kv.pull(k), v) for k, v in zip(keys, stored, strict=True))
    opt.close()


def test_a_closed_store_fails_the_backward_that_pushes():
    store = akv.create("local")
    model = mlp()
    DistributedOptimizer(model.parameters(), store, akv.optimizer.SGD(learning_rate=0.1))
    store.close()
    x, y = batches(1)[0]
    with pytest.raises(ClosedError):
        F.cross_entropy(model(x), y).backward()


def test_keys_already_in_the_store_are_refused(kv):
    model = mlp()
    DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))
    with pytest.raises(DuplicateInitError):
        DistributedOptimizer(model.parameters(), kv, akv.optimizer.SGD(learning_rate=0.1))


# ---------------------------------------------------------------- bad arguments


def sgd():
    return akv.optimizer.SGD(learning_rate=0.1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda m, kv: (m.parameters(), kv, torch.optim.SGD(list(m.parameters())[:1], lr=0.1)),
            r"torch optimizer must hold exactly the parameters given",
        ),
        (lambda m, kv: (m.parameters(), kv, "sgd"), "optimizer must be .* got builtins.str"),
        (lambda m, kv: ([], kv, sgd()), "params is empty"),
        (
            lambda m, kv: (m.parameters(), None, sgd()),
            r"kv must be an akv\.KVStore \(from akv\.create\), got builtins\.NoneType",
        ),
        (lambda m, kv: (m.parameters(), kv._inner, sgd()), "got an AsyncKVStore"),
        (lambda m, kv: (m[0].weight, kv, sgd()), "got a single tensor"),
        (lambda m, kv: (42, kv, sgd()), "params must be an iterable .* got builtins.int"),
        (
            lambda m, kv: ([{"params": list(m.parameters())}], kv, sgd()),
            "parameter groups",
        ),
        (
            lambda m, kv: ([("w", m[0].weight), m[0].bias], kv, sgd()),
            r"params item 1 \(parameter 1\) mixes named and unnamed",
        ),
        (lambda m, kv: ([(3, m[0].weight)], kv, sgd()), "name must be a str, got builtins.int"),
        (
            lambda m, kv: ([("w", np.ones(3))], kv, sgd()),
            r"parameter 'w' must be a torch.Tensor .* got numpy.ndarray",
        ),
        (
            lambda m, kv: ([("a", m[0].weight), ("b", m[0].weight)], kv, sgd()),
            r"parameter 'b' is the same tensor as parameter 'a'",
        ),
        (
            lambda m, kv: ([("a", m[0].weight), ("a", m[0].bias)], kv, sgd()),
            r"parameter 'a' is given twice",
        ),
        (
            lambda m, kv: ([("w2", m[0].weight * 2)], kv, sgd()),
            r"parameter 'w2' is not a leaf tensor",
        ),
        (
            lambda m, kv: ([p.detach() for p in m.parameters()], kv, sgd()),
            "none of the 4 parameters in params requires grad",
        ),
    ],
)
def test_bad_arguments_raise_invalid_argument_naming_it(kv, make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        DistributedOptimizer(*make(mlp(), kv))
    assert kv.keys() == []  # nothing was initialized


@pytest.mark.parametrize("passes", [0, -1, 1.5, True])
def test_bad_backward_passes_per_step(kv, passes):
    with pytest.raises(InvalidArgumentError, match="backward_passes_per_step must be an int"):
        DistributedOptimizer(mlp().parameters(), kv, sgd(), backward_passes_per_step=passes)


def test_importing_akv_does_not_import_torch():
    code = "import sys, akv; assert 'torch' not in sys.modules, 'akv imported torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- several workers


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rescale_grad", [1.0, 0.5], ids=["summed", "averaged"])
def test_two_dist_sync_workers_sum_gradients_and_end_equal(rescale_grad):
    from tests.akv.cluster.cluster import Cluster

    steps, lr, momentum, wd = 4, 0.1, 0.9, 1e-3
    data = batches(steps, size=2 * BATCH)

    # Each worker starts elsewhere: rank 0's values win. (Built here: torch's generator is
    # shared by the threads.)
    models = [mlp(seed=10 + rank) for rank in range(2)]

    def worker(env):
        with akv.create("dist_sync", environ=env) as store:
            rank = store.rank
            model = models[rank]
            opt = DistributedOptimizer(
                model.named_parameters(),
                store,
                akv.optimizer.SGD(
                    learning_rate=lr, momentum=momentum, wd=wd, rescale_grad=rescale_grad
                ),
            )
            start = [p.detach().clone() for p in model.parameters()]
            for x, y in data:
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                train_step(model, opt, x[mine], y[mine])
            return rank, start, model

    with Cluster(num_workers=2, num_servers=1) as cluster, ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(worker, [cluster.worker_env(r) for r in range(2)]))
    outcomes.sort(key=lambda outcome: outcome[0])
    (_, start0, model0), (_, start1, model1) = outcomes
    for a, b, initial in zip(start0, start1, mlp(seed=10).parameters(), strict=True):
        assert torch.equal(a, initial) and torch.equal(b, initial)
    for a, b in zip(model0.parameters(), model1.parameters(), strict=True):
        assert torch.equal(a, b)  # both pulled the same weights

    # The reference: one torch model, whose gradient is the sum of the workers' gradients
    # (each the mean over its half batch), times rescale_grad.
    reference = mlp(seed=10)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    for x, y in data:
        torch_opt.zero_grad()
        halves = [
            F.cross_entropy(reference(x[h]), y[h]) for h in (slice(0, BATCH), slice(BATCH, None))
        ]
        (rescale_grad * sum(halves)).backward()
        torch_opt.step()
    assert_same_weights(model0, reference)


# ---------------------------------------------------------------------- torch optimizers


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    ],
    ids=["SGD", "AdamW"],
)
def test_a_torch_optimizer_on_one_worker_equals_the_bare_optimizer_exactly(kv, make):
    """The store only sums (one worker: the gradient itself), then torch steps: the same
    weights, bit for bit, as the bare optimizer's, with an LR scheduler on both."""
    model, reference = mlp(), mlp()
    opt = DistributedOptimizer(model.parameters(), kv, make(model.parameters()))
    bare = make(reference.parameters())
    # An LR scheduler takes the torch optimizer itself (opt.optimizer), as the bare one.
    schedules = [
        torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt.optimizer, bare)
    ]
    for x, y in batches(5):
        train_step(model, opt, x, y)
        train_step(reference, bare, x, y)
        for schedule in schedules:
            schedule.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
    assert (
        opt.param_groups[0]["lr"]
        == bare.param_groups[0]["lr"]
        < make([torch.zeros(1)]).param_groups[0]["lr"]
    )
    assert opt.state_dict()["state"].keys() == bare.state_dict()["state"].keys()
    opt.close()


def test_gradients_are_clipped_between_synchronize_and_step(kv):
    model, reference = mlp(), mlp()
    opt = DistributedOptimizer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=1.0))
    bare = torch.optim.SGD(reference.parameters(), lr=1.0)
    (x, y), *_ = batches(1)
    for net, optimizer in ((model, opt), (reference, bare)):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if optimizer is opt:
            opt.synchronize()  # the summed gradients are in .grad now
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.01)
        optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
    opt.close()


def test_an_akv_optimizer_has_no_torch_state_dict(kv):
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, sgd())
    for call in (lambda: opt.state_dict(), lambda: opt.synchronize(), lambda: opt.param_groups):
        with pytest.raises(InvalidArgumentError, match="the optimizer is akv's"):
            call()
    opt.close()


@pytest.mark.parametrize("setup", ["set_optimizer", "set_updater", "an akv DistributedOptimizer"])
def test_a_torch_optimizer_refuses_a_store_that_updates_pushes(kv, setup):
    """The store's optimizer would update the gradient sums the torch optimizer pulls into
    .grad (they came back as updated values, silently): refused before anything is put in
    the store."""
    if setup == "set_optimizer":
        kv.set_optimizer(sgd())
    elif setup == "set_updater":
        kv.set_updater(lambda key, recv, stored: None)
    else:
        DistributedOptimizer({"other": torch.nn.Parameter(torch.ones(2))}, kv, sgd())
    model = mlp()
    torch_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="the store only sums the gradients, but"):
        DistributedOptimizer(model.named_parameters(), kv, torch_sgd)
    name, param = next(iter(model.named_parameters()))
    with pytest.raises(akv.KeyNotInitializedError):  # nothing was put in the store
        kv.pull(name, out=np.zeros(param.shape, np.float32))


@pytest.mark.parametrize("cleared", [False, True], ids=["still set", "cleared before step"])
def test_an_optimizer_set_after_a_torch_optimizer_fails_its_step(kv, cleared):
    """The pushes of a step the store's optimizer updated are refused by that step, also
    when the optimizer was cleared again before it (the sums are the updated values)."""
    model = mlp()
    opt = DistributedOptimizer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), *_ = batches(1)
    train_step(model, opt, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    kv.set_optimizer(sgd())
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if cleared:
        kv.set_updater(None)
        assert not kv.updates_on_push
    with pytest.raises(akv.OptimizerError, match="it was set after this optimizer was made"):
        opt.step()
    for got, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(got, want)  # the torch optimizer did not step on them


def test_bfloat16_parameters_with_an_akv_optimizer_are_refused_at_once(kv):
    # Every step raised "the weight must be floating-point, got bfloat16" (found by a
    # review); a torch optimizer trains them (tested with the dtypes above).
    layer = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"parameters \['weight', 'bias'\] are bfloat16"):
        DistributedOptimizer(layer.named_parameters(), kv, akv.optimizer.SGD())
    assert kv.keys() == []


def test_a_torch_optimizer_is_refused_with_dist_async():
    model = mlp()
    store = akv.create("local")
    try:
        store._inner._type = "dist_async"  # the refusal reads the type name only
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(InvalidArgumentError, match="a dist_async store has no rounds"):
            DistributedOptimizer(model.parameters(), store, optimizer)
    finally:
        store._inner._type = "local"
        store.close()


@pytest.mark.timeout(90)
def test_two_dist_sync_workers_step_a_torch_optimizer_on_the_summed_gradients():
    """The servers only sum: each worker's torch AdamW steps on the sum of both workers'
    gradients, so both end equal to one AdamW on the summed gradient."""
    from tests.akv.cluster.cluster import Cluster

    steps = 4
    data = batches(steps, size=2 * BATCH)
    models = [mlp(seed=20 + rank) for rank in range(2)]

    def worker(env):
        with akv.create("dist_sync", environ=env) as store:
            rank = store.rank
            model = models[rank]
            opt = DistributedOptimizer(
                model.named_parameters(), store, torch.optim.AdamW(model.parameters(), lr=0.01)
            )
            for x, y in data:
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                train_step(model, opt, x[mine], y[mine])
            opt.close()
            return rank, model

    with Cluster(num_workers=2, num_servers=1) as cluster, ThreadPoolExecutor(2) as pool:
        outcomes = sorted(pool.map(worker, [cluster.worker_env(r) for r in range(2)]))
    (_, model0), (_, model1) = outcomes
    for a, b in zip(model0.parameters(), model1.parameters(), strict=True):
        assert torch.equal(a, b)
    reference = mlp(seed=20)  # rank 0's start
    bare = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for x, y in data:
        bare.zero_grad()
        halves = [
            F.cross_entropy(reference(x[h]), y[h]) for h in (slice(0, BATCH), slice(BATCH, None))
        ]
        sum(halves).backward()
        bare.step()
    assert_same_weights(model0, reference)


# ---------------------------------------------------------------------- fused buckets


def deep(seed: int = 0):
    """Many small tensors: 6 layers of 12 x 12 (weights and biases)."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(FEATURES, 12), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(12, 12), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(12, CLASSES))


@pytest.mark.parametrize(
    "make",
    [
        lambda params: akv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
        lambda params: torch.optim.Adam(params, lr=0.01),
    ],
    ids=["akv SGD in the store", "torch Adam here"],
)
def test_fused_buckets_train_as_one_key_per_parameter(make):
    """Fused into buckets of at most 1 KiB, the parameters train to the same weights, bit
    for bit, as with one key each; the store holds a few keys instead of 12."""
    results = []
    for bucket_bytes in (None, 1024):
        model = deep()
        with akv.create("local") as store:
            opt = DistributedOptimizer(
                model.named_parameters(), store, make(model.parameters()), bucket_bytes=bucket_bytes
            )
            for x, y in batches(4):
                train_step(model, opt, x, y)
            keys = opt.store_keys
            opt.close()
        results.append((model, keys))
    (plain, plain_keys), (fused, fused_keys) = results
    for a, b in zip(plain.parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(plain_keys) == 12
    assert 1 < len(fused_keys) < 12 and any(str(k).startswith("bucket") for k in fused_keys)


@pytest.mark.parametrize(
    ("layers", "keys"),
    [
        ([(12, 12)], ["0.weight", "0.bias"]),  # one each: both keep their names
        ([(12, 12), (12, 2)], ["0.weight", "bucket1"]),  # 48 + 96 + 8 bytes: one bucket
    ],
)
def test_a_bucket_of_one_parameter_keeps_its_key(layers, keys):
    """A 12 x 12 weight (576 bytes) is larger than a bound of 300 bytes: alone in its
    bucket, it keeps its name, as does a bias alone in the next one."""
    model = torch.nn.Sequential(*(torch.nn.Linear(*shape) for shape in layers))
    with akv.create("local") as store:
        opt = DistributedOptimizer(
            model.named_parameters(),
            store,
            torch.optim.SGD(model.parameters(), lr=0.1),
            bucket_bytes=300,
        )
        assert opt.store_keys == keys
        opt.close()


def test_a_bucket_member_without_a_gradient_gets_the_sum_of_the_others(kv):
    model = deep()
    first = next(model.parameters())
    opt = DistributedOptimizer(
        model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=1 << 20
    )
    assert len(opt.store_keys) == 1 and opt.store_keys == [12]  # 12 parameters: key 12 + 0
    _, y = batches(1)[0]
    hidden = torch.randn(BATCH, 12)
    F.cross_entropy(model[2:](hidden), y).backward()  # the first layer takes no part
    assert first.grad is None
    before = first.detach().clone()
    others = [p.detach().clone() for p in list(model.parameters())[2:]]
    opt.step()  # the bucket is pushed at the step, the first layer's gradient as zeros
    assert first.grad is not None and torch.equal(first.grad, torch.zeros_like(first))
    assert torch.equal(first, before)  # a zero gradient, plain SGD: unchanged
    after = list(model.parameters())[2:]
    assert not any(torch.equal(a, b) for a, b in zip(others, after, strict=True))
    opt.close()


def test_buckets_refuse_per_tensor_norms_and_bad_sizes(kv):
    model = deep()
    with pytest.raises(InvalidArgumentError, match="LAMB scales each tensor by its own norm"):
        DistributedOptimizer(model.parameters(), kv, akv.optimizer.LAMB(), bucket_bytes=1024)
    with pytest.raises(InvalidArgumentError, match="bucket_bytes must be an int >= 1"):
        DistributedOptimizer(model.parameters(), kv, sgd(), bucket_bytes=0)
