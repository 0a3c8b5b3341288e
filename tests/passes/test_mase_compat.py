"""MASE users switching over: MaseGraph alias, MASE format names and pass keys (aliased or refused by name)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph, MaseGraph, passes
from fxforge.passes import PassArgsError
from fxforge.passes.quantize.formats import QuantizeConfigError, get_format


def test_masegraph_alias_and_lora_checkpoint_exports() -> None:
    assert MaseGraph is ForgeGraph
    assert callable(passes.save_lora_adapters) and callable(passes.load_lora_adapters)


def test_mase_format_names() -> None:
    assert get_format("minifloat_ieee").name == "minifloat"
    with pytest.raises(QuantizeConfigError, match="MASE format 'minifloat_denorm'.*allowed"):
        get_format("minifloat_denorm")


def test_mase_pass_keys_are_aliased_or_refused(tmp_path: Path) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    mg, _ = passes.init_metadata_analysis_pass(mg)
    with pytest.raises(PassArgsError, match="add_value.*never tensor values"):
        passes.add_common_metadata_analysis_pass(mg, {"add_value": False})
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
