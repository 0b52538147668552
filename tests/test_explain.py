"""treegather.explain (issue 11 item 18), the pointer errors end with, and ``python -m treegather``.

explain is checked against the real thing: the per-device sizes it computes are the shapes
scatter makes, the shapes it says gather returns are the shapes gather returns, the error it
says scatter would raise is the one scatter raises, and it never splits, copies or moves data.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
from corpus import Point

import treegather as tg
import treegather.__main__ as demo
from treegather._layout import EXPLAIN_POINTER

CPU3 = ["cpu"] * 3


def _shape(t: torch.Tensor) -> str:
    dims = list(t.shape)
    return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(map(str, dims)) + ")"


def _leaves(tree: Any) -> list[Any]:
    """Leaves, a list of per-sample items counting as one (the examples' split_items lists)."""
    import optree

    return optree.tree_leaves(tree, is_leaf=lambda v: isinstance(v, list), namespace=tg.NAMESPACE)


# ------------------------------------------------------------------------------ scatter rows


def test_scatter_rows_give_path_value_rule_why_and_per_device_sizes() -> None:
    batch = {"x": torch.zeros(10, 4), "ids": list("abcdefghij"), "lr": 0.1, "t": torch.tensor(2)}
    ex = tg.explain(batch, tg.by_path({"ids": tg.split_items()}), ["cpu"] * 4)
    assert ex.way == "scatter" and ex.sizes == (3, 3, 2, 2) and ex.error is None
    assert [r.path for r in ex] == ["inputs['ids']", "inputs['lr']", "inputs['t']", "inputs['x']"]
    ids, lr, t, x = ex
    assert (ids.rule, ids.why) == ("split_items()", "by_path pattern 'ids'")
    assert ids.per_device == ("3 item(s)", "3 item(s)", "2 item(s)", "2 item(s)")
    assert (lr.value, lr.rule, lr.why, lr.per_device) == (
        "float 0.1",
        "broadcast()",
        "default for float",
        ("whole",) * 4,
    )
    assert (t.rule, t.why) == ("broadcast()", "default for a 0-dim Tensor")
    assert (x.value, x.rule, x.why) == (
        "Tensor(10, 4) float32",
        "split()",
        "default for a Tensor with dims",
    )
    assert x.per_device == ("(3, 4)", "(3, 4)", "(2, 4)", "(2, 4)")
    assert x.result == "split along dim 0: 10 rows"
    text = str(ex)
    assert text.splitlines()[0] == "scatter over 4 devices (cpu x4): shard sizes (3, 3, 2, 2)"
    assert "inputs['x']" in text and "(3, 4), (3, 4), (2, 4), (2, 4)" in text
    assert repr(ex) == text


def test_scatter_without_devices_says_what_is_done() -> None:
    ex = tg.explain({"x": torch.zeros(5, 2), "name": "run"})
    assert ex.sizes is None and ex.devices is None
    assert ex["inputs['x']"].result == "split along dim 0: 5 rows"
    assert ex["inputs['x']"].per_device is None
    assert ex["inputs['name']"].result == "whole, to every device"
    assert "per-device sizes not shown" in str(ex)


def test_fewer_rows_than_devices_says_how_many_devices_are_used() -> None:
    ex = tg.explain({"x": torch.zeros(2, 2), "b": 1}, None, CPU3)
    assert ex.sizes == (1, 1) == tg.scatter({"x": torch.zeros(2, 2)}, CPU3).sizes
    assert str(ex).splitlines()[0].endswith("shard sizes (1, 1) (2 of 3 devices used)")
    assert ex["inputs['b']"].per_device == ("whole", "whole")


EXAMPLES: list[tuple[Any, Any, int]] = [
    ({"x": torch.zeros(7, 3), "m": {"w": torch.ones(2), "lr": 0.5}}, {"x": 0, "m": None}, 0),
    ({"x": torch.zeros(2, 9), "y": torch.zeros(4, 9)}, tg.split(1), 0),
    ({"x": torch.zeros(3, 5), "y": torch.zeros(3)}, None, 0),
    ({"a": torch.zeros(4, 6)}, None, 1),
    ({"x": torch.zeros(6, 2), "ids": list(range(6))}, tg.by_path({"ids": "split_items"}), 0),
    (
        {"x": torch.zeros(6, 2), "y": torch.zeros(6)},
        tg.by_path({"*": tg.split(sizes=[1, 5])}),
        0,
    ),
    (Point(torch.zeros(2, 2), torch.zeros(2)), None, 0),
    ({"enc.w": torch.zeros(5, 1), "b": torch.zeros(5)}, tg.by_path({("enc.w",): 0}), 0),
]


@pytest.mark.parametrize(("tree", "layout", "dim"), EXAMPLES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_scatter_sizes_are_the_shapes_scatter_makes(
    tree: Any, layout: Any, dim: int, k: int
) -> None:
    devices = ["cpu"] * k
    try:
        shards = tg.scatter(tree, devices, layout, dim=dim)
    except tg.BatchSizeError as exc:  # explicit sizes on too few devices: the same error
        ex = tg.explain(tree, layout, devices, dim=dim)
        assert ex.error == f"BatchSizeError: {exc}".removesuffix("\n" + EXPLAIN_POINTER)
        return
    ex = tg.explain(tree, layout, devices, dim=dim)
    assert ex.error is None and ex.sizes == shards.sizes
    per_shard = [_leaves(s) for s in shards]
    for i, row in enumerate(ex):
        assert row.per_device is not None and len(row.per_device) == len(shards)
        for r, cell in enumerate(row.per_device):
            got = per_shard[r][i]
            if cell == "whole":
                assert not isinstance(got, torch.Tensor) or got.shape == _leaves(tree)[i].shape
            elif cell.endswith("item(s)"):
                assert cell == f"{len(got)} item(s)"
            else:
                assert cell == _shape(got), (row.path, r)


def test_scatter_problems_are_shown_not_raised_and_match_scatter_error() -> None:
    tree = {"x": torch.zeros(4, 2), "y": torch.zeros(3), "z": torch.zeros(4), "s": "a"}
    layout = tg.by_path({"s": tg.split()})
    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter(tree, CPU3, layout)
    ex = tg.explain(tree, layout, CPU3)
    assert ex.error == f"LeafTypeError: {info.value}".removesuffix("\n" + EXPLAIN_POINTER)
    assert ex.sizes is None
    assert (
        ex["inputs['s']"].problem
        == "split() needs a tensor, got str 'a' (use split_items() on a list of per-sample items)"
    )
    assert ex["inputs['y']"].problem == "batch size 3, where the other split leaves have 4"
    assert ex["inputs['x']"].problem is None
    assert (
        ex["inputs['s']"].result == "fails (see problems)" and ex["inputs['s']"].per_device is None
    )
    text = str(ex)
    assert "problems:" in text and "scatter would raise LeafTypeError" in text


def test_unregistered_dataclass_problem_is_shown_with_its_hint() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    ex = tg.explain({"b": Batch(torch.zeros(2)), "y": torch.zeros(2)}, None, CPU3)
    assert "register_dataclass" in (ex["inputs['b']"].problem or "")
    assert ex.error is not None and ex.error.startswith("LeafTypeError: ")


# ------------------------------------------------------------------------------- why column


def test_why_names_default_single_rule_prefix_pattern_path_and_by_path_default() -> None:
    tree = {"a": torch.zeros(2), "meta": {"k": 1, "enc.w": torch.zeros(2)}}
    assert {r.why for r in tg.explain(tree, tg.broadcast())} == {
        "the layout (one rule for every leaf)"
    }
    ex = tg.explain(tree, {"a": 0, "meta": None})
    assert ex["inputs['meta']['k']"].why == "prefix layout at inputs['meta']"
    assert ex["inputs['a']"].why == "prefix layout at inputs['a']"
    ex = tg.explain(tree, tg.by_path({"meta.*": "broadcast", ("meta", "enc.w"): 0}, default=None))
    assert ex["inputs['meta']['k']"].why == "by_path pattern 'meta.*'"
    assert ex["inputs['meta']['enc.w']"].why == "by_path path ('meta', 'enc.w')"
    assert ex["inputs['a']"].why == "default for a Tensor with dims"
    ex = tg.explain(tree, tg.by_path({"a": 0}, default="broadcast"))
    assert ex["inputs['meta']['k']"].why == "by_path default"


def test_whole_value_groups_are_one_row() -> None:
    outs = {"meta": {"id": 1, "tags": ["a"]}, "loss": torch.tensor(1.0)}
    ex = tg.explain(outs, tg.by_path({"meta": "first"}), way="gather")
    assert [r.path for r in ex] == ["outputs['loss']", "outputs['meta']"]
    assert ex["outputs['meta']"].value == "dict of 2 item(s)"
    assert ex["outputs['meta']"].result == "replica 0's value"


def test_resolve_sources_leaves_resolve_unchanged() -> None:
    import optree

    from treegather._layout import resolve, resolve_sources

    tree = {"a": [torch.zeros(1), 2], "b": {"c": "x", "d": None}, "e.f": 1}
    spec = optree.tree_structure(tree, namespace=tg.NAMESPACE)
    layouts = [
        None,
        tg.first(),
        tg.by_path({"a": "as_list", ("e.f",): "sum", "b.*": "cat"}),
        {"a": "stack", "b": "first", "e.f": None},
    ]
    for layout in layouts:
        plan = resolve(spec, layout, "gather", 0, "outputs")
        again, sources = resolve_sources(spec, layout, "gather", 0, "outputs")
        assert plan.up_spec == again.up_spec and plan.rules == again.rules
        assert [g and (g[0], g[1].raw, g[2]) for g in plan.groups] == [
            g and (g[0], g[1].raw, g[2]) for g in again.groups
        ]
        assert len(sources) == again.up_spec.num_leaves


# ----------------------------------------------------------------------------------- gather


def test_gather_results_are_the_shapes_gather_returns() -> None:
    def out(r: int) -> dict[str, Any]:
        return {
            "logits": torch.full((2, 3), float(r)),
            "loss": torch.tensor(float(r)),
            "acc": torch.tensor([r, r]),
            "h": torch.zeros(2, 4, dtype=torch.float64),
            "p": torch.zeros(2, 5),
            "n": 3,
            "names": ["a", "b"],
        }

    layout = tg.by_path(
        {
            "acc": "mean",
            "h": tg.stack(1),
            "p": tg.pad(lengths=True),
            "n": "sum",
            "names": "cat_items",
        }
    )
    outs = [out(r) for r in range(3)]
    got = tg.gather(outs, "cpu", layout)
    ex = tg.explain(outs[0], layout, CPU3, "gather")
    assert ex["outputs['logits']"].result.startswith(f"Tensor{_shape(got['logits'])} float32")
    assert ex["outputs['loss']"].result.startswith(f"Tensor{_shape(got['loss'])} float32")
    assert ex["outputs['acc']"].result.startswith(f"Tensor{_shape(got['acc'])} float32")
    assert ex["outputs['h']"].result == f"Tensor{_shape(got['h'])} float64"
    assert ex["outputs['p']"].result.startswith(
        f"Padded(data=Tensor{_shape(got['p'].data)} float32, lengths=Tensor(3, 2) int64)"
    )
    assert ex["outputs['n']"].result == "int" and got["n"] == 9
    assert ex["outputs['names']"].result.startswith(f"list of {len(got['names'])} item(s)")
    assert str(ex).splitlines()[0] == "gather of 3 replica(s) shaped like this one"


def test_gather_without_devices_writes_sizes_in_k_and_flags_rules_that_do_not_fit() -> None:
    ex = tg.explain({"x": torch.zeros(4, 2), "s": "a"}, tg.by_path({"s": "cat"}), way="gather")
    assert ex["outputs['x']"].result.startswith("Tensor(k*4, 2) float32")
    assert ex["outputs['s']"].problem == "cat() needs a tensor, got str"
    assert "outputs['s']: cat() needs a tensor" in str(ex)


# ------------------------------------------------------------------------- nothing is moved


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_explain_never_splits_copies_or_moves_data() -> None:
    tree = {"x": torch.zeros(9, 2), "y": torch.ones(9), "ids": list(range(9))}
    for way, layout in (("scatter", tg.by_path({"ids": "split_items"})), ("gather", None)):
        with _Recorder() as rec:
            tg.explain(tree, layout, CPU3, way)
        moved = {"split", "tensor_split", "to", "cat", "stack", "narrow", "__getitem__", "clone"}
        assert not moved & set(rec.calls), rec.calls
    with _Recorder() as rec:  # the recorder does see a split when there is one
        tg.scatter(tree, CPU3, tg.by_path({"ids": "split_items"}))
    assert "tensor_split" in rec.calls


# ---------------------------------------------------------------------- layout errors, object


def test_layout_errors_end_with_the_explain_pointer_except_from_explain() -> None:
    tree = {"x": torch.zeros(2), "y": torch.zeros(2)}
    cases = [
        lambda: tg.scatter(tree, CPU3, {"x": 0}),  # not a prefix
        lambda: tg.scatter(tree, CPU3, tg.by_path({"z": 0})),  # matches nothing
        lambda: tg.scatter(tree, CPU3, {"x": "splitt", "y": 0}),  # unknown rule
        lambda: tg.gather([tree] * 2, "cpu", tg.by_path({"*": "sum", "x": "first", "[xy]": 0})),
    ]
    for call in cases:
        with pytest.raises(tg.LayoutError) as info:
            call()
        assert str(info.value).endswith("\n" + EXPLAIN_POINTER), str(info.value)
    assert EXPLAIN_POINTER == "(treegather.explain(tree, layout) shows the rule of every leaf)"
    with pytest.raises(tg.LayoutError) as info:
        tg.explain(tree, tg.by_path({"z": 0}), CPU3)
    assert "by_path pattern 'z' matches nothing" in str(info.value)
    assert EXPLAIN_POINTER not in str(info.value)


def test_explanation_indexing_html_and_argument_errors() -> None:
    ex = tg.explain({"x": torch.zeros(2, 2)}, devices=CPU3)
    assert ex[0] is ex["inputs['x']"] and len(ex) == 1 and list(ex) == [ex[0]]
    with pytest.raises(KeyError) as missing:
        ex["x"]
    assert missing.value.args[0] == "no row for 'x'; the paths are: [\"inputs['x']\"]"
    page = ex._repr_html_()
    assert page.startswith("<p>scatter over 3 devices") and "<th>per device</th>" in page
    assert "inputs[&#x27;x&#x27;]" in page
    with pytest.raises(ValueError, match="way is 'scatter' or 'gather'"):
        tg.explain({}, way="both")
    with pytest.raises(TypeError, match="dim is an int"):
        tg.explain({}, dim=True)
    assert "(no leaves)" in str(tg.explain({}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.way = "gather"  # type: ignore[misc]


# --------------------------------------------------------------------- python -m treegather


def test_main_help_prints_usage_instead_of_running_the_demo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        demo.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m treegather") and "treegather.explain" in out
    assert "scattered" not in out
    with pytest.raises(SystemExit) as info:
        demo.main(["--bogus"])
    assert info.value.code == 2


def test_main_demo_shows_the_exception_type(capsys: pytest.CaptureFixture[str]) -> None:
    demo.main([])
    out = capsys.readouterr().out
    assert "scattered 10 rows over 3 devices" in out
    assert "  treegather.StructureMismatchError: " in out


def test_python_dash_m_treegather_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "treegather", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m treegather")


# ----------------------------------------------------------- a data_parallel call, optional


def test_explain_shows_a_data_parallel_call_as_written() -> None:
    batch = {"x": torch.zeros(6, 2), "names": list("abcdef")}
    layout = tg.by_path({"names": tg.split_items()})
    # a single input: explain(batch, in_layout, devices), the rows data_parallel(fn, batch) uses
    single = tg.explain(batch, layout, ["cpu"] * 2)
    assert [r.path for r in single] == ["inputs['names']", "inputs['x']"]
    # with keyword arguments: as data_parallel takes them
    labels = {"labels": torch.arange(6)}
    both = tg.explain(
        batch,
        tg.by_path({"names": tg.split_items(), "labels": 0}),
        ["cpu"] * 2,
        module_kwargs=labels,
    )
    assert [(r.path, r.rule, r.why) for r in both] == [
        ("inputs['names']", "split_items()", "by_path pattern 'names'"),
        ("inputs['x']", "split()", "default for a Tensor with dims"),
        ("kwargs['labels']", "split()", "by_path pattern 'labels'"),
    ]
    assert both.sizes == (3, 3)
    # a tuple is the positional arguments, as in scatter_kwargs and DataParallel
    positional = tg.explain(
        (batch,), tg.by_path({"0.names": tg.split_items()}), ["cpu"] * 2, module_kwargs={}
    )
    assert [r.path for r in positional] == ["args[0]['names']", "args[0]['x']"]
    # the error data_parallel would raise, without the pointer to explain
    with pytest.raises(tg.LayoutError) as info:
        tg.explain(batch, layout, ["cpu"] * 2, module_kwargs={"names": list("uvwxyz")})
    assert "'names' could mean inputs['names'] or kwargs['names']" in str(info.value)
    assert EXPLAIN_POINTER not in str(info.value)
    with pytest.raises(ValueError, match="way='scatter'"):
        tg.explain(batch, None, None, "gather", module_kwargs={})


def test_explain_marks_optional_patterns_and_notes_the_unmatched_ones() -> None:
    layout = tg.by_path({"loss": tg.mean(), "logits": 0}, optional=("loss",))
    out = {"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3)}
    ex = tg.explain(out, layout, ["cpu"] * 2, "gather")
    assert ex["outputs['loss']"].why == "by_path pattern 'loss' (optional)"
    assert ex["outputs['logits']"].why == "by_path pattern 'logits'" and ex.notes == ()
    label_free = tg.explain({"logits": torch.zeros(2, 3)}, layout, ["cpu"] * 2, "gather")
    assert label_free.notes == ("by_path pattern 'loss' (optional) matches nothing here",)
    assert str(label_free).endswith(
        "notes:\n  - by_path pattern 'loss' (optional) matches nothing here"
    )
    assert "<p>notes:</p><ul><li>by_path pattern" in label_free._repr_html_()
