"""Linears with dynamic 8-bit inputs export to ONNX as DynamicQuantizeLinear -> MatMulInteger, which ONNX Runtime
fuses (with the bias) into its dynamic int8 kernels; fxforge's dynamic quantizer and DynamicQuantizeLinear give
the same codes; the deploy check bounds the artifact by the steps the dynamic quantizers took; what
DynamicQuantizeLinear cannot compute (symmetric) stays refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import bert_inputs, make_tiny_bert
from onnx import TensorProto, helper

from fxforge import ForgeGraph
from fxforge.deploy import DeployError, export_onnx
from fxforge.deploy.qdq import to_qdq
from fxforge.deploy.qdq_dynamic import QdqDynamicLinear, dynamic_steps
from fxforge.deploy.qdq_formats import QdqLinear
from fxforge.passes.quantize import QuantizedLinear, calibrate_transform_pass, quantize_transform_pass
from fxforge.passes.quantize.fixed import scale_zero_point, tensor_range

NAMES = ["input_ids", "attention_mask"]
LINEARS = 14  # tiny BERT: 2 layers x 6 linears + pooler + classifier
DYNAMIC = {"name": "scaled_integer", "data_in_width": 8, "data_in_symmetric": False, "data_in_dynamic": True,
           "weight_width": 8, "weight_symmetric": True, "weight_granularity": "per_channel"}
STATIC = {**DYNAMIC, "data_in_dynamic": False}


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=NAMES).eval()


def _quantized(bert: ForgeGraph, cfg: dict[str, Any]) -> ForgeGraph:
    mg, _ = quantize_transform_pass(bert.copy(), cfg)
    mg, _ = calibrate_transform_pass(mg, {"data": [bert_inputs(batch=4, seq=16, labels=False)]})
    return mg.eval()


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_fxforge_dynamic_codes_are_dynamic_quantize_linear_codes() -> None:
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("q", TensorProto.UINT8, [None]),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("z", TensorProto.UINT8, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    cases = [torch.zeros(7), torch.full((5,), -2.5), torch.tensor([-1.0, 0.5, 2.5, 3.0])]
    cases += [torch.randn(int(n), generator=gen) * float(s) + float(m) for n, s, m in
              zip(torch.randint(1, 400, (200,), generator=gen), torch.rand(200, generator=gen) * 30,
                  torch.randn(200, generator=gen) * 3, strict=True)]
    for x in cases:
        q, s, z = session.run(None, {"x": x.numpy()})
        scale, zero_point = scale_zero_point(*tensor_range(x), 8, symmetric=False)
        codes = torch.clamp(torch.round(x / scale) + zero_point, 0, 255)
        assert np.float32(scale) == s and int(zero_point) == int(z)
        assert np.array_equal(codes.numpy().astype(np.uint8), q)


def test_qdq_dynamic_linear_equals_the_simulated_layer(bert: ForgeGraph) -> None:
    mg = _quantized(bert, {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": DYNAMIC}})
    qg = to_qdq(mg)
    name = "bert.encoder.layer.1.intermediate.dense"
    simulated, exported = mg.model.get_submodule(name), qg.graph.model.get_submodule(name)
    assert isinstance(simulated, QuantizedLinear) and isinstance(exported, QdqDynamicLinear)
    x = torch.randn(3, 11, simulated.in_features) * 2 + 0.3
    with torch.no_grad():
        a, b = simulated(x), exported(x)
    # the same integer products; only float rounding of the simulated matmul differs
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max())), float((a - b).abs().max())


def test_dynamic_int8_bert_exports_as_ort_dynamic_kernels(bert: ForgeGraph, tmp_path: Path) -> None:
    mg = _quantized(bert, {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": DYNAMIC}})
    qg = to_qdq(mg)
    assert sum(isinstance(m, QdqDynamicLinear) for m in qg.graph.model.modules()) == LINEARS
    assert qg.output_step is None and f"{LINEARS} with dynamic uint8 inputs" in qg.description
    manifest = export_onnx(mg, tmp_path / "dyn")
    assert manifest.check is not None and manifest.check.passed and len(manifest.check.shapes) == 2
    assert len({repr(s.shapes) for s in manifest.check.shapes}) == 2  # two different input shapes checked
    assert all(s.bound_kind == "quant_steps" for s in manifest.check.shapes)
    path = tmp_path / "dyn" / manifest.artifact
    ops = _ops(path)
    # query, key and value quantize the same input: the exporter's optimizer keeps one DynamicQuantizeLinear
    assert ops["MatMulInteger"] == LINEARS and ops["DynamicQuantizeLinear"] == LINEARS - 2 * 2, ops
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    fused = _ops(tmp_path / "opt.onnx")
    # every linear (bias included) runs as one of ORT's dynamic int8 kernels; nothing is left in float
    assert fused["DynamicQuantizeMatMul"] + fused["MatMulIntegerToFloat"] == LINEARS, fused
    assert fused["MatMulInteger"] == 0 and fused["Cast"] <= 3, fused


@pytest.mark.slow_deploy  # a second export and check (~10 s); the all-dynamic one above stays in make test
def test_mixed_static_and_dynamic_inputs_export_and_check(bert: ForgeGraph, tmp_path: Path) -> None:
    cfg = {"by": "regex", r".*intermediate\.dense|.*output\.dense": {"config": DYNAMIC},
           r".*(query|key|value|dense|classifier)": {"config": STATIC}}
    mg = _quantized(bert, cfg)
    qg = to_qdq(mg)
    kinds = Counter(type(m).__name__ for m in qg.graph.model.modules() if isinstance(m, QdqLinear | QdqDynamicLinear))
    assert kinds["QdqDynamicLinear"] == 6 and kinds["QdqLinear"] == LINEARS - 6, kinds
    assert qg.output_step is not None  # the static inputs have fixed steps; the check adds the dynamic ones'
    manifest = export_onnx(mg, tmp_path / "mixed")
    assert manifest.check is not None and manifest.check.passed


def test_dynamic_step_is_the_largest_scale_taken(bert: ForgeGraph) -> None:
    mg = _quantized(bert, {"by": "name", "classifier": {"config": DYNAMIC}})
    layer = mg.model.get_submodule("classifier")
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    inputs = [bert_inputs(batch=2, seq=9, labels=False), bert_inputs(batch=3, seq=5, labels=False)]
    with dynamic_steps(mg.model) as taken, torch.no_grad():
        for x in inputs:
            mg(**x)
    handle.remove()
    step = max(taken)
    expected = max(float(scale_zero_point(*tensor_range(x), 8, symmetric=False)[0]) for x in seen)
    assert len(seen) == 2 and step == pytest.approx(expected, rel=0, abs=0)


@pytest.mark.parametrize("change, words", [
    ({"data_in_symmetric": True}, "computed from each batch"),
    ({"data_in_width": 6}, "computed from each batch"),
])
def test_what_dynamic_quantize_linear_cannot_compute_is_refused(bert: ForgeGraph, change: dict[str, Any],
                                                                 words: str) -> None:
    mg, _ = quantize_transform_pass(bert.copy(), {"by": "name", "classifier": {"config": {**DYNAMIC, **change}}})
    with pytest.raises(DeployError, match=r"to_qdq: classifier\.data_in_quantizer .*" + words +
                       r".*DynamicQuantizeLinear"):
        to_qdq(mg)
