"""Code the compiled layer generates to recognise and read one structure: guards and readers.

All are made from a ``PyTreeSpec`` alone (never from user data) and are pure functions:

- a **guard** ``guard(tree) -> bool`` says whether ``tree`` has exactly the structure of the
  spec: the same container classes (``dict`` is not ``OrderedDict``), dict keys in the same
  insertion order, the same ``default_factory`` and deque ``maxlen``, the same custom-node
  metadata compared type-aware (``True`` is not ``1``), ``None`` where the spec has ``None``.
  When it says yes, ``spec.flatten_up_to(tree)`` cannot fail (so optree never formats the tree
  into an error message). :func:`interpreted_guard` walks a list of steps (cheap to build, used
  first); :func:`compiled_guard` writes the same steps out as straight-line Python (no nesting,
  so any depth compiles) for structures seen often.
- a **reader** ``read(tree) -> leaves | None`` is a compiled guard that also reads every leaf
  (one index of its parent each): the guard and ``flatten_up_to`` in one call.
  :func:`compiled_columns` reads gather's k replicas at once, as columns, and can compare each
  leaf's dtype across replicas on the way.

The per-device builders are in :mod:`treegather._compiled.builders`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import optree
from optree import PyTreeSpec

from .._caches import shareable, typed_key
from .._tree import NAMESPACE, context_names

__all__ = [
    "MAX_CELLS",
    "Step",
    "compiled_columns",
    "compiled_guard",
    "compiled_reader",
    "guard_steps",
    "interpreted_guard",
    "sharing",
    "structure_steps",
]

Guard = Callable[[Any], bool]

# Step kinds.
_EXACT_KEYS, _EXACT_LEN, _EXACT_TYPE, _NONE, _CUSTOM, _DEFAULTDICT, _DEQUE = range(7)

# (slot of the parent, how to reach the node from it, check kind, expected type, expected value)
# ``reach`` is an entry to index the parent with, or _ROOT for the tree itself. A custom node's
# children are reached through the slot holding its flattened children list.
Step = tuple[int, Any, int, type, Any]
# Where a leaf is: (slot of its parent, the entry to index the parent with).
Reach = tuple[int, Any]
Reader = Callable[[Any], "list[Any] | None"]
_ROOT: Any = object()

MAX_CELLS = 4_000  # leaves x replicas a builder or columns reader is compiled for


def guard_steps(spec: PyTreeSpec) -> list[Step] | None:
    """The checks a tree must pass to have exactly ``spec``'s structure, in pre-order.

    Step ``i`` puts the node it checks in slot ``i + 1`` (slot 0 is the tree). ``None`` when the
    structure has a node the guard cannot check (the caller then does not cache it).
    """
    found = structure_steps(spec)
    return None if found is None else found[0]


def structure_steps(spec: PyTreeSpec) -> tuple[list[Step], list[Reach]] | None:
    """:func:`guard_steps`, and where each leaf is: ``(slot of its parent, entry)`` in spec order.

    Made from the spec rebuilt around placeholder leaves: one ``unflatten``, then a walk of the
    containers (no recursion, no copies of sub-specs).
    """
    n = spec.num_leaves
    try:
        template = spec.unflatten([_Leaf(i) for i in range(n)])
    except Exception:  # a registered class refusing placeholder children: not cached
        return None
    steps: list[Step] = []
    leaves: list[Reach | None] = [None] * n
    stack: list[tuple[Any, int, Any]] = [(template, 0, _ROOT)]
    while stack:
        node, parent, reach = stack.pop()
        if type(node) is _Leaf:
            if leaves[node.index] is not None:  # a custom node repeating a child
                return None
            leaves[node.index] = (parent, reach)
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
    if None in leaves:
        return None
    return steps, leaves  # type: ignore[return-value]


def sharing(steps: list[Step]) -> tuple[bool, bool]:
    """Whether a tree that passes the guard of ``steps`` is told apart from the tree the steps
    were made from only by its leaves: ``(metadata, paths)``.

    ``metadata``: every dict key and node metadata (a dataclass's static fields) is an immutable
    value or compared by identity, so a result rebuilt from the cached spec holds nothing the
    caller could tell from its own objects. Not so for a list in a static field (an equal list
    is another, mutable object), a float (``-0.0`` passes for ``0.0``), or a dict key whose class
    defines ``==`` (an equal key may differ otherwise): such results are rebuilt from the
    structure of this call's tree. ``paths``: the same for dict keys and node entries alone (the
    paths :func:`treegather.by_path` matches and messages name).
    """
    metadata = paths = True
    for _, _, kind, _, expected in steps:
        if kind == _EXACT_KEYS or kind == _DEFAULTDICT:
            keys = expected[0] if kind == _EXACT_KEYS else expected[1]
            if not all(map(_exact_key, keys)):
                metadata = paths = False
        elif kind == _CUSTOM:
            meta_key, entries_key = expected[1][1]
            if not shareable(entries_key):
                metadata = paths = False
            elif not shareable(meta_key):
                metadata = False
    return metadata, paths


def _exact_key(key: Any) -> bool:
    """Whether a dict key the guard accepts (same type, ``==``) is this very key's value."""
    cls = type(key)
    return cls in _EXACT_KEY_TYPES or isinstance(key, enum.Enum) or cls.__eq__ is object.__eq__


_EXACT_KEY_TYPES = frozenset([type(None), bool, int, str, bytes])


class _Leaf:
    """The placeholder for leaf ``index`` in a template (an unregistered class: a leaf)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


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
        handler = optree.register_pytree_node.get(cls, namespace=NAMESPACE)
    except Exception:
        return None
    if handler is None:
        return None
    flatten = handler.flatten_func
    # (the class's own flatten function: the guard is used only while the registry is as it
    # was, so the lookup optree.tree_flatten_one_level makes on every call is made once here)
    entries = tuple(entries)
    names = context_names(meta)  # (a ModelOutput: its keys say all its typed key says)
    fast = names if names is not None and names[1] == entries else None
    expected = (len(children), typed_key((meta, entries)), flatten, fast)
    return _CUSTOM, expected, list(enumerate(children))  # reached by index in the children


def _custom_children(value: Any, expected: tuple[int, Any, Any, Any]) -> list[Any] | None:
    """A custom node's children, when its metadata and entries are the expected ones: what
    ``optree.tree_flatten_one_level`` gives (with ``expected``'s flatten function, the one the
    registry holds for the value's class), checked as it checks it: by typed key, or for a
    context of ``str`` names (a bridged ``ModelOutput``) by :func:`context_names`."""
    try:
        returned = tuple(expected[2](value))
        if len(returned) == 2:
            children, meta = returned
            entries: Any = None
        else:
            children, meta, entries = returned
        children = list(children)
        entries = tuple(range(len(children)) if entries is None else entries)
    except Exception:
        return None
    if len(children) != expected[0] or len(entries) != expected[0]:
        return None
    fast = expected[3]
    if fast is not None:
        return children if context_names(meta) == fast and entries == fast[1] else None
    if typed_key((meta, entries)) != expected[1]:
        return None
    return children


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
    ``1``), or ``"any"``: the same key set in any order, compared with ``==`` (as optree's
    ``flatten_up_to`` compares replicas of gather).

    >>> spec = optree.tree_structure({"a": [1, 2], "b": None})
    >>> guard = compiled_guard(guard_steps(spec))
    >>> guard({"a": [3, 4], "b": None}), guard({"a": (3, 4), "b": None})
    (True, False)
    """
    guard: Guard = _generate(steps, None, [keys])
    return guard


def compiled_reader(steps: list[Step], leaves: list[Reach], keys: str = "typed") -> Reader:
    """The guard and ``flatten_up_to`` in one: ``read(tree)`` is the list of the tree's leaves
    in spec order when the tree passes the guard (keys checked as in :func:`compiled_guard`),
    ``None`` when it does not. Each leaf is read with one index of its parent.

    >>> spec = optree.tree_structure({"b": [1, 2], "a": None, "c": 3})
    >>> read = compiled_reader(*structure_steps(spec))
    >>> read({"b": [10, 20], "a": None, "c": 30}), read({"b": [10, 20], "a": 0, "c": 30})
    ([10, 20, 30], None)
    >>> compiled_reader(*structure_steps(spec), keys="any")({"c": 30, "a": None, "b": [10, 20]})
    [10, 20, 30]
    """
    read: Reader = _generate(steps, leaves, [keys])
    return read


def compiled_columns(
    steps: list[Step], leaves: list[Reach], k: int, same_dtype: bool = False
) -> Reader | None:
    """For gather: ``read(trees)`` of a list of k trees is the list of columns (leaf i of each
    tree, a tuple), when tree 0 passes the typed guard and the others the ``"any"`` one; else
    ``None``. With ``same_dtype`` it is also ``None`` unless every leaf has a ``dtype``, one per
    column (gather's per-step check, cheaper here than in a second pass for small trees).
    ``None`` instead of a reader above :data:`MAX_CELLS` leaves x trees.

    >>> spec = optree.tree_structure({"a": 1, "b": [2]})
    >>> read = compiled_columns(*structure_steps(spec), 2)
    >>> read([{"a": 1, "b": [2]}, {"b": [20], "a": 10}])
    [(1, 10), (2, 20)]
    >>> read([{"b": [2], "a": 1}, {"a": 10, "b": [20]}]) is None  # tree 0's keys in another order
    True
    """
    if k < 1 or len(leaves) * k > MAX_CELLS:
        return None
    modes = ["typed"] + ["any"] * (k - 1)
    read: Reader = _generate(steps, leaves, modes, columns=True, same_dtype=same_dtype)
    return read


def _generate(
    steps: list[Step],
    leaves: list[Reach] | None,
    modes: list[str],
    columns: bool = False,
    same_dtype: bool = False,
) -> Any:
    """Compile a guard (``leaves`` is ``None``: it returns a bool), a reader of one tree (one
    mode), or with ``columns`` a reader of a list of trees (one mode each)."""
    consts: dict[str, Any] = {"_custom": _custom_children}
    names: dict[int, str] = {}
    fail = "return False" if leaves is None else "return None"

    def const(value: Any) -> str:
        # One name per distinct object (every dict node shares ``dict``); closure cells are
        # read with LOAD_DEREF, cheaper than a global lookup.
        name = names.get(id(value))
        if name is None:
            name = names[id(value)] = f"_c{len(consts)}"
            consts[name] = value
        return name

    def index(entry: Any) -> str:
        # A str or int key is written as a literal (a constant of the code: thousands of
        # closure cells would make compiling slow); anything else is a closure cell.
        return repr(entry) if type(entry) in (str, int) else const(entry)

    if not columns:
        lines = ["  def guard(s0):", "    try:", "      pass"]
        prefixes = ["s"]
    else:
        prefixes = [f"t{r}_" for r in range(len(modes))]
        roots = ", ".join(f"{p}0" for p in prefixes)
        lines = ["  def guard(trees):", "    try:", f"      {roots}, = trees"]
    checks = _Checks()
    for prefix, keys in zip(prefixes, modes):
        lines += checks.walk(steps, prefix, keys, (const, index), fail)
    lines += checks.batched(const, fail)
    if leaves is None:
        lines.append("      return True")
    else:
        cells = [
            [f"{p}{parent}" if entry is _ROOT else f"{p}{parent}[{index(entry)}]" for p in prefixes]
            for parent, entry in leaves
        ]
        if not columns:
            lines.append(f"      return [{', '.join(c[0] for c in cells)}]")
        elif same_dtype:
            lines += _same_dtype_columns(cells, fail)
        else:
            displays = ", ".join("(" + ", ".join(c) + ",)" for c in cells)
            lines.append(f"      return [{displays}]")
    # A user container misbehaving under indexing is not this structure.
    lines += ["    except Exception:", f"      {fail}", "  return guard"]
    params = ", ".join([*consts, "type=type", "tuple=tuple", "map=map", "len=len"])
    source = f"def make({params}):\n" + "\n".join(lines)
    namespace: dict[str, Any] = {}
    what = "guard" if leaves is None else "reader"
    exec(compile(source, f"<treegather {what}: {len(steps)} nodes>", "exec"), namespace)
    return namespace["make"](**consts)


def _same_dtype_columns(cells: list[list[str]], fail: str) -> list[str]:
    """Lines binding each column and comparing its dtypes (torch dtypes are singletons)."""
    lines = []
    for i, cell in enumerate(cells):
        xs = [f"x{r}" for r in range(len(cell))]
        lines.append(f"      {', '.join(xs)}, = {', '.join(cell)},")
        lines.append("      d = x0.dtype")
        if len(xs) > 1:
            differs = " or ".join(f"{x}.dtype is not d" for x in xs[1:])
            lines.append(f"      if {differs}: {fail}")
        lines.append(f"      c{i} = ({', '.join(xs)},)")
    lines.append(f"      return [{', '.join(f'c{i}' for i in range(len(cells)))}]")
    return lines


class _Checks:
    """The checks of a generated guard: each node's class is checked before anything indexes
    it; dict keys (in order, and by type) and sequence lengths are then compared for all nodes
    at once, in C. A defaultdict's keys are checked before it is indexed (indexing a missing
    key would insert it)."""

    def __init__(self) -> None:
        self.key_nodes: list[str] = []
        self.key_values: list[Any] = []
        self.key_types: list[type] = []
        self.sized: list[str] = []
        self.sizes: list[Any] = []

    def walk(
        self,
        steps: list[Step],
        p: str,
        keys: str,
        names: tuple[Callable[[Any], str], Callable[[Any], str]],
        fail: str,
    ) -> list[str]:
        """Lines binding ``{p}{i}`` to node i of one tree and checking it (or queueing checks).

        ``names`` writes a value into the source: as a closure constant, and as an index.
        """
        const, index = names
        lines = []
        for i, (parent, reach, kind, cls, expected) in enumerate(steps, start=1):
            var = f"{p}{i}"
            src = f"{p}{parent}" if reach is _ROOT else f"{p}{parent}[{index(reach)}]"
            lines.append(f"      {var} = {src}")
            if kind == _NONE:
                lines.append(f"      if {var} is not None: {fail}")
                continue
            lines.append(f"      if type({var}) is not {const(cls)}: {fail}")
            if kind == _DEFAULTDICT:
                factory, expected_keys, expected_types = expected
                lines.append(f"      if {var}.default_factory is not {const(factory)}: {fail}")
                if keys == "typed":
                    lines.append(f"      k = tuple({var})")
                    lines.append(f"      if k != {const(expected_keys)}: {fail}")
                    lines.append(f"      if tuple(map(type, k)) != {const(expected_types)}: {fail}")
                else:
                    lines.append(
                        f"      if {var}.keys() != {const(frozenset(expected_keys))}: {fail}"
                    )
            elif kind == _EXACT_KEYS:
                if keys == "typed":
                    self.key_nodes.append(var)
                    self.key_values.extend(expected[0])
                    self.key_types.extend(expected[1])
                else:  # every expected key is read (or fails): the same count, the same set
                    self.sized.append(f"len({var})")
                    self.sizes.append(len(expected[0]))
            elif kind == _EXACT_LEN:
                self.sized.append(f"len({var})")
                self.sizes.append(expected)
            elif kind == _DEQUE:
                lines.append(f"      if (len({var}), {var}.maxlen) != {const(expected)}: {fail}")
            elif kind == _CUSTOM:
                lines.append(f"      {var} = _custom({var}, {const(expected)})")
                lines.append(f"      if {var} is None: {fail}")
        return lines

    def batched(self, const: Callable[[Any], str], fail: str) -> list[str]:
        """Lines comparing every queued length and key at once."""
        lines = []
        if self.sized:
            sized = ", ".join(self.sized)
            lines.append(f"      if ({sized},) != {const(tuple(self.sizes))}: {fail}")
        if self.key_nodes:
            unpacked = ", ".join(f"*{v}" for v in self.key_nodes)
            lines.append(f"      k = ({unpacked},)")
            lines.append(f"      if k != {const(tuple(self.key_values))}: {fail}")
            lines.append(f"      if tuple(map(type, k)) != {const(tuple(self.key_types))}: {fail}")
        return lines
