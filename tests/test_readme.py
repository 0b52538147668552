"""The README's code is true: every Python block runs, and what its comments claim holds.

Blocks before "Across processes" run here, each in a fresh namespace, followed by checks of
what the block's comments say. The "Across processes" blocks make one script, run by
``torchrun --nproc-per-node 2`` as the README says, with checks of its claims (every sample
once, in dataset order; the hand-written gather equal to the Collector's). The README's two
commands are the ones ``.ci/run`` runs.
"""

from __future__ import annotations

import contextlib
import io
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
    assert len(ACROSS) == 5  # setup, by hand, Collector, Collector over accelerate, contrastive


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
    pytest.importorskip("transformers")
    ns, _ = _run(dict(LOCAL)["Hugging Face models"])
    model, batch, ids = ns["model"], ns["batch"], ns["ids"]
    with torch.no_grad():
        one = model(**batch)
        torch.testing.assert_close(ns["out"].loss, one.loss)  # "the one-device loss"
        torch.testing.assert_close(ns["out"].logits, one.logits)
        one_step = model(input_ids=ids[:, :1], cache=one.cache)
        torch.testing.assert_close(ns["step"].logits, one_step.logits, atol=1e-5, rtol=1e-4)
        greedy = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        found = model.generate(
            input_ids=ids,
            max_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert torch.equal(ns["new"], greedy)
    # "found, of one device's type: sequences equal to one device's; scores one device's steps,
    # where a shard that had stopped has -inf for its rows; cache of one device's shape"
    got = ns["found"]
    assert type(got) is type(found) and torch.equal(got.sequences, found.sequences)
    assert len(got.scores) == len(found.scores)
    for a, b in zip(got.scores, found.scores):
        for rows_a, rows_b in zip(a.split([3, 2, 2]), b.split([3, 2, 2])):
            if not torch.isinf(rows_a).all():
                torch.testing.assert_close(rows_a, rows_b, atol=1e-5, rtol=1e-4)
    shapes = [t.shape for t in tg._tree.flatten(got.cache)[0]]
    assert shapes == [t.shape for t in tg._tree.flatten(found.cache)[0]]


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
