"""A Collector's join of its adds (samples.join and its fast checks): in one process, every
sequence of adds gives what the definition gives (reference_only: gather's rules over the
adds), the same result or the same error, odd ones included (keys that change, values of other
kinds, dtypes or shapes, separators and surrogates in strings, shared tensors, other containers,
values changed after their add)."""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from corpus import assert_tree_equal

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only


class Label(enum.StrEnum):
    CAT = "cat"


@dataclasses.dataclass
class Out:
    x: torch.Tensor


NAMES = tg.by_path({"names": tg.cat_items()})


def _batch(n: int, at: int = 0) -> dict[str, Any]:
    return {
        "logits": torch.arange(at, at + n * 3, dtype=torch.float32).view(n, 3),
        "ids": torch.arange(at, at + n),
        "names": [f"s{at + i}" for i in range(n)],
    }


def _two_batches() -> list[Any]:
    return [_batch(2), _batch(2, 10)]


def _two_keys_one_tensor() -> list[Any]:
    t = torch.ones(2, 2)
    return [{"a": t, "b": t}, {"a": torch.zeros(1, 2), "b": torch.ones(1, 2)}]


# Per case: the adds (outputs, one per add; indices follow in order) and the layout.
CASES: dict[str, tuple[Callable[[], list[Any]], Any]] = {
    "plain": (lambda: [_batch(3), _batch(2, 3), _batch(1, 5)], NAMES),
    "tensors_only": (lambda: [{"x": torch.ones(2, 2)}, {"x": torch.zeros(3, 2)}], None),
    "one_add": (lambda: [_batch(4)], NAMES),
    "keys_in_another_order": (
        lambda: [
            {"x": torch.ones(1), "y": torch.ones(1)},
            {"y": torch.zeros(2), "x": torch.ones(2)},
        ],
        None,
    ),
    "a_key_missing": (
        lambda: [_batch(2), {"logits": torch.ones(1, 3), "ids": torch.ones(1)}],
        NAMES,
    ),
    "tensor_then_list": (
        lambda: [{"x": torch.ones(2), "s": ["a", "b"]}, {"x": [1.0], "s": ["c"]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "dtypes_differ": (
        lambda: [{"x": torch.ones(2)}, {"x": torch.ones(1, dtype=torch.float64)}],
        None,
    ),
    "trailing_shapes_differ": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.ones(1, 4)}],
        None,
    ),
    "separator_in_a_later_add": (  # pickled to travel
        lambda: [{"x": torch.ones(1), "s": ["a"]}, {"x": torch.ones(1), "s": ["b\x00c"]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "lone_surrogates_in_a_later_add": (  # not UTF-8: pickled to travel (as by the definition)
        lambda: [{"x": torch.ones(1), "s": ["a"]}, {"x": torch.ones(1), "s": ["b\udcff"]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "str_subclass_in_a_later_add": (  # pickled: Label.CAT comes back
        lambda: [{"x": torch.ones(1), "s": ["a"]}, {"x": torch.ones(1), "s": [Label.CAT]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "empty_adds": (
        lambda: [
            {"x": torch.zeros(0, 2), "s": []},
            {"x": torch.ones(2, 2), "s": ["p", "q"]},
            {"x": torch.zeros(0, 2), "s": []},
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "only_empty_strings_lists": (
        lambda: [{"x": torch.zeros(0, 2), "s": []}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "one_tensor_under_two_keys": (_two_keys_one_tensor, None),
    "nested_dict_value": (
        lambda: [{"h": {"a": torch.ones(2)}, "x": torch.ones(2)}] * 2,
        None,
    ),
    "tuple_outputs": (lambda: [(torch.ones(2), torch.zeros(2))] * 2, None),
    "ordered_dict": (lambda: [OrderedDict(x=torch.ones(2))] * 2, None),
    "dataclass_outputs": (lambda: [Out(torch.ones(2)), Out(torch.zeros(1))], None),
    "per_add_values": (
        lambda: [
            {"x": torch.ones(n, 2) * n, "loss": torch.tensor(n / 2), "v": torch.arange(3.0) * n}
            for n in (1, 2, 3)
        ],
        tg.by_path({"loss": tg.mean(), "v": tg.stack()}),
    ),
    "plain_values_per_add": (
        lambda: [{"x": torch.ones(2), "epoch": 3, "split": "val", "w": 0.5}] * 2,
        None,
    ),
    "pad": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.ones(1, 5)}],
        {"x": tg.pad(0)},
    ),
    "rows_disagree_in_an_add": (
        lambda: [{"x": torch.ones(2), "s": ["a", "b"]}, {"x": torch.ones(2), "s": ["c"]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "no_per_sample_leaf": (lambda: [{"loss": torch.tensor(1.0)}], None),
    "strings_without_cat_items": (
        lambda: [{"x": torch.ones(2), "s": ["a", "b"]}] * 2,
        None,
    ),
    "other_items": (  # pickled to travel
        lambda: [{"x": torch.ones(2), "s": [1, None]}, {"x": torch.ones(1), "s": [(2, "t")]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "tensor_items": (
        lambda: [{"x": torch.ones(2), "s": [torch.ones(1), torch.zeros(1)]}],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "a_parameter_added_under_no_grad": (  # a Tensor subclass: the definition
        lambda: [{"x": torch.nn.Parameter(torch.ones(2))}, {"x": torch.ones(1)}],
        None,
    ),
    "a_parameter_in_a_later_add": (  # the definition, detached as the fast path's result
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.nn.Parameter(torch.zeros(1, 3))}],
        None,
    ),
    # What torch.cat itself checks in the fast join (devices, the dims past the first) and what
    # it lets through (a 1-D empty tensor beside any shape): the definition's result or error.
    "a_1d_empty_tensor_between": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.zeros(0)}, {"x": torch.zeros(1, 3)}],
        None,
    ),
    "a_1d_empty_tensor_first": (
        lambda: [{"x": torch.zeros(0)}, {"x": torch.ones(2, 3)}],
        None,
    ),
    "dims_differ_in_a_later_add": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.zeros(1, 3, 1)}],
        None,
    ),
    "a_meta_tensor_in_a_later_add": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.zeros(1, 3, device="meta")}],
        None,
    ),
    "an_ndarray_in_a_later_add": (
        lambda: [{"x": torch.ones(2, 3)}, {"x": torch.zeros(1, 3).numpy()}],
        None,
    ),
    "a_transposed_view": (
        lambda: [{"x": torch.arange(6.0).view(3, 2).t()}, {"x": torch.zeros(1, 3)}],
        None,
    ),
}


def _run(adds: list[Any], layout: Any, *, mutate: Callable[[list[Any]], None] | None = None) -> Any:
    """The Collector's result and indices for ``adds`` (rows numbered in add order), or the
    error it raised (its type and text)."""
    col = tgd.Collector()
    at = 0
    try:
        with torch.no_grad():
            for outputs in adds:
                rows = _rows(outputs)
                col.add(outputs, indices=list(range(at, at + rows))[::-1])
                at += rows
        if mutate is not None:
            mutate(adds)
        return col.all_gather(layout), col.indices
    except Exception as exc:
        return type(exc), str(exc)


def _rows(outputs: Any) -> int:
    for leaf in optree.tree_leaves(outputs, namespace=tg.NAMESPACE):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


def _same(fast: Any, reference: Any) -> None:
    if isinstance(reference, tuple) and isinstance(reference[0], type):
        assert fast == reference
    else:
        assert_tree_equal(fast, reference)
        for leaf in optree.tree_leaves((fast, reference), namespace=tg.NAMESPACE):  # detached
            assert not (isinstance(leaf, torch.Tensor) and leaf.requires_grad)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_join_gives_what_the_definition_gives(name: str) -> None:
    make, layout = CASES[name]
    fast = _run(make(), layout)
    with reference_only():
        reference = _run(make(), layout)
    _same(fast, reference)


def test_values_changed_after_their_add() -> None:
    """Tensors changed in place, resized or given another dtype, lists grown or given other
    items, after their add: the join reads them as they are at the exchange, as the definition
    does (the same result or error)."""

    def grow(adds: list[Any]) -> None:
        adds[0]["logits"].add_(100)
        adds[1]["ids"].resize_(3)

    def reshape(adds: list[Any]) -> None:
        adds[1]["logits"].resize_(2, 4)

    def shift_rows(adds: list[Any]) -> None:  # the same rows in all, split otherwise
        adds[0]["logits"].resize_(3, 3)
        adds[1]["logits"].resize_(1, 3)

    def lists(adds: list[Any]) -> None:
        adds[0]["names"].append("late")
        adds[1]["names"][0] = "changed"

    def items(adds: list[Any]) -> None:  # another type in place: pickled, as it now is
        adds[0]["names"][0] = Label.CAT
        adds[1]["names"][1] = 7

    def retyped(adds: list[Any]) -> None:  # a tensor's storage swapped for another dtype
        adds[1]["ids"].data = adds[1]["ids"].data.double()

    for mutate in (grow, reshape, shift_rows, lists, items, retyped):
        fast = _run(_two_batches(), NAMES, mutate=mutate)
        with reference_only():
            reference = _run(_two_batches(), NAMES, mutate=mutate)
        _same(fast, reference)
