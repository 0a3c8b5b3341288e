"""Fixed-point fraction widths chosen from the range (``frac_width: "auto"``) and the report's warning when a
layer's weights mostly round to zero, on the real pretrained MiniLM (where a fixed frac_width of 2 or 3 zeroes
three quarters of the encoder's weights at 8 bits)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, logits

from fxforge import ForgeGraph
from fxforge.graph.metadata import get_meta
from fxforge.passes.base import PassArgsError
from fxforge.passes.quantize import (
    CalibrationRecord,
    QuantizationRecord,
    QuantizationWarning,
    calibrate_transform_pass,
    quantization_report_analysis_pass,
    quantize_transform_pass,
)
from fxforge.passes.quantize.fixed import auto_frac_width, fixed_point_range

NAMES = ["input_ids", "attention_mask"]


def linear_cfg(width: int, frac: int | str, roles: tuple[str, ...] = ("weight",)) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": "integer"}
    for r in roles:
        cfg[f"{r}_width"], cfg[f"{r}_frac_width"] = width, frac
    return {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": cfg}}


@pytest.fixture(scope="module")
def minilm_graph(minilm_classifier: nn.Module) -> ForgeGraph:
    """The pretrained MiniLM captured once per module; tests quantize copies."""
    return ForgeGraph(copy.deepcopy(minilm_classifier), hf_input_names=NAMES).eval()


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    return [bert_inputs(vocab=vocab, batch=2, seq=24, labels=False) for _ in range(2)]


def test_auto_frac_width_is_the_largest_that_covers_the_range() -> None:
    for width in (4, 8):
        for amax in (0.0391, 0.5, 1.0, 0.773, 7.915, 100.0, 2.0**-9):
            f = int(auto_frac_width(torch.tensor(amax), width))
            assert fixed_point_range(width, f)[1] >= amax  # the integer part covers max|x|: nothing clips
            assert fixed_point_range(width, f + 1)[1] < amax  # one more fraction bit would clip
    per_row = auto_frac_width(torch.tensor([0.25, 3.0, 0.0]), 8)
    assert per_row.tolist() == [8, 5, 0]  # a zero row takes 0 (any width represents zeros exactly)


def test_auto_is_validated_and_recorded_as_given(bert_graph: ForgeGraph) -> None:
    with pytest.raises(PassArgsError, match=r"weight_frac_width must be of type int or one of \['auto'\]"):
        quantize_transform_pass(bert_graph.copy(), linear_cfg(8, "automatic"))
    bad = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": "auto", "weight_frac_width": 2}}}
    with pytest.raises(PassArgsError, match="weight_width must be of type int, got 'auto'"):
        quantize_transform_pass(bert_graph.copy(), bad)
    mg, _ = quantize_transform_pass(bert_graph.copy(), linear_cfg(8, "auto"))
    rec = get_meta(mg.node("bert_encoder_layer_0_attention_self_query")).software.get(QuantizationRecord)
    assert rec.config["weight_frac_width"] == "auto"


def test_uncalibrated_auto_activation_names_the_pass_to_run(bert_graph: ForgeGraph) -> None:
    mg, _ = quantize_transform_pass(bert_graph.copy(), linear_cfg(8, "auto", ("data_in", "weight")))
    with pytest.raises(RuntimeError, match="calibrate_transform_pass"):
        logits(mg, bert_inputs())
    mg, info = calibrate_transform_pass(mg, {"data": [bert_inputs()]})
    assert info["scales_set"] == 14
    rec = get_meta(mg.node("bert_encoder_layer_0_attention_self_query")).software.get(CalibrationRecord)
    data_in = rec.stats["data_in"]
    f = data_in["frac_width"]  # the fraction width calibration chose, for the user to read
    assert fixed_point_range(8, f)[1] >= max(abs(data_in["lo"]), abs(data_in["hi"])) > fixed_point_range(8, f + 1)[1]


def test_calibrated_auto_graph_round_trips_a_checkpoint(bert_graph: ForgeGraph, tmp_path: Path) -> None:
    mg, _ = quantize_transform_pass(bert_graph.copy(), linear_cfg(6, "auto", ("data_in", "weight", "bias")))
    mg, _ = calibrate_transform_pass(mg, {"data": [bert_inputs()]})
    mg.export(tmp_path / "ckpt")
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    x = bert_inputs(batch=2, seq=9)
    assert torch.equal(logits(back, x), logits(mg, x))


def test_frac_width_2_zeroes_most_minilm_weights_and_the_report_warns(minilm_graph: ForgeGraph,
                                                                      minilm_classifier: nn.Module) -> None:
    """The README's old search space on MiniLM: at 8 bits with 2 fraction bits most weights become 0."""
    mg, _ = quantize_transform_pass(minilm_graph.copy(), linear_cfg(8, 2))
    data = _batches(minilm_classifier.config.vocab_size)
    with pytest.warns(QuantizationWarning, match=r"mostly round to zero.*'weight_frac_width': 'auto'"):
        _, rep = quantization_report_analysis_pass(mg, {"data": data})
    rows = {r["node"]: r for r in rep["nodes"]}
    assert rows["bert_encoder_layer_0_attention_self_value"]["weight_zero_fraction"] > 0.9
    encoder = [r for n, r in rows.items() if "encoder" in n]
    assert len(encoder) == 36 and sum(r["weight_zero_fraction"] > 0.5 for r in encoder) >= 30
    assert rep["weight_zero_fraction"] > 0.9  # 0.95 of MiniLM's linear weights round to 0
    assert set(rep["zeroed_weight_nodes"]) == {n for n, r in rows.items() if r["weight_zero_fraction"] > 0.5}
    assert "bert_encoder_layer_0_attention_self_value" in rep["zeroed_weight_nodes"]


def test_auto_frac_width_keeps_minilm_weights_and_a_high_sqnr(minilm_graph: ForgeGraph,
                                                              minilm_classifier: nn.Module) -> None:
    """8-bit fixed-point weights with fraction widths chosen from each output row's range: few weights round
    to zero, no warning, and every node keeps a high SQNR (with frac_width 2: 0.95 of the weights are 0)."""
    mg, _ = quantize_transform_pass(minilm_graph.copy(), linear_cfg(8, "auto"))
    data = _batches(minilm_classifier.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        _, rep = quantization_report_analysis_pass(mg, {"data": data})
    assert rep["zeroed_weight_nodes"] == []
    assert rep["weight_zero_fraction"] < 0.04  # measured 0.020
    assert max(r["weight_zero_fraction"] for r in rep["nodes"]) < 0.06  # measured 0.032
    assert min(r["sqnr_db"] for r in rep["nodes"]) > 18.0  # measured 22.5 (layer 4's attention output)
    assert rep["output_sqnr_db"] > 23.0  # measured 27.5
