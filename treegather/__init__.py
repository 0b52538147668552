"""treegather: scatter, replicate, apply and gather over registered pytrees, for PyTorch.

The four steps of data parallelism as pure functions over pytrees (optree, namespace
``"treegather"``), each driven by a per-leaf layout: split or broadcast on the way in; cat,
stack, mean, sum, pad, as_list, first, cat_items or any callable on the way out.

>>> import torch, treegather as tg
>>> shards = tg.scatter({"x": torch.arange(6.0), "tag": "train"}, ["cpu"] * 3)
>>> tg.gather([{"y": s["x"] * 2, "tag": s["tag"]} for s in shards], "cpu",
...           tg.by_path({"tag": "first"}))
{'y': tensor([ 0.,  2.,  4.,  6.,  8., 10.]), 'tag': 'train'}
"""

from __future__ import annotations

from . import (
    _packed,  # noqa: F401  (PackedSequence: split and joined by rows)
    _pyg,  # noqa: F401  (PyG's graph batches: split and joined by graphs, once PyG is in use)
    _tensordict,  # noqa: F401  (registers tensordict's classes once it is in use)
    _transformers,  # noqa: F401  (registers transformers' caches once it is in use)
)
from ._caches import clear_caches
from ._errors import (
    ArgumentTypeError,
    BatchSizeError,
    DeviceError,
    LayoutError,
    LeafTypeError,
    ShapeMismatchError,
    StateError,
    StructureMismatchError,
    TreeDepthError,
    TreegatherError,
    UninitializedModuleError,
    WeightError,
)
from ._explain import explain
from ._explain.table import ExplainedLeaf, Explanation
from ._gather import gather
from ._layout import ByPath, by_path
from ._parallel import (
    DataParallel,
    data_parallel,
    parallel_apply,
    parallel_apply_async,
    patch,
    replicate,
)
from ._rules import (
    Padded,
    as_list,
    broadcast,
    cat,
    cat_items,
    first,
    mean,
    pad,
    split,
    split_items,
    stack,
    sum,
)
from ._scatter import scatter, scatter_kwargs
from ._shards import Shards
from ._tree import NAMESPACE, register_dataclass, register_node

__version__ = "0.1.0.dev0"

__all__ = [
    # the four steps
    "scatter",
    "scatter_kwargs",
    "gather",
    "Shards",
    # layouts: scatter rules
    "split",
    "broadcast",
    "split_items",
    # layouts: gather rules
    "cat",
    "stack",
    "mean",
    "sum",
    "pad",
    "as_list",
    "first",
    "cat_items",
    "Padded",
    # layouts: path patterns
    "by_path",
    "ByPath",
    # seeing what a layout does
    "explain",
    "Explanation",
    "ExplainedLeaf",
    # pytree registration
    "register_dataclass",
    "register_node",
    "NAMESPACE",
    # caches
    "clear_caches",
    # errors
    "TreegatherError",
    "LayoutError",
    "StructureMismatchError",
    "BatchSizeError",
    "WeightError",
    "LeafTypeError",
    "ShapeMismatchError",
    "DeviceError",
    "ArgumentTypeError",
    "UninitializedModuleError",
    "TreeDepthError",
    "StateError",
    # replicate, apply and the data-parallel entry points (issue 3)
    "replicate",
    "parallel_apply",
    "parallel_apply_async",
    "data_parallel",
    "DataParallel",
    "patch",
]


# --- treegather.distributed (lazy) -----------------------------------------------------------
# ``import treegather`` never imports the collectives: ``treegather.distributed`` loads on first
# use, as ``import treegather.distributed as tgd``, ``from treegather import distributed`` or
# ``tg.distributed``. (Not in ``__all__``, so that ``from treegather import *`` stays light.)
def __getattr__(name: str) -> object:
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """``dir(treegather)``: the public names (``__all__``, ``distributed`` and ``__version__``);
    the internal modules (``_gather``, ``_rules``, ...) stay importable, unlisted."""
    return sorted({*__all__, "distributed", "__version__"})
