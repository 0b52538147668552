"""Evaluation across processes: every sample once, in dataset order, with a ``Collector``.

Run it on CPU with two processes (gloo), from the repository root:

    torchrun --nproc-per-node 2 notebooks/ddp_eval.py

**The problem.** ``DistributedSampler`` pads the dataset so that every rank gets as many samples
(21 samples on 2 ranks: 22, sample 0 twice) and interleaves the ranks (rank 0 gets 0, 2, 4, ...,
rank 1 gets 1, 3, 5, ..., 0), shuffled here. Gathering the predictions as they come gives 22
rows in the sampler's order, and a metric over them is off; so is a per-rank total
(``tgd.all_gather({"correct": ..., "seen": ...}, tg.sum())`` adds up what each rank counted,
the padding duplicate included: 22 samples seen). The code written by hand today gathers, then
undoes the sampler by index (strings need ``all_gather_object`` on top); accelerate's
``gather_for_metrics`` drops the duplicates of the last batch only, and keeps the ranks'
interleaved order. Sections 1 and 2 of ``main`` show the gather by hand and the per-rank
totals.

**The Collector.** Run the loop through ``collector.observe(loader)``: it iterates the loader
once, as ``for batch in loader`` does, and notes the dataset indices the loader's sampler hands
out for each batch. ``add`` keeps each batch's outputs local (no communication); one exchange at
the end gives every rank each sample once, in dataset order: per-sample ids (strings), logits,
labels, variable-length per-token scores, and a batch loss (section 3). The same loop serves a
loader that accelerate prepared (section 4, which needs ``accelerate``). Every rank checks the
results against evaluating the whole dataset in one process.

- **Where the rows come from.** Each ``add`` in the loop takes rows of the batch the loop last
  yielded: the indices the sampler (or batch sampler) handed out for it, to the main process or
  to ``num_workers`` workers, copied as they were handed out: any sampler, a seeded
  ``RandomSampler``, ``batch_sampler=`` yielding lists, tuples, tensors, numpy arrays, ranges or
  other iterables of ints, accelerate's loaders (their shards, and the batches they repeat to
  even them out, observed as they come). A batch may be added in several parts (its rows in
  order); a batch with no add is skipped (``continue`` on a bad batch, a caught out-of-memory
  error), and ``partial=True`` then holds exactly the samples added. Outputs kept and added
  after the loop take its batches in turn, whole. Nothing is read twice, so the shuffle, the generators and the epoch counters are
  what they would be without a Collector. ``Collector(loader)`` with a plain ``for batch in
  loader`` loop reads the sampler again at the first ``add``, which only samplers known to give
  the same order again allow (``SequentialSampler``, ``DistributedSampler`` after
  ``set_epoch``, a ``BatchSampler`` over those); any other is a typed error naming ``observe``
  and ``indices=``. ``add(outputs, indices=...)`` names the rows itself (an
  ``IterableDataset``, any other loop; non-negative integers). With no process group, a
  Collector works in one process.
- **What ``collate_fn`` must keep.** Rows are matched to the batch's indices by position, so
  the ``collate_fn`` must keep the batch's samples and their order (torch's default does). One
  that drops samples (a corrupt one), adds rows or reorders them (sorting by length for
  ``pack_padded_sequence``) must carry each sample's dataset index in the batch, and the loop
  passes it: ``col.add(outputs, indices=batch["index"])``, checked against the batch the loop is
  on (its samples, each once, in any order). Without them, a batch whose adds hold more or fewer
  rows than it has samples is an error naming the batch; a reordered batch cannot be told from
  the outputs, and its rows would be mislabelled.
- **One dataset.** Rows are matched across ranks by dataset index, so every rank's loader must
  index the same dataset, split by its sampler. A rank's own part of it (``Subset(data,
  my_indices)``, a dataset sharded per rank) restarts its indices at 0, and the same index on
  two ranks would read as padding: the exchange compares the datasets (class, length, a
  ``Subset``'s indices) and raises on every rank when they differ. A shard type it cannot tell
  apart (equal lengths, not a ``Subset``) needs ``add(outputs, indices=...)`` with indices into
  one dataset.
- **Complete or told.** The exchange checks that every rank added every batch of its epoch: a
  rank that left its loop early (a step limit one rank reaches) is an error on every rank,
  naming the rank and its counts; ``collector.all_gather(partial=True)`` takes what was added,
  and ``collector.indices`` says which samples the result holds. A loader that drops samples
  (``drop_last=True`` on the ``DataLoader``, the ``DistributedSampler`` or a ``BatchSampler``)
  has not seen the dataset: the same error, saying how many samples it drops and where, unless
  ``partial=True``.
- **Per sample by the layout.** Tensors joined along the batch dim (``cat()``, ``cat(-2)`` of a
  2-D leaf, ``pad(0)``) and lists under ``cat_items()`` are put in dataset order; a list of
  strings needs its rule (``cat_items()`` per sample, ``as_list()`` per add). Any other leaf,
  such as a 0-dim batch loss, is one value per ``add`` combined by its rule, padding duplicates
  included: per-sample values are the exact way (here the loss recomputed from the gathered
  logits, next to the batch-loss mean). A ``cat()``/``pad()`` dim the leaf does not have is the
  error ``tg.gather`` gives; ``pad(0, lengths=True)`` is refused, as its lengths are per add:
  add each row's length as a per-sample leaf instead.
- **One answer.** Every rank must pass the same layout (and ``partial``): ranks that differ, or
  whose adds differ in structure, all raise the same error, naming the leaf.
  ``collector.gather(layout, dst=0)`` returns the result on ``dst`` only;
  ``Collector(device="cpu")`` keeps the adds off the GPU; the exchange lets go of the adds;
  ``collector.reset()`` starts the next evaluation. ``add`` may run in another thread than the
  exchange: each add lands in it or raises.
- **Cost.** The exchange is one ``all_gather`` of every rank's adds, joined (tensors as bytes,
  strings as UTF-8), taken whole: a repeated evaluation costs the wire plan's one collective
  while it fits the group's inline capacity, else two.
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
    """A toy evaluation set: features, labels, the sample's index and id, and a variable number
    of tokens per sample."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
        self.y = torch.randint(N_CLASSES, (N_SAMPLES,), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, object]:
        return {
            "x": self.x[i],
            "y": self.y[i],
            "index": i,
            "id": f"doc-{i:02d}",
            "n_tokens": 1 + i % 5,
        }


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


def by_hand(model: torch.nn.Module, loader: DataLoader) -> tuple[torch.Tensor, int]:
    """What is written by hand today: gather every rank's rows, then undo the sampler by index.
    The logits in dataset order, and how many rows the all-gathers brought."""
    with torch.no_grad():
        index, logits = map(torch.cat, zip(*[(b["index"], model(b["x"])) for b in loader]))
    all_index = [torch.empty_like(index) for _ in range(dist.get_world_size())]
    all_logits = [torch.empty_like(logits) for _ in all_index]
    dist.all_gather(all_index, index)
    dist.all_gather(all_logits, logits)  # padded, interleaved
    index, order = torch.cat(all_index).sort(stable=True)
    keep = torch.cat([torch.tensor([True]), index[1:] != index[:-1]])
    return torch.cat(all_logits)[order][keep], len(order)


def per_rank_totals(model: torch.nn.Module, loader: DataLoader) -> dict[str, torch.Tensor]:
    """Each rank counts what it saw; ``tg.sum()`` adds the counts up, padding duplicates too."""
    correct = seen = 0
    with torch.no_grad():
        for batch in loader:
            correct += int((model(batch["x"]).argmax(1) == batch["y"]).sum())
            seen += len(batch["y"])
    counts = {"correct": torch.tensor(correct), "seen": torch.tensor(seen)}
    return tgd.all_gather(counts, tg.sum())  # type: ignore[no-any-return]


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
    with torch.no_grad():
        full = model.module(data.x)  # one process, the whole dataset: the reference

    # 1. By hand: 22 rows gathered, put back in dataset order by their index.
    hand_logits, gathered = by_hand(model, loader)

    # 2. Per-rank totals: the padding duplicate is counted.
    totals = per_rank_totals(model, loader)

    # 3. The Collector: the loop as usual, one exchange.
    collector = tgd.Collector()
    seen = 0
    for batch in collector.observe(loader):  # each batch's indices noted
        collector.add(outputs(model, batch))  # no communication
        seen += len(batch["x"])
    result = collector.all_gather(LAYOUT)  # one exchange, every rank gets the result

    # 4. The same loop over a loader that accelerate prepared (shuffled, its own sharding).
    from accelerate import Accelerator

    torch.manual_seed(1234)  # (as accelerate.utils.set_seed: the ranks shuffle alike)
    prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=BATCH, shuffle=True))
    again = tgd.Collector()
    with torch.no_grad():
        for batch in again.observe(prepared):
            again.add({"logits": model(batch["x"]), "index": batch["index"]})
    from_accelerate = again.all_gather()

    # Every rank: each sample once, in dataset order, equal to one process.
    assert result["ids"] == [f"doc-{i:02d}" for i in range(N_SAMPLES)], "once, in order"
    assert collector.indices is not None
    assert collector.indices.tolist() == list(range(N_SAMPLES))
    assert torch.allclose(result["logits"], full, atol=1e-6)
    assert torch.equal(result["labels"], data.y)
    assert gathered == seen * world == N_SAMPLES + 1 and torch.equal(hand_logits, result["logits"])
    assert torch.equal(from_accelerate["index"], torch.arange(N_SAMPLES))
    assert torch.allclose(from_accelerate["logits"], full, atol=1e-6)
    accuracy = (result["logits"].argmax(1) == result["labels"]).float().mean()
    assert int(totals["seen"]) == N_SAMPLES + 1  # sample 0 twice
    assert float(totals["correct"] / totals["seen"]) != float(accuracy)
    if rank == 0:
        exact = F.cross_entropy(result["logits"], result["labels"])  # from per-sample values
        print(f"ranks={world}: each rank saw {seen} samples (the sampler pads to {seen * world})")
        print(f"by hand: {gathered} rows gathered, {len(hand_logits)} once each by index")
        print(
            f"per-rank totals: {int(totals['seen'])} samples seen, accuracy "
            f"{float(totals['correct'] / totals['seen']):.4f} (the Collector's: {accuracy:.4f})"
        )
        print(f"gathered {len(result['ids'])} samples, each once, in dataset order")
        print(f"accuracy={accuracy:.3f} loss={exact:.4f} (batch-loss mean {result['loss']:.4f})")
        print(f"token_scores {tuple(result['token_scores'].shape)}")
        print(f"accelerate: {len(from_accelerate['index'])} samples, each once, in dataset order")
    del model  # DDP holds the process group: let go of it while every rank still has the group
    dist.barrier()  # every rank done before the group goes (DDP's threads may abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
