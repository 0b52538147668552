"""PyTorch Geometric's graph batches as a first-class input (issue 47, point 3), and objects
that hold tensors never sent whole to every device (point 2).

A PyG ``Batch`` (what its ``DataLoader`` yields) is split by graphs and joined back, as a
``PackedSequence`` is by rows: GCN and GIN models with global pooling through
``tg.data_parallel`` and ``tg.DataParallel`` on 2 and 3 CPU devices give one device's outputs
(per graph and per node) and gradients (every parameter's, and the node features'); every rank's
graphs come back in rank order from ``tgd.all_gather``, and in dataset order from a
``Collector``, on 1 rank and in a spawned group of 2. A single ``Data`` (one graph), a plain
object or a container holding tensors is refused naming its path; a module passed along is not.

PyG is an optional dependency (the ``test`` extra): every test here skips without it, and the
spawned ranks import it only in the check that needs it (it is slow to import).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import spawned_groups
import torch
from torch import nn

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only
from treegather._compiled import COMPILE_AFTER
from treegather._shards import balanced

Tensor = torch.Tensor
CPU2, CPU3 = ["cpu"] * 2, ["cpu"] * 3
F, H, C = 4, 8, 3  # node features, hidden, classes
N = 7  # graphs: 4 + 3 on 2 devices, 3 + 2 + 2 on 3
RTOL, ATOL = 1e-5, 1e-6
DIFFS: dict[str, float] = {}  # the largest difference seen, per comparison (shown at the end)


def _import() -> Any:
    with warnings.catch_warnings():  # (PyG 2.8 scripts helpers at import: torch deprecates it)
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip(
            "torch_geometric", reason="torch_geometric is not installed (the test extra)"
        )


@pytest.fixture(autouse=True)
def pyg() -> Any:
    """torch_geometric, or the test skips (imported on first use: a spawned rank imports this
    module for its checks, and only the graph check in the group of 2 pays for PyG)."""
    return _import()


def graph(pyg: Any, i: int) -> Any:
    """Graph ``i``: ``2 + i % 4`` nodes in a ring (both ways), features from ``i``, label ``i``."""
    n = 2 + i % 4
    g = torch.Generator().manual_seed(i)
    ring = torch.arange(n)
    edges = torch.stack([torch.cat([ring, (ring + 1) % n]), torch.cat([(ring + 1) % n, ring])])
    return pyg.data.Data(x=torch.randn(n, F, generator=g), edge_index=edges, y=torch.tensor([i]))


def graphs(pyg: Any, n: int = N) -> list[Any]:
    return [graph(pyg, i) for i in range(n)]


def batch_of(pyg: Any, n: int = N, **kwargs: Any) -> Any:
    return pyg.data.Batch.from_data_list(graphs(pyg, n), **kwargs)


class GCN(nn.Module):
    """Two GCN layers and mean pooling: a graph-level output and the node embeddings."""

    def __init__(self, pyg: Any) -> None:
        super().__init__()
        self.conv1, self.conv2 = pyg.nn.GCNConv(F, H), pyg.nn.GCNConv(H, H)
        self.head = nn.Linear(H, C)
        self.pool = pyg.nn.global_mean_pool

    def forward(self, data: Any) -> dict[str, Tensor]:
        h = self.conv2(self.conv1(data.x, data.edge_index).relu(), data.edge_index).relu()
        return _outputs(self.head(self.pool(h, data.batch, data.num_graphs)), h, data)


class GIN(nn.Module):
    """Two GIN layers and sum pooling."""

    def __init__(self, pyg: Any) -> None:
        super().__init__()
        mlp = lambda a, b: nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b))  # noqa: E731
        self.conv1, self.conv2 = pyg.nn.GINConv(mlp(F, H)), pyg.nn.GINConv(mlp(H, H))
        self.head = nn.Linear(H, C)
        self.pool = pyg.nn.global_add_pool

    def forward(self, data: Any) -> dict[str, Tensor]:
        h = self.conv2(self.conv1(data.x, data.edge_index).relu(), data.edge_index)
        return _outputs(self.head(self.pool(h, data.batch, data.num_graphs)), h, data)


def _outputs(graph: Tensor, nodes: Tensor, data: Any) -> dict[str, Tensor]:
    """Per graph, per node, and the graphs this replica saw (one row per replica)."""
    return {"graph": graph, "nodes": nodes, "seen": torch.tensor([data.num_graphs])}


MODELS = {"GCN": GCN, "GIN": GIN}


def model(pyg: Any, name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name](pyg)


def loss_of(out: dict[str, Tensor], y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out["graph"], y % C) + out["nodes"].square().mean()


def close(name: str, got: Tensor, want: Tensor) -> None:
    assert got.shape == want.shape, f"{name}: {got.shape} != {want.shape}"
    diff = float((got - want).detach().abs().max()) if got.numel() else 0.0
    DIFFS[name] = max(DIFFS.get(name, 0.0), diff)
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), f"{name}: {diff}"


def same_batch(got: Any, want: Any) -> None:
    """Two graph batches hold the same graphs, in the same order (every tensor equal)."""
    assert type(got) is type(want) and got.num_graphs == want.num_graphs
    assert sorted(got.keys()) == sorted(want.keys())
    for key in want.keys():
        a, b = got[key], want[key]
        assert torch.equal(a, b) if isinstance(b, Tensor) else a == b, key


# ------------------------------------------------------------- models equal one device


def _run(pyg: Any, name: str, k: int, entry: str, n: int = N) -> tuple[Any, Any]:
    """One device's outputs and gradients, and those of ``k`` devices through ``entry``."""
    results = []
    for devices in (None, ["cpu"] * k):
        net = model(pyg, name)
        batch = batch_of(pyg, n)
        batch.x.requires_grad_()
        if devices is None:
            out = net(batch)
        elif entry == "data_parallel":
            out = tg.data_parallel(net, (batch,), devices)
        else:
            out = tg.DataParallel(net, device_ids=devices)(batch)
        loss_of(out, batch.y).backward()
        grads = {p: w.grad for p, w in net.named_parameters()}
        results.append((out, grads, batch.x.grad))
    return results[0], results[1]


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_graph_models_equal_one_device(pyg: Any, name: str, k: int, entry: str) -> None:
    (out1, grads1, x1), (outk, gradsk, xk) = _run(pyg, name, k, entry)
    assert outk["seen"].tolist() == list(balanced(N, k))  # (each replica its shard's graphs)
    for key in ("graph", "nodes"):  # per graph (pooled) and per node (cat of node rows)
        close(f"{name} on {k}: outputs[{key!r}]", outk[key], out1[key])
    assert gradsk.keys() == grads1.keys() and all(g is not None for g in gradsk.values())
    for p in grads1:
        close(f"{name} on {k}: grad {p}", gradsk[p], grads1[p])
    close(f"{name} on {k}: grad x", xk, x1)


def test_loader_batches_with_uneven_graph_counts_equal_one_device(pyg: Any) -> None:
    net = model(pyg, "GCN")
    loader = pyg.loader.DataLoader(graphs(pyg), batch_size=3)  # 3, 3 and 1 graph(s)
    seen = []
    for batch in loader:
        want = net(batch)
        got = tg.data_parallel(net, (batch,), CPU2)
        seen.append(got["seen"].tolist())
        for key in ("graph", "nodes"):
            close(f"loader batch: outputs[{key!r}]", got[key], want[key])
    assert seen == [[2, 1], [2, 1], [1]]


# ---------------------------------------------------------------- scatter and gather


def test_scatter_splits_by_graphs_and_gather_joins_them(pyg: Any) -> None:
    batch = batch_of(pyg)
    x = batch.x.clone()
    tree = {"g": batch, "ids": torch.arange(N)}
    for devices, sizes in ((CPU2, (4, 3)), (CPU3, (3, 2, 2))):
        shards = tg.scatter(tree, devices)
        assert shards.sizes == sizes
        assert [s["g"].num_graphs for s in shards] == list(sizes)
        assert [s["g"].y.tolist() for s in shards] == [s["ids"].tolist() for s in shards]
        for s, start in zip(shards, [0, *torch.tensor(sizes).cumsum(0).tolist()]):
            want = pyg.data.Batch.from_data_list(graphs(pyg)[start : start + s["g"].num_graphs])
            same_batch(s["g"], want)
        same_batch(tg.gather([s["g"] for s in shards], "cpu"), batch)
    assert tree["g"] is batch and torch.equal(batch.x, x)  # (the input is left as it was)


def test_the_repro_of_the_issue_sees_each_shards_graphs(pyg: Any) -> None:
    # (every device got all 7 graphs: g was [7, 7, 7] beside n = [3, 2, 2])
    out = tg.data_parallel(
        lambda inp: {"n": inp["ids"].shape[0], "g": inp["graphs"].num_graphs},
        ({"graphs": batch_of(pyg), "ids": torch.arange(N)},),
        CPU3,
    )
    assert out == {"n": [3, 2, 2], "g": [3, 2, 2]}


def test_follow_batch_and_hetero_batches_keep_their_form(pyg: Any) -> None:
    batch = batch_of(pyg, follow_batch=["x"])
    shards = tg.scatter(batch, CPU2)
    assert all(hasattr(s, "x_batch") and hasattr(s, "x_ptr") for s in shards)
    same_batch(tg.gather(list(shards), "cpu"), batch)
    hetero = []
    for i in range(5):
        h = pyg.data.HeteroData()
        h["a"].x = torch.full((1 + i % 2, 2), float(i))
        h["a", "to", "a"].edge_index = torch.zeros(2, 1, dtype=torch.long)
        hetero.append(h)
    hb = pyg.data.Batch.from_data_list(hetero)
    shards = tg.scatter(hb, CPU2)
    assert [s.num_graphs for s in shards] == [3, 2]
    joined = tg.gather(list(shards), "cpu")
    assert type(joined) is type(hb) and torch.equal(joined["a"].x, hb["a"].x)


def test_fast_path_agrees_with_the_definition(pyg: Any) -> None:
    tree = {"g": batch_of(pyg), "x": torch.randn(N, 2)}
    with reference_only():
        want = tg.scatter(tree, CPU3)
        want_out = tg.gather(list(want), "cpu")
    for _ in range(COMPILE_AFTER + 2):
        got = tg.scatter(tree, CPU3)
        assert got.sizes == want.sizes
        for a, b in zip(got, want):
            same_batch(a["g"], b["g"])
            assert torch.equal(a["x"], b["x"])
        out = tg.gather(list(got), "cpu")
        same_batch(out["g"], want_out["g"])


def test_explain_shows_a_graph_batch_split_by_graphs(pyg: Any) -> None:
    text = str(tg.explain({"g": batch_of(pyg), "ids": torch.arange(N)}, devices=CPU3))
    assert "split by rows" in text and "3 row(s), 2 row(s), 2 row(s)" in text


def test_a_batch_not_made_from_a_data_list_is_refused(pyg: Any) -> None:
    made = pyg.data.Batch(x=torch.zeros(3, F), batch=torch.tensor([0, 0, 1]))
    with pytest.raises(tg.LeafTypeError, match=r"inputs\['g'\]: a DataBatch not made by"):
        tg.scatter({"g": made, "ids": torch.arange(2)}, CPU2)


def test_an_attribute_set_after_batching_is_refused_not_lost(pyg: Any) -> None:
    batch = batch_of(pyg)
    batch.scale = torch.ones(5)  # (no graph holds it: splitting by graphs would drop it)
    with pytest.raises(tg.LeafTypeError, match=r"inputs\['g'\]: a DataBatch with 'scale' set"):
        tg.scatter({"g": batch}, CPU2)


# ------------------------------------------------------------------------ refusals


class Holder:
    """A plain user class holding the batch."""

    def __init__(self, x: Tensor) -> None:
        self.name = "train"
        self.parts = {"x": x}


class Slotted:
    __slots__ = ("ids",)

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids


def test_objects_holding_tensors_are_refused_naming_the_path(pyg: Any) -> None:
    cases = {
        "a plain user class": (Holder(torch.zeros(N, 2)), r"Holder is an object .* \.parts\['x'\]"),
        "a class with slots": (Slotted(torch.arange(N)), r"Slotted is an object .* \.ids"),
        "a container": (collections.UserList([torch.zeros(N)]), r"UserList is a container"),
        "a single Data": (graph(pyg, 0), r"Data is an object .* one row of a graph batch"),
    }
    for name, (value, text) in cases.items():
        for fast in (True, False):
            with contextlib.nullcontext() if fast else reference_only():
                with pytest.raises(tg.LeafTypeError, match=r"inputs\['v'\]: " + text) as info:
                    tg.scatter({"v": value, "ids": torch.arange(N)}, CPU2)
            assert "sent whole to every device" in str(info.value), name
            assert "broadcast()" in str(info.value), name
        # alone (nothing else split) too; and broadcast() sends it whole on purpose
        with pytest.raises(tg.LeafTypeError, match=r"inputs: "):
            tg.scatter(value, CPU2)
        shards = tg.scatter({"v": value, "ids": torch.arange(N)}, CPU2, {"v": None, "ids": 0})
        assert all(s["v"] is value for s in shards)
    with pytest.raises(tg.LeafTypeError, match=r"Batch\.from_data_list"):
        tg.data_parallel(lambda d: d.x, (graph(pyg, 1),), CPU2)


def test_objects_without_tensors_and_modules_are_sent_as_they_are(pyg: Any) -> None:
    # A module's tensors are its parameters, not the batch: a loss module passed along (as
    # torch's own scatter passes it) reaches every replica as the same object.
    crit = nn.CrossEntropyLoss(weight=torch.ones(C))
    config = Holder(torch.tensor(2.0))  # (a 0-dim tensor: a scalar, not the batch)
    x, y = torch.randn(N, C), torch.arange(N) % C
    shards = tg.scatter((x, y, crit, config), CPU2)
    assert all(s[2] is crit and s[3] is config for s in shards)
    out = tg.data_parallel(lambda a, b, f, _: f(a, b).expand(1), (x, y, crit, config), CPU2)
    assert out.shape == (2,)


# ----------------------------------------------------------------- across processes


def _distributed(rank: int, world: int) -> dict[str, str]:
    """``tgd.all_gather`` of this rank's graphs, and a Collector's over a PyG DataLoader behind
    a DistributedSampler (padded, shuffled), each with the fast paths and under the
    definition: ``"ok"`` (equal to one process's batch of every graph), or what went wrong."""
    out: dict[str, str] = {}
    try:
        pyg = _import()
    except BaseException as exc:  # (skipped: no PyG)
        return {"skipped": repr(exc)}
    everything = batch_of(pyg, 9)
    for mode in ("fast", "reference"):
        with reference_only() if mode == "reference" else contextlib.nullcontext():
            for way, run in (("all_gather", _gathered), ("Collector", _collected)):
                try:
                    got = run(pyg, rank, world)
                    same_batch(got["g"], everything)
                    assert torch.equal(got["y"], everything.y), got["y"]
                    out[f"{way} {mode}"] = "ok"
                except Exception:
                    out[f"{way} {mode}"] = traceback.format_exc()
    return out


def _gathered(pyg: Any, rank: int, world: int) -> Any:
    sizes = balanced(9, world)
    start = sum(sizes[:rank])
    mine = pyg.data.Batch.from_data_list(graphs(pyg, 9)[start : start + sizes[rank]])
    return tgd.all_gather({"g": mine, "y": mine.y})


def _collected(pyg: Any, rank: int, world: int) -> Any:
    from torch.utils.data import DistributedSampler

    dataset = graphs(pyg, 9)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = pyg.loader.DataLoader(dataset, batch_size=2, sampler=sampler)
    col = tgd.Collector(loader)
    for batch in loader:
        col.add({"g": batch, "y": batch.y})
    got = col.all_gather()
    assert col.indices is not None and col.indices.tolist() == list(range(9))
    return got


@spawned_groups.register("graphs", budget_s=60)
def _group_check(rank: int, world: int) -> dict[str, str] | None:
    """In the group of 2 only (PyG is slow to import): treegather in use (a leaf of a class of
    its own looked up) has not imported PyG, and graph batches work once it is imported."""
    if world != 2:
        return None
    tg.scatter({"x": torch.zeros(4), "config": Holder(torch.tensor(1.0))}, CPU2)
    lazy = "torch_geometric" not in sys.modules
    out = _distributed(rank, world)
    out["import"] = "ok" if lazy else "torch_geometric was imported before the check imported it"
    return out


def _check(results: dict[int, dict[str, str]]) -> None:
    wrong = [
        f"rank {r}, {k}: {v}" for r, res in results.items() for k, v in res.items() if v != "ok"
    ]
    assert not wrong, "\n".join(wrong)
    assert all(len(res) >= 4 for res in results.values()), results


def test_all_gather_and_collector_on_one_rank(world_of_one: None) -> None:
    _check({0: _distributed(0, 1)})


@pytest.fixture(scope="module", params=[2], ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The spawned group of 2 ranks' results (the session's shared group)."""
    return spawned_groups.results(request.param, tmp_path_factory)


@pytest.mark.distributed
def test_all_gather_and_collector_on_two_ranks(ranks: list[dict[str, Any]]) -> None:
    _check({r: res["graphs"] for r, res in enumerate(ranks)})
    assert all("import" in res["graphs"] for res in ranks)


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    """The largest differences seen, shown at the module's end (``-rA``: in the terminal)."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not DIFFS:
        return
    reporter.write_line("")
    worst: dict[str, float] = {}
    for name, diff in DIFFS.items():
        kind = name.split(": ")[0] + (": outputs" if "outputs" in name else ": gradients")
        worst[kind] = max(worst.get(kind, 0.0), diff)
    for kind, diff in sorted(worst.items()):
        reporter.write_line(f"graphs, largest difference, {kind}: {diff:.2e}")
