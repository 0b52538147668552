"""Layouts: single rules, prefix trees (ints, None, strings), by_path patterns, rule phases."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from corpus import FOREIGN, Point, Sample
from torch import nn

import treegather as tg

CPU2 = ["cpu", "cpu"]


def batch() -> dict[str, Any]:
    return {
        "ids": torch.arange(4),
        "mask": torch.ones(4, 4),
        "meta": {"lr": 0.5, "name": "run"},
    }


def replica_outputs() -> list[dict[str, Any]]:
    return [
        {
            "loss": torch.tensor(float(r + 1)),
            "logits": torch.full((2, 3), float(r)),
            "meta": {"id": r, "tag": "t"},
        }
        for r in range(2)
    ]


# ------------------------------------------------------------------------------ single rule


def test_a_single_scatter_rule_applies_to_every_leaf() -> None:
    shards = tg.scatter(batch(), CPU2, tg.broadcast())
    assert shards.sizes is None
    assert all(s["mask"].shape == (4, 4) for s in shards)
    shards = tg.scatter({"a": torch.ones(3, 4), "b": torch.ones(5, 4)}, CPU2, tg.split(1))
    assert [s["a"].shape for s in shards] == [(3, 2), (3, 2)]
    assert [s["b"].shape for s in shards] == [(5, 2), (5, 2)]


def test_a_single_gather_rule_applies_to_every_leaf() -> None:
    outs = [{"a": torch.ones(2), "b": torch.zeros(2)}, {"a": torch.ones(2), "b": torch.ones(2)}]
    out = tg.gather(outs, "cpu", tg.stack())
    assert out["a"].shape == (2, 2) and out["b"].tolist() == [[0, 0], [1, 1]]
    assert tg.gather(outs, "cpu", "sum")["b"].tolist() == [1.0, 1.0]
    assert tg.gather(outs, "cpu", 0)["a"].shape == (4,)


# ---------------------------------------------------------------------------- prefix trees


def test_prefix_tree_with_ints_none_and_strings() -> None:
    layout = {"ids": 0, "mask": 1, "meta": None}
    shards = tg.scatter(batch(), CPU2, layout)
    assert [s["ids"].tolist() for s in shards] == [[0, 1], [2, 3]]
    assert [s["mask"].shape for s in shards] == [(4, 2), (4, 2)]
    assert shards[1]["meta"] == {"lr": 0.5, "name": "run"}
    shards = tg.scatter(batch(), CPU2, {"ids": "split", "mask": "broadcast", "meta": "broadcast"})
    assert shards[0]["mask"].shape == (4, 4)


def test_prefix_tree_in_gather_int_is_cat_none_is_first_strings_are_rules() -> None:
    out = tg.gather(replica_outputs(), "cpu", {"loss": "mean", "logits": 1, "meta": None})
    assert out["loss"].item() == 1.5
    assert out["logits"].shape == (2, 6)
    assert out["meta"] == {"id": 0, "tag": "t"}
    out = tg.gather(replica_outputs(), "cpu", {"loss": "sum", "logits": "stack", "meta": "as_list"})
    assert out["loss"].item() == 3.0
    assert out["logits"].shape == (2, 2, 3)
    assert out["meta"] == [{"id": 0, "tag": "t"}, {"id": 1, "tag": "t"}]


def test_prefix_tree_missing_a_key_is_a_layout_error_with_a_by_path_hint() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.scatter(batch(), CPU2, {"ids": 0, "mask": None})
    msg = str(info.value)
    assert "not a prefix of the structure of inputs" in msg
    assert "'meta'" in msg
    assert "by_path" in msg


def test_prefix_tree_mismatch_deep_down_names_where() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(replica_outputs(), "cpu", {"loss": "mean", "logits": 0, "meta": {"id": "sum"}})
    msg = str(info.value)
    assert "'meta'" in msg and "'tag'" in msg


def test_prefix_tree_of_other_container_types() -> None:
    shards = tg.scatter(Point(torch.arange(4), torch.ones(2, 4)), CPU2, Point(0, 1))
    assert shards[0].y.shape == (2, 2)
    shards = tg.scatter(Sample(torch.arange(4), torch.arange(4)), CPU2, Sample(None, "split"))
    assert shards[0].image.tolist() == [0, 1, 2, 3]
    assert shards[0].label.tolist() == [0, 1]
    shards = tg.scatter([torch.arange(4), (torch.arange(4), "x")], CPU2, [0, None])
    assert shards[1][1][0].tolist() == [0, 1, 2, 3]


def test_prefix_tree_with_the_wrong_container_type_is_an_error() -> None:
    with pytest.raises(tg.LayoutError, match="not a prefix"):
        tg.scatter((torch.arange(4), torch.arange(4)), CPU2, [0, 0])


def test_unknown_rule_name_suggests_the_close_one() -> None:
    with pytest.raises(tg.LayoutError, match=r"unknown rule 'splitt' \(did you mean 'split'\?\)"):
        tg.scatter(batch(), CPU2, {"ids": "splitt", "mask": 0, "meta": None})


def test_not_a_rule_is_an_error() -> None:
    with pytest.raises(tg.LayoutError, match="is not a rule"):
        tg.scatter(torch.arange(4), CPU2, 1.5)
    with pytest.raises(tg.LayoutError, match="True is not a rule"):
        tg.gather([torch.zeros(1)] * 2, "cpu", True)


# ---------------------------------------------------------------------------- wrong phase


@pytest.mark.parametrize(
    "rule",
    [tg.cat(), tg.stack(), tg.mean(), tg.sum(), tg.pad(), tg.as_list(), tg.first(), tg.cat_items()],
)
def test_gather_rules_are_refused_by_scatter(rule: Any) -> None:
    with pytest.raises(tg.LayoutError, match="is a gather rule and cannot be used in scatter"):
        tg.scatter({"x": torch.arange(4)}, CPU2, tg.by_path({"x": rule}))


@pytest.mark.parametrize("rule", [tg.split(), tg.broadcast(), tg.split_items()])
def test_scatter_rules_are_refused_by_gather(rule: Any) -> None:
    with pytest.raises(tg.LayoutError, match="is a scatter rule and cannot be used in gather"):
        tg.gather([{"x": torch.ones(1)}] * 2, "cpu", {"x": rule})


@pytest.mark.parametrize(
    "name", ["cat", "stack", "mean", "sum", "pad", "as_list", "first", "cat_items"]
)
def test_gather_rule_names_are_refused_by_scatter(name: str) -> None:
    with pytest.raises(tg.LayoutError, match=f"'{name}' is a gather rule, not a scatter rule"):
        tg.scatter({"x": torch.arange(4)}, CPU2, {"x": name})


def test_callables_are_gather_rules_only() -> None:
    with pytest.raises(tg.LayoutError, match="custom callables are gather rules"):
        tg.scatter({"x": torch.arange(4)}, CPU2, {"x": lambda v, d: v})


GATHER_FACTORIES = ["cat", "stack", "mean", "sum", "pad", "as_list", "first", "cat_items"]
SCATTER_FACTORIES = ["split", "broadcast", "split_items"]


@pytest.mark.parametrize("name", GATHER_FACTORIES + SCATTER_FACTORIES)
def test_a_rule_factory_not_called_is_a_layout_error(name: str) -> None:
    """``{"loss": tg.mean}`` is a mistake, not a custom rule: a LayoutError naming the path and
    the call to write, when the layout is resolved (before any custom rule runs), in the
    reference and compiled paths alike, and from by_path patterns and defaults too."""
    from treegather._caches import reference_only

    factory = getattr(tg, name)
    calls: list[Any] = []

    def custom(values: list[Any], device: torch.device) -> Any:
        calls.append(values)
        return values

    outs = [{"loss": torch.tensor(1.0), "other": torch.ones(1)} for _ in range(2)]
    is_gather = name in GATHER_FACTORIES
    gather_says = rf"tg\.{name} is a rule factory, not a rule" + (
        rf": write tg\.{name}\(\)" if is_gather else ", and tg"
    )
    for attempt in range(4):  # cold, then a structure the compiled layer has seen
        ctx = reference_only if attempt == 3 else contextlib.nullcontext
        with ctx(), pytest.raises(tg.LayoutError, match=r"outputs\['loss'\]: " + gather_says):
            tg.gather(outs, "cpu", {"loss": factory, "other": custom})
        with ctx(), pytest.raises(tg.LayoutError, match=r"by_path pattern 'loss': " + gather_says):
            tg.gather(outs, "cpu", tg.by_path({"loss": factory}))
        with ctx(), pytest.raises(tg.LayoutError, match=r"by_path default: tg\." + name):
            tg.gather(outs, "cpu", tg.by_path({}, default=factory))
        scatter_says = rf"inputs\['x'\]: tg\.{name} is a rule factory, not a rule" + (
            ", and tg" if is_gather else rf": write tg\.{name}\(\)"
        )
        with ctx(), pytest.raises(tg.LayoutError, match=scatter_says):
            tg.scatter({"x": torch.arange(4), "y": torch.arange(4)}, CPU2, {"x": factory, "y": 0})
    assert calls == []  # the custom rule beside it never ran
    # A callable that is no factory is still a custom gather rule.
    assert tg.gather(outs, "cpu", {"loss": custom, "other": custom})["loss"] == [
        outs[0]["loss"],
        outs[1]["loss"],
    ]


def _says_foreign(rule: Any, where: str, phase: str) -> str:
    name = f"{type(rule).__module__}.{type(rule).__qualname__}"
    use = r"a gather rule of your own is a callable f\(values, device\)" if phase else "scatter"
    return rf"{where}: {name} subclasses treegather's internal rule class.*{use}"


def test_rule_is_not_public() -> None:
    assert not hasattr(tg, "Rule") and "Rule" not in tg.__all__ and "Rule" not in dir(tg)


@pytest.mark.parametrize("rule", FOREIGN, ids=lambda r: type(r).__name__)
def test_a_rule_class_of_your_own_is_a_layout_error_saying_to_pass_a_callable(rule: Any) -> None:
    """In every entry point and every place a layout holds a rule: a LayoutError naming where,
    cold and warm, and the custom rule beside it never runs (not a raw ``TypeError`` from
    ``dataclasses``, nor a message with a hole: "is a  rule")."""
    calls: list[Any] = []

    def custom(values: list[Any], device: torch.device) -> Any:
        calls.append(values)
        return values

    outs = [{"s": torch.ones(2), "other": torch.ones(1)} for _ in range(2)]
    for _ in range(3):
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, r"outputs\['s'\]", "g")):
            tg.gather(outs, "cpu", {"s": rule, "other": custom})
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, "layout at outputs", "g")):
            tg.gather(outs, "cpu", rule)
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, r"inputs\['x'\]", "")):
            tg.scatter({"x": torch.arange(4)}, CPU2, {"x": rule})
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, "by_path pattern 's'", "g")):
            tg.by_path({"s": rule, "never": tg.cat()}, optional=["never"])
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, "by_path default", "g")):
            tg.by_path({}, default=rule)
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, r"outputs\['s'\]", "g")):
            tg.data_parallel(lambda x: {"s": x}, torch.arange(4.0), CPU2, out_layout={"s": rule})
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, "layout", "")):
            tg.data_parallel(lambda x: x, torch.arange(4.0), CPU2, in_layout=rule)
        with pytest.raises(tg.LayoutError, match=_says_foreign(rule, r"outputs\['s'\]", "g")):
            tg.explain(outs[0], {"s": rule, "other": 0}, way="gather")
    with pytest.raises(tg.LayoutError, match=_says_foreign(rule, r"outputs", "g")):
        tg.DataParallel(nn.Linear(2, 2), ["cpu"] * 2, out_layout=rule)(torch.ones(4, 2))
    assert calls == []


# -------------------------------------------------------------------------------- by_path


def test_by_path_sets_some_leaves_and_leaves_the_rest_to_defaults() -> None:
    out = tg.gather(replica_outputs(), "cpu", tg.by_path({"loss": "mean", "meta.*": "first"}))
    assert out["loss"].item() == 1.5
    assert out["logits"].shape == (4, 3)  # default cat
    assert out["meta"] == {"id": 0, "tag": "t"}


def test_by_path_default_applies_to_unmatched_leaves() -> None:
    out = tg.gather(replica_outputs(), "cpu", tg.by_path({"loss": "mean"}, default="first"))
    assert out["logits"].tolist() == [[0.0] * 3] * 2
    assert out["meta"] == {"id": 0, "tag": "t"}


def test_by_path_star_matches_one_segment() -> None:
    outs = [{"h": [torch.ones(1, 2), torch.ones(1, 2)], "x": torch.ones(1, 2)} for _ in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"h.*": 1}))
    assert [t.shape for t in out["h"]] == [(1, 4), (1, 4)]
    assert out["x"].shape == (2, 2)


def test_by_path_double_star_matches_any_depth() -> None:
    outs = [{"a": {"b": {"logits": torch.ones(1, 2)}}, "logits": torch.ones(1, 2)}] * 2
    out = tg.gather(outs, "cpu", tg.by_path({"**.logits": "stack"}))
    assert out["logits"].shape == (2, 1, 2)  # ** matches zero segments too
    assert out["a"]["b"]["logits"].shape == (2, 1, 2)


def test_by_path_index_and_attribute_segments() -> None:
    outs = [Point(x=[torch.ones(1), torch.ones(1)], y=torch.ones(1)) for _ in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"x.1": "stack", "y": "sum"}))
    assert out.x[0].shape == (2,) and out.x[1].shape == (2, 1) and out.y.tolist() == [2.0]


def test_by_path_more_literal_segments_win() -> None:
    outs = [{"meta": {"id": r, "name": "n"}} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"meta.*": "first", "meta.id": "as_list"}))
    assert out == {"meta": {"id": [0, 1], "name": "n"}}
    out = tg.gather(outs, "cpu", tg.by_path({"*.*": "first", "*.id": "sum"}))
    assert out == {"meta": {"id": 1, "name": "n"}}


def test_by_path_deeper_pattern_beats_an_inner_node_pattern_with_the_same_literals() -> None:
    outs = [{"meta": {"id": r, "name": "n"}} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"meta": "sum", "meta.*": "as_list"}))
    assert out == {"meta": {"id": [0, 1], "name": ["n", "n"]}}


def test_by_path_tie_is_an_error_naming_the_leaf_and_both_patterns() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.scatter(batch(), CPU2, tg.by_path({"meta.*": "broadcast", "*.lr": "split"}))
    msg = str(info.value)
    assert "inputs['meta']['lr'] is matched equally well by 'meta.*' and '*.lr'" in msg
    assert "Hint: make one pattern more specific" in msg


def test_by_path_pattern_matching_nothing_is_an_error_with_close_names() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.scatter(batch(), CPU2, tg.by_path({"mak": "split"}))
    msg = str(info.value)
    assert "by_path pattern 'mak' matches nothing; close paths: mask" in msg
    assert "Hint: patterns are dotted paths from the root" in msg


def test_by_path_every_pattern_matching_nothing_is_listed() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(replica_outputs(), "cpu", tg.by_path({"los": "mean", "logit": 1, "zzz": 0}))
    msg = str(info.value)
    assert msg.startswith("3 problems:")
    assert "'los' matches nothing; close paths: loss" in msg
    assert "'logit' matches nothing; close paths: logits" in msg
    assert "'zzz' matches nothing" in msg


def test_by_path_rejects_bad_patterns() -> None:
    with pytest.raises(tg.LayoutError, match="empty segment"):
        tg.by_path({"a..b": "first"})
    with pytest.raises(tg.LayoutError, match="is not a string"):
        tg.by_path({1: "first"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="expects a mapping"):
        tg.by_path(["a"])  # type: ignore[arg-type]


def test_by_path_repr() -> None:
    assert repr(tg.by_path({"a": "first"})) == "by_path({'a': 'first'}, default=None)"


# ------------------------------------------------------------------------ optional patterns


def test_by_path_optional_pattern_may_match_nothing_the_others_still_may_not() -> None:
    train = tg.by_path({"loss": tg.mean(), "meta": "first"}, optional=("loss",))
    out = tg.gather(replica_outputs(), "cpu", train)
    assert out["loss"].item() == 1.5 and out["meta"] == {"id": 0, "tag": "t"}
    label_free = [{k: v for k, v in o.items() if k != "loss"} for o in replica_outputs()]
    out = tg.gather(label_free, "cpu", train)  # the same layout, a call without labels
    assert set(out) == {"logits", "meta"} and out["meta"] == {"id": 0, "tag": "t"}
    with pytest.raises(tg.LayoutError, match="pattern 'loss' matches nothing"):
        tg.gather(label_free, "cpu", tg.by_path({"loss": tg.mean(), "meta": "first"}))
    typo = tg.by_path({"loss": tg.mean(), "mta": "first"}, optional=("loss",))
    with pytest.raises(tg.LayoutError) as info:  # typo detection stays for the others
        tg.gather(label_free, "cpu", typo)
    assert str(info.value).startswith("by_path pattern 'mta' matches nothing; close paths: meta")
    # in scatter too, and for exact tuple paths
    shards = tg.scatter(
        batch(), CPU2, tg.by_path({("labels",): 0, "ids": 0}, optional=[("labels",)])
    )
    assert [s["ids"].tolist() for s in shards] == [[0, 1], [2, 3]]


def test_by_path_optional_names_patterns_exactly_and_type_aware() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.by_path({("loss",): "mean"}, optional=("loss",))  # the string, not the exact path
    assert str(info.value).startswith(
        "by_path optional names 'loss', which is not among the layout's patterns (('loss',))"
    )
    with pytest.raises(tg.LayoutError, match=r"optional names \(True,\)"):
        tg.by_path({(1,): "first"}, optional=[(True,)])  # True is not 1
    assert tg.by_path({(1,): "first"}, optional=[(1,)]).optional == ((1,),)
    with pytest.raises(tg.ArgumentTypeError, match=r"optional=\('loss',\)"):
        tg.by_path({"loss": "mean"}, optional="loss")  # type: ignore[arg-type]
    with pytest.raises(tg.ArgumentTypeError):
        tg.by_path({"loss": "mean"}, optional=1)  # type: ignore[arg-type]


def test_by_path_optional_is_part_of_the_layouts_value() -> None:
    plain = tg.by_path({"loss": "mean", "meta": "first"})
    opt = tg.by_path({"loss": "mean", "meta": "first"}, optional=("loss",))
    assert opt == tg.by_path({"loss": "mean", "meta": "first"}, optional=["loss"])
    assert opt == tg.by_path({"loss": "mean", "meta": "first"}, optional=("loss", "loss"))
    assert hash(opt) == hash(tg.by_path({"loss": "mean", "meta": "first"}, optional=["loss"]))
    assert opt != plain and opt != tg.by_path({"loss": "mean", "meta": "first"}, optional=["meta"])
    assert (
        repr(opt) == "by_path({'loss': 'mean', 'meta': 'first'}, default=None, optional=('loss',))"
    )
    assert repr(plain) == "by_path({'loss': 'mean', 'meta': 'first'}, default=None)"
    # the cached plan of one is never the other's: a warm optional layout does not hide the
    # plain one's error, in either order and on both paths
    from treegather._caches import reference_only
    from treegather.distributed.layout import layout_text

    label_free = [{k: v for k, v in o.items() if k != "loss"} for o in replica_outputs()]
    tg.clear_caches()
    for _ in range(3):
        tg.gather(label_free, "cpu", opt)
        with pytest.raises(tg.LayoutError, match="'loss' matches nothing"):
            tg.gather(label_free, "cpu", plain)
        with reference_only():
            tg.gather(label_free, "cpu", opt)
    # ranks compare layouts by a text key: optional is part of it
    assert layout_text(opt, 0)[0] != layout_text(plain, 0)[0]
    assert "optional=('loss',)" in layout_text(opt, 0)[1]


def test_layout_text_kept_per_layout_tells_equal_keys_apart() -> None:
    """A layout's text is kept per immutable layout; layouts whose typed keys are equal but
    whose texts differ (-0.0 and 0.0, True and 1) never share it, in either order, warm."""
    from treegather.distributed.layout import layout_text

    tg.clear_caches()
    pairs = [
        (tg.by_path({"x": tg.pad(fill=-0.0)}), tg.by_path({"x": tg.pad(fill=0.0)})),
        (tg.pad(fill=-0.0), tg.pad(fill=0.0)),
        (tg.by_path({"x": tg.pad(fill=True)}), tg.by_path({"x": tg.pad(fill=1)})),
        (tg.by_path({"x": tg.cat()}), tg.by_path({"x": tg.stack()})),
    ]
    for a, b in pairs:
        for _ in range(2):
            assert layout_text(a, 0)[0] != layout_text(b, 0)[0]
            assert layout_text(b, 0)[0] != layout_text(a, 0)[0]
            assert layout_text(a, 0) != layout_text(a, True)  # (dim's type counts)
            assert layout_text(a, 0, True) != layout_text(a, 0)
    same = tg.by_path({"x": tg.cat()})
    assert layout_text(same, 0) == layout_text(tg.by_path({"x": tg.cat()}), 0)


# --------------------------------------------------------------- inner nodes: leaf-wise vs whole


def test_leaf_wise_rule_on_an_inner_node_applies_to_every_leaf_below() -> None:
    outs = [{"h": {"a": torch.ones(2), "b": torch.ones(2)}} for _ in range(3)]
    out = tg.gather(outs, "cpu", tg.by_path({"h": "stack"}))
    assert out["h"]["a"].shape == (3, 2) and out["h"]["b"].shape == (3, 2)
    out = tg.gather(outs, "cpu", {"h": "sum"})
    assert out["h"]["a"].tolist() == [3.0, 3.0]
    shards = tg.scatter({"h": {"a": torch.ones(4), "b": torch.ones(4)}}, CPU2, {"h": None})
    assert shards[0]["h"]["a"].shape == (4,)


def test_whole_value_rule_on_an_inner_node_receives_the_subtrees_whole() -> None:
    outs = replica_outputs()
    out = tg.gather(outs, "cpu", tg.by_path({"meta": "as_list"}))
    assert out["meta"] == [{"id": 0, "tag": "t"}, {"id": 1, "tag": "t"}]
    out = tg.gather(outs, "cpu", tg.by_path({"meta": "first"}))
    assert out["meta"] == {"id": 0, "tag": "t"}
    seen: list[Any] = []

    def custom(values: list[Any], device: torch.device) -> str:
        seen.append((values, device))
        return "custom"

    out = tg.gather(outs, "cpu", tg.by_path({"meta": custom}))
    assert out["meta"] == "custom"
    assert seen == [([{"id": 0, "tag": "t"}, {"id": 1, "tag": "t"}], torch.device("cpu"))]


def test_whole_value_subtrees_may_differ_in_structure_between_replicas() -> None:
    outs = [{"x": torch.ones(1), "extra": [1]}, {"x": torch.ones(1), "extra": [1, 2, 3]}]
    out = tg.gather(outs, "cpu", tg.by_path({"extra": "as_list"}))
    assert out["extra"] == [[1], [1, 2, 3]]


def test_rule_inside_a_whole_value_node_is_an_error() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(replica_outputs(), "cpu", tg.by_path({"meta": "first", "meta.id": "sum"}))
    msg = str(info.value)
    assert "first() on outputs['meta'] (pattern 'meta') takes the subtree whole" in msg
    assert "pattern 'meta.id' sets a rule inside it" in msg


def test_whole_value_rule_on_a_none_node() -> None:
    outs = [{"a": None, "b": torch.ones(1)}] * 2
    assert tg.gather(outs, "cpu", tg.by_path({"a": "as_list"}))["a"] == [None, None]
    out = tg.gather(outs, "cpu", {"a": None, "b": 0})
    assert out["a"] is None and out["b"].tolist() == [1.0, 1.0]


def test_same_layout_object_reused_for_different_structures() -> None:
    layout = tg.by_path({"x": "sum"})
    assert tg.gather([{"x": 1}, {"x": 2}], "cpu", layout) == {"x": 3}
    assert tg.gather([{"x": 1, "y": 2}, {"x": 2, "y": 3}], "cpu", layout) == {"x": 3, "y": [2, 3]}


# ------------------------------------------------ exact paths: every key addressable (issue 11.9)


def named_parameter_grads() -> list[dict[str, Any]]:
    """Per-replica outputs keyed like ``named_parameters()``: every key holds dots."""
    return [
        {
            "encoder.layer.0.weight": torch.full((2, 2), float(r)),
            "encoder.layer.0.bias": torch.full((2,), float(r)),
            "step": r,
        }
        for r in range(2)
    ]


def test_by_path_tuple_path_addresses_a_key_with_dots() -> None:
    layout = tg.by_path(
        {("encoder.layer.0.weight",): "sum", ("encoder.layer.0.bias",): "mean", ("step",): "first"}
    )
    out = tg.gather(named_parameter_grads(), "cpu", layout)
    assert out["encoder.layer.0.weight"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert out["encoder.layer.0.bias"].tolist() == [0.5, 0.5]
    assert out["step"] == 0


def test_by_path_tuple_path_in_scatter_kwargs_starts_at_the_keyword() -> None:
    params = {"encoder.weight": torch.ones(3, 3), "encoder.bias": torch.ones(3)}
    a, kw = tg.scatter_kwargs(
        (torch.zeros(4, 3),),
        {"params": params},
        CPU2,
        tg.by_path({("params", "encoder.weight"): "broadcast", ("params", "encoder.bias"): None}),
    )
    assert [x[0].shape[0] for x in a] == [2, 2]
    assert all(k["params"]["encoder.weight"].shape == (3, 3) for k in kw)


def test_by_path_tuple_path_compares_each_segment_literally() -> None:
    outs = [{"meta": {"[x]": r, "x": r, "a*": r, "ab": r}} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({("meta", "[x]"): "sum", ("meta", "a*"): "first"}))
    assert out == {"meta": {"[x]": 1, "x": [0, 1], "a*": 0, "ab": [0, 1]}}


def test_by_path_string_segment_spelling_a_key_exactly_means_that_key() -> None:
    # fnmatch alone reads "[x]" as the class {x} and "loss[0]" as "loss0": the key spelled
    # exactly wins, the look-alike sibling is left alone.
    outs = [{"[x]": r, "x": r, "loss[0]": r, "loss0": r} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"[x]": "sum", "loss[0]": "first"}))
    assert out == {"[x]": 1, "x": [0, 1], "loss[0]": 0, "loss0": [0, 1]}


def test_by_path_glob_classes_still_match_when_no_key_spells_them() -> None:
    outs = [{"x": r, "y": r, "z": r} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"[xy]": "sum"}))
    assert out == {"x": 1, "y": 1, "z": [0, 1]}


def test_by_path_close_paths_are_written_as_by_path_takes_them() -> None:
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(named_parameter_grads(), "cpu", tg.by_path({"encoder.layer.0.weight": "sum"}))
    msg = str(info.value)
    assert "by_path pattern 'encoder.layer.0.weight' matches nothing; close paths: " in msg
    assert "('encoder.layer.0.weight',)" in msg
    assert "a tuple is an exact path" in msg
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(named_parameter_grads(), "cpu", tg.by_path({("encoder.layer.0.wieght",): 1}))
    assert (
        "by_path path ('encoder.layer.0.wieght',) matches nothing; close paths: "
        "('encoder.layer.0.weight',)" in str(info.value)
    )


def test_by_path_exact_path_types_count() -> None:
    outs = [{"h": [torch.ones(1), torch.ones(1)], 1: torch.ones(1), "1": torch.ones(1)}] * 2
    out = tg.gather(outs, "cpu", tg.by_path({("h", 0): "stack", (1,): "sum"}))
    assert out["h"][0].shape == (2, 1) and out["h"][1].shape == (2,)
    assert out[1].tolist() == [2.0] and out["1"].tolist() == [1.0, 1.0]
    out = tg.gather(outs, "cpu", tg.by_path({("h", "1"): "stack"}))  # an index as its digits
    assert out["h"][1].shape == (2, 1)
    with pytest.raises(tg.LayoutError, match=r"by_path path \(True,\) matches nothing"):
        tg.gather(outs, "cpu", tg.by_path({(True,): "sum"}))


def test_by_path_exact_path_counts_every_segment_as_literal() -> None:
    outs = [{"meta": {"id": r, "name": "n"}} for r in range(2)]
    out = tg.gather(outs, "cpu", tg.by_path({"*.*": "first", ("meta", "id"): "as_list"}))
    assert out == {"meta": {"id": [0, 1], "name": "n"}}
    with pytest.raises(tg.LayoutError, match=r"equally well by 'meta\.id' and \('meta', 'id'\)"):
        tg.gather(outs, "cpu", tg.by_path({"meta.id": "sum", ("meta", "id"): "as_list"}))


def test_by_path_with_tuple_paths_is_an_immutable_value() -> None:
    a = tg.by_path({("a.b",): 1, "c": "first"})
    assert a == tg.by_path({("a.b",): 1, "c": "first"})
    assert hash(a) == hash(tg.by_path({("a.b",): 1, "c": "first"}))
    assert a != tg.by_path({("a.b",): True, "c": "first"})  # True is not 1
    assert tg.by_path({("a",): 1}) != tg.by_path({"a": 1})  # the form is part of the value
    assert repr(a) == "by_path({('a.b',): 1, 'c': 'first'}, default=None)"
    with pytest.raises(AttributeError, match="immutable"):
        a.default = 0


def test_equal_inline_tuple_path_layouts_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from treegather import _compiled
    from treegather._compiled import structure as _structure

    calls: list[Any] = []
    real = _compiled.resolve

    def counting(*args: Any) -> Any:
        calls.append(args[1])
        return real(*args)

    # Cold calls resolve in _compiled, a structure's plans in _structure: count both.
    monkeypatch.setattr(_compiled, "resolve", counting)
    monkeypatch.setattr(_structure, "resolve", counting)
    tg.clear_caches()
    for _ in range(6):
        out = tg.gather(named_parameter_grads(), "cpu", tg.by_path({("step",): "first"}))
        assert out["step"] == 0
    # The first sighting resolves cold; from the second on, one plan for every equal layout.
    assert len(calls) == 2


def test_exact_paths_resolve_alike_in_the_reference_and_compiled_paths() -> None:
    from treegather._caches import reference_only

    outs = [{"[x]": r, "x": r, "a.b": torch.ones(1)} for r in range(2)]
    layouts = [
        tg.by_path({"[x]": "sum", ("a.b",): "stack"}),
        tg.by_path({"a.b": "stack"}),  # matches nothing: the same error both ways
    ]
    for layout in layouts:
        results = []
        for mode in ("compiled", "compiled", "compiled", "reference"):
            try:
                if mode == "reference":
                    with reference_only():
                        results.append(repr(tg.gather(outs, "cpu", layout)))
                else:
                    results.append(repr(tg.gather(outs, "cpu", layout)))
            except tg.LayoutError as exc:
                results.append(f"LayoutError: {exc}")
        assert len(set(results)) == 1, results


def test_by_path_rejects_an_empty_or_untyped_path() -> None:
    with pytest.raises(tg.LayoutError, match=r"by_path path \(\) is empty"):
        tg.by_path({(): "first"})
    with pytest.raises(tg.LayoutError, match=r"not a string .* or a tuple .*\(1,\)"):
        tg.by_path({1: "first"})  # type: ignore[dict-item]
    with pytest.raises(tg.LayoutError, match=r"empty segment .*\('a\.\.b',\)"):
        tg.by_path({"a..b": "first"})


def test_unknown_rule_name_lists_the_rule_names_the_close_one_first() -> None:
    outs = [{"loss": torch.tensor(1.0)}] * 2
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(outs, "cpu", {"loss": "avg"})
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        "layout at outputs['loss']: unknown rule 'avg' (did you mean 'mean'?); the gather rules "
        "are 'mean', "
    )
    listed = first.partition("the gather rules are ")[2].split(", ")
    assert sorted(listed) == sorted(
        repr(n) for n in ("cat", "stack", "mean", "sum", "pad", "as_list", "first", "cat_items")
    )
    with pytest.raises(
        tg.LayoutError,
        match=r"unknown rule 'firts' \(did you mean 'first'\?\); "
        r"the gather rules are 'first', ",
    ):
        tg.gather(outs, "cpu", {"loss": "firts"})
    # a scatter rule's name in a gather layout: said so, and the gather rules listed
    with pytest.raises(
        tg.LayoutError,
        match=r"unknown rule 'splitt' \('split' is a scatter "
        r"rule\); the gather rules are ",
    ):
        tg.gather(outs, "cpu", {"loss": "splitt"})
    with pytest.raises(tg.LayoutError, match=r"the scatter rules are 'split', "):
        tg.scatter(batch(), CPU2, {"ids": "splt", "mask": 0, "meta": None})
