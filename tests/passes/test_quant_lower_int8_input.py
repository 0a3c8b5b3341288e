"""Int8Linear's dynamic inputs are quantized as the simulated data_in quantizer: lowered == simulated to fp32."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.passes.quantize import Int8Linear, QuantizedLinear, lower_int8_transform_pass, quantize_transform_pass
from fxforge.passes.quantize import lower as lower_mod
from fxforge.passes.quantize.config import QuantizeConfig
from fxforge.passes.quantize.fixed import scale_zero_point, tensor_range

DYNAMIC = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_dynamic": True,
                                               "data_in_symmetric": True, "weight_width": 8,
                                               "weight_granularity": "per_channel"}}}
SATURATES = lower_mod.int8_kernel_saturates("onednn")
needs_exact_kernel = pytest.mark.skipif(not lower_mod.onednn_available() or SATURATES,
                                        reason="onednn missing or its int8 GEMM saturates 8-bit codes on this CPU "
                                               "(no VNNI): dynamic inputs fall back to 7-bit torch codes there")


def _config(symmetric: bool) -> dict:
    cfg = copy.deepcopy(DYNAMIC)
    cfg["linear"]["config"]["data_in_symmetric"] = symmetric
    return cfg


def _pair(symmetric: bool, in_features: int = 96) -> tuple[QuantizedLinear, Int8Linear]:
    torch.manual_seed(0)
    fp = nn.Linear(in_features, 40)
    q = QuantizedLinear.from_float(fp, QuantizeConfig.from_dict(_config(symmetric)).rule_for("x", "linear")[1])
    scheme = "symmetric" if symmetric else "asymmetric"
    return q, Int8Linear.from_linear(fp, backend="onednn", input_scheme=scheme)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dynamic_codes_are_the_simulated_integers(symmetric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # (codes only: no kernel runs, so this holds on every CPU) the uint8 codes minus the zero point, times the
    # scale, are exactly what the simulated data_in quantizer returns
    monkeypatch.setattr(lower_mod, "int8_kernel_saturates", lambda backend: False)
    q, lin = _pair(symmetric)
    assert q.data_in_quantizer is not None
    for x in (torch.randn(7, 96) * 3 + 0.5, torch.rand(5, 96), -torch.rand(3, 96), torch.zeros(2, 96)):
        xq, scale, zero_point = lin.quantize_input(x)
        assert xq.dtype == torch.uint8 and (zero_point == 128 if symmetric else 0 <= zero_point <= 255)
        lo, hi = tensor_range(x)
        s, z = scale_zero_point(lo, hi, 8, symmetric)
        assert scale == float(s) and (symmetric or zero_point == int(z))
        dequantized = (xq.float() - zero_point) * torch.tensor(scale)
        assert torch.equal(dequantized, q.data_in_quantizer(x))


@pytest.mark.parametrize("symmetric", [True, False])
def test_saturating_kernel_falls_back_to_7bit_codes(symmetric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # (codes only, every CPU) where the kernel saturates 8-bit codes (no VNNI) the simulated scheme is not used:
    # inputs get 7-bit codes (0..127), which the kernel multiplies exactly -- the branch the kernel tests below
    # cannot reach on a VNNI machine, and the only one an AVX2 machine has
    monkeypatch.setattr(lower_mod, "int8_kernel_saturates", lambda backend: True)
    _, lin = _pair(symmetric)
    x = torch.randn(7, 96) * 3 + 0.5
    xq, scale, zero_point = lin.quantize_input(x)
    assert xq.dtype == torch.uint8 and int(xq.max()) <= 127 and int(xq.max()) >= 120
    assert 0 <= zero_point <= 127
    assert ((xq.float() - zero_point) * scale - x).abs().max() <= scale / 2 + 1e-6


@needs_exact_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_linear_within_fp32_bound_of_simulated(symmetric: bool) -> None:
    q, lin = _pair(symmetric)
    assert q.data_in_quantizer is not None and q.weight_quantizer is not None
    for x in (torch.randn(4, 9, 96) * 2 + 0.3, torch.randn(13, 96)):
        with torch.no_grad():
            simulated, lowered = q(x), lin(x)
            xq, wq = q.data_in_quantizer(x), q.weight_quantizer(q.weight)
            magnitude = xq.abs() @ wq.abs().T + q.bias.abs()
        bound = (96 + 5) * 2.0**-24 * magnitude  # lower.FP32_BOUND
        assert bool(((lowered - simulated).abs() <= bound).all())
        if symmetric:  # the old behaviour (torch's own, asymmetric, dynamic quantization) is not the simulation
            old = copy.deepcopy(lin)
            old.input_scheme = "torch"
            with torch.no_grad():
                assert not bool(((old(x) - simulated).abs() <= bound).all())


@needs_exact_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_lowered_tiny_bert_matches_simulated(symmetric: bool, tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = quantize_transform_pass(mg, _config(symmetric))
    shapes = [(4, 16), (3, 11)]
    with torch.no_grad():
        simulated = [mg(**bert_inputs(labels=False, batch=b, seq=s)).logits for b, s in shapes]
    mg, info = lower_int8_transform_pass(mg, {"strict": True, "backend": "onednn"})
    assert info["lowered"] == 14 and info["static_inputs"] == 0 and not info["reduce_range"]
    scheme = "symmetric" if symmetric else "asymmetric"
    assert {m.input_scheme for m in mg.model.modules() if isinstance(m, Int8Linear)} == {scheme}
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "int8"))
    for (b, s), sim in zip(shapes, simulated):
        with torch.no_grad():
            lowered = mg(**bert_inputs(labels=False, batch=b, seq=s)).logits
            assert torch.equal(loaded(**bert_inputs(labels=False, batch=b, seq=s)).logits, lowered)
        # fp32 rounding only (FP32_BOUND per layer; measured ~1e-7 here, where no input sits on a rounding
        # boundary of the next quantizer): far below one int8 step
        assert (lowered - sim).abs().max() <= 1e-5 * sim.abs().max()
        assert torch.equal(lowered.argmax(-1), sim.argmax(-1))


def test_input_scheme_is_checkpointed_and_defaults_to_torch() -> None:
    from fxforge.graph import targets

    spec = targets.module_spec_for(Int8Linear(8, 4, input_scheme="asymmetric"))
    assert spec.to_config is not None and spec.from_config is not None
    config = spec.to_config(Int8Linear(8, 4, input_scheme="asymmetric"))
    assert config["input_scheme"] == "asymmetric" and spec.from_config(config).input_scheme == "asymmetric"
    old = {"in_features": 8, "out_features": 4, "bias": True, "backend": "onednn", "reduce_range": False,
           "static_input": False, "post_op": "none", "post_op_algorithm": ""}
    assert spec.from_config(old).input_scheme == "torch"  # checkpoints written before the field: old behaviour
    with pytest.raises(ValueError, match="input_scheme"):
        Int8Linear(8, 4, backend="fbgemm", input_scheme="symmetric")
