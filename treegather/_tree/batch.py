"""Nodes that carry the batch: metadata that follows the rows, and values laid out by rows their own way.

Two kinds of registered node depend on the batch beyond their leaves:

- A **batch node** holds a batch size in its metadata (TensorDict's ``batch_size``, a
  ``@tensorclass``, a user's dataclass with a ``batch_size`` field): registered with
  ``batch_size=`` (:func:`treegather.register_node`, :func:`treegather.register_dataclass`), its
  metadata travels as a :class:`Batched`, compared without the sizes (replicas with other row
  counts have one structure) and rebuilt by :func:`rebuild` with the sizes of this shard (scatter),
  of the joined rows (gather, the distributed gathers, a Collector), never guessed from leaves.
- A value whose leaves are not laid out by rows (a ``PackedSequence``: its rows interleave,
  time-major) is held whole, as a :class:`Rows` leaf with the functions that split it by rows
  and join it (unpack, join, pack again); the default scatter and gather rules call them. A
  class whose subclasses are made at run time (PyG's graph batches) cannot be registered as a
  node: :func:`rows_class` names its base instead, and :func:`rows_of` holds such a leaf as a
  ``Rows`` value while a step works on it, so one code path serves both.

Finding the batch nodes of a structure walks it; :func:`is_batched` tells in constant time
whether a structure that :func:`treegather._tree.flatten` made has any (a thread's flatten
counts the batch nodes it flattened), so that trees without them never pay for the walk.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as _torch_pytree
from optree import PyTreeKind, PyTreeSpec

from .._errors import ArgumentTypeError, ShapeMismatchError, bullet_list, safe_repr
from .paths import Node, display_path, nodes

__all__ = [
    "BatchNode",
    "BatchRule",
    "Batched",
    "Misclaim",
    "NodeRebuildError",
    "Rows",
    "RowsKind",
    "along_rows",
    "batch_nodes",
    "check_sizes",
    "counted",
    "is_batched",
    "misclaim_text",
    "misclaims",
    "node_data",
    "note",
    "one_row_of",
    "rebuild",
    "resized",
    "rows_class",
    "rows_kind",
    "rows_of",
    "rule_of",
    "set_rule",
    "sizes_by_path",
    "tally",
    "unflattened",
    "unreadable",
    "unwrapped",
]

Size = tuple[int, ...]


class BatchRule(NamedTuple):
    """How a registered class's metadata holds its batch size."""

    cls: type
    size: Callable[[Any], Sequence[int]]
    """``metadata -> batch size`` (the leading dims its leaves share with it)."""
    resize: Callable[[Any, Size], Any]
    """``(metadata, batch size) -> metadata`` with that batch size, the rest as it was."""
    differs: str = ""
    """What a message says when replicas' (ranks') metadata differ, if the class has more to
    say than that they must agree (what to do instead)."""


_RULES: dict[type, BatchRule] = {}  # (registry.py keeps it in step with optree's registry)


def rule_of(cls: type) -> BatchRule | None:
    """How ``cls``'s metadata holds its batch size, if it does."""
    return _RULES.get(cls)


def set_rule(cls: type, rule: BatchRule | None) -> None:
    """Record (``None``: forget) ``cls``'s rule, as it is registered with optree."""
    if rule is None:
        _RULES.pop(cls, None)
    else:
        _RULES[cls] = rule


class Batched:
    """A batch node's metadata as optree holds it: the class's own metadata and its batch size.

    Two compare equal when their metadata does with the batch size set to zeros of the same
    length: replicas (shards, ranks) whose rows differ have one structure, and everything else
    in the metadata must still agree. Pickled by its class (registered on the receiving side).
    """

    __slots__ = ("_key", "_size", "aux", "rule")
    _shareable_fields = False

    def __init__(self, aux: Any, rule: BatchRule) -> None:
        self.aux = aux
        self.rule = rule
        self._size: Size | None = None
        self._key: Any = _UNSET

    @property
    def size(self) -> Size:
        """The batch size this metadata holds (ints)."""
        if self._size is None:
            self._size = tuple(map(operator.index, self.rule.size(self.aux)))
        return self._size

    def key(self) -> Any:
        """The metadata without its sizes (zeros of the same length)."""
        if self._key is _UNSET:
            self._key = self.rule.resize(self.aux, (0,) * len(self.size))
        return self._key

    def __eq__(self, other: object) -> bool:
        if type(other) is not Batched:
            return NotImplemented
        return other.rule.cls is self.rule.cls and bool(other.key() == self.key())

    def __hash__(self) -> int:
        return hash((self.rule.cls, self.key()))

    def __repr__(self) -> str:
        return safe_repr(self.aux)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restored, (self.rule.cls, self.aux))

    def _typed_fields(self) -> tuple[Any, ...]:
        """For :func:`treegather._caches.typed_key` (what the wire plan fingerprints): without
        the sizes."""
        return (self.rule.cls, self.key())


_UNSET: Any = object()


def _no_catch_up() -> None:
    """Until :mod:`.registry` installs its own: nothing to catch up with."""


catch_up: Callable[[], None] = _no_catch_up
"""Bring the rules up to date with the classes registered since (set by :mod:`.registry`, which
imports this module: an integration's class is registered once torch's pytree registry is read)."""


def _restored(cls: type, aux: Any) -> Batched:
    """A :class:`Batched` unpickled (another rank's): the class's rule, registered here."""
    rule = _RULES.get(cls)
    if rule is None:  # (an integration's class, registered once the registry is read)
        catch_up()
        rule = _RULES.get(cls)
    if rule is None:
        raise TypeError(f"{cls.__qualname__} is not registered with a batch_size here")
    _count()
    return Batched(aux, rule)


# --------------------------------------------------------------------- which specs have them

_TALLY = threading.local()


def _count() -> None:
    _TALLY.n = getattr(_TALLY, "n", 0) + 1


def counted(meta: Batched) -> Batched:
    """``meta``, counted for this thread's :func:`tally` (every batch node's flatten), its batch
    size read (one that cannot be is counted for :func:`unreadable`)."""
    _count()
    try:
        meta.size  # noqa: B018 (read once here, kept for every later step)
    except Exception:
        _TALLY.bad = getattr(_TALLY, "bad", 0) + 1
    return meta


def unreadable() -> int:
    """How many batch sizes this thread's flattens could not read so far (:func:`check_sizes`
    says where)."""
    return getattr(_TALLY, "bad", 0)


def tally() -> int:
    """How many batch nodes this thread has flattened (or unpickled) so far."""
    return getattr(_TALLY, "n", 0)


# Specs known to hold batch nodes, by identity (not a cache: a fact about a live object, gone
# with it), with their batch nodes once walked.
_BATCHED: dict[int, tuple[weakref.ref[PyTreeSpec], tuple[BatchNode, ...] | None]] = {}
_LOCK = threading.Lock()


def note(spec: PyTreeSpec) -> None:
    """Record that ``spec`` holds batch nodes (its flatten counted some)."""
    key = id(spec)

    def forget(_: Any, key: int = key, table: dict[int, Any] = _BATCHED, lock: Any = _LOCK) -> None:
        with lock:  # (the table and lock bound here: at exit the module's globals may be gone)
            entry = table.get(key)
            if entry is not None and entry[0]() is None:
                del table[key]

    with _LOCK:
        _BATCHED[key] = (weakref.ref(spec, forget), None)


def is_batched(spec: PyTreeSpec) -> bool:
    """Whether ``spec`` (made by :func:`treegather._tree.flatten`) holds a batch node. Constant
    time; a spec made otherwise (unpickled, built by optree) says ``False`` unless noted."""
    entry = _BATCHED.get(id(spec))
    return entry is not None and entry[0]() is spec


class BatchNode(NamedTuple):
    """One batch node of a structure: where it is, and its metadata."""

    node: Node
    meta: Batched


def batch_nodes(spec: PyTreeSpec) -> tuple[BatchNode, ...]:
    """Every batch node of ``spec`` in pre-order (a walk, kept for a noted spec).

    >>> import optree
    >>> batch_nodes(optree.tree_structure({"a": [1]}))
    ()
    """
    entry = _BATCHED.get(id(spec))
    if entry is not None and entry[0]() is spec and entry[1] is not None:
        return entry[1]
    found: list[BatchNode] = []
    if _RULES:
        for nd in nodes(spec):
            sub = nd.spec
            if sub.kind != PyTreeKind.CUSTOM or sub.type not in _RULES:
                continue
            meta = node_data(sub)
            if type(meta) is Batched:
                found.append(BatchNode(nd, meta))
    result = tuple(found)
    if entry is not None and entry[0]() is spec:
        with _LOCK:
            _BATCHED[id(spec)] = (entry[0], result)
    return result


def sizes_by_path(spec: PyTreeSpec) -> dict[tuple[Any, ...], Size]:
    """The batch size of every batch node of ``spec``, by its raw path (none for a spec that
    :func:`is_batched` says holds none)."""
    if not is_batched(spec):
        return {}
    return {bn.node.raw: bn.meta.size for bn in batch_nodes(spec)}


def check_sizes(spec: PyTreeSpec, root: str | None = "tree", where: str = "") -> None:
    """Read the batch size of every batch node of ``spec``, as flattening a tree does once.

    A batch size that cannot be read (the class's ``batch_size`` function raises, or gives other
    than ints: a field holding ``None``, a float, a tensor) is an
    :class:`~treegather.ArgumentTypeError` naming the node's path (from ``root``; ``where``
    starts the message), chained from the first failure, instead of the bare error of whichever
    step first asked for it.
    """
    problems: list[str] = []
    first: BaseException | None = None
    for bn in batch_nodes(spec):
        try:
            bn.meta.size  # noqa: B018
        except Exception as exc:
            first = first or exc
            name = bn.meta.rule.cls.__qualname__
            problems.append(
                f"{display_path(bn.node, root)}: the {name}'s batch size cannot be read from its "
                f"metadata {safe_repr(bn.meta.aux)} ({type(exc).__name__}: {exc})"
            )
    if problems:
        hint = "a batch size is an int (the rows) or a sequence of ints (its leading dims)"
        raise ArgumentTypeError(where + bullet_list(problems, hint)) from first


def node_data(spec: PyTreeSpec) -> Any:
    """The metadata of ``spec``'s root node (its flatten's ``aux``; a batch node's
    :class:`Batched`)."""
    data: list[Any] = []
    level: Any = spec.one_level()
    level.walk(range(spec.num_children), lambda t, d, c: data.append(d), None)
    return data[-1] if data else None


# ----------------------------------------------------------------------------- rebuilding

_OVERRIDES = threading.local()


def unflattened(meta: Batched, unflatten: Callable[[Any, Any], Any], children: Any) -> Any:
    """A batch node rebuilt by its class's ``unflatten``: with the metadata :func:`rebuild`
    gives it, else its own; within :func:`rebuild`, a failure is a :class:`NodeRebuildError`."""
    table = getattr(_OVERRIDES, "table", None)
    if table is None:
        return unflatten(meta.aux, children)
    aux = table.get(id(meta), meta.aux)
    try:
        return unflatten(aux, children)
    except Exception as exc:
        raise NodeRebuildError(meta, exc) from exc


class NodeRebuildError(Exception):
    """A batch node's class refused to rebuild with the metadata :func:`rebuild` gave it."""

    def __init__(self, meta: Batched, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.meta = meta
        self.exc = exc


def resized(meta: Batched, size: Size) -> Any:
    """``meta``'s metadata with ``size`` as its batch size (the class's own function)."""
    return meta.rule.resize(meta.aux, tuple(size))


def rebuild(
    spec: PyTreeSpec,
    leaves: Sequence[Any],
    sizes: dict[int, Size],
    root: str | None = "tree",
    found: Sequence[BatchNode] | None = None,
) -> Any:
    """``spec.unflatten(leaves)``, the batch node ``i`` of ``spec`` (``found``, else
    :func:`batch_nodes`) rebuilt with batch size ``sizes[i]`` (the others with their own).

    A batch node whose class refuses (its unflatten, or its ``with_batch_size``, raises) is a
    :class:`~treegather.ShapeMismatchError` naming the node's path (from ``root``).
    """
    if found is None:
        found = batch_nodes(spec)
    if not found:
        return spec.unflatten(leaves)
    table: dict[int, Any] = {}
    for i, size in sizes.items():
        bn = found[i]
        if tuple(size) == bn.meta.size:
            continue
        try:
            table[id(bn.meta)] = resized(bn.meta, size)
        except Exception as exc:
            raise _refused(bn, size, exc, root) from None
    before = getattr(_OVERRIDES, "table", None)
    _OVERRIDES.table = table
    try:
        return spec.unflatten(leaves)
    except NodeRebuildError as exc:
        for i, bn in enumerate(found):
            if bn.meta is exc.meta:
                raise _refused(bn, sizes.get(i, bn.meta.size), exc.exc, root) from None
        raise
    finally:
        _OVERRIDES.table = before


def along_rows(found: Sequence[BatchNode], rows: int, joined: Sequence[bool]) -> dict[int, Size]:
    """The batch sizes of the nodes ``found`` (by index) when their rows are joined along dim 0
    into ``rows`` rows: a node with a position joined along the rows (``joined[pos]``), or
    with no position at all, holds ``rows`` at dim 0; the others keep their own.

    >>> along_rows((), 8, [True])
    {}
    """
    out: dict[int, Size] = {}
    for i, bn in enumerate(found):
        size = bn.meta.size
        start, stop = bn.node.start, bn.node.stop
        if size and (start == stop or any(joined[start:stop])):
            out[i] = (rows, *size[1:])
    return out


class Misclaim(NamedTuple):
    """A batch node holding another number of rows than its leaves (or the batch) along a dim
    that follows the rows."""

    at: int
    """The node's index in the nodes checked."""
    size: Size
    """Its batch size (the claim)."""
    dim: int
    rows: int
    """The rows found along ``dim``."""
    leaf: int | None
    """The position of the leaf holding them; ``None``: the batch's rows (a node without leaves
    along that dim)."""


def misclaims(
    found: Sequence[BatchNode],
    sizes: Sequence[Size],
    held: Mapping[int, tuple[int, ...]],
    along: Mapping[int, tuple[int, int]],
    batch: int | None = None,
) -> list[Misclaim]:
    """Every batch node whose batch size disagrees with the rows of its leaves, in one tree
    (a scatter's input, one replica's output, one rank's tree, one add).

    ``sizes[i]`` is node ``found[i]``'s batch size there; ``held[i]`` the dims of it that
    follow the rows (those its leaves are split or joined along); ``along[pos]`` the
    ``(dim, rows)`` of each position split or joined along a dim. A node must hold, along each
    such dim, the rows of every leaf of its own split or joined along it; a node without such
    leaves the ``batch``'s rows (unchecked when ``None``). One misclaim per node and dim.

    >>> misclaims((), (), {}, {0: (0, 5)})
    []
    """
    out: list[Misclaim] = []
    for i, dims in held.items():
        size = sizes[i]
        start, stop = found[i].node.start, found[i].node.stop
        for d in dims:
            leaves = [(p, along[p][1]) for p in range(start, stop) if along.get(p, (-1,))[0] == d]
            if not leaves:
                if batch is not None and size[d] != batch:
                    out.append(Misclaim(i, size, d, batch, None))
                continue
            for p, rows in leaves:
                if rows != size[d]:
                    out.append(Misclaim(i, size, d, rows, p))
                    break
    return out


def misclaim_text(
    m: Misclaim, found: Sequence[BatchNode], root: str | None, whose: str, leaf: str = ""
) -> str:
    """``m`` as a problem: the node's path (from ``root``), ``whose`` batch size (``"its"``,
    ``"replica 1's"``), the rows it claims and those found (at ``leaf``, the path of the leaf
    holding them, when there is one)."""
    bn = found[m.at]
    claimed = (
        f"{display_path(bn.node, root)}: {whose} {bn.meta.rule.cls.__qualname__} batch size "
        f"{list(m.size)} holds {m.size[m.dim]} row(s) along dim {m.dim}"
    )
    if m.leaf is None or not leaf:
        return f"{claimed}, but the batch has {m.rows}"
    return f"{claimed}, but its leaf {leaf} holds {m.rows} there"


def _refused(bn: BatchNode, size: Size, exc: BaseException, root: str | None) -> Exception:
    name = bn.meta.rule.cls.__qualname__
    return ShapeMismatchError(
        f"{display_path(bn.node, root)}: the {name} cannot be rebuilt with batch size "
        f"{list(size)} around its leaves ({type(exc).__name__}: {exc})\n"
        f"Hint: a batch node's leaves must keep its batch dims; split them, or combine them "
        f"with cat(), along a batch dim (the default), or take the node whole (broadcast() in "
        f"a scatter; first(), as_list() in a gather)"
    )


# ------------------------------------------------------------------ values laid out by rows


class RowsKind(NamedTuple):
    """How a :class:`Rows` value is split by rows and joined (for one class of value)."""

    name: str
    """What the value is, for messages (``"PackedSequence"``)."""
    rows: Callable[[Any], int]
    """``value -> rows``."""
    split: Callable[[Any, Sequence[int]], list[Any]]
    """``(value, sizes) -> one value per shard`` of those rows, in order."""
    join: Callable[[Sequence[Any]], Any]
    """``values -> one value`` of every value's rows, in order (all on one device)."""
    to: Callable[[Any, torch.device], Any]
    """``(value, device) -> value`` on ``device`` (a new value when it moves: never the
    argument changed)."""
    problem: Callable[[Any], str | None] | None = None
    """``value -> why it cannot be split by rows`` (``None``: it can); absent: always can."""
    batched: str = ""
    """How single rows become one value of this kind (the fix an error suggests for one row
    sent where a batch of them is split: ``"torch_geometric.data.Batch.from_data_list"``)."""
    tensors: (
        Callable[[Any], tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]] | None
    ) = None
    """``value -> (its tensors, a function rebuilding it around others in their place)``: what
    a gradient reaches (``sync_grads``), and what travels detached; ``None``: the tensors
    torch's pytree finds in it (a ``PackedSequence``'s fields, a lazy stack's tensordicts')."""


_KINDS: dict[str, RowsKind] = {}


def rows_kind(kind: RowsKind) -> RowsKind:
    """Register ``kind`` by its name (a :class:`Rows` value pickles as its value and that name,
    so that another process finds the functions it registered itself); returns it."""
    known = _KINDS.get(kind.name)
    if known is not None:
        return known
    _KINDS[kind.name] = kind
    return kind


def _rows_of(value: Any, name: str, bare: bool = False) -> Rows:
    return Rows(value, _KINDS[name], bare)


class Rows:
    """A value laid out by rows its own way (a ``PackedSequence``), with the functions that
    split it by rows and join it.

    It comes in two forms, one behaviour. A registered node holds one as its child (the
    ``PackedSequence`` node, a ``LazyStackedTensorDict`` stacked along dim 0), and its unflatten
    takes the value back out. A leaf whose class is laid out by rows (:func:`rows_class`: a PyG
    graph batch, whose classes are made at run time) is the value itself in the tree:
    :func:`rows_of` holds it ``bare`` while a step works on it, and :attr:`held` gives the tree
    the value itself again. :func:`treegather.scatter` splits either with the batch (its rows
    count in the batch size), and :func:`treegather.gather` joins the replicas' values by
    default (a list of them under ``as_list()``).
    """

    __slots__ = ("bare", "kind", "value")

    def __init__(self, value: Any, kind: RowsKind, bare: bool = False) -> None:
        self.value = value
        self.kind = kind
        self.bare = bare

    def __repr__(self) -> str:
        return f"<{self.kind.name} of {self.kind.rows(self.value)} rows>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rows_of, (self.value, self.kind.name, self.bare))

    @property
    def rows(self) -> int:
        return self.kind.rows(self.value)

    @property
    def held(self) -> Any:
        """What the tree holds in this value's place: the value itself when it is a leaf
        (``bare``), else this wrapper (a registered node's child, which its unflatten takes)."""
        return self.value if self.bare else self

    def problem(self) -> str | None:
        """Why this value cannot be split by rows (``None``: it can)."""
        check = self.kind.problem
        return None if check is None else check(self.value)

    def split(self, sizes: Sequence[int]) -> list[Rows]:
        kind, bare = self.kind, self.bare
        return [Rows(v, kind, bare) for v in kind.split(self.value, sizes)]

    def to(self, device: torch.device) -> Rows:
        return Rows(self.kind.to(self.value, device), self.kind, self.bare)

    def tensors(self) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Rows]]:
        """Its tensors, and a function rebuilding it around others in their place."""
        found, rebuilt = (self.kind.tensors or _tensors_of)(self.value)
        kind, bare = self.kind, self.bare
        return found, lambda tensors: Rows(rebuilt(tensors), kind, bare)

    def requiring_grad(self) -> tuple[int, ...]:
        """Which of its tensors (:meth:`tensors`) require grad."""
        return tuple(j for j, t in enumerate(self.tensors()[0]) if t.requires_grad)

    @property
    def requires_grad(self) -> bool:
        """Whether a tensor of it requires grad."""
        return any(t.requires_grad for t in self.tensors()[0])

    def detached(self) -> Rows:
        """It around its tensors detached (what travels to another process)."""
        found, rebuilt = self.tensors()
        if not any(t.requires_grad for t in found):
            return self
        return rebuilt([t.detach() for t in found])

    @staticmethod
    def join(values: Sequence[Rows], device: torch.device) -> Rows:
        """Every replica's rows, in order, on ``device`` (each moved there first: the
        replicas may live on several devices)."""
        kind = values[0].kind
        joined = kind.join([kind.to(v.value, device) for v in values])
        return Rows(joined, kind, values[0].bare)


# ------------------------------------------------------------ classes laid out by rows

Resolve = Callable[[], type | None]


class _RowsClass(NamedTuple):
    base: Resolve
    kind: RowsKind
    one: Resolve | None


_CLASSES: list[_RowsClass] = []
_NOT_ROWS = frozenset(
    [type(None), bool, int, float, complex, str, bytes, list, tuple, dict, torch.Tensor]
)


def rows_class(base: Resolve, kind: RowsKind, one: Resolve | None = None) -> None:
    """Hold every instance of a subclass of ``base()`` as a value laid out by rows of ``kind``,
    a leaf (:class:`Rows`, ``bare``): for classes made at run time, which cannot be registered
    as nodes one by one (PyG makes ``DataBatch``, ``HeteroDataBatch`` and one batch class per
    ``Data`` subclass as they are first batched). ``base`` returns the class once its library
    is loaded, else ``None`` (nothing can be an instance of it yet, so ``import treegather``
    imports no such library). An instance of a subclass of ``one()`` that is no such value is
    one row of one (a single graph): scatter refuses it, saying ``kind.batched`` makes a batch.
    """
    _CLASSES.append(_RowsClass(base, kind, one))
    _BY_CLASS.clear()


# class -> (kind, whether an instance is one row of that kind), or None: the classes of the
# non-tensor leaves seen, each looked up once. Not a cache: a fact about a live class (whether
# it subclasses another never changes), gone with it.
_BY_CLASS: weakref.WeakKeyDictionary[type, tuple[RowsKind, bool] | None] = (
    weakref.WeakKeyDictionary()
)


def _class_kind(cls: type) -> tuple[RowsKind, bool] | None:
    try:
        return _BY_CLASS[cls]
    except KeyError:
        pass
    except TypeError:  # (a class that cannot be held weakly)
        return None
    found: tuple[RowsKind, bool] | None = None
    for entry in _CLASSES:
        base = entry.base()
        if base is not None and issubclass(cls, base):
            found = (entry.kind, False)
            break
        one = entry.one() if entry.one is not None else None
        if one is not None and issubclass(cls, one):
            found = (entry.kind, True)
    _BY_CLASS[cls] = found  # (a class made before its library loaded subclasses none of it)
    return found


def rows_of(value: Any) -> Rows | None:
    """``value`` as a value laid out by rows: itself when it is a :class:`Rows` (a registered
    node's child), held ``bare`` when its class is laid out by rows (:func:`rows_class`), else
    ``None``. A tensor, a number or a string costs one type check.

    >>> rows_of(1.0) is None, rows_of("text") is None
    (True, True)
    """
    kind = type(value)
    if kind is Rows:
        return value
    if kind in _NOT_ROWS or not _CLASSES:
        return None
    found = _class_kind(kind)
    return None if found is None or found[1] else Rows(value, found[0], True)


def one_row_of(value: Any) -> RowsKind | None:
    """The kind ``value`` is one row of (a single PyG ``Data``, one graph of a graph batch),
    else ``None``."""
    kind = type(value)
    if kind in _NOT_ROWS or kind is Rows or not _CLASSES:
        return None
    found = _class_kind(kind)
    return found[0] if found is not None and found[1] else None


def _tensors_of(value: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors torch's pytree finds in ``value``, and how to put others in their place."""
    leaves, spec = _torch_pytree.tree_flatten(value)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuilt(tensors: list[torch.Tensor]) -> Any:
        new = list(leaves)
        for i, t in zip(at, tensors, strict=True):
            new[i] = t
        return _torch_pytree.tree_unflatten(new, spec)

    return [leaves[i] for i in at], rebuilt


def unwrapped(child: Any) -> Any:
    """A :class:`Rows` child back as its value; a list of them (``as_list()``) as a list."""
    if isinstance(child, Rows):
        return child.value
    if isinstance(child, list):
        return [unwrapped(c) for c in child]
    return child
