"""Exact evaluation where a framework runs the loop, on the shared gloo groups: Lightning's
``Trainer`` (2 ranks) and torchmetrics (2 and 3 ranks), as notebooks/frameworks.py writes them.

Lightning: the guide's ``Classifier`` (a Collector made from the loader the Trainer runs, in
each evaluation hook) under ``validate``, ``test``, ``predict`` and ``fit`` (two epochs, with the
default sanity check), over a loader made with ``shuffle=False`` and ``shuffle=True``: 13
samples, which Lightning's ``DistributedSampler`` pads to 14. A shuffled predict loader is read
by ``Collector(loader)`` never (refused) and by the guide's prediction writer. The guide's own
runs go in the same group. torchmetrics: Accuracy, F1Score, AUROC and MeanSquaredError from the
Collector's result against one process and against the metric updated per batch under DDP.
The Hugging Face Trainer: the guide's ``CollectingTrainer`` under ``torchrun`` (conftest's
launch), against one process and accelerate's own gather.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import spawned_groups
import torch
from spawned_groups import WORLD_SIZES

GUIDE = Path(__file__).resolve().parents[1] / "notebooks" / "frameworks.py"
LIGHTNING_WORLD = 2
STAGES = ("validate", "test", "predict", "fit")
METRICS = ("accuracy", "f1", "auroc", "mse")


def _guide() -> Any:
    """notebooks/frameworks.py as a module (imported once per rank: Lightning takes seconds)."""
    if "frameworks_guide" not in sys.modules:
        spec = importlib.util.spec_from_file_location("frameworks_guide", GUIDE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["frameworks_guide"] = module
        spec.loader.exec_module(module)
    return sys.modules["frameworks_guide"]


def _quiet() -> None:
    import logging
    import warnings

    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


def _seen(model: Any, stage: str) -> list[dict[str, Any]]:
    """What each of ``stage``'s exchanges gave this rank: the rows' indices and sample ids,
    whether it was the sanity check, each row against the model's output for its sample (the
    weights of that moment: see ``_Recorded``), the metrics against one process."""
    guide = _guide()
    out = []
    for (result, sanity), (full, indices) in zip(
        model.results.get(stage, []), model.full.get(stage, [])
    ):
        rows = indices.tolist()
        out.append(
            {
                "indices": rows,
                "i": result["i"].tolist(),
                "sanity": sanity,
                "rows_differ": float((result["logits"] - full["logits"][rows]).abs().max()),
                "metrics": guide.compute(result),
                "one_process": guide.compute(_rows(full, rows)),
            }
        )
    return out


def _rows(full: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    data = _guide().Toy()
    return {
        "logits": full["logits"][rows],
        "score": full["score"][rows],
        "y": data.y[rows],
        "target": data.target[rows],
    }


def _recorded() -> Any:
    guide = _guide()

    class Recorded(guide.Classifier):  # type: ignore[misc, name-defined]
        """The guide's Classifier, also noting the model's output for every sample (one
        forward of the whole dataset) and the Collector's indices at each exchange."""

        def __init__(self, collect_predictions: bool = True) -> None:
            super().__init__(collect_predictions)
            self.full: dict[str, list[Any]] = {}

        def finish(self, stage: str, result: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                full = self(guide.Toy().x)
            self.full.setdefault(stage, []).append((full, self.collector.indices))
            super().finish(stage, result)

    return Recorded


@spawned_groups.register("frameworks.lightning", budget_s=120)  # (importing Lightning: most)
def _lightning(rank: int, world: int) -> dict[Any, Any] | None:
    """Every stage over a loader made with shuffle=False and shuffle=True, each Trainer on this
    group's ranks (processes made outside Lightning, as torchrun's are)."""
    if world != LIGHTNING_WORLD:
        return None
    from torch.utils.data import DataLoader

    from treegather import ArgumentTypeError, BatchSizeError

    guide = _guide()
    _quiet()
    Recorded = _recorded()
    out: dict[Any, Any] = {}
    for shuffle in (False, True):
        torch.manual_seed(0)
        loader = DataLoader(guide.Toy(), batch_size=guide.BATCH, shuffle=shuffle)
        model = Recorded()
        guide.trainer().validate(model, loader, verbose=False)
        guide.trainer().test(model, loader, verbose=False)
        try:
            guide.trainer().predict(model, loader)
        except ArgumentTypeError as exc:  # (every rank: the same sampler)
            out[("predict", shuffle, "refused")] = str(exc)
        writer = guide.CollectPredictions()
        model.collect_predictions = False
        guide.trainer(callbacks=[writer]).predict(model, loader, return_predictions=False)
        result = writer.collector.all_gather()
        with torch.no_grad():
            full = model(guide.Toy().x)
        out[("predict", shuffle, "writer")] = {
            "indices": writer.collector.indices.tolist(),
            "i": result["i"].tolist(),
            "rows_differ": float((result["logits"] - full["logits"]).abs().max()),
        }
        trained = Recorded()
        train = DataLoader(guide.Toy(), batch_size=guide.BATCH, shuffle=True)
        guide.trainer(max_epochs=2).fit(trained, train, loader)
        for stage in ("validate", "test", "predict"):
            out[(stage, shuffle)] = _seen(model, stage)
        out[("fit", shuffle)] = _seen(trained, "validate")

    class Whole(Recorded):  # type: ignore[misc, valid-type]
        """Exchanges without partial=, in the sanity check too."""

        def on_validation_epoch_end(self) -> None:
            self.finish("validate", self.collector.all_gather())

    try:
        guide.trainer(max_epochs=1).fit(Whole(), train, loader)
    except BatchSizeError as exc:  # (every rank: the Collector raises alike)
        out["sanity_without_partial"] = str(exc)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        guide.lightning_guide()
    out["guide"] = printed.getvalue()
    return out


@spawned_groups.register("frameworks.torchmetrics", budget_s=60)
def _torchmetrics(rank: int, world: int) -> dict[str, Any]:
    """Each metric of the guide: one process (the whole dataset's outputs, no process group
    involved), per batch under DDP (synced at compute), and from the Collector's result."""
    from torch.utils.data import DataLoader, DistributedSampler

    import treegather.distributed as tgd

    guide = _guide()
    _quiet()
    data = guide.Toy()
    torch.manual_seed(0)
    model = guide.Classifier()
    out: dict[str, Any] = {}
    with torch.no_grad():
        full = model(data.x)
    one = guide.metrics()
    guide.update(one, {**full, "y": data.y, "target": data.target})
    out["one_process"] = {k: float(m.compute()) for k, m in one.items()}
    for batch in (4, 3):  # (uneven batches: 7 rows per rank in 4 + 3, 5 in 4 + 1, ...)
        sampler = DistributedSampler(data, shuffle=True, seed=3)  # pads 13 to 14 or 15
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
        naive = guide.metrics(sync_on_compute=True)
        collector = tgd.Collector(loader)
        with torch.no_grad():
            for b in loader:
                rows = model.outputs(b)
                collector.add(rows)
                guide.update(naive, rows)
            result = collector.all_gather()
        out[batch] = {
            "per_rank": len(sampler),
            "naive": {k: float(m.compute()) for k, m in naive.items()},
            "exact": guide.compute(result),
            "indices": collector.indices.tolist(),
        }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        guide.torchmetrics_guide()
    out["guide"] = printed.getvalue()
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    return world, spawned_groups.results(world, tmp_path_factory)


def _lightning_results(ranks: Any) -> list[dict[Any, Any]]:
    world, results = ranks
    assert world == LIGHTNING_WORLD
    return [res["frameworks.lightning"] for res in results]


ALL = list(range(13))


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [LIGHTNING_WORLD], indirect=True, ids=["world2"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("stage", STAGES)
def test_lightning_stage_gives_every_sample_once_in_order(
    ranks: Any, stage: str, shuffle: bool
) -> None:
    """Each exchange on every rank: every sample once, in dataset order, each row its own
    sample's output, the metrics those of one process (fit: the sanity check takes the rows of
    its two batches per rank, partial; then both epochs whole)."""
    per_rank = _lightning_results(ranks)
    if stage == "predict" and shuffle:  # a shuffled predict loader: read by the writer
        for mine in per_rank:
            got = mine[("predict", True, "writer")]
            assert got["indices"] == got["i"] == ALL, got
            assert got["rows_differ"] <= 1e-6, got
        return
    for r, mine in enumerate(per_rank):
        seen = mine[(stage, shuffle)]
        assert len(seen) == (3 if stage == "fit" else 1), (stage, len(seen))
        for e, got in enumerate(seen):
            sanity = stage == "fit" and e == 0
            assert got["sanity"] == sanity, (r, e)
            assert got["indices"] == got["i"], (r, e)
            assert got["rows_differ"] <= 1e-6, (r, e, got["rows_differ"])
            assert got["metrics"] == got["one_process"], (r, e, got)
            if sanity:  # two batches of 3 on each rank, none of them padding
                expected = _first_batches(shuffle, batches=2, batch=3)
                assert got["indices"] == expected, (r, got["indices"], expected)
            else:
                assert got["indices"] == ALL, (r, e)
        assert seen == per_rank[0][(stage, shuffle)]  # (every rank: the same result)


def _first_batches(shuffle: bool, batches: int, batch: int) -> list[int]:
    """The samples of the first batches of each rank of the DistributedSampler Lightning puts
    in a validation loader during fit (its seed: 0; epoch 0)."""
    from torch.utils.data import DistributedSampler

    out: set[int] = set()
    for r in range(LIGHTNING_WORLD):
        s = DistributedSampler(ALL, LIGHTNING_WORLD, r, shuffle=shuffle, seed=0)
        out.update(list(s)[: batches * batch])
    return sorted(out)


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [LIGHTNING_WORLD], indirect=True, ids=["world2"])
def test_lightning_shuffled_predict_loader_is_refused_with_the_spellings_that_work(
    ranks: Any,
) -> None:
    """``Collector(trainer.predict_dataloaders)`` over a loader made with shuffle=True: the
    sampler Lightning wraps draws a new order when read; the error names it and the spellings
    that work where Lightning runs the loop. An unshuffled predict loader is not refused."""
    for mine in _lightning_results(ranks):
        assert ("predict", False, "refused") not in mine
        text = mine[("predict", True, "refused")]
        assert "over a RandomSampler" in text, text
        assert "_IndexBatchSamplerWrapper over a BatchSampler over a " in text, text
        assert "add(outputs, indices=...)" in text and "batch_indices" in text, text


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [LIGHTNING_WORLD], indirect=True, ids=["world2"])
def test_lightning_sanity_check_without_partial_says_how_to_pass_it(ranks: Any) -> None:
    """fit's sanity check exchanges after 2 batches per rank: without ``partial=`` every rank
    raises, and the error names the spelling."""
    for mine in _lightning_results(ranks):
        text = mine["sanity_without_partial"]
        assert "the evaluation is incomplete" in text, text
        assert "partial=self.trainer.sanity_checking" in text, text


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [LIGHTNING_WORLD], indirect=True, ids=["world2"])
def test_lightning_guide_runs(ranks: Any) -> None:
    """notebooks/frameworks.py's Lightning part, on the group's ranks (its checks: rank 0)."""
    out = _lightning_results(ranks)[0]["guide"]
    assert "sanity check: 12 samples (2 batches per rank), partial" in out, out
    assert "validate x2, test, predict: 13 samples, each once, in order" in out, out


@pytest.mark.distributed
def test_torchmetrics_from_the_collector_equal_one_process(ranks: Any) -> None:
    """Every metric from the Collector's result is one process's, bit for bit, on every rank;
    updated per batch and synced, it counts the sampler's padding (differs)."""
    world, results = ranks
    for r, res in enumerate(results):
        mine = res["frameworks.torchmetrics"]
        one = mine["one_process"]
        assert list(one) == list(METRICS)
        for batch in (4, 3):
            got = mine[batch]
            assert got["per_rank"] * world > 13, "the sampler pads"
            assert got["indices"] == ALL, (r, batch)
            assert got["exact"] == one, (r, batch, got["exact"], one)
            assert got["naive"] != one, (r, batch)  # (the case: padding counted)
    assert "collected" in results[0]["frameworks.torchmetrics"]["guide"]


def test_hugging_face_trainer_guide_runs_under_torchrun(torchrun_outputs: dict[str, str]) -> None:
    """notebooks/frameworks.py's Hugging Face part under ``torchrun --nproc-per-node 2``: the
    Trainer's ``evaluate()`` and ``predict()`` (accelerate's BatchSamplerShard, the last round
    padded) give every sample once, in dataset order, with one process's metrics; with
    ``dataloader_drop_last=True`` every rank raises the same error, naming what is dropped."""
    out = torchrun_outputs["frameworks_transformers"]
    assert (
        "trainer evaluate/predict: 13 samples over 2 ranks in batches of 4, each once, in "
        "dataset order (accelerate's gather: 13 rows)"
    ) in out, out
    assert "trainer metrics = one process: accuracy=" in out, out
    dropped = out[out.index("dataloader_drop_last=True: ") :]
    assert dropped.startswith(
        "dataloader_drop_last=True: ranks 0, 1: its loader drops 5 sample(s) of the dataset: "
        "a BatchSampler(drop_last=True) the last 1 of the 13 indices"
    ), dropped
    assert "BatchSamplerShard the last 1 of the 3 batches its BatchSampler gives (4 samples)" in out
