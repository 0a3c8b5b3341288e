"""quantize_module_transform_pass: the graph pass's quantization on a plain nn.Module, and on a model that
cannot be captured; calculate_avg_bits_module_analysis_pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, logits, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.capture import CaptureError
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.quantize import (
    QuantizedConv1d,
    QuantizedLayerNorm,
    QuantizedLinear,
    calculate_avg_bits_module_analysis_pass,
    quantize_module_transform_pass,
    quantize_transform_pass,
)


def fmt(name: str, roles: tuple[str, ...], **params: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": name}
    for role in roles:
        cfg.update({f"{role}_{k}": v for k, v in params.items()})
    return {"config": cfg}


CONFIG = {"by": "type",
          "linear": fmt("integer", ("data_in", "weight", "bias"), width=8, frac_width=5),
          "layer_norm": fmt("integer", ("data_in", "weight"), width=10, frac_width=6)}
MXINT = {"by": "regex", ".*(query|key|value)": fmt("mxint", ("weight",), width=4, block_size=16),
         ".*dense": fmt("integer", ("data_in", "weight"), width=6, frac_width=4)}
SHAPES = [(3, 11), (2, 7)]


@pytest.fixture(scope="module")
def bert() -> tuple[nn.Module, ForgeGraph]:
    """The tiny BERT and its capture (tests quantize copies)."""
    model = make_tiny_bert()
    return model, ForgeGraph(copy.deepcopy(model), hf_input_names=["input_ids", "attention_mask"]).eval()


@pytest.mark.parametrize("config", [CONFIG, MXINT], ids=["by_type_integer", "by_regex_mxint"])
def test_module_quantization_equals_graph_quantization(bert: tuple[nn.Module, ForgeGraph],
                                                       config: dict[str, Any]) -> None:
    model, graph = bert
    before = copy.deepcopy(config)
    qmodel, info = quantize_module_transform_pass(model, config)
    qgraph, ginfo = quantize_transform_pass(graph, config)
    assert config == before and qmodel is not model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # the input is left float
    assert info.by_op == ginfo.by_op and info.changed
    swapped = {n for n, m in qmodel.named_modules() if isinstance(m, QuantizedLinear | QuantizedLayerNorm)}
    assert set(info.quantized_modules) == swapped and swapped
    for batch, seq in SHAPES:
        inputs = bert_inputs(labels=False, batch=batch, seq=seq)
        out = logits(qmodel, inputs)
        assert torch.equal(out, logits(qgraph, inputs))
        assert not torch.equal(out, logits(model, inputs))
    bits = calculate_avg_bits_module_analysis_pass(qmodel)[1]
    assert bits.average_bitwidth == calculate_avg_bits_module_analysis_pass(qgraph)[1].average_bitwidth
    assert bits.layers == sum(isinstance(m, QuantizedLinear | QuantizedLayerNorm) and m.weight_quantizer is not None
                              for m in qmodel.modules())


class DataDependent(nn.Module):
    """A model torch.export cannot capture: its forward branches on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.big = nn.Linear(16, 4)
        self.small = nn.Linear(16, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.embed(x))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        if h.mean() > 0:  # data-dependent control flow
            return self.big(h)
        return self.small(h) * 2


def test_a_model_that_cannot_be_captured_is_quantized_by_module() -> None:
    torch.manual_seed(0)
    model = DataDependent().eval()
    x = torch.randn(2, 5, 6)
    with pytest.raises((CaptureError, RuntimeError, ValueError)):
        ForgeGraph(model, example_inputs=(x,), frontend="export")
    config = {"by": "type", "linear": fmt("integer", ("data_in", "weight", "bias"), width=6, frac_width=3),
              "conv1d": fmt("integer", ("data_in", "weight"), width=6, frac_width=3),
              "relu": fmt("integer", ("data_in",), width=6, frac_width=3)}
    qmodel, info = quantize_module_transform_pass(model, config)
    assert info.by_op == {"linear": 3, "conv1d": 1} and info.not_reached == ["act"]
    assert isinstance(qmodel.conv, QuantizedConv1d) and isinstance(qmodel.big, QuantizedLinear)
    # each layer equals the float layer on quantized input, weight and bias: fixed point with 3 fractional bits
    q = lambda t: torch.clamp(torch.round(t * 8), -32, 31) / 8  # noqa: E731
    for shape in ((2, 5, 6), (3, 9, 6)):
        x = torch.randn(*shape)
        h = torch.relu(torch.nn.functional.linear(q(x), q(model.embed.weight), q(model.embed.bias)))
        h = torch.nn.functional.conv1d(q(h.transpose(1, 2)), q(model.conv.weight), model.conv.bias, padding=1)
        h = h.transpose(1, 2)
        head = model.big if h.mean() > 0 else model.small
        ref = torch.nn.functional.linear(q(h), q(head.weight), q(head.bias)) * (1 if h.mean() > 0 else 2)
        with torch.no_grad():
            torch.testing.assert_close(qmodel(x), ref, atol=1e-6, rtol=1e-6)
    bits = calculate_avg_bits_module_analysis_pass(qmodel)[1]
    assert bits.average_bitwidth == 6.0 and bits.layers == 4
    assert calculate_avg_bits_module_analysis_pass(model)[1].average_bitwidth == 32.0


def test_by_name_mxint_bits_and_refusals() -> None:
    model = DataDependent().eval()
    cfg = {"by": "name", "big": fmt("mxint", ("weight",), width=4, block_size=16)}
    qmodel, info = quantize_module_transform_pass(model, cfg)
    assert info.quantized_modules == ["big"] and isinstance(qmodel.big, QuantizedLinear)
    bits = calculate_avg_bits_module_analysis_pass(qmodel)[1]
    assert bits.layers == 1 and bits.average_bitwidth == qmodel.big.weight_quantizer.bits > 4
    with pytest.raises(PassArgsError, match="matched no quantizable module"):
        quantize_module_transform_pass(model, {"by": "name", "nope": cfg["big"]})
    with pytest.raises(PassError, match="already quantized"):
        quantize_module_transform_pass(qmodel, cfg)
    graph = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids"])
    with pytest.raises(TypeError, match="plain nn.Module"):
        quantize_module_transform_pass(graph, cfg)
    _, info = quantize_module_transform_pass(model, {"by": "regex_name", "b.g": cfg["big"]})  # MASE's spelling
    assert info.quantized_modules == ["big"]
    same, _ = quantize_module_transform_pass.apply_inplace(model, cfg)
    assert same is model and isinstance(model.big, QuantizedLinear)
