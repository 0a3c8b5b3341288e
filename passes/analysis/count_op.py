"""count_op_analysis_pass: how many nodes of each canonical op (e.g. how many dropouts)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ..base import forge_pass
from ..contract import PassInfo


@dataclass(frozen=True)
class CountOpArgs:
    """ops: only count these canonical op names (all ops when None)."""

    ops: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CountOpInfo(PassInfo):
    """counts: nodes per canonical op (sorted by op); total: their sum."""

    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0


@forge_pass("analysis", CountOpArgs, info=CountOpInfo)
def count_op_analysis_pass(graph: ForgeGraph, args: CountOpArgs) -> tuple[ForgeGraph, CountOpInfo]:
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
    return graph, CountOpInfo(counts=dict(sorted(counts.items())), total=sum(counts.values()))
