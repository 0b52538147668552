"""``sync_grads=True``: gradients through :func:`treegather.distributed.all_gather`.

The forward is the usual exchange; what changes is that every rank's tensor leaves that require
grad (every rank knows which: the wire plan's digest, or the full exchange's headers, carries
them) come out of one autograd function, :class:`_Exchanged`, whose inputs are this rank's own
such leaves. The rules then combine them with ordinary differentiable torch ops, so any rule
(``cat`` of uneven rows, ``stack``, ``pad``, ``mean``, ``sum``, a custom callable) passes
gradients back to every rank's values.

The backward is one collective for the whole tree: each rank lays out the gradients it got for
every rank's values, in one flat buffer of one wide dtype (the same layout on every rank), and
an all-reduce sums them; each rank keeps its own part. That is the gradient of the sum of every
rank's loss with respect to this rank's contribution, as with
``torch.distributed.nn.functional.all_gather``. Every rank must therefore run the backward
(each rank's loss depends on the gathered result): a rank that has nothing of its own that
requires grad still takes part (its function has an empty input that does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["connect"]

Tensor = torch.Tensor


def connect(
    per_rank: list[list[Any]],
    grads: Sequence[Sequence[int]],
    own: Sequence[Tensor],
    rank: int,
    group: Any,
    device: torch.device,
) -> None:
    """Replace, in every rank's leaves, the values at that rank's ``grads`` positions by outputs of
    one autograd function whose inputs are this rank's own leaves ``own`` (in place).

    ``grads[r]`` are the positions of rank ``r``'s leaves that require grad; ``own`` are this
    rank's tensors at ``grads[rank]``. ``device`` is where the backward's all-reduce runs.
    """
    if not any(grads) or not torch.is_grad_enabled():
        return
    received = [per_rank[r][i] for r, positions in enumerate(grads) for i in positions]
    sizes = [len(positions) for positions in grads]
    anchor = torch.empty(0, requires_grad=True)  # every rank takes part in the backward
    outputs = _Exchanged.apply((received, sizes, rank, group, device), anchor, *own)
    k = 0
    for r, positions in enumerate(grads):
        for i in positions:
            per_rank[r][i] = outputs[k]
            k += 1


class _Exchanged(torch.autograd.Function):
    """Every rank's values (received) as functions of this rank's own: gradients all-reduced."""

    @staticmethod
    def forward(
        ctx: Any, info: tuple[Any, ...], anchor: Tensor, *own: Tensor
    ) -> tuple[Tensor, ...]:
        received, sizes, rank, group, device = info
        ctx.sizes = sizes
        ctx.rank = rank
        ctx.group = group
        ctx.device = device
        ctx.shapes = [t.shape for t in received]
        ctx.dtypes = [t.dtype for t in received]
        ctx.own = [(t.shape, t.dtype, t.device) for t in own]
        # New tensors (the received bytes are views of a buffer that may be reused).
        return tuple(t.clone() for t in received)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> tuple[Any, ...]:
        wide = _wide(ctx.dtypes)
        parts = [
            torch.zeros(shape.numel(), dtype=wide, device=ctx.device)
            if g is None
            else g.reshape(-1).to(device=ctx.device, dtype=wide)
            for g, shape in zip(grad_outputs, ctx.shapes)
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=wide, device=ctx.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        mine = ctx.shapes[start : start + ctx.sizes[ctx.rank]]
        offset = sum(s.numel() for s in ctx.shapes[:start])
        grads: list[Tensor] = []
        for shape, (own_shape, dtype, device) in zip(mine, ctx.own):
            n = shape.numel()
            grads.append(flat[offset : offset + n].view(own_shape).to(device=device, dtype=dtype))
            offset += n
        return (None, None, *grads)


def _wide(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """One dtype every gradient fits in without loss: float32 (or float64, or complex)."""
    complex_ = any(d.is_complex for d in dtypes)
    double = any(d in (torch.float64, torch.complex128) for d in dtypes)
    if complex_:
        return torch.complex128 if double else torch.complex64
    return torch.float64 if double else torch.float32
