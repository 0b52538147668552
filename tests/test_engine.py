"""Differential tests: the compiled layer against the plain path it optimises (issue 10, item 3).

The reference is the public function run inside :func:`treegather._caches.reference_only`
(the plain steps, no cache). The same call through the public function (the compiled layer)
must give exactly the same result (container types, dict key order, dtypes, values, shard
sizes) or the same error type with the same message:

- cold (just after :func:`treegather.clear_caches`),
- warm (the same structure ``COMPILE_AFTER + 2`` times, so guards and builders are compiled),
- after other structures with the same root type (each leaf in turn replaced by a list),
- with two structures alternating (an unrelated tree, the same tree with every dict's keys in
  reverse order, or with static fields, dict keys and layout values swapped for values ``==``
  merges with them: ``1``/``True``/``1.0``, ``"a"``/a str enum, ``pad(fill=1)``/``fill=True``),
- from four threads at once.

Trees mix dicts (str, str-enum and int keys in random insertion order), lists, tuples,
namedtuples, registered dataclasses (one frozen, two with a static field), a class registered
only with torch's pytree, ``None``, strings and Python numbers, and float32/int64/bool tensors
sharing a batch dim (some 0-dim); a third of the pairs are the per-step case (batched tensors
only, default layouts). Layouts: ``None``, one rule, :func:`treegather.by_path` patterns (exact,
``*``, ``**``) and prefix trees, drawn from every scatter and gather rule and some invalid ones.

Trees per run (``ci`` profile, derandomized): :func:`test_differential` draws 2 trees per
example for ``MAIN_EXAMPLES = 520`` examples (1,040 trees, checked by the test itself), and
:func:`test_differential_threads` 2 trees per example for ``THREAD_EXAMPLES = 60`` examples
(120 trees): at least 1,160 generated trees in all, plus every corpus case in
:func:`test_corpus_differential`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import corpus
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from corpus import Batch, FrozenSample, MarkedStatic, Point, Sample, Tagged, assert_tree_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treegather as tg
from treegather import _caches, _compiled
from treegather._rules import Pad

MAIN_EXAMPLES = 520
THREAD_EXAMPLES = 60
WARM_CALLS = _compiled.COMPILE_AFTER + 2
THREADS = 4


# ------------------------------------------------------------------------------ outcomes


class Outcome(NamedTuple):
    """What one call did: its result, or its error's type and message."""

    value: Any
    error: type[BaseException] | None
    message: str


def run(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(call(), None, "")
    except Exception as exc:
        return Outcome(None, type(exc), str(exc))


def reference(call: Callable[[], Any]) -> Outcome:
    with _caches.reference_only():
        return run(call)


def assert_same(actual: Outcome, expected: Outcome, context: str) -> None:
    """Exactly the same result (including shard sizes and devices), or the same error."""
    assert actual.error is expected.error, (
        f"{context}: {actual.error} ({actual.message!r}) != {expected.error} ({expected.message!r})"
    )
    if expected.error is not None:
        assert actual.message == expected.message, f"{context}: messages differ"
        return
    assert_tree_equal(actual.value, expected.value, context)
    # assert_tree_equal compares dict keys with ==, which takes {True: x} for {1: x}.
    assert typed_keys(actual.value) == typed_keys(expected.value), f"{context}: dict key types"
    if isinstance(expected.value, tg.Shards):
        assert actual.value.sizes == expected.value.sizes, f"{context}: sizes"
        assert actual.value.devices == expected.value.devices, f"{context}: devices"


def typed_keys(tree: Any) -> list[tuple[type, Any]]:
    """Every dict key in ``tree`` with its type, in order (containers walked as
    :func:`corpus.assert_tree_equal` walks them, not through treegather)."""
    out: list[tuple[type, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            continue
        if isinstance(node, dict):
            out.extend((type(k), k) for k in node)
            stack.extend(reversed(list(node.values())))
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(reversed([getattr(node, f.name) for f in dataclasses.fields(node)]))
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
    return out


# ------------------------------------------------------------------------------ blueprints
# A blueprint describes a tree independently of the batch size and the replica, so that the
# same structure can be built for scatter (one tree) and for gather (one tree per replica,
# each with its own batch size and values).
#
#   ("tensor", dtype, batched, trailing_shape, seed)   ("atom", value)   ("none",)
#   ("dict", ((key, child), ...))   ("list", children)   ("tuple", children)
#   ("point" | "batch" | "sample" | "frozen", (child, child))
#   ("tagged", child, name)   ("marked", child, version)      (static fields: name, version)

DTYPES = (torch.float32, torch.int64, torch.bool)
STATICS = ("train", 1, True, 1.0, 0, False)


@dataclasses.dataclass
class TorchPair:
    """A class registered only with torch's pytree (as transformers registers ``ModelOutput``)."""

    first: Any
    second: Any


torch_pytree.register_pytree_node(
    TorchPair,
    lambda p: ([p.first, p.second], ["first", "second"]),
    lambda children, names: TorchPair(*children),
)

PAIRS = {
    "point": Point,
    "batch": Batch,
    "sample": Sample,
    "frozen": FrozenSample,
    "torch": TorchPair,
}
FIELDS = {"point": Point._fields, "batch": Batch._fields, "torch": ("first", "second")}


def custom_rule(values: list[Any], device: torch.device) -> Any:
    """A custom gather rule (the same object everywhere, as callables compare by identity)."""
    return ("custom", len(values), str(device))


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(offset, offset + n, dtype=torch.int64).reshape(shape)
    if dtype is torch.bool:
        return base % 3 == 0
    return base.to(dtype)


def build(bp: Any, batch: int, replica: int = 0, reverse: bool = False) -> Any:
    """The tree ``bp`` describes, with ``batch`` rows per batched tensor, for ``replica``.

    ``reverse``: every dict's keys in reverse insertion order (the same structure to gather).
    """
    kind = bp[0]
    if kind == "tensor":
        _, dtype, batched, trailing, seed = bp
        shape = (batch, *trailing) if batched else ()
        return _tensor(dtype, shape, seed + 100 * replica)
    if kind == "atom":
        return bp[1]
    if kind == "none":
        return None
    if kind == "dict":
        items = [(k, build(c, batch, replica, reverse)) for k, c in bp[1]]
        return dict(reversed(items) if reverse else items)
    if kind in ("list", "tuple"):
        children = [build(c, batch, replica, reverse) for c in bp[1]]
        return children if kind == "list" else tuple(children)
    if kind in PAIRS:
        return PAIRS[kind](*(build(c, batch, replica, reverse) for c in bp[1]))
    if kind == "tagged":
        return Tagged(build(bp[1], batch, replica, reverse), bp[2])
    if kind == "marked":
        return MarkedStatic(build(bp[1], batch, replica, reverse), bp[2])
    raise AssertionError(bp)


def paths(bp: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every node's path below the root, as :func:`treegather.by_path` segments."""
    kind = bp[0]
    named: list[tuple[str, Any]] = []
    if kind == "dict":
        named = [(str(k), c) for k, c in bp[1]]
    elif kind in ("list", "tuple"):
        named = [(str(i), c) for i, c in enumerate(bp[1])]
    elif kind in PAIRS:
        fields = FIELDS.get(kind, ("image", "label"))
        named = list(zip(fields, bp[1]))
    elif kind in ("tagged", "marked"):
        named = [("data", bp[1])]
    out: list[tuple[str, ...]] = []
    for name, child in named:
        out.append((*prefix, name))
        out.extend(paths(child, (*prefix, name)))
    return out


class Key(str, enum.Enum):
    """A str-enum dict key: equal to (and hashed as) the plain string ``"a"``."""

    A = "a"


# Values Python's == merges, each replaced by another of its class (old, new): matched by type
# and value (a dict of them would merge its own keys).
EQUAL_VALUES: list[tuple[Any, Any]] = [
    (1, True),
    (True, 1.0),
    (1.0, 1),
    (0, False),
    (False, 0),
    ("a", Key.A),
    (Key.A, "a"),
]


def swap_equal(value: Any) -> Any:
    """``value`` replaced by an equal value of another type (``1`` -> ``True``), if it has one."""
    return next(
        (new for old, new in EQUAL_VALUES if type(old) is type(value) and old == value), value
    )


def swap_equal_bp(bp: Any) -> Any:
    """``bp`` with static fields and dict keys swapped through :data:`EQUAL_VALUES`."""
    kind = bp[0]
    if kind == "dict":
        return ("dict", tuple((swap_equal(k), swap_equal_bp(c)) for k, c in bp[1]))
    if kind in ("list", "tuple") or kind in PAIRS:
        return (kind, tuple(swap_equal_bp(c) for c in bp[1]))
    if kind in ("tagged", "marked"):
        return (kind, swap_equal_bp(bp[1]), swap_equal(bp[2]))
    return bp


def swap_equal_layout(layout: Any) -> Any:
    """``layout`` with ints, bools, floats and ``pad``'s fill swapped through :data:`EQUAL_VALUES`."""
    if isinstance(layout, tg.ByPath):
        patterns = {p: swap_equal_layout(r) for p, _, r in layout.patterns}
        return tg.by_path(patterns, swap_equal_layout(layout.default))
    if isinstance(layout, Pad):
        return dataclasses.replace(layout, fill=swap_equal(layout.fill))
    if type(layout) in (dict, list, tuple):
        return optree.tree_map(swap_equal_layout, layout, none_is_leaf=True)
    return swap_equal(layout) if type(layout) in (int, bool, float) else layout


def _leaf() -> st.SearchStrategy[Any]:
    tensors = st.tuples(
        st.just("tensor"),
        st.sampled_from(DTYPES),
        st.booleans(),
        st.sampled_from([(), (), (2,), (1, 3)]),
        st.integers(0, 50),
    )
    atoms = st.tuples(
        st.just("atom"),
        st.one_of(
            st.sampled_from(["", "tag", "a.b"]),
            st.integers(-3, 3),
            st.sampled_from([0.5, -2.0, 1.0]),
            st.booleans(),
        ),
    )
    return st.one_of(tensors, tensors, atoms, st.just(("none",)))


KINDS = ("dict", "dict", "list", "tuple", *sorted(PAIRS), "tagged", "marked")
KEYS = st.one_of(st.sampled_from(["a", "b", "c", "loss", "x", Key.A]), st.integers(0, 3))


def _node(kind: str, kids: list[Any], keys: list[Any], static: Any) -> Any:
    if kind == "dict":
        return ("dict", tuple(zip(keys, kids)))  # keys in drawn (random) insertion order
    if kind in ("list", "tuple"):
        return (kind, tuple(kids[:3]))
    padded = [*kids, ("none",), ("none",)]
    if kind in PAIRS:
        return (kind, tuple(padded[:2]))
    return (kind, padded[0], static)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # ``children`` appears once, so that the strategy's repr stays small at any depth.
    return st.builds(
        _node,
        st.sampled_from(KINDS),
        st.lists(children, max_size=4),
        st.lists(KEYS, min_size=4, max_size=4, unique=True),
        st.sampled_from(STATICS),
    )


BLUEPRINTS = st.recursive(_leaf(), _extend, max_leaves=10)

SCATTER_RULES: list[Any] = [
    tg.split(),
    tg.split(1),
    tg.split(sizes=[1, 1]),
    tg.broadcast(),
    tg.split_items(),
    0,
    1,
    None,
    "split",
    "broadcast",
    "split_items",
    True,
    "splt",
    tg.mean(),
]
GATHER_RULES: list[Any] = [
    tg.cat(),
    tg.cat(1),
    tg.stack(),
    tg.mean(),
    tg.sum(),
    tg.pad(),
    tg.pad(fill=-1, lengths=True),
    tg.pad(fill=1),
    tg.as_list(),
    tg.first(),
    tg.first(check=True),
    tg.cat_items(),
    custom_rule,
    0,
    1,
    None,
    "mean",
    "sum",
    "stack",
    "first",
    "as_list",
    "cat_items",
    "pad",
    True,
    1.0,
    tg.split(),
]


@st.composite
def layouts(draw: st.DrawFn, bp: Any, rules: list[Any]) -> Any:
    """None, one rule, by_path patterns over the tree's paths, or a prefix tree of rules."""
    kind = draw(st.sampled_from(["none", "rule", "by_path", "by_path", "prefix"]))
    if kind == "none":
        return None
    rule = st.sampled_from(rules)
    if kind == "rule":
        return draw(rule)
    if kind == "prefix":
        # Per-leaf rules in the tree's own containers (what corpus.gather_inverse builds).
        _, spec = optree.tree_flatten(build(bp, 1), namespace=tg.NAMESPACE)
        return spec.unflatten(
            draw(st.lists(rule, min_size=spec.num_leaves, max_size=spec.num_leaves))
        )
    known = paths(bp) or [("nothing",)]
    patterns: dict[str, Any] = {}
    for _ in range(draw(st.integers(1, 3))):
        segs = list(draw(st.sampled_from(known)))
        shape = draw(st.sampled_from(["exact", "exact", "star", "deep"]))
        if shape == "star":
            segs[draw(st.integers(0, len(segs) - 1))] = "*"
        elif shape == "deep":
            segs = ["**", segs[-1]]
        patterns[".".join(segs)] = draw(rule)
    default = draw(st.one_of(st.none(), rule)) if draw(st.integers(0, 4)) == 0 else None
    return tg.by_path(patterns, default)


class Case(NamedTuple):
    """One tree (and its replicas' outputs) with a scatter and a gather layout."""

    name: str
    tree: Any
    devices: list[str]
    scatter_layout: Any
    outputs: list[Any]
    gather_layout: Any
    dim: int
    sizes: tuple[int, ...] | None

    def scatter(self) -> Any:
        return tg.scatter(self.tree, self.devices, self.scatter_layout, dim=self.dim)

    def scatter_kwargs(self) -> Any:
        """The tree as one positional and one keyword argument (paths start at ``0`` or
        ``kw``: a by_path or prefix-tree layout written for the tree alone is used as ``None``)."""
        layout = self.scatter_layout
        if isinstance(layout, (tg.ByPath, dict, list, tuple)) or dataclasses.is_dataclass(layout):
            layout = None
        return tg.scatter_kwargs(
            (self.tree,), {"kw": self.tree}, self.devices, layout, dim=self.dim
        )

    def gather(self) -> Any:
        return tg.gather(self.outputs, "cpu", self.gather_layout, dim=self.dim, sizes=self.sizes)


class Params(NamedTuple):
    """What :func:`params` draws besides the blueprint (reused for a variant of the same tree)."""

    batch: int
    replica_batches: list[int]
    reverse_one: bool
    mismatch: str | None
    scatter_layout: Any
    gather_layout: Any
    dim: int
    pass_sizes: bool


@st.composite
def params(draw: st.DrawFn, bp: Any) -> Params:
    k = draw(st.integers(1, 3))
    return Params(
        batch=draw(st.integers(1, 5)),
        replica_batches=draw(st.lists(st.integers(1, 3), min_size=k, max_size=k)),
        reverse_one=draw(st.integers(0, 4)) == 0,  # replica 1's dicts in another key order
        # The last replica differs (a mismatch to report) one time in six.
        mismatch=draw(st.sampled_from([None] * 15 + ["atom", "list", "none"])),
        scatter_layout=draw(layouts(bp, SCATTER_RULES)),
        gather_layout=draw(layouts(bp, GATHER_RULES)),
        dim=draw(st.sampled_from([0, 0, 0, 0, 1, -1])),
        pass_sizes=draw(st.booleans()),
    )


def make_case(bp: Any, name: str, p: Params) -> Case:
    k = len(p.replica_batches)
    outputs = [
        build(bp, b, r, reverse=p.reverse_one and r == 1) for r, b in enumerate(p.replica_batches)
    ]
    if p.mismatch is not None:
        outputs[-1] = build(perturb(bp, p.mismatch), p.replica_batches[-1], k - 1)
    return Case(
        name=name,
        tree=build(bp, p.batch),
        devices=["cpu"] * k,
        scatter_layout=p.scatter_layout,
        outputs=outputs,
        gather_layout=p.gather_layout,
        dim=p.dim,
        sizes=tuple(p.replica_batches) if p.pass_sizes else None,
    )


def batched_only(bp: Any) -> Any:
    """``bp`` with every leaf a batched tensor (``None`` nodes kept): the per-step case, which
    the compiled layer runs without the reference steps once the structure is known."""
    kind = bp[0]
    if kind == "tensor":
        return ("tensor", bp[1], True, bp[3], bp[4])
    if kind == "atom":
        return ("tensor", torch.float32, True, (), 7)
    if kind == "dict":
        return ("dict", tuple((k, batched_only(c)) for k, c in bp[1]))
    if kind in ("list", "tuple") or kind in PAIRS:
        return (kind, tuple(batched_only(c) for c in bp[1]))
    if kind in ("tagged", "marked"):
        return (kind, batched_only(bp[1]), bp[2])
    return bp


@st.composite
def blueprint_and_params(draw: st.DrawFn, plain: bool) -> tuple[Any, Params]:
    bp = draw(BLUEPRINTS)
    if not plain:
        return bp, draw(params(bp))
    bp = batched_only(bp)
    p = draw(params(bp))
    return bp, p._replace(scatter_layout=None, gather_layout=None, dim=0, mismatch=None)


@st.composite
def case_pairs(draw: st.DrawFn) -> tuple[Case, Case]:
    """Two cases to alternate: B is unrelated to A, A with its dicts' keys reversed, or A with
    its static fields, dict keys and layout values swapped for values Python's ``==`` merges
    with them (``1`` and ``True``, ``"a"`` and a str enum), under the same layouts.

    One pair in three is "plain" (batched tensors only, default layouts, ``dim=0``): the per-step
    case the compiled layer runs on its own, without the reference steps.
    """
    plain = draw(st.integers(0, 2)) == 0
    bp_a, p_a = draw(blueprint_and_params(plain))
    a = make_case(bp_a, "A", p_a)
    how = draw(st.sampled_from(["other", "reversed", "equal"]))
    if how == "other":
        bp_b, p_b = draw(blueprint_and_params(plain))
        return a, make_case(bp_b, "B(other)", p_b)
    if how == "reversed":
        return a, make_case(_reversed(bp_a), "B(reversed)", p_a)
    p_b = p_a._replace(
        scatter_layout=swap_equal_layout(p_a.scatter_layout),
        gather_layout=swap_equal_layout(p_a.gather_layout),
    )
    return a, make_case(swap_equal_bp(bp_a), "B(equal)", p_b)


def perturb(bp: Any, how: str) -> Any:
    """``bp`` with its first leaf (pre-order) replaced: by a string (a leaf of another type),
    by a one-item list (a subtree where a leaf was) or by ``None`` (an empty node)."""
    done = [False]

    def walk(node: Any) -> Any:
        kind = node[0]
        if kind in ("tensor", "atom", "none"):
            if done[0]:
                return node
            done[0] = True
            return {"atom": ("atom", "x"), "list": ("list", (node,)), "none": ("none",)}[how]
        if kind == "dict":
            return ("dict", tuple((k, walk(c)) for k, c in node[1]))
        if kind in ("list", "tuple") or kind in PAIRS:
            return (kind, tuple(walk(c) for c in node[1]))
        return (kind, walk(node[1]), node[2])

    return walk(bp)


def _reversed(bp: Any) -> Any:
    kind = bp[0]
    if kind == "dict":
        return ("dict", tuple((k, _reversed(c)) for k, c in reversed(bp[1])))
    if kind in ("list", "tuple") or kind in PAIRS:
        return (kind, tuple(_reversed(c) for c in bp[1]))
    if kind in ("tagged", "marked"):
        return (kind, _reversed(bp[1]), bp[2])
    return bp


# ------------------------------------------------------------------------------ scenarios

OPS = ("scatter", "scatter_kwargs", "gather")


def expected_of(case: Case) -> dict[str, Outcome]:
    return {op: reference(getattr(case, op)) for op in OPS}


def check(case: Case, expected: dict[str, Outcome], when: str) -> None:
    for op in OPS:
        assert_same(run(getattr(case, op)), expected[op], f"{op} {case.name} {when}")


def others(case: Case) -> list[Case]:
    """Cases with the same root type but another structure: each leaf in turn put in a list."""
    out = []
    leaves, spec = optree.tree_flatten(case.tree, namespace=tg.NAMESPACE)
    outs = [optree.tree_flatten(o, namespace=tg.NAMESPACE) for o in case.outputs]
    for i in range(min(len(leaves), 3)):
        tree = spec.unflatten([[v] if j == i else v for j, v in enumerate(leaves)])
        outputs = [
            s.unflatten([[v] if j == i else v for j, v in enumerate(ls)]) if s == spec else o
            for (ls, s), o in zip(outs, case.outputs)
        ]
        out.append(case._replace(name=f"{case.name}/other{i}", tree=tree, outputs=outputs))
    return out


def differential(a: Case, b: Case) -> None:
    """Cold, warm, after other structures, and alternating, against the reference."""
    exp_a, exp_b = expected_of(a), expected_of(b)
    tg.clear_caches()
    check(a, exp_a, "cold")
    for i in range(WARM_CALLS):
        check(a, exp_a, f"warm call {i + 2}")
    for other in others(a):
        exp_o = expected_of(other)
        for when in ("after A", "again"):
            check(other, exp_o, when)
        check(a, exp_a, f"after {other.name}")
    for i in range(WARM_CALLS):
        check(b, exp_b, f"alternating {i}")
        check(a, exp_a, f"alternating {i}")


TREES_SEEN = [0]


@settings(max_examples=MAIN_EXAMPLES, suppress_health_check=list(HealthCheck))
@given(case_pairs())
def _differential_property(pair: tuple[Case, Case]) -> None:
    TREES_SEEN[0] += 2
    differential(*pair)


def test_differential() -> None:
    """The compiled layer equals the reference on >= 1,000 generated trees (two per example)."""
    TREES_SEEN[0] = 0
    _differential_property()
    assert TREES_SEEN[0] >= 1000, f"only {TREES_SEEN[0]} trees were generated"


@settings(max_examples=THREAD_EXAMPLES, suppress_health_check=list(HealthCheck))
@given(case_pairs())
def test_differential_threads(pair: tuple[Case, Case]) -> None:
    """Four threads at once, each alternating both structures from a cold start."""
    a, b = pair
    expected = {a.name: expected_of(a), b.name: expected_of(b)}
    tg.clear_caches()
    barrier = threading.Barrier(THREADS)
    seen: list[tuple[str, str, Outcome]] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        mine = []
        for i in range(WARM_CALLS):
            for case in (a, b) if i % 2 else (b, a):
                for op in OPS:
                    mine.append((case.name, op, run(getattr(case, op))))
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == THREADS * WARM_CALLS * 2 * len(OPS)
    for name, op, outcome in seen:
        assert_same(outcome, expected[name][op], f"{op} {name} in a thread")


# ------------------------------------------------------------------------------ recognition


@pytest.mark.parametrize(
    "tree",
    [c.tree for c in corpus.CASES] + [TorchPair(torch.zeros(4, 2), {"x": torch.zeros(4)})],
    ids=[*corpus.CASE_IDS, "torch_pytree_node"],
)
def test_a_structure_is_recognised_from_its_second_call(tree: Any) -> None:
    """A structure seen before is recognised: one :class:`~treegather._compiled.structure.Structure`,
    found again on every later call. Otherwise the structure never takes the compiled path, and
    each call learns it anew (evicting other structures with its root type)."""
    found = [_compiled.recognise(tree)[1] for _ in range(WARM_CALLS)]
    assert found[0] is None  # a first sighting is only counted
    assert found[1] is not None
    assert [s is found[1] for s in found[1:]] == [True] * (WARM_CALLS - 1)
    assert found[1].hits == WARM_CALLS - 2


# ------------------------------------------------ minimal cases the differential property found


def test_warm_gather_explains_a_dim_out_of_range_as_a_cold_call_does() -> None:
    """``gather(..., dim=1)`` of 1-dim tensors is a :class:`ShapeMismatchError` naming the leaf,
    on every call: not torch's bare ``IndexError`` once the structure is known."""
    outs = [torch.zeros(3), torch.zeros(2)]
    messages = []
    for _ in range(WARM_CALLS):
        with pytest.raises(tg.ShapeMismatchError) as info:
            tg.gather(outs, "cpu", dim=1)
        messages.append(str(info.value))
    assert messages == [messages[0]] * WARM_CALLS


# ------------------------------------------------------ results built from the call's objects


class EqualKey:
    """A dict key equal to (and hashed as) every EqualKey of its name, whatever its tag: two
    calls' keys pass for each other, yet a result must hold the caller's own."""

    def __init__(self, name: str, tag: int) -> None:
        self.name, self.tag = name, tag

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EqualKey) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"EqualKey({self.name!r})"


@tg.register_dataclass(static=("names",))
@dataclasses.dataclass
class Named:
    """A registered dataclass whose static field holds a list."""

    data: Any
    names: list[str]


def _metadata_objects(tree: Any) -> list[Any]:
    """Every dict key and static field value in ``tree``, in order (walked here, not through
    treegather)."""
    out: list[Any] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            continue
        if isinstance(node, dict):
            out.extend(node)
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, (Named, Tagged)):
            out.append(node.names if isinstance(node, Named) else node.name)
            stack.append(node.data)
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
    return out


def _fresh_tree(kind: str, call: int, rows: int = 4) -> Any:
    """A new tree of one structure on every call: new metadata objects, equal to the last."""
    data = torch.arange(rows * 2.0).view(rows, 2)
    if kind == "static list":
        return {"out": Named(data, ["a"]), "x": data + 1}
    if kind == "equal keys":
        return {EqualKey("k", call): data, "m": {EqualKey("j", call): data + 1}}
    if kind == "signed zero":  # -0.0 and 0.0 are equal, and one typed value
        return Tagged(data, float("-0.0") if call % 2 else float("0.0"))
    raise AssertionError(kind)


_OWN_CALLS: dict[str, Callable[[Any], Any]] = {
    "scatter": lambda tree: tg.scatter(tree, ["cpu"] * 2),
    "scatter by_path": lambda tree: tg.scatter(tree, ["cpu"] * 2, tg.by_path({"**": "split"})),
    "scatter_kwargs": lambda tree: tg.scatter_kwargs((tree,), {"kw": tree}, ["cpu"] * 2)[0],
    "gather": lambda outs: tg.gather(outs, "cpu"),
    "gather by_path": lambda outs: tg.gather(outs, "cpu", tg.by_path({"**": "cat"})),
    "gather group": lambda outs: tg.gather(outs, "cpu", tg.by_path({"*": tg.as_list()})),
}


@pytest.mark.parametrize("kind", ["static list", "equal keys", "signed zero"])
@pytest.mark.parametrize("op", sorted(_OWN_CALLS))
def test_results_are_built_from_the_calls_own_objects(kind: str, op: str) -> None:
    """Static fields and dict keys of a result are the objects of this call's tree (for gather,
    replica 0's), on every call, as the plain path builds them: never a structure seen before's.

    Before, once a structure was compiled, a static list in every result was the cached spec's
    own (``out.names.append(...)`` changed every later result), keys were the first call's,
    and a ``-0.0`` static came back as the first call's ``0.0``.
    """
    call = _OWN_CALLS[op]
    tg.clear_caches()
    for i in range(WARM_CALLS + 2):
        if op.startswith("gather"):
            given = [_fresh_tree(kind, i, rows) for rows in (2, 3)]
            source = given[0]
        else:
            given = source = _fresh_tree(kind, i)
        expected = reference(functools.partial(call, given))
        actual = run(functools.partial(call, given))
        assert_same(actual, expected, f"{op} call {i + 1}")
        scattered = op.startswith("scatter")
        results = list(actual.value) if scattered else [actual.value]
        references = list(expected.value) if scattered else [expected.value]
        mine = _metadata_objects(source)
        for result, ref in zip(results, references):
            shared, plain = _metadata_objects(result), _metadata_objects(ref)
            assert len(shared) == len(plain)
            assert all(a is b for a, b in zip(shared, plain)), f"{op} call {i + 1}: not its own"
            if op != "gather group":  # (as_list also holds replica 1's subtrees)
                assert all(a is b for a, b in zip(shared, mine)), f"{op} call {i + 1}"
        if i == WARM_CALLS:  # a caller editing a result changes no later result
            for result in results:
                for value in _metadata_objects(result):
                    if isinstance(value, list):
                        value.append("edited")


# --------------------------------------------------------------------------------- corpus


def _corpus_calls(case: corpus.Case) -> dict[str, Callable[[], Any]]:
    devices = ["cpu"] * 3
    tree = case.tree
    shards = tg.scatter(tree, devices) if case.batch is not None else [tree, tree]
    outs = list(shards)
    inverse = corpus.gather_inverse(outs[0])
    return {
        "scatter": lambda: tg.scatter(tree, devices),
        "scatter broadcast": lambda: tg.scatter(tree, devices, tg.broadcast()),
        "scatter_kwargs": lambda: tg.scatter_kwargs((tree,), {"kw": tree}, devices),
        "gather": lambda: tg.gather(outs, "cpu"),
        "gather inverse": lambda: tg.gather(outs, "cpu", inverse),
        "gather first": lambda: tg.gather(outs, "cpu", tg.first(check=True)),
        "gather as_list by_path": lambda: tg.gather(outs, "cpu", tg.by_path({}, tg.as_list())),
    }


@pytest.mark.parametrize("case", corpus.CASES, ids=corpus.CASE_IDS)
def test_corpus_differential(case: corpus.Case) -> None:
    """Every corpus tree: cold, warm and alternating with another corpus tree."""
    calls = _corpus_calls(case)
    other = _corpus_calls(corpus.CASES[(corpus.CASES.index(case) + 1) % len(corpus.CASES)])
    expected = {name: reference(call) for name, call in calls.items()}
    expected_other = {name: reference(call) for name, call in other.items()}
    tg.clear_caches()
    for i in range(WARM_CALLS + 1):
        for name, call in calls.items():
            assert_same(run(call), expected[name], f"{case.name} {name} call {i + 1}")
            assert_same(run(other[name]), expected_other[name], f"other {name} call {i + 1}")


def _meta_or_real(meta: bool, at: str) -> list[dict[str, torch.Tensor]]:
    """Two replicas of one structure; with ``meta``, the leaf ``at`` is a meta tensor in both."""
    outs = []
    for r in range(2):
        tree = {"a": torch.full((2, 3), float(r)), "b": torch.ones(2, 2) + r, "c": torch.ones(2, 1)}
        if meta:
            tree[at] = torch.empty(tree[at].shape, device="meta")
        outs.append(tree)
    return outs


@pytest.mark.parametrize("at", ["a", "b", "c"])
@pytest.mark.parametrize("dim", [0, 1])
def test_meta_leaves_after_real_calls_differential(at: str, dim: int) -> None:
    """A structure compiled with CPU tensors, then the same structure with a meta tensor at any
    position (the per-step path cats in C: a column wholly on ``meta`` used to come back
    there), alternating: the same result or error as the plain path, every call."""
    real, meta = _meta_or_real(False, at), _meta_or_real(True, at)
    expected = {
        name: reference(lambda o=outs: tg.gather(o, "cpu", dim=dim))
        for name, outs in (("real", real), ("meta", meta))
    }
    assert expected["real"].error is None
    assert expected["meta"].error is tg.LeafTypeError
    assert f"outputs['{at}']: a meta tensor" in expected["meta"].message
    for i in range(WARM_CALLS + 1):
        for name, outs in (("real", real), ("meta", meta)):
            got = run(lambda o=outs: tg.gather(o, "cpu", dim=dim))
            assert_same(got, expected[name], f"{name} call {i + 1}")


class _Holder:
    """An unregistered object holding the batch (a leaf)."""

    def __init__(self, x: Any) -> None:
        self.meta, self.parts = "m", [x]


class _Slotted:
    __slots__ = ("x",)

    def __init__(self, x: Any) -> None:
        self.x = x


_HELD = {
    "object": lambda: _Holder(torch.zeros(4, 2)),
    "slots": lambda: _Slotted(torch.arange(4)),
    "UserDict": lambda: collections.UserDict(ids=torch.zeros(4)),
    "object without tensors": lambda: _Holder("no tensor"),
    "module": lambda: torch.nn.Linear(2, 2),
}


@pytest.mark.parametrize("held", list(_HELD))
def test_objects_holding_tensors_after_tensors_differential(held: str) -> None:
    """A structure compiled with tensors only, then the same structure with an unregistered
    object at one position, alternating: an object holding tensors is refused (it would be
    sent whole to every device) with the plain path's message, every call; one without tensors,
    and a module, is sent as it is."""
    value = _HELD[held]()
    plain = {"x": torch.zeros(4, 2), "v": torch.ones(4)}
    mixed = {"x": torch.zeros(4, 2), "v": value}
    calls = {
        "plain": lambda: tg.scatter(plain, ["cpu"] * 2),
        "mixed": lambda: tg.scatter(mixed, ["cpu"] * 2),
        "mixed kwargs": lambda: tg.scatter_kwargs((mixed,), {"kw": value}, ["cpu"] * 2),
    }
    expected = {name: reference(call) for name, call in calls.items()}
    refused = held in ("object", "slots", "UserDict")
    assert (expected["mixed"].error is tg.LeafTypeError) is refused
    if refused:
        assert expected["mixed"].message.startswith("inputs['v']: ")
        assert "would be sent whole to every device" in expected["mixed"].message
    tg.clear_caches()
    for i in range(WARM_CALLS + 1):
        for name, call in calls.items():
            assert_same(run(call), expected[name], f"{held} {name} call {i + 1}")


# ----------------------------------------------------------- rows the default would misplace


def _replicas(*trees: Any) -> list[Any]:
    return list(trees)


def _hidden(rows: tuple[int, ...], at: int) -> list[Any]:
    """An LSTM's ``(h_n, c_n)`` per replica, each replica's rows along dim ``at``."""
    return [
        (
            torch.full((1, r, 3) if at == 1 else (r, 1, 3), float(i)),
            torch.ones((1, r, 3) if at == 1 else (r, 1, 3)),
        )
        for i, r in enumerate(rows)
    ]


def _dets(rows: tuple[int, ...], boxes: int | None = None) -> list[Any]:
    """One dict per sample per replica: ``1 + sample % 3`` boxes, or ``boxes`` (``0``: as
    many as the replica's rows, the shapes of a list of batched tensors)."""
    return [
        {
            "dets": [
                {"boxes": torch.zeros(1 + j % 3 if boxes is None else boxes or r, 4)}
                for j in range(r)
            ],
            "x": torch.zeros(r, 2),
        }
        for r in rows
    ]


# (name, outputs, sizes, layout, dim) pairs: a case refused because of where its rows are, and
# one of the same structure that is not (or the same data under a layout that says where).
MISPLACED = {
    "lstm even": (_hidden((4, 4), 1), (4, 4), None, 0),
    "lstm uneven": (_hidden((4, 3), 1), (4, 3), None, 0),
    "lstm, rows first": (_hidden((4, 4), 0), (4, 4), None, 0),
    "lstm under cat(1)": (_hidden((4, 4), 1), (4, 4), tg.by_path({"*": tg.cat(1)}), 0),
    "lstm under cat(0)": (_hidden((4, 4), 1), (4, 4), (tg.cat(0), tg.cat(0)), 0),
    "lstm, no sizes": (_hidden((4, 4), 1), None, None, 0),
    "lstm, dim 1": (_hidden((4, 4), 0), (4, 4), None, 1),
    "lstm and a loss": (
        [{"h": h, "loss": torch.tensor(float(i))} for i, (h, _) in enumerate(_hidden((4, 4), 1))],
        (4, 4),
        None,
        0,
    ),
    "detections even": (_dets((2, 2)), (2, 2), None, 0),
    "detections uneven": (_dets((3, 2)), (3, 2), None, 0),
    "detections under cat_items": (
        _dets((2, 2)),
        (2, 2),
        {"dets": tg.cat_items(), "x": None},
        0,
    ),
    "boxes of the shard's rows": (_dets((2, 2), 0), (2, 2), None, 0),
}
PAIRS_OF_ROWS = [
    ("lstm even", "lstm, rows first"),
    ("lstm even", "lstm under cat(1)"),
    ("lstm uneven", "lstm even"),
    ("lstm even", "lstm under cat(0)"),
    ("lstm even", "lstm, no sizes"),
    ("lstm, dim 1", "lstm even"),
    ("lstm and a loss", "lstm, rows first"),
    ("detections even", "boxes of the shard's rows"),
    ("detections even", "detections under cat_items"),
    ("detections uneven", "detections even"),
]


def _rows_case(name: str) -> Case:
    outputs, sizes, layout, dim = MISPLACED[name]
    return Case(name, outputs[0], ["cpu"] * len(outputs), None, outputs, layout, dim, sizes)


@pytest.mark.parametrize("pair", PAIRS_OF_ROWS, ids=[f"{a} | {b}" for a, b in PAIRS_OF_ROWS])
def test_rows_elsewhere_differential(pair: tuple[str, str]) -> None:
    """A leaf whose rows are in another dim, a list of per-sample items (issue 47): refused by
    the compiled layer exactly as by the plain path, cold, warm and alternating with a tree of
    the same structure that is gathered (the per-step path compiled on it must not let the
    other through)."""
    a, b = (_rows_case(name) for name in pair)
    refused, gathered = expected_of(a)["gather"], expected_of(b)["gather"]
    assert refused.error in (tg.ShapeMismatchError, tg.StructureMismatchError), refused
    assert "its rows are along" in refused.message or "one item per sample" in refused.message
    assert gathered.error is None or b.name in ("lstm even", "detections even"), gathered
    differential(a, b)
