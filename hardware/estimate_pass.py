"""hardware_estimate_analysis_pass: resources and cycles of the design emit_verilog_transform_pass would write.

Per layer: multipliers, adder bits, weight memory bits, buffer bits, the cycle its last output beat leaves for
one vector, and its initiation interval, for the chosen parallelism; the total latency in cycles and at
``clock_mhz``. The timing model (hardware/estimate.py) follows the emitted RTL, so the latency equals the
cycle count measured in simulation. Each emitted layer's fx node gets a ``hardware.estimate`` record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..graph.metadata import MetaRecord, get_meta, has_meta, register_record
from ..passes.base import forge_pass
from ..passes.contract import PassInfo
from ..passes.propagate import init_node
from .estimate import DesignTotals, Resources, resource_fields

__all__ = ["hardware_estimate_analysis_pass", "HardwareEstimateRecord", "HardwareEstimateInfo"]


@register_record("hardware.estimate")
@dataclass(frozen=True)
class HardwareEstimateRecord(MetaRecord, Resources):
    """One emitted layer: its kind, parallelism (elements per output beat), resources (the estimate's fields) and
    the cycle its last output beat leaves."""

    kind: str = ""
    parallelism: int = 1
    last_out_cycle: int = 0


@dataclass(frozen=True)
class HardwareEstimateArgs:
    """parallelism and nodes: as emit_verilog_transform_pass's; clock_mhz: for the latency in microseconds."""

    parallelism: dict[str, int] = field(default_factory=dict)
    nodes: Any = None
    clock_mhz: float = 100.0


@dataclass(frozen=True)
class HardwareEstimateInfo(PassInfo, DesignTotals):
    """layers: per layer (name -> resources and cycles); totals (the estimate's: resources, the design's initiation
    interval, i.e. its busiest layer's in cycles per vector, latency in cycles, clock); latency in microseconds."""

    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    latency_us: float = 0.0


@forge_pass("analysis", HardwareEstimateArgs, info=HardwareEstimateInfo)
def hardware_estimate_analysis_pass(graph: ForgeGraph,
                                    args: HardwareEstimateArgs) -> tuple[ForgeGraph, HardwareEstimateInfo]:
    """Estimate the emitted design of ``graph`` (refused as by emit_verilog_transform_pass when unsupported)."""
    from .estimate import estimate_design
    from .ir import build_hw_graph

    if args.clock_mhz <= 0:
        raise ValueError(f"clock_mhz must be > 0, got {args.clock_mhz}")
    hw = build_hw_graph(graph, dict(args.parallelism), args.nodes)
    est = estimate_design(hw, args.clock_mhz)
    nodes = {n.name: n for n in graph.model.graph.nodes}
    for e in est.layers:
        node = nodes.get(e.name)
        if node is None:
            continue
        if not has_meta(node):
            init_node(node, graph.model)
        layer = hw.layers.get(e.name)
        get_meta(node).hardware.set(HardwareEstimateRecord(
            kind=e.kind, parallelism=layer.parallelism if layer is not None else 1, last_out_cycle=e.last_out,
            **resource_fields(e)))
    return graph, HardwareEstimateInfo(layers={e.name: e.to_json() for e in est.layers}, latency_us=est.latency_us,
                                       **resource_fields(est, DesignTotals))
