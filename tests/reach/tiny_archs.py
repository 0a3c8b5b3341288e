"""Tiny random models of many transformers architectures (from its auto mappings) and their inputs at two shapes.

Each model is built offline from a small config (hidden 32, 2 layers, vocabulary 99) with its training-only
defaults as transformers ships them (drop_path_rate, layerdrop, SpecAugment masking; drop_path_rate is raised to
0.1 where it defaults to 0: DINOv2, ConvNeXt, PoolFormer), so a capture that bakes a training branch into the eval
graph, or cannot trace it, shows up here. ``ARCHS`` maps an architecture's
name to how it is built and fed; ``REPRESENTATIVE`` are the ones ``make test`` runs (one of each kind).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

VOCAB = 99
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 37, "max_position_embeddings": 64}
DECODER = {**TEXT, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# grouped_mm needs 16-byte aligned strides: expert widths are multiples of 4 floats
MOE = {**DECODER, "intermediate_size": 32, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16}
SEQ2SEQ = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 37, "decoder_ffn_dim": 37, "max_position_embeddings": 64,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}
T5 = {"vocab_size": VOCAB, "d_model": 32, "d_ff": 37, "d_kv": 8, "num_layers": 2, "num_heads": 4,
      "decoder_start_token_id": 0}
VIT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
       "image_size": 32, "patch_size": 8, "num_labels": 3}
SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4,
        "num_labels": 3}
STAGES = {"hidden_sizes": [16, 32], "depths": [1, 1], "num_labels": 3}
AUDIO = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
         "conv_dim": [16, 16], "conv_stride": [5, 4], "conv_kernel": [10, 8], "num_conv_pos_embeddings": 16,
         "num_conv_pos_embedding_groups": 2, "vocab_size": 12}
CLIP = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}


@dataclass(frozen=True)
class Arch:
    """How to build one architecture: transformers model and config classes, config kwargs, and its input kind
    (text, seq2seq, image, image_fixed (a fixed side), audio, features (a fixed-length spectrogram))."""

    model: str
    config: str
    kwargs: dict[str, Any]
    kind: str
    side: int = 32  # image side (image_fixed) or spectrogram length (features)
    extra: dict[str, Any] = field(default_factory=dict)  # per-input settings, e.g. {"mel": 16}


def _a(model: str, config: str, kind: str, base: dict[str, Any], **kw: Any) -> Arch:
    return Arch(model, config, {**base, **kw}, kind)


ARCHS: dict[str, Arch] = {
    # encoders
    "bert": _a("BertForSequenceClassification", "BertConfig", "text", TEXT),
    "roberta": _a("RobertaForMaskedLM", "RobertaConfig", "text", TEXT, pad_token_id=1),
    "xlm_roberta": _a("XLMRobertaForSequenceClassification", "XLMRobertaConfig", "text", TEXT, pad_token_id=1),
    "distilbert": _a("DistilBertForSequenceClassification", "DistilBertConfig", "text", {}, vocab_size=VOCAB, dim=32,
                     n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64),
    "albert": _a("AlbertForMaskedLM", "AlbertConfig", "text", TEXT, embedding_size=16),
    "electra": _a("ElectraForSequenceClassification", "ElectraConfig", "text", TEXT, embedding_size=16),
    "deberta": _a("DebertaForMaskedLM", "DebertaConfig", "text", TEXT),
    "deberta_v2": _a("DebertaV2ForSequenceClassification", "DebertaV2Config", "text", TEXT),
    "mpnet": _a("MPNetForMaskedLM", "MPNetConfig", "text", TEXT),
    "funnel": _a("FunnelForSequenceClassification", "FunnelConfig", "text", {}, vocab_size=VOCAB, block_sizes=[1, 1],
                 d_model=32, n_head=4, d_head=8, d_inner=37),
    "convbert": _a("ConvBertForSequenceClassification", "ConvBertConfig", "text", TEXT, embedding_size=32),
    "mobilebert": _a("MobileBertForSequenceClassification", "MobileBertConfig", "text", TEXT, embedding_size=16,
                     intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
    "ernie": _a("ErnieForMaskedLM", "ErnieConfig", "text", TEXT),
    "roformer": _a("RoFormerForMaskedLM", "RoFormerConfig", "text", TEXT, embedding_size=32),
    "megatron_bert": _a("MegatronBertForMaskedLM", "MegatronBertConfig", "text", TEXT),
    "modernbert": _a("ModernBertForMaskedLM", "ModernBertConfig", "text", TEXT, global_attn_every_n_layers=2,
                     local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    "squeezebert": _a("SqueezeBertForSequenceClassification", "SqueezeBertConfig", "text", TEXT, embedding_size=32,
                      intermediate_size=40,
                      q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2,
                      output_groups=2),
    # decoders
    "gpt2": _a("GPT2LMHeadModel", "GPT2Config", "text", {}, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
               n_positions=64, bos_token_id=1, eos_token_id=2),
    "gpt_neo": _a("GPTNeoForCausalLM", "GPTNeoConfig", "text", {}, vocab_size=VOCAB, hidden_size=32, num_layers=2,
                  num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64),
    "gptj": _a("GPTJForCausalLM", "GPTJConfig", "text", {}, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
               rotary_dim=4, n_positions=64),
    "gpt_neox": _a("GPTNeoXForCausalLM", "GPTNeoXConfig", "text", TEXT),
    "gpt_bigcode": _a("GPTBigCodeForCausalLM", "GPTBigCodeConfig", "text", {}, vocab_size=VOCAB, n_embd=32, n_layer=2,
                      n_head=4, n_positions=64),
    "codegen": _a("CodeGenForCausalLM", "CodeGenConfig", "text", {}, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                  rotary_dim=4, n_positions=64, n_ctx=64),
    "opt": _a("OPTForCausalLM", "OPTConfig", "text", {}, vocab_size=VOCAB, hidden_size=32, ffn_dim=37,
              num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64),
    "llama": _a("LlamaForCausalLM", "LlamaConfig", "text", DECODER),
    "mistral": _a("MistralForCausalLM", "MistralConfig", "text", DECODER),
    "qwen2": _a("Qwen2ForCausalLM", "Qwen2Config", "text", DECODER),
    "qwen3": _a("Qwen3ForCausalLM", "Qwen3Config", "text", DECODER, head_dim=8),
    "phi": _a("PhiForCausalLM", "PhiConfig", "text", DECODER),
    "phi3": _a("Phi3ForCausalLM", "Phi3Config", "text", DECODER),
    "gemma": _a("GemmaForCausalLM", "GemmaConfig", "text", DECODER, head_dim=8),
    "gemma2": _a("Gemma2ForCausalLM", "Gemma2Config", "text", DECODER, head_dim=8, sliding_window=8),
    "falcon": _a("FalconForCausalLM", "FalconConfig", "text", {}, vocab_size=VOCAB, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4),
    "bloom": _a("BloomForCausalLM", "BloomConfig", "text", {}, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    "stablelm": _a("StableLmForCausalLM", "StableLmConfig", "text", DECODER),
    "olmo": _a("OlmoForCausalLM", "OlmoConfig", "text", DECODER),
    "starcoder2": _a("Starcoder2ForCausalLM", "Starcoder2Config", "text", DECODER),
    "granite": _a("GraniteForCausalLM", "GraniteConfig", "text", DECODER),
    "biogpt": _a("BioGptForCausalLM", "BioGptConfig", "text", TEXT),
    "xglm": _a("XGLMForCausalLM", "XGLMConfig", "text", {}, vocab_size=VOCAB, d_model=32, num_layers=2,
               attention_heads=4, ffn_dim=37, max_position_embeddings=64),
    # mixture of experts
    "mixtral": _a("MixtralForCausalLM", "MixtralConfig", "text", MOE),
    "qwen3_moe": _a("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "text", MOE, head_dim=8),
    "qwen2_moe": _a("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "text", MOE, shared_expert_intermediate_size=16),
    "olmoe": _a("OlmoeForCausalLM", "OlmoeConfig", "text", MOE),
    # encoder-decoders
    "t5": _a("T5ForConditionalGeneration", "T5Config", "seq2seq", T5),
    "mt5": _a("MT5ForConditionalGeneration", "MT5Config", "seq2seq", T5),
    "bart": _a("BartForConditionalGeneration", "BartConfig", "seq2seq", SEQ2SEQ),
    "mbart": _a("MBartForConditionalGeneration", "MBartConfig", "seq2seq", SEQ2SEQ),
    "marian": _a("MarianMTModel", "MarianConfig", "seq2seq", SEQ2SEQ, decoder_start_token_id=0),
    "pegasus": _a("PegasusForConditionalGeneration", "PegasusConfig", "seq2seq", SEQ2SEQ),
    "blenderbot": _a("BlenderbotForConditionalGeneration", "BlenderbotConfig", "seq2seq", SEQ2SEQ),
    "m2m_100": _a("M2M100ForConditionalGeneration", "M2M100Config", "seq2seq", SEQ2SEQ),
    "plbart": _a("PLBartForConditionalGeneration", "PLBartConfig", "seq2seq", SEQ2SEQ),
    # vision
    "vit": _a("ViTForImageClassification", "ViTConfig", "image_fixed", VIT),
    "deit": _a("DeiTForImageClassification", "DeiTConfig", "image_fixed", VIT),
    "beit": _a("BeitForImageClassification", "BeitConfig", "image_fixed", VIT, drop_path_rate=0.1),
    "data2vec_vision": _a("Data2VecVisionForImageClassification", "Data2VecVisionConfig", "image_fixed", VIT,
                          drop_path_rate=0.1),
    "dinov2": _a("Dinov2ForImageClassification", "Dinov2Config", "image_fixed", VIT, drop_path_rate=0.1),
    "swin": _a("SwinForImageClassification", "SwinConfig", "image_fixed", SWIN),
    "convnext": _a("ConvNextForImageClassification", "ConvNextConfig", "image", STAGES, num_stages=2,
                     drop_path_rate=0.1),
    "resnet": _a("ResNetForImageClassification", "ResNetConfig", "image", STAGES, embedding_size=16),
    "regnet": _a("RegNetForImageClassification", "RegNetConfig", "image", STAGES, embedding_size=16, groups_width=8),
    "mobilenet_v2": _a("MobileNetV2ForImageClassification", "MobileNetV2Config", "image", {}, depth_multiplier=0.35,
                       image_size=32, num_labels=3),
    "efficientnet": _a("EfficientNetForImageClassification", "EfficientNetConfig", "image_fixed", {}, image_size=32,
                       width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=3),
    "poolformer": _a("PoolFormerForImageClassification", "PoolFormerConfig", "image", {}, hidden_sizes=[16, 32],
                     depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
                     num_labels=3, drop_path_rate=0.1),
    "segformer": _a("SegformerForImageClassification", "SegformerConfig", "image", {}, num_encoder_blocks=2,
                    depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                    num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3),
    # audio
    "wav2vec2": _a("Wav2Vec2ForCTC", "Wav2Vec2Config", "audio", AUDIO),
    "hubert": _a("HubertForCTC", "HubertConfig", "audio", AUDIO),
    "wavlm": _a("WavLMForCTC", "WavLMConfig", "audio", AUDIO, num_buckets=16, max_bucket_distance=32),
    "data2vec_audio": _a("Data2VecAudioForCTC", "Data2VecAudioConfig", "audio", AUDIO),
    "whisper": _a("WhisperForAudioClassification", "WhisperConfig", "features", {}, vocab_size=VOCAB, d_model=32,
                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=16, max_source_positions=32, num_labels=3,
                  pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2),
    # CLIP / SigLIP towers
    "clip_vision": _a("CLIPVisionModel", "CLIPVisionConfig", "image_fixed", CLIP, image_size=32, patch_size=8),
    "clip_text": _a("CLIPTextModel", "CLIPTextConfig", "text", CLIP, vocab_size=VOCAB, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "siglip_vision": _a("SiglipVisionModel", "SiglipVisionConfig", "image_fixed", CLIP, image_size=32, patch_size=8),
    "siglip_text": _a("SiglipTextModel", "SiglipTextConfig", "text", CLIP, vocab_size=VOCAB, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
# Whisper's encoder takes exactly 2 * max_source_positions frames.
ARCHS["whisper"] = Arch(**{**ARCHS["whisper"].__dict__, "side": 64, "extra": {"mel": 16}})

# One of each kind: what `make test` runs (the rest are marked `reach`, run by `make test-reach`).
REPRESENTATIVE = ("bert", "llama", "mixtral", "t5", "vit", "beit", "resnet", "mobilenet_v2", "wav2vec2",
                  "siglip_vision", "convnext", "gpt2")
SECOND_FILE = REPRESENTATIVE[1::2]  # run from test_reach_second.py: the halves go to both xdist workers

CAPTURE_SHAPE = (2, 16)  # (batch, length) for text; images capture at batch 2, side 32
# Two (batch, length) shapes other than the capture's; the last row of every batch is padded.
TEXT_SHAPES = ((3, 11), (1, 7))
IMAGE_SIDES = ((3, 40), (1, 24))  # convolutional models take any side
AUDIO_LENGTHS = ((3, 800), (1, 560))


def build(name: str, seed: int = 0) -> nn.Module:
    """A freshly initialised tiny ``name`` model in eval mode."""
    import transformers as T

    arch = ARCHS[name]
    torch.manual_seed(seed)
    config = getattr(T, arch.config)(**arch.kwargs)
    return getattr(T, arch.model)(config).eval()


def inputs(name: str, batch: int, size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for ``name``: text of ``size`` tokens (last row half padded), images ``size`` pixels a side (fixed-size
    models ignore ``size``), audio of ``size`` samples."""
    arch = ARCHS[name]
    gen = torch.Generator().manual_seed(seed)
    if arch.kind in ("image", "image_fixed"):
        side = arch.side if arch.kind == "image_fixed" else size
        return {"pixel_values": torch.randn(batch, 3, side, side, generator=gen)}
    if arch.kind == "audio":
        return {"input_values": torch.randn(batch, size, generator=gen)}
    if arch.kind == "features":
        return {"input_features": torch.randn(batch, arch.extra["mel"], arch.side, generator=gen)}
    ids = torch.randint(3, VOCAB, (batch, size), generator=gen)
    mask = torch.ones(batch, size, dtype=torch.long)
    mask[-1, size // 2:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if arch.kind == "seq2seq":
        out["decoder_input_ids"] = torch.randint(3, VOCAB, (batch, size // 2 + 1), generator=gen)
    return out


def at_capture_size(name: str, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of ``batch`` samples at the capture's length / image side / audio length."""
    kind = ARCHS[name].kind
    size = {"audio": 640, "image": 32, "image_fixed": 32}.get(kind, CAPTURE_SHAPE[1])
    return inputs(name, batch, size, seed=seed)


def capture_inputs(name: str) -> dict[str, torch.Tensor]:
    """The example inputs a capture (and raw torch.export) traces with."""
    return at_capture_size(name, CAPTURE_SHAPE[0])


def check_inputs(name: str) -> list[dict[str, torch.Tensor]]:
    """Inputs at two shapes that differ from the capture's (text: one padded row each)."""
    kind = ARCHS[name].kind
    shapes = {"audio": AUDIO_LENGTHS, "image": IMAGE_SIDES, "image_fixed": IMAGE_SIDES,
              "features": ((3, 0), (1, 0))}.get(kind, TEXT_SHAPES)
    return [inputs(name, b, s, seed=2 + i) for i, (b, s) in enumerate(shapes)]

# Round 2 (issue 27): more MoE, mobile / hierarchical vision, long-attention and state-space models, all `reach`.
if __package__:  # imported as reach.tiny_archs (tests/graph), else as a module beside this file
    from .tiny_archs_extra import EXTRA_ARCHS  # noqa: E402
else:
    from tiny_archs_extra import EXTRA_ARCHS  # noqa: E402
ARCHS.update(EXTRA_ARCHS)
