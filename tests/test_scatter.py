"""scatter and scatter_kwargs: balanced splits, broadcasts, per-sample items, devices, errors."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from corpus import CASE_IDS, CASES, assert_tree_equal

import treegather as tg
from treegather._tree import flatten

CPU2 = ["cpu", "cpu"]


# --------------------------------------------------------------------------- the corpus


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_corpus_shards_keep_the_structure_and_the_balanced_sizes(
    case: Any, devices: list[str]
) -> None:
    shards = tg.scatter(case.tree, devices)
    assert isinstance(shards, tg.Shards) and isinstance(shards, list)
    k = len(devices)
    if case.batch is None:
        assert shards.sizes is None
        assert len(shards) == k
    else:
        used = min(case.batch, k)
        expected = tuple(len(c) for c in torch.arange(case.batch).tensor_split(used))
        assert shards.sizes == expected
        assert len(shards) == used
    assert len(shards.devices) == len(shards)
    _, spec = flatten(case.tree)
    for r, shard in enumerate(shards):
        leaves, shard_spec = flatten(shard)
        assert shard_spec == spec
        for leaf, orig in zip(leaves, flatten(case.tree)[0]):
            if isinstance(orig, torch.Tensor) and orig.dim() > 0:
                assert leaf.shape[0] == shards.sizes[r]
                assert leaf.device == shards.devices[r]
            elif isinstance(orig, torch.Tensor):
                assert_tree_equal(leaf.cpu(), orig)
            else:
                assert leaf == orig


# -------------------------------------------------------------- torch's scatter, item by item


def test_five_rows_on_four_devices_use_four_devices() -> None:
    # torch.nn.parallel's scatter splits with chunk: 5 rows -> 2, 2, 1 on 3 of the 4 devices.
    assert len(torch.arange(5).chunk(4)) == 3
    shards = tg.scatter(torch.arange(5), ["cpu"] * 4)
    assert len(shards) == 4
    assert shards.sizes == (2, 1, 1, 1)
    assert [s.tolist() for s in shards] == [[0, 1], [2], [3], [4]]


def test_splits_follow_tensor_split_order() -> None:
    shards = tg.scatter({"x": torch.arange(10)}, ["cpu"] * 4)
    assert shards.sizes == (3, 3, 2, 2)
    expected = torch.arange(10).tensor_split(4)
    assert all(torch.equal(s["x"], e) for s, e in zip(shards, expected))


def test_batch_smaller_than_the_device_count_makes_fewer_shards() -> None:
    shards = tg.scatter({"x": torch.arange(2), "tag": "t"}, ["cpu", -1, "cpu", -1])
    assert len(shards) == 2
    assert shards.sizes == (1, 1)
    assert len(shards.devices) == 2
    assert [s["tag"] for s in shards] == ["t", "t"]


def test_an_empty_batch_is_one_empty_shard() -> None:
    shards = tg.scatter(torch.zeros(0, 3), CPU2)
    assert shards.sizes == (0,)
    assert len(shards) == 1 and shards[0].shape == (0, 3)


def test_inputs_of_different_batch_sizes_are_an_error_naming_both() -> None:
    # torch's scatter zips the chunks without strict=True: 4 and 3 rows silently truncated.
    with pytest.raises(tg.BatchSizeError) as info:
        tg.scatter({"images": torch.zeros(4, 3), "labels": torch.zeros(3)}, CPU2)
    msg = str(info.value)
    assert "split leaves disagree on the batch size" in msg
    assert "4 at inputs['images']" in msg
    assert "3 at inputs['labels']" in msg
    assert isinstance(info.value, ValueError)


def test_batch_size_error_lists_every_size() -> None:
    tree = {"a": torch.zeros(4), "b": [torch.zeros(3), torch.zeros(3)], "c": torch.zeros(5)}
    with pytest.raises(tg.BatchSizeError) as info:
        tg.scatter(tree, CPU2)
    msg = str(info.value)
    assert "4 at inputs['a']" in msg
    assert "3 at inputs['b'][0], inputs['b'][1]" in msg
    assert "5 at inputs['c']" in msg


def test_non_tensors_and_0_dim_tensors_are_broadcast() -> None:
    scale = torch.tensor(2.0)
    shards = tg.scatter({"x": torch.arange(4), "scale": scale, "n": 3, "s": "str"}, CPU2)
    for s in shards:
        assert s["scale"] is scale and s["n"] == 3 and s["s"] == "str"


def test_broadcast_of_a_tensor_gives_every_replica_the_whole_value() -> None:
    w = torch.randn(3, 2)
    shards = tg.scatter({"x": torch.arange(4), "w": w}, CPU2, tg.by_path({"w": "broadcast"}))
    assert all(torch.equal(s["w"], w) for s in shards)


def test_nothing_split_means_one_replica_per_device() -> None:
    shards = tg.scatter({"n": 1}, ["cpu"] * 3)
    assert len(shards) == 3 and shards.sizes is None
    assert tg.scatter(None, CPU2) == [None, None]


# ----------------------------------------------------------------------------- split rules


def test_split_along_another_dim_and_the_dim_keyword() -> None:
    x = torch.arange(12).reshape(2, 6)
    assert [s.shape for s in tg.scatter(x, ["cpu"] * 3, tg.split(1))] == [(2, 2)] * 3
    assert [s.shape for s in tg.scatter(x, ["cpu"] * 3, dim=1)] == [(2, 2)] * 3
    assert [s.shape for s in tg.scatter(x, ["cpu"] * 3, dim=-1)] == [(2, 2)] * 3


def test_split_along_a_dim_out_of_range_is_an_error() -> None:
    with pytest.raises(tg.TreegatherError, match=r"inputs\['x'\]: cannot split along dim 2"):
        tg.scatter({"x": torch.ones(2, 3)}, CPU2, tg.split(2))


def test_explicit_sizes() -> None:
    shards = tg.scatter(
        {"a": torch.arange(4), "b": torch.arange(4)}, CPU2, {"a": tg.split(sizes=[1, 3]), "b": 0}
    )
    assert shards.sizes == (1, 3)
    assert [s["b"].tolist() for s in shards] == [[0], [1, 2, 3]]
    shards = tg.scatter(torch.arange(4), ["cpu"] * 3, tg.split(sizes=[3, 1]))
    assert shards.sizes == (3, 1) and len(shards) == 2


@pytest.mark.parametrize("sizes", [[3, 2], [1, 1, 2]])
def test_explicit_sizes_must_add_up_and_fit_the_devices(sizes: list[int]) -> None:
    expected = f"split sizes {sizes} must add up to the batch size 4 and name at most 2 shards"
    with pytest.raises(tg.BatchSizeError, match=re.escape(expected)):
        tg.scatter(torch.arange(4), CPU2, tg.split(sizes=sizes))


def test_explicit_sizes_must_agree() -> None:
    layout = {"a": tg.split(sizes=[1, 3]), "b": tg.split(sizes=[3, 1])}
    with pytest.raises(
        tg.BatchSizeError, match=r"\[1, 3\] at inputs\['a'\]; \[3, 1\] at inputs\['b'\]"
    ):
        tg.scatter({"a": torch.arange(4), "b": torch.arange(4)}, CPU2, layout)


def test_explicit_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive shard sizes"):
        tg.split(sizes=[0, 2])


def test_split_on_a_string_is_a_leaf_type_error_with_a_hint() -> None:
    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter({"x": torch.arange(4), "ids": "abcd"}, CPU2, tg.by_path({"ids": "split"}))
    msg = str(info.value)
    assert "inputs['ids']: split() needs a tensor, got str 'abcd'" in msg
    assert "use split_items()" in msg
    assert isinstance(info.value, TypeError)


# ---------------------------------------------------------------------------- split_items


def test_split_items_cuts_runs_matching_the_tensor_split() -> None:
    tree = {
        "x": torch.arange(5),
        "words": ["a", "b", "c", "d", "e"],
        "t": ("p", "q", "r", "s", "t"),
    }
    shards = tg.scatter(tree, ["cpu"] * 3, tg.by_path({"words": "split_items", "t": "split_items"}))
    assert shards.sizes == (2, 2, 1)
    assert [s["words"] for s in shards] == [["a", "b"], ["c", "d"], ["e"]]
    assert [s["t"] for s in shards] == [("p", "q"), ("r", "s"), ("t",)]


def test_split_items_alone_decides_the_batch() -> None:
    shards = tg.scatter(["a", "b", "c"], ["cpu"] * 5, tg.split_items())
    assert shards.sizes == (1, 1, 1)
    assert list(shards) == [["a"], ["b"], ["c"]]


def test_split_items_moves_ragged_tensors_with_their_samples() -> None:
    ragged = [torch.ones(1), torch.ones(2), torch.ones(3)]
    shards = tg.scatter({"r": ragged}, CPU2, {"r": tg.split_items()})
    assert [[t.shape[0] for t in s["r"]] for s in shards] == [[1, 2], [3]]


def test_split_items_length_must_match_the_batch() -> None:
    with pytest.raises(tg.BatchSizeError, match=r"3 at inputs\['l'\]; 4 at inputs\['x'\]"):
        tg.scatter(
            {"x": torch.arange(4), "l": ["a", "b", "c"]}, CPU2, tg.by_path({"l": "split_items"})
        )


def test_split_items_needs_a_sequence() -> None:
    with pytest.raises(
        tg.LeafTypeError,
        match=r"inputs\['l'\]: split_items\(\) needs a list or tuple, got str 'abcd'",
    ):
        tg.scatter({"x": torch.arange(4), "l": "abcd"}, CPU2, tg.by_path({"l": "split_items"}))


# -------------------------------------------------------------------------------- devices


def test_devices_ints_strings_torch_device_and_minus_one_is_cpu() -> None:
    shards = tg.scatter(torch.arange(3), [-1, "cpu", torch.device("cpu")])
    assert shards.devices == (torch.device("cpu"),) * 3
    assert all(s.device == torch.device("cpu") for s in shards)
    one = tg.scatter(torch.arange(3), "cpu")
    assert len(one) == 1 and one.sizes == (3,)
    assert tg.scatter(torch.arange(3), -1).devices == (torch.device("cpu"),)


def test_bad_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        tg.scatter(torch.arange(3), [])
    with pytest.raises(ValueError, match="-1 is the CPU"):
        tg.scatter(torch.arange(3), [-2])
    with pytest.raises(TypeError, match="not a device"):
        tg.scatter(torch.arange(3), [True])


@pytest.mark.cuda
def test_scatter_moves_shards_to_cuda() -> None:
    shards = tg.scatter(
        {"x": torch.arange(4), "w": torch.ones(2)}, [0, 0], tg.by_path({"w": "broadcast"})
    )
    assert all(s["x"].device.type == "cuda" and s["w"].device.type == "cuda" for s in shards)


def test_shards_repr_and_attributes() -> None:
    shards = tg.scatter(torch.arange(3), CPU2)
    assert repr(shards).startswith("Shards([tensor([0, 1]), tensor([2])], sizes=(2, 1)")
    assert shards.devices == (torch.device("cpu"),) * 2


# -------------------------------------------------------------------------- differentiable


def test_scatter_is_differentiable() -> None:
    x = torch.randn(5, 2, requires_grad=True)
    shards = tg.scatter(x, ["cpu"] * 3)
    sum(((r + 1) * s).sum() for r, s in enumerate(shards)).backward()  # type: ignore[union-attr]
    expected = torch.tensor([1.0, 1, 2, 2, 3]).unsqueeze(1).expand(5, 2)
    assert torch.equal(x.grad, expected)


# ----------------------------------------------------------------------- unknown classes


def test_unregistered_dataclass_is_an_error_with_a_register_hint() -> None:
    @dataclasses.dataclass
    class Unknown:
        x: Any

    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter({"batch": Unknown(torch.arange(4))}, CPU2)
    msg = str(info.value)
    assert msg.startswith("inputs['batch']: ")
    assert "Unknown is a dataclass treegather does not know" in msg
    assert "register_dataclass" in msg


def test_unregistered_dataclass_may_be_broadcast_on_purpose() -> None:
    @dataclasses.dataclass
    class Config:
        depth: int

    shards = tg.scatter(
        {"x": torch.arange(4), "cfg": Config(3)}, CPU2, tg.by_path({"cfg": "broadcast"})
    )
    assert [s["cfg"] for s in shards] == [Config(3), Config(3)]


@pytest.mark.parametrize("base", [dict, list])
def test_unregistered_dict_or_list_subclass_is_never_sent_whole_silently(base: type) -> None:
    # torch's scatter treats dict subclasses as dicts; treegather must either do the same or
    # say that the class needs registering -- not broadcast the whole batch to every device.
    cls = type("Unregistered" + base.__name__.title(), (base,), {})
    tree = cls({"x": torch.arange(4)}) if base is dict else cls([torch.arange(4)])
    try:
        shards = tg.scatter(tree, CPU2)
    except tg.LeafTypeError as exc:
        assert "register" in str(exc)
        return
    first = shards[0]["x"] if base is dict else shards[0][0]
    assert first.tolist() == [0, 1]


# ---------------------------------------------------------------------------- scatter_kwargs


def test_scatter_kwargs_by_path_starts_at_the_index_or_keyword() -> None:
    args = ({"ids": torch.arange(4), "tokens": ["a", "b", "c", "d"]}, "mode")
    kwargs = {"labels": torch.arange(4), "weights": torch.ones(3)}
    layout = tg.by_path({"0.tokens": tg.split_items(), "weights": "broadcast"})
    a, kw = tg.scatter_kwargs(args, kwargs, CPU2, layout)
    assert len(a) == len(kw) == 2
    assert isinstance(a, tg.Shards) and isinstance(kw, tg.Shards)
    assert a.sizes == kw.sizes == (2, 2)
    assert [x[0]["ids"].tolist() for x in a] == [[0, 1], [2, 3]]
    assert [x[0]["tokens"] for x in a] == [["a", "b"], ["c", "d"]]
    assert [x[1] for x in a] == ["mode", "mode"]
    assert all(type(x) is tuple for x in a)
    assert [k["labels"].tolist() for k in kw] == [[0, 1], [2, 3]]
    assert all(k["weights"].shape == (3,) for k in kw)


def test_scatter_kwargs_by_path_on_ids_and_labels() -> None:
    args = ({"ids": torch.arange(6).reshape(2, 3)},)
    kwargs = {"labels": torch.arange(3), "mask": torch.ones(2, 2)}
    a, kw = tg.scatter_kwargs(
        args, kwargs, ["cpu"] * 3, tg.by_path({"0.ids": 1, "labels": 0, "mask": None})
    )
    assert [x[0]["ids"].shape for x in a] == [(2, 1)] * 3
    assert [k["labels"].tolist() for k in kw] == [[0], [1], [2]]
    assert all(k["mask"].shape == (2, 2) for k in kw)


def test_scatter_kwargs_prefix_layout_mirrors_args_and_kwargs() -> None:
    a, kw = tg.scatter_kwargs(
        (torch.arange(4),), {"labels": torch.arange(4)}, CPU2, ((0,), {"labels": None})
    )
    assert [x[0].tolist() for x in a] == [[0, 1], [2, 3]]
    assert [k["labels"].tolist() for k in kw] == [[0, 1, 2, 3]] * 2


def test_scatter_kwargs_errors_name_args_and_kwargs() -> None:
    with pytest.raises(tg.BatchSizeError, match=r"4 at args\[0\]; 3 at kwargs\['labels'\]"):
        tg.scatter_kwargs((torch.arange(4),), {"labels": torch.arange(3)}, CPU2)
    with pytest.raises(tg.LayoutError, match="'lables' matches nothing; close paths: labels"):
        tg.scatter_kwargs(
            (torch.arange(4),), {"labels": torch.arange(4)}, CPU2, tg.by_path({"lables": None})
        )


def test_scatter_kwargs_without_kwargs_and_with_a_list_of_args() -> None:
    a, kw = tg.scatter_kwargs([torch.arange(4)], None, CPU2)
    assert [type(x) for x in a] == [tuple, tuple]
    assert list(kw) == [{}, {}]
    a, kw = tg.scatter_kwargs((), {"n": 1}, ["cpu"] * 3)
    assert list(a) == [(), (), ()] and list(kw) == [{"n": 1}] * 3


def test_scatter_kwargs_keeps_the_keyword_order() -> None:
    _, kw = tg.scatter_kwargs((), {"z": torch.arange(2), "a": torch.arange(2)}, CPU2)
    assert [list(k) for k in kw] == [["z", "a"]] * 2


def test_scatter_kwargs_single_whole_value_rule_applies_to_each_argument() -> None:
    # One rule for (args, kwargs) means each argument, never the synthetic pair itself.
    args, kwargs = tg.scatter_kwargs(
        (["a", "b", "c"],), {"t": ["x", "y", "z"]}, ["cpu"] * 2, tg.split_items()
    )
    assert [a[0] for a in args] == [["a", "b"], ["c"]]
    assert [k["t"] for k in kwargs] == [["x", "y"], ["z"]]
    with pytest.raises(tg.LeafTypeError, match=r"args\[1\]: split_items\(\) needs a list or tuple"):
        tg.scatter_kwargs((["a"], "s"), {}, ["cpu"] * 2, tg.split_items())
