"""Gathering evaluation outputs under DDP with treegather.distributed.

Run it on CPU with two processes (gloo), from the repository root:

    torchrun --nproc-per-node 2 notebooks/ddp_eval.py

Every rank evaluates its own shard of a toy dataset: 21 samples over 2 ranks, so the shards are
uneven (10 and 11 samples) and nothing is padded or duplicated, unlike ``DistributedSampler``.
Each rank collects its outputs in one pytree: per-sample ids (strings), logits, labels,
variable-length per-token scores, its mean loss and a little bookkeeping. One call,
``treegather.distributed.gather(outputs, dst=0, layout, sizes=n)``, brings the whole tree to
rank 0 in three collectives (whatever the number of leaves), with the same layout rules as the
single-process ``treegather.gather``. Rank 0 then checks the result against evaluating the full
dataset in one process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import treegather as tg
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import treegather as tg
import treegather.distributed as tgd

N_SAMPLES, N_FEATURES, N_CLASSES, BATCH = 21, 8, 3, 4


def dataset() -> dict[str, object]:
    """A toy evaluation set: features, labels, ids and a variable number of tokens per sample."""
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(N_SAMPLES, N_FEATURES, generator=g),
        "y": torch.randint(N_CLASSES, (N_SAMPLES,), generator=g),
        "ids": [f"doc-{i:02d}" for i in range(N_SAMPLES)],
        "n_tokens": [1 + i % 5 for i in range(N_SAMPLES)],
    }


def evaluate(model: torch.nn.Module, data: dict, indices: list[int]) -> dict[str, object]:
    """Evaluate ``indices`` batch by batch; return this rank's outputs as one pytree."""
    logits, labels, ids, scores, lengths, losses = [], [], [], [], [], []
    for start in range(0, len(indices), BATCH):
        batch = indices[start : start + BATCH]
        x, y = data["x"][batch], data["y"][batch]
        with torch.no_grad():
            out = model(x)
        logits.append(out)
        labels.append(y)
        ids += [data["ids"][i] for i in batch]
        losses.append(F.cross_entropy(out, y, reduction="sum"))
        for i, row in zip(batch, out):  # per-token scores of variable length
            n = data["n_tokens"][i]
            scores.append(row.softmax(0).max().repeat(n) * torch.linspace(1, 0.5, n))
            lengths.append(n)
    longest = max(lengths, default=0)
    token_scores = torch.zeros(len(scores), longest)  # padded within the rank...
    for row, s in zip(token_scores, scores):
        row[: len(s)] = s
    return {
        "ids": ids,
        "logits": torch.cat(logits),
        "labels": torch.cat(labels),
        "loss": torch.stack(losses).sum() / len(indices),
        "token_scores": token_scores,  # ... and across ranks by pad() below
        "token_lengths": torch.tensor(lengths),
        "info": {"rank": dist.get_rank(), "samples": len(indices), "seconds": 0.0},
    }


LAYOUT = {
    "ids": tg.cat_items(),  # one list of all ids, in rank order
    "logits": tg.cat(),  # uneven row counts are fine
    "labels": tg.cat(),
    "loss": tg.mean(),  # weighted by each rank's sizes= (its sample count)
    "token_scores": tg.pad(0, fill=0.0),  # cat along dim 0, dim 1 padded to the longest rank
    "token_lengths": tg.cat(),
    "info": tg.as_list(),  # one dict per rank
}


def main() -> None:
    dist.init_process_group("gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(N_FEATURES, N_CLASSES))
    model.eval()
    # Rank 0's settings reach every rank (the others pass None).
    settings = tgd.broadcast({"split": "validation", "step": 1000} if rank == 0 else None, src=0)

    data = dataset()
    bounds = [N_SAMPLES * r // world for r in range(world + 1)]
    mine = list(range(bounds[rank], bounds[rank + 1]))  # contiguous, uneven shards
    t0 = time.perf_counter()
    outputs = evaluate(model, data, mine)
    outputs["info"]["seconds"] = round(time.perf_counter() - t0, 3)

    # Every rank gets the global counts (a sum over ranks) ...
    totals = tgd.all_gather(
        {
            "correct": int((outputs["logits"].argmax(1) == outputs["labels"]).sum()),
            "samples": len(mine),
        },
        tg.sum(),
    )
    # ... and rank 0 gets everything, in one call.
    result = tgd.gather(outputs, dst=0, layout=LAYOUT, sizes=len(mine))

    if rank == 0:
        assert result["ids"] == data["ids"], "every sample exactly once, in order"
        with torch.no_grad():
            full = model.module(data["x"])
        assert torch.allclose(result["logits"], full, atol=1e-6)
        assert torch.allclose(result["loss"], F.cross_entropy(full, data["y"]), atol=1e-6)
        accuracy = totals["correct"] / totals["samples"]
        print(f"split={settings['split']} step={settings['step']} ranks={world}")
        print(
            f"gathered {len(result['ids'])} samples: {[i['samples'] for i in result['info']]} per rank"
        )
        print(f"loss={result['loss'].item():.4f} accuracy={accuracy:.3f}")
        print(
            f"token_scores {tuple(result['token_scores'].shape)}, lengths {result['token_lengths'].tolist()}"
        )
    dist.barrier()  # every rank done before the group goes (DDP's threads may abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
