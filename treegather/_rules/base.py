"""What every layout rule is: a small frozen object that owns its meaning.

A rule class says, for the values of one position of a tree (a leaf, or a subtree a whole-value
rule takes), everything treegather does with it: a scatter rule how it is cut for the devices
(:meth:`ScatterRule.shard`) and what each device gets (:meth:`ScatterRule.explain`); a gather
rule how the per-replica values become one (:meth:`GatherRule.combine`), what can be wrong with
them (:meth:`GatherRule.problem`, the text of the error) and what they become
(:meth:`GatherRule.becomes`, for :func:`treegather.explain`). A rule's short name (``"cat"``,
``"mean"``) registers with its class, and so does its constructor (``tg.mean``), so a layout
that names it, or forgets to call it, is understood without a table elsewhere. A new rule is one
class, its constructor and its export.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

from .._errors import layout_error, safe_repr

__all__ = [
    "Combining",
    "Cut",
    "GatherRule",
    "HINTS",
    "Problem",
    "Rule",
    "ScatterRule",
    "by_replica",
    "constructor",
    "custom_rule",
    "foreign_rule",
    "is_foreign",
    "is_number",
    "rule_named",
    "to_rule",
]

Tensor = torch.Tensor
R = TypeVar("R", bound=Callable[..., Any])


class Rule:
    """Base class of treegather's layout rules (frozen dataclasses, compared and keyed by value).

    Internal: the rules are made by their constructors (``tg.cat()``, ``tg.mean()``, ...), and a
    gather rule of your own is a callable ``f(values, device)`` in the layout (the per-replica
    values in, the gathered value out). A subclass defined outside treegather is refused in a
    layout with a :class:`~treegather.LayoutError` that says so (:func:`to_rule`).
    """

    phase: ClassVar[str] = ""
    whole: ClassVar[bool] = False
    """True when the rule takes a subtree whole instead of applying to each leaf below it."""
    name: ClassVar[str] = ""
    """The rule's short name in layouts (``"cat"``), registered with the class."""

    def __init_subclass__(cls, *, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
            _BY_NAME[name] = cls

    @classmethod
    def named(cls, dim: int) -> Rule:
        """The rule a layout means by the short name (``"cat"`` with the call's ``dim``)."""
        return cls()

    def describe(self) -> str:
        if not dataclasses.is_dataclass(self):  # (a subclass of someone else's: refused)
            return f"{type(self).__name__.lower()}()"
        fields = dataclasses.fields(self)
        args = ", ".join(
            f"{f.name}={safe_repr(getattr(self, f.name))}"
            for f in fields
            if getattr(self, f.name) != f.default
        )
        return f"{type(self).__name__.lower()}({args})"

    def _typed_fields(self) -> tuple[Any, ...]:
        """The field values, for :func:`treegather._caches.typed_key` (``True`` is not ``1``);
        a subclass that is no dataclass (someone else's, refused by :func:`to_rule`) by its
        id, so that the layout's key can be made and the layout refused as a cold call does."""
        if not dataclasses.is_dataclass(self):
            return (type(self).__qualname__, id(self))
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


# ------------------------------------------------------------------------------- scatter


class Cut(NamedTuple):
    """How scatter cuts one position (what :meth:`ScatterRule.shard` found)."""

    kind: str
    """``"split"`` (a tensor along ``dim``), ``"items"`` (a list of per-sample items), ``"whole"``
    (every device gets it) or ``"array"`` (an array-like the default sends whole: a problem next
    to split data)."""
    dim: int = 0
    rows: int = 0
    """The batch size this position is seen with (``"split"``, ``"items"``)."""
    sizes: tuple[int, ...] | None = None
    """Explicit shard sizes (``split(sizes=...)``)."""


WHOLE = Cut("whole")


class ScatterRule(Rule):
    """A rule for :func:`treegather.scatter`: how one position is cut for the devices."""

    phase = "scatter"

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        """How ``x`` is cut, or what is wrong with it (the path is added by the caller)."""
        raise NotImplementedError

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        """For :func:`treegather.explain`: what happens to ``x``, and what each device gets."""
        raise NotImplementedError


# -------------------------------------------------------------------------------- gather


class Combining(NamedTuple):
    """What a gather rule combines one position with."""

    target: torch.device
    moving: bool  # replicas' tensors live off the target
    sizes: tuple[int, ...] | None  # rows per replica (weights for mean)
    dim: int  # the call's dim (the default rules')
    node: Any = None  # the plan node (whole-value rules name it in their errors)
    inputs: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...] | None = None
    """Each replica's call ``(args, kwargs)``, where the gather follows one (``mean(weight=f)``)."""
    failed: bool = True
    """:meth:`GatherRule.problem` explains a combine that failed (``False``: it checks the
    values before they are moved, on every step, and leaves what torch itself refuses, such
    as a mix of dense and sparse tensors, to that explanation)."""


class Problem(NamedTuple):
    """What a rule found wrong with one position's values (one line of the error)."""

    text: str
    """The message, after the position's path."""
    type_problem: bool = False
    """A value of the wrong kind (``LeafTypeError``), rather than of the wrong shape or dtype
    (``ShapeMismatchError``)."""
    hint: str | None = None
    """A key of :data:`HINTS`: the usual fix, said once at the end of the error."""
    path: str | None = None
    """The paths the problem is at, when not the position's own (inside a whole subtree)."""


HINTS = {
    "shape": "pad() concatenates tensors whose other dims differ; as_list() keeps per-replica "
    "values",
    "dataclass": "register output dataclasses with treegather.register_dataclass(cls) (or "
    "@treegather.register_dataclass above @dataclass): they then come back whole",
    "dtype": "return one dtype from every replica (cast in the model, e.g. .float() or "
    ".long()); torch would promote them, and an int64 id does not survive float32",
    "meta": "a meta tensor has a shape and a dtype but no values (a model built or left on the "
    "meta device): materialise it first (e.g. module.to_empty(device=...) and load the "
    "weights), or keep it out of the outputs (as_list() leaves values untouched)",
    "uninitialized": "an uninitialized parameter or buffer belongs to a lazy module "
    "(torch.nn.LazyLinear, ...) that has not run yet: run one forward first, or keep it out of "
    "the outputs (as_list() leaves values untouched)",
    "kind": "torch combines dense tensors of the usual dtypes; as_list() keeps tensors of any "
    "other kind as they are, and a custom rule f(values, device) combines them your way",
}


class GatherRule(Rule):
    """A rule for :func:`treegather.gather`: how one position's per-replica values become one."""

    phase = "gather"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        """The combined value. Bad data may raise a plain error: :meth:`problem` names it."""
        raise NotImplementedError

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        """What is wrong with ``col`` under this rule (``None``: nothing). ``shown`` is the name
        the message gives the rule (default: :meth:`describe`)."""
        return None

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        """For :func:`treegather.explain`: what ``k`` replicas' values like ``x`` become (``k``
        unknown: ``None``), and a problem the rule would find."""
        raise NotImplementedError


def is_number(x: Any) -> bool:
    """A Python/numpy number that is not a bool."""
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def by_replica(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(f"replica {i}: {list(s)}" for i, s in enumerate(shapes))


# --------------------------------------------------------------------------- the registry

_BY_NAME: dict[str, type[Rule]] = {}
_CONSTRUCTORS: dict[int, tuple[Callable[..., Any], str]] = {}
_CUSTOM: list[Callable[[Callable[..., Any]], Rule]] = []


def constructor(rule: type[Rule]) -> Callable[[R], R]:
    """Register a rule's constructor (``tg.mean``): a layout that names the constructor without
    calling it (``{"loss": tg.mean}``) is then a clear error, not a custom rule."""

    def register(fn: R) -> R:
        _CONSTRUCTORS[id(fn)] = (fn, rule.name)
        return fn

    return register


def custom_rule(make: Callable[[Callable[..., Any]], Rule]) -> Callable[[Callable[..., Any]], Rule]:
    """Register how a callable in a layout becomes a rule (the custom gather rule)."""
    _CUSTOM.append(make)
    return make


def rule_named(name: str, dim: int) -> Rule | None:
    """The rule a short name means (``"cat"``), ``None`` for no rule of that name."""
    cls = _BY_NAME.get(name)
    return None if cls is None else cls.named(dim)


def to_rule(value: Any, phase: str, dim: int, where: str) -> Rule | None:
    """Normalise one layout entry to a rule (``None`` result: the default for the leaf's type).

    A rule is itself; ``None`` is ``broadcast()`` / ``first()``; an int is ``split(d)`` /
    ``cat(d)``; a string is a rule's short name; a callable is a custom gather rule.
    """
    if isinstance(value, Rule):
        if is_foreign(value):
            raise layout_error(foreign_rule(value, phase, where))
        if value.phase != phase:
            raise layout_error(
                f"{where}: {value.describe()} is a {value.phase} rule and cannot be used in {phase}"
            )
        return value
    if value is None:
        return rule_named("broadcast" if phase == "scatter" else "first", dim)
    if isinstance(value, bool):
        raise layout_error(f"{where}: {safe_repr(value)} is not a rule")
    if isinstance(value, int):
        return rule_named("split" if phase == "scatter" else "cat", value)
    if isinstance(value, str):
        rule = rule_named(value, dim)
        if rule is None:
            names = _names_by_closeness(value, phase)
            close = difflib.get_close_matches(value, names, n=1, cutoff=0.7) or [
                n for n in names[:1] if _SYNONYMS.get(value.lower()) == n
            ]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            other = difflib.get_close_matches(value, list(_BY_NAME), n=1, cutoff=0.7)
            if not close and other:
                hint = f" ({other[0]!r} is a {_BY_NAME[other[0]].phase} rule)"
            raise layout_error(
                f"{where}: unknown rule {safe_repr(value)}{hint}; the {phase} rules are "
                + ", ".join(map(repr, names))
            )
        if rule.phase != phase:
            raise layout_error(
                f"{where}: {safe_repr(value)} is a {rule.phase} rule, not a {phase} rule"
            )
        return rule
    if callable(value):
        found = _CONSTRUCTORS.get(id(value))
        if found is not None and found[0] is value:
            name = found[1]
            made = rule_named(name, dim)
            assert made is not None
            if made.phase == phase:
                use = (
                    f": write tg.{name}() (a callable in a layout is taken as a custom gather "
                    "rule f(values, device))"
                )
            else:
                use = f", and tg.{name}() is a {made.phase} rule, which {phase} cannot use"
            raise layout_error(f"{where}: tg.{name} is a rule factory, not a rule{use}")
        if phase != "gather":
            raise layout_error(f"{where}: custom callables are gather rules, not scatter rules")
        return _CUSTOM[0](value)
    raise layout_error(
        f"{where}: {safe_repr(value)} is not a rule (expected a rule, int, None or string)"
    )


# Names other libraries give these rules (torchmetrics' "avg", pandas' "concat"): ranked first.
_SYNONYMS = {
    "avg": "mean",
    "average": "mean",
    "concat": "cat",
    "concatenate": "cat",
    "add": "sum",
    "total": "sum",
    "list": "as_list",
    "tolist": "as_list",
    "chunk": "split",
    "replicate": "broadcast",
}


def _names_by_closeness(name: str, phase: str) -> list[str]:
    """The short names of the ``phase``'s rules, the closest to ``name`` first (a known synonym,
    then by similarity, then alphabetically)."""
    synonym = _SYNONYMS.get(name.lower())
    names = [n for n, cls in _BY_NAME.items() if cls.phase == phase]
    return sorted(
        names,
        key=lambda n: (n != synonym, -difflib.SequenceMatcher(None, name, n).ratio(), n),
    )


_PACKAGE = "treegather."


def is_foreign(value: Any) -> bool:
    """A :class:`Rule` of a class defined outside treegather (which layouts refuse)."""
    return isinstance(value, Rule) and not type(value).__module__.startswith(_PACKAGE)


def foreign_rule(value: Rule, phase: str, where: str) -> str:
    """The error for a subclass of :class:`Rule` defined outside treegather, in a layout: the
    rule classes are internal, and a gather rule of your own is a callable (``phase`` empty:
    a layout for either phase, as :func:`treegather.by_path` is when it is made)."""
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    scatter = "scatter takes split(), broadcast() and split_items() (or an int, None or a name)"
    if phase != "scatter":
        use = (
            "a gather rule of your own is a callable f(values, device) in the layout: it gets "
            "the per-replica values (subtrees on an inner node) and the target device and "
            "returns the gathered value, e.g. {'scores': lambda values, device: "
            "torch.stack([v.to(device) for v in values]).amax(0)}"
        )
        if not phase:  # (a layout for either)
            use += f"; {scatter}"
    else:
        use = scatter
    return (
        f"{where}: {name} subclasses treegather's internal rule class, "
        f"which layouts do not take from outside treegather; {use}"
    )
