"""The memory benchmark (``python -m treegather.benchmarks.memory``) runs, on a tiny scale."""

from __future__ import annotations

from treegather.benchmarks import memory


def test_measure_in_a_group_of_one(world_of_one: None) -> None:
    result = memory.measure(small=3000, large=300, leaves=[50, 200])
    assert result["world"] == 1
    names = [p["name"] for p in result["peaks"]]
    assert names == ["small", "large", "large, chunks of 30"]
    for p in result["peaks"][:2]:
        assert p["samples"] in (3000, 300) and p["result_mib"] > 0
        # (what all_gather holds at least: its own rows and the result)
        assert p["floor_x_result"] > 1 and p["peak_x_floor"] >= 0.99
    assert result["peaks"][2]["result_mib"] == result["peaks"][1]["result_mib"]
    assert [r["leaves"] for r in result["per_leaf"]] == [50, 200]
    assert all(r["collector on"] > 0 and r["collector off"] > 0 for r in result["per_leaf"])
    table = memory.format_table([result])
    assert "small: 3000 samples (1)" in table and "200 leaves (1)" in table
