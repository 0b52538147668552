"""A DDP evaluation loop with ``DistributedSampler`` and ``treegather.distributed.Collector``.

Run it on CPU with two processes (gloo), from the repository root:

    torchrun --nproc-per-node 2 notebooks/ddp_eval.py

21 samples over 2 ranks: ``DistributedSampler`` pads the dataset to 22 (sample 0 twice) and
interleaves the ranks (rank 0 gets 0, 2, 4, ..., rank 1 gets 1, 3, 5, ..., 0), shuffled here.
Gathering the predictions as they come would give 22 rows in the sampler's order, the padding
duplicate included, and a metric that is off. The loop runs through ``collector.observe(loader)``,
which notes the dataset indices the loader's sampler hands out for every batch (nothing is read
twice), keeps everything local during the loop, and makes one exchange at the end: every sample exactly once, in dataset order, with per-sample ids
(strings), logits, labels, variable-length per-token scores and the loss, on every rank. Rank 0
then checks the result against evaluating the whole dataset in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

try:
    import treegather as tg
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treegather as tg
import treegather.distributed as tgd

N_SAMPLES, N_FEATURES, N_CLASSES, BATCH = 21, 8, 3, 4


class Toy(Dataset):
    """A toy evaluation set: features, labels, ids and a variable number of tokens per sample."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
        self.y = torch.randint(N_CLASSES, (N_SAMPLES,), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": self.x[i], "y": self.y[i], "id": f"doc-{i:02d}", "n_tokens": 1 + i % 5}


def outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, object]:
    """One batch's outputs: every leaf per sample (batch dim first), except the loss."""
    with torch.no_grad():
        logits = model(batch["x"])
    longest = int(batch["n_tokens"].max())
    scores = torch.zeros(len(logits), longest)  # per-token scores, padded within the batch
    for row, p, n in zip(scores, logits.softmax(1).amax(1), batch["n_tokens"].tolist()):
        row[:n] = p * torch.linspace(1, 0.5, n)
    return {
        "ids": list(batch["id"]),  # a per-sample list of strings
        "logits": logits,
        "labels": batch["y"],
        "token_scores": scores,
        "loss": F.cross_entropy(logits, batch["y"]),  # one value per batch
    }


LAYOUT = tg.by_path(
    {
        "ids": tg.cat_items(),  # one list of all ids, each once, in dataset order
        "token_scores": tg.pad(0, fill=0.0),  # per sample, padded to the longest batch
        "loss": tg.mean(),  # per batch: weighted by the batches' rows (padding included)
    }
)  # logits and labels: the default, cat() per sample


def main() -> None:
    dist.init_process_group("gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(N_FEATURES, N_CLASSES))
    model.eval()
    data = Toy()
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    sampler.set_epoch(3)  # as for any epoch: the loader shuffles by it
    collector = tgd.Collector()
    seen = 0
    for batch in collector.observe(loader):  # the loop as usual; each batch's indices noted
        collector.add(outputs(model, batch))  # no communication
        seen += len(batch["x"])
    result = collector.all_gather(LAYOUT)  # one exchange, every rank gets the result

    if rank == 0:
        assert result["ids"] == [f"doc-{i:02d}" for i in range(N_SAMPLES)], "once, in order"
        assert collector.indices is not None
        assert collector.indices.tolist() == list(range(N_SAMPLES))
        with torch.no_grad():
            full = model.module(data.x)
        assert torch.allclose(result["logits"], full, atol=1e-6)
        assert torch.equal(result["labels"], data.y)
        accuracy = (result["logits"].argmax(1) == result["labels"]).float().mean()
        exact = F.cross_entropy(result["logits"], result["labels"])  # from per-sample values
        print(f"ranks={world}: each rank saw {seen} samples (the sampler pads to {seen * world})")
        print(f"gathered {len(result['ids'])} samples, each once, in dataset order")
        print(f"accuracy={accuracy:.3f} loss={exact:.4f} (batch-loss mean {result['loss']:.4f})")
        print(f"token_scores {tuple(result['token_scores'].shape)}")
    del model  # DDP holds the process group: let go of it while every rank still has the group
    dist.barrier()  # every rank done before the group goes (DDP's threads may abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
