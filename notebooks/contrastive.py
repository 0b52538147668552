"""A CLIP-style contrastive loss across ranks, with ``all_gather(..., sync_grads=True)``.

Run it on CPU with two processes (gloo), from the repository root:

    torchrun --nproc-per-node 2 notebooks/contrastive.py

In-batch negatives are only as many as the batch: under DDP each rank sees its own rows, so the
embeddings of every rank are gathered and each rank's loss compares its rows with all of them.
``treegather.distributed.all_gather`` gathers the whole tree of embeddings (uneven batches
too) in one collective; with ``sync_grads=True`` the result is differentiable, and the backward
sends every rank the gradient of every rank's loss with respect to its own embeddings in one
all-to-all. DDP then averages the parameter gradients as usual. Rank 0 checks the step against
one process that holds every rank's rows.

Every rank must run the backward (the all-to-all is a collective). It is itself differentiable:
with ``create_graph=True`` (a gradient penalty, a Hessian-vector product) second derivatives
are exact, every rank running the same double backward. Without ``sync_grads``, a backward that
reaches the result of tensors that require grad raises, saying to pass it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import treegather as tg  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import treegather.distributed as tgd

DIM_IN, DIM_OUT = 8, 4


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's (images, texts): uneven batches, 3 rows on rank 0, 2 on rank 1, ..."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        n = max(1, 3 - r)
        out.append((torch.randn(n, DIM_IN, generator=g), torch.randn(n, DIM_IN, generator=g)))
    return out


class Clip(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = torch.nn.Linear(DIM_IN, DIM_OUT)
        self.text = torch.nn.Linear(DIM_IN, DIM_OUT)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "image": F.normalize(self.image(images), dim=1),
            "text": F.normalize(self.text(texts), dim=1),
        }


def clip_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The symmetric contrastive loss over every pair of the (global) batch."""
    logits = scale.exp() * image @ text.T
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Clip()
    reference = Clip()
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    images, texts = batches(world)[rank]
    local = ddp(images, texts)
    # One collective for the whole tree; differentiable, so every rank's loss reaches every
    # rank's embeddings.
    both = tgd.all_gather(local, sync_grads=True)
    loss = clip_loss(both["image"], both["text"], model.scale)
    loss.backward()  # DDP averages the parameter gradients over the ranks

    # One process holding every rank's rows; each rank's loss is the same function of them,
    # so the gradient DDP averages is the gradient of one of them.
    rows = batches(world)
    everything = reference(torch.cat([i for i, _ in rows]), torch.cat([t for _, t in rows]))
    clip_loss(everything["image"], everything["text"], reference.scale).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert q.grad is not None and p.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    if rank == 0:
        print(f"ranks={world}: global batch {len(both['image'])} rows, loss {loss.item():.4f}")
        print("every parameter's gradient equals one process holding every rank's rows")
    # DDP holds the process group: let go of it (and of the step's tensors) while every rank
    # still has its group, so that no rank tears gloo down alone after destroying it.
    del ddp, local, both, loss
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
