"""The tiny transformers models of the step benchmark: those of the conformance tests.

One entry of :data:`ARCHITECTURES` per architecture of ``tests/test_transformers.py``, built
from the same tiny, seeded configs (2 layers, hidden size 32, 4 heads, a 64-token vocabulary;
no download) with a batch of ``rows`` samples and the output layout the tests gather it with.
Adding an architecture is one entry here (its builder, its batch, its layout if the loss is
not a ``mean``). Needs ``transformers`` (:func:`available` says whether it imports).

>>> from treegather.benchmarks.architectures import ARCHITECTURES
>>> "bert" in ARCHITECTURES and "clip" in ARCHITECTURES
True
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import treegather as tg

__all__ = ["ARCHITECTURES", "Architecture", "available"]

VOCAB = 64
PAD = 0
SEQ = 16
EAGER = {"attn_implementation": "eager"}
TOKENS = {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}


def available() -> bool:
    """Whether ``transformers`` can be imported (the architectures need it)."""
    return importlib.util.find_spec("transformers") is not None


def _t() -> Any:
    import transformers

    return transformers


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How to build one model, a batch of ``rows`` samples for it, and gather its output."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], dict[str, Any]]
    reduce: str = "mean"
    """How the per-shard losses combine: ``"mean"`` (weighted by rows) or ``"sum"``."""
    per_shard: tuple[str, ...] = ()
    """Outputs kept per shard (``as_list()``): per-shard by nature, as CLIP's similarities."""

    def out_layout(self) -> Any:
        """The layout ``data_parallel`` gathers the output with (the loss by :attr:`reduce`)."""
        rules: dict[str, Any] = {"loss": tg.sum() if self.reduce == "sum" else tg.mean()}
        rules.update(dict.fromkeys(self.per_shard, tg.as_list()))
        return tg.by_path(rules)


def _ids(g: torch.Generator, rows: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=g)


def _bert() -> nn.Module:
    t = _t()
    config = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        pad_token_id=PAD,
        **EAGER,
    )
    return t.BertForSequenceClassification(config)


def _gpt2() -> nn.Module:
    t = _t()
    config = t.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, **TOKENS, **EAGER
    )
    return t.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    t = _t()
    config = t.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **TOKENS,
        **EAGER,
    )
    return t.LlamaForCausalLM(config)


def _t5(**extra: Any) -> nn.Module:
    t = _t()
    config = t.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=PAD,
        pad_token_id=PAD,
        eos_token_id=2,
        **EAGER,
        **extra,
    )
    return t.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    t = _t()
    config = t.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        **TOKENS,
        **EAGER,
    )
    return t.BartForConditionalGeneration(config)


def _vit() -> nn.Module:
    t = _t()
    config = t.ViTConfig(
        image_size=16,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=3,
        **EAGER,
    )
    return t.ViTForImageClassification(config)


def _wav2vec2() -> nn.Module:
    t = _t()
    config = t.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(4, 4),
        conv_kernel=(8, 8),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        pad_token_id=PAD,
        **EAGER,
    )
    return t.Wav2Vec2ForCTC(config)


def _clip() -> nn.Module:
    t = _t()
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        **TOKENS,
    )
    vision = dict(
        image_size=16,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    config = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, **EAGER)
    return t.CLIPModel(config)


def _causal(use_cache: bool) -> Callable[[torch.Generator, int], dict[str, Any]]:
    def batch(g: torch.Generator, rows: int) -> dict[str, Any]:
        ids = _ids(g, rows)
        return {"input_ids": ids, "labels": ids, "use_cache": use_cache}

    return batch


def _classes(g: torch.Generator, rows: int) -> dict[str, Any]:
    return {"input_ids": _ids(g, rows), "labels": torch.randint(0, 3, (rows,), generator=g)}


def _seq2seq(g: torch.Generator, rows: int) -> dict[str, Any]:
    return {"input_ids": _ids(g, rows), "labels": torch.randint(3, VOCAB, (rows, 4), generator=g)}


def _images(g: torch.Generator, rows: int) -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 3, (rows,), generator=g),
    }


def _audio(g: torch.Generator, rows: int) -> dict[str, Any]:
    return {
        "input_values": torch.randn(rows, 400, generator=g),
        "labels": torch.randint(1, 16, (rows, 3), generator=g),
    }


def _text_and_images(g: torch.Generator, rows: int) -> dict[str, Any]:
    return {
        "input_ids": _ids(g, rows),
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
        "return_loss": True,  # each shard's contrastive loss (in-batch negatives per shard)
    }


ARCHITECTURES: dict[str, Architecture] = {
    "bert": Architecture(_bert, _classes),
    "gpt2": Architecture(_gpt2, _causal(False)),
    "gpt2_cache": Architecture(_gpt2, _causal(True)),
    "llama": Architecture(_llama, _causal(False)),
    "t5": Architecture(_t5, _seq2seq),
    "vit": Architecture(_vit, _images),
    # CTC's default reduction is "sum": per-shard sums add up
    "wav2vec2": Architecture(_wav2vec2, _audio, reduce="sum"),
    # in-batch negatives per shard: the similarity matrices are kept per replica
    "clip": Architecture(
        _clip, _text_and_images, per_shard=("logits_per_image", "logits_per_text")
    ),
    "bart": Architecture(_bart, _seq2seq),
}
