"""sensitivity_analysis_pass measures embedding tables too (the joint search quantizes them: they are half of
MiniLM's weights): the loss a table costs at a width is the calibration loss of the quantize pass's graph with
that table alone quantized, minus the float one's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_bert

from fxforge import ForgeGraph, passes

NAMES = ["input_ids", "attention_mask", "labels"]


def test_embedding_tables_measured_as_the_quantize_pass_rounds_them() -> None:
    torch.manual_seed(0)
    bert = ForgeGraph(make_tiny_bert(), hf_input_names=NAMES).eval()
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 100, (4, 8), generator=gen), "attention_mask": torch.ones(4, 8,
                dtype=torch.long), "labels": torch.randint(0, 2, (4,), generator=gen)}]
    _, info = passes.sensitivity_analysis_pass(bert, {"data": batches, "method": "loss", "widths": [2, 8],
                                                      "format": "mxint", "targets": {"type": ["embedding"]},
                                                      "prune_ratios": []})
    by_name = {layer.name: layer for layer in info.layers}
    assert set(by_name) == {"bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
                            "bert.embeddings.token_type_embeddings"}
    name = "bert.embeddings.word_embeddings"
    q, _ = passes.quantize_transform_pass(bert, {"by": "name", name: {"config": {"name": "mxint", "weight_width": 2}}})
    with torch.no_grad():
        loss = float(q(**batches[0]).loss) - float(bert(**batches[0]).loss)
    assert by_name[name].delta(2) == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert by_name[name].delta(2) != 0.0  # 2-bit rounding moves an untrained model's loss (either way)
