"""The compiled layer: every cache and every speed trick of scatter and gather, behind guards.

The plain path (:func:`treegather._scatter.scatter_reference`,
:func:`treegather._gather.gather_reference`) defines what scatter and gather do: flatten,
resolve the plan, validate, apply each leaf's rule, unflatten. This module makes the same steps
cheap for a structure seen before, and nothing else in the package caches or learns:

1. **Recognise the structure and keep its plans** (:mod:`treegather._structure`): a generated
   reader checks a tree has exactly a structure seen before and reads its leaves in one call;
   plans are kept per structure, keyed by the layout's value.
2. **Run an executor.** The per-step cases (default rules, every leaf a tensor) run one
   ``tensor_split`` / ``torch.cat`` per leaf, called from C, build the k device trees with a
   compiled builder (:mod:`treegather._builders`), and move small tensors between host and
   GPU in one copy per dtype (:mod:`treegather._transfer`). Anything unusual (a guard fails, a
   leaf is not a tensor, torch refuses) is *not applicable*: the reference steps run from
   there, with the leaves and plan already at hand, and produce the result or the error
   exactly as a cold call would.

Guards, readers and builders are compiled to Python source once a structure has been seen
``COMPILE_AFTER`` times; caches are bounded LRUs registered with
:func:`treegather.clear_caches`, and registering a tree node clears them.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from itertools import chain, repeat
from typing import Any

import torch

from . import _gather as _g
from . import _scatter as _s
from ._devices import accelerator_tensors_possible
from ._layout import resolve
from ._structure import COMPILE_AFTER, Structure, find, find_columns, recognise
from ._transfer import coalesced_to

__all__ = ["COMPILE_AFTER", "Structure", "find", "gather", "recognise", "reference_only", "scatter"]

Tensor = torch.Tensor


class _Local(threading.local):
    off = False  # reference_only() in this thread


_LOCAL = _Local()
# len() of a tensor without the Python-level Tensor.__len__ wrapper (same result, torch function
# modes still honoured; 0 for a 0-dim tensor): about 40% cheaper than reading .shape.
_TENSOR_LEN = getattr(getattr(torch._C, "TensorBase", None), "__len__", None)
_IS_CPU = operator.attrgetter("is_cpu")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_FIRST = operator.itemgetter(0)
_GATHER = "gather"  # the phase (plans are looked up by identity first)


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Within this block (in this thread) scatter and gather run the plain path only.

    For differential tests: the same call with and without the compiled layer.
    """
    before = _LOCAL.off
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = before


# --------------------------------------------------------------------------------- scatter


def scatter(
    inputs: Any, devs: tuple[torch.device, ...], layout: Any, dim: int, root: str | None
) -> Any:
    """:func:`treegather.scatter` for a structure seen before; the reference steps otherwise."""
    if _LOCAL.off:
        return _s.scatter_reference(inputs, devs, layout, dim, root)
    leaves, st, spec = recognise(inputs)
    if st is None:
        plan = resolve(spec, layout, "scatter", dim, root)
    else:
        plan = st.plan(layout, "scatter", dim, root, leaves)[0]  # type: ignore[index]
        if plan.default_only:
            kinds = [d.type for d in devs]
            if kinds.count("cpu") == len(devs):
                fast = _scatter_cpu_tensors(leaves, st, devs, dim)
            elif kinds.count("cuda") == len(devs):  # a CPU batch to the GPUs: coalesced copies
                fast = _scatter_cpu_tensors(leaves, st, devs, dim, move=True)
            else:
                fast = None
            if fast is not None:
                return fast
    return _s.place(inputs, leaves, plan, devs, dim, root)


def _scatter_cpu_tensors(
    leaves: list[Any], st: Structure, devs: tuple[torch.device, ...], dim: int, move: bool = False
) -> _s.Shards | None:
    """Default rules, every leaf a CPU tensor of >= 1 dim with one batch size: split in C;
    with ``move``, each device's pieces are then copied there with :func:`coalesced_to` (one
    copy per dtype for the small ones).

    ``None`` (not applicable) for anything else: the reference steps handle and report it.
    """
    count = len(leaves)
    if not count or list(map(type, leaves)).count(Tensor) != count:
        return None
    if not all(map(_IS_CPU, leaves)):  # (a meta tensor is not on the CPU either)
        return None
    try:
        if dim == 0 and _TENSOR_LEN is not None:
            sizes = set(map(_TENSOR_LEN, leaves))  # 0 for a 0-dim tensor
        else:
            sizes = set(map(operator.itemgetter(dim), map(_SHAPE, leaves)))
    except IndexError:  # a 0-dim tensor, or a dim out of range
        return None
    if len(sizes) != 1 or 0 in sizes:
        return None
    n = sizes.pop()
    k = min(n, len(devs))
    split = Tensor.tensor_split  # looked up per call, as x.tensor_split would be
    try:
        if dim:
            columns = list(map(split, leaves, repeat(k, count), repeat(dim, count)))
        else:
            columns = list(map(split, leaves, repeat(k, count)))
    except (RuntimeError, NotImplementedError):  # sparse or nested: the reference explains
        return None
    if move:
        rows = [coalesced_to(row, d) for row, d in zip(zip(*columns), devs)]
        columns = list(zip(*rows))
    build = st.builder(k)
    if build is not None:
        trees = build(*columns)
    else:
        unflatten = st.spec.unflatten
        trees = [unflatten(c) for c in zip(*columns)]
    return _s.Shards(trees, _s.balanced(n, k), devs[:k])


# ---------------------------------------------------------------------------------- gather


def gather(
    outputs: list[Any],
    target: torch.device,
    layout: Any,
    dim: int,
    sizes: tuple[int, ...] | None,
) -> Any:
    """:func:`treegather.gather` for a structure seen before; the reference steps otherwise."""
    if _LOCAL.off:
        return _g.gather_reference(outputs, target, layout, dim, sizes)
    found = find_columns(outputs)
    if found is not None:
        return _gather_seen(found[0], outputs, found[1], found[2], target, layout, dim, sizes)
    # Replicas whose structure is not replica 0's exactly (keys in another order, or a real
    # mismatch), or a structure not seen before: the reference steps.
    leaves0, seen, spec0 = recognise(outputs[0])
    if seen is None:
        plan = resolve(spec0, layout, _GATHER, dim, _g.ROOT)
    else:
        plan = seen.plan(layout, _GATHER, dim, _g.ROOT, leaves0)[0]  # type: ignore[index]
    return _g.gather_from(outputs, leaves0, plan, target, dim, sizes)


def _gather_seen(
    st: Structure,
    outputs: list[Any],
    columns: list[tuple[Any, ...]],
    same_dtypes: bool,
    target: torch.device,
    layout: Any,
    dim: int,
    sizes: tuple[int, ...] | None,
) -> Any:
    """Every replica has ``st``'s structure; ``columns[i]`` holds leaf i of each replica, and
    ``same_dtypes`` says each column was found to have one dtype."""
    last = st.last  # (the same layout object as last call: Structure.cached_plan's first test)
    if last[0] is layout and last[1] is _GATHER and last[3] is dim and last[2] is _g.ROOT:
        found = last[4]
    else:
        found = st.cached_plan(layout, _GATHER, dim, _g.ROOT)
    if found is None:
        found = st.plan(layout, _GATHER, dim, _g.ROOT, list(map(_FIRST, columns)))
        if found is None:
            return _g.gather_reference(outputs, target, layout, dim, sizes)
    plan, per_step = found
    if plan.up_spec is not st.spec:  # whole-value groups: the reference steps take them
        row0 = list(map(_FIRST, columns))
        if not st.leaves_ok(row0):
            return _g.gather_reference(outputs, target, layout, dim, sizes)
        return _g.gather_from(outputs, row0, plan, target, dim, sizes)
    if per_step and target.type == "cpu":
        # The per-step case: default rules, all tensors (replica 0's, when the plan was made).
        # torch.cat refuses anything but tensors and mismatched shapes; then the reference
        # steps below explain the problem.
        try:
            # One dtype per leaf across replicas (torch.cat would promote silently); a value
            # without a dtype (a subtree or None where a leaf should be) stops here.
            if same_dtypes or _one_dtype_per_leaf(columns, len(outputs)):
                if columns[0][0].is_cpu:  # (torch.cat refuses tensors on other devices)
                    if dim:
                        return st.rebuild([torch.cat(c, dim) for c in columns])
                    return st.rebuild(list(map(torch.cat, columns)))
                if accelerator_tensors_possible():  # replicas on GPUs
                    return st.rebuild(_cat_on_host(columns, target, dim))
        except (TypeError, RuntimeError, AttributeError, IndexError):
            pass  # the reference steps below explain it
    if not st.leaves_ok(list(chain.from_iterable(columns))):  # a subtree where a leaf is
        return _g.gather_reference(outputs, target, layout, dim, sizes)
    return _g.combine(outputs, columns, plan, target, dim, sizes)


def _one_dtype_per_leaf(columns: list[tuple[Any, ...]], k: int) -> bool:
    dtypes = list(map(_DTYPE, chain.from_iterable(columns)))  # leaf-major
    first = dtypes[::k]
    return all(dtypes[r::k] == first for r in range(1, k))


def _cat_on_host(columns: list[tuple[Any, ...]], host: torch.device, dim: int) -> list[Tensor]:
    """One ``torch.cat`` per leaf on the host, each replica's small leaves copied there in one
    copy per dtype (:func:`coalesced_to`) instead of one per leaf."""
    moved = [coalesced_to(row, host) for row in zip(*columns)]
    return [torch.cat(c, dim) for c in zip(*moved)]
