"""The pytree layer: treegather's optree namespace, which classes are nodes, flattening, paths.

:mod:`.registry` (the namespace, registration, the torch-pytree bridge, optional integrations),
:mod:`.batch` (nodes that carry the batch: metadata that follows the rows, values split by rows),
:mod:`.held` (where a value treegather does not know holds a tensor),
:mod:`.ops` (flatten, the plain definition), :mod:`.paths` (every node's path as the user would
type it) and :mod:`.text` (how messages describe a value).
"""

from __future__ import annotations

from .batch import (
    Batched,
    BatchNode,
    BatchRule,
    Rows,
    RowsKind,
    along_rows,
    batch_nodes,
    is_batched,
    one_row_of,
    rebuild,
    rows_class,
    rows_of,
    unwrapped,
)
from .held import held_tensor
from .ops import alike, depth_error, flatten, move_tree
from .paths import (
    INPUT_AND_KWARGS,
    MAPPING_KINDS,
    Node,
    child_styles,
    display_path,
    format_path,
    is_call_root,
    leaf_nodes,
    nodes,
)
from .registry import (
    NAMESPACE,
    Opaque,
    context_names,
    is_leaf,
    register_dataclass,
    register_node,
    registry_version,
    sync,
    watch,
)
from .text import describe, differing, dtype_text, shape_text, type_name

__all__ = [
    "BatchNode",
    "BatchRule",
    "Batched",
    "INPUT_AND_KWARGS",
    "MAPPING_KINDS",
    "NAMESPACE",
    "Node",
    "Opaque",
    "Rows",
    "RowsKind",
    "alike",
    "along_rows",
    "batch_nodes",
    "child_styles",
    "context_names",
    "depth_error",
    "describe",
    "differing",
    "display_path",
    "dtype_text",
    "flatten",
    "format_path",
    "held_tensor",
    "is_batched",
    "is_call_root",
    "is_leaf",
    "leaf_nodes",
    "move_tree",
    "nodes",
    "one_row_of",
    "rebuild",
    "register_dataclass",
    "register_node",
    "registry_version",
    "rows_class",
    "rows_of",
    "shape_text",
    "type_name",
    "sync",
    "unwrapped",
    "watch",
]
