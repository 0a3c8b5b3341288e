"""HuggingFace specifics: recognising HF models and building their dummy inputs (MASE's hf_input_names)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn as nn

DEFAULT_HF_INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask")
_KNOWN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


def is_hf_model(model: nn.Module) -> bool:
    """True for transformers' PreTrainedModel instances (never imports transformers: a model can only be one
    if transformers' modeling code is already loaded, and importing it here would load torchao noisily)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _label_shape(model: nn.Module, batch: int, seq: int) -> tuple[int, ...]:
    name = type(model).__name__
    if name.endswith(("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction")):
        return (batch,)
    return (batch, seq)


def hf_dummy_inputs(model: nn.Module, input_names: Sequence[str], batch: int = 2,
                    seq: int = 16) -> dict[str, torch.Tensor]:
    """Random but valid inputs for an HF model, keyed by input name.

    The second sample is padded (attention_mask zeros at the end) so the masking path is traced and
    checked; batch and sequence length differ so dynamic shapes are not conflated.
    """
    unknown = [n for n in input_names if n not in _KNOWN_INPUTS]
    if unknown:
        raise ValueError(f"unknown hf_input_names {unknown}; allowed: {list(_KNOWN_INPUTS)}")
    config = model.config
    gen = torch.Generator().manual_seed(0)
    max_pos = getattr(config, "max_position_embeddings", seq) or seq
    seq = min(seq, int(max_pos))
    inputs: dict[str, torch.Tensor] = {}
    for name in input_names:
        if name == "input_ids":
            inputs[name] = torch.randint(0, int(config.vocab_size), (batch, seq), generator=gen)
        elif name == "attention_mask":
            mask = torch.ones(batch, seq, dtype=torch.long)
            if batch > 1:
                mask[-1, seq // 2:] = 0
            inputs[name] = mask
        elif name == "token_type_ids":
            inputs[name] = torch.zeros(batch, seq, dtype=torch.long)
        elif name == "position_ids":
            inputs[name] = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        elif name == "labels":
            num_labels = int(getattr(config, "num_labels", 2))
            high = num_labels if _label_shape(model, batch, seq) == (batch,) else int(config.vocab_size)
            inputs[name] = torch.randint(0, max(high, 1), _label_shape(model, batch, seq), generator=gen)
    return inputs
