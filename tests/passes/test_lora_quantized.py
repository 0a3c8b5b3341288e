"""Fusing LoRA into a quantized base is not exact: the bare pass refuses it; ``requantize=True`` fuses and
reports the error it measured (the tiny-BERT reproduction of issue 25: logits moved by 0.096 silently)."""

from __future__ import annotations

import pytest
import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes.quantize import QuantizedLinear
from fxforge.passes.transform.lora import LoraLinear, lora_layers

HF_NAMES = ["input_ids", "attention_mask", "labels"]


def _quantized_lora(weight_width: int) -> ForgeGraph:
    """Tiny BERT, integer weights (``weight_width`` bits, 4 fraction bits), LoRA rank 2 with B ~ 0.1."""
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()
    cfg = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                               "weight_width": weight_width, "weight_frac_width": 4}}}
    mg, _ = passes.quantize_transform_pass(mg, cfg)
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2})
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, _, m in lora_layers(mg.model):
            m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=gen))
    return mg


def _effective_weight(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    q = getattr(layer, "weight_quantizer", None)
    return weight if q is None else q(weight)


@pytest.mark.parametrize("weight_width", [8, 4])
def test_bare_fuse_refuses_a_quantized_base_and_names_the_way_out(weight_width: int) -> None:
    mg = _quantized_lora(weight_width)
    inputs = bert_inputs()
    with torch.no_grad():
        before = mg(**inputs).logits
    with pytest.raises(passes.PassError, match=r"quantized base.*requantize.*fuse before quantiz") as err:
        passes.fuse_lora_weights_transform_pass(mg)
    assert "fuse_lora_weights_transform_pass" in str(err.value)
    assert len(lora_layers(mg.model)) == 14  # nothing was fused
    with torch.no_grad():
        assert torch.equal(mg(**inputs).logits, before)


@pytest.mark.parametrize("weight_width", [8, 4])
def test_requantize_fuses_and_reports_the_measured_error(weight_width: int) -> None:
    mg = _quantized_lora(weight_width)
    inputs = bert_inputs()
    lora = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert isinstance(lora, LoraLinear)
    applied = _effective_weight(lora.base, lora.base.weight) + lora.delta_weight()  # what the adapted layer applies
    with torch.no_grad():
        before = mg(**inputs).logits
    mg, info = passes.fuse_lora_weights_transform_pass(mg, {"requantize": True})
    assert len(info.fused) == 14 and sorted(info.requantized) == sorted(info.fused)
    fused = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert isinstance(fused, QuantizedLinear)
    with torch.no_grad():
        expected = (_effective_weight(fused, fused.weight) - applied).abs().max().item()
        after = mg(**inputs).logits
    assert info.requantized["bert.encoder.layer.0.attention.self.query"] == pytest.approx(expected, abs=1e-7)
    assert expected > 0.0 and info.max_weight_error == max(info.requantized.values())
    assert 0.0 < (after - before).abs().max().item()  # bounded, not exact: the pass said so


def test_float_layers_fuse_without_the_opt_in_and_quantized_ones_can_be_excluded() -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()
    cfg = {"by": "name", "classifier": {"config": {"name": "integer", "weight_width": 8, "weight_frac_width": 4}}}
    mg, _ = passes.quantize_transform_pass(mg, cfg)
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2})
    mg, info = passes.fuse_lora_weights_transform_pass(mg, {"exclude": {"name": "classifier"}})
    assert len(info.fused) == 13 and info.requantized == {} and info.max_weight_error == 0.0
    assert [p for _, p, _ in lora_layers(mg.model)] == ["classifier"]
