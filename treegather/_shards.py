"""What scatter returns: the per-device trees, with the shard sizes gather needs.

(Its own module: the reference steps and the compiled layer both build it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Shards", "balanced"]


class Shards(list[Any]):
    """The per-device trees :func:`scatter` returns: a list, plus what gather needs to know.

    Attributes:
        sizes: rows in each shard (``None`` when nothing was split); pass them to
            :func:`gather` so that :func:`mean` is weighted exactly.
        devices: the device of each shard, in order.
        inputs: for the outputs of ``DataParallel.parallel_apply`` (and of a patched
            ``nn.DataParallel``'s), each replica's call ``(args, kwargs)``, which their
            ``gather`` passes to ``mean(weight=...)``; ``None`` elsewhere.
    """

    sizes: tuple[int, ...] | None
    devices: tuple[torch.device, ...]
    inputs: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...] | None

    def __init__(
        self,
        trees: Sequence[Any] = (),
        sizes: tuple[int, ...] | None = None,
        devices: tuple[torch.device, ...] = (),
        inputs: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...] | None = None,
    ) -> None:
        super().__init__(trees)
        self.sizes = sizes
        self.devices = devices
        self.inputs = inputs

    def __repr__(self) -> str:
        return f"Shards({list.__repr__(self)}, sizes={self.sizes}, devices={list(map(str, self.devices))})"


def balanced(n: int, k: int) -> tuple[int, ...]:
    """Rows per shard when ``n`` rows are split ``k`` ways, in ``torch.tensor_split`` order.

    >>> balanced(10, 4)
    (3, 3, 2, 2)
    """
    base, extra = divmod(n, k)
    return (base + 1,) * extra + (base,) * (k - extra)
