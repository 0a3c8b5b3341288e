"""count_op_analysis_pass: how many nodes of each canonical op (e.g. how many dropouts)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ..base import forge_pass


@dataclass(frozen=True)
class CountOpArgs:
    """ops: only count these canonical op names (all ops when None)."""

    ops: tuple[str, ...] | None = None


@forge_pass("analysis", CountOpArgs)
def count_op_analysis_pass(graph: ForgeGraph, args: CountOpArgs) -> tuple[ForgeGraph, dict[str, Any]]:
    """Count call nodes by canonical op; info = {"counts": {op: n}, "total": n}."""
    counts: Counter[str] = Counter()
    for node in graph.model.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        _, op = classify(node, graph.model)
        if args.ops is None or op in args.ops:
            counts[op] += 1
    if args.ops is not None:
        for op in args.ops:
            counts.setdefault(op, 0)
    return graph, {"counts": dict(sorted(counts.items())), "total": sum(counts.values())}
