"""Exact evaluation where a framework runs the loop: Lightning's Trainer, torchmetrics, and the
Hugging Face Trainer.

Run it on CPU with two processes (gloo), from the repository root (or one part of it:
``lightning``, ``torchmetrics``, ``transformers`` after the script's name):

    torchrun --nproc-per-node 2 notebooks/frameworks.py

Under DDP, Lightning puts a ``DistributedSampler`` in every loader it runs: 13 samples over 2
ranks are padded to 14 (one sample twice), and a metric computed from what the ranks saw counts
that duplicate (Lightning warns about it in ``validate`` and ``test``). The Collector gives every
rank each sample once, in dataset order, without owning the loop:

- **Lightning.** Make a ``Collector`` from the loader the Trainer runs
  (``trainer.val_dataloaders``, ``test_dataloaders``, ``predict_dataloaders``) at the start of
  each epoch, ``add`` each step's outputs, exchange at the epoch's end. The sanity check that
  ``fit`` runs first (``num_sanity_val_steps=2``: two batches per rank) is not a whole epoch:
  pass ``partial=self.trainer.sanity_checking``. A predict loader made with ``shuffle=True``
  draws a new order each time it is read, so ``Collector(loader)`` refuses it: a prediction
  writer gets each batch's dataset indices and passes them, ``add(outputs, indices=...)``.
- **torchmetrics.** Gather the per-sample predictions and targets with the Collector, then
  update each metric once with them, on every rank, made with ``sync_on_compute=False``: every
  rank already holds every sample, so the metric must not add the other ranks' copies. Any
  metric works (curves, AUROC, retrieval), whatever its states are. A metric updated per batch
  in the loop and synced at ``compute()`` counts the padding duplicate instead.
- **Hugging Face Trainer.** ``evaluate()`` and ``predict()`` run ``evaluation_loop``, which
  calls ``prediction_step`` for each batch of the loader accelerate prepared (under torchrun a
  ``BatchSamplerShard``: each process every other batch, the last round padded with samples
  from the start). A small subclass makes the Collector from that loader in
  ``evaluation_loop``, adds each step's logits and labels in ``prediction_step``, exchanges once
  after the loop and runs ``compute_metrics`` on the result: every sample once, in dataset
  order, on every rank, whatever the dataset's size. Compute per-sample values there (the loss
  as the mean over samples, not batches): the metrics are one process's. A ``loss`` it returns
  stands for the Trainer's ``eval_loss``, a mean of batch losses. A loader that drops samples
  (``TrainingArguments(dataloader_drop_last=True)``) has not seen the dataset: the exchange is
  an error on every rank, saying how many samples it drops and where.

Rank 0 checks every result against one process.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics import AUROC, Accuracy, F1Score, MeanSquaredError, Metric
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    EvalPrediction,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import EvalLoopOutput

try:
    import treegather  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import treegather as tg
import treegather.distributed as tgd

N_SAMPLES, N_FEATURES, N_CLASSES, BATCH = 13, 6, 3, 3


class Toy(Dataset[dict[str, Any]]):
    """13 samples: features, a class label, a regression target, and the sample's index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
        self.y = torch.randint(N_CLASSES, (N_SAMPLES,), generator=g)
        self.target = torch.randn(N_SAMPLES, generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "x": self.x[i], "y": self.y[i], "target": self.target[i]}


def metrics(sync_on_compute: bool = False) -> dict[str, Metric]:
    """The metrics. Computed from a Collector's result, every rank holds every sample: no sync
    of their own (``sync_on_compute=False``)."""
    kw: dict[str, Any] = {"sync_on_compute": sync_on_compute}
    classes = {"task": "multiclass", "num_classes": N_CLASSES, **kw}
    return {
        "accuracy": Accuracy(**classes),
        "f1": F1Score(average="macro", **classes),
        "auroc": AUROC(**classes),
        "mse": MeanSquaredError(**kw),
    }


def update(metrics: dict[str, Metric], outputs: dict[str, torch.Tensor]) -> None:
    for name, metric in metrics.items():
        if name == "mse":
            metric.update(outputs["score"], outputs["target"])
        else:
            metric.update(outputs["logits"].softmax(1), outputs["y"])


def compute(result: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metrics of a gathered result (every sample once), each updated once with it."""
    exact = metrics()
    update(exact, result)
    return {name: float(metric.compute()) for name, metric in exact.items()}


# ----------------------------------------------------------------------------------- Lightning


class Classifier(L.LightningModule):
    """A classifier (with a regression head) whose evaluation is exact, whoever runs the loop."""

    def __init__(self, collect_predictions: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Linear(N_FEATURES, N_CLASSES + 1)
        self.collect_predictions = collect_predictions  # (False: a CollectPredictions writer does)
        self.results: dict[str, list[Any]] = {}  # (kept for the checks: stage -> each epoch's)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"logits": out[:, :N_CLASSES], "score": out[:, N_CLASSES]}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        out = self(batch["x"])
        return F.cross_entropy(out["logits"], batch["y"]) + F.mse_loss(
            out["score"], batch["target"]
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def outputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One batch's per-sample outputs, with its samples' indices and labels."""
        return {"i": batch["i"], "y": batch["y"], "target": batch["target"], **self(batch["x"])}

    # One Collector per evaluation epoch, made from the loader the Trainer runs.

    def on_validation_epoch_start(self) -> None:
        self.collector = tgd.Collector(self.trainer.val_dataloaders)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.collector.add(self.outputs(batch))  # no communication

    def on_validation_epoch_end(self) -> None:
        # fit's sanity check runs 2 batches per rank, not the epoch: take what it added
        result = self.collector.all_gather(partial=self.trainer.sanity_checking)
        self.finish("validate", result)

    def on_test_epoch_start(self) -> None:
        self.collector = tgd.Collector(self.trainer.test_dataloaders)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.collector.add(self.outputs(batch))

    def on_test_epoch_end(self) -> None:
        self.finish("test", self.collector.all_gather())

    def on_predict_epoch_start(self) -> None:
        if self.collect_predictions:
            self.collector = tgd.Collector(self.trainer.predict_dataloaders)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        out = self.outputs(batch)
        if self.collect_predictions:
            self.collector.add(out)
        return out

    def on_predict_epoch_end(self) -> None:
        if self.collect_predictions:
            self.finish("predict", self.collector.all_gather())

    def finish(self, stage: str, result: dict[str, torch.Tensor]) -> None:
        """Every rank holds every sample once, in dataset order: the metrics need no sync."""
        values = compute(result)
        if stage != "predict":  # (the same value on every rank)
            self.log_dict({f"{stage}/{k}": v for k, v in values.items()}, sync_dist=False)
        self.results.setdefault(stage, []).append((result, self.trainer.sanity_checking))


class CollectPredictions(BasePredictionWriter):
    """A shuffled predict loader: Lightning hands each batch's dataset indices to its writers."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.collector = tgd.Collector()

    def write_on_batch_end(
        self,
        trainer: Any,
        module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.collector.add(prediction, indices=batch_indices)  # this batch's dataset indices


def trainer(**kw: Any) -> L.Trainer:
    """A Trainer on this process group's ranks (torchrun made them), quiet."""
    return L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.gettempdir(),
        **kw,
    )


def lightning_guide() -> None:
    data = Toy()
    torch.manual_seed(0)
    model = Classifier()
    loader = DataLoader(data, batch_size=BATCH)  # Lightning adds the DistributedSampler
    shuffled = DataLoader(data, batch_size=BATCH, shuffle=True)
    trainer(max_epochs=2).fit(model, shuffled, loader)  # sanity check, then 2 epochs
    trainer().test(model, loader, verbose=False)
    trainer().predict(model, loader)

    writer = CollectPredictions()  # a shuffled predict loader: the writer collects
    model.collect_predictions = False
    trainer(callbacks=[writer]).predict(model, shuffled, return_predictions=False)
    shuffled_result = writer.collector.all_gather()

    with torch.no_grad():
        full = model(data.x)  # one process, after training
    one = compute({**full, "y": data.y, "target": data.target})
    sanity, *epochs = model.results["validate"]
    if dist.get_rank() == 0:
        assert sanity[1] and not any(partial for _, partial in epochs), "sanity check: partial"
        assert len(sanity[0]["i"]) < N_SAMPLES
        print(f"sanity check: {len(sanity[0]['i'])} samples (2 batches per rank), partial")
        for stage in ("validate", "test", "predict"):
            for result, _ in model.results[stage][-1:]:
                assert result["i"].tolist() == list(range(N_SAMPLES)), (stage, "once, in order")
        result = model.results["predict"][-1][0]
        assert torch.allclose(result["logits"], full["logits"], atol=1e-6)
        assert shuffled_result["i"].tolist() == list(range(N_SAMPLES)), "writer: once, in order"
        assert compute(model.results["test"][-1][0]) == one
        print(f"validate x{len(epochs)}, test, predict: {N_SAMPLES} samples, each once, in order")
        print(
            "lightning metrics = one process: " + ", ".join(f"{k}={v:.4f}" for k, v in one.items())
        )


# --------------------------------------------------------------------------------- torchmetrics


def torchmetrics_guide() -> None:
    """A plain DDP loop, shuffled: metrics updated per batch (synced at compute) against the
    Collector's result, each metric updated once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Toy()
    torch.manual_seed(0)
    model = Classifier()
    sampler = DistributedSampler(data, shuffle=True, seed=1)  # pads 13 to 14 (2 ranks)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    per_batch = metrics(sync_on_compute=True)  # the usual way: synced at compute()
    collector = tgd.Collector()
    with torch.no_grad():
        for batch in collector.observe(loader):
            out = model.outputs(batch)
            collector.add(out)
            update(per_batch, out)
        naive = {k: float(m.compute()) for k, m in per_batch.items()}  # padding counted
        exact = compute(collector.all_gather())  # every sample once
        full = model(data.x)
    one = compute({**full, "y": data.y, "target": data.target})
    if rank == 0:
        assert exact == one, (exact, one)
        print(
            f"ranks={world}: each rank saw {len(sampler)} samples (padded to {len(sampler) * world})"
        )
        for k in one:
            print(
                f"{k}: one process {one[k]:.4f}, per batch {naive[k]:.4f}, collected {exact[k]:.4f}"
            )


# ------------------------------------------------------------------------ Hugging Face Trainer


class Sentences(Dataset[dict[str, torch.Tensor]]):
    """13 token sequences with a binary label: 13 samples in batches of 4 on 2 processes fill
    no round of batches, so accelerate pads the last one."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(5, 30, (N_SAMPLES, 6), generator=g)
        self.labels = torch.randint(2, (N_SAMPLES,), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def classification_metrics(prediction: EvalPrediction) -> dict[str, float]:
    """Accuracy and the loss, from per-sample values (the loss: the mean over samples)."""
    logits = torch.as_tensor(prediction.predictions)
    labels = torch.as_tensor(prediction.label_ids)
    return {
        "accuracy": float((logits.argmax(-1) == labels).float().mean()),
        "loss": float(F.cross_entropy(logits, labels)),
    }


class CollectingTrainer(Trainer):
    """``evaluate()`` and ``predict()`` with every sample once, in dataset order: each step's
    outputs go to a Collector made from the loader the Trainer runs, exchanged once after the
    loop; ``compute_metrics`` runs on that result, on every rank."""

    def evaluation_loop(
        self,
        dataloader: DataLoader[Any],
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        self.collector = tgd.Collector(dataloader, device="cpu")  # the loader this loop runs
        compute_metrics, self.compute_metrics = self.compute_metrics, None  # (ours, below)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            self.compute_metrics = compute_metrics
        result = self.collector.all_gather()  # every sample once, in dataset order
        predictions = result["logits"].numpy()
        labels = None if result["labels"] is None else result["labels"].numpy()  # (predict)
        metrics = dict(output.metrics)  # (the Trainer's own: its loss, its timings)
        if compute_metrics is not None and labels is not None:
            found = compute_metrics(EvalPrediction(predictions=predictions, label_ids=labels))
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in found.items()})
        return EvalLoopOutput(predictions, labels, metrics, num_samples=len(predictions))

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        loss, logits, labels = super().prediction_step(model, inputs, False, ignore_keys)
        self.collector.add({"logits": logits, "labels": labels})  # no communication
        return (loss, None, None) if prediction_loss_only else (loss, logits, labels)


def hf_model() -> BertForSequenceClassification:
    """A 2-layer BERT classifier built from a config (the same weights on every rank)."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def hf_args(**kw: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_eval_batch_size=4,
        report_to=[],
        disable_tqdm=True,
        **kw,
    )


def transformers_guide() -> None:
    """``evaluate()`` and ``predict()`` under torchrun: the Collector's result against one
    process, and against accelerate's own gather (the plain Trainer's ``predict``)."""
    data, model = Sentences(), hf_model()
    trainer = CollectingTrainer(
        model=model, args=hf_args(), eval_dataset=data, compute_metrics=classification_metrics
    )
    metrics = trainer.evaluate()
    predicted = trainer.predict(data)
    order = trainer.collector.indices.tolist()
    accelerate_s = Trainer(model=model, args=hf_args()).predict(data).predictions  # (its gather)

    # A loader that drops samples has not seen the dataset: the same error on every rank.
    dropping = CollectingTrainer(
        model=model,
        args=hf_args(dataloader_drop_last=True),
        eval_dataset=data,
        compute_metrics=classification_metrics,
    )
    try:
        dropping.evaluate()
        refused = ""
    except tg.BatchSizeError as exc:
        refused = str(exc)
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, refused)

    model.eval()
    with torch.no_grad():  # one process, every sample
        full = model(input_ids=data.input_ids).logits
    one = classification_metrics(EvalPrediction(full.numpy(), data.labels.numpy()))
    if dist.get_rank() == 0:
        assert order == list(range(N_SAMPLES)), "each sample once, in dataset order"
        assert np.allclose(predicted.predictions, full.numpy(), atol=1e-5)
        assert np.array_equal(predicted.label_ids, data.labels.numpy())
        for name, value in one.items():
            assert abs(metrics[f"eval_{name}"] - value) < 1e-6, (name, metrics, one)
            assert abs(predicted.metrics[f"test_{name}"] - value) < 1e-6, name
        assert np.allclose(accelerate_s, full.numpy(), atol=1e-5)  # (its count, here: right)
        assert refused and all(text == refused for text in said), "every rank, the same"
        world = dist.get_world_size()
        print(
            f"trainer evaluate/predict: {N_SAMPLES} samples over {world} ranks in batches of "
            f"4, each once, in dataset order (accelerate's gather: {len(accelerate_s)} rows)"
        )
        print("trainer metrics = one process: " + ", ".join(f"{k}={v:.4f}" for k, v in one.items()))
        print("dataloader_drop_last=True: " + refused.splitlines()[1].removeprefix("  - "))


SECTIONS = {
    "lightning": lightning_guide,
    "torchmetrics": torchmetrics_guide,
    "transformers": transformers_guide,
}


def main(sections: list[str]) -> None:
    dist.init_process_group("gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT
    # Lightning's advice: workers for a toy dataset, sync_dist for values that are the same on
    # every rank, and no DistributedSampler in validate/test (the padding the Collector drops)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in sections or list(SECTIONS):
        SECTIONS[name]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
