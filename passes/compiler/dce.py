"""dce_transform_pass: erase pure nodes whose value nobody uses, unused parameter reads included.

Impure nodes (in-place ops, random ops, dropout modules, calls fxforge cannot prove pure) stay even
when unused: their effect is the point. Submodules nothing calls any more are dropped by the rewrite
engine; parameters are never deleted from modules still in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .purity import is_pure


@dataclass(frozen=True)
class DCEInfo(PassInfo):
    """removed: dead pure nodes erased; parameter_reads_removed: of those, unused get_attr nodes;
    nodes_before / nodes_after: graph size."""

    removed: int
    parameter_reads_removed: int
    nodes_before: int
    nodes_after: int


def remove_dead(gm: fx.GraphModule, rw: GraphRewrite) -> tuple[int, int]:
    """Erase unused pure nodes, last to first so chains die in one sweep; (removed, get_attr removed)."""
    removed = reads = 0
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and is_pure(node, gm):
            reads += node.op == "get_attr"
            rw.bypass(node, None)
            removed += 1
    return removed, reads


@forge_pass("transform", NoArgs, info=DCEInfo,
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="only unused values are erased"))
def dce_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, DCEInfo]:
    """Erase dead pure computations and unused parameter reads."""
    gm = graph.model
    before = len(gm.graph.nodes)
    with GraphRewrite(gm) as rw:
        removed, reads = remove_dead(gm, rw)
    return graph, DCEInfo(removed=removed, parameter_reads_removed=reads, nodes_before=before,
                          nodes_after=len(gm.graph.nodes))
