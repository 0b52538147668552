"""The benchmark runs end to end (its numbers are not checked: no timing asserts in tests)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from treegather import bench


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
def test_bench_main_writes_one_row_per_op_and_implementation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cold: bool
) -> None:
    out = tmp_path / "rows.json"
    argv = ["--leaves", "3", "--replicas", "2", "--rounds", "1", "--json", str(out)]
    rows = bench.main(argv + (["--cold-allocator"] if cold else []))
    printed = capsys.readouterr().out
    assert ("cold allocator" in printed) == cold
    assert json.loads(out.read_text()) == rows
    # Two shapes in the full grid, 2 ops, 3 implementations; then the compiled layer's rows.
    main_rows = [r for r in rows if "shape" in r]
    assert sorted({(r["op"], r["impl"]) for r in main_rows}) == sorted(
        (op, impl) for op in ("scatter", "gather") for impl in ("floor", "treegather", "recursion")
    )
    assert len(main_rows) == 2 * 2 * 3
    engine = sorted((r["op"], r["impl"]) for r in rows if "shape" not in r)
    assert engine == sorted(
        [
            ("scatter", "alternating"),
            ("gather", "alternating"),
            ("gather", "inline by_path"),
            ("scatter", "first call"),
            ("gather", "first call"),
            *((op, f"rotating {n}") for op in ("scatter", "gather") for n in (20, 64, 256)),
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

    tree = bench.nested_tree(12, (6, 2))
    leaves, _ = tg._tree.flatten(tree)
    shards = tg.scatter(tree, ["cpu"] * 3)
    rec = bench._rec_scatter(tree, 3)
    for r in range(3):
        ours, theirs = tg._tree.flatten(shards[r])[0], tg._tree.flatten(rec[r])[0]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert all(torch.equal(a, x.tensor_split(3)[r]) for a, x in zip(ours, leaves, strict=True))
    back = tg.gather(list(shards), "cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            tg._tree.flatten(back)[0], tg._tree.flatten(bench._rec_gather(rec))[0], strict=True
        )
    )
