"""benchmarks/minilm_ship: the demo's kind of point (FFN shrunk, int8 linears, 4-bit embeddings) on a tiny BERT:
built, lowered to real kernels, and its sizes measured from the files and tensors themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, logits, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.benchmarks.minilm_ship import disk_bytes, linear_macs, lower_point, resident_bytes, ship_point
from fxforge.passes.quantize.lower import Int8Linear
from fxforge.passes.quantize.woq_modules import WeightOnlyEmbedding


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()


def test_point_shrinks_the_ffn_and_lowers_every_linear_and_embedding(base: ForgeGraph) -> None:
    point = ship_point(base, 0.5)
    sizes = {n: m.out_features for n, m in point.model.named_modules() if n.endswith("intermediate.dense")}
    full = {n: m.out_features for n, m in base.model.named_modules() if n.endswith("intermediate.dense")}
    assert sizes and all(sizes[n] == full[n] // 2 for n in full)
    lowered, info = lower_point(point)
    kinds = [type(m) for m in lowered.model.modules()]
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in base.model.modules())
    n_embedding = sum(isinstance(m, torch.nn.Embedding) for m in base.model.modules())
    assert kinds.count(Int8Linear) == n_linear and kinds.count(WeightOnlyEmbedding) == n_embedding
    assert len(info.lowered) == n_linear + n_embedding and not info.skipped
    inputs = bert_inputs()
    # lowered vs simulated: the same int8 arithmetic up to the kernels' rounding (dynamic activation scales)
    assert torch.allclose(logits(lowered, inputs), logits(point, inputs), atol=0.05)
    assert linear_macs(lowered, 10) < linear_macs(base, 10)


def test_sizes_are_measured_from_the_checkpoint_file_and_the_tensors(base: ForgeGraph, tmp_path: Path) -> None:
    point = ship_point(base, 0.5)
    lowered, _ = lower_point(point)
    on_disk = disk_bytes(lowered, tmp_path / "low")
    assert on_disk == (tmp_path / "low" / "weights.safetensors").stat().st_size
    assert disk_bytes(base) > 3 * on_disk  # fp32 vs 4-bit tables + int8 linears with half the FFN gone
    embedding = next(m for m in lowered.model.modules() if isinstance(m, WeightOnlyEmbedding))
    assert embedding.codes.dtype == torch.uint8 and embedding.codes.shape[1] * 2 == embedding.embedding_dim
    tensors = [*lowered.model.parameters(), *lowered.model.buffers()]
    assert resident_bytes(lowered) == sum(t.numel() * t.element_size() for t in tensors) < resident_bytes(base) / 3
