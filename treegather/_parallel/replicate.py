"""replicate: one copy of a module, or of a tree of tensors, per device.

Copies are differentiable: gradients flowing into any replica reduce back onto the source
parameters (or source tensors). A module's replicas are built fresh (:mod:`.shells`) or, with
``reuse=True``, taken from the kept ones (:mod:`.kept`) and re-bound to the module as it is now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

import torch
from torch import nn

from .._devices import DeviceLike, as_devices
from .._tree import flatten
from .kept import give_back, reusable, take
from .shells import check_initialized, param_copies, replicate_module

__all__ = ["replicate"]

M = TypeVar("M", bound=nn.Module)


@overload
def replicate(
    module_or_tree: M, devices: Sequence[DeviceLike], *, detach: bool = ..., reuse: bool = ...
) -> list[M]: ...
@overload
def replicate(
    module_or_tree: Any, devices: Sequence[DeviceLike], *, detach: bool = ..., reuse: bool = ...
) -> list[Any]: ...


def replicate(
    module_or_tree: Any,
    devices: Sequence[DeviceLike],
    *,
    detach: bool = False,
    reuse: bool = False,
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
    >>> a = tg.replicate(lin, ["cpu"] * 2, reuse=True)
    >>> b = tg.replicate(lin, ["cpu"] * 2, reuse=True)
    >>> a[1] is b[1], a[1] is r[1]
    (True, False)

    A module gives one module per device, built like ``torch.nn.DataParallel``'s replicas
    (TorchScript modules too). Parameters are differentiable copies (on the source's own
    device, the source parameters themselves), so gradients accumulate on the original
    parameters, sparse gradients (``nn.Embedding(sparse=True)``) included; a replica's
    ``parameters()``, ``named_parameters()``, ``buffers()`` and ``.device``-style lookups give
    its own tensors. Each replica has hook tables of its own (copies of the source's): a hook
    its forward registers or removes is seen by that replica only, never by the source or
    another replica; so is anything its forward assigns on itself. Buffers are shared with
    the source by the first replica that sits on the source's device (replica 0 in the usual
    ``devices[0] == module device`` case), so BatchNorm running statistics are updated through
    that replica only, exactly as in ``nn.DataParallel``; every other replica gets a private
    copy, so threaded workers never write to the same buffer. When all devices are distinct
    CUDA devices and the module lives on ``devices[0]``, torch's coalesced broadcast does the
    copying (``torch.nn.parallel.replicate`` itself builds fresh replicas then; kept ones are
    re-bound to one coalesced broadcast of the parameters and one of the buffers per call).

    A compiled module (``torch.compile(m)`` or ``m.compile()``, also below the top level) gives
    compiled replicas that share its compiled code: dynamo treats the replicas' parameters as
    graph inputs, so a new replica does not recompile. The source is never modified.

    Any other value is a pytree (registered in treegather's namespace, e.g. the parameter
    dict for ``torch.func.functional_call``): each tensor leaf is copied (kept as it is on its
    own device), other leaves are shared, and the structure is rebuilt per device.

    Args:
        module_or_tree: an ``nn.Module`` (TorchScript included) or a pytree of tensors.
        devices: one device per replica; repeats are allowed.
        detach: detach the copies from autograd (torch's DataParallel passes
            ``not torch.is_grad_enabled()``).
        reuse: for a module, hand back the replicas of the previous ``reuse=True`` call for
            the same devices (and ``detach``) while you still hold them and the module's tree
            is unchanged, re-bound to the module as it is now (its attributes, hooks, buffers
            and parameters; what :func:`data_parallel` and :class:`DataParallel` do every
            step). They are the same objects each call: use one call's replicas before the
            next, from one thread. A replaced layer, parameter or buffer, a new attribute, a
            swapped class, ``.eval()`` / ``.train()`` or a compiled forward rebuilds them (a
            new hook or a changed attribute value is re-bound); replicas you no
            longer hold are rebuilt too (the cache holds nothing that keeps the module alive:
            a deleted module frees them). TorchScript modules are replicated anew every call.

    Returns:
        A list with one replica per entry of ``devices``.

    Raises:
        ValueError: ``devices`` is empty.
        UninitializedModuleError: the module has uninitialized (lazy) parameters or buffers
            (``nn.LazyLinear`` before its first forward); nothing is replicated.
        RuntimeError: a TorchScript module has plain Python modules below it (as in torch).
    """
    devs = as_devices(devices)
    if not devs:
        raise ValueError("replicate needs at least one device, got an empty device list")
    if isinstance(module_or_tree, nn.Module):
        check_initialized(module_or_tree, len(devs))
        if reuse and reusable(module_or_tree, devs):
            replicas, kept, _ = take(module_or_tree, devs, detach)
            if kept is not None:
                give_back(kept)  # the caller holds the replicas: kept weakly
            return replicas
        return replicate_module(module_or_tree, devs, detach)
    leaves, spec = flatten(module_or_tree)
    per_leaf = [
        param_copies(x, devs, detach) if isinstance(x, torch.Tensor) else [x] * len(devs)
        for x in leaves
    ]
    return [spec.unflatten([copies[j] for copies in per_leaf]) for j in range(len(devs))]
