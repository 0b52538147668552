"""Collector: an evaluation's outputs, collected on each rank and exchanged once.

The adds' rows are the dataset indices the loader handed out (:mod:`.loaders`); the exchange
is one all-gather of every rank's adds joined (a :class:`Payload`), after which every rank checks
what every rank sent and puts the rows in dataset order (:mod:`.samples`; ARCHITECTURE.md).
"""

from __future__ import annotations

import operator
import pickle
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from .._caches import LRU
from .._devices import DeviceLike, as_device
from .._errors import (
    ArgumentTypeError,
    BatchSizeError,
    LayoutError,
    LeafTypeError,
    StateError,
    StructureMismatchError,
    TreegatherError,
)
from .._layout import Plan, resolve
from .._rules import AsList, kinds
from .._tree import BatchNode, along_rows, batch_nodes, display_path, flatten, rebuild, type_name
from .._tree.batch import misclaim_text, misclaims, sizes_by_path
from . import calls, errors
from .describe import format_problems
from .drops import Drop, drops
from .exchange import COLLECT
from .layout import layout_text
from .loaders import OBSERVE, Observation, dataset_key, index_tensor, observe, pure_sampler, read
from .samples import (
    CROSS,
    ITEMS,
    PER_ADD,
    ROWS,
    SAMPLES,
    Opaque,
    Texts,
    arrived,
    dataset_order,
    gather_noted,
    join,
    moved,
    placed,
    plan_of,
    rows_per_add,
    rules_of,
    sendable,
    travelling,
)

__all__ = ["Collector"]

Tensor = torch.Tensor
ROOT = "outputs"


_SHAPES: LRU[Any, tuple[Any, Any, bytes]] = LRU("distributed.collector_shapes", maxsize=64)


class _Problem(NamedTuple):
    """What a rank found wrong with its own adds: raised on every rank after the exchange."""

    error: str  # the error class's name
    message: str
    why: tuple[str, ...] = ()  # an incomplete epoch's reasons (_Short.why)


class Payload(NamedTuple):
    """One rank's adds, as they travel."""

    indices: Tensor  # the dataset index of every row, in add order
    rows: Tensor  # rows per add
    values: tuple[Any, ...]  # per plan position: a tensor of every row, Texts, or Opaque
    shape: bytes  # pickled (structure to the nodes taken whole, each position's kind, add #0's)


class _Add(NamedTuple):
    outputs: Any
    indices: Any  # as given to add(), or None
    yielded: int  # batches the observed loop had yielded when it was added (-1: it had ended)


class Collector:
    """An evaluation's outputs, collected locally and exchanged once, each sample once, in order.

    >>> import torch, treegather.distributed as tgd
    >>> col = tgd.Collector()                      # no process group: one process
    >>> col.add({"logits": torch.ones(2, 3), "ids": torch.tensor([7, 9])}, indices=[3, 1])
    >>> col.add({"logits": torch.zeros(1, 3), "ids": torch.tensor([8])}, indices=[2])
    >>> out = col.all_gather()
    >>> out["ids"], col.indices
    (tensor([9, 8, 7]), tensor([1, 2, 3]))

    Iterate the ``DataLoader`` through :meth:`observe` (any sampler or batch sampler, worker
    processes, accelerate's prepared loaders), call :meth:`add` with each batch's outputs (no
    communication: per-sample leaves have the batch dim first), then :meth:`all_gather` (every
    rank gets the result) or :meth:`gather` (``dst`` gets it, the others ``None``):

    .. code-block:: python

        col = tgd.Collector()
        for batch in col.observe(loader):         # the indices of each batch, as it is made
            col.add(model(batch["x"]))
        result = col.all_gather({"names": tg.cat_items()})

    An add in the loop takes the rows of the batch the loop last yielded, the indices the
    loader's index sampler handed out for it (nothing is read twice; the ``collate_fn`` keeps
    the samples in order, or the loop passes their ids: see :meth:`observe`).
    ``Collector(sampler)`` (or ``Collector(loader)``) with a plain loop, or a loop a framework
    runs (Lightning: ``Collector(trainer.val_dataloaders)``), reads the sampler again at the
    first add, which only ``SequentialSampler``, ``DistributedSampler``, a ``BatchSampler``
    over those, wrappers that hand one of them on (Lightning's) and accelerate's
    ``BatchSamplerShard`` over those (the Hugging Face Trainer's) allow; ``add(outputs,
    indices=...)`` names the rows itself. Every rank's loader must index the same dataset (its
    class, length and a ``Subset``'s indices are compared). A sample seen twice (a
    ``DistributedSampler``'s padding) is kept once, the first rank's, in dataset index order
    (:attr:`indices`); every rank must add its whole epoch, and its loader must have seen the
    dataset: one that drops samples (``drop_last=True`` on the ``DataLoader``, a
    ``DistributedSampler`` or a ``BatchSampler``) has not (``partial=True``: what was added).

    Per-sample leaves are those the layout joins along the batch dim (``cat()``, ``cat(-2)`` of
    2-D leaves, ``pad(0)``) and lists under ``cat_items()``; every other leaf is one value per
    add, combined by its rule over every add of every rank (``mean()`` weighted by the adds'
    rows). Errors in what was added are found at the exchange and raised on every rank, naming
    the path and the add (never a hang). An add from another thread lands in the exchange or
    raises.

    Args:
        source: a sampler (or ``DataLoader``) whose order this rank's adds follow in a plain
            loop, read again at the first add; ``None`` with :meth:`observe` or ``indices=``.
        device: where added outputs are kept (e.g. ``"cpu"`` for a long evaluation on the
            GPU); default: where they are.
        group: the ``torch.distributed`` process group; ``None`` for the default group, or one
            process when none is initialised.

    Raises:
        ArgumentTypeError: ``source`` is a sampler whose order cannot be read again, or a list
            of loaders.
    """

    def __init__(
        self,
        source: Iterable[Any] | None = None,
        *,
        device: DeviceLike | None = None,
        group: Any = None,
    ) -> None:
        self._sampler = pure_sampler(source)
        self._drops = [] if source is None else drops(source)  # (drop_last: what it leaves out)
        ds = getattr(source, "dataset", None)  # (a DataLoader's, a DistributedSampler's)
        self._dataset = None if ds is None else dataset_key(ds)
        self._device = None if device is None else as_device(device)
        self._group = group
        self._lock = threading.Lock()
        self.reset()

    def __len__(self) -> int:
        """How many adds this rank has collected since the last :meth:`reset`."""
        return len(self._adds)

    def reset(self) -> None:
        """Forget every add (and the loop observed): ready for the next epoch."""
        with self._lock:
            self._adds: list[_Add] = []
            self._order: Tensor | None = None  # the sampler's indices this epoch, once read
            self._seen: Observation | None = None  # the loop observed this epoch
            self._done = False
            self.indices: Tensor | None = None
            """The dataset indices of the last exchange's result, in order (``None`` before)."""

    def observe(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (a ``DataLoader``, or one accelerate prepared) once, as ``for
        batch in loader`` does, noting the dataset indices its index sampler hands out (to the
        main process or its workers) for every batch, copied as they are handed out (a list,
        tuple, tensor, numpy array, range or other iterable of ints). ``loader`` is checked at
        once.

        An :meth:`add` made in the loop takes rows of the batch the loop last yielded: a
        batch's outputs in one add, or in several (its rows in order); a batch with no add is
        skipped (with ``partial=True`` the result leaves its samples out, and :attr:`indices`
        says which it holds). Adds made after the loop take the batches it received in turn,
        whole.

        Rows are matched to the batch's indices by position, so ``collate_fn`` must keep the
        batch's samples and their order (torch's default does). One that drops samples (a
        corrupt one), adds rows or reorders them (sorted by length for
        ``pack_padded_sequence``) must carry each sample's dataset index in the batch, for the
        loop to pass: ``col.add(outputs, indices=batch["index"])``, checked against the
        observed batch (its rows, each once, in any order). Adds of a batch that hold more or
        fewer rows than it has indices, without ``indices=``, are an error at the exchange; a
        reordered batch without them cannot be told from the outputs.

        Raises:
            ArgumentTypeError: ``loader`` makes its batches from no index sampler of its own (an
                ``IterableDataset``, ``dispatch_batches``, ``in_order=False``, another class):
                pass ``add(outputs, indices=...)`` instead.
            StateError: adds were made already, or ``observe`` ran already: :meth:`reset`.
        """
        with self._lock:
            self._ready("Collector.observe")
            if self._adds or self._seen is not None:
                raise StateError(
                    "Collector.observe: this evaluation has adds or an observed loop already; "
                    "observe one loop per evaluation, from its start (reset() starts the next)"
                )
            seen = Observation()
            batches = observe(loader, seen)
            self._seen = seen
        return batches

    def add(self, outputs: Any, indices: Sequence[int] | Tensor | None = None) -> None:
        """Keep one batch's ``outputs`` (no communication).

        The rows of the per-sample leaves are ``indices`` (this batch's dataset indices), or
        in an observed loop the next rows of the batch it last yielded (:meth:`observe`), or
        the next rows of the sampler (``Collector(sampler)``). With the Collector's
        ``device``, tensors are moved there (detached); without it they are kept as they are
        (detached when grad mode is on: evaluate under ``torch.no_grad()`` and nothing is
        copied or flattened here).

        Raises:
            StateError: the Collector was exchanged already; call :meth:`reset` first.
        """
        if self._device is not None:
            outputs = moved(outputs, self._device)
        elif torch.is_grad_enabled():
            outputs = moved(outputs, None)
        with self._lock:
            self._ready("Collector.add")
            seen = self._seen
            if (
                seen is None
                and indices is None
                and self._order is None
                and self._sampler is not None
            ):
                self._order = read(self._sampler)
            self._adds.append(_Add(outputs, indices, 0 if seen is None else seen.at))

    def all_gather(self, layout: Any = None, *, partial: bool = False) -> Any:
        """Every rank's adds, combined on every rank: each sample once, in index order.

        One :func:`treegather.distributed.all_gather` of every rank's adds, joined (a repeated
        evaluation: one collective). ``None`` when no rank added anything.

        Args:
            layout: how to combine each leaf of one add's outputs (as for gather), the same on
                every rank.
            partial: take what was added, even where a rank did not add its whole epoch
                (:attr:`indices` tells which samples the result holds); the same on every rank.
                Lightning's sanity check (two batches per rank before ``fit``):
                ``partial=self.trainer.sanity_checking``.

        Raises:
            BatchSizeError: a rank added fewer (or more) rows than its epoch holds, or its
                loader drops samples of the dataset (``drop_last``: the error says how many and
                where), or rows that are not its loader's, or a batch's adds hold more or fewer
                rows than it has samples (:meth:`observe`), or the ranks' loaders index
                different datasets; raised on every rank.
            StructureMismatchError: the ranks' adds differ in structure (the path is named).
            LayoutError: the ranks passed different layouts (or ``partial``); a list of
                non-tensors has no rule.
            StateError: exchanged already; call :meth:`reset` first.
        """
        return self._exchange(layout, None, partial)

    def gather(self, layout: Any = None, *, dst: int = 0, partial: bool = False) -> Any:
        """As :meth:`all_gather`, but the result is returned on rank ``dst`` only (``None``
        elsewhere, where :attr:`indices` is ``None`` too); adds too large to come with the
        call's first collective go to ``dst`` alone."""
        return self._exchange(layout, dst, partial)

    # ---------------------------------------------------------------------------- exchange

    def _ready(self, call: str) -> None:
        if self._done:
            raise StateError(
                f"{call} after all_gather()/gather(): the outputs collected so far were "
                "exchanged; call reset() to start the next evaluation"
            )

    def chunks(
        self, layout: Any = None, *, rows: int, partial: bool = False
    ) -> Iterator[tuple[Tensor, Any]]:
        """Every rank's adds, combined on every rank, handed out in chunks of at most ``rows``
        samples: ``(indices, result)`` pairs, each sample once, in dataset index order.

        The bounded form of :meth:`all_gather`, for evaluations whose result does not fit in
        memory: a rank holds its own adds and one chunk at a time (write each to disk, or
        reduce it, before taking the next). Chunk ``k`` holds the samples of dataset indices
        ``k * rows`` to ``(k + 1) * rows - 1`` that were added (chunks with none are skipped);
        per-sample leaves hold those samples' rows, every other leaf the value :meth:`all_gather`
        gives it (one per add, combined over every add). One collective to find the dataset's
        end, then one exchange per chunk: every rank must take every chunk (iterate to the
        end). After the last, :attr:`indices` holds every chunk's indices.

        >>> import torch, treegather.distributed as tgd
        >>> col = tgd.Collector()
        >>> col.add({"x": torch.arange(5.0)}, indices=[4, 0, 3, 1, 2])
        >>> [(i.tolist(), out["x"].tolist()) for i, out in col.chunks(rows=2)]
        [([0, 1], [1.0, 3.0]), ([2, 3], [4.0, 2.0]), ([4], [0.0])]

        Raises:
            ArgumentTypeError: ``rows`` is not a positive int.
            BatchSizeError, StructureMismatchError, LayoutError, StateError: as
                :meth:`all_gather` raises them (with the first chunk, on every rank).
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ArgumentTypeError(f"Collector.chunks: rows must be a positive int, got {rows!r}")
        local, plans, call, unexpected = self._prepared(layout, partial)
        try:  # (the dataset's end, on every rank: how many chunks there are)
            own_end = (
                int(local.indices.max()) + 1
                if isinstance(local, Payload) and local.indices.numel()
                else 0
            )
            ends = [own_end]
            if _initialized():
                found = calls.all_gather(torch.tensor([own_end]), None, self._group, 0, None, False)
                ends = found.tolist()
            kept: list[Tensor] = []
            whole = plans.get(local.shape) if isinstance(local, Payload) else None
            for lo in range(0, max(*ends, 1), rows):  # (at least one: a problem is told there)
                piece = local
                if whole is not None:
                    try:
                        piece, plans[local.shape] = _piece(local, lo, lo + rows, whole)
                    except TreegatherError as exc:  # (raised on every rank, after the exchange)
                        piece = _Problem(type(exc).__name__, str(exc))
                out = self._finished(
                    [(Opaque(call), piece)], layout, None, plans, "Collector.chunks"
                )
                if self.indices is not None and self.indices.numel():
                    kept.append(self.indices)
                    yield self.indices, out
            self.indices = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)
        except TreegatherError as exc:
            if unexpected is not None and exc.__cause__ is None:
                raise exc from unexpected  # this rank's own error, as it was raised
            raise

    def _exchange(self, layout: Any, dst: int | None, partial: bool) -> Any:
        name = "Collector.all_gather" if dst is None else "Collector.gather"
        local, plans, call, unexpected = self._prepared(layout, partial)
        handed = [(Opaque(call), local)]  # (handed over: sent, then let go of)
        del local
        try:
            return self._finished(handed, layout, dst, plans, name)
        except TreegatherError as exc:
            if unexpected is not None and exc.__cause__ is None:
                raise exc from unexpected  # this rank's own error, as it was raised
            raise

    def _prepared(
        self, layout: Any, partial: bool
    ) -> tuple[Any, dict[bytes, Any], Any, Exception | None]:
        """This rank's payload (or its problem, raised on every rank after the exchange), its
        plans by structure, what the ranks compare of the call, and an error not ours."""
        with self._lock:
            if self._done:
                raise StateError(
                    "Collector exchanged twice: call reset() (and add again) before the next "
                    "all_gather()/gather()"
                )
            self._done = True
            adds, self._adds = self._adds, []  # (let go of them: the payload holds what travels)
        plans: dict[bytes, tuple[Plan, list[int], list[Any]]] = {}  # this rank's: plan, values
        local: Any = None
        unexpected: Exception | None = None
        try:
            source = self._source()
            if adds:
                local = self._local(adds, source, bool(partial), layout, plans)
            else:
                _complete(0, source, bool(partial))
        except TreegatherError as exc:  # raised on every rank, after the exchange
            local = _Problem(type(exc).__name__, str(exc), getattr(exc, "why", ()))
        except Exception as exc:  # (not ours: every rank still learns of it, instead of waiting)
            if not _initialized():
                raise
            unexpected = exc
            local = _Problem(TreegatherError.__name__, f"{type(exc).__name__}: {exc}")
        del adds
        key, shown = layout_text(layout, 0)
        shown = shown.removesuffix(", dim=0") + (", partial=True" if partial else "")
        data = self._seen.dataset if self._seen is not None else self._dataset
        return local, plans, (f"{key};partial={bool(partial)}", shown, data), unexpected

    def _finished(
        self, handed: list[Any], layout: Any, dst: int | None, plans: dict[bytes, Any], name: str
    ) -> Any:
        """The exchange of the payload ``handed`` over and the result made of every rank's."""

        def finish(received: list[Any]) -> Any:
            try:
                ranks = _ranks(self._group)
                errors.same_layouts(
                    ranks,
                    [c.value[:2] for c, _ in received],
                    "the ranks passed different layouts (or partial=): each would combine the "
                    "adds with other rules",
                    "pass the same layout (and partial=) on every rank",
                )
                known = [(r, c.value[2]) for r, (c, _) in zip(ranks, received) if c.value[2]]
                if len({d[0] for _, d in known}) > 1:  # (rows are matched by dataset index)
                    raise BatchSizeError(
                        "the ranks' loaders index different datasets ("
                        + errors.by_rank([r for r, _ in known], [d[1] for _, d in known])
                        + "): an index on two ranks would be kept once, as padding\nHint: give each"
                        " rank one dataset, split by its sampler, or pass add(indices=...) into it"
                    )
                return self._combine([p for _, p in received], layout, plans)
            except TreegatherError as exc:
                raise type(exc)(f"{name}: {exc}") from exc.__cause__

        return _exchange(handed, dst, self._group, finish)

    def _source(self) -> _Rows:
        """Where the adds without ``indices=`` take their rows: the observed loop's batches,
        the sampler's order (read now if no add read it), or nothing."""
        seen = self._seen
        if seen is not None:
            order, ends = seen.rows()
            return _Rows(order, ends, seen, seen.drops)
        if self._order is None and self._sampler is not None:
            self._order = read(self._sampler)
        return _Rows(self._order, None, None, self._drops)

    def _local(
        self, adds: list[_Add], source: Any, partial: bool, layout: Any, plans: dict[Any, Any]
    ) -> Payload:
        """This rank's adds concatenated: per-sample leaves in one piece, the others listed."""
        trees = [add.outputs for add in adds]
        plan, kinds, spec0 = plan_of(trees[0], layout)
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
        columns = list(zip(*values))
        rows = rows_per_add(columns, plan, kinds)
        batched = batch_nodes(up)
        if batched:  # (nodes holding a batch size: each add's must hold its rows)
            _check_claims(trees, batched, plan, kinds, rows)
        idx, taken = _indices(rows, adds, source)
        _complete(taken, source, partial)
        device = self._target(values)
        rules = rules_of(plan)

        def reference() -> list[Any]:  # the definition: gather over the adds
            per_add = up.unflatten(
                [AsList() if k == PER_ADD else CROSS[k](r) for k, r in zip(kinds, rules)]
            )
            return up.flatten_up_to(
                gather_noted(trees, device, per_add, rows, "add #{i} of this rank")
            )

        types: dict[int, set[type]] = {}
        combined = join(columns, kinds, rules, device, reference, per_add=True, types=types)
        sent = _initialized()  # (pickled now, so that what does not pickle is named here)
        wrapped = tuple(
            sendable(v, plan.node_of(p))
            if k == SAMPLES
            else travelling(
                v,
                types.get(p),
                display_path(plan.node_of(p), ROOT) if sent else None,
                k == PER_ADD,
            )
            for p, (k, v) in enumerate(zip(kinds, combined))
        )
        key = (id(up), id(spec0), tuple(kinds))  # (the structure's pickle, made once)
        if (found := _SHAPES.get(key)) is None or found[0] is not up or found[1] is not spec0:
            found = (up, spec0, pickle.dumps((up, key[2], spec0), pickle.HIGHEST_PROTOCOL))
            _SHAPES.put(key, found)
        shape = found[2]
        # (this rank's strings as it had them, not decoded again; no tensor kept past the call)
        plans[shape] = (
            plan,
            kinds,
            [v if type(w) is Texts else None for v, w in zip(combined, wrapped)],
        )
        return Payload(idx, torch.tensor(rows), wrapped, shape)

    def _target(self, values: list[list[Any]] | None = None) -> torch.device:
        """The Collector's device, else the adds' first tensor's, else the CPU."""
        found = (x.device for row in values or () for x in row if isinstance(x, Tensor))
        return self._device if self._device is not None else next(found, torch.device("cpu"))

    def _combine(self, payloads: list[Any], layout: Any, plans: dict[Any, Any]) -> Any:
        """Every rank's payload -> one tree, each sample once, in index order (the same on
        every rank: it depends on the payloads alone, in rank order)."""
        ranks = _ranks(self._group)
        problems = [(r, p) for r, p in zip(ranks, payloads, strict=True) if isinstance(p, _Problem)]
        if problems:
            raise _problem_error(problems)
        present = [(r, p) for r, p in zip(ranks, payloads, strict=True) if p is not None]
        if not present:
            self.indices = torch.zeros(0, dtype=torch.int64)
            return None
        first = present[0][1].shape
        found = plans.get(first)  # (this rank's plan, where the first rank's keys are in its order)
        if found is None or any(p.shape != first for _, p in present[1:]):
            up, kinds, spec = pickle.loads(first)  # (ranks compare the first two)
            if any(pickle.loads(p.shape)[:2] != (up, kinds) for _, p in present[1:]):
                _raise_differences(present)
        plan, kinds = found[:2] if found else (resolve(spec, layout, "gather", 0, ROOT), kinds)
        device = self._target()
        rules = rules_of(plan)
        up = plan.up_spec
        order = dataset_order([p.indices for _, p in present])
        own: Any = dict(present).get(dist.get_rank() if _initialized() else 0)
        mine = plans[own.shape][2] if own is not None else ()
        per_rank = [  # (this rank's strings as it had them, not decoded again)
            [m if type(v) is Texts else arrived(v) for v, m in zip(p.values, mine)]
            if p is own
            else list(map(arrived, p.values))
            for _, p in present
        ]
        plain = [all(isinstance(p.values[j], Texts) for _, p in present) for j in range(len(kinds))]
        found = batch_nodes(up)  # (nodes holding a batch size: rebuilt with the rows they hold)
        joined = [k != PER_ADD for k in kinds]

        def reference() -> list[Any]:  # the definition: gather over the ranks
            cross = up.unflatten([CROSS[k](r) for k, r in zip(kinds, rules)])
            trees = [
                rebuild(up, v, along_rows(found, p.indices.numel(), joined), ROOT, found)
                for v, (_, p) in zip(per_rank, present)
            ]
            names = [r for r, _ in present]
            got = up.flatten_up_to(gather_noted(trees, device, cross, None, "rank {r}", names))
            return [v if k == PER_ADD else [v] for k, v in zip(kinds, got)]  # (as parts)

        columns = list(zip(*per_rank))
        values = join(columns, kinds, rules, device, reference, plain=plain, parts=True)
        out = [
            v if k == PER_ADD else _placed(v, order, plan, p, rules[p], device)
            for p, (k, v) in enumerate(zip(kinds, values))
        ]
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
                        where = display_path(plan.node_of(p), ROOT)
                        raise type(exc)(_at(str(exc), where)) from None
                    except Exception as exc:  # a custom rule's own: its note names the leaf
                        where = display_path(plan.node_of(p), ROOT)
                        notes = getattr(exc, "__notes__", None)
                        if notes:
                            exc.__notes__ = [_at(n, where) for n in notes]
                        raise
        self.indices = order.kept
        return rebuild(up, out, along_rows(found, order.kept.numel(), joined), ROOT, found)


_ROOT_PATH = re.compile(r"(^|, | at |\n  - )outputs(?=[\[ .:(]|$)")


def _at(text: str, where: str) -> str:
    """A message about one leaf's values, gathered as a tree of their own (whose paths start
    at ``outputs``), with the paths starting at the leaf's own path ``where``."""
    return _ROOT_PATH.sub(lambda m: m.group(1) + where, text)


def _placed(
    values: list[Any], order: Any, plan: Plan, p: int, rule: Any, device: torch.device
) -> Any:
    """:func:`placed`, or a typed error naming the leaf where torch cannot put its rows in
    order (``index_select`` of a kind of tensor that has none)."""
    first = values[0]
    if not isinstance(first, Tensor) or (type(first) is Tensor and kinds.ordinary(first)):
        return placed(values, order, device)
    try:
        return placed(values, order, device)
    except (RuntimeError, TypeError) as exc:  # (NotImplementedError is a RuntimeError)
        shown = "cat()" if rule is None else rule.describe()
        raise LeafTypeError(
            f"{display_path(plan.node_of(p), ROOT)}: {shown} in a Collector puts the rows in "
            f"dataset order, which torch cannot do for {kinds.kind_text(first)} "
            f"{type(first).__name__}s ({type(exc).__name__}: {str(exc).splitlines()[0][:100]}); "
            f"{kinds.fix(first)}, or keep each add's value with as_list()"
        ) from None


def _check_claims(
    trees: list[Any], found: Sequence[BatchNode], plan: Plan, what: list[int], rows: list[int]
) -> None:
    """Every add's batch nodes against its rows, as scatter checks a batch's
    (:func:`treegather._tree.batch.misclaims`): a node with per-sample leaves, or with no leaf,
    must hold the add's rows at dim 0 (those it is rebuilt with, :func:`along_rows`); ``what``
    each position is (per sample, or one value per add)."""
    joined = [k != PER_ADD for k in what]
    held = {i: (0,) for i in along_rows(found, 0, joined)}
    problems: list[str] = []
    for a, (tree, n) in enumerate(zip(trees, rows)):
        by_path = sizes_by_path(flatten(tree, ROOT)[1])
        sizes = [by_path.get(bn.node.raw, bn.meta.size) for bn in found]
        along = {p: (0, n) for p, j in enumerate(joined) if j}
        for m in misclaims(found, sizes, held, along, n):
            leaf = "" if m.leaf is None else display_path(plan.node_of(m.leaf), ROOT)
            problems.append(misclaim_text(m, found, ROOT, f"add #{a}'s", leaf))
    if problems:
        raise BatchSizeError(
            format_problems(
                "nodes holding a batch size must hold the rows of their add",
                problems,
                "give each node its add's rows as its batch size (the Collector rebuilds it "
                "with the rows it returns)",
            )
        )


def _piece(local: Payload, lo: int, hi: int, whole: Any) -> tuple[Payload, Any]:
    """This rank's payload restricted to the samples of dataset indices ``lo`` to ``hi - 1``
    (a chunk): the per-sample values of those rows, every per-add value (combined over every
    add in each chunk); and its plan's entry (``whole``: the payload's) with the chunk's own
    strings."""
    plan, kinds, strings = whole
    at = ((local.indices >= lo) & (local.indices < hi)).nonzero().squeeze(1)
    picked = at.tolist()
    values, chunk_strings = [], []
    for v, k, own in zip(local.values, kinds, strings):
        if k == PER_ADD:
            values.append(v)
            chunk_strings.append(own)
        elif k == SAMPLES:
            values.append(v.index_select(0, at.to(v.device)))
            chunk_strings.append(None)
        elif k == ROWS:
            where = display_path(plan.node_of(len(values)), ROOT)
            raise LayoutError(
                f"{where}: a {type_name(arrived(v))} holds its rows its own way, which are not "
                "cut into chunks\nHint: use Collector.all_gather(), or add its rows as a "
                "per-sample list under cat_items()"
            )
        else:  # (a per-sample list: strings travel as their bytes)
            items = own if type(v) is Texts else arrived(v)
            chosen = [items[i] for i in picked]
            values.append(travelling(chosen))
            chunk_strings.append(chosen if type(values[-1]) is Texts else None)
    piece = Payload(local.indices[at], local.rows, tuple(values), local.shape)
    return piece, (plan, kinds, chunk_strings)


def _exchange(
    handed: list[Any], dst: int | None, group: Any, finish: Callable[[list[Any]], Any]
) -> Any:
    """One exchange of every rank's payload (``handed`` over in a list: let go of once sent);
    ``finish`` makes the result of them (on every rank for an all-gather, on ``dst`` for a
    gather, where an error it raises reaches every rank)."""
    if not _initialized():
        if dst not in (None, 0):
            raise ValueError(f"Collector.gather(dst={dst}): without a process group dst is 0")
        return finish([handed.pop()])
    with calls.collections_paused():
        if dst is None:
            found = calls.all_gather(handed, AsList(), group, 0, None, False, COLLECT, handed=True)
            return finish(found)
        return calls.gather(handed, dst, AsList(), group, 0, None, finish, COLLECT, handed=True)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _ranks(group: Any) -> list[int]:
    if not _initialized():
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def _problem_error(problems: list[tuple[int, _Problem]]) -> TreegatherError:
    """Every rank's problem, as one error: the first one's class, its ranks named (ranks with
    the same problem on one line)."""
    short = [(r, p) for r, p in problems if p.error == INCOMPLETE]
    if not short:
        return errors.rank_errors([(r, p.error, p.message) for r, p in problems])
    # (what a rank lacks is reported before anything it added wrong)
    by_message: dict[str, list[int]] = {}
    for r, p in short:
        by_message.setdefault(p.message, []).append(r)
    why = {w for _, p in short for w in p.why}
    hint = []
    if DROPPED in why:
        hint.append(
            "a loader that drops samples has not seen the whole dataset: evaluate without "
            "drop_last (DataLoader(drop_last=False); DistributedSampler(drop_last=False) pads "
            "instead, and the Collector keeps each sample once)"
        )
    if why - {DROPPED}:
        hint.append(
            "every rank must add every batch of its epoch (a step limit that one rank "
            "reaches drops its samples)"
        )
    rows = [
        f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items()
    ]
    return BatchSizeError(
        format_problems(
            "the evaluation is incomplete (the result would lack these ranks' samples)",
            rows,
            "; ".join(hint)
            + ", or pass partial=True to take what was added (col.indices then tells which "
            "samples the result holds; Lightning's sanity check before fit: "
            "partial=self.trainer.sanity_checking)",
        )
    )


class _Rows(NamedTuple):
    """Where a rank's adds take their rows: the indices of its epoch (``None``: only from
    ``indices=``), each observed batch's end in them, the loop observed, and what its loader
    leaves out of the dataset."""

    order: Tensor | None
    ends: list[int] | None
    seen: Observation | None
    drops: list[Drop]


class _Short(TreegatherError):
    """A rank did not add its whole epoch (raised on every rank with the others' counts):
    ``why`` names the reasons (:data:`STOPPED`, :data:`FEWER`, :data:`DROPPED`)."""

    def __init__(self, reasons: list[tuple[str, str]]) -> None:
        super().__init__("; and ".join(text for _, text in reasons))
        self.why = tuple(kind for kind, _ in reasons)


INCOMPLETE = _Short.__name__
STOPPED, FEWER, DROPPED = "stopped", "fewer", "dropped"


def _indices(rows: list[int], adds: list[_Add], source: _Rows) -> tuple[Tensor, int]:
    """Every row's dataset index, in add order, and how many of the epoch's rows the adds took
    (the ones without ``indices=`` take the next ones; ``indices=`` beside them must name the
    same rows)."""
    if source.seen is not None:
        return _loop_indices(rows, adds, source)
    order = source.order
    total = sum(rows)
    if order is not None and total <= order.numel() and all(a.indices is None for a in adds):
        return order[:total], total
    named = [a.indices for a in adds]  # every add names its rows, int64 on the CPU: one check
    if order is None and set(map(type, named)) == {Tensor} and set(map(_KIND, named)) == {_INT64}:
        flat = torch.cat(named)
        if list(map(Tensor.numel, named)) == rows and (not flat.numel() or int(flat.min()) >= 0):
            return flat, 0
    parts: list[Tensor] = []
    taken = 0
    for a, (n, add) in enumerate(zip(rows, adds)):
        given = _given(a, n, add)
        if order is None:
            if given is None:
                raise BatchSizeError(
                    f"add #{a}: no indices=, and no loader observed or sampler given: the "
                    f"Collector cannot tell which samples these rows are; {OBSERVE}"
                )
            parts.append(given)
            continue
        left = order.numel() - taken
        if n > left:
            raise BatchSizeError(
                f"add #{a}: {n} row(s), but the sampler has {left} of its {order.numel()} "
                f"indices left for this rank (the adds before it hold {taken} rows): add each "
                "batch once"
            )
        ahead = order[taken : taken + n]
        if given is not None and not torch.equal(given, ahead):
            raise BatchSizeError(
                f"add #{a}: indices= {given[:8].tolist()} are not the next indices its sampler "
                f"handed out, {ahead[:8].tolist()}: pass indices= on every add, or on none"
            )
        parts.append(ahead)
        taken += n
    if not parts:
        return torch.zeros(0, dtype=torch.int64), taken
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), taken


def _loop_indices(rows: list[int], adds: list[_Add], source: _Rows) -> tuple[Tensor, int]:
    """:func:`_indices` in an observed loop. An add made in the loop takes rows of the batch
    the loop last yielded: the next ones of it, or those its ``indices=`` names (rows of that
    batch, in any order); a batch's adds that take rows by counting hold all its rows (split
    or whole) or none (a skipped batch). Adds made after the loop ended name their rows (rows
    the loop received that no add took), or take whole batches in turn, after the last batch an
    add in the loop took rows of, through the last one the loop received."""
    order, ends = source.order, source.ends
    assert order is not None and ends is not None
    at = list(map(_YIELDED, adds))  # (in add order: 0 first, -1 last, others ascending)
    if at[0] > 0 and at[-1] > 0 and all(a.indices is None for a in adds):
        held: dict[int, int] = {}  # the usual loops: in it, nothing named, batches whole
        for n, y in zip(rows, at):
            held[y] = held.get(y, 0) + n
        if all(ends[y] - ends[y - 1] == n for y, n in held.items()):
            if len(held) == at[-1]:  # (every batch, in turn)
                return order[: ends[at[-1]]], ends[at[-1]]
            return torch.cat([order[ends[y - 1] : ends[y]] for y in held]), sum(rows)
    parts: list[Tensor] = []
    pos = [0] * (len(ends) - 1)  # rows of each batch the adds in the loop took
    free: dict[int, Counter[int]] = {}  # batches an add in the loop named rows of: rows left
    counted: dict[int, int] = {}  # batches an add in the loop took rows of by counting: its #
    last = -1  # the last batch an add in the loop took rows of
    named: bool | None = None  # whether the adds after the loop name their rows
    left: Counter[int] | None = None  # the rows no add took, for those that name them
    start = cursor = 0  # where the adds after the loop that count start, and go on
    bounds: set[int] = set()  # where batches end
    for a, (n, add) in enumerate(zip(rows, adds)):
        given = _given(a, n, add)
        if add.yielded < 0:  # (made after the loop ended)
            if named is None:
                named, start, bounds = given is not None, ends[last + 1], set(ends)
                cursor = start
            elif named != (given is not None):
                raise BatchSizeError(
                    f"add #{a}: made after the loop, {'without' if named else 'with'} "
                    "indices=, beside adds after the loop that are not: pass indices= on every "
                    "add made after the loop, or on none"
                )
            if given is not None:
                if left is None:
                    left = Counter(order.tolist())
                    left.subtract(torch.cat(parts).tolist() if parts else [])
                wanted = Counter(given.tolist())
                if wanted - left:
                    raise BatchSizeError(
                        f"add #{a}: indices= {given[:8].tolist()} are not rows the loop "
                        "received that no add before it took (it was made after the loop)"
                    )
                left.subtract(wanted)
            else:
                end = cursor + n
                if end not in bounds:
                    sizes = [e - s for s, e in pairwise(ends) if s >= cursor][:8]
                    raise BatchSizeError(
                        f"add #{a}: made after the loop, with {n} row(s), but the batches the "
                        f"loop received next hold {sizes or 'no'} row(s): an add made after "
                        "the loop takes whole batches, in turn (those after the adds in the "
                        f"loop); {_OWN_ROWS}"
                    )
                given, cursor = order[cursor:end], end
            parts.append(given)
            continue
        b = add.yielded - 1
        if b < 0:
            raise BatchSizeError(
                f"add #{a}: made before the loop received its first batch, so it belongs to no "
                "batch: add each batch's outputs inside the loop, after the batch"
            )
        first, m, p = ends[b], ends[b + 1] - ends[b], pos[b]
        if p + n > m:
            raise BatchSizeError(
                f"add #{a}: {n} row(s), but when it was made the loop was on its batch #{b}, "
                f"and the loader has {m - p} of its {m} indices left for that batch (the adds "
                "before it took the rest): add each batch's outputs once, inside the loop after "
                f"the batch; {_OWN_ROWS}"
            )
        batch = order[first : first + m]
        took = batch[p : p + n] if given is None else given
        rest = free.get(b)
        if rest is None and given is not None:  # (less what the adds before it counted)
            rest = free[b] = Counter(batch[p:].tolist())
        if rest is not None:
            wanted = Counter(took.tolist())
            if wanted - rest:
                if given is None:
                    raise BatchSizeError(
                        f"add #{a}: takes the next {n} row(s) of batch #{b}, "
                        f"{took[:8].tolist()}, which an add before it named with indices=: "
                        "pass indices= on every add of a batch, or on none"
                    )
                raise BatchSizeError(
                    f"add #{a}: indices= {given[:8].tolist()} are not the rows of the batch the "
                    f"loop was on when it was made (its batch #{b}: {batch[:8].tolist()}), or "
                    "repeat rows an add before it took: indices= names rows of that batch"
                )
            rest.subtract(wanted)
        if given is None:
            counted.setdefault(b, a)
        parts.append(took)
        pos[b], last = p + n, b
    for b, a in counted.items():  # taken by counting: all of its rows, or its rows lie
        if pos[b] < ends[b + 1] - ends[b]:
            raise BatchSizeError(
                f"the adds made while the loop was on its batch #{b} (add #{a} first) hold "
                f"{pos[b]} of its {ends[b + 1] - ends[b]} rows: with fewer rows than the batch "
                f"has samples, the Collector cannot tell which rows are which; {_OWN_ROWS}"
            )
    if named is False and cursor != ends[-1]:
        raise BatchSizeError(
            f"the adds made after the loop hold {cursor - start} of the {ends[-1] - start} rows "
            "of the batches the loop received after those the adds in it took: adds made "
            f"after the loop take all these batches, in turn; {_OWN_ROWS}"
        )
    if not parts:
        return torch.zeros(0, dtype=torch.int64), 0
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), sum(rows)


_OWN_ROWS = (
    "a collate_fn that drops, adds or reorders samples needs add(outputs, indices=ids) with "
    "each row's dataset index, carried in the batch (checked against the batch's indices)"
)
_YIELDED = operator.attrgetter("yielded")


_KIND = operator.attrgetter("dtype", "device", "ndim")
_INT64 = (torch.int64, torch.device("cpu"), 1)


def _given(a: int, n: int, add: _Add) -> Tensor | None:
    """Add ``#a``'s own ``indices=``, as a tensor, one for each of its ``n`` rows (or None)."""
    if add.indices is None:
        return None
    given = index_tensor(add.indices, f"add #{a}: indices=")
    if given.numel() != n:
        raise BatchSizeError(
            f"add #{a}: indices= has {given.numel()} index(es) for {n} row(s) of per-sample outputs"
        )
    return given


def _complete(taken: int, source: _Rows, partial: bool) -> None:
    """Raise (on every rank, after the exchange) when this rank's adds lack rows of its epoch:
    every index its sampler chain would give with nothing dropped (:mod:`.drops`)."""
    order, seen = source.order, source.seen
    if partial or order is None:
        return
    reasons: list[tuple[str, str]] = []
    if seen is not None and not seen.finished:
        of = f" of its loader's {seen.length}" if seen.length is not None else ""
        got = f"added {taken} of their {order.numel()} row(s)"
        why = (
            "; it received as many batches as len(loader) but never asked for the next, which "
            "ends the loader (zip() with a shorter iterable, islice(): iterate the observed "
            "loader first in zip(), or to its end)"
            if seen.yielded == seen.length
            else ""
        )
        text = f"its loop stopped early (yielded {seen.yielded}{of} batch(es), {got}){why}"
        reasons.append((STOPPED, text))
    elif taken != order.numel():
        how = "its loader yielded" if seen is not None else "its sampler holds"
        why = "" if seen is not None else " (a loader's drop_last? Collector(loader) knows it)"
        text = f"it added {taken} of the {order.numel()} row(s) {how} this epoch{why}"
        reasons.append((FEWER, text))
    if source.drops:
        counts = [d.samples for d in source.drops]
        many = "samples" if None in counts else f"{sum(c or 0 for c in counts)} sample(s)"
        listed = ", and ".join(d.text for d in source.drops)
        reasons.append((DROPPED, f"its loader drops {many} of the dataset: {listed}"))
    if reasons:
        raise _Short(reasons)


def _raise_differences(present: list[tuple[int, Any]]) -> NoReturn:
    """The ranks' adds differ in structure, or (the same structure) in which leaves are per
    sample: name them."""
    named = {
        SAMPLES: "per sample",
        ITEMS: "a per-sample list",
        ROWS: "laid out by rows",
        PER_ADD: "one value per add",
    }
    shapes = [pickle.loads(p.shape) for _, p in present]
    same = all(s[0] == shapes[0][0] for s in shapes)

    def said(up: Any, kinds: list[int]) -> list[tuple[str, str, Any]]:
        leaf = iter(kinds)
        return [
            (at, f"{is_}, {named[next(leaf)]}" if same and is_ == "a leaf" else is_, metadata)
            for at, is_, metadata in errors.node_rows(up)
        ]

    errors.raise_structure_mismatch([r for r, _ in present], [said(u, k) for u, k, _ in shapes])
