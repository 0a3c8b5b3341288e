"""fxforge: capture a PyTorch model into one metadata-annotated torch.fx IR, run passes, export safely.

    from fxforge import ForgeGraph, passes
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
"""

from . import (
    hardware,  # registers the hardware passes (emit_verilog, hardware_estimate) and their metadata record
    kernels,  # registers torch.ops.fxforge.* (checkpoints name them)
    passes,
)
from .graph.capture import CaptureError
from .graph.forge_graph import ForgeGraph, PassRecord
from .graph.inputs import ExampleInputs
from .graph.targets import CheckpointError

MaseGraph = ForgeGraph  # MASE's name, for code moving over from chop (see docs/migration.md)

__all__ = ["CaptureError", "CheckpointError", "ExampleInputs", "ForgeGraph", "MaseGraph", "PassRecord", "hardware",
           "kernels", "passes"]
