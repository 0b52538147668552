"""The pytree layer: treegather's optree namespace, registration, flattening and leaf paths.

Everything treegather does to a tree goes through :func:`flatten` here, so that one place knows
which classes are containers: optree's built-ins (dict, OrderedDict, defaultdict, list, tuple,
namedtuple, deque, ``None`` as an empty node), classes registered with :func:`register_dataclass`
or :func:`register_node`, and classes registered with torch's own pytree
(``torch.utils._pytree.register_pytree_node``, as transformers does for every ``ModelOutput``).
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, cast, overload

import optree
import torch
import torch.utils._pytree as _torch_pytree
from optree import PyTreeKind, PyTreeSpec

__all__ = [
    "NAMESPACE",
    "register_dataclass",
    "register_node",
    "flatten",
    "leaves_are_leaves",
    "flatten_replicas",
    "remember_replicas",
    "flatten_full",
    "Node",
    "nodes",
    "format_path",
]

NAMESPACE = "treegather"
"""The optree namespace treegather registers its container classes in."""

T = TypeVar("T")

# ----------------------------------------------------------------------------- registration

_REGISTERED: set[type] = set()
# Classes registered only through the torch pytree bridge: an explicit treegather registration
# replaces the bridged one instead of failing (whether the bridge ran first must not matter).
_BRIDGED: set[type] = set()


def _invalidate() -> None:
    _SPEC_MRU.clear()
    _KNOWN_LEAF_TYPES.clear()
    _NODES_CACHE.clear()
    _REPLICAS_CACHE.clear()


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


# ----------------------------------------------------------------- torch.utils._pytree bridge

_torch_synced = 0


class _Context:
    """Hashable wrapper for a torch pytree context (often a list of keys)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key = repr(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return self._key


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


def _sync_torch_registry() -> None:
    """Bridge classes registered with torch's pytree since the last call (cheap when none are)."""
    global _torch_synced
    supported = _torch_pytree.SUPPORTED_NODES
    if len(supported) == _torch_synced:
        return
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


# ------------------------------------------------------------------------------- flattening

# Recently seen structures per root type. A hit costs one ``flatten_up_to`` (C++, no key sorting)
# plus a set of leaf types, instead of a full flatten: the hot path of every training step.
_SPEC_MRU: dict[type, list[tuple[PyTreeSpec, Callable[[Any], bool] | None]]] = {}
_MRU_SIZE = 4
# Classes seen as leaves of a full flatten; a class is a leaf or a node by its type alone.
_KNOWN_LEAF_TYPES: set[type] = set()


def flatten_full(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` in treegather's namespace, without the structure cache."""
    _sync_torch_registry()
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves, spec


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` in treegather's namespace (``None`` is an empty node).

    Returns the leaves and the exact structure; for a structure seen recently this skips the full
    flatten (about 5x faster on a 1000-leaf nested dict).

    >>> leaves, spec = flatten({"b": 1, "a": (2, None)})
    >>> leaves, spec.unflatten(leaves)
    ([2, 1], {'b': 1, 'a': (2, None)})
    """
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        _sync_torch_registry()
    root_type = type(tree)
    recent = _SPEC_MRU.get(root_type)
    if recent:
        for i, (spec, key_order_ok) in enumerate(recent):
            try:
                leaves = spec.flatten_up_to(tree)
            except (ValueError, TypeError):
                continue
            if leaves_are_leaves(leaves) and (key_order_ok is None or key_order_ok(tree)):
                if i:
                    recent.insert(0, recent.pop(i))
                return leaves, spec
            break
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    _KNOWN_LEAF_TYPES.update(map(type, leaves))
    checker = _key_order_checker(spec)
    if checker is not False:
        bucket = _SPEC_MRU.setdefault(root_type, [])
        bucket.insert(0, (spec, checker if callable(checker) else None))
        del bucket[_MRU_SIZE:]
    return leaves, spec


# Per (root type, replica count): the structure of the whole list of replica outputs seen last,
# with its key-order check for replica 0. gather flattens every replica in one C call with it.
_REPLICAS_CACHE: dict[tuple[type, int], list[Any]] = {}  # [spec, list spec, check, caller's]


def flatten_replicas(outputs: list[Any]) -> tuple[list[Any], PyTreeSpec, list[Any]] | None:
    """All replicas' leaves at once, when they share the structure last seen for such a list.

    Returns ``(flat, spec, entry)`` or ``None`` (a structure not seen recently, or replicas
    that differ): the caller then takes the general path. ``flat`` holds replica 0's
    ``spec.num_leaves`` leaves, then replica 1's, and so on. Replica 0's dict key order is
    checked, so the spec rebuilds exactly its order. ``flatten_up_to`` lets a subtree or a
    ``None`` stand where the structure has a leaf: the caller checks ``leaves_are_leaves(flat)``
    unless its own work fails on such values anyway (``torch.cat`` does). ``entry[3]`` is the
    caller's to keep per-structure state in (gather keeps its last plan there).
    """
    if len(_torch_pytree.SUPPORTED_NODES) != _torch_synced:
        return None
    hit = _REPLICAS_CACHE.get((type(outputs[0]), len(outputs)))
    if hit is None:
        return None
    spec, list_spec, key_order_ok, _ = hit
    try:
        flat: list[Any] = list_spec.flatten_up_to(cast(Any, outputs))
    except (ValueError, TypeError):
        return None
    if key_order_ok is not None and not key_order_ok(outputs[0]):
        return None
    return flat, spec, hit


def remember_replicas(outputs: list[Any], spec: PyTreeSpec) -> None:
    """Record that ``outputs`` (a list of replica trees) all have structure ``spec``."""
    for cached, checker in _SPEC_MRU.get(type(outputs[0]), ()):
        if cached is spec:
            list_spec = optree.treespec_list([spec] * len(outputs), namespace=NAMESPACE)
            if len(_REPLICAS_CACHE) > 64:
                _REPLICAS_CACHE.clear()
            _REPLICAS_CACHE[(type(outputs[0]), len(outputs))] = [spec, list_spec, checker, None]
            return


def leaves_are_leaves(values: list[Any]) -> bool:
    """Whether every value is of a class seen as a leaf (not a container, not ``None``).

    ``flatten_up_to`` lets a subtree stand where a structure has a leaf; this is the check, at
    C speed for the usual all-tensor case (a list count is about twice as fast as a set).
    """
    types = list(map(type, values))
    if types.count(torch.Tensor) == len(types):
        return True
    return set(types) <= _KNOWN_LEAF_TYPES


_MAPPING_KINDS = (PyTreeKind.DICT, PyTreeKind.ORDEREDDICT, PyTreeKind.DEFAULTDICT)
_INDEXABLE_KINDS = (
    PyTreeKind.DICT,
    PyTreeKind.ORDEREDDICT,
    PyTreeKind.DEFAULTDICT,
    PyTreeKind.LIST,
    PyTreeKind.TUPLE,
    PyTreeKind.NAMEDTUPLE,
    PyTreeKind.STRUCTSEQUENCE,
    PyTreeKind.DEQUE,
)


def _key_order_checker(spec: PyTreeSpec) -> Callable[[Any], bool] | bool | None:
    """Compile a check that a tree's mappings match ``spec``'s: type, default_factory, key order.

    ``flatten_up_to`` matches mappings by key, whatever their mapping type, so a cached structure
    would otherwise hand back the key order, the mapping type or the defaultdict factory of an
    earlier call. Returns ``None`` when the structure has no mapping, and ``False`` when a
    mapping sits below a node it cannot index (never cache then).
    """
    consts: dict[str, Any] = {}
    lines: list[str] = []  # the parts of one tuple expression, compared with one constant
    expected: list[Any] = []
    names = iter(range(1 << 30))

    def const(value: Any) -> str:
        name = f"_c{len(consts)}"
        consts[name] = value
        return name

    def visit(node: PyTreeSpec, var: str) -> bool:
        kind = node.kind
        if kind in (PyTreeKind.LEAF, PyTreeKind.NONE):
            return True
        if kind not in _INDEXABLE_KINDS:
            return not any(c.kind in _MAPPING_KINDS or not c.is_leaf() for c in node.children())
        entries = node.entries()
        if kind in _MAPPING_KINDS:
            # flatten_up_to also accepts dict, OrderedDict and defaultdict for one another (and
            # ignores default_factory): check the exact type and factory too.
            rebuilt = node.unflatten([None] * node.num_leaves)
            lines.append(f"type({var})")
            expected.append(type(rebuilt))
            if kind == PyTreeKind.DEFAULTDICT:
                lines.append(f"{var}.default_factory")
                expected.append(rebuilt.default_factory)
            if len(entries) > 1:
                lines.append(f"*{var}")
                expected.extend(rebuilt.keys())
        elif kind == PyTreeKind.DEQUE:  # flatten_up_to ignores maxlen too
            lines.append(f"{var}.maxlen")
            expected.append(node.unflatten([None] * node.num_leaves).maxlen)
        for entry, child in zip(entries, node.children()):
            if child.is_leaf():
                continue
            child_var = f"v{next(names)}"
            mark = len(lines)
            # Fetch the child where it is first needed (a walrus inside the one expression).
            if not visit(child, child_var):
                return False
            if len(lines) > mark:
                lines[mark] = lines[mark].replace(
                    child_var, f"({child_var} := {var}[{const(entry)}])", 1
                )
        return True

    if not visit(spec, "t"):
        return False
    if not lines:
        return None
    # One tuple of types, factories and keys against one constant: each container is fetched
    # once, and a single comparison decides (a microsecond or so for a few dicts). The check
    # runs after flatten_up_to has matched every mapping's key set, so only orders can differ.
    source = f"def check(t):\n    return ({', '.join(lines)},) == {const(tuple(expected))}\n"
    namespace: dict[str, Any] = dict(consts)
    exec(compile(source, "<treegather structure check>", "exec"), namespace)
    return namespace["check"]


# ---------------------------------------------------------------------------------- paths


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


_NODES_CACHE: dict[PyTreeSpec, list[Node]] = {}


def _child_styles(node: PyTreeSpec) -> list[tuple[Any, str]]:
    kind = node.kind
    entries = node.entries()
    if kind in _MAPPING_KINDS:
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

    >>> [format_path("x", n.path) for n in nodes(optree.tree_structure({"a": [1, 2]}))]
    ['x', "x['a']", "x['a'][0]", "x['a'][1]"]
    """
    try:
        return _NODES_CACHE[spec]
    except (KeyError, TypeError):
        pass
    out: list[Node] = []

    def visit(
        node: PyTreeSpec, path: tuple[tuple[Any, str], ...], raw: tuple[Any, ...], start: int
    ) -> None:
        out.append(Node(path, raw, start, start + node.num_leaves, node))
        if node.is_leaf():
            return
        pos = start
        for styled, entry, child in zip(_child_styles(node), node.entries(), node.children()):
            visit(child, (*path, styled), (*raw, entry), pos)
            pos += child.num_leaves

    visit(spec, (), (), 0)
    try:
        if len(_NODES_CACHE) > 256:
            _NODES_CACHE.clear()
        _NODES_CACHE[spec] = out
    except TypeError:  # unhashable static metadata: do not cache
        pass
    return out


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
            parts.append(f"[{entry!r}]")
    return "".join(parts)


def describe(value: Any) -> str:
    """A short description of a leaf for error messages: shape/dtype/device or type."""
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__qualname__} {text}"
