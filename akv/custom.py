"""Custom stores: MXNet's ``KVStoreBase`` interface, its registry and its ``teststore``.

A class that implements :class:`KVStoreBase` and is registered with
:meth:`KVStoreBase.register` is what :func:`akv.create` makes for its name (the class name
in lower case), before it looks at akv's own store types::

    @akv.KVStoreBase.register
    class MyStore(akv.KVStoreBase):
        ...  # broadcast, pushpull, is_capable, type, rank, num_workers

    kv = akv.create("mystore")

akv's own blocking store (:class:`akv.KVStore`) is a ``KVStoreBase`` too, so code written
against the interface takes either. Unlike MXNet's base class, whose every method fails
only when called, the methods a store must have are abstract (a class that lacks one
cannot be made), and the optimizer methods, which a store without an optimizer need not
have, raise :class:`~akv.errors.CapabilityError` naming the store.
"""

from __future__ import annotations

import abc
import builtins
import warnings
from typing import Any, ClassVar

from akv.args import Key
from akv.errors import CapabilityError, InvalidArgumentError

__all__ = ["KVStoreBase", "TestStore", "check_capability"]


def check_capability(capability: object, store_type: str) -> str:
    """``capability`` in lower case, if it is one a store may be asked about.

    Raises
    ------
    CapabilityError
        It is not a capability akv knows (MXNet raises ``ValueError``; this is one).
    """
    known = (KVStoreBase.OPTIMIZER,)
    name = capability.lower() if isinstance(capability, str) else None
    if name not in known:
        raise CapabilityError(
            f"is_capable: unknown capability {capability!r} (store {store_type!r} knows "
            f"{', '.join(map(repr, known))})"
        )
    return name


class KVStoreBase(abc.ABC):
    """A key-value store for data-parallel training, as MXNet 1.9's ``KVStoreBase``.

    A subclass implements :meth:`broadcast`, :meth:`pushpull`, :meth:`is_capable` and the
    properties :attr:`type`, :attr:`rank` and :attr:`num_workers`; the optimizer methods
    are for stores whose ``is_capable(KVStoreBase.OPTIMIZER)`` is true.
    """

    #: The capability of applying an optimizer where the values live.
    OPTIMIZER: ClassVar[str] = "optimizer"
    #: Registered stores by name (the class name in lower case).
    kv_registry: ClassVar[dict[str, builtins.type[KVStoreBase]]] = {}

    @abc.abstractmethod
    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> Any:
        """Make ``value`` (rank 0's) the key's value and write it into ``out`` (an array or
        a list of arrays) on every worker."""

    @abc.abstractmethod
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> Any:
        """Sum ``value`` (an array or a list) over the workers and write the result into
        ``out``, or into ``value`` when ``out`` is None."""

    @abc.abstractmethod
    def is_capable(self, capability: str) -> bool:
        """Whether the store has ``capability`` (:attr:`OPTIMIZER`); an unknown one raises
        :class:`~akv.errors.CapabilityError`."""

    @property
    @abc.abstractmethod
    def type(self) -> str:
        """The store's type name."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's rank, in ``[0, num_workers)``."""

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """How many workers share the store."""

    def set_optimizer(self, optimizer: Any) -> Any:
        """Apply ``optimizer`` where the values live (stores with the capability).

        Raises
        ------
        CapabilityError
            This store has no optimizer.
        """
        raise self._lacks("set_optimizer")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> Any:
        """Write the optimizer's states to ``fname`` (stores with the capability).

        Raises
        ------
        CapabilityError
            This store has no optimizer.
        """
        raise self._lacks("save_optimizer_states")

    def load_optimizer_states(self, fname: str) -> Any:
        """Read the optimizer's states from ``fname`` (stores with the capability).

        Raises
        ------
        CapabilityError
            This store has no optimizer.
        """
        raise self._lacks("load_optimizer_states")

    def _lacks(self, what: str) -> CapabilityError:
        return CapabilityError(
            f"{what}: store {self.type!r} ({type(self).__name__}) has no optimizer "
            f"(its is_capable({KVStoreBase.OPTIMIZER!r}) is False)"
        )

    @staticmethod
    def register(klass: builtins.type[KVStoreBase]) -> builtins.type[KVStoreBase]:
        """Register ``klass`` under its name in lower case, for :func:`akv.create`; returns
        it (a class decorator). A later class of the same name replaces it, with a
        warning, as in MXNet.

        Raises
        ------
        InvalidArgumentError
            ``klass`` is not a subclass of KVStoreBase, or its name is one of akv's own
            store types (which a custom store may not hide).
        """
        from akv.kinds import is_store_type

        if not isinstance(klass, builtins.type) or not issubclass(klass, KVStoreBase):
            raise InvalidArgumentError(
                f"KVStoreBase.register: {klass!r} is not a subclass of akv.KVStoreBase"
            )
        name = klass.__name__.lower()
        if is_store_type(name):
            raise InvalidArgumentError(
                f"KVStoreBase.register: {klass.__name__} would be created as {name!r}, one of "
                "akv's own store types; give the class another name"
            )
        previous = KVStoreBase.kv_registry.get(name)
        if previous is not None and previous is not klass:
            warnings.warn(
                f"KVStoreBase.register: {klass.__module__}.{klass.__name__} replaces "
                f"{previous.__module__}.{previous.__name__} as store {name!r}",
                UserWarning,
                stacklevel=2,
            )
        KVStoreBase.kv_registry[name] = klass
        return klass


@KVStoreBase.register
class TestStore(KVStoreBase):
    """MXNet's ``teststore``: one worker, no optimizer; :meth:`broadcast` copies and
    :meth:`pushpull` sums, in the caller's arrays (anything with ``[...] =`` assignment and
    ``+``: NumPy arrays, torch tensors...)."""

    __test__ = False  # not a pytest test class, whatever its name

    def broadcast(self, key: Key, value: Any, out: Any, priority: int = 0) -> None:
        """Copy ``value`` into ``out`` (an array or a list of arrays)."""
        for target in out if isinstance(out, list) else [out]:
            target[...] = value

    def pushpull(self, key: Key, value: Any, out: Any = None, priority: int = 0) -> None:
        """A list ``value`` is summed into ``out`` (or into each of its own arrays); one
        array is copied into ``out`` (nothing to do without ``out``)."""
        if not isinstance(value, list):
            if out is not None:
                self.broadcast(key, value, out)
            return
        total = value[0] + 0  # a new array: the sum must not alias an input
        for member in value[1:]:
            total = total + member
        self.broadcast(key, total, value if out is None else out)

    @staticmethod
    def is_capable(capability: str) -> bool:
        """Only the optimizer is asked about, and it has none (a static method, as in
        MXNet: ``type(kv).is_capable(...)`` works too)."""
        check_capability(capability, "teststore")
        return False

    @property
    def type(self) -> str:
        """``"teststore"``."""
        return "teststore"

    @property
    def rank(self) -> int:
        """0: one worker."""
        return 0

    @property
    def num_workers(self) -> int:
        """1."""
        return 1
