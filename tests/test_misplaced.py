"""Rows the default gather rules would join in the wrong place (issue 47, point 5).

With the shard sizes known (``data_parallel``, ``DataParallel``, ``patch``, ``gather(...,
sizes=)``), a tensor whose rows are visibly in another dim and a list holding one item per
sample are refused with a typed error naming the path, the sizes, what was seen and the rule to
write; any rule in the layout is taken as written. A value laid out by rows (a
``PackedSequence``, a dim-0 ``LazyStackedTensorDict``) is joined by ``cat()`` and split by
``split()`` by its rows, as the defaults do, and refused by name by every other rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import treegather as tg
from treegather._caches import reference_only

CPU2, CPU3 = ["cpu"] * 2, ["cpu"] * 3
HIDDEN = tg.by_path({"0": tg.cat(1), "1": tg.cat(1)})  # an LSTM's (h_n, c_n): batch in dim 1


def _lstm() -> nn.LSTM:
    torch.manual_seed(0)
    return nn.LSTM(5, 5, batch_first=True)


# ------------------------------------------------------------------------------ a tensor


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_an_lstm_state_is_refused_naming_the_paths_sizes_shapes_and_rule(rows: int) -> None:
    lstm = _lstm()
    x = torch.randn(rows, 3, 5)
    with pytest.raises(tg.ShapeMismatchError) as caught:
        tg.data_parallel(lambda x: lstm(x)[1], x, CPU2)
    text = str(caught.value)
    shards = [4, 4] if rows == 8 else [4, 3]
    shapes = ", ".join(f"replica {r}: [1, {s}, 5]" for r, s in enumerate(shards))
    for path in ("outputs[0]", "outputs[1]"):
        assert f"{path}: its rows are along dim 1, not dim 0" in text
    assert f"shard rows ({shards}) along dim 1" in text and f"({shapes})" in text
    assert "tg.by_path({'0': tg.cat(1), '1': tg.cat(1)})" in text
    assert "Rows" not in text.replace("rows", "")
    # the rule it names gives what one device gives
    got = tg.data_parallel(lambda x: lstm(x)[1], x, CPU2, out_layout=HIDDEN)
    for a, b in zip(got, lstm(x)[1], strict=True):
        torch.testing.assert_close(a, b)


def test_every_entry_point_that_knows_the_sizes_refuses_it() -> None:
    lstm = _lstm()
    x = torch.randn(8, 3, 5)
    pick = _Hidden(lstm)
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\[1\]: its rows are along dim 1"):
        tg.DataParallel(pick, CPU2)(x)
    dp = tg.patch(nn.DataParallel(pick))
    args, kwargs = dp.scatter((x,), {}, CPU2)
    outputs = [pick(*a, **k) for a, k in zip(args, kwargs, strict=True)]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\[0\]: its rows are along dim 1"):
        dp.gather(outputs, "cpu")
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\[0\]: its rows are along dim 1"):
        tg.gather(outputs, "cpu", sizes=[4, 4])
    # without the sizes nothing is known: the default rule, as torch's gather
    assert [t.shape for t in tg.gather(outputs, "cpu")] == [(2, 4, 5)] * 2
    assert [t.shape for t in tg.DataParallel(pick, CPU2, out_layout=HIDDEN)(x)] == [(1, 8, 5)] * 2


class _Hidden(nn.Module):
    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor) -> Any:
        return self.lstm(x)[1]


@pytest.mark.parametrize(
    "layout",
    [tg.cat(), (tg.cat(0), tg.cat(0)), tg.by_path({"*": tg.cat(0)}), tg.stack(), tg.as_list()],
    ids=["cat", "prefix cat(0)", "by_path cat(0)", "stack", "as_list"],
)
def test_a_rule_in_the_layout_is_taken_as_written(layout: Any) -> None:
    outs = [(torch.zeros(1, 4, 5), torch.ones(1, 4, 5))] * 2
    expected = tg.gather(outs, "cpu", layout)  # (no sizes: nothing checked)
    got = tg.gather(outs, "cpu", layout, sizes=[4, 4])
    assert [type(v) for v in got] == [type(v) for v in expected]


@pytest.mark.parametrize(
    "sizes, shapes",
    [
        ([1, 1], [(3, 1), (3, 1)]),  # one row each: every size-1 dim holds it
        ([4], [(3, 4)]),  # one replica
        ([4, 4], [(4, 4), (4, 4)]),  # the gather dim holds the rows too
        ([4, 4], [(4, 2), (3, 4)]),  # a replica holds them along dim 0
        ([4, 4], [(4,), (4,)]),
        ([4, 4], [(2,), (3,)]),  # no other dim
        ([4, 4], [(), ()]),  # 0-dim: stacked
        ([4, 4], [(2, 3), (2, 3)]),  # no dim holds them
        ([4, 4], [(2, 4), (2, 3)]),  # not on every replica
    ],
)
def test_shapes_that_decide_nothing_are_gathered(sizes: list[int], shapes: list[tuple]) -> None:
    outs = [{"t": torch.zeros(s), "n": torch.zeros(s, dtype=torch.long)} for s in shapes]
    for ref in (False, True):
        with reference_only() if ref else _nothing():
            try:
                tg.gather(outs, "cpu", sizes=sizes)
            except tg.ShapeMismatchError as exc:  # (uneven shapes: refused, but not as rows)
                assert "its rows are along" not in str(exc)


def test_the_call_dim_is_the_one_checked() -> None:
    outs = [{"x": torch.zeros(2, 3), "y": torch.zeros(3, 2)}] * 2  # y: 3 rows along dim 0
    with pytest.raises(tg.ShapeMismatchError) as caught:
        tg.gather(outs, "cpu", dim=1, sizes=[3, 3])
    text = str(caught.value)
    assert "outputs['y']: its rows are along dim 0, not dim 1" in text
    assert "default rule cat(dim=1)" in text and "tg.by_path({'y': tg.cat(0)})" in text
    assert "outputs['x']" not in text  # (3 rows along dim 1: where the default joins them)


def test_the_root_gets_the_rule_alone() -> None:
    with pytest.raises(
        tg.ShapeMismatchError,
        match=r"(?s)outputs: its rows .*patch\): tg\.cat\(1\) \(the rule of the whole",
    ):
        tg.gather([torch.zeros(2, 3)] * 2, "cpu", sizes=[3, 3])


def test_the_rows_are_said_before_another_problem() -> None:
    """Checked before anything is combined: the rows are said first (the dtypes that differ
    elsewhere are the combine's error once the layout says where the rows are)."""
    outs = [
        {"h": torch.zeros(1, 4, 5), "s": torch.zeros(2, dtype=d)}
        for d in (torch.int64, torch.float32)
    ]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['h'\]: its rows are along dim 1"):
        tg.gather(outs, "cpu", sizes=[4, 4])
    with pytest.raises(
        tg.ShapeMismatchError, match=r"outputs\['s'\]: cat\(dim=0\) needs one dtype"
    ):
        tg.gather(outs, "cpu", tg.by_path({"h": tg.cat(1)}), sizes=[4, 4])


# -------------------------------------------------------------------------------- a list


def _detections(x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One dict per image, as a detection model gives in eval (the counts vary)."""
    out = []
    for image in x:
        n = int(image.abs().sum().item() * 10) % 3 + 1
        out.append({"boxes": image[:4].repeat(n, 1), "labels": torch.arange(n)})
    return out


@pytest.mark.parametrize("rows", [4, 5], ids=["even", "uneven"])
def test_a_list_of_one_item_per_sample_is_refused_naming_cat_items(rows: int) -> None:
    x = torch.randn(rows, 6)
    with pytest.raises(tg.StructureMismatchError) as caught:
        tg.data_parallel(_detections, x, CPU2)
    text = str(caught.value)
    shards = [2, 2] if rows == 4 else [3, 2]
    assert "outputs: " in text and f"{shards}" in text and "cat_items()" in text
    assert "tg.cat_items()" in text
    got = tg.data_parallel(_detections, x, CPU2, out_layout=tg.cat_items())
    expected = _detections(x)
    assert len(got) == rows
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_list_inside_the_output_is_named_by_its_path() -> None:
    outs = [{"dets": [{"s": torch.zeros(r)} for r in (1, 3)], "x": torch.zeros(2, 5)}] * 2
    with pytest.raises(tg.StructureMismatchError) as caught:
        tg.gather(outs, "cpu", sizes=[2, 2])
    text = str(caught.value)
    assert "outputs['dets']: a list of one item per sample" in text
    assert "tg.by_path({'dets': tg.cat_items()})" in text
    assert tg.gather(outs, "cpu", {"dets": tg.cat_items(), "x": None}, sizes=[2, 2])["dets"]


@pytest.mark.parametrize(
    "items",
    [
        [torch.zeros(2, 3), torch.zeros(2, 5)],  # two heads' outputs: batched
        [torch.zeros(2, 3), torch.zeros(())],  # (a feature and a loss: two structures)
        [torch.zeros(2, 3), torch.zeros(2, 3, 1)],  # (dims that differ: two structures)
        [{"b": torch.zeros(2, 4)}, {"b": torch.zeros(2, 4)}],  # (one image's two boxes each:
        # the shapes of a list of two batched tensors, which cannot be told apart)
    ],
    ids=["heads", "feature and loss", "other dims", "boxes like a batch"],
)
def test_a_list_holding_batched_tensors_is_gathered_item_by_item(items: list[Any]) -> None:
    outs = [items, items]
    got = tg.gather(outs, "cpu", sizes=[2, 2])
    assert len(got) == 2


@pytest.mark.parametrize(
    "items",
    [("a", "b"), [torch.zeros(2, 3), "x"], [[1], [2, 3, 4]], ["a"]],
    ids=["tuple", "two structures", "items of two structures", "one item"],
)
def test_what_is_not_a_list_of_samples_is_gathered(items: Any) -> None:
    tg.gather([items, items], "cpu", sizes=[2, 2])


@pytest.mark.parametrize(
    "items",
    [["a", "b"], [0.5, 0.3], [torch.tensor(0.5), torch.tensor(0.3)], [None, None]],
    ids=["strings", "numbers", "0-dim tensors", "nothing"],
)
def test_a_list_without_tensors_of_dims_is_gathered_item_by_item(items: list[Any]) -> None:
    """Per-sample strings or scalars have the shapes of two names or two loss terms: nothing
    says which, so the default rules apply (cat_items() in the layout says per sample)."""
    got = tg.gather([items, items], "cpu", sizes=[2, 2])
    assert len(got) == 2
    assert tg.gather([items, items], "cpu", tg.cat_items(), sizes=[2, 2]) == items + items


def test_one_item_of_the_shards_rows_on_every_replica_is_not_a_batch() -> None:
    """Item 1 holds two boxes on both replicas of two rows, item 0 one: a batched leaf is one
    that holds the rows in every item."""
    outs = [[{"b": torch.zeros(1, 4)}, {"b": torch.zeros(2, 4)}]] * 2
    with pytest.raises(tg.StructureMismatchError, match=r"outputs: a list of one item per sample"):
        tg.gather(outs, "cpu", sizes=[2, 2])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
