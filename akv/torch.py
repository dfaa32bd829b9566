"""PyTorch training through an akv store: :class:`DistributedOptimizer` (data-parallel dense
parameters) and :class:`Embedding` (an embedding table that lives in the store).

>>> import akv, akv.torch, torch
>>> model = torch.nn.Linear(3, 1)
>>> with akv.create("local") as kv:
...     opt = akv.torch.DistributedOptimizer(
...         model.named_parameters(), kv, akv.optimizer.SGD(learning_rate=0.1)
...     )
...     model(torch.ones(2, 3)).sum().backward()  # each gradient is pushed when it is ready
...     opt.step()  # the updated weights are pulled into the parameters, in place
...     opt.zero_grad()

The optimizer is akv's (MXNet's), and it runs where the weights live: in the store for a
``local`` store, on the parameter servers for a ``dist_*`` store. Each worker keeps a copy
of the parameters, pushes its gradients and pulls the updated weights; the store sums the
gradients of every worker before the update (MXNet's meaning). An :class:`Embedding`
keeps its table as a row-sparse key of the store: each forward pulls the batch's rows, each
backward pushes their gradient. See ``docs/torch.md``.

This module imports torch; ``import akv`` never imports it (use ``import akv.torch``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from akv import optimizer as _optimizer
from akv._torch_common import blocking_store, describe
from akv._torch_embedding import Embedding
from akv.args import Key
from akv.errors import (
    DoublePushError,
    InvalidArgumentError,
    OptimizerError,
    StorageTypeError,
)
from akv.store import KVStore
from akv_engine import Waitable

__all__ = ["DistributedOptimizer", "Embedding"]

Params = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


def _collect(params: object) -> list[tuple[Key, torch.Tensor]]:
    """``(key, tensor)`` for every parameter given, in order (frozen ones included).

    Names are the keys of named parameters; otherwise a parameter's key is its position.
    """
    if isinstance(params, torch.Tensor):
        raise InvalidArgumentError(
            "DistributedOptimizer: params must be an iterable of parameters "
            "(model.parameters()) or of (name, parameter) pairs (model.named_parameters()), "
            "got a single tensor; wrap it in a list"
        )
    if isinstance(params, Mapping):
        params = list(params.items())
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise InvalidArgumentError(
            "DistributedOptimizer: params must be an iterable of parameters or of "
            f"(name, parameter) pairs, got {describe(params)}"
        )
    items: list[tuple[Key, torch.Tensor]] = []
    named: bool | None = None
    for position, item in enumerate(params):
        if isinstance(item, dict):
            raise InvalidArgumentError(
                f"DistributedOptimizer: params item {position} is a dict: parameter groups "
                "(torch.optim's per-group options) are not supported; set per-parameter "
                "learning rates with optimizer.set_lr_mult / set_wd_mult"
            )
        if isinstance(item, tuple) and len(item) == 2:
            name, tensor = item
            if not isinstance(name, str):
                raise InvalidArgumentError(
                    f"DistributedOptimizer: params item {position}: a parameter's name must "
                    f"be a str, got {describe(name)}"
                )
            key: Key = name
            label = f"parameter {name!r}"
            is_named = True
        else:
            tensor, key, label, is_named = item, position, f"parameter {position}", False
        if named is not None and named != is_named:
            raise InvalidArgumentError(
                f"DistributedOptimizer: params item {position} ({label}) mixes named and "
                "unnamed parameters; pass model.named_parameters() or model.parameters()"
            )
        named = is_named
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"DistributedOptimizer: {label} must be a torch.Tensor (a Parameter), got "
                f"{describe(tensor)}"
            )
        items.append((key, tensor))
    return items


def _trainable(items: list[tuple[Key, torch.Tensor]]) -> list[tuple[Key, torch.Tensor]]:
    """The parameters that require grad; refuses duplicates, non-leaves and sparse layouts."""
    seen_keys: set[Key] = set()
    seen_tensors: dict[int, Key] = {}
    kept = []
    for key, tensor in items:
        if key in seen_keys:
            raise InvalidArgumentError(f"DistributedOptimizer: parameter {key!r} is given twice")
        seen_keys.add(key)
        if not tensor.requires_grad:
            continue
        if id(tensor) in seen_tensors:
            raise InvalidArgumentError(
                f"DistributedOptimizer: parameter {key!r} is the same tensor as parameter "
                f"{seen_tensors[id(tensor)]!r}; give each parameter once"
            )
        seen_tensors[id(tensor)] = key
        if not tensor.is_leaf:
            raise InvalidArgumentError(
                f"DistributedOptimizer: parameter {key!r} is not a leaf tensor (it was "
                "computed from other tensors); only leaves accumulate gradients"
            )
        if tensor.layout != torch.strided:
            raise InvalidArgumentError(
                f"DistributedOptimizer: parameter {key!r} has layout {tensor.layout}; only "
                "dense (strided) parameters are supported"
            )
        kept.append((key, tensor))
    return kept


#: Why a torch optimizer cannot share a store that applies an optimizer: the store's
#: optimizer would update the gradient sums it pulls (wrong gradients, silently).
_SUMS_UPDATED = (
    "DistributedOptimizer: with a torch optimizer the store only sums the gradients, but "
    "this store applies an optimizer or updater to every push (set_optimizer or set_updater "
    "was called): the sums pulled into .grad would be the optimizer's updated values. Give "
    "DistributedOptimizer an akv optimizer instead (it then updates these parameters and any "
    "akv.torch.Embedding table of the store alike), or use a store without one"
)


class DistributedOptimizer:
    """Train torch parameters with an akv store: gradients pushed, weights pulled.

    Parameters
    ----------
    params:
        ``model.named_parameters()`` (keys are the names), ``model.parameters()`` (keys are
        the positions 0, 1, ... in the order given), or a mapping from names to parameters.
        Parameters with ``requires_grad=False`` are skipped (their keys stay unused).
    kv:
        A blocking store from :func:`akv.create` (``local``, ``dist_sync``, ``dist_async``
        or their variants). Its keys must be of the kind the parameters use and must not
        be initialized yet. The store stays the caller's: close it yourself.
    optimizer:
        An :class:`akv.optimizer.Optimizer`, given to ``kv.set_optimizer``: it runs where
        the weights live (in a local store, on the servers in a distributed one). Or any
        ``torch.optim.Optimizer`` over these parameters (MXNet's ``update_on_kvstore=False``,
        Horovod's wrapper): the store only sums the gradients (every worker's pushes of a
        round), :meth:`synchronize` pulls the sums into the parameters' ``.grad``, and the
        torch optimizer steps on every worker alike (its parameter groups, state dict and
        LR schedulers as with the bare optimizer; clip between :meth:`synchronize` and
        :meth:`step`). Not with ``dist_async``, which has no rounds to sum.
    backward_passes_per_step:
        How many backward passes accumulate a gradient before it is pushed (default 1).
    bucket_bytes:
        Fuse consecutive parameters (same dtype and device) into store keys of up to this
        many bytes, as DDP's buckets and Horovod's tensor fusion do: a model of many small
        tensors then sends few messages. A bucket is pushed once all its gradients are
        ready, with the priority of its first parameter; its store key is ``"bucket<i>"``
        (str keys) or ``<number of parameters given> + i`` (int keys); a bucket of one
        parameter (one larger than the bound, say) keeps that parameter's key. Default None:
        one key per parameter. Not with optimizers that use each tensor's norm (LAMB, LARS).

    Guarantees
    ----------
    * On return every worker's parameters hold rank 0's values: every worker initializes
      the keys with its own values, the store keeps rank 0's, and every worker pulls them
      into its parameters in place.
    * A parameter's gradient is pushed (with ``priority=-index``, MXNet's order: earlier
      layers first) from a hook as soon as backward has accumulated it; the hook does not
      wait for the push. The gradient's memory is read until :meth:`step` returns, so it
      must not be changed before then.
    * :meth:`step` waits for every push of the step, then pulls the updated weights into
      the parameters of the gradients it pushed, in place: a parameter's storage
      (``data_ptr()``) never changes. Once it returns, every worker of a ``dist_sync``
      store holds the same weights. With a torch optimizer it pulls the summed gradients
      into ``.grad`` instead (unless :meth:`synchronize` did already) and steps it.
    * Gradients of all workers are summed before the optimizer sees them; use
      ``rescale_grad=1/kv.num_workers`` to average them.
    * Argument errors raise :class:`~akv.errors.InvalidArgumentError` naming the argument
      or parameter; a push or pull that failed raises its error from :meth:`step`.
    """

    def __init__(
        self,
        params: Params,
        kv: KVStore,
        optimizer: _optimizer.Optimizer | torch.optim.Optimizer,
        *,
        backward_passes_per_step: int = 1,
        bucket_bytes: int | None = None,
    ) -> None:
        blocking_store(kv, "DistributedOptimizer", "the optimizer waits for the store in step()")
        local = isinstance(optimizer, torch.optim.Optimizer)
        if not local and not isinstance(optimizer, _optimizer.Optimizer):
            raise InvalidArgumentError(
                "DistributedOptimizer: optimizer must be an akv.optimizer.Optimizer or a "
                f"torch.optim.Optimizer, got {describe(optimizer)}"
            )
        if local and kv.type.lower().startswith("dist") and "async" in kv.type.lower():
            raise InvalidArgumentError(
                f"DistributedOptimizer: a torch optimizer steps on the workers on the sum of "
                f"a round's gradients, and a {kv.type} store has no rounds: use an akv "
                "optimizer (it runs on the servers), or a dist_sync store"
            )
        if (
            not isinstance(backward_passes_per_step, int)
            or isinstance(backward_passes_per_step, bool)
            or backward_passes_per_step < 1
        ):
            raise InvalidArgumentError(
                "DistributedOptimizer: backward_passes_per_step must be an int >= 1, got "
                f"{backward_passes_per_step!r}"
            )
        given = _collect(params)
        if not given:
            raise InvalidArgumentError("DistributedOptimizer: params is empty")
        trainable = _trainable(given)
        if not trainable:
            raise InvalidArgumentError(
                f"DistributedOptimizer: none of the {len(given)} parameters in params requires grad"
            )
        if local:
            _check_torch_params(cast(torch.optim.Optimizer, optimizer), trainable)
            if kv.updates_on_push:
                raise InvalidArgumentError(_SUMS_UPDATED)
        else:
            bfloat16 = [key for key, tensor in trainable if tensor.dtype is torch.bfloat16]
            if bfloat16:
                raise InvalidArgumentError(
                    f"DistributedOptimizer: parameters {bfloat16} are bfloat16, which akv's "
                    "optimizers do not update (float16, float32 and float64 weights): use a "
                    "torch.optim optimizer (it steps in bfloat16 as torch does), or float32 "
                    "parameters"
                )
        self._kv = kv
        self._optimizer = optimizer
        #: A torch optimizer steps here on the summed gradients (None: akv's, in the store).
        self._local = cast(torch.optim.Optimizer, optimizer) if local else None
        self._synchronized: list[int] | None = None  # the slots synchronize() pulled
        self._passes = backward_passes_per_step
        self._keys: list[Key] = [key for key, _ in trainable]
        self._params: list[torch.Tensor] = [tensor for _, tensor in trainable]
        # MXNet's trainers: priority -index, so the first layers' work comes back first.
        self._priorities = [-index for index in range(len(trainable))]
        self._lock = threading.Lock()
        self._ready = [0] * len(trainable)  # backward passes seen since the last step
        self._buckets = _buckets(trainable, len(given), bucket_bytes, optimizer)
        self._bucket_of = {
            slot: b for b, bucket in enumerate(self._buckets) for slot in bucket.slots
        }
        self._filled = [0] * len(self._buckets)  # gradients copied into each bucket
        self._pushes: dict[int, Waitable] = {}  # bucket -> push in flight this step
        self._updated_pushes = False  # a push of this step met a store that updates pushes

        store_keys = [bucket.key for bucket in self._buckets]
        kv.init(store_keys, [self._weights(bucket) for bucket in self._buckets])
        if self._local is None:
            kv.set_optimizer(cast(_optimizer.Optimizer, optimizer))
        for bucket in self._buckets:  # rank 0's values are kept: every worker takes them
            kv.pull(bucket.key, out=self._weights(bucket) if bucket.flat is None else bucket.flat)
            bucket.scatter([self._params[slot].detach() for slot in bucket.slots])
        _bump_versions(self._params)
        self._handles: list[Any] = []
        for slot, param in enumerate(self._params):
            # torch leaves this method unannotated: typed here, where it is called.
            register = cast(Callable[..., Any], param.register_post_accumulate_grad_hook)
            self._handles.append(register(self._hook(slot)))

    # ------------------------------------------------------------------ properties

    @property
    def kv(self) -> KVStore:
        """The store the gradients are pushed to."""
        return self._kv

    @property
    def optimizer(self) -> _optimizer.Optimizer | torch.optim.Optimizer:
        """The optimizer given: akv's (in the store), or torch's (stepped here)."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's parameter groups (for LR schedulers and the like).

        Raises
        ------
        InvalidArgumentError
            The optimizer is akv's: its hyper-parameters are the optimizer's attributes.
        """
        return self._torch_optimizer("param_groups").param_groups

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's ``state_dict()`` (an akv optimizer's states are saved with
        ``kv.save_optimizer_states``)."""
        return self._torch_optimizer("state_dict").state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The torch optimizer's ``load_state_dict``."""
        self._torch_optimizer("load_state_dict").load_state_dict(state)

    def _torch_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self._local is None:
            raise InvalidArgumentError(
                f"DistributedOptimizer.{what}: the optimizer is akv's, which runs in the store "
                "(a torch optimizer has this; an akv one keeps its settings as attributes)"
            )
        return self._local

    @property
    def keys(self) -> list[Key]:
        """The keys of the trained parameters, in order (index = priority order); with
        buckets, the store keys are :attr:`store_keys`."""
        return list(self._keys)

    @property
    def store_keys(self) -> list[Key]:
        """The store keys pushed and pulled: one per parameter, or per bucket."""
        return [bucket.key for bucket in self._buckets]

    @property
    def params(self) -> list[torch.Tensor]:
        """The trained parameters (those that require grad), in the order of :attr:`keys`."""
        return list(self._params)

    # ------------------------------------------------------------------ training

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the step: wait for the pushes, pull the new weights into the parameters.

        ``closure`` (optional, as torch's optimizers): called first, with grad enabled, to
        recompute the loss; its result is returned. A parameter whose gradient was not
        pushed by its hook but is not None (set by hand, or fewer backward passes than
        ``backward_passes_per_step``) is pushed here; one whose gradient is None is left
        alone, as torch's optimizers do. Raises the first error of a push or pull, after
        waiting for all of them.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._local is not None:
            if self._synchronized is None:
                self.synchronize()
            self._synchronized = None
            self._local.step()
            return loss
        pushed = self._finish_pushes()
        targets = [[self._params[slot].detach() for slot in self._buckets[b].slots] for b in pushed]
        self._pull_buckets(pushed, targets)
        _bump_versions([self._params[slot] for b in pushed for slot in self._buckets[b].slots])
        return loss

    def _pull_buckets(self, pushed: list[int], targets: list[list[torch.Tensor]]) -> None:
        """Pull each bucket in ``pushed`` into its tensors ``targets`` (in place), waiting."""
        pulls = []
        for b, outs in zip(pushed, targets, strict=True):
            bucket = self._buckets[b]
            out = outs[0] if bucket.flat is None else bucket.flat
            pulls.append((b, self._kv._inner.pull(bucket.key, out=out, priority=bucket.priority)))
        self._wait_all(pulls)
        for b, outs in zip(pushed, targets, strict=True):
            self._buckets[b].scatter(outs)

    def synchronize(self) -> None:
        """With a torch optimizer: wait for the gradients' pushes and pull each round's sum
        into the parameters' ``.grad``, in place, so that it may be clipped or read before
        :meth:`step` (which then steps without pulling again). Raises the first error of a
        push or pull, after waiting for all of them.

        Raises
        ------
        InvalidArgumentError
            The optimizer is akv's: the store pulls weights, not gradients, in :meth:`step`.
        OptimizerError
            The store applies an optimizer or updater (``set_optimizer`` or ``set_updater``
            was called after this optimizer was made): the pushes of this step were
            updated, not summed.
        """
        self._torch_optimizer("synchronize")
        pushed = self._finish_pushes()
        updated, self._updated_pushes = self._updated_pushes, False
        if updated or self._kv.updates_on_push:  # set after this optimizer was made
            raise OptimizerError(f"{_SUMS_UPDATED} (it was set after this optimizer was made)")
        targets = []
        for b in pushed:
            grads = []
            for slot in self._buckets[b].slots:
                param = self._params[slot]
                if param.grad is None:  # pushed as zeros in its bucket: gets the sum
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad.detach())
            targets.append(grads)
        self._pull_buckets(pushed, targets)
        self._synchronized = pushed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients as ``torch.optim.Optimizer.zero_grad`` does.

        Waits first for the pushes still reading the gradients. What was pushed stays
        pushed: :meth:`step` still pulls it (and reports its failure), and a gradient
        pushed since the last step is not pushed again before the next one.
        """
        with self._lock:
            pending = list(self._pushes.values())
        for waitable in pending:
            # Only to let the push finish reading the gradient: step() (or close()) reports
            # its failure.
            with contextlib.suppress(Exception):
                self._kv._wait(waitable)
        for param in self._params:
            grad = param.grad
            if grad is None:
                continue
            if set_to_none:
                param.grad = None
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()

    def close(self) -> None:
        """Wait for pushes in flight and remove the hooks; the store stays open. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._wait_all(self._take_pushes())

    def __repr__(self) -> str:
        where = "on the workers" if self._local is not None else "in the store"
        return (
            f"<DistributedOptimizer {len(self._keys)} parameters, "
            f"{type(self._optimizer).__name__} {where}, {self._kv!r}>"
        )

    # ------------------------------------------------------------------ internals

    def _hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        def pushed_when_ready(param: torch.Tensor) -> None:
            with self._lock:
                passes = self._ready[slot] + 1
                if passes > self._passes:
                    raise DoublePushError(
                        f"DistributedOptimizer: the gradient of parameter "
                        f"{self._keys[slot]!r} was ready {passes} times since the last "
                        f"step() (backward_passes_per_step={self._passes}): call step() "
                        "between backward passes, or raise backward_passes_per_step"
                    )
                self._ready[slot] = passes
                if passes < self._passes:
                    return
                self._push(slot)

        return pushed_when_ready

    def _push(self, slot: int) -> None:
        """``slot``'s gradient is ready (holding the lock): push it, or its bucket once
        every gradient of the bucket is ready, without waiting."""
        b = self._bucket_of[slot]
        bucket = self._buckets[b]
        grad = self._dense_grad(slot)
        if bucket.flat is None:
            self._push_bucket(b, grad.detach())
            return
        bucket.fill(slot, grad.detach())
        self._filled[b] += 1
        if self._filled[b] == len(bucket.slots):
            self._push_bucket(b, bucket.flat)

    def _dense_grad(self, slot: int) -> torch.Tensor:
        """``slot``'s gradient, refused when it is sparse (its store key is dense)."""
        grad = self._params[slot].grad
        assert grad is not None
        if grad.layout != torch.strided:
            raise StorageTypeError(
                f"DistributedOptimizer: parameter {self._keys[slot]!r} got a gradient of "
                f"layout {grad.layout} (torch.nn.Embedding or EmbeddingBag with sparse=True?), "
                "and its key in the store is dense: for a table kept on the servers use "
                "akv.torch.Embedding, else build the layer with sparse=False"
            )
        return grad

    def _push_bucket(self, b: int, value: torch.Tensor) -> None:
        """Push bucket ``b``'s gradients (holding the lock), noting whether the store
        updates pushes now: a torch optimizer's step then refuses the sums it pulls."""
        bucket = self._buckets[b]
        self._updated_pushes |= self._kv.updates_on_push
        self._pushes[b] = self._kv._inner.push(bucket.key, value, priority=bucket.priority)

    def _finish_pushes(self) -> list[int]:
        """Push what the hooks did not (a bucket's missing gradients as zeros), wait for every
        push; the buckets pushed, in order."""
        with self._lock:
            for b, bucket in enumerate(self._buckets):
                if b in self._pushes:
                    continue
                grads = [self._params[slot].grad for slot in bucket.slots]
                if all(grad is None for grad in grads):
                    continue
                for slot, grad in zip(bucket.slots, grads, strict=True):
                    if grad is not None:
                        self._dense_grad(slot)
                if bucket.flat is not None:
                    bucket.flat.zero_()
                    for slot, grad in zip(bucket.slots, grads, strict=True):
                        if grad is not None:
                            bucket.fill(slot, grad.detach())
                    self._push_bucket(b, bucket.flat)
                else:
                    self._push(bucket.slots[0])
        pending = self._take_pushes()
        self._wait_all(pending)
        return sorted(b for b, _ in pending)

    def _weights(self, bucket: _Bucket) -> torch.Tensor:
        """A bucket's parameters' values: the one parameter itself, or their concatenation."""
        if bucket.flat is None:
            return self._params[bucket.slots[0]].detach()
        return torch.cat([self._params[slot].detach().reshape(-1) for slot in bucket.slots])

    def _take_pushes(self) -> list[tuple[int, Waitable]]:
        with self._lock:
            pending = list(self._pushes.items())
            self._pushes = {}
            self._ready = [0] * len(self._params)
            self._filled = [0] * len(self._buckets)
        return pending

    def _wait_all(self, work: list[tuple[int, Waitable]]) -> None:
        """Wait for every piece of work, then raise the first failure (if any)."""
        first: BaseException | None = None
        for _, waitable in work:
            try:
                self._kv._wait(waitable)
            except BaseException as exc:  # raised below, once everything has finished
                first = exc if first is None else first
        if first is not None:
            raise first


class _Bucket:
    """Parameters pushed and pulled as one store key: their slots (consecutive), the key,
    the priority of the first, and a flat buffer of their elements (None for a bucket of
    one parameter, which is sent as it is)."""

    def __init__(self, key: Key, slots: list[int], tensors: list[torch.Tensor]) -> None:
        self.key = key
        self.slots = slots
        self.priority = -slots[0]
        self.sizes = [tensor.numel() for tensor in tensors]
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        first = tensors[0]
        self.flat: torch.Tensor | None = None
        if len(tensors) > 1:
            self.flat = torch.zeros(sum(self.sizes), dtype=first.dtype, device=first.device)

    def fill(self, slot: int, grad: torch.Tensor) -> None:
        """Copy ``slot``'s gradient into its place in the flat buffer."""
        assert self.flat is not None
        index = self.slots.index(slot)
        start = self.starts[index]
        self.flat[start : start + self.sizes[index]].copy_(grad.reshape(-1))

    def scatter(self, outs: list[torch.Tensor]) -> None:
        """Copy the flat buffer's pieces into ``outs`` (the bucket's tensors, in place)."""
        if self.flat is None:
            return
        for out, start, size in zip(outs, self.starts, self.sizes, strict=True):
            out.copy_(self.flat[start : start + size].reshape(out.shape))


def _buckets(
    trainable: list[tuple[Key, torch.Tensor]],
    given: int,
    bucket_bytes: int | None,
    optimizer: object,
) -> list[_Bucket]:
    """The store keys of the parameters: one per parameter, or consecutive ones of one dtype
    and device fused up to ``bucket_bytes``.

    Raises
    ------
    InvalidArgumentError
        A bad ``bucket_bytes``, or buckets with an optimizer that uses each tensor's norm.
    """
    if bucket_bytes is None:
        return [_Bucket(key, [slot], [t]) for slot, (key, t) in enumerate(trainable)]
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidArgumentError(
            f"DistributedOptimizer: bucket_bytes must be an int >= 1 or None, got {bucket_bytes!r}"
        )
    if type(optimizer).__name__ in ("LAMB", "LARS"):
        raise InvalidArgumentError(
            f"DistributedOptimizer: {type(optimizer).__name__} scales each tensor by its own "
            "norm, which a bucket of fused tensors would change: give no bucket_bytes"
        )
    groups: list[list[int]] = []
    size = 0
    for slot, (_, tensor) in enumerate(trainable):
        nbytes = tensor.numel() * tensor.element_size()
        if groups:
            last = trainable[groups[-1][-1]][1]
            same = last.dtype == tensor.dtype and last.device == tensor.device
            if same and size + nbytes <= bucket_bytes:
                groups[-1].append(slot)
                size += nbytes
                continue
        groups.append([slot])
        size = nbytes
    str_keys = isinstance(trainable[0][0], str)
    buckets = []
    for index, slots in enumerate(groups):
        tensors = [trainable[slot][1] for slot in slots]
        if len(slots) == 1:
            key = trainable[slots[0]][0]
        else:
            key = f"bucket{index}" if str_keys else given + index
        buckets.append(_Bucket(key, slots, tensors))
    return buckets


def _check_torch_params(
    optimizer: torch.optim.Optimizer, trainable: list[tuple[Key, torch.Tensor]]
) -> None:
    """A torch optimizer must step exactly the trained parameters (the gradients it reads
    are the ones the store sums).

    Raises
    ------
    InvalidArgumentError
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = {id(tensor) for _, tensor in trainable}
    missing = [key for key, tensor in trainable if id(tensor) not in stepped]
    if missing or stepped - trained:
        raise InvalidArgumentError(
            "DistributedOptimizer: the torch optimizer must hold exactly the parameters given "
            f"that require grad; parameters it lacks: {missing[:5]}, and it holds "
            f"{len(stepped - trained)} others"
        )


def _bump_versions(params: list[torch.Tensor]) -> None:
    """Tell autograd the parameters changed (the store wrote them through NumPy views).

    A graph that saved a parameter before the write then fails at backward, as it would
    after ``torch.optim``'s in-place update, instead of using the new values silently.
    """
    increment: Callable[[torch.Tensor], None] | None = getattr(
        torch.autograd.graph, "increment_version", None
    )
    if increment is None:
        return
    for param in params:
        increment(param)
