"""Benchmark what a large evaluation costs in memory, and a large tree per leaf, on gloo ranks.

Run ``python -m treegather.benchmarks.memory`` (options: ``--world 1 2``, ``--small 1000000``,
``--large 10000``, ``--leaves 1000 10000 100000``, ``--json PATH``). It spawns ``world`` gloo
ranks on localhost, as :mod:`treegather.benchmarks.distributed` does. It measures:

- **an evaluation's peak**: each rank adds its share of a dataset (``small``: 10 float32 and
  an int64 label per sample, in batches of 1,000; ``large``: 4,096 float32 per sample, in
  batches of 100; each add with its ``indices=``), lets go of its own references, then calls
  ``Collector.all_gather()``: the peak of the tensor bytes held during the call (counted from
  ``torch.profiler``'s allocation events, so that memory the allocator keeps for later does not
  count), against the result's bytes (the outputs and ``Collector.indices``, the dataset
  indices of their rows) and against the floor (its own rows, as added, indices
  included, and the result: what a call holds at least when the result is made while its own
  rows are still held). The rank with the largest peak.
- **per leaf**: ``all_gather`` of a dict of 1,000 to 100,000 small tensors (2 x 3 float32),
  in µs per leaf, with Python's garbage collector as it is and switched off around the call
  (the call pauses it itself; before it did, 100,000 leaves cost 2.5x as much with it on).

Targets (issue 46): the peak at most 2.1x the result where the floor is 2.0x (one rank), and
a flat per-leaf cost up to 100,000 leaves.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .distributed import init_rank, spawn

__all__ = ["WORKLOADS", "format_table", "main", "measure", "run"]

# name -> (floats per sample, samples per add, with an int64 label)
WORKLOADS = {"small": (10, 1000, True), "large": (4096, 100, False)}


def _peak_row(name: str, samples: int, chunk: int = 0) -> dict[str, Any]:
    """One evaluation of ``samples`` samples: this rank's adds, then the exchange's peak of
    live tensor bytes (``torch.profiler``'s allocation events: what is held, whatever the
    allocator keeps for later)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import treegather.distributed as tgd

    width, per_add, label = WORKLOADS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, samples, world)  # (DistributedSampler's order, no padding)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        col = tgd.Collector()
        for at in range(0, mine.numel(), per_add):
            index = mine[at : at + per_add].clone()
            outputs = {"logits": torch.randn(index.numel(), width)}
            if label:
                outputs["labels"] = index.clone()
            col.add(outputs, indices=index)
        del outputs, index
        dist.barrier()
        with record_function("exchange"):
            if chunk:  # (each chunk let go of before the next: only its bytes counted)
                result = sum(_nbytes([*part.values(), i]) for i, part in col.chunks(rows=chunk))
            else:
                out = col.all_gather()
                # (what all_gather returns, and the dataset indices of its rows, in order)
                result = _nbytes([*out.values(), col.indices])
                del out
    events = list(prof.profiler.kineto_results.events())
    start = next(e.start_ns() for e in events if e.name() == "exchange")
    live, own, peak = 0, 0, 0
    for at, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if at < start:
            own = live = live + nbytes
        else:
            live += nbytes
            peak = max(peak, live)
    row = {
        "name": name + (f", chunks of {chunk}" if chunk else ""),
        "samples": samples,
        "world": world,
        "own_mib": own / 2**20,
        "result_mib": result / 2**20,
        "peak_mib": peak / 2**20,
        "peak_x_result": peak / result,
        "floor_x_result": (own + result) / result,
        "peak_x_floor": peak / (own + result),
    }
    del col, prof
    return _slowest(row, "peak_x_result")


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _slowest(row: dict[str, Any], key: str) -> dict[str, Any]:
    """The row of the rank with the largest ``key``, on every rank."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return max(rows, key=lambda r: r[key] if r[key] is not None else -1)


def _per_leaf_row(n: int, reps: int = 3) -> dict[str, Any]:
    """``all_gather`` of ``n`` small leaves, µs per leaf: the best of ``reps`` calls, with the
    garbage collector as it is and off (the results kept, as a caller keeps them)."""
    import treegather.distributed as tgd

    tree = {f"k{i}": torch.zeros(2, 3) for i in range(n)}
    kept = [tgd.all_gather(tree)]
    found: dict[str, float] = {}
    for mode in ("collector on", "collector off"):
        times = []
        for _ in range(reps):
            dist.barrier()
            if mode == "collector off":
                gc.disable()
            start = time.perf_counter()
            kept.append(tgd.all_gather(tree))
            times.append(time.perf_counter() - start)
            gc.enable()
        found[mode] = min(times) / n * 1e6
    slowest = _slowest({"leaves": n, **found}, "collector on")
    del kept
    return slowest


def measure(
    small: int = 1_000_000, large: int = 10_000, leaves: Sequence[int] = (1000, 10_000, 100_000)
) -> dict[str, Any]:
    """Measure in the process group this process is in (every rank calls it): the peaks of
    evaluations of ``small`` and ``large`` samples (0: not measured), and the per-leaf cost of
    trees of ``leaves`` leaves."""
    peaks = [_peak_row(name, n) for name, n in (("small", small), ("large", large)) if n]
    if large:  # the bounded form: Collector.chunks, a tenth of the dataset at a time
        peaks.append(_peak_row("large", large, chunk=max(1, large // 10)))
    per_leaf = [_per_leaf_row(n) for n in leaves]
    return {"world": dist.get_world_size(), "peaks": peaks, "per_leaf": per_leaf}


def _worker(
    rank: int,
    world: int,
    port: int,
    small: int,
    large: int,
    leaves: Sequence[int],
    out: str,
) -> None:
    init_rank(rank, world, port)
    try:
        result = measure(small, large, leaves)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(
    world: int = 2,
    *,
    small: int = 1_000_000,
    large: int = 10_000,
    leaves: Sequence[int] = (1000, 10_000, 100_000),
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks and measure (the peaks and the per-leaf costs on ranks of
    their own).

    Returns:
        ``world``, ``peaks`` (per workload: ``own_mib``, ``result_mib``, ``peak_mib`` and the
        ratios ``peak_x_result``, ``floor_x_result``, ``peak_x_floor``; the rank with the
        largest peak) and ``per_leaf`` (per size: µs per leaf with the collector on and off,
        the slowest rank's).
    """
    peaks = spawn(_worker, world, (small, large, []), timeout_s)["peaks"] if small or large else []
    per_leaf = spawn(_worker, world, (0, 0, list(leaves)), timeout_s)["per_leaf"] if leaves else []
    return {"world": world, "peaks": peaks, "per_leaf": per_leaf}


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Render :func:`run`'s results (one per world size) as two Markdown tables.

    Example:
        >>> r = {"world": 1, "peaks": [{"name": "large", "samples": 10000, "own_mib": 160.0,
        ...     "result_mib": 156.0, "peak_mib": 312.0, "peak_x_result": 2.0,
        ...     "floor_x_result": 2.03, "peak_x_floor": 0.99}],
        ...     "per_leaf": [{"leaves": 1000, "collector on": 1.5, "collector off": 1.4}]}
        >>> print(format_table([r]))  # doctest: +NORMALIZE_WHITESPACE
        | Collector.all_gather (ranks) | own rows | result | peak | peak / result | floor / result | peak / floor |
        |---|---:|---:|---:|---:|---:|---:|
        | large: 10000 samples (1) | 160 MiB | 156 MiB | 312 MiB | 2.00x | 2.03x | 0.99x |
        <BLANKLINE>
        | all_gather, per leaf (ranks) | collector on | collector off |
        |---|---:|---:|
        | 1000 leaves (1) | 1.50 µs | 1.40 µs |
    """
    lines = [
        "| Collector.all_gather (ranks) | own rows | result | peak | peak / result "
        "| floor / result | peak / floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for p in r["peaks"]:
            lines.append(
                f"| {p['name']}: {p['samples']} samples ({r['world']}) | {p['own_mib']:.0f} MiB "
                f"| {p['result_mib']:.0f} MiB | {p['peak_mib']:.0f} MiB "
                f"| {p['peak_x_result']:.2f}x | {p['floor_x_result']:.2f}x "
                f"| {p['peak_x_floor']:.2f}x |"
            )
    lines += [
        "",
        "| all_gather, per leaf (ranks) | collector on | collector off |",
        "|---|---:|---:|",
    ]
    for r in results:
        for p in r["per_leaf"]:
            lines.append(
                f"| {p['leaves']} leaves ({r['world']}) | {p['collector on']:.2f} µs "
                f"| {p['collector off']:.2f} µs |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: run the benchmark for each world size and print the tables."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.memory",
        description="The peak memory of a Collector evaluation against its result, and the "
        "per-leaf cost of all_gather on large trees, on gloo ranks.",
    )
    parser.add_argument("--world", type=int, nargs="*", default=[1, 2], help="ranks (1 2)")
    parser.add_argument("--small", type=int, default=1_000_000, help="samples, small (1000000)")
    parser.add_argument("--large", type=int, default=10_000, help="samples, large (10000)")
    parser.add_argument("--leaves", type=int, nargs="*", default=[1000, 10_000, 100_000])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    results = [run(w, small=args.small, large=args.large, leaves=args.leaves) for w in args.world]
    print(format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
