"""Embedding tables quantized by the quantize pass: opt-in, row-local lookups, weight bits and checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, logits

from fxforge import ForgeGraph
from fxforge.passes.quantize import quantize_transform_pass
from fxforge.passes.quantize.config import RoleSpec
from fxforge.passes.quantize.modules import QuantizedEmbedding
from fxforge.passes.quantize.quantizer import Quantize
from fxforge.search.objectives import weight_bits

MXINT4 = {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}


def _embeddings(mg: ForgeGraph) -> list[QuantizedEmbedding]:
    return [m for m in mg.model.modules() if isinstance(m, QuantizedEmbedding)]


def test_default_never_quantizes_embeddings(bert_graph: ForgeGraph) -> None:
    cfg = {"by": "type", "default": {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": 6}}}
    mg, info = quantize_transform_pass(bert_graph.copy(), cfg)
    assert "embedding" not in info["by_op"] and info["by_op"]["linear"] > 0
    assert not _embeddings(mg)


@pytest.mark.parametrize("shape", [(3, 11), (2, 17)])
def test_embedding_rule_quantizes_the_tables(bert_graph: ForgeGraph, shape: tuple[int, int]) -> None:
    mg, info = quantize_transform_pass(bert_graph.copy(), {"by": "type", "embedding": MXINT4})
    assert info["by_op"] == {"embedding": 3}  # word, position and token-type tables
    tables = _embeddings(mg)
    assert len(tables) == 3 and all(set(t.quantizers()) == {"weight"} for t in tables)
    inputs = bert_inputs(batch=shape[0], seq=shape[1])
    ref = logits(bert_graph, inputs)
    out = logits(mg, inputs)
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 0.5
    # the same graph with float tables whose weights were quantized up front gives the same logits
    manual = bert_graph.copy()
    for name, m in manual.model.named_modules():
        if isinstance(m, nn.Embedding):
            q = next(t for n, t in mg.model.named_modules() if n == name)
            with torch.no_grad():
                m.weight.copy_(q.weight_quantizer(q.weight))
    assert torch.allclose(logits(manual, inputs), out, atol=1e-6)


@pytest.mark.parametrize("spec", [
    {"format": "scaled_integer", "width": 4, "granularity": "per_channel"},  # per row: rows looked up only
    {"format": "scaled_integer", "width": 4, "granularity": "per_tensor"},   # scale from the whole table
    {"format": "integer", "width": 6, "frac_width": 4},
])
def test_lookup_equals_quantized_table(spec: dict[str, Any]) -> None:
    float_table = nn.Embedding(50, 16, padding_idx=0)
    rs = RoleSpec.from_json(spec)
    quant = {"name": spec["format"], **{f"weight_{k}": v for k, v in rs.p.items()}}
    from fxforge.passes.quantize.config import OpQuantConfig

    table = QuantizedEmbedding.from_float(float_table, OpQuantConfig.parse(quant, "test"))
    assert table.weight is float_table.weight
    idx = torch.randint(0, 50, (4, 7))
    full = Quantize(rs, "weight", is_param=True, channel_axis=0)(float_table.weight)
    assert torch.equal(table(idx), nn.functional.embedding(idx, full, padding_idx=0))
    table(idx).sum().backward()  # the STE passes gradients to the float table
    assert float_table.weight.grad is not None and float_table.weight.grad.abs().sum() > 0


def test_weight_bits_count_quantized_tables(bert_graph: ForgeGraph) -> None:
    mg, _ = quantize_transform_pass(bert_graph.copy(), {"by": "type", "embedding": MXINT4})
    table_params = sum(m.weight.numel() for m in _embeddings(mg))
    saved = table_params * (32 - (4 + 8 / 32))
    assert weight_bits(mg) == pytest.approx(weight_bits(bert_graph) - saved)


def test_by_name_and_checkpoint_roundtrip(bert_graph: ForgeGraph, tmp_path: Path) -> None:
    mg, info = quantize_transform_pass(bert_graph.copy(), {"by": "regex", r".*word_embeddings": MXINT4})
    assert info["by_op"] == {"embedding": 1}
    inputs = bert_inputs(batch=2, seq=9)
    out = logits(mg, inputs)
    mg.export(tmp_path / "ckpt")
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    assert len(_embeddings(back)) == 1
    assert torch.equal(logits(back, inputs), out)
