"""``sync_grads=True``: gradients through :func:`treegather.distributed.all_gather`.

The forward is the usual exchange; what changes is that every rank's tensor leaves that require
grad (every rank knows which: the wire plan's digest, or the full exchange's headers, carries
them) come out of one autograd function, :class:`_Exchanged`, whose inputs are this rank's own
such leaves. The rules then combine them with ordinary differentiable torch ops, so any rule
(``cat`` of uneven rows, ``stack``, ``pad``, ``mean``, ``sum``, a custom callable) passes
gradients back to every rank's values.

The backward is one all-to-all for the whole tree, itself differentiable (:class:`_Summed`):
ARCHITECTURE.md, "The wire plan, in detail".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .. import _tree
from .._tree import rows_of

__all__ = ["connect", "unsynced"]

Tensor = torch.Tensor


def connect(
    per_rank: list[list[Any]],
    grads: Sequence[Sequence[int]],
    own: Sequence[Any],
    rank: int,
    group: Any,
    device: torch.device,
    parts: Sequence[Mapping[int, Sequence[int]]] | None = None,
) -> None:
    """Replace, in every rank's leaves, the values at that rank's ``grads`` positions by outputs of
    one autograd function whose inputs are this rank's own values ``own`` (in place).

    ``grads[r]`` are the positions of rank ``r``'s leaves that require grad; ``own`` are this
    rank's values at ``grads[rank]``. ``device`` is where the backward's all-to-all runs. A value
    laid out by rows (:class:`~treegather._tree.Rows`: a ``PackedSequence``), which travels
    detached, takes part with its tensors ``parts[r][i]`` (those that required grad on rank
    ``r``), and is rebuilt around their outputs.
    """
    if not any(grads) or not torch.is_grad_enabled():
        return
    which = parts if parts is not None else [{}] * len(grads)
    received = [
        [t for i in positions for t in _grad_tensors(per_rank[r][i], which[r].get(i, ()))]
        for r, positions in enumerate(grads)
    ]
    sizes = [len(tensors) for tensors in received]
    mine = [t for i, v in zip(grads[rank], own) for t in _grad_tensors(v, which[rank].get(i, ()))]
    anchor = torch.empty(0, requires_grad=True)  # every rank takes part in the backward
    flat = [t for tensors in received for t in tensors]
    outputs = iter(_Exchanged.apply((flat, sizes, rank, group, device), anchor, *mine))
    for r, positions in enumerate(grads):
        for i in positions:
            per_rank[r][i] = _replaced(per_rank[r][i], which[r].get(i, ()), outputs)


def _grad_tensors(value: Any, parts: Sequence[int]) -> list[Tensor]:
    """The tensors of a leaf that require grad: itself, or a value laid out by rows' ``parts``."""
    held = rows_of(value)
    if held is not None:
        found = held.tensors()[0]
        return [found[j] for j in parts]
    return [value]


def _replaced(value: Any, parts: Sequence[int], outputs: Iterator[Tensor]) -> Any:
    """``value`` with its tensors that require grad (``parts``, of a value laid out by rows)
    replaced by the next ``outputs``."""
    held = rows_of(value)
    if held is not None:
        found, rebuilt = held.tensors()
        tensors = list(found)
        for j in parts:
            tensors[j] = next(outputs)
        return rebuilt(tensors).held
    return next(outputs)


class _Exchanged(torch.autograd.Function):
    """Every rank's values (received) as functions of this rank's own: gradients summed."""

    @staticmethod
    def forward(
        ctx: Any, info: tuple[Any, ...], anchor: Tensor, *own: Tensor
    ) -> tuple[Tensor, ...]:
        received, ctx.sizes, ctx.rank, ctx.group, ctx.device = info
        ctx.shapes = [t.shape for t in received]
        ctx.dtypes = [t.dtype for t in received]
        ctx.own = [(t.shape, t.dtype, t.device) for t in own]
        # Views of the received bytes, not copies: a sync_grads call never reuses its buffer.
        return tuple(t.detach() for t in received)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> tuple[Any, ...]:
        wide = _wide(ctx.dtypes)
        parts = [
            torch.zeros(shape.numel(), dtype=wide, device=ctx.device)
            if g is None
            else g.reshape(-1).to(device=ctx.device, dtype=wide)
            for g, shape in zip(grad_outputs, ctx.shapes)
        ]
        ends = itertools.accumulate(ctx.sizes)
        counts = [sum(s.numel() for s in ctx.shapes[e - n : e]) for e, n in zip(ends, ctx.sizes)]
        mine = _Summed.apply((ctx.group, ctx.rank, counts, ctx.sizes), False, *parts)
        numels = [shape.numel() for shape, _, _ in ctx.own]
        grads = [
            part.view(shape).to(device=device, dtype=dtype)
            for part, (shape, dtype, device) in zip(mine.split(numels), ctx.own)
        ]
        return (None, None, *grads)


class _Summed(torch.autograd.Function):
    """Every rank's flat gradients ``parts`` (``sizes[r]`` of them, ``counts[r]`` elements, for
    rank ``r``'s values) summed over the ranks: this rank's, from one all-to-all of the other
    ranks' parts. ``spread``, its adjoint: this rank's part to every rank. Each is the other's
    backward, so derivatives of every order are exact."""

    @staticmethod
    def forward(ctx: Any, how: tuple[Any, ...], spread: bool, *parts: Tensor) -> Tensor:
        ctx.how, ctx.spread, ctx.numels = how, spread, [p.numel() for p in parts]
        group, rank, counts, sizes = how
        k, mine = len(counts), slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        theirs = [0 if r == rank else c for r, c in enumerate(counts)]  # (none to itself)
        ours = [0 if r == rank else counts[rank] for r in range(k)]
        others = [*parts[: mine.start], *parts[mine.stop :], parts[0][:0]]
        send = parts[0].repeat(k - 1) if spread else torch.cat(others)
        got = parts[0].new_empty(sum(theirs if spread else ours))
        dist.all_to_all_single(got, send, *((theirs, ours) if spread else (ours, theirs)), group)
        if spread:
            return torch.cat(
                [parts[0] if r == rank else p for r, p in enumerate(got.split(theirs))]
            )
        total = got if k == 2 else got.view(k - 1, counts[rank]).sum(0)
        for piece, own in zip(total.split(ctx.numels[mine]), parts[mine]):
            piece += own
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        group, rank, counts, _ = ctx.how
        if ctx.spread:  # (the flat parts of every rank: one per rank)
            ones = (group, rank, counts, [1] * len(counts))
            return None, None, _Summed.apply(ones, False, *grad.split(counts))
        return (None, None, *_Summed.apply(ctx.how, True, grad).split(ctx.numels))


def unsynced(out: Any, leaves: Sequence[Any] | None, tree: Any) -> Any:
    """``out`` of a call without ``sync_grads``: when this rank's ``leaves`` (``tree``'s) require
    grad, its tensors pass through :class:`_Unsynced`, so a backward there says what to do."""
    if not torch.is_grad_enabled():
        return out
    mine = _tree.flatten(tree)[0] if leaves is None else leaves
    if not any(
        x.requires_grad
        if isinstance(x, Tensor)
        else (held := rows_of(x)) is not None and held.requires_grad
        for x in mine
    ):
        return out
    anchor, (found, spec) = torch.empty(0, requires_grad=True), _tree.flatten(out)

    def passed(x: Any) -> Any:
        if isinstance(x, Tensor):
            return _guarded(anchor, x)
        held = rows_of(x)
        if held is not None:  # (its tensors a gradient could reach)
            tensors, rebuilt = held.tensors()
            return rebuilt([_guarded(anchor, t) if _float(t) else t for t in tensors]).held
        return x

    return spec.unflatten([passed(x) for x in found])


def _guarded(anchor: Tensor, x: Tensor) -> Tensor:
    """``x`` through :class:`_Unsynced`, where that keeps its type (a ``Parameter`` rebuilt
    from another rank's, a leaf by definition, stays the ``Parameter`` it was; a tensor
    without data is kept too)."""
    if isinstance(x, UninitializedTensorMixin):
        return x
    guarded = _Unsynced.apply(anchor, x)
    return guarded if type(guarded) is type(x) else x


def _float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Unsynced(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, value: Tensor) -> Tensor:
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        raise RuntimeError(
            "a backward reached the result of treegather.distributed.all_gather(...) called "
            "without sync_grads=True, which passes no gradient: pass sync_grads=True (gradients "
            "to every rank's tensors), or .detach() the tree before the call to gather constants"
        )


def _wide(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """One dtype every gradient fits in without loss: float32 (or float64, or complex)."""
    complex_ = any(d.is_complex for d in dtypes)
    double = any(d in (torch.float64, torch.complex128) for d in dtypes)
    if complex_:
        return torch.complex128 if double else torch.complex64
    return torch.float64 if double else torch.float32
