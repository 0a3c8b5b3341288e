"""The mixed-precision example's pieces on a tiny BERT: its uniform "auto" configuration calibrates and keeps
the logits close, and its default per-layer choices (fraction widths from the range) warn about nothing."""

from __future__ import annotations

import warnings

import torch
from conftest import bert_inputs, logits, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.examples.search_mixed_precision import CHOICES, uniform
from fxforge.passes.quantize import QuantizationWarning, quantization_report_analysis_pass
from fxforge.pipelines import Pipeline
from fxforge.search import MixedPrecisionSpace


def test_uniform_auto_calibrates_and_the_default_choices_keep_every_layer() -> None:
    base = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    calib = [bert_inputs(batch=4, seq=12) for _ in range(2)]
    steps = uniform(8, "auto", calib)
    assert [s[0] for s in steps] == ["quantize_transform_pass", "calibrate_transform_pass"]
    graph, _ = Pipeline(steps, name="uniform 8/auto", verify=False)(base)
    x = bert_inputs(batch=3, seq=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        _, rep = quantization_report_analysis_pass(graph, {"data": [x]})
        MixedPrecisionSpace({"integer": CHOICES["auto"]}, roles=("data_in", "weight"), per="layer").bind(base)
    assert rep["weight_zero_fraction"] < 0.03 and rep["output_sqnr_db"] > 45.0  # measured 0.010 and 62 dB
    assert (logits(graph, x) - logits(base, x)).abs().max() < 0.005  # measured 0.0004
    assert not torch.equal(logits(graph, x), logits(base, x))
