"""Prune groups for sensitivity_analysis_pass: each attention block's heads and each FFN's hidden units.

Groups come from the pruning passes' own dependency analysis (passes/prune/groups.py, ffn.py) and are
named as they name them: a head group by its attention node, an FFN group by the block's first producer
layer. Removing a unit zeroes what it feeds the next Linear (its columns of the output / down projection),
which is exactly what masking and shrinking do, so that is the perturbation used.

Unit importance is the first-order Taylor estimate of the loss change from removing the unit,
``|sum over its consumer columns of w * dL/dw|`` per batch, summed over batches: the score
``prune_transform_pass`` ranks heads / FFN units by with ``method "taylor"``, so the units counted removed
here are the ones that pass removes. Without a loss (``sqnr`` on unlabelled batches) it is the unit's
activation-weighted output norm, ``mean|a_u| * ||W[:, u]||``. The loss increase at each ratio is measured,
not estimated: the lowest-scored ``round(ratio * units)`` units are masked and the calibration loss is
re-run (``sqnr``: the output's noise over signal power instead).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from ..prune.ffn import ffn_layers
from ..prune.groups import GroupError, analyse_dependencies
from ..select import select_nodes
from .sensitivity_types import GroupSensitivity, SensitivityArgs

if TYPE_CHECKING:
    from ...graph.forge_graph import ForgeGraph
    from .sensitivity import Evaluator

__all__ = ["prune_groups"]

Columns = list[tuple[str, int]]  # (consumer layer path, column) pairs a unit feeds


class _Group:
    """One head / FFN group while it is measured: its units' consumer columns and producer layers."""

    def __init__(self, name: str, kind: Literal["heads", "ffn"], units: list[Columns], layers: list[str]) -> None:
        self.name, self.kind, self.units, self.layers = name, kind, units, tuple(sorted(set(layers)))


def _find_groups(graph: ForgeGraph) -> list[_Group]:
    """The graph's head and FFN groups (none for a model without attention heads or FFN blocks)."""
    gm = graph.model
    try:
        dep = analyse_dependencies(gm, graph.example_inputs)
    except GroupError:
        return []
    classes, feeds = dep.classes(), defaultdict(list)
    for consumer, cols in dep.columns.items():
        for col, u in cols.items():
            feeds[dep.find(u)].append((consumer, col))
    groups = []
    for node, per_head in dep.heads.items():
        roots = [dep.find(u) for u in per_head]
        if any(dep.pinned(r) or not feeds[r] for r in roots):
            continue  # a head that cannot be removed (or feeds no Linear) is no prune candidate
        layers = [dep.units[m][0] for r in roots for m in classes[r]]
        groups.append(_Group(node, "heads", [feeds[r] for r in roots], layers))
    linears = {name: m for _, name, m, _ in select_nodes(gm, {"type": ["linear"]}, modules_only=True)
               if isinstance(m, nn.Linear)}
    seen: set[str] = set()
    for path, (why, partners) in ffn_layers(dep, linears, dict(gm.named_modules())).items():
        key = min(partners) if partners else path
        if why or key in seen or key not in linears:
            continue
        seen.add(key)
        roots = list(dict.fromkeys(dep.root(key, r) for r in range(linears[key].weight.shape[0])))
        if all(feeds[r] for r in roots):
            groups.append(_Group(key, "ffn", [feeds[r] for r in roots], list(partners)))
    return groups


def _taylor_scores(ev: Evaluator, groups: list[_Group], params: dict[str, torch.Tensor]) -> list[list[float]]:
    """Per group, per unit: sum over batches of |sum of w * dL/dw over the unit's consumer columns|."""
    keys = sorted({f"{c}.weight" for g in groups for unit in g.units for c, _ in unit})
    scores = [[0.0] * len(g.units) for g in groups]
    for fresh, grads in ev.grads({k: params[k] for k in keys}):
        per_col = {k[: -len(".weight")]: (w.detach() * g).double().sum(0) for k, w, g in zip(keys, fresh, grads)}
        for gi, g in enumerate(groups):
            for ui, unit in enumerate(g.units):
                scores[gi][ui] += abs(float(sum(per_col[c][col] for c, col in unit)))
    return scores


def _activation_scores(ev: Evaluator, groups: list[_Group], params: dict[str, torch.Tensor]) -> list[list[float]]:
    """Per group, per unit: mean |input column| of each consumer times that column's weight norm."""
    consumers = sorted({c for g in groups for unit in g.units for c, _ in unit})
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = defaultdict(int)

    def hook(path: str) -> Any:
        def record(_module: Any, inputs: tuple[Any, ...]) -> None:
            x = inputs[0].detach().abs().double().reshape(-1, inputs[0].shape[-1])
            sums[path] = sums.get(path, 0) + x.sum(0)
            counts[path] += x.shape[0]
        return record

    handles = [ev.gm.get_submodule(c).register_forward_pre_hook(hook(c)) for c in consumers]
    try:
        ev.outputs()
    finally:
        for h in handles:
            h.remove()
    norms = {c: params[f"{c}.weight"].detach().double().norm(dim=0) for c in consumers}
    return [[float(sum(sums[c][col] / max(counts[c], 1) * norms[c][col] for c, col in unit)) for unit in g.units]
            for g in groups]


def prune_groups(graph: ForgeGraph, ev: Evaluator, args: SensitivityArgs, params: dict[str, torch.Tensor],
                 baseline: float, lossy: bool) -> tuple[GroupSensitivity, ...]:
    """Every head / FFN group's unit scores and its loss increase (or output noise) at each prune ratio."""
    groups = _find_groups(graph)
    if not groups:
        return ()
    scores = _taylor_scores(ev, groups, params) if lossy else _activation_scores(ev, groups, params)
    reference = ev.outputs() if args.method == "sqnr" else []
    out = []
    for g, unit_scores in zip(groups, scores):
        order = torch.argsort(torch.tensor(unit_scores, dtype=torch.float64), stable=True).tolist()
        prune = []
        for ratio in sorted(args.prune_ratios):
            k = int(round(ratio * len(g.units)))
            overrides: dict[str, torch.Tensor] = {}
            for ui in order[:k]:
                for c, col in g.units[ui]:
                    key = f"{c}.weight"
                    if key not in overrides:
                        overrides[key] = params[key].detach().clone()
                    overrides[key][:, col] = 0
            if not overrides:
                delta = 0.0
            elif args.method == "sqnr":
                delta = ev.noise_ratio(reference, overrides)
            else:
                delta = ev.mean_loss(overrides) - baseline
            prune.append((float(ratio), delta))
        out.append(GroupSensitivity(g.name, g.kind, len(g.units), tuple(unit_scores), tuple(prune), g.layers))
    return tuple(out)
