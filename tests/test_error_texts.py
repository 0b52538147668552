"""No error text with a hole in it: every message a sample of bad inputs makes, checked whole.

Each case below is one bad call of a public entry point (scatter, gather, the layouts, explain,
replicate, the data-parallel entry points, registration, the distributed calls and the
Collector in a world of one, the seed API). Its error is rendered (``str``, with the notes
Python prints) and checked for an empty slot: two spaces inside a line (``"is a  rule"``), a
space before punctuation, empty quotes or brackets, a placeholder left unformatted
(``{target}``), a line ending in an article or a preposition, an ``f``-string's ``None`` where a
name should be. A message that names a user value shows what the user wrote, so the cases
use values with no spaces or brackets of their own.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from corpus import FILLS_THAT_DO_NOT_FIT, FOREIGN
from torch import nn

import treegather as tg

CPU2 = ["cpu"] * 2
Call = Callable[[], Any]

# (pattern, what it finds): applied to each line, its indentation (bullet lists) stripped.
HOLES = [
    (re.compile(r"\S {2,}\S"), "two spaces inside a line"),
    (re.compile(r" [,.;:](?=\s|$)"), "a space before punctuation"),
    (re.compile(r"(?<![\w)\]])''(?![\w(])|\"\""), "empty quotes"),
    (re.compile(r"\[\s*\]|\(\s+\)|\(\s*,|,\s+[)\]]|,\s*,"), "an empty item"),
    (re.compile(r"(?<!\{)\{[A-Za-z_][\w.]*\}(?!\})"), "a placeholder left unformatted"),
    (re.compile(r"\b(a|an|the|of|to|in|on|for|is)\s*$"), "a line ending mid-sentence"),
    (re.compile(r"\b(is a|an?|the|of|got) None (rule|value|tensor|device)\b"), "None for a name"),
]


def holes(text: str) -> list[str]:
    """Where ``text`` has an empty slot (empty: none)."""
    found = []
    for line in text.splitlines():
        if line != line.rstrip():
            found.append(f"a space at the end of a line: {line!r}")
        body = line.strip()
        for pattern, what in HOLES:
            if pattern.search(body):
                found.append(f"{what}: {body!r}")
    return found


def test_the_check_finds_the_holes_it_names() -> None:
    assert holes("outputs['x']: max2() is a  rule and cannot be used in gather")
    assert holes("cannot be stored in  (it would wrap)")
    assert holes("a meta tensor holds no data to gather onto {target}")
    assert holes("replica 0 holds ")
    assert holes("got , replica 1: [2]")
    assert not holes("2 problems:\n  - outputs['x']: cat(dim=0) needs tensors, got [1, 2]")
    assert not holes("e.g. {'scores': lambda values, device: f(v)} and ('a',) or as_list()")


# ------------------------------------------------------------------------------ the cases

CASES: dict[str, Call] = {}


def case(name: str) -> Callable[[Call], Call]:
    def register(fn: Call) -> Call:
        CASES[name] = fn
        return fn

    return register


def _cases(prefix: str, calls: dict[str, Call]) -> None:
    for name, call in calls.items():
        CASES[f"{prefix}.{name}"] = call


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


@dataclasses.dataclass
class Unregistered:
    x: torch.Tensor


def _self_containing() -> Any:
    tree: dict[str, Any] = {"x": torch.ones(2)}
    tree["me"] = tree
    return tree


class _Holder:
    """An unregistered class holding the batch."""

    def __init__(self) -> None:
        self.parts = {"x": torch.ones(2)}


def _raises(values: list[Any], device: torch.device) -> Any:
    raise ValueError("no")


def _raise(exc: BaseException) -> Any:
    raise exc


T1, T2, T3 = torch.ones(2, 3), torch.ones(2, 4), torch.ones(3)
OUTS = [{"x": T1, "n": 1}, {"x": T2, "n": 2}]

_cases(
    "scatter",
    {
        "batch_sizes": lambda: tg.scatter({"a": torch.ones(4), "b": torch.ones(5)}, CPU2),
        "dim": lambda: tg.scatter(torch.ones(4), CPU2, dim=3),
        "bool_dim": lambda: tg.scatter(torch.ones(4), CPU2, dim=True),
        "no_devices": lambda: tg.scatter(torch.ones(4), []),
        "bad_device": lambda: tg.scatter(torch.ones(4), ["nowhere"]),
        "split_a_string": lambda: tg.scatter({"s": "abc"}, CPU2, {"s": tg.split()}),
        "split_items_of_a_tensor": lambda: tg.scatter(
            {"s": torch.ones(2)}, CPU2, {"s": tg.split_items()}
        ),
        "split_sizes": lambda: tg.scatter(torch.ones(4), CPU2, tg.split(sizes=[1, 2])),
        "split_sizes_negative": lambda: tg.scatter(torch.ones(4), CPU2, tg.split(sizes=[5, -1])),
        "0_dim": lambda: tg.scatter({"x": torch.tensor(1.0), "y": torch.ones(2)}, CPU2, 0),
        "self_containing": lambda: tg.scatter(_self_containing(), CPU2),
        "unregistered_dataclass": lambda: tg.scatter(
            {"u": Unregistered(torch.ones(2)), "x": torch.ones(2)}, CPU2
        ),
        "object_holding_tensors": lambda: tg.scatter({"o": _Holder(), "x": torch.ones(2)}, CPU2),
        "container_holding_tensors": lambda: tg.scatter(
            {"c": collections.UserDict(ids=torch.ones(2)), "x": torch.ones(2)}, CPU2
        ),
        "meta": lambda: tg.scatter({"x": torch.ones(2, device="meta")}, ["cpu", "cpu"]),
        "kwargs_not_a_dict": lambda: tg.scatter_kwargs((), [1], CPU2),  # type: ignore[arg-type]
    },
)
_cases(
    "gather",
    {
        "empty": lambda: tg.gather([], "cpu"),
        "not_a_sequence": lambda: tg.gather(3, "cpu"),  # type: ignore[arg-type]
        "target": lambda: tg.gather([T3, T3], "nowhere"),
        "missing_key": lambda: tg.gather([{"a": T3, "b": T3}, {"a": T3}], "cpu"),
        "list_vs_tuple": lambda: tg.gather([[T3], (T3,)], "cpu"),
        "dtype": lambda: tg.gather([T3, T3.long()], "cpu"),
        "shapes": lambda: tg.gather(OUTS, "cpu"),
        "stack": lambda: tg.gather(OUTS, "cpu", {"x": tg.stack(), "n": "first"}),
        "pad_dims": lambda: tg.gather([T1, T3], "cpu", tg.pad()),
        "cat_dim": lambda: tg.gather([T1, T1], "cpu", tg.cat(5)),
        "mean_of_strings": lambda: tg.gather(["a", "b"], "cpu", tg.mean()),
        "sizes_length": lambda: tg.gather([T3, T3], "cpu", tg.mean(), sizes=[1]),
        "sizes_negative": lambda: tg.gather([T3, T3], "cpu", sizes=[1, -1]),
        "sizes_float": lambda: tg.gather([T3, T3], "cpu", sizes=[1, 1.5]),
        "sizes_zero": lambda: tg.gather([T3, T3], "cpu", tg.mean(), sizes=[0, 0]),
        "sizes_zero_numbers": lambda: tg.gather([1.0, 2.0], "cpu", tg.mean(), sizes=[0, 0]),
        "sum_beyond_int64": lambda: tg.gather([np.int64(2**62)] * 2, "cpu", tg.sum()),
        "mean_beyond_a_float": lambda: tg.gather([10**400, 1], "cpu", tg.mean()),
        "mean_of_bools": lambda: tg.gather([True, False], "cpu", tg.mean()),
        "sum_of_a_tensor_and_a_number": lambda: tg.gather([T3, 1.0], "cpu", tg.sum()),
        "meta": lambda: tg.gather([torch.ones(2, device="meta")] * 2, "cpu"),
        "cat_items": lambda: tg.gather([["a"], "b"], "cpu", tg.cat_items()),
        "cat_items_sizes": lambda: tg.gather([["a"], ["b"]], "cpu", tg.cat_items(), sizes=[2, 1]),
        "first_check": lambda: tg.gather([1, 2], "cpu", tg.first(check=True)),
        "custom_raises": lambda: tg.gather([T3, T3], "cpu", _raises),
        "unregistered": lambda: tg.gather([Unregistered(T3), Unregistered(T3)], "cpu", tg.cat()),
        "a_tensor_against_a_string": lambda: tg.gather([{"x": T3}, {"x": "s"}], "cpu"),
        "bool_dim": lambda: tg.gather([T3, T3], "cpu", dim=True),
        "stack_dim": lambda: tg.gather([T3, T3], "cpu", tg.stack(4)),
        "first_check_tensors": lambda: tg.gather([T3, T3 * 2], "cpu", tg.first(check=True)),
        "whole_then_leaf": lambda: tg.gather(
            [{"a": ["x"], "b": T1}, {"a": ["y", "z"], "b": T2}], "cpu", {"a": tg.as_list(), "b": 0}
        ),
        **{
            f"pad_fill_{dtype}_{fill!r}": (
                lambda dtype=dtype, fill=fill: tg.gather(
                    [torch.ones(1, 2).to(dtype), torch.ones(1, 3).to(dtype)], "cpu", tg.pad(1, fill)
                )
            )
            for dtype, fill in FILLS_THAT_DO_NOT_FIT
            if dtype != torch.complex32  # (torch warns that it is experimental)
        },
    },
)
_cases(
    "layout",
    {
        "unknown_rule": lambda: tg.gather([T3, T3], "cpu", "maen"),
        "scatter_rule_in_gather": lambda: tg.gather([T3, T3], "cpu", tg.split()),
        "gather_rule_in_scatter": lambda: tg.scatter(T3, CPU2, tg.mean()),
        "gather_name_in_scatter": lambda: tg.scatter(T3, CPU2, "mean"),
        "factory": lambda: tg.gather([T3, T3], "cpu", tg.mean),
        "scatter_factory": lambda: tg.scatter(T3, CPU2, tg.split),
        "bool": lambda: tg.gather([T3, T3], "cpu", True),
        "object": lambda: tg.gather([T3, T3], "cpu", object()),
        "callable_in_scatter": lambda: tg.scatter(T3, CPU2, lambda v, d: v),
        "prefix_lacks_a_key": lambda: tg.gather([{"a": T3, "b": T3}] * 2, "cpu", {"a": 0}),
        "prefix_container": lambda: tg.gather([{"a": T3}] * 2, "cpu", [0]),
        "by_path_matches_nothing": lambda: tg.gather([{"a": T3}] * 2, "cpu", tg.by_path({"b": 0})),
        "by_path_tie": lambda: tg.gather(
            [{"a": {"b": T3}}] * 2, "cpu", tg.by_path({"a.*": 0, "*.b": "stack"})
        ),
        "by_path_empty_segment": lambda: tg.by_path({"a..b": 0}),
        "by_path_pattern_type": lambda: tg.by_path({3: 0}),  # type: ignore[dict-item]
        "by_path_empty_path": lambda: tg.by_path({(): 0}),
        "by_path_optional_unknown": lambda: tg.by_path({"a": 0}, optional=["b"]),
        "by_path_optional_string": lambda: tg.by_path({"a": 0}, optional="a"),
        "by_path_not_a_mapping": lambda: tg.by_path([1]),  # type: ignore[arg-type]
        **{
            f"foreign_{type(rule).__name__}_{where}": (
                lambda rule=rule, where=where: tg.gather(
                    [{"s": T3}] * 2,
                    "cpu",
                    {"s": rule} if where == "prefix" else tg.by_path({"s": rule}),
                )
            )
            for rule in FOREIGN
            for where in ("prefix", "by_path")
        },
        "foreign_in_scatter": lambda: tg.scatter({"s": T3}, CPU2, {"s": FOREIGN[0]}),
    },
)


def _lazy() -> Any:
    return tg.data_parallel(nn.LazyLinear(2), torch.ones(4, 3), CPU2)


def _meta_module() -> Any:
    return tg.data_parallel(Net().to("meta"), torch.ones(4, 2), CPU2)


_cases(
    "parallel",
    {
        "lazy_module": _lazy,
        "module_elsewhere": _meta_module,
        "backend": lambda: tg.data_parallel(Net(), torch.ones(4, 2), CPU2, backend="fast"),  # type: ignore[arg-type]
        "no_devices": lambda: tg.data_parallel(Net(), torch.ones(4, 2), []),
        "dim": lambda: tg.data_parallel(Net(), torch.ones(4, 2), CPU2, dim=1.5),  # type: ignore[arg-type]
        "dict_positionally": lambda: tg.data_parallel(Net(), {"x": torch.ones(4, 2)}, CPU2),
        "forward_raises": lambda: tg.data_parallel(Net(), torch.ones(4, 3), CPU2),
        "apply_lengths": lambda: tg.parallel_apply([abs, abs], [(1,)], None, CPU2),
        "apply_backend": lambda: tg.parallel_apply([abs], [(1,)], backend="x"),  # type: ignore[arg-type]
        "replicate_devices": lambda: tg.replicate(Net(), []),
        "DataParallel_layout": lambda: tg.DataParallel(Net(), CPU2, out_layout="maen")(
            torch.ones(4, 2)
        ),
        "DataParallel_devices": lambda: tg.DataParallel(Net(), ["nowhere"])(torch.ones(4, 2)),
        "out_layout": lambda: tg.data_parallel(
            lambda x: {"y": x}, torch.ones(4), CPU2, out_layout={"z": 0}
        ),
        "in_layout": lambda: tg.data_parallel(
            lambda x: x, {"a": torch.ones(4)}, CPU2, in_layout=tg.by_path({"b": 0})
        ),
        **{
            f"weight_{name}": (
                lambda weight=weight: tg.data_parallel(
                    torch.mean,
                    (),
                    CPU2,
                    module_kwargs={"input": torch.ones(4)},
                    out_layout=tg.mean(weight=weight),
                )
            )
            for name, weight in (
                ("signature", lambda labels: 1),
                ("raises", lambda **_: 1 // 0),
                ("raises_no_text", lambda **_: _raise(KeyError())),
                ("negative", lambda **_: -0.5),
                ("nan", lambda **_: float("nan")),
                ("not_a_number", lambda **_: "3"),
            )
        },
    },
)
_cases(
    "explain",
    {
        "way": lambda: tg.explain(T3, way="sideways"),  # type: ignore[arg-type]
        "layout": lambda: tg.explain({"a": T3}, {"b": 0}),
        "devices": lambda: tg.explain(T3, devices=["nowhere"]),
        "gather_rule_in_scatter": lambda: tg.explain({"a": T3}, {"a": tg.mean()}),
    },
)


class NotADataclass:
    pass


@dataclasses.dataclass
class WithField:
    a: int = 0


@tg.register_dataclass(batch_size="rows")
@dataclasses.dataclass
class Sized:
    x: torch.Tensor
    rows: Any


_cases(
    "register",
    {
        "batch_size_field": lambda: tg.scatter({"s": Sized(torch.ones(4), None)}, CPU2),
        "dataclass": lambda: tg.register_dataclass(NotADataclass),
        "static_field": lambda: tg.register_dataclass(WithField, static=["nope"]),  # type: ignore[call-arg]
        "node": lambda: tg.register_node(int, None, None),  # type: ignore[arg-type]
    },
)


def _jactorch() -> dict[str, Call]:
    from treegather.compat import jactorch

    return {
        "v2_layout": lambda: jactorch.dict_gather_v2(
            [{"h": "a"}, {"h": "b"}], -1, layout={"h": jactorch.pad()}
        ),
        "v2_shapes": lambda: jactorch.dict_gather_v2(
            [{"h": torch.ones(2, 3)}, {"h": torch.ones(2, 4)}], -1, layout={"h": jactorch.concat()}
        ),
        "v1_target": lambda: jactorch.dict_gather_v1([{"h": T3}], "nowhere"),
    }


_cases("jactorch", _jactorch())


def _distributed() -> dict[str, Call]:
    def tgd() -> Any:
        import treegather.distributed as module

        return module

    def state_error() -> Any:
        collector = tgd().Collector()
        collector.add({"x": T3}, indices=[0, 1, 2])
        collector.all_gather()
        return collector.add({"x": T3}, indices=[0, 1, 2])

    def rows_error() -> Any:
        collector = tgd().Collector()
        collector.add({"x": T3}, indices=[0])
        return collector.all_gather()

    return {
        "unpicklable_tensor": lambda: tgd().all_gather({"s": torch.eye(2).to_mkldnn()}),
        "dst": lambda: tgd().gather({"x": T3}, dst=5),
        "dst_type": lambda: tgd().gather({"x": T3}, dst="0"),
        "src": lambda: tgd().broadcast({"x": T3}, src=-1),
        "sizes": lambda: tgd().all_gather({"x": T3}, sizes=-1),
        "layout": lambda: tgd().all_gather({"x": T3}, tg.by_path({"y": 0})),
        "unpicklable": lambda: tgd().all_gather({"x": T3, "f": lambda: 1}),
        "pad_fill": lambda: tgd().all_gather({"h": torch.ones(1, 2).half()}, tg.pad(1, 70000.0)),
        "foreign_rule": lambda: tgd().all_gather({"s": T3}, {"s": FOREIGN[1]}),
        "dim": lambda: tgd().all_gather({"x": T3}, dim=True),
        "collector_state": state_error,
        "collector_rows": rows_error,
    }


DISTRIBUTED = _distributed()


def _rendered(exc: BaseException) -> str:
    notes = "\n".join(getattr(exc, "__notes__", ()))
    return f"{exc}\n{notes}" if notes else str(exc)


def _check(call: Call) -> str:
    with pytest.raises(Exception) as info:
        call()
    text = _rendered(info.value)
    assert text.strip(), f"{type(info.value).__name__} with no message"
    found = holes(text)
    assert not found, f"{type(info.value).__name__}: {text}\n" + "\n".join(found)
    return text


@pytest.mark.parametrize("name", list(CASES))
def test_no_error_text_has_a_hole(name: str) -> None:
    _check(CASES[name])


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_no_distributed_error_text_has_a_hole(world_of_one: None, name: str) -> None:
    _check(DISTRIBUTED[name])
