"""export_onnx / export_aoti on float graphs: the artifact runs in ONNX Runtime / aoti_load_package at two shapes
within 1e-4 relative of the fxforge graph; captured, LoRA-fused, pruned + shrunk and compiler-optimized graphs
export; fxforge:: kernels are refused naming the op and node; the caller's graph is never changed."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.deploy import DeployError, export_aoti, export_onnx, read_manifest
from fxforge.deploy import export as export_module
from fxforge.deploy.manifest import AxisRange
from fxforge.passes.prune import prune_transform_pass, shrink_transform_pass
from fxforge.passes.quantize import calibrate_transform_pass, lower_weight_only_transform_pass, quantize_transform_pass

BOUND = 1e-4
SHAPES = ((1, 16), (3, 11))  # batch and sequence both differ; batch 1 as the 1x128 benchmark runs it
STATIC_INT8 = {"by": "type", "default": {"config": {"name": None}},
               "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "weight_width": 8,
                                     "weight_granularity": "per_channel"}}}
INT8_SCALED = {"by": "type", "linear": {"config": {"name": "scaled_integer", "weight_width": 8,
                                                   "weight_granularity": "per_channel"}}}


def _relative(got: Any, want: torch.Tensor) -> float:
    return float((torch.as_tensor(got) - want).abs().max() / want.abs().max())


def _ort(path: Path, inputs: dict[str, torch.Tensor]) -> list[Any]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})


def _bert_labels() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()


@pytest.fixture(scope="module")
def bert_onnx(tmp_path_factory: pytest.TempPathFactory) -> tuple[ForgeGraph, Path, Any, str, torch.Tensor]:
    """The tiny BERT captured with labels, exported (and subprocess-checked) once; with its code and outputs
    before the export."""
    mg = _bert_labels()
    x = bert_inputs(batch=2, seq=9)
    with torch.no_grad():
        before = mg(**x).logits
    code = mg.model.code
    out = tmp_path_factory.mktemp("deploy") / "bert"
    manifest = export_onnx(mg, out, source="tiny-bert")
    return mg, out, manifest, code, before


def test_bert_onnx_has_no_labels_and_matches_at_two_shapes(bert_onnx: Any) -> None:
    mg, out, manifest, _, _ = bert_onnx
    model = onnx.load(str(out / "model.onnx"))
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["logits"]
    # torch.onnx's softmax NaN guards are dropped (deploy/onnx_rewrites.py): equal outputs below, padded row included
    assert "Softmax" in {n.op_type for n in model.graph.node} and "IsNaN" not in {n.op_type for n in model.graph.node}
    assert manifest.inputs == ("input_ids", "attention_mask") and manifest.outputs == ("logits",)
    assert manifest.dynamic_axes == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                     "logits": {0: "batch"}}
    for batch, seq in SHAPES:
        x = bert_inputs(batch=batch, seq=seq)
        (got,) = _ort(out / "model.onnx", {k: v for k, v in x.items() if k != "labels"})
        with torch.no_grad():
            want = mg(**x).logits
        assert got.shape == tuple(want.shape) and _relative(got, want) <= BOUND, (batch, seq)


def test_bert_onnx_manifest_records_the_subprocess_check(bert_onnx: Any) -> None:
    _, out, manifest, _, _ = bert_onnx
    assert sorted(p.name for p in out.iterdir()) == ["deploy.json", "model.onnx"]  # weights inside the file
    assert manifest.artifact_bytes == (out / "model.onnx").stat().st_size
    assert read_manifest(out) == manifest and manifest.source == "tiny-bert" and manifest.quantization == "float"
    check = manifest.check
    assert check is not None and check.passed and not check.fxforge_importable and len(check.shapes) == 2
    assert {s.bound_kind for s in check.shapes} == {"relative"} and all(s.error <= BOUND for s in check.shapes)
    batches = sorted(s.shapes["input_ids"][0] for s in check.shapes)
    seqs = {s.shapes["input_ids"][1] for s in check.shapes}
    assert batches[0] == 1 and batches[1] > 1 and len(seqs) == 2


def test_callers_graph_unchanged(bert_onnx: Any) -> None:
    mg, _, _, code, before = bert_onnx
    assert mg.model.code == code
    assert any(n.name == "labels" for n in mg.nodes) and any("shape_guard" in n.name for n in mg.nodes)
    with torch.no_grad():
        assert torch.equal(mg(**bert_inputs(batch=2, seq=9)).logits, before)


def _lora_fused() -> ForgeGraph:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "alpha": 16.0})
    with torch.no_grad():
        for name, p in mg.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # adapters that change the weights they fuse into
    mg, _ = passes.fuse_lora_weights_transform_pass(mg)
    return mg


def _pruned_shrunk() -> ForgeGraph:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    for cfg in ({"weight": {"sparsity": 0.5, "granularity": "head"}},
                {"weight": {"sparsity": 0.5, "granularity": "ffn"}}):
        mg, _ = prune_transform_pass(mg, cfg)
    small, _ = shrink_transform_pass(mg)
    assert small.model.get_submodule("bert.encoder.layer.0.attention.self.query").weight.shape == (16, 32)
    return small


def _optimized() -> ForgeGraph:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    passes.add_common_metadata_analysis_pass(mg)
    mg, info = passes.optimize_graph_pipeline(mg)
    assert info.nodes_after < info.nodes_before
    return mg


@pytest.mark.parametrize("build", [_lora_fused, _pruned_shrunk, _optimized], ids=["lora", "shrunk", "optimized"])
def test_transformed_bert_exports_to_onnx(build: Callable[[], ForgeGraph], tmp_path: Path) -> None:
    mg = build()
    manifest = export_onnx(mg, tmp_path / "out", check=False)
    assert manifest.check is None and manifest.outputs == ("logits",)
    for batch, seq in SHAPES:
        x = bert_inputs(batch=batch, seq=seq, labels=False)
        (got,) = _ort(tmp_path / "out" / "model.onnx", x)
        with torch.no_grad():
            assert _relative(got, mg(**x).logits) <= BOUND, (batch, seq)


def test_zoo_gpt_exports_to_onnx(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 16))).eval()
    with caplog.at_level(logging.WARNING):
        manifest = export_onnx(mg, tmp_path / "gpt", check=False)
    assert not [r for r in caplog.records if "torchvision" in r.getMessage()]  # torch.onnx's registry noise
    assert manifest.inputs == ("idx",) and manifest.outputs == ("output_0",)
    assert manifest.dynamic_axes == {"idx": {0: "batch", 1: "seq"}, "output_0": {0: "batch", 1: "seq"}}
    # the sequence bound torch.export proves (the rotary tables' 32 rows) is recorded and guarded in the file
    assert manifest.axis_ranges["output_0"] == {0: AxisRange(1, None, "idx[0]"), 1: AxisRange(1, 32, "idx[1]")}
    with pytest.raises(Exception, match=r"fxforge range guard: idx axis 1 \(seq\) must be 1\.\.32"):
        _ort(tmp_path / "gpt" / "model.onnx", {"idx": torch.zeros(2, 33, dtype=torch.long)})
    gen = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        idx = torch.randint(0, 64, shape, generator=gen)
        (got,) = _ort(tmp_path / "gpt" / "model.onnx", {"idx": idx})
        with torch.no_grad():
            assert _relative(got, mg(idx)) <= BOUND, shape


def test_fxforge_kernel_refused_naming_op_and_node(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    sim, _ = quantize_transform_pass(mg, INT8_SCALED)
    low, info = lower_weight_only_transform_pass(sim)
    assert set(info.lowered.values()) == {"int8"}
    for export in (export_onnx, export_aoti):
        with pytest.raises(DeployError, match=r"fxforge::int8_weight_only_linear at node '\w+' \(module [\w.]+\)"):
            export(low, tmp_path / "out")
        assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_aoti_package_matches_at_two_batches(tmp_path: Path) -> None:
    mg = _bert_labels()
    manifest = export_aoti(mg, tmp_path / "aoti", check=False)
    assert manifest.format == "aoti" and manifest.inputs == ("input_ids", "attention_mask")
    assert read_manifest(tmp_path / "aoti") == manifest
    package = torch._inductor.aoti_load_package(str(tmp_path / "aoti" / "model.pt2"))
    for batch, seq in SHAPES:
        x = bert_inputs(batch=batch, seq=seq)
        with torch.no_grad():
            (got,) = package(x["input_ids"], x["attention_mask"])
            assert _relative(got, mg(**x).logits) <= BOUND, (batch, seq)
    # compiled with freezing: weights are constants and linears run oneDNN's prepacked GEMM (_linear_pointwise)
    # instead of addmm on the raw weights (MiniLM 8x128 on this CPU: 0.69x eager, 0.99x unfrozen)
    with zipfile.ZipFile(tmp_path / "aoti" / "model.pt2") as package_zip:
        wrapper = "".join(package_zip.read(n).decode() for n in package_zip.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu__linear_pointwise" in wrapper and "aoti_torch_cpu_addmm" not in wrapper, "not frozen"


def test_failed_check_keeps_the_artifact_and_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 16))).eval()
    monkeypatch.setattr(export_module, "FLOAT_BOUND", 1e-12)  # float rounding alone exceeds it
    with pytest.raises(DeployError, match=r"written to .*check failed: error [0-9.e-]+ \(relative\) > bound 1e-12"):
        export_onnx(mg, tmp_path / "gpt")
    manifest = read_manifest(tmp_path / "gpt")
    assert manifest.check is not None and not manifest.check.passed and (tmp_path / "gpt" / "model.onnx").is_file()


@pytest.fixture(scope="module")
def quantized_bert() -> ForgeGraph:
    """The tiny BERT (with labels) with static int8 linears, calibrated."""
    mg, _ = quantize_transform_pass(_bert_labels(), STATIC_INT8)
    mg, _ = calibrate_transform_pass(mg, {"data": [bert_inputs(batch=4, seq=16), bert_inputs(batch=2, seq=30)]})
    return mg


def test_quantized_graph_exports_as_qdq_checked_in_steps(quantized_bert: ForgeGraph, tmp_path: Path) -> None:
    manifest = export_onnx(quantized_bert, tmp_path / "q")
    assert manifest.quantization.startswith("qdq int8 (14 layers") and manifest.outputs == ("logits",)
    check = manifest.check
    assert check is not None and check.passed and {s.bound_kind for s in check.shapes} == {"quant_steps"}
    ops = {n.op_type for n in onnx.load(str(tmp_path / "q" / "model.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    # the artifact as written runs every linear as ORT's integer MatMul (each Q/DQ pair read by one MatMul); no
    # weight is dequantized to float
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "q" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    fused = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert fused.count("MatMulIntegerToFloat") == 14 and "DequantizeLinear" not in fused, sorted(set(fused))


@pytest.mark.slow_deploy  # an AOTI compile: make test-deploy
def test_quantized_graph_compiles_its_simulation_to_aoti(quantized_bert: ForgeGraph, tmp_path: Path) -> None:
    manifest = export_aoti(quantized_bert, tmp_path / "qa")
    assert manifest.quantization.startswith("simulated (28 quantizers")  # 14 weight + 14 input quantizers
    check = manifest.check
    assert check is not None and check.passed and {s.bound_kind for s in check.shapes} == {"quant_steps"}
    assert min(s.shapes["input_ids"][0] for s in check.shapes) == 1


def test_axes_the_guard_fixes_stay_static_with_a_warning(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"], dynamic=False).eval()
    with pytest.warns(UserWarning, match=r"input_ids axis 0 \(batch\) static: .*dynamic=False"):
        manifest = export_onnx(mg, tmp_path / "static", check=False)
    assert manifest.dynamic_axes == {}
    model = onnx.load(str(tmp_path / "static" / "model.onnx"))
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert shape == list(mg.example_inputs.kwargs["input_ids"].shape)  # type: ignore[union-attr]


def test_afno_sequence_axis_static_when_onnx_runtime_cannot_run_it(tmp_path: Path) -> None:
    """ORT's DFT kernel fails on torch.onnx's rfft over a symbolic length (even at the example's length): the
    export retries with the sequence static, says why, and the artifact runs at two batch sizes."""
    mg = ForgeGraph(make_gpt(mixer="afno"), example_inputs=torch.randint(0, 64, (2, 16))).eval()
    with pytest.warns(UserWarning, match=r"ONNX Runtime could not run the model with dynamic axes .*DFT.*batch only"):
        manifest = export_onnx(mg, tmp_path / "afno", check=False)
    assert manifest.dynamic_axes == {"idx": {0: "batch"}, "output_0": {0: "batch"}}
    for batch in (1, 3):
        idx = torch.randint(0, 64, (batch, 16))
        (got,) = _ort(tmp_path / "afno" / "model.onnx", {"idx": idx})
        with torch.no_grad():
            assert _relative(got, mg(idx)) <= BOUND, batch
