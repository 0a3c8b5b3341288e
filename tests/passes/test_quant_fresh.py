"""A quantized graph always computes with its current weights, whatever updated them (QAT)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.passes.quantize import QuantizedLinear, quantize_transform_pass

CFG = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                           "weight_width": 8, "weight_frac_width": 7, "bias_width": 8,
                                           "bias_frac_width": 5}}}


def _fixed(x: torch.Tensor, frac: int) -> torch.Tensor:
    return torch.clamp(torch.round(x * 2**frac), -128, 127) / 2**frac


def _expected(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """What the layer must compute from its weights as they are now."""
    return F.linear(_fixed(x, 4), _fixed(layer.weight.detach(), 7), _fixed(layer.bias.detach(), 5))


def _adamw(fused: bool, foreach: bool) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=fused, foreach=foreach)


UPDATES: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None] = {
    "adamw_fused": _adamw(True, False),
    "adamw_foreach": _adamw(False, True),
    "adamw_for_loop": _adamw(False, False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
    "param_data": None,  # a manual ``param.data`` update, as some training loops do
}


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_eval_after_training_uses_the_updated_weights(update: str) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    mg = ForgeGraph(model, torch.randn(2, 16), frontend="fx")
    mg, _ = quantize_transform_pass(mg, CFG)  # a transform returns the quantized graph (its input stays float)
    layer = mg.model.get_submodule("0")
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(5, 16)
    mg.eval()
    with torch.no_grad():
        mg(x)  # an evaluation before training (MASE: evaluate after PTQ, then QAT)
    params = list(mg.model.parameters())
    make = UPDATES[update]
    for _ in range(3):
        if make is None:
            layer.weight.data = layer.weight.data + 0.05 * torch.randn_like(layer.weight)
            layer.bias.data.add_(0.05)
        else:
            opt = make(params)
            mg.train()
            mg(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            mg.eval()
        with torch.no_grad():
            sub = layer(x)
        assert torch.equal(sub, _expected(layer, x))


def test_qat_trained_graph_reloads_to_the_same_outputs(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    mg, _ = quantize_transform_pass(mg, CFG)
    inputs = bert_inputs()
    with torch.no_grad():
        before = mg(**inputs).logits
    opt = torch.optim.AdamW([p for p in mg.model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    mg.train()
    for _ in range(3):
        mg(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    mg.eval()
    with torch.no_grad():
        after = mg(**inputs).logits
        reloaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "qat"))(**inputs).logits
    assert not torch.equal(before, after)  # training changed the quantized model
    assert (after - reloaded).abs().max() <= 1e-6
