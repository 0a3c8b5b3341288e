"""optimize_graph_pipeline: the compiler passes in a sensible order, repeated to a fixed point.

Order per round: CSE (merge the unrolled copies) → DCE → hoist parameter-only subgraphs → batch
matmuls (sequence, siblings, biases) → fuse elementwise chains → CSE → DCE; then, for inference only
(``fold=True``, graph in eval mode), fold constants into buffers. Rounds repeat until one changes
nothing (no step's info reports ``changed``) or ``max_rounds`` is reached. A plain function: a
pipelines/ preset can wrap it. Like a transform it leaves its input graph unchanged: it copies it once
and runs every step in place on that copy (``apply_inplace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...graph.forge_graph import ForgeGraph
from ..base import PassFn
from ..contract import PassInfo
from .batch_matmuls import batch_matmuls_transform_pass
from .cse import cse_transform_pass
from .dce import dce_transform_pass
from .fold import fold_constants_transform_pass
from .fuse_elementwise import fuse_elementwise_transform_pass
from .hoist import hoist_parameter_subgraphs_transform_pass

STEPS: dict[str, PassFn] = {
    "cse": cse_transform_pass,
    "dce": dce_transform_pass,
    "hoist": hoist_parameter_subgraphs_transform_pass,
    "batch_matmuls": batch_matmuls_transform_pass,
    "fuse_elementwise": fuse_elementwise_transform_pass,
}
ROUND: tuple[str, ...] = ("cse", "dce", "hoist", "batch_matmuls", "fuse_elementwise", "cse", "dce")


@dataclass(frozen=True)
class OptimizeInfo(PassInfo):
    """rounds: rounds run (the last changed nothing unless max_rounds stopped it); steps: (pass, info)
    in order; nodes_before / nodes_after: graph size; folded: buffers made by constant folding."""

    rounds: int
    steps: tuple[tuple[str, dict[str, Any]], ...]
    nodes_before: int
    nodes_after: int
    folded: int


def optimize_graph_pipeline(graph: ForgeGraph, *, skip: tuple[str, ...] = (), fold: bool = False,
                            max_rounds: int = 4) -> tuple[ForgeGraph, OptimizeInfo]:
    """Run the compiler passes to a fixed point (``skip`` names steps to leave out, for ablations).

    ``fold=True`` folds parameter-only values into buffers at the end: inference only (the graph must
    be in eval mode; see fold_constants_transform_pass).
    """
    unknown = sorted(set(skip) - set(STEPS))
    if unknown:
        raise ValueError(f"optimize_graph_pipeline: unknown step(s) {unknown} in skip; allowed: {sorted(STEPS)}")
    if max_rounds < 1:
        raise ValueError(f"optimize_graph_pipeline: max_rounds must be >= 1, got {max_rounds}")
    before = len(graph.model.graph.nodes)
    graph = graph.copy()  # one copy for the whole pipeline; the steps below change it in place
    steps: list[tuple[str, dict[str, Any]]] = []
    rounds = 0
    for rounds in range(1, max_rounds + 1):  # noqa: B007 -- reported
        changed = False
        for name in ROUND:
            if name in skip:
                continue
            graph, info = STEPS[name].apply_inplace(graph)
            steps.append((name, info.to_json()))
            changed |= bool(info.changed)
        if not changed:
            break
    folded = 0
    if fold:
        graph, info = fold_constants_transform_pass.apply_inplace(graph)
        steps.append(("fold_constants", info.to_json()))
        folded = info.folded
    return graph, OptimizeInfo(rounds=rounds, steps=tuple(steps), nodes_before=before,
                               nodes_after=len(graph.model.graph.nodes), folded=folded)
