"""emit_verilog_transform_pass: write a fixed-point quantized graph as streaming SystemVerilog (MASE tutorial 8).

The work is hardware/'s (the IR, the modules, the emitter): this module only declares the pass. The graph
is not changed; the files are the result. Unsupported ops or formats (floating point, MX / block formats,
attention, norms) are refused naming the node and the format, never emitted approximately.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..passes.base import PassArgsError, PassError, forge_pass
from ..passes.contract import NumericalContract, PassInfo


@dataclass(frozen=True)
class EmitVerilogArgs:
    """out_dir: where the sources, ROM files and design.json go; top: the top module's name; parallelism:
    elements per beat by Linear node name (its output stream) and ``data_in_0`` (the input), default 1;
    nodes: a selector of the region to emit (None: the whole graph)."""

    out_dir: str
    top: str = "top"
    parallelism: dict[str, int] = field(default_factory=dict)
    nodes: Any = None


@dataclass(frozen=True)
class EmitVerilogInfo(PassInfo):
    """out_dir, top, sources (compile order), roms, layers: kind per emitted layer; source_hash: SHA-256 of the
    sources (one simulator build each)."""

    out_dir: str = ""
    top: str = ""
    sources: list[str] = field(default_factory=list)
    roms: list[str] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)
    source_hash: str = ""


@forge_pass("transform", EmitVerilogArgs, info=EmitVerilogInfo,
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="writes files; the graph is unchanged"))
def emit_verilog_transform_pass(graph: ForgeGraph, args: EmitVerilogArgs) -> tuple[ForgeGraph, EmitVerilogInfo]:
    """Emit ``graph`` (fixed-point Linear / ReLU / add / argmax) as SystemVerilog into ``args.out_dir``.

    The RTL computes the integers of :func:`fxforge.hardware.integer_forward`, which equal the quantized
    model's outputs; simulate it with ``fxforge.hardware.simulate.simulate_design``.
    """
    from .emit import emit_design  # hardware/ consumes graphs; imported only when emitting
    from .ir import UnsupportedForHardware, build_hw_graph

    bad = {k: v for k, v in args.parallelism.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise PassArgsError(f"emit_verilog_transform_pass: parallelism values must be integers >= 1, got {bad}")
    try:
        hw = build_hw_graph(graph, dict(args.parallelism), args.nodes)
    except UnsupportedForHardware as exc:  # names the node and the format
        raise PassError(f"emit_verilog_transform_pass refuses the graph: {exc} (the emitter takes graphs "
                        "quantized to fixed point by quantize_transform_pass, format 'integer')") from exc
    design = emit_design(hw, args.out_dir, args.top)
    return graph, EmitVerilogInfo(out_dir=str(design.out_dir), top=design.top, sources=list(design.sources),
                                  roms=list(design.roms), source_hash=design.source_hash, changed=False,
                                  layers={n: v.kind for n, v in hw.layers.items()})
