"""cse_transform_pass: whole-graph common-subexpression elimination of pure ops.

Two nodes with the same op, the same target, the same inputs (after earlier merges) and the same
constant arguments compute the same value when the op is pure (passes/compiler/purity.py); the later
one is erased and its users read the first. On the unrolled A-GRU this collapses the T copies of
``W - Wᵀ - γ·eye`` (and of ``eye``) into one and the duplicated ``h @ Aᵀ`` of every step into one.
Dropout, random factories, in-place ops and values written in place are never merged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .purity import cse_key, is_pure, mutated_nodes


@dataclass(frozen=True)
class CSEInfo(PassInfo):
    """merged: nodes erased because an identical pure node computed the same value first;
    by_op: merged count per target; nodes_before / nodes_after: graph size."""

    merged: int
    by_op: dict[str, int]
    nodes_before: int
    nodes_after: int


def merge_duplicates(gm: fx.GraphModule, rw: GraphRewrite, only: Iterable[fx.Node] | None = None) -> dict[str, int]:
    """Erase every pure node (of ``only``, default all) that duplicates an earlier one; counts per target."""
    allowed = None if only is None else set(only)
    mutated = mutated_nodes(gm.graph)
    seen: dict[Any, fx.Node] = {}
    merged: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        if (allowed is not None and node not in allowed) or node in mutated or not is_pure(node, gm):
            continue
        key = cse_key(node)
        if key is None:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            rw.bypass(node, first)
            name = str(node.target) if node.op != "call_function" else getattr(
                node.target, "__name__", str(node.target))
            merged[name] = merged.get(name, 0) + 1
    return merged


@forge_pass("transform", NoArgs, info=CSEInfo,
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="a merged node computed the same value"))
def cse_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, CSEInfo]:
    """Merge identical pure computations across the whole graph (outputs and gradients unchanged)."""
    gm = graph.model
    before = len(gm.graph.nodes)
    with GraphRewrite(gm) as rw:
        by_op = merge_duplicates(gm, rw)
    return graph, CSEInfo(merged=sum(by_op.values()), by_op=by_op, nodes_before=before,
                          nodes_after=len(gm.graph.nodes))
