"""The pytree layer: treegather's optree namespace, registration, flattening and leaf paths.

Everything treegather does to a tree goes through :func:`flatten` here, so that one place knows
which classes are containers: optree's built-ins (dict, OrderedDict, defaultdict, list, tuple,
namedtuple, deque, ``None`` as an empty node), classes registered with :func:`register_dataclass`
or :func:`register_node`, classes registered with torch's own pytree
(``torch.utils._pytree.register_pytree_node``, as transformers does for every ``ModelOutput``),
and transformers' key/value caches once transformers is in use (:mod:`treegather._transformers`).
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import sys
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, overload

import optree
import torch
import torch.utils._pytree as _torch_pytree
from optree import PyTreeKind, PyTreeSpec

from ._caches import clear_tree_caches
from ._errors import TreeDepthError, safe_repr

__all__ = [
    "NAMESPACE",
    "INPUT_AND_KWARGS",
    "Opaque",
    "is_call_root",
    "register_dataclass",
    "register_node",
    "flatten",
    "is_leaf",
    "registry_version",
    "Node",
    "nodes",
    "leaf_nodes",
    "child_styles",
    "format_path",
    "display_path",
    "describe",
    "move_tree",
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
def register_dataclass(cls: type[T], *, static: Iterable[str] = ()) -> type[T]: ...
@overload
def register_dataclass(
    cls: None = None, *, static: Iterable[str] = ()
) -> Callable[[type[T]], type[T]]: ...
def register_dataclass(
    cls: type[T] | None = None, *, static: Iterable[str] = ()
) -> type[T] | Callable[[type[T]], type[T]]:
    """Make a ``@dataclasses.dataclass`` a tree node whose fields are its children.

    Use it as a function or as a decorator (above ``@dataclass``). Fields named in ``static``, or
    declared with ``field(metadata={"static": True})``, are passed through untouched: never split,
    never gathered, and replicas must agree on them. Frozen dataclasses and dataclasses that are
    also ``OrderedDict`` subclasses (the shape of transformers' ``ModelOutput``) are rebuilt
    through their constructor, so the result equals an object made the normal way.

    Args:
        cls: the dataclass; omit it to use ``register_dataclass(static=...)`` as a decorator.
        static: names of fields that are metadata rather than data.

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
    """
    if cls is None:
        return functools.partial(register_dataclass, static=static)
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

    _register(cls, flatten_fn, unflatten_fn)
    return cls


def register_node(
    cls: type[T],
    flatten: Callable[[Any], tuple[Sequence[Any], Any] | tuple[Sequence[Any], Any, Sequence[Any]]],
    unflatten: Callable[[Any, Iterable[Any]], Any],
) -> type[T]:
    """Register any container class as a tree node, optree-style.

    Args:
        cls: the class.
        flatten: ``obj -> (children, aux)`` or ``obj -> (children, aux, names)``; ``aux`` is
            hashable metadata that replicas must agree on, ``names`` label the children in paths
            and in :func:`by_path` patterns (default: their indices).
        unflatten: ``(aux, children) -> obj``.

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
    """
    _register(cls, flatten, unflatten)
    return cls


def _register(cls: type, flatten_fn: Callable[..., Any], unflatten_fn: Callable[..., Any]) -> None:
    if cls in _BRIDGED:
        optree.unregister_pytree_node(cls, namespace=NAMESPACE)
        _BRIDGED.discard(cls)
        _REGISTERED.discard(cls)
    if cls in _REGISTERED:
        raise ValueError(f"{cls.__qualname__} is already registered with treegather")
    optree.register_pytree_node(
        cls,
        flatten_fn,
        unflatten_fn,
        namespace=NAMESPACE,
    )
    _REGISTERED.add(cls)
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


class _Context:
    """Hashable wrapper for a torch pytree context (often a list of keys)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        # (process-independent, and the same for equal contexts whose repr fails)
        self._key = safe_repr(value, None, stable=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return self._key

    def _typed_fields(self) -> tuple[Any, ...]:
        """For :func:`treegather._caches.typed_key`: the context's value, types included."""
        return (self.value,)


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
        return t_unflatten(list(children), meta.value)

    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)  # type: ignore[arg-type]
    _REGISTERED.add(cls)
    _BRIDGED.add(cls)


_transformers_done = False


def _sync_transformers() -> None:
    """Register transformers' cache classes once ``transformers.cache_utils`` is loaded.

    Called at import and from :func:`_sync_torch_registry` (whenever torch's pytree registry
    has grown, which importing any transformers model does): no cost on the hot path, and
    ``import treegather`` never imports transformers.
    """
    global _transformers_done
    module = sys.modules.get("transformers.cache_utils")
    if _transformers_done or module is None:
        return
    _transformers_done = True
    from ._transformers import register_caches

    register_caches(module)


def _sync_torch_registry() -> None:
    """Bridge classes registered with torch's pytree since the last call (cheap when none are)."""
    global _torch_synced
    supported = _torch_pytree.SUPPORTED_NODES
    if len(supported) == _torch_synced:
        return
    _sync_transformers()  # first: its classes are then treegather's, never bridged
    for cls, node_def in list(supported.items()):
        if not isinstance(cls, type) or cls in _REGISTERED:
            continue
        if (getattr(cls, "__module__", "") or "").startswith("torch"):
            continue  # torch's own (torch.Size, return types, fx): leaves, as users expect
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


# ------------------------------------------------------------------------------- flattening


def flatten(tree: Any, root: str | None = "tree", where: str = "") -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` in treegather's namespace (``None`` is an empty node).

    The plain definition: one ``optree.tree_flatten``, no cache (the compiled layer,
    :mod:`treegather._compiled`, recognises structures it has seen before without it). A tree
    that contains itself, or is deeper than optree flattens, is a :class:`TreeDepthError`
    naming the path (from ``root``, as :func:`display_path` writes it; ``where`` starts the
    message, e.g. ``"replica 1: "``), not optree's bare ``RecursionError``.

    >>> leaves, spec = flatten({"b": 1, "a": (2, None)})
    >>> leaves, spec.unflatten(leaves)
    ([2, 1], {'b': 1, 'a': (2, None)})
    >>> d = {"x": 1}; d["self"] = d
    >>> flatten(d, "inputs")
    Traceback (most recent call last):
    ...
    treegather.TreeDepthError: inputs['self'] is inputs itself: the tree contains itself ...
    """
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        _sync_torch_registry()
    try:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    except RecursionError:
        raise depth_error(tree, root, where) from None
    return leaves, spec


MAX_DEPTH: int = getattr(getattr(optree, "_C", None), "MAX_RECURSION_DEPTH", 1000)
"""How deep a tree optree flattens."""
_WALK_BUDGET = 1_000_000  # nodes depth_error visits at most (a DAG may share subtrees)


def depth_error(tree: Any, root: str | None = "tree", where: str = "") -> TreeDepthError:
    """Why ``tree`` cannot be flattened: the path where it contains itself (a container that
    is its own ancestor), or the path where it passes :data:`MAX_DEPTH` levels. Iterative."""
    ancestors: list[int] = []  # ids of the containers from the root down to the current node
    depth_of: dict[int, int] = {}
    stack: list[tuple[Any, tuple[tuple[Any, str], ...], tuple[Any, ...]]] = [(tree, (), ())]
    budget = _WALK_BUDGET
    while stack and budget:
        budget -= 1
        node, path, raw = stack.pop()
        while len(ancestors) > len(path):
            depth_of.pop(ancestors.pop(), None)
        if node is None or optree.tree_is_leaf(node, namespace=NAMESPACE):
            continue
        seen = depth_of.get(id(node))
        if seen is not None:
            here = _shown_path(root, path, raw)
            return TreeDepthError(
                f"{where}{here} is {_shown_path(root, path[:seen], raw[:seen])} itself: the "
                "tree contains itself (a cycle), so it has no end to flatten\n"
                "Hint: a container must not hold itself or one of its ancestors; keep such a "
                "reference out of the tree (e.g. in a static field, or as a plain id)"
            )
        if len(path) >= MAX_DEPTH:
            return TreeDepthError(
                f"{where}{_shown_path(root, path, raw)}: the tree is nested deeper than "
                f"{MAX_DEPTH} levels, the most optree flattens\n"
                "Hint: flatten the nesting (e.g. a list of layers instead of a chain of dicts)"
            )
        depth_of[id(node)] = len(ancestors)
        ancestors.append(id(node))
        children, _, entries, _ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
        steps = zip(_styles_of(node, entries), entries, children)
        stack.extend(
            (child, (*path, styled), (*raw, entry))
            for styled, entry, child in reversed(list(steps))
        )
    return TreeDepthError(
        f"{where}{'(args, kwargs)' if root is None else root}: the tree is too deep to flatten "
        "(optree raised RecursionError)"
    )


def _styles_of(node: Any, entries: Sequence[Any]) -> list[tuple[Any, str]]:
    """:func:`child_styles` for a container itself (one level, from its optree entries)."""
    if type(node) in (dict, OrderedDict, defaultdict):
        return [(k, "key") for k in entries]
    if optree.is_namedtuple(node):
        return [(f, "attr") for f in type(node)._fields]
    if optree.is_structseq(node):
        return [(f, "attr") for f in optree.structseq_fields(node)]
    if type(node) in (list, tuple, deque):
        return [(i, "index") for i in range(len(entries))]
    return [
        (e, "attr")
        if isinstance(e, str) and e.isidentifier() and not keyword.iskeyword(e)
        else (e, "index" if isinstance(e, int) else "key")
        for e in entries
    ]


def _shown_path(root: str | None, path: tuple[tuple[Any, str], ...], raw: tuple[Any, ...]) -> str:
    """:func:`display_path` for a path of any length: a long one keeps its ends."""
    node = Node(path, raw, 0, 0, None)  # type: ignore[arg-type]
    if len(path) <= 24:
        return display_path(node, root)
    head = display_path(Node(path[:12], raw[:12], 0, 0, None), root)  # type: ignore[arg-type]
    tail = format_path("", path[-8:])
    return f"{head}...{tail} ({len(path)} levels)"


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


# ---------------------------------------------------------------------------------- paths

MAPPING_KINDS = (PyTreeKind.DICT, PyTreeKind.ORDEREDDICT, PyTreeKind.DEFAULTDICT)


class Node(NamedTuple):
    """One node of a structure, as seen from the root."""

    path: tuple[tuple[Any, str], ...]
    """``(entry, style)`` pairs from the root; style is ``"key"``, ``"index"`` or ``"attr"``."""
    raw: tuple[Any, ...]
    """The optree entries from the root (indices for sequences and namedtuples)."""
    start: int
    """Index of the node's first leaf in the flat leaf list."""
    stop: int
    """One past the node's last leaf."""
    spec: PyTreeSpec
    """The node's own structure."""


def child_styles(node: PyTreeSpec) -> list[tuple[Any, str]]:
    """How each child of ``node`` is written in a path: ``(entry, "key" | "index" | "attr")``."""
    kind = node.kind
    entries = node.entries()
    if kind in MAPPING_KINDS:
        return [(k, "key") for k in entries]
    if kind in (PyTreeKind.NAMEDTUPLE, PyTreeKind.STRUCTSEQUENCE):
        fields = (
            node.type._fields  # type: ignore[union-attr]
            if kind == PyTreeKind.NAMEDTUPLE
            else optree.structseq_fields(node.type)  # type: ignore[arg-type]
        )
        return [(f, "attr") for f in fields]
    if kind == PyTreeKind.CUSTOM:
        return [
            (e, "attr")
            if isinstance(e, str) and e.isidentifier() and not keyword.iskeyword(e)
            else (e, "index" if isinstance(e, int) else "key")
            for e in entries
        ]
    return [(i, "index") for i in range(len(entries))]


def nodes(spec: PyTreeSpec) -> list[Node]:
    """Every node of ``spec`` in pre-order (root first, leaves included), with its path and leaves.

    Iterative: a tree of any depth optree can flatten is fine.

    >>> [format_path("x", n.path) for n in nodes(optree.tree_structure({"a": [1, 2]}))]
    ['x', "x['a']", "x['a'][0]", "x['a'][1]"]
    """
    out: list[Node] = []
    stack: list[tuple[PyTreeSpec, tuple[tuple[Any, str], ...], tuple[Any, ...], int]] = [
        (spec, (), (), 0)
    ]
    while stack:
        node, path, raw, start = stack.pop()
        out.append(Node(path, raw, start, start + node.num_leaves, node))
        if node.is_leaf():
            continue
        children = []
        pos = start
        for styled, entry, child in zip(child_styles(node), node.entries(), node.children()):
            children.append((child, (*path, styled), (*raw, entry), pos))
            pos += child.num_leaves
        stack.extend(reversed(children))
    return out


def leaf_nodes(spec: PyTreeSpec) -> list[Node]:
    """The nodes of ``spec``'s leaves, in leaf order."""
    return [nd for nd in nodes(spec) if nd.spec.is_leaf()]


def move_tree(tree: Any, target: torch.device) -> Any:
    """``tree`` with every tensor leaf on ``target`` (others untouched)."""
    return optree.tree_map(
        lambda x: x.to(target) if isinstance(x, torch.Tensor) and x.device != target else x,
        tree,
        namespace=NAMESPACE,
    )


INPUT_AND_KWARGS = "(inputs, kwargs)"
"""The ``root`` of an ``(input, kwargs)`` pair: :func:`treegather.data_parallel`'s single
input (paths start at it, ``inputs['names']``) next to its keyword arguments (``kwargs['labels']``).
``root=None`` is an ``(args, kwargs)`` pair, whose paths start at the positional index."""


def is_call_root(root: str | None) -> bool:
    """Whether ``root`` names a call's pair (``(args, kwargs)`` or ``(input, kwargs)``), whose
    first level (the pair's index) is not part of any path."""
    return root is None or root == INPUT_AND_KWARGS


def display_path(node: Node, root: str | None) -> str:
    """A node's path for messages; ``root=None`` means an ``(args, kwargs)`` pair and
    :data:`INPUT_AND_KWARGS` an ``(input, kwargs)`` pair.

    >>> [display_path(n, INPUT_AND_KWARGS) for n in nodes(optree.tree_structure(({"a": 1}, {"b": 2})))]
    ['(inputs, kwargs)', 'inputs', "inputs['a']", 'kwargs', "kwargs['b']"]
    """
    if root is not None and root != INPUT_AND_KWARGS:
        return format_path(root, node.path)
    if not node.path:
        return "(args, kwargs)" if root is None else INPUT_AND_KWARGS
    head = "kwargs" if node.raw[0] == 1 else "args" if root is None else "inputs"
    return format_path(head, node.path[1:])


def format_path(root: str, path: Sequence[tuple[Any, str]]) -> str:
    """Write a path as a user would type it: ``outputs['logits']``, ``out.hidden[2]``.

    >>> format_path("outputs", [("hidden", "attr"), (2, "index"), ("k", "key")])
    "outputs.hidden[2]['k']"
    """
    parts = [root]
    for entry, style in path:
        if style == "attr":
            parts.append(f".{entry}")
        elif style == "index":
            parts.append(f"[{entry}]")
        else:
            parts.append(f"[{safe_repr(entry)}]")
    return "".join(parts)


def describe(value: Any) -> str:
    """A short description of a leaf for error messages: shape/dtype/device or type, and a
    ``repr`` cut to 60 characters that never raises (:func:`treegather._errors.safe_repr`)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # a nested tensor has no single shape
            return f"nested Tensor(dtype={value.dtype}, device={value.device})"
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    return f"{type(value).__qualname__} {safe_repr(value, 60)}"


_sync_transformers()  # transformers imported before treegather: its caches are nodes from now on
