"""Structured FFN pruning of gated (SwiGLU) MLPs: gate_proj and up_proj rows with down_proj's columns are one
unit; masked and shrunk on tiny Llama and Qwen2, the shrunk graph equals the masked one at two shapes."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_inputs, tiny_hf

from fxforge import ForgeGraph
from fxforge.passes import PassError
from fxforge.passes.prune import prune_transform_pass, shrink_transform_pass

FFN = {"weight": {"sparsity": 0.25, "granularity": "ffn"}}


def _graph(family: str) -> ForgeGraph:
    return ForgeGraph(tiny_hf(family), hf_input_names=["input_ids", "attention_mask"])


def _rows_off(mg: ForgeGraph, path: str) -> torch.Tensor:
    return ~mg.model.get_submodule(path).weight_mask.any(dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gated_mlp_prunes_and_shrinks_exactly(family: str) -> None:
    mg, info = prune_transform_pass(_graph(family), FFN)
    assert (info.units_pruned, info.units_total) == (32, 128)  # 16 of 64 units in each of 2 layers
    assert sorted(s.name for s in info.layers) == sorted(f"model.layers.{i}.mlp.{p}" for i in (0, 1)
                                                         for p in ("gate_proj", "up_proj"))
    for i in (0, 1):  # a unit is a gate row and the up row of the same index
        gate, up = _rows_off(mg, f"model.layers.{i}.mlp.gate_proj"), _rows_off(mg, f"model.layers.{i}.mlp.up_proj")
        assert int(gate.sum()) == 16 and torch.equal(gate, up)
    small, sinfo = shrink_transform_pass(mg.copy())
    assert sinfo.groups_removed == 32
    for i in (0, 1):
        mlp = f"model.layers.{i}.mlp"
        assert small.model.get_submodule(f"{mlp}.gate_proj").weight.shape == (48, 32)
        assert small.model.get_submodule(f"{mlp}.up_proj").weight.shape == (48, 32)
        assert small.model.get_submodule(f"{mlp}.down_proj").weight.shape == (32, 48)
    with torch.no_grad():
        for batch, seq in ((2, 9), (3, 20)):
            x = hf_inputs(family, batch, seq)
            x.pop("labels")
            ref = mg(**x).logits
            assert ref.shape == (batch, seq, 100)
            assert (small(**x).logits - ref).abs().max() <= 1e-5


def test_gated_unit_needs_both_producers_selected() -> None:
    with pytest.raises(PassError, match=r"gate_proj.*up_proj.*must be selected too"):
        prune_transform_pass(_graph("llama"), {**FFN, "targets": {"name": "mlp.gate_proj"}})


def test_attention_layers_are_not_ffn_layers() -> None:
    with pytest.raises(PassError, match="'model.layers.0.self_attn.q_proj' has no FFN units: its rows belong to "
                                        "attention heads"):
        prune_transform_pass(_graph("llama"), {**FFN, "targets": {"name": "layers.0.self_attn.q_proj"}})
