"""Values laid out by rows (a ``PackedSequence``, a dim-0 ``LazyStackedTensorDict``, a
``NonTensorStack``, a PyG graph batch) in layouts (issue 47, point 5): ``cat()`` joins and
``split()`` splits them by their rows, as the default rules do, so that a prefix layout can say
"by rows"; every other rule is refused with a typed error naming the path and the value's kind,
never treegather's internal ``Rows``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only
from treegather._tree import flatten, rows_of

CPU2 = ["cpu"] * 2


def _packed(x: torch.Tensor) -> PackedSequence:
    return pack_sequence([row[: 1 + i % 3] for i, row in enumerate(x)], enforce_sorted=False)


def _lazy(x: torch.Tensor) -> LazyStackedTensorDict:
    return LazyStackedTensorDict.lazy_stack([TensorDict({"a": row}, []) for row in x], 0)


def _graphs(x: torch.Tensor) -> Any:
    """A PyG graph batch of one graph per row (``1 + i % 3`` nodes of its features)."""
    with warnings.catch_warnings():  # (PyG 2.8 scripts helpers at import: torch deprecates it)
        warnings.simplefilter("ignore", DeprecationWarning)
        pyg = pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
    graphs = [
        pyg.data.Data(x=row.expand(1 + i % 3, -1), edge_index=torch.zeros(2, 0, dtype=torch.long))
        for i, row in enumerate(x)
    ]
    return pyg.data.Batch.from_data_list(graphs)


def _names(x: torch.Tensor) -> NonTensorStack:
    return NonTensorStack.from_list([f"row{float(row[0]):.3f}" for row in x])


KINDS = {
    "PackedSequence": _packed,
    "LazyStackedTensorDict": _lazy,
    "NonTensorStack": _names,
    "graph batch": _graphs,
}


def test_the_kinds_are_every_kind_laid_out_by_rows() -> None:
    """Every kind the library registers (a new one fails here until it has a case)."""
    x = torch.randn(6, 4)
    for make in KINDS.values():
        leaves, _ = flatten(make(x))
        assert any(rows_of(v) is not None for v in leaves)
    from treegather._tree import batch

    assert set(batch._KINDS) <= set(KINDS)


def _rows(v: Any) -> int:
    return int(v.batch_sizes[0]) if isinstance(v, PackedSequence) else len(v)


def _same(a: Any, b: Any) -> bool:
    if hasattr(a, "num_graphs"):  # (a graph batch)
        return bool(a.num_graphs == b.num_graphs and torch.equal(a.x, b.x))
    if isinstance(a, PackedSequence):
        return all(torch.equal(u, v) for u, v in zip(unpack_sequence(a), unpack_sequence(b)))
    if isinstance(a, NonTensorStack):
        return isinstance(b, NonTensorStack) and a.tolist() == b.tolist()
    return bool((a == b).all())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("ref", [False, True], ids=["fast", "definition"])
def test_cat_and_split_mean_by_rows(kind: str, ref: bool) -> None:
    make = KINDS[kind]
    x = torch.randn(5, 4)
    with reference_only() if ref else _nothing():
        for layout in (tg.split(), {"v": tg.split(0), "x": None}, tg.by_path({"v": 0})):
            got = tg.scatter({"v": make(x), "x": x}, CPU2, layout)
            want = tg.scatter({"v": make(x), "x": x}, CPU2)
            assert got.sizes == want.sizes == (3, 2)
            assert all(_same(g["v"], w["v"]) for g, w in zip(got, want, strict=True))
        sized = tg.scatter({"v": make(x), "x": x}, CPU2, tg.split(sizes=[1, 4]))
        assert sized.sizes == (1, 4) and [_rows(s["v"]) for s in sized] == [1, 4]
        assert _same(tg.gather(list(sized), "cpu", sizes=sized.sizes)["v"], make(x))
        parts = [{"v": make(s)} for s in x.split(3)]
        for layout in (tg.cat(), {"v": tg.cat()}, tg.by_path({"v": 0})):
            assert _same(tg.gather(parts, "cpu", layout, sizes=[3, 2])["v"], make(x))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "rule, says",
    [
        (tg.cat(1), "joins a {} only by its rows, along dim 0: write cat()"),
        (tg.cat(-1), "joins a {} only by its rows"),
        (tg.stack(), "stack() does not apply to a {}"),
        (tg.mean(), "mean() does not apply to a {}"),
        (tg.sum(), "sum() does not apply to a {}"),
        (tg.pad(), "pad() does not apply to a {}"),
    ],
)
def test_other_rules_are_refused_by_the_kinds_name(kind: str, rule: Any, says: str) -> None:
    make = KINDS[kind]
    parts = [{"v": make(s)} for s in torch.randn(5, 4).split(3)]
    name = kind  # (the kind's name)
    for ref in (False, True):
        with reference_only() if ref else _nothing():
            with pytest.raises(tg.LeafTypeError) as caught:
                tg.gather(parts, "cpu", {"v": rule})
        text = str(caught.value)
        assert text.startswith("outputs['v']") and says.format(name) in text
        assert not re.search(r"\bRows\b", text)
    explained = tg.explain(parts[0], {"v": rule}, CPU2, "gather")
    assert explained[0].problem and says.format(name) in explained[0].problem
    assert not re.search(r"\bRows\b", str(explained))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_split_along_another_dim_is_refused_by_the_kinds_name(kind: str) -> None:
    with pytest.raises(tg.LeafTypeError) as caught:
        tg.scatter({"v": KINDS[kind](torch.randn(4, 4))}, CPU2, tg.split(1))
    text = str(caught.value)
    assert "split(dim=1) splits a" in text and "only by its rows" in text
    assert not re.search(r"\bRows\b", text)
    assert not re.search(
        r"\bRows\b", str(tg.explain({"v": KINDS[kind](torch.randn(4, 4))}, None, CPU2))
    )


def test_the_collector_puts_a_packed_sequence_in_order_under_cat_as_by_default() -> None:
    # (it was refused, under cat() as under the default: the Collector now puts its rows in
    # dataset order, and cat() means "by rows" there too)
    seqs = [torch.ones(2), torch.ones(1), torch.ones(3)]
    got = []
    for layout in ({"p": tg.cat()}, None):
        col = tgd.Collector()
        col.add({"p": pack_sequence([seqs[2], seqs[0]], enforce_sorted=False)}, indices=[2, 0])
        col.add({"p": pack_sequence([seqs[1]])}, indices=[1])
        got.append(col.all_gather(layout)["p"])
    want = pack_sequence(seqs, enforce_sorted=False)
    assert all(_same(g, want) for g in got)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
