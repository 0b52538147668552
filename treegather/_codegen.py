"""Code the compiled layer generates for one structure: its guard and its per-device builder.

Both are made from a ``PyTreeSpec`` alone (never from user data) and are pure functions:

- a **guard** ``guard(tree) -> bool`` says whether ``tree`` has exactly the structure of the
  spec: the same container classes (``dict`` is not ``OrderedDict``), dict keys in the same
  insertion order, the same ``default_factory`` and deque ``maxlen``, the same custom-node
  metadata compared type-aware (``True`` is not ``1``), ``None`` where the spec has ``None``.
  When it says yes, ``spec.flatten_up_to(tree)`` cannot fail (so optree never formats the tree
  into an error message). :func:`interpreted_guard` walks a list of steps (cheap to build, used
  first); :func:`compiled_guard` writes the same steps out as straight-line Python (no nesting,
  so any depth compiles) for structures seen often.
- a **builder** ``build(*columns) -> [tree_0, ..., tree_{k-1}]`` makes the k per-device trees of
  a scatter from one column (k values) per leaf, written out as dict/list/tuple displays; only
  for plain ``dict`` (``str`` keys), ``list``, ``tuple`` and ``None`` nodes (anything else keeps
  ``unflatten``, which rebuilds every registered class exactly).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import optree
from optree import PyTreeSpec

from ._caches import typed_key
from ._tree import NAMESPACE

__all__ = ["Step", "guard_steps", "interpreted_guard", "compiled_guard", "compiled_builder"]

Guard = Callable[[Any], bool]
Builder = Callable[..., list[Any]]

# Step kinds.
_EXACT_KEYS, _EXACT_LEN, _EXACT_TYPE, _NONE, _CUSTOM, _DEFAULTDICT, _DEQUE = range(7)

# (slot of the parent, how to reach the node from it, check kind, expected type, expected value)
# ``reach`` is an entry to index the parent with, or _ROOT for the tree itself. A custom node's
# children are reached through the slot holding its flattened children list.
Step = tuple[int, Any, int, type, Any]
_ROOT: Any = object()

MAX_CELLS = 4_000  # leaves x replicas a builder is compiled for (about 8 ms per 1000 cells, once)
MAX_DEPTH = 50  # builder displays nest; well inside the parser's limit on nested brackets


def guard_steps(spec: PyTreeSpec) -> list[Step] | None:
    """The checks a tree must pass to have exactly ``spec``'s structure, in pre-order.

    Step ``i`` puts the node it checks in slot ``i + 1`` (slot 0 is the tree). ``None`` when the
    structure has a node the guard cannot check (the caller then does not cache it). Made from
    the spec rebuilt around placeholder leaves: one ``unflatten``, then a walk of the
    containers (no recursion, no copies of sub-specs).
    """
    try:
        template = spec.unflatten([_LEAF] * spec.num_leaves)
    except Exception:  # a registered class refusing placeholder children: not cached
        return None
    steps: list[Step] = []
    stack: list[tuple[Any, int, Any]] = [(template, 0, _ROOT)]
    while stack:
        node, parent, reach = stack.pop()
        if node is _LEAF:
            continue
        slot = len(steps) + 1
        found = _step(node)
        if found is None:
            return None
        kind, expected, children = found
        steps.append((parent, reach, kind, type(node), expected))
        stack.extend((child, slot, entry) for entry, child in reversed(children))
    try:
        # The walk must have seen exactly the spec (a custom unflatten may transform children).
        if optree.tree_structure(template, namespace=NAMESPACE) != spec:
            return None
    except Exception:
        return None
    return steps


_LEAF: Any = object()  # the placeholder leaf of a template


def _step(node: Any) -> tuple[int, Any, list[tuple[Any, Any]]] | None:
    """(check kind, expected value, [(entry, child)]) for one container of a template."""
    cls = type(node)
    if node is None:
        return _NONE, None, []
    if cls is dict or cls is OrderedDict:
        keys = tuple(node)
        return _EXACT_KEYS, (keys, tuple(map(type, keys))), [(key, node[key]) for key in node]
    if cls is defaultdict:
        keys = tuple(node)
        factory_keys = (node.default_factory, keys, tuple(map(type, keys)))
        return _DEFAULTDICT, factory_keys, [(k, node[k]) for k in node]
    if cls is list or cls is tuple:
        return _EXACT_LEN, len(node), list(enumerate(node))
    if cls is deque:
        return _DEQUE, (len(node), node.maxlen), list(enumerate(node))
    if optree.is_namedtuple_class(cls) or optree.is_structseq_class(cls):
        return _EXACT_TYPE, None, list(enumerate(node))
    try:
        children, meta, entries, _ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
    except Exception:
        return None
    expected = (len(children), typed_key((meta, tuple(entries))))
    return _CUSTOM, expected, list(enumerate(children))  # reached by index in the children


def _custom_children(value: Any, expected: tuple[int, Any]) -> list[Any] | None:
    """A custom node's children, when its metadata and entries are the expected ones."""
    try:
        children, meta, entries, _ = optree.tree_flatten_one_level(value, namespace=NAMESPACE)
    except Exception:
        return None
    if len(children) != expected[0] or typed_key((meta, tuple(entries))) != expected[1]:
        return None
    return list(children)


def _check(value: Any, kind: int, cls: type, expected: Any) -> Any:
    """The node itself (or, for a custom node, its children list) when it passes; else _FAIL."""
    if kind == _NONE:
        return value if value is None else _FAIL
    if type(value) is not cls:
        return _FAIL
    value = _as_any(value)  # (the type check above narrows it to ``object`` for mypy)
    if kind == _EXACT_KEYS:
        keys = tuple(value)
        ok = keys == expected[0] and tuple(map(type, keys)) == expected[1]
        return value if ok else _FAIL
    if kind == _EXACT_LEN:
        return value if len(value) == expected else _FAIL
    if kind == _EXACT_TYPE:
        return value
    if kind == _DEFAULTDICT:
        keys = tuple(value)
        ok = (
            value.default_factory is expected[0]
            and keys == expected[1]
            and tuple(map(type, keys)) == expected[2]
        )
        return value if ok else _FAIL
    if kind == _DEQUE:
        return value if (len(value), value.maxlen) == expected else _FAIL
    children = _custom_children(value, expected)
    return _FAIL if children is None else children


_FAIL: Any = object()


def _as_any(value: Any) -> Any:
    return value


def interpreted_guard(steps: list[Step]) -> Guard:
    """A guard that walks ``steps`` (cheap to make; about 0.4 us per container to run).

    >>> spec = optree.tree_structure({"a": [1, 2], "b": None})
    >>> guard = interpreted_guard(guard_steps(spec))
    >>> guard({"a": [3, 4], "b": None}), guard({"b": None, "a": [3, 4]}), guard({"a": [3], "b": None})
    (True, False, False)
    """

    def guard(tree: Any) -> bool:
        slots = [tree]
        append = slots.append
        try:
            for parent, reach, kind, cls, expected in steps:
                value = slots[parent] if reach is _ROOT else slots[parent][reach]
                checked = _check(value, kind, cls, expected)
                if checked is _FAIL:
                    return False
                append(checked)
        except Exception:  # a user container misbehaving under indexing: not this structure
            return False
        return True

    return guard


def compiled_guard(steps: list[Step], keys: str = "typed") -> Guard:
    """The same guard written out as straight-line Python (a few times faster to run).

    ``keys`` says how dict keys are checked: ``"typed"`` (in order, and by type: ``True`` is not
    ``1``), or ``"any"``: not at all, for gather's check of replicas 1.. against replica 0,
    where optree's ``flatten_up_to`` then compares key sets (any order, with ``==``, as the
    reference compares replicas) and raises on a difference.

    >>> spec = optree.tree_structure({"a": [1, 2], "b": None})
    >>> guard = compiled_guard(guard_steps(spec))
    >>> guard({"a": [3, 4], "b": None}), guard({"a": (3, 4), "b": None})
    (True, False)
    """
    consts: dict[str, Any] = {"_custom": _custom_children}
    names: dict[int, str] = {}
    lines = ["  def guard(s0):", "    try:", "      pass"]

    def const(value: Any) -> str:
        # One name per distinct object (every dict node shares ``dict``); closure cells are
        # read with LOAD_DEREF, cheaper than a global lookup.
        name = names.get(id(value))
        if name is None:
            name = names[id(value)] = f"_c{len(consts)}"
            consts[name] = value
        return name

    # Each node's class is checked before anything indexes it; dict keys (in order, and by
    # type) and sequence lengths are then compared for all nodes at once, in C.
    key_nodes: list[str] = []
    key_values: list[Any] = []
    key_types: list[type] = []
    sized: list[str] = []
    sizes: list[Any] = []
    for i, (parent, reach, kind, cls, expected) in enumerate(steps, start=1):
        var = f"s{i}"
        src = f"s{parent}" if reach is _ROOT else f"s{parent}[{const(reach)}]"
        lines.append(f"      {var} = {src}")
        if kind == _NONE:
            lines.append(f"      if {var} is not None: return False")
            continue
        lines.append(f"      if type({var}) is not {const(cls)}: return False")
        if kind == _EXACT_KEYS or kind == _DEFAULTDICT:
            if kind == _DEFAULTDICT:
                lines.append(
                    f"      if {var}.default_factory is not {const(expected[0])}: return False"
                )
                expected = expected[1:]
            if keys == "typed":
                key_nodes.append(var)
                key_values.extend(expected[0])
                key_types.extend(expected[1])
        elif kind == _EXACT_LEN:
            sized.append(f"len({var})")
            sizes.append(expected)
        elif kind == _DEQUE:
            lines.append(f"      if (len({var}), {var}.maxlen) != {const(expected)}: return False")
        elif kind == _CUSTOM:
            lines.append(f"      {var} = _custom({var}, {const(expected)})")
            lines.append(f"      if {var} is None: return False")
    if sized:
        lines.append(f"      if ({', '.join(sized)},) != {const(tuple(sizes))}: return False")
    if key_nodes:
        unpacked = ", ".join(f"*{v}" for v in key_nodes)
        lines.append(f"      k = ({unpacked},)")
        lines.append(f"      if k != {const(tuple(key_values))}: return False")
        lines.append(f"      if tuple(map(type, k)) != {const(tuple(key_types))}: return False")
    # A user container misbehaving under indexing is not this structure.
    lines += ["    except Exception:", "      return False", "    return True", "  return guard"]
    params = ", ".join([*consts, "type=type", "tuple=tuple", "map=map", "len=len"])
    source = f"def make({params}):\n" + "\n".join(lines)
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<treegather guard: {len(steps)} nodes>", "exec"), namespace)
    guard: Guard = namespace["make"](**consts)
    return guard


# -------------------------------------------------------------------------------- builders


class _Unsupported(Exception):
    pass


def compiled_builder(spec: PyTreeSpec, k: int) -> Builder | None:
    """A function ``build(*columns) -> [tree_0, ..., tree_{k-1}]`` for ``spec``, or ``None``.

    ``columns[i][r]`` is leaf ``i`` of tree ``r``; ``None`` for structures it cannot write out.

    >>> build = compiled_builder(optree.tree_structure({"x": 0, "y": [0, None]}), 2)
    >>> build(("a0", "a1"), ("b0", "b1"))
    [{'x': 'a0', 'y': ['b0', None]}, {'x': 'a1', 'y': ['b1', None]}]
    """
    n = spec.num_leaves
    if n == 0 or k < 1 or n * k > MAX_CELLS:
        return None
    # The structure with leaf i replaced by the int i: its containers are the ones unflatten
    # builds, in the same order, and each int says which column a leaf comes from.
    try:
        template = spec.unflatten(list(range(n)))
        trees = [_display(template, r) for r in range(k)]
    except Exception:  # _Unsupported, or a registered class refusing ints as its children
        return None
    params = ", ".join(f"c{i}" for i in range(n))
    source = f"def build({params}):\n    return [{', '.join(trees)}]\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<treegather builder: {n} leaves x {k}>", "exec"), namespace)
    build: Builder = namespace["build"]
    return build


def _display(template: Any, r: int) -> str:
    """Python source building ``template`` for replica ``r`` (leaf ``i`` is ``c{i}[r]``)."""
    # Iterative (an explicit stack of pending parts), bounded by MAX_DEPTH for the parser.
    parts: list[str] = []
    stack: list[tuple[Any, int]] = [(template, 0)]
    while stack:
        node, depth = stack.pop()
        if type(node) is str:  # a piece of source text queued between children
            parts.append(node)
            continue
        kind = type(node)
        if kind is int:
            parts.append(f"c{node}[{r}]")
            continue
        if node is None:
            parts.append("None")
            continue
        if depth >= MAX_DEPTH:
            raise _Unsupported
        if kind is dict:
            if not all(type(key) is str for key in node):
                raise _Unsupported
            pending: list[Any] = ["{"]
            for key, value in node.items():
                pending += [f"{key!r}: ", (value, depth + 1), ", "]
            pending.append("}")
        elif kind is list or kind is tuple:
            pending = ["[" if kind is list else "("]
            for value in node:
                pending += [(value, depth + 1), ", "]
            pending.append("]" if kind is list else ")")
        else:
            raise _Unsupported  # OrderedDict, namedtuple, a registered class: unflatten rebuilds it
        stack.extend((p, depth) if type(p) is str else p for p in reversed(pending))
    return "".join(parts)
