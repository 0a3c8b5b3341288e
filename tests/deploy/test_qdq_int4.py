"""<= 4-bit weights export to ONNX as real INT4 / UINT4 initializers (opset 21): the file holds packed 4-bit
codes that onnx reads back as fxforge's codes, ONNX Runtime runs it in the subprocess check within one output step
of fxforge's simulated outputs at two shapes, mixed w4/w8 graphs keep ORT's integer MatMuls for the 8-bit layers,
and what QDQ cannot express (4-bit MXINT) is still refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TinyMLP, bert_inputs, make_tiny_bert
from onnx import TensorProto, helper, numpy_helper

from fxforge import ForgeGraph
from fxforge.deploy import DeployError, DeployManifest, export_onnx
from fxforge.deploy.qdq import to_qdq
from fxforge.deploy.qdq_formats import QdqLinear
from fxforge.deploy.qdq_int4 import INT4_OPSET, int4_blocker, int4_weights, store_int4, store_int4_file
from fxforge.passes.quantize import calibrate_transform_pass, quantize_transform_pass

NAMES = ["input_ids", "attention_mask"]
LINEARS = 14  # tiny BERT: 2 layers x 6 linears + pooler + classifier
FOUR_BIT = (TensorProto.INT4, TensorProto.UINT4)


def _fixed(weight: int) -> dict[str, Any]:
    return {"name": "integer", "data_in_width": 8, "data_in_frac_width": "auto", "weight_width": weight,
            "weight_frac_width": "auto"}


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=NAMES).eval()


@pytest.fixture(scope="module")
def mlp() -> ForgeGraph:
    torch.manual_seed(0)
    return ForgeGraph(TinyMLP().eval(), example_inputs=(torch.randn(4, 8),))


def _quantized(bert: ForgeGraph, cfg: dict[str, Any]) -> ForgeGraph:
    mg, _ = quantize_transform_pass(bert.copy(), cfg)
    batches = [bert_inputs(batch=4, seq=16, labels=False), bert_inputs(batch=2, seq=30, labels=False)]
    mg, _ = calibrate_transform_pass(mg, {"data": batches})
    return mg


def _codes(path: Path) -> dict[str, Any]:
    return {t.name: t for t in onnx.load(path).graph.initializer if t.name.endswith(".codes")}


def _check_passed(manifest: DeployManifest) -> None:
    assert manifest.check is not None and manifest.check.passed and not manifest.check.fxforge_importable
    shapes = manifest.check.shapes
    assert len(shapes) == 2 and shapes[0].shapes != shapes[1].shapes
    assert all(s.bound_kind == "quant_steps" and s.error <= 1.0 for s in shapes), shapes
    print("max |ORT - fxforge| in output steps:", [s.error for s in shapes])


def _optimized_ops(path: Path) -> Counter[str]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(path.with_suffix(".opt.onnx"))
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(path.with_suffix(".opt.onnx")).graph.node)


def test_w4a8_mlp_stores_int4_and_uint4_weights_and_ort_matches(mlp: ForgeGraph, tmp_path: Path) -> None:
    # the fast end-to-end test: fc1 signed fixed point (INT4), fc2 asymmetric per channel (UINT4, zero points);
    # 2-D inputs go through Unsqueeze after their input QDQ, the pattern ORT 1.32 fails to load at opset 21 with
    # int8 activations (its QDQ propagation), which store_int4 makes uint8
    uint4 = {"name": "scaled_integer", "data_in_width": 8, "weight_width": 4, "weight_symmetric": False,
             "weight_granularity": "per_channel"}
    mg, _ = quantize_transform_pass(mlp.copy(), {"by": "name", "fc1": {"config": _fixed(4)}, "fc2": {"config": uint4}})
    mg, _ = calibrate_transform_pass(mg, {"data": [torch.randn(32, 8, generator=torch.Generator().manual_seed(0)) * 2]})
    manifest = export_onnx(mg, tmp_path / "mlp")
    _check_passed(manifest)
    model = onnx.load(tmp_path / "mlp" / "model.onnx")
    inits = {t.name: t for t in model.graph.initializer}
    assert {n: t.data_type for n, t in inits.items() if n.endswith(".codes")} == \
        {"fc1.codes": TensorProto.INT4, "fc2.codes": TensorProto.UINT4}
    q_zero = [inits[n.input[2]].data_type for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert q_zero and set(q_zero) == {TensorProto.UINT8}  # activations: int8 codes + 128, same values


@pytest.mark.slow_deploy  # a tiny BERT export + subprocess check (~10 s); the MLP test above is the fast one
def test_w4a8_bert_stores_int4_weights_and_ort_matches(bert: ForgeGraph, tmp_path: Path) -> None:
    mg = _quantized(bert, {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": _fixed(4)}})
    manifest = export_onnx(mg, tmp_path / "w4a8")
    assert "int4 weights held in ONNX INT4/UINT4 initializers" in manifest.quantization
    _check_passed(manifest)  # ORT in a fresh process, fxforge not importable, two shapes, <= 1 step
    path = tmp_path / "w4a8" / "model.onnx"
    model = onnx.load(path)
    assert next(o.version for o in model.opset_import if o.domain == "") == INT4_OPSET and model.ir_version >= 10
    codes = _codes(path)
    assert len(codes) == LINEARS and {t.data_type for t in codes.values()} == {TensorProto.INT4}
    # packed two per byte, and onnx reads back exactly fxforge's codes (element 2i in the low nibble)
    layers = {f"{n}.codes": m for n, m in to_qdq(mg).graph.model.named_modules() if isinstance(m, QdqLinear)}
    for name, tensor in codes.items():
        assert len(tensor.raw_data) == (int(np.prod(tensor.dims)) + 1) // 2
        assert np.array_equal(numpy_helper.to_array(tensor).astype(np.int8), layers[name].codes.numpy())
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in codes]
    inits = {t.name: t for t in model.graph.initializer}
    assert len(dq) == LINEARS and all(inits[n.input[2]].data_type == TensorProto.INT4 for n in dq)
    # ORT has no integer kernel for 4-bit weights: it dequantizes them and runs float MatMuls (measured)
    ops = _optimized_ops(path)
    assert ops["MatMulIntegerToFloat"] == 0 and ops["MatMul"] >= LINEARS, ops
    print(f"w4a8 tiny BERT artifact: {manifest.artifact_bytes} bytes, 4-bit codes "
          f"{sum(len(t.raw_data) for t in codes.values())} bytes (int8 codes: "
          f"{sum(int(np.prod(t.dims)) for t in codes.values())})")


@pytest.mark.slow_deploy  # a tiny BERT export + subprocess check (~10 s)
def test_mixed_w4_w8_graph_keeps_integer_matmuls_for_8_bit_layers(bert: ForgeGraph, tmp_path: Path) -> None:
    # layer 0's FFN: signed fixed point 4-bit (INT4); layer 1's: asymmetric per-channel 4-bit (UINT4 + zero points)
    uint4 = {"name": "scaled_integer", "data_in_width": 8, "weight_width": 4, "weight_symmetric": False,
             "weight_granularity": "per_channel"}
    cfg = {"by": "regex", r"bert\.encoder\.layer\.0\.(intermediate|output)\.dense": {"config": _fixed(4)},
           r"bert\.encoder\.layer\.1\.(intermediate|output)\.dense": {"config": uint4},
           r".*(query|key|value|dense|classifier)": {"config": _fixed(8)}}
    mg = _quantized(bert, cfg)
    qg = to_qdq(mg)
    weights = int4_weights(qg.graph.model)
    assert weights == {f"bert.encoder.layer.{i}.{p}.dense.codes": i == 0 for i in (0, 1)
                       for p in ("intermediate", "output")}
    manifest = export_onnx(mg, tmp_path / "mixed")
    assert manifest.quantization.startswith("qdq w4/8a8") and "int4 weights held in ONNX INT4/UINT4" \
        in manifest.quantization
    _check_passed(manifest)
    path = tmp_path / "mixed" / "model.onnx"
    types = {name: t.data_type for name, t in _codes(path).items()}
    assert {n: types[n] for n in weights} == {n: TensorProto.INT4 if s else TensorProto.UINT4
                                              for n, s in weights.items()}
    assert Counter(t for n, t in types.items() if n not in weights) == {TensorProto.INT8: LINEARS - 4}
    ops = _optimized_ops(path)
    assert ops["MatMulIntegerToFloat"] == LINEARS - 4, ops  # the 8-bit layers still run as integer MatMuls


def test_mxint4_layer_is_still_refused(mlp: ForgeGraph, tmp_path: Path) -> None:
    mxint = {"name": "mxint", "data_in_width": 4, "weight_width": 4, "data_in_block_size": 16,
             "weight_block_size": 16}
    mg, _ = quantize_transform_pass(mlp.copy(), {"by": "name", "fc1": {"config": _fixed(4)}, "fc2": {"config": mxint}})
    mg, _ = calibrate_transform_pass(mg, {"data": [torch.randn(32, 8)]})
    with pytest.raises(DeployError, match=r"to_qdq: fc2 \(weight\) is quantized as mxint\(.*width=4"):
        export_onnx(mg, tmp_path / "mx")
    assert not (tmp_path / "mx").exists()


def test_weight_only_4_bit_layer_keeps_int8_storage_and_says_why(mlp: ForgeGraph) -> None:
    # fc2 has no input quantizer: ORT at opset 21 would run it as MatMulNBits, requantizing its float input
    weight_only = {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"}
    mg, _ = quantize_transform_pass(mlp.copy(), {"by": "name", "fc1": {"config": _fixed(4)},
                                                 "fc2": {"config": weight_only}})
    mg, _ = calibrate_transform_pass(mg, {"data": [torch.randn(32, 8)]})
    qg = to_qdq(mg)
    assert "int4 weights held in int8 (not INT4: weight-only or dynamic-input layers) initializers" in qg.description
    assert int4_weights(qg.graph.model) == {}
    assert int4_blocker(qg.graph.model) == "fc2 is weight-only, and ONNX Runtime runs such layers as MatMulNBits " \
        "at opset 21"


def _tiny(op: str, opset: int, codes: np.ndarray, **attrs: Any) -> Any:
    """x @ DequantizeLinear(codes) followed by ``op`` at ``opset``: a hand-made exported file."""
    nodes = [helper.make_node("DequantizeLinear", ["w.codes", "s", "z"], ["w"], name="dq"),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node(op, ["y"], ["out"], name="last", **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2])],
                              [numpy_helper.from_array(codes, "w.codes"),
                               numpy_helper.from_array(np.array(0.5, np.float32), "s"),
                               numpy_helper.from_array(np.array(0, codes.dtype), "z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def test_store_int4_refuses_what_it_cannot_store_exactly() -> None:
    ok = np.array([[-8, 7], [3, -1]], np.int8)
    model = _tiny("Relu", 18, ok)
    assert store_int4(model, {"w.codes": True}) == 1 and model.opset_import[0].version == INT4_OPSET
    x = np.array([[1.0, 2.0]], np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # ORT's DequantizeLinear kernel
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert np.array_equal(session.run(None, {"x": x})[0], np.maximum(x @ (ok.astype(np.float32) * 0.5), 0))
    with pytest.raises(DeployError, match=r"weight w\.codes holds values in \[-9, 7\], outside the INT4 range"):
        store_int4(_tiny("Relu", 18, np.array([[-9, 7], [0, 0]], np.int8)), {"w.codes": True})
    with pytest.raises(DeployError, match=r"node 'last' is a GroupNormalization, whose definition changes"):
        store_int4(_tiny("GroupNormalization", 18, ok, num_groups=1), {"w.codes": True})
    with pytest.raises(DeployError, match=r"0 initializers .* named like 'other\.codes'"):
        store_int4(_tiny("Relu", 18, ok), {"other.codes": True})
    shared = _tiny("Relu", 18, ok)
    shared.graph.node.append(helper.make_node("Identity", ["w.codes"], ["w2"], name="reads_codes"))
    with pytest.raises(DeployError, match=r"weight w\.codes is read by .*Identity"):
        store_int4(shared, {"w.codes": True})


def test_weight_only_4_bit_layer_is_refused_where_ort_would_requantize_its_input(tmp_path: Path) -> None:
    # x (float) @ DQ(W): at opset 21 ORT's optimizer makes this MatMulNBits, which quantizes x to int8 (measured:
    # 2.5276 for 2.5 in this graph): refused, not exported as different math
    path = tmp_path / "weight_only.onnx"
    onnx.save(_tiny("Relu", 18, np.array([[-8, 7], [3, -1]], np.int8)), path)
    with pytest.raises(DeployError, match=r"weight-only layers.*w\.codes.*MatMulNBits.*quantizes their float"):
        store_int4_file(path, {"w.codes": True})
