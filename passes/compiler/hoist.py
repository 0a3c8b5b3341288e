"""hoist_parameter_subgraphs_transform_pass: parameter/constant-only computations move to the top of forward.

A computation whose inputs are only parameters, buffers and constants (``W - Wᵀ - γ·eye`` in the
A-GRU, the transposed input weights) is loop-invariant in an unrolled graph: it moves, with the
parameter reads it needs, before the first node that reads an input, and identical copies merge, so
it runs once per call. It still runs in forward from the live parameters, so training sees updated
weights and gradients flow through it (compare fold_constants_transform_pass, inference only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .cse import merge_duplicates
from .purity import parameter_only_nodes


@dataclass(frozen=True)
class HoistInfo(PassInfo):
    """hoisted: parameter-only nodes moved to the top; merged: identical copies of them erased;
    nodes_before / nodes_after: graph size."""

    hoisted: int
    merged: int
    nodes_before: int
    nodes_after: int


def hoist_nodes(gm: fx.GraphModule) -> int:
    """Move parameter-only nodes and the get_attr reads they use before the first other computation
    (keeping their relative order, so the graph stays topologically sorted); how many computations moved."""
    graph = gm.graph
    chosen = parameter_only_nodes(gm)
    moving = set(chosen) | {i for n in chosen for i in n.all_input_nodes if i.op == "get_attr"}
    anchor = next(n for n in graph.nodes if n not in moving and n.op not in ("placeholder", "get_attr"))
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for node in sorted(moving, key=order.__getitem__):
        if order[node] > order[anchor]:
            anchor.prepend(node)
            moved += node.op != "get_attr"
    return moved


@forge_pass("transform", NoArgs, info=HoistInfo,
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="the same ops run earlier, once"))
def hoist_parameter_subgraphs_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, HoistInfo]:
    """Hoist parameter/constant-only subgraphs to the top of forward and merge their copies (still differentiable)."""
    gm = graph.model
    before = len(gm.graph.nodes)
    with GraphRewrite(gm) as rw:
        hoisted = hoist_nodes(gm)
        reads = [n for n in gm.graph.nodes if n.op == "get_attr"]
        merged = merge_duplicates(gm, rw, reads + parameter_only_nodes(gm))
    return graph, HoistInfo(hoisted=hoisted, merged=sum(merged.values()), nodes_before=before,
                            nodes_after=len(gm.graph.nodes))
