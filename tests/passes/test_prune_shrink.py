"""shrink_transform_pass: dependency groups from the graph, physical removal of heads / FFN units,
exact on masked models at several shapes, export / reload, clear errors for unresolvable groups."""

from __future__ import annotations

import pytest
import torch
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.passes import PassError
from fxforge.passes.prune import prune_transform_pass, shrink_transform_pass

STRUCTURED = ({"weight": {"sparsity": 0.5, "granularity": "head"}},
              {"weight": {"sparsity": 0.5, "granularity": "ffn"}})


def _masked(mg: ForgeGraph) -> ForgeGraph:
    for cfg in STRUCTURED:
        mg, _ = prune_transform_pass(mg, cfg)
    return mg


def test_bert_shrinks_exactly_and_reloads(tmp_path) -> None:
    mg = _masked(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]))
    small, info = shrink_transform_pass(mg.copy())
    assert info.heads == {"bert_encoder_layer_0_attention_self_sdpa": (4, 2),
                          "bert_encoder_layer_1_attention_self_sdpa": (4, 2)}
    q = small.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert type(q) is torch.nn.Linear and q.weight.shape == (16, 32)
    assert small.model.get_submodule("bert.encoder.layer.0.output.dense").weight.shape == (32, 32)
    assert info.params_after < info.params_before
    for shape in ((3, 11), (2, 20)):
        x = bert_inputs(batch=shape[0], seq=shape[1], labels=False)
        assert (small(**x)[0] - mg(**x)[0]).abs().max() <= 1e-5
    back = ForgeGraph.from_checkpoint(small.export(tmp_path / "small"))
    x = bert_inputs(labels=False)
    assert torch.equal(back(**x)[0], small(**x)[0])


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_gpt_fused_qkv_split_and_head_count_follow(frontend: str) -> None:
    mg = _masked(ForgeGraph(make_gpt(n_head=4), example_inputs=torch.randint(0, 64, (2, 16)), frontend=frontend))
    small, info = shrink_transform_pass(mg.copy())
    assert small.model.get_submodule("blocks.0.mixer.c_attn").weight.shape == (48, 32)
    assert small.model.get_submodule("blocks.0.mlp.c_proj").weight.shape == (32, 64)
    for shape in ((3, 10), (1, 16)):
        i = torch.randint(0, 64, shape)
        assert (small(i) - mg(i)).abs().max() <= 1e-5


def test_unresolvable_groups_name_the_node() -> None:
    bert = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])
    mg, _ = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "row"},
                                               "targets": {"name": "layer.0.attention.output.dense"}})
    with pytest.raises(PassError, match="cannot remove row 0 of 'bert.encoder.layer.0.attention.output.dense': node '"):
        shrink_transform_pass(mg)
    mg, _ = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "row"},
                                               "targets": {"name": "layer.0.attention.self.query"}})
    with pytest.raises(PassError, match="tied to rows that are not masked: .*key"):
        shrink_transform_pass(mg)
    kept, info = shrink_transform_pass(mg, {"strict": False})
    assert info.groups_removed == 0 and info.kept_masked
    with pytest.raises(PassError, match="requires 'pruned'.*run prune_transform_pass first"):
        shrink_transform_pass(bert)
