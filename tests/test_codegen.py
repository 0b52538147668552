"""The code the compiled layer generates: structure guards and per-device builders."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import optree
import pytest
import torch
from corpus import Sample
from hypothesis import given
from hypothesis import strategies as st

import treegather as tg
from treegather._compiled import COMPILE_AFTER
from treegather._compiled.builders import MAX_DEPTH, compiled_builder, compiled_unflatten
from treegather._compiled.codegen import (
    compiled_columns,
    compiled_guard,
    compiled_reader,
    guard_steps,
    interpreted_guard,
    structure_steps,
)
from treegather._tree import NAMESPACE, flatten

Pair = namedtuple("Pair", ["left", "right"])

LEAF = st.just(0)
KEY = st.sampled_from(["a", "b", "c", "loss", "x0", "if", "with space", "é", "'q'"])


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(KEY, children, max_size=4),  # insertion order as drawn, not sorted
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.none(),
    )


TREES = st.recursive(LEAF, _containers, max_leaves=12)


def _spec(tree: Any) -> optree.PyTreeSpec:
    return optree.tree_structure(tree, namespace=NAMESPACE)


def _compiled(spec: optree.PyTreeSpec, k: int) -> Any:
    return compiled_builder(spec, k)


def _same(a: Any, b: Any) -> bool:
    # Exactly the same containers, key orders and leaf objects.
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


@given(tree=TREES, k=st.integers(1, 4))
def test_a_builder_makes_what_unflatten_makes(tree: Any, k: int) -> None:
    spec = _spec(tree)
    columns = [tuple(object() for _ in range(k)) for _ in range(spec.num_leaves)]
    expected = [spec.unflatten([c[r] for c in columns]) for r in range(k)]
    build = _compiled(spec, k)
    if spec.num_leaves == 0:
        assert build is None  # nothing to split: scatter never asks
        return
    assert build is not None
    assert all(_same(a, b) for a, b in zip(build(*columns), expected, strict=True))


@pytest.mark.parametrize(
    "tree",
    [
        OrderedDict(a=0, b=0),
        {"p": Pair(0, 0)},
        {1: 0, "a": 0},
        {"s": Sample(image=torch.zeros(1), label=torch.zeros(1))},
    ],
    ids=["OrderedDict", "namedtuple", "int key", "dataclass"],
)
def test_structures_it_cannot_write_out_keep_unflatten(tree: Any) -> None:
    spec = _spec(tree)
    assert _compiled(spec, 2) is None


def test_too_deep_a_structure_keeps_unflatten() -> None:
    tree: Any = 0
    for _ in range(MAX_DEPTH + 1):
        tree = [tree]
    spec = _spec(tree)
    assert _compiled(spec, 2) is None


def test_scatter_gives_the_same_trees_before_and_after_compiling() -> None:
    def batch() -> dict[str, Any]:
        return {
            "z": torch.arange(12).reshape(6, 2),
            "a": [torch.arange(6), (torch.ones(6, 1), None)],
            "m": {"y": torch.zeros(6), "b": torch.ones(6, 3)},
        }

    first = tg.scatter(batch(), ["cpu"] * 4)
    for _ in range(COMPILE_AFTER + 2):
        again = tg.scatter(batch(), ["cpu"] * 4)
        assert again.sizes == first.sizes == (2, 2, 1, 1)
        for a, b in zip(again, first, strict=True):
            assert optree.tree_structure(a, namespace=NAMESPACE) == optree.tree_structure(
                b, namespace=NAMESPACE
            )
            assert list(a) == ["z", "a", "m"] and list(a["m"]) == ["y", "b"]
            assert all(torch.equal(x, y) for x, y in zip(flatten(a)[0], flatten(b)[0], strict=True))
    # The trees share no containers (each replica owns its dicts and lists).
    assert again[0]["m"] is not again[1]["m"] and again[0]["a"] is not again[1]["a"]


# ------------------------------------------------------------------------------------ guards

MUTATIONS = st.sampled_from(["same", "reorder", "retype", "grow", "leaf_to_none", "none_to_leaf"])


def _mutate(tree: Any, how: str) -> Any:
    """A tree of another structure (or the same one, for "same"), changed at its first node."""
    if how == "same" or tree is None or not isinstance(tree, (dict, list, tuple)):
        return tree if how == "same" else [tree]
    if isinstance(tree, dict):
        if how == "reorder" and len(tree) > 1:
            return dict(reversed(list(tree.items())))
        if how == "retype":
            return OrderedDict(tree)
        if how == "grow":
            return {**tree, "zz": 0}
        return {key: (None if v == 0 else 0) for key, v in tree.items()} if tree else {"n": 0}
    if how == "retype":
        return tuple(tree) if isinstance(tree, list) else list(tree)
    if how == "grow":
        return type(tree)([*tree, 0])
    return type(tree)([None if v == 0 else v for v in tree]) if tree else type(tree)([0])


@given(tree=TREES, how=MUTATIONS)
def test_guards_accept_exactly_the_structure_they_were_made_for(tree: Any, how: str) -> None:
    spec = _spec(tree)
    steps = guard_steps(spec)
    assert steps is not None
    other = _mutate(tree, how)
    # The exact containers (classes, lengths, dict keys in the same insertion order); a leaf
    # position may hold anything (the compiled layer checks leaves separately).
    same = _same_shape(tree, other)
    for guard in (interpreted_guard(steps), compiled_guard(steps)):
        assert guard(tree)
        assert guard(other) is same
        if same:  # then flatten_up_to cannot fail
            spec.flatten_up_to(other)


def _same_shape(a: Any, b: Any) -> bool:
    if type(a) is int:  # a leaf of the spec
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_shape(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b))
    return True


@given(tree=TREES, how=MUTATIONS, k=st.integers(1, 3))
def test_readers_give_what_flatten_up_to_gives(tree: Any, how: str, k: int) -> None:
    # A reader is its guard and flatten_up_to in one: the leaves of a tree of exactly this
    # structure, None for anything else. The "any" reader and the columns reader's replicas
    # 1.. accept dict keys in any order, as flatten_up_to does.
    spec = _spec(tree)
    found = structure_steps(spec)
    assert found is not None
    other = _mutate(tree, how)
    read, read_any = compiled_reader(*found), compiled_reader(*found, keys="any")
    assert read(tree) == spec.flatten_up_to(tree)
    expected = spec.flatten_up_to(other) if _same_shape(tree, other) else None
    assert read(other) == expected
    reordered = how == "reorder" and isinstance(tree, dict) and len(tree) > 1
    assert read_any(other) == (spec.flatten_up_to(other) if reordered else expected)
    columns = compiled_columns(*found, k)
    assert columns is not None
    assert columns([tree] * k) == list(zip(*[spec.flatten_up_to(tree)] * k))
    assert columns([other, *[tree] * (k - 1)]) == (
        None if expected is None else list(zip(expected, *[spec.flatten_up_to(tree)] * (k - 1)))
    )
    if k > 1:
        again = columns([tree, *[other] * (k - 1)])
        assert (again is None) is (read_any(other) is None)


@given(tree=TREES, k=st.integers(1, 3), change=st.sampled_from(["none", "dtype", "no dtype"]))
def test_a_dtype_checking_columns_reader(tree: Any, k: int, change: str) -> None:
    # The same columns as the plain reader while every leaf has one dtype across the trees;
    # None when one replica's leaf has another dtype (or none at all).
    spec = _spec(tree)
    n = spec.num_leaves
    found = structure_steps(spec)
    assert found is not None
    fused, plain = compiled_columns(*found, k, same_dtype=True), compiled_columns(*found, k)
    assert fused is not None and plain is not None
    trees = [spec.unflatten([torch.zeros(1) for _ in range(n)]) for _ in range(k)]
    assert fused(trees) == plain(trees)
    if n and change != "none":
        odd = torch.zeros(1, dtype=torch.int64) if change == "dtype" else "s"
        trees[-1] = spec.unflatten([*([torch.zeros(1)] * (n - 1)), odd])
        assert (
            fused(trees) is None
            if (k > 1 or change == "no dtype")
            else fused(trees) == plain(trees)
        )
        assert plain(trees) is not None


@given(tree=TREES)
def test_a_generated_unflatten_makes_what_unflatten_makes(tree: Any) -> None:
    spec = _spec(tree)
    leaves = [object() for _ in range(spec.num_leaves)]
    build = compiled_unflatten(spec)
    if build is not None:
        assert _same(build(leaves), spec.unflatten(leaves))
    else:
        assert spec.num_leaves == 0


@pytest.mark.parametrize("keys", ["typed", "any"])
def test_guards_and_readers_never_insert_into_a_defaultdict(keys: str) -> None:
    # Indexing a defaultdict with a missing key inserts it: the keys are checked first.
    from collections import defaultdict

    spec = _spec(defaultdict(list, {"a": {"x": 0}, "b": [0]}))
    steps, reach = structure_steps(spec)  # type: ignore[misc]
    for check in (
        compiled_guard(steps, keys=keys),
        compiled_reader(steps, reach, keys=keys),
        interpreted_guard(steps),
    ):
        other = defaultdict(list, {"c": {"x": 1}, "b": [2]})
        assert not check(other)
        assert list(other) == ["c", "b"], check
    shuffled = defaultdict(list, {"b": [2], "a": {"x": 1}})
    assert compiled_reader(steps, reach, keys="any")(shuffled) == [1, 2]
    assert compiled_reader(steps, reach)(shuffled) is None


def test_guards_compare_custom_metadata_by_type() -> None:
    from corpus import Tagged

    steps = guard_steps(_spec(Tagged(0, name=1)))
    assert steps is not None
    for guard in (interpreted_guard(steps), compiled_guard(steps)):
        assert guard(Tagged(5, name=1))
        assert not guard(Tagged(5, name=True)) and not guard(Tagged(5, name=1.0))


def test_guards_handle_a_thousand_levels() -> None:
    tree: Any = 0
    for i in range(1000):
        tree = {"k": tree} if i % 2 else [tree]
    steps = guard_steps(_spec(tree))
    assert steps is not None and len(steps) == 1000
    for guard in (interpreted_guard(steps), compiled_guard(steps)):
        assert guard(tree)
        assert not guard([tree])
    read = compiled_reader(*structure_steps(_spec(tree)))  # type: ignore[misc]
    assert read(tree) == [0] and read([tree]) is None
