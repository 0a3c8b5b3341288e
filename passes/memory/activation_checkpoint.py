"""activation_checkpoint_transform_pass: fit a training step's activation memory into a budget by recomputation.

How it chooses (passes/memory/checkpoint_plan.py): one training-mode run with grad records, per node, the
bytes autograd saves for backward and the result storages (the liveness analysis's runner), and a forward cost
(the profile pass's latency when present, else FLOPs + bytes). A dynamic program over the topological order
(Chen et al.'s sublinear-memory segments, Checkmate-style costs) picks contiguous segments to recompute:
for each cap on one segment's internal saved bytes and each price of recompute time, it minimises kept bytes
(saved tensors outside segments + boundary inputs of segments) + price x recomputed cost; the cheapest plan
whose estimated peak (kept + the largest segment + a gradient in flight) fits the budget wins, less the
segments the budget does not need. A budget below the smallest peak any plan reaches is refused with that
figure. With ``measure`` the budget holds on the allocator's measured peak instead of the estimate: candidate
plans are applied to a copy and measured over one training step on the planning inputs, and the cheapest that
measures within the budget wins (passes/memory/measured_fit.py).
With ``selective`` the regions keep their matrix multiplies' and attentions' results (selective
activation checkpointing) and the planner prices a segment that way: kept bytes add those results, recomputed
cost is the rest's. ``selective="attention"`` keeps only the fused attention kernels' results: at a long
sequence attention is the costliest op for the bytes it returns (the zoo GPT at T = 1024: 8 ms for 2 MB per
layer), so such regions fit the memory of checkpointing every layer and recompute a third less (0.60 of a
forward against full regions' 0.92).

How it rewrites: each segment becomes a :class:`CheckpointRegion` (passes/memory/checkpoint_region.py) called
once from the graph; it runs ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True)``, so outputs and gradients are bitwise those of the original graph, dropout
included (the RNG state of the forward is replayed). Nodes that write in place, return nothing (guards) or
switch grad mode never enter a segment. get_attr nodes stay in the graph and are passed in. The regions'
layers keep their paths (and parameter names); module transforms (LoRA, quantize, prune) cannot select them
and refuse to run after this pass ("activation-checkpointed" graph property): run them first.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ..analysis.step_memory import measured_step_bytes
from ..base import PassArgsError, PassError, forge_pass
from ..contract import NumericalContract, PassInfo
from ..propagate import flat_inputs
from ..rewrite import GraphRewrite
from .checkpoint_plan import Plan, graph_costs, plan_checkpoints
from .checkpoint_region import CheckpointRegion, Selective, is_selective
from .measured_fit import fit_measured

__all__ = ["ActivationCheckpointArgs", "ActivationCheckpointInfo", "activation_checkpoint_transform_pass"]

MB = 2**20
_NAME = "activation_checkpoint_transform_pass"


@dataclass(frozen=True)
class ActivationCheckpointArgs:
    """Exactly one of budget_mb (peak training activation memory, MB = 2^20 bytes) or fraction (of the
    unmodified graph's estimated peak); data: inputs to plan on instead of the example inputs; selective: True
    keeps the regions' matrix multiplies' and attentions' results and recomputes only the rest (selective
    activation checkpointing: more memory per region, far less recomputation, which torch.compile fuses into
    backward); "attention" keeps only the fused attention kernels' results; each is planned with its memory
    model. measure: fit the budget on the allocator's measured peak of candidate plans (one training step each
    on the planning inputs, in train mode, RNG state restored) rather than on the estimate."""

    budget_mb: float | None = None
    fraction: float | None = None
    data: Any = None
    selective: Selective = False
    measure: bool = False

    def __post_init__(self) -> None:
        if (self.budget_mb is None) == (self.fraction is None):
            raise ValueError("give exactly one of 'budget_mb' (MB) or 'fraction' (of the unmodified peak)")
        if self.budget_mb is not None and not self.budget_mb > 0:
            raise ValueError(f"budget_mb must be > 0, got {self.budget_mb}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if not is_selective(self.selective):
            raise ValueError(f"selective must be true, false or 'attention', got {self.selective!r}")
        if not isinstance(self.measure, bool):
            raise ValueError(f"measure must be true or false, got {self.measure!r}")


@dataclass(frozen=True)
class ActivationCheckpointInfo(PassInfo):
    """Estimated peaks (bytes), the budget, the segments (first and last node of each), the extra forward cost
    as a fraction of one forward, and where the costs came from; with measure, the chosen plan's measured peak
    and how many plans were measured (else None and 0)."""

    planned_peak_bytes: int
    baseline_peak_bytes: int
    budget_bytes: int
    segments: int
    segment_nodes: tuple[tuple[str, str], ...]
    recompute_fraction: float
    cost_source: str
    measured_peak_bytes: int | None = None
    measured_plans: int = 0


def _checkpoint_segment(gm: fx.GraphModule, rw: GraphRewrite, seg: list[fx.Node], k: int,
                        selective: Selective) -> None:
    """One segment (nodes in graph order) becomes a CheckpointRegion call; its outputs are read by getitem."""
    members = set(seg)
    inputs = list(dict.fromkeys(a for n in seg for a in n.all_input_nodes if a not in members))
    outputs = [n for n in seg if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in inputs}
    children: dict[str, nn.Module] = {}
    local: dict[str, str] = {}
    for node in seg:
        new = graph.node_copy(node, env.__getitem__)
        new.meta = {}
        if node.op == "call_module":
            path = str(node.target)
            if path not in local:
                local[path] = f"m{len(local)}"
                children[local[path]] = gm.get_submodule(path)
            new.target = local[path]
        env[node] = new
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    region = CheckpointRegion(graph, children, len(inputs), selective=selective)
    call = rw.call_module(f"activation_checkpoint_{k}", region, tuple(inputs), after=seg[-1])
    if len(outputs) == 1:  # one value, not a 1-tuple (metadata records a 1-tuple as its element)
        rw.redirect_users(outputs[0], call, keep=members.__contains__)
        outputs = []
    last = call
    for i, out in enumerate(outputs):
        last = rw.call_function(operator.getitem, (call, i), after=last)
        rw.redirect_users(out, last, keep=members.__contains__)
    for node in reversed(seg):
        rw.erase(node)


@forge_pass("transform", ActivationCheckpointArgs, info=ActivationCheckpointInfo, forbids=("activation-checkpointed",),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, mode="train",
                                       note="recomputation replays the same ops and RNG state"))
def activation_checkpoint_transform_pass(graph: ForgeGraph, args: ActivationCheckpointArgs
                                         ) -> tuple[ForgeGraph, ActivationCheckpointInfo]:
    """Plan segments within the budget (module docstring) and rewrite them into checkpointed regions."""
    gm = graph.model
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise PassArgsError(f"{_NAME}: no inputs: capture with example_inputs or pass {{'data': ...}}")
    flat = flat_inputs(gm, example)
    if not any(t.requires_grad for t in (*gm.parameters(), *(v for v in flat if isinstance(v, torch.Tensor)))):
        raise PassError(f"{_NAME}: nothing in the graph requires grad (every parameter is frozen), so a training "
                        "step saves no activation to recompute; make the layers to train trainable first "
                        "(unfreeze_transform_pass, or insert_lora_adapter_transform_pass)")
    costs = graph_costs(gm, flat, selective=args.selective)
    share = args.fraction if args.fraction is not None else 1.0
    budget = int(args.budget_mb * MB) if args.budget_mb is not None else int(share * costs.baseline_peak)
    measured: int | None = None
    tried = 0
    if args.measure:
        fit = fit_measured(costs, budget, lambda p: _measured_peak(graph, p, flat, args.selective))
        plan, measured, tried = fit.plan, fit.measured, fit.measured_plans
        if plan is None:
            raise PassError(f"{_NAME}: a budget of {budget / MB:.4f} MB is below the smallest peak measured, "
                            f"{(fit.least_measured or 0) / MB:.4f} MB over {tried} plans (the smallest estimated "
                            f"{fit.least_estimate / MB:.4f} MB); give at least that, or smaller inputs")
    else:
        plan, smallest = plan_checkpoints(costs, budget)
        if plan is None:
            raise PassError(f"{_NAME}: a budget of {budget / MB:.4f} MB is below the smallest peak any plan "
                            f"reaches, {smallest / MB:.4f} MB (unmodified: {costs.baseline_peak / MB:.4f} MB); give "
                            "at least that, or smaller inputs")
    segments = _rewrite(gm, plan.segments, args.selective)
    forward = costs.forward_cost
    return graph, ActivationCheckpointInfo(
        planned_peak_bytes=plan.peak, baseline_peak_bytes=costs.baseline_peak, budget_bytes=budget,
        segments=len(segments), segment_nodes=tuple((s[0].name, s[-1].name) for s in segments),
        recompute_fraction=plan.cost / forward if forward > 0 else 0.0, cost_source=costs.cost_source,
        measured_peak_bytes=measured, measured_plans=tried)


def _rewrite(gm: fx.GraphModule, plan: tuple[tuple[int, int], ...], selective: Selective) -> list[list[fx.Node]]:
    """Each planned segment (node indices in ``gm``'s graph order) becomes a region; returns the segments'
    nodes. Not recompiled (the pass decorator recompiles the graph; a caller outside it must)."""
    nodes = list(gm.graph.nodes)
    segments = [[n for n in nodes[a:b + 1] if n.op != "get_attr"] for a, b in plan]
    if segments:
        with GraphRewrite(gm) as rw:
            for k, seg in enumerate(segments):
                _checkpoint_segment(gm, rw, seg, k, selective)
    return segments


def _measured_peak(graph: ForgeGraph, plan: Plan, flat: list[Any], selective: Selective) -> int:
    """The allocator's peak over one training step of a copy of ``graph`` rewritten with ``plan`` (weights
    shared, train mode, every weight's grad allocated first and put back after, the RNG state restored)."""
    trial = graph.copy(share_weights=True).model
    _rewrite(trial, plan.segments, selective)
    trial.recompile()
    trial.train()
    with torch.random.fork_rng(devices=[]):
        return measured_step_bytes(trial, flat)


def checkpoint_regions(module: nn.Module) -> list[CheckpointRegion]:
    """The checkpointed regions in a (rewritten) graph module."""
    return [m for m in module.modules() if isinstance(m, CheckpointRegion)]
