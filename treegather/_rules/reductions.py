"""The gather rules that reduce over the replicas: mean (weighted by rows, or by weights taken
from each replica's inputs) and sum.

Of tensors or of numbers (Python's and numpy's scalars: :mod:`.numbers`), elementwise; see
:mod:`.leafwise` for what every leaf-wise rule checks.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from .._caches import FAST_PATHS
from .._errors import ArgumentTypeError, LayoutError, WeightError, safe_repr
from .._tree import describe, dtype_text, shape_text
from .base import Combining, Problem, by_replica, constructor, is_number
from .leafwise import LeafRule, one_dtype, to_target
from .numbers import mean_of, result_type_name, sum_of

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
            weighted = ""
            if mean:
                weight = getattr(self, "weight", None)
                weighted = (
                    " (weighted by sizes when given)"
                    if weight is None
                    else f" (weighted by {_name(weight)}(*args, **kwargs) of each shard's call)"
                )
            return f"Tensor{shape_text(list(x.shape))} {dtype_text(dtype)}{weighted}", None
        if is_number(x):
            return result_type_name(x, mean), None
        return self.refused(x)


@dataclasses.dataclass(frozen=True)
class Mean(_Reduction, name="mean"):
    """The mean over the replicas, weighted by their rows when the sizes are known, or by the
    weight ``weight`` finds in each replica's inputs."""

    verb: ClassVar[str] = "average"
    weight: Callable[..., Any] | None = None

    def describe(self) -> str:
        return "mean()" if self.weight is None else f"mean(weight={_name(self.weight)})"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if self.weight is not None:
            sizes: tuple[float, ...] | None = self.weights(ctx)
            if len(col) == 1:
                sizes = None  # one replica: its value, whatever it weighs
        else:
            sizes = ctx.sizes
            if sizes is not None and builtins.sum(sizes) == 0:
                if len(sizes) > 1:  # weights that are all zero weigh nothing: no mean to take
                    raise ValueError(
                        "mean() weighted by sizes needs sizes that add up to more than 0"
                    )
                sizes = None  # an empty batch (one empty shard): nothing to weight by
        if sizes is not None and FAST_PATHS.on and _losses(col, ctx.target) and all(sizes):
            # One loss per replica, float32/float64, no share of 0, 2 replicas (up to 4 on the
            # CPU, whose sum adds so few in order): each times its share, added in order, as
            # _weighted_mean computes it bit for bit, in three ops instead of seven
            total = builtins.sum(sizes)
            out = col[0] * (sizes[0] / total)
            for v, s in zip(col[1:], sizes[1:], strict=True):
                out = out + v * (s / total)
            return out
        if all(is_number(v) for v in col):
            return mean_of(col, sizes)  # (exact; weights that are all 0: NaN)
        one_dtype(col)
        if sizes is not None and 0 in sizes and any(sizes):
            # A replica that weighs 0 takes no part, and no gradient flows into it: its value
            # (the NaN mean of an empty shard, a class-weighted loss over 0/0) would give NaN
            # gradients even times 0. Its shape is checked all the same.
            if len({v.shape for v in col}) > 1:
                raise ValueError("per-replica tensors have different shapes")
            col = tuple(v for v, s in zip(col, sizes, strict=True) if s)
            sizes = tuple(s for s in sizes if s)
        stacked = torch.stack(to_target(col, ctx.target))
        if not (stacked.is_floating_point() or stacked.is_complex()):
            stacked = stacked.to(torch.get_default_dtype())
        return stacked.mean(0) if sizes is None else _weighted_mean(stacked, sizes)

    def weights(self, ctx: Combining) -> tuple[float, ...]:
        """What ``weight`` finds in each replica's inputs (``weight(*args, **kwargs)``): ints
        and floats, each finite and >= 0. A typed error naming the rule for a ``weight`` that
        does not take the call or raises (:class:`WeightError`, from its exception), for a
        weight that is no real number, is negative, NaN or infinite, or for a gather without
        inputs; the combine step adds the path."""
        weight = self.weight
        assert weight is not None
        shown = self.describe()
        if ctx.inputs is None:
            raise LayoutError(
                f"{shown} weighs each replica by what {_name(weight)} counts in its inputs, "
                "and this gather has none: data_parallel, DataParallel and patch pass each "
                "shard's call; elsewhere gather with mean() and sizes=[each replica's count] "
                "(treegather.distributed: each rank's count as sizes=)"
            )
        out = []
        for r, (args, kwargs) in enumerate(ctx.inputs):
            try:
                value = weight(*args, **kwargs)
            except Exception as exc:
                raise WeightError(_failed(weight, shown, r, args, kwargs, exc)) from exc
            out.append(_weight(value, r, shown))
        return tuple(out)

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        shown = shown or self.describe()
        sizes = ctx.sizes
        if self.weight is None and sizes is not None and len(sizes) > 1 and not any(sizes):
            # (first: of numbers too, which the leaf-wise checks accept)
            return Problem(f"{shown} is weighted by sizes {list(sizes)}, which add up to 0")
        return super().problem(col, ctx, shown)


_WIDE_FLOATS = (torch.float32, torch.float64)


def _losses(col: tuple[Any, ...], target: torch.device) -> bool:
    """2 (on the CPU up to 4) 0-dim float32 or float64 tensors of one dtype, on ``target``."""
    first = col[0]
    if not (len(col) == 2 or (len(col) <= 4 and target.type == "cpu")):
        return False  # (more: torch's sum adds them in another order, and a GPU's may too)
    if type(first) is not Tensor or first.dim() or first.dtype not in _WIDE_FLOATS:
        return False
    dtype = first.dtype
    return all(
        type(v) is Tensor and not v.dim() and v.dtype is dtype and v.device == target for v in col
    )


def _name(fn: Callable[..., Any]) -> str:
    """How a message names a callable: its qualified name (``tokens``, ``<lambda>``)."""
    name = getattr(fn, "__qualname__", None)
    return name.rpartition("<locals>.")[2] if isinstance(name, str) else safe_repr(fn)


def _weight(value: Any, r: int, shown: str) -> float:
    """Replica ``r``'s weight: a real number (an int or a float, numpy's too) or a 0-dim real
    tensor (read back: on a GPU, one sync), finite and >= 0; ints stay ints (exact means)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.dtype not in (torch.bool,) and not value.is_complex():
            value = value.item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        w: float = operator.index(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        w = float(value)
    else:
        raise ArgumentTypeError(
            f"{shown}: the weight of replica {r} must be a number >= 0 (an int, a float or a "
            "0-dim tensor, e.g. (labels != -100).sum() or class_weight[labels].sum()), got "
            f"{describe(value)}"
        )
    if not w >= 0 or w == math.inf:  # (NaN is not >= 0)
        raise WeightError(
            f"{shown}: the weight of replica {r} is {w}, and a weight is a finite number >= 0"
        )
    return w


def _failed(
    weight: Callable[..., Any],
    shown: str,
    r: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exc: BaseException,
) -> str:
    """The message for a ``weight`` that raised on replica ``r``'s call: whether its signature
    does not take the call (the usual mistake: keywords it has no parameter for), or it failed
    inside, then the call's shape and the exception."""
    name = _name(weight)
    call = f"{len(args)} positional argument(s)"
    if kwargs:
        call += " and keyword(s) " + ", ".join(map(safe_repr, kwargs))
    try:
        inspect.signature(weight).bind(*args, **kwargs)
        takes = True
    except TypeError:
        takes = False
    except ValueError:  # (no signature to read: a builtin)
        takes = True
    said = safe_repr(exc, None, text=str)
    raised = type(exc).__name__ + (f": {said}" if said else "")
    if takes:
        return f"{shown}: {name} raised {raised} on replica {r}'s call ({call})"
    return (
        f"{shown}: {name} does not take replica {r}'s call, which has {call} ({raised}); the "
        "weight is called as the replica was, weight(*args, **kwargs): take what it does not "
        "read as **_, e.g. lambda labels, **_: (labels != -100).sum()"
    )


# The dtype torch's mean accumulates in, where it is not the input's (at::opmath_type).
_ACCUMULATE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
}


def _weighted_mean(stacked: Tensor, sizes: Sequence[float]) -> Tensor:
    """The mean of ``stacked`` along dim 0 weighted by ``sizes`` (adding up to more than 0),
    accumulated as :func:`torch.mean` does (float16 and bfloat16 in float32), each value times
    its share of the rows (so no product exceeds the value: a float16 loss of 100 times 4096
    rows would be inf), and returned in the input's dtype. (:meth:`Mean.combine` leaves out the
    replicas of 0 rows while any replica has rows; weights that are all 0 come here: each
    value is replaced by 0 before it is weighted by NaN, which gives it a zero gradient.)"""
    dtype = stacked.dtype
    wide = _ACCUMULATE.get(dtype, dtype)
    total = builtins.sum(sizes)
    shape = (-1,) + (1,) * (stacked.dim() - 1)
    # (Weights that are all 0, from mean(weight=f): the mean of no items, NaN, no gradient.)
    shared = [s / total if total else math.nan for s in sizes]
    shares = torch.tensor(shared, dtype=wide, device=stacked.device)
    values = stacked.to(wide)
    if 0 in sizes:
        kept = torch.tensor([s > 0 for s in sizes], device=stacked.device).reshape(shape)
        values = torch.where(kept, values, torch.zeros((), dtype=wide, device=stacked.device))
    return (values * shares.reshape(shape)).sum(0).to(dtype)


@dataclasses.dataclass(frozen=True)
class Sum(_Reduction, name="sum"):
    """The elementwise sum over the replicas."""

    verb: ClassVar[str] = "add"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if all(is_number(v) for v in col):
            return sum_of(col)  # (exact: numpy's narrow ints added as int64, as numpy.sum does)
        one_dtype(col)
        return torch.stack(to_target(col, ctx.target)).sum(0)


@constructor(Mean)
def mean(*, weight: Callable[..., Any] | None = None) -> Mean:
    """Gather rule: the mean of the per-replica values, weighted by shard sizes when known, or
    by the weight ``weight`` finds in each shard's inputs.

    With ``gather(..., sizes=[...])`` (which :func:`treegather.data_parallel` passes for you) the
    mean of per-shard batch means equals the full-batch mean, even for uneven splits. Integer
    tensors are promoted to the default float dtype. Python numbers give a Python float, numpy
    scalars the dtype :func:`numpy.mean` gives (float64 for integers, else their own), computed
    from their exact values, so that they never overflow: ``numpy.int8(100)`` twice is ``100.0``,
    ``numpy.float16(60000)`` twice ``60000``. Sizes that add up to 0 are a
    :class:`ShapeMismatchError` (there is no mean to weigh).

    The weighted mean accumulates as :func:`torch.mean` does: float16 and bfloat16 values (and
    complex32) in float32, other dtypes in their own, each value multiplied by its share of the
    rows (``sizes[i] / sum(sizes)``, so no product is larger than the value), and the result
    comes back in the values' dtype: a float16 loss of 100.0 over two shards of 4096 rows is
    100.0, not ``inf``. A replica of 0 rows (``sizes[i] == 0``) takes no part in the mean: its
    value (torch's mean of an empty batch is NaN) neither reaches the result nor gets a
    gradient (none flows into it, so no NaN either). Without ``sizes`` it is the plain
    :func:`torch.mean` of the per-replica values. The result is differentiable either way.

    Weights from the data: a loss that averages over something other than rows (tokens whose
    label is not ``-100``, the frames of a padded utterance, the targets' class weights) is
    exact only weighted by what it averages over. ``weight`` finds that for one shard: after the
    replicas ran, it is called once per replica (at every position the rule applies to) with
    that shard's call, exactly as the replica was called, ``weight(*args, **kwargs)``: ``args``
    the shard's positional inputs, ``kwargs`` its keyword inputs, split and on the shard's
    device. So for ``data_parallel(model, (), devices, module_kwargs=batch)`` and
    ``DataParallel(model)(**batch)`` (every Hugging Face model) it is ``weight(**shard)``, the
    shard's keyword arguments, e.g. ``lambda labels, **_: (labels != -100).sum()`` (for a causal
    LM, which shifts its labels by one, ``(labels[:, 1:] != -100).sum()``); for
    ``data_parallel(fn, batch)`` it is ``weight(shard)``. It returns the shard's weight, any
    real number >= 0: a count (an int, a 0-dim integer tensor) or a sum of real weights (a
    float, a 0-dim floating tensor: for ``CrossEntropyLoss(weight=w)`` or ``NLLLoss(weight=w)``
    with the mean reduction, ``w[labels].sum()``, labels ``ignore_index`` left out), read back
    as a Python number (on a GPU, one synchronisation per replica). The result is the mean
    weighted by these instead of the rows, accumulated as above; a replica that weighs 0 takes
    no part (its NaN loss included), and when every replica weighs 0 it is NaN (the mean of no
    items, as a one-device loss over no tokens), with no gradient. A weight below 0, NaN or
    infinite, and a ``weight`` that does not take the shard's call (a keyword it has no
    parameter for: end it with ``**_``) or raises, are a :class:`WeightError` naming the path
    and the rule (the exception ``weight`` raised is its ``__cause__``); a weight that is no
    real number, an :class:`ArgumentTypeError`. Only a gather that follows a call has its
    inputs: :func:`treegather.data_parallel`, :class:`treegather.DataParallel` and
    :func:`treegather.patch` pass them (:func:`treegather.explain` shows the weight); a
    :func:`treegather.gather` of outputs alone, or across processes, raises a
    :class:`LayoutError` (there, pass each replica's count as ``sizes=``).

    Args:
        weight: ``weight(*args, **kwargs) -> number >= 0`` for each shard's call, or ``None``
            (rows).

    >>> import torch, treegather as tg
    >>> tg.gather([torch.tensor(1.0), torch.tensor(4.0)], "cpu", tg.mean(), sizes=[2, 1])
    tensor(2.)
    >>> half = [torch.tensor(100.0, dtype=torch.float16)] * 2
    >>> tg.gather(half, "cpu", tg.mean(), sizes=[4096, 4096])
    tensor(100., dtype=torch.float16)
    >>> tg.gather([torch.tensor(1.0), torch.tensor(float("nan"))], "cpu", tg.mean(), sizes=[3, 0])
    tensor(1.)
    >>> def token_loss(scores, labels):  # a mean over the labels that are not -100
    ...     return {"loss": scores[labels != -100].mean()}
    >>> batch = {"scores": torch.arange(8.0).view(4, 2),
    ...          "labels": torch.tensor([[1, 1], [1, -100], [-100, -100], [1, 1]])}
    >>> tokens = lambda labels, **_: (labels != -100).sum()
    >>> tg.data_parallel(token_loss, (), ["cpu"] * 2, module_kwargs=batch,
    ...                  out_layout={"loss": tg.mean(weight=tokens)})
    {'loss': tensor(3.2000)}
    >>> token_loss(**batch)  # one device; mean() would weigh the shards by rows: 3.75
    {'loss': tensor(3.2000)}
    >>> w = torch.tensor([1.0, 4.0])  # class weights: the loss averages over w[labels]
    >>> loss = lambda scores, labels: torch.nn.functional.cross_entropy(scores, labels, weight=w)
    >>> scores = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 3.0]])
    >>> labels = torch.tensor([0, 0, 1, 1])
    >>> tg.data_parallel(loss, (scores, labels), ["cpu"] * 2,
    ...                  out_layout=tg.mean(weight=lambda scores, labels: w[labels].sum()))
    tensor(0.4407)
    >>> loss(scores, labels)  # one device; mean() by rows would give 0.5455
    tensor(0.4407)
    """
    if weight is not None and not callable(weight):
        raise ArgumentTypeError(
            f"mean(weight=...) takes a callable weighing a shard's inputs, got {describe(weight)}"
        )
    return Mean(weight)


@constructor(Sum)
def sum() -> Sum:
    """Gather rule: the elementwise sum of the per-replica values.

    Tensors add as :func:`torch.sum` adds them (integers and bools in int64). Python numbers
    give their Python sum; numpy scalars their exact sum in the dtype :func:`numpy.sum` gives
    (integers narrower than 64 bits in int64, unsigned in uint64: ``numpy.int8(100)`` twice is
    ``200``, not ``-56``): a float sum beyond its dtype is ``inf``, as a tensor's is, and an
    integer sum that int64 (uint64) cannot hold is a :class:`ShapeMismatchError`, where numpy
    and torch would wrap around.

    >>> import torch, treegather as tg
    >>> tg.gather([{"n": torch.tensor(2)}, {"n": torch.tensor(3)}], "cpu", tg.sum())
    {'n': tensor(5)}
    """
    return Sum()
