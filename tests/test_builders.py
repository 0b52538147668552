"""The compiled per-device builders scatter uses for structures it sees again and again."""

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
from treegather._builders import _COMPILE_AFTER, _MAX_DEPTH, replica_builder
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
    # A new spec object every time (flatten would hand back a cached one, already counted).
    return optree.tree_structure(tree, namespace=NAMESPACE)


def _compiled(spec: optree.PyTreeSpec, k: int) -> Any:
    for _ in range(_COMPILE_AFTER - 1):
        assert replica_builder(spec, k) is None
    return replica_builder(spec, k)


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
    for _ in range(_MAX_DEPTH + 1):
        tree = [tree]
    spec = _spec(tree)
    assert _compiled(spec, 2) is None


def test_a_rebuilt_equal_spec_object_starts_counting_again() -> None:
    # Entries are keyed by the spec object; another object with the same structure is another
    # entry (never a stale builder for a recycled id).
    spec = _spec({"q": [0, 0]})
    build = _compiled(spec, 3)
    assert build is not None
    other = _spec({"q": [0, 0]})
    assert other == spec and other is not spec
    assert replica_builder(other, 3) is None


def test_scatter_gives_the_same_trees_before_and_after_compiling() -> None:
    def batch() -> dict[str, Any]:
        return {
            "z": torch.arange(12).reshape(6, 2),
            "a": [torch.arange(6), (torch.ones(6, 1), None)],
            "m": {"y": torch.zeros(6), "b": torch.ones(6, 3)},
        }

    first = tg.scatter(batch(), ["cpu"] * 4)
    for _ in range(_COMPILE_AFTER + 2):
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
