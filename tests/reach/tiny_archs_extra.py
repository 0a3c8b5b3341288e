"""More tiny transformers architectures for the reach sweep (issue 27, round 2): mixtures of experts, mobile and
hierarchical vision models, long/sparse attention and state-space / recurrent language models.

Same style as tiny_archs (hidden 32, 2 layers, vocabulary 99, HF's training-only defaults kept: router jitter,
drop_path_rate raised to 0.1 where it defaults to 0). ``EXTRA_ARCHS`` is merged into ``tiny_archs.ARCHS``; none of
these is in ``make test``'s representative 12 (all are marked ``reach``). Import ``tiny_archs`` (which imports
this), not this module first.
"""

from __future__ import annotations

from typing import Any

if __package__:  # imported as reach.tiny_archs_extra (tests/graph reuses tiny_archs as the reach package's)
    from .tiny_archs import DECODER, MOE, SEQ2SEQ, STAGES, TEXT, VIT, VOCAB, Arch
else:
    from tiny_archs import DECODER, MOE, SEQ2SEQ, STAGES, TEXT, VIT, VOCAB, Arch

_DEEPSEEK = {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
             "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "head_dim": 4, "first_k_dense_replace": 1,
             "num_key_value_heads": 4,
             "n_group": 1, "topk_group": 1}
_MAMBA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "expand": 2,
          "conv_kernel": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _a(model: str, config: str, kind: str, base: dict[str, Any], **kw: Any) -> Arch:
    return Arch(model, config, {**base, **kw}, kind)


EXTRA_ARCHS: dict[str, Arch] = {
    # mixtures of experts
    "switch_transformers": _a("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", "seq2seq", {},
                              vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                              num_heads=4, num_experts=4, expert_capacity=8, encoder_sparse_step=1,
                              decoder_sparse_step=1, decoder_start_token_id=0),
    "granitemoe": _a("GraniteMoeForCausalLM", "GraniteMoeConfig", "text", MOE),
    "phimoe": _a("PhimoeForCausalLM", "PhimoeConfig", "text", MOE),
    "deepseek_v2": _a("DeepseekV2ForCausalLM", "DeepseekV2Config", "text", _DEEPSEEK),
    "deepseek_v3": _a("DeepseekV3ForCausalLM", "DeepseekV3Config", "text", _DEEPSEEK),
    "gpt_oss": _a("GptOssForCausalLM", "GptOssConfig", "text", MOE, head_dim=8, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "dbrx": _a("DbrxForCausalLM", "DbrxConfig", "text", {}, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2,
               max_seq_len=64, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
               ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "jetmoe": _a("JetMoeForCausalLM", "JetMoeConfig", "text", MOE, kv_channels=8),
    "jamba": _a("JambaForCausalLM", "JambaConfig", "text", MOE, attn_layer_period=2,
                attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4),
    "granitemoe_shared": _a("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", "text", MOE,
                            shared_intermediate_size=16),
    "ernie4_5_moe": _a("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", "text", MOE, moe_k=2, moe_num_experts=4,
                       moe_layer_start_index=0),
    "glm4_moe": _a("Glm4MoeForCausalLM", "Glm4MoeConfig", "text", MOE, n_routed_experts=4, n_shared_experts=1,
                   first_k_dense_replace=1, head_dim=8, n_group=1, topk_group=1),
    # mobile / hierarchical vision
    "mobilevit": _a("MobileViTForImageClassification", "MobileViTConfig", "image", {}, image_size=32,
                    hidden_sizes=[12, 16, 20], neck_hidden_sizes=[8, 8, 16, 16, 32, 32, 32], num_labels=3),
    # stride 32 with 2-pixel patches: sides below 64 leave nothing to unfold
    "mobilevitv2": Arch("MobileViTV2ForImageClassification", "MobileViTV2Config",
                        {"image_size": 64, "width_multiplier": 0.25, "n_attn_blocks": [1, 1, 1],
                         "base_attn_unit_dims": [16, 24, 32], "num_labels": 3}, "image_fixed", side=64),
    "mobilenet_v1": _a("MobileNetV1ForImageClassification", "MobileNetV1Config", "image", {}, depth_multiplier=0.25,
                       image_size=32, num_labels=3),
    "levit": Arch("LevitForImageClassification", "LevitConfig",
                  {"image_size": 64, "patch_size": 16, "hidden_sizes": [16, 32, 48], "num_attention_heads": [1, 2, 3],
                   "depths": [1, 1, 1], "key_dim": [8, 8, 8], "num_labels": 3,
                   "down_ops": [["Subsample", 8, 16 // 8, 4, 2, 2], ["Subsample", 8, 32 // 8, 4, 2, 2]]},
                  "image_fixed", side=64),
    "convnextv2": _a("ConvNextV2ForImageClassification", "ConvNextV2Config", "image", STAGES, num_stages=2,
                     drop_path_rate=0.1),
    "dinov2_with_registers": _a("Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersConfig",
                                "image_fixed", VIT, num_register_tokens=2, drop_path_rate=0.1),
    "swinv2": _a("Swinv2ForImageClassification", "Swinv2Config", "image_fixed", {}, image_size=32, patch_size=4,
                 embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3),
    "focalnet": _a("FocalNetForImageClassification", "FocalNetConfig", "image", {}, embed_dim=16, depths=[1, 1],
                   hidden_sizes=[16, 32], patch_size=4, num_labels=3, drop_path_rate=0.1),
    "pvt_v2": _a("PvtV2ForImageClassification", "PvtV2Config", "image", {}, num_encoder_blocks=2, depths=[1, 1],
                 sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                 num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3, drop_path_rate=0.1),
    "bit": _a("BitForImageClassification", "BitConfig", "image", STAGES, embedding_size=16, num_groups=4,
              layer_type="bottleneck"),
    # long / sparse attention
    "longformer": _a("LongformerForSequenceClassification", "LongformerConfig", "text", TEXT, attention_window=4,
                     pad_token_id=1),
    "big_bird": _a("BigBirdForSequenceClassification", "BigBirdConfig", "text", TEXT, block_size=2,
                   num_random_blocks=1),
    "xlnet": _a("XLNetForSequenceClassification", "XLNetConfig", "text", {}, vocab_size=VOCAB, d_model=32, n_layer=2,
                n_head=4, d_inner=37, mem_len=None),
    "led": _a("LEDForConditionalGeneration", "LEDConfig", "seq2seq", SEQ2SEQ, attention_window=4,
              max_encoder_position_embeddings=64, max_decoder_position_embeddings=64),
    # state-space / recurrent
    "mamba": _a("MambaForCausalLM", "MambaConfig", "text", _MAMBA, time_step_rank=4),
    "mamba2": _a("Mamba2ForCausalLM", "Mamba2Config", "text", _MAMBA, num_heads=4, head_dim=16, n_groups=1,
                 chunk_size=8, time_step_rank=4),
    "falcon_mamba": _a("FalconMambaForCausalLM", "FalconMambaConfig", "text", _MAMBA, time_step_rank=4),
    "rwkv": _a("RwkvForCausalLM", "RwkvConfig", "text", {}, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               attention_hidden_size=32, intermediate_size=37, context_length=64),
    "recurrent_gemma": _a("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", "text", DECODER, num_key_value_heads=1,
                          lru_width=32, attention_window_size=8, head_dim=8, block_types=["recurrent", "attention"]),
}
