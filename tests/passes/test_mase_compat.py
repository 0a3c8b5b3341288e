"""MASE users switching over: MaseGraph alias, MASE format names and pass keys (aliased or refused by name)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, logits, make_gpt

from fxforge import ForgeGraph, MaseGraph, passes
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.quantize.formats import QuantizeConfigError, get_format


def test_masegraph_and_mase_lora_checkpoint_round_trip(tiny_bert: torch.nn.Module, tmp_path: Path) -> None:
    """A MASE user's LoRA flow under MASE's names: adapters saved from one MaseGraph load into a fresh one."""
    names = ["input_ids", "attention_mask"]
    x = bert_inputs(labels=False)
    mg = MaseGraph(copy.deepcopy(tiny_bert), hf_input_names=names)
    base = logits(mg, x)
    tuned, _ = passes.insert_lora_adapter_transform_pass(mg.copy(), {"rank": 2})
    with torch.no_grad():
        for name, p in tuned.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    out = logits(tuned, x)
    assert (out - base).abs().max() > 1e-3  # the adapters change the outputs
    path = passes.save_lora_adapters(tuned, tmp_path / "adapters")
    back, info = passes.load_lora_adapters(MaseGraph(copy.deepcopy(tiny_bert), hf_input_names=names), path)
    assert torch.equal(logits(back, x), out) and info["adapted"]


def test_mase_format_names() -> None:
    assert get_format("minifloat_ieee").name == "minifloat"
    with pytest.raises(QuantizeConfigError, match="MASE format 'minifloat_denorm'.*allowed"):
        get_format("minifloat_denorm")


def test_mase_pass_keys_are_aliased_or_refused(tmp_path: Path) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    mg, _ = passes.init_metadata_analysis_pass(mg)
    with pytest.raises(PassArgsError, match="add_value.*never tensor values"):
        passes.add_common_metadata_analysis_pass(mg, {"add_value": True})
    out = tmp_path / "table.txt"
    args = {"file_name": str(out), "show": False}
    passes.report_graph_analysis_pass(mg, args)
    assert out.read_text().startswith("node") and args == {"file_name": str(out), "show": False}
    with pytest.raises(PassArgsError, match="not both"):
        passes.report_graph_analysis_pass(mg, {"file_name": "a", "file": "b"})


def test_quantize_by_name_accepts_fx_node_names(tiny_bert: torch.nn.Module) -> None:
    from fxforge.passes.quantize.records import QuantizationRecord

    int8 = {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": 4}}
    for key in ("bert_encoder_layer_0_attention_self_query", "bert.encoder.layer.0.attention.self.query"):
        mg = ForgeGraph(copy.deepcopy(tiny_bert), hf_input_names=["input_ids", "attention_mask"])
        mg, _ = passes.init_metadata_analysis_pass(mg)
        q, _ = passes.quantize_transform_pass(mg, {"by": "name", key: int8})
        hits = [n.name for n in q.nodes if q.meta(n).software.get(QuantizationRecord) is not None]
        assert hits == ["bert_encoder_layer_0_attention_self_query"], (key, hits)


def test_mase_add_value_false_is_what_fxforge_does() -> None:
    """MASE's ``{"add_value": False}`` asks for metadata without tensor values: fxforge's only kind."""
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, info = passes.add_common_metadata_analysis_pass(mg, {"add_value": False})
    assert info.nodes == len(mg.model.graph.nodes)
    assert mg.meta(mg.node("wte")).common.results["data_out_0"].shape == (2, 8, 32)


def test_dummy_in_missing_an_input_names_the_graph_inputs(tiny_bert: torch.nn.Module) -> None:
    """Captured without hf_input_names the graph takes (input_ids, attention_mask); MASE's dummy_in with only
    input_ids is refused naming both and the way out, not with a bare TypeError."""
    ids = bert_inputs(batch=2, seq=8, labels=False)
    mg, _ = passes.init_metadata_analysis_pass(ForgeGraph(copy.deepcopy(tiny_bert)))
    with pytest.raises(PassError, match=r"add_common_metadata_analysis_pass.*'attention_mask'.*takes "
                                        r"\['input_ids', 'attention_mask'\].*hf_input_names"):
        passes.add_common_metadata_analysis_pass(mg, {"dummy_in": {"input_ids": ids["input_ids"]}})
    mg, _ = passes.add_common_metadata_analysis_pass(mg, {"dummy_in": ids})  # every input given
    only, _ = passes.init_metadata_analysis_pass(ForgeGraph(copy.deepcopy(tiny_bert), hf_input_names=["input_ids"]))
    only, info = passes.add_common_metadata_analysis_pass(only, {"dummy_in": {"input_ids": ids["input_ids"]}})
    assert info.nodes == len(only.model.graph.nodes)
