"""DataParallel and patch: treegather's steps inside ``torch.nn.DataParallel``.

``DataParallel`` is a small adapter: a ``torch.nn.DataParallel`` subclass whose four steps are
treegather's (``device_ids`` in torch's conventions, the ``module.`` state_dict prefix kept);
``patch`` swaps the scatter/gather/replicate steps of an existing ``nn.DataParallel``. The
functional entry point is :func:`treegather.data_parallel` (:mod:`treegather._data_parallel`).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from .._devices import DeviceLike, as_device, as_devices
from .._gather import gather_call
from .._scatter import scatter_kwargs
from .._shards import Shards
from .apply import Backend, parallel_apply
from .kept import Kept, give_back
from .replicate import replicate
from .step import (
    _check_module_device,
    _replicas_for_step,
    _trim_unsplit,
    calls_of,
    hint_module_kwargs,
)

__all__ = ["DataParallel", "patch"]

T = TypeVar("T", bound=nn.Module)
DP = TypeVar("DP", bound=nn.DataParallel)


class DataParallel(nn.DataParallel):
    """``torch.nn.DataParallel`` whose scatter, replicate, parallel_apply and gather are treegather's.

    >>> import torch, treegather as tg
    >>> dp = tg.DataParallel(torch.nn.Linear(3, 2), device_ids=["cpu"] * 3)
    >>> isinstance(dp, torch.nn.DataParallel), list(dp.state_dict())
    (True, ['module.weight', 'module.bias'])
    >>> dp(torch.ones(4, 3)).shape
    torch.Size([4, 2])

    Inputs and outputs may be any registered pytree; ``in_layout`` (a layout of
    ``(args, kwargs)``) and ``out_layout`` say how each leaf is split and combined. Explicit
    device lists, CPU ones included (``["cpu"] * 4``), run the whole pipeline, even a single
    device (the output is still gathered, so shapes match N devices). ``device_ids=None``
    behaves like torch: every visible CUDA device, or on a machine without CUDA a plain call
    of the module. ``isinstance(dp, torch.nn.DataParallel)`` holds and ``state_dict()`` keys
    carry the usual ``module.`` prefix. Replicas are kept from call to call while the module
    is unchanged, as in :func:`data_parallel` (unless a subclass overrides ``replicate``);
    each replica's hook tables and attributes are its own, so nothing a replica's forward
    registers or assigns reaches ``module``.

    Only ``forward`` is data-parallel: to run another method of the module on every device
    (``generate``), pass the bound method to :func:`data_parallel`, e.g.
    ``tg.data_parallel(dp.module.generate, (), dp.device_ids, module_kwargs=batch,
    out_layout=tg.pad(0, fill=pad_id))``: each replica's ``generate`` runs on its shard, and
    sequences of uneven lengths are padded to the longest.

    Args:
        module: the module to parallelise (parameters and buffers on ``device_ids[0]``).
        device_ids: devices in torch's conventions (CUDA indices, strings, ``torch.device``).
        output_device: where outputs are gathered; default ``device_ids[0]``.
        dim: the default split/concatenation dim.
        in_layout: layout of ``(args, kwargs)`` for scatter.
        out_layout: layout of the module's output for gather.
        backend: the :func:`parallel_apply` backend.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        in_layout: Any = None,
        out_layout: Any = None,
        backend: Backend = "auto",
    ) -> None:
        if device_ids is None:
            super().__init__(module, None, output_device, dim)  # type: ignore[arg-type]
            self.dim = dim
        else:
            nn.Module.__init__(self)  # torch's __init__ drops device_ids without CUDA
            devs = as_devices(device_ids, "device_ids")
            self.module = module
            self.dim = dim
            self.device_ids = [_torch_id(d) for d in devs]
            out = devs[0] if output_device is None else as_device(output_device)
            self.output_device = _torch_id(out)
            self.src_device_obj = devs[0]
            if len(devs) == 1:
                self.module.to(devs[0])
        self.in_layout = in_layout
        self.out_layout = out_layout
        self.backend = backend

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter ``(inputs, kwargs)``, replicate, apply, gather; a plain call without devices."""
        with torch.autograd.profiler.record_function("DataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            keep = type(self).replicate is DataParallel.replicate  # kept replicas (issue 14)
            if not keep:
                _check_module_device(self.module, self.src_device_obj)
            args_shards, kwargs_shards = _as_shards(
                *self.scatter(inputs, kwargs, self.device_ids), self.device_ids
            )
            devices = _shard_devices(args_shards, self.device_ids)
            kept: Kept | None = None
            if len(devices) == 1:
                if keep:
                    _check_module_device(self.module, self.src_device_obj)
                replicas: Any = [self.module]
            elif keep:
                replicas, kept = _replicas_for_step(self.module, devices, self.src_device_obj)
            else:
                replicas = self.replicate(self.module, devices)
            try:
                outputs = self.parallel_apply(replicas, args_shards, kwargs_shards)
            except Exception as exc:
                hint_module_kwargs(exc, self.module, inputs, kwargs, dp=True)
                raise
            del replicas  # nothing here holds the replicas when they are handed back
            if kept is not None:
                give_back(kept)
            return self.gather(outputs, self.output_device)

    def replicate(self, module: T, device_ids: Sequence[DeviceLike]) -> list[T]:
        """:func:`treegather.replicate`, detached when grad mode is off (as torch does)."""
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> tuple[Shards, Shards]:
        """:func:`treegather.scatter_kwargs` with ``in_layout`` and ``dim``."""
        return scatter_kwargs(inputs, kwargs, device_ids, self.in_layout, dim=self.dim)

    def parallel_apply(
        self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        """:func:`treegather.parallel_apply`; the result carries the shard sizes for gather."""
        devices = _shard_devices(inputs, self.device_ids)[: len(replicas)]
        outputs = parallel_apply(list(replicas), inputs, kwargs, devices, backend=self.backend)
        sizes = getattr(inputs, "sizes", None)
        return Shards(outputs, sizes, tuple(devices), calls_of(inputs, kwargs))

    def gather(self, outputs: Any, output_device: DeviceLike) -> Any:
        """:func:`treegather.gather` with ``out_layout``, ``dim``, the shard sizes and (for
        ``mean(weight=f)``) the shards' calls that :meth:`parallel_apply`'s outputs carry."""
        sizes, calls = getattr(outputs, "sizes", None), getattr(outputs, "inputs", None)
        return gather_call(list(outputs), output_device, self.out_layout, self.dim, sizes, calls)


def patch(dp: DP, *, in_layout: Any = None, out_layout: Any = None) -> DP:
    """Make an existing ``nn.DataParallel`` scatter and gather pytrees with treegather.

    >>> import torch, treegather as tg
    >>> dp = tg.patch(torch.nn.DataParallel(torch.nn.Linear(3, 2)), out_layout={"a": tg.mean()})
    >>> a, kw = dp.scatter((torch.ones(4, 3),), {"tag": "x"}, ["cpu"] * 2)
    >>> [t[0].shape[0] for t in a], [k["tag"] for k in kw]
    ([2, 2], ['x', 'x'])
    >>> dp.gather([{"a": torch.tensor(1.0)}, {"a": torch.tensor(3.0)}], "cpu")
    {'a': tensor(2.)}

    ``dp.scatter`` and ``dp.gather`` become treegather's :func:`scatter_kwargs` and
    :func:`gather` with the given layouts and ``dp.dim``, also when ``dp`` has no devices
    (torch's own DataParallel still has both methods on a CPU-only machine, where its forward
    is a plain call). ``dp.parallel_apply`` stays torch's, its outputs carrying the shard sizes
    of its inputs and the shards' calls, so that ``mean()`` in ``out_layout`` is weighted
    exactly by torch's forward, by rows or (``mean(weight=f)``) by what ``f`` weighs in each
    call (torch passes the scatter's result to parallel_apply and that one's to gather). A gather of
    a plain list of outputs uses the sizes of ``dp``'s latest scatter, kept beside ``dp`` (in a
    weak table of treegather's, never on ``dp``): do not interleave two such manual steps on one
    patched module from several threads. ``dp.replicate`` becomes :func:`treegather.replicate`
    (torch's own coalesced copies on distinct CUDA devices, as before), so that a compiled
    model (``torch.compile(m)``) is replicated without being changed.

    Args:
        dp: the ``nn.DataParallel`` to patch (modified in place).
        in_layout: layout of ``(args, kwargs)`` for scatter.
        out_layout: layout of the module's output for gather.

    Returns:
        ``dp`` itself.
    """
    if not isinstance(dp, nn.DataParallel):
        raise TypeError(f"patch expects a torch.nn.DataParallel, got {type(dp).__name__}")
    dim = getattr(dp, "dim", 0)

    def scatter(
        self: nn.DataParallel,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> tuple[Shards, Shards]:
        shards = scatter_kwargs(inputs, kwargs, device_ids, in_layout, dim=dim)
        _LATEST_SIZES[self] = shards[0].sizes
        return shards

    apply = dp.parallel_apply  # torch's (or the class's own)

    def parallel_apply_(
        self: nn.DataParallel, replicas: Sequence[nn.Module], inputs: Any, kwargs: Any
    ) -> Any:
        outputs = apply(replicas, inputs, kwargs)
        sizes = getattr(inputs, "sizes", None)  # the scatter's Shards
        if sizes is not None and len(sizes) != len(outputs):
            sizes = None
        devices = tuple(getattr(inputs, "devices", ()))
        return Shards(list(outputs), sizes, devices, calls_of(inputs, kwargs))

    def gather_(self: nn.DataParallel, outputs: Any, output_device: DeviceLike) -> Any:
        sizes = getattr(outputs, "sizes", None) or _LATEST_SIZES.get(self)
        if sizes is not None and len(sizes) != len(outputs):
            sizes = None
        calls = getattr(outputs, "inputs", None)
        return gather_call(list(outputs), output_device, out_layout, dim, sizes, calls)

    def replicate_(
        self: nn.DataParallel, module: nn.Module, device_ids: Sequence[DeviceLike]
    ) -> list[nn.Module]:
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    dp.scatter = types.MethodType(scatter, dp)  # type: ignore[method-assign]
    dp.gather = types.MethodType(gather_, dp)  # type: ignore[method-assign]
    dp.replicate = types.MethodType(replicate_, dp)  # type: ignore[method-assign]
    dp.parallel_apply = types.MethodType(parallel_apply_, dp)  # type: ignore[method-assign]
    return dp


# The shard sizes of a patched module's latest scatter, for a gather of a plain list of outputs
# (torch's own forward passes Shards along, which carry them). State between two calls of one
# module, kept beside it (weakly: it goes with the module), not on it; not a cache.
_LATEST_SIZES: weakref.WeakKeyDictionary[nn.Module, tuple[int, ...] | None] = (
    weakref.WeakKeyDictionary()
)


def _as_shards(
    args_shards: Sequence[Any], kwargs_shards: Sequence[Any], device_ids: Sequence[Any]
) -> tuple[Shards, Shards]:
    """Take what ``scatter`` gave: treegather's ``Shards``, or plain per-device sequences from an
    overridden ``scatter`` (torch's API), padded to the same length as torch does."""
    if isinstance(args_shards, Shards) and isinstance(kwargs_shards, Shards):
        return _trim_unsplit(args_shards, kwargs_shards)
    args_list, kwargs_list = list(args_shards), list(kwargs_shards or ())
    n = max(len(args_list), len(kwargs_list))
    args_list += [()] * (n - len(args_list))
    kwargs_list += [{}] * (n - len(kwargs_list))
    devs = tuple(as_device(d) for d in device_ids[:n])
    sizes = getattr(args_shards, "sizes", None)
    return Shards(args_list, sizes, devs), Shards(kwargs_list, sizes, devs)


def _shard_devices(shards: Any, device_ids: Sequence[Any]) -> list[torch.device]:
    devices = getattr(shards, "devices", None)
    if devices:
        return list(devices)
    return [as_device(d) for d in device_ids[: len(shards)]]


def _torch_id(device: torch.device) -> Any:
    """torch's ``device_ids`` convention: an int for CUDA devices, else the device."""
    return device.index if device.type == "cuda" and device.index is not None else device
