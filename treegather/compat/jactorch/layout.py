"""The seed's ``DataLayout`` (jactorch.data.layout), translated into treegather gather rules.

A seed layout maps dotted keys (``'a.b'``, ``'a.0'``) to specs. :func:`to_gather_layout` looks
them up against one replica's output and writes a :func:`treegather.by_path` layout of exact
(tuple) paths to custom rules ``f(values, device)``, which treegather's resolver and
:func:`treegather.gather` apply (no glob escaping: a key with a ``.`` or ``*`` is just a key).
The padding specs use treegather's own padding step. The specs that add a ``<key>_length``
sibling return a private :class:`_WithLength` marker, which :func:`insert_lengths` replaces
afterwards, in the parent mapping. Nothing here walks the per-replica outputs: treegather does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import optree
import torch

from ..._caches import typed_key
from ..._errors import LayoutError, LeafTypeError, ShapeMismatchError
from ..._layout import by_path, display_path
from ..._rules import Combining, Pad
from ..._tree import NAMESPACE, flatten, nodes
from .spec import (
    _WITH_LENGTH,
    DataLayout,
    DataLayoutSpec,
    LayoutLike,
    concat,
    pad,
    pad2d,
    padimage,
    skip,
    stack,
)

__all__ = [
    "DataLayout",
    "DataLayoutSpec",
    "LayoutLike",
    "concat",
    "insert_lengths",
    "pad",
    "pad2d",
    "padimage",
    "skip",
    "stack",
    "gather_layout",
    "to_gather_layout",
]


class _WithLength:
    """What a length-adding rule returns: the gathered data and the sibling ``_length`` tensor."""

    __slots__ = ("data", "lengths", "spec", "where")

    def __init__(self, data: torch.Tensor, lengths: torch.Tensor, spec: DataLayoutSpec, where: str):
        self.data, self.lengths, self.spec, self.where = data, lengths, spec, where

    def __repr__(self) -> str:  # only seen if a marker escapes; it should not
        return f"_WithLength({self.where}, {self.spec!r})"


class _SkipRule:
    """The ``skip`` spec: the list of per-replica values (or subtrees), untouched."""

    def __call__(self, values: Sequence[Any], device: torch.device) -> list[Any]:
        return list(values)

    def __repr__(self) -> str:
        return "<jactorch skip rule>"

    def __eq__(self, other: object) -> bool:
        return type(other) is _SkipRule

    def __hash__(self) -> int:
        return hash(_SkipRule)

    def _typed_fields(self) -> tuple[Any, ...]:
        """Compared by value (:func:`treegather._caches.typed_key`): equal layouts share a plan."""
        return ()


class _NumbersRule:
    """No spec, under a layout: Python ints/bools -> an int64 tensor, floats -> float64."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, values: Sequence[Any], device: torch.device) -> torch.Tensor:
        bad = [i for i, v in enumerate(values) if not isinstance(v, (bool, int, float))]
        if bad:
            got = ", ".join(f"replica {i}: {type(values[i]).__name__}" for i in bad)
            raise LeafTypeError(
                f"{self.where}: replica 0 holds a Python number, so the layout makes an int64 or "
                f"float64 tensor of it, but {got}\nHint: return the same kind of value from every "
                "replica, or mark the key 'skip'"
            )
        dtype = torch.float64 if any(isinstance(v, float) for v in values) else torch.int64
        return torch.tensor(list(values), dtype=dtype, device=device)

    def __repr__(self) -> str:
        return "<jactorch numbers rule: ints -> int64, floats -> float64>"

    def __eq__(self, other: object) -> bool:
        return type(other) is _NumbersRule and other.where == self.where

    def __hash__(self) -> int:
        return hash(self.where)

    def _typed_fields(self) -> tuple[Any, ...]:
        """Compared by value (:func:`treegather._caches.typed_key`): equal layouts share a plan."""
        return (self.where,)


class _LengthRule:
    """``concat`` / ``pad`` / ``pad2d`` / ``padimage``: pad, concatenate along dim 0, record sizes.

    The padding is treegather's own :func:`treegather.pad` step: each replica's tensor gets a
    leading dim of 1, the core pads every dim but that one to the largest replica and
    concatenates along it, and the two leading dims are merged again: the seed's "pad the first
    dims to the longest, then concatenate along dim 0".
    """

    def __init__(self, spec: DataLayoutSpec, where: str) -> None:
        self.spec, self.where = spec, where

    def __repr__(self) -> str:
        return f"<jactorch {self.spec!r} rule>"

    def __eq__(self, other: object) -> bool:
        return type(other) is _LengthRule and typed_key(self._typed_fields()) == typed_key(
            other._typed_fields()
        )

    def __hash__(self) -> int:
        return hash((self.spec.type, self.where))

    def _typed_fields(self) -> tuple[Any, ...]:
        """Compared by value (:func:`treegather._caches.typed_key`): equal layouts share a plan."""
        return (self.spec.type, self.spec.fill, self.where)

    def _check(self, values: Sequence[Any]) -> None:
        kind = self.spec.type
        bad = [
            f"replica {i}: {type(v).__name__}"
            for i, v in enumerate(values)
            if not torch.is_tensor(v)
        ]
        if bad:
            raise LeafTypeError(
                f"{self.where}: layout {self.spec!r} needs a tensor in every replica, got "
                f"{', '.join(bad)}\nHint: use 'skip' (or no spec) for non-tensor values"
            )
        dtypes = [v.dtype for v in values]
        if len(set(dtypes)) > 1:  # as dict_gather_v1 (treegather.gather) refuses them
            got = ", ".join(f"replica {i}: {d}" for i, d in enumerate(dtypes))
            raise ShapeMismatchError(
                f"{self.where}: layout {self.spec!r} needs one dtype in every replica, got {got}"
                "\nHint: return one dtype from every replica (cast in the model, e.g. .float() or "
                ".long()); torch would promote them, and an int64 id does not survive float32"
            )
        shapes = [tuple(v.shape) for v in values]
        if kind == "padimage":  # (C, H, W) with the same C, as the seed
            ok = all(len(s) == 3 for s in shapes) and len({s[0] for s in shapes}) == 1
        else:  # the padded dims lead; the rest must agree
            lead = 2 if kind == "pad2d" else 1
            ok = all(len(s) >= lead for s in shapes) and len({s[lead:] for s in shapes}) == 1
        if not ok:
            rule = {
                "concat": "at least 1 dim, equal sizes after dim 0",
                "pad": "at least 1 dim, equal sizes after dim 0",
                "pad2d": "at least 2 dims, equal sizes after dim 1",
                "padimage": "(C, H, W) images with the same C",
            }[kind]
            got = ", ".join(f"replica {i}: {list(s)}" for i, s in enumerate(shapes))
            raise ShapeMismatchError(f"{self.where}: layout {self.spec!r} needs {rule}; got {got}")

    def __call__(self, values: Sequence[Any], device: torch.device) -> _WithLength:
        self._check(values)
        kind = self.spec.type
        rule = Pad(0, self.spec.fill)
        ctx = Combining(device, True, None, 0)
        if kind == "concat":  # equal sizes after dim 0: the core's pad is a plain concatenation
            data = rule.combine(tuple(values), ctx)
            lengths = [[v.shape[0]] for v in values]
        else:
            data = rule.combine(tuple(v.unsqueeze(0) for v in values), ctx).flatten(0, 1)
            axes = {"pad": (0,), "pad2d": (0, 1), "padimage": (1, 2)}[kind]
            lengths = [[v.shape[a] for a in axes] for v in values]
        # On the CPU, as the seed's torch.LongTensor (pack_padded_sequence wants CPU lengths).
        length = torch.tensor(lengths, dtype=torch.int64)
        return _WithLength(
            data, length[:, 0] if kind in ("concat", "pad") else length, self.spec, self.where
        )


def _as_layout(layout: LayoutLike) -> DataLayout:
    if isinstance(layout, DataLayout):
        return layout
    if isinstance(layout, Mapping):
        return DataLayout(layout)
    raise LayoutError(
        f"a seed layout is a DataLayout or a dict of dotted keys to specs, got {type(layout).__name__}"
    )


def _is_sequence(container: type) -> bool:
    return issubclass(container, Sequence) and not issubclass(container, str)


def to_gather_layout(layout: LayoutLike, example: Any) -> Any:
    """Translate a seed layout into a :func:`treegather.by_path` layout for ``example``'s structure.

    ``example`` is one replica's output. The seed's dotted keys (``'a.b'``) join the keys of a
    path with dots and drop the indices of a top-level sequence, so they are looked up against
    ``example``'s actual paths here and written as exact (tuple) paths, which treegather's own
    resolver applies: a key with a ``.``, ``*`` or ``[`` in it is just a key. A spec covers its
    subtree unless a deeper key overrides it; ``skip`` takes the whole node it names. Keys
    that match nothing are ignored, as in the seed.

    Args:
        layout: the seed layout (a :class:`DataLayout` or a dict).
        example: one replica's output tree.

    Returns:
        A :func:`treegather.by_path` layout, a single rule when ``example`` is one leaf, or
        ``None`` when every leaf keeps the default.

    >>> to_gather_layout({"z": "concat"}, (torch.zeros(()), {"z": torch.zeros(2)}))
    by_path({(1, 'z'): <jactorch DataLayoutSpec('concat') rule>}, default=None)
    """
    return gather_layout(layout, example)[0]


def gather_layout(layout: LayoutLike, example: Any) -> tuple[Any, bool]:
    """:func:`to_gather_layout`, and whether any rule adds a ``<key>_length`` sibling.

    Not cached: the rules compare by value, so treegather's compiled layer finds the plan it
    resolved for an equal layout on an earlier call.

    >>> gather_layout({"z": "skip"}, {"a.b": 1, "z": [2]})
    (by_path({('a.b',): <jactorch numbers rule: ints -> int64, floats -> float64>, ('z',): <jactorch skip rule>}, default=None), False)
    """
    seed = _as_layout(layout)
    leaves, treespec = flatten(example)
    keys: dict[tuple[Any, ...], str | None] = {}
    specs: dict[tuple[Any, ...], DataLayoutSpec | None] = {}
    rules: dict[tuple[Any, ...], Any] = {}
    skipped: set[tuple[Any, ...]] = set()
    containers: dict[tuple[Any, ...], type] = {}
    for node in nodes(treespec):
        raw = node.raw
        if not node.spec.is_leaf():
            containers[raw] = cast(type, node.spec.type)
        if raw:
            parent = raw[:-1]
            if parent in skipped:
                skipped.add(raw)
                continue
            above = keys[parent]
            if above is None and _is_sequence(containers[parent]):
                key = None  # a top-level sequence adds no prefix
            else:
                key = str(raw[-1]) if above is None else f"{above}.{raw[-1]}"
            keys[raw] = key
            declared = seed[key] if key is not None and key in seed else None
            spec = declared if declared is not None else specs[parent]
        else:
            keys[raw], spec = None, None
        specs[raw] = spec
        if spec is not None and spec.type == "skip":
            rules[raw] = _SkipRule()
            skipped.add(raw)
        elif node.spec.is_leaf():
            where = display_path(node, "outputs")
            if spec is not None and spec.type in _WITH_LENGTH:
                rules[raw] = _LengthRule(spec, where)
            elif isinstance(leaves[node.start], (bool, int, float)):
                rules[raw] = _NumbersRule(where)
    if () in rules:  # the outputs are a single leaf: its rule is the whole layout
        return rules[()], False
    if not rules:
        return None, False
    adds = any(isinstance(r, _LengthRule) for r in rules.values())
    return by_path(rules), adds


def insert_lengths(tree: Any) -> Any:
    """Replace each length marker by its data and a ``<key>_length`` sibling in the parent dict.

    Mutates the freshly gathered dicts in place (keeping key order, the ``_length`` key right
    after its key) and returns ``tree``. A marker under any other parent is an error.

    >>> insert_lengths({"a": 1})
    {'a': 1}
    """
    if isinstance(tree, _WithLength):
        raise LayoutError(f"{tree.where}: layout {tree.spec!r} needs a dict parent")
    if isinstance(tree, dict) and not dataclasses.is_dataclass(tree):
        items = list(tree.items())
        if not any(isinstance(v, _WithLength) for _, v in items):
            for _, value in items:
                insert_lengths(value)
            return tree
        tree.clear()
        for key, value in items:
            if not isinstance(value, _WithLength):
                tree[key] = insert_lengths(value)
                continue
            length_key = f"{key}_length" if isinstance(key, str) else None
            if length_key is None or length_key in dict(items):
                why = "that key is already in the outputs" if length_key else "the key is no str"
                raise LayoutError(
                    f"{value.where}: layout {value.spec!r} adds a sibling key "
                    f"{length_key or '<key>_length'!r}, but {why}\nHint: rename the key, or "
                    "use treegather.gather with pad(lengths=True)"
                )
            tree[key] = value.data
            tree[length_key] = value.lengths
        return tree
    if tree is None or torch.is_tensor(tree) or isinstance(tree, (str, bytes, int, float)):
        return tree
    try:
        children = optree.tree_flatten_one_level(tree, namespace=NAMESPACE).children
    except ValueError:  # a leaf
        return tree
    for child in children:
        if isinstance(child, _WithLength):
            raise LayoutError(
                f"{child.where}: layout {child.spec!r} adds a sibling '<key>_length', which "
                f"needs a dict parent, but the parent is a {type(tree).__name__}\nHint: use "
                "'stack' here, or treegather.gather with pad(lengths=True)"
            )
        insert_lengths(child)
    return tree
