"""The Torch-Pruning baseline the pruning example and benchmark compare against: same target, L1 or Taylor."""

from __future__ import annotations

import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge.benchmarks.prune_recipes import torch_pruning_model


def test_torch_pruning_baseline_hits_the_target_with_l1_and_taylor() -> None:
    x = bert_inputs()
    example = {k: v for k, v in x.items() if k != "labels"}
    dense = make_tiny_bert()
    cfg = dense.config
    kept = {}
    for name, calib in (("l1", None), ("taylor", [x, bert_inputs(batch=2, seq=7)])):
        torch.manual_seed(0)
        model = make_tiny_bert()
        model.load_state_dict(dense.state_dict())
        pruned = torch_pruning_model(model, example, calib)
        layer = pruned.bert.encoder.layer[0]
        assert layer.intermediate.dense.out_features == cfg.intermediate_size // 2
        assert layer.attention.self.num_attention_heads < cfg.num_attention_heads
        assert layer.attention.self.query.out_features == (layer.attention.self.num_attention_heads
                                                           * cfg.hidden_size // cfg.num_attention_heads)
        assert all(p.grad is None for p in pruned.parameters())
        assert pruned(**x).logits.shape == (3, 2)
        kept[name] = layer.intermediate.dense.weight.detach().clone()
    assert not torch.equal(kept["l1"], kept["taylor"])  # the criterion decides which units stay
