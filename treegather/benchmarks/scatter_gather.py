"""The benchmark: scatter and gather against the bare torch ops and the peers, in one run.

``python -m treegather.benchmarks`` prints one table. Each case builds a nested dict of N
tensors and times, interleaved round by round so machine noise hits every implementation alike:

- ``floor``: only the torch ops on pre-flattened leaves (one ``tensor_split`` per leaf for
  scatter, one ``torch.cat`` per leaf for gather) — no tree handling at all;
- ``treegather``: :func:`treegather.scatter` / :func:`treegather.gather`;
- ``recursion``: a torch ``scatter_gather``-style recursion over dicts (``torch.cat`` on CPU);
- ``optree``: ``optree.tree_flatten``, one ``tensor_split`` per leaf, ``spec.unflatten`` per
  device; gather: flatten every replica, one ``torch.cat`` per leaf, unflatten (CPU only);
- ``cxx_pytree``: the same with ``torch.utils._cxx_pytree``, torch's C++ pytree (CPU only).

Each ratio is the median over rounds of (time / floor time in the same round); times are the
CPU time of the benchmarking thread with the garbage collector off, as ``timeit`` does, over
samples of about 50 ms (``pyperf`` uses 100 ms), so that one cold first call does not dominate.
The small tensors have 8 rows per replica (``8Kx4``: ``[32, 4]`` at K = 4), the large ones
``[128, 256]``; ``--shapes 8x4`` gives the grid's small tensors of earlier tables.

Before timing, the process allocates and frees one 16 MiB tensor, as every training step does.
When glibc frees a block it had mapped for a large allocation, it raises its mmap threshold to
that size and its trim threshold to twice that; a process that never freed one (this benchmark,
otherwise) keeps the 128 KiB defaults, and then, depending on where its heap
happens to end, freeing a call's results can return memory to the OS that the next call faults
back in: hundreds of page faults per call, landing on one implementation or another by chance
(at 1000 leaves: 0.92x for treegather in one run, 1.45x in another). ``--cold-allocator``
skips this step; the page faults per call are in the ``--json`` rows either way. ``--quick``
runs in about a minute, ``--json PATH`` saves the rows. The method and the last measured
tables are in ``treegather/benchmarks/README.md``.
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

from .cases import run_case
from .engine import engine_cases

__all__ = ["PEERS", "main", "shape_of"]


PEERS = ("recursion", "optree", "cxx_pytree")


def shape_of(spec: str, k: int) -> tuple[int, ...]:
    """A grid shape for ``k`` replicas: ``"128x256"`` as written, ``"8Kx4"``: 8 rows per replica.

    >>> shape_of("8Kx4", 4), shape_of("128x256", 4)
    ((32, 4), (128, 256))
    """
    dims = []
    for part in spec.lower().split("x"):
        dims.append(int(part[:-1]) * k if part.endswith("k") else int(part))
    return tuple(dims)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller grid (10 / 100 / 1000 leaves of [8K, 4], K = 4), about a minute",
    )
    parser.add_argument("--json", metavar="PATH", help="save the rows as JSON")
    parser.add_argument("--leaves", type=int, nargs="*", help="override the leaf counts")
    parser.add_argument("--replicas", type=int, nargs="*", help="override the replica counts")
    parser.add_argument(
        "--shapes",
        nargs="*",
        metavar="SPEC",
        help="override the tensor shapes: 128x256, or 8Kx4 for 8 rows per replica "
        "(default: 8Kx4 128x256; --quick: 8Kx4)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu: repeated CPU devices; cuda: a CPU batch to cuda:0 repeated (needs CUDA)",
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per case (default 15)")
    parser.add_argument(
        "--big-leaves",
        type=int,
        default=100_000,
        help="leaves of the big structure of the 'after a big one' rows (default 100000)",
    )
    parser.add_argument(
        "--cold-allocator",
        action="store_true",
        help="skip freeing one large tensor first (page faults may then land on any implementation)",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="also time whole data-parallel training steps (python -m treegather.benchmarks.steps)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print the table (``python -m treegather.benchmarks --help``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        leaves, ks, shapes, rounds = [10, 100, 1000], [4], ["8Kx4"], 9
    else:
        leaves, ks, shapes, rounds = [10, 100, 1000], [2, 4, 8], ["8Kx4", "128x256"], 15
    rounds = args.rounds or rounds
    leaves = args.leaves or leaves
    ks = args.replicas or ks
    shapes = args.shapes or shapes
    for spec in shapes:
        try:
            shape_of(spec, 1)
        except ValueError:
            parser.error(f"--shapes: {spec!r} is not a shape such as 128x256 or 8Kx4")
    rows = _grid(shapes, leaves, ks, rounds, args.device, not args.cold_allocator)
    rows += _engine_rows([n for n in leaves if n >= 100] or leaves[-1:], rounds, args.big_leaves)
    if args.steps:
        from . import steps

        print()
        rows.extend(steps.main(["--quick"] if args.quick else []))
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


def _grid(
    shapes: list[str], leaves: list[int], ks: list[int], rounds: int, device: str, warm: bool
) -> list[dict[str, Any]]:
    """Every case of the grid, timed and printed as it finishes (the header first)."""
    rows: list[dict[str, Any]] = []
    if device == "cuda":
        where = f"cuda:0 x K ({torch.cuda.get_device_name(0)}), batch from the CPU"
    else:
        where = f"CPU x K ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    print(
        f"treegather {tg.__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()}; {where}; 1 intra-op thread; median of {rounds} interleaved "
        f"rounds; {'one 16 MiB tensor freed first' if warm else 'cold allocator'}"
    )
    print("ratios to the floor, each the median of per-round ratios; ahead: the lowest ratio")
    print(
        f"{'op':8} {'leaves':>6} {'shape':>9} {'K':>2} | {'floor us':>9} {'treegather':>16} "
        + " ".join(f"{p:>10}" for p in PEERS)
        + f" | {'ahead':>10}"
    )
    for spec in shapes:
        for n in leaves:
            for k in ks:
                shape = shape_of(spec, k)
                case = run_case(n, shape, k, rounds=rounds, device=device, warm_allocator=warm)
                rows.extend(case)
                for op in ("scatter", "gather"):
                    print(_grid_line(op, n, shape, k, case), flush=True)
    return rows


def _grid_line(op: str, n: int, shape: Sequence[int], k: int, case: list[dict[str, Any]]) -> str:
    r = {row["impl"]: row for row in case if row["op"] == op}
    ratios = {name: r[name]["ratio"] for name in ("treegather", *PEERS) if name in r}
    peers = " ".join(f"{r[p]['ratio']:>9.2f}x" if p in r else f"{'-':>10}" for p in PEERS)
    return (
        f"{op:8} {n:>6} {'x'.join(map(str, shape)):>9} {k:>2} | "
        f"{r['floor']['median_us']:>9.1f} "
        f"{r['treegather']['median_us']:>9.1f} {r['treegather']['ratio']:>5.2f}x "
        f"{peers} | {min(ratios, key=ratios.__getitem__):>10}"
    )


def _engine_rows(leaves: list[int], rounds: int, big_leaves: int) -> list[dict[str, Any]]:
    """The compiled layer's rows (:func:`~treegather.benchmarks.engine.engine_cases`), printed."""
    rows: list[dict[str, Any]] = []
    print("\ncompiled layer, K=4 (8x4 tensors):")
    print(f"{'op':8} {'leaves':>6} {'case':>16} | {'baseline us':>11} {'us':>9} {'ratio':>7}")
    for n in leaves:
        for row in engine_cases(n, rounds=rounds, big_leaves=big_leaves):
            rows.append(row)
            print(
                f"{row['op']:8} {n:>6} {row['impl']:>16} | {row['baseline_us']:>11.1f} "
                f"{row['median_us']:>9.1f} {row['ratio']:>6.2f}x",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
