"""QAT with the HF Trainer on a quantized graph, and lowering scaled int8 to real int8 kernels."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.metadata import get_meta
from fxforge.passes.base import PassError
from fxforge.passes.quantize import (
    Int8Linear,
    LoweringRecord,
    QuantizedLinear,
    calibrate_analysis_pass,
    lower_int8_transform_pass,
    quantize_transform_pass,
)
from fxforge.passes.quantize.lower import BACKENDS

INT8 = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_dynamic": True,
                                            "data_in_symmetric": False, "weight_width": 8,
                                            "weight_granularity": "per_channel"}}}


@pytest.fixture(scope="module")
def bert_graph() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()


def test_qat_step_with_hf_trainer(tmp_path: Path) -> None:
    from fxforge.data import get_tokenized_dataset, get_trainer
    from fxforge.models.bert import tiny_bert

    model = tiny_bert(num_hidden_layers=1, max_position_embeddings=32)
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "labels"])
    cfg = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 5,
                                               "weight_width": 8, "weight_frac_width": 7}}}
    mg, _ = quantize_transform_pass(mg, cfg)
    ds, tok = get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=24, limit=8,
                                    test_limit=4)
    trainer = get_trainer(mg.model, ds, tok, output_dir=str(tmp_path), max_steps=2, learning_rate=1e-2,
                          per_device_train_batch_size=4, training_args={"eval_strategy": "no"})
    layer = mg.model.get_submodule("bert.encoder.layer.0.intermediate.dense")
    assert isinstance(layer, QuantizedLinear)
    before = layer.weight.detach().clone()
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(layer.weight.detach(), before)  # STE gradients reached the fp32 weights
    # the shadow weights moved, the quantized ones stay on the fixed-point grid
    assert layer.weight_quantizer is not None
    wq = layer.weight_quantizer(layer.weight.detach())
    assert torch.equal(wq * 128, torch.round(wq * 128))


@pytest.mark.parametrize(("backend", "static"), [("onednn", True), ("onednn", False), ("fbgemm", False)])
def test_lower_int8_close_to_fp32_and_reloads(bert_graph: ForgeGraph, tmp_path: Path, backend: str,
                                              static: bool) -> None:
    mg = bert_graph.copy()
    inputs = bert_inputs(labels=False, batch=4, seq=16)
    with torch.no_grad():
        ref = mg(**inputs).logits
    cfg = copy.deepcopy(INT8)
    cfg["linear"]["config"]["data_in_dynamic"] = not static
    mg, _ = quantize_transform_pass(mg, cfg)
    if static:
        mg, _ = calibrate_analysis_pass(mg, {"data": [inputs]})
    with torch.no_grad():
        simulated = mg(**inputs).logits
    mg, info = lower_int8_transform_pass(mg, {"strict": True, "backend": backend})
    assert info["lowered"] == 14 and info["skipped"] == {} and info["static_inputs"] == (14 if static else 0)
    assert info["fused_activations"] == (2 if backend == "onednn" else 0)  # intermediate.dense + GELU
    layer = mg.model.get_submodule("bert.encoder.layer.0.intermediate.dense")
    assert isinstance(layer, Int8Linear) and layer.weight_int8.dtype == torch.int8
    assert layer.post_op == ("gelu" if backend == "onednn" else "none")
    rec = get_meta(mg.node("classifier")).software.get(LoweringRecord)
    assert rec is not None and ("static" in rec.activation) == static
    with torch.no_grad():
        lowered = mg(**inputs).logits
    scale = ref.abs().max()
    assert (lowered - ref).abs().max() < 0.05 * scale
    # static inputs: the kernel computes the simulation, unless this CPU's kernel needs 7-bit input codes
    reduced = layer.effective_reduce_range
    assert info["reduce_range"] is reduced and ("7-bit" in rec.activation) == reduced
    assert (lowered - simulated).abs().max() < (0.01 if static and not reduced else 0.05) * scale
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "int8"))
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, lowered)
    assert loaded.model.get_submodule("classifier").weight_int8.dtype == torch.int8
    copied = mg.copy()
    with torch.no_grad():
        assert torch.equal(copied(**inputs).logits, lowered)


def test_int8_weights_equal_simulated_weights() -> None:
    from fxforge.passes.quantize.config import QuantizeConfig

    fp = nn.Linear(64, 48)
    q = QuantizedLinear.from_float(fp, QuantizeConfig.from_dict(INT8).rule_for("x", "linear")[1])
    lin = Int8Linear.from_linear(fp)
    assert q.weight_quantizer is not None
    assert torch.equal(lin.dequantized_weight(), q.weight_quantizer(fp.weight.detach()))
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert (lin(x) - fp(x)).abs().max() < 0.05 * fp(x).abs().max()


def test_lower_int8_refuses_other_formats(bert_graph: ForgeGraph) -> None:
    mg = bert_graph.copy()
    cfg = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": 7}}}
    mg, _ = quantize_transform_pass(mg, cfg)
    with pytest.raises(PassError, match="weight is not 8-bit symmetric scaled_integer"):
        lower_int8_transform_pass(mg, {"strict": True})
    with pytest.raises(PassError, match="no scaled-int8 quantized linear .*matched"):
        lower_int8_transform_pass(mg)


def test_report_on_lowered_graph_needs_a_baseline(bert_graph: ForgeGraph) -> None:
    from fxforge.passes.quantize import quantization_report_analysis_pass

    fp32 = bert_graph
    mg, _ = quantize_transform_pass(fp32.copy(), INT8)
    mg, _ = lower_int8_transform_pass(mg)
    data = [bert_inputs(labels=False)]
    with pytest.raises(PassError, match="pass {'baseline'"):
        quantization_report_analysis_pass(mg, {"data": data})
    _, rep = quantization_report_analysis_pass(mg, {"data": data, "baseline": fp32})
    assert rep["output_sqnr_db"] > 15 and len(rep["nodes"]) == 14


def _exact_int8(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What an int8 GEMM must compute: the quantized input times the int8 weight, exactly (int32 sums)."""
    xq, scale, zero_point = lin.quantize_input(x.reshape(-1, x.shape[-1]))
    acc = (xq.long() - zero_point) @ lin.weight_int8.long().T  # exact integer accumulation
    y = acc.double() * scale * lin.weight_scale.double() + (0 if lin.bias is None else lin.bias.double())
    return y.float().reshape(*x.shape[:-1], lin.out_features)


@pytest.mark.parametrize(("backend", "static"), [("onednn", True), ("onednn", False), ("fbgemm", False)])
@pytest.mark.parametrize("in_features", [64, 256])
def test_int8_kernel_computes_exact_integer_products(backend: str, static: bool, in_features: int) -> None:
    # Inputs whose uint8 codes reach 255 next to large weights: pairs of u8*s8 products exceed int16, which
    # x86 int8 GEMMs without VNNI (vpmaddubsw) saturate. The kernel result must still be the exact integer sum.
    fp = nn.Linear(in_features, 32)
    x = torch.randn(2, 4, in_features) * 3
    input_range = (float(x.abs().max()) / 127.5, 128) if static else None
    lin = Int8Linear.from_linear(fp, backend=backend, input_range=input_range)
    with torch.no_grad():
        y, ref, fp_out = lin(x), _exact_int8(lin, x), fp(x)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (y - fp_out).abs().max() < 0.05 * fp_out.abs().max()


def test_int8_kernel_saturation_probe_forces_reduced_range(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever this CPU is: a kernel that saturates must get 7-bit inputs (codes <= 127), a graph lowered
    # elsewhere (reduce_range=False in its checkpoint) included; a kernel that does not keeps 8 bits.
    from fxforge.passes.quantize import lower

    fp = nn.Linear(64, 16)
    x = torch.randn(3, 64) * 3
    for saturates in (True, False):
        monkeypatch.setattr(lower, "int8_kernel_saturates", lambda backend, s=saturates: s)
        for backend, input_range in (("onednn", (0.05, 128)), ("onednn", None), ("fbgemm", None)):
            lin = Int8Linear.from_linear(fp, backend=backend, input_range=input_range)
            assert lin.effective_reduce_range is saturates
            xq, _, zero_point = lin.quantize_input(x)
            assert int(xq.max()) <= (127 if saturates else 255) and 0 <= zero_point <= (127 if saturates else 255)
            assert int(xq.max()) > 127 or saturates  # 8-bit codes are really used when allowed


def test_int8_kernel_saturation_probe_matches_this_cpu() -> None:
    from fxforge.passes.quantize.lower import int8_kernel_saturates

    vnni = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()
    # fbgemm's int8 GEMM without VNNI adds u8*s8 pairs in 16 bits (vpmaddubsw), which saturates
    assert int8_kernel_saturates("fbgemm") is not vnni
    if vnni:
        assert not any(int8_kernel_saturates(b) for b in BACKENDS)
