"""The gather rules that reduce over the replicas: mean (weighted by rows) and sum.

Of tensors or of Python numbers, elementwise; see :mod:`.leafwise` for what every leaf-wise
rule checks.
"""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any

import torch

from .._tree import dtype_text, shape_text
from .base import Combining, Problem, by_replica, constructor, is_number
from .leafwise import LeafRule, one_dtype, to_target

__all__ = ["Mean", "Sum", "mean", "sum"]

Tensor = torch.Tensor


class _Reduction(LeafRule):
    """``mean`` and ``sum``: elementwise over the replicas, of tensors or of numbers."""

    numbers = True

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        if len(set(shapes)) > 1:
            return Problem(f"{shown} needs equal shapes, got {by_replica(shapes)}", hint="shape")
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        mean = isinstance(self, Mean)
        if isinstance(x, Tensor):
            dtype = x.dtype
            if mean and not (x.is_floating_point() or x.is_complex()):
                dtype = torch.get_default_dtype()
            weighted = " (weighted by sizes when given)" if mean else ""
            return f"Tensor{shape_text(list(x.shape))} {dtype_text(dtype)}{weighted}", None
        if is_number(x):
            return ("float" if mean else type(x).__qualname__), None
        return "-", f"{self.describe()} needs a tensor or a number, got {type(x).__qualname__}"


@dataclasses.dataclass(frozen=True)
class Mean(_Reduction, name="mean"):
    """The mean over the replicas, weighted by their rows when the sizes are known."""

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        sizes = ctx.sizes
        if sizes is not None and builtins.sum(sizes) == 0:
            if len(sizes) > 1:  # weights that are all zero weigh nothing: no mean to take
                raise ValueError("mean() weighted by sizes needs sizes that add up to more than 0")
            sizes = None  # an empty batch (one empty shard): nothing to weight by
        if all(is_number(v) for v in col):
            if sizes is None:
                return builtins.sum(col) / len(col)
            total = builtins.sum(sizes)
            if all(type(v) is int for v in col):  # exact
                return builtins.sum(v * s for v, s in zip(col, sizes)) / total
            # Each value times its share of the rows: never a product larger than the value (a
            # numpy float16 times 4096 rows overflows); a share of 0 leaves the value out (NaN).
            return builtins.sum(v * (s / total) for v, s in zip(col, sizes) if s)
        one_dtype(col)
        stacked = torch.stack(to_target(col, ctx.target))
        if not (stacked.is_floating_point() or stacked.is_complex()):
            stacked = stacked.to(torch.get_default_dtype())
        return stacked.mean(0) if sizes is None else _weighted_mean(stacked, sizes)

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        sizes = ctx.sizes
        if sizes is not None and len(sizes) > 1 and not any(sizes):
            return Problem(f"{shown} is weighted by sizes {list(sizes)}, which add up to 0")
        return super().shape_problem(shapes, dtype, ctx, shown)


# The dtype torch's mean accumulates in, where it is not the input's (at::opmath_type).
_ACCUMULATE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
}


def _weighted_mean(stacked: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """The mean of ``stacked`` along dim 0 weighted by ``sizes`` (adding up to more than 0),
    accumulated as :func:`torch.mean` does (float16 and bfloat16 in float32), each value times
    its share of the rows (so no product exceeds the value: a float16 loss of 100 times 4096
    rows would be inf), and returned in the input's dtype. A replica of 0 rows takes no part:
    its value (the NaN mean of an empty batch) is replaced by 0 before it is weighted by 0,
    which also gives it a zero gradient rather than a NaN one."""
    dtype = stacked.dtype
    wide = _ACCUMULATE.get(dtype, dtype)
    total = builtins.sum(sizes)
    shape = (-1,) + (1,) * (stacked.dim() - 1)
    shares = torch.tensor([s / total for s in sizes], dtype=wide, device=stacked.device)
    values = stacked.to(wide)
    if 0 in sizes:
        kept = torch.tensor([s > 0 for s in sizes], device=stacked.device).reshape(shape)
        values = torch.where(kept, values, torch.zeros((), dtype=wide, device=stacked.device))
    return (values * shares.reshape(shape)).sum(0).to(dtype)


@dataclasses.dataclass(frozen=True)
class Sum(_Reduction, name="sum"):
    """The elementwise sum over the replicas."""

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if all(is_number(v) for v in col):
            return builtins.sum(col)
        one_dtype(col)
        return torch.stack(to_target(col, ctx.target)).sum(0)


@constructor(Mean)
def mean() -> Mean:
    """Gather rule: the mean of the per-replica values, weighted by shard sizes when known.

    With ``gather(..., sizes=[...])`` (which :func:`treegather.data_parallel` passes for you) the
    mean of per-shard batch means equals the full-batch mean, even for uneven splits. Integer
    tensors are promoted to the default float dtype; Python numbers give a Python float.

    The weighted mean accumulates as :func:`torch.mean` does: float16 and bfloat16 values (and
    complex32) in float32, other dtypes in their own, each value multiplied by its share of the
    rows (``sizes[i] / sum(sizes)``, so no product is larger than the value), and the result
    comes back in the values' dtype: a float16 loss of 100.0 over two shards of 4096 rows is
    100.0, not ``inf``. A replica of 0 rows (``sizes[i] == 0``) takes no part in the mean: its
    value (torch's mean of an empty batch is NaN) neither reaches the result nor gets a NaN
    gradient (its gradient is zero). Without ``sizes`` it is the plain :func:`torch.mean` of
    the per-replica values. The result is differentiable either way.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.tensor(1.0), torch.tensor(4.0)], "cpu", tg.mean(), sizes=[2, 1])
    tensor(2.)
    >>> half = [torch.tensor(100.0, dtype=torch.float16)] * 2
    >>> tg.gather(half, "cpu", tg.mean(), sizes=[4096, 4096])
    tensor(100., dtype=torch.float16)
    >>> tg.gather([torch.tensor(1.0), torch.tensor(float("nan"))], "cpu", tg.mean(), sizes=[3, 0])
    tensor(1.)
    """
    return Mean()


@constructor(Sum)
def sum() -> Sum:
    """Gather rule: the elementwise sum of the per-replica values.

    >>> import torch, treegather as tg
    >>> tg.gather([{"n": torch.tensor(2)}, {"n": torch.tensor(3)}], "cpu", tg.sum())
    {'n': tensor(5)}
    """
    return Sum()
