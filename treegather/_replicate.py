"""replicate: one copy of a module, or of a tree of tensors, per device.

Copies are differentiable: gradients flowing into any replica reduce back onto the source
parameters (or source tensors). Repeated devices (``["cpu"] * 3``) are first-class: replicas on
the source's own device alias its parameters instead of copying them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

import torch
from torch import nn

from ._devices import DeviceLike, as_devices
from ._tree import flatten

__all__ = ["replicate"]

M = TypeVar("M", bound=nn.Module)


@overload
def replicate(
    module_or_tree: M, devices: Sequence[DeviceLike], *, detach: bool = ...
) -> list[M]: ...
@overload
def replicate(
    module_or_tree: Any, devices: Sequence[DeviceLike], *, detach: bool = ...
) -> list[Any]: ...


def replicate(
    module_or_tree: Any, devices: Sequence[DeviceLike], *, detach: bool = False
) -> list[Any]:
    """Make one replica of a module, or of a tree of tensors, per device.

    >>> import torch, treegather as tg
    >>> lin = torch.nn.Linear(3, 2)
    >>> r = tg.replicate(lin, ["cpu"] * 2)
    >>> sum(m(torch.ones(1, 3)).sum() for m in r).backward()
    >>> torch.equal(lin.weight.grad, torch.full((2, 3), 2.0))
    True
    >>> trees = tg.replicate({"w": lin.weight}, ["cpu", "cpu"], detach=True)
    >>> [t["w"].requires_grad for t in trees]
    [False, False]

    A module gives one module per device, built like ``torch.nn.DataParallel``'s replicas
    (TorchScript modules too). Parameters are differentiable copies (aliases on the source's
    own device), so gradients accumulate on the original parameters. Buffers are shared with
    the source by the first replica that sits on the source's device (replica 0 in the usual
    ``devices[0] == module device`` case), so BatchNorm running statistics are updated through
    that replica only, exactly as in ``nn.DataParallel``; every other replica gets a private
    copy, so threaded workers never write to the same buffer. When all devices are distinct
    CUDA devices and the module lives on ``devices[0]``, torch's coalesced broadcast
    (``torch.nn.parallel.replicate``) does the copying.

    Any other value is a pytree (registered in treegather's namespace, e.g. the parameter
    dict for ``torch.func.functional_call``): each tensor leaf is copied (aliased on its own
    device), other leaves are shared, and the structure is rebuilt per device.

    Args:
        module_or_tree: an ``nn.Module`` (TorchScript included) or a pytree of tensors.
        devices: one device per replica; repeats are allowed.
        detach: detach the copies from autograd (torch's DataParallel passes
            ``not torch.is_grad_enabled()``).

    Returns:
        A list with one replica per entry of ``devices``.

    Raises:
        ValueError: ``devices`` is empty.
        RuntimeError: a TorchScript module has plain Python modules below it (as in torch).
    """
    devs = as_devices(devices)
    if not devs:
        raise ValueError("replicate needs at least one device, got an empty device list")
    if isinstance(module_or_tree, nn.Module):
        return _replicate_module(module_or_tree, devs, detach)
    leaves, spec = flatten(module_or_tree)
    per_leaf = [
        _param_copies(x, devs, detach) if isinstance(x, torch.Tensor) else [x] * len(devs)
        for x in leaves
    ]
    return [spec.unflatten([copies[j] for copies in per_leaf]) for j in range(len(devs))]


def _param_copies(
    t: torch.Tensor, devs: Sequence[torch.device], detach: bool
) -> list[torch.Tensor]:
    """Differentiable copies of a parameter-like tensor: an alias on its own device."""
    src = t.detach() if detach else t
    return [src.view_as(src) if d == t.device else src.to(d) for d in devs]


def _buffer_copies(t: torch.Tensor, devs: Sequence[torch.device]) -> list[torch.Tensor]:
    """Detached buffer copies: the first replica on the buffer's device shares its storage."""
    src = t.detach()
    out: list[torch.Tensor] = []
    shared = False
    for d in devs:
        if d == t.device and not shared:
            out.append(src)
            shared = True
        else:
            out.append(src.clone() if d == t.device else src.to(d))
    return out


def _use_torch_broadcast(module: nn.Module, devs: Sequence[torch.device]) -> bool:
    if not all(d.type == "cuda" for d in devs) or len(set(devs)) != len(devs):
        return False
    src = torch.device("cuda", torch.cuda.current_device()) if devs[0].index is None else devs[0]
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == src for t in tensors)


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


def _replicate_module(module: nn.Module, devs: Sequence[torch.device], detach: bool) -> list[Any]:
    _check_replicatable(module)
    if _use_torch_broadcast(module, devs):
        replicas = torch.nn.parallel.replicate(module, list(devs), detach)
    else:
        replicas = _replicate_module_generic(module, devs, detach)
    for r in replicas:
        _ensure_concrete_type(r)
    return replicas


def _replicate_module_generic(
    module: nn.Module, devs: Sequence[torch.device], detach: bool
) -> list[nn.Module]:
    n = len(devs)
    originals = list(module.modules())
    position = {m: i for i, m in enumerate(originals)}
    shells = [[m._replicate_for_data_parallel() for m in originals] for _ in range(n)]

    tensor_copies: dict[torch.Tensor, list[torch.Tensor]] = {}
    for p in module.parameters():
        tensor_copies[p] = _param_copies(p, devs, detach)
    for b in module.buffers():
        if b.requires_grad and not detach:
            tensor_copies[b] = _param_copies(b, devs, detach)
        else:
            tensor_copies[b] = _buffer_copies(b, devs)

    for i, orig in enumerate(originals):
        slots = [
            *((k, c, position) for k, c in orig._modules.items()),
            *((k, t, None) for k, t in orig._parameters.items()),
            *((k, t, None) for k, t in orig._buffers.items()),
        ]
        for j in range(n):
            shell = shells[j][i]
            for key, value, where in slots:
                if value is None:
                    _clear_slot(shell, orig, key)
                elif where is not None:
                    setattr(shell, key, shells[j][position[value]])  # type: ignore[index]
                else:
                    setattr(shell, key, tensor_copies[value][j])  # type: ignore[index]
    return [shells[j][0] for j in range(n)]


def _clear_slot(shell: nn.Module, orig: nn.Module, key: str) -> None:
    for table in ("_modules", "_parameters", "_buffers"):
        if key in getattr(orig, table):
            getattr(shell, table)[key] = None


def _ensure_concrete_type(replica: nn.Module) -> None:
    """TorchScript replicas lack ``_concrete_type``; set it so they can be scripted into others."""
    if isinstance(replica, torch.jit.RecursiveScriptModule) and not hasattr(
        replica, "_concrete_type"
    ):
        replica._concrete_type = torch._C.ConcreteModuleType.from_jit_type(replica._c._type())
