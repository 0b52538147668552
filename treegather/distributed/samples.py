"""A Collector's per-sample values: how the adds' (and then the ranks') values are joined,
checked, put in dataset order, and sent.

Each position of one add's plan is per sample (``SAMPLES``: tensors under ``cat()`` or
``pad(0)``; ``ITEMS``: lists under ``cat_items()``) or one value per add (``PER_ADD``).
:func:`join` joins a column of values as its rule does, taking the gather rules themselves
(:func:`treegather.gather`) whenever anything is unusual; :func:`dataset_order` gives the
positions that put rows in index order, each index once; lists of strings travel as one UTF-8
tensor (:func:`travelling`, :func:`arrived`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple

import torch

from .._caches import FAST_PATHS
from .._compiled.structure import recognise
from .._errors import BatchSizeError, TreegatherError
from .._layout import Plan, resolve
from .._rules import Cat, CatItems, Combining, Pad, Rule
from .._tree import display_path
from .wire import tensor_bytes

__all__ = [
    "CROSS",
    "ITEMS",
    "Opaque",
    "PER_ADD",
    "SAMPLES",
    "Texts",
    "arrived",
    "dataset_order",
    "gather_noted",
    "is_loader",
    "join",
    "moved",
    "plan_of",
    "read_order",
    "rows_per_add",
    "rules_of",
    "travelling",
]

Tensor = torch.Tensor
ROOT = "outputs"


class Opaque:
    """A value that travels whole (one pickled object), not as the leaves of a tree."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getstate__(self) -> Any:
        return self.value

    def __setstate__(self, value: Any) -> None:
        self.value = value


class Texts(NamedTuple):
    """A list of strings as it travels: their UTF-8 bytes, one tensor (no pickling), with the
    separator that no string holds."""

    data: Tensor  # uint8
    items: int  # how many strings


SEP = "\x00"


def travelling(value: Any) -> Any:
    """A list that travels whole: strings as bytes in a tensor, anything else pickled once."""
    if type(value) is list and value and set(map(type, value)) == {str}:
        joined = SEP.join(value)
        if joined.count(SEP) == len(value) - 1:  # no string holds the separator
            data = torch.frombuffer(bytearray(joined.encode()), dtype=torch.uint8)
            return Texts(data, len(value))
    return Opaque(value)


def arrived(value: Any) -> Any:
    """What :func:`travelling` sent, back as it was."""
    if isinstance(value, Opaque):
        return value.value
    if isinstance(value, Texts):
        return tensor_bytes(value.data).decode().split(SEP) if value.items else []
    return value


# ------------------------------------------------------------------------------- helpers

# What a plan position is: concatenated per sample, or one value per add.
SAMPLES, ITEMS, PER_ADD = 0, 1, 2
CROSS = {
    SAMPLES: lambda rule: rule if rule is not None else Cat(0),
    ITEMS: lambda rule: CatItems(),
    PER_ADD: lambda rule: CatItems(),  # the per-add lists of every rank, one after the other
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
    for rule, value in zip(rules_of(plan), values):
        if isinstance(rule, CatItems):
            kinds.append(ITEMS)
        elif (
            (rule is None or (isinstance(rule, (Cat, Pad)) and rule.dim == 0))
            and isinstance(value, Tensor)
            and value.dim() > 0
        ):
            kinds.append(SAMPLES)
        else:
            kinds.append(PER_ADD)
    return plan, kinds, spec


def rows_per_add(values: list[list[Any]], plan: Plan, kinds: list[int]) -> list[int]:
    """Each add's rows, from its per-sample leaves (which must agree within the add)."""
    if SAMPLES not in kinds and ITEMS not in kinds:
        raise BatchSizeError(
            "the Collector found no per-sample leaf in the outputs (a tensor with the batch dim "
            "first under cat(), or a per-sample list under cat_items()): it cannot match rows "
            "to samples"
        )
    sample = [p for p, k in enumerate(kinds) if k != PER_ADD]
    try:  # every per-sample value's len, one C pass per position; equal: the rows
        lengths = [list(map(len, (row[p] for row in values))) for p in sample]
        if all(n == lengths[0] for n in lengths[1:]) and all(
            type(row[p]) is Tensor or type(row[p]) in (list, tuple)
            for row in values[:1]
            for p in sample
        ):
            return lengths[0]
    except TypeError:  # a 0-dim tensor, a value with no len: named below
        pass
    rows: list[int] = []
    problems: list[str] = []
    for a, row in enumerate(values):
        counts = [count(row[p]) for p in sample]
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
        shown = problems[:10] + (
            [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
        )
        raise BatchSizeError(
            "\n".join(shown)
            + "\nHint: per-sample leaves (cat(), pad(0), cat_items()) have one row per sample; "
            "give leaves that are not per sample another rule (stack(), sum(), as_list(), ...)"
        )
    return rows


def count(value: Any) -> int:
    """Rows of a per-sample value (-1: it has none)."""
    if isinstance(value, Tensor):
        return value.shape[0] if value.dim() > 0 else -1
    return len(value) if isinstance(value, (list, tuple)) else -1


def gather_noted(
    values: list[Any],
    device: torch.device,
    layout: Any,
    sizes: list[int] | None,
    replica: str,
    names: list[int] | None = None,
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
) -> list[Any]:
    """Each position's values (one per add, or one per rank) joined as its rule joins them:
    tensors concatenated (``cat``) or padded (``pad``), lists one after the other. Anything
    unusual (a dtype, shape or device that differs, a value of another kind, tensors among
    list items) takes ``reference`` instead, :func:`treegather.gather` with the same rules,
    which gives the same result or names the problem; so does every call under
    :func:`treegather._caches.reference_only`.
    """
    if not FAST_PATHS.on:  # the one fast-path switch: the definition only
        return reference()
    out: list[Any] = []
    with torch.no_grad():  # results are detached
        for kind, rule, col in zip(kinds, rules, columns):
            if kind == SAMPLES:
                if not alike(col, device, same_tail=not isinstance(rule, Pad)):
                    return reference()
                if isinstance(rule, Pad):
                    out.append(rule.combine(col, Combining(device, True, None, 0)))
                else:
                    out.append(torch.cat(col) if len(col) > 1 else col[0])
            elif kind == PER_ADD and per_add:
                out.append(list(col))
            else:
                if not all(type(v) in (list, tuple) for v in col):
                    return reference()
                items = list(chain.from_iterable(col))
                if Tensor in set(map(type, items)):  # tensors among the items: moved there
                    return reference()
                out.append(tuple(items) if type(col[0]) is tuple else items)
    return out


def alike(col: tuple[Any, ...], device: torch.device, *, same_tail: bool) -> bool:
    """Tensors of >= 1 dim, of one dtype, on ``device`` (and of one shape past the first dim):
    a few C passes over the column."""
    first = col[0]
    if type(first) is not Tensor or first.dim() == 0 or first.device != device:
        return False
    if list(map(type, col)).count(Tensor) != len(col):
        return False
    if len(set(map(DTYPE, col))) != 1 or len(set(map(DEVICE, col))) != 1:
        return False
    if same_tail:
        return len({shape[1:] for shape in map(SHAPE, col)}) == 1
    return len(set(map(Tensor.dim, col))) == 1


DTYPE = attrgetter("dtype")
DEVICE = attrgetter("device")
SHAPE = attrgetter("shape")


def dataset_order(idx: Tensor) -> tuple[Tensor | None, Tensor]:
    """Positions that put ``idx`` in order, each index once (the first seen), and the result."""
    if idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):
        return None, idx
    ordered, perm = torch.sort(idx, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return perm[first], ordered[first]


def moved(tree: Any, device: torch.device | None) -> Any:
    """``tree`` with its tensors detached (and on ``device``): the leaves read as the compiled
    layer reads a structure it has seen (one generated call), only the tensors that require
    grad or sit elsewhere touched, the tree rebuilt the same way (``tree`` itself when none
    does)."""
    leaves, st, spec = recognise(tree, ROOT)
    types = list(map(type, leaves))
    tensors = {t for t in set(types) if issubclass(t, Tensor)}  # (a few distinct types)
    at = [i for i, t in enumerate(types) if t in tensors]
    if not any(
        leaves[i].requires_grad or (device is not None and leaves[i].device != device) for i in at
    ):
        return tree  # nothing to detach or move: kept as given (as an add with no device is)
    for i in at:
        x = leaves[i]
        x = x.detach() if x.requires_grad else x
        leaves[i] = x if device is None or x.device == device else x.to(device)
    rebuild = st.rebuild if st is not None and spec is st.spec else spec.unflatten
    return rebuild(leaves)


def is_loader(obj: Any) -> bool:
    loader = getattr(torch.utils.data, "DataLoader", None)
    return loader is not None and isinstance(obj, loader)


def read_order(sampler: Iterable[Any]) -> Tensor:
    """This epoch's indices of ``sampler`` (a batch sampler's batches flattened), as int64."""
    items = list(sampler)
    if items and isinstance(items[0], (list, tuple)):
        items = [int(i) for batch in items for i in batch]
    return torch.tensor(items, dtype=torch.int64)
