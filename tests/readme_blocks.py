"""The README's fenced blocks, by section; and its "Across processes" blocks as one script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks() -> list[tuple[str, str, str]]:
    """(section, language, code) of every fenced block, in order."""
    out, section = [], ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    pos = 0
    for m in fence.finditer(README):
        for line in README[pos : m.start()].splitlines():
            if line.startswith("## "):
                section = line[3:].strip()
        pos = m.end()
        out.append((section, m.group(1), m.group(2)))
    return out


BLOCKS = blocks()
LOCAL = [(s, c) for s, lang, c in BLOCKS if lang == "python" and s != "Across processes"]
ACROSS = [c for s, lang, c in BLOCKS if lang == "python" and s == "Across processes"]


def across_script() -> str:
    """The "Across processes" blocks in order (the evaluation with a Collector, the contrastive
    loss), with checks of what they and the section's text claim, for ``torchrun
    --nproc-per-node 2``. (The code written by hand today and the accelerate-prepared loader
    moved to notebooks/ddp_eval.py, which checks them against the Collector.)"""
    evaluation, contrastive = ACROSS
    return "\n".join(
        [
            evaluation,
            "assert result['logits'].shape == (11, 3)",
            "with torch.no_grad():",
            "    full = model(data.tensors[0])  # one process, the whole dataset",
            "assert torch.allclose(result['logits'], full, atol=1e-6)",
            "assert torch.equal(col.indices, torch.arange(11))",
            # "gathered as they come, the predictions are 12 rows in the sampler's order"
            "come = tgd.all_gather({'ids': torch.cat([i for _, i in loader])})['ids']",
            "assert len(come) == 12 and sorted(set(come.tolist())) == list(range(11)), come",
            "assert come.tolist() != sorted(come.tolist()), come",
            # the metric line: per-rank totals count the padding duplicate (12 seen for 11)
            "n_seen = sum(len(x) for x, _ in loader)",
            "seen = tgd.all_gather({'seen': torch.tensor(n_seen)}, tg.sum())['seen']",
            "assert int(seen) == 12, seen",
            contrastive,
            "assert all(p.grad is not None for p in model.parameters())",
            "assert len(both['image']) == 5  # 3 rows from rank 0, 2 from rank 1",
            "print(f'rank {dist.get_rank()}: README blocks ok')",
            "dist.destroy_process_group()",
        ]
    )
