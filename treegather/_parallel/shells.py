"""Fresh replicas: one shell per submodule and device, linked to this step's tensors.

What :func:`treegather.replicate` builds (:mod:`.replicate`), and what the kept replicas
(:mod:`.kept`) are built from and re-bound with.

Copies are differentiable: gradients flowing into any replica reduce back onto the source
parameters (or source tensors). Repeated devices (``["cpu"] * 3``) are first-class: replicas on
the source's own device use its parameters themselves instead of copying them. Nothing of the
source module is ever written to (compiled modules included), whether replication succeeds or
fails.

Each replica's per-module tables are its own: the hook tables (forward, forward-pre, backward,
backward-pre, their kwargs / always-call companions, state-dict hooks) and the set of
non-persistent buffer names are copies of the source's, so what a replica's forward registers or
removes is seen by that replica only (torch's ``_replicate_for_data_parallel`` shares them). A
replica's ``_parameters`` holds its own tensors (so ``replica.parameters()`` and transformers'
``next(self.parameters())`` see them); they are also plain attributes, as in torch, for speed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import itemgetter, methodcaller
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import UninitializedModuleError

__all__ = [
    "CALL_TABLES",
    "OWN_TABLES",
    "check_initialized",
    "params_copied",
    "param_copies",
    "replicate_module",
    "tensors_of",
]

M = TypeVar("M", bound=nn.Module)

# The per-module tables a replica gets its own copy of: every container ``nn.Module.__init__``
# creates besides the parameter, buffer and submodule tables (hook tables, non-persistent
# buffer names), read from torch itself so that a table a later torch adds is included.
OWN_TABLES: tuple[str, ...] = tuple(
    key
    for key, value in vars(nn.Module()).items()
    if isinstance(value, (dict, set)) and key not in ("_parameters", "_buffers", "_modules")
)
# The ones torch's ``Module._call_impl`` reads on every call (the hooks a call runs).
CALL_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_own_tables_of = itemgetter(*OWN_TABLES)
_copy = methodcaller("copy")
_values = methodcaller("values")


def param_copies(t: torch.Tensor, devs: Sequence[torch.device], detach: bool) -> list[torch.Tensor]:
    """Differentiable copies of a parameter-like tensor: the tensor itself on its own device.

    Replicas on the source's device use the source parameter itself (no view): gradients
    accumulate on it directly, sparse ones included (a ``view_as`` alias would reshape them,
    which sparse tensors do not support), and ``torch.compile`` sees leaf tensors.
    """
    src = t.detach() if detach else t
    return [src if d == t.device else src.to(d) for d in devs]


SHARE, CLONE, MOVE = 0, 1, 2


def copy_kinds(at: torch.device, devs: Sequence[torch.device]) -> tuple[int, ...]:
    """How each replica gets its detached copy of a buffer on ``at``: :data:`SHARE` (the buffer
    itself, detached) for the first replica on ``at``, :data:`CLONE` for the others there,
    :data:`MOVE` (a copy on the replica's device) elsewhere."""
    first = devs.index(at) if at in devs else -1
    return tuple(SHARE if j == first else CLONE if d == at else MOVE for j, d in enumerate(devs))


def _buffer_copies(t: torch.Tensor, devs: Sequence[torch.device]) -> list[torch.Tensor]:
    """Detached buffer copies: the first replica on the buffer's device shares its storage."""
    src = t.detach()
    return [
        src if kind == SHARE else src.clone() if kind == CLONE else src.to(d)
        for kind, d in zip(copy_kinds(t.device, devs), devs)
    ]


def _use_torch_broadcast(module: nn.Module, devs: Sequence[torch.device]) -> bool:
    if not all(d.type == "cuda" for d in devs) or len(set(devs)) != len(devs):
        return False
    if any(_compiled_kind(m) for m in module.modules()):
        return False  # torch's replicate would write through a compiled wrapper into the source
    src = torch.device("cuda", torch.cuda.current_device()) if devs[0].index is None else devs[0]
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == src for t in tensors)


def check_initialized(module: nn.Module, n_devices: int) -> None:
    """Refuse a module with uninitialized (lazy) parameters or buffers, naming each one.

    A lazy module infers its shapes on its first forward and then changes its parameters and
    its class in place: replicas would each initialize the source's own (shared) parameter
    objects, or fail inside torch. A lazy module with no tensor to infer
    (``nn.LazyInstanceNorm1d(affine=False, track_running_stats=False)``) is refused too while
    its first forward has not run: each replica would run its initialization, which removes
    the hook it was registered by from the source's table (the handle points there), leaving
    the caller's module lazy and without it. Every such module is listed, by its
    ``named_modules()`` path under ``model``.
    """
    from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

    modules = list(module.modules())
    tables = [t for m in modules for t in (m._parameters, m._buffers)]
    tensors = chain.from_iterable(map(_values, tables))  # (TorchScript's tables are no dicts)
    if not any(map(isinstance, tensors, repeat(UninitializedTensorMixin))) and not any(
        map(_before_first_forward, modules)
    ):
        return
    lazy: list[str] = []
    for name, m in module.named_modules(prefix="model"):
        found = [*m._parameters.items(), *m._buffers.items()]
        names = [key for key, t in found if isinstance(t, UninitializedTensorMixin)]
        if names:
            lazy.append(f"{name} ({type(m).__name__}: {', '.join(names)})")
        elif _before_first_forward(m):
            lazy.append(f"{name} ({type(m).__name__}: its first forward)")
    where = "1 device" if n_devices == 1 else f"{n_devices} devices"
    raise UninitializedModuleError(
        f"cannot replicate a module with uninitialized (lazy) parameters onto {where}: "
        f"{'; '.join(lazy)}. Run one forward on one device first (model(batch), or "
        "data_parallel / DataParallel with a single device, which calls the module "
        "itself) so that torch infers their shapes; then replicate it"
    )


def _before_first_forward(m: nn.Module) -> bool:
    """A lazy module whose initialization hook (run by its first forward, then removed) is
    still registered."""
    from torch.nn.modules.lazy import LazyModuleMixin

    if not isinstance(m, LazyModuleMixin):
        return False
    hook = vars(m).get("_initialize_hook")
    return isinstance(hook, RemovableHandle) and hook.id in m._forward_pre_hooks


def _check_replicatable(module: nn.Module) -> None:
    from torch.jit._state import _enabled

    if not _enabled:
        return
    for m in module.modules():
        if isinstance(m, torch.jit.ScriptModule):
            bad = [n for n, c in m.named_modules() if not isinstance(c, torch.jit.ScriptModule)]
            if bad:
                raise RuntimeError(
                    "Cannot replicate a TorchScript module with plain Python modules below it "
                    f"({', '.join(bad[:3])}); script the whole module"
                )


def replicate_module(module: nn.Module, devs: Sequence[torch.device], detach: bool) -> list[Any]:
    _check_replicatable(module)
    if _use_torch_broadcast(module, devs):
        replicas = torch.nn.parallel.replicate(module, list(devs), detach)
        for replica in replicas:
            _own_tables(module, replica)
    else:
        replicas = _replicate_module_generic(module, devs, detach)
    for r in replicas:
        _ensure_concrete_type(r)
    return replicas


def _replicate_module_generic(
    module: nn.Module, devs: Sequence[torch.device], detach: bool
) -> list[nn.Module]:
    """Build every replica from fresh shells; nothing is ever written to ``module``'s tree."""
    _, rows = _build_rows(module, devs, detach)
    return [row[0] for row in rows]


def _build_rows(
    module: nn.Module, devs: Sequence[torch.device], detach: bool
) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """The original modules and, per device, one linked shell per original (same order).

    A shell is a new object of the module's class whose ``__dict__`` is a shallow copy of the
    original's, with its own ``_parameters``, ``_buffers``, ``_modules`` and hook tables. The
    shells are linked by writing into those tables and into the shell's own ``__dict__``
    (replica parameters are in ``_parameters`` and, as in torch, plain attributes too, so that
    reading them costs no ``__getattr__``), never through ``setattr``: a
    module class may route attribute writes elsewhere (``torch.compile``'s wrapper forwards
    them to the module it wraps, which would be the caller's). TorchScript modules are copied
    by TorchScript itself and linked with ``setattr`` on the copy.
    """
    n = len(devs)
    originals = list(module.modules())
    position = {id(m): i for i, m in enumerate(originals)}
    kinds = [_compiled_kind(m) for m in originals]
    rows = [[_shell(m) for m in originals] for _ in range(n)]
    tensor_copies = _tensor_copies(*tensors_of(originals), devs, detach)

    for i, orig in enumerate(originals):
        scripted = isinstance(orig, torch.jit.ScriptModule)
        for j in range(n):
            shell = rows[j][i]
            if scripted:
                _link_script_shell(shell, orig, rows[j], position, tensor_copies, j)
                continue
            table = shell.__dict__
            modules, buffers = table["_modules"], table["_buffers"]
            for key, child in orig._modules.items():
                modules[key] = None if child is None else rows[j][position[id(child)]]
            for key, param in orig._parameters.items():
                if param is None:
                    table["_parameters"][key] = None
                else:
                    table[key] = table["_parameters"][key] = tensor_copies[id(param)][j]
            for key, buf in orig._buffers.items():
                if buf is not None:
                    buffers[key] = tensor_copies[id(buf)][j]
    for i, kind in enumerate(kinds):
        if kind:
            for j in range(n):
                _rebind_compiled(rows[j][i], originals[i], kind)
    return originals, rows


def tensors_of(originals: Sequence[nn.Module]) -> tuple[list[Any], list[Any]]:
    """``module.parameters()`` and ``module.buffers()`` from ``list(module.modules())``: the same
    tensors in the same order (each once, where it first appears), without walking the tree."""
    params = dict.fromkeys(p for m in originals for p in m._parameters.values() if p is not None)
    buffers = dict.fromkeys(b for m in originals for b in m._buffers.values() if b is not None)
    return list(params), list(buffers)


def _tensor_copies(
    params: Iterable[torch.Tensor],
    buffers: Iterable[torch.Tensor],
    devs: Sequence[torch.device],
    detach: bool,
) -> dict[int, list[torch.Tensor]]:
    """Per source tensor (by id), its copy for each device."""
    params, buffers = list(params), list(buffers)
    if _coalesced(devs, [*params, *buffers]):
        return _broadcast_copies(params, buffers, devs, detach)
    copies: dict[int, list[torch.Tensor]] = {}
    for p in params:
        copies[id(p)] = param_copies(p, devs, detach)
    for b in buffers:
        if b.requires_grad and not detach:
            copies[id(b)] = param_copies(b, devs, detach)
        else:
            copies[id(b)] = _buffer_copies(b, devs)
    return copies


def params_copied(
    params: Sequence[torch.Tensor], devs: Sequence[torch.device], detach: bool
) -> bool:
    """Whether some replica gets copies of ``params`` (not the parameters themselves)."""
    return detach or _coalesced(devs, params) or any(d != p.device for p in params for d in devs)


def _coalesced(devs: Sequence[torch.device], tensors: Sequence[torch.Tensor]) -> bool:
    """Distinct CUDA devices, every tensor dense on the first: torch's coalesced broadcast."""
    if len(devs) < 2 or not all(d.type == "cuda" for d in devs) or len(set(devs)) != len(devs):
        return False
    src = torch.device("cuda", torch.cuda.current_device()) if devs[0].index is None else devs[0]
    return all(t.device == src and t.layout == torch.strided for t in tensors)


def _broadcast_copies(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    devs: Sequence[torch.device],
    detach: bool,
) -> dict[int, list[torch.Tensor]]:
    """Copies by torch's coalesced broadcast (a few bucketed copies, not one per tensor and
    device): differentiable for parameters and buffers that require grad, detached for other
    buffers. The replica on the source device keeps the sources themselves, as elsewhere."""
    differentiable = not detach
    grads = [*params, *(b for b in buffers if b.requires_grad and differentiable)]
    plain = [b for b in buffers if not (b.requires_grad and differentiable)]
    copies: dict[int, list[torch.Tensor]] = {}
    for group, det in ((grads, detach), (plain, True)):
        if not group:
            continue
        per_device = _broadcast(group, devs, det)
        for i, t in enumerate(group):
            copies[id(t)] = [t.detach() if det else t, *(row[i] for row in per_device[1:])]
    return copies


def _broadcast(
    tensors: list[torch.Tensor], devs: Sequence[torch.device], detach: bool
) -> list[list[torch.Tensor]]:
    """``[device][i]``: tensor i on each device, by torch's (private) replicate helper."""
    from torch.nn.parallel.replicate import _broadcast_coalesced_reshape

    out: list[list[torch.Tensor]] = _broadcast_coalesced_reshape(tensors, list(devs), detach)
    return out


def _shell(m: nn.Module) -> nn.Module:
    """A new module of ``m``'s class sharing its plain attributes, with tables of its own."""
    if isinstance(m, torch.jit.ScriptModule):
        return m._replicate_for_data_parallel()
    shell = m.__new__(type(m))
    table = m.__dict__.copy()
    try:
        table.update(zip(OWN_TABLES, map(_copy, _own_tables_of(table))))
    except KeyError:  # a module without some of torch's tables
        for key in OWN_TABLES:
            if key in table:
                table[key] = table[key].copy()
    table["_parameters"] = {}
    table["_buffers"] = m._buffers.copy()
    table["_modules"] = m._modules.copy()
    table["_is_replica"] = True
    object.__setattr__(shell, "__dict__", table)
    return shell


def _own_tables(module: nn.Module, replica: nn.Module) -> None:
    """Give a replica made by torch's ``replicate`` tables of its own, and its parameters.

    torch's replicas share the source's hook tables and expose no parameters; the replica's
    modules come in the source's ``modules()`` order (torch builds them in that order).
    """
    for orig, copied in zip(module.modules(), replica.modules()):
        if isinstance(copied, torch.jit.ScriptModule):
            continue
        table = copied.__dict__
        for key in OWN_TABLES:
            if key in table:
                table[key] = table[key].copy()
        params = table["_parameters"]
        for key, param in orig._parameters.items():
            if key not in params:  # (a copy that is a Parameter was registered as one)
                params[key] = None if param is None else table[key]


def _link_script_shell(
    shell: Any,
    orig: nn.Module,
    row: list[nn.Module],
    position: dict[int, int],
    tensor_copies: dict[int, list[torch.Tensor]],
    j: int,
) -> None:
    """Link a TorchScript copy (its attributes live in C++, so ``setattr`` is the only way)."""
    for table in ("_modules", "_parameters", "_buffers"):
        for key, value in getattr(orig, table).items():
            if value is None:
                getattr(shell, table)[key] = None
            elif table == "_modules":
                setattr(shell, key, row[position[id(value)]])
            else:
                setattr(shell, key, tensor_copies[id(value)][j])


# ------------------------------------------------------------------------- compiled modules
#
# ``torch.compile(m)`` returns an ``OptimizedModule`` wrapping ``m`` (``_orig_mod``) whose
# ``forward`` is bound to ``m``; ``m.compile()`` stores ``_compiled_call_impl``, a compiled
# ``m._call_impl`` bound to ``m``. A replica must run its own module through the same
# compiled code: its forward is rebound with the same dynamo context. Dynamo caches compiled
# code on the code object and treats module tensors as graph inputs, so every replica reuses
# the code compiled for the first one (the tests count compilations).


def _compiled_kind(m: nn.Module) -> str:
    """``"wrapper"`` for a ``torch.compile(m)`` result, ``"in_place"`` after ``m.compile()``."""
    if m.__dict__.get("_compiled_call_impl") is not None:
        return "in_place"
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(m, eval_frame.OptimizedModule):
        return "wrapper"
    return ""


def _rebind_compiled(shell: nn.Module, orig: nn.Module, kind: str) -> None:
    table = shell.__dict__
    if kind == "wrapper":
        table["_torchdynamo_orig_callable"] = table["_modules"]["_orig_mod"].forward
        table["_torchdynamo_wrapper_id"] = id(shell)
        shell._initialize()  # type: ignore[operator]  # rebinds forward to the shell's module
        return
    compiled = orig.__dict__["_compiled_call_impl"]
    ctx = _dynamo_context(compiled)
    if ctx is None:
        raise RuntimeError(
            f"cannot replicate the compiled {type(orig).__name__} (m.compile()): this torch "
            "version hides its compile options; use torch.compile(m) instead of m.compile()"
        )
    table["_compiled_call_impl"] = ctx(shell._call_impl)


def _dynamo_context(compiled: Any) -> Any:
    """The dynamo context (backend, mode, options) a ``torch.compile``'d function runs with."""
    eval_frame = sys.modules["torch._dynamo.eval_frame"]
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, eval_frame._TorchDynamoContext):
            return value
    return None


def _ensure_concrete_type(replica: nn.Module) -> None:
    """TorchScript replicas lack ``_concrete_type``; set it so they can be scripted into others."""
    if isinstance(replica, torch.jit.RecursiveScriptModule) and not hasattr(
        replica, "_concrete_type"
    ):
        replica._concrete_type = torch._C.ConcreteModuleType.from_jit_type(replica._c._type())
