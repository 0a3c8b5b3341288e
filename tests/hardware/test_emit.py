"""The Verilog emitter without a simulator: files and parameters, the integer reference against the quantized
model (bit-exact at every width, two input shapes), and refusals that name the node and the format."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hw_models import MLP, FFNBlock, fixed_config, quantized, sample_inputs

from fxforge import ForgeGraph
from fxforge.hardware import build_hw_graph, dequantize, emit_verilog_transform_pass, integer_forward, quantize_input
from fxforge.hardware.rom import pack_words
from fxforge.passes import PassError, quantize_transform_pass

WIDTHS = [(2, 0, 1, 0), (4, 2, 3, 1), (8, 4, 5, 3), (16, 9, 10, 8)]  # width, data_in / weight / data_out frac


def _reference(graph: ForgeGraph, x: torch.Tensor) -> torch.Tensor:
    hw = build_hw_graph(graph)
    return dequantize(hw, integer_forward(hw, quantize_input(x, hw.layers[hw.input].fmt)))


@pytest.mark.parametrize("width, frac, weight_frac, out_frac", WIDTHS)
@pytest.mark.parametrize("model", ["mlp", "ffn"])
def test_integer_reference_equals_the_quantized_model(width: int, frac: int, weight_frac: int, out_frac: int,
                                                      model: str) -> None:
    net = MLP(argmax=False) if model == "mlp" else FFNBlock()
    g = quantized(net, fixed_config(width, frac, weight_frac=weight_frac, out_frac=out_frac))
    for shape in ((64, 8), (3, 5, 8)):  # two input shapes; values that saturate the input and negatives
        x = sample_inputs(shape[0] * (shape[1] if len(shape) == 3 else 1), 8, scale=2.0 ** (width - frac - 1))
        x = x.reshape(shape)
        with torch.no_grad():
            want = g.model.double()(x.double())  # float64: exact for every accumulator here (up to 53 bits)
            want32 = g.model.float()(x)
        got = _reference(g, x)
        assert torch.equal(got, want), (model, width, shape)
        if width <= 8:  # float32 is exact too while the accumulator fits its 24-bit mantissa
            assert torch.equal(got, want32.double())
        hw = build_hw_graph(g)
        out = hw.layers[hw.output].fmt
        assert ((got == out.qmax * 2.0**-out.frac) | (got == out.qmin * 2.0**-out.frac)).any()  # saturated
        assert got.unique().numel() >= 3  # not a degenerate (all-zero / all-saturated) output


def test_argmax_reference_is_the_models_class() -> None:
    g = quantized(MLP(argmax=True), fixed_config(4, 2))
    x = sample_inputs(200, 8, scale=2.0)
    with torch.no_grad():
        want = g.model(x)
    assert torch.equal(_reference(g, x), want)  # ties (frequent at 4 bits) go to the first maximum, as torch's


def test_emit_writes_mase_interface_modules_and_roms(tmp_path: Path) -> None:
    g = quantized(MLP(argmax=True), fixed_config(8, 4, weight_frac=5))
    out, info = emit_verilog_transform_pass(g, {"out_dir": str(tmp_path), "top": "mlp_top",
                                                "parallelism": {"data_in_0": 2, "fc1": 4, "fc2": 2}})
    assert info.changed is False and out.model.code == g.model.code
    assert info.layers["fc1"] == "linear" and info.layers["argmax"] == "argmax"
    top = (tmp_path / "mlp_top.sv").read_text()
    for port in ("input  logic clk", "input  logic rst", "data_in_0 [DATA_IN_0_PARALLELISM_DIM_0]", "data_in_0_valid",
                 "output logic data_in_0_ready", "data_out_0 [DATA_OUT_0_PARALLELISM_DIM_0]", "data_out_0_valid",
                 "input  logic data_out_0_ready"):
        assert port in top
    assert "parameter int DATA_IN_0_PRECISION_0 = 8," in top and "parameter int DATA_IN_0_PRECISION_1 = 4," in top
    assert "parameter int DATA_IN_0_PARALLELISM_DIM_0 = 2," in top
    fc1 = re.search(r"fixed_linear #\((.*?)\) u_fc1 ", top, re.S)
    assert fc1 is not None
    params = dict(re.findall(r"\.(\w+)\(([^)]*)\)", fc1.group(1)))
    assert params["WEIGHT_PRECISION_0"] == "8" and params["WEIGHT_PRECISION_1"] == "5"
    assert params["DATA_IN_0_PARALLELISM_DIM_0"] == "2" and params["DATA_OUT_0_PARALLELISM_DIM_0"] == "4"
    assert params["WEIGHT_ROM"] == '"fc1_weight.mem"'
    assert set(info.sources) >= {"fixed_linear.sv", "fixed_requant.sv", "fixed_relu.sv", "fixed_argmax.sv",
                                 "mlp_top.sv"}
    # the ROM holds the quantizer's integers: word (block, beat) = W[block*4 + j, beat*2 + i] at lane j*2 + i
    words = (tmp_path / "fc1_weight.mem").read_text().split()
    assert len(words) == (16 // 4) * (8 // 2)
    m = g.model.fc1
    ints = torch.round(m.weight_quantizer(m.weight.detach()) * 2**5).to(torch.int64)
    word = int(words[1 * 4 + 3], 16)  # block 1, beat 3
    lane = lambda k: ((word >> (8 * k)) & 0xFF) - (256 if (word >> (8 * k)) & 0x80 else 0)  # noqa: E731
    assert [lane(j * 2 + i) for j in range(4) for i in range(2)] == \
        [int(ints[4 + j, 6 + i]) for j in range(4) for i in range(2)]


def test_rom_words_are_twos_complement_lanes() -> None:
    assert pack_words(torch.tensor([[-1, 1], [-2, 0]]), 4) == ["1f", "0e"]


def test_ffn_block_gets_a_fork_and_fifos(tmp_path: Path) -> None:
    g = quantized(FFNBlock(head=False), fixed_config(8, 4))
    _, info = emit_verilog_transform_pass(g, {"out_dir": str(tmp_path)})
    top = (tmp_path / "top.sv").read_text()
    assert "stream_fork" in top and top.count("stream_fifo #(") == 2 and "fixed_add" in top
    assert "stream_fork.sv" in info.sources


@pytest.mark.parametrize("model", ["mlp", "ffn"])
def test_every_instantiated_module_ships_with_the_design(tmp_path: Path, model: str) -> None:
    # the layers share their handshake (stream_join, stream_sequencer) and fixed_requant its rounding: a module
    # instantiated by any emitted source must be defined by one of them, or the design does not build elsewhere
    g = quantized(MLP(argmax=True) if model == "mlp" else FFNBlock(argmax=True), fixed_config(8, 4))
    _, info = emit_verilog_transform_pass(g, {"out_dir": str(tmp_path)})
    assert sorted(p.name for p in tmp_path.glob("*.sv")) == sorted(info.sources)
    defined, instantiated = set(), set()
    for name in info.sources:
        text = (tmp_path / name).read_text()
        defined |= set(re.findall(r"^module (\w+)", text, re.M))
        instantiated |= set(re.findall(r"^\s*(\w+) #\($", text, re.M)) - {"module"}
    assert {"fixed_linear", "fixed_relu", "fixed_requant", "fixed_argmax", "fixed_round_saturate", "stream_join",
            "stream_sequencer"} <= instantiated <= defined
    assert defined == {n.removesuffix(".sv") for n in info.sources}  # and nothing more than it uses
    if model == "ffn":
        assert {"fixed_add", "stream_fork", "stream_fifo"} <= instantiated


def _refusal(graph: ForgeGraph, tmp_path: Path, **args: object) -> str:
    with pytest.raises(PassError) as err:
        emit_verilog_transform_pass(graph, {"out_dir": str(tmp_path), **args})
    assert not list(tmp_path.iterdir())  # nothing emitted approximately
    return str(err.value)


@pytest.mark.parametrize("fmt, words", [
    ({"name": "minifloat", "data_in_width": 8, "data_in_exponent_width": 4, "weight_width": 8,
      "weight_exponent_width": 4}, ["'minifloat'"]),
    ({"name": "mxint", "data_in_width": 8, "weight_width": 8}, ["'mxint'"]),
    ({"name": "integer", "data_in_width": 8, "data_in_frac_width": 4, "weight_width": 8,
      "weight_frac_width": "auto", "bias_width": 8, "bias_frac_width": 4}, ["frac_width 'auto'"]),
])
def test_unsupported_formats_are_refused_by_node_and_format(tmp_path: Path, fmt: dict, words: list[str]) -> None:
    g = ForgeGraph(MLP(argmax=False).eval(), (torch.randn(4, 8),))
    g, _ = quantize_transform_pass(g, {"by": "type", "default": {"config": fmt}})
    message = _refusal(g, tmp_path)
    assert "node 'fc1' (linear)" in message and all(w in message for w in words), message


def test_float_layers_and_attention_are_refused(tmp_path: Path) -> None:
    g = ForgeGraph(MLP(argmax=False).eval(), (torch.randn(4, 8),))
    assert "node 'fc1' (linear): Linear, not quantized to fixed point" in _refusal(g, tmp_path)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.fc(x)
            return nn.functional.scaled_dot_product_attention(q, q, q)

    g = quantize_transform_pass(ForgeGraph(Attn().eval(), (torch.randn(2, 3, 8),)), fixed_config(8, 4))[0]
    message = _refusal(g, tmp_path)
    assert "scaled_dot_product_attention" in message and "node" in message, message


def test_bad_parallelism_and_a_second_input_format_are_refused(tmp_path: Path) -> None:
    g = quantized(MLP(argmax=False), fixed_config(8, 4))
    assert "must divide the vector length 16" in _refusal(g, tmp_path, parallelism={"fc1": 3})
    assert "not Linear layers" in _refusal(g, tmp_path, parallelism={"relu": 2})
    cfg = fixed_config(8, 4)
    cfg["add"] = {"config": {**cfg["default"]["config"], "data_in_frac_width": 3}}
    g = quantized(FFNBlock(), cfg)
    assert "the hardware takes one input format" in _refusal(g, tmp_path)
