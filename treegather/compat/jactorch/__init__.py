"""Jacinle's ``jactorch.parallel.dict_gather`` API, working, as thin wrappers over treegather.

Same names and signatures as the seed. :func:`dict_gather_v1` is :func:`treegather.gather`
with its default rules; :func:`dict_gather_v2` turns the seed's layout into treegather rules
(see :mod:`treegather.compat.jactorch.layout`). Unlike the seed, replicas whose outputs
differ in length or keys raise :class:`treegather.StructureMismatchError` instead of being
truncated, and everything runs on the CPU too. Each seed name mapped to native treegather, and
every difference from the seed: ``treegather/compat/jactorch/README.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..._devices import DeviceLike, as_device, as_devices
from ..._gather import gather
from ..._parallel.kept import give_back, reusable, take
from ..._parallel.nn import DataParallel
from ..._rules import broadcast
from ..._scatter import scatter
from ..._shards import Shards
from ..._tree import NAMESPACE
from .layout import (
    DataLayout,
    DataLayoutSpec,
    LayoutLike,
    concat,
    gather_layout,
    insert_lengths,
    pad,
    pad2d,
    padimage,
    skip,
    stack,
)

__all__ = [
    # data-parallel modules
    "DictGatherDataParallel",
    "JacDataParallel",
    # gathering
    "dict_gather_v1",
    "dict_gather_v2",
    "data_parallel_dict_gather",
    "patch_dict_gathering",
    # layouts
    "DataLayout",
    "DataLayoutSpec",
    "skip",
    "stack",
    "concat",
    "pad",
    "pad2d",
    "padimage",
]


def _replicas(outputs: Sequence[Any]) -> list[Any]:
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise TypeError(
            f"outputs must be a list of per-replica outputs, got {type(outputs).__name__}"
        )
    if len(outputs) == 0:
        raise ValueError("outputs is empty: there is nothing to gather")
    return list(outputs)


def dict_gather_v1(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Gather per-replica outputs onto ``target_device`` (``-1`` means the CPU).

    Tensors are concatenated along ``dim`` (0-dim tensors become a vector of per-replica
    values), ``None`` stays ``None``, mappings and sequences (namedtuples too) are gathered
    item by item keeping their type, strings and other values become the list of per-replica
    values. Replicas whose keys or lengths differ raise
    :class:`treegather.StructureMismatchError` (the seed truncated them).

    Args:
        outputs: one output tree per replica.
        target_device: where the gathered tensors go; ``-1`` or ``"cpu"`` for the CPU.
        dim: the dimension tensors are concatenated along.

    Returns:
        The gathered tree.

    >>> loss = [torch.tensor(1.0), torch.tensor(3.0)]
    >>> out = dict_gather_v1([(loss[0], {"n": "a"}), (loss[1], {"n": "b"})], -1)
    >>> out
    (tensor([1., 3.]), {'n': ['a', 'b']})
    """
    return gather(_replicas(outputs), as_device(target_device), dim=dim)


def dict_gather_v2(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    layout: LayoutLike | None = None,
    dim: int = 0,
) -> Any:
    """Gather like :func:`dict_gather_v1`, with per-key specs from a seed layout.

    ``layout`` (a :class:`DataLayout` or a plain dict) maps dotted keys (``'a.b'``; ``'a.0'``
    for an item of a sequence inside a dict; a top-level tuple adds no prefix) to a spec,
    which covers the key's subtree unless a deeper key overrides it: ``skip`` (the list of
    per-replica values, untouched), ``stack`` (as v1), ``concat``, ``pad(fill)``,
    ``pad2d(fill)`` and ``padimage(fill)``; the last four concatenate along dim 0 and add a
    sibling ``<key>_length`` LongTensor (on the CPU, as the seed) to the parent mapping.
    With a layout, Python ints/bools become int64 tensors and floats float64 tensors.

    Args:
        outputs: one output tree per replica.
        target_device: where the gathered tensors go; ``-1`` means the CPU.
        layout: the seed layout; ``None`` gathers as :func:`dict_gather_v1`.
        dim: the dimension unspecified tensors are concatenated along.

    Returns:
        The gathered tree, with the ``_length`` keys added.

    Raises:
        treegather.LayoutError: a ``_length`` key would go into a sequence or clash with a key.
        treegather.LeafTypeError: a padding spec met a non-tensor.
        treegather.ShapeMismatchError: the tensors of a padding spec do not fit together.

    >>> outs = [{"z": torch.ones(2, 1), "n": 1}, {"z": torch.zeros(1, 1), "n": 2}]
    >>> out = dict_gather_v2(outs, -1, layout={"z": "pad"})
    >>> out["z"].flatten(), out["z_length"], out["n"]
    (tensor([1., 1., 0., 0.]), tensor([2, 1]), tensor([1, 2]))
    """
    if layout is None:
        return dict_gather_v1(outputs, target_device, dim=dim)
    replicas = _replicas(outputs)
    rules, adds_lengths = gather_layout(layout, replicas[0])
    out = gather(replicas, as_device(target_device), rules, dim=dim)
    return insert_lengths(out) if adds_lengths else out


def data_parallel_dict_gather(
    data_parallel: torch.nn.Module,
    outputs: Sequence[Any],
    output_device: DeviceLike,
    layout: LayoutLike | None = None,
) -> Any:
    """Gather ``outputs`` as :func:`dict_gather_v2`, along ``data_parallel.dim``.

    A ``torch.nn.DataParallel`` built where CUDA is missing has no ``dim`` attribute (the
    seed crashed on it); 0 is used then.

    Args:
        data_parallel: the data-parallel module whose ``dim`` is used.
        outputs: one output tree per replica.
        output_device: where the gathered tensors go; ``-1`` means the CPU.
        layout: an optional seed layout.

    Returns:
        The gathered tree.

    >>> dp = torch.nn.DataParallel(torch.nn.Identity())
    >>> data_parallel_dict_gather(dp, [{"x": torch.ones(1)}, {"x": torch.zeros(1)}], -1)
    {'x': tensor([1., 0.])}
    """
    dim = getattr(data_parallel, "dim", 0)
    return dict_gather_v2(outputs, output_device, layout=layout, dim=dim)


def patch_dict_gathering(data_parallel: torch.nn.DataParallel) -> None:
    """Make an existing ``DataParallel`` gather dicts (and any tree) with :func:`dict_gather_v2`.

    The patched ``data_parallel.gather(outputs, output_device)`` is called as torch calls it
    (the seed's patch raised "got multiple values for argument 'data_parallel'").

    Args:
        data_parallel: a ``torch.nn.DataParallel`` (or subclass) instance; patched in place.

    Raises:
        TypeError: ``data_parallel`` is not a ``torch.nn.DataParallel``.

    >>> dp = torch.nn.DataParallel(torch.nn.Identity())
    >>> patch_dict_gathering(dp)
    >>> dp.gather([{"x": torch.ones(1)}, {"x": torch.zeros(1)}], -1)
    {'x': tensor([1., 0.])}
    """
    if not isinstance(data_parallel, torch.nn.DataParallel):
        raise TypeError(
            f"patch_dict_gathering needs a torch.nn.DataParallel, got {type(data_parallel).__name__}"
        )

    def gather(outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        return data_parallel_dict_gather(data_parallel, outputs, output_device)

    data_parallel.gather = gather  # type: ignore[method-assign]


# ----------------------------------------------------------------------- data-parallel modules


class DictGatherDataParallel(DataParallel):
    """A :class:`treegather.DataParallel` that gathers with :func:`dict_gather_v2` (no layout).

    The seed's class, working: it is a ``torch.nn.DataParallel`` that also runs on explicit
    CPU device lists, and its ``dim`` is always set (the seed's gather crashed without CUDA).

    Args:
        module: the module to replicate.
        device_ids: the devices to run on (default: every CUDA device).
        output_device: where outputs are gathered (default: ``device_ids[0]``).
        dim: the dimension inputs are split and outputs concatenated along.

    >>> dp = DictGatherDataParallel(torch.nn.Identity(), device_ids=["cpu", "cpu"])
    >>> dp({"x": torch.arange(4.0), "tag": "t"})
    {'x': tensor([0., 1., 2., 3.]), 'tag': ['t', 't']}
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ) -> None:
        super().__init__(module, device_ids, output_device, dim)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Gather the replicas' outputs with :func:`data_parallel_dict_gather`."""
        return data_parallel_dict_gather(self, outputs, output_device)


class _CallbackContext:
    """Shared by the copies of one submodule during one replication (the seed's CallbackContext)."""


def _exec_replication_callback(modules: Sequence[torch.nn.Module]) -> None:
    """Call ``m.__data_parallel_replicate__(ctx, copy_id)`` on every submodule of every copy.

    Copies of the same submodule share one ``ctx``; the master copy (0) is called first.
    """
    ctxs = [_CallbackContext() for _ in modules[0].modules()]
    for copy_id, module in enumerate(modules):
        for ctx, m in zip(ctxs, module.modules()):
            callback = getattr(m, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctx, copy_id)


def _rows(tree: Any) -> int:
    """A shard's batch size, best effort: dim 0 of its first tensor with dims, else 1."""
    for leaf in optree.tree_leaves(tree, namespace=NAMESPACE):
        if torch.is_tensor(leaf) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _as_shards(
    inputs: Sequence[Any], kwargs: Sequence[Any] | None, device_ids: Sequence[DeviceLike], what: str
) -> tuple[Shards, Shards]:
    """Per-device ``(inputs, kwargs)`` lists as the Shards treegather's forward expects."""
    if isinstance(inputs, Shards) and isinstance(kwargs, Shards):
        return inputs, kwargs
    args = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    kws = [dict(k) for k in (kwargs or [])]
    n = max(len(args), len(kws))
    args += [()] * (n - len(args))
    kws += [{}] * (n - len(kws))
    devices = as_devices(device_ids, "device_ids")
    if not 1 <= n <= len(devices):
        raise ValueError(
            f"{what} gave {n} per-device inputs for {len(devices)} devices; give one per device "
            "(or fewer)"
        )
    sizes = tuple(_rows(x) for x in zip(args, kws))
    return Shards(args, sizes, devices[:n]), Shards(kws, sizes, devices[:n])


def _user_scattered(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]
) -> tuple[Shards, Shards]:
    """The seed's ``use_user_scattered``: one positional list of per-device inputs, moved."""
    what = "JacDataParallel(user_scattered=True)"
    if kwargs:
        raise TypeError(f"{what} takes no keyword arguments, got {sorted(kwargs)}")
    if len(inputs) != 1 or not isinstance(inputs[0], (list, tuple)):
        got = f"{len(inputs)} positional arguments"
        if len(inputs) == 1:
            got = f"a {type(inputs[0]).__name__}"
        raise TypeError(f"{what} is called with one list of per-device inputs, got {got}")
    devices = as_devices(device_ids, "device_ids")
    moved = [(scatter(x, [d], broadcast())[0],) for x, d in zip(inputs[0], devices)]
    if len(inputs[0]) > len(devices):
        moved += [(x,) for x in inputs[0][len(devices) :]]  # reported by _as_shards
    return _as_shards(moved, None, devices, what)


class JacDataParallel(DataParallel):
    """The seed's ``JacDataParallel`` on top of :class:`treegather.DataParallel`.

    Args:
        module: the module to replicate.
        device_ids: the devices to run on (default: every CUDA device).
        output_device: where outputs are gathered (default: ``device_ids[0]``).
        dim: the dimension inputs are split and outputs concatenated along.
        allow_replication_callback: call ``__data_parallel_replicate__(ctx, copy_id)`` on the
            submodules of every fresh replica (copies of one submodule share ``ctx``).
        user_scattered: the module is called with one list of per-device inputs, each passed
            (moved to its device) as the single positional argument of one replica.
        use_scatter_stream: accepted for compatibility; treegather picks its own copies.
        scatter_func: ``f(inputs, kwargs, device_ids, dim=dim) -> (inputs, kwargs)`` replacing
            the scatter step.
        use_dict_gather: gather with :func:`dict_gather_v2` (else treegather's gather).
        dict_gather_layout: the seed layout for :func:`dict_gather_v2`.
        persistent: keep the replicas across calls (treegather's kept replicas, as
            :func:`treegather.replicate` with ``reuse=True``): they are rebuilt only when the
            module changed (a replaced layer, ``.eval()``, a new attribute), and the
            replication callbacks run only on rebuilt replicas. Do not call one persistent
            instance from several threads at once.
        copy_parameters: kept for the seed's signature; replicas always compute with the
            module's current parameters (the parameters themselves on the module's device,
            a fresh differentiable copy elsewhere), so gradients reach the module exactly,
            whatever this is.
        copy_buffers: with ``persistent``, refresh the replicas' buffers from the module on
            every call (replica 0 shares the module's buffers; BatchNorm statistics move
            through it only, as in torch). ``False`` lets replicas other than 0 keep their
            own buffers from call to call, as the seed did.

    >>> dp = JacDataParallel(torch.nn.Identity(), device_ids=["cpu", "cpu"],
    ...                      dict_gather_layout={"z": "concat"})
    >>> out = dp({"z": torch.arange(3.0)})
    >>> out["z"], out["z_length"]
    (tensor([0., 1., 2.]), tensor([2, 1]))
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        allow_replication_callback: bool = True,
        user_scattered: bool = False,
        use_scatter_stream: bool = True,
        scatter_func: Callable[..., Any] | None = None,
        use_dict_gather: bool = True,
        dict_gather_layout: LayoutLike | None = None,
        persistent: bool = False,
        copy_parameters: bool = False,
        copy_buffers: bool = True,
    ) -> None:
        super().__init__(module, device_ids, output_device, dim)
        self.allow_replication_callback = allow_replication_callback
        self.user_scattered = user_scattered
        self.use_scatter_stream = use_scatter_stream
        self.scatter_func = scatter_func
        self.use_dict_gather = use_dict_gather
        self.dict_gather_layout = dict_gather_layout
        self.persistent = persistent
        self.copy_parameters = copy_parameters
        self.copy_buffers = copy_buffers

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> Any:
        """Split the inputs: ``scatter_func``, else the user's per-device list, else treegather."""
        if self.scatter_func is not None:
            args, kws = self.scatter_func(inputs, kwargs, device_ids, dim=self.dim)
            return _as_shards(args, kws, device_ids, "scatter_func")
        if self.user_scattered:
            return _user_scattered(inputs, kwargs, device_ids)
        return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module: torch.nn.Module, device_ids: Sequence[DeviceLike]) -> Any:
        """Replicate with treegather (kept across calls if ``persistent``), then run the
        replication callbacks on new replicas."""
        devs = as_devices(device_ids, "device_ids")
        callback = _exec_replication_callback if self.allow_replication_callback else None
        if self.persistent and reusable(module, devs):
            modules, kept, _ = take(
                module,
                devs,
                not torch.is_grad_enabled(),
                copy_buffers=self.copy_buffers,
                prepare=callback,
            )
            # Held here from call to call (the kept cache holds replicas only weakly while
            # something else does): the replicas, and what the callbacks gave them, stay.
            self.__dict__["_persistent_replicas"] = modules
            if kept is not None:
                give_back(kept)
            return modules
        modules = super().replicate(module, device_ids)
        if callback is not None:
            callback(modules)
        return modules

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Gather with :func:`dict_gather_v2` and ``dict_gather_layout`` (or treegather's)."""
        if self.use_dict_gather:
            return data_parallel_dict_gather(
                self, outputs, output_device, layout=self.dict_gather_layout
            )
        return super().gather(outputs, output_device)
