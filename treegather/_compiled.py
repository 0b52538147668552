"""The compiled layer: every cache and every speed trick of scatter and gather, behind guards.

The plain path (:func:`treegather._scatter.scatter_reference`,
:func:`treegather._gather.gather_reference`) defines what scatter and gather do: flatten,
resolve the plan, validate, apply each leaf's rule, unflatten. This module makes the same steps
cheap for a structure seen before, and nothing else in the package caches or learns:

1. **Recognise the structure.** Structures seen twice get a :class:`Structure`: their spec, a
   guard (:mod:`treegather._codegen`) that checks a tree has exactly that structure, and
   the leaf types seen. A tree that passes the guard is flattened with one
   ``spec.flatten_up_to`` (C, no dict-key sorting: about 8x cheaper than a full flatten);
   the guard runs first, so that call cannot fail and optree never formats the tree into an
   error. A tree that no guard accepts is flattened the plain way, as a cold call would.
2. **Keep the plan.** Each structure keeps its resolved plans keyed by the layout's value
   (:func:`treegather._layout.layout_key`: type-aware, so ``True`` is not ``1``), so an
   inline ``by_path({...})`` finds the plan an equal layout resolved last step.
3. **Run an executor.** The per-step cases (default rules, every leaf a CPU tensor) run one
   ``tensor_split`` / ``torch.cat`` per leaf, called from C, and build the k device trees with
   a compiled builder. Anything unusual (a guard fails, a leaf is not a tensor, torch refuses)
   is *not applicable*: the reference steps run from there, with the leaves and plan already
   at hand, and produce the result or the error exactly as a cold call would.

Guards and builders are compiled to Python source once a structure has been seen
``COMPILE_AFTER`` times; caches are bounded LRUs registered with
:func:`treegather.clear_caches`, and registering a tree node clears them.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator
from itertools import chain, repeat
from typing import Any

import torch
from optree import PyTreeSpec

from . import _gather as _g
from . import _scatter as _s
from . import _tree
from ._builders import Builder, compiled_builder, compiled_unflatten
from ._caches import LRU
from ._codegen import (
    Reach,
    Reader,
    Step,
    compiled_columns,
    compiled_reader,
    interpreted_guard,
    structure_steps,
)
from ._devices import accelerator_tensors_possible
from ._layout import ByPath, Plan, layout_key, resolve
from ._rules import Rule
from ._transfer import coalesced_to

__all__ = ["COMPILE_AFTER", "Structure", "find", "gather", "recognise", "reference_only", "scatter"]

Tensor = torch.Tensor
COMPILE_AFTER = 3  # sightings of a structure before its guard and builders are compiled
_BUCKET = 16  # structures kept per root type
_PLANS_PER_STRUCTURE = 16

# Root type -> the structures recently seen with that root type, newest first.
_STRUCTURES: LRU[type, list[Structure]] = LRU("structures", 64)
# Structures seen once (by spec equality): a second sighting makes a Structure. The count is
# only a hint (== merges True and 1 in metadata); the guard is made from the current spec.
_SIGHTINGS: LRU[PyTreeSpec, bool] = LRU("structure sightings", 256)


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
_TENSORS = frozenset([Tensor])
# Up to this many leaves x replicas, gather's reader also compares dtypes (faster for small
# trees; above, one map over the leaves is cheaper than the generated comparisons).
_FUSED_DTYPE_CELLS = 1024
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


class Structure:
    """One exact structure seen before, and what the compiled layer keeps for it."""

    __slots__ = (
        "builders",
        "columns",
        "guard",
        "hits",
        "last",
        "leaf_types",
        "plans",
        "reach",
        "read",
        "read_any",
        "rebuild",
        "spec",
        "steps",
        "version",
    )

    def __init__(
        self,
        spec: PyTreeSpec,
        steps: list[Step],
        reach: list[Reach],
        leaves: list[Any],
        version: int,
    ) -> None:
        self.spec = spec
        self.steps = steps
        self.reach = reach
        self.guard = interpreted_guard(steps)
        # read(tree): the tree's leaves when it has exactly this structure (dict keys in order
        # and by type: a result is rebuilt from it), else None. read_any, for gather's replicas
        # 1..: the same containers, dict keys in any order compared with == (as the reference
        # compares replicas). Both start as the interpreted guard and one flatten_up_to, and
        # become one generated function each once the structure is a regular.
        self.read: Reader = self._read_checked
        self.read_any: Reader = self._read_checked
        self.leaf_types = frozenset(map(type, leaves))
        self.version = version
        self.hits = 0
        self.plans: dict[Any, tuple[Plan, bool]] = {}
        # The last immutable layout asked for, by identity: (layout, phase, root, dim, found).
        self.last: tuple[Any, ...] = (_NO_LAYOUT,)
        self.builders: dict[int, Builder | None] = {}
        # k -> (reader, whether it also checks one dtype per leaf across replicas, the plain
        # reader when it does)
        self.columns: dict[int, tuple[Reader, bool, Reader]] = {}
        self.rebuild: Callable[[list[Any]], Any] = spec.unflatten

    def _read_checked(self, tree: Any) -> list[Any] | None:
        # The guard first: then flatten_up_to cannot fail (nor format the tree into an error).
        if self.guard(tree):
            leaves: list[Any] = self.spec.flatten_up_to(tree)
            return leaves
        return None

    def _columns_checked(self, trees: list[Any]) -> list[Any] | None:
        rows = [self.read(trees[0]), *map(self.read_any, trees[1:])]
        return None if None in rows else list(zip(*rows))

    def columns_reader(self, k: int) -> tuple[Reader, bool, Reader]:
        """For gather: ``read(trees)`` of k replicas is their columns (leaf i of each replica,
        a tuple) when replica 0 has exactly this structure and the others the same containers
        (keys in any order, compared with ==, as the reference compares replicas), else None.

        For a small structure of tensors the reader also requires one dtype per leaf across
        replicas (the flag says so), and the third item is the reader without that check.
        """
        found = self.columns.get(k)
        if found is not None:
            return found
        if self.hits < COMPILE_AFTER:
            return self._columns_checked, False, self._columns_checked
        plain = compiled_columns(self.steps, self.reach, k) or self._columns_checked
        found = (plain, False, plain)
        if self.leaf_types == _TENSORS and len(self.reach) * k <= _FUSED_DTYPE_CELLS:
            fused = compiled_columns(self.steps, self.reach, k, same_dtype=True)
            if fused is not None:
                found = (fused, True, plain)
        if len(self.columns) >= 4:
            self.columns.clear()
        self.columns[k] = found
        return found

    def seen(self) -> None:
        """Count a hit; compile the readers once the structure is clearly a regular."""
        self.hits += 1
        if self.hits == COMPILE_AFTER:
            self.read = compiled_reader(self.steps, self.reach)
            self.read_any = compiled_reader(self.steps, self.reach, keys="any")
            self.rebuild = compiled_unflatten(self.spec) or self.spec.unflatten

    def leaves_ok(self, leaves: list[Any]) -> bool:
        """Every value is a leaf (``flatten_up_to`` lets a subtree or None stand in for one)."""
        types = list(map(type, leaves))
        if types.count(Tensor) == len(types):
            return True
        known = self.leaf_types
        return all(t in known or _tree.is_leaf(v) for t, v in zip(types, leaves))

    def builder(self, k: int) -> Builder | None:
        """The compiled builder of k device trees, once the structure is a regular."""
        try:
            return self.builders[k]
        except KeyError:
            pass
        if self.hits < COMPILE_AFTER:
            return None
        if len(self.builders) >= 4:
            self.builders.clear()
        build = self.builders[k] = compiled_builder(self.spec, k)
        return build

    def cached_plan(self, layout: Any, phase: str, dim: int, root: str | None) -> Any:
        """The ``(plan, all batched)`` kept for an equal layout, or ``None``."""
        last = self.last
        if last[0] is layout and last[1] is phase and last[2] is root and last[3] is dim:
            return last[4]
        found = self.plans.get(_plan_key(layout, phase, dim, root))
        if found is not None and _immutable(layout):
            # (a mutable layout may change between calls: keyed by value each time)
            self.last = (layout, phase, root, dim, found)
        return found

    def plan(
        self, layout: Any, phase: str, dim: int, root: str | None, leaves: list[Any]
    ) -> tuple[Plan, bool] | None:
        """The plan (resolved once per equal layout) and whether it is the per-step case: the
        default rules, and every leaf a >= 1-dim tensor (at least one).

        ``leaves`` are one tree's values at this structure's leaves. ``None`` when the plan is
        not cached yet and ``leaves`` are not all leaves (a subtree or ``None`` where this
        structure has a leaf): the caller runs the reference steps.
        """
        found: tuple[Plan, bool] | None = self.cached_plan(layout, phase, dim, root)
        if found is not None:
            return found
        if not self.leaves_ok(leaves):  # a subtree where a leaf is: not this structure's plan
            return None
        plan = resolve(self.spec, layout, phase, dim, root)
        found = (plan, plan.default_only and bool(leaves) and _all_batched(leaves))
        if len(self.plans) >= _PLANS_PER_STRUCTURE:
            self.plans.clear()
        self.plans[_plan_key(layout, phase, dim, root)] = found
        if _immutable(layout):
            self.last = (layout, phase, root, dim, found)
        return found


def _plan_key(layout: Any, phase: str, dim: int, root: str | None) -> Any:
    plain = type(layout) in (type(None), str, int, ByPath)  # their hash is a typed value
    return (phase, root, type(dim), dim, type(layout), layout if plain else layout_key(layout))


_NO_LAYOUT: Any = object()


def _immutable(layout: Any) -> bool:
    """Layouts whose value cannot change (hashing them is their value key)."""
    return layout is None or type(layout) in (str, int, ByPath) or isinstance(layout, Rule)


def _all_batched(leaves: list[Any]) -> bool:
    return all(type(x) is Tensor and x.dim() > 0 for x in leaves)


def find(tree: Any) -> tuple[Structure, list[Any]] | None:
    """The :class:`Structure` that accepts ``tree`` (containers only) and the tree's leaves."""
    bucket = _STRUCTURES.get(type(tree))
    if bucket:
        version = _tree.registry_version()
        for st in bucket:
            if st.version == version:
                leaves = st.read(tree)
                if leaves is not None:
                    return st, leaves
    return None


def recognise(tree: Any) -> tuple[list[Any], Structure | None, PyTreeSpec]:
    """The leaves of ``tree``, its :class:`Structure` when seen before, and its spec.

    A hit costs the structure's reader; a miss costs one full flatten.
    """
    found = find(tree)
    if found is not None:
        st, leaves = found
        if st.leaves_ok(leaves):
            st.seen()
            return leaves, st, st.spec
        # The containers match but a leaf is a subtree: never learned.
        leaves, spec = _tree.flatten(tree)
        return leaves, None, spec
    leaves, spec = _tree.flatten(tree)
    return leaves, _learn(tree, spec, leaves, _tree.registry_version()), spec


def _learn(tree: Any, spec: PyTreeSpec, leaves: list[Any], version: int) -> Structure | None:
    """A :class:`Structure` for a spec seen before; only a sighting the first time."""
    try:
        if _SIGHTINGS.pop(spec) is None:
            _SIGHTINGS.put(spec, True)
            return None
    except TypeError:  # unhashable metadata: never cached
        return None
    found = structure_steps(spec)
    if found is None:
        return None
    st = Structure(spec, *found, leaves, version)
    bucket = [st, *(_STRUCTURES.get(type(tree)) or ())][:_BUCKET]
    _STRUCTURES.put(type(tree), bucket)
    return st


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
    bucket = _STRUCTURES.get(type(outputs[0]))
    if bucket:
        version = _tree.registry_version()
        k = len(outputs)
        for st in bucket:
            if st.version == version:
                read, same_dtypes, plain = st.columns.get(k) or st.columns_reader(k)
                columns = read(outputs)
                if columns is None and same_dtypes:  # a dtype differs, or a value has none
                    columns, same_dtypes = plain(outputs), False
                if columns is not None:
                    if st.hits < COMPILE_AFTER:
                        st.seen()
                    return _gather_seen(
                        st, outputs, columns, same_dtypes, target, layout, dim, sizes
                    )
    # Replicas whose structure is not replica 0's exactly (keys in another order, or a real
    # mismatch), or a structure not seen before: the reference steps.
    leaves0, st, spec0 = recognise(outputs[0])
    if st is None:
        plan = resolve(spec0, layout, _GATHER, dim, _g.ROOT)
    else:
        plan = st.plan(layout, _GATHER, dim, _g.ROOT, leaves0)[0]  # type: ignore[index]
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
