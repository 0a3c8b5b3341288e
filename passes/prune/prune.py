"""``prune_transform_pass``: MASE-style pruning masks (weights and activations), element-wise or structured.

Selected Linear / Conv layers become their masked twins (passes/prune/modules.py) through the rewrite
engine; the masks are buffers applied in the forward, so pruned weights stay zero through training,
LoRA, quantization and checkpoints. Structured granularities use the graph's dependency groups
(passes/prune/groups.py): ``head`` masks the q/k/v rows of whole attention heads, ``ffn`` whole
feed-forward units (passes/prune/ffn.py; a gated MLP's gate and up rows together);
``shrink_transform_pass`` then removes masked groups physically.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import NoMatchError, describe_candidates, inject_modules
from ..select import select_nodes
from .config import PruneArgs, PruneSection
from .ffn import ffn_units
from .groups import DependencyGraph, GroupError, analyse_dependencies
from .modules import MaskedLayer, PrunableLayer, is_masked, is_prunable, pruned_from
from .movement import movement_scores
from .scores import unit_taylor_scores, weight_scores

__all__ = ["prune_transform_pass", "PruneInfo", "LayerSparsity"]

DEFAULT_TARGETS: dict[str, Any] = {"type": ["linear", "conv1d", "conv2d"]}
Unit = tuple[str, list[tuple[str, int]]]  # (group key: layer path or attention node, rows (path, row) cut together)


def _is_pruned(graph: ForgeGraph) -> bool:
    return any(is_masked(m) for m in graph.model.modules())


register_property("pruned", _is_pruned, "some layer carries pruning masks (prune_transform_pass)")


@dataclass(frozen=True)
class LayerSparsity:
    """One masked layer: weights kept / total and the achieved sparsity."""

    name: str
    kept: int
    total: int
    sparsity: float


@dataclass(frozen=True)
class PruneInfo(PassInfo):
    """Per-layer figures, the global figure over the masked layers, and what was removed in units."""

    layers: tuple[LayerSparsity, ...]
    kept: int
    total: int
    sparsity: float
    granularity: str
    method: str
    scope: str
    units_pruned: int
    units_total: int
    activation_sparsity: float


def _lowest(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Bool mask of the round(fraction * n) lowest scores (exact count, ties broken by position)."""
    out = torch.zeros(scores.numel(), dtype=torch.bool)
    k = int(round(fraction * scores.numel()))
    if k > 0:
        out[torch.argsort(scores.reshape(-1).float(), stable=True)[:k]] = True
    return out.reshape(scores.shape)


def _structured_units(sec: PruneSection, dep: DependencyGraph | None, layers: dict[str, PrunableLayer],
                      modules: dict[str, nn.Module], explicit: bool) -> tuple[dict[str, PrunableLayer], list[Unit]]:
    """The layers that carry ``sec.granularity`` units (a subset of the selected ``layers`` when the
    selector was the default) and the units: (group key, rows, score placeholder, size)."""
    units: list[Unit] = []
    if sec.granularity == "row" or dep is None:
        for path, layer in layers.items():
            units += [(path, [(path, r)]) for r in range(layer.weight.shape[0])]
        return layers, units
    if sec.granularity == "ffn":
        return ffn_units(dep, layers, modules, explicit)
    heads, classes = dep.head_of(), dep.classes()
    in_heads = {dep.units[u][0] for root in heads for u in classes[root]}
    bad = [p for p in layers if p not in in_heads]
    if explicit and bad:
        raise GroupError(f"head pruning: layer {bad[0]!r} has no attention heads (its rows do not reach a "
                         f"scaled_dot_product_attention as a head axis); layers with heads: {sorted(in_heads)}")
    for root, (node, h) in heads.items():
        rows = [dep.units[u] for u in classes[root]]
        if not any(p in layers for p, _ in rows):
            continue
        if dep.pinned(root):
            raise GroupError(f"head {h} of {node!r} cannot be pruned: {dep.pinned(root)}")
        missing = sorted({p for p, _ in rows if p not in layers})
        if missing:
            raise GroupError(f"head pruning at {node!r}: q/k/v layers {missing} must be selected too")
        units.append((node, rows))
    if not units:
        raise GroupError(f"head pruning: no selected layer has attention heads; layers with heads: "
                         f"{sorted(in_heads)}")
    return {p: layers[p] for p in layers if p in in_heads}, units


def _structured_masks(sec: PruneSection, layers: Mapping[str, MaskedLayer], units: list[Unit],
                      scores: dict[str, torch.Tensor] | list[float]) -> tuple[dict[str, torch.Tensor], int]:
    """Row masks (True = prune) from unit scores: element scores summed per unit (local: per group key,
    global: one threshold over per-element means so wide and narrow layers are on one scale), or one
    score per unit (taylor's loss-change estimates, on one scale already); returns (masks, units pruned)."""
    if isinstance(scores, list):
        scored = [(key, rows, s, 1) for (key, rows), s in zip(units, scores, strict=True)]
    else:
        scored = [(key, rows, sum(float(scores[p][r].sum()) for p, r in rows),
                   sum(scores[p][r].numel() for p, r in rows)) for key, rows in units]
    masks = {p: torch.zeros(layer.weight.shape[0], dtype=torch.bool) for p, layer in layers.items()}
    keys = sorted({k for k, _, _, _ in scored}) if sec.scope == "local" else [None]
    pruned = 0
    for key in keys:
        chosen = [u for u in scored if key is None or u[0] == key]
        vals = torch.tensor([s / n if key is None else s for _, _, s, n in chosen])
        for (_, rows, _, _), d in zip(chosen, _lowest(vals, sec.sparsity).tolist()):
            if d:
                pruned += 1
                for p, r in rows:
                    masks[p][r] = True
    return masks, pruned


def _masked_layer(gm: fx.GraphModule, path: str) -> MaskedLayer:
    """The layer at ``path`` once the pass has swapped it for its masked twin."""
    layer = gm.get_submodule(path)
    if not is_masked(layer):
        raise RuntimeError(f"prune_transform_pass: layer {path!r} is a {type(layer).__name__} after masking, "
                           "not a masked layer; a bug in the pass, please report it")
    return layer


def _candidates(gm: fx.GraphModule, targets: Any, exclude: Any) -> dict[str, PrunableLayer]:
    """Selected layers that have a masked twin (or are masked already); NoMatchError lists candidates."""
    out = {name: m for _, name, m, _ in select_nodes(gm, targets, exclude, modules_only=True)
           if m is not None and is_prunable(m)}
    if not out:
        raise NoMatchError(f"no Linear / Conv layer matched targets={targets!r} exclude={exclude!r}; "
                           f"candidates: {describe_candidates(gm)}")
    return out


@forge_pass("transform", PruneArgs, info=PruneInfo, ensures=("pruned",), forbids=("quantized", "lora", "int8-lowered",
                                                                      "activation-checkpointed", "pipeline-stages"),
            contract=NumericalContract("bounded", note="pruning changes outputs; the error is measured"))
def prune_transform_pass(graph: ForgeGraph, args: PruneArgs) -> tuple[ForgeGraph, PruneInfo]:
    """Mask the selected layers' weights (and optionally inputs) as MASE's config says; info per layer."""
    gm = graph.model
    sec, act = args.weight_section, args.activation_section
    explicit = args.targets is not None
    targets = args.targets if explicit else DEFAULT_TARGETS
    structured = sec if sec is not None and sec.sparsity > 0 and sec.granularity != "elementwise" else None
    if structured is not None and structured.granularity in ("head", "ffn") and not explicit:
        targets = {"type": ["linear"]}
    selected = _candidates(gm, targets, args.exclude)
    units: list[Unit] = []
    dep: DependencyGraph | None = None
    if structured is not None:  # head / ffn: only the layers in those groups are wrapped (found before any change)
        dep = analyse_dependencies(gm, graph.example_inputs) if structured.granularity != "row" else None
        selected, units = _structured_units(structured, dep, selected, dict(gm.named_modules()), explicit)
    recorded = movement_scores(graph, selected) if sec is not None and sec.sparsity > 0 and sec.method == "movement" \
        else None  # read from the nodes' metadata before the layers are swapped
    inject_modules(gm, {"name": sorted(selected)}, None,
                   lambda name, m: pruned_from(m) if name in selected else None, what="Linear / Conv layer")
    layers = {p: _masked_layer(gm, p) for p in selected}
    units_pruned = units_total = 0
    if sec is not None and sec.sparsity > 0:
        if sec.granularity == "elementwise":
            scores = recorded if recorded is not None else weight_scores(
                graph, layers, sec.method, args.data, args.num_batches, args.loss_fn, args.seed)
            if sec.scope == "global":
                flat = torch.cat([s.reshape(-1) for s in scores.values()])
                drop = _lowest(flat, sec.sparsity).split([s.numel() for s in scores.values()])
                drops = {p: d.reshape(scores[p].shape) for p, d in zip(scores, drop)}
            else:
                drops = {p: _lowest(s, sec.sparsity) for p, s in scores.items()}
            for p, d in drops.items():
                layers[p].set_masks(~d)
            units_pruned = sum(int(d.sum()) for d in drops.values())
            units_total = sum(d.numel() for d in drops.values())
        else:
            unit_scores: dict[str, torch.Tensor] | list[float]
            if sec.method == "taylor" and dep is not None:  # head / ffn: one loss-change estimate per unit
                unit_scores = unit_taylor_scores(graph, dep, units, args.data, args.num_batches, args.loss_fn)
            elif recorded is not None:  # movement: element scores summed per unit, like l1 / l2
                unit_scores = recorded
            else:
                unit_scores = weight_scores(graph, layers, sec.method, args.data, args.num_batches, args.loss_fn,
                                            args.seed)
            rows, units_pruned = _structured_masks(sec, layers, units, unit_scores)
            units_total = len(units)
            for p, r in rows.items():
                layer = layers[p]
                wmask = (~r).reshape(-1, *([1] * (layer.weight.dim() - 1))).expand_as(layer.weight)
                layer.set_masks(wmask, ~r)
    if act is not None:
        for layer in layers.values():
            layer.act_sparsity, layer.act_method, layer.act_scope = act.sparsity, act.method, act.scope
    stats = []
    for name, layer in layers.items():
        kept, total = int(layer.weight_mask.sum()), layer.weight_mask.numel()
        stats.append(LayerSparsity(name, kept, total, 1.0 - kept / total))
    kept, total = sum(s.kept for s in stats), sum(s.total for s in stats)
    info = PruneInfo(tuple(stats), kept, total, 1.0 - kept / max(total, 1),
                     sec.granularity if sec else "none", sec.method if sec else "none", sec.scope if sec else "none",
                     units_pruned, units_total, act.sparsity if act else 0.0)
    return graph, info
