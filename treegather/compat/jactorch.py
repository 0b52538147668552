"""Jacinle's ``jactorch.parallel.dict_gather`` API, working, as thin wrappers over treegather.

Same names and signatures as the seed. :func:`dict_gather_v1` is :func:`treegather.gather`
with its default rules; :func:`dict_gather_v2` turns the seed's layout into treegather rules
(see :mod:`treegather.compat._jactorch_layout`). Unlike the seed, replicas whose outputs
differ in length or keys raise :class:`treegather.StructureMismatchError` instead of being
truncated, and everything runs on the CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._devices import DeviceLike, as_device
from .._gather import gather
from ._jactorch_layout import (
    DataLayout,
    DataLayoutSpec,
    LayoutLike,
    concat,
    insert_lengths,
    pad,
    pad2d,
    padimage,
    skip,
    stack,
    to_gather_layout,
)

__all__ = [
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
    rules = to_gather_layout(layout, replicas[0])
    return insert_lengths(gather(replicas, as_device(target_device), rules, dim=dim))


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
