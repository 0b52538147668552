"""Which classes are tree nodes: treegather's optree namespace and everything registered in it.

:func:`register_dataclass` and :func:`register_node`; classes registered with torch's own pytree
(``torch.utils._pytree.register_pytree_node``, as transformers does for every ``ModelOutput``),
bridged on first use; optional integrations that register their classes once their library is
in use (:func:`watch`: transformers' key/value caches); and :func:`registry_version`, which
changes whenever any of this does (optree's own registry included), so that cached structures
go stale.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import optree
import torch
import torch.utils._pytree as _torch_pytree

from .._caches import clear_tree_caches
from .._errors import ArgumentTypeError, safe_repr
from . import batch as _batch
from .batch import Batched, BatchRule, counted, set_rule, unflattened

__all__ = [
    "context_names",
    "NAMESPACE",
    "Opaque",
    "is_leaf",
    "register_dataclass",
    "register_node",
    "register_default",
    "registry_version",
    "sync",
    "unregister",
    "watch",
]


NAMESPACE = "treegather"
"""The optree namespace treegather registers its container classes in."""

T = TypeVar("T")

# ----------------------------------------------------------------------------- registration

_REGISTERED: set[type] = set()
# Classes registered only through the torch pytree bridge (or transformers' caches, registered
# by treegather itself): an explicit treegather registration replaces it instead of failing
# (whether the bridge ran first must not matter).
_BRIDGED: set[type] = set()


_version = 0


def _invalidate() -> None:
    """Every cached structure may depend on which classes are nodes: start cold."""
    global _version
    _version += 1
    _note_optree_registry()  # (a registration through treegather is accounted for here)
    clear_tree_caches()


@overload
def register_dataclass(
    cls: type[T], *, static: Iterable[str] = (), batch_size: str | None = None
) -> type[T]: ...
@overload
def register_dataclass(
    cls: None = None, *, static: Iterable[str] = (), batch_size: str | None = None
) -> Callable[[type[T]], type[T]]: ...
def register_dataclass(
    cls: type[T] | None = None, *, static: Iterable[str] = (), batch_size: str | None = None
) -> type[T] | Callable[[type[T]], type[T]]:
    """Make a ``@dataclasses.dataclass`` a tree node whose fields are its children.

    Use it as a function or as a decorator (above ``@dataclass``). Fields named in ``static``, or
    declared with ``field(metadata={"static": True})``, are passed through untouched: never split,
    never gathered, and replicas must agree on them. Frozen dataclasses and dataclasses that are
    also ``OrderedDict`` subclasses (the shape of transformers' ``ModelOutput``) are rebuilt
    through their constructor, so the result equals an object made the normal way.

    A static field that holds the batch size (an int: the rows, a numpy integer kept as its
    type; or a sequence of ints, the leading dims the tensors share, as TensorDict's
    ``batch_size``) is named by ``batch_size``: it follows the rows, as for
    :func:`register_node`'s ``batch_size=`` (each shard holds its own rows, a gather the rows
    joined; rows its leaves do not hold are a :class:`~treegather.BatchSizeError`). A field
    holding anything else (``None``, a float, a bool, a tensor) is an
    :class:`~treegather.ArgumentTypeError` naming the node's path when the tree is flattened.

    Args:
        cls: the dataclass; omit it to use ``register_dataclass(static=...)`` as a decorator.
        static: names of fields that are metadata rather than data.
        batch_size: the static field holding the batch size, if any.

    Returns:
        ``cls`` itself (or a decorator returning it).

    >>> import dataclasses, torch, treegather as tg
    >>> @tg.register_dataclass
    ... @dataclasses.dataclass
    ... class Out:
    ...     loss: torch.Tensor
    ...     names: list
    >>> out = tg.gather([Out(torch.tensor(1.0), ["a"]), Out(torch.tensor(3.0), ["b"])], "cpu",
    ...                 tg.by_path({"loss": "mean", "names": tg.cat_items()}))
    >>> out
    Out(loss=tensor(2.), names=['a', 'b'])

    A batch that holds its size (each shard holds its own rows, the gather all of them):

    >>> @tg.register_dataclass(static=["split"], batch_size="rows")
    ... @dataclasses.dataclass
    ... class Batch:
    ...     x: torch.Tensor
    ...     split: str
    ...     rows: int
    >>> shards = tg.scatter(Batch(torch.zeros(5, 2), "val", 5), ["cpu", "cpu"])
    >>> [s.rows for s in shards], tg.gather(list(shards), "cpu").rows
    ([3, 2], 5)
    """
    if cls is None:
        return functools.partial(register_dataclass, static=static, batch_size=batch_size)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(
            f"register_dataclass expects a class decorated with @dataclasses.dataclass, got {cls!r}"
            " (put @register_dataclass above @dataclass)"
        )
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    static_names = set(static) | {f.name for f in fields if f.metadata.get("static", False)}
    unknown = static_names - set(names)
    if unknown:
        raise ValueError(f"{cls.__qualname__} has no field(s) {sorted(unknown)} to mark static")
    if batch_size is not None:
        if batch_size not in names:
            raise ValueError(f"{cls.__qualname__} has no field {batch_size!r} for the batch size")
        static_names.add(batch_size)
    dynamic = tuple(n for n in names if n not in static_names)
    statics = tuple(n for n in names if n in static_names)
    init_names = tuple(f.name for f in fields if f.init)
    late_names = tuple(f.name for f in fields if not f.init)

    def flatten_fn(obj: Any) -> tuple[list[Any], tuple[Any, ...], tuple[str, ...]]:
        return [getattr(obj, n) for n in dynamic], tuple(getattr(obj, n) for n in statics), dynamic

    def unflatten_fn(meta: tuple[Any, ...], children: Iterable[Any]) -> Any:
        values = dict(zip(dynamic, children))
        values.update(zip(statics, meta))
        obj = cls(**{n: values[n] for n in init_names})
        for n in late_names:
            object.__setattr__(obj, n, values[n])
        return obj

    rule = None
    if batch_size is not None:
        at = statics.index(batch_size)
        rule = BatchRule(cls, _field_size(at, batch_size), _field_resize(at))
    _register(cls, flatten_fn, unflatten_fn, rule)
    return cls


def _field_size(at: int, name: str) -> Callable[[tuple[Any, ...]], tuple[int, ...]]:
    def size(meta: tuple[Any, ...]) -> tuple[int, ...]:
        value = meta[at]
        if _is_count(value):
            return (value,)
        if isinstance(value, (str, bytes, bool, torch.Tensor)) or not isinstance(value, Iterable):
            raise TypeError(f"{name}={safe_repr(value)} is neither an int nor a sequence of ints")
        return tuple(value)

    return size


def _is_count(value: Any) -> bool:
    """An integer that is not a bool (an int, a numpy integer): the rows, a batch size of one dim."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _field_resize(at: int) -> Callable[[tuple[Any, ...], tuple[int, ...]], tuple[Any, ...]]:
    def resize(meta: tuple[Any, ...], size: tuple[int, ...]) -> tuple[Any, ...]:
        value = meta[at]
        new: Any = type(value)(size[0]) if _is_count(value) else type(value)(size)
        return (*meta[:at], new, *meta[at + 1 :])

    return resize


def register_node(
    cls: type[T],
    flatten: Callable[[Any], tuple[Sequence[Any], Any] | tuple[Sequence[Any], Any, Sequence[Any]]],
    unflatten: Callable[[Any, Iterable[Any]], Any],
    *,
    batch_size: Callable[[Any], Sequence[int]] | None = None,
    with_batch_size: Callable[[Any, tuple[int, ...]], Any] | None = None,
) -> type[T]:
    """Register any container class as a tree node, optree-style.

    A class whose metadata holds a batch size (the leading dims its tensors share with it, as
    TensorDict's ``batch_size``) says how with ``batch_size`` and ``with_batch_size``; its
    metadata then follows the rows instead of being compared: :func:`scatter` gives each shard
    the batch size of its rows (along the dim its leaves are split), :func:`gather` (and
    :func:`treegather.distributed.all_gather`, a ``Collector``) the rows joined (summed along
    the dim its leaves are concatenated; its other dims must agree), and replicas must agree on
    the rest of the metadata. Nothing is guessed from the leaves' shapes. A node without
    leaves of its own (only strings, say) follows the batch it is in; a node claiming another
    number of rows than its leaves hold along those dims (than the batch, in a scatter or a
    ``Collector`` add), in any replica or rank, is a :class:`~treegather.BatchSizeError`
    naming its path.

    Args:
        cls: the class.
        flatten: ``obj -> (children, aux)`` or ``obj -> (children, aux, names)``; ``aux`` is
            hashable metadata that replicas must agree on, ``names`` label the children in paths
            and in :func:`by_path` patterns (default: their indices).
        unflatten: ``(aux, children) -> obj``.
        batch_size: ``aux -> batch size`` (a sequence of ints), for a class whose metadata
            holds one.
        with_batch_size: ``(aux, batch size) -> aux`` with that batch size, the rest unchanged
            (it must return equal metadata for equal arguments).

    Returns:
        ``cls``.

    >>> import torch, treegather as tg
    >>> class Pair:
    ...     def __init__(self, a, b): self.a, self.b = a, b
    >>> _ = tg.register_node(Pair, lambda p: ((p.a, p.b), None, ("a", "b")),
    ...                      lambda aux, ch: Pair(*ch))
    >>> shards = tg.scatter(Pair(torch.arange(4), torch.zeros(4)), ["cpu", "cpu"])
    >>> shards[1].a
    tensor([2, 3])

    A batch that knows its size (a string beside it, so the size is not a leaf's shape):

    >>> class Batch:
    ...     def __init__(self, x, tag, n): self.x, self.tag, self.n = x, tag, n
    >>> _ = tg.register_node(Batch, lambda b: ((b.x,), (b.tag, b.n), ("x",)),
    ...                      lambda aux, ch: Batch(ch[0], *aux),
    ...                      batch_size=lambda aux: (aux[1],),
    ...                      with_batch_size=lambda aux, size: (aux[0], size[0]))
    >>> shards = tg.scatter(Batch(torch.zeros(5, 5), "train", 5), ["cpu", "cpu"])
    >>> [s.n for s in shards], [s.x.shape for s in shards]
    ([3, 2], [torch.Size([3, 5]), torch.Size([2, 5])])
    >>> out = tg.gather(list(shards), "cpu")
    >>> out.n, out.x.shape, out.tag
    (5, torch.Size([5, 5]), 'train')
    """
    if not isinstance(cls, type):
        raise ArgumentTypeError(f"register_node: cls must be a class, got {safe_repr(cls)}")
    for name, fn in (("flatten", flatten), ("unflatten", unflatten)):
        if not callable(fn):
            raise ArgumentTypeError(
                f"register_node({cls.__qualname__}, ...): {name} must be a function, got "
                f"{safe_repr(fn)}"
            )
    rule = None
    if batch_size is not None or with_batch_size is not None:
        if not (callable(batch_size) and callable(with_batch_size)):
            raise ArgumentTypeError(
                f"register_node({cls.__qualname__}, ...): batch_size and with_batch_size go "
                f"together, each a function; got {safe_repr(batch_size)} and "
                f"{safe_repr(with_batch_size)}"
            )
        rule = BatchRule(cls, batch_size, with_batch_size)
    _register(cls, flatten, unflatten, rule)
    return cls


def _register(
    cls: type,
    flatten_fn: Callable[..., Any],
    unflatten_fn: Callable[..., Any],
    rule: BatchRule | None = None,
) -> None:
    if cls in _BRIDGED:
        optree.unregister_pytree_node(cls, namespace=NAMESPACE)
        _BRIDGED.discard(cls)
        _REGISTERED.discard(cls)
        set_rule(cls, None)
    if cls in _REGISTERED:
        raise ValueError(f"{cls.__qualname__} is already registered with treegather")
    if rule is not None:
        flatten_fn, unflatten_fn = _batched(flatten_fn, unflatten_fn, rule)
    with warnings.catch_warnings():  # (a namedtuple subclass: registered here on purpose)
        warnings.simplefilter("ignore", UserWarning)
        optree.register_pytree_node(
            cls,
            flatten_fn,
            unflatten_fn,
            namespace=NAMESPACE,
        )
    set_rule(cls, rule)
    _REGISTERED.add(cls)
    _invalidate()


def _batched(
    flatten_fn: Callable[..., Any], unflatten_fn: Callable[..., Any], rule: BatchRule
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A batch node's flatten and unflatten: its metadata held as a :class:`Batched`."""

    def flatten(obj: Any) -> Any:
        out = tuple(flatten_fn(obj))
        return (out[0], counted(Batched(out[1], rule)), *out[2:])

    def unflatten(meta: Batched, children: Iterable[Any]) -> Any:
        return unflattened(meta, unflatten_fn, children)

    return flatten, unflatten


def register_default(
    cls: type,
    flatten_fn: Callable[..., Any],
    unflatten_fn: Callable[..., Any],
    rule: BatchRule | None = None,
) -> bool:
    """Register ``cls`` as treegather's own choice (an integration's: transformers' caches),
    which an explicit :func:`register_node` or :func:`register_dataclass` replaces, as it
    replaces a class bridged from torch's pytree. ``False`` (nothing done) when the user
    registered ``cls`` already: theirs wins."""
    if cls in _REGISTERED and cls not in _BRIDGED:
        return False
    _register(cls, flatten_fn, unflatten_fn, rule)
    _BRIDGED.add(cls)
    return True


def unregister(cls: type) -> None:
    """Forget ``cls`` (tests: an integration's classes registered afresh)."""
    optree.unregister_pytree_node(cls, namespace=NAMESPACE)
    _REGISTERED.discard(cls)
    _BRIDGED.discard(cls)
    set_rule(cls, None)
    _invalidate()


class Opaque:
    """A value a registered node holds whole, with the reason it cannot be split or combined.

    A node's flatten returns one as its only child when this instance cannot be divided
    batch-wise (a transformers ``StaticCache``): scatter refuses it, saying ``reason`` (unless
    the layout says ``broadcast()``), and gather keeps the replicas' values as a list.
    """

    __slots__ = ("reason", "value")

    def __init__(self, value: Any, reason: str) -> None:
        self.value = value
        self.reason = reason

    def __repr__(self) -> str:
        return f"<{type(self.value).__qualname__}, kept whole>"


# ----------------------------------------------------------------- torch.utils._pytree bridge

_torch_synced = 0


_PLAIN = frozenset([type(None), bool, int, str, bytes])  # (values that cannot change)


class _Context:
    """Hashable wrapper for a torch pytree context (often a list of keys)."""

    __slots__ = ("_key", "value")
    _shareable_fields = True  # (unflatten hands out copies of a list value: see _bridge)

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key: str | None = None  # (made when first needed: every flatten makes one)

    def _text(self) -> str:
        if self._key is None:  # (process-independent, the same for equal ones whose repr fails)
            self._key = safe_repr(self.value, None, stable=True)
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash(self._text())

    def __repr__(self) -> str:
        return self._text()

    def _typed_fields(self) -> tuple[Any, ...]:
        """For :func:`treegather._caches.typed_key`: the context's value, types included. A list
        of plain values (``ModelOutput``'s keys) is keyed as the immutable values it holds:
        each unflatten gets a copy of it (:func:`_bridge`), so a structure's cached context may
        stand for this one."""
        value = self.value
        if type(value) is list and set(map(type, value)) <= _PLAIN:
            return ("list of", tuple(value))
        return (value,)


def context_names(meta: Any) -> tuple[type, tuple[str, ...]] | None:
    """For a node bridged from torch's pytree whose context is a list or tuple of ``str``
    (``ModelOutput``'s keys): the container's type and the names; else None. Two contexts with
    the same answer have the same typed key (:func:`treegather._caches.typed_key`), told in a
    few C passes (the compiled layer's guard asks on every call)."""
    if type(meta) is not _Context:
        return None
    value = meta.value
    kind = type(value)
    if (kind is list or kind is tuple) and set(map(type, value)) <= _STR:
        return kind, tuple(value)
    return None


_STR = frozenset([str])


def _bridge(cls: type, node_def: Any) -> None:
    t_flatten = node_def.flatten_fn
    t_unflatten = node_def.unflatten_fn

    def flatten_fn(obj: Any) -> tuple[list[Any], _Context, tuple[Any, ...] | None]:
        children, context = t_flatten(obj)
        children = list(children)
        names = None
        if (
            isinstance(context, (list, tuple))
            and len(context) == len(children)
            and all(isinstance(k, str) for k in context)
        ):
            names = tuple(context)
        return children, _Context(context), names

    def unflatten_fn(meta: _Context, children: Iterable[Any]) -> Any:
        value = meta.value
        return t_unflatten(list(children), list(value) if type(value) is list else value)

    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)  # type: ignore[arg-type]
    _REGISTERED.add(cls)
    _BRIDGED.add(cls)


_WATCHERS: list[Callable[[], None]] = []


def watch(fn: Callable[[], None]) -> None:
    """Call ``fn`` now and whenever torch's pytree registry has grown (an optional integration,
    such as transformers' caches, registers its classes once its library is in use)."""
    _WATCHERS.append(fn)
    fn()


# torch's own classes that are containers of the user's values, bridged like any other (fx's
# immutable list and dict: a graph's arguments). torch's return types are optree structseqs.
_TORCH_CONTAINERS = frozenset(["torch.fx.immutable_collections"])


def _sync_torch_registry() -> None:
    """Bridge classes registered with torch's pytree since the last call (cheap when none are)."""
    global _torch_synced
    supported = _torch_pytree.SUPPORTED_NODES
    if len(supported) == _torch_synced:
        return
    for fn in _WATCHERS:  # first: their classes are then treegather's, never bridged
        fn()
    for cls, node_def in list(supported.items()):
        if not isinstance(cls, type) or cls in _REGISTERED:
            continue
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("torch") and module not in _TORCH_CONTAINERS:
            continue  # torch's own values (torch.Size, op schemas): leaves, as users expect
        if (
            cls in (tuple, list, dict)
            or optree.is_namedtuple_class(cls)
            or optree.is_structseq_class(cls)
        ):
            continue
        try:
            _bridge(cls, node_def)
        except ValueError:  # registered with optree by other means: optree already knows it
            _REGISTERED.add(cls)
    _torch_synced = len(supported)
    _invalidate()


# -------------------------------------------------------------------- optree's own registry

# A class may also be registered (or unregistered) with optree directly, in treegather's
# namespace or in optree's global one, which applies to every namespace. optree keeps every
# registration in one dict, keyed by the class (global) or by (namespace, class): a
# registration appends an entry, an unregistration removes one, so any change changes its
# length or its last entry. Both are read per call (the entry is held, so that its identity is
# never reused); only when they changed are the entries that apply to treegather's namespace
# compared with those seen last, and a difference makes every cached structure stale.
_OPTREE_REGISTRY: dict[Any, Any] | None = getattr(optree.registry, "_NODETYPE_REGISTRY", None)
if not isinstance(_OPTREE_REGISTRY, dict):  # another optree: its registry size, per call
    _OPTREE_REGISTRY = None
_optree_size = getattr(getattr(optree, "_C", None), "get_registry_size", None)
_optree_len = -1
_optree_last: Any = None
_optree_ours: dict[Any, Any] = {}


def _optree_changed() -> bool:
    """Whether optree's registry may have changed since :func:`_note_optree_registry` (cheap)."""
    registry = _OPTREE_REGISTRY
    if registry is None:
        return _optree_size is not None and _optree_size(NAMESPACE) != _optree_len
    if len(registry) != _optree_len:
        return True
    try:
        return next(reversed(registry.values())) is not _optree_last
    except (StopIteration, RuntimeError):  # empty, or changed while read
        return True


def _note_optree_registry() -> bool:
    """Record optree's registry as it is now; whether its entries for treegather changed."""
    global _optree_len, _optree_last, _optree_ours
    registry = _OPTREE_REGISTRY
    if registry is None:
        size = -1 if _optree_size is None else _optree_size(NAMESPACE)
        changed, _optree_len = size != _optree_len, size
        return changed
    items = list(registry.items())  # (one C call: a registration in another thread waits)
    ours = {k: v for k, v in items if type(k) is not tuple or k[:1] == (NAMESPACE,)}
    changed = ours.keys() != _optree_ours.keys() or any(
        v is not _optree_ours[k] for k, v in ours.items()
    )
    _optree_len, _optree_last, _optree_ours = len(items), items[-1][1] if items else None, ours
    return changed


def _sync_optree_registry() -> None:
    """Make cached structures stale when a class was (un)registered with optree directly."""
    if _note_optree_registry():
        _invalidate()


_note_optree_registry()


def is_leaf(value: Any) -> bool:
    """Whether ``value`` is a leaf (not a registered container, not ``None``).

    >>> is_leaf(1.0), is_leaf(None), is_leaf([1])
    (True, False, False)
    """
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        _sync_torch_registry()
    return optree.tree_is_leaf(value, namespace=NAMESPACE)


def registry_version() -> int:
    """A number that changes whenever treegather's idea of which classes are nodes changes.

    Cached structures record it; a registration (here, with torch's pytree, or with optree
    directly in treegather's namespace or the global one) makes them stale. Per call: two
    length checks and one identity check.
    """
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        _sync_torch_registry()
    if _optree_changed():
        _sync_optree_registry()
    return _version


def sync() -> None:
    """Catch up with torch's pytree registry (cheap when it has not grown)."""
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        _sync_torch_registry()


_batch.catch_up = sync  # (an unpickled batch node of a class bridged since: see batch.py)
