"""Weight-only lowering: simulated int8 / int4 / MXINT4 layers on real CPU kernels, within the stated bounds
on tiny BERT, the zoo GPT and a tiny Llama, at their packed size, through checkpoints and torch.export."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import bert_inputs, make_gpt, make_tiny_bert
from hf_tiny import hf_inputs, tiny_hf

from fxforge import ForgeGraph
from fxforge.graph.metadata import get_meta
from fxforge.passes import PASSES
from fxforge.passes.base import PassError
from fxforge.passes.metrics import compare_outputs
from fxforge.passes.quantize import (
    Int8Linear,
    LoweringRecord,
    QuantizedLinear,
    WeightOnlyEmbedding,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    lower_weight_only_transform_pass,
    quantize_transform_pass,
)
from fxforge.passes.quantize.woq_codes import simulated_bias, simulated_weight
from fxforge.passes.quantize.woq_modules import resident_bytes

MXINT4 = {"by": "type", "linear": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}}
INT4_ROW = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"}}}
INT8_FIXED = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": "auto"}}}
INT8_SCALED = {"by": "type", "linear": {"config": {"name": "scaled_integer", "weight_width": 8,
                                                   "weight_granularity": "per_channel"}}}
DYNAMIC = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_dynamic": True,
                                               "data_in_symmetric": False, "weight_width": 8,
                                               "weight_granularity": "per_channel"}}}
WOQ = (WeightOnlyInt8Linear, WeightOnlyInt4Linear)

Model = tuple[ForgeGraph, list[Any], Callable[[Any, Any], torch.Tensor]]


def _bert() -> Model:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    return mg, [bert_inputs(labels=False, batch=b, seq=s) for b, s in ((3, 11), (2, 7))], lambda g, i: g(**i).logits


def _gpt() -> Model:
    gen = torch.Generator().manual_seed(3)
    idx = [torch.randint(0, 64, shape, generator=gen) for shape in ((2, 16), (3, 24))]
    return ForgeGraph(make_gpt(), example_inputs=(idx[0],)).eval(), idx, lambda g, i: g(i)


def _llama() -> Model:
    mg = ForgeGraph(tiny_hf("llama"), hf_input_names=["input_ids", "attention_mask"]).eval()
    cases = []
    for batch, seq in ((3, 11), (1, 7)):
        case = hf_inputs("llama", batch, seq)
        del case["labels"]
        cases.append(case)
    return mg, cases, lambda g, i: g(**i).logits


MODELS: dict[str, Callable[[], Model]] = {"bert": _bert, "gpt": _gpt, "llama": _llama}


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    """name -> (captured float graph, inputs at two shapes, run), built once per module on first use."""
    return {}


def _model(models: dict[str, Model], name: str) -> Model:
    if name not in models:
        models[name] = MODELS[name]()
    return models[name]


def _capture_io(gm: nn.Module, types: tuple[type[nn.Module], ...]) -> tuple[dict[str, list[Any]], list[Any]]:
    """Forward hooks recording (input, output) of every module of ``types``; returns (records, handles)."""
    seen: dict[str, list[Any]] = {}
    handles = []
    for name, m in gm.named_modules():
        if isinstance(m, types):
            def hook(mod: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                seen.setdefault(name, []).append((args[0].detach(), out.detach()))
            handles.append(m.register_forward_hook(hook))
    return seen, handles


@pytest.mark.parametrize("config", ["mxint4", "int8_fixed"])
@pytest.mark.parametrize("model", ["bert", "gpt", "llama"])
def test_lowered_equals_simulated_within_bound(models: dict[str, Model], model: str, config: str) -> None:
    base, cases, run = _model(models, model)
    cfg = {"mxint4": MXINT4, "int8_fixed": INT8_FIXED}[config]
    sim, _ = quantize_transform_pass(base.copy(), cfg)
    low, info = lower_weight_only_transform_pass(sim)
    assert info.skipped == {} and len(info.lowered) == sum(isinstance(m, QuantizedLinear) for m in sim.model.modules())
    for path in info.lowered:  # int4 wherever the int4 pack takes the shape (rows in blocks of 16)
        layer = low.model.get_submodule(path)
        int4 = config == "mxint4" and layer.out_features % 16 == 0
        assert isinstance(layer, WeightOnlyInt4Linear if int4 else WeightOnlyInt8Linear), path
    for path in info.lowered:  # the lowered weight is the simulated weight, exactly
        layer, ref = low.model.get_submodule(path), sim.model.get_submodule(path)
        assert torch.equal(layer.dequantized_weight(), simulated_weight(ref)), path
    contract = PASSES["lower_weight_only_transform_pass"].spec.contract
    for case in cases:
        seen, handles = _capture_io(low.model, WOQ)
        with torch.no_grad():
            want, got = run(sim, case), run(low, case)
        for h in handles:
            h.remove()
        assert set(seen) == set(info.lowered)
        for path, calls in seen.items():  # per layer: within its stated bound of the simulated layer on that input
            layer, ref = low.model.get_submodule(path), sim.model.get_submodule(path)
            for x, y in calls:
                expect = F.linear(x, simulated_weight(ref), simulated_bias(ref))
                excess = (y.double() - expect.double()).abs() - layer.error_bound(x)
                assert excess.max() <= 0, (path, float(excess.max()))
        diff = compare_outputs(want, got)
        assert contract.min_sqnr_db is not None and diff.sqnr_db >= contract.min_sqnr_db, (model, config, diff)


def test_exact_where_the_arithmetic_is() -> None:
    # small-integer inputs and power-of-two weights: every product and partial sum is exact in bf16/fp32
    for cfg, cls in ((MXINT4, WeightOnlyInt4Linear), (INT8_FIXED, WeightOnlyInt8Linear)):
        mg = ForgeGraph(nn.Sequential(nn.Linear(64, 32, bias=False)), example_inputs=(torch.zeros(3, 64),))
        mg, _ = quantize_transform_pass(mg, cfg)
        low, info = lower_weight_only_transform_pass(mg)
        assert isinstance(low.model.get_submodule("0"), cls)
        x = torch.randint(-2, 3, (5, 64)).float()
        with torch.no_grad():
            assert torch.equal(low(x), mg(x)), cfg


def test_resident_memory_is_the_packed_size(models: dict[str, Model]) -> None:
    base, cases, run = _model(models, "llama")
    sim, _ = quantize_transform_pass(base.copy(), MXINT4)
    low, info = lower_weight_only_transform_pass(sim)
    expected = 0
    for path in info.lowered:
        m = low.model.get_submodule(path)
        n, k = m.out_features, m.in_features
        bias = 0 if m.bias is None else 4 * n
        if isinstance(m, WeightOnlyInt4Linear):  # two codes per byte + a bf16 (scale, zero) per group of 32
            assert m.group_size == 32 and m.weight_int4pack.dtype == torch.uint8
            expected += n * k // 2 + (k // 32) * n * 2 * 2 + bias
        else:  # int8 codes + an fp32 scale per row
            assert isinstance(m, WeightOnlyInt8Linear)
            expected += n * k + 4 * n + bias
        assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in m.buffers())  # no fp32 weight kept
    assert info.resident_bytes == expected
    assert sum(resident_bytes(low.model.get_submodule(p)) for p in info.lowered) == expected
    fp32 = sum(resident_bytes(base.model.get_submodule(p)) for p in info.lowered)
    assert expected < 0.25 * fp32  # 5 bits a weight (4.25 for the codes and their 1-byte-equivalent scales)


def test_checkpoint_reload_and_torch_export(models: dict[str, Model], tmp_path: Path) -> None:
    base, cases, run = _model(models, "gpt")
    sim, _ = quantize_transform_pass(base.copy(), MXINT4)
    low, info = lower_weight_only_transform_pass(sim)
    loaded = ForgeGraph.from_checkpoint(low.export(tmp_path / "woq"))
    for idx in cases:
        with torch.no_grad():
            assert torch.equal(run(loaded, idx), run(low, idx))
    layer = loaded.model.get_submodule(next(iter(info.lowered)))
    assert isinstance(layer, WOQ)
    ep = torch.export.export(low.model, (cases[1],))
    with torch.no_grad():
        assert torch.equal(ep.module()(cases[1]), low(cases[1]))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("_weight_int4pack_mm_for_cpu" in t for t in targets), targets


def test_bert_lowered_checkpoint_and_export(models: dict[str, Model], tmp_path: Path) -> None:
    base, cases, run = _model(models, "bert")
    sim, _ = quantize_transform_pass(base.copy(), INT8_SCALED)
    low, info = lower_weight_only_transform_pass(sim)
    assert info.skipped == {} and set(info.lowered.values()) == {"int8"}
    rec = get_meta(low.node("classifier")).software.get(LoweringRecord)
    assert rec is not None and "woq_int8" in rec.kernel and rec.activation == "fp32"
    loaded = ForgeGraph.from_checkpoint(low.export(tmp_path / "woq"))
    with torch.no_grad():
        assert torch.equal(run(loaded, cases[1]), run(low, cases[1]))
    ep = torch.export.export(low.model, (), dict(cases[1]))
    with torch.no_grad():
        assert torch.equal(ep.module()(**cases[1]).logits, run(low, cases[1]))


def test_formats_without_a_kernel_stay_simulated_with_reasons(models: dict[str, Model]) -> None:
    base, cases, run = _model(models, "bert")
    cfg = {"by": "regex",
           r".*layer\.0\.attention.*": {"config": {"name": "minifloat", "weight_width": 8, "weight_exponent_width": 4}},
           r".*layer\.0\.intermediate.*": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 16}},
           r".*layer\.0\.output\.dense": {"config": {"name": "integer", "weight_width": 12, "weight_frac_width": 12}},
           r".*layer\.1\.attention\.self\.query": {"config": {"name": "scaled_integer", "weight_width": 8,
                                                                "weight_symmetric": False}},
           r"classifier": {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": 6}}}
    sim, _ = quantize_transform_pass(base.copy(), cfg)
    low, info = lower_weight_only_transform_pass(sim)
    # MXINT4 in blocks of 16: no int4 pack for that group, so the bf16 group path (woq_group) takes it
    assert set(info.lowered) == {"classifier", "bert.encoder.layer.0.intermediate.dense"}
    assert info.lowered["bert.encoder.layer.0.intermediate.dense"] == "group g16"
    skipped = info.skipped
    assert "minifloat(width=8" in skipped["bert.encoder.layer.0.attention.self.query"]
    assert "not integers" in skipped["bert.encoder.layer.0.attention.self.query"]
    assert "-bit codes" in skipped["bert.encoder.layer.0.output.dense"]
    assert "asymmetric" in skipped["bert.encoder.layer.1.attention.self.query"]
    assert isinstance(low.model.get_submodule("bert.encoder.layer.1.attention.self.query"), QuantizedLinear)
    with torch.no_grad():
        assert compare_outputs(run(sim, cases[0]), run(low, cases[0])).sqnr_db > 60
    conv = ForgeGraph(nn.Sequential(nn.Conv1d(4, 16, 3), nn.Flatten(), nn.Linear(16 * 30, 32)),
                      example_inputs=(torch.zeros(2, 4, 32),))
    conv, _ = quantize_transform_pass(conv, {"by": "type", "default": {"config": {
        "name": "integer", "weight_width": 8, "weight_frac_width": "auto"}}})
    _, info = lower_weight_only_transform_pass(conv)
    assert set(info.lowered) == {"2"} and "QuantizedConv1d has no weight-only kernel" in info.skipped["0"]
    with pytest.raises(PassError, match="have no exact kernel.*minifloat"):
        lower_weight_only_transform_pass(sim, {"strict": True})


def test_8bit_activations_take_the_int8_path(models: dict[str, Model]) -> None:
    base, cases, run = _model(models, "bert")
    sim, _ = quantize_transform_pass(base.copy(), DYNAMIC)
    low, info = lower_weight_only_transform_pass(sim, {"backend": "fbgemm"})
    assert set(info.lowered.values()) == {"int8-dynamic"} and info.skipped == {}
    assert all(isinstance(low.model.get_submodule(p), Int8Linear) for p in info.lowered)
    rec = get_meta(low.node("classifier")).software.get(LoweringRecord)
    assert rec is not None and rec.kernel == "quantized::linear_dynamic"
    with torch.no_grad():  # activation rounding differs from the simulation's where the CPU needs 7-bit codes
        assert compare_outputs(run(sim, cases[0]), run(low, cases[0])).sqnr_db > 20


@pytest.mark.parametrize(("fmt", "width"), [("mxint", 4), ("integer", 8)])
def test_embeddings_lowered_exactly_at_their_width(models: dict[str, Model], tmp_path: Path, fmt: str,
                                                   width: int) -> None:
    base, cases, run = _model(models, "bert")
    params = {"weight_block_size": 32} if fmt == "mxint" else {"weight_frac_width": "auto"}
    cfg = {"by": "type", "embedding": {"config": {"name": fmt, "weight_width": width, **params}}}
    sim, _ = quantize_transform_pass(base.copy(), cfg)
    low, info = lower_weight_only_transform_pass(sim)
    assert info.skipped == {} and len(info.lowered) == 3  # word, position, token type
    word = low.model.get_submodule("bert.embeddings.word_embeddings")
    assert isinstance(word, WeightOnlyEmbedding) and word.width == width
    v, d = word.num_embeddings, word.embedding_dim
    blocks = d // 32 if fmt == "mxint" else 1
    assert resident_bytes(word) == v * d * width // 8 + v * blocks * 4
    assert torch.equal(word.dequantized_weight(), simulated_weight(sim.model.get_submodule(
        "bert.embeddings.word_embeddings")))
    for case in cases:
        with torch.no_grad():
            assert torch.equal(run(low, case), run(sim, case))
    loaded = ForgeGraph.from_checkpoint(low.export(tmp_path / "emb"))
    with torch.no_grad():
        assert torch.equal(run(loaded, cases[0]), run(low, cases[0]))


def _pack_rows(codes: torch.Tensor, block: int) -> torch.Tensor:
    """ATen's int4 pack as a CPU with ``block``-row blocks lays it out (the inverse of woq_modules._unpack_rows)."""
    n, k = codes.shape
    t = (codes + 8).to(torch.uint8).reshape(n // block, block, k).transpose(1, 2)
    return (t[..., : block // 2] | (t[..., block // 2:] << 4)).reshape(n, k // 2).contiguous()


def test_int4_layer_repacks_another_cpu_layout_or_refuses(tmp_path: Path) -> None:
    codes, scale = torch.randint(-8, 8, (128, 64)), torch.full((128, 2), 0.25)
    layer = WeightOnlyInt4Linear.from_codes(codes, scale, 32, torch.randn(128))
    x = torch.randn(5, 64)
    want = layer(x)
    other = "rows32" if layer.layout == "rows64" else "rows64"  # what the other x86 vector width packs
    foreign = WeightOnlyInt4Linear(64, 128, 32, True, other)
    foreign.weight_int4pack = _pack_rows(codes, int(other[4:]))
    foreign.scales_and_zeros, foreign.bias = layer.scales_and_zeros, layer.bias
    assert not torch.equal(foreign.weight_int4pack, layer.weight_int4pack)
    assert torch.equal(foreign(x), want) and foreign.layout == layer.layout  # repacked once, for this CPU
    assert torch.equal(foreign.weight_int4pack, layer.weight_int4pack)
    foreign.layout = "sha0123456789abcdef"  # a layout fxforge cannot read
    with pytest.raises(RuntimeError, match="re-run lower_weight_only_transform_pass"):
        foreign(x)


def test_int4_many_rows_take_a_bf16_gemm_within_the_bound() -> None:
    codes = torch.randint(-8, 8, (64, 96))
    scale = torch.pow(2.0, torch.randint(-6, -2, (64, 3)).float())
    layer = WeightOnlyInt4Linear.from_codes(codes, scale, 32, torch.randn(64))
    w = codes.float() * scale.repeat_interleave(32, dim=1)
    assert torch.equal(layer.dequantized_weight(), w)
    for rows in (layer.DENSE_FROM_ROWS - 1, layer.DENSE_FROM_ROWS + 3):  # ATen's int4 GEMM, then the dense path
        x = torch.randn(rows, 96) * 3
        y = layer(x)
        excess = (y.double() - F.linear(x, w, layer.bias).double()).abs() - layer.error_bound(x)
        assert excess.max() <= 0, rows


def test_nothing_to_lower_names_what_to_run(models: dict[str, Model]) -> None:
    base, cases, run = _model(models, "bert")
    cfg = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                               "weight_width": 8, "weight_frac_width": 6}}}
    sim, _ = quantize_transform_pass(base.copy(), cfg)
    with pytest.raises(PassError, match="data_in is quantized.*quantize_transform_pass"):
        lower_weight_only_transform_pass(sim)
    low, _ = lower_weight_only_transform_pass(quantize_transform_pass(base.copy(), MXINT4)[0])
    with pytest.raises(PassError, match="none is left.*lowered them already"):
        lower_weight_only_transform_pass(low)
    with pytest.raises(PassError, match="quantized"):  # a lowered graph is still a quantized one
        PASSES["prune_transform_pass"](low, {"weight": {"sparsity": 0.2}})
