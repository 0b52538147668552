"""The benchmark: scatter and gather against the bare torch ops, side by side in one run.

``python -m treegather.bench`` prints one table. Each case builds a nested dict of N leaves and
times, interleaved round by round so machine noise hits every implementation alike:

- ``floor``: only the torch ops on pre-flattened leaves (one ``tensor_split`` per leaf for
  scatter, one ``torch.cat`` per leaf for gather) — no tree handling at all;
- ``treegather``: :func:`treegather.scatter` / :func:`treegather.gather`;
- ``recursion``: a torch ``scatter_gather``-style recursion over dicts (``torch.cat`` on CPU).

Each ratio is the median over rounds of (time / floor time in the same round); times are the
CPU time of the benchmarking thread with the garbage collector off, as ``timeit`` does, over
samples of about 50 ms (``pyperf`` uses 100 ms), so that one cold first call does not dominate.

Before timing, the process allocates and frees one 16 MiB tensor, as every training step does.
When glibc frees a block it had mapped for a large allocation, it raises its mmap threshold to
that size and its trim threshold to twice that; a process that never freed one (this benchmark,
otherwise) keeps the 128 KiB defaults, and then, depending on where its heap
happens to end, freeing a call's results can return memory to the OS that the next call faults
back in: hundreds of page faults per call, landing on one implementation or another by chance
(at 1000 leaves: 0.92x for treegather in one run, 1.45x in another). ``--cold-allocator``
skips this step; the page faults per call are in the ``--json`` rows either way. ``--quick``
runs in about a minute and a half, ``--json PATH`` saves the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

import treegather as tg

from ._bench_cases import _rec_gather as _rec_gather
from ._bench_cases import _rec_scatter as _rec_scatter
from ._bench_cases import nested_tree, run_case
from ._bench_engine import engine_cases as engine_cases
from ._bench_timing import prepare_allocator as prepare_allocator

__all__ = ["nested_tree", "run_case", "main"]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print the table (``python -m treegather.bench --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller grid, about a minute and a half"
    )
    parser.add_argument("--json", metavar="PATH", help="save the rows as JSON")
    parser.add_argument("--leaves", type=int, nargs="*", help="override the leaf counts")
    parser.add_argument("--replicas", type=int, nargs="*", help="override the replica counts")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu: repeated CPU devices; cuda: a CPU batch to cuda:0 repeated (needs CUDA)",
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per case (default 15)")
    parser.add_argument(
        "--cold-allocator",
        action="store_true",
        help="skip freeing one large tensor first (page faults may then land on any implementation)",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="also time whole data-parallel training steps (python -m treegather.bench_steps)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        leaves, ks, shapes, rounds = [10, 100, 1000], [4], [(8, 4)], 9
    else:
        leaves, ks, shapes, rounds = [10, 100, 1000], [2, 4, 8], [(8, 4), (128, 256)], 15
    rounds = args.rounds or rounds
    leaves = args.leaves or leaves
    ks = args.replicas or ks
    rows: list[dict[str, Any]] = []
    if args.device == "cuda":
        where = f"cuda:0 x K ({torch.cuda.get_device_name(0)}), batch from the CPU"
    else:
        where = f"CPU x K ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    print(
        f"treegather {tg.__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()}; {where}; 1 intra-op thread; median of {rounds} interleaved "
        f"rounds; {'cold allocator' if args.cold_allocator else 'one 16 MiB tensor freed first'}"
    )
    print(
        f"{'op':8} {'leaves':>6} {'shape':>10} {'K':>2} | {'floor us':>9} {'treegather':>16} {'recursion':>16}"
    )
    for shape in shapes:
        for n in leaves:
            for k in ks:
                case = run_case(
                    n,
                    shape,
                    k,
                    rounds=rounds,
                    device=args.device,
                    warm_allocator=not args.cold_allocator,
                )
                rows.extend(case)
                for op in ("scatter", "gather"):
                    r = {row["impl"]: row for row in case if row["op"] == op}
                    print(
                        f"{op:8} {n:>6} {'x'.join(map(str, shape)):>10} {k:>2} | "
                        f"{r['floor']['median_us']:>9.1f} "
                        f"{r['treegather']['median_us']:>9.1f} {r['treegather']['ratio']:>5.2f}x "
                        f"{r['recursion']['median_us']:>9.1f} {r['recursion']['ratio']:>5.2f}x",
                        flush=True,
                    )
    engine_leaves = [n for n in leaves if n >= 100] or leaves[-1:]
    print(f"\ncompiled layer, K=4 ({'x'.join(map(str, shapes[0]))} tensors):")
    print(f"{'op':8} {'leaves':>6} {'case':>16} | {'baseline us':>11} {'us':>9} {'ratio':>7}")
    for n in engine_leaves:
        for row in engine_cases(n, rounds=rounds):
            rows.append(row)
            print(
                f"{row['op']:8} {n:>6} {row['impl']:>16} | {row['baseline_us']:>11.1f} "
                f"{row['median_us']:>9.1f} {row['ratio']:>6.2f}x",
                flush=True,
            )
    if args.steps:
        from . import bench_steps

        print()
        rows.extend(bench_steps.main(["--quick"] if args.quick else []))
    faulty = sorted(
        {
            f"{r['impl']} ({r['op']}, {r['leaves']} leaves)"
            for r in rows
            if r.get("page_faults_per_call", 0) >= 1
        }
    )
    if faulty:
        print(
            "page faults: at least one per call for " + ", ".join(faulty) + " (see --json); "
            "such a cell measures the allocator as much as the code",
            file=sys.stderr,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
