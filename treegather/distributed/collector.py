"""Collector: an evaluation's outputs, collected on each rank and exchanged once.

A DDP evaluation loop sees each rank's samples in the order its sampler yields them, and
``DistributedSampler`` pads the dataset so that every rank gets as many samples (the first
samples again) and interleaves the ranks. :class:`Collector` matches the rows of every
:meth:`~Collector.add` to the indices the sampler yields for this rank, keeps everything local
until :meth:`~Collector.all_gather` (or :meth:`~Collector.gather`), and then makes one exchange:
every dataset sample exactly once, in index order.

The exchange's definition is one :func:`treegather.distributed.all_gather` (``gather``: to
``dst``) of every rank's adds joined (:class:`~treegather.distributed.columns.Payload`) under
``as_list()``. Its fast layer (:mod:`~treegather.distributed.columns`) packs them into the
call's first collective when every rank's payload agrees, so a repeated evaluation costs one
collective; the rows are then put in dataset order per rank
(:func:`~treegather.distributed.samples.dataset_order`,
:func:`~treegather.distributed.samples.place`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from .._caches import FAST_PATHS
from .._devices import DeviceLike, as_device
from .._errors import BatchSizeError, StateError, StructureMismatchError, TreegatherError
from .._layout import Plan, resolve
from .._rules import AsList
from .._tree import display_path
from . import columns, errors, protocol
from .columns import MIN_RUN, Payload
from .samples import (
    CROSS,
    PER_ADD,
    SAMPLES,
    Mine,
    Opaque,
    Texts,
    arrived,
    by_position,
    dataset_order,
    gather_noted,
    is_loader,
    join,
    moved,
    place,
    placed,
    plan_of,
    read_order,
    rows_per_add,
    rules_of,
    travelling,
)

__all__ = ["Collector"]

Tensor = torch.Tensor
ROOT = "outputs"


class _Problem(NamedTuple):
    """What a rank found wrong with its own adds: raised on every rank after the exchange."""

    error: str  # the error class's name
    message: str


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
        self._sampler = getattr(sampler, "sampler", sampler) if is_loader(sampler) else sampler
        self._device = None if device is None else as_device(device)
        self._group = group
        self._adds: list[tuple[Any, Sequence[int] | Tensor | None]] = []
        self._order: Tensor | None = None  # this epoch's indices of the sampler
        self._run = (0, 0, 0)  # their leading arithmetic run (columns.leading_run)
        self._given = False  # some add passed indices=
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
        self._run = (0, 0, 0)
        self._given = False
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
            outputs = moved(outputs, self._device)
        elif torch.is_grad_enabled():
            outputs = moved(outputs, None)
        if indices is not None:
            self._given = True
        elif self._order is None and self._sampler is not None:
            self._order = read_order(self._sampler)
            self._run = columns.leading_run(self._order)
        self._adds.append((outputs, indices))

    def all_gather(self, layout: Any = None) -> Any:
        """Every rank's adds, combined on every rank: each sample once, in index order.

        ``layout`` is a layout of one add's outputs, as for :func:`treegather.gather`.
        One collective while every rank's adds agree and fit the group's inline capacity (see
        the module), else what one :func:`treegather.distributed.all_gather` of this rank's
        adds, concatenated, costs, plus one. ``None`` when no rank added anything.
        """
        return self._exchange(layout, None)

    def gather(self, layout: Any = None, *, dst: int = 0) -> Any:
        """As :meth:`all_gather`, but the result is returned on rank ``dst`` only (``None``
        elsewhere, where :attr:`indices` is ``None`` too); adds too large to come with the
        call's first collective go to ``dst`` alone."""
        return self._exchange(layout, dst)

    # ---------------------------------------------------------------------------- exchange

    def _exchange(self, layout: Any, dst: int | None) -> Any:
        if self._done:
            raise StateError(
                "Collector exchanged twice: call reset() (and add again) before the next "
                "all_gather()/gather()"
            )
        self._done = True
        plans: dict[Any, tuple[Plan, list[int], Any]] = {}
        local: Any = None
        own: list[Any] = []
        unexpected: Exception | None = None
        try:
            if self._adds:
                local, own = self._local(layout, plans)
        except TreegatherError as exc:  # raised on every rank, after the exchange
            local = _Problem(type(exc).__name__, str(exc))
        except Exception as exc:  # (not ours: every rank still learns of it, instead of waiting)
            if not _initialized():
                raise
            unexpected = exc
            local = _Problem(TreegatherError.__name__, f"{type(exc).__name__}: {exc}")

        def finish(payloads: list[Any]) -> Any:
            return self._combine(payloads, layout, plans)

        try:
            if FAST_PATHS.on and _initialized():  # every rank's bytes in one collective
                done = columns.exchange(local, own, layout, dst, self._group, finish)
                if done is not None:
                    if not done.is_root:
                        self.indices = None
                    return done.result if done.is_root else None
            return _exchange(local, dst, self._group, finish)
        except TreegatherError as exc:
            if unexpected is not None and exc.__cause__ is None:
                raise exc from unexpected  # this rank's own error, as it was raised
            raise

    def _local(self, layout: Any, plans: dict[Any, Any]) -> tuple[Payload, list[Any]]:
        """This rank's adds concatenated: per-sample leaves in one piece, the others listed;
        and those values before they were made to travel."""
        trees = [tree for tree, _ in self._adds]
        plan, kinds, spec0 = plan_of(trees[0], layout)
        plans[spec0] = (plan, kinds, spec0)
        up = plan.up_spec
        try:
            values = list(map(up.flatten_up_to, trees))
        except (ValueError, TypeError):
            for a, tree in enumerate(trees):
                try:
                    up.flatten_up_to(tree)
                except (ValueError, TypeError):
                    raise StructureMismatchError(
                        f"add #{a} has another structure than add #0 (outputs of every batch "
                        "must have the same keys, fields and lengths; per-sample lists go under "
                        "cat_items())"
                    ) from None
            raise
        rows = rows_per_add(values, plan, kinds)
        idx = self._indices(rows)
        device = self._target(values)
        rules = rules_of(plan)

        def reference() -> list[Any]:  # the definition: gather over the adds
            adds = up.unflatten(
                [AsList() if k == PER_ADD else CROSS[k](r) for k, r in zip(kinds, rules)]
            )
            return up.flatten_up_to(
                gather_noted(trees, device, adds, rows, "add #{i} of this rank")
            )

        types: dict[int, set[type]] = {}
        combined = join(
            list(zip(*values)), kinds, rules, device, reference, per_add=True, types=types
        )
        wrapped = tuple(
            v if k == SAMPLES else travelling(v, types.get(p))
            for p, (k, v) in enumerate(zip(kinds, combined))
        )
        shape = Opaque((spec0, tuple(kinds)))
        return Payload(idx, torch.tensor(rows), wrapped, shape, self._known_run(idx)), combined

    def _known_run(self, idx: Tensor) -> tuple[int, int, int] | None:
        """The leading run of ``idx`` when it is the sampler's first indices (whose run the
        first add found), else ``None`` (found when packed)."""
        if idx.numel() < MIN_RUN or not self._sampled(idx.numel()):
            return None
        first, step, n = self._run
        return first, step, min(n, idx.numel())

    def _sampled(self, total: int) -> bool:
        """Whether the indices of ``total`` rows are the sampler's first (no add passed
        ``indices=``)."""
        order = self._order
        return order is not None and total <= len(order) and not self._given

    def _indices(self, rows: list[int]) -> Tensor:
        order = self._order
        total = sum(rows)
        if self._sampled(total):  # every add took the sampler's next indices: one slice
            assert order is not None
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
        if found is not None and not _same_order(found[2], spec):
            found = None  # (the first rank's dict keys in another order: its plan, its order)
        plan = found[0] if found is not None else resolve(spec, layout, "gather", 0, ROOT)
        device = self._target()
        rules = rules_of(plan)
        up = plan.up_spec
        order = dataset_order([p.indices for _, p in present], [p.run for _, p in present])
        per_rank = [[arrived(v) for v in p.values] for _, p in present]
        plain = [
            all(isinstance(p.values[j], (Texts, Mine)) for _, p in present)
            for j in range(len(kinds))
        ]
        out = place(list(zip(*per_rank)), kinds, rules, device, order, plain)
        if out is None:  # the definition: join by gather's rules, then pick the rows
            if len(per_rank) > 1:

                def reference() -> list[Any]:  # the definition: gather over the ranks
                    cross = up.unflatten([CROSS[k](r) for k, r in zip(kinds, rules)])
                    trees = [up.unflatten(v) for v in per_rank]
                    names = [r for r, _ in present]
                    return up.flatten_up_to(
                        gather_noted(trees, device, cross, None, "rank {r}", names)
                    )

                values = join(list(zip(*per_rank)), kinds, rules, device, reference)
            else:
                values = per_rank[0]
            picked = by_position(order, [p.indices for _, p in present])  # (one after another)
            out = [v if k == PER_ADD else placed([v], picked) for k, v in zip(kinds, values)]
        if PER_ADD in kinds:  # one value per add, weighted by the adds' rows
            rows = torch.cat([p.rows for _, p in present]).tolist()
            many = len(present) > 1
            names = [
                f"add #{a}" + (f" of rank {r}" if many else "")
                for r, pl in present
                for a in range(pl.rows.numel())
            ]
            for p, (kind, rule) in enumerate(zip(kinds, rules)):
                if kind == PER_ADD:
                    try:
                        out[p] = gather_noted(out[p], device, rule, rows, "{r}", names)
                    except TreegatherError as exc:  # its paths start at the value: say where
                        text, where = str(exc), display_path(plan.node_of(p), ROOT)
                        text = where + text[len(ROOT) :] if text.startswith(ROOT) else text
                        raise type(exc)(text) from None
        self.indices = order.kept
        return up.unflatten(out)


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


def _same_order(mine: Any, first: Any) -> bool:
    """Whether two equal structures also list their dicts' keys in the same order (optree's
    ``==`` and hash do not tell; unflattening follows the order). The result follows the first
    rank's."""
    if mine is first:
        return True
    try:
        return pickle.dumps(mine) == pickle.dumps(first)
    except Exception:  # (a node that does not pickle came from this rank alone)
        return True


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    if not _initialized():
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def _problem_error(problems: list[tuple[int, _Problem]]) -> TreegatherError:
    cls = errors.ERROR_CLASSES.get(problems[0][1].error, TreegatherError)
    by_message: dict[str, list[int]] = {}
    for rank, p in problems:
        by_message.setdefault(p.message, []).append(rank)
    return cls(
        "\n".join(
            f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
            for msg, rs in by_message.items()
        )
    )
