"""remove_dropout_transform_pass: contract = eval outputs unchanged; train mode becomes deterministic."""

from __future__ import annotations

import torch
import torch.nn as nn
from conftest import bert_inputs

from fxforge import ForgeGraph, passes


def test_remove_dropout_keeps_eval_outputs(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    inputs = bert_inputs()
    before = mg(**inputs).logits
    code_before = mg.model.code
    mg, info = passes.remove_dropout_transform_pass(mg)
    assert info.to_json() == {"removed": 6, "attention_dropout_disabled": 2, "dropout_modules_left": 0, "changed": True}
    assert mg.model.code != code_before  # recompiled
    _, counts = passes.count_op_analysis_pass(mg, {"ops": ["dropout"]})
    assert counts["counts"]["dropout"] == 0
    assert (mg(**inputs).logits - before).abs().max() <= 1e-6
    mg.train()
    assert torch.equal(mg(**inputs).logits, mg(**inputs).logits)
    assert [p.name for p in mg.history] == ["remove_dropout_transform_pass", "count_op_analysis_pass"]
