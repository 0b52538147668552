"""treegather.compat.jactorch: the seed's dict_gather API, over 2-3 CPU "devices".

The gather functions get lists of per-replica outputs built by hand; the DataParallel classes
run on ``["cpu"] * k`` device lists. Tests named ``test_seed_bug_*`` are regressions for the
seed's bugs.
"""

from __future__ import annotations

import collections
import dataclasses
import doctest
import inspect
from typing import Any, ClassVar

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treegather as tg
import treegather.compat.jactorch as jactorch
from treegather.compat.jactorch import (
    DataLayout,
    DataLayoutSpec,
    DictGatherDataParallel,
    JacDataParallel,
    concat,
    data_parallel_dict_gather,
    dict_gather_v1,
    dict_gather_v2,
    pad,
    pad2d,
    padimage,
    patch_dict_gathering,
    skip,
    stack,
)

Pair = collections.namedtuple("Pair", ["first", "second"])


@tg.register_dataclass
@dataclasses.dataclass
class Out:
    z: torch.Tensor
    meta: dict[str, Any]


def assert_tree_equal(actual: Any, expected: Any) -> None:
    """Same structure (container types included), same tensors (values, dtype, device)."""
    a_leaves, a_spec = optree.tree_flatten(actual, namespace="treegather")
    e_leaves, e_spec = optree.tree_flatten(expected, namespace="treegather")
    assert a_spec == e_spec, f"{a_spec} != {e_spec}"
    for path, a, e in zip(e_spec.paths(), a_leaves, e_leaves):
        if torch.is_tensor(e):
            assert torch.is_tensor(a), (path, a)
            assert a.dtype == e.dtype and a.device == e.device, (path, a, e)
            assert torch.equal(a, e), (path, a, e)
        else:
            assert type(a) is type(e) and a == e, (path, a, e)


# ----------------------------------------------------------------------------- dict_gather_v1


@pytest.mark.parametrize("k", [2, 3])
def test_v1_training_tuple(k: int) -> None:
    outputs = [
        (
            torch.tensor(float(i)),  # 0-dim loss
            {"acc": torch.tensor(i / 4), "count": torch.tensor(i)},  # 0-dim monitors
            {"logits": torch.full((2, 3), float(i)), "pred": torch.tensor([i, i])},
        )
        for i in range(k)
    ]
    loss, monitors, outs = dict_gather_v1(outputs, -1)
    assert_tree_equal(loss, torch.arange(k, dtype=torch.float32))
    assert_tree_equal(
        monitors, {"acc": torch.arange(k) / 4, "count": torch.arange(k, dtype=torch.int64)}
    )
    assert_tree_equal(
        outs["logits"], torch.arange(k).float().repeat_interleave(2)[:, None].expand(-1, 3)
    )
    assert_tree_equal(outs["pred"], torch.arange(k).repeat_interleave(2))


def test_v1_evaluation_dict() -> None:
    outputs = [
        {
            "loss": torch.tensor(1.0),
            "monitors": {"acc": torch.tensor(0.5), "detail": {"tp": torch.tensor([1, 2])}},
            "outputs": {"boxes": torch.ones(2, 4), "names": ["a", "b"]},
            "extra": None,
        },
        {
            "loss": torch.tensor(3.0),
            "monitors": {"acc": torch.tensor(1.0), "detail": {"tp": torch.tensor([3])}},
            "outputs": {"boxes": torch.zeros(1, 4), "names": ["c", "d"]},
            "extra": None,
        },
    ]
    out = dict_gather_v1(outputs, "cpu")
    expected = {
        "loss": torch.tensor([1.0, 3.0]),
        "monitors": {"acc": torch.tensor([0.5, 1.0]), "detail": {"tp": torch.tensor([1, 2, 3])}},
        "outputs": {
            "boxes": torch.cat([torch.ones(2, 4), torch.zeros(1, 4)]),
            "names": [["a", "c"], ["b", "d"]],
        },
        "extra": None,
    }
    assert_tree_equal(out, expected)
    assert list(out) == ["loss", "monitors", "outputs", "extra"]


def test_v1_keeps_sequence_types_and_lists_non_tensors() -> None:
    outputs = [
        Pair(torch.tensor([1]), ("s0", 1, 0.5)),
        Pair(torch.tensor([2]), ("s1", 2, 1.5)),
        Pair(torch.tensor([3]), ("s2", 3, 2.5)),
    ]
    out = dict_gather_v1(outputs, -1)
    assert type(out) is Pair
    assert_tree_equal(out.first, torch.tensor([1, 2, 3]))
    assert out.second == (["s0", "s1", "s2"], [1, 2, 3], [0.5, 1.5, 2.5])
    assert type(out.second) is tuple


def test_v1_dim() -> None:
    outputs = [torch.ones(2, 1), torch.zeros(2, 2)]
    assert_tree_equal(dict_gather_v1(outputs, -1, dim=1), torch.tensor([[1.0, 0, 0], [1, 0, 0]]))


def test_v1_mixed_python_monitors_are_listed() -> None:
    outputs = [{"acc": 1, "loss": 0.5}, {"acc": 0.75, "loss": 2}]
    assert dict_gather_v1(outputs, -1) == {"acc": [1, 0.75], "loss": [0.5, 2]}


def test_v1_differentiable() -> None:
    x = torch.ones(3, requires_grad=True)
    out = dict_gather_v1([{"y": x[:2] * 2}, {"y": x[2:] * 3}], -1)
    out["y"].sum().backward()
    assert_tree_equal(x.grad, torch.tensor([2.0, 2.0, 3.0]))


def test_v1_rejects_empty_and_non_lists() -> None:
    with pytest.raises(ValueError, match="empty"):
        dict_gather_v1([], -1)
    with pytest.raises(TypeError, match="list of per-replica outputs"):
        dict_gather_v1(torch.ones(2), -1)  # type: ignore[arg-type]


# ------------------------------------------------------------------- seed bugs (gather side)


def test_seed_bug_collections_mapping_non_tensor_outputs() -> None:
    # The seed hit collections.Mapping (gone since Python 3.10) on every non-tensor output.
    outputs = [{"name": "a", "meta": {"id": 1}}, {"name": "b", "meta": {"id": 2}}]
    assert dict_gather_v1(outputs, -1) == {"name": ["a", "b"], "meta": {"id": [1, 2]}}
    assert dict_gather_v2(outputs, -1) == {"name": ["a", "b"], "meta": {"id": [1, 2]}}


def test_seed_bug_cpu_tensors() -> None:
    # The seed's torch Gather raised "Gather function not implemented for CPU tensors".
    outputs = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])]
    for target in (-1, "cpu", torch.device("cpu")):
        assert_tree_equal(dict_gather_v1(outputs, target), torch.tensor([1.0, 2.0, 3.0]))
    assert_tree_equal(dict_gather_v2(outputs, -1, layout={}), torch.tensor([1.0, 2.0, 3.0]))


def test_seed_bug_truncation_of_sequences_is_an_error() -> None:
    # The seed zipped sequences: replica 1's third item was silently dropped.
    outputs = [(torch.ones(1), torch.ones(1)), (torch.ones(1), torch.ones(1), torch.ones(1))]
    with pytest.raises(tg.StructureMismatchError):
        dict_gather_v1(outputs, -1)
    with pytest.raises(tg.StructureMismatchError):
        dict_gather_v2(outputs, -1, layout={"x": "concat"})


def test_seed_bug_extra_keys_are_an_error() -> None:
    # The seed iterated replica 0's keys: replica 1's extra key was silently dropped.
    outputs = [{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}]
    with pytest.raises(tg.StructureMismatchError):
        dict_gather_v1(outputs, -1)
    with pytest.raises(tg.StructureMismatchError):
        dict_gather_v2(outputs, -1, layout={"a": "concat"})


def test_seed_bug_padimage_builds_padimage() -> None:
    # The seed's padimage() returned a 'pad2d' spec, padding (C, H) instead of (H, W).
    assert padimage().type == "padimage"
    assert padimage(fill=2) == DataLayoutSpec("padimage", fill=2)
    assert DataLayout({"im": "padimage"})["im"] == padimage()


def test_seed_bug_mixed_ints_and_floats_are_not_truncated() -> None:
    # The seed made torch.LongTensor([1, 0.75]) of mixed monitors: tensor([1, 0]).
    outputs = [{"acc": 1, "loss": 0.5, "ok": True}, {"acc": 0.75, "loss": 2, "ok": False}]
    out = dict_gather_v2(outputs, -1, layout={})
    assert_tree_equal(
        out,
        {
            "acc": torch.tensor([1.0, 0.75], dtype=torch.float64),
            "loss": torch.tensor([0.5, 2.0], dtype=torch.float64),
            "ok": torch.tensor([1, 0]),
        },
    )


# ------------------------------------------------------------------- dict_gather_v2 layouts


def _z(rows: int, start: float) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + start


def test_v2_concat_variable_length_and_skip() -> None:
    outputs = [
        (torch.tensor(0.5), {"z": _z(37, 0), "devices": ("cpu", "cpu")}),
        (torch.tensor(1.5), {"z": _z(52, 1000), "devices": ("cpu", "cpu")}),
    ]
    loss, out = dict_gather_v2(outputs, -1, layout={"z": "concat", "devices": "skip"})
    assert_tree_equal(loss, torch.tensor([0.5, 1.5]))
    assert list(out) == ["z", "z_length", "devices"]
    assert out["z"].shape == (89, 3)
    assert_tree_equal(out["z"], torch.cat([_z(37, 0), _z(52, 1000)]))
    assert_tree_equal(out["z_length"], torch.tensor([37, 52]))
    assert out["devices"] == [("cpu", "cpu"), ("cpu", "cpu")]


def test_v2_data_layout_object_equals_dict() -> None:
    outputs = [{"z": _z(2, 0)}, {"z": _z(1, 9)}, {"z": _z(3, 5)}]
    by_dict = dict_gather_v2(outputs, -1, layout={"z": "concat"})
    by_object = dict_gather_v2(outputs, -1, layout=DataLayout({"z": concat()}))
    assert_tree_equal(by_dict, by_object)
    assert_tree_equal(by_dict["z_length"], torch.tensor([2, 1, 3]))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (pad(), [1, 2, 3, 4, 0, 0, 5, 6, 0]),
        ("pad", [1, 2, 3, 4, 0, 0, 5, 6, 0]),
        (pad(fill=-1), [1, 2, 3, 4, -1, -1, 5, 6, -1]),
    ],
)
def test_v2_pad(spec: Any, expected: list[int]) -> None:
    outputs = [
        {"s": torch.tensor([1, 2, 3])},
        {"s": torch.tensor([4])},
        {"s": torch.tensor([5, 6])},
    ]
    out = dict_gather_v2(outputs, -1, layout={"s": spec})
    assert_tree_equal(out, {"s": torch.tensor(expected), "s_length": torch.tensor([3, 1, 2])})


def test_v2_pad_keeps_trailing_dims_and_gradients() -> None:
    a = torch.ones(1, 2, requires_grad=True)
    b = torch.ones(2, 2, requires_grad=True)
    out = dict_gather_v2([{"h": a * 2}, {"h": b * 3}], -1, layout={"h": pad(fill=7)})
    assert_tree_equal(out["h"].detach(), torch.tensor([[2.0, 2], [7, 7], [3, 3], [3, 3]]))
    out["h"].sum().backward()
    assert_tree_equal(a.grad, torch.full((1, 2), 2.0))
    assert_tree_equal(b.grad, torch.full((2, 2), 3.0))


def test_v2_pad2d() -> None:
    outputs = [{"m": torch.tensor([[1, 2], [3, 4]])}, {"m": torch.tensor([[5, 6, 7]])}]
    out = dict_gather_v2(outputs, -1, layout={"m": pad2d()})
    expected = torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 7], [0, 0, 0]])
    assert_tree_equal(out, {"m": expected, "m_length": torch.tensor([[2, 2], [1, 3]])})


def test_v2_padimage() -> None:
    outputs = [
        {"im": torch.tensor([[[1.0], [2.0]]])},  # (C=1, H=2, W=1)
        {"im": torch.tensor([[[3.0, 4.0]]])},  # (C=1, H=1, W=2)
    ]
    out = dict_gather_v2(outputs, -1, layout={"im": padimage(fill=9)})
    expected = torch.tensor([[[1.0, 9], [2, 9]], [[3, 4], [9, 9]]])
    assert_tree_equal(out, {"im": expected, "im_length": torch.tensor([[2, 1], [1, 2]])})


def test_v2_nested_key_pad() -> None:
    outputs = [
        {"a": {"b": torch.tensor([1.0, 2.0]), "c": torch.tensor(1.0)}},
        {"a": {"b": torch.tensor([3.0]), "c": torch.tensor(2.0)}},
    ]
    out = dict_gather_v2(outputs, -1, layout={"a.b": "pad"})
    expected = {
        "a": {
            "b": torch.tensor([1.0, 2.0, 3.0, 0.0]),
            "b_length": torch.tensor([2, 1]),
            "c": torch.tensor([1.0, 2.0]),
        }
    }
    assert_tree_equal(out, expected)
    assert list(out["a"]) == ["b", "b_length", "c"]


def test_v2_spec_covers_subtree_unless_overridden() -> None:
    outputs = [
        {"a": {"x": torch.tensor([1]), "y": torch.tensor([2, 3])}},
        {"a": {"x": torch.tensor([4, 5]), "y": torch.tensor([6])}},
    ]
    out = dict_gather_v2(outputs, -1, layout={"a": "pad", "a.y": stack()})
    expected = {
        "a": {
            "x": torch.tensor([1, 0, 4, 5]),
            "x_length": torch.tensor([1, 2]),
            "y": torch.tensor([2, 3, 6]),
        }
    }
    assert_tree_equal(out, expected)


def test_v2_sequence_items_inside_dict_and_top_level_tuple() -> None:
    outputs = [
        ({"seq": [torch.tensor([1]), ("m", 1)]}, 1),
        ({"seq": [torch.tensor([2]), ("n", 2)]}, 2),
    ]
    # 'seq.1' names the second item of the list; the top-level tuple adds no prefix.
    first, n = dict_gather_v2(outputs, -1, layout={"seq.1": skip()})
    assert_tree_equal(first["seq"][0], torch.tensor([1, 2]))
    assert first["seq"][1] == [("m", 1), ("n", 2)]
    assert_tree_equal(n, torch.tensor([1, 2]))


def test_v2_skip_keeps_python_values() -> None:
    outputs = [{"k": 1, "meta": {"n": 1}}, {"k": 2, "meta": {"n": 2.5}}]
    out = dict_gather_v2(outputs, -1, layout={"meta": "skip"})
    assert_tree_equal(out["k"], torch.tensor([1, 2]))
    assert out["meta"] == [{"n": 1}, {"n": 2.5}]
    assert out["meta"][0] is outputs[0]["meta"]


def test_v2_none_and_strings() -> None:
    outputs = [{"x": None, "s": "a", "t": torch.ones(1)}, {"x": None, "s": "b", "t": torch.ones(1)}]
    out = dict_gather_v2(outputs, -1, layout={"t": "concat"})
    assert out["x"] is None and out["s"] == ["a", "b"]
    assert_tree_equal(out["t_length"], torch.tensor([1, 1]))


def test_v2_unused_keys_are_ignored() -> None:
    outputs = [{"a": torch.ones(1)}, {"a": torch.ones(1)}]
    out = dict_gather_v2(outputs, -1, layout={"missing": "pad", "a.deeper": "concat"})
    assert_tree_equal(out, {"a": torch.ones(2)})


# ------------------------------------------------------------------------- layout errors


def test_v2_length_under_sequence_is_an_error() -> None:
    outputs = [{"a": [torch.ones(1)]}, {"a": [torch.ones(2)]}]
    with pytest.raises(tg.LayoutError, match=r"outputs\['a'\]\[0\].*dict parent.*list"):
        dict_gather_v2(outputs, -1, layout={"a.0": "concat"})


def test_v2_length_key_clash_is_an_error() -> None:
    outputs = [{"z": torch.ones(1), "z_length": 1}, {"z": torch.ones(2), "z_length": 2}]
    with pytest.raises(tg.LayoutError, match=r"'z_length'.*already"):
        dict_gather_v2(outputs, -1, layout={"z": "concat"})


def test_v2_padding_a_non_tensor_is_an_error() -> None:
    outputs = [{"s": "a"}, {"s": "b"}]
    with pytest.raises(tg.LeafTypeError, match=r"outputs\['s'\].*needs a tensor"):
        dict_gather_v2(outputs, -1, layout={"s": "pad"})


@pytest.mark.parametrize(
    ("spec", "shapes"),
    [
        ("concat", [(2, 3), (2, 4)]),
        ("pad", [(), (2,)]),
        ("pad2d", [(2,), (2,)]),
        ("padimage", [(1, 2, 2), (2, 2, 2)]),
        ("padimage", [(2, 2), (2, 2)]),
    ],
)
def test_v2_shape_errors_name_path_and_shapes(spec: str, shapes: list[tuple[int, ...]]) -> None:
    outputs = [{"t": torch.zeros(s)} for s in shapes]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['t'\].*replica 1"):
        dict_gather_v2(outputs, -1, layout={"t": spec})


@pytest.mark.parametrize("spec", ["concat", "pad", "pad2d", "padimage"])
def test_v2_mixed_dtypes_name_the_path_as_v1_does(spec: str) -> None:
    """int64 against float32 replicas: the ShapeMismatchError naming outputs['z'] that
    dict_gather_v1 gives, not the core's plain ValueError without a path."""
    outputs = [
        {"z": torch.ones(2, 3, 3, dtype=torch.int64)},
        {"z": torch.ones(2, 3, 3, dtype=torch.float32)},
    ]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['z'\].*one dtype.*float32"):
        dict_gather_v1(outputs, -1)
    match = r"outputs\['z'\]: layout .*needs one dtype in every replica, got replica 0: "
    with pytest.raises(
        tg.ShapeMismatchError, match=match + r"torch.int64, replica 1: torch.float32"
    ):
        dict_gather_v2(outputs, -1, layout={"z": spec})


def test_v2_mixed_number_and_tensor_is_an_error() -> None:
    outputs = [{"acc": 1.0}, {"acc": torch.tensor(1.0)}]
    with pytest.raises(tg.LeafTypeError, match=r"outputs\['acc'\].*replica 1: Tensor"):
        dict_gather_v2(outputs, -1, layout={})


def test_layout_spec_errors() -> None:
    with pytest.raises(tg.LayoutError, match="unknown layout spec 'padd'"):
        DataLayout({"x": "padd"})
    with pytest.raises(tg.LayoutError, match="expected a DataLayoutSpec"):
        DataLayout({"x": 3})  # type: ignore[dict-item]
    with pytest.raises(tg.LayoutError, match="DataLayout or a dict"):
        dict_gather_v2([torch.ones(1)], -1, layout=["x"])  # type: ignore[arg-type]


# ------------------------------------------------------------------ data-parallel gathering


def test_seed_bug_patch_dict_gathering_multiple_values() -> None:
    # The seed's functools.partial raised "got multiple values for argument 'data_parallel'".
    dp = torch.nn.DataParallel(torch.nn.Identity())
    patch_dict_gathering(dp)
    out = dp.gather([{"x": torch.ones(1), "s": "a"}, {"x": torch.zeros(1), "s": "b"}], -1)
    assert_tree_equal(out, {"x": torch.tensor([1.0, 0.0]), "s": ["a", "b"]})
    with pytest.raises(TypeError, match=r"torch\.nn\.DataParallel"):
        patch_dict_gathering(torch.nn.Identity())  # type: ignore[arg-type]


def test_seed_bug_data_parallel_without_dim() -> None:
    # Where CUDA is missing, torch's DataParallel sets no .dim; the seed's gather crashed on it.
    dp = torch.nn.DataParallel(torch.nn.Identity())
    out = data_parallel_dict_gather(
        dp, [{"z": torch.ones(2)}, {"z": torch.ones(1)}], -1, {"z": "concat"}
    )
    assert_tree_equal(out, {"z": torch.ones(3), "z_length": torch.tensor([2, 1])})


def test_v2_keys_with_dots_and_pattern_characters() -> None:
    # by_path patterns are dotted fnmatch patterns; the seed's keys are plain dict keys.
    outputs = [
        {"acc.top1": 1, "acc_top5": 2, "loss[0]": 0.5, "a*": torch.ones(1), "ab": torch.ones(2)},
        {"acc.top1": 0, "acc_top5": 3, "loss[0]": 1.5, "a*": torch.ones(2), "ab": torch.ones(1)},
    ]
    out = dict_gather_v2(outputs, -1, layout={"a*": "concat"})
    assert_tree_equal(
        out,
        {
            "acc.top1": torch.tensor([1, 0]),
            "acc_top5": torch.tensor([2, 3]),
            "loss[0]": torch.tensor([0.5, 1.5], dtype=torch.float64),
            "a*": torch.ones(3),
            "a*_length": torch.tensor([1, 2]),
            "ab": torch.ones(3),
        },
    )


def test_v2_keys_with_dots_are_exact_paths_not_look_alikes() -> None:
    # Exact (tuple) by_path paths: 'a.b' no longer matches 'a_b' as well (the old glob escaping
    # matched a '.' as '?', and had to refuse this output), and both keys are gathered.
    outputs = [{"a.b": 1, "a_b": 2, "c": torch.ones(1)}, {"a.b": 3, "a_b": 4, "c": torch.ones(2)}]
    out = dict_gather_v2(outputs, -1, layout={"a.b": "skip", "c": "concat"})
    assert out["a.b"] == [1, 3]
    assert_tree_equal(out["a_b"], torch.tensor([2, 4]))
    assert_tree_equal(out["c_length"], torch.tensor([1, 2]))


def test_v2_dotted_seed_key_names_a_dotted_key_and_a_nested_one_alike() -> None:
    # The seed joins keys with dots: 'a.b' names outputs['a.b'] and outputs['a']['b'], both.
    outputs = [{"a.b": torch.ones(1), "a": {"b": torch.ones(2)}}] * 2
    out = dict_gather_v2(outputs, -1, layout={"a.b": "concat"})
    assert_tree_equal(out["a.b_length"], torch.tensor([1, 1]))
    assert_tree_equal(out["a"]["b_length"], torch.tensor([2, 2]))


def test_v2_translation_is_exact_paths_with_no_glob_escaping_and_no_cache() -> None:
    from treegather.compat.jactorch import layout as impl

    for gone in ("translate", "_escape", "_check_dotted_keys", "_CACHE"):
        assert not hasattr(impl, gone), gone
    layout = impl.to_gather_layout({"x*": "pad", "m": "skip"}, {"x*": torch.ones(1), "m": {}})
    assert isinstance(layout, tg.ByPath)
    assert [p for p, _, _ in layout.patterns] == [("m",), ("x*",)]
    # Equal seed layouts give equal by_path values: the core's compiled layer shares the plan.
    again = impl.to_gather_layout({"x*": "pad", "m": "skip"}, {"x*": torch.ones(3), "m": {}})
    assert again == layout and hash(again) == hash(layout)
    other = impl.to_gather_layout({"x*": pad(fill=1), "m": "skip"}, {"x*": torch.ones(1), "m": {}})
    assert other != layout
    assert impl.to_gather_layout({"x*": pad(fill=True)}, {"x*": torch.ones(1)}) != (
        impl.to_gather_layout({"x*": pad(fill=1)}, {"x*": torch.ones(1)})
    )


def test_v2_padding_is_the_core_pad(monkeypatch: pytest.MonkeyPatch) -> None:
    from treegather._rules import Pad

    calls: list[Any] = []
    real = Pad.combine

    def spy(rule: Any, col: Any, ctx: Any) -> Any:
        calls.append(rule)
        return real(rule, col, ctx)

    monkeypatch.setattr(Pad, "combine", spy)
    outputs = [{"s": torch.tensor([1, 2])}, {"s": torch.tensor([3])}]
    for spec in ("concat", "pad"):
        dict_gather_v2(outputs, -1, layout={"s": spec})
    assert [type(r).__name__ for r in calls] == ["Pad", "Pad"]


def test_v2_top_level_numbers() -> None:
    assert_tree_equal(dict_gather_v2([1, 2, 3], -1, layout={}), torch.tensor([1, 2, 3]))
    assert dict_gather_v1([1, 2, 3], -1) == [1, 2, 3]


def test_v2_length_under_dataclass() -> None:
    outputs = [Out(torch.ones(1), {"h": torch.ones(2)}), Out(torch.ones(2), {"h": torch.ones(1)})]
    out = dict_gather_v2(outputs, -1, layout={"meta.h": "pad"})
    assert type(out) is Out
    assert_tree_equal(out.z, torch.ones(3))
    assert_tree_equal(
        out.meta, {"h": torch.tensor([1.0, 1, 1, 0]), "h_length": torch.tensor([2, 1])}
    )
    with pytest.raises(tg.LayoutError, match=r"outputs\.z.*dict parent.*Out"):
        dict_gather_v2(outputs, -1, layout={"z": "concat"})


@given(
    rows=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    spec=st.sampled_from(["concat", "pad"]),
    fill=st.integers(-2, 2),
)
def test_v2_lengths_recover_every_replica(rows: list[int], spec: str, fill: int) -> None:
    values = [torch.arange(n * 2).reshape(n, 2) + 100 * i for i, n in enumerate(rows)]
    layout = {"v": concat() if spec == "concat" else pad(fill)}
    out = dict_gather_v2([{"v": v} for v in values], -1, layout=layout)
    assert_tree_equal(out["v_length"], torch.tensor(rows))
    step = max(rows) if spec == "pad" else None
    start = 0
    for i, (v, n) in enumerate(zip(values, out["v_length"].tolist())):
        block = out["v"][start : start + (step if step is not None else n)]
        assert_tree_equal(block[:n], v)
        assert bool((block[n:] == fill).all()), i
        start += block.shape[0]
    assert start == out["v"].shape[0]


# ------------------------------------------------------------------ data-parallel modules


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, tag: str = "t") -> dict[str, Any]:
        y = x * self.w
        return {
            "loss": y.sum(),
            "y": y,
            "name": tag,
            "devices": (str(x.device), str(self.w.device)),
        }


class VarNet(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"z": x.repeat_interleave(x.long()), "devices": (str(x.device),), "n": x.numel()}


@pytest.mark.parametrize("k", [2, 3])
def test_dict_gather_data_parallel_on_cpu_devices(k: int) -> None:
    net = Net()
    dp = DictGatherDataParallel(net, device_ids=["cpu"] * k)
    assert isinstance(dp, torch.nn.DataParallel) and dp.dim == 0
    x = torch.arange(6.0)
    out = dp(x)
    sums = torch.stack([c.sum() * 2 for c in x.tensor_split(k)])
    assert_tree_equal(out["loss"].detach(), sums)
    assert_tree_equal(out["y"].detach(), x * 2)
    assert out["name"] == ["t"] * k
    assert out["devices"] == (["cpu"] * k, ["cpu"] * k)
    out["loss"].sum().backward()
    assert_tree_equal(net.w.grad, torch.tensor(15.0))


def test_seed_bug_dict_gather_data_parallel_dim_on_cpu() -> None:
    # The seed's DictGatherDataParallel.gather read self.dim, which torch does not set without CUDA.
    dp = DictGatherDataParallel(Net())
    assert dp.dim == 0
    out = dp.gather([{"x": torch.ones(2)}, {"x": torch.zeros(1)}], -1)
    assert_tree_equal(out, {"x": torch.tensor([1.0, 1.0, 0.0])})


def test_jac_data_parallel_dict_gather_layout() -> None:
    dp = JacDataParallel(
        VarNet(), device_ids=["cpu"] * 2, dict_gather_layout={"z": "concat", "devices": "skip"}
    )
    out = dp(torch.tensor([1.0, 2.0, 3.0, 1.0]))
    expected = {
        "z": torch.tensor([1.0, 2, 2, 3, 3, 3, 1]),
        "z_length": torch.tensor([3, 4]),
        "devices": [("cpu",), ("cpu",)],
        "n": torch.tensor([2, 2]),
    }
    assert_tree_equal(out, expected)


def test_jac_data_parallel_without_dict_gather() -> None:
    dp = JacDataParallel(VarNet(), device_ids=["cpu"] * 2, use_dict_gather=False)
    out = dp(torch.tensor([1.0, 2.0]))
    assert_tree_equal(out["z"], torch.tensor([1.0, 2.0, 2.0]))
    assert out["n"] == [1, 1]


def test_jac_data_parallel_user_scattered() -> None:
    dp = JacDataParallel(Net(), device_ids=["cpu"] * 3, user_scattered=True)
    out = dp([torch.ones(2), torch.ones(3), torch.ones(1)])
    assert_tree_equal(out["loss"].detach(), torch.tensor([4.0, 6.0, 2.0]))
    assert_tree_equal(out["y"].detach(), torch.full((6,), 2.0))
    out = dp([torch.ones(2), torch.ones(3)])  # fewer inputs than devices: the first devices
    assert_tree_equal(out["loss"].detach(), torch.tensor([4.0, 6.0]))
    with pytest.raises(TypeError, match="one list of per-device inputs"):
        dp(torch.ones(2))
    with pytest.raises(TypeError, match="no keyword arguments"):
        dp([torch.ones(1)], tag="a")
    with pytest.raises(ValueError, match="4 per-device inputs for 3 devices"):
        dp([torch.ones(1)] * 4)


def test_jac_data_parallel_scatter_func() -> None:
    calls: list[tuple[int, int]] = []

    def my_scatter(inputs: Any, kwargs: Any, device_ids: Any, dim: int = 0) -> Any:
        calls.append((len(device_ids), dim))
        (x,) = inputs
        return [(x[:1],), (x[1:],)], [{"tag": "a"}, {"tag": "b"}]

    dp = JacDataParallel(Net(), device_ids=["cpu"] * 2, scatter_func=my_scatter)
    out = dp(torch.arange(3.0))
    assert_tree_equal(out["y"].detach(), torch.tensor([0.0, 2.0, 4.0]))
    assert out["name"] == ["a", "b"]
    assert calls == [(2, 0)]


class SyncLike(torch.nn.Module):
    """Records __data_parallel_replicate__ calls, the way SyncBatchNorm-style modules use them."""

    log: ClassVar[list[tuple[str, int, Any]]] = []

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.lin = torch.nn.Linear(1, 1)

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        if copy_id == 0:
            ctx.master = f"{self.name}-master"
        SyncLike.log.append((self.name, copy_id, getattr(ctx, "master", None)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("k", [2, 3])
def test_jac_data_parallel_replication_callback(k: int) -> None:
    SyncLike.log = []
    model = torch.nn.Sequential(SyncLike("a"), SyncLike("b"))
    dp = JacDataParallel(model, device_ids=["cpu"] * k)
    assert dp(torch.ones(6, 1)).shape == (6, 1)
    expected = [(n, i, f"{n}-master") for i in range(k) for n in ("a", "b")]
    assert SyncLike.log == expected
    SyncLike.log = []
    JacDataParallel(model, device_ids=["cpu"] * k, allow_replication_callback=False)(
        torch.ones(6, 1)
    )
    assert SyncLike.log == []


@pytest.mark.parametrize("k", [2, 3])
def test_jac_data_parallel_persistent_keeps_replicas_and_calls_back_once(k: int) -> None:
    SyncLike.log = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(SyncLike("a"), SyncLike("b"))
    dp = JacDataParallel(model, device_ids=["cpu"] * k, persistent=True)
    x = torch.randn(6, 1)
    first = dp.replicate(model, ["cpu"] * k)
    assert dp.replicate(model, ["cpu"] * k)[1] is first[1]  # kept across calls
    for _ in range(3):
        out = dp(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
    assert SyncLike.log == [(n, i, f"{n}-master") for i in range(k) for n in ("a", "b")]
    model.eval()  # a changed module rebuilds the replicas, and the callbacks run again
    dp(x)
    assert len(SyncLike.log) == 4 * k
    assert model[0].lin.weight.grad is not None


@pytest.mark.parametrize("copy_buffers", [True, False])
def test_jac_data_parallel_persistent_copy_buffers(copy_buffers: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).train()
    x = torch.cat([torch.randn(4, 2), torch.randn(4, 2) + 5])  # the two shards differ
    dp = JacDataParallel(model, device_ids=["cpu"] * 2, persistent=True, copy_buffers=copy_buffers)
    dp(x)
    dp(x)
    replica = dp.replicate(model, ["cpu"] * 2)[1]
    assert model[1].num_batches_tracked.item() == 2  # through replica 0 only
    same = torch.equal(replica[1].running_mean, model[1].running_mean)
    assert same is copy_buffers  # refreshed from the module, or the replica's own statistics


# ------------------------------------------------------ every device set (CPU, CUDA when present)


def test_v2_on_each_device_set(devices: list[str]) -> None:
    target = torch.device(devices[0])
    outputs: list[dict[str, Any]] = [
        {"z": torch.full((i + 1, 2), float(i), device=d), "m": 0.5 * i, "tag": "t"}
        for i, d in enumerate(devices)
    ]
    out = dict_gather_v2(outputs, devices[0], layout={"z": "pad", "tag": "skip"})
    k = len(devices)
    rows = [torch.tensor([[float(i)] * 2] * (i + 1) + [[0.0, 0.0]] * (k - 1 - i)) for i in range(k)]
    expected = {
        "z": torch.cat(rows).to(target),
        "z_length": torch.arange(1, k + 1),  # on the CPU, as the seed's
        "m": (0.5 * torch.arange(k, dtype=torch.float64)).to(target),
        "tag": ["t"] * k,
    }
    assert_tree_equal(out, expected)
    assert_tree_equal(dict_gather_v1(outputs, -1)["z"], torch.cat([o["z"].cpu() for o in outputs]))


def test_data_parallel_classes_on_each_device_set(devices: list[str]) -> None:
    x = torch.arange(6.0, device=devices[0])
    net = Net().to(devices[0])
    out = DictGatherDataParallel(net, device_ids=devices)(x)
    assert_tree_equal(out["y"].detach(), x * 2)
    assert out["name"] == ["t"] * min(len(devices), 6)
    jac = JacDataParallel(VarNet(), device_ids=devices, dict_gather_layout={"z": "concat"})
    out = jac(torch.ones(6, device=devices[0]))
    assert_tree_equal(out["z"], torch.ones(6, device=devices[0]))
    assert_tree_equal(
        out["z_length"], torch.tensor([len(c) for c in torch.ones(6).tensor_split(len(devices))])
    )


# ------------------------------------------------------------------------------ public face


@pytest.mark.parametrize("name", jactorch.__all__)
def test_every_public_name_is_documented_with_an_example(name: str) -> None:
    obj = getattr(jactorch, name)
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert own and own.strip(), f"{name} has no docstring of its own"
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    assert all(p.annotation is not inspect.Parameter.empty for p in params), name
    if params:
        assert "Args:" in own, f"{name}'s docstring has no Args section"
    tests = doctest.DocTestFinder(recurse=False).find(obj, name)
    assert any(t.examples for t in tests), f"{name} has no >>> example"


def test_v2_equal_but_differently_typed_fills_never_share_a_translation() -> None:
    # The old module-level cache keyed specs by ==, so pad(fill=True) reused pad(fill=1)'s rule.
    good = [{"s": torch.tensor([1, 2])}, {"s": torch.tensor([3])}]
    out = dict_gather_v2(good, -1, layout={"s": pad(fill=1)})
    assert_tree_equal(out["s"], torch.tensor([1, 2, 3, 1]))
    bad = [{"s": "a"}, {"s": "b"}]
    with pytest.raises(tg.LeafTypeError, match=r"DataLayoutSpec\('pad', fill=True\)"):
        dict_gather_v2(bad, -1, layout={"s": pad(fill=True)})
    with pytest.raises(tg.LeafTypeError, match=r"DataLayoutSpec\('pad', fill=1\.0\)"):
        dict_gather_v2(bad, -1, layout={"s": pad(fill=1.0)})
