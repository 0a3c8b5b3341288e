"""Tiny random HuggingFace models (2 layers, hidden 32) of each family fxforge captures, and their inputs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

VOCAB = 100
CAUSAL_LMS = ("gpt2", "llama", "qwen2", "opt")
INPUT_NAMES: dict[str, list[str]] = {
    **{name: ["input_ids", "attention_mask", "labels"] for name in CAUSAL_LMS},
    "t5": ["input_ids", "attention_mask", "decoder_input_ids", "labels"],
    "vit": ["pixel_values", "labels"],
    "resnet": ["pixel_values", "labels"],
}


def tiny_hf(family: str, seed: int = 0, **overrides: object) -> nn.Module:
    """A freshly initialised tiny model of ``family`` in eval mode (``overrides`` change its config)."""
    import transformers as T

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "max_position_embeddings": 64}
    decoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, **common}
    configs = {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                       n_positions=64, bos_token_id=0, eos_token_id=0,
                                                       **overrides)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**{**decoder, **overrides})),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**{**decoder, **overrides})),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=4, word_embed_proj_dim=32, **common,
                                                    **overrides)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                                                              vocab_size=VOCAB, decoder_start_token_id=0,
                                                              **overrides)),
        "vit": lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               image_size=32, patch_size=8, num_labels=3,
                                                               **overrides)),
        "resnet": lambda: T.ResNetForImageClassification(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32],
                                                                        depths=[1, 1], num_labels=3,
                                                                        **overrides)),
    }
    return configs[family]().eval()


def hf_inputs(family: str, batch: int, seq: int, left_pad: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for ``family`` whose sizes differ from the capture's dummy inputs; text has one padded sample
    (padded on the left with ``left_pad``), images are ``seq`` x ``seq`` pixels."""
    gen = torch.Generator().manual_seed(seed)
    if family in ("vit", "resnet"):
        return {"pixel_values": torch.randn(batch, 3, seq, seq, generator=gen),
                "labels": torch.randint(0, 3, (batch,), generator=gen)}
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if left_pad:
        mask[-1, : seq // 2] = 0
    else:
        mask[-1, seq // 2:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if family == "t5":
        dec = torch.randint(1, VOCAB, (batch, max(seq // 2, 1)), generator=gen)
        return {**out, "decoder_input_ids": dec, "labels": dec.clone()}
    return {**out, "labels": ids.masked_fill(mask == 0, -100)}
