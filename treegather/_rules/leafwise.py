"""The gather rules that combine tensors leaf by leaf: what they share, and cat, stack and pad.

(``mean`` and ``sum`` are in :mod:`.reductions`.) On an inner node each applies to every leaf
below it. Each class combines one leaf's
per-replica values (:meth:`combine`: plain errors for bad data), says what is wrong with them
(:meth:`problem`: the checks every such rule makes -- tensors without data, unregistered
dataclasses, values that are no tensors, mixed dtypes, kinds of tensor torch cannot combine
that way (:mod:`.kinds`) -- then the rule's own, on the shapes) and what they become
(:meth:`becomes`).
"""

from __future__ import annotations

import builtins
import dataclasses
import numbers
import operator
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from .._errors import safe_repr
from .._tree import Rows, describe, dtype_text, rows_of, shape_text, type_name
from . import kinds
from .base import Combining, GatherRule, Problem, by_replica, constructor, is_number

__all__ = [
    "JOIN_ROWS",
    "Cat",
    "LeafRule",
    "Pad",
    "Padded",
    "Stack",
    "cat",
    "cat_values",
    "fill_fits",
    "fill_value",
    "one_dtype",
    "pad",
    "stack",
    "to_target",
]

Tensor = torch.Tensor
_DTYPE, _LAYOUT, _NESTED = map(operator.attrgetter, ("dtype", "layout", "is_nested"))
_ORDINARY, _STRIDED = kinds.ORDINARY, torch.strided


def one_dtype(col: Sequence[Tensor]) -> None:
    """Refuse per-replica tensors of several dtypes (torch would promote them: an int64 id
    becomes a float32 that cannot hold it); :meth:`LeafRule.problem` names each dtype."""
    first = col[0].dtype
    for v in col:
        if v.dtype != first:
            raise ValueError("per-replica tensors have different dtypes")


def to_target(values: Sequence[Tensor], target: torch.device) -> list[Tensor]:
    nb = target.type == "cuda"
    return [v if v.device == target else v.to(target, non_blocking=nb) for v in values]


def _times(n: int, k: int | None) -> int | str:
    return n * k if k is not None else f"k*{n}"


class LeafRule(GatherRule):
    """A gather rule that combines the tensors of one leaf (applied to each leaf below a node)."""

    numbers: ClassVar[bool] = False
    """Python numbers are values too (``mean``, ``sum``)."""
    verb: ClassVar[str] = "combine"
    """What the rule does to tensors, as its refusals say it (``"concatenate"``)."""
    widens: ClassVar[bool] = False
    """The replicas' shapes may differ in other dims (``pad``): :func:`.kinds.cannot` asks
    with tensors of two widths."""

    def probe(self) -> LeafRule:
        """The rule :func:`.kinds.cannot` asks whether a kind of tensor can be combined with:
        this class with its defaults (what torch can do does not depend on the dim)."""
        return type(self)()

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        """The checks every leaf-wise rule makes, then :meth:`shape_problem`.

        (Also run before tensors are moved between devices, for every leaf of every step: the
        common case, dense tensors of one usual dtype, costs a read or two per value; what
        torch refuses itself, a mix of kinds, is named when the combine failed.)"""
        shown = shown or self.describe()
        if any(type(v) is not Tensor and rows_of(v) is not None for v in col):
            return self.rows_problem(col, ctx, shown)
        meta_ok = ctx.target.type == "meta"
        types = list(map(type, col))
        if types.count(Tensor) == len(types):  # (plain tensors: no subclass, none uninitialized)
            empty = [] if meta_ok else [r for r, v in enumerate(col) if v.is_meta]
        else:  # (meta tensors, unless gathered onto the meta device; uninitialized ones)
            empty = [
                r
                for r, v in enumerate(col)
                if isinstance(v, Tensor) and ((v.is_meta and not meta_ok) or kinds.no_data(v))
            ]
            tensors = [isinstance(v, Tensor) for v in col]
            if not all(tensors) and not empty:
                found = _unknown_dataclasses(col)
                if found:
                    return Problem(
                        f"{found} is a dataclass treegather does not know, so {shown} cannot "
                        "look inside it; register it with treegather.register_dataclass",
                        True,
                        "dataclass",
                    )
                if self.numbers:
                    return _numbers_problem(col, tensors, shown)
                bad = tensors.index(False)
                return Problem(
                    f"{shown} needs tensors, replica {bad} holds {describe(col[bad])}",
                    True,
                    "shape",
                )
        if empty:
            text, hint = kinds.no_data_text(col[empty[0]], ctx.target, shown)
            replicas = ", ".join(f"replica {r}: {describe(col[r])}" for r in empty)
            return Problem(f"{text} ({replicas})", True, hint)
        dtypes = list(map(_DTYPE, col))
        if len(set(dtypes)) > 1:
            return Problem(
                f"{shown} needs one dtype in every replica, got "
                + ", ".join(f"replica {i}: {d}" for i, d in enumerate(dtypes)),
                hint="dtype",
            )
        mixed = ctx.failed and (len(set(map(_LAYOUT, col))) > 1 or len(set(map(_NESTED, col))) > 1)
        if mixed:  # (torch mixes no kinds: dense with sparse, nested, ...)
            return Problem(
                f"{shown} needs one kind of tensor in every replica, got "
                + ", ".join(f"replica {i}: {kinds.kind_text(v)}" for i, v in enumerate(col)),
                True,
                "kind",
            )
        first = col[0]
        if dtypes[0] not in _ORDINARY or first.layout is not _STRIDED or first.is_nested:
            # A kind torch may not combine (asked once per kind), after what the rule itself
            # refuses of the dtype (pad's fill); dense tensors of a usual dtype skip both here.
            problem = self.dtype_problem(dtypes[0], shown)
            if problem is None:
                why = kinds.cannot(self, first, ctx)
                if why:
                    problem = Problem(kinds.refusal(shown, self.verb, first, why), True, "kind")
            if problem is not None:
                return problem
        return self.shape_problem([tuple(v.shape) for v in col], dtypes[0], ctx, shown)

    def dtype_problem(self, dtype: torch.dtype, shown: str) -> Problem | None:
        """What is wrong with tensors of ``dtype`` under this rule, whatever torch can do."""
        return None

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        """What is wrong with tensors of these shapes (one dtype) under this rule."""
        return None

    def rows_problem(self, col: tuple[Any, ...], ctx: Combining, shown: str) -> Problem | None:
        """What is wrong with values of which one at least is laid out by rows (a
        ``PackedSequence``, a PyG graph batch: :func:`~treegather._tree.rows_of`): this rule
        does not apply to them (:meth:`Cat` with dim 0 joins them by rows)."""
        return Problem(_not_by_rows(shown, _rows_name(col)), True)

    def refused(self, x: Any) -> tuple[str, str | None]:
        """:meth:`becomes` for a value that is not a tensor: what the rule needs instead."""
        if rows_of(x) is not None:
            return "-", _not_by_rows(self.describe(), type_name(x))
        need = "a tensor or a number" if self.numbers else "a tensor"
        return "-", f"{self.describe()} needs {need}, got {type_name(x)}"


def _rows_name(col: Sequence[Any]) -> str:
    """The kind of the first value laid out by rows in ``col`` (``PackedSequence``)."""
    return type_name(next(v for v in col if rows_of(v) is not None))


def _not_by_rows(shown: str, name: str) -> str:
    return (
        f"{shown} does not apply to a {name}: its rows are not laid out along a dim of a tensor; "
        "cat() (dim 0, as the default does) joins it by its rows, as_list() keeps the "
        "per-replica values"
    )


def _only_by_rows(shown: str, name: str) -> str:
    return f"{shown} joins a {name} only by its rows, along dim 0: write cat() (or no rule)"


class _JoinRows(GatherRule):
    """The default rule of a value laid out by rows its own way (a ``PackedSequence``, a PyG
    graph batch: :func:`~treegather._tree.rows_of`), and what ``cat()`` (dim 0) does to one:
    every replica's rows, in order, joined by its own function (unpacked, joined, packed
    again), in the form the tree holds it."""

    def describe(self) -> str:
        return "rows joined"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if self.problem(col, ctx) is not None:
            raise TypeError("values that are not of one kind laid out by rows")
        values = [rows_of(v) for v in col]
        return Rows.join(values, ctx.target).held  # type: ignore[arg-type]

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        first = rows_of(col[0])
        for r, v in enumerate(col):
            rows = rows_of(v)
            if rows is None or first is None or rows.kind != first.kind:
                name = first.kind.name if first is not None else "value laid out by rows"
                return Problem(
                    f"{shown or self.describe()}: replica {r} holds {describe(v)} where replica 0 "
                    f"holds a {name}",
                    True,
                )
            problem = rows.problem()
            if problem is not None:
                return Problem(f"{shown or self.describe()}: replica {r} holds {problem}", True)
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        rows = rows_of(x)
        name = rows.kind.name if rows is not None else "value"
        return f"one {name} of every replica's rows, in order", None


JOIN_ROWS = _JoinRows()


def _numbers_problem(col: Sequence[Any], tensors: list[bool], shown: str) -> Problem | None:
    """What is wrong with values that are not all tensors, for a rule that also takes numbers
    (``mean``, ``sum``): nothing when every one is a number; else the first that is neither
    (a bool is not a number to these rules: ``True`` is not ``1``), or the mix."""
    numbers = [is_number(v) for v in col]
    if all(numbers):
        return None
    wrong = [r for r, (t, n) in enumerate(zip(tensors, numbers, strict=True)) if not (t or n)]
    if wrong:
        bad = wrong[0]
        flag = " (a bool is neither here)" if isinstance(col[bad], bool) else ""
        text = f"{shown} needs tensors or numbers, replica {bad} holds {describe(col[bad])}{flag}"
    else:
        kinds = ", ".join(
            f"replica {r}: {'a tensor' if t else 'a number'}" for r, t in enumerate(tensors)
        )
        text = f"{shown} needs tensors in every replica or numbers in every replica, got {kinds}"
    return Problem(text, True, "shape")


def _unknown_dataclasses(col: Sequence[Any]) -> str:
    """The names of the dataclasses among ``col`` (values treegather cannot look inside)."""
    classes = {type(v) for v in col if dataclasses.is_dataclass(v) and not isinstance(v, type)}
    return ", ".join(sorted(c.__qualname__ for c in classes))


@dataclasses.dataclass(frozen=True)
class Cat(LeafRule, name="cat"):
    """Concatenate along ``dim`` (the default for tensors; all 0-dim values: a vector; a value
    laid out by rows, under dim 0: its rows joined, as its default rule does)."""

    verb: ClassVar[str] = "concatenate"
    dim: int = 0

    @classmethod
    def named(cls, dim: int) -> Cat:
        return cls(dim)

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        first = col[0]
        if type(first) is not Tensor and self.dim == 0 and rows_of(first) is not None:
            return JOIN_ROWS.combine(col, ctx)  # (a PackedSequence, a graph batch: by its rows)
        return cat_values(col, ctx.target, ctx.moving, self.dim)

    def rows_problem(self, col: tuple[Any, ...], ctx: Combining, shown: str) -> Problem | None:
        if self.dim != 0:
            return Problem(_only_by_rows(shown, _rows_name(col)), True)
        return JOIN_ROWS.problem(col, ctx, shown)

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        ndims = {len(s) for s in shapes}
        if ndims == {0}:
            return None
        if len(ndims) > 1:
            if 0 in ndims:
                return Problem(
                    f"{shown} cannot mix 0-dim and n-dim tensors: {by_replica(shapes)}",
                    hint="shape",
                )
            text = f"{shown} needs tensors with the same number of dims, got {by_replica(shapes)}"
            return Problem(text, hint="shape")
        nd = ndims.pop()
        d = self.dim
        if not -nd <= d < nd:
            return Problem(f"{shown} is out of range for {nd}-dim tensors", hint="shape")
        if len({tuple(s[: d % nd] + s[d % nd + 1 :]) for s in shapes}) > 1:
            text = f"{shown} needs equal sizes in every dim but {d}, got {by_replica(shapes)}"
            return Problem(text, hint="shape")
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        by_rows = not isinstance(x, Tensor) and rows_of(x) is not None
        if by_rows and self.dim == 0:
            return JOIN_ROWS.becomes(x, k)
        if by_rows:
            return "-", _only_by_rows(self.describe(), type_name(x))
        if not isinstance(x, Tensor):
            return self.refused(x)
        shape: list[Any] = list(x.shape)
        nd = len(shape)
        if nd == 0:
            kk = "k" if k is None else str(k)
            return f"Tensor({kk},) {dtype_text(x.dtype)} (0-dim values stacked)", None
        if not -nd <= self.dim < nd:
            return "-", f"{self.describe()}: dim {self.dim} is out of range for {nd}-dim tensors"
        shape[self.dim % nd] = _times(shape[self.dim % nd], k)
        return (
            f"Tensor{shape_text(shape)} {dtype_text(x.dtype)} (if every replica is alike)",
            None,
        )


def cat_values(col: Sequence[Tensor], target: torch.device, moving: bool, dim: int) -> Tensor:
    """:class:`Cat`'s combine: one dtype, moved to ``target`` (0-dim values stacked)."""
    one_dtype(col)
    if moving:
        col = to_target(col, target)
    scalars = col[0].dim() == 0  # all 0-dim: the vector of them
    try:
        out = torch.stack(col) if scalars else torch.cat(col, dim)  # type: ignore[arg-type]
    except RuntimeError:  # replicas on several devices
        if moving:
            raise
        moved = to_target(col, target)
        out = torch.stack(moved) if scalars else torch.cat(moved, dim)
    return out if out.device == target else out.to(target)


@dataclasses.dataclass(frozen=True)
class Stack(LeafRule, name="stack"):
    """Stack along a new ``dim``."""

    verb: ClassVar[str] = "stack"
    dim: int = 0

    @classmethod
    def named(cls, dim: int) -> Stack:
        return cls(dim)

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        one_dtype(col)
        return torch.stack(to_target(col, ctx.target), self.dim)

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        if len(set(shapes)) > 1:
            return Problem(f"{shown} needs equal shapes, got {by_replica(shapes)}", hint="shape")
        nd = len(shapes[0])
        if not -nd - 1 <= self.dim <= nd:
            return Problem(f"{shown} is out of range for {nd}-dim tensors", hint="shape")
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        if not isinstance(x, Tensor):
            return self.refused(x)
        shape: list[Any] = list(x.shape)
        nd = len(shape)
        if not -(nd + 1) <= self.dim <= nd:
            return "-", f"{self.describe()}: dim {self.dim} is out of range for {nd}-dim tensors"
        shape.insert(self.dim % (nd + 1), "k" if k is None else str(k))
        return f"Tensor{shape_text(shape)} {dtype_text(x.dtype)}", None


@dataclasses.dataclass(frozen=True)
class Pad(LeafRule, name="pad"):
    """Pad every other dim to the largest replica, then concatenate along ``dim``."""

    verb: ClassVar[str] = "pad and concatenate"
    widens: ClassVar[bool] = True
    dim: int = 0
    fill: float = 0
    lengths: bool = False

    @classmethod
    def named(cls, dim: int) -> Pad:
        return cls(dim)

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        one_dtype(col)
        dtype = col[0].dtype
        if not fill_fits(self.fill, dtype):
            raise ValueError(f"pad(fill={safe_repr(self.fill)}) cannot be stored in {dtype}")
        fill = fill_value(self.fill, dtype)
        values = to_target(col, ctx.target)
        ndim = values[0].dim()
        if ndim == 0 or any(v.dim() != ndim for v in values):
            raise ValueError("pad() needs tensors of the same number of dims (at least 1)")
        if not -ndim <= self.dim < ndim:  # never wrap around: pad(dim=2) on 2-dim is a mistake
            raise ValueError(f"pad(dim={self.dim}) is out of range for {ndim}-dim tensors")
        d = self.dim % ndim
        shape = [builtins.max(v.shape[j] for v in values) for j in range(ndim)]
        padded = []
        for v in values:
            want = list(shape)
            want[d] = v.shape[d]
            if list(v.shape) == want:
                padded.append(v)
                continue
            buf = v.new_full(want, fill)
            buf[tuple(slice(0, s) for s in v.shape)] = v
            padded.append(buf)
        data = torch.cat(padded, d)
        if not self.lengths:
            return data
        lengths = torch.tensor([list(v.shape) for v in values], dtype=torch.long, device=ctx.target)
        return Padded(data, lengths)

    def dtype_problem(self, dtype: torch.dtype, shown: str) -> Problem | None:
        if fill_fits(self.fill, dtype):
            return None
        return Problem(
            f"{shown}: fill {safe_repr(self.fill)} cannot be stored in {dtype} as itself (it "
            "would wrap, be cut or overflow, or padding would look like data); pick a fill "
            "the dtype holds",
            True,
        )

    def shape_problem(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, ctx: Combining, shown: str
    ) -> Problem | None:
        problem = self.dtype_problem(dtype, shown)
        if problem is not None:
            return problem
        if len({len(s) for s in shapes}) > 1 or len(shapes[0]) == 0:
            text = f"{shown} needs tensors with the same number of dims (>= 1), got {by_replica(shapes)}"
            return Problem(text, hint="shape")
        nd = len(shapes[0])
        if not -nd <= self.dim < nd:
            return Problem(f"{shown} is out of range for {nd}-dim tensors", hint="shape")
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        if not isinstance(x, Tensor):
            return self.refused(x)
        shape: list[Any] = list(x.shape)
        nd = len(shape)
        if nd == 0 or not -nd <= self.dim < nd:
            return "-", f"{self.describe()} needs tensors of at least {max(1, self.dim + 1)} dim(s)"
        if not fill_fits(self.fill, x.dtype):
            return (
                "-",
                f"{self.describe()}: fill {safe_repr(self.fill)} cannot be stored in {x.dtype}",
            )
        shape[self.dim % nd] = _times(shape[self.dim % nd], k)
        data = f"Tensor{shape_text(shape)} {dtype_text(x.dtype)}"
        others = " (other dims padded to the largest replica)"
        if self.lengths:
            kk = "k" if k is None else str(k)
            return f"Padded(data={data}, lengths=Tensor({kk}, {nd}) int64){others}", None
        return data + others, None


class Padded(NamedTuple):
    """What :func:`pad` with ``lengths=True`` gathers a leaf into."""

    data: torch.Tensor
    """The per-replica tensors padded to a common shape and concatenated along the pad dim."""
    lengths: torch.Tensor
    """An int64 tensor of shape ``(replicas, ndim)``: each replica's original shape."""


def fill_fits(fill: Any, dtype: torch.dtype) -> bool:
    """Whether ``pad(fill=...)`` can be stored in ``dtype`` as itself: no wrap, no truncation, no
    overflow.

    Integer dtypes (and ``bool``) hold the whole numbers of their range; floating dtypes the
    numbers up to their largest finite value (rounded, as any float is: ``0.1`` fits), NaN, and
    the infinities where the dtype has them (not ``float8_e4m3fn``, ``float8_e4m3fnuz``,
    ``float8_e5m2fnuz``, ``float8_e8m0fnu``; the last holds no zero or negative number either);
    complex dtypes hold a real or complex fill whose parts fit their real dtype; a complex fill
    fits no real dtype. ``True`` and ``False`` are ``1`` and ``0``.

    >>> import torch
    >>> fill_fits(-1, torch.uint8), fill_fits(1.5, torch.int64), fill_fits(True, torch.bool)
    (False, False, True)
    >>> fill_fits(70000.0, torch.float16), fill_fits(float("-inf"), torch.float16)
    (False, True)
    >>> fill_fits(float("nan"), torch.int32), fill_fits(1j, torch.float32), fill_fits(1j, torch.complex64)
    (False, False, True)
    """
    value: Any = _plain(fill)
    if value is None:
        return False
    if dtype.is_complex:
        parts: tuple[Any, ...] = (value.real, value.imag) if type(value) is complex else (value,)
        real = _REAL_OF.get(dtype)
        return real is not None and all(_float_holds(p, real) for p in parts)
    if type(value) is complex:
        return False
    if dtype.is_floating_point:
        return _float_holds(value, dtype)
    if type(value) is float:
        if not value.is_integer():  # 1.5, nan, inf
            return False
        value = int(value)
    if dtype == torch.bool:
        return value in (0, 1)
    try:
        dtype.is_signed  # noqa: B018  (torch cannot say for a dtype of no plain numbers)
        info = torch.iinfo(dtype)
    except (TypeError, RuntimeError):
        # A dtype of no plain numbers: quantized ones (torch.iinfo reads qint8 as int8, but a
        # stored number stands for another), bits, sub-byte ints: nothing is stored as itself.
        return False
    return bool(info.min <= value <= info.max)


def fill_value(fill: Any, dtype: torch.dtype) -> Any:
    """The fill :func:`fill_fits` accepted, as the Python number ``new_full`` is given: numpy
    scalars as Python ones (torch reads a numpy ``complex64`` as its real part), and a whole
    number beyond int64 as a float for a floating dtype (torch cannot take it as an int)."""
    value = _plain(fill)
    inexact = dtype.is_floating_point or dtype.is_complex
    if type(value) is int and inexact and not _INT64[0] <= value <= _INT64[1]:
        return float(value)
    return value


def _plain(fill: Any) -> int | float | complex | None:
    """``fill`` as a Python int, float or complex (a bool as 0 or 1), or None for no number."""
    if type(fill) in (int, float, complex):
        return fill
    if isinstance(fill, bool):
        return int(fill)
    if isinstance(fill, numbers.Integral):
        return int(fill)
    if isinstance(fill, numbers.Real):
        return float(fill)
    if isinstance(fill, numbers.Complex):
        return complex(fill)
    return None


def _float_holds(value: float | int, dtype: torch.dtype) -> bool:
    """Whether a real number fits a floating dtype (its range; NaN; an infinity if it has one)."""
    if value != value:  # NaN: every floating dtype has one
        return True
    if value in (_INF, -_INF):
        return dtype not in _NO_INFINITY
    try:
        info = torch.finfo(dtype)
        low, high = info.min, info.max  # (min: the lowest value, as torch checks)
    except (TypeError, RuntimeError):  # (float4_e2m1fn_x2: two packed in a byte, no range)
        return False
    return bool(low <= value <= high)


_INF = float("inf")
_INT64 = (-(2**63), 2**63 - 1)
_REAL_OF = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}
# Floating dtypes without infinities (torch refuses to fill them with one).
_NO_INFINITY = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


# --------------------------------------------------------------------------- constructors


@constructor(Cat)
def cat(dim: int = 0) -> Cat:
    """Gather rule: concatenate along ``dim`` (the default for tensors).

    When every replica holds a 0-dim tensor the result is the vector of them, as in torch. A
    value laid out by rows its own way (a ``PackedSequence``, a ``LazyStackedTensorDict``
    stacked along dim 0) is joined by its rows under ``cat()`` (dim 0), as the default joins
    it: ``cat()`` in a prefix layout says "by rows" for every leaf below it; another dim is
    refused naming the value's kind.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.ones(1, 2), torch.zeros(1, 3)], "cpu", tg.cat(1))
    tensor([[1., 1., 0., 0., 0.]])
    >>> from torch.nn.utils.rnn import pack_sequence
    >>> packed = [pack_sequence([torch.ones(3), torch.ones(2)]), pack_sequence([torch.ones(1)])]
    >>> tg.gather(packed, "cpu", tg.cat()).batch_sizes
    tensor([3, 2, 1])
    """
    return Cat(int(dim))


@constructor(Stack)
def stack(dim: int = 0) -> Stack:
    """Gather rule: stack the per-replica tensors along a new ``dim``.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.ones(2), torch.zeros(2)], "cpu", tg.stack()).shape
    torch.Size([2, 2])
    """
    return Stack(int(dim))


@constructor(Pad)
def pad(dim: int = 0, fill: float = 0, lengths: bool = False) -> Pad:
    """Gather rule: pad every other dim to the largest replica, then concatenate along ``dim``.

    With ``lengths=True`` the leaf becomes ``Padded(data, lengths)``, ``lengths`` holding each
    replica's original shape, shape ``(replicas, ndim)``.

    >>> import torch, treegather as tg
    >>> out = tg.gather([torch.ones(1, 2), torch.ones(1, 3)], "cpu", tg.pad(fill=-1, lengths=True))
    >>> out.data
    tensor([[ 1.,  1., -1.],
            [ 1.,  1.,  1.]])
    >>> out.lengths
    tensor([[1, 2],
            [1, 3]])
    """
    return Pad(int(dim), fill, bool(lengths))
