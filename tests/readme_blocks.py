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
    """The "Across processes" blocks in order (setup, by hand, Collector, the same over an
    accelerate-prepared loader, contrastive), with checks of what they claim, for ``torchrun
    --nproc-per-node 2``."""
    setup, by_hand, collector, prepared, contrastive = ACROSS
    return "\n".join(
        [
            setup,
            by_hand,
            "hand_ids, hand_logits = ids, logits",
            "assert hand_ids.tolist() == list(range(11)), hand_ids",
            collector,
            "assert torch.equal(result['logits'], hand_logits)",
            "assert result['logits'].shape == (11, 3)",
            prepared,
            "assert torch.equal(result['logits'], hand_logits)",
            contrastive,
            "assert all(p.grad is not None for p in model.parameters())",
            "print(f'rank {dist.get_rank()}: README blocks ok')",
            "dist.destroy_process_group()",
        ]
    )
