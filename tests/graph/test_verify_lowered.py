"""A lowered checkpoint's size report: the int codes and kernel scales of lowered layers (weight-only int4/int8
linears, low-bit embeddings, the int8 x int8 Int8Linear) are counted as weights, stored at their width, and the
``weight_bits`` accounting counts them at their format's bits, within 5% of what the file stores."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert
from hf_tiny import hf_inputs, tiny_hf

from fxforge import ExampleInputs, ForgeGraph
from fxforge.graph.verify import measure_weights, verify_checkpoint
from fxforge.passes.quantize import (
    Int8Linear,
    WeightOnlyEmbedding,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    lower_weight_only_transform_pass,
    quantize_transform_pass,
)
from fxforge.search.objectives import weight_bits


def _cfg(linear: dict[str, Any], embedding: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"by": "type", "linear": {"config": linear}}
    if embedding is not None:
        cfg["embedding"] = {"config": embedding}
    return cfg


MXINT4 = {"name": "mxint", "weight_width": 4, "weight_block_size": 32}
INT8 = {"name": "scaled_integer", "weight_width": 8, "weight_granularity": "per_channel"}
DYNAMIC = {**INT8, "data_in_width": 8, "data_in_dynamic": True, "data_in_symmetric": False}
CONFIGS = {"int4": _cfg(MXINT4, MXINT4), "int8": _cfg(INT8, INT8), "int8-dynamic": _cfg(DYNAMIC, None)}


def _llama() -> ForgeGraph:
    mg = ForgeGraph(tiny_hf("llama"), hf_input_names=["input_ids", "attention_mask"]).eval()
    case = hf_inputs("llama", 2, 9)
    del case["labels"]
    mg.example_inputs = ExampleInputs((), case)
    return mg


def _bert() -> ForgeGraph:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg.example_inputs = ExampleInputs((), bert_inputs(labels=False))
    return mg


MODELS: dict[str, Callable[[], ForgeGraph]] = {"llama": _llama, "bert": _bert}
LOWERED = (WeightOnlyInt4Linear, WeightOnlyInt8Linear, WeightOnlyEmbedding, Int8Linear)


def _format_bits(m: nn.Module) -> int:
    """A lowered layer's bits from its format alone (not its tensors): codes at their width plus the scales
    its kernel reads (int4: a bf16 scale and zero per group and row; int8: an fp32 scale per row; embeddings:
    an fp32 scale per block of a row) plus an fp32 bias."""
    if isinstance(m, WeightOnlyEmbedding):
        return m.num_embeddings * m.embedding_dim * m.width + m.num_embeddings * (m.embedding_dim // m.block_size) * 32
    n, k = m.out_features, m.in_features
    bias = 0 if m.bias is None else 32 * n
    if isinstance(m, WeightOnlyInt4Linear):
        return n * k * 4 + (k // m.group_size) * n * 2 * 16 + bias
    return n * k * 8 + n * 32 + bias


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", list(MODELS))
def test_lowered_layers_are_weights_stored_and_accounted(tmp_path: Path, model: str, config: str) -> None:
    sim, _ = quantize_transform_pass(MODELS[model](), CONFIGS[config])
    low, info = lower_weight_only_transform_pass(sim)
    layers = {p: low.model.get_submodule(p) for p in info.lowered}
    assert layers and all(isinstance(m, LOWERED) for m in layers.values()), info.lowered
    if config == "int4":
        assert any(isinstance(m, WeightOnlyInt4Linear) for m in layers.values())
    path = low.export(tmp_path / "low")

    # the file: every lowered layer's codes, scales and bias are weight bytes, stored at their width
    stored = measure_weights(path)
    inputs = {"input_scale", "input_zero_point"}  # Int8Linear's calibrated input range: not its weight
    lowered_bytes = sum(t.numel() * t.element_size() for m in layers.values()
                        for n, t in m.named_buffers() if n not in inputs)
    assert stored.lowered == lowered_bytes and stored.lowered_layers == len(layers)
    assert stored.lowered == sum(_format_bits(m) for m in layers.values()) // 8  # codes at their width
    assert stored.weights == stored.packed + stored.unpacked + stored.lowered
    rest = sum(t.numel() * t.element_size() for n, t in low.model.named_buffers()
               if not any(n.startswith(p + ".") for p in layers))
    assert stored.other <= rest + 8 * len(layers)  # other: the model's own buffers (+ Int8Linear input ranges)

    # the accounting: params at their dtype, lowered layers at their format's bits
    params = sum(p.numel() * p.element_size() * 8 for p in low.model.parameters())
    assert weight_bits(low) == params + sum(_format_bits(m) for m in layers.values())

    report, back = verify_checkpoint(path, weight_bits=weight_bits)
    assert report.ok and back is not None and report.accounted_bytes is not None
    ratio = report.stored.weights / report.accounted_bytes  # type: ignore[union-attr]
    assert 0.95 <= ratio <= 1.05, (stored, report.accounted_bytes)
    text = report.text()
    assert f"{stored.lowered:,} B lowered ({len(layers)} layers" in text and f"stored/accounted {ratio:.3f}" in text
