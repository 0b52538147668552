"""A Collector's values: joined, checked, sent and put in dataset order.

Each position of an add's plan is per sample (``SAMPLES``: tensors under ``cat()``/``pad(0)``;
``ITEMS``: lists under ``cat_items()``; ``ROWS``: a value laid out by rows its own way, a
``PackedSequence`` or a PyG graph batch, under the default rule) or one value per add
(``PER_ADD``). :func:`join` joins
a column as its rule does (the gather rules themselves when anything is unusual);
:func:`dataset_order` and :func:`placed` put rows in index order, each index once; strings
travel as one UTF-8 tensor (:func:`travelling`, :func:`arrived`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from itertools import chain, compress
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .._caches import FAST_PATHS
from .._compiled.structure import recognise
from .._errors import BatchSizeError, LayoutError, LeafTypeError, TreegatherError
from .._layout import Plan, resolve
from .._rules import JOIN_ROWS, Cat, CatItems, Combining, Pad, Rule, fill_fits
from .._rules.kinds import ordinary
from .._tree import Rows, display_path, format_path, rows_of
from . import pickling
from .exchange import tensor_bytes

__all__ = [
    "CROSS",
    "ITEMS",
    "Opaque",
    "Order",
    "PER_ADD",
    "ROWS",
    "SAMPLES",
    "Texts",
    "arrived",
    "dataset_order",
    "gather_noted",
    "join",
    "moved",
    "placed",
    "plan_of",
    "rows_per_add",
    "rules_of",
    "sendable",
    "travelling",
]

Tensor = torch.Tensor
ROOT = "outputs"


class Opaque:
    """A value that travels whole (one pickled object), not as the leaves of a tree; ``blob``:
    its pickle, when made already."""

    __slots__ = ("blob", "value")

    def __init__(self, value: Any, blob: bytes | None = None) -> None:
        self.value = value
        self.blob = blob

    def __getstate__(self) -> Any:
        return self.blob if self.blob is not None else pickling.dumps(self.value)

    def __setstate__(self, blob: bytes) -> None:
        self.value = pickle.loads(blob)
        self.blob = blob


class Texts(NamedTuple):
    """A list of strings (``str`` exactly) as it travels: their UTF-8 bytes, one tensor (no
    pickling), joined by a separator that no string holds."""

    data: Tensor  # uint8
    items: int  # how many strings


SEP = "\x00"


PROTOCOL = pickle.HIGHEST_PROTOCOL


def travelling(
    value: Any, types: set[type] | None = None, path: str | None = None, per_add: bool = False
) -> Any:
    """A value that travels whole: a list of strings as UTF-8 bytes in a tensor, anything else
    pickled once (now, when ``path`` names it: what does not pickle is an error naming it, and
    the add, for ``per_add`` values). ``types``: the types of its items, when the caller has
    them."""
    if type(value) is list and value:
        if (set(map(type, value)) if types is None else types) == {str}:
            joined = SEP.join(value)
            if joined.count(SEP) == len(value) - 1:  # no string holds the separator
                try:
                    raw = joined.encode()
                except UnicodeEncodeError:  # lone surrogates (os.fsdecode of odd bytes): pickled
                    return Opaque(value)
                return Texts(torch.frombuffer(bytearray(raw), dtype=torch.uint8), len(value))
    if path is None:
        return Opaque(value)
    try:
        return Opaque(value, pickling.dumps(value))
    except Exception as exc:
        found, where = exc, ""
        for a, item in enumerate(value if type(value) is list and per_add else ()):
            try:  # (a value per add: which add's)
                pickling.dumps(item)
            except Exception as inner:
                found, where, value = inner, f" (add #{a})", item
                break
        raise LeafTypeError(
            f"{path}{where}: {type(value).__name__} cannot travel between ranks "
            f"({type(found).__name__}: {found})\nHint: non-tensor outputs must pickle "
            "(strings, numbers, lists of them); leave the others out of what you add"
        ) from None


def sendable(t: Tensor, node: Any) -> Any:
    """A per-sample tensor as it travels: its bytes (a dense tensor), else pickled now (a
    sparse, nested or quantized tensor, a subclass), so that one that cannot be is an error
    naming its leaf."""
    if pickling.plain(t):
        return t
    return travelling(t, None, display_path(node, ROOT))


def arrived(value: Any) -> Any:
    """What :func:`travelling` sent, back as it was."""
    if isinstance(value, Opaque):
        return value.value
    if isinstance(value, Texts):
        return tensor_bytes(value.data).decode().split(SEP) if value.items else []
    return value


# ------------------------------------------------------------------------------- helpers

# What a plan position is: concatenated per sample, or one value per add.
SAMPLES, ITEMS, PER_ADD, ROWS = 0, 1, 2, 3
CROSS = {
    SAMPLES: lambda rule: rule if rule is not None else Cat(0),
    ITEMS: lambda rule: CatItems(),
    PER_ADD: lambda rule: CatItems(),  # the per-add lists of every rank, one after the other
    ROWS: lambda rule: JOIN_ROWS,
}


def rules_of(plan: Plan) -> list[Rule | None]:
    return [g[2] if g is not None else r for r, g in zip(plan.rules, plan.groups)]


def plan_of(tree: Any, layout: Any) -> tuple[Plan, list[int], Any]:
    """The gather plan of one add's structure (kept per structure, as gather keeps it), what
    each of its positions is, and the structure."""
    leaves, structure, spec = recognise(tree)
    found = None if structure is None else structure.plan(layout, "gather", 0, ROOT, leaves)
    plan = found[0] if found is not None else resolve(spec, layout, "gather", 0, ROOT)
    values = leaves if plan.up_spec is spec else plan.up_spec.flatten_up_to(tree)
    kinds = []
    for p, (rule, value) in enumerate(zip(rules_of(plan), values)):
        if isinstance(rule, CatItems):
            kinds.append(ITEMS)
        elif (rule is None or (isinstance(rule, Cat) and rule.dim == 0)) and rows_of(
            value
        ) is not None:  # (cat() joins it by rows, as the default does)
            kinds.append(ROWS)  # (split into its rows to be put in order: placed)
        elif (
            isinstance(value, Tensor)
            and _dims(value) > 0
            and (rule is None or (isinstance(rule, (Cat, Pad)) and _batch_dim(rule.dim, value)))
        ):
            if isinstance(rule, Pad) and rule.lengths:
                raise LayoutError(
                    f"{display_path(plan.node_of(p), ROOT)}: {rule.describe()} in a Collector: "
                    "its lengths would be each add's, and the rows are put in dataset order, "
                    "not in adds\nHint: use pad(0), and add each row's lengths as a per-sample "
                    "leaf (e.g. {'lengths': torch.tensor([len(s) for s in batch])} under cat())"
                )
            kinds.append(SAMPLES)  # joined along the batch dim (cat(-2) of a 2-D leaf too)
        else:
            if isinstance(rule, (Cat, Pad)) and isinstance(value, Tensor) and _dims(value):
                if not -value.dim() <= rule.dim < value.dim():  # gather's error, as it says it
                    from .._gather import gather

                    gather([tree], value.device, layout)
            kinds.append(PER_ADD)
    _lists_need_a_rule(plan, kinds, values)
    return plan, kinds, spec


def _dims(value: Tensor) -> int:
    """``value``'s number of dims (0 for an uninitialized parameter, which has none yet)."""
    return 0 if isinstance(value, UninitializedTensorMixin) else value.dim()


def _batch_dim(dim: int, value: Tensor) -> bool:
    """Whether ``dim`` is ``value``'s first dim, as written (``-2`` of a 2-D tensor too)."""
    return -value.dim() <= dim < value.dim() and dim % value.dim() == 0


def _lists_need_a_rule(plan: Plan, kinds: list[int], values: list[Any]) -> None:
    """A list (or tuple) of non-tensors that the layout gives no rule: per sample or per add?
    (Taken item by item, its items would be joined position by position over the adds.)"""
    lists: dict[str, int] = {}
    for p, (kind, rule, value) in enumerate(zip(kinds, plan.rules, values)):
        if kind == PER_ADD and rule is None and plan.groups[p] is None:
            node = plan.node_of(p)
            if node.path and node.path[-1][1] == "index" and not isinstance(value, Tensor):
                where = format_path(ROOT, node.path[:-1])
                lists[where] = lists.get(where, 0) + 1
    if lists:
        where, n = next(iter(lists.items()))
        raise LayoutError(
            f"{where}: a list of {n} non-tensor item(s) in each add, with no rule: per sample or "
            "per add? tg.cat_items() if it holds one item per row (put in dataset order with "
            "the rows), tg.as_list() if it is one value per add (the result lists every add's)"
            + (f" (and {len(lists) - 1} more such list(s))" if len(lists) > 1 else "")
            + "\nHint: name it in the layout, e.g. tg.by_path({'names': tg.cat_items()}) for "
            "outputs['names']"
        )


def rows_per_add(columns: list[tuple[Any, ...]], plan: Plan, kinds: list[int]) -> list[int]:
    """Each add's rows, from its per-sample leaves (``columns``: each position's values, one
    per add), which must agree within the add."""
    if SAMPLES not in kinds and ITEMS not in kinds and ROWS not in kinds:
        raise BatchSizeError(
            "the Collector found no per-sample leaf in the outputs (a tensor with the batch dim "
            "first under cat(), or a per-sample list under cat_items()): it cannot match rows "
            "to samples"
        )
    sample = [p for p, k in enumerate(kinds) if k != PER_ADD]
    try:  # every per-sample value's rows, one C pass per position; equal: the rows
        lengths = [
            [v.size(0) for v in columns[p]]  # (a nested tensor has no shape, but a size(0))
            if type(columns[p][0]) is Tensor
            else list(map(_count, columns[p]))
            if kinds[p] == ROWS
            else list(map(len, columns[p]))
            for p in sample
        ]
        if all(n == lengths[0] for n in lengths[1:]) and all(
            type(columns[p][0]) in (Tensor, list, tuple) or kinds[p] == ROWS for p in sample
        ):
            return lengths[0]
    except (TypeError, IndexError, AttributeError):  # a 0-dim tensor, no len: named below
        pass
    rows: list[int] = []
    problems: list[str] = []
    for a, row in enumerate(zip(*columns)):
        counts = [_count(v) for v in (row[p] for p in sample)]
        if len(set(counts)) == 1 and counts[0] >= 0:
            rows.append(counts[0])
            continue
        seen: dict[int, list[int]] = {}
        for p, n in zip(sample, counts):
            seen.setdefault(n, []).append(p)
        parts = "; ".join(
            f"{'no rows' if n < 0 else f'{n} row(s)'} at "
            + ", ".join(display_path(plan.node_of(p), ROOT) for p in ps[:3])
            for n, ps in seen.items()
        )
        problems.append(f"add #{a}: per-sample leaves disagree on the rows: {parts}")
    if problems:
        shown = problems[:10] + [f"... and {len(problems) - 10} more"] * (len(problems) > 10)
        raise BatchSizeError(
            "\n".join(shown)
            + "\nHint: per-sample leaves (cat(), pad(0), cat_items()) have one row per sample; "
            "give leaves that are not per sample another rule (stack(), sum(), as_list(), ...)"
        )
    return rows


def _count(value: Any) -> int:
    """The rows of a per-sample value (``-1``: it has none)."""
    if isinstance(value, Tensor):  # (a nested tensor has no shape, but a size(0))
        return value.size(0) if _dims(value) else -1
    if isinstance(value, (list, tuple)):
        return len(value)
    rows = rows_of(value)
    try:
        return -1 if rows is None else rows.rows
    except Exception:  # (its kind cannot read its rows: the join names why)
        return -1


def gather_noted(
    values: list[Any],
    device: torch.device,
    layout: Any,
    sizes: list[int] | None,
    replica: str,
    names: Sequence[Any] | None = None,
) -> Any:
    """:func:`treegather.gather` of the adds' (or ranks') values; its errors say what a
    replica is here."""
    from .._gather import gather

    try:
        return gather(values, device, layout, sizes=sizes)
    except TreegatherError as exc:
        shown = ", ".join(
            f"replica {i} is {replica.format(i=i, r=(names or [])[i] if names else i)}"
            for i in range(min(len(values), 4))
        )
        raise type(exc)(f"{exc}\n({shown}{', ...' if len(values) > 4 else ''})") from None


def join(
    columns: list[tuple[Any, ...]],
    kinds: list[int],
    rules: list[Rule | None],
    device: torch.device,
    reference: Callable[[], list[Any]],
    *,
    per_add: bool = False,
    types: dict[int, set[type]] | None = None,
    plain: Sequence[bool] = (),
    parts: bool = False,
) -> list[Any]:
    """Each position's values (one per add, or one per rank) joined as its rule joins them:
    tensors concatenated (``cat``) or padded (``pad``), lists one after the other (per-add
    values: ``per_add``, a list of the adds'; else every rank's lists one after the other).
    Anything unusual (a dtype, shape or device that differs, a value of another kind, lists
    and tuples mixed, tensors among list items) takes ``reference`` instead,
    :func:`treegather.gather` with the same rules, which gives the same result or names the
    problem; so does every call under :func:`treegather._caches.reference_only`. ``types``
    receives the item types of each list position it joined; ``plain``: the positions known to
    hold strings only; ``parts``: per-sample positions left as their parts (checked), for
    :func:`placed` to join in the result's order.
    """
    out: list[Any] = []
    with torch.no_grad():  # results are detached (the definition's too)
        if not FAST_PATHS.on:  # the one fast-path switch: the definition only
            return reference()
        for p, (kind, rule, col) in enumerate(zip(kinds, rules, columns)):
            if kind == SAMPLES and not parts and len(col) > 1 and not isinstance(rule, Pad):
                joined = _catted(col, device)
                if joined is None:
                    return reference()
                out.append(joined)
            elif kind == SAMPLES:
                if not alike(col, device, same_tail=not isinstance(rule, Pad)):
                    return reference()
                if isinstance(rule, Pad) and not fill_fits(rule.fill, col[0].dtype):
                    return reference()  # (which names the leaf)
                if isinstance(rule, Pad):
                    padded = rule.combine(col, Combining(device, True, None, 0))
                    out.append([padded] if parts else padded)
                else:
                    out.append(col if parts else torch.cat(col) if len(col) > 1 else col[0])
            elif kind == PER_ADD:
                out.append(list(col) if per_add else list(chain.from_iterable(col)))
            elif kind == ROWS:
                ctx = Combining(device, True, None, 0)
                if JOIN_ROWS.problem(col, ctx) is not None:
                    return reference()  # (which names it)
                out.append(col if parts else JOIN_ROWS.combine(col, ctx))
            else:
                if set(map(type, col)) not in ({list}, {tuple}):
                    return reference()
                known = p < len(plain) and plain[p]
                items = [] if known and parts else list(chain.from_iterable(col))
                # (strings only, the usual case, told by one count: faster than a set of types)
                strings = known or (bool(items) and list(map(type, items)).count(str) == len(items))
                found: set[type] = {str} if strings else set(map(type, items))
                if Tensor in found:  # tensors among the items: moved there
                    return reference()
                if types is not None:
                    types[p] = found
                out.append(col if parts else tuple(items) if type(col[0]) is tuple else items)
    return out


def alike(col: tuple[Any, ...], device: torch.device, *, same_tail: bool) -> bool:
    """Tensors of >= 1 dim, of one dtype, on ``device`` (and of one shape past the first dim):
    a few C passes over the column."""
    if not _tensors(col, device) or len(set(map(DEVICE, col))) != 1:
        return False
    shapes = set(map(SHAPE, col))  # a few distinct ones: the rows differ, the rest should not
    if same_tail:
        return len({shape[1:] for shape in shapes}) == 1
    return len(set(map(len, shapes))) == 1


def _catted(col: tuple[Any, ...], device: torch.device) -> Tensor | None:
    """``torch.cat(col)`` where :func:`alike` holds, else ``None``: what ``cat`` checks itself
    (one device, one shape past the first dim, at one number of dims) left to it."""
    if not _tensors(col, device) or len({*map(NDIM, col)}) != 1:
        return None  # (one number of dims: cat takes a 1-D empty tensor beside any shape)
    try:
        return torch.cat(col)
    except RuntimeError:
        return None


def _tensors(col: tuple[Any, ...], device: torch.device) -> bool:
    """Tensors only, dense ones of a usual dtype, of one dtype, the first of >= 1 dim and on
    ``device`` (any other kind: the gather rules, which say what torch cannot do)."""
    first = col[0]
    if type(first) is not Tensor or not ordinary(first):
        return False
    if first.dim() == 0 or first.device != device:
        return False
    if list(map(type, col)).count(Tensor) != len(col) or len(set(map(DTYPE, col))) != 1:
        return False
    return set(map(LAYOUT, col)) == _STRIDED and not any(map(NESTED, col))


def _placed_rows(values: Sequence[Any], order: Order, device: torch.device) -> Any:
    """:func:`placed` of values laid out by rows: split into single rows, placed, joined."""
    with torch.no_grad():
        parts = [rows.split([1] * rows.rows) for rows in map(_rows, values)]
        ordered = placed(parts, order) if order.kept.numel() else []
        joined = Rows.join(ordered, device) if ordered else _rows(values[0])
        return joined.to(device).held


def _rows(value: Any) -> Rows:
    rows = rows_of(value)
    assert rows is not None  # (a position of one kind laid out by rows: checked by join)
    return rows


DEFAULT = torch.device("cpu")
DTYPE = attrgetter("dtype")
LAYOUT = attrgetter("layout")
NESTED = attrgetter("is_nested")
_STRIDED = {torch.strided}
NDIM = attrgetter("ndim")
REQUIRES_GRAD = attrgetter("requires_grad")
DEVICE = attrgetter("device")
SHAPE = attrgetter("shape")


class Order(NamedTuple):
    """Where the ranks' rows go: each dataset index once (the first seen), in index order."""

    kept: Tensor  # the result's dataset indices, in order
    perm: Tensor | None  # positions in the rows one after the other; None: as they are (or:)
    dealt: tuple[tuple[int, int], ...] | None = None  # per part: where it starts, rows it keeps

    def positions(self) -> Tensor | None:
        """``perm``, or where the dealt rows are in the rows one after the other (or ``None``)."""
        if self.dealt is None:
            return self.perm
        j, w = torch.arange(self.kept.numel()), len(self.dealt)
        return torch.tensor([start for start, _ in self.dealt])[j % w] + j // w

    def destinations(self, lengths: Sequence[int]) -> list[Tensor]:
        """For parts of ``lengths`` rows, where each row goes in the result (``-1``: it is not
        kept, another copy of its index is)."""
        dest = torch.full((sum(lengths),), -1, dtype=torch.int64)
        perm = self.positions()
        n = self.kept.numel()
        dest.index_copy_(0, torch.arange(n) if perm is None else perm, torch.arange(n))
        return list(dest.split(list(lengths)))


def dataset_order(parts: Sequence[Tensor]) -> Order:
    """The order of the rows of ``parts`` (int64 dataset indices, one part per rank), each
    index once (the first seen), in index order.

    >>> o = dataset_order([torch.tensor([0, 2, 4]), torch.tensor([1, 3, 0])])  # padded
    >>> o.kept.tolist(), o.positions().tolist(), o.dealt
    ([0, 1, 2, 3, 4], [0, 3, 1, 4, 2], ((0, 3), (3, 2)))
    """
    idx = torch.cat(list(parts)) if len(parts) != 1 else parts[0].clone()
    n = idx.numel()
    if n < 2:
        return Order(idx, None)
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo == 0 and (dealt := _dealt(parts, hi + 1)) is not None:
        return Order(torch.arange(hi + 1), None, dealt)
    if bool((idx[1:] > idx[:-1]).all()):  # in order already (the ranks' blocks one after another)
        return Order(idx, None)
    if lo >= 0 and hi < 2 * n + 1024:  # dense indices: one scatter, no sort
        first = torch.full((hi + 1,), n, dtype=torch.int64)
        first.scatter_reduce_(0, idx, torch.arange(n), "amin")
        kept = (first < n).nonzero().squeeze(1)
        return Order(kept, first.index_select(0, kept))
    ordered, order = torch.sort(idx, stable=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return Order(ordered[keep], order[keep])


def _dealt(parts: Sequence[Tensor], n: int) -> tuple[tuple[int, int], ...] | None:
    """Each part's start and rows kept when ``0`` to ``n - 1`` were dealt to the parts in turn
    (part ``r``'s first rows ``r``, ``r + w``, ...: ``DistributedSampler`` without shuffling)
    and every other row repeats an index first seen before it (padding); else ``None``."""
    w, start, out = len(parts), 0, []
    for r, part in enumerate(parts):
        k = (n - r + w - 1) // w
        if part.numel() < k or not torch.equal(part[:k], torch.arange(r, r + w * k, w)):
            return None
        if part.numel() > k and bool((part[k:] % w > r).any()):  # first seen in a later part
            return None
        out.append((start, k))
        start += part.numel()
    return tuple(out)


def placed(values: Sequence[Any], order: Order, device: torch.device | None = None) -> Any:
    """One position's values of every part (tensors of one dtype and trailing shape, lists of
    non-tensors, or values laid out by rows of one kind, joined on ``device``), one after the
    other, in the result's order. Tensors are new ones (never views of a part) and lists new
    lists; each part's rows are copied straight to their places in the result (no copy of every
    part's rows side by side first: the memory of one result).

    A value laid out by rows its own way (a ``PackedSequence``, a PyG graph batch) is put in
    order by its own functions: each part split into single rows, the rows placed as list
    items are, joined again (detached, as every result is). Tensors of another kind than dense
    ones of the usual dtypes (sparse, quantized, float8, a subclass) are put in order by
    ``index_select`` (which torch may lack for them: it raises).
    """
    first, n = values[0], order.kept.numel()
    if rows_of(first) is not None:
        return _placed_rows(values, order, device or DEFAULT)
    if isinstance(first, Tensor) and (type(first) is not Tensor or not ordinary(first)):
        rows = torch.cat(list(values)) if len(values) > 1 else first
        perm = order.positions()
        return rows.index_select(0, perm) if perm is not None else rows.clone()
    if order.dealt is not None and len(values) == len(order.dealt):  # slices, no index per row
        w = len(values)
        joined: Any = (
            first.new_empty((n, *first.shape[1:])) if type(first) is Tensor else [None] * n
        )
        for r, (v, (_, k)) in enumerate(zip(values, order.dealt)):
            joined[r::w] = v if k == len(v) else v[:k]
        return joined if type(first) is not tuple else tuple(joined)
    perm = order.positions()
    if type(first) is Tensor:
        if len(values) == 1:
            return first.index_select(0, perm) if perm is not None else first.clone()
        if perm is None:  # (in order: each part after the one before)
            return torch.cat(list(values))
        out = first.new_empty((n, *first.shape[1:]))
        for part, dest in zip(values, order.destinations(list(map(len, values)))):
            kept = int((dest >= 0).sum())
            if kept == len(part):
                out.index_copy_(0, dest, part)
            elif bool((dest[:kept] >= 0).all()):  # (the rows it keeps first: padding after)
                out.index_copy_(0, dest[:kept], part[:kept])
            else:
                keep = dest >= 0
                out.index_copy_(0, dest[keep], part[keep])
        return out
    joined = list(chain.from_iterable(values))
    if perm is not None:
        picked = perm.tolist()
        joined = list(itemgetter(*picked)(joined)) if len(picked) > 1 else [joined[picked[0]]]
    return tuple(joined) if type(first) is tuple else joined


def moved(tree: Any, device: torch.device | None) -> Any:
    """``tree`` with its tensors detached (and on ``device``): the leaves read as the compiled
    layer reads a structure it has seen (one generated call), only the tensors that require
    grad or sit elsewhere touched, the tree rebuilt the same way (``tree`` itself when none
    does)."""
    if type(tree) is dict and _settled(tree, device):
        return tree
    leaves, st, spec = recognise(tree, ROOT)
    tensors = {t for t in set(map(type, leaves)) if issubclass(t, Tensor)}  # (a few types)
    if not tensors:
        return tree
    found = list(compress(leaves, map(tensors.__contains__, map(type, leaves))))  # (C passes)
    grads = any(map(REQUIRES_GRAD, found))
    if not grads and (device is None or set(map(DEVICE, found)) == {device}):
        return tree  # nothing to detach or move: kept as given (as an add with no device is)
    at = [i for i, x in enumerate(leaves) if type(x) in tensors]
    for i in at:
        x = leaves[i]
        if x.requires_grad and not isinstance(x, UninitializedTensorMixin):  # (nothing to detach)
            x = x.detach()
        leaves[i] = x if device is None or x.device == device else x.to(device)
    rebuild = st.rebuild if st is not None and spec is st.spec else spec.unflatten
    return rebuild(leaves)


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})


def _settled(outputs: dict[Any, Any], device: torch.device | None) -> bool:
    """Whether a dict of outputs (tensors, lists of plain values, plain values: what most
    evaluations return) has no tensor to detach or move, told without flattening it."""
    for value in outputs.values():
        kind = type(value)
        if kind is Tensor:
            if value.requires_grad or (device is not None and value.device != device):
                return False
        elif kind is list or kind is tuple:
            if not set(map(type, value)) <= _PLAIN:
                return False
        elif kind not in _PLAIN:
            return False
    return True
