"""quantize_transform_pass on tiny BERT and the AFNO GPT; calibration, report, export/reload."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, logits, make_gpt

from fxforge import ForgeGraph
from fxforge.graph.metadata import get_meta
from fxforge.passes.base import PassArgsError, PassError
from fxforge.passes.quantize import (
    CalibrationRecord,
    QuantizationRecord,
    Quantize,
    QuantizedLayerNorm,
    QuantizedLinear,
    QuantizedSDPA,
    calibrate_analysis_pass,
    quantization_report_analysis_pass,
    quantize_transform_pass,
)
from fxforge.passes.quantize.config import RoleSpec

INPUTS = ["input_ids", "attention_mask", "labels"]


def fixed(width: int, frac: int, roles: tuple[str, ...] = ("data_in", "weight", "bias")) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": "integer"}
    for r in roles:
        cfg[f"{r}_width"], cfg[f"{r}_frac_width"] = width, frac
    return {"config": cfg}


def _count(mg: ForgeGraph, cls: type[nn.Module]) -> int:
    return sum(isinstance(m, cls) for m in mg.model.modules())


def test_mase_config_by_type_on_bert(bert_graph: ForgeGraph) -> None:
    mg = bert_graph.copy()
    inputs = bert_inputs()
    ref = logits(mg, inputs)
    cfg = {"by": "type", "default": {"config": {"name": None}}, "linear": fixed(16, 12)}
    before = copy.deepcopy(cfg)
    mg, info = quantize_transform_pass(mg, cfg)
    assert cfg == before
    assert info["by_op"] == {"linear": 14} and _count(mg, QuantizedLinear) == 14
    assert not any(type(m) is nn.Linear for m in mg.model.modules())
    out = logits(mg, inputs)
    assert (out - ref).abs().max() < 2e-3 and not torch.equal(out, ref)
    node = mg.node("bert_encoder_layer_0_attention_self_query")
    rec = get_meta(node).software.get(QuantizationRecord)
    assert rec is not None and rec.rule == "linear" and rec.format == "integer"
    assert rec.config["weight_frac_width"] == 12
    assert rec.quantizers["weight"] == "bert.encoder.layer.0.attention.self.query.weight_quantizer"
    assert get_meta(node).common.module_type.endswith("QuantizedLinear")
    assert mg.history[-1].name == "quantize_transform_pass"
    with pytest.raises(PassError, match="quantize_transform_pass: cannot run on a graph where 'quantized' holds"):
        quantize_transform_pass(mg, cfg)


def test_by_name_and_regex(bert_graph: ForgeGraph) -> None:
    mg, info = quantize_transform_pass(bert_graph.copy(), {"by": "name", "query": fixed(8, 6),
                                                           "classifier": fixed(8, 6)})
    assert info["by_op"] == {"linear": 3}
    assert isinstance(mg.model.get_submodule("classifier"), QuantizedLinear)
    assert type(mg.model.get_submodule("bert.encoder.layer.0.attention.self.key")) is nn.Linear

    mg, info = quantize_transform_pass(bert_graph.copy(), {"by": "regex", r"bert\.encoder\.layer\.0\..*": fixed(8, 6)})
    # the regex selects every quantizable node of layer 0: 6 linears, 2 LayerNorms, the attention
    assert info["by_op"] == {"linear": 6, "layer_norm": 2, "scaled_dot_product_attention": 1}
    assert isinstance(mg.model.get_submodule("bert.encoder.layer.0.output.LayerNorm"), QuantizedLayerNorm)
    assert type(mg.model.get_submodule("bert.encoder.layer.1.output.dense")) is nn.Linear

    with pytest.raises(PassArgsError, match=r"key\(s\) \['quer'\] matched no quantizable node; .*include"):
        quantize_transform_pass(bert_graph.copy(), {"by": "name", "quer": fixed(8, 6)})


def test_every_op_type_on_bert(bert_graph: ForgeGraph) -> None:
    mg = bert_graph.copy()
    inputs = bert_inputs()
    ref = logits(mg, inputs)
    all_roles = fixed(16, 11, ("data_in", "weight", "bias", "data_out"))
    mg, info = quantize_transform_pass(mg, {"by": "type", "default": all_roles})
    # int64 adds (position ids) are left alone; SDPA covers the attention matmuls and softmax
    assert info["by_op"] == {"add": 6, "layer_norm": 5, "linear": 14, "scaled_dot_product_attention": 2, "gelu": 2}
    sdpa = mg.model.get_submodule("bert.encoder.layer.0.attention.self.sdpa")
    assert isinstance(sdpa, QuantizedSDPA)
    assert set(sdpa.quantizers()) == {"q", "k", "scores", "softmax_in", "probs", "probs_matmul", "v", "out"}
    assert (logits(mg, inputs) - ref).abs().max() < 5e-3
    # padding stays masked: quantizing the softmax input happens before the mask is added
    mask = inputs["attention_mask"].clone()
    ids = inputs["input_ids"].clone()
    ids[-1, mask[-1] == 0] = 7
    changed = dict(inputs, input_ids=ids)
    assert torch.equal(logits(mg, inputs)[-1], logits(mg, changed)[-1])


def test_matmul_and_softmax_entries_reach_attention(bert_graph: ForgeGraph) -> None:
    cfg = {"by": "type", "softmax": {"config": {"name": "integer", "data_out_width": 8, "data_out_frac_width": 7}}}
    mg, info = quantize_transform_pass(bert_graph.copy(), cfg)
    assert info["by_op"] == {"scaled_dot_product_attention": 2}
    assert set(mg.model.get_submodule("bert.encoder.layer.1.attention.self.sdpa").quantizers()) == {"probs"}


def test_afno_complex_fft_path() -> None:
    mg = ForgeGraph(make_gpt("afno"), example_inputs=torch.randint(0, 64, (2, 16)))
    idx = torch.randint(0, 64, (2, 16))
    ref = mg(idx)
    cfg = {"by": "type", "fft": fixed(16, 10, ("data_in", "data_out")),
           "mul": fixed(16, 10, ("data_in",)), "einsum": {"config": {"name": "mxint", "data_in_width": 8,
                                                                     "weight_width": 8}}}
    mg, info = quantize_transform_pass(mg, cfg)
    assert info["by_op"]["fft_rfft"] == 4 and info["by_op"]["fft_irfft"] == 2
    out = mg(idx)
    assert 0 < (out - ref).abs().max() < 1e-2 * ref.abs().max()
    rfft = next(n for n in mg.nodes if n.name == "fft_rfft")
    q_out = mg.model.get_submodule(get_meta(rfft).software.get(QuantizationRecord).quantizers["data_out"])
    z = torch.randn(3, 5, dtype=torch.complex64) * 3
    qz = q_out(z)
    assert qz.is_complex()
    assert torch.equal(torch.view_as_real(qz), q_out(torch.view_as_real(z).contiguous()))  # real and imag parts
    assert torch.equal(qz.real * 1024, torch.round(qz.real * 1024))


def test_calibration_sets_scales_and_metadata(bert_graph: ForgeGraph) -> None:
    cfg = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8,
                                               "data_in_symmetric": False, "weight_width": 8,
                                               "weight_granularity": "per_channel"}}}
    mg, _ = quantize_transform_pass(bert_graph.copy(), cfg)
    inputs = bert_inputs()
    with pytest.raises(RuntimeError, match="not calibrated: run calibrate_transform_pass"):
        logits(mg, inputs)
    data = [bert_inputs(batch=4, seq=9), bert_inputs(batch=2, seq=13)]
    mg, info = calibrate_analysis_pass(mg, {"data": data, "method": "minmax"})
    assert info["batches"] == 2 and info["scales_set"] == 14 and info["unseen"] == 0
    rec = get_meta(mg.node("classifier")).software.get(CalibrationRecord)
    assert rec is not None and rec.method == "minmax" and rec.num_batches == 2
    stats = rec.stats["data_in"]
    q = mg.model.get_submodule("classifier.data_in_quantizer")
    assert q.calibrated and stats["scale"] == pytest.approx(float(q.scale))
    assert stats["scale"] == pytest.approx((max(stats["max"], 0) - min(stats["min"], 0)) / 255)
    ref = logits(bert_graph, inputs)
    assert (logits(mg, inputs) - ref).abs().max() < 0.02

    pct, _ = quantize_transform_pass(bert_graph.copy(), cfg)
    pct, _ = calibrate_analysis_pass(pct, {"data": data, "method": "percentile", "percentile": 99.0})
    p_stats = get_meta(pct.node("classifier")).software.get(CalibrationRecord).stats["data_in"]
    assert p_stats["hi"] - p_stats["lo"] < stats["hi"] - stats["lo"]


def test_report_sqnr_and_bits(bert_graph: ForgeGraph) -> None:
    data = [bert_inputs()]
    results = {}
    for width in (8, 16):
        mg, _ = quantize_transform_pass(bert_graph.copy(), {"by": "type", "linear": fixed(width, width - 3)})
        _, rep = quantization_report_analysis_pass(mg, {"data": data})
        results[width] = rep
        assert len(rep["nodes"]) == 14 and all(r["sqnr_db"] > 0 for r in rep["nodes"])
        assert rep["avg_weight_bits"] == width and rep["avg_activation_bits"] == width
    assert results[16]["output_sqnr_db"] > results[8]["output_sqnr_db"] + 20
    mx, _ = quantize_transform_pass(bert_graph.copy(), {"by": "type", "linear": {"config": {
        "name": "mxint", "data_in_width": 8, "weight_width": 8}}})
    _, rep = quantization_report_analysis_pass(mx, {"data": data, "baseline": bert_graph})
    assert rep["avg_weight_bits"] == 8.25 and rep["output_sqnr_db"] > 20


def test_export_reload_identical(bert_graph: ForgeGraph, tmp_path: Path) -> None:
    cfg = {"by": "type",
           "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "weight_width": 8,
                                 "weight_granularity": "per_channel", "data_in_granularity": "per_channel"}},
           "matmul": {"config": {"name": "minifloat", "data_in_width": 8, "data_in_exponent_width": 4,
                                 "data_in_special": "fn", "weight_width": 8, "weight_exponent_width": 5}},
           "softmax": {"config": {"name": "integer", "data_out_width": 8, "data_out_frac_width": 7}},
           "gelu": {"config": {"name": "mxfp", "data_in_width": 8, "data_in_exponent_width": 4}},
           "layer_norm": {"config": {"name": "block_fp", "data_in_width": 6, "data_in_block_size": 16}}}
    mg, _ = quantize_transform_pass(bert_graph.copy(), cfg)
    mg, _ = calibrate_analysis_pass(mg, {"data": [bert_inputs()]})
    inputs = bert_inputs(batch=2, seq=7)
    out = logits(mg, inputs)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "q"))
    assert torch.equal(logits(loaded, inputs), out)
    for name in ("classifier", "bert_encoder_layer_0_attention_self_sdpa", "gelu"):
        for rec_cls in (QuantizationRecord, CalibrationRecord):
            assert get_meta(loaded.node(name)).software.get(rec_cls) == get_meta(mg.node(name)).software.get(rec_cls)
    q = loaded.model.get_submodule("classifier.data_in_quantizer")
    assert isinstance(q, Quantize) and q.calibrated and q.scale.shape == (32,)


def test_quantize_module_complex_and_scalar() -> None:
    spec = RoleSpec.from_json({"format": "integer", "width": 8, "frac_width": 4})
    q = Quantize(spec)
    assert torch.equal(q(torch.tensor(0.3)), torch.tensor(0.3125))
    assert torch.equal(q(torch.tensor([3, 4])), torch.tensor([3, 4]))  # integer tensors pass through
    q.enabled = False
    x = torch.randn(4)
    assert q(x) is x


class _Toy(nn.Module):
    """Every remaining op kind: conv1d, conv2d, relu, functional linear on a parameter, matmul, bmm,
    softmax, mul, add (fx frontend: torch functions and operators)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(2, 3, 3, padding=1)
        self.act = nn.ReLU()
        self.proj = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv1(x)).transpose(1, 2)  # (B, T, 8)
        h = torch.nn.functional.linear(h, self.proj)
        att = torch.softmax(torch.matmul(h, h.transpose(1, 2)), dim=-1)
        h = torch.bmm(att, h) * 0.5 + h
        return h.mean(dim=(1, 2)) + torch.relu(self.conv2(img)).mean(dim=(1, 2, 3))


def test_conv_matmul_bmm_relu_softmax_on_fx_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, img = torch.randn(2, 4, 10), torch.randn(2, 2, 6, 6)
    mg = ForgeGraph(_Toy().eval(), example_inputs=(x, img), frontend="fx")
    ref = mg(x, img)
    mg, info = quantize_transform_pass(mg, {"by": "type", "default": fixed(16, 10, ("data_in", "weight", "bias",
                                                                                    "data_out"))})
    assert info["by_op"] == {"conv1d": 1, "relu": 2, "linear": 1, "matmul": 1, "softmax": 1, "bmm": 1, "mul": 1,
                             "add": 2, "conv2d": 1}
    out = mg(x, img)
    assert 0 < (out - ref).abs().max() < 1e-2
    lin = next(n for n in mg.nodes if n.name == "linear")
    assert get_meta(lin).software.get(QuantizationRecord).quantizers.keys() == {"data_in_0", "weight_1", "data_out"}
    w_q = mg.model.get_submodule("fxforge_quant.linear__weight_1")
    assert isinstance(w_q, Quantize) and w_q.is_param  # a get_attr parameter: quantized from itself
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "toy"))
    assert torch.equal(loaded(x, img), out)


def test_attention_function_node_causal_gpt(tmp_path: Path) -> None:
    """GPT's causal F.scaled_dot_product_attention (a call_function) becomes a QuantizedSDPA."""
    idx = torch.randint(0, 64, (2, 12))
    mg = ForgeGraph(make_gpt("attn"), example_inputs=idx, frontend="fx")
    ref = mg(idx)
    cfg = {"by": "type", "matmul": fixed(16, 12, ("data_in", "weight", "data_out")),
           "softmax": fixed(16, 14, ("data_in", "data_out"))}
    mg, info = quantize_transform_pass(mg, cfg)
    assert info["by_op"] == {"scaled_dot_product_attention": 2}
    node = mg.node("scaled_dot_product_attention")  # the node keeps its name, now a call_module
    assert node.op == "call_module"
    sdpa = mg.model.get_submodule(str(node.target))
    assert isinstance(sdpa, QuantizedSDPA) and sdpa.is_causal
    assert get_meta(node).software.get(QuantizationRecord).config["softmax"]["data_in_frac_width"] == 14
    out = mg(idx)
    assert 0 < (out - ref).abs().max() < 1e-2
    # causality survives: changing the last token leaves earlier positions untouched
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 64
    assert torch.equal(mg(idx2)[:, :-1], out[:, :-1])
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "gpt"))
    assert torch.equal(loaded(idx), out)


class _RuntimeScaleAttention(nn.Module):
    """SDPA whose scale is computed from the query's shape (a graph node under the fx frontend)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=q.size(-1) ** -0.5)


def test_attention_with_a_run_time_scale_is_refused_naming_the_node() -> None:
    """QuantizedSDPA stores dropout_p and scale as constants: a computed one is refused with the node and the
    way out (exclude it), not a raw TypeError from float(Node)."""
    x = torch.randn(2, 3, 5, 8)
    mg = ForgeGraph(_RuntimeScaleAttention(), example_inputs=(x, x, x), frontend="fx")
    cfg = {"by": "type", "softmax": {"config": {"name": "integer", "data_out_width": 8, "data_out_frac_width": 7}}}
    with pytest.raises(PassError, match=r"scaled_dot_product_attention.*'scale' is computed at run time \(node "
                                        r"'pow_1'\).*exclude it with by='name'"):
        quantize_transform_pass(mg, cfg)
