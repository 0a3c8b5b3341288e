"""count_op_analysis_pass: how many nodes of each canonical op (e.g. how many dropouts)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify, resolve_op_name
from ..base import forge_pass
from ..contract import PassInfo


@dataclass(frozen=True)
class CountOpArgs:
    """ops: only count these ops (all when None): canonical names (graph/ir) or nn.Module class names
    (``Dropout`` counts ``dropout``); an unknown name is an error listing close canonical ops."""

    ops: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.ops is not None:  # class names ("Dropout") become their canonical op; unknown names fail
            object.__setattr__(self, "ops", tuple(dict.fromkeys(resolve_op_name(op) for op in self.ops)))


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
