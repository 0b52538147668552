"""The seed's layout specs (jactorch.data.layout): ``DataLayoutSpec``, its constructors
(``skip``, ``stack``, ``concat``, ``pad``, ``pad2d``, ``padimage``) and ``DataLayout``, the
mapping of dotted keys to specs. :mod:`treegather.compat.jactorch.layout` translates them into
treegather gather rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..._errors import LayoutError

__all__ = [
    "DataLayout",
    "DataLayoutSpec",
    "LayoutLike",
    "concat",
    "pad",
    "pad2d",
    "padimage",
    "skip",
    "stack",
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
