"""Replicas kept across steps: a module's replica shells reused while they are valid (issue 14).

A data-parallel step re-replicates the model, as torch does: a new shell for every submodule of
every replica. Here the shells of a module's last replication for a device list are kept (in a
:class:`~treegather._caches.WeakCache` keyed by the module: a deleted model frees them) and each
step only re-binds what must change:

- buffers: replica 0 shares the source's (on the source's device), every other replica gets
  fresh copies, so BatchNorm statistics move through replica 0 only, exactly as in torch;
- parameters: on the source's device the shells hold the source parameters themselves, so
  nothing is copied; on other devices (and for detached replicas) they are copied again, by
  torch's coalesced, differentiable broadcast when the devices are distinct CUDA devices.

Guards: kept shells are used only while the module is what it was when they were built. Every
value in every submodule's ``__dict__`` (training mode, hook tables, a compiled forward, plain
attributes), ``_modules``, ``_parameters`` and ``_buffers`` is compared by identity with the
values seen at build time (and every module's class), and every shell's ``__dict__`` with what it was (an attribute a
replica's forward stored on itself is not carried into the next step). Anything else rebuilds.
Hook tables are shared by the module and its replicas (as in torch), so a hook registered
between steps runs on the kept replicas at once. Changes made in place on a parameter
(``load_state_dict``, ``requires_grad_(False)``, ``p.data = ...``) need no rebuild:
same-device shells hold the parameter itself, other devices copy it anew every step.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable, Sequence
from itertools import chain
from operator import is_
from typing import Any

import torch
from torch import nn

from ._caches import WeakCache
from ._replicate import (
    _build_rows,
    _check_replicatable,
    _tensor_copies,
    params_copied,
)

__all__ = ["Kept", "give_back", "kept_count", "reusable", "take"]

Key = tuple[tuple[torch.device, ...], bool]

# module -> {(devices, detach): Kept}; a few device lists per module (train/eval alternate).
_KEPT: WeakCache[nn.Module, dict[Key, Kept]] = WeakCache("replicate.kept", maxsize=64, trees=False)
_PER_MODULE = 4
_LOCK = threading.Lock()


class Kept:
    """The linked replica shells of one module for one device list, and what they were built from."""

    __slots__ = (
        "buffer_slots",
        "buffers",
        "classes",
        "copy_params",
        "detach",
        "devs",
        "n_table_values",
        "param_slots",
        "params",
        "root",
        "root_keys",
        "root_values",
        "rows",
        "shell_dicts",
        "shell_sizes",
        "shell_tables",
        "shell_values",
        "sub_dicts",
        "submodules",
        "table_values",
        "tables",
    )

    def __init__(self, module: nn.Module, devs: tuple[torch.device, ...], detach: bool) -> None:
        originals, rows = _build_rows(module, devs, detach)
        self.root = weakref.ref(module)  # the cache is keyed weakly by it: never hold it
        self.submodules = originals[1:]
        self.devs = devs
        self.detach = detach
        self.rows = rows
        self.params = list(module.parameters())
        self.buffers = list(module.buffers())
        self.param_slots = [
            (i, key, p)
            for i, m in enumerate(originals)
            for key, p in m._parameters.items()
            if p is not None
        ]
        self.buffer_slots = [
            (i, key, b)
            for i, m in enumerate(originals)
            for key, b in m._buffers.items()
            if b is not None
        ]
        self.copy_params = params_copied(self.params, devs, detach)
        # The guards: what every table held at build time, compared by identity in C
        # (chain/map/is_) with what it holds now. The root's own __dict__ is compared in
        # Python: a compiled forward in it (m.compile()) is bound to the root, so it is held
        # through a weakref (held strongly, it would keep the root alive in this weak cache).
        self.root_keys = tuple(module.__dict__)
        self.root_values = [_weak_if_bound(v) for v in module.__dict__.values()]
        self.sub_dicts = list(map(vars, self.submodules))
        self.classes = list(map(type, originals))  # a swapped __class__ is in no __dict__
        self.tables: list[dict[str, Any]] = [module._modules, module._parameters, module._buffers]
        self.tables += [
            t for m in self.submodules for t in (vars(m), m._modules, m._parameters, m._buffers)
        ]
        self.table_values: list[Any] = list(chain.from_iterable(map(dict.values, self.tables)))
        self.n_table_values = len(self.table_values)
        shells = [s for row in rows for s in row]
        self.shell_dicts: list[dict[str, Any]] = list(map(vars, shells))
        self.shell_tables: list[dict[str, Any]] = [
            t for s in shells for t in (s._modules, s._buffers, s._parameters)
        ]
        self.shell_sizes = list(map(len, self.shell_tables))
        self.shell_values = list(chain.from_iterable(map(dict.values, self.shell_dicts)))

    def valid(self, module: nn.Module) -> bool:
        """The module and every shell are exactly as they were when the shells were built."""
        if self.root() is not module:
            return False
        own = module.__dict__
        if tuple(own) != self.root_keys:
            return False
        for now, then in zip(own.values(), self.root_values):
            if now is not then and not (type(then) is weakref.ref and then() is now):
                return False
        return (
            type(module) is self.classes[0]
            and all(map(is_, map(type, self.submodules), self.classes[1:]))
            and all(map(is_, map(vars, self.submodules), self.sub_dicts))
            and sum(map(len, self.tables)) == self.n_table_values
            and all(map(is_, chain.from_iterable(map(dict.values, self.tables)), self.table_values))
            and list(map(len, self.shell_tables)) == self.shell_sizes
            and sum(map(len, self.shell_dicts)) == len(self.shell_values)
            and all(
                map(is_, chain.from_iterable(map(dict.values, self.shell_dicts)), self.shell_values)
            )
        )

    def on(self, device: torch.device) -> bool:
        """Every parameter and buffer of the module is on ``device``."""
        return all(t.device == device for t in self.params) and all(
            t.device == device for t in self.buffers
        )

    def refresh(self, *, copy_buffers: bool = True) -> list[nn.Module]:
        """Re-bind this step's tensors into the shells; return one replica per device."""
        rows = self.rows
        if self.copy_params:
            copies = _tensor_copies(self.params, (), self.devs, self.detach)
            for i, key, p in self.param_slots:
                for j, row in enumerate(rows):
                    row[i].__dict__[key] = copies[id(p)][j]
        if copy_buffers and self.buffer_slots:
            copies = _tensor_copies((), self.buffers, self.devs, self.detach)
            for i, key, b in self.buffer_slots:
                for j, row in enumerate(rows):
                    row[i]._buffers[key] = copies[id(b)][j]
        if self.copy_params:
            self.shell_values = list(chain.from_iterable(map(dict.values, self.shell_dicts)))
        return [row[0] for row in rows]


def _weak_if_bound(value: Any) -> Any:
    """A weakref to a compiled forward (``m.compile()``), else the value itself."""
    if isinstance(value, types.FunctionType) and hasattr(value, "_torchdynamo_orig_callable"):
        return weakref.ref(value)
    return value


def reusable(module: nn.Module, devs: Sequence[torch.device]) -> bool:
    """Kept shells are built for eager and compiled modules, not TorchScript (TorchScript
    copies are made by TorchScript itself, every call)."""
    return not isinstance(module, torch.jit.ScriptModule)


def take(
    module: nn.Module,
    devs: Sequence[torch.device],
    detach: bool,
    *,
    copy_buffers: bool = True,
    before_build: Callable[[], None] | None = None,
) -> tuple[list[nn.Module], Kept, bool]:
    """This step's replicas from the kept shells (or new ones): ``(replicas, kept, fresh)``.

    The kept shells leave the cache until :func:`give_back`: a concurrent step on the same
    module builds its own, and a step that fails never hands back shells in an unknown state.
    ``before_build`` runs before new shells are built (a device check).
    """
    key: Key = (tuple(devs), detach)
    with _LOCK:
        entries = _KEPT.get(module)
        kept = entries.pop(key, None) if entries else None
    if kept is not None and kept.valid(module):
        return kept.refresh(copy_buffers=copy_buffers), kept, False
    if before_build is not None:
        before_build()
    _check_replicatable(module)
    kept = Kept(module, key[0], detach)
    return [row[0] for row in kept.rows], kept, True


def give_back(kept: Kept) -> None:
    """Keep ``kept`` for the next step on its module (unless the module is gone)."""
    module = kept.root()
    if module is None:
        return
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
