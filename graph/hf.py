"""HuggingFace specifics: recognising HF models, their dummy inputs (MASE's hf_input_names) and capture settings."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

DEFAULT_HF_INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask")
KNOWN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "decoder_input_ids",
                 "decoder_attention_mask", "pixel_values")
_TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids", "decoder_input_ids",
                          "decoder_attention_mask"})
_DEFAULT_IMAGE_SIZE = 32  # models whose config has no image_size (ResNet): convolutions accept any size


def is_hf_model(model: nn.Module) -> bool:
    """True for transformers' PreTrainedModel instances (never imports transformers: a model can only be one
    if transformers' modeling code is already loaded, and importing it here would load torchao noisily)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def default_input_names(model: nn.Module) -> tuple[str, ...]:
    """What the model needs at least: its main input (``pixel_values`` for vision models), the attention mask
    for text models, and ``decoder_input_ids`` for encoder-decoders (T5, BART)."""
    main = str(getattr(model, "main_input_name", "input_ids"))
    if main != "input_ids":
        return (main,)
    names = DEFAULT_HF_INPUT_NAMES
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        names = (*names, "decoder_input_ids")
    return names


def _label_shape(model: nn.Module, batch: int, seq: int) -> tuple[int, ...]:
    name = type(model).__name__
    if name.endswith(("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction",
                      "ForImageClassification")):
        return (batch,)
    return (batch, seq)


def _config_int(config: Any, name: str, default: int | None, why: str) -> int:
    value = getattr(config, name, None)
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    if value is None:
        if default is None:
            raise ValueError(f"cannot build dummy inputs for {type(config).__name__}: it has no {name!r} ({why}); "
                             "pass example_inputs instead")
        return default
    return int(value)


def hf_dummy_inputs(model: nn.Module, input_names: Sequence[str], batch: int = 2,
                    seq: int = 16) -> dict[str, torch.Tensor]:
    """Random but valid inputs for an HF model, keyed by input name.

    The second sample is padded (attention_mask zeros at the end) so the masking path is traced and
    checked; batch and sequence length differ so dynamic shapes are not conflated. Images are built from
    the config's ``num_channels`` and ``image_size``.
    """
    unknown = [n for n in input_names if n not in KNOWN_INPUTS]
    if unknown:
        raise ValueError(f"unknown hf_input_names {unknown}; allowed: {list(KNOWN_INPUTS)}")
    config = model.config
    vision = "pixel_values" in input_names
    text = [n for n in input_names if n in _TEXT_INPUTS]
    if vision and text:
        raise ValueError(f"hf_input_names mixes pixel_values with text inputs {text}; pass example_inputs instead")
    gen = torch.Generator().manual_seed(0)
    max_pos = getattr(config, "max_position_embeddings", seq) or seq
    seq = min(seq, int(max_pos))
    dec_seq = max(seq // 2, 1)
    inputs: dict[str, torch.Tensor] = {}
    for name in input_names:
        if name in ("input_ids", "decoder_input_ids"):
            vocab = _config_int(config, "vocab_size", None, "needed for token ids")
            inputs[name] = torch.randint(0, vocab, (batch, seq if name == "input_ids" else dec_seq), generator=gen)
        elif name in ("attention_mask", "decoder_attention_mask"):
            length = seq if name == "attention_mask" else dec_seq
            mask = torch.ones(batch, length, dtype=torch.long)
            if batch > 1:
                mask[-1, length // 2:] = 0
            inputs[name] = mask
        elif name == "token_type_ids":
            inputs[name] = torch.zeros(batch, seq, dtype=torch.long)
        elif name == "position_ids":
            inputs[name] = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        elif name == "pixel_values":
            channels = _config_int(config, "num_channels", 3, "image channels")
            size = _config_int(config, "image_size", _DEFAULT_IMAGE_SIZE, "image side")
            inputs[name] = torch.randn(batch, channels, size, size, generator=gen)
        elif name == "labels":
            num_labels = int(getattr(config, "num_labels", 2))
            length = dec_seq if getattr(config, "is_encoder_decoder", False) else seq
            shape = _label_shape(model, batch, length)
            high = num_labels if shape == (batch,) else _config_int(config, "vocab_size", None, "token labels")
            inputs[name] = torch.randint(0, max(high, 1), shape, generator=gen)
    return inputs


def _builds_cache(model: nn.Module) -> bool:
    """Whether ``model``'s forward returns a KV cache when its config says ``use_cache`` (a decoder, an
    encoder-decoder, or a generating model); BERT-like encoders (``is_decoder`` False) ignore the flag."""
    configs = [c for m in model.modules() if (c := getattr(m, "config", None)) is not None]
    if any(getattr(c, "is_decoder", False) or getattr(c, "is_encoder_decoder", False) for c in configs):
        return True
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        return True
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kinds = {getattr(c, "model_type", None) for c in configs}  # a decoder family without an LM head (GPT2Model)
    return any(k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and k not in MODEL_FOR_MASKED_LM_MAPPING_NAMES for k in kinds)


@contextmanager
def cache_disabled(model: nn.Module, notes: list[str]) -> Iterator[None]:
    """Turn ``use_cache`` off in every config of the model while capturing (restored afterwards).

    A decoder with the cache on returns a ``DynamicCache`` that torch.export cannot put in a graph's output;
    the captured graph computes the full sequence each call (training, scoring, one generation step without a
    cache), which is what a graph of the forward is.
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", False) is True}
    for c in configs.values():
        c.use_cache = False
    if configs and _builds_cache(model):  # an encoder's config has use_cache too, but its forward never reads it
        notes.append("use_cache was turned off for capture (a KV cache is not a tensor output); the graph returns "
                     "no past_key_values and recomputes the whole sequence per call")
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True
