"""attention_swap_transform_pass: multi-head -> grouped-query attention on a captured tiny Llama (checked against
HF's own GQA Llama with pooled weights) and the zoo GPT (fused qkv, rotary), at two shapes; the tiny BERT's is in
tests/passes/test_transform_contracts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import make_gpt
from hf_tiny import hf_inputs, tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes import PassError
from fxforge.passes.metrics import signal_noise_power
from fxforge.passes.transform.attention_swap import attention_swap_transform_pass
from fxforge.passes.transform.grouped_kv import GroupedKVLinear


def _shapes(family: str) -> list[dict[str, torch.Tensor]]:
    return [{k: v for k, v in hf_inputs(family, b, s).items() if k != "labels"} for b, s in ((2, 9), (3, 13))]


def _pooled(weight: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Each group of consecutive heads' rows replaced by their mean (the reference, written out)."""
    rows = weight.reshape(heads, -1, *weight.shape[1:])
    return torch.stack([rows[g * (heads // groups):(g + 1) * (heads // groups)].mean(0) for g in range(groups)]) \
        .reshape(-1, *weight.shape[1:])


@pytest.mark.slow  # the Llama's export capture: ~30 s on a loaded core; GPT and BERT below stay in make test
def test_llama_equals_hf_gqa_llama_with_pooled_weights() -> None:
    model = tiny_hf("llama", num_key_value_heads=4)
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"])
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    batches = _shapes("llama")
    out, info = attention_swap_transform_pass(mg, {"kv_heads": 2, "data": batches})
    assert sorted(info.layers) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    layer = info.layers["model.layers.0.self_attn"]
    assert (layer.heads, layer.kv_heads, layer.key, layer.value) == (4, 2, "model.layers.0.self_attn.k_proj",
                                                                   "model.layers.0.self_attn.v_proj")
    # HF's own grouped-query Llama (repeat_kv inside its attention) holding the mean-pooled projections
    gqa = tiny_hf("llama", num_key_value_heads=2)
    state = {k: _pooled(v, 4, 2) if ".k_proj." in k or ".v_proj." in k else v for k, v in model.state_dict().items()}
    gqa.load_state_dict(state)
    assert info.parameters_removed == sum(p.numel() for p in model.parameters()) - \
        sum(p.numel() for p in gqa.parameters())
    with torch.no_grad():
        refs, outs = [], []
        for batch in batches:
            refs.append(model(**batch).logits)
            outs.append(out(**batch).logits)
            torch.testing.assert_close(outs[-1], gqa(**batch).logits, atol=1e-5, rtol=1e-5)
    signal, noise = signal_noise_power(refs, outs)
    assert info.relative_output_error == pytest.approx((noise / signal) ** 0.5, rel=1e-4)
    assert info.relative_output_error > 1e-3 and 0 < info.layers["model.layers.1.self_attn"].weight_error < 1


@pytest.fixture(scope="module")
def gpt() -> ForgeGraph:
    mg = ForgeGraph(make_gpt(n_head=4), example_inputs=torch.randint(0, 64, (2, 8)))
    return passes.add_common_metadata_analysis_pass(mg)[0]


def test_gpt_fused_qkv_to_multi_query(gpt: ForgeGraph, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    idx = [torch.randint(0, 64, shape, generator=gen) for shape in ((2, 11), (3, 16))]
    out, info = attention_swap_transform_pass(gpt, {"kv_heads": 1, "data": [(i,) for i in idx]})
    proj = out.model.get_submodule("blocks.0.mixer.c_attn")
    assert isinstance(proj, GroupedKVLinear) and proj.weight.shape == (32 + 2 * 8, 32)  # q + one k and v head
    assert info.layers["blocks.1.mixer"].key == info.layers["blocks.1.mixer"].value == "blocks.1.mixer.c_attn"
    # the pooled projection: q rows kept, each of k and v the mean of the 4 heads
    w = gpt.model.get_submodule("blocks.0.mixer.c_attn").weight
    torch.testing.assert_close(proj.weight, torch.cat([w[:32], _pooled(w[32:64], 4, 1), _pooled(w[64:], 4, 1)]))
    with torch.no_grad():
        refs, outs = [gpt(i) for i in idx], [out(i) for i in idx]
    signal, noise = signal_noise_power(refs, outs)
    assert info.relative_output_error == pytest.approx((noise / signal) ** 0.5, rel=1e-4) and noise > 0
    loaded = ForgeGraph.from_checkpoint(out.export(tmp_path / "gqa"))
    with torch.no_grad():
        assert all(torch.equal(loaded(i), o) for i, o in zip(idx, outs))
    fresh, _ = passes.add_common_metadata_analysis_pass(out.copy())
    assert {n.name: get_meta(n).common.to_json() for n in out.nodes} == \
        {n.name: get_meta(n).common.to_json() for n in fresh.nodes}


def test_kv_heads_equal_to_heads_leaves_outputs_equal(gpt: ForgeGraph) -> None:
    out, info = attention_swap_transform_pass(gpt, {"kv_heads": 4})
    assert info.layers == {} and info.changed is False
    linear = nn.Linear(16, 24)
    same = GroupedKVLinear.from_linear(linear, ((8, 2, 2, 8),))  # the module itself at groups == heads: exact
    x, idx = torch.randn(3, 5, 16), torch.randint(0, 64, (3, 5))
    with torch.no_grad():
        assert torch.equal(same(x), linear(x)) and torch.equal(out(idx), gpt(idx))


def test_refusal_names_the_layer_and_layers_selects(gpt: ForgeGraph) -> None:
    """(The tiny BERT's swap is checked at two shapes by tests/passes/test_transform_contracts.py.)"""
    with pytest.raises(PassError, match=r"layer 'blocks.0.mixer' has 4 key heads.*kv_heads=3.*\[1, 2, 4\]"):
        attention_swap_transform_pass(gpt, {"kv_heads": 3})
    with pytest.raises(PassError, match="name no attention layer"):
        attention_swap_transform_pass(gpt, {"kv_heads": 2, "layers": ["blocks.7.mixer"]})
    data = [(torch.randint(0, 64, shape),) for shape in ((3, 11), (2, 7))]
    out, info = attention_swap_transform_pass(gpt, {"kv_heads": 2, "layers": ["1.mixer"], "data": data})
    assert list(info.layers) == ["blocks.1.mixer"] and info.parameters_removed == 2 * 16 * 32
    assert type(out.model.get_submodule("blocks.0.mixer.c_attn")) is nn.Linear
    assert 0 < info.relative_output_error < 1 and info.output_sqnr_db > 0
