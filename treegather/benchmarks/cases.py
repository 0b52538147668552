"""The benchmark's table: scatter and gather against the floor, a recursion and the peers.

``nested_tree`` builds a case's batch; ``run_case`` times, for one (leaves, shape, replicas),
the bare torch ops on pre-flattened leaves (``floor``), :mod:`treegather`, a torch
``scatter_gather``-style recursion over dicts (``_rec_scatter`` / ``_rec_gather``; on CUDA,
torch's own ``scatter_gather``) and, on the CPU, the same steps written with a pytree library:
optree (``optree_scatter`` / ``optree_gather``) and torch's C++ pytree,
``torch.utils._cxx_pytree`` (``cxx_scatter`` / ``cxx_gather``). ``transfer_impls`` are the
implementations of a case whose batch moves between devices (the CUDA table, the GPU check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.utils import _cxx_pytree as cxx

import treegather as tg

from .timing import _compare, prepare_allocator


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


# The peers: what a user writes with a pytree library. Scatter flattens the tree, makes one
# tensor_split per leaf and unflattens each device's leaves; gather flattens every replica, makes
# one torch.cat per leaf and unflattens. Neither checks that the replicas agree in structure or
# dtype (treegather's gather does), nor handles non-tensor leaves: the least work a tree-aware
# step can do.
def optree_scatter(tree: Any, k: int) -> list[Any]:
    """``tree`` cut in ``k`` along dim 0 with optree: flatten, split per leaf, unflatten.

    >>> [s["a"].tolist() for s in optree_scatter({"a": torch.arange(3)}, 2)]
    [[0, 1], [2]]
    """
    leaves, spec = optree.tree_flatten(tree)
    columns = [x.tensor_split(k) for x in leaves]
    return [spec.unflatten([c[r] for c in columns]) for r in range(k)]


def optree_gather(outs: Sequence[Any]) -> Any:
    """The replicas' trees joined with optree: flatten each, one ``torch.cat`` per leaf.

    >>> optree_gather([{"a": torch.arange(2)}, {"a": torch.arange(1)}])["a"].tolist()
    [0, 1, 0]
    """
    flat = [optree.tree_flatten(o) for o in outs]
    return flat[0][1].unflatten([torch.cat(c) for c in zip(*(leaves for leaves, _ in flat))])


def cxx_scatter(tree: Any, k: int) -> list[Any]:
    """As :func:`optree_scatter`, with ``torch.utils._cxx_pytree`` (torch's C++ pytree).

    >>> [s["a"].tolist() for s in cxx_scatter({"a": torch.arange(3)}, 2)]
    [[0, 1], [2]]
    """
    leaves, spec = cxx.tree_flatten(tree)
    columns = [x.tensor_split(k) for x in leaves]
    return [cxx.tree_unflatten([c[r] for c in columns], spec) for r in range(k)]


def cxx_gather(outs: Sequence[Any]) -> Any:
    """As :func:`optree_gather`, with ``torch.utils._cxx_pytree``.

    >>> cxx_gather([{"a": torch.arange(2)}, {"a": torch.arange(1)}])["a"].tolist()
    [0, 1, 0]
    """
    flat = [cxx.tree_flatten(o) for o in outs]
    return cxx.tree_unflatten(
        [torch.cat(c) for c in zip(*(leaves for leaves, _ in flat))], flat[0][1]
    )


def transfer_impls(
    tree: Any, devices: Sequence[torch.device], outs: Sequence[Any], to: torch.device
) -> dict[str, dict[str, Callable[[], Any]]]:
    """A CPU batch ``tree`` onto ``devices`` (scatter), and the replicas' outputs ``outs``
    onto ``to`` (gather), three ways each:

    - ``floor``: per-leaf ``.to()``: one ``tensor_split`` per leaf and one ``.to(device)`` per
      piece; gather: one ``.to(to)`` per piece and one ``torch.cat`` per leaf;
    - ``treegather``: :func:`treegather.scatter` / :func:`treegather.gather`;
    - ``recursion``: torch's own ``torch.nn.parallel.scatter_gather`` (``Scatter`` and
      ``Gather``), which takes CUDA devices only: a caller runs it once to learn whether it
      accepts ``devices`` and ``to``.

    Each call waits for the CUDA device (``torch.cuda.synchronize``) when any is involved.

    >>> tree = {"a": torch.arange(4.0)}
    >>> impls = transfer_impls(tree, [torch.device("cpu")] * 2, tg.scatter(tree, ["cpu"] * 2), torch.device("cpu"))
    >>> [p.tolist() for p in impls["scatter"]["floor"]()[0]], impls["gather"]["treegather"]()["a"].tolist()
    ([[0.0, 1.0], [2.0, 3.0]], [0.0, 1.0, 2.0, 3.0])
    """
    from torch.nn.parallel import scatter_gather as torch_sg

    k = len(devices)
    leaves, _ = tg._tree.flatten(tree)
    columns = list(zip(*[tg._tree.flatten(o)[0] for o in outs]))
    cuda = any(d.type == "cuda" for d in (*devices, to))
    # (torch's Gather takes "cpu" for the host, its Scatter device indices)
    target: Any = "cpu" if to.type == "cpu" else to.index or 0
    indices = [d.index if d.type == "cuda" else d for d in devices]

    def sync(fn: Callable[[], Any]) -> Callable[[], Any]:
        if not cuda:
            return fn

        def run() -> Any:
            out = fn()
            torch.cuda.synchronize()
            return out

        return run

    def floor_scatter() -> Any:
        return [
            [p.to(d, non_blocking=True) for p, d in zip(x.tensor_split(k), devices)] for x in leaves
        ]

    def floor_gather() -> Any:
        if all(d == to for d in devices):  # (the pieces are where the result goes)
            return [torch.cat(c) for c in columns]
        return [torch.cat([p.to(to) for p in c]) for c in columns]

    return {
        "scatter": {
            "floor": sync(floor_scatter),
            "treegather": sync(lambda: tg.scatter(tree, list(devices))),
            "recursion": sync(lambda: torch_sg.scatter(tree, indices)),
        },
        "gather": {
            "floor": sync(floor_gather),
            "treegather": sync(lambda: tg.gather(outs, to)),
            "recursion": sync(lambda: torch_sg.gather(outs, target)),
        },
    }


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

    The implementations (``impl``): ``floor``, ``treegather``, ``recursion``, and on the CPU
    the peers ``optree`` and ``cxx_pytree``, all timed in the same interleaved rounds; each
    row's ``ratio`` is the median of its per-round ratios to the floor. On ``device="cuda"``
    the batch starts on the CPU and goes to ``cuda:0`` repeated ``k`` times, "recursion" is
    torch's own ``scatter_gather`` (which needs CUDA), and there are no peer rows.
    ``target_s`` is the length of one timing sample; ``warm_allocator=False`` skips
    :func:`prepare_allocator`.
    """
    if warm_allocator:
        prepare_allocator()
    devices = [device if device == "cpu" else "cuda:0"] * k
    tree = nested_tree(n_leaves, shape)
    shards = tg.scatter(tree, devices)
    outs = list(shards)
    if device == "cpu":
        leaves, _ = tg._tree.flatten(tree)
        columns = list(zip(*[tg._tree.flatten(o)[0] for o in outs]))
        impls: dict[str, dict[str, Callable[[], Any]]] = {
            "scatter": {
                "floor": lambda: [x.tensor_split(k) for x in leaves],
                "treegather": lambda: tg.scatter(tree, devices),
                "recursion": lambda: _rec_scatter(tree, k),
                "optree": lambda: optree_scatter(tree, k),
                "cxx_pytree": lambda: cxx_scatter(tree, k),
            },
            "gather": {
                "floor": lambda: [torch.cat(c) for c in columns],
                "treegather": lambda: tg.gather(outs, "cpu"),
                "recursion": lambda: _rec_gather(outs),
                "optree": lambda: optree_gather(outs),
                "cxx_pytree": lambda: cxx_gather(outs),
            },
        }
    else:
        # CPU batch -> cuda:0 repeated k times, and back onto cuda:0
        cuda = torch.device("cuda", 0)
        impls = transfer_impls(tree, [cuda] * k, outs, cuda)
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
