"""The benchmark runs end to end (its numbers are not checked: no timing asserts in tests)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treegather.benchmarks import cases, scatter_gather


@pytest.fixture(autouse=True)
def _small_heap() -> Iterator[None]:
    # The benchmark collects garbage before every sample (as in its own small process); in the
    # test process the heap holds every other test's imports, so freeze them out of the scans.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cold", [False, True], ids=["allocator-warmed", "cold-allocator"])
def test_main_writes_one_row_per_op_and_implementation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cold: bool
) -> None:
    out = tmp_path / "rows.json"
    argv = ["--leaves", "3", "--replicas", "2", "--rounds", "1", "--big-leaves", "40"]
    argv += ["--json", str(out)]
    rows = scatter_gather.main(argv + (["--cold-allocator"] if cold else []))
    printed = capsys.readouterr().out
    assert ("cold allocator" in printed) == cold
    assert json.loads(out.read_text()) == rows
    # Two shapes in the full grid, 2 ops, 5 implementations; then the compiled layer's rows.
    main_rows = [r for r in rows if "shape" in r]
    impls = ("floor", "treegather", "recursion", "optree", "cxx_pytree")
    assert sorted({(r["op"], r["impl"]) for r in main_rows}) == sorted(
        (op, impl) for op in ("scatter", "gather") for impl in impls
    )
    assert len(main_rows) == 2 * 2 * 5
    # The small tensors have 8 rows per replica, the large ones are fixed.
    assert sorted({tuple(r["shape"]) for r in main_rows}) == [(16, 4), (128, 256)]
    # Every peer's ratio is in the table, and which implementation is ahead.
    table = [
        line.split() for line in printed.splitlines() if line.startswith(("scatter", "gather"))
    ]
    assert len(table) == 2 * 2 + len(engine_rows(rows))
    for line in table[:4]:
        assert len(line) == 4 + 1 + 1 + 2 + 3 + 1 + 1, (
            line
        )  # case | floor, tg us+x, 3 peers | ahead
        assert all(cell.endswith("x") for cell in line[7:10]) and line[-1] in impls[1:]
    engine = sorted((r["op"], r["impl"]) for r in engine_rows(rows))
    assert engine == sorted(
        [
            ("scatter", "alternating"),
            ("gather", "alternating"),
            ("gather", "inline by_path"),
            ("scatter", "first call"),
            ("gather", "first call"),
            *((op, f"rotating {n}") for op in ("scatter", "gather") for n in (20, 64, 256)),
            ("scatter", "after a big one"),
            ("gather", "after a big one"),
        ]
    )
    assert all(r["ratio"] > 0 and r["baseline_us"] > 0 for r in rows if "shape" not in r)
    for row in main_rows:
        assert row["leaves"] == 3 and row["replicas"] == 2
        assert row["median_us"] > 0 and row["page_faults_per_call"] >= 0
        if row["impl"] == "floor":
            assert row["ratio"] == 1.0


def test_run_case_recursion_and_treegather_agree_with_the_floor() -> None:
    # The three implementations the table compares must do the same work.
    import torch

    import treegather as tg

    tree = cases.nested_tree(12, (6, 2))
    leaves, _ = tg._tree.flatten(tree)
    shards = tg.scatter(tree, ["cpu"] * 3)
    rec = cases._rec_scatter(tree, 3)
    for r in range(3):
        ours, theirs = tg._tree.flatten(shards[r])[0], tg._tree.flatten(rec[r])[0]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert all(torch.equal(a, x.tensor_split(3)[r]) for a, x in zip(ours, leaves, strict=True))
    back = tg.gather(list(shards), "cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            tg._tree.flatten(back)[0], tg._tree.flatten(cases._rec_gather(rec))[0], strict=True
        )
    )


def engine_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "shape" not in r]


def test_shapes_option_takes_rows_per_replica(capsys: pytest.CaptureFixture[str]) -> None:
    assert scatter_gather.shape_of("8Kx4", 3) == (24, 4)
    with pytest.raises(SystemExit):
        scatter_gather.main(["--shapes", "8Kxfour"])
    assert "is not a shape" in capsys.readouterr().err


@pytest.mark.parametrize("k", [2, 4])
def test_the_peers_do_the_work_of_treegather(k: int) -> None:
    # optree and torch's C++ pytree, as the table times them: the same shards, the same gather.
    import torch

    import treegather as tg

    tree = cases.nested_tree(30, (8 * k, 4))
    shards = tg.scatter(tree, ["cpu"] * k)
    for scatter in (cases.optree_scatter, cases.cxx_scatter):
        theirs = scatter(tree, k)
        assert len(theirs) == k
        for ours, their in zip(shards, theirs, strict=True):
            assert tg._tree.flatten(ours)[1] == tg._tree.flatten(their)[1]
            for a, b in zip(tg._tree.flatten(ours)[0], tg._tree.flatten(their)[0], strict=True):
                assert torch.equal(a, b)
    back = tg.gather(list(shards), "cpu")
    for gather in (cases.optree_gather, cases.cxx_gather):
        joined = gather(list(shards))
        assert tg._tree.flatten(joined)[1] == tg._tree.flatten(back)[1]
        for a, b in zip(tg._tree.flatten(joined)[0], tg._tree.flatten(back)[0], strict=True):
            assert torch.equal(a, b)
