"""A shared corpus of trees, with what treegather should make of them, and an exact comparison.

Every case is a :class:`Case`: a tree, the batch size its split leaves share (``None`` when
nothing is split), and a short name for test ids. The container classes the corpus needs (a
namedtuple, a ``typing.NamedTuple``, registered dataclasses, a ``ModelOutput``-shaped
``OrderedDict`` dataclass, a registered dict subclass) are defined and registered here once.

:func:`assert_tree_equal` is the oracle: it walks both trees itself (not through treegather),
so a bug in treegather's pytree layer cannot hide a difference.
"""

from __future__ import annotations

import dataclasses
import typing
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any, NamedTuple

import torch

import treegather as tg
from treegather._rules import GatherRule, Rule, ScatterRule

# ----------------------------------------------------------------------- container classes

Point = namedtuple("Point", ["x", "y"])


class Batch(NamedTuple):
    ids: Any
    mask: Any


@tg.register_dataclass
@dataclasses.dataclass
class Sample:
    image: Any
    label: Any


@tg.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrozenSample:
    image: Any
    label: Any


@tg.register_dataclass(static=("name",))
@dataclasses.dataclass
class Tagged:
    data: Any
    name: str = "train"


@dataclasses.dataclass
class MarkedStatic:
    data: Any
    version: int = dataclasses.field(default=1, metadata={"static": True})


tg.register_dataclass(MarkedStatic)


class ModelOutputBase(OrderedDict):  # type: ignore[type-arg]
    """The shape of ``transformers.utils.ModelOutput``: an OrderedDict dataclass whose dict holds
    only the fields that are not ``None``; ``__post_init__`` fills it."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@tg.register_dataclass
@dataclasses.dataclass
class CausalLMOutput(ModelOutputBase):
    loss: typing.Optional[Any] = None  # noqa: UP045 - a transformers-style annotation
    logits: Any = None
    hidden_states: typing.Optional[tuple] = None  # noqa: UP045


class AttrDict(dict):  # type: ignore[type-arg]
    """A dict subclass, registered as a node with register_node."""


tg.register_node(
    AttrDict,
    lambda d: (list(d.values()), tuple(d.keys()), tuple(d.keys())),
    lambda keys, children: AttrDict(zip(keys, children)),
)


# ------------------------------------------------------------------------------- the oracle


def assert_tree_equal(actual: Any, expected: Any, path: str = "x") -> None:
    """Exact equality: same container types, same dict key order, tensors equal in shape, dtype,
    device and values, defaultdict factories equal, dataclass fields equal."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{path}: {actual.device} != {expected.device}"
        assert torch.equal(actual, expected), f"{path}: values differ"
        return
    if dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_tree_equal(
                getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}"
            )
        if isinstance(expected, dict):
            assert list(actual.keys()) == list(expected.keys()), f"{path}: keys {list(actual)}"
        return
    if isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), (
            f"{path}: keys {list(actual.keys())} != {list(expected.keys())}"
        )
        # Keys that compare equal may still differ (True and 1, an enum and its value).
        assert list(map(type, actual)) == list(map(type, expected)), f"{path}: key types differ"
        if isinstance(expected, defaultdict):
            assert actual.default_factory is expected.default_factory, f"{path}: default_factory"
        for key in expected:
            assert_tree_equal(actual[key], expected[key], f"{path}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{path}[{i}]")
        return
    if isinstance(expected, float) and expected != expected:  # NaN
        assert actual != actual, f"{path}: {actual!r} != nan"
        return
    assert actual == expected, f"{path}: {actual!r} != {expected!r}"
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"


# -------------------------------------------------------------------------------- the corpus


class Case(NamedTuple):
    name: str
    tree: Any
    batch: int | None
    """Rows of every split leaf under the default layout (None: nothing is split)."""


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float64).reshape(shape).to(dtype)


def cases() -> list[Case]:
    """Fresh corpus trees (fresh so a test that mutates one cannot affect another)."""
    dd: defaultdict[str, Any] = defaultdict(list)
    dd["z"] = _t(6, 2)
    dd["a"] = "tag"
    return [
        Case("tensor_1d", _t(6), 6),
        Case("tensor_3d", _t(5, 2, 3), 5),
        Case("tensor_0d", torch.tensor(3.5), None),
        Case("int_tensor", _t(7, 2, dtype=torch.int64), 7),
        Case("bool_tensor", torch.tensor([True, False, True, True]), 4),
        Case("string", "hello", None),
        Case("int", 3, None),
        Case("float", 2.5, None),
        Case("none", None, None),
        Case("empty_dict", {}, None),
        Case("empty_tuple", (), None),
        Case("empty_list", [], None),
        Case(
            "nested_dict",
            {"z": {"b": _t(6, 3), "a": {"deep": _t(6)}}, "meta": {"lr": 0.1, "tag": "x"}},
            6,
        ),
        Case("tuple", (_t(4, 2), "s", (_t(4), 7)), 4),
        Case("list", [_t(3), None, [_t(3, 1)]], 3),
        Case("namedtuple", Point(_t(5, 2), "label"), 5),
        Case("typing_namedtuple", Batch(ids=_t(5, dtype=torch.int64), mask=None), 5),
        Case("dataclass", Sample(image=_t(4, 3), label=_t(4, dtype=torch.int64)), 4),
        Case("frozen_dataclass", FrozenSample(image=_t(4, 3), label="cat"), 4),
        Case("static_field", Tagged(data=_t(6, 2), name="eval"), 6),
        Case("metadata_static", MarkedStatic(data={"q": _t(3)}, version=7), 3),
        Case(
            "model_output",
            CausalLMOutput(logits=_t(4, 5), hidden_states=(_t(4, 2), _t(4, 2))),
            4,
        ),
        Case("model_output_all", CausalLMOutput(loss=torch.tensor(0.25), logits=_t(4, 5)), 4),
        Case("dict_subclass", AttrDict(b=_t(5), a="note"), 5),
        Case("ordered_dict", OrderedDict([("z", _t(5)), ("a", _t(5, 2))]), 5),
        Case("defaultdict", dd, 6),
        Case("none_inside", {"a": None, "b": (None, _t(2)), "c": []}, 2),
        Case("scalars", {"i": 1, "f": 0.5, "b": True, "s": "str", "t": torch.tensor(2)}, None),
        Case("keys_reversed", {"b": _t(6), "a": _t(6, 2)}, 6),
        Case("mixed", {"x": [Point(_t(6), {"k": _t(6, 1)})], "y": (Sample(_t(6), 1),)}, 6),
    ]


CASES = cases()
CASE_IDS = [c.name for c in CASES]


def gather_inverse(tree: Any) -> Any:
    """The gather layout undoing scatter's default on ``tree``: a prefix tree with ``cat`` for
    tensors of one or more dims and ``first`` for every other leaf (and ``None`` nodes)."""
    from treegather._tree import flatten

    leaves, spec = flatten(tree)
    rules = ["cat" if isinstance(v, torch.Tensor) and v.dim() > 0 else "first" for v in leaves]
    return spec.unflatten(rules)


# ------------------------------------------------------------------------- rules of your own


# Rules written outside treegather, as a user reading the rule classes might: the one way to
# write a gather rule of your own is a callable (``Rule`` is internal, not in the public face).
class PlainMax(Rule):
    def combine(self, col: tuple[Any, ...], ctx: Any) -> Any:
        return torch.stack(col).amax(0)


@dataclasses.dataclass(frozen=True)
class FrozenMax(Rule):
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class GatherMax(GatherRule):
    def combine(self, col: tuple[Any, ...], ctx: Any) -> Any:
        return torch.stack(col).amax(0)


class SplitHalf(ScatterRule):
    pass


FOREIGN: list[Any] = [PlainMax(), FrozenMax(), GatherMax(), SplitHalf()]


# ------------------------------------------------------------------------------ pad fills

# A fill beyond each kind of dtype: float and integer ranges, NaN/inf in integers, complex in
# reals, an infinity a float8 dtype does not have, a zero float8_e8m0fnu does not have.
FILLS_THAT_DO_NOT_FIT: list[tuple[torch.dtype, Any]] = [
    (torch.float16, 70000.0),
    (torch.bfloat16, 1e39),
    (torch.float32, 1e39),
    (torch.float64, 10**400),
    (torch.int8, 128),
    (torch.int32, float("nan")),
    (torch.int64, float("inf")),
    (torch.float32, 1j),
    (torch.complex64, complex(1e39, 0)),
    (torch.complex32, complex(0, 70000)),
    (torch.float8_e4m3fn, float("inf")),
    (torch.float8_e8m0fnu, 0.0),
]


__all__ = [
    "AttrDict",
    "Batch",
    "CASES",
    "CASE_IDS",
    "Case",
    "CausalLMOutput",
    "FILLS_THAT_DO_NOT_FIT",
    "FOREIGN",
    "FrozenSample",
    "MarkedStatic",
    "ModelOutputBase",
    "Point",
    "Sample",
    "Tagged",
    "assert_tree_equal",
    "cases",
    "gather_inverse",
]
