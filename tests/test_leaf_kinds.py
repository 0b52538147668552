"""Every kind of leaf torch has, through every rule, three ways (issue 47, point 1).

The kinds come from torch: every ``torch.dtype`` attribute of the ``torch`` module, every
``torch.layout``, and every public tensor subclass torch defines (a dtype, layout or subclass
the table below does not cover fails :func:`test_the_kinds_cover_what_torch_has`, until it
has a case or a reason); besides them nested tensors (jagged and strided), a user's
``__torch_function__`` subclass, meta tensors, zero-size dims and Python scalars (``Decimal``,
``Fraction``, enum members, ``datetime``/``date``/``timedelta``, ``complex``).

Each kind goes through every gather rule (``cat``, ``stack``, ``mean``, ``mean(weight=...)``,
``sum``, ``pad``, ``as_list``, ``first(check=True)`` of two equal values, ``cat_items`` of
per-replica lists of it, a custom callable) three ways: ``tg.gather`` (the plain path under
``reference_only``, and the compiled path, cold to compiled, which must agree with it;
``mean(weight=...)`` through ``tg.data_parallel``, which passes the calls it weighs),
``treegather.distributed.all_gather`` on a one-rank gloo group (cold, then on the wire plan)
and the ``Collector`` on that group (two adds, one evaluation); and through every scatter rule
(``split``, ``broadcast``, ``split_items`` of a list of it, the default) by ``tg.scatter``,
both paths. A few cells run on 2 spawned ranks too: a ``__torch_function__`` subclass, an
``(n, 0)`` tensor, a sparse, a quantized and a float8 one, a ``Decimal``, a nested tensor, and
a value only rank 1 cannot send (every rank's error names the path and the rank).

The oracle is what one device gives, computed with torch directly: ``torch.cat`` of the
replicas' values for ``cat``, the rule's documented definition for ``mean`` (integers in the
default float dtype, weights as shares, accumulated as ``torch.mean`` does), Python's own
arithmetic for numbers, ``torch.tensor_split`` for ``split``; where torch cannot give it, a
typed :class:`treegather.TreegatherError` whose message names the leaf's path and the rule
(:mod:`rule_matrix`). Across processes results land where the rank's tensors are (a meta
tensor's on the meta device), a Collector's adds are detached, and a value must also travel: a
dense tensor as its bytes, anything else as torch serialises it; a value torch cannot serialise
is a typed error naming its path. A raw error from torch or from treegather's internals fails
the cell.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import decimal
import enum
import fractions
import io
import numbers
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import spawned_groups
import torch
from rule_matrix import (
    RULES,
    SHOWN,
    WARM_CALLS,
    Exact,
    Expect,
    Outcome,
    Typed,
    custom,
    differential,
    equal,
    problem,
    run,
)

import treegather as tg

Tensor = torch.Tensor
CPU = torch.device("cpu")
PATH = re.compile(r"(outputs|inputs)\['m'\]\['x'\](\[\d+\])*( \((replica \d+|add #\d+)\))?: ")
"""Where a message names the leaf (an item of it, for a rule applied to a list)."""
WHERE = "outputs['m']['x']"
QUIET = (  # what torch says while these kinds are made and used (not treegather's)
    "ignore:ComplexHalf support is experimental:UserWarning",
    "ignore:.*quantized tensor creation functions.*:UserWarning",
    "ignore:TypedStorage is deprecated:UserWarning",
    "ignore:The PyTorch API of MaskedTensors is in prototype:UserWarning",
    "ignore:The PyTorch API of nested tensors is in prototype:UserWarning",
    "ignore:Sparse CSR tensor support is in beta state:UserWarning",
    "ignore:.*is not implemented in __torch_dispatch__ for MaskedTensor:UserWarning",
)
pytestmark = [
    *(pytest.mark.filterwarnings(w) for w in QUIET),
    pytest.mark.usefixtures("one_thread"),  # (tiny ops: a busy thread pool only waits)
]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """:data:`QUIET` outside a test (in the spawned ranks, at import)."""
    import warnings

    with warnings.catch_warnings():
        for w in QUIET:
            _, message, category = w.split(":")
            warnings.filterwarnings("ignore", message, getattr(builtins, category))
        yield


# ----------------------------------------------------------------------------- the kinds


class Tagged(torch.Tensor):
    """A user's tensor subclass with a ``__torch_function__`` (torch's ops return one)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 3


class Kind(NamedTuple):
    name: str
    make: Callable[[int], Any]
    """Replica ``r``'s value (two calls with one ``r``: two equal values)."""


def _grid(r: int) -> Tensor:
    """Replica ``r``'s numbers, 2x2, >= 0 (every dtype holds them, or rounds them)."""
    return torch.arange(4.0).view(2, 2) + 4 * r


def _sparse(r: int) -> Tensor:
    """Replica ``r``'s numbers, 2x4, half of them zeros."""
    return torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0]]) * (r + 1)


def _raw(dtype: torch.dtype) -> Callable[[int], Tensor]:
    """Bytes seen as ``dtype`` (a dtype torch stores but computes nothing in)."""
    size = dtype.itemsize
    return lambda r: (
        (torch.arange(4 * size, dtype=torch.uint8) + 16 * r).view(2, 2 * size).view(dtype)
    )


# torch's dtypes by how a value of each is made; test_the_kinds_cover_what_torch_has checks
# that these are all of torch's dtypes.
ARITHMETIC = (
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
    "complex32 complex64 complex128 float8_e5m2 float8_e4m3fn float8_e5m2fnuz float8_e4m3fnuz "
    "float8_e8m0fnu"
).split()
QUANTIZED = "qint8 quint8 qint32 quint4x2 quint2x4".split()
RAW = (
    "bits1x8 bits2x4 bits4x2 bits8 bits16 uint1 uint2 uint3 uint4 uint5 uint6 uint7 int1 int2 "
    "int3 int4 int5 int6 int7 float4_e2m1fn_x2"
).split()


def _dtype_kinds() -> list[Kind]:
    kinds = []
    for name in ARITHMETIC:
        dtype = getattr(torch, name)
        kinds.append(Kind(name, lambda r, d=dtype: _grid(r).to(d)))
    for name in QUANTIZED:
        dtype = getattr(torch, name)
        kinds.append(Kind(name, lambda r, d=dtype: torch.quantize_per_tensor(_grid(r), 0.5, 0, d)))
    kinds += [Kind(name, _raw(getattr(torch, name))) for name in RAW]
    return kinds


# Every torch.layout, by the kind that holds it (strided: every dtype's).
LAYOUTS = {
    "strided": "float32",
    "sparse_coo": "sparse_coo",
    "sparse_csr": "sparse_csr",
    "sparse_csc": "sparse_csc",
    "sparse_bsr": "sparse_bsr",
    "sparse_bsc": "sparse_bsc",
    "_mkldnn": "mkldnn",
    "jagged": "nested jagged",
}


def _nested(layout: torch.layout) -> Callable[[int], Tensor]:
    return lambda r: torch.nested.nested_tensor([_sparse(r)[0], _sparse(r)[1, :3]], layout=layout)


def _masked(r: int) -> Tensor:
    return torch.masked.masked_tensor(_sparse(r), _sparse(r) != 0)


# Every public tensor subclass of torch (a module path without a private part), by the kind
# that covers it, or why none does.
SUBCLASSES = {
    "torch.nn.parameter.Parameter": "Parameter",
    "torch.nn.parameter.Buffer": "Buffer",
    "torch.nn.parameter.UninitializedParameter": "UninitializedParameter",
    "torch.nn.parameter.UninitializedBuffer": "UninitializedBuffer",
    "torch.masked.maskedtensor.core.MaskedTensor": "MaskedTensor",
}
NOT_SUBCLASSES = {
    "torch.sparse.semi_structured.SparseSemiStructuredTensor": "made from CUDA tensors only",
    "torch.sparse.semi_structured.SparseSemiStructuredTensorCUTLASS": "made on CUDA only",
    "torch.sparse.semi_structured.SparseSemiStructuredTensorCUSPARSELT": "made on CUDA only",
    "torch.distributed.tensor.DTensor": "a value spread over a device mesh already: gathered "
    "by its own full_tensor()",
}


def _kinds() -> list[Kind]:
    return [
        *_dtype_kinds(),
        Kind("sparse_coo", lambda r: _sparse(r).to_sparse()),
        Kind("sparse_csr", lambda r: _sparse(r).to_sparse_csr()),
        Kind("sparse_csc", lambda r: _sparse(r).to_sparse_csc()),
        Kind("sparse_bsr", lambda r: _sparse(r).to_sparse_bsr((1, 2))),
        Kind("sparse_bsc", lambda r: _sparse(r).to_sparse_bsc((1, 2))),
        Kind("mkldnn", lambda r: _sparse(r).to_mkldnn()),
        Kind("nested jagged", _nested(torch.jagged)),
        Kind("nested strided", _nested(torch.strided)),
        Kind("meta", lambda r: _sparse(r).to("meta")),
        Kind("Tagged (__torch_function__)", lambda r: _sparse(r).as_subclass(Tagged)),
        Kind("MaskedTensor", _masked),
        Kind("Parameter", lambda r: torch.nn.Parameter(_sparse(r))),
        Kind("Buffer", lambda r: torch.nn.Buffer(_sparse(r))),
        Kind("UninitializedParameter", lambda r: torch.nn.UninitializedParameter()),
        Kind("UninitializedBuffer", lambda r: torch.nn.UninitializedBuffer()),
        Kind("(0, 3)", lambda r: torch.zeros(0, 3)),
        Kind("(2, 0)", lambda r: torch.zeros(2, 0)),
        Kind("Decimal", lambda r: decimal.Decimal("1.25") + r),
        Kind("Fraction", lambda r: fractions.Fraction(1, 3) + r),
        Kind("Enum", lambda r: Color(r + 1)),
        Kind("IntEnum", lambda r: (Level.LOW, Level.HIGH)[r]),
        Kind("datetime", lambda r: datetime.datetime(2024, 1, 1) + datetime.timedelta(days=r)),
        Kind("date", lambda r: datetime.date(2024, 1, 1 + r)),
        Kind("timedelta", lambda r: datetime.timedelta(hours=1 + r)),
        Kind("complex", lambda r: complex(1 + r, -2)),
    ]


with quiet():
    KINDS = _kinds()
BY_NAME = {k.name: k for k in KINDS}


def public_subclasses() -> set[str]:
    """torch's public tensor subclasses (every class below ``torch.Tensor`` defined in a
    module of torch whose path has no private part), once torch's modules that define them
    are imported."""
    import torch.distributed.tensor
    import torch.masked
    import torch.sparse.semi_structured

    found, todo = set(), [torch.Tensor]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            module = sub.__module__
            if module.split(".")[0] == "torch" and not any(
                p.startswith("_") for p in module.split(".")
            ):
                found.add(f"{module}.{sub.__qualname__}")
    return found


def test_the_kinds_cover_what_torch_has() -> None:
    """A dtype, layout or public tensor subclass torch adds fails here until it is covered."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    named = ARITHMETIC + QUANTIZED + RAW
    assert len(named) == len(set(named))
    made = {getattr(torch, name) for name in named}
    assert not dtypes - made, f"torch has dtypes no kind makes: {sorted(map(str, dtypes - made))}"
    assert made == dtypes
    for name in named:  # each makes a value of its dtype
        assert BY_NAME[name].make(0).dtype == getattr(torch, name), name
    layouts = {str(v) for v in vars(torch).values() if isinstance(v, torch.layout)}
    assert layouts == {f"torch.{name}" for name in LAYOUTS}, layouts
    for name, kind in LAYOUTS.items():
        assert str(BY_NAME[kind].make(0).layout) == f"torch.{name}", name
    found = public_subclasses()
    missing = found - set(SUBCLASSES) - set(NOT_SUBCLASSES)
    assert not missing, f"torch has public tensor subclasses no kind covers: {sorted(missing)}"
    assert set(SUBCLASSES) | set(NOT_SUBCLASSES) == found
    assert all(k in BY_NAME for k in SUBCLASSES.values())
    assert BY_NAME["nested strided"].make(0).is_nested


# ---------------------------------------------------------------------------- the oracle


class Refused(Exception):
    """The oracle's answer where the rule refuses the values by its definition: a typed
    error of ``error`` saying ``text``."""

    def __init__(self, error: type[tg.TreegatherError], text: str, rule: bool = True) -> None:
        super().__init__(text)
        self.error, self.text, self.rule = error, text, rule


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _tensors(values: tuple[Any, ...], numbers_too: bool = False) -> bool:
    """Whether ``values`` are tensors (``False``: numbers, where ``numbers_too``), else the
    rule's refusal."""
    if all(isinstance(v, Tensor) for v in values):
        return True
    if numbers_too and all(map(_is_number, values)):
        return False
    needs = "needs tensors or numbers" if numbers_too else "needs tensors"
    raise Refused(tg.LeafTypeError, needs)


def _moved(x: Any, target: torch.device = CPU) -> Any:
    """``x`` on the target device, as a rule moves a value (tensors in lists too)."""
    if isinstance(x, list):
        return [_moved(v, target) for v in x]
    return x.to(target) if isinstance(x, Tensor) else x


def one_cat(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    _tensors(values)
    if all(v.dim() == 0 for v in values):
        return torch.stack(values).to(target)
    return torch.cat(values).to(target)


def one_stack(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    _tensors(values)
    return torch.stack(values).to(target)


_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_ACCUMULATE[torch.complex32] = torch.complex64


def one_mean(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    """The mean as the rule defines it: of numbers, Python's (exact for ``Fraction``,
    ``Decimal`` and ints weighted by ints; else each value times its share); of tensors, in
    the default float dtype for integers, weighted by shares accumulated as ``torch.mean``."""
    if not _tensors(values, numbers_too=True):
        if sizes is None:
            return builtins.sum(values) / len(values)
        total = builtins.sum(sizes)
        if all(isinstance(v, (numbers.Rational, decimal.Decimal)) for v in values):
            return builtins.sum(v * w for v, w in zip(values, sizes, strict=True)) / total
        return builtins.sum(v * (w / total) for v, w in zip(values, sizes, strict=True))
    stacked = torch.stack(values)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    if sizes is None:
        return stacked.mean(0).to(target)
    dtype = stacked.dtype
    wide = _ACCUMULATE.get(dtype, dtype)
    total = builtins.sum(sizes)
    shares = torch.tensor([s / total for s in sizes], dtype=wide)
    shares = shares.view(-1, *[1] * (stacked.dim() - 1))
    return (stacked.to(wide) * shares).sum(0).to(dtype).to(target)


def one_sum(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    if not _tensors(values, numbers_too=True):
        return builtins.sum(values)
    return torch.stack(values).sum(0).to(target)


def one_pad(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    """Every other dim padded with 0 to the largest replica, then ``torch.cat``; 0 must be
    stored in the dtype as itself."""
    _tensors(values)
    dtype = values[0].dtype
    zero = torch.full((1,), 0, dtype=dtype).to(torch.complex128 if dtype.is_complex else float)
    if zero.item() != 0:
        raise Refused(tg.LeafTypeError, "cannot be stored in")
    shapes = [tuple(v.shape) for v in values]
    if len({len(s) for s in shapes}) > 1 or not shapes[0]:
        raise Refused(tg.ShapeMismatchError, "same number of dims")
    top = [builtins.max(s[j] for s in shapes) for j in range(len(shapes[0]))]
    padded = []
    for v in values:
        want = [v.shape[0], *top[1:]]
        if list(v.shape) != want:
            buf = v.new_full(want, 0)
            buf[tuple(slice(0, s) for s in v.shape)] = v
            v = buf
        padded.append(v)
    return torch.cat(padded).to(target)


def one_as_list(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    return list(values)


def one_first(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    if not all(equal(values[0], v, strict=True) for v in values[1:]):
        raise Refused(tg.ShapeMismatchError, "differs from replica 0")
    return _moved(values[0], target)


def one_cat_items(values: tuple[Any, ...], sizes: Any, target: torch.device) -> Any:
    return _moved([x for v in values for x in v], target)


ONE_DEVICE: dict[str, Callable[[tuple[Any, ...], Any, torch.device], Any]] = {
    "cat": one_cat,
    "stack": one_stack,
    "mean": one_mean,
    "mean_weighted": one_mean,
    "sum": one_sum,
    "pad": one_pad,
    "as_list": one_as_list,
    "first": one_first,
    "cat_items": one_cat_items,
}


def expected(
    rule: str, values: tuple[Any, ...], sizes: Any = None, target: torch.device = CPU
) -> Expect:
    """What one device gives for these replicas' values under ``rule``, gathered onto
    ``target``: the value, the rule's refusal, or (torch cannot) a typed error naming the
    rule."""
    if rule == "custom":
        return custom(values, target)
    try:
        with quiet():
            return Exact(ONE_DEVICE[rule](values, sizes, target))
    except Refused as refused:
        return Typed(refused.error, refused.text, refused.rule)
    except Exception:  # torch cannot: a typed error, naming the rule
        return Typed(tg.TreegatherError, "")


def travels(x: Any) -> bool:
    """Whether ``x`` can go to another process: a dense tensor as its bytes, anything else as
    torch serialises it (``torch.save`` and ``torch.load`` give it back)."""
    if type(x) is list:
        return all(map(travels, x))
    if (
        type(x) is Tensor
        and x.layout == torch.strided
        and not (x.is_quantized or x.is_nested or x.is_meta)
    ):
        return True
    buf = io.BytesIO()
    try:
        with quiet():
            torch.save(x, buf)
            buf.seek(0)
            back = torch.load(buf, weights_only=False)
        return equal(back, x)
    except Exception:
        return False


def landing(values: tuple[Any, ...]) -> torch.device:
    """Where ``treegather.distributed`` puts results: the device of the rank's tensors (when
    they are on one), else the CPU."""
    found = [x for v in values for x in (v if isinstance(v, list) else [v])]
    devices = {x.device for x in found if isinstance(x, Tensor)}
    return devices.pop() if len(devices) == 1 else CPU


def across(expect: Expect, values: tuple[Any, ...]) -> Expect:
    """``expect``, where every value can travel; else a typed error naming the path."""
    if all(map(travels, values)):
        return expect
    return Typed(tg.LeafTypeError, "", rule=False)


# ------------------------------------------------------------------------------- the cells

WEIGHTS = (1, 3)
GATHER_RULES = [*RULES, "mean_weighted"]
SHOWN_HERE = {**SHOWN, "mean_weighted": "mean(weight=weigh)"}


def replicas(kind: Kind, rule: str, k: int = 2) -> tuple[Any, ...]:
    """The replicas' values of a cell: ``first`` gets equal ones; ``cat_items`` lists of one."""
    with quiet():
        if rule == "first":
            return tuple(kind.make(0) for _ in range(k))
        values = tuple(kind.make(r) for r in range(k))
    return tuple([v] for v in values) if rule == "cat_items" else values


def weigh(i: Tensor) -> int:
    """``mean(weight=...)``: replica ``i``'s weight."""
    return WEIGHTS[int(i)]


def _gathered(rule: str, values: tuple[Any, ...]) -> Callable[[], Any]:
    if rule == "mean_weighted":  # (a gather that follows a call: data_parallel)
        layout = {"m": {"x": tg.mean(weight=weigh)}}
        return lambda: tg.data_parallel(
            lambda i: {"m": {"x": values[int(i)]}},
            torch.arange(len(values)),
            ["cpu"] * len(values),
            out_layout=layout,
        )["m"]["x"]
    outputs = [{"m": {"x": v}} for v in values]
    return lambda: tg.gather(outputs, "cpu", {"m": {"x": RULES[rule]}})["m"]["x"]


def _check(rule: str, expect: Expect, got: Outcome) -> str | None:
    return problem(SHOWN_HERE[rule], expect, got, PATH, WHERE)


@pytest.mark.parametrize("rule", GATHER_RULES)
def test_each_kind_is_one_device_or_a_typed_error_in_the_plain_and_the_compiled_path(
    rule: str,
) -> None:
    problems = []
    for kind in KINDS:
        values = replicas(kind, rule)
        expect = expected(rule, values, WEIGHTS if rule == "mean_weighted" else None)
        found = differential(_gathered(rule, values), lambda got: _check(rule, expect, got))  # noqa: B023
        if found is not None:
            problems.append(f"{kind.name}: {found}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------- scatter

SCATTER_RULES = {
    "split": tg.split(),
    "broadcast": tg.broadcast(),
    "split_items": tg.split_items(),
    "default": None,
}
SCATTER_SHOWN = {"split": "split", "broadcast": "", "split_items": "split_items()", "default": ""}


def one_split(x: Any, k: int) -> list[Any]:
    """``torch.tensor_split`` into ``k`` shards (fewer for fewer rows, one for none)."""
    if not isinstance(x, Tensor):
        raise Refused(tg.LeafTypeError, "needs a tensor")
    if x.dim() == 0:
        raise Refused(tg.ShapeMismatchError, "cannot split")
    n = builtins.max(1, builtins.min(k, x.shape[0]))
    return [s.to(CPU) for s in torch.tensor_split(x, n)]


def scattered(rule: str, x: Any, k: int = 2) -> Expect:
    """What each device gets: a tensor split by ``split`` (the default, for a tensor with
    dims), a value whole by ``broadcast`` (the default for the rest), a list's items by
    ``split_items`` (cut like the batch); tensors moved to the device."""
    try:
        with quiet():
            if rule == "split" or (rule == "default" and isinstance(x, Tensor) and x.dim()):
                return Exact(one_split(x, k))
            if rule == "split_items":
                return Exact([_moved([item]) for item in x])
            return Exact([_moved(x)] * k)
    except Refused as refused:
        return Typed(refused.error, refused.text, refused.rule)
    except Exception:
        return Typed(tg.TreegatherError, "", rule=rule in ("split", "split_items"))


@pytest.mark.parametrize("rule", SCATTER_RULES)
def test_each_kind_is_scattered_as_one_device_cuts_it_or_a_typed_error(rule: str) -> None:
    problems = []
    for kind in KINDS:
        with quiet():
            x = [kind.make(0), kind.make(1)] if rule == "split_items" else kind.make(0)
        expect = scattered(rule, x)
        layout = None if rule == "default" else {"m": {"x": SCATTER_RULES[rule]}}
        tree = {"m": {"x": x}}

        def call() -> Any:
            return [s["m"]["x"] for s in tg.scatter(tree, ["cpu"] * 2, layout)]  # noqa: B023

        found = differential(
            call,
            lambda got: problem(SCATTER_SHOWN[rule], expect, got, PATH, WHERE),  # noqa: B023
        )
        if found is not None:
            problems.append(f"{kind.name}: {found}")
    assert not problems, "\n".join(problems)


def test_the_matrix_is_every_kind_by_every_rule() -> None:
    assert len(KINDS) == len({k.name for k in KINDS}) >= 70
    assert set(GATHER_RULES) == set(ONE_DEVICE) | {"custom"}
    ways = len(GATHER_RULES) + 2 * len(RULES) + len(SCATTER_RULES)  # (and across processes)
    assert len(KINDS) * ways >= 2200


def test_the_ordinary_dtypes_are_those_every_leaf_rule_combines() -> None:
    """The dtypes whose dense tensors the rules never ask about: each leaf-wise rule combines
    them (as torch's CPU does; the rules ask per device type otherwise)."""
    from treegather._rules import Combining, kinds

    for dtype in kinds.ORDINARY:
        x = torch.zeros(2, 2, dtype=dtype)
        assert kinds.ordinary(x)
        for rule in (tg.cat(), tg.stack(), tg.mean(), tg.sum(), tg.pad()):
            for sizes in (None, (1, 2)):
                ctx = Combining(CPU, False, sizes, 0)
                assert kinds.cannot(rule, x, ctx) == "", (dtype, rule, sizes)
    assert not kinds.ordinary(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert not kinds.ordinary(torch.zeros(2, 2).to_sparse())


def test_a_kind_is_asked_about_once() -> None:
    """What torch can do with a kind is asked once: later failures of that kind are refused
    without asking again."""
    from treegather._rules import kinds

    values = replicas(BY_NAME["float8_e4m3fn"], "sum")
    for _ in range(3):
        with pytest.raises(tg.LeafTypeError, match="sum\\(\\) cannot add float8_e4m3fn"):
            tg.gather(values, "cpu", tg.sum())
    assert len(kinds._CANNOT) == 1


@pytest.mark.parametrize("other", ["sparse_coo", "nested strided", "mkldnn"])
def test_replicas_holding_two_kinds_of_tensor_are_refused_naming_both(other: str) -> None:
    """torch joins no dense tensor with a sparse, nested or mkldnn one (its raw error came
    out): a typed error naming the path, the rule and each replica's kind."""
    with quiet():
        values = ({"m": {"x": _sparse(0)}}, {"m": {"x": BY_NAME[other].make(1)}})
    for rule in (tg.cat(), tg.stack(), tg.mean(), tg.sum(), tg.pad()):
        for n in range(WARM_CALLS):
            with pytest.raises(tg.LeafTypeError) as info:
                tg.gather(values, "cpu", rule)
            text = str(info.value)
            assert text.startswith(f"{WHERE}: {rule.describe()} needs one kind of tensor"), n
            assert "replica 0: float32, replica 1: " in text, text


# ---------------------------------------------------------------------- across processes

DISTRIBUTED_RULES = list(RULES)  # (mean(weight=...) weighs calls, which processes do not pass)


@pytest.mark.parametrize("rule", DISTRIBUTED_RULES)
def test_each_kind_through_all_gather_is_one_device_or_a_typed_error(
    world_of_one: None, rule: str
) -> None:
    import treegather.distributed as tgd

    problems = []
    for kind in KINDS:
        values = replicas(kind, rule, 1)
        expect = across(expected(rule, values, target=landing(values)), values)
        tree, layout = {"m": {"x": values[0]}}, {"m": {"x": RULES[rule]}}
        tg.clear_caches()
        for n in range(2):  # the header, then the wire plan
            got = run(lambda: tgd.all_gather(tree, layout)["m"]["x"])  # noqa: B023
            found = _check(rule, expect, got)
            if found is not None:
                problems.append(f"{kind.name}: all_gather call {n} {found}")
                break
    assert not problems, "\n".join(problems)


def _per_sample(rule: str, values: tuple[Any, ...]) -> bool:
    """Whether the Collector joins these values by rows (``cat``, ``pad`` of tensors with
    dims), rather than one value per add."""
    try:
        return rule in ("cat", "pad") and all(isinstance(v, Tensor) and v.dim() for v in values)
    except Exception:  # (a tensor whose dims cannot be read)
        return False


def _detached(x: Any) -> Any:
    if isinstance(x, list):
        return [_detached(v) for v in x]
    uninitialized = isinstance(x, torch.nn.parameter.UninitializedTensorMixin)
    return x.detach() if isinstance(x, Tensor) and x.requires_grad and not uninitialized else x


def collected(rule: str, values: tuple[Any, ...], rows: list[int]) -> Expect:
    """What the Collector gives for adds of these values (``rows`` each, in dataset order):
    per-sample values joined by the rule and put in dataset order by torch's
    ``index_select`` of their rows; others combined by the rule over the adds, weighted by
    their rows. An add keeps tensors detached (a ``Parameter``: a plain tensor)."""
    values = tuple(_detached(v) for v in values)
    expect = expected(rule, values, None if rule in ("cat", "pad") else rows)
    if isinstance(expect, Exact) and _per_sample(rule, values):
        try:
            with quiet():
                order = torch.arange(builtins.sum(rows))
                expect = Exact(expect.value.index_select(0, order))
        except Exception:
            return Typed(tg.TreegatherError, "")
    return across(expect, values)


def _collect(values: tuple[Any, ...], rows: list[int], layout: Any) -> Any:
    """A Collector's result for adds of ``values``, ``rows`` each, in dataset order."""
    import treegather.distributed as tgd

    col = tgd.Collector()
    start = 0
    for v, k in zip(values, rows, strict=True):
        ids = torch.arange(start, start + k)
        col.add({"m": {"x": v}, "i": ids}, indices=ids)
        start += k
    return col.all_gather(layout)["m"]["x"]


@pytest.mark.parametrize("rule", DISTRIBUTED_RULES)
def test_each_kind_through_the_collector_is_one_device_or_a_typed_error(
    world_of_one: None, rule: str
) -> None:

    problems = []
    for kind in KINDS:
        values = replicas(kind, rule)
        per_sample = _per_sample(rule, values)
        rows = [v.size(0) if per_sample else 1 for v in values]
        expect = collected(rule, values, rows)
        layout = {"m": {"x": RULES[rule]}, "i": tg.cat()}
        tg.clear_caches()
        found = _check(rule, expect, run(lambda: _collect(values, rows, layout)))  # noqa: B023
        if found is not None:
            problems.append(f"{kind.name}: Collector {found}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ on 2 spawned ranks

# (kind, rule) cells on real ranks: each rank's value is make(rank) (first: make(0)).
ON_RANKS = [
    ("Tagged (__torch_function__)", "cat"),
    ("Tagged (__torch_function__)", "as_list"),
    ("MaskedTensor", "as_list"),
    ("(2, 0)", "cat"),
    ("(2, 0)", "stack"),
    ("sparse_coo", "cat"),
    ("qint8", "as_list"),
    ("float8_e4m3fn", "first"),
    ("float8_e4m3fn", "mean"),
    ("Decimal", "mean"),
    ("nested jagged", "cat"),
]


def on_ranks(rank: int, world: int) -> list[str]:
    """Every :data:`ON_RANKS` cell through ``all_gather`` (cold, then repeated) on this rank,
    then a value only one rank cannot send (rank 1's mkldnn tensor): what is wrong."""
    try:
        return _on_ranks(rank, world)
    except Exception:  # (a check that raises would end every later check of the group)
        return [f"the check itself: {traceback.format_exc()}"]


def _on_ranks(rank: int, world: int) -> list[str]:
    import treegather.distributed as tgd

    problems = []
    for name, rule in ON_RANKS:
        kind = BY_NAME[name]
        values = replicas(kind, rule, world)
        expect = across(expected(rule, values, target=landing(values)), values)
        tree, layout = {"m": {"x": values[rank]}}, {"m": {"x": RULES[rule]}}
        for n in range(3):  # the header, the wire plan (when it has one), again
            with quiet():
                got = run(lambda: tgd.all_gather(tree, layout)["m"]["x"])  # noqa: B023
            found = _check(rule, expect, got)
            if found is not None:
                problems.append(f"{name}, {rule}: call {n} {found}")
                break
    # One rank's value cannot travel: every rank raises, naming the path and the rank.
    x = _sparse(rank).to_mkldnn() if rank == 1 else _sparse(rank)
    got = run(lambda: tgd.all_gather({"m": {"x": x}}))
    found = problem("", Typed(tg.LeafTypeError, "on rank 1", rule=False), got, PATH, WHERE)
    if found is not None:
        problems.append(f"mkldnn on rank 1 only: {found}")
    return problems


spawned_groups.register("leaf_kinds", budget_s=40)(on_ranks)


@pytest.fixture(scope="module", params=[2], ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[list[str]]:
    found = spawned_groups.results(request.param, tmp_path_factory)
    return [res["leaf_kinds"] for res in found]


@pytest.mark.distributed
def test_cells_on_two_ranks_are_one_device_or_a_typed_error_naming_the_path(
    ranks: list[list[str]],
) -> None:
    wrong = [f"rank {r}: {p}" for r, problems in enumerate(ranks) for p in problems]
    assert not wrong, "\n".join(wrong)
