"""The report says what is true of the model in it: an encoder's report has no use_cache note (its forward never
builds a KV cache), a decoder's keeps it, and a quantized linear's precision is its quantized widths."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import make_tiny_bert  # noqa: E402
from hf_tiny import tiny_hf  # noqa: E402

QUANT = {"by": "type", "default": {"config": {"name": None}},
         "linear": {"config": {"name": "integer", "data_in_width": 6, "data_in_frac_width": 3,
                               "weight_width": 4, "weight_frac_width": 2, "bias_width": 8, "bias_frac_width": 4}}}


def test_encoder_capture_carries_no_use_cache_note() -> None:
    from fxforge import ForgeGraph
    from fxforge.report import build_report

    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])
    assert not [n for n in mg.capture_notes if "use_cache" in n], mg.capture_notes
    assert "use_cache" not in build_report(mg)


def test_decoder_capture_keeps_use_cache_note() -> None:
    from fxforge import ForgeGraph

    mg = ForgeGraph(tiny_hf("gpt2"), hf_input_names=["input_ids", "attention_mask"])
    assert any("use_cache was turned off" in n for n in mg.capture_notes), mg.capture_notes


def test_quantized_linear_precision_shows_its_widths() -> None:
    from fxforge import ForgeGraph, passes
    from fxforge.report.rows import node_rows

    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    mg, _ = passes.quantize_transform_pass(mg, QUANT)
    rows = {r.name: r for r in node_rows(mg)}
    query = rows["bert_encoder_layer_0_attention_self_query"]
    assert "32" not in query.precision, query.precision
    assert "integer" in query.precision and "w4" in query.precision and "in6" in query.precision, query.precision
    assert rows["bert_encoder_layer_0_attention_output_layer_norm"].precision == "float32"
