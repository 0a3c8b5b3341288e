"""Hardware: fixed-point quantized graphs as streaming SystemVerilog, simulated bit-exact with cocotb.

``build_hw_graph`` (ir.py) turns a quantized ForgeGraph into integer layers or refuses it naming the node;
``integer_forward`` (reference.py) is their arithmetic in torch; ``emit_design`` (emit.py) writes the RTL;
``simulate_design`` (simulate.py) runs it under Verilator (or Icarus) through cocotb's Python runner.
The two passes (emit_pass.py, estimate_pass.py) live here, not in passes/, which hardware builds on; importing
``fxforge`` registers them, so ``get_pass("emit_verilog")`` and pipeline configs find them.
"""

from .emit import EmittedDesign, emit_design
from .emit_pass import EmitVerilogInfo, emit_verilog_transform_pass
from .estimate_pass import HardwareEstimateInfo, HardwareEstimateRecord, hardware_estimate_analysis_pass
from .ir import Fixed, HwGraph, HwLayer, UnsupportedForHardware, build_hw_graph
from .reference import dequantize, integer_forward, quantize_input, requantize

__all__ = ["EmittedDesign", "Fixed", "HwGraph", "HwLayer", "UnsupportedForHardware", "build_hw_graph",
           "dequantize", "emit_design", "integer_forward", "quantize_input", "requantize", "EmitVerilogInfo",
           "emit_verilog_transform_pass", "HardwareEstimateInfo", "HardwareEstimateRecord",
           "hardware_estimate_analysis_pass"]
