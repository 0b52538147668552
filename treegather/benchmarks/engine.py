"""The benchmark's compiled-layer rows: alternating structures, first calls, inline layouts.

Each of :func:`engine_cases`' rows is a ratio measured side by side in one run against a
baseline of the same work done the easy way (one repeated structure, a warm call, a hoisted
layout).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import treegather as tg

from .cases import nested_tree
from .timing import _compare, _time, frozen_heap, prepare_allocator


def engine_cases(
    n_leaves: int,
    k: int = 4,
    rounds: int = 15,
    target_s: float = 0.05,
    big_leaves: int = 100_000,
) -> list[dict[str, Any]]:
    """The compiled layer's promises, each a ratio measured side by side in one run:

    - ``alternating``: two structures of ``n_leaves`` taking turns (a GAN step, train and eval
      outputs) against one repeated structure, per call (target <= 1.3x);
    - ``first call``: a call on a structure never seen (made right after the caches were
      cleared; only the call is timed) against a warm call (target <= 3x at 1000 leaves);
    - ``inline by_path``: ``by_path({...})`` written inside the call against the same layout
      hoisted out of the loop (target <= 1.1x);
    - ``rotating N``: N structures of ``n_leaves`` taken in turn, more than the compiled layer
      keeps per root type (16), against a call on a structure never seen, made in the same
      state (target <= 1x: a rotation costs at most what a cold call costs);
    - ``after a big one``: a structure made before a ``big_leaves``-leaf dict (whose first keys
      are its own) was used 8 times, against one made after it, per call: a structure's cost
      must not depend on what else was seen (target <= 1.1x).
    """
    with frozen_heap():  # (the timed calls' collections visit only what they made)
        return _engine_cases(n_leaves, k, rounds, target_s, big_leaves)


def _engine_cases(
    n_leaves: int, k: int, rounds: int, target_s: float, big_leaves: int
) -> list[dict[str, Any]]:
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
    # A structure seen before a big one (tree_a) against one seen after it (tree_c).
    tree_c = _renamed(tree_a, "c")
    outs_c = list(tg.scatter(tree_c, devices))
    for _ in range(6):
        scatter(tree_a), gather(outs_a)
    big = dict(tree_a)  # (tree_a's keys first, then big_leaves more tensors)
    big.update((f"big{i}", torch.zeros(8, 4)) for i in range(big_leaves))
    outs_big = list(tg.scatter(big, devices))
    for _ in range(8):
        scatter(big), gather(outs_big)
    del big, outs_big
    for _ in range(6):
        scatter(tree_c), gather(outs_c)
    cases[("scatter", "after a big one")] = {
        "repeated": lambda: scatter(tree_c),
        "treegather": lambda: scatter(tree_a),
    }
    cases[("gather", "after a big one")] = {
        "repeated": lambda: gather(outs_c),
        "treegather": lambda: gather(outs_a),
    }
    rows = []
    for (op, what), fns in cases.items():
        found = _compare(fns, "repeated", rounds, target_s)
        rows.append(_engine_row(op, what, n_leaves, k, found["repeated"][0], found["treegather"]))
    for op, call in (("scatter", lambda: scatter(tree_a)), ("gather", lambda: gather(outs_a))):
        warm_s, cold_s, ratio = _first_call(call, rounds)
        rows.append(_engine_row(op, "first call", n_leaves, k, warm_s, (cold_s, ratio, 0.0)))
    for n in ROTATIONS:
        for op, fn, base in (("scatter", scatter, tree_a), ("gather", _gather_all, outs_a)):
            cold_s, turn_s, ratio = _rotation(fn, base, n, rounds)
            rows.append(_engine_row(op, f"rotating {n}", n_leaves, k, cold_s, (turn_s, ratio, 0.0)))
    return rows


ROTATIONS = (20, 64, 256)


def _gather_all(outs: list[Any]) -> Any:
    return tg.gather(outs, "cpu")


def _renamed(base: Any, prefix: str) -> Any:
    """``base`` (a dict, or one dict per replica) with its top-level keys renamed: another
    structure, sharing every subtree and tensor."""
    if isinstance(base, list):
        return [_renamed(tree, prefix) for tree in base]
    return {f"{prefix}{key}": value for key, value in base.items()}


def _rotation(
    call: Callable[[Any], Any], base: Any, n: int, rounds: int, reps: int = 5
) -> tuple[float, float, float]:
    """(cold s, rotation s per call, median of per-round rotation/cold) for ``call`` on ``n``
    structures made from ``base`` taken in turn.

    The rotation is warmed up by full turns: six up to 32 structures (the structures kept are
    compiled on their third hit), two above (where most calls are not served by the cache
    whatever it compiled); each of at most three rounds then times ``min(n, 16)`` calls
    continuing it, and ``reps`` calls each on a structure never seen (in the same state: the
    rotation's structures cached), as a cold call in a long-running process is.
    """
    items = [_renamed(base, f"r{j}_") for j in range(n)]
    for _ in range(6 if n <= 32 else 2):
        for item in items:
            call(item)
    turn, cold, ratios = [], [], []
    i = fresh = 0
    m = min(n, 16)
    for _ in range(min(rounds, 3)):
        batch = [items[(i + j) % n] for j in range(m)]
        i += m
        news = [_renamed(base, f"new{fresh + j}_") for j in range(reps)]
        fresh += reps
        gc.collect()
        gc.disable()
        try:
            t0 = time.thread_time()
            for item in batch:
                call(item)
            t = (time.thread_time() - t0) / m
            t0 = time.thread_time()
            for item in news:
                call(item)
            c = (time.thread_time() - t0) / reps
        finally:
            gc.enable()
        turn.append(t)
        cold.append(c)
        ratios.append(t / c)
    return statistics.median(cold), statistics.median(turn), statistics.median(ratios)


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
