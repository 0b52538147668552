"""treegather.distributed across real processes: 2 and 3 gloo ranks on localhost.

Each world size is one spawned group, shared with the other distributed test modules
(:mod:`spawned_groups`), whose ranks run every check in a row, including the error cases (which
must leave the group in step for the checks after them), once with the cached wire plan and
once with the full exchange only, and report their results through a file per rank; the tests
below only compare those results with the single-process :func:`treegather.gather` of the same
per-rank trees. Every group runs under a hard deadline and its processes are joined, terminated
or killed before the fixture returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import spawned_groups
import torch
import torch.distributed as dist
from corpus import FILLS_THAT_DO_NOT_FIT, FOREIGN
from spawned_groups import WORLD_SIZES

import treegather as tg
from treegather import _tree
from treegather._caches import FAST_PATHS, reference_only
from treegather._errors import safe_repr
from treegather.distributed.exchange import MAX_INLINE

pytestmark = pytest.mark.distributed

GROUP_DEADLINE_S = 60.0  # the checks of one group, both paths; a torchrun example

# ------------------------------------------------------------------------------------ corpus


@tg.register_dataclass
@dataclasses.dataclass
class Metrics:
    """A registered dataclass leaf container."""

    loss: torch.Tensor
    count: int
    tag: str


def _ragged(r: int) -> Any:
    g = torch.Generator().manual_seed(100 + r)
    return {"logits": torch.randn(r + 1, 3, generator=g), "ids": torch.arange(r + 1) + 10 * r}


def _metrics(r: int) -> Any:
    return {"loss": torch.tensor(1.0 + r), "acc": torch.tensor(0.25 * r, dtype=torch.float64)}


def _dataclass(r: int) -> Any:
    return Metrics(loss=torch.full((r + 1,), float(r)), count=r + 1, tag=f"t{r}")


def _strings(r: int) -> Any:
    return {"names": [f"sample-{r}-{i}" for i in range(2)], "split": "val", "extra": None}


def _mixed_dtypes(r: int) -> Any:
    rows = r + 1
    return {
        "f32": torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) / 3,
        "i64": torch.arange(rows) * (r + 7),
        "bool": torch.arange(rows) % 2 == r % 2,
        "bf16": (torch.arange(rows * 2).view(rows, 2) / 7).to(torch.bfloat16),
        "f16": torch.full((rows,), 0.1 * r, dtype=torch.float16),
        "u8": torch.full((rows, 3), r, dtype=torch.uint8),
        "c64": torch.full((rows,), complex(r, 1), dtype=torch.complex64),
    }


def _empty(r: int) -> Any:
    return {
        "rows": torch.ones(r, 4),  # rank 0 has no rows
        "none": torch.empty(0, dtype=torch.int64),
        "bool": torch.zeros(0, 2, dtype=torch.bool),
        "bf16": torch.zeros(0, dtype=torch.bfloat16),
        "nested": {"also_empty": {}, "tuple": ()},
    }


def _no_leaves(r: int) -> Any:
    return {"a": {}, "b": [], "c": None}


def _bare_tensor(r: int) -> Any:
    return torch.arange(3) * r


def _nested(r: int) -> Any:
    return {
        "a": [(torch.ones(r + 1, 2), "x"), {"b": torch.zeros(r + 2, dtype=torch.int32)}],
        "c": 3,
    }


def _same_shapes(r: int) -> Any:
    return {"h": torch.full((2, 3), float(r)), "cfg": {"lr": 0.1, "name": "run"}}


def _padded(r: int) -> Any:
    return {"tokens": torch.arange((r + 1) * (r + 2)).view(r + 1, r + 2)}


def _per_sample(r: int) -> Any:
    """Per-sample lists whose length differs by rank: taken whole by cat_items()/as_list()."""
    return {
        "ids": [f"id{r}-{i}" for i in range(r + 1)],
        "tokens": [torch.arange(i + 1) + 10 * r for i in range(r + 2)],
        "spans": {"rank": r, "pairs": [(i, torch.tensor([i, i + 1])) for i in range(r)]},
        "x": torch.full((r + 1, 2), float(r)),
    }


def _count_items(values: list[Any], device: torch.device) -> Any:
    """A custom rule on an inner node: the per-rank subtrees whole."""
    return [len(v["pairs"]) for v in values]


def _lengths(values: list[Any], device: torch.device) -> Any:
    """A custom gather rule: the per-rank number of rows."""
    return torch.tensor([v.shape[0] for v in values], device=device)


def _conj_views(r: int) -> Any:
    """Conjugate and negative views (lazy bits a byte view cannot carry): their values travel."""
    z = torch.arange(2 * (r + 1), dtype=torch.float32).view(r + 1, 2) + 1j * (r + 1)
    w = z.clone()  # the negative view must not share storage with a complex leaf (torch.save)
    return {"conj": z.conj(), "neg": w.conj().imag, "plain": z}


def _key_order(r: int) -> Any:
    """Dict keys inserted in another order on odd ranks: every rank gets rank 0's order."""
    items = [("b", torch.full((r + 1,), float(r))), ("a", f"r{r}"), ("c", {"y": 1, "x": 2})]
    if r % 2:
        items.reverse()
        items[0] = ("c", {"x": 2, "y": 1})
    return dict(items)


def _half_loss(r: int) -> Any:
    """A float16 loss per rank of 4096 rows: loss x rows overflows float16."""
    return {"loss": torch.tensor(100.0 + r, dtype=torch.float16)}


def _empty_rank(r: int) -> Any:
    """Rank 0 has no rows: its loss is torch's mean of an empty batch (NaN)."""
    return {"loss": torch.ones(0 if r == 0 else 3).mean() * (r + 1)}


# name -> (tree maker, layout maker, sizes per rank or None)
CASES: dict[str, tuple[Callable[[int], Any], Callable[[], Any], Callable[[int], int] | None]] = {
    "ragged": (_ragged, lambda: None, None),
    "metrics_0dim": (_metrics, lambda: None, None),
    "metrics_mean": (_metrics, lambda: {"loss": tg.mean(), "acc": tg.sum()}, lambda r: r + 1),
    "dataclass": (_dataclass, lambda: None, None),
    "strings_none": (_strings, lambda: None, None),
    "mixed_dtypes": (_mixed_dtypes, lambda: None, None),
    "empty": (_empty, lambda: None, None),
    "no_leaves": (_no_leaves, lambda: None, None),
    "bare_tensor": (_bare_tensor, lambda: None, None),
    "nested": (_nested, lambda: None, None),
    "stack_first": (_same_shapes, lambda: {"h": tg.stack(), "cfg": tg.first()}, None),
    "as_list": (_same_shapes, lambda: tg.as_list(), None),
    "pad": (_padded, lambda: {"tokens": tg.pad(0, fill=-1, lengths=True)}, None),
    "per_sample_lists": (
        _per_sample,
        lambda: {"ids": tg.cat_items(), "tokens": tg.cat_items(), "spans": _count_items, "x": 0},
        None,
    ),
    "per_sample_as_list": (
        _per_sample,
        lambda: tg.by_path({"ids": "as_list", "tokens": "as_list", "spans": "as_list"}),
        None,
    ),
    "by_path_custom": (
        _ragged,
        lambda: tg.by_path({"logits": tg.as_list(), "ids": _lengths}),
        None,
    ),
    "conj_views": (_conj_views, lambda: None, None),
    "large_leaves": (  # a few hundred KiB per leaf: each result leaf gets its own storage
        lambda r: {"w": torch.full((r + 300, 256), float(r)), "b": torch.arange(r + 300)},
        lambda: None,
        None,
    ),
    "key_order": (_key_order, lambda: None, None),
    "mean_float16": (_half_loss, lambda: {"loss": tg.mean()}, lambda r: 4096),
    "mean_empty_rank": (_empty_rank, lambda: {"loss": tg.mean()}, lambda r: 0 if r == 0 else 3),
}
OPS = ("all_gather", "gather", "broadcast")


def _dst(world: int) -> int:
    return world - 1


def _src(world: int) -> int:
    return min(1, world - 1)


def _run_op(op: str, name: str, rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    make, layout, sizes = CASES[name]
    size = sizes(rank) if sizes else None
    if op == "all_gather":
        return tgd.all_gather(make(rank), layout(), sizes=size)
    if op == "gather":
        return tgd.gather(make(rank), _dst(world), layout(), sizes=size)
    return tgd.broadcast(make(rank) if rank == _src(world) else None, src=_src(world))


def _expected(op: str, name: str, rank: int, world: int) -> Any:
    make, layout, sizes = CASES[name]
    if op == "broadcast":
        return make(_src(world))
    if op == "gather" and rank != _dst(world):
        return None
    trees = [make(r) for r in range(world)]
    return tg.gather(
        trees, "cpu", layout(), sizes=[sizes(r) for r in range(world)] if sizes else None
    )


# --------------------------------------------------------------------------- error scenarios


def _unpicklable(r: int) -> Any:
    return {"x": torch.ones(1), "f": (lambda: r) if r == 1 else "ok"}


ERRORS: dict[str, Callable[[int, int], Any]] = {}


def _error(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    ERRORS[fn.__name__] = fn
    return fn


@_error
def missing_key(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    tree = {"a": torch.ones(rank + 1), "b": torch.ones(1)}
    if rank == 1:
        del tree["b"]
    return tgd.all_gather(tree)


@_error
def list_vs_tuple(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    seq = [torch.ones(1), torch.ones(2)]
    return tgd.gather({"out": {"pair": tuple(seq) if rank == world - 1 else seq}}, dst=0)


@_error
def tensor_vs_string(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather({"x": "n/a" if rank == 1 else torch.ones(1)})


@_error
def dtype(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather(
        {"scores": torch.ones(2, dtype=torch.int64 if rank == 1 else torch.float32)}
    )


@_error
def non_cat_dim_all_gather(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather({"emb": torch.ones(2, 3 + (rank == 1))})


@_error
def non_cat_dim_gather(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather({"emb": torch.ones(2, 3 + (rank == 1))}, dst=0)


@_error
def stack_shapes_gather(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather({"h": torch.ones(rank + 1)}, dst=world - 1, layout={"h": tg.stack()})


@_error
def unpicklable_leaf(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather(_unpicklable(rank))


@_error
def sizes_on_some_ranks(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather(
        {"loss": torch.tensor(1.0)}, {"loss": tg.mean()}, sizes=None if rank else 4
    )


@_error
def bad_sizes(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather(
        {"loss": torch.tensor(1.0)}, 0, {"loss": tg.mean()}, sizes=2.5 if rank == 1 else 2
    )


@_error
def dst_disagrees(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather({"x": torch.ones(1)}, dst=0 if rank == 0 else 1)


@_error
def different_calls(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    if rank == 0:
        return tgd.gather({"x": torch.ones(1)}, dst=0)
    return tgd.all_gather({"x": torch.ones(1)})


def _bad_rank_waits(rank: int, world: int, bad: int, call: Callable[[], Any]) -> Any:
    """Run ``call`` (whose arguments are bad on rank ``bad``); rank ``bad`` then makes no other
    collective until every other rank is done with its call, as a rank that raised and went on
    with other work would: the others must not wait for it (they used to, until the process
    group's timeout)."""

    store = dist.distributed_c10d._get_default_store()
    key = f"{call.__qualname__}:{FAST_PATHS.on}:done"
    try:
        return call()
    finally:
        if rank == bad:
            store.wait([f"{key}:{r}" for r in range(world) if r != bad], timedelta(seconds=45))
        else:
            store.set(f"{key}:{rank}", "1")


@_error
def bad_dst_on_one_rank(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    def call() -> Any:
        return tgd.gather({"x": torch.ones(rank + 1)}, dst=world if rank == 1 else 0)

    return _bad_rank_waits(rank, world, 1, call)


@_error
def dst_of_the_wrong_type_on_one_rank(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather({"x": torch.ones(1)}, "0" if rank == world - 1 else 0, sizes=1)


@_error
def bad_dst_on_every_rank(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.gather({"x": torch.ones(1)}, dst=-1)


@_error
def bool_dim_on_every_rank(rank: int, world: int) -> Any:
    """dim=True on every rank: dst found it after the gather, and the other ranks got its error
    rebuilt as another class."""
    import treegather.distributed as tgd

    return tgd.gather({"x": torch.ones(1)}, world - 1, dim=True)


@_error
def bad_src_on_one_rank(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    def call() -> Any:
        return tgd.broadcast({"x": torch.ones(1)} if rank == 0 else None, src=0 if rank else -5)

    return _bad_rank_waits(rank, world, 0, call)


@_error
def broadcast_unpicklable(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.broadcast(_unpicklable(rank) if rank == 1 else None, src=1)


@_error
def src_disagrees(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.broadcast({"x": torch.ones(1)}, src=0 if rank == world - 1 else 1)


@_error
def mismatch_beside_whole_nodes(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    tree = {"ids": [f"id{i}" for i in range(rank + 1)], "x": torch.ones(1)}
    if rank == 1:
        tree["y"] = torch.ones(1)
    return tgd.all_gather(tree, tg.by_path({"ids": tg.cat_items()}, default=tg.cat()))


@_error
def layout_error(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather({"x": torch.ones(1)}, tg.by_path({"nope": tg.cat()}))


@_error
def different_layouts(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    layout = {"h": tg.stack()} if rank == 1 else {"h": tg.cat()}
    return tgd.all_gather({"h": torch.ones(2, 3)}, layout)


@_error
def mean_vs_first(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    layout = {"loss": tg.first()} if rank == 1 else {"loss": tg.mean()}
    return tgd.gather({"loss": torch.tensor(1.0)}, 0, layout, sizes=2)


@_error
def different_dims(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather({"h": torch.ones(2, 2)}, dim=1 if rank == 1 else 0)


@_error
def changed_structure_after_fast_calls(rank: int, world: int) -> Any:
    """Two calls with one structure (the cached plan), then rank 1 adds a key."""
    import treegather.distributed as tgd

    for step in range(2):
        tgd.all_gather({"a": torch.ones(rank + step + 1, 2)})
    tree = {"a": torch.ones(rank + 1, 2)}
    if rank == 1:
        tree["extra"] = torch.zeros(1)
    return tgd.all_gather(tree)


@_error
def pad_fill_overflow(rank: int, world: int) -> Any:
    """A fill float16 cannot hold (torch's bare overflow error once): the rule's own error."""
    import treegather.distributed as tgd

    tree = {"h": torch.ones(1, 2 + rank, dtype=torch.float16)}
    return tgd.all_gather(tree, {"h": tg.pad(1, fill=70000.0)})


# ------------------------------------------------------------------------ collective counting

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_gather_coalesced",
    "_all_gather_base",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "reduce",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def _counting() -> Iterator[list[str]]:
    """Count the collectives that reach the backend (innermost torch.distributed calls).

    Both ``torch.distributed.X`` and ``distributed_c10d.X`` are wrapped, so calls that torch
    makes internally (``all_gather_object`` issues two ``all_gather``) are seen too; a call is
    counted only when it issued no nested collective, i.e. once per backend operation.
    """
    c10d = dist.distributed_c10d
    calls: list[str] = []
    stack: list[list[bool]] = []
    saved: list[tuple[Any, str, Any]] = []

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if stack:
                stack[-1][0] = True
            stack.append([False])
            try:
                return fn(*args, **kwargs)
            finally:
                nested = stack.pop()[0]
                if not nested:
                    calls.append(name)

        return counted

    for module in (dist, c10d):
        for name in _COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is not None:
                saved.append((module, name, fn))
                setattr(module, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _big_tree(rank: int) -> Any:
    """1000 leaves of two dtypes (float32 and int64), ragged first dims."""
    return {
        f"layer{j}": {
            f"t{i}": torch.ones(rank + 1 + i % 3, 4) if i % 2 else torch.arange(rank + 1 + i % 3)
            for i in range(10 * j, 10 * j + 10)
        }
        for j in range(100)
    }


def _count_calls(rank: int, world: int) -> dict[str, Any]:
    import treegather.distributed as tgd

    tree = _big_tree(rank)
    leaves, _ = _tree.flatten(tree)
    assert len(leaves) == 1000 and {x.dtype for x in leaves} == {torch.float32, torch.int64}
    counts: dict[str, Any] = {}
    for op, call in (
        ("all_gather", lambda: tgd.all_gather(tree)),  # larger than anything before it
        ("all_gather_again", lambda: tgd.all_gather(tree)),
        ("gather", lambda: tgd.gather(tree, dst=0)),
        ("broadcast", lambda: tgd.broadcast(tree, src=0)),
    ):
        with _counting() as calls:
            out = call()
        counts[op] = list(calls)
        if op == "all_gather":
            counts["all_gather_rows"] = int(out["layer0"]["t1"].shape[0])
    return counts


class Unprintable:
    """A picklable leaf whose ``repr`` raises: nothing may format it (optree's errors do)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        raise RuntimeError("repr not available")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unprintable) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def _rows_tree(rank: int, step: int) -> Any:
    """_big_tree's structure (1000 leaves, two dtypes) with rows that change every call."""
    return {
        f"layer{j}": {
            f"t{i}": torch.full((rank + step + i % 3, 4), float(i + rank))
            if i % 2
            else torch.arange(rank + 1 + (i + step) % 3)
            for i in range(10 * j, 10 * j + 10)
        }
        for j in range(100)
    }


# Rows of 1 KiB (256 float32) that make a leaf larger than any inline payload.
WIDE_ROWS = MAX_INLINE // 1024 + 20


def _wide(rank: int, step: int = 0) -> Any:
    """One float32 leaf of over MAX_INLINE bytes per rank: larger than any inline payload."""
    return {
        "x": torch.full((rank + WIDE_ROWS, 256), float(rank + step)),
        "n": torch.arange(rank + 1),
    }


def _alternating(rank: int, world: int) -> bool:
    """Alternating structures holding leaves whose repr raises, strings and None."""
    import treegather.distributed as tgd

    for step in range(4):
        a = {"x": torch.ones(rank + 1), "u": Unprintable(rank), "s": "str", "n": None}
        b = {"y": [torch.zeros(2, 2), Unprintable(rank + step)], "z": (torch.tensor(1.5),)}
        got = tgd.all_gather(a if step % 2 else b)
        if step % 2:
            assert got["u"] == [Unprintable(r) for r in range(world)]
            assert torch.equal(got["x"], torch.ones(sum(r + 1 for r in range(world))))
            assert got["s"] == ["str"] * world and got["n"] is None
        else:
            assert got["y"][1] == [Unprintable(r + step) for r in range(world)]
            assert got["y"][0].shape == (2 * world, 2)
            assert torch.equal(got["z"][0], torch.full((world,), 1.5))
    return True


@contextlib.contextmanager
def _counting_full() -> Iterator[list[str]]:
    """Count the calls whose headers travel (the ranks' plans differ: the full exchange)."""
    import treegather.distributed as tgd

    full: list[str] = []
    real = tgd.exchange._with_headers

    def counted(*args: Any, **kwargs: Any) -> Any:
        full.append("full")
        return real(*args, **kwargs)

    tgd.exchange._with_headers = counted
    try:
        yield full
    finally:
        tgd.exchange._with_headers = real


def _fast_path_checks(rank: int, world: int) -> dict[str, Any]:
    """Count collectives and full exchanges on repeated, changed and alternating structures."""
    import treegather.distributed as tgd

    report: dict[str, Any] = {}
    with _counting_full() as full:
        tgd.all_gather(_rows_tree(rank, 2))  # the largest rows below: the capacity holds them
        for step in range(3):  # a repeated structure whose rows vary per call
            with _counting() as calls:
                got = tgd.all_gather(_rows_tree(rank, step))
            expected = tg.gather([_rows_tree(r, step) for r in range(world)], "cpu")
            assert_tree_equal(got, expected)
            report[("repeated", step)] = (list(calls), len(full))
        for step in (6, 6):  # rows that outgrow the capacity: payload apart once, then inline
            with _counting() as calls:
                got = tgd.all_gather(_rows_tree(rank, step))
            assert_tree_equal(got, tg.gather([_rows_tree(r, step) for r in range(world)], "cpu"))
            report.setdefault("grown", []).append((list(calls), len(full)))
        kept = []
        for step in range(2):  # above the largest inline payload: always a second collective
            with _counting() as calls:
                got = tgd.all_gather(_wide(rank, step))
            kept.append(got)
            report.setdefault("wide", []).append((list(calls), len(full)))
        for step, got in enumerate(kept):  # the group reuses its receive buffer: no aliasing
            assert_tree_equal(got, tg.gather([_wide(r, step) for r in range(world)], "cpu"))
        with _counting() as calls:  # gather: the payloads ride with the rows, then the outcome
            got = tgd.gather(_rows_tree(rank, 1), dst=world - 1)
        expected = tg.gather([_rows_tree(r, 1) for r in range(world)], "cpu")
        assert_tree_equal(got, expected if rank == world - 1 else None)
        report["gather"] = (list(calls), len(full))
        # One rank passes its keys in another order: every rank falls back, same result.
        with _counting() as calls:
            got = tgd.all_gather(_key_order(rank))
        report["fallback"] = (list(calls), len(full), list(got), list(got["c"]))
        assert_tree_equal(got, tg.gather([_key_order(r) for r in range(world)], "cpu"))
        _alternating(rank, world)
        report["alternating_full"] = len(full)
    return report


def _counts_tree(rank: int, change: str = "") -> Any:
    """Leaves in four regions; ``change`` reshapes some of them, mostly keeping element counts."""
    tree = {
        "a": torch.full((rank + 2, 4), float(rank)),
        "b": torch.arange(12.0).view(3, 4) + rank,
        "c": torch.arange(6) + rank,
        "d": torch.tensor(float(rank)),
        "e": torch.full((rank + 1, 2), -1.0),
    }
    if change == "b":  # a later leaf of a's region: only packing can tell
        tree["b"] = tree["b"].view(4, 3)
    elif change == "ab":  # the region's first leaf too
        tree["a"] = tree["a"].view(-1, 2)
        tree["b"] = tree["b"].view(6, 2)
    elif change == "c":
        tree["c"] = tree["c"].view(2, 3)
    elif change == "d":
        tree["d"] = tree["d"].view(1)
    elif change == "c32":
        tree["c"] = tree["c"].to(torch.int32)
    elif change == "e0":
        tree["e"] = torch.zeros(0, 2)
    elif change == "e0_1d":
        tree["e"] = torch.zeros(0)
    return tree


def _wide_pair(rank: int, change: bool) -> Any:
    """Two leaves of one region, larger than any inline payload; ``change`` reshapes the
    second one with the same element count."""
    y = torch.arange(WIDE_ROWS * 256.0).view(WIDE_ROWS, 256) + rank
    x = torch.full((rank + WIDE_ROWS, 256), float(rank))
    return {"x": x, "y": y.view(2 * WIDE_ROWS, 128) if change else y}


def _same_counts_checks(rank: int, world: int) -> list[tuple[str, int]]:
    """Calls whose leaves keep their element counts but change shape: each result must equal
    the single-process gather's; returns the full exchanges after each step (fast path only)."""
    import treegather.distributed as tgd

    report = []
    with _counting_full() as full:
        steps = ["", "", "", "b", "b", "ab", "ab", "c", "d", "c32", "", "e0", "e0", "e0_1d"]
        for step, change in enumerate(steps):
            got = tgd.all_gather(_counts_tree(rank, change))
            assert_tree_equal(
                got, tg.gather([_counts_tree(r, change) for r in range(world)], "cpu")
            )
            report.append((f"{step}:{change}", len(full)))
        for step, change in enumerate(["b", "", "b", "", "b", ""]):  # alternating, same counts
            got = tgd.all_gather(_counts_tree(rank, change))
            assert_tree_equal(
                got, tg.gather([_counts_tree(r, change) for r in range(world)], "cpu")
            )
            report.append((f"alternating{step}:{change}", len(full)))
        for change in (False, False, False, True, True):  # packed after the ranks agreed
            got = tgd.all_gather(_wide_pair(rank, change))
            assert_tree_equal(got, tg.gather([_wide_pair(r, change) for r in range(world)], "cpu"))
            report.append((f"wide:{change}", len(full)))
    return report


def _dim1(rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    return tgd.all_gather({"h": torch.full((2, rank + 1), float(rank))}, dim=1)


def _cleared_on_one_rank(rank: int, world: int) -> tuple[list[str], int, int]:
    """clear_caches() on rank 0 only, between two wire-plan calls of one structure."""
    import treegather.distributed as tgd

    tree = _rows_tree(rank, 1)
    tgd.all_gather(tree)  # the plan is cached and the inline capacity holds its payload
    before = tgd.group.group(None).state.capacity
    if rank == 0:
        tg.clear_caches()
    with _counting() as calls:
        got = tgd.all_gather(tree)
    assert_tree_equal(got, tg.gather([_rows_tree(r, 1) for r in range(world)], "cpu"))
    return list(calls), before, tgd.group.group(None).state.capacity


def _subgroup(sub: Any, rank: int, world: int) -> Any:
    import treegather.distributed as tgd

    tree = _ragged(rank)
    return (
        tgd.all_gather(tree, group=sub),
        tgd.gather(tree, dst=world - 1, group=sub),
        tgd.broadcast(tree if rank == world - 1 else None, src=world - 1, group=sub),
    )


# -------------------------------------------------------------------------------- the worker


def _capture(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc), traceback.format_exc())


@spawned_groups.register("distributed.fast", budget_s=GROUP_DEADLINE_S / 2)
def _fast_checks(rank: int, world: int) -> dict[Any, Any]:
    return _checks(rank, world, fast=True)


# The same processes run everything twice (spawning a group costs more than its checks).
@spawned_groups.register("distributed.full", budget_s=GROUP_DEADLINE_S / 2)
def _full_checks(rank: int, world: int) -> dict[Any, Any]:
    return _checks(rank, world, fast=False)


def _checks(rank: int, world: int, fast: bool) -> dict[Any, Any]:
    """Every check of one group, with the cached wire plan (``fast``) or the full exchange only."""
    import treegather.distributed as tgd

    with contextlib.nullcontext() if fast else reference_only():
        return _checks_in_mode(rank, world, fast, tgd)


def _checks_in_mode(rank: int, world: int, fast: bool, tgd: Any) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for name in CASES:
        for op in OPS:
            results[(name, op)] = _capture(lambda: _run_op(op, name, rank, world))  # noqa: B023
    for name, fn in ERRORS.items():
        results[("error", name)] = _capture(lambda: fn(rank, world))  # noqa: B023
        # The group must still be in step after an error: one ordinary call.
        results[("after", name)] = _capture(lambda: _run_op("all_gather", "ragged", rank, world))
    results["count"] = _capture(lambda: _count_calls(rank, world))
    if fast:
        results["fast"] = _capture(lambda: _fast_path_checks(rank, world))
    results["dim1"] = _capture(lambda: _dim1(rank, world))
    results["same_counts"] = _capture(lambda: _same_counts_checks(rank, world))
    results["alternating"] = _capture(lambda: _alternating(rank, world))
    results["capacity"] = tgd.group.group(None).state.capacity
    sub = dist.new_group([0, world - 1])  # every rank creates it; the middle rank stays out
    if rank in (0, world - 1):
        results["subgroup"] = _capture(lambda: _subgroup(sub, rank, world))
    if fast:  # last: the caches of rank 0 differ from the others' after it
        results["cleared_on_one_rank"] = _capture(lambda: _cleared_on_one_rank(rank, world))
    return results


@pytest.fixture(
    scope="module",
    params=[(w, path) for w in WORLD_SIZES for path in ("fast", "full")],
    ids=lambda p: f"world{p[0]}-{p[1]}",
)
def group_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[Any, Any]]]:
    """Each world size's results with the cached wire plan, and with the full exchange only."""
    world, path = request.param
    results = spawned_groups.results(world, tmp_path_factory)
    return world, [{"lazy": res["lazy"], **res[f"distributed.{path}"]} for res in results]


# ------------------------------------------------------------------------------------- checks


def assert_tree_equal(actual: Any, expected: Any) -> None:
    la, sa = _tree.flatten(actual)
    le, se = _tree.flatten(expected)
    assert sa == se, f"structure {sa} != {se}"
    for x, y in zip(la, le):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor), (x, y)
            assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), (x, y)
            assert torch.equal(x, y), (x, y)
        else:
            assert type(x) is type(y) and x == y, (x, y)


def _ok(result: tuple[Any, ...]) -> Any:
    assert result[0] == "ok", result[3] if len(result) > 3 else result
    return result[1]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process_gather(group_results: Any, case: str, op: str) -> None:
    world, results = group_results
    for rank, res in enumerate(results):
        assert_tree_equal(_ok(res[(case, op)]), _expected(op, case, rank, world))


def test_weighted_means_neither_overflow_nor_count_empty_ranks(group_results: Any) -> None:
    """``mean()`` weighted by ``sizes`` across ranks: a float16 loss of ~100 on ranks of 4096
    rows is its mean, not inf; a rank of 0 rows (its loss NaN) takes no part, on every rank."""
    world, results = group_results
    expected = {
        "mean_float16": torch.tensor(sum(100.0 + r for r in range(world)) / world).half(),
        "mean_empty_rank": torch.tensor(sum(r + 1.0 for r in range(1, world)) / (world - 1)),
    }
    for rank, res in enumerate(results):
        for case, value in expected.items():
            assert_tree_equal(_ok(res[(case, "all_gather")]), {"loss": value})
            got = _ok(res[(case, "gather")])
            assert_tree_equal(got, {"loss": value} if rank == _dst(world) else None)


ERROR_EXPECTATIONS: dict[str, tuple[type[Exception], list[str]]] = {
    "missing_key": (tg.StructureMismatchError, ["outputs['b']", "rank 1"]),
    "list_vs_tuple": (tg.StructureMismatchError, ["outputs['out']['pair']", "list", "tuple"]),
    "tensor_vs_string": (
        tg.StructureMismatchError,
        ["outputs['x']", "str on rank 1", "Tensor(float32)"],
    ),
    # gather's own message (the rule's): one dtype message, in one process or across ranks
    "dtype": (
        tg.ShapeMismatchError,
        [
            "outputs['scores']: cat(dim=0) needs one dtype in every replica",
            "replica 0: torch.float32, replica 1: torch.int64",
            "(replica i above is rank i)",
        ],
    ),
    "non_cat_dim_all_gather": (tg.ShapeMismatchError, ["['emb']", "replica 1: [2, 4]", "rank"]),
    "non_cat_dim_gather": (tg.ShapeMismatchError, ["['emb']", "replica 1: [2, 4]", "rank"]),
    "stack_shapes_gather": (tg.ShapeMismatchError, ["['h']", "stack"]),
    "unpicklable_leaf": (tg.LeafTypeError, ["on rank 1", "outputs['f']", "picklable"]),
    "sizes_on_some_ranks": (tg.BatchSizeError, ["sizes=", "4 on rank 0", "None on rank"]),
    "bad_sizes": (tg.BatchSizeError, ["on rank 1", "sizes must be", "2.5"]),
    "dst_disagrees": (tg.StructureMismatchError, ["dst=0", "dst=1"]),
    "bad_dst_on_one_rank": (
        ValueError,
        ["every rank raises", "rank 1: treegather.distributed.gather: dst=", "is not a rank"],
    ),
    "dst_of_the_wrong_type_on_one_rank": (
        tg.ArgumentTypeError,
        ["treegather.distributed.gather: dst must be an int (a global rank), got str '0'"],
    ),
    "bad_dst_on_every_rank": (
        ValueError,
        ["rank 0: treegather.distributed.gather: dst=-1 is not a rank", "rank 1: ", "Hint"],
    ),
    "bool_dim_on_every_rank": (
        tg.ArgumentTypeError,
        ["rank 0: treegather.distributed.gather: dim must be an int", "got bool True", "rank 1"],
    ),
    "bad_src_on_one_rank": (
        ValueError,
        ["rank 0: treegather.distributed.broadcast: src=", "is not a rank of the process group"],
    ),
    "different_calls": (tg.StructureMismatchError, ["gather", "all_gather", "rank 0"]),
    "mismatch_beside_whole_nodes": (tg.StructureMismatchError, ["outputs['y']", "missing on rank"]),
    "layout_error": (tg.LayoutError, ["on ranks 0, 1", "nope"]),
    "broadcast_unpicklable": (tg.LeafTypeError, ["on rank 1", "outputs['f']", "picklable"]),
    "src_disagrees": (tg.StructureMismatchError, ["broadcast(..., src=0)", "src=1"]),
    "different_layouts": (
        tg.LayoutError,
        ["different layouts", "layout {'h': stack()}, dim=0 on rank 1", "{'h': cat()}", "Hint"],
    ),
    "mean_vs_first": (
        tg.LayoutError,
        ["layout {'loss': first()}, dim=0 on rank 1", "{'loss': mean()}, dim=0 on rank"],
    ),
    "different_dims": (tg.LayoutError, ["dim=1 on rank 1", "layout None, dim=0 on rank"]),
    "changed_structure_after_fast_calls": (
        tg.StructureMismatchError,
        ["outputs['extra']", "missing on rank"],
    ),
    "pad_fill_overflow": (tg.LeafTypeError, ["outputs['h']", "70000.0", "torch.float16"]),
}


@pytest.mark.parametrize("name", list(ERROR_EXPECTATIONS))
def test_mismatch_raises_the_same_error_on_every_rank(group_results: Any, name: str) -> None:
    world, results = group_results
    cls, fragments = ERROR_EXPECTATIONS[name]
    outcomes = [res[("error", name)] for res in results]
    for rank, outcome in enumerate(outcomes):
        assert outcome[0] == "raised", f"rank {rank} did not raise: {outcome}"
        assert outcome[1] == cls.__name__, f"rank {rank}: {outcome[3]}"
        for fragment in fragments:
            assert fragment in outcome[2], (
                f"{fragment!r} not in rank {rank}'s message:\n{outcome[2]}"
            )
    assert len({o[2] for o in outcomes}) == 1, "ranks raised different messages"
    # ... and the group is still in step afterwards.
    for rank, res in enumerate(results):
        assert_tree_equal(_ok(res[("after", name)]), _expected("all_gather", "ragged", rank, world))


def test_collectives_do_not_grow_with_leaves(group_results: Any) -> None:
    world, results = group_results
    for res in results:
        counts = _ok(res["count"])
        assert counts["all_gather_rows"] == sum(r + 2 for r in range(world))
        for op in ("all_gather", "all_gather_again", "gather", "broadcast"):
            assert len(counts[op]) <= 4, (op, counts[op])
        # The exact protocol, pinned (``all_gather_single`` is torch >= 2.13's name for
        # ``all_gather_into_tensor``). The full exchange: a length exchange, then one buffer
        # (gather: headers + data, then the outcome). The wire plan: rows and payload in one
        # collective once the group's inline capacity holds the payload; the first call of a
        # larger tree finds it too small and sends the payload in a second collective.
        ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        assert counts["all_gather"] == [ag, ag]
        if "fast" in res:
            assert counts["all_gather_again"] == [ag]
            assert counts["gather"] == [ag, "broadcast"]
        else:
            assert counts["all_gather_again"] == [ag, ag]
            assert counts["gather"] == [ag, "gather", "broadcast"]
        assert counts["broadcast"] == [ag, "broadcast"]


def test_inline_capacity_is_the_same_on_every_rank(group_results: Any) -> None:
    """The size of every first collective: grown by the wire-plan calls, equal on every rank."""
    _, results = group_results
    capacities = {res["capacity"] for res in results}
    assert len(capacities) == 1, capacities
    if "fast" in results[0]:
        assert 0 < capacities.pop() <= 256 << 10


def test_clearing_caches_on_one_rank_keeps_the_group_in_step(group_results: Any) -> None:
    """clear_caches() on rank 0 only: the group's facts and the wire plans are caches that rank 0
    builds again; the inline capacity is protocol state that it keeps, so the next call is one
    collective of the same size on every rank (a rank that forgot it would make gloo abort)."""
    _, results = group_results
    if "fast" not in results[0]:  # the group that runs everything on the full path
        return
    ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    found = [_ok(res["cleared_on_one_rank"]) for res in results]
    for calls, before, after in found:
        assert calls == [ag] and before == after > 0, (calls, before, after)
    assert len({before for _, before, _ in found}) == 1, found


def test_repeated_structure_takes_the_fingerprint_path(group_results: Any) -> None:
    """One collective, no full exchange (no pickled header), whatever the rows of each call;
    two when the payload does not fit the inline capacity (grown rows, large payloads)."""
    _, results = group_results
    ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    for res in results:
        if "fast" not in res:  # the group that runs everything on the full path
            continue
        report = _ok(res["fast"])
        for step in range(3):
            calls, full = report[("repeated", step)]
            assert calls == [ag] and full == 0, (step, calls, full)
        assert report["grown"] == [([ag, ag], 0), ([ag], 0)], report["grown"]
        assert report["wide"] == [([ag, ag], 0), ([ag, ag], 0)], report["wide"]
        assert report["gather"] == ([ag, "broadcast"], 0), report["gather"]


def test_changed_structure_falls_back_on_every_rank(group_results: Any) -> None:
    """Keys in another order on odd ranks: every rank takes the full exchange, rank 0's order."""
    _, results = group_results
    ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    for res in results:
        if "fast" not in res:
            continue
        calls, full, keys, inner = _ok(res["fast"])["fallback"]
        # The digests differ in the first collective; then one collective of every rank's
        # header and payload.
        assert calls == [ag, ag] and full == 1, (calls, full)
        assert keys == ["b", "a", "c"] and inner == ["y", "x"], (keys, inner)
        assert _ok(res["fast"])["alternating_full"] == 1  # alternating: no full exchange


def test_same_counts_other_shapes(group_results: Any) -> None:
    """A repeated call compares element counts, not shapes: a leaf reshaped with the same count
    is caught by packing (a later leaf of a region) or by its region's first leaf, and gives the
    single-process result; only the call that packing refuted takes the full exchange."""
    _, results = group_results
    for res in results:
        report = _ok(res["same_counts"])
        if "fast" not in res:
            continue
        fulls = [n for _, n in report]
        # "3:b" is refuted by packing (b is not its region's first leaf), "wide:True" by the
        # check before packing a payload that does not fit inline: one full exchange each.
        # Every other change fails the comparison of counts and first leaves: a plan of its own.
        # Shapes alternating with the same counts: refuted once, then read every call.
        assert fulls == [0, 0, 0] + [1] * 11 + [1] * 6 + [1, 1, 1, 2, 2], report


def test_alternating_structures_never_format_leaves(group_results: Any) -> None:
    """Leaves whose repr raises, structures alternating: valid calls succeed on both paths."""
    _, results = group_results
    for res in results:
        assert _ok(res["alternating"]) is True


def test_all_gather_returns_rank_0_key_order(group_results: Any) -> None:
    _, results = group_results
    for res in results:
        for op in ("all_gather", "gather"):
            out = _ok(res[("key_order", op)])
            if out is not None:
                assert list(out) == ["b", "a", "c"] and list(out["c"]) == ["y", "x"], out


def test_ddp_eval_example_runs_under_torchrun(torchrun_outputs: dict[str, str]) -> None:
    """notebooks/ddp_eval.py: DistributedSampler (padded, shuffled) and a Collector."""
    out = torchrun_outputs["ddp_eval"]
    assert "each rank saw 11 samples (the sampler pads to 22)" in out, out
    assert "gathered 21 samples, each once, in dataset order" in out, out


def test_contrastive_example_runs_under_torchrun(torchrun_outputs: dict[str, str]) -> None:
    """notebooks/contrastive.py: a CLIP-style loss with all_gather(sync_grads=True) under DDP."""
    out = torchrun_outputs["contrastive"]
    assert "every parameter's gradient equals one process" in out, out


def test_dim_and_subgroups(group_results: Any) -> None:
    world, results = group_results
    expected = tg.gather(
        [{"h": torch.full((2, r + 1), float(r))} for r in range(world)], "cpu", dim=1
    )
    both = tg.gather([_ragged(0), _ragged(world - 1)], "cpu")
    for rank, res in enumerate(results):
        assert_tree_equal(_ok(res["dim1"]), expected)
        if rank in (0, world - 1):  # global ranks 0 and world - 1 form the subgroup
            got_all, got_dst, got_bcast = _ok(res["subgroup"])
            assert_tree_equal(got_all, both)
            assert_tree_equal(got_dst, both if rank == world - 1 else None)
            assert_tree_equal(got_bcast, _ragged(world - 1))
        else:
            assert "subgroup" not in res


def test_all_tests_left_no_children() -> None:
    # (a group still running in the background is not a test's: it is joined when it ends)
    assert set(multiprocessing.active_children()) <= spawned_groups.running()


# ---------------------------------------------------------------------- single-process checks


def test_uninitialised_group_is_a_clear_error() -> None:
    import treegather.distributed as tgd

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tgd.all_gather({"x": torch.ones(1)})


def test_bad_dst_is_rejected(world_of_one: None) -> None:
    import treegather.distributed as tgd

    with pytest.raises(ValueError, match=r"dst=3 is not a rank"):
        tgd.gather({"x": torch.ones(1)}, dst=3)


def test_dst_and_src_are_ints_or_integer_types(world_of_one: None) -> None:
    """Integer types with ``__index__`` are ranks (as for dims); a bool or a str is an
    ArgumentTypeError (it used to be a ValueError saying the rank does not exist)."""
    import treegather.distributed as tgd

    tree = {"x": torch.ones(2)}
    np = pytest.importorskip("numpy")
    assert torch.equal(tgd.gather(tree, dst=np.int64(0))["x"], tree["x"])
    assert torch.equal(tgd.broadcast(tree, src=torch.tensor(0))["x"], tree["x"])
    with pytest.raises(tg.ArgumentTypeError, match=r"dst must be an int .*, got bool True"):
        tgd.gather(tree, dst=True)
    with pytest.raises(tg.ArgumentTypeError, match=r"src must be an int .*, got str '0'"):
        tgd.broadcast(tree, src="0")
    # ... and the group is still in step.
    assert torch.equal(tgd.all_gather(tree)["x"], tree["x"])


def test_results_are_detached_copies(world_of_one: None) -> None:
    import treegather.distributed as tgd

    x = torch.ones(2, requires_grad=True)
    out = tgd.all_gather({"x": x}, {"x": tg.as_list()})
    with pytest.raises(RuntimeError, match="pass sync_grads=True"):  # no gradient reaches x
        out["x"][0].sum().backward()
    out["x"][0].add_(1)
    assert torch.equal(x.detach(), torch.ones(2))
    out = tgd.all_gather({"x": x})  # the wire plan's vectorised combine
    with pytest.raises(RuntimeError, match="pass sync_grads=True"):
        out["x"].sum().backward()
    out["x"].add_(1)
    assert torch.equal(x.detach(), torch.ones(2))
    assert not tgd.all_gather({"x": x.detach()})["x"].requires_grad


def test_coalesced_device_staging_on_cpu(world_of_one: None) -> None:
    """The host<->device path (tensors on another device than the bytes travel on), on CPU.

    ``cpu:0`` and ``cpu`` are different ``torch.device`` values on the same memory, so the
    branch that packs where the tensors live, moves the whole payload in one copy and moves the
    received bytes to the target in one copy per rank runs here; on a GPU it is the same code.
    """
    from treegather.distributed import describe, exchange, payload, place

    tree = {"x": torch.arange(12.0).view(6, 2), "n": torch.tensor(3), "s": "a", "b": [True]}
    for _ in range(3):  # (a plan is kept)
        local = describe.describe(tree, None, 0, None)
    assert local.plan is not None and local.plan.vectorised
    stride = payload.padded(local.nbytes)
    direct = torch.empty(stride, dtype=torch.uint8)
    assert payload.write(local, direct)
    elsewhere = local._replace(devices=frozenset({torch.device("cpu", 0)}))
    staged = torch.empty(stride, dtype=torch.uint8)
    assert payload.write(elsewhere, staged)
    assert torch.equal(direct, staged)
    arrived = exchange.Arrived([[0] * 4 + [local.nbytes] + [0] * 5], staged, [0], None)
    placed = place.place([0], arrived, local, torch.device("cpu", 0), None, 0)
    assert_tree_equal(placed.result, tg.gather([tree], "cpu"))


@tg.register_dataclass(static=["flag"])
@dataclasses.dataclass
class Flagged:
    """A dataclass with a static field: node metadata that must stay type-exact."""

    x: torch.Tensor
    flag: Any


def test_wire_plans_are_type_aware_and_cleared(world_of_one: None) -> None:
    """True, 1 and 1.0 as static metadata, and key orders, each get their own plan."""
    import treegather.distributed as tgd
    from treegather.distributed import describe as plan

    tg.clear_caches()
    assert plan.plan_count() == 0
    for flag in (1, True, 1.0, True):
        out = tgd.all_gather({"m": Flagged(torch.ones(2), flag)})
        assert type(out["m"].flag) is type(flag)
    for keys in (("a", "b"), ("b", "a")):
        assert tuple(tgd.all_gather({k: torch.ones(1) for k in keys})) == keys
    assert plan.plan_count() == 5
    tg.clear_caches()
    assert plan.plan_count() == 0


def test_results_are_built_from_the_calls_own_objects(world_of_one: None) -> None:
    """A static field holding a list comes back as this call's own list on every call, as the
    full exchange rebuilds it: not, once a wire plan is cached, the list of the call that made
    the plan (which one result's edit would change for every later call)."""
    import treegather.distributed as tgd

    tg.clear_caches()
    for layout in (None, tg.by_path({"m.x": "cat"})):
        for _ in range(5):
            names = ["a"]
            out = tgd.all_gather({"m": Flagged(torch.ones(2), names)}, layout)
            assert out["m"].flag is names
            out["m"].flag.append("edited")


class _KeyReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("key repr not available")

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _KeyReprRaises)


def test_error_texts_survive_a_key_whose_repr_raises(world_of_one: None) -> None:
    """The rank's own error names the leaf (``outputs[<_KeyReprRaises object at 0x...>]``), not
    "could not prepare this rank's tree: RuntimeError: key repr not available"."""
    import treegather.distributed as tgd

    key = _KeyReprRaises()
    shown = f"outputs[<_KeyReprRaises object at {id(key):#x}>]"
    with pytest.raises(tg.LeafTypeError, match=r"mkldnn float32 tensors cannot be pickled") as info:
        tgd.all_gather({key: torch.zeros(2).to_mkldnn()})  # (no kind of tensor torch can pickle)
    assert shown in str(info.value)
    with pytest.raises(tg.BatchSizeError, match=r"got <_KeyReprRaises object at 0x"):
        tgd.all_gather({"a": torch.zeros(2)}, sizes=key)
    out = tgd.all_gather({key: torch.ones(2), "s": "x"})
    assert out[key].tolist() == [1.0, 1.0] and out["s"] == ["x"]


def test_a_tree_that_contains_itself_is_a_typed_error(world_of_one: None) -> None:
    """Every collective: a :class:`TreeDepthError` naming where the cycle closes (sent to every
    rank), not "could not prepare this rank's tree: RecursionError"."""
    import treegather.distributed as tgd

    cyclic: dict[str, Any] = {"x": torch.zeros(2)}
    cyclic["self"] = cyclic
    for call in (
        lambda: tgd.all_gather(cyclic),
        lambda: tgd.gather(cyclic, dst=0),
        lambda: tgd.broadcast(cyclic, src=0),
    ):
        with pytest.raises(tg.TreeDepthError, match=r"outputs\['self'\] is outputs itself"):
            call()
    assert tgd.all_gather({"x": torch.ones(1)})["x"].tolist() == [1.0]  # the group is in step


def test_group_facts_are_a_registered_cache_and_the_capacity_is_not(world_of_one: None) -> None:
    """A group's fixed facts are a cache that clear_caches() empties (they were kept in a table
    outside the registry); the inline capacity beside them is protocol state, never cleared."""
    import treegather.distributed as tgd
    from treegather._caches import caches
    from treegather.distributed import group

    tree = {"x": torch.ones(3, 2), "n": torch.arange(3)}
    for _ in range(2):
        tgd.all_gather(tree)  # a wire plan, whose payload grows the inline capacity
    (facts,) = [c for c in caches() if c.name == "distributed.groups"]
    state = group.group(None).state
    capacity = state.capacity
    assert len(facts) == 1 and capacity > 0
    tg.clear_caches()
    assert len(facts) == 0
    assert group.group(None).state is state and state.capacity == capacity
    assert len(facts) == 1  # looked up again
    assert_tree_equal(tgd.all_gather(tree), tg.gather([tree], "cpu"))
    assert state.capacity == capacity


def test_kept_receive_buffer(world_of_one: None) -> None:
    """A large wire-plan payload is received into a buffer the group keeps for its next call;
    results never alias it, other layouts never use it, clear_caches() releases it."""
    import treegather.distributed as tgd
    from treegather.distributed import group

    tg.clear_caches()
    first = tgd.all_gather(_wide(0, 1))
    second = tgd.all_gather(_wide(0, 2))
    assert len(group._KEPT) == 1
    assert_tree_equal(first, tg.gather([_wide(0, 1)], "cpu"))
    assert_tree_equal(second, tg.gather([_wide(0, 2)], "cpu"))
    tg.clear_caches()
    assert len(group._KEPT) == 0
    views = tgd.all_gather(_wide(0, 3), tg.first())  # may return views of the received bytes
    tgd.all_gather(_wide(0, 4), tg.first())
    assert len(group._KEPT) == 0
    assert_tree_equal(views, _wide(0, 3))


def test_import_treegather_does_not_import_distributed(group_results: Any) -> None:
    _, results = group_results
    assert all(res["lazy"] for res in results)


def test_lazy_attribute() -> None:
    import treegather.distributed as tgd
    from treegather import distributed

    assert tg.distributed is tgd and distributed is tgd
    with pytest.raises(AttributeError):
        _ = tg.not_a_name


# ----------------------------------------------------------------------------------- on a GPU


def _cuda_tree(r: int) -> Any:
    dev = torch.device("cuda", torch.cuda.current_device())
    return {
        "logits": torch.arange((r + 1) * 3, dtype=torch.float32, device=dev).view(r + 1, 3),
        "mask": torch.arange(r + 1, device=dev) % 2 == 0,
        "bf16": torch.full((r + 1, 2), 0.5 + r, dtype=torch.bfloat16, device=dev),
        "empty": torch.empty(0, 4, device=dev),
        "loss": torch.tensor(1.0 + r, device=dev),
        "name": f"rank{r}",
    }


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_cuda_tensors_one_rank(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL (tensors on the rank's GPU), torch's default mixed group, and gloo with GPU tensors."""
    import treegather.distributed as tgd

    torch.cuda.set_device(0)
    carriers: list[torch.device] = []
    real = tgd.exchange._all_gather_into

    def spy(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        carriers.append(inp.device)
        real(out, inp, group)

    monkeypatch.setattr(tgd.exchange, "_all_gather_into", spy)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        tree = _cuda_tree(0)
        assert_tree_equal(tgd.all_gather(tree), tg.gather([tree], "cuda:0"))
        # The tensor bytes ride on the GPU except on plain gloo.
        assert carriers[-1].type == ("cpu" if backend == "gloo" else "cuda"), carriers
        assert_tree_equal(tgd.gather(tree, dst=0), tg.gather([tree], "cuda:0"))
        assert_tree_equal(tgd.broadcast(tree, src=0), tree)
        cpu_tree = {"x": torch.arange(3), "s": "cpu"}
        out = tgd.all_gather(cpu_tree)
        assert_tree_equal(out, tg.gather([cpu_tree], "cpu"))  # results follow the inputs
        assert_tree_equal(
            tgd.all_gather({"loss": tree["loss"]}, tg.mean(), sizes=3), {"loss": tree["loss"]}
        )
    finally:
        dist.destroy_process_group()


def _cuda_gloo_worker(rank: int, world: int, port: int, outdir: str) -> None:
    """Two gloo ranks sharing GPU 0 (NCCL needs one GPU per rank; gloo does not)."""
    import treegather.distributed as tgd

    results: dict[Any, Any] = {}
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        tree = _cuda_tree(rank)
        results["all_gather"] = _capture(lambda: tgd.all_gather(tree))
        results["gather"] = _capture(lambda: tgd.gather(tree, dst=1))
        results["broadcast"] = _capture(lambda: tgd.broadcast(tree if rank == 0 else None, src=0))
        for value in results.values():  # results stay on the GPU, like the inputs
            if value[0] == "ok" and value[1] is not None:
                assert all(
                    x.device.type == "cuda"
                    for x in _tree.flatten(value[1])[0]
                    if isinstance(x, torch.Tensor)
                )
    except Exception:
        results["fatal"] = traceback.format_exc()
    finally:
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_tensors_two_gloo_ranks(tmp_path: Path) -> None:
    results = spawned_groups.run_group(2, tmp_path, _cuda_gloo_worker, deadline_s=GROUP_DEADLINE_S)
    torch.cuda.set_device(0)
    expected = tg.gather([_cuda_tree(0), _cuda_tree(1)], "cuda:0")
    for rank, res in enumerate(results):
        assert_tree_equal(_ok(res["all_gather"]), expected)
        assert_tree_equal(_ok(res["gather"]), expected if rank == 1 else None)
        assert_tree_equal(_ok(res["broadcast"]), _cuda_tree(0))


class _Broken:
    """A registered container whose flatten function fails."""


tg.register_node(
    _Broken, lambda b: (_ for _ in ()).throw(ValueError("broken flatten")), lambda m, c: _Broken()
)


def test_local_problems_become_shared_errors(world_of_one: None) -> None:
    """Problems found before the exchange travel in the header (the other ranks raise them too)."""
    import treegather.distributed as tgd

    with pytest.raises(tg.LeafTypeError, match=r"(?s)on rank 0: .*outputs\['s'\]: .*mkldnn"):
        tgd.all_gather({"s": torch.eye(2).to_mkldnn()})  # (a tensor torch cannot pickle)
    with pytest.raises(tg.TreegatherError, match="ValueError: broken flatten"):
        tgd.gather({"b": _Broken()})
    with pytest.raises(tg.BatchSizeError, match="sizes must be"):
        tgd.all_gather({"x": torch.ones(1)}, sizes=-1)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_a_fill_the_dtype_cannot_hold_is_a_leaf_type_error(world_of_one: None) -> None:
    """``pad``'s fill checked for every kind of dtype, as in ``tg.gather``: a ``LeafTypeError``
    naming the path (cold, and with the wire plan), never torch's bare overflow error."""
    import treegather.distributed as tgd

    for dtype, fill in FILLS_THAT_DO_NOT_FIT:
        tree = {"h": torch.ones(1, 2).to(dtype)}
        for _ in range(2):
            with pytest.raises(tg.LeafTypeError, match=r"outputs\['h'\]") as info:
                tgd.all_gather(tree, {"h": tg.pad(1, fill)})
            assert str(dtype) in str(info.value) and safe_repr(fill) in str(info.value)


def test_a_rule_class_of_your_own_is_a_layout_error(world_of_one: None) -> None:
    """As in ``tg.gather``: the rule classes are internal, a rule of your own is a callable."""
    import treegather.distributed as tgd

    for rule in FOREIGN:
        for _ in range(2):
            with pytest.raises(tg.LayoutError, match=r"outputs\['s'\]: .* f\(values, device\)"):
                tgd.all_gather({"s": torch.ones(2)}, {"s": rule})


def test_layouts_past_the_first_leaf_fall_back(world_of_one: None) -> None:
    """The wire plan looks at the first tensor only; packing (inline) or the check before a
    separate payload finds a sparse leaf after it, and the full exchange carries it (pickled,
    as torch pickles it: its cat is the sparse tensor one device gives), or reports a leaf
    that cannot travel (mkldnn)."""
    import treegather.distributed as tgd
    from treegather.distributed import group

    tree = {"a": torch.ones(2), "s": torch.eye(2).to_sparse()}
    unsent = {"a": torch.ones(2), "s": torch.eye(2).to_mkldnn()}
    state = group.group(None).state
    for capacity in (0, 4096):  # a separate payload, then one inline with the row
        state.capacity = capacity
        for out in (tgd.all_gather(tree), tgd.gather(tree)):
            assert out["s"].layout == torch.sparse_coo
            assert torch.equal(out["s"].to_dense(), torch.eye(2))
        with pytest.raises(tg.LeafTypeError, match=r"(?s)outputs\['s'\]: .*mkldnn"):
            tgd.all_gather(unsent)
        with pytest.raises(tg.LeafTypeError, match=r"(?s)outputs\['s'\]: .*mkldnn"):
            tgd.gather(unsent)
        assert state.capacity == capacity  # no plan agreed: the capacity stays


_WITHOUT_NUMPY = """
import os, sys, tempfile
sys.modules["numpy"] = None  # as on a machine without numpy: torch does not require it
import torch, torch.distributed as dist
import treegather.distributed as tgd
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
many = {f"k{i}": torch.full((2, 3), float(i)) for i in range(40)}  # rows picked by one index
tree = {"x": torch.arange(6.0).view(3, 2), "name": "a", "many": many}
for _ in range(4):  # the full exchange, then the wire plan
    out = tgd.all_gather(tree)
    assert torch.equal(out["x"], tree["x"]) and out["name"] == ["a"], out
    assert all(torch.equal(out["many"][k], v) for k, v in many.items())
    assert tgd.gather(tree, 0)["name"] == ["a"] and tgd.broadcast(tree, 0)["name"] == "a"
dist.destroy_process_group()
print("ok")
"""


def test_distributed_runs_without_numpy() -> None:
    """numpy is not a dependency (torch runs without it): object leaves travel as bytes read
    with torch alone, and the row permutation of many small leaves is computed with torch."""
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMPY],
        capture_output=True,
        text=True,
        timeout=GROUP_DEADLINE_S,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_no_garbage_collection_runs_inside_a_call(world_of_one: None) -> None:
    """Issue 46: a call on a large tree sets off no collection of Python's garbage collector
    until it is done (the one the collector makes when it is on again, as the call returns),
    where a 20,000-leaf all_gather set off about 250, each walking everything the process
    holds (100,000 leaves cost twice as much per leaf with them); the collector is as it was
    before the call."""
    import gc
    import traceback

    import treegather.distributed as tgd

    tree = {f"k{i}": torch.zeros(2, 3) for i in range(20_000)}
    runs: list[int] = []
    inside = [False]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and inside[0]:
            caller = traceback.extract_stack()[-2]  # (the collector, on again, as the call ends)
            if not (caller.name == "__exit__" and caller.filename.endswith("contextlib.py")):
                runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        for call in (tgd.all_gather, lambda t: tgd.gather(t, 0), lambda t: tgd.broadcast(t, 0)):
            for _ in range(2):
                inside[0] = True
                out = call(tree)
                inside[0] = False
                assert len(out) == len(tree)
        assert runs == [] and gc.isenabled(), runs
        gc.disable()  # (off before the call: off after it)
        tgd.all_gather(tree)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(count)
