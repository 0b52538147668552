"""Replicas kept across steps: a module's replica shells reused while its tree is unchanged (issue 14).

A data-parallel step re-replicates the model, as torch does: a new shell for every submodule of
every replica. Here the shells of a module's last replication for a device list are kept (in a
:class:`~treegather._caches.WeakCache` keyed by the module) and each step re-binds them to the
module as it is now:

- every shell keeps one ``__dict__`` of its own from step to step (its hook tables, copies of its
  original's, and what replication bound into it); each step writes its original's plain
  entries into it (a value changed on the module, ``m.scale = 3.0``, is seen at once), this
  step's parameters (in ``_parameters`` and as attributes) and buffers, its submodule shells,
  and refills its hook tables with the original's hooks (a hook registered on the module
  between steps runs from the next step on; one a replica's forward registered is gone, as is
  an attribute it stored on itself);
- buffers: replica 0 shares the source's (on the source's device), every other replica gets
  fresh copies, so BatchNorm statistics move through replica 0 only, exactly as in torch; every
  buffer table is rebuilt each step, its None entries (a loss module's ``weight``, a norm
  without running statistics, ``register_buffer(name, None)``) None in every replica, whether
  or not the module has any tensor buffer;
- parameters: on the source's device the shells hold the source parameters themselves, so
  nothing is copied; on other devices (and for detached replicas) they are copied again, by
  torch's coalesced, differentiable broadcast when the devices are distinct CUDA devices.

Guards: kept shells are used only while the module's tree is what it was when they were built:
every submodule, parameter and buffer (``_modules``, ``_parameters``, ``_buffers``: keys, and
values by identity), every module's class, training flag, in-place compiled forward
(``m.compile()``) and the keys of its ``__dict__`` (an attribute added, removed, or replaced by
another: ``del m.scale; m.factor = 3.0``). A change to
any of these rebuilds the shells, and so does a plain value that stops being an atom (below);
other changes are re-bound at the next step, and changes made in place on a parameter
(``load_state_dict``, ``requires_grad_(False)``, ``p.data = ...``) need nothing.

Nothing the cache holds between steps reaches the module strongly (issue 20 item 7): the guards
hold weak references (and ids checked only while those references are alive), keys, classes
and flags. After a step, when nothing but the cache references the shells (their reference
counts are what they were when built), they are stripped: the original's entries (but atoms:
bools, numbers, strings, dtypes, devices and tuples of those, which reference nothing) and the
step's parameters become None, the step's tables give way to the shell's own empty ones and
its hook tables are emptied, so the shells are kept and refilled at the next step. When
something else still holds them (an autograd graph through a full backward hook or gradient
checkpointing, the caller of ``replicate(reuse=True)``) they are left intact and held weakly:
the next step refills them if they are still alive, and builds new ones if not. Either way a
deleted module frees them.

The originals' hook tables are read every step: which of them hold something (their sizes, in
one C pass) and, for those, their contents, so that a hook registered, removed, placed into a
table without ``register_*_hook`` (a library copying hooks from another module), a whole table
assigned (as ``torch._dynamo`` does around a call) or cleared is seen at the next step, as
fresh replicas see it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain, compress, filterfalse, repeat
from operator import attrgetter, is_, is_not, itemgetter, le, methodcaller
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._caches import FAST_PATHS, WeakCache
from . import shells
from .shells import (
    CALL_TABLES,
    CLONE,
    OWN_TABLES,
    SHARE,
    _build_rows,
    _check_replicatable,
    _compiled_kind,
    _tensor_copies,
    check_initialized,
    copy_kinds,
    params_copied,
    tensors_of,
)

__all__ = ["Kept", "give_back", "kept_count", "reusable", "take"]

Key = tuple[tuple[torch.device, ...], bool]
# module -> {(devices, detach): Kept}; a few device lists per module (train/eval alternate).
_KEPT: WeakCache[nn.Module, dict[Key, Kept]] = WeakCache("replicate.kept", maxsize=64, trees=False)
_PER_MODULE = 4
_LOCK = threading.Lock()

_TREE = itemgetter("_modules", "_parameters", "_buffers")
_BUFFERS = itemgetter("_buffers")
_PARAMETERS = itemgetter("_parameters")
_OWN_TABLES = itemgetter(*OWN_TABLES)
_CALL_TABLES = tuple(t for t in OWN_TABLES if t in CALL_TABLES)
_CALLS = itemgetter(*_CALL_TABLES)
_DEREF = weakref.ref.__call__
_PER_STEP = frozenset(("_modules", "_parameters", "_buffers"))
_REQUIRED = frozenset((*OWN_TABLES, *_PER_STEP))
_set_dict = object.__setattr__


class Kept:
    """The linked replica shells of one module for one device list, and what they were built from."""

    __slots__ = (
        "atom_dicts",
        "atom_getters",
        "atom_keys",
        "atom_values",
        "atoms",
        "base_counts",
        "buffer_dicts",
        "buffer_lens",
        "calls",
        "child_values",
        "children",
        "children_lens",
        "classes",
        "compiled_at",
        "compiled_ids",
        "compiled_now",
        "compiled_refs",
        "copy_params",
        "detach",
        "devices",
        "devs",
        "dicts",
        "empties",
        "flat",
        "keepable",
        "kinds",
        "n_keys",
        "n_params",
        "nones",
        "obj_at",
        "obj_dicts",
        "obj_getters",
        "obj_keys",
        "od_lens",
        "own_keys",
        "own_tables",
        "param_dicts",
        "plans",
        "refs",
        "rest_getters",
        "restores",
        "root",
        "rows",
        "shared",
        "shell_refs",
        "slot_dicts",
        "slot_empties",
        "slot_keys",
        "src_filled",
        "src_lens",
        "step",
        "step_stamp",
        "stripped",
        "tensor_refs",
        "training",
        "training_at",
        "tree_ids",
        "tree_keys",
        "used_empties",
        "wrappers",
    )

    def __init__(self, module: nn.Module, devs: tuple[torch.device, ...], detach: bool) -> None:
        self.step_stamp = RemovableHandle.next_id  # (a hook registered from here on: the step's)
        originals, rows = _build_rows(module, devs, detach)
        self.root = weakref.ref(module)  # the cache is keyed weakly by it: never hold it
        self.devs = devs
        self.detach = detach
        self.rows: list[list[nn.Module]] | None = rows
        ods = list(map(vars, originals))
        # Shells are refilled from their originals' tables, so every original must have them
        # all (every nn.Module does); TorchScript copies live in C++ and are rebuilt each step.
        self.keepable = not any(isinstance(o, torch.jit.ScriptModule) for o in originals) and all(
            map(le, repeat(_REQUIRED), map(dict.keys, ods))
        )
        if not self.keepable:
            return
        # The guards: weak references, and ids compared only while those are alive.
        self.refs = [weakref.ref(o) for o in originals]
        self.classes = list(map(type, originals))  # a swapped __class__ is in no __dict__
        # An attribute added or removed changes a size; one replaced by another (the same size)
        # is a recorded key missing, which reading them all each step finds (KeyError).
        self.od_lens = list(map(len, ods))
        tables = list(chain.from_iterable(map(_TREE, ods)))
        self.tree_keys = list(chain.from_iterable(tables))
        self.tree_ids = list(map(id, chain.from_iterable(map(dict.values, tables))))
        self.src_lens = list(map(len, chain.from_iterable(map(_OWN_TABLES, ods))))
        self.src_filled = list(compress(range(len(self.src_lens)), self.src_lens))
        compiled = list(map(dict.get, ods, repeat("_compiled_call_impl")))
        self.compiled_ids = list(map(id, compiled))
        # (a module that gains one grows its __dict__, which the sizes see)
        self.compiled_at = [i for i, f in enumerate(compiled) if f is not None]
        self.compiled_now = [id(f) for f in compiled if f is not None]
        self.wrappers = [bool(_compiled_kind(o)) for o in originals]
        self.compiled_refs = [weakref.ref(f) for f in compiled if f is not None]
        params, buffers = tensors_of(originals)
        self.n_params = len(params)
        self.tensor_refs = [weakref.ref(t) for t in (*params, *buffers)]
        self.copy_params = params_copied(params, devs, detach)
        self.kinds: tuple[torch.device | None, tuple[int, ...]] = (None, ())
        self.devices: list[torch.device] = []  # this step's tensors' devices
        self.plans = Plans(originals, params, buffers)
        flat = [s for row in rows for s in row]
        self.flat: list[nn.Module] | None = flat
        self.own_tables: list[Any] | None = None
        self.shell_refs = [weakref.ref(s) for s in flat]
        self.seal()
        self.step: list[torch.Tensor] | None = None  # this step's tensors (not after a build)
        self.stripped = False
        # What references each shell when only this object does (its rows, the parent shells'
        # _modules tables, a compiled forward bound to it): compared after every step.
        self.base_counts = list(map(sys.getrefcount, self.flat))

    def seal(self, *, every_shell: bool = False) -> None:
        """Record what each shell's ``__dict__`` holds of its own: every entry that is not its
        original's (its tables, ``_is_replica``, a compiled forward bound to it), besides the
        original's plain entries and this step's tensors, which each step puts in and takes
        out again. The replicas of one module hold the same keys, unless replication callbacks
        ran on them (``every_shell``)."""
        flat = self.flat
        assert flat is not None
        m = self.plans.m
        ods = [vars(r()) for r in self.refs]
        keys_of: list[tuple[str, ...]] = []
        plain = (*OWN_TABLES, "_is_replica")  # what _shell gives a module that is not compiled
        for s, shell in enumerate(flat if every_shell else flat[:m]):
            if not every_shell and self.compiled_ids[s] == _NONE_ID and not self.wrappers[s]:
                keys_of.append(plain)
                continue
            od, table = ods[s % m], vars(shell)
            names = list(table)
            theirs = map(od.get, names, repeat(_MISSING))
            differ = compress(names, map(is_not, table.values(), theirs))
            step = self.plans.pkeys[s % m]
            keys_of.append(tuple(k for k in differ if k not in _PER_STEP and k not in step))
        self.own_keys = keys_of if every_shell else keys_of * len(self.devs)
        # The originals' plain entries: atoms (bools, numbers, strings, dtypes, devices, tuples
        # of those) stay in the shells from step to step, compared by identity with the
        # original's each step; anything else (configs, functions, methods bound to a module)
        # is written in every step and replaced by None after it, like the step's parameters.
        self.atom_keys, self.atom_getters, self.atom_values, self.atoms = [], [], [], []
        self.obj_at, self.obj_keys, self.obj_getters, self.nones, self.n_keys = [], [], [], [], []
        getters: dict[tuple[str, ...], Any] = {}
        skips: dict[tuple[str, ...], frozenset[str]] = {}
        for s, own in enumerate(keys_of):  # (per module, and per replica after callbacks)
            od = ods[s % m]
            skip = skips.get(own) or skips.setdefault(own, _PER_STEP.union(own))
            keys = tuple(filterfalse(skip.__contains__, od))
            atom_keys = tuple(k for k in keys if type(od[k]) in _ATOMS or _is_atom(od[k]))
            obj_keys = tuple(k for k in keys if k not in atom_keys)
            self.atom_keys.append(atom_keys)
            self.atom_getters.append(
                getters.get(atom_keys) or getters.setdefault(atom_keys, _getter(atom_keys))
            )
            if not atom_keys:  # (every module has some: ``training``, ...; not this one)
                self.keepable = False
                return
            self.atom_values.append(self.atom_getters[-1](od))
            self.atoms.append(dict(zip(atom_keys, self.atom_values[-1])))
            if obj_keys:
                self.obj_at.append(s)
                self.obj_keys.append(obj_keys)
                self.obj_getters.append(
                    getters.get(obj_keys) or getters.setdefault(obj_keys, _getter(obj_keys))
                )
            attrs = tuple(k for k, p in od["_parameters"].items() if p is not None)
            self.nones.append(dict.fromkeys(obj_keys + attrs))  # what they become after a step
            self.n_keys.append(len(own) + len(_PER_STEP) + len(keys) + len(attrs))
        # Every key of every original is read each step (so a key replaced by another, at the
        # same size, is missed by one read): the atoms, the other plain entries, the tables,
        # and here the rest (a compiled module's own entries).
        atoms_of = [
            set().union(*(self.atom_keys[s] for s in range(i, len(keys_of), m))) for i in range(m)
        ]
        covered = [atoms | _REQUIRED for atoms in atoms_of]
        for s, keys in zip(self.obj_at, self.obj_keys):
            covered[s % m] = covered[s % m].union(keys)
        self.rest_getters = []
        for i, od in enumerate(ods):
            rest = tuple(k for k in od if k not in covered[i])
            if rest:
                self.rest_getters.append((i, _getter(rest)))
        # The training flags not compared with the atoms (not a bool): compared on their own.
        self.training_at = [
            i for i, od in enumerate(ods) if "training" in od and "training" not in atoms_of[i]
        ]
        self.training = [ods[i]["training"] for i in self.training_at]
        self.shared = not every_shell  # the replicas of a module share these (read only)
        if self.shared:
            self.nones, self.n_keys = self.nones * len(self.devs), self.n_keys * len(self.devs)
        self._adopt(list(map(vars, flat)), ods)

    def _adopt(self, dicts: list[dict[str, Any]], ods: list[dict[str, Any]]) -> None:
        """Take the shells' ``__dict__`` as they are: their own tables, and the empty tables
        that stand in for this step's submodules, parameters and buffers between steps."""
        self.dicts = dicts
        self.own_tables = list(chain.from_iterable(map(_OWN_TABLES, dicts)))
        n = len(self.devs)
        self.empties = []
        used: list[dict[str, Any]] = []
        # Where a step puts tables of its own (submodules, parameters, buffers), and the empty
        # ones that stand in for them between steps; the buffer tables' sizes are checked.
        self.slot_dicts, self.slot_keys, self.slot_empties = [], [], []
        self.buffer_dicts, self.buffer_lens = [], []
        self.children, self.children_lens = [], []  # submodule tables, kept from step to step
        for table, od in zip(dicts, ods * n):
            row: list[dict[str, Any]] = []
            for key in _EMPTY_KEYS:  # the shell's own empty table where its original has none
                empty: dict[str, Any]
                if not od[key]:
                    empty = table[key]
                    used.append(empty)
                elif key == "_modules":
                    empty = {}  # (the shell's submodules stay: they are its own)
                    self.children.append(table[key])
                    self.children_lens.append(len(od[key]))
                else:
                    empty = {}
                    self.slot_dicts.append(table)
                    self.slot_keys.append(key)
                    self.slot_empties.append(empty)
                row.append(empty)
            if od["_buffers"]:
                self.buffer_dicts.append(table)
                self.buffer_lens.append(len(od["_buffers"]))
            self.empties.append(row)
        self.used_empties = used
        m = self.plans.m
        self.param_dicts = [
            [dicts[j * m + i] for i, _, _ in self.plans.with_params] for j in range(n)
        ]
        # Per replica, the shells whose originals hold entries other than atoms.
        if self.shared:
            self.obj_dicts = [[dicts[j * m + s] for s in self.obj_at] for j in range(n)]
        else:
            self.obj_dicts = [[dicts[s] for s in self.obj_at]]
        self.atom_dicts = self.atoms * n if self.shared else self.atoms
        # What each shell's __dict__ gets back after a step: None for its original's entries
        # and this step's parameters, its own tables of hooks a call runs (a forward may have
        # assigned others: the ones torch's _call_impl reads), and its original's atoms.
        self.calls = list(chain.from_iterable(map(_CALLS, dicts)))
        width = len(_CALL_TABLES)
        self.restores = [
            {
                **self.nones[s],
                **dict(zip(_CALL_TABLES, self.calls[s * width : (s + 1) * width])),
                **self.atom_dicts[s],  # (a forward may have set one)
            }
            for s in range(len(dicts))
        ]
        self.child_values = list(chain.from_iterable(map(dict.values, self.children)))

    def _current(
        self, module: nn.Module
    ) -> tuple[list[nn.Module], list[dict[str, Any]], list[torch.Tensor]] | None:
        """The originals, their ``__dict__`` and tensors, if the tree is what it was; else None."""
        if self.root() is not module:
            return None
        mods = list(map(_DEREF, self.refs))
        if not all(map(is_not, mods, repeat(None))) or list(map(type, mods)) != self.classes:
            return None
        ods = list(map(vars, mods))
        if list(map(len, ods)) != self.od_lens:
            return None
        # (a training flag that is an atom is compared with the atoms, _changed_atoms)
        if [ods[i].get("training") for i in self.training_at] != self.training:
            return None
        try:
            tables = list(chain.from_iterable(map(_TREE, ods)))
        except KeyError:
            return None
        if list(chain.from_iterable(tables)) != self.tree_keys:
            return None
        tensors = list(map(_DEREF, self.tensor_refs))
        if not all(map(is_not, tensors, repeat(None))):
            return None
        # Every recorded object is alive (held here): an equal id is the same object.
        if list(map(id, chain.from_iterable(map(dict.values, tables)))) != self.tree_ids:
            return None
        if self.compiled_at and (
            [id(ods[i].get("_compiled_call_impl")) for i in self.compiled_at] != self.compiled_now
            or not all(map(is_not, map(_DEREF, self.compiled_refs), repeat(None)))
        ):
            return None
        try:  # the keys no other read looks up (a compiled module's own)
            for i, getter in self.rest_getters:
                getter(ods[i])
        except KeyError:
            return None
        return cast("list[nn.Module]", mods), ods, cast("list[torch.Tensor]", tensors)

    def reuse(self, module: nn.Module, *, copy_buffers: bool = True) -> list[nn.Module] | None:
        """Re-bind the shells to the module as it is now: one replica per device, or None when
        the module's tree changed (or the shells, held weakly, are gone)."""
        current = self._current(module)
        if current is None:
            return None
        _, ods, tensors = current
        m, n = self.plans.m, len(self.devs)
        try:  # (a KeyError: a key replaced by another on some module; before any change)
            changed = self._changed_atoms(ods)
            tables = list(chain.from_iterable(map(_OWN_TABLES, ods)))
            obj_ods = [ods[s % m] for s in self.obj_at]
            objs = list(map(itemgetter.__call__, self.obj_getters, obj_ods))
        except KeyError:
            return None
        if changed is None:
            return None
        olds: list[dict[str, Any]] | None = None
        if not self.stripped:  # intact shells, held weakly: give them fresh dicts of their own
            alive = list(map(_DEREF, self.shell_refs))
            if not all(map(is_not, alive, repeat(None))):
                return None
            flat = cast("list[nn.Module]", alive)
            del alive
            olds = list(map(vars, flat))
            try:
                dicts = [{k: old[k] for k in keys} for old, keys in zip(olds, self.own_keys)]
            except KeyError:  # the last forward deleted something of its own: build anew
                return None
            for table in dicts:
                for key in _EMPTY_KEYS:
                    table[key] = {}
            new_rows = [flat[j * m : (j + 1) * m] for j in range(n)]
            for j, row in enumerate(new_rows):
                rowx: list[Any] = [*row, None]
                for i, keys, where in self.plans.containers:
                    dicts[j * m + i]["_modules"] = dict(zip(keys, map(rowx.__getitem__, where)))
            deque(map(_set_dict, flat, repeat("__dict__"), dicts), 0)
            self.rows = new_rows
            self.flat = flat
            self._adopt(dicts, ods)
            deque(map(dict.update, dicts, self.atom_dicts), 0)
        else:
            for s in changed:  # an atom changed on a module: every replica of it gets it
                at = slice(s % m, None, m) if self.shared else slice(s, s + 1)
                for table in (*self.dicts[at], *self.restores[at]):
                    table.update(self.atoms[s])
        rows = self.rows
        assert rows is not None and self.own_tables is not None
        self._sync_tables(tables, self.own_tables, n, intact=olds is not None)
        params, buffers = tensors[: self.n_params], tensors[self.n_params :]
        pcols = _columns(params, self.devs, self.detach, True) if self.copy_params else None
        # Every shell whose original has a buffer table gets it rebuilt from this step's
        # column, whatever the table holds: None entries (``register_buffer(name, None)``, a
        # loss module's ``weight``) are the column's last item, so a tree whose buffers are all
        # None re-binds as one with tensors does. Only copy_buffers=False on intact shells
        # keeps each replica's own (``_fill``).
        self.devices = devices = list(map(_DEVICE, tensors))
        bcols = None
        if self.plans.with_buffers and (copy_buffers or olds is None):
            bcols = self._buffer_columns(buffers, devices[self.n_params :])
        self._fill(rows, ods, objs, pcols, bcols, olds)
        self.step = tensors
        self.step_stamp = RemovableHandle.next_id
        self.stripped = False
        return [row[0] for row in rows]

    def _buffer_columns(
        self, buffers: list[torch.Tensor], devices: list[torch.device]
    ) -> list[list[Any]]:
        """This step's buffer copies, as :func:`_columns` makes them: while every buffer is on
        one device, none needs a differentiable copy and torch's coalesced broadcast does not
        apply (distinct CUDA devices), each replica's column in one C pass
        (:func:`~treegather._parallel.shells.copy_kinds`, as
        :func:`~treegather._parallel.shells._buffer_copies` makes them one by one)."""
        detach = self.detach
        if not (
            buffers
            and devices.count(devices[0]) == len(devices)
            and (detach or not any(map(_REQUIRES_GRAD, buffers)))
            and not shells._coalesced(self.devs, buffers)
        ):
            return _columns(buffers, self.devs, detach, False)
        at, kinds = self.kinds
        if at != devices[0]:
            at = devices[0]
            self.kinds = (at, kinds := copy_kinds(at, self.devs))
        sources = list(map(_DETACH, buffers))
        columns: list[list[Any]] = []
        for kind, d in zip(kinds, self.devs):
            if kind == SHARE:
                columns.append([*sources, None])
            elif kind == CLONE:
                columns.append([*map(_CLONE_OF, sources), None])
            else:
                columns.append([*map(_TO, sources, repeat(d)), None])
        return columns

    def _changed_atoms(self, ods: list[dict[str, Any]]) -> list[int] | None:
        """Which entries of ``atom_values`` changed on their modules (their new values
        recorded), or None when one is no atom any more (the shells are rebuilt)."""
        sources = ods if self.shared else ods * len(self.devs)
        now = list(map(itemgetter.__call__, self.atom_getters, sources))
        if all(map(is_, chain.from_iterable(now), chain.from_iterable(self.atom_values))):
            return []
        changed = []
        for s, (new, old) in enumerate(zip(now, self.atom_values)):
            if not all(map(is_, new, old)):
                if not all(map(_is_atom, new)):
                    return None
                if "training" in self.atom_keys[s]:  # .train() / .eval(): the tree's guard
                    at = self.atom_keys[s].index("training")
                    if new[at] is not old[at]:
                        return None
                self.atom_values[s] = new
                self.atoms[s].update(zip(self.atom_keys[s], new))
                changed.append(s)
        return changed

    def _sync_tables(
        self, tables: list[Any], own_tables: list[Any], n: int, *, intact: bool
    ) -> None:
        """Give every shell's own tables its original's contents (hooks, non-persistent names).

        Which of the originals' tables hold something is read every step (their sizes, in one
        C pass), and the tables themselves from the originals' ``__dict__``: a hook registered,
        removed, placed into a table without ``register_*_hook``, a table assigned or cleared
        are all seen at the next step. ``tables``: every original's, as they are now (in
        :data:`OWN_TABLES` order). Own tables are empty after a strip; intact shells' tables
        (held weakly) may hold what their last forward registered.
        """
        lens = list(map(len, tables))
        if lens != self.src_lens:
            self.src_lens = lens
            self.src_filled = list(compress(range(len(lens)), lens))
        filled = self.src_filled
        sources = list(map(tables.__getitem__, filled))
        per_replica = len(tables)
        if intact:
            for at in compress(range(len(own_tables)), map(len, own_tables)):
                own_tables[at].clear()
        for j in range(n):
            for p, src in zip(filled, sources):
                own_tables[j * per_replica + p].update(src)

    def _fill(
        self,
        rows: list[list[nn.Module]],
        ods: list[dict[str, Any]],
        objs: list[tuple[Any, ...]],
        pcols: list[list[Any]] | None,
        bcols: list[list[Any]] | None,
        olds: list[dict[str, Any]] | None,
    ) -> None:
        """Put this step's entries into every shell's ``__dict__``: its original's plain entries
        (in C, one pass per replica), this step's parameters (also as attributes, as in torch),
        submodule shells and buffers (Python only for the modules that have some). ``objs``:
        the originals' entries that are no atoms, per module that has some."""
        plans = self.plans
        m = plans.m
        owners = [ods[i] for i, _, _ in plans.with_params]
        for j in range(len(rows)):
            dicts = self.dicts[j * m : (j + 1) * m]
            if self.shared or j == 0:
                targets = self.obj_dicts[j]
                deque(map(dict.update, targets, map(zip, self.obj_keys, objs)), 0)
            if pcols is None:  # the source parameters themselves
                params = list(map(dict.copy, map(_PARAMETERS, owners)))
            else:
                pcol = pcols[j]
                params = [
                    dict(zip(keys, map(pcol.__getitem__, where)))
                    for _, keys, where in plans.with_params
                ]
            holders = self.param_dicts[j]
            deque(map(dict.update, holders, params), 0)  # as attributes too, as in torch
            deque(map(dict.__setitem__, holders, repeat("_parameters"), params), 0)
            for i, key in plans.none_params:
                del dicts[i][key]
            if bcols is not None:
                bcol = bcols[j]
                for i, keys, where in plans.with_buffers:
                    dicts[i]["_buffers"] = dict(zip(keys, map(bcol.__getitem__, where)))
            elif plans.with_buffers:  # copy_buffers=False: each replica keeps its own buffers
                assert olds is not None
                for i, keys, _ in plans.with_buffers:
                    own = olds[j * m + i]["_buffers"]
                    dicts[i]["_buffers"] = {key: own.get(key) for key in keys}

    def on(self, device: torch.device) -> bool:
        """Every parameter and buffer of the module is on ``device`` (in a step that reused the
        shells: a build checks the devices before it starts)."""
        assert self.step is not None
        return self.devices.count(device) == len(self.devices)

    def end_step(self) -> None:
        """After a step: strip the shells if nothing else holds them, else let go of them."""
        self.step = None
        flat = self.flat
        assert flat is not None
        if list(map(sys.getrefcount, flat)) == self.base_counts:
            self._strip(flat)
            self.stripped = True
        else:  # in use elsewhere: held weakly (what they hold may reach the module)
            self.rows = self.flat = self.own_tables = None
            self.dicts, self.empties, self.used_empties, self.param_dicts = [], [], [], []
            self.obj_dicts, self.atom_dicts, self.restores, self.calls = [], [], [], []
            self.children, self.children_lens, self.child_values = [], [], []
            self.slot_dicts, self.slot_empties, self.buffer_dicts = [], [], []
            self.stripped = False

    def _strip(self, flat: list[nn.Module]) -> None:
        """Take out of every shell's ``__dict__`` what is its original's or this step's.

        Each shell keeps one ``__dict__`` from step to step, with the same keys: its own entries
        stay, the original's plain entries and this step's parameters become None, this step's
        tables give way to empty ones of its own, and its own hook tables are emptied (nothing
        is inserted, deleted, allocated or freed, and nothing of the originals is held): the
        tables a call runs hooks from, every one (a forward may have placed a hook in one, or
        assigned itself another: its own is put back), and the others where the step copied
        the original's, or every one after a hook was registered in the step. A forward that
        stored, registered or deleted something on itself is found by the sizes and set right
        by :meth:`_strip_carefully`.
        """
        dicts = self.dicts
        own_tables = self.own_tables
        assert own_tables is not None
        calls = self.calls
        for table in compress(calls, map(len, calls)):
            table.clear()
        clean = RemovableHandle.next_id == self.step_stamp  # no hook registered in the step
        if clean:
            per_replica = len(self.src_lens)
            for j in range(len(self.devs)):
                for p in self.src_filled:
                    own_tables[j * per_replica + p].clear()
        else:
            for table in compress(own_tables, map(len, own_tables)):
                table.clear()
        if list(map(len, map(_BUFFERS, self.buffer_dicts))) != self.buffer_lens:
            clean = False  # a buffer registered or deleted in the step (its name, in a set)
        if list(map(len, self.children)) != self.children_lens or not all(
            map(is_, chain.from_iterable(map(dict.values, self.children)), self.child_values)
        ):
            clean = False  # a submodule replaced, added or deleted in the step
        deque(map(dict.__setitem__, self.slot_dicts, self.slot_keys, self.slot_empties), 0)
        deque(map(dict.update, dicts, self.restores), 0)
        if not clean or any(map(len, self.used_empties)) or list(map(len, dicts)) != self.n_keys:
            self._strip_carefully(dicts)

    def _strip_carefully(self, dicts: list[dict[str, Any]]) -> None:
        """Each shell's ``__dict__`` back to exactly its own entries, and every own table
        emptied (the next step refills them): after a forward stored, registered or deleted
        something on itself."""
        assert self.own_tables is not None
        width = len(OWN_TABLES)
        for s, table in enumerate(dicts):
            keep = {*self.own_keys[s], *_PER_STEP, *self.nones[s], *self.atom_dicts[s]}
            for key in [k for k in table if k not in keep]:
                del table[key]
            table.update(self.restores[s])  # (also the ones a forward deleted)
            table.update(zip(OWN_TABLES, self.own_tables[s * width : (s + 1) * width]))
            table.update(self.atom_dicts[s])
            for index, key in enumerate(_EMPTY_KEYS):
                empty = self.empties[s][index]
                empty.clear()
                table[key] = empty
        m = self.plans.m
        for j, row in enumerate(self.rows or ()):
            rowx: list[Any] = [*row, None]
            for (i, keys, where), children in zip(
                self.plans.containers, self.children[j * len(self.plans.containers) :]
            ):
                children.clear()
                children.update(zip(keys, map(rowx.__getitem__, where)))
                dicts[j * m + i]["_modules"] = children
        for t in self.own_tables:
            t.clear()


_MISSING = object()
_NONE_ID = id(None)
_EMPTY_KEYS = ("_modules", "_parameters", "_buffers")


_ATOMS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
)


def _is_atom(value: Any) -> bool:
    """A value that references nothing else (so a shell may hold it between steps)."""
    kind = type(value)
    return kind in _ATOMS or (kind is tuple and all(map(_is_atom, value)))


def _getter(keys: tuple[str, ...]) -> Any:
    """An itemgetter giving a tuple whose first ``len(keys)`` items are those keys' values."""
    if len(keys) > 1:
        return itemgetter(*keys)
    return itemgetter(*(keys or ("_modules",)) * 2)  # (one key: itemgetter gives no tuple)


class Plans:
    """Where each shell's submodules, parameters and buffers come from every step: only the
    modules that have some are listed (most have no children, many no parameters)."""

    __slots__ = ("bkeys", "containers", "m", "none_params", "pkeys", "with_buffers", "with_params")

    def __init__(
        self,
        originals: list[nn.Module],
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
    ) -> None:
        position = {id(o): i for i, o in enumerate(originals)}
        p_at = {id(p): k for k, p in enumerate(params)}
        b_at = {id(b): k for k, b in enumerate(buffers)}
        self.m = len(originals)
        self.pkeys = [tuple(o._parameters) for o in originals]
        self.bkeys = [tuple(o._buffers) for o in originals]
        # (module, keys, positions in the row / in this step's column; the last one is None)
        self.containers: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []
        self.with_params: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []
        self.with_buffers: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []
        self.none_params: list[tuple[int, str]] = []  # None parameters are no attributes
        for i, o in enumerate(originals):
            mods, ps, bs = o._modules, o._parameters, o._buffers
            if mods:
                where = (self.m if c is None else position[id(c)] for c in mods.values())
                self.containers.append((i, tuple(mods), tuple(where)))
            if ps:
                where = (len(params) if p is None else p_at[id(p)] for p in ps.values())
                self.with_params.append((i, tuple(ps), tuple(where)))
                self.none_params += [(i, k) for k, p in ps.items() if p is None]
            if bs:
                where = (len(buffers) if b is None else b_at[id(b)] for b in bs.values())
                self.with_buffers.append((i, tuple(bs), tuple(where)))


def _columns(
    tensors: list[torch.Tensor], devs: tuple[torch.device, ...], detach: bool, params: bool
) -> list[list[Any]]:
    """This step's copies: per device, one per tensor (in order), then None (where a table's
    None entries point)."""
    if not tensors:
        return [[None] for _ in devs]
    copies = (
        _tensor_copies(tensors, (), devs, detach)
        if params
        else _tensor_copies((), tensors, devs, detach)
    )
    per_tensor = [copies[id(t)] for t in tensors]
    return [[*(c[j] for c in per_tensor), None] for j in range(len(devs))]


_DEVICE = attrgetter("device")
_REQUIRES_GRAD = attrgetter("requires_grad")
_DETACH = methodcaller("detach")
_CLONE_OF = methodcaller("clone")
_TO = torch.Tensor.to


def reusable(module: nn.Module, devs: Sequence[torch.device]) -> bool:
    """Kept shells are built for eager and compiled modules, not TorchScript (TorchScript
    copies are made by TorchScript itself, every call), and never under
    :func:`treegather._caches.reference_only` (fresh replicas every step)."""
    return FAST_PATHS.on and not isinstance(module, torch.jit.ScriptModule)


def take(
    module: nn.Module,
    devs: Sequence[torch.device],
    detach: bool,
    *,
    copy_buffers: bool = True,
    before_build: Callable[[], None] | None = None,
    prepare: Callable[[list[nn.Module]], None] | None = None,
) -> tuple[list[nn.Module], Kept | None, bool]:
    """This step's replicas from the kept shells (or new ones): ``(replicas, kept, fresh)``.

    The kept shells leave the cache until :func:`give_back`: a concurrent step on the same
    module builds its own, and a step that fails never hands back shells in an unknown state.
    ``before_build`` runs before new shells are built (a device check); ``prepare`` runs on
    every new set of replicas (``fresh``), before what they hold of their own is recorded
    (replication callbacks). ``kept`` is None when the module cannot be kept (TorchScript
    inside): fresh every call.
    """
    key: Key = (tuple(devs), detach)
    with _LOCK:
        entries = _KEPT.get(module)
        kept = entries.pop(key, None) if entries else None
    if kept is not None:
        replicas = kept.reuse(module, copy_buffers=copy_buffers)
        if replicas is not None:
            return replicas, kept, False
        del kept
    check_initialized(module, len(devs))
    if before_build is not None:
        before_build()
    _check_replicatable(module)
    built = Kept(module, key[0], detach)
    assert built.rows is not None
    replicas = [row[0] for row in built.rows]
    if not built.keepable:
        if prepare is not None:
            prepare(replicas)
        return replicas, None, True
    if prepare is not None:
        prepare(replicas)
        built.seal(every_shell=True)
    if not built.keepable:
        return replicas, None, True
    return replicas, built, True


def give_back(kept: Kept) -> None:
    """Keep ``kept`` for the next step on its module (unless the module is gone).

    Call it once the step no longer holds the replicas: shells that nothing else references
    are stripped of the module's values; shells still held elsewhere are kept weakly.
    """
    module = kept.root()
    if module is None:
        return
    kept.end_step()
    key: Key = (kept.devs, kept.detach)
    with _LOCK:
        entries = _KEPT.get(module)
        if entries is None:
            entries = {}
            _KEPT.put(module, entries)
        entries.pop(key, None)
        entries[key] = kept
        while len(entries) > _PER_MODULE:
            del entries[next(iter(entries))]


def kept_count(module: nn.Module) -> int:
    """How many device lists have kept shells for ``module`` (for tests)."""
    entries = _KEPT.get(module)
    return len(entries) if entries else 0
