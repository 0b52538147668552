"""``all_gather(sync_grads=True)`` to second order, and the result of a call without it.

Values laid out by rows (a ``PackedSequence``, a lazy stack of tensordicts) take part too.
The multi-process checks run in the spawned gloo groups of 2 and 3 ranks shared with the other
distributed test modules (:mod:`spawned_groups`); each rank returns its gradients, and the tests
compare them with one process holding every rank's rows (uneven rows, a nested tree) and with
``torch.distributed.nn.functional.all_gather`` run in the same ranks (even rows: it needs them).
Every check runs on the wire plan and on the full exchange (:func:`reference_only`).
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import spawned_groups
import torch
import torch.distributed as dist
from spawned_groups import WORLD_SIZES
from tensordict import LazyStackedTensorDict, TensorDict
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only
from treegather.benchmarks.distributed import counting
from treegather.distributed.layout import layout_text

ROWS = [3, 1, 2]  # rank r's rows: uneven
PATHS = ("fast", "full")


def _inputs(rank: int, rows: list[int] = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows[rank], 3, generator=g, dtype=torch.float64)
    return x, torch.randn(2, 2, generator=g, dtype=torch.float64)


def _tree(x: torch.Tensor, z: torch.Tensor) -> dict[str, Any]:
    """A nested tree of tensors computed from the leaves (so gradients pass through ops on both
    sides of the exchange), with a string that travels along."""
    return {"a": x, "nest": [torch.tanh(z), {"c": x.pow(2), "tag": "t"}]}


def _loss(gathered: dict[str, Any], rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss: not linear in anything, so second derivatives are not zero."""
    a, (tz, rest) = gathered["a"], gathered["nest"]
    return (a**3).sum() * (rank + 1) + (tz**2).sum() * rest["c"].sum() + (a * rest["c"]).sum()


def _second_order(
    rank: int, gather: Callable[[dict[str, Any]], dict[str, Any]], rows: list[int]
) -> dict[str, Any]:
    """First-order gradients of every rank's summed loss, with ``create_graph=True``, then the
    gradient of a penalty on them (the double backward), for this rank's leaves."""
    x, z = (t.clone().requires_grad_(True) for t in _inputs(rank, rows))
    loss = _loss(gather(_tree(x, z)), rank)
    first = torch.autograd.grad(loss, [x, z], create_graph=True)
    penalty = sum(g.pow(2).sum() for g in first)
    with counting() as calls:
        penalty.backward()  # type: ignore[union-attr]
    return {"first": [g.detach() for g in first], "x": x.grad, "z": z.grad, "calls": calls}


def _by_torch(tree: dict[str, Any]) -> dict[str, Any]:
    """The same tree gathered leaf by leaf with torch's differentiable all_gather."""
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():  # deprecated in torch 2.13, still the reference
        warnings.simplefilter("ignore", FutureWarning)
        a, tz, c = (torch.cat(all_gather(t)) for t in (tree["a"], *_tensors(tree["nest"])))
    return {"a": a, "nest": [tz, {"c": c, "tag": ["t"] * dist.get_world_size()}]}


def _tensors(nest: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return nest[0], nest[1]["c"]


def _rows_inputs(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s sequences (uneven counts and lengths), and a tensordict row's values."""
    g = torch.Generator().manual_seed(10 + rank)
    lengths = [3, 1, 2][: 2 + rank % 2]
    return [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in (*lengths, 2)]


def _rows_tree(leaves: list[torch.Tensor]) -> dict[str, Any]:
    """Values laid out by rows, computed from the leaves: a PackedSequence (its sequences'
    steps interleaved) and a lazy stack of tensordicts along dim 0 (one per row)."""
    *sequences, row = leaves
    packed = pack_sequence([torch.tanh(s) for s in sequences], enforce_sorted=False)
    rows = [TensorDict({"v": row[i] * 2}, []) for i in range(len(row))]
    return {"packed": packed, "stack": LazyStackedTensorDict.lazy_stack(rows, 0)}


def _rows_loss(gathered: dict[str, Any], rank: int) -> torch.Tensor:
    padded, _ = pad_packed_sequence(gathered["packed"], batch_first=True)
    return (padded**3).sum() * (rank + 1) + (gathered["stack"]["v"] ** 2).sum() * (rank + 2)


def _rows_grads(rank: int) -> dict[str, Any]:
    """This rank's leaves' gradients of its loss on the values gathered with sync_grads (every
    rank runs the backward), and what a backward says without it."""
    leaves = [t.clone().requires_grad_(True) for t in _rows_inputs(rank)]
    _rows_loss(tgd.all_gather(_rows_tree(leaves), sync_grads=True), rank).backward()
    plain = tgd.all_gather(_rows_tree(leaves))
    return {
        "grads": [t.grad for t in leaves],
        "no_sync": _capture(lambda: _rows_loss(plain, rank).backward()),
    }


def _capture(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc), traceback.format_exc())


def _checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    synced = lambda tree: tgd.all_gather(tree, sync_grads=True)  # noqa: E731
    out["uneven"] = _second_order(rank, synced, ROWS)
    even = [2] * 3
    out["even"] = _second_order(rank, synced, even)
    out["torch"] = _second_order(rank, _by_torch, even)
    # Without sync_grads: a backward that reaches the result says what to pass.
    v = torch.ones(2, requires_grad=True)
    plain = tgd.all_gather({"v": v * 2, "tag": "t"})
    out["requires_grad"] = plain["v"].requires_grad
    out["no_sync"] = _capture(lambda: plain["v"].sum().backward())
    out["detached"] = tgd.all_gather({"v": (v * 2).detach()})["v"].requires_grad
    with torch.no_grad():
        out["no_grad"] = tgd.all_gather({"v": v * 2})["v"].requires_grad
    # mean(weight=f) has no calls to weigh across processes: the same error on every rank
    out["weighted"] = _capture(lambda: tgd.all_gather({"l": v.sum()}, {"l": tg.mean(weight=len)}))
    out["rows"] = _rows_grads(rank)
    return out


@spawned_groups.register("grads", budget_s=45)
def _both_paths(rank: int, world: int) -> dict[str, Any]:
    fast = _checks(rank, world)
    with reference_only():
        full = _checks(rank, world)
    return {"fast": fast, "full": full}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, [res["grads"] for res in spawned_groups.results(world, tmp_path_factory)]


pytestmark = pytest.mark.distributed


def _one_process(world: int, rows: list[int]) -> tuple[list[Any], list[Any]]:
    """Every rank's leaves in one process: each rank's first-order gradients of the sum of
    every rank's loss (``create_graph``), and each rank's leaves' gradients of the sum of every
    rank's penalty."""
    leaves = [tuple(t.clone().requires_grad_(True) for t in _inputs(r, rows)) for r in range(world)]
    gathered = tg.gather([_tree(x, z) for x, z in leaves], "cpu")
    total = sum(_loss(gathered, r) for r in range(world))
    firsts = [torch.autograd.grad(total, list(pair), create_graph=True) for pair in leaves]
    sum(g.pow(2).sum() for first in firsts for g in first).backward()  # type: ignore[union-attr]
    return firsts, [(x.grad, z.grad) for x, z in leaves]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", ["uneven", "even"])
def test_second_order_equals_one_process_holding_every_ranks_rows(
    ranks: Any, path: str, rows: str
) -> None:
    world, results = ranks
    firsts, seconds = _one_process(world, ROWS if rows == "uneven" else [2] * 3)
    for rank, res in enumerate(results):
        got = res[path][rows]
        for g, want in zip(got["first"], firsts[rank]):
            torch.testing.assert_close(g, want.detach(), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(got["x"], seconds[rank][0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(got["z"], seconds[rank][1], atol=1e-10, rtol=1e-10)
        # the double backward: the exchange's backward differentiated (one all-to-all), and
        # the first backward's all-to-all again, for the gathered values' part in it
        assert got["calls"] == ["all_to_all_single"] * 2, got["calls"]


@pytest.mark.parametrize("path", PATHS)
def test_second_order_equals_torch_distributed_nn_all_gather(ranks: Any, path: str) -> None:
    _, results = ranks
    for res in results:
        ours, theirs = res[path]["even"], res[path]["torch"]
        for a, b in zip(
            [*ours["first"], ours["x"], ours["z"]], [*theirs["first"], theirs["x"], theirs["z"]]
        ):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("path", PATHS)
def test_a_backward_through_a_result_without_sync_grads_says_sync_grads(
    ranks: Any, path: str
) -> None:
    _, results = ranks
    for res in results:
        got = res[path]
        status, name, message, _ = got["no_sync"]
        assert (status, name) == ("raised", "RuntimeError")
        assert message == (
            "a backward reached the result of treegather.distributed.all_gather(...) called "
            "without sync_grads=True, which passes no gradient: pass sync_grads=True (gradients "
            "to every rank's tensors), or .detach() the tree before the call to gather constants"
        )
        assert got["requires_grad"] is True
        # inputs that do not require grad, or no grad mode: plain detached results, as before
        assert got["detached"] is False and got["no_grad"] is False


@pytest.mark.parametrize("path", PATHS)
def test_a_mean_weighted_by_the_data_is_a_layout_error_on_every_rank(ranks: Any, path: str) -> None:
    _, results = ranks
    for res in results:
        status, name, message, _ = res[path]["weighted"]
        assert (status, name) == ("raised", "LayoutError"), message
        assert message.startswith("outputs['l']: mean(weight=len) weighs each replica by what len")
        assert "treegather.distributed: each rank's count as sizes=" in message


@pytest.mark.parametrize("path", PATHS)
def test_values_laid_out_by_rows_pass_the_gradient_to_every_rank(ranks: Any, path: str) -> None:
    # a PackedSequence (a lazy stack of tensordicts) travelled pickled whole: every rank's
    # gradient was None, silently; without sync_grads, a backward said nothing either
    world, results = ranks
    leaves = [[t.clone().requires_grad_(True) for t in _rows_inputs(r)] for r in range(world)]
    gathered = tg.gather([_rows_tree(mine) for mine in leaves], "cpu")
    sum(_rows_loss(gathered, r) for r in range(world)).backward()  # type: ignore[union-attr]
    for rank, res in enumerate(results):
        got = res[path]["rows"]
        for g, t in zip(got["grads"], leaves[rank], strict=True):
            assert g is not None
            torch.testing.assert_close(g, t.grad, atol=1e-10, rtol=1e-10)
        status, name, message, _ = got["no_sync"]
        assert (status, name) == ("raised", "RuntimeError") and "pass sync_grads=True" in message


@pytest.mark.parametrize("path", PATHS)
def test_a_graph_batch_passes_the_gradient(world_of_one: None, path: str) -> None:
    # a PyG graph batch (a leaf laid out by rows, its tensors not in torch's pytree): its node
    # features are what one process's loss differentiates, through all_gather on one rank
    with warnings.catch_warnings():  # (PyG 2.8 scripts helpers at import: torch deprecates it)
        warnings.simplefilter("ignore", DeprecationWarning)
        pyg = pytest.importorskip("torch_geometric.data")
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(2, 0, dtype=torch.long)
    graphs = [pyg.Data(x=torch.tanh(x[i : i + 1 + i % 2]), edge_index=none) for i in range(3)]
    with reference_only() if path == "full" else contextlib.nullcontext():
        got = tgd.all_gather({"g": pyg.Batch.from_data_list(graphs)}, sync_grads=True)["g"]
    (got.x**3).sum().backward()
    want = x.detach().clone().requires_grad_(True)
    (torch.cat([torch.tanh(want[i : i + 1 + i % 2]) for i in range(3)]) ** 3).sum().backward()
    torch.testing.assert_close(x.grad, want.grad, atol=1e-12, rtol=1e-12)


def test_a_callable_in_a_rule_compares_across_ranks_by_module_and_qualname() -> None:
    def tokens(labels: torch.Tensor) -> torch.Tensor:
        return (labels != -100).sum()

    key, shown = layout_text({"loss": tg.mean(weight=tokens)}, 0)
    assert f"weight=tuple:('callable', '{__name__}.test_a_callable_in_a_rule_compares" in key
    assert "0x" not in key  # no address: the same key in every process
    assert shown == "layout {'loss': mean(weight=tokens)}, dim=0"
    other = layout_text({"loss": tg.mean()}, 0)[0]
    assert other != key and layout_text({"loss": tg.mean(weight=tokens)}, 0)[0] == key
