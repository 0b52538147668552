"""transformers models through every entry point, cold: the conformance matrix, caches, recipes.

Each architecture is built once per module from a tiny, seeded config (no download) and never
called; every test works on deep copies of it, so each call through treegather is the model's
first (transformers installs its output-capture hooks lazily, on a model's first call). Each
case runs 7 rows on ``["cpu"] * 3`` (shards of 3, 2, 2) and compares with one device: loss,
logits, hidden states, attentions, caches and every parameter's gradient; the source's hooks
(per submodule) and ``state_dict()`` are unchanged. The recipes of the README's "Hugging Face
models" section and of its guide, notebooks/transformers.ipynb, are measured here too (the MoE
loss on Mixtral and Qwen2-MoE, Mamba's list of caches). Select with ``-m transformers``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import spawned_groups
import torch
import torch.nn.functional as F
from torch import nn

import treegather as tg

# The tiny models (and their constants) shared with the step benchmark (`python -m
# treegather.benchmarks.steps --transformers`), defined once there: it times what these check.
from treegather.benchmarks.architectures import (
    EAGER,
    PAD,
    TOKENS,
    VOCAB,
    _bart,
    _bert,
    _clip,
    _gpt2,
    _llama,
    _t5,
    _vit,
    _wav2vec2,
)

transformers = pytest.importorskip("transformers")
T: Any = transformers

pytestmark = pytest.mark.transformers

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu"] * 3
N = 7  # rows: shards of 3, 2 and 2


# ---------------------------------------------------------------------------- architectures


@dataclasses.dataclass(frozen=True)
class Arch:
    """One row of the matrix: how to build the model, a batch of N rows, how to score it."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, Any]]
    layout: Any = dataclasses.field(default_factory=lambda: tg.by_path({"loss": tg.mean()}))
    loss: Callable[[Any, nn.Module], torch.Tensor] = lambda out, model: out.loss
    skip: tuple[str, ...] = ()  # output keys not compared leaf by leaf (per-shard by nature)


def _ids(g: torch.Generator, rows: int = N, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=g)


def _mistral() -> nn.Module:
    config = T.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        sliding_window=5,
        **TOKENS,
        **EAGER,
    )
    return T.MistralForCausalLM(config)


def _t5_varied() -> nn.Module:
    """T5 at a larger init scale: at the default one, greedy decoding repeats the pad token."""
    return _t5(initializer_factor=5.0)


def _whisper() -> nn.Module:
    config = T.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,  # input features of 32 frames
        max_target_positions=32,
        decoder_start_token_id=1,
        **TOKENS,
        **EAGER,
    )
    return T.WhisperForConditionalGeneration(config)


def _bert_tokens() -> nn.Module:
    config = T.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=5,
        pad_token_id=PAD,
        **EAGER,
    )
    return T.BertForTokenClassification(config)


def _clip_loss(out: Any, model: nn.Module) -> torch.Tensor:
    """CLIP's contrastive loss computed on the whole (gathered) batch of embeddings."""
    logits = model.logit_scale.exp() * out.text_embeds @ out.image_embeds.t()
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _seq2seq_batch(g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "labels": torch.randint(3, VOCAB, (N, 4), generator=g)}


ARCHS: dict[str, Arch] = {
    "bert": Arch(_bert, lambda g: {"input_ids": _ids(g), "labels": torch.randint(0, 3, (N,))}),
    "gpt2": Arch(
        _gpt2, lambda g: {"input_ids": (ids := _ids(g)), "labels": ids, "use_cache": False}
    ),
    "gpt2_cache": Arch(
        _gpt2, lambda g: {"input_ids": (ids := _ids(g)), "labels": ids, "use_cache": True}
    ),
    "llama": Arch(_llama, lambda g: {"input_ids": (ids := _ids(g)), "labels": ids}),
    "t5": Arch(_t5, _seq2seq_batch),
    "vit": Arch(
        _vit,
        lambda g: {
            "pixel_values": torch.randn(N, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (N,), generator=g),
        },
    ),
    # CTC's default reduction is "sum": per-shard sums add up, sum() is exact
    "wav2vec2": Arch(
        _wav2vec2,
        lambda g: {
            "input_values": torch.randn(N, 400, generator=g),
            "labels": torch.randint(1, 16, (N, 3), generator=g),
        },
        layout=tg.by_path({"loss": tg.sum()}),
    ),
    # in-batch negatives: the loss is computed on the gathered embeddings, the per-shard
    # similarity matrices are kept per replica
    "clip": Arch(
        _clip,
        lambda g: {"input_ids": _ids(g), "pixel_values": torch.randn(N, 3, 16, 16, generator=g)},
        layout=tg.by_path({"logits_per_image": tg.as_list(), "logits_per_text": tg.as_list()}),
        loss=_clip_loss,
        skip=("logits_per_image", "logits_per_text"),
    ),
    "bart": Arch(_bart, _seq2seq_batch),
}

_BUILT: dict[Callable[[], nn.Module], nn.Module] = {}


def pristine(build: Callable[[], nn.Module]) -> nn.Module:
    """A copy of the model ``build`` makes (seeded, built once per module), never called."""
    if build not in _BUILT:
        torch.manual_seed(0)
        _BUILT[build] = build().eval()  # eval: no dropout, so shards equal one device
    return copy.deepcopy(_BUILT[build])


def batch_of(arch: Arch, seed: int = 0) -> dict[str, Any]:
    return arch.batch(torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- checks

HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per submodule, how many hooks each of its tables holds."""
    return {
        name: tuple(len(getattr(m, table, ())) for table in HOOK_TABLES)
        for name, m in model.named_modules()
    }


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def leaves_of(tree: Any) -> list[Any]:
    """``tree``'s leaves as treegather sees them (flattening registers transformers' caches)."""
    return tg._tree.flatten(tree)[0]


def assert_same_tree(got: Any, expected: Any, skip: tuple[str, ...] = (), where: str = "") -> None:
    """Same structure (treegather's view: caches are nodes) and equal tensors, leaf by leaf."""
    tg._tree.registry_version()  # (registers transformers' caches on first use)
    if skip:
        got = {k: v for k, v in got.items() if k not in skip}
        expected = {k: v for k, v in expected.items() if k not in skip}
    paths, leaves, spec = optree.tree_flatten_with_path(got, namespace=tg.NAMESPACE)
    _, exp_leaves, exp_spec = optree.tree_flatten_with_path(expected, namespace=tg.NAMESPACE)
    assert spec == exp_spec, f"{where}: {spec} != {exp_spec}"
    for path, a, b in zip(paths, leaves, exp_leaves):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), (where, path)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{where} {path}")
        else:
            assert a == b, (where, path, a, b)


def run(entry: str, model: nn.Module, kwargs: dict[str, Any], layout: Any) -> Any:
    """One call through ``entry`` on DEVICES."""
    if entry == "data_parallel":
        return tg.data_parallel(model, (), DEVICES, module_kwargs=kwargs, out_layout=layout)
    return tg.DataParallel(model, device_ids=DEVICES, out_layout=layout)(**kwargs)


# ------------------------------------------------------------------------- the matrix

OUTPUTS = {"output_hidden_states": True, "output_attentions": True}


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_forward_and_backward_equal_one_device_cold(name: str, entry: str) -> None:
    arch = ARCHS[name]
    model, ref = pristine(arch.build), pristine(arch.build)
    hooks, state = hook_counts(model), state_of(model)
    kwargs = {**batch_of(arch), **OUTPUTS}
    out = run(entry, model, kwargs, arch.layout)  # the model's first call
    expected = ref(**kwargs)
    assert type(out) is type(expected)
    assert_same_tree(out, expected, arch.skip, f"{name} via {entry}")
    arch.loss(out, model).backward()
    arch.loss(expected, ref).backward()
    grads = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        q = grads[pname]
        assert (p.grad is None) == (q.grad is None), pname
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=pname)
    # the source is the user's model as it was: no hook, attribute or tensor of the replicas
    assert hook_counts(model) == hooks
    assert_same_tree(state_of(model), state)
    with torch.no_grad():  # and called directly afterwards it is the one-device model
        assert_same_tree(model(**kwargs), ref(**kwargs), arch.skip, f"{name} direct")


DECODERS = {"gpt2_cache": {}, "llama": {}, "t5": {}, "bart": {"use_cache": True}}


@pytest.mark.parametrize("name", list(DECODERS))
def test_cached_decode_step_feeds_the_gathered_cache_back(name: str) -> None:
    arch = ARCHS[name]
    model, ref = pristine(arch.build), pristine(arch.build)
    first = {k: v for k, v in batch_of(arch).items() if k != "labels"}
    first = {**first, **DECODERS[name]}
    seq2seq = name in ("t5", "bart")
    if seq2seq:
        first["decoder_input_ids"] = torch.randint(3, VOCAB, (N, 3), generator=torch.Generator())
    out = tg.data_parallel(model, (), DEVICES, module_kwargs=first)
    expected = ref(**first)
    cache = out.cache
    assert isinstance(cache, type(expected.cache))  # one cache of the whole batch ...
    assert_same_tree(cache, expected.cache, where=f"{name} cache")  # ... equal to one device's
    length = cache.get_seq_length()
    keys = [t.clone() for t in leaves_of(cache)]
    step: dict[str, Any] = {"cache": cache, "use_cache": True}
    nxt = torch.randint(3, VOCAB, (N, 1), generator=torch.Generator().manual_seed(1))
    if seq2seq:
        step |= {"encoder_outputs": (out.encoder_last_hidden_state,), "decoder_input_ids": nxt}
    else:
        step["input_ids"] = nxt
    got = tg.data_parallel(model, (), DEVICES, module_kwargs=step)
    ref_step = {**step, "cache": expected.cache}
    if seq2seq:
        ref_step["encoder_outputs"] = (expected.encoder_last_hidden_state,)
    want = ref(**ref_step)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
    assert got.cache.get_seq_length() == length + 1
    assert_same_tree(got.cache, want.cache, where=f"{name} next cache")
    # the cache passed in was split per replica, never modified
    assert cache.get_seq_length() == length
    for a, b in zip(leaves_of(cache), keys):
        assert torch.equal(a, b)


def _greedy(model: nn.Module, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=PAD, **kw
    )


def _uneven_eos(generated: torch.Tensor, start: int, sizes: tuple[int, ...]) -> int:
    """A token that, taken as eos, makes the shards stop at different lengths (found from
    one device's greedy output without eos: each row stops at its first such token)."""
    new = generated[:, start:]
    steps = new.shape[1]
    for token in range(3, VOCAB):
        hit = new == token
        stop = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.tensor(steps))
        lengths = [int(s.max()) for s in stop.split(list(sizes))]
        if len(set(lengths)) > 1:
            return token
    raise AssertionError("no token makes the shards stop at different lengths")


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_with_uneven_lengths_pads_with_the_pad_id(name: str) -> None:
    build = _t5_varied if name == "t5" else ARCHS[name].build
    model, ref = pristine(build), pristine(build)
    ids = _ids(torch.Generator().manual_seed(2))
    start = 0 if name == "t5" else ids.shape[1]
    no_eos = _greedy(ref, ids, max_new_tokens=6, eos_token_id=None)
    eos = _uneven_eos(no_eos, start + (name == "t5"), (3, 2, 2))
    expected = _greedy(ref, ids, max_new_tokens=6, eos_token_id=eos)
    kwargs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "do_sample": False,
        "max_new_tokens": 6,
        "eos_token_id": eos,
        "pad_token_id": PAD,
    }
    # the shards stop at different lengths (cat alone would be a ShapeMismatchError)
    got = tg.data_parallel(
        model.generate, (), DEVICES, module_kwargs=kwargs, out_layout=tg.pad(0, fill=PAD)
    )
    assert torch.equal(got, expected)
    assert hook_counts(model) == hook_counts(pristine(build))


def steps(scores: list[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[Any, ...]:
    """The guide's rule for generate's scores (notebooks/transformers.ipynb): each shard's tuple holds a [rows, vocab] tensor
    per step it ran; a step a shard did not run (it stopped) is -inf for its rows."""
    longest = max(map(len, scores))
    return tuple(
        torch.cat([s[i] if i < len(s) else torch.full_like(s[0], -torch.inf) for s in scores]).to(
            device
        )
        for i in range(longest)
    )


GENERATED = tg.by_path({"sequences": tg.pad(0, fill=PAD), "scores": steps, "cache": tg.pad(0)})


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_dict_with_scores_and_cache_equals_one_device_where_each_shard_ran(
    name: str,
) -> None:
    build = _t5_varied if name == "t5" else ARCHS[name].build
    model, ref = pristine(build), pristine(build)
    ids = _ids(torch.Generator().manual_seed(2))
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "return_dict_in_generate": True}
    kwargs |= {"output_scores": True}
    no_eos = _greedy(ref, ids, eos_token_id=None, **kwargs).sequences
    start = 0 if name == "t5" else ids.shape[1]
    eos = _uneven_eos(no_eos, start + (name == "t5"), (3, 2, 2))
    expected = _greedy(ref, ids, eos_token_id=eos, **kwargs)
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "do_sample": False}
    call |= {"eos_token_id": eos, "pad_token_id": PAD, **kwargs}
    got = tg.data_parallel(model.generate, (), DEVICES, module_kwargs=call, out_layout=GENERATED)
    assert type(got) is type(expected) and list(got) == list(expected)
    assert torch.equal(got.sequences, expected.sequences)  # padded as one device pads
    ran = [int((got.scores[i] != -torch.inf).any(1).sum()) for i in range(len(got.scores))]
    assert len(got.scores) == len(expected.scores) and min(ran) < N  # a shard stopped early
    scale = max(float(b[torch.isfinite(b)].abs().max()) for b in expected.scores)
    for i, (a, b) in enumerate(zip(got.scores, expected.scores)):
        for rows_a, rows_b in zip(a.split([3, 2, 2]), b.split([3, 2, 2])):
            if torch.isinf(rows_a).all():  # this shard had stopped: its rows are -inf
                continue
            # (T5 at its large init scale: logits of ~70, shards' sums rounded differently)
            torch.testing.assert_close(rows_a, rows_b, atol=1e-4 * scale, rtol=1e-4, msg=f"{i}")
    # one cache of the batch, of one device's shape; equal to it up to where each shard stopped
    assert type(got.cache) is type(expected.cache)
    shards = [slice(0, 3), slice(3, 5), slice(5, 7)]
    missing = [sum(bool(torch.isinf(s[rows]).all()) for s in got.scores) for rows in shards]
    assert any(missing)
    pairs = [(got.cache, expected.cache, True)]
    if name == "t5":  # the cross-attention cache does not grow with the steps
        pairs = [(got.cache.self_attention_cache, expected.cache.self_attention_cache, True)]
        pairs.append((got.cache.cross_attention_cache, expected.cache.cross_attention_cache, False))
    for ours, theirs, grows in pairs:
        for a, b in zip(leaves_of(ours), leaves_of(theirs)):
            assert a.shape == b.shape
            for rows, stopped in zip(shards, missing):
                n = a.shape[-2] - (stopped if grows else 0)
                scale = float(b.abs().max())
                torch.testing.assert_close(
                    a[rows, ..., :n, :], b[rows, ..., :n, :], atol=1e-4 * scale, rtol=1e-4
                )


# ---------------------------------------------------------------------------- recipes


def test_recipe_clip_in_batch_negatives_need_the_gathered_embeddings() -> None:
    arch = ARCHS["clip"]
    model, ref = pristine(arch.build), pristine(arch.build)
    batch = batch_of(arch)
    expected = ref(**batch, return_loss=True).loss
    # each replica's loss sees only its shard's negatives: not the one-device loss
    per_shard_layout = tg.by_path(
        {"loss": tg.mean(), "logits_per_image": tg.as_list(), "logits_per_text": tg.as_list()}
    )
    per_shard = tg.data_parallel(
        model,
        (),
        DEVICES,
        module_kwargs={**batch, "return_loss": True},
        out_layout=per_shard_layout,
    )
    assert abs(per_shard.loss.item() - expected.item()) > 1e-3
    # gather the embeddings, compute the loss on the full batch: the one-device loss
    out = tg.data_parallel(model, (), DEVICES, module_kwargs=batch, out_layout=arch.layout)
    loss = _clip_loss(out, model)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=pname)


# ----------------------------------------------- token losses with padding: weights from the data

KEEP = (6, 2, 5, 3, 6, 1, 4)  # labels kept per row (the rest -100): uneven tokens per shard


def _padded(labels: torch.Tensor) -> torch.Tensor:
    labels = labels.clone()
    for row, keep in enumerate(KEEP):
        labels[row, keep:] = -100
    return labels


def labelled(labels: torch.Tensor, **_: Any) -> torch.Tensor:
    """What a token loss averages over: the labels that are not -100."""
    return (labels != -100).sum()


def shifted(labels: torch.Tensor, **_: Any) -> torch.Tensor:
    """A causal LM's: it predicts token t + 1 from token t, so the first label is never used."""
    return (labels[:, 1:] != -100).sum()


def _causal(g: torch.Generator) -> dict[str, Any]:
    ids = _ids(g)
    return {"input_ids": ids, "labels": _padded(ids)}


def _labels(g: torch.Generator, high: int = VOCAB, low: int = 3) -> torch.Tensor:
    return _padded(torch.randint(low, high, (N, 6), generator=g))


PADDED: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Any], Any]] = {
    "t5": (_t5, lambda g: {"input_ids": _ids(g), "labels": _labels(g)}, labelled),
    "bart": (_bart, lambda g: {"input_ids": _ids(g), "labels": _labels(g)}, labelled),
    "whisper": (
        _whisper,
        lambda g: {"input_features": torch.randn(N, 8, 32, generator=g), "labels": _labels(g)},
        labelled,
    ),
    "bert_tokens": (
        _bert_tokens,
        lambda g: {"input_ids": _ids(g), "labels": _labels(g, 5, 0)},
        labelled,
    ),
    "gpt2": (_gpt2, _causal, shifted),
    "llama": (_llama, _causal, shifted),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_token_losses_with_padding_weighted_by_the_data_equal_one_device_cold(name: str) -> None:
    build, batch_of, count = PADDED[name]
    ref = pristine(build)
    batch = batch_of(torch.Generator().manual_seed(3))
    expected = ref(**batch).loss
    expected.backward()
    layout = tg.by_path({"loss": tg.mean(weight=count)})
    for k, entry in ((2, "DataParallel"), (3, "data_parallel")):
        model = pristine(build)  # cold: the copy's first call goes through treegather
        devices = ["cpu"] * k
        if entry == "data_parallel":
            out = tg.data_parallel(model, (), devices, module_kwargs=batch, out_layout=layout)
        else:
            out = tg.DataParallel(model, device_ids=devices, out_layout=layout)(**batch)
        torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=0, msg=f"{name} on {k}")
        out.loss.backward()
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), pname
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0, msg=pname)
    with torch.no_grad():  # what the guide's loss paragraph says instead
        three = pristine(build)
        if name == "t5":
            rows = tg.by_path({"loss": tg.mean()})
            by_rows = tg.data_parallel(three, (), DEVICES, module_kwargs=batch, out_layout=rows)
            assert abs(by_rows.loss.item() - expected.item()) > 1e-2  # rows are not tokens
        if count is labelled:  # num_items_in_batch: accepted, ignored, so sum() is 3x the loss
            ignored = {**batch, "num_items_in_batch": int(count(**batch))}
            summed = tg.by_path({"loss": tg.sum()})
            out = tg.data_parallel(three, (), DEVICES, module_kwargs=ignored, out_layout=summed)
            torch.testing.assert_close(out.loss, 3 * expected.detach(), rtol=0.05, atol=0)


def test_recipe_ctc_sum_reduction_takes_sum_not_mean() -> None:
    arch = ARCHS["wav2vec2"]
    model, ref = pristine(arch.build), pristine(arch.build)
    batch = batch_of(arch)
    expected = ref(**batch).loss
    total = tg.data_parallel(model, (), DEVICES, module_kwargs=batch, out_layout=arch.layout)
    torch.testing.assert_close(total.loss, expected)
    mean = tg.data_parallel(
        model, (), DEVICES, module_kwargs=batch, out_layout=tg.by_path({"loss": tg.mean()})
    )
    assert abs(mean.loss.item() - expected.item()) > 1e-3


def test_recipe_sampling_draws_differ_from_one_device_but_repeat_with_a_seed() -> None:
    arch = ARCHS["llama"]
    model, ref = pristine(arch.build), pristine(arch.build)
    ids = _ids(torch.Generator().manual_seed(4))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "do_sample": True}
    kwargs |= {"max_new_tokens": 5, "eos_token_id": None, "pad_token_id": PAD}
    torch.manual_seed(0)
    one = ref.generate(**kwargs)

    def sampled() -> torch.Tensor:
        torch.manual_seed(0)
        return tg.data_parallel(model.generate, (), DEVICES, module_kwargs=kwargs, backend="serial")

    first, again = sampled(), sampled()
    assert first.shape == one.shape and not torch.equal(first, one)  # other draws per shard
    assert torch.equal(first, again)  # the serial backend draws in shard order: reproducible


# ------------------------------------------------- mixture of experts: no weighting is exact


def _mixtral() -> nn.Module:
    config = T.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        output_router_logits=True,  # (router_aux_loss_coef: the default, 0.001)
        **TOKENS,
        **EAGER,
    )
    return T.MixtralForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    config = T.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        output_router_logits=True,
        **TOKENS,
        **EAGER,
    )
    return T.Qwen2MoeForCausalLM(config)


MOE = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe}


def _moe_batch() -> dict[str, torch.Tensor]:
    """7 rows, two of them padded (attention mask 0, label -100), two more with fewer labels."""
    ids = _ids(torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[[1, 4], 4:] = 0
    labels = _padded(ids).masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def moe_loss(model: nn.Module, out: Any, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The guide's recipe: the model's own loss on the gathered logits and router logits."""
    lb = sys.modules[type(model).__module__].load_balancing_loss_func  # (Mixtral's = Qwen2-MoE's)
    aux = lb(out.router_logits, model.num_experts, model.num_experts_per_tok, mask)
    lm = model.loss_function(out.logits, labels, model.config.vocab_size)
    return lm + model.router_aux_loss_coef * aux


def _worst(model: nn.Module, ref: nn.Module, only: str = "") -> float:
    """The largest gradient difference, relative to the largest entry of each gradient."""
    grads = dict(ref.named_parameters())
    return max(
        float((p.grad - grads[n].grad).abs().max() / grads[n].grad.abs().max())
        for n, p in model.named_parameters()
        if only in n
    )


@pytest.mark.parametrize("name", list(MOE))
def test_recipe_moe_loss_from_the_gathered_router_logits_equals_one_device(name: str) -> None:
    build = MOE[name]
    ref = pristine(build)
    batch = _moe_batch()
    expected = ref(**batch)
    expected.loss.backward()

    # the token-weighted recipe: its cross-entropy is exact, its load-balancing term is not
    # (a product of two batch means), and aux_loss is one value per shard
    weighted = pristine(build)
    layout = tg.by_path({"loss": tg.mean(weight=shifted)})
    old = tg.data_parallel(weighted, (), DEVICES, module_kwargs=batch, out_layout=layout)
    assert old.aux_loss.shape == (3,)
    old.loss.backward()
    assert _worst(weighted, ref, "mlp.gate.weight") > 1e-3  # the router's gate, off

    # gathered logits and router logits (no labels: no loss per shard), the loss on the batch
    model = pristine(build)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    out = tg.data_parallel(model, (), DEVICES, module_kwargs=inputs)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (N * 6, 4)
    loss = moe_loss(model, out, batch["labels"], batch["attention_mask"])
    torch.testing.assert_close(loss, expected.loss, rtol=1e-6, atol=0)
    loss.backward()
    for pname, p in model.named_parameters():
        q = dict(ref.named_parameters())[pname].grad
        assert p.grad is not None and q is not None, pname
        torch.testing.assert_close(p.grad, q, rtol=1e-6, atol=1e-6 * float(q.abs().max()))
    assert _worst(model, ref) < 1e-5 < _worst(weighted, ref)


# ------------------------------------------------------------------------ caches as nodes


def _mistral_cache(rows: int = N) -> tuple[nn.Module, Any, torch.Tensor]:
    model = pristine(_mistral)
    ids = _ids(torch.Generator().manual_seed(5), rows, 8)
    with torch.no_grad():
        out = model(input_ids=ids)
    return model, out.cache, ids


def test_a_dynamic_cache_is_split_per_replica_and_never_modified() -> None:
    model, cache, _ = _mistral_cache()
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer"] * 2
    before = [t.clone() for t in leaves_of(cache)]
    shards = tg.scatter({"cache": cache}, DEVICES)
    assert [s["cache"].layers[0].keys.shape[0] for s in shards] == [3, 2, 2]
    assert all(type(s["cache"]) is type(cache) and s["cache"] is not cache for s in shards)
    assert shards[1]["cache"].get_seq_length() == cache.get_seq_length() == 8
    nxt = torch.randint(3, VOCAB, (N, 1), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = tg.data_parallel(model, (), DEVICES, module_kwargs={"input_ids": nxt, "cache": cache})
        want = pristine(_mistral)(input_ids=nxt, cache=copy.deepcopy(cache))
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
    assert cache.get_seq_length() == 8  # was 11 when the replicas advanced the caller's cache
    for a, b in zip(leaves_of(cache), before):
        assert torch.equal(a, b)
    assert got.cache.get_seq_length() == 9
    # the rebuilt cache is a working cache: the layers' metadata kept, the device rebuilt
    layer = shards[2]["cache"].layers[1]
    assert layer.sliding_window == 5 and layer.cumulative_length == 8
    assert layer.device == torch.device("cpu") and int(layer._sliding_window_tensor) == 5


def test_caches_that_cannot_be_split_are_refused_with_the_reason() -> None:
    cu = transformers.cache_utils
    static = cu.StaticCache(config=pristine(_llama).config, max_cache_len=16)
    batch = {"ids": torch.zeros(4, 2), "cache": static}
    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter(batch, DEVICES)
    msg = str(info.value)
    assert msg.startswith("inputs['cache'].layers: a StaticCache treegather cannot split")
    assert "writes in place" in msg and "broadcast()" in msg
    # broadcast() is the user's choice: every shard gets the one cache
    shards = tg.scatter(batch, DEVICES, tg.by_path({"cache": tg.broadcast()}))
    assert all(s["cache"] is static for s in shards)
    # gathered: the replicas' caches, as a list (as for any leaf gather cannot combine)
    assert tg.gather([{"c": static}, {"c": static}], "cpu") == {"c": [static, static]}
    # a DynamicCache holding another kind of layer stays whole too, saying which
    mixed = cu.DynamicCache()
    mixed.layers = [cu.DynamicLayer(), cu.LinearAttentionLayer()]  # a hybrid model's cache
    with pytest.raises(tg.LeafTypeError, match=r"its layer 1 is a LinearAttentionLayer"):
        tg.scatter({"ids": torch.zeros(4, 2), "cache": mixed}, DEVICES)
    explained = tg.explain({"ids": torch.zeros(4, 2), "cache": mixed}, None, DEVICES)
    assert "its layer 1 is a LinearAttentionLayer" in (
        explained["inputs['cache'].layers"].problem or ""
    )


def _mamba() -> nn.Module:
    config = T.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=3,
        **TOKENS,
    )
    return T.MambaForCausalLM(config)


def test_a_recurrent_cache_is_gathered_as_the_list_of_the_replicas_caches() -> None:
    """Mamba's cache (LinearAttentionLayer states) cannot be split or joined by rows: gathered,
    it is the replicas' caches, each of its shard's rows; fed back, scatter refuses it."""
    model, ref = pristine(_mamba), pristine(_mamba)
    ids = _ids(torch.Generator().manual_seed(9), N, 5)
    with torch.no_grad():
        out = tg.data_parallel(model, (), DEVICES, module_kwargs={"input_ids": ids})
        one = ref(input_ids=ids)
    torch.testing.assert_close(out.logits, one.logits, atol=2e-5, rtol=1e-4)
    assert type(out.cache) is list and len(out.cache) == 3
    assert all(type(c) is type(one.cache) for c in out.cache)
    for cache, rows in zip(out.cache, (slice(0, 3), slice(3, 5), slice(5, 7))):
        for mine, whole in zip(cache.layers, one.cache.layers, strict=True):
            for states in ("conv_states", "recurrent_states"):
                got, want = getattr(mine, states)[0], getattr(whole, states)[0][rows]
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    step = {"input_ids": ids[:, :1], "cache": out.cache}
    with pytest.raises(tg.LeafTypeError, match=r"kwargs\['cache'\]\[0\]\.layers: a DynamicCache"):
        tg.data_parallel(model, (), DEVICES, module_kwargs=step)


def test_an_encoder_decoder_cache_round_trips_and_a_user_registration_wins() -> None:
    model = pristine(_t5)
    ids = _ids(torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=ids[:, :3])
    cache = out.cache
    shards = tg.scatter(cache, DEVICES)
    assert [s.cross_attention_cache.layers[0].keys.shape[0] for s in shards] == [3, 2, 2]
    assert shards[0].is_updated == cache.is_updated
    back = tg.gather(list(shards), "cpu", sizes=shards.sizes)
    assert type(back) is type(cache) and back.is_updated == cache.is_updated
    assert_same_tree(back, cache)
    # an explicit registration replaces treegather's own, as it does a torch-pytree bridge
    cls = transformers.cache_utils.EncoderDecoderCache
    try:
        tg.register_node(cls, lambda c: ((), None), lambda aux, ch: "mine")
        assert tg.gather([cache, cache], "cpu") == "mine"
    finally:
        from treegather import _transformers
        from treegather._tree import registry

        registry.unregister(cls)
        _transformers.register_caches(transformers.cache_utils)
    assert type(tg.gather([cache, cache], "cpu", sizes=(N, N))) is cls


_USE = """
from transformers import DynamicCache, MistralConfig
import transformers.modeling_outputs  # what importing any model does: outputs registered
config = MistralConfig(num_hidden_layers=1, sliding_window=5)
cache = DynamicCache(config=config)
cache.update(torch.ones(4, 2, 3, 8), torch.ones(4, 2, 3, 8), 0)
shards = tg.scatter({"cache": cache}, ["cpu"] * 2)
assert type(shards[0]["cache"]) is DynamicCache, shards
assert shards[0]["cache"].layers[0].keys.shape == (2, 2, 3, 8)
back = tg.gather([s["cache"] for s in shards], "cpu")
assert type(back) is DynamicCache and back.layers[0].keys.shape == (4, 2, 3, 8)
layer = back.layers[0]
print(type(layer).__name__, back.get_seq_length(), layer._sliding_window_tensor.tolist())
print(tg.explain(cache, None, ["cpu"] * 2)[0].path)
"""

_LATER = """
import sys, torch
import treegather as tg
tg.gather([{"x": torch.zeros(2)}] * 2, "cpu")
assert "transformers" not in sys.modules, "treegather imported transformers"
"""

_EXPORTED = """
import sys, torch
from transformers import DynamicCache
from transformers.exporters.exporter_dynamo import register_pytree_node
register_pytree_node(DynamicCache)  # as transformers' torch.export path does, before treegather
import treegather as tg
"""


def run_import_orders(out: Path) -> dict[str, tuple[int, str, str]]:
    """Both import orders below, each in a fresh interpreter, started side by side (their
    imports of torch and transformers overlap): ``(returncode, stdout, stderr)`` per order."""
    procs = {}
    for order, code in (("later", _LATER), ("exported", _EXPORTED)):
        with (out / f"{order}.out").open("w") as o, (out / f"{order}.err").open("w") as e:
            procs[order] = subprocess.Popen(
                [sys.executable, "-c", code + _USE],
                cwd=ROOT,
                stdout=o,
                stderr=e,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
    deadline = time.monotonic() + 120
    for proc in procs.values():
        while proc.poll() is None and time.monotonic() < deadline:
            if spawned_groups.STOP.is_set():
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    return {
        order: (
            proc.returncode,
            (out / f"{order}.out").read_text(),
            (out / f"{order}.err").read_text(),
        )
        for order, proc in procs.items()
    }


def background_job(item: pytest.Item) -> Any:
    """The two fresh interpreters of ``import_orders``, as a job started at collection."""
    if "import_orders" not in getattr(item, "fixturenames", ()):
        return None
    return ("import_orders",), lambda: functools.partial(
        run_import_orders, spawned_groups.scratch("import_orders")
    )


@pytest.fixture(scope="module")
def import_orders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    job = spawned_groups.started(("import_orders",))
    if job is not None:
        return job.result()  # type: ignore[no-any-return]
    return run_import_orders(tmp_path_factory.mktemp("import_orders"))


@pytest.mark.parametrize("order", ["later", "exported"])
def test_caches_are_nodes_only_once_transformers_is_in_use(
    order: str, import_orders: dict[str, tuple[int, str, str]]
) -> None:
    # later: treegather used without transformers never imports it; imported afterwards, its
    # caches become nodes. exported: transformers first, its caches already registered with
    # torch's pytree (generic flattening): treegather's own registration is the one used.
    returncode, stdout, stderr = import_orders[order]
    assert returncode == 0, stderr[-3000:]
    # one working cache: the window a number (not one per replica), paths by name
    assert stdout.split() == [
        "DynamicSlidingWindowLayer",
        "3",
        "5",
        "inputs.layers[0]['keys']",
    ]


def test_caches_scatter_and_gather_alike_on_the_compiled_and_reference_paths() -> None:
    from treegather._caches import reference_only
    from treegather._compiled.structure import find

    _, cache, _ = _mistral_cache()
    tree = {"cache": cache, "ids": torch.arange(N)}

    def shapes(shards: Any) -> list[Any]:
        return [
            (
                type(s["cache"]).__name__,
                [tuple(t.shape) for t in leaves_of(s)],
            )
            for s in shards
        ]

    with reference_only():
        want = tg.scatter(tree, DEVICES)
        back_want = tg.gather(list(want), "cpu", sizes=want.sizes)
    for _ in range(5):  # cold, seen, then compiled
        got = tg.scatter(tree, DEVICES)
        assert shapes(got) == shapes(want)
        back = tg.gather(list(got), "cpu", sizes=got.sizes)
        assert_same_tree(back, back_want)
        assert_same_tree(back["cache"], cache)
    assert (
        find(tree) is not None
    )  # the cache's structure is recognised: its metadata keys are stable
