"""What the compiled layer keeps per structure: recognising a tree seen before, and its plans.

Structures seen twice get a :class:`Structure`: their spec, a guard (:mod:`treegather._compiled.codegen`)
that checks a tree has exactly that structure, the leaf types seen, and the plans resolved for
it. Until a structure has been seen ``COMPILE_AFTER`` times its guard is interpreted and a tree
that passes it is flattened with one ``spec.flatten_up_to`` (C, no dict-key sorting; the guard
runs first, so that call cannot fail and optree never formats the tree into an error); then
generated readers do the guard and every leaf read in one call. A tree that no structure
accepts is flattened the plain way, as a cold call would. Plans are kept per structure, keyed
by the layout's value (:func:`treegather._layout.layout_key`: type-aware, so ``True`` is not
``1``), so an inline ``by_path({...})`` finds the plan an equal layout resolved last step.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
from optree import PyTreeSpec

from .. import _tree
from .._caches import LRU
from .._layout import ByPath, Plan, layout_key, rebase, resolve
from .._rules import Rule
from .builders import Builder, compiled_builder, compiled_unflatten
from .codegen import (
    Reach,
    Reader,
    Step,
    compiled_columns,
    compiled_reader,
    interpreted_guard,
    sharing,
    structure_steps,
)

__all__ = ["COMPILE_AFTER", "Structure", "bucket_key", "find", "find_columns", "recognise"]

Tensor = torch.Tensor
COMPILE_AFTER = 3  # sightings of a structure before its guard and builders are compiled
_BUCKET = 16  # structures kept per root (its type and, for a builtin container, its length)
_PLANS_PER_STRUCTURE = 16
_MAX_COMPILE_AFTER = 3 << 10  # hits an often-evicted structure needs before its code is made

# Root (see bucket_key) -> the structures recently seen with that root, the last found first
# (see _learn for which a full bucket takes in; it evicts its least recently used structure into
# _SIGHTINGS). Keyed by the root's length too, so that a structure is never checked against
# those of other lengths: what a call costs does not depend on what else was seen.
_STRUCTURES: LRU[Any, list[Structure]] = LRU("structures", 256)
# By spec equality: when a structure was last seen (a stamp of _CLOCK) while not in a bucket
# (seen again, it may make a Structure), or a Structure evicted from its bucket, without its
# generated code (seen again, it serves the call with its plans, or is taken back). Only a
# hint (== merges True and 1 in metadata): the current tree is checked by the guard.
_SIGHTINGS: LRU[PyTreeSpec, Any] = LRU("structure sightings", 256)
_CLOCK = itertools.count()  # stamps each structure's last use
_USED = operator.attrgetter("used")
_TENSORS = frozenset([Tensor])
# Up to this many leaves x replicas, gather's reader also compares dtypes (faster for small
# trees; above, one map over the leaves is cheaper than the generated comparisons).
_FUSED_DTYPE_CELLS = 1024


class Structure:
    """One exact structure seen before, and what the compiled layer keeps for it."""

    __slots__ = (
        "builders",
        "columns",
        "compile_after",
        "exact",
        "exact_paths",
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
        "used",
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
        # Whether a tree this structure accepts differs from ``spec`` in its leaves only (see
        # codegen.sharing): then results are rebuilt from ``spec``; otherwise from the structure
        # of the call's own tree, as the plain path does (and plans are rebased onto it).
        self.exact, self.exact_paths = sharing(steps)
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
        # Hits before the code is generated: COMPILE_AFTER, doubled each time it is evicted.
        self.compile_after = COMPILE_AFTER
        self.used = next(_CLOCK)
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
        first = self.read(trees[0])
        if first is None:  # (the other replicas need not be read)
            return None
        rows = [first, *map(self.read_any, trees[1:])]
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
        if self.hits < self.compile_after:
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
        self.used = next(_CLOCK)
        if self.hits == self.compile_after:
            self.read = compiled_reader(self.steps, self.reach)
            self.read_any = compiled_reader(self.steps, self.reach, keys="any")
            self.rebuild = compiled_unflatten(self.spec) or self.spec.unflatten

    def retire(self) -> None:
        """Evicted from its bucket: drop the generated code (steps and plans stay), and wait
        for twice as many hits before generating it again. A structure in a rotation longer
        than the bucket is then never compiled again, and costs no more than a cold call."""
        self.read = self.read_any = self._read_checked
        self.rebuild = self.spec.unflatten
        self.columns = {}
        self.builders = {}
        self.hits = 0
        self.compile_after = min(2 * self.compile_after, _MAX_COMPILE_AFTER)

    def leaves_ok(self, leaves: list[Any]) -> bool:
        """Every value is a leaf (``flatten_up_to`` lets a subtree or None stand in for one)."""
        types = list(map(type, leaves))
        return types.count(Tensor) == len(types) or self.types_ok(types, leaves)

    def types_ok(self, types: list[type], leaves: list[Any]) -> bool:
        """:meth:`leaves_ok` for leaves whose ``types`` are read already (not all tensors)."""
        known = self.leaf_types
        if known.issuperset(types):  # (one C pass: the types seen when the structure was made)
            return True
        return all(t in known or _tree.is_leaf(v) for t, v in zip(types, leaves))

    def builder(self, k: int) -> Builder | None:
        """The compiled builder of k device trees, once the structure is a regular."""
        try:
            return self.builders[k]
        except KeyError:
            pass
        if self.hits < self.compile_after:
            return None
        if len(self.builders) >= 4:
            self.builders.clear()
        build = self.builders[k] = compiled_builder(self.spec, k)
        return build

    def cached_plan(
        self, layout: Any, phase: str, dim: int, root: str | None, spec: PyTreeSpec | None = None
    ) -> Any:
        """The ``(plan, all batched)`` kept for an equal layout, or ``None``.

        ``spec``: the structure of this call's tree when it is not :attr:`spec` itself (a
        structure that is not :attr:`exact`): the plan is then made for it.
        """
        last = self.last
        if last[0] is layout and last[1] is phase and last[2] is root and last[3] is dim:
            found = last[4]
        else:
            found = self.plans.get(_plan_key(layout, phase, dim, root))
            if found is not None and _immutable(layout):
                # (a mutable layout may change between calls: keyed by value each time)
                self.last = (layout, phase, root, dim, found)
        if found is None or spec is None or spec is self.spec:
            return found
        return self._for_spec(found, spec, layout, phase, dim, root)

    def _for_spec(
        self,
        found: tuple[Plan, bool],
        spec: PyTreeSpec,
        layout: Any,
        phase: str,
        dim: int,
        root: str | None,
    ) -> tuple[Plan, bool]:
        """A kept plan made for this call's ``spec``: rebased (same rules, containers and
        paths from ``spec``), or resolved again where the rules may depend on more than what the
        guard compared (by_path patterns on keys that are equal but not the same) or the plan
        builds a coarser structure of its own (whole-value groups)."""
        plan, per_step = found
        if plan.up_spec is plan.spec and (self.exact_paths or not isinstance(layout, ByPath)):
            return rebase(plan, spec), per_step
        return resolve(spec, layout, phase, dim, root), per_step

    def plan(
        self,
        layout: Any,
        phase: str,
        dim: int,
        root: str | None,
        leaves: list[Any],
        spec: PyTreeSpec | None = None,
    ) -> tuple[Plan, bool] | None:
        """The plan (resolved once per equal layout) and whether it is the per-step case: the
        default rules, and every leaf a >= 1-dim tensor (at least one).

        ``leaves`` are one tree's values at this structure's leaves; ``spec`` that tree's
        structure when it is not :attr:`spec` itself (see :meth:`cached_plan`). ``None`` when
        the plan is not cached yet and ``leaves`` are not all leaves (a subtree or ``None``
        where this structure has a leaf): the caller runs the reference steps.
        """
        found: tuple[Plan, bool] | None = self.cached_plan(layout, phase, dim, root, spec)
        if found is not None:
            return found
        if not self.leaves_ok(leaves):  # a subtree where a leaf is: not this structure's plan
            return None
        plan = resolve(self.spec if spec is None else spec, layout, phase, dim, root)
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


_SIZED = frozenset([dict, OrderedDict, defaultdict, list, tuple, deque])


def bucket_key(tree: Any) -> Any:
    """Which bucket ``tree``'s structure is kept in: its root's type, with its length for a
    builtin container (a structure of another length can never accept the tree).

    >>> bucket_key({"a": 1, "b": 2}), bucket_key(3)
    ((<class 'dict'>, 2), <class 'int'>)
    """
    kind = type(tree)
    return (kind, len(tree)) if kind in _SIZED else kind


def _found(key: Any, bucket: list[Structure], at: int) -> None:
    """The structure at ``at`` in ``bucket`` was found: it goes first, so that a structure used
    again is checked first whatever was seen in between (a new list: readers never see one
    change)."""
    if at:
        _STRUCTURES.put(key, [bucket[at], *bucket[:at], *bucket[at + 1 :]])


def find(tree: Any) -> tuple[Structure, list[Any]] | None:
    """The :class:`Structure` that accepts ``tree`` (containers only) and the tree's leaves."""
    key = bucket_key(tree)
    bucket = _STRUCTURES.get(key)
    if bucket:
        version = _tree.registry_version()
        for at, st in enumerate(bucket):
            if st.version == version:
                leaves = st.read(tree)
                if leaves is not None:
                    _found(key, bucket, at)
                    return st, leaves
    return None


def find_columns(outputs: list[Any]) -> tuple[Structure, list[tuple[Any, ...]], bool] | None:
    """For gather: the :class:`Structure` replica 0 has exactly (the other replicas the same
    containers, dict keys in any order, compared with ==, as the reference compares replicas),
    their columns (leaf i of each replica), and whether each column was found to have one dtype.
    """
    key = bucket_key(outputs[0])
    bucket = _STRUCTURES.get(key)
    if bucket:
        version = _tree.registry_version()
        k = len(outputs)
        for at, st in enumerate(bucket):
            if st.version == version:
                read, same_dtypes, plain = st.columns.get(k) or st.columns_reader(k)
                columns = read(outputs)
                if columns is None and same_dtypes:  # a dtype differs, or a value has none
                    columns, same_dtypes = plain(outputs), False
                if columns is not None:
                    _found(key, bucket, at)
                    if st.hits < st.compile_after:
                        st.seen()
                    else:
                        st.used = next(_CLOCK)
                    return st, columns, same_dtypes
    return None


def recognise(
    tree: Any, root: str | None = "tree"
) -> tuple[list[Any], Structure | None, PyTreeSpec]:
    """The leaves of ``tree``, its :class:`Structure` when seen before, and its spec: the
    structure's own, or for a structure that is not :attr:`Structure.exact` the tree's.

    A hit costs the structure's reader (and a flatten when not exact); a miss one full flatten.
    ``root`` names the tree in a :class:`~treegather.TreeDepthError` (see
    :func:`treegather._tree.flatten`).
    """
    found = find(tree)
    if found is not None:
        st, leaves = found
        if st.leaves_ok(leaves):
            st.seen()
            if not st.exact:  # results are rebuilt from this tree's own structure
                leaves, spec = _tree.flatten(tree, root)
                return leaves, st, spec
            return leaves, st, st.spec
        # The containers match but a leaf is a subtree: never learned.
        leaves, spec = _tree.flatten(tree, root)
        return leaves, None, spec
    leaves, spec = _tree.flatten(tree, root)
    return leaves, _learn(tree, spec, leaves, _tree.registry_version()), spec


def _learn(tree: Any, spec: PyTreeSpec, leaves: list[Any], version: int) -> Structure | None:
    """The :class:`Structure` for a spec seen before (the one evicted, when it was); only a
    sighting the first time.

    A structure holding a batch node (:mod:`treegather._tree.batch`) is never learned: its
    results are rebuilt with each call's batch sizes, which the plain steps work out.

    A full bucket takes a structure in only if it was seen again sooner than the bucket's least
    recently used structure was last used (which then makes room): in a rotation through more
    structures than a bucket holds, the bucket keeps the same structures, compiled, and the
    others run as a cold call does (without generating any code), instead of every structure
    being compiled again and evicted before its next use.
    """
    if _tree.is_batched(spec):  # rebuilt with each call's batch sizes: the plain steps
        return None
    now = next(_CLOCK)
    try:
        seen = _SIGHTINGS.pop(spec)
    except TypeError:  # unhashable metadata: never cached
        return None
    if seen is None:
        _SIGHTINGS.put(spec, now)
        return None
    retired = seen if type(seen) is Structure else None
    last: int = seen if retired is None else retired.used
    if retired is not None and not (retired.version == version and retired.guard(tree)):
        retired = None  # (== merged it with another structure, or the registry changed)
    root = bucket_key(tree)
    bucket = [s for s in _STRUCTURES.get(root) or () if s.version == version]
    victim = min(bucket, key=_USED) if len(bucket) >= _BUCKET else None
    if victim is not None and last < victim.used:
        # Not taken in: a sighting again (a structure evicted before serves this call).
        if retired is not None:
            retired.used = now
        _SIGHTINGS.put(spec, now if retired is None else retired)
        return retired
    if retired is not None:
        st = retired  # taken back with its plans; its code is made later, if at all
    else:
        found = structure_steps(spec)
        if found is None:
            return None
        st = Structure(spec, *found, leaves, version)
    st.used = now
    if victim is not None:
        bucket.remove(victim)
        victim.retire()
        _SIGHTINGS.put(victim.spec, victim)
    _STRUCTURES.put(root, [st, *bucket])
    return st
