"""``python -m treegather``: a short demo of the main job, on repeated CPU devices.

Scatters a nested batch over three CPU "devices", runs a tiny model on each shard, and gathers
a nested output holding a registered dataclass, per-sample strings, a ``None`` and a 0-dim
loss, then checks the result against running the model on the whole batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import torch

import treegather as tg


@tg.register_dataclass
@dataclasses.dataclass
class Output:
    """What the demo model returns: a registered dataclass comes back whole."""

    loss: torch.Tensor
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    names: list[str]
    aux: torch.Tensor | None = None


def model(batch: dict) -> Output:
    x = batch["features"]["x"] * batch["scale"]
    logits = x @ torch.ones(4, 2)
    loss = ((logits - batch["labels"][:, None]) ** 2).mean()
    return Output(loss, logits, (x, x.tanh()), [f"{n}!" for n in batch["names"]])


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m treegather",
        description=(
            "Run treegather's demo on three CPU 'devices': scatter a nested batch, run a tiny "
            "model on each shard, gather its dataclass output, check it against the unsplit "
            "model, and show the error a structure mismatch raises. Needs no GPU."
        ),
        epilog=(
            "To see what a layout does to your own tree before running a model: "
            "print(treegather.explain(tree, layout, devices))"
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (``--help`` prints usage and exits), then run the demo."""
    _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    torch.manual_seed(0)
    batch = {
        "features": {"x": torch.randn(10, 4)},
        "labels": torch.arange(10.0),
        "names": [f"sample{i}" for i in range(10)],
        "scale": 0.5,  # broadcast to every device
    }
    devices = ["cpu"] * 3
    in_layout = tg.by_path({"names": tg.split_items()})
    out_layout = tg.by_path({"loss": tg.mean(), "names": tg.cat_items()})

    shards = tg.scatter(batch, devices, in_layout)
    print(f"scattered 10 rows over {len(shards)} devices: sizes {shards.sizes}")
    outputs = [model(shard) for shard in shards]
    out = tg.gather(outputs, "cpu", out_layout, sizes=shards.sizes)
    print(
        f"gathered {type(out).__name__}: loss={out.loss.item():.4f} logits{tuple(out.logits.shape)} "
        f"hidden=({', '.join(str(tuple(h.shape)) for h in out.hidden)}) names[:3]={out.names[:3]} "
        f"aux={out.aux}"
    )

    full = model(batch)
    assert torch.allclose(out.loss, full.loss) and torch.equal(out.logits, full.logits)
    assert out.names == full.names and out.aux is None
    print("matches the unsplit model: the weighted mean of per-shard losses is the full-batch loss")

    try:
        tg.gather([outputs[0], dataclasses.replace(outputs[1], aux=torch.zeros(1))], "cpu")
    except tg.StructureMismatchError as err:
        print("and a mismatch is an error, never a silent drop:")
        text = f"{type(err).__module__}.{type(err).__qualname__}: {err}"
        print("  " + text.replace("\n", "\n  "))


if __name__ == "__main__":
    main()
