"""The seed's ``DataLayout`` (jactorch.data.layout), translated into treegather gather rules.

A seed layout maps dotted keys (``'a.b'``, ``'a.0'``) to specs. :func:`to_gather_layout` turns
it into a :func:`treegather.by_path` layout of custom rules ``f(values, device)`` that
:func:`treegather.gather` applies; the specs that add a ``<key>_length`` sibling return a
private :class:`_WithLength` marker, which :func:`insert_lengths` replaces afterwards, in the
parent mapping. Nothing here walks the per-replica outputs: treegather does.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import torch

from .._errors import LayoutError, LeafTypeError, ShapeMismatchError
from .._layout import by_path
from .._tree import NAMESPACE, flatten

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
    "to_gather_layout",
    "translate",
]

_TYPES = ("skip", "stack", "concat", "pad", "pad2d", "padimage")
_WITH_LENGTH = ("concat", "pad", "pad2d", "padimage")


class DataLayoutSpec:
    """How one key of the outputs is gathered: the seed's ``DataLayoutSpec(type, **options)``.

    Args:
        type: one of ``'skip'``, ``'stack'``, ``'concat'``, ``'pad'``, ``'pad2d'``,
            ``'padimage'``.
        **kwargs: options; the padding specs read ``fill`` (default 0).

    Raises:
        LayoutError: ``type`` is not one of the names above.

    >>> DataLayoutSpec("pad", fill=-1)
    DataLayoutSpec('pad', fill=-1)
    """

    fill: Any = 0

    def __init__(self, type: str, **kwargs: Any) -> None:
        if not isinstance(type, str) or type.lower() not in _TYPES:
            raise LayoutError(
                f"unknown layout spec {type!r}; expected one of {', '.join(map(repr, _TYPES))}"
            )
        self.__dict__.update(kwargs)
        self.type = type.lower()

    def __repr__(self) -> str:
        if self.type in ("skip", "stack", "concat"):
            return f"DataLayoutSpec({self.type!r})"
        return f"DataLayoutSpec({self.type!r}, fill={self.fill!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataLayoutSpec):
            return NotImplemented
        return self.type == other.type and self.fill == other.fill

    def __hash__(self) -> int:
        return hash((self.type, repr(self.fill)))


def skip() -> DataLayoutSpec:
    """Keep the per-replica values untouched, as a list (a whole subtree on an inner key).

    >>> skip()
    DataLayoutSpec('skip')
    """
    return DataLayoutSpec("skip")


def stack() -> DataLayoutSpec:
    """Gather like :func:`~treegather.compat.jactorch.dict_gather_v1` (concatenate along ``dim``).

    Unlike :func:`treegather.stack`, this does not add a dimension: it is the seed's
    "no spec" behaviour, spelled out.

    >>> stack()
    DataLayoutSpec('stack')
    """
    return DataLayoutSpec("stack")


def concat() -> DataLayoutSpec:
    """Concatenate along dim 0 and add a ``<key>_length`` LongTensor of each replica's size(0).

    >>> concat()
    DataLayoutSpec('concat')
    """
    return DataLayoutSpec("concat")


def pad(fill: Any = 0) -> DataLayoutSpec:
    """Pad dim 0 of each replica to the longest with ``fill``, concatenate, add ``<key>_length``.

    Args:
        fill: the padding value.

    Returns:
        The spec.

    >>> pad(fill=-1)
    DataLayoutSpec('pad', fill=-1)
    """
    return DataLayoutSpec("pad", fill=fill)


def pad2d(fill: Any = 0) -> DataLayoutSpec:
    """Pad dims 0 and 1 with ``fill``, concatenate, add a ``<key>_length`` of shape (replicas, 2).

    Args:
        fill: the padding value.

    Returns:
        The spec.

    >>> pad2d()
    DataLayoutSpec('pad2d', fill=0)
    """
    return DataLayoutSpec("pad2d", fill=fill)


def padimage(fill: Any = 0) -> DataLayoutSpec:
    """Pad H and W of (C, H, W) images, concatenate along dim 0, add ``<key>_length`` (replicas, 2).

    The seed's ``padimage()`` built a ``pad2d`` spec; this one is a real ``padimage``.

    Args:
        fill: the padding value.

    Returns:
        The spec.

    >>> padimage()
    DataLayoutSpec('padimage', fill=0)
    """
    return DataLayoutSpec("padimage", fill=fill)


class DataLayout:
    """A seed layout: dotted keys (``'a.b'``, ``'a.0'``) mapped to :class:`DataLayoutSpec`.

    Args:
        layout: ``{key: spec}``, a spec being a :class:`DataLayoutSpec` or its type name.

    >>> layout = DataLayout({"z": "concat", "devices": "skip"})
    >>> "z" in layout, layout["z"], layout["missing"]
    (True, DataLayoutSpec('concat'), None)
    """

    def __init__(self, layout: Mapping[str, str | DataLayoutSpec] | None = None) -> None:
        self.layout: dict[str, DataLayoutSpec] = {}
        for key, spec in (layout or {}).items():
            self.decl(key, spec)

    def decl(self, key: str, spec: str | DataLayoutSpec) -> None:
        """Declare (or replace) the spec of ``key``.

        >>> layout = DataLayout()
        >>> layout.decl("a.b", "pad")
        >>> layout["a.b"]
        DataLayoutSpec('pad', fill=0)
        """
        if isinstance(spec, str):
            spec = DataLayoutSpec(spec)
        elif not isinstance(spec, DataLayoutSpec):
            raise LayoutError(
                f"layout key {key!r}: expected a DataLayoutSpec or a spec name, got {spec!r}"
            )
        self.layout[str(key)] = spec

    def __contains__(self, key: object) -> bool:
        return key in self.layout

    def __getitem__(self, key: str) -> DataLayoutSpec | None:
        return self.layout.get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def __repr__(self) -> str:
        return f"DataLayout({self.layout!r})"


LayoutLike = DataLayout | Mapping[str, str | DataLayoutSpec]


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


class _LengthRule:
    """``concat`` / ``pad`` / ``pad2d`` / ``padimage``: pad, concatenate along dim 0, record sizes."""

    def __init__(self, spec: DataLayoutSpec, where: str) -> None:
        self.spec, self.where = spec, where

    def __repr__(self) -> str:
        return f"<jactorch {self.spec!r} rule>"

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
        tensors = [v.to(device) for v in values]
        if kind == "concat":
            lengths = [[t.shape[0]] for t in tensors]
            padded = tensors
        else:
            axes = {"pad": (0,), "pad2d": (0, 1), "padimage": (1, 2)}[kind]
            lengths = [[t.shape[a] for a in axes] for t in tensors]
            target = [max(n[j] for n in lengths) for j in range(len(axes))]
            padded = []
            for t in tensors:
                shape = list(t.shape)
                for a, n in zip(axes, target):
                    shape[a] = n
                if shape == list(t.shape):
                    padded.append(t)
                    continue
                out = t.new_full(shape, self.spec.fill)
                out[tuple(slice(0, n) for n in t.shape)] = t
                padded.append(out)
        data = torch.cat(padded, dim=0)
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


def _where(entries: Sequence[optree.PyTreeEntry]) -> str:
    return optree.PyTreeAccessor(tuple(entries)).codify("outputs")


def _is_sequence(entry: optree.PyTreeEntry) -> bool:
    return issubclass(entry.type, Sequence) and not issubclass(entry.type, str)


def _seed_keys(entries: Sequence[optree.PyTreeEntry]) -> list[str | None]:
    """The seed's dotted key of each node on a path; a top-level sequence adds no prefix."""
    keys: list[str | None] = []
    key: str | None = None
    for entry in entries:
        if key is None and _is_sequence(entry):
            keys.append(None)
            continue
        part = str(entry.entry)
        key = part if key is None else f"{key}.{part}"
        keys.append(key)
    return keys


def _escape(segment: str) -> str:
    """One exact by_path segment: fnmatch specials escaped; a '.' in a key matches as '?'."""
    out = "".join(f"[{c}]" if c in "*?[" else c for c in segment)
    return out.replace(".", "?")


_CACHE: dict[Any, Any] = {}


def to_gather_layout(layout: LayoutLike, example: Any) -> Any:
    """Translate a seed layout into a :func:`treegather.by_path` layout for ``example``'s structure.

    ``example`` is one replica's output: the seed's keys drop the indices of a top-level
    sequence, so they are resolved against the actual paths here, into exact by_path patterns
    of custom rules. A spec covers its subtree unless a deeper key overrides it; ``skip``
    applies to the whole node it names. Keys that match nothing are ignored, as in the seed.

    Args:
        layout: the seed layout (a :class:`DataLayout` or a dict).
        example: one replica's output tree.

    Returns:
        A :func:`treegather.by_path` layout, or ``None`` when every leaf keeps the default.

    >>> to_gather_layout({"z": "concat"}, (torch.zeros(()), {"z": torch.zeros(2)}))
    by_path({'1.z': <jactorch DataLayoutSpec('concat') rule>}, default=None)
    """
    return translate(layout, example)[0]


def translate(layout: LayoutLike, example: Any) -> tuple[Any, bool]:
    """:func:`to_gather_layout`, and whether any rule adds a ``<key>_length`` (cached).

    >>> translate({"z": "skip"}, {"z": 1})
    (by_path({'z': <jactorch skip rule>}, default=None), False)
    """
    seed = _as_layout(layout)
    leaves, treespec = flatten(example)
    try:
        key: Any = (
            treespec,
            tuple((k, s.type, s.fill) for k, s in seed.layout.items()),
            tuple(isinstance(leaf, (bool, int, float)) for leaf in leaves),
        )
        hash(key)
    except TypeError:  # an unhashable fill value: no caching
        key = None
    if key is not None and key in _CACHE:
        cached: tuple[Any, bool] = _CACHE[key]
        return cached
    rules: dict[tuple[str, ...], Any] = {}
    for leaf, accessor in zip(leaves, treespec.accessors()):
        entries = tuple(accessor)
        spec: DataLayoutSpec | None = None
        for depth, seed_key in enumerate(_seed_keys(entries)):
            if seed_key is not None and seed_key in seed:
                spec = seed[seed_key]
            if spec is not None and spec.type == "skip":
                rules[tuple(str(e.entry) for e in entries[: depth + 1])] = _SkipRule()
                break
        else:
            path = tuple(str(e.entry) for e in entries)
            if spec is not None and spec.type in _WITH_LENGTH:
                rules[path] = _LengthRule(spec, _where(entries))
            elif isinstance(leaf, (bool, int, float)):
                rules[path] = _NumbersRule(_where(entries))
    if () in rules:  # the outputs are a single leaf: its rule is the whole layout
        return rules[()], False
    _check_dotted_keys(rules, treespec)
    result: tuple[Any, bool] = (None, False)
    if rules:
        adds = any(isinstance(r, _LengthRule) for r in rules.values())
        result = (by_path({".".join(map(_escape, p)): r for p, r in rules.items()}), adds)
    if key is not None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = result
    return result


def _check_dotted_keys(rules: Mapping[tuple[str, ...], Any], treespec: Any) -> None:
    """A key with a '.' is matched as '?': make sure no sibling key then matches too."""
    dotted = [p for p in rules if any("." in seg for seg in p)]
    if not dotted:
        return
    paths = {
        tuple(str(e.entry) for e in accessor[:n])
        for accessor in treespec.accessors()
        for n in range(1, len(accessor) + 1)
    }
    for path in dotted:
        pattern = tuple(map(_escape, path))
        hits = [
            p for p in paths if len(p) == len(path) and all(map(fnmatch.fnmatchcase, p, pattern))
        ]
        if len(hits) > 1:
            others = sorted(".".join(h) for h in hits if h != path)
            raise LayoutError(
                f"the key path {'.'.join(path)!r} contains a '.', which treegather's dotted "
                f"paths cannot tell apart from {', '.join(map(repr, others))}\nHint: rename "
                "one of the keys"
            )


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
