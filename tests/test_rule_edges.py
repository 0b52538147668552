"""Every gather rule at the edges of its inputs, enumerated (issue 41, point 4).

One table: for each edge input (empty tensors, a replica of 0 rows, 0-dim tensors, bool
tensors, NaN and inf, Python numbers, bools and NaN, a numpy scalar of every numeric dtype at
its largest value, numpy NaN and bools, ``None``, strings, lists of items, one replica, sizes
adding up to 0) and each gather rule (``cat``, ``stack``, ``mean``, ``sum``, ``pad``,
``as_list``, ``first(check=True)``, ``cat_items``, a custom callable), what the gather gives:
the exact result, or a typed :class:`treegather.TreegatherError` naming the leaf's path (and the
rule, where the rule refuses the values). A custom rule's own exception is the user's: it keeps
its type and gets a note naming the path and the rule (``test_errors.py`` pins that contract).

Each case runs through the plain path (``reference_only``), through the compiled path (cold,
then until its structure is compiled), which must agree with it exactly, and through
``treegather.distributed.all_gather`` on a one-rank gloo group (rank 0's value, cold and on the
wire plan), which must give what the plain gather of that one replica gives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from rule_matrix import (
    RULES,
    SHOWN,
    Exact,
    Expect,
    Outcome,
    Typed,
    Users,
    differential,
    equal,
    run,
)
from rule_matrix import custom as _custom
from rule_matrix import problem as _matrix_problem

import treegather as tg
from treegather import _caches

T = torch.tensor
NAN, INF = math.nan, math.inf
PATH = re.compile(r"(^|\n  - )outputs\['m'\]\['x'\](\[\d+\])*: ")
"""Where a message names the leaf (a leaf below it, for a rule applied to a list)."""


class Edge(NamedTuple):
    name: str
    values: tuple[Any, ...]
    sizes: tuple[int, ...] | None
    expect: dict[str, Expect]


NEEDS_TENSORS = Typed(tg.LeafTypeError, "needs tensors, replica 0 holds")
NEEDS_A_LIST = Typed(tg.LeafTypeError, "needs a list or tuple in every replica; replica 0 holds")
DIFFERS = Typed(tg.ShapeMismatchError, "replica 1 differs from replica 0")
STRUCTURE = Typed(tg.StructureMismatchError, "replica 0 has a list of 1 item(s)", rule=False)


def tensors(
    name: str, values: tuple[Any, ...], sizes: tuple[int, ...] | None, **rules: Expect
) -> Edge:
    """An edge of tensors: ``as_list`` keeps them, ``first`` checks them, ``cat_items``
    refuses them, the custom rule does what it does; the other rules as given."""
    same = all(equal(v, values[0]) for v in values)
    expect: dict[str, Expect] = {
        "as_list": Exact(list(values)),
        "first": Exact(values[0]) if same else DIFFERS,
        "cat_items": NEEDS_A_LIST,
        "custom": _custom(values),
    }
    return Edge(name, values, sizes, {**expect, **rules})


def numbers(
    name: str,
    values: tuple[Any, ...],
    mean: Expect,
    sum: Expect,
    sizes: tuple[int, ...] | None = None,
) -> Edge:
    """An edge of numbers (Python's, numpy's; bools, strings): only mean and sum take them."""
    same = all(equal(v, values[0]) for v in values)
    return Edge(
        name,
        values,
        sizes,
        {
            "cat": NEEDS_TENSORS,
            "stack": NEEDS_TENSORS,
            "pad": NEEDS_TENSORS,
            "mean": mean,
            "sum": sum,
            "as_list": Exact(list(values)),
            "first": Exact(values[0]) if same else DIFFERS,
            "cat_items": NEEDS_A_LIST,
            "custom": _custom(values),
        },
    )


def _edge(
    name: str, values: tuple[Any, ...], sizes: tuple[int, ...] | None, expect: dict[str, Expect]
) -> Edge:
    """An edge with the custom rule's expectation added (what the callable itself does)."""
    return Edge(name, values, sizes, {**expect, "custom": _custom(values)})


def _numpy_edges() -> list[Edge]:
    """Every numpy numeric dtype at its largest value, twice: the mean is that value (numpy's
    mean dtype: float64 for integers), never an overflow; the sum is twice it in numpy's sum
    dtype (int64/uint64 for narrower integers), inf where a float dtype cannot hold it, and a
    typed error for 64-bit integers (numpy and torch would wrap around)."""
    edges = []
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        top = int(np.iinfo(t).max)
        wide = np.uint64 if np.dtype(t).kind == "u" else np.int64
        total: Expect = (
            Exact(wide(2 * top))
            if 2 * top <= np.iinfo(wide).max
            else Typed(tg.ShapeMismatchError, f"which {np.dtype(wide)} cannot hold")
        )
        edges.append(
            numbers(f"numpy {t.__name__}", (t(top), t(top)), Exact(np.float64(top)), total)
        )
    for f in (np.float16, np.float32, np.float64, np.longdouble):
        top = np.finfo(f).max
        edges.append(numbers(f"numpy {f.__name__}", (top, top), Exact(top), Exact(f(INF))))
    for c in (np.complex64, np.complex128, np.clongdouble):
        top = c(np.finfo(c).max + 1j)  # (the real dtype's largest value)
        twice = c(complex(INF, 2)) if c is not np.clongdouble else c(np.longdouble(INF) + 2j)
        edges.append(numbers(f"numpy {c.__name__}", (top, top), Exact(top), Exact(twice)))
    # numpy.int8(100) twice: 100.0, not -28.0; float16(60000) twice: 60000, not inf; weighted
    int8, half = (np.int8(100), np.int8(20)), (np.float16(60000), np.float16(60000))
    edges += [
        numbers("numpy int8 100", int8[:1] * 2, Exact(np.float64(100)), Exact(np.int64(200))),
        numbers("numpy float16 60000", half, Exact(half[0]), Exact(np.float16(INF))),
        numbers("numpy int8, sized", int8, Exact(np.float64(40)), Exact(np.int64(120)), (1, 3)),
        numbers("numpy float16, sized", half, Exact(half[0]), Exact(np.float16(INF)), (1, 3)),
    ]
    return edges


def _edges() -> list[Edge]:
    empty, rows = torch.zeros(0, 2), torch.ones(3, 2)
    nan_t = T([NAN, 1.0])
    mean_needs = Typed(tg.LeafTypeError, "needs tensors or numbers, replica 0 holds")
    zero_sizes = Typed(tg.ShapeMismatchError, "is weighted by sizes [0, 0], which add up to 0")
    nested = [NAN, {"t": T([NAN, 2.0])}, np.array([NAN, 1.0])]
    return [
        tensors(
            "empty tensors",
            (torch.zeros(0), torch.zeros(0)),
            (1, 1),
            cat=Exact(torch.zeros(0)),
            stack=Exact(torch.zeros(2, 0)),
            mean=Exact(torch.zeros(0)),
            sum=Exact(torch.zeros(0)),
            pad=Exact(torch.zeros(0)),
        ),
        tensors(
            "a replica of 0 rows",
            (empty, rows),
            (0, 3),
            cat=Exact(rows),
            stack=Typed(tg.ShapeMismatchError, "needs equal shapes, got replica 0: [0, 2]"),
            mean=Typed(tg.ShapeMismatchError, "needs equal shapes, got replica 0: [0, 2]"),
            sum=Typed(tg.ShapeMismatchError, "needs equal shapes, got replica 0: [0, 2]"),
            pad=Exact(rows),
        ),
        tensors(
            "0-dim",
            (T(1.0), T(4.0)),
            (1, 3),
            cat=Exact(T([1.0, 4.0])),
            stack=Exact(T([1.0, 4.0])),
            mean=Exact(T(3.25)),
            sum=Exact(T(5.0)),
            pad=Typed(tg.ShapeMismatchError, "needs tensors with the same number of dims (>= 1)"),
        ),
        tensors(
            "0-dim int",
            (T(3), T(4)),
            (1, 1),
            cat=Exact(T([3, 4])),
            stack=Exact(T([3, 4])),
            mean=Exact(T(3.5)),
            sum=Exact(T(7)),
            pad=Typed(tg.ShapeMismatchError, "needs tensors with the same number of dims (>= 1)"),
        ),
        tensors(
            "bool tensors",
            (T([True]), T([False])),
            (1, 1),
            cat=Exact(T([True, False])),
            stack=Exact(T([[True], [False]])),
            mean=Exact(T([0.5])),
            sum=Exact(T([1])),
            pad=Exact(T([True, False])),
        ),
        tensors(
            "NaN in the same places",
            (nan_t, nan_t.clone()),
            (1, 1),
            cat=Exact(T([NAN, 1.0, NAN, 1.0])),
            stack=Exact(torch.stack([nan_t, nan_t])),
            mean=Exact(nan_t),
            sum=Exact(T([NAN, 2.0])),
            pad=Exact(T([NAN, 1.0, NAN, 1.0])),
        ),
        tensors(
            "0-dim NaN",
            (T(NAN), T(NAN)),
            (1, 1),
            cat=Exact(T([NAN, NAN])),
            stack=Exact(T([NAN, NAN])),
            mean=Exact(T(NAN)),
            sum=Exact(T(NAN)),
            pad=Typed(tg.ShapeMismatchError, "needs tensors with the same number of dims (>= 1)"),
        ),
        tensors(
            "complex NaN",
            (T([complex(NAN, 1.0)]), T([complex(NAN, 1.0)])),
            (1, 1),
            cat=Exact(T([complex(NAN, 1.0)] * 2)),
            stack=Exact(T([[complex(NAN, 1.0)]] * 2)),
            mean=Exact(T([complex(NAN, 1.0)])),
            sum=Exact(T([complex(NAN, 2.0)])),
            pad=Exact(T([complex(NAN, 1.0)] * 2)),
        ),
        tensors(
            "inf and -inf",
            (T([INF]), T([-INF])),
            (1, 1),
            cat=Exact(T([INF, -INF])),
            stack=Exact(T([[INF], [-INF]])),
            mean=Exact(T([NAN])),
            sum=Exact(T([NAN])),
            pad=Exact(T([INF, -INF])),
        ),
        tensors(
            "one replica",
            (T([1.0, 2.0]),),
            (2,),
            cat=Exact(T([1.0, 2.0])),
            stack=Exact(T([[1.0, 2.0]])),
            mean=Exact(T([1.0, 2.0])),
            sum=Exact(T([1.0, 2.0])),
            pad=Exact(T([1.0, 2.0])),
        ),
        tensors(
            "sizes adding up to 0",
            (T(1.0), T(2.0)),
            (0, 0),
            cat=Exact(T([1.0, 2.0])),
            stack=Exact(T([1.0, 2.0])),
            mean=zero_sizes,
            sum=Exact(T(3.0)),
            pad=Typed(tg.ShapeMismatchError, "needs tensors with the same number of dims (>= 1)"),
        ),
        _edge(
            "numbers, sizes adding up to 0",
            (1.0, 2.0),
            (0, 0),
            {
                "cat": NEEDS_TENSORS,
                "stack": NEEDS_TENSORS,
                "mean": zero_sizes,
                "sum": Exact(3.0),
                "pad": NEEDS_TENSORS,
                "as_list": Exact([1.0, 2.0]),
                "first": DIFFERS,
                "cat_items": NEEDS_A_LIST,
            },
        ),
        numbers("Python ints", (1, 2), Exact(1.5), Exact(3)),
        numbers("Python ints, sized", (1, 2), Exact(1.75), Exact(3), (1, 3)),
        numbers("Python floats, sized", (0.5, 2.0), Exact(1.625), Exact(2.5), (1, 3)),
        numbers("Python NaN", (NAN, NAN), Exact(NAN), Exact(NAN)),
        numbers("Python inf and -inf", (INF, -INF), Exact(NAN), Exact(NAN)),
        numbers("Python floats near the top", (1e308, 1e308), Exact(1e308), Exact(INF)),
        numbers(
            "Python floats near the top, sized", (1e308,) * 2, Exact(1e308), Exact(INF), (1, 3)
        ),
        numbers("Python complex, sized", (1j, 2 + 0j), Exact(1.5 + 0.25j), Exact(2 + 1j), (1, 3)),
        numbers("Python bools", (True, False), mean_needs, mean_needs),
        numbers(
            "numpy NaN", (np.float32(NAN),) * 2, Exact(np.float32(NAN)), Exact(np.float32(NAN))
        ),
        numbers("numpy bools", (np.True_, np.False_), mean_needs, mean_needs),
        numbers("strings", ("a", "b"), mean_needs, mean_needs),
        *_numpy_edges(),
        _edge(
            "None",
            (None, None),
            (1, 1),
            {
                **{rule: Exact(None) for rule in ("cat", "stack", "mean", "sum", "pad")},
                "as_list": Exact([None, None]),
                "first": Exact(None),
                "cat_items": Typed(tg.LeafTypeError, "replica 0 holds NoneType None"),
            },
        ),
        _edge(
            "lists of items",
            ([1], [2, 3]),
            (1, 2),
            {
                **{rule: STRUCTURE for rule in ("cat", "stack", "mean", "sum", "pad")},
                "as_list": Exact([[1], [2, 3]]),
                "first": DIFFERS,
                "cat_items": Exact([1, 2, 3]),
            },
        ),
        _edge(
            "empty lists",
            ([], []),
            (0, 0),
            {
                **{rule: Exact([]) for rule in ("cat", "stack", "mean", "sum", "pad")},
                "as_list": Exact([[], []]),
                "first": Exact([]),
                "cat_items": Exact([]),
            },
        ),
        _edge(
            "NaN nested in a value",
            (nested, [NAN, {"t": T([NAN, 2.0])}, np.array([NAN, 1.0])]),
            None,
            {
                "cat": NEEDS_TENSORS,
                "stack": NEEDS_TENSORS,
                "mean": mean_needs,
                "sum": mean_needs,
                "pad": NEEDS_TENSORS,
                "as_list": Exact([nested, nested]),
                "first": Exact(nested),
                "cat_items": Exact([*nested, *nested]),
            },
        ),
    ]


# ---------------------------------------------------------------------------------- checks


def _gather(rule: str, values: tuple[Any, ...], sizes: tuple[int, ...]) -> Callable[[], Any]:
    outputs = [{"m": {"x": v}} for v in values]
    return lambda: tg.gather(outputs, "cpu", {"m": {"x": RULES[rule]}}, sizes=sizes)["m"]["x"]


def _problem(rule: str, expect: Expect, got: Outcome) -> str | None:
    """What is wrong with ``got`` for a case that should give ``expect`` (``None``: nothing)."""
    return _matrix_problem(SHOWN[rule], expect, got, PATH, "outputs['m']['x']")


EDGES = _edges()
CASES = [(rule, edge) for rule in RULES for edge in EDGES]


def test_the_matrix_covers_every_rule_and_every_edge() -> None:
    assert set(RULES) == {
        "cat",
        "stack",
        "mean",
        "sum",
        "pad",
        "as_list",
        "first",
        "cat_items",
        "custom",
    }
    for edge in EDGES:
        assert set(edge.expect) == set(RULES), edge.name
    exact = sum(isinstance(e.expect[r], Exact) for r, e in CASES)
    typed = sum(isinstance(e.expect[r], Typed) for r, e in CASES)
    users = sum(isinstance(e.expect[r], Users) for r, e in CASES)
    assert users == sum(isinstance(e.expect["custom"], Users) for e in EDGES)  # custom only
    assert exact + typed + users == len(CASES) >= 9 * 40


@pytest.mark.parametrize("rule", RULES)
def test_each_edge_is_exact_or_a_typed_error_in_the_plain_and_the_compiled_path(rule: str) -> None:
    with np.errstate(all="raise"):  # (no numpy warning either: an overflow raises)
        problems = []
        for edge in EDGES:
            call = _gather(rule, edge.values, edge.sizes)
            found = differential(call, lambda got: _problem(rule, edge.expect[rule], got))  # noqa: B023
            if found is not None:
                problems.append(f"{edge.name}: {found}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("rule", RULES)
def test_each_edge_through_all_gather_is_the_plain_gather_of_its_one_rank(
    world_of_one: None, rule: str
) -> None:
    import treegather.distributed as tgd
    from treegather.distributed.errors import rank_note

    problems = []
    with np.errstate(all="raise"):
        for edge in EDGES:
            tree = {"m": {"x": edge.values[0]}}
            size = None if edge.sizes is None else edge.sizes[0]
            layout = {"m": {"x": RULES[rule]}}
            with _caches.reference_only():
                one = None if size is None else [size]
                plain = run(lambda: tg.gather([tree], "cpu", layout, sizes=one)["m"]["x"])  # noqa: B023
            if plain.error is None:
                expected: Expect = Exact(plain.value)
            elif isinstance(plain.error, tg.TreegatherError):
                expected = Typed(type(plain.error), "", rule=False)
            else:
                expected = Users(type(plain.error))
            tg.clear_caches()
            for n in range(2):  # the header, then the wire plan
                got = run(lambda: tgd.all_gather(tree, layout, sizes=size)["m"]["x"])  # noqa: B023
                found = _problem(rule, expected, got)
                if found is None and isinstance(plain.error, tg.TreegatherError):
                    if str(got.error) != f"{plain.error}\n{rank_note([0])}":
                        found = f"says {str(got.error)!r}"
                if found is not None:
                    problems.append(f"{edge.name}: all_gather call {n} {found}")
                    break
    assert not problems, "\n".join(problems)


def test_explain_names_the_type_the_reductions_give_numbers() -> None:
    for edge in EDGES:
        for rule in ("mean", "sum"):
            expect = edge.expect[rule]
            if not isinstance(expect, Exact) or not all(map(tg._rules.is_number, edge.values)):
                continue
            shown = tg.explain(edge.values[0], RULES[rule], ["cpu"] * 2, "gather")["outputs"]
            kind = type(expect.value)
            name = kind.__qualname__ if kind.__module__ == "builtins" else f"numpy.{kind.__name__}"
            assert shown.result == name, (edge.name, rule)
