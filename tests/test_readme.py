"""The README's code is true: every Python block runs, and what its comments claim holds.

Blocks outside "Across processes" run here, each in a fresh namespace, followed by checks of
what the block's comments say. The "Across processes" blocks make one script, run by
``torchrun --nproc-per-node 2`` as the README says, with checks of its claims (every sample
once, in dataset order, equal to one process; per-rank totals count the padding duplicate).
The README's two commands are the ones ``.ci/run`` runs. The README is a landing page: at most
400 lines, each story a short section linking to its guide in notebooks/, where the long
recipes live and are checked (the notebooks by tests/test_notebooks.py, the scripts under
torchrun by tests/test_distributed.py).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from typing import Any

import pytest
import readme_blocks
import torch

import treegather as tg

ROOT = readme_blocks.ROOT
BLOCKS, LOCAL, ACROSS = readme_blocks.BLOCKS, readme_blocks.LOCAL, readme_blocks.ACROSS


def _run(code: str) -> tuple[dict[str, Any], str]:
    """Run ``code`` as a module of its own (dataclasses look their module up)."""
    module = types.ModuleType("readme_block")
    sys.modules[module.__name__] = module
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__, out.getvalue()


def test_readme_has_the_blocks_this_file_checks() -> None:
    sections = [s for s, _ in LOCAL]
    assert sections == [
        "A first example",
        "The four steps",
        "The entry points",
        "Hugging Face models",
        "From jactorch",
    ], sections
    assert len(ACROSS) == 2  # the evaluation with a Collector, the contrastive loss


SECTIONS = [
    "Install and run",
    "A first example",
    "Layouts",
    "The four steps",
    "The entry points",
    "Errors",
    "Hugging Face models",
    "Across processes",
    "From jactorch",
    "More",
]
# Each story's section, and the guide it links to (run by the test suite).
GUIDES = {
    "Hugging Face models": "notebooks/transformers.ipynb",
    "Evaluation across processes": "notebooks/ddp_eval.py",
    "Contrastive losses": "notebooks/contrastive.py",
    "From jactorch": "notebooks/migrating.ipynb",
}


def section(title: str) -> str:
    """The text under the heading ``title`` (## or ###), up to the next heading."""
    text = readme_blocks.README
    start = re.search(rf"^#{{2,3}} {re.escape(title)}\n", text, re.M)
    assert start is not None, title
    end = re.search(r"^#{2,3} ", text[start.end() :], re.M)
    return text[start.end() : start.end() + end.start() if end else len(text)]


def test_readme_is_a_landing_page() -> None:
    """At most 400 lines; the sections in their order; each story short, linking its guide."""
    lines = readme_blocks.README.splitlines()
    assert len(lines) <= 400, len(lines)
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings == SECTIONS, headings
    for story, guide in GUIDES.items():
        text = section(story)
        assert guide in text, (story, guide)
        assert (ROOT / guide).is_file(), guide
        assert len(text.splitlines()) <= 50, (story, len(text.splitlines()))


def test_the_metric_line_says_what_it_counts() -> None:
    """The per-rank total says, at that line, that it counts the padding duplicates, and points
    to the Collector (the across-processes script checks the count: 12 seen for 11)."""
    text = " ".join(section("Across processes").split())
    at = text.index('tgd.all_gather({"correct": n_correct, "seen": n_seen}, tg.sum())')
    passage = text[at : at + 400]  # the rest of that sentence and the next
    assert "padding duplicates" in passage and "12 samples seen for 11" in passage, passage
    assert "Collector" in passage, passage


def test_first_commands_are_what_ci_runs() -> None:
    install = next(c for _, lang, c in BLOCKS if lang == "bash")
    lines = [line.split("#")[0].strip() for line in install.strip().splitlines()]
    assert lines == ['pip install -e ".[test]" && python -m treegather', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    for line in lines:
        assert f"\n{line}\n" in ci, line


def test_first_example() -> None:
    ns, printed = _run(dict(LOCAL)["A first example"])
    assert printed.strip() == (
        "(4, 3, 3) torch.Size([10, 2]) ['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j']"
    )
    out, batch = ns["out"], ns["batch"]
    assert type(out).__name__ == "Output"
    torch.testing.assert_close(out.loss, batch["x"].pow(2).mean())  # the full-batch loss
    torch.testing.assert_close(out.logits, batch["x"] @ torch.ones(4, 2))


def test_four_steps() -> None:
    ns, _ = _run(dict(LOCAL)["The four steps"])
    model, x, y = ns["model"], ns["x"], ns["y"]
    assert ns["shards"].sizes == (4, 3, 3)
    torch.testing.assert_close(y, model(x))  # "equal to model(x)"
    assert all(p.grad is not None for p in model.parameters())  # "gradients reach model"


def test_entry_points() -> None:
    ns, _ = _run(dict(LOCAL)["The entry points"])
    net, batch, labels, out = ns["net"], ns["batch"], ns["labels"], ns["out"]
    assert isinstance(ns["dp"], torch.nn.DataParallel)
    one = net(batch, labels=labels)  # one device
    torch.testing.assert_close(out["y"], one["y"])
    torch.testing.assert_close(out["loss"], one["loss"])
    assert out["names"] == one["names"] == list("ABCDEFGHIJ")
    first = tg.data_parallel(
        net,
        batch,
        ns["devices"],
        out_layout=ns["out_layout"],
        in_layout=tg.by_path({"names": tg.split_items()}),
    )
    assert first["loss"] is None  # "loss: None"


@pytest.mark.transformers
def test_hugging_face_recipe() -> None:
    """The token-weighted loss; the cache, generate and MoE recipes are the guide's
    (notebooks/transformers.ipynb), checked there against one device."""
    pytest.importorskip("transformers")
    ns, _ = _run(dict(LOCAL)["Hugging Face models"])
    model, batch, out = ns["model"], ns["batch"], ns["out"]
    one = model(**batch)
    torch.testing.assert_close(out.loss, one.loss)  # "the one-device loss"
    torch.testing.assert_close(out.logits, one.logits)
    rows = tg.data_parallel(model, (), ns["devices"], module_kwargs=batch)
    assert abs(rows.loss.mean().item() - one.loss.item()) > 1e-5  # the tokens make it exact


def test_from_jactorch_imports() -> None:
    ns, _ = _run(dict(LOCAL)["From jactorch"])
    assert ns["dict_gather_v2"].__module__.startswith("treegather.compat.jactorch")


def test_explain_output_is_what_explain_prints() -> None:
    """The table under "See what a layout does" is the output of the call beside it."""
    table = next(c for s, lang, c in BLOCKS if s == "Layouts" and lang == "")
    batch = {
        "input_ids": torch.zeros(10, 16, dtype=torch.int64),
        "labels": torch.zeros(10),
        "names": [str(i) for i in range(10)],
        "lr": 0.1,
    }
    got = str(tg.explain(batch, tg.by_path({"names": tg.split_items()}), ["cpu"] * 4))
    strip = "\n".join(line.rstrip() for line in got.strip().splitlines())
    assert strip == "\n".join(line.rstrip() for line in table.strip().splitlines())


@pytest.mark.distributed
def test_across_processes_blocks_run_under_torchrun(torchrun_outputs: dict[str, str]) -> None:
    """The blocks, with checks of what they claim, under ``torchrun --nproc-per-node 2``
    (``readme_blocks.across_script``)."""
    out = torchrun_outputs["readme"]
    assert "rank 0: README blocks ok" in out and "rank 1: README blocks ok" in out, out
