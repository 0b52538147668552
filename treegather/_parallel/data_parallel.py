"""data_parallel: scatter, replicate, apply, gather, composed into one function.

The functional entry point, with its argument handling (``inputs`` as positional arguments,
the default devices) and the hint for a dict batch passed positionally. The
``torch.nn.DataParallel`` adapter (``DataParallel``, ``patch``) is
:mod:`treegather._nn_data_parallel`; what both do for one step (the replicas, the module's
device) is :mod:`treegather._step`; running eagerly under ``torch.compile`` is
:mod:`treegather._under_compile`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._devices import DeviceLike, as_device, as_devices
from .._errors import check_dim
from .._gather import gather_call
from .._scatter import scatter_call
from .apply import Backend, apply_calls
from .kept import Kept, give_back
from .step import (
    _check_module_device,
    _replicas_for_step,
    _trim_unsplit,
    calls_of,
    hint_module_kwargs,
)
from .under_compile import _compiler_active, _outside_compiler

__all__ = ["data_parallel"]


def data_parallel(
    fn: Callable[..., Any],
    inputs: Any,
    devices: Sequence[DeviceLike] | None = None,
    *,
    output_device: DeviceLike | None = None,
    module_kwargs: Mapping[str, Any] | None = None,
    in_layout: Any = None,
    out_layout: Any = None,
    dim: int = 0,
    backend: Backend = "auto",
) -> Any:
    """Evaluate ``fn(*inputs, **module_kwargs)`` split over ``devices``: scatter, replicate, apply, gather.

    >>> import torch, treegather as tg
    >>> net = torch.nn.Linear(3, 2)
    >>> x = torch.randn(5, 3)
    >>> out = tg.data_parallel(net, x, ["cpu"] * 2)
    >>> out.shape, torch.allclose(out, net(x))
    (torch.Size([5, 2]), True)
    >>> loss = lambda x: {"loss": x.pow(2).mean(), "tag": "sq"}
    >>> r = tg.data_parallel(loss, torch.arange(5.0), ["cpu"] * 3,
    ...                      out_layout={"loss": tg.mean(), "tag": "first"})
    >>> r["loss"].item() == torch.arange(5.0).pow(2).mean().item(), r["tag"]
    (True, 'sq')
    >>> batch = {"x": torch.zeros(4, 3), "ids": ["a", "b", "c", "d"]}
    >>> tg.data_parallel(lambda b: {"ids": [i * 2 for i in b["ids"]]}, batch, ["cpu"] * 2,
    ...                  in_layout=tg.by_path({"ids": tg.split_items()}),
    ...                  out_layout={"ids": tg.cat_items()})
    {'ids': ['aa', 'bb', 'cc', 'dd']}

    Steps: ``inputs`` and ``module_kwargs`` are divided by ``in_layout`` (default: tensors
    split along ``dim``, everything else broadcast); an ``nn.Module`` is replicated
    onto the devices that received a shard, and so is the module of a bound method
    (``data_parallel(model.generate, ...)`` calls each replica's ``generate``; a plain
    callable is called as it is, on every shard); :func:`parallel_apply` runs the shards with
    ``backend``; :func:`gather` combines the outputs on ``output_device`` by ``out_layout``,
    with the shard sizes, so ``mean()`` is exact for uneven splits, and with the shards' calls,
    for ``mean(weight=f)`` (weights from the data). The output is always gathered, so one
    device gives the same output shapes as N devices (a 0-dim loss becomes a vector unless
    ``out_layout`` says ``mean()``, ``sum()`` or ``first()``). When nothing is split (no tensor
    input with a batch dim), ``fn`` runs once, on the first device.

    A module's replicas are kept from step to step (held so that a deleted module frees
    them): each step re-binds them to the module as it is now (its attributes and hooks,
    buffers, and parameters on other devices), and a change to the module's tree (a replaced
    layer, a new attribute, ``.eval()``, ``.half()``, compiling it) rebuilds them. Results
    equal fresh replicas' exactly; concurrent steps on one module each get their own replicas.
    What a replica's forward registers (hooks) or assigns on itself (attributes, submodules,
    parameters, buffers) stays in that replica for that step: the module you pass never sees
    it, and neither does the next step.

    Under ``torch.compile``: a compiled model (``torch.compile(m)`` or ``m.compile()``) is
    replicated with its compiled code, which every replica shares. A compiled function that
    calls ``data_parallel`` works too, but ``data_parallel`` itself always runs eagerly there
    (a graph break, so ``fullgraph=True`` raises); compile the model for speed.

    Args:
        fn: an ``nn.Module`` (parameters and buffers on ``devices[0]``), a bound method of one
            (``model.generate``: each replica's method is called), or any callable.
        inputs: a tuple (not a namedtuple) is the positional arguments (``()`` = none);
            anything else is the single argument.
        devices: the devices (repeats allowed, e.g. ``["cpu"] * 4``); default: every
            visible CUDA device, else the CPU alone.
        output_device: where the result goes; default ``devices[0]``.
        module_kwargs: keyword arguments for ``fn``, scattered with the positional ones (a
            dict batch for ``model(**batch)``, as every Hugging Face model takes, goes here).
        in_layout: how the inputs are split, as the call was written. For a single input
            (``data_parallel(fn, batch)``), a layout of ``batch`` exactly as in
            :func:`scatter` (``by_path({"names": split_items()})``; a prefix tree of
            ``batch``, ``module_kwargs`` then keeping their default rules), whose
            :func:`by_path` patterns also name ``module_kwargs`` by keyword; for a tuple, a
            layout of ``(args, kwargs)`` as in :func:`scatter_kwargs` (``"0.names"``,
            ``"labels"``). A pattern that could mean a key of the single input or a keyword
            argument is a :class:`LayoutError`. ``explain(batch, in_layout, devices,
            module_kwargs=...)`` shows what it does.
        out_layout: a layout of ``fn``'s output as in :func:`gather`.
        dim: the default split/concatenation dim.
        backend: the :func:`parallel_apply` backend.

    Returns:
        The gathered output tree.

    Raises:
        RuntimeError: a module's parameters or buffers are not on ``devices[0]``.
        UninitializedModuleError: the module has uninitialized (lazy) parameters and the
            batch is split over 2 or more devices (one device calls the module itself).
    """
    if _compiler_active():
        return _outside_compiler(data_parallel)(
            fn,
            inputs,
            devices,
            output_device=output_device,
            module_kwargs=module_kwargs,
            in_layout=in_layout,
            out_layout=out_layout,
            dim=dim,
            backend=backend,
        )
    devs = _default_devices(devices)
    dim = check_dim(dim, "data_parallel")
    args_shards, kwargs_shards = scatter_call(inputs, module_kwargs, devs, in_layout, dim)
    args_shards, kwargs_shards = _trim_unsplit(args_shards, kwargs_shards)
    used = args_shards.devices or devs[: len(args_shards)]
    kept: Kept | None = None
    module = fn if isinstance(fn, nn.Module) else _module_of(fn)
    if module is None:
        fns: Any = fn
    elif len(used) == 1:
        _check_module_device(module, devs[0])
        fns = [fn]
    else:
        fns, kept = _replicas_for_step(module, used, devs[0])
        if fn is not module:  # a bound method: the same method of each replica
            fns = [types.MethodType(fn.__func__, replica) for replica in fns]  # type: ignore[attr-defined]
    calls = calls_of(args_shards, kwargs_shards)  # (run, and read by mean(weight=f))
    try:
        outputs = apply_calls(fns, calls, used, backend)
    except Exception as exc:
        hint_module_kwargs(exc, fn, inputs, module_kwargs)
        raise
    del fns  # nothing here holds the replicas when they are handed back
    if kept is not None:
        give_back(kept)  # not after a failed step: the next one builds new replicas
    target = devs[0] if output_device is None else as_device(output_device)
    return gather_call(outputs, target, out_layout, dim, args_shards.sizes, calls)


def _module_of(fn: Callable[..., Any]) -> nn.Module | None:
    """The module whose bound method ``fn`` is (``model.generate``), else None."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) and isinstance(fn, types.MethodType):
        return owner
    return None


def _default_devices(devices: Sequence[DeviceLike] | None) -> tuple[torch.device, ...]:
    if devices is not None:
        return as_devices(devices)
    if torch.cuda.is_available():
        return tuple(torch.device("cuda", i) for i in range(torch.cuda.device_count()))
    return (torch.device("cpu"),)


# torch.compile never traces into data_parallel (a graph break at the call, whose message says
# what to do under fullgraph=True); the call then runs eagerly through _outside_compiler.
data_parallel._torchdynamo_disable = True  # type: ignore[attr-defined]
data_parallel._torchdynamo_disable_msg = (  # type: ignore[attr-defined]
    "treegather.data_parallel runs eagerly; to compile the model, "
    "pass torch.compile(model) to data_parallel instead"
)
