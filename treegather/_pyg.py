"""PyTorch Geometric's graph batches as values laid out by rows: one row per graph.

A PyG ``Batch`` (what ``torch_geometric.loader.DataLoader`` yields) is many graphs held as one
big disconnected graph: its node features are the graphs' nodes one after the other, its
``edge_index`` their edges with node numbers shifted, its ``batch`` vector says which graph
each node belongs to. No leaf of it is laid out by graphs (the node and edge counts differ
from graph to graph), so torch's ``DataParallel`` cannot split it, and PyG ships its own. Here
it is a value laid out by rows (:class:`~treegather._tree.Rows`), as a ``PackedSequence`` is:
scatter separates its graphs (PyG's ``to_data_list``: views of its tensors, so gradients flow
back to them) and batches each shard's graphs again (``Batch.from_data_list``, with the
original's ``follow_batch`` vectors); gather joins every replica's graphs in order the same
way; ``tgd.all_gather`` every rank's, in rank order; a ``Collector`` puts them in dataset order.

PyG makes its batch classes at run time (``DataBatch``, ``HeteroDataBatch``, one per ``Data``
subclass, the first time such graphs are batched), so they cannot be registered as tree nodes
one by one: every subclass of ``torch_geometric.data.Batch`` is held as a leaf laid out by rows
(:func:`~treegather._tree.rows_class`), looked up once per class. ``import treegather`` never
imports PyG: the class is read from ``sys.modules`` once PyG is loaded (nothing can be an
instance of it before). A single ``Data`` (one graph) sent where the batch is split is refused,
saying how to batch graphs.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ._tree.batch import RowsKind, rows_class, rows_kind

__all__ = ["GRAPHS"]


def _batch_class() -> type | None:
    """PyG's ``Batch``, once ``torch_geometric.data`` is loaded."""
    return getattr(sys.modules.get("torch_geometric.data.batch"), "Batch", None)


def _graph_class() -> type | None:
    """PyG's ``BaseData`` (``Data``, ``HeteroData``): one graph."""
    return getattr(sys.modules.get("torch_geometric.data.data"), "BaseData", None)


def _rows(batch: Any) -> int:
    return int(batch.num_graphs)


_OWN = frozenset(["batch", "ptr"])  # (the vectors Batch.from_data_list makes)


def _follow(batch: Any) -> list[str]:
    """The keys ``batch`` was made with ``follow_batch=`` for (its ``{key}_batch`` vectors)."""
    found = []
    for store, slices in _stores(batch):
        for key in store.keys():
            if key.endswith("_batch") and key[: -len("_batch")] in slices:
                found.append(key[: -len("_batch")])
    return sorted(set(found))


def _stores(batch: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Each store of ``batch`` (one for a ``Data``'s batch, one per node and edge type for a
    ``HeteroData``'s) with the slices PyG keeps for it."""
    slices = getattr(batch, "_slice_dict", None) or {}
    out = []
    for store in batch.stores:
        key = getattr(store, "_key", None)
        out.append((store, slices if key is None else slices.get(key, {})))
    return out


def _problem(batch: Any) -> str | None:
    name = type(batch).__qualname__
    if getattr(batch, "_slice_dict", None) is None:
        return (
            f"a {name} not made by torch_geometric.data.Batch.from_data_list: PyG cannot tell "
            "its graphs apart (it keeps no slices), so it cannot be split or joined by graphs; "
            "make it with Batch.from_data_list (or torch_geometric.loader.DataLoader), or mark "
            "it broadcast() in the layout"
        )
    follow = set(_follow(batch))
    extra = []
    for store, slices in _stores(batch):
        for key in store.keys():
            if key in slices or key in _OWN:
                continue
            if key.endswith(("_batch", "_ptr")) and key.rsplit("_", 1)[0] in follow:
                continue
            where = getattr(store, "_key", None)
            extra.append(repr(key) if where is None else f"{where!r}: {key!r}")
    if extra:
        return (
            f"a {name} with {', '.join(sorted(extra))} set after batching: it belongs to no "
            "graph, so splitting the batch by graphs would lose it; set it on each graph "
            "before batching, pass it beside the batch, or mark the batch broadcast() in the "
            "layout"
        )
    return None


def _split(batch: Any, sizes: Sequence[int]) -> list[Any]:
    if not _rows(batch):
        return [batch for _ in sizes]
    graphs = batch.to_data_list()
    follow = _follow(batch) or None
    made: Any = _batch_class()  # (a batch exists: PyG is loaded)
    out, start = [], 0
    for n in sizes:
        out.append(made.from_data_list(graphs[start : start + n], follow_batch=follow))
        start += n
    return out


def _join(values: Sequence[Any]) -> Any:
    present = [v for v in values if _rows(v)]
    if not present:
        return values[0]
    graphs = [g for v in present for g in v.to_data_list()]
    made: Any = _batch_class()
    return made.from_data_list(graphs, follow_batch=_follow(present[0]) or None)


def _to(batch: Any, device: torch.device) -> Any:
    # (PyG's .to() changes the batch it is called on: a shallow copy is moved, the one given
    # stays as it was)
    return copy.copy(batch).to(device)


def _tensors(batch: Any) -> tuple[list[torch.Tensor], Any]:
    """Every tensor of ``batch``'s stores, and how to make a batch around others in their place
    (a shallow copy: the one given stays as it was)."""
    at = [
        (i, key)
        for i, store in enumerate(batch.stores)
        for key, value in store.items()
        if isinstance(value, torch.Tensor)
    ]

    def rebuilt(tensors: list[torch.Tensor]) -> Any:
        out = copy.copy(batch)
        stores = out.stores
        for (i, key), t in zip(at, tensors, strict=True):
            stores[i][key] = t
        return out

    return [batch.stores[i][key] for i, key in at], rebuilt


GRAPHS = rows_kind(
    RowsKind(
        "graph batch",
        _rows,
        _split,
        _join,
        _to,
        _problem,
        "batch graphs with torch_geometric.data.Batch.from_data_list (what "
        "torch_geometric.loader.DataLoader yields), which treegather splits by graphs",
        tensors=_tensors,
    )
)

rows_class(_batch_class, GRAPHS, _graph_class)
