"""fold_constants_transform_pass: parameter/constant-only results become buffers (inference only).

Each parameter-only value that a non-constant node reads (``A = W - Wᵀ - γ·eye``, transposed weights)
is computed once, now, and stored as a root buffer named ``fxforge_folded_<n>``; the subgraph that
produced it is erased. The buffers do not follow later weight updates, so the pass refuses a graph in
train mode, and ``ForgeGraph.train()`` warns on a folded graph (graph/forge_graph.FOLDED_PREFIX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ...graph.forge_graph import FOLDED_PREFIX, ForgeGraph, folded_buffers
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import GraphRewrite
from .dce import remove_dead
from .purity import parameter_only_nodes


def _folded(graph: ForgeGraph) -> bool:
    return bool(folded_buffers(graph.model))


register_property("constants-folded", _folded,
                  "parameter-only values are stored as buffers for inference (fold_constants_transform_pass)")


@dataclass(frozen=True)
class FoldInfo(PassInfo):
    """folded: values stored as buffers; removed: nodes erased with them; buffer_bytes: their size;
    nodes_before / nodes_after: graph size."""

    folded: int
    removed: int
    buffer_bytes: int
    nodes_before: int
    nodes_after: int


def _fresh_name(gm: fx.GraphModule, start: int) -> tuple[str, int]:
    i = start
    while hasattr(gm, f"{FOLDED_PREFIX}{i}"):
        i += 1
    return f"{FOLDED_PREFIX}{i}", i + 1


@forge_pass("transform", NoArgs, info=FoldInfo, ensures=("constants-folded",), forbids=("pipeline-stages",),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="the same values, computed ahead of time"))
def fold_constants_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, FoldInfo]:
    """Store every parameter-only value a computation reads as a buffer; the graph must be in eval mode."""
    gm = graph.model
    if gm.training:
        raise ValueError("fold_constants_transform_pass: the graph is in train mode; folded values would not "
                         "follow weight updates (stale weights). Call graph.eval() first for inference, or use "
                         "hoist_parameter_subgraphs_transform_pass, which keeps them computed from the weights")
    before = len(gm.graph.nodes)
    chosen = parameter_only_nodes(gm)
    members = set(chosen)
    frontier = [n for n in chosen if any(u not in members for u in n.users)]
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "get_attr" or node in members:
                interp.env[node] = interp.run_node(node)
    folded = size = 0
    index = 0
    with GraphRewrite(gm) as rw:
        for node in frontier:
            value = interp.env[node]
            if not isinstance(value, torch.Tensor):
                continue
            name, index = _fresh_name(gm, index)
            read = rw.get_attr(name, before=node,
                               buffer=value.detach().clone(memory_format=torch.contiguous_format))
            rw.bypass(node, read)
            folded += 1
            size += value.numel() * value.element_size()
        removed, _ = remove_dead(gm, rw)
    interp.env.clear()
    return graph, FoldInfo(folded=folded, removed=removed + folded, buffer_bytes=size, nodes_before=before,
                           nodes_after=len(gm.graph.nodes))
