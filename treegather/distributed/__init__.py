"""Gather pytrees across processes: treegather's layouts on ``torch.distributed``.

:func:`all_gather`, :func:`gather` and :func:`broadcast` move whole pytrees between the ranks of
a process group (gloo on CPU, NCCL on CUDA, any backend with all-gather, gather and broadcast) and
combine them with exactly the rules of the single-process :func:`treegather.gather`: ``cat``
with uneven sizes, ``stack``, ``mean`` weighted by ``sizes``, ``pad``, ``as_list``, ``first`` and
custom callables; non-tensor leaves default to ``as_list()``. :class:`Collector` collects an
evaluation's outputs on each rank and exchanges them once, each sample once, in dataset order.
Only all-gather, gather and broadcast are used (how many: see :func:`all_gather`), which never
look at the values: ``bool``, ``bfloat16``, complex and float8 leaves travel on any backend;
conjugate and negative views travel as their values.

When the trees differ (a missing key, a tensor against a string, mismatched dtypes, ``sizes=``
on some ranks only, another ``dst``, ``layout`` or ``dim``) or a rank finds a problem before the
exchange (an unpicklable leaf), every rank raises the same error naming the leaf path and the
ranks, instead of hanging in a mismatched collective (``gather``: ``dst`` checks and tells).

Results are new tensors, detached from autograd (unless ``all_gather(sync_grads=True)``; a
backward through them says to pass it), built from the exchanged bytes on every rank (its own
contribution included), so all ranks compute bitwise-identical results, with rank 0's dict key
order; they land on the device of this rank's tensor leaves (the communication device when
those are spread over several). Bytes travel on the device torch uses for object collectives
(CPU for gloo, the current GPU for NCCL), or on the GPU when a group with several backends
(torch's default ``cpu:gloo,cuda:nccl``) holds GPU tensors on every rank.

The internal modules, one by one: "Across processes" in ``treegather/ARCHITECTURE.md``.

Security:
    Non-tensor leaves and the headers travel as :mod:`pickle` data and are unpickled on the
    receiving ranks, as with :func:`torch.distributed.all_gather_object`, only from the ranks of
    the process group you pass: only join process groups whose members you trust.
"""

from __future__ import annotations

from typing import Any

from . import calls
from .collector import Collector

__all__ = ["Collector", "all_gather", "gather", "broadcast"]
__dir__ = __all__.copy  # dir(): the public names, not the internal modules (calls, exchange, ...)


def all_gather(
    tree: Any,
    layout: Any = None,
    *,
    group: Any = None,
    dim: int = 0,
    sizes: int | None = None,
    sync_grads: bool = False,
) -> Any:
    """Gather every rank's ``tree`` onto every rank, combined leaf by leaf with ``layout``.

    The distributed counterpart of :func:`treegather.gather`, with the ranks of ``group`` as
    the replicas (in rank order): tensors are concatenated along ``dim`` by default (uneven
    lengths allowed; 0-dim tensors become a vector), other leaves become a list with one value
    per rank, and ``layout`` picks other rules (``stack``, ``mean``, ``pad``, ``first``, a custom
    callable, ...) for the whole tree, a prefix of it, or :func:`~treegather.by_path` patterns.

    A repeated structure (only the batch rows changing) costs one collective while its payload
    fits the group's inline capacity (up to 1 MiB per rank), else two, and no pickling for
    an all-tensor tree (ARCHITECTURE.md counts every case). Every rank must
    call it with a tree of the same structure (nodes the layout takes whole, such as per-sample
    lists under ``cat_items()``, may differ) and the same ``layout``/``dim``; otherwise every
    rank raises the same error.

    Args:
        tree: This rank's pytree (tensors on the rank's device, strings, numbers, ``None``,
            registered containers).
        layout: How to combine each leaf across ranks, as for :func:`treegather.gather`;
            ``None`` for the defaults.
        group: The process group; ``None`` for the default group.
        dim: The dimension ``cat`` and ``stack`` work along.
        sizes: This rank's weight for ``mean()`` (e.g. its batch size); exchanged with the
            others. Pass it on every rank or on none.
        sync_grads: Make the result differentiable: result tensors built from tensors that
            require grad pass gradients back to every rank's contribution, under any rule.
            The backward gives each rank the gradient of the sum of every rank's loss with
            respect to its own tensors (as ``torch.distributed.nn.functional.all_gather``),
            in one all-to-all for the whole tree, itself differentiable (``create_graph=True``:
            exact second derivatives); every rank must run it. No extra collective in the
            forward. Pass the same value on every rank. Without it, a backward that reaches a
            result whose inputs required grad raises, saying to pass ``sync_grads=True``.

    Returns:
        The combined tree, identical on every rank, on the device of this rank's tensors
        (new tensors, detached from autograd unless ``sync_grads``; see above).

    Raises:
        StructureMismatchError: The ranks' trees differ in structure (the message names the
            path and the ranks) or the ranks made different calls.
        ShapeMismatchError: A rule cannot combine the ranks' tensors (dtypes, other dims).
        BatchSizeError: ``sizes`` is not an int, or was passed on some ranks only; a node
            holding a batch size claims other rows than its leaves hold on a rank.
        LeafTypeError: A leaf cannot travel (unpicklable object, sparse tensor).
        LayoutError: ``layout`` does not fit the tree.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather as tg, treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> rank = dist.get_rank()  # every rank runs the same code
        >>> out = {"ids": torch.arange(rank + 2), "loss": torch.tensor(0.5), "name": f"r{rank}"}
        >>> tgd.all_gather(out)
        {'ids': tensor([0, 1]), 'loss': tensor([0.5000]), 'name': ['r0']}
        >>> tgd.all_gather(out, {"ids": tg.cat(), "loss": tg.mean(), "name": tg.first()}, sizes=2)
        {'ids': tensor([0, 1]), 'loss': tensor(0.5000), 'name': 'r0'}
        >>> dist.destroy_process_group()
    """
    return calls.all_gather(tree, layout, group, dim, sizes, sync_grads)


def gather(
    tree: Any,
    dst: int = 0,
    layout: Any = None,
    *,
    group: Any = None,
    dim: int = 0,
    sizes: int | None = None,
) -> Any:
    """Gather every rank's ``tree`` onto rank ``dst`` only; the other ranks get ``None``.

    Same rules and arguments as :func:`all_gather`, but the result is built on ``dst`` only
    (three collectives: lengths, one gather to ``dst``, and a small broadcast of the outcome
    from ``dst``; two for a repeated structure whose payload fits the inline capacity, which
    rides with the lengths to every rank). ``dst`` checks the headers and applies the rules,
    then tells the other ranks how it went, so that a structure, dtype or shape mismatch (or
    any error in a custom rule) raises on every rank, not only on ``dst``: the same error for
    treegather's own errors, a ``RuntimeError`` naming the original otherwise. The other ranks
    therefore return once ``dst`` has finished.

    Args:
        tree: This rank's pytree.
        dst: The global rank that receives the result (as in :func:`torch.distributed.gather`).
        layout: How to combine each leaf across ranks, as for :func:`treegather.gather`.
        group: The process group; ``None`` for the default group.
        dim: The dimension ``cat`` and ``stack`` work along.
        sizes: This rank's weight for ``mean()`` (e.g. its batch size).

    Returns:
        The combined tree on ``dst`` (on the device of ``dst``'s tensors); ``None`` elsewhere.

    Raises:
        StructureMismatchError: The ranks' trees differ in structure, or ranks disagree on ``dst``.
        ShapeMismatchError: A rule cannot combine the ranks' tensors.
        BatchSizeError: ``sizes`` is not an int, or was passed on some ranks only.
        LeafTypeError: A leaf cannot travel.
        ValueError: ``dst`` names no rank of the group on some rank (raised on every rank;
            :class:`~treegather.ArgumentTypeError` when it is not an int).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather as tg, treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> preds = {"logits": torch.ones(3, 2), "ids": ["a", "b", "c"]}  # per-sample ids
        >>> tgd.gather(preds, dst=0, layout={"logits": tg.cat(), "ids": tg.cat_items()})
        {'logits': tensor([[1., 1.], [1., 1.], [1., 1.]]), 'ids': ['a', 'b', 'c']}
        >>> dist.destroy_process_group()
    """
    return calls.gather(tree, dst, layout, group, dim, sizes)


def broadcast(tree: Any, src: int = 0, *, group: Any = None) -> Any:
    """Send rank ``src``'s ``tree`` to every rank of the group.

    Two collectives whatever the tree. The other ranks' ``tree`` is ignored (pass ``None``);
    they receive new tensors on their own device of the same kind as ``src``'s (their current
    CUDA device for CUDA tensors, CPU for CPU tensors or when they have no such device), and
    unpickled copies of the non-tensor leaves. Rank ``src`` gets its own ``tree`` back.

    Args:
        tree: The pytree to send, on rank ``src``; ignored on the other ranks.
        src: The global rank that sends (as in :func:`torch.distributed.broadcast`).
        group: The process group; ``None`` for the default group.

    Returns:
        Rank ``src``'s tree, on every rank.

    Raises:
        StructureMismatchError: The ranks disagree on ``src``.
        LeafTypeError: A leaf of ``src``'s tree cannot travel.
        ValueError: ``src`` names no rank of the group on some rank (raised on every rank;
            :class:`~treegather.ArgumentTypeError` when it is not an int).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> config = {"seed": 1234, "weights": torch.tensor([0.25, 0.75])} if dist.get_rank() == 0 else None
        >>> tgd.broadcast(config, src=0)
        {'seed': 1234, 'weights': tensor([0.2500, 0.7500])}
        >>> dist.destroy_process_group()
    """
    return calls.broadcast(tree, src, group)
