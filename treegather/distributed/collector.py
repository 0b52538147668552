"""Collector: an evaluation's outputs, collected on each rank and exchanged once.

A DDP evaluation loop sees each rank's samples in the order its sampler yields them, and
``DistributedSampler`` pads the dataset so that every rank gets as many samples (the first
samples again) and interleaves the ranks. :class:`Collector` matches the rows of every
:meth:`~Collector.add` to the indices the sampler yields for this rank, keeps everything local
until :meth:`~Collector.all_gather` (or :meth:`~Collector.gather`), and then makes one exchange
of the existing machinery: every dataset sample exactly once, in index order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

import torch

from .. import _errors
from .._caches import FAST_PATHS
from .._compiled.structure import recognise
from .._devices import DeviceLike, as_device
from .._errors import BatchSizeError, StateError, StructureMismatchError, TreegatherError
from .._layout import Plan, resolve
from .._rules import AsList, Cat, CatItems, Combining, Pad, Rule
from .._tree import display_path
from . import protocol

__all__ = ["Collector"]

Tensor = torch.Tensor
ROOT = "outputs"


class _Problem(NamedTuple):
    """What a rank found wrong with its own adds: raised on every rank after the exchange."""

    error: str  # the error class's name
    message: str


_ERRORS: dict[str, type[TreegatherError]] = {
    cls.__name__: cls
    for cls in vars(_errors).values()
    if isinstance(cls, type) and issubclass(cls, TreegatherError)
}


class Collector:
    """An evaluation's outputs, collected locally and exchanged once, each sample once, in order.

    >>> import torch, treegather.distributed as tgd
    >>> col = tgd.Collector()                      # no process group: one process
    >>> col.add({"logits": torch.ones(2, 3), "ids": torch.tensor([7, 9])}, indices=[3, 1])
    >>> col.add({"logits": torch.zeros(1, 3), "ids": torch.tensor([8])}, indices=[2])
    >>> out = col.all_gather()
    >>> out["ids"], col.indices
    (tensor([9, 8, 7]), tensor([1, 2, 3]))

    Give it the sampler the ``DataLoader`` uses (``DistributedSampler`` or any sampler of
    dataset indices; a ``DataLoader`` itself means its sampler), call :meth:`add` with each
    batch's outputs (no communication: per-sample leaves have the batch dim first), then
    :meth:`all_gather` (every rank gets the result) or :meth:`gather` (``dst`` gets it, the
    others ``None``):

    .. code-block:: python

        sampler.set_epoch(epoch)                  # first: the Collector reads this epoch's order
        col = tgd.Collector(sampler)
        for batch in loader:
            col.add(model(batch["x"]))
        result = col.all_gather({"names": tg.cat_items()})

    The rows of every add are matched to the next indices the sampler yields for this rank,
    read once, at the first add after the Collector is made or :meth:`reset` (so call
    ``set_epoch`` before the loop, as the ``DataLoader`` needs it too). A sampler whose order is
    not reproducible (a ``RandomSampler`` without a seeded generator) needs
    ``add(outputs, indices=...)``, which also works with no sampler. Samples seen twice (the
    padding ``DistributedSampler`` adds) are kept once, the first rank's, and the result is in
    dataset index order (:attr:`indices` says which indices it holds: with ``drop_last`` on the
    sampler or the loader, the samples that were seen).

    Which leaves are per sample is the layout's to say, as in :func:`treegather.gather`:
    tensors of one or more dims under the default rule (``cat()``), ``cat(0)`` or ``pad(0)``
    are concatenated per sample, per-sample lists under ``cat_items()``; every other leaf (a
    0-dim batch loss, ``stack()``, ``mean()``, ``as_list()``, a custom rule) is one value per
    add, combined by its rule over every add of every rank (``mean()`` weighted by the adds'
    rows). Such values are per batch, so the padding duplicates are inside them; per-sample
    values are the exact way.

    Errors in what was added (rows that do not match the sampler's remaining indices,
    per-sample leaves with other row counts in one add, adds of different structure) are found
    at the exchange and raised on every rank, naming the path and the add (never a hang).

    Args:
        sampler: the sampler (or ``DataLoader``) whose indices this rank's adds follow;
            ``None`` when every add passes ``indices=``.
        device: where added outputs are kept (e.g. ``"cpu"`` for a long evaluation on the
            GPU); default: where they are.
        group: the ``torch.distributed`` process group; ``None`` for the default group, or one
            process when none is initialised.
    """

    def __init__(
        self,
        sampler: Iterable[Any] | None = None,
        *,
        device: DeviceLike | None = None,
        group: Any = None,
    ) -> None:
        self._sampler = getattr(sampler, "sampler", sampler) if _is_loader(sampler) else sampler
        self._device = None if device is None else as_device(device)
        self._group = group
        self._adds: list[tuple[Any, Sequence[int] | Tensor | None]] = []
        self._order: Tensor | None = None  # this epoch's indices of the sampler
        self._done = False
        self.indices: Tensor | None = None
        """The dataset indices of the last exchange's result, in order (``None`` before one)."""

    def __len__(self) -> int:
        """How many adds this rank has collected since the last :meth:`reset`."""
        return len(self._adds)

    def reset(self) -> None:
        """Forget every add (and the sampler's order): ready for the next epoch."""
        self._adds = []
        self._order = None
        self._done = False
        self.indices = None

    def add(self, outputs: Any, indices: Sequence[int] | Tensor | None = None) -> None:
        """Keep one batch's ``outputs`` (no communication).

        The rows of the per-sample leaves are matched to ``indices`` (this batch's dataset
        indices) or, without them, to the next indices of the sampler. With the Collector's
        ``device``, tensors are moved there (detached); without it they are kept as they are
        (detached when grad mode is on: evaluate under ``torch.no_grad()`` and nothing is
        copied or flattened here).

        Raises:
            StateError: the Collector was exchanged already; call :meth:`reset` first.
        """
        if self._done:
            raise StateError(
                "Collector.add after all_gather()/gather(): the outputs collected so far were "
                "exchanged; call reset() to start the next evaluation"
            )
        if self._device is not None:
            outputs = _moved(outputs, self._device)
        elif torch.is_grad_enabled():
            outputs = _moved(outputs, None)
        if indices is None and self._order is None and self._sampler is not None:
            self._order = _read_order(self._sampler)
        self._adds.append((outputs, indices))

    def all_gather(self, layout: Any = None) -> Any:
        """Every rank's adds, combined on every rank: each sample once, in index order.

        ``layout`` is a layout of one add's outputs, as for :func:`treegather.gather`.
        One :func:`treegather.distributed.all_gather` of this rank's adds, concatenated.
        ``None`` when no rank added anything.
        """
        return self._exchange(layout, None)

    def gather(self, layout: Any = None, *, dst: int = 0) -> Any:
        """As :meth:`all_gather`, but the result is built on rank ``dst`` only (``None`` elsewhere)."""
        return self._exchange(layout, dst)

    # ---------------------------------------------------------------------------- exchange

    def _exchange(self, layout: Any, dst: int | None) -> Any:
        if self._done:
            raise StateError(
                "Collector exchanged twice: call reset() (and add again) before the next "
                "all_gather()/gather()"
            )
        self._done = True
        plans: dict[Any, tuple[Plan, list[int]]] = {}
        try:
            local: Any = self._local(layout, plans)
        except TreegatherError as exc:  # raised on every rank, after the exchange
            local = _Problem(type(exc).__name__, str(exc))

        def finish(payloads: list[Any]) -> Any:
            return self._combine(payloads, layout, plans)

        return _exchange(local, dst, self._group, finish)

    def _local(self, layout: Any, plans: dict[Any, Any]) -> _Payload | None:
        """This rank's adds concatenated: per-sample leaves in one piece, the others listed."""
        if not self._adds:
            return None
        trees = [tree for tree, _ in self._adds]
        plan, kinds, spec0 = _plan_of(trees[0], layout)
        plans[spec0] = (plan, kinds)
        up = plan.up_spec
        values = []
        for a, tree in enumerate(trees):
            try:
                values.append(up.flatten_up_to(tree))
            except (ValueError, TypeError):
                raise StructureMismatchError(
                    f"add #{a} has another structure than add #0 (outputs of every batch must "
                    "have the same keys, fields and lengths; per-sample lists go under "
                    "cat_items())"
                ) from None
        rows = _rows_per_add(values, plan, kinds)
        idx = self._indices(rows)
        device = self._target(values)
        rules = _rules(plan)

        def reference() -> list[Any]:  # the definition: gather over the adds
            adds = up.unflatten(
                [AsList() if k == _PER_ADD else _CROSS[k](r) for k, r in zip(kinds, rules)]
            )
            return up.flatten_up_to(
                _gather_noted(trees, device, adds, rows, "add #{i} of this rank")
            )

        combined = _join(list(zip(*values)), kinds, rules, device, reference, per_add=True)
        wrapped = tuple(_Opaque(v) if k != _SAMPLES else v for k, v in zip(kinds, combined))
        return _Payload(idx, torch.tensor(rows), wrapped, _Opaque((spec0, tuple(kinds))))

    def _indices(self, rows: list[int]) -> Tensor:
        order = self._order
        total = sum(rows)
        if order is not None and total <= len(order) and all(i is None for _, i in self._adds):
            # Every add took the sampler's next indices: one slice of them.
            return order[:total]
        parts: list[Tensor] = []
        taken = 0
        for a, (n, (_, given)) in enumerate(zip(rows, self._adds)):
            if given is not None:
                idx = torch.as_tensor(given, dtype=torch.int64).reshape(-1).cpu()
                if idx.numel() != n:
                    raise BatchSizeError(
                        f"add #{a}: indices= has {idx.numel()} index(es) for {n} row(s) of "
                        "per-sample outputs"
                    )
                parts.append(idx)
                continue
            if order is None:
                raise BatchSizeError(
                    f"add #{a}: no indices= and no sampler: the Collector cannot tell which "
                    "samples these rows are; pass Collector(sampler) or add(outputs, indices=...)"
                )
            if taken + n > len(order):
                raise BatchSizeError(
                    f"add #{a}: {n} row(s), but the sampler has {len(order) - taken} of its "
                    f"{len(order)} indices left for this rank (the adds before it hold {taken} "
                    "rows); add each batch once, with the sampler the DataLoader uses "
                    "(set_epoch before the loop), or pass indices="
                )
            parts.append(order[taken : taken + n])
            taken += n
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def _target(self, values: list[list[Any]] | None = None) -> torch.device:
        if self._device is not None:
            return self._device
        for row in values or ():
            for x in row:
                if isinstance(x, Tensor):
                    return x.device
        return torch.device("cpu")

    def _combine(self, payloads: list[Any], layout: Any, plans: dict[Any, Any]) -> Any:
        """Every rank's payload -> one tree, each sample once, in index order (the same on
        every rank: it depends on the payloads alone, in rank order)."""
        ranks = _ranks(self._group)
        problems = [(r, p) for r, p in zip(ranks, payloads) if isinstance(p, _Problem)]
        if problems:
            raise _problem_error(problems)
        present = [(r, p) for r, p in zip(ranks, payloads) if p is not None]
        if not present:
            self.indices = torch.zeros(0, dtype=torch.int64)
            return None
        spec, kinds = present[0][1].shape.value
        other = [r for r, p in present[1:] if p.shape.value != (spec, kinds)]
        if other:
            raise StructureMismatchError(
                f"the ranks' outputs differ from rank {present[0][0]}'s in structure, or in which "
                f"leaves are per sample, on rank(s) {', '.join(map(str, other))}"
                "\nHint: every rank must add outputs of the same structure"
            )
        found = plans.get(spec)
        plan = found[0] if found is not None else resolve(spec, layout, "gather", 0, ROOT)
        device = self._target()
        rules = _rules(plan)
        idx = torch.cat([p.indices for _, p in present])
        rows = torch.cat([p.rows for _, p in present]).tolist()
        up = plan.up_spec
        per_rank = [
            [v.value if isinstance(v, _Opaque) else v for v in p.values] for _, p in present
        ]
        if len(per_rank) > 1:

            def reference() -> list[Any]:  # the definition: gather over the ranks
                cross = up.unflatten([_CROSS[k](r) for k, r in zip(kinds, rules)])
                trees = [up.unflatten(v) for v in per_rank]
                names = [r for r, _ in present]
                return up.flatten_up_to(
                    _gather_noted(trees, device, cross, None, "rank {r}", names)
                )

            values = _join(list(zip(*per_rank)), kinds, rules, device, reference)
        else:
            values = per_rank[0]
        perm, kept = _order(idx)
        out: list[Any] = []
        for kind, rule, value in zip(kinds, rules, values):
            if kind == _PER_ADD:
                out.append(_gather_noted(value, device, rule, rows, "add #{i}"))
            elif perm is None:
                out.append(value)
            elif isinstance(value, Tensor):
                out.append(value.index_select(0, perm.to(value.device)))
            else:
                picked = perm.tolist()
                items = list(itemgetter(*picked)(value)) if len(picked) > 1 else [value[picked[0]]]
                out.append(tuple(items) if isinstance(value, tuple) else items)
        self.indices = kept
        return up.unflatten(out)


class _Opaque:
    """A value that travels whole (one pickled object), not as the leaves of a tree."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getstate__(self) -> Any:
        return self.value

    def __setstate__(self, value: Any) -> None:
        self.value = value


class _Payload(NamedTuple):
    """One rank's adds, as they travel."""

    indices: Tensor  # the dataset index of every row, in add order
    rows: Tensor  # rows per add
    values: tuple[Any, ...]  # per plan position: per-sample tensors whole, lists opaque
    shape: _Opaque  # (the structure of the rank's first add, what each position is)


# ------------------------------------------------------------------------------- helpers

# What a plan position is: concatenated per sample, or one value per add.
_SAMPLES, _ITEMS, _PER_ADD = 0, 1, 2
_CROSS = {
    _SAMPLES: lambda rule: rule if rule is not None else Cat(0),
    _ITEMS: lambda rule: CatItems(),
    _PER_ADD: lambda rule: CatItems(),  # the per-add lists of every rank, one after the other
}


def _rules(plan: Plan) -> list[Rule | None]:
    return [g[2] if g is not None else r for r, g in zip(plan.rules, plan.groups)]


def _plan_of(tree: Any, layout: Any) -> tuple[Plan, list[int], Any]:
    """The gather plan of one add's structure (kept per structure, as gather keeps it), what
    each of its positions is, and the structure."""
    leaves, structure, spec = recognise(tree)
    found = None if structure is None else structure.plan(layout, "gather", 0, ROOT, leaves)
    plan = found[0] if found is not None else resolve(spec, layout, "gather", 0, ROOT)
    values = leaves if plan.up_spec is spec else plan.up_spec.flatten_up_to(tree)
    kinds = []
    for rule, value in zip(_rules(plan), values):
        if isinstance(rule, CatItems):
            kinds.append(_ITEMS)
        elif (
            (rule is None or (isinstance(rule, (Cat, Pad)) and rule.dim == 0))
            and isinstance(value, Tensor)
            and value.dim() > 0
        ):
            kinds.append(_SAMPLES)
        else:
            kinds.append(_PER_ADD)
    return plan, kinds, spec


def _rows_per_add(values: list[list[Any]], plan: Plan, kinds: list[int]) -> list[int]:
    """Each add's rows, from its per-sample leaves (which must agree within the add)."""
    if _SAMPLES not in kinds and _ITEMS not in kinds:
        raise BatchSizeError(
            "the Collector found no per-sample leaf in the outputs (a tensor with the batch dim "
            "first under cat(), or a per-sample list under cat_items()): it cannot match rows "
            "to samples"
        )
    sample = [p for p, k in enumerate(kinds) if k != _PER_ADD]
    rows: list[int] = []
    problems: list[str] = []
    for a, row in enumerate(values):
        counts = [_count(row[p]) for p in sample]
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


def _count(value: Any) -> int:
    """Rows of a per-sample value (-1: it has none)."""
    if isinstance(value, Tensor):
        return value.shape[0] if value.dim() > 0 else -1
    return len(value) if isinstance(value, (list, tuple)) else -1


def _gather_noted(
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


def _join(
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
            if kind == _SAMPLES:
                if not _alike(col, device, same_tail=not isinstance(rule, Pad)):
                    return reference()
                if isinstance(rule, Pad):
                    out.append(rule.combine(col, Combining(device, True, None, 0)))
                else:
                    out.append(torch.cat(col) if len(col) > 1 else col[0])
            elif kind == _PER_ADD and per_add:
                out.append(list(col))
            else:
                if not all(type(v) in (list, tuple) for v in col):
                    return reference()
                items = list(chain.from_iterable(col))
                if Tensor in set(map(type, items)):  # tensors among the items: moved there
                    return reference()
                out.append(tuple(items) if type(col[0]) is tuple else items)
    return out


def _alike(col: tuple[Any, ...], device: torch.device, *, same_tail: bool) -> bool:
    """Tensors of >= 1 dim, of one dtype, on ``device`` (and of one shape past the first dim)."""
    first = col[0]
    if type(first) is not Tensor or first.dim() == 0 or first.device != device:
        return False
    dtype, tail, ndim = first.dtype, first.shape[1:], first.dim()
    for v in col:
        if type(v) is not Tensor or v.dtype != dtype or v.device != first.device:
            return False
        if (v.shape[1:] != tail) if same_tail else (v.dim() != ndim):
            return False
    return True


def _order(idx: Tensor) -> tuple[Tensor | None, Tensor]:
    """Positions that put ``idx`` in order, each index once (the first seen), and the result."""
    if idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):
        return None, idx
    ordered, perm = torch.sort(idx, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return perm[first], ordered[first]


def _moved(tree: Any, device: torch.device | None) -> Any:
    """``tree`` with its tensors detached (and on ``device``): the leaves read as the compiled
    layer reads a structure it has seen (one generated call), the tensors alone touched, the
    tree rebuilt the same way."""
    leaves, st, spec = recognise(tree, ROOT)
    types = list(map(type, leaves))
    tensors = {t for t in set(types) if issubclass(t, Tensor)}  # (a few distinct types)
    for i, t in enumerate(types):
        if t in tensors:
            x = leaves[i].detach()
            leaves[i] = x if device is None or x.device == device else x.to(device)
    rebuild = st.rebuild if st is not None and spec is st.spec else spec.unflatten
    return rebuild(leaves)


def _is_loader(obj: Any) -> bool:
    loader = getattr(torch.utils.data, "DataLoader", None)
    return loader is not None and isinstance(obj, loader)


def _read_order(sampler: Iterable[Any]) -> Tensor:
    """This epoch's indices of ``sampler`` (a batch sampler's batches flattened), as int64."""
    items = list(sampler)
    if items and isinstance(items[0], (list, tuple)):
        items = [int(i) for batch in items for i in batch]
    return torch.tensor(items, dtype=torch.int64)


def _exchange(local: Any, dst: int | None, group: Any, finish: Callable[[list[Any]], Any]) -> Any:
    """One exchange of every rank's payload; ``finish`` makes the result of them (on every rank
    for an all-gather, on ``dst`` for a gather, where an error it raises reaches every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if dst not in (None, 0):
            raise ValueError(f"Collector.gather(dst={dst}): without a process group dst is 0")
        return finish([local])
    if dst is None:
        return finish(protocol.all_gather(local, AsList(), group, 0, None, False))
    return protocol.gather(local, dst, AsList(), group, 0, None, finish)


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def _problem_error(problems: list[tuple[int, _Problem]]) -> TreegatherError:
    cls = _ERRORS.get(problems[0][1].error, TreegatherError)
    by_message: dict[str, list[int]] = {}
    for rank, p in problems:
        by_message.setdefault(p.message, []).append(rank)
    return cls(
        "\n".join(
            f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
            for msg, rs in by_message.items()
        )
    )
