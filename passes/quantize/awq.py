"""awq_transform_pass: activation-aware weight quantization (AWQ) inside fxforge's own quantized layers.

Linears whose weight the config quantizes are grouped by the value they read (q/k/v share one group and one
scale). One run of the float graph over the calibration batches gives each group's input statistics; for each
group (last first, so a fold into an earlier linear's rows is in place before that linear's own search) the
scale s = mean|x|^α minimising the group's output error after quantization is chosen (``awq_search``), the
weights become W·diag(s) (optionally row-clipped) and 1/s is applied to the input exactly (``awq_scale``:
folded into the producing norm / linear, or a ChannelScale node). Then ``quantize_transform_pass`` quantizes
the scaled graph with the same config, so the result is an ordinary quantized graph: it packs, lowers and
checkpoints like one. Every format the quantize pass has works (the search calls the layer's own weight
quantizer); data_in quantization is not modelled by the search (it sees float inputs).

Members (``awq_layers``): nn.Linear, PrunedLinear without activation sparsity, LoRA-wrapped linears (lora_A
scaled with the base weight) and functional linears over a private weight (after fuse_kernels). Not scaled
(round-to-nearest, listed in ``skipped``): a linear called from several nodes or sharing a parameter (tied
heads), other wrappers, convs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import PassArgsError, forge_pass
from ..batching import evaluating, iter_batches, run_batch
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .awq_layers import Member, find_groups
from .awq_scale import fold_inverse_scale
from .awq_search import InputStats, search_clip, search_scale
from .config import QuantizeConfig
from .transform import quantize_transform_pass

__all__ = ["awq_transform_pass", "AwqArgs", "AwqInfo"]

_PROBES = "fxforge_awq_probes"  # calibration probes, present only while the statistics are collected


@dataclass(frozen=True)
class AwqArgs:
    """config: the MASE quantization config (as for quantize_transform_pass); data: calibration batches (None:
    the example inputs); num_batches: stop after this many; grid: α values tried in [0, 1]; clip: also search a
    per-output-row clamp of the scaled weight, over ``clip_grid`` ratios from 1 down to ``clip_min``."""

    config: dict[str, Any] = field(default_factory=dict)
    data: Any = None
    num_batches: int | None = None
    grid: int = 20
    clip: bool = False
    clip_grid: int = 10
    clip_min: float = 0.5

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise ValueError(f"grid must be >= 1, got {self.grid}")
        if self.clip_grid < 1:
            raise ValueError(f"clip_grid must be >= 1, got {self.clip_grid}")
        if not 0.0 < self.clip_min <= 1.0:
            raise ValueError(f"clip_min must be in (0, 1], got {self.clip_min}")
        if self.num_batches is not None and self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1 or None, got {self.num_batches}")


@dataclass(frozen=True)
class AwqInfo(PassInfo):
    """layers: per scaled Linear, the chosen ``alpha`` and the relative output error on the calibration inputs
    of round-to-nearest (``rtn``, α = 0) and AWQ (``awq``); scaled_into: per layer, where its input's inverse
    scale went; skipped: quantized layers left at round-to-nearest, with the reason; batches: calibration
    batches run; quantized_nodes: as quantize_transform_pass reports."""

    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    scaled_into: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    batches: int = 0
    quantized_nodes: int = 0


class _Recorder(nn.Module):
    """Adds every tensor it sees to a group's input statistics and returns nothing (a calibration probe)."""

    def __init__(self, stats: InputStats) -> None:
        super().__init__()
        self.stats = stats

    def forward(self, x: torch.Tensor) -> None:
        self.stats.add(x)


def _collect(graph: ForgeGraph, groups: dict[fx.Node, list[Member]], args: AwqArgs
             ) -> tuple[dict[fx.Node, InputStats], int]:
    """Each group's input statistics over the calibration batches, from one run of the float graph.

    A probe node reading the group's input is inserted before its first member for the run and removed after it
    (the graph is then as it was: no metadata to keep), so functional linears are read like modules."""
    gm = graph.model
    stats = {x: InputStats.empty(members[0].weight.shape[1]) for x, members in groups.items()}
    probes: list[fx.Node] = []
    batches = 0
    try:
        for i, (x, members) in enumerate(groups.items()):
            path = f"{_PROBES}.g{i}"
            gm.add_submodule(path, _Recorder(stats[x]))
            with gm.graph.inserting_before(members[0].node):
                probes.append(gm.graph.call_module(path, (x,)))
        gm.recompile()
        with evaluating(gm):
            for batch in iter_batches(graph, args.data, args.num_batches):
                run_batch(gm, batch)
                batches += 1
    finally:
        for node in probes:
            gm.graph.erase_node(node)
        if hasattr(gm, _PROBES):
            gm.delete_submodule(_PROBES)
        gm.recompile()
    return stats, batches


# the same graph states refused as quantize_transform_pass (it runs inside this pass): quantized, split into
# pipeline stages, activation-checkpointed
@forge_pass("transform", AwqArgs, info=AwqInfo, forbids=quantize_transform_pass.spec.forbids,
            ensures=("metadata", "quantized"),
            contract=NumericalContract("bounded", note="quantized weights after activation-aware input scaling "
                                                       "(exact before quantization); error per layer reported "
                                                       "next to round-to-nearest's"))
def awq_transform_pass(graph: ForgeGraph, args: AwqArgs) -> tuple[ForgeGraph, AwqInfo]:
    """Scale each Linear group's weights by AWQ's searched input scale, then quantize with ``config``."""
    try:
        config = QuantizeConfig.from_dict(args.config)
    except ValueError as exc:
        raise PassArgsError(f"awq_transform_pass: config: {exc}") from None
    gm = graph.model
    groups, skipped = find_groups(gm, config)
    if not groups:
        raise PassArgsError("awq_transform_pass: the config quantizes no Linear weight AWQ can scale; give e.g. "
                            "{'linear': {'config': {'name': 'integer', 'weight_width': 4, 'weight_frac_width': "
                            f"'auto'}}}}; skipped: {skipped}")
    stats, batches = _collect(graph, groups, args)
    if batches == 0:
        raise ValueError("awq_transform_pass: calibration data is empty; pass {'data': [batch, ...]}")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ratios = torch.linspace(1.0, args.clip_min, args.clip_grid + 1)[1:].tolist() if args.clip else []
    report: dict[str, dict[str, float]] = {}
    scaled_into: dict[str, str] = {}
    with GraphRewrite(gm) as rw:
        for x in sorted(groups, key=order.__getitem__, reverse=True):
            members = groups[x]
            if stats[x].rows == 0:
                skipped.update({m.path: "no calibration batch reached it (round-to-nearest kept)" for m in members})
                continue
            weights = [m.float_weight() for m in members]
            choice = search_scale(weights, [m.quantizer for m in members], stats[x], args.grid)
            s = choice.scale.to(device=weights[0].device)
            for i, m in enumerate(members):
                scaled = (weights[i].double() * s).to(weights[i].dtype)
                entry = {"alpha": choice.alpha, "rtn": choice.rtn[i], "awq": choice.awq[i]}
                if ratios:
                    scaled, entry["awq"] = search_clip(weights[i], scaled, m.quantizer, s, stats[x], ratios)
                m.set_scaled(scaled, s)
                report[m.path] = entry
            if choice.alpha == 0.0:  # s = 1 exactly: nothing to divide
                scaled_into.update({m.path: "nothing (alpha 0: round-to-nearest)" for m in members})
                continue
            where = fold_inverse_scale(rw, x, [m.node for m in members], s, like=members[0].weight)
            scaled_into.update({m.path: where for m in members})
    graph, qinfo = quantize_transform_pass.apply_inplace(graph, args.config)
    return graph, AwqInfo(layers=dict(sorted(report.items())), scaled_into=scaled_into, skipped=skipped,
                          batches=batches, quantized_nodes=qinfo.quantized_nodes)
