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
runs in well under a minute, ``--json PATH`` saves the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import treegather as tg

__all__ = ["nested_tree", "run_case", "main"]

_ALLOCATOR_READY = False


def prepare_allocator() -> None:
    """Free one 16 MiB tensor, once per process: the allocator state of any training process.

    (glibc's dynamic trim threshold rises past what one call of the benchmark frees; see the
    module docstring.)
    """
    global _ALLOCATOR_READY
    if not _ALLOCATOR_READY:
        block = torch.empty(16 << 20, dtype=torch.uint8)
        del block
        _ALLOCATOR_READY = True


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def nested_tree(n_leaves: int, shape: Sequence[int], depth: int = 3) -> dict[str, Any]:
    """A depth-``depth`` nested dict with ``n_leaves`` tensors of ``shape`` (fan-out balanced).

    >>> t = nested_tree(10, (8, 4))
    >>> len(tg._tree.flatten(t)[0])
    10
    """
    fan = max(2, round(n_leaves ** (1.0 / depth)))
    counter = iter(range(n_leaves))

    def build(level: int, budget: int) -> dict[str, Any]:
        if level == depth - 1 or budget <= fan:
            return {f"leaf{next(counter)}": torch.randn(*shape) for _ in range(budget)}
        per, extra = divmod(budget, fan)
        return {
            f"n{level}_{i}": build(level + 1, per + (1 if i < extra else 0))
            for i in range(fan)
            if per + (1 if i < extra else 0)
        }

    return build(0, n_leaves)


# torch.nn.parallel.scatter_gather-style recursion, with torch.cat so it runs on the CPU.
def _rec_scatter(obj: Any, k: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return list(obj.tensor_split(k))
    if isinstance(obj, dict):
        return [
            type(obj)(z)
            for z in zip(*[[(key, v) for v in _rec_scatter(val, k)] for key, val in obj.items()])
        ]
    return [obj] * k


def _rec_gather(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, dict):
        return type(first)((key, _rec_gather([o[key] for o in outs])) for key in first)
    return outs


def _time(
    fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.thread_time
) -> tuple[float, int]:
    """Seconds per call, and minor page faults over the ``reps`` calls."""
    # CPU time of this thread by default: on a shared machine, time spent descheduled (other
    # tenants, steal) would otherwise land on whichever implementation happened to be running.
    # The garbage collector is off while timing, as timeit does: a collection triggered by one
    # implementation's allocations would otherwise be paid by whichever runs next.
    gc.collect()
    gc.disable()
    try:
        faults = _minor_faults()
        t0 = clock()
        for _ in range(reps):
            fn()
        elapsed = clock() - t0
        return elapsed / reps, _minor_faults() - faults
    finally:
        gc.enable()


def _cuda_impls(
    tree: Any, k: int, leaves: list[Any], outs: list[Any], columns: list[Any]
) -> dict[str, dict[str, Callable[[], Any]]]:
    """On CUDA: CPU batch -> ``cuda:0`` repeated ``k`` times, and back onto ``cuda:0``."""
    from torch.nn.parallel import scatter_gather as torch_sg

    dev = torch.device("cuda", 0)

    def sync(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = fn()
            torch.cuda.synchronize()
            return out

        return run

    return {
        "scatter": {
            "floor": sync(
                lambda: [[p.to(dev, non_blocking=True) for p in x.tensor_split(k)] for x in leaves]
            ),
            "treegather": sync(lambda: tg.scatter(tree, [dev] * k)),
            "recursion": sync(lambda: torch_sg.scatter(tree, [0] * k)),
        },
        "gather": {
            "floor": sync(lambda: [torch.cat(c) for c in columns]),
            "treegather": sync(lambda: tg.gather(outs, dev)),
            "recursion": sync(lambda: torch_sg.gather(outs, 0)),
        },
    }


def _compare(
    fns: dict[str, Callable[[], Any]],
    baseline: str,
    rounds: int,
    target_s: float,
    clock: Callable[[], float] = time.thread_time,
) -> dict[str, tuple[float, float, float]]:
    """Interleaved timing: per implementation (median seconds per call, median ratio to the
    baseline over rounds, page faults per call)."""
    for fn in fns.values():  # warm up (caches, treegather's compiled guards and builders)
        for _ in range(3):
            fn()
    reps = max(1, int(target_s / max(_time(fns[baseline], 3, clock)[0], 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    faults = dict.fromkeys(fns, 0)
    names = list(fns)
    for r in range(rounds):
        # Rotate the order each round so no implementation always runs first (or last).
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, new_faults = _time(fns[name], reps, clock)
            samples[name].append(seconds)
            faults[name] += new_faults
    # The ratio is the median of per-round ratios: each round times every implementation back
    # to back, so slow phases of a shared machine cancel out.
    return {
        name: (
            statistics.median(ts),
            statistics.median(t / b for t, b in zip(ts, samples[baseline])),
            faults[name] / (reps * rounds),
        )
        for name, ts in samples.items()
    }


def engine_cases(
    n_leaves: int, k: int = 4, rounds: int = 15, target_s: float = 0.05
) -> list[dict[str, Any]]:
    """The compiled layer's promises, each a ratio measured side by side in one run:

    - ``alternating``: two structures of ``n_leaves`` taking turns (a GAN step, train and eval
      outputs) against one repeated structure, per call (target <= 1.3x);
    - ``first call``: a call on a structure never seen (made right after the caches were
      cleared; only the call is timed) against a warm call (target <= 3x at 1000 leaves);
    - ``inline by_path``: ``by_path({...})`` written inside the call against the same layout
      hoisted out of the loop (target <= 1.1x).
    """
    prepare_allocator()
    devices = ["cpu"] * k
    tree_a = nested_tree(n_leaves, (8, 4))
    tree_b = {f"b{key}": value for key, value in nested_tree(n_leaves, (8, 4)).items()}
    outs_a, outs_b = list(tg.scatter(tree_a, devices)), list(tg.scatter(tree_b, devices))
    first_key = next(iter(tree_a))
    hoisted = tg.by_path({f"{first_key}.**": "cat"}, default="cat")

    def alternate(fn: Callable[[Any], Any], a: Any, b: Any) -> Callable[[], Any]:
        return lambda: (fn(a), fn(b))

    def repeat_(fn: Callable[[Any], Any], a: Any) -> Callable[[], Any]:
        return lambda: (fn(a), fn(a))

    def scatter(t: Any) -> Any:
        return tg.scatter(t, devices)

    def gather(o: Any) -> Any:
        return tg.gather(o, "cpu")

    cases: dict[tuple[str, str], dict[str, Callable[[], Any]]] = {
        ("scatter", "alternating"): {
            "repeated": repeat_(scatter, tree_a),
            "treegather": alternate(scatter, tree_a, tree_b),
        },
        ("gather", "alternating"): {
            "repeated": repeat_(gather, outs_a),
            "treegather": alternate(gather, outs_a, outs_b),
        },
        ("gather", "inline by_path"): {
            "repeated": lambda: tg.gather(outs_a, "cpu", hoisted),
            "treegather": lambda: tg.gather(
                outs_a, "cpu", tg.by_path({f"{first_key}.**": "cat"}, default="cat")
            ),
        },
    }
    rows = []
    for (op, what), fns in cases.items():
        found = _compare(fns, "repeated", rounds, target_s)
        rows.append(_engine_row(op, what, n_leaves, k, found["repeated"][0], found["treegather"]))
    for op, call in (("scatter", lambda: scatter(tree_a)), ("gather", lambda: gather(outs_a))):
        warm_s, cold_s, ratio = _first_call(call, rounds)
        rows.append(_engine_row(op, "first call", n_leaves, k, warm_s, (cold_s, ratio, 0.0)))
    return rows


def _engine_row(
    op: str, what: str, n: int, k: int, base_s: float, found: tuple[float, float, float]
) -> dict[str, Any]:
    return {
        "op": op,
        "impl": what,
        "leaves": n,
        "replicas": k,
        "median_us": found[0] * 1e6,
        "baseline_us": base_s * 1e6,
        "ratio": found[1],
    }


def _first_call(call: Callable[[], Any], rounds: int, reps: int = 5) -> tuple[float, float, float]:
    """(warm s, first-call s, median of per-round first/warm) for ``call``.

    Each round warms the structure up again (guards and builders compiled), times warm calls,
    then times calls each made right after :func:`treegather.clear_caches` (a structure never
    seen), minus the time clearing takes.
    """
    warm, cold, ratios = [], [], []
    for _ in range(rounds):
        for _ in range(6):  # past COMPILE_AFTER: the compiled guard and builder exist
            call()
        w = _time(call, reps)[0]
        gc.collect()
        gc.disable()
        try:
            spent = 0.0
            for _ in range(reps):
                tg.clear_caches()
                t0 = time.thread_time()
                call()
                spent += time.thread_time() - t0
        finally:
            gc.enable()
        c = spent / reps
        warm.append(w)
        cold.append(c)
        ratios.append(c / w)
    return statistics.median(warm), statistics.median(cold), statistics.median(ratios)


def run_case(
    n_leaves: int,
    shape: Sequence[int],
    k: int,
    rounds: int = 15,
    target_s: float = 0.05,
    device: str = "cpu",
    warm_allocator: bool = True,
) -> list[dict[str, Any]]:
    """Time scatter and gather for one case; returns one row per (op, implementation).

    On ``device="cuda"`` the batch starts on the CPU and goes to ``cuda:0`` repeated ``k``
    times, and "recursion" is torch's own ``scatter_gather`` (which needs CUDA).
    ``target_s`` is the length of one timing sample; ``warm_allocator=False`` skips
    :func:`prepare_allocator`.
    """
    if warm_allocator:
        prepare_allocator()
    devices = [device if device == "cpu" else "cuda:0"] * k
    tree = nested_tree(n_leaves, shape)
    leaves, _ = tg._tree.flatten(tree)
    shards = tg.scatter(tree, devices)
    outs = list(shards)
    columns = list(zip(*[tg._tree.flatten(o)[0] for o in outs]))
    if device == "cpu":
        impls: dict[str, dict[str, Callable[[], Any]]] = {
            "scatter": {
                "floor": lambda: [x.tensor_split(k) for x in leaves],
                "treegather": lambda: tg.scatter(tree, devices),
                "recursion": lambda: _rec_scatter(tree, k),
            },
            "gather": {
                "floor": lambda: [torch.cat(c) for c in columns],
                "treegather": lambda: tg.gather(outs, "cpu"),
                "recursion": lambda: _rec_gather(outs),
            },
        }
    else:
        impls = _cuda_impls(tree, k, leaves, outs, columns)
    clock = time.thread_time if device == "cpu" else time.perf_counter
    rows = []
    for op, fns in impls.items():
        for name, (median_s, ratio, faults) in _compare(
            fns, "floor", rounds, target_s, clock
        ).items():
            rows.append(
                {
                    "op": op,
                    "impl": name,
                    "leaves": n_leaves,
                    "shape": list(shape),
                    "replicas": k,
                    "median_us": median_s * 1e6,
                    "ratio": ratio,
                    "page_faults_per_call": faults,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark and print the table (``python -m treegather.bench --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smaller grid, under a minute")
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
