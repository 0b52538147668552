"""Benchmark :func:`treegather.distributed.all_gather` against gathering leaf by leaf.

Run ``python -m treegather.bench_distributed`` (options: ``--leaves 100 1000``, ``--world 2``,
``--repeats 15``, ``--json PATH``). It spawns ``world`` gloo ranks on localhost; each holds a tree
of ragged tensors (leaf ``i`` on rank ``r`` has shape ``[r + 1 + i % 3, 4]``) and the ranks time,
after a barrier, the median of ``repeats`` calls of:

- ``per-leaf``: the approach of accelerate's ``pad_across_processes`` + ``gather`` (and of most
  hand-written evaluation loops): for every leaf, all-gather its size, pad it to the largest
  rank's, all-gather it, trim the padding and concatenate: two collectives per leaf;
- ``accelerate``: ``accelerate.utils.pad_across_processes`` then ``accelerate.utils.gather`` on
  the whole tree, when accelerate is installed (it pads but does not trim);
- ``treegather``: ``treegather.distributed.all_gather(tree)``: two collectives for the tree.

Both results are checked equal before timing. The table is printed by rank 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run", "format_table", "main"]


def _tree(rank: int, leaves: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"leaf{i}": torch.randn(rank + 1 + i % 3, 4, generator=g) for i in range(leaves)}


def _per_leaf_all_gather(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """accelerate-style: per leaf, all-gather the size, pad, all-gather, trim, concatenate."""
    world = dist.get_world_size()
    out = {}
    for key, t in tree.items():
        size = torch.tensor([t.shape[0]], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        rows = [int(s) for s in sizes]
        padded = t.new_zeros((max(rows), *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        out[key] = torch.cat([p[:n] for p, n in zip(parts, rows)])
    return out


def _accelerate_gather() -> Callable[[Any], Any] | None:
    try:
        from accelerate import PartialState
        from accelerate.utils import gather, pad_across_processes
    except ImportError:
        return None
    try:
        PartialState(cpu=True)  # attaches to the gloo group already initialised
    except Exception:
        return None

    def run(tree: Any) -> Any:
        return gather(pad_across_processes(tree, dim=0))

    return run


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # Every rank waits for the slowest: report the slowest rank's median.
    mine = torch.tensor([statistics.median(times) * 1e3])
    all_ms = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(all_ms, mine)
    return max(float(t) for t in all_ms)


def _worker(
    rank: int, world: int, port: int, leaves: Sequence[int], repeats: int, out: str
) -> None:
    import treegather.distributed as tgd

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        accelerate = _accelerate_gather()
        rows = []
        for n in leaves:
            tree = _tree(rank, n)
            expected = _per_leaf_all_gather(tree)
            got = tgd.all_gather(tree)
            assert all(torch.equal(got[k], expected[k]) for k in tree), "results differ"
            tgd.all_gather(tree)  # warm-up
            per_leaf_repeats = max(3, repeats // 3) if n >= 1000 else repeats
            row: dict[str, Any] = {
                "leaves": n,
                "world": world,
                "per_leaf_ms": _median_ms(lambda: _per_leaf_all_gather(tree), per_leaf_repeats),  # noqa: B023
                "treegather_ms": _median_ms(lambda: tgd.all_gather(tree), repeats),  # noqa: B023
                "accelerate_ms": (
                    _median_ms(lambda: accelerate(tree), per_leaf_repeats)  # noqa: B023
                    if accelerate is not None
                    else None
                ),
                "per_leaf_collectives": 2 * n,
                "treegather_collectives": 2,
            }
            row["speedup"] = row["per_leaf_ms"] / row["treegather_ms"]
            rows.append(row)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    leaves: Sequence[int] = (100, 1000),
    *,
    world: int = 2,
    repeats: int = 15,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo ranks on localhost and time both approaches for each tree size.

    Args:
        leaves: The tree sizes (number of ragged ``[r + 1 + i % 3, 4]`` leaves) to time.
        world: How many ranks to spawn.
        repeats: Timed calls per measurement (a third of that, at least 3, for the slow
            per-leaf approach at 1000 leaves and more).
        timeout_s: Kill the ranks if they have not finished by then.

    Returns:
        One dict per tree size: ``leaves``, ``world``, ``per_leaf_ms``, ``treegather_ms``,
        ``accelerate_ms`` (``None`` without accelerate), ``speedup`` and the collective counts.

    Example:
        >>> rows = run(leaves=(10,), repeats=2)
        >>> rows[0]["leaves"], rows[0]["per_leaf_collectives"], rows[0]["treegather_collectives"]
        (10, 20, 2)
    """
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, port, tuple(leaves), repeats, out), daemon=True
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0] * world or not os.path.exists(out):
            raise RuntimeError(f"benchmark ranks failed or timed out (exit codes {codes})")
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text())
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render :func:`run`'s rows as a Markdown table.

    Example:
        >>> print(format_table([{"leaves": 100, "world": 2, "per_leaf_ms": 120.0,
        ...     "treegather_ms": 4.0, "accelerate_ms": None, "speedup": 30.0,
        ...     "per_leaf_collectives": 200, "treegather_collectives": 2}]))
        | leaves | ranks | per-leaf all_gather | accelerate | treegather.all_gather | speedup | collectives (per-leaf / treegather) |
        |---:|---:|---:|---:|---:|---:|---:|
        | 100 | 2 | 120.00 ms | n/a | 4.00 ms | 30.0x | 200 / 2 |
    """
    lines = [
        "| leaves | ranks | per-leaf all_gather | accelerate | treegather.all_gather | speedup "
        "| collectives (per-leaf / treegather) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = "n/a" if r["accelerate_ms"] is None else f"{r['accelerate_ms']:.2f} ms"
        lines.append(
            f"| {r['leaves']} | {r['world']} | {r['per_leaf_ms']:.2f} ms | {acc} "
            f"| {r['treegather_ms']:.2f} ms | {r['speedup']:.1f}x "
            f"| {r['per_leaf_collectives']} / {r['treegather_collectives']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: run the benchmark and print the table.

    Example:
        >>> main(["--leaves", "10", "--repeats", "2"])  # doctest: +ELLIPSIS
        | leaves | ranks | per-leaf all_gather | ...
        ...
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m treegather.bench_distributed", description=__doc__
    )
    parser.add_argument("--leaves", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = run(args.leaves, world=args.world, repeats=args.repeats)
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
