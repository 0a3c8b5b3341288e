"""The activation-checkpoint planner: which contiguous segments of the graph to recompute in backward.

Costs come from one run of the graph in training mode with grad (the liveness analysis's runner: it records
what autograd saves per node, by storage, and each node's result storages), plus FLOPs per node from the same
run; a node's forward time is its ProfileRecord latency when the profile pass ran, else FLOPs + 4 x result
bytes (a memory-bound op costs time too; attention the counter has no formula for is counted from its shapes).

Memory model (Chen et al., "sublinear memory"): a checkpointed segment keeps only its boundary inputs (and the
CPU RNG state); its internal saved tensors come back one segment at a time during backward. So

    peak = sum(saved bytes of nodes outside segments) + sum(boundary input + RNG state bytes of segments)
           + max(saved bytes inside one segment) + transient

where transient = 2 x the largest activation (a gradient in flight beside its input). Backward frees what it
has passed, so the figure is taken per segment (plan_of): what is kept up to the segment's end + its inside,
or all kept bytes at backward's start if larger; the plain sum above bounds it loosely (MiniLM
8x128: ~20 % above the measured peak, so a plan for it over-saved). For a cap L on the
largest segment and a price lambda per unit of recompute cost, a dynamic program over the topological order
(f[i] = min over "keep node i" / "segment j..i" of kept bytes + lambda * recomputed cost) finds the best
segmentation; sweeping L and lambda (a grid of L, refined around the L of the smallest peak when no plan on
the grid fits; a grid of lambda, then bisection of lambda at the budget's edge for each L) gives a set of plans,
and the cheapest whose peak fits the budget wins; then its segments the budget does not need are dropped,
costliest first (identical layers cost the same, so a price alone takes them all or none).
The smallest peak over the sweep (lambda -> 0) is the smallest reachable figure.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...graph.metadata import get_meta, has_meta
from ..analysis.liveness import _Runner
from ..analysis.profile import FlopsPerNode, ProfileRecord
from .checkpoint_region import KeptStorages, Selective, kept_ops

__all__ = ["GraphCosts", "Plan", "graph_costs", "plan_checkpoints", "plan_of"]

_REFINE = 4  # rounds of cap refinement (plan_checkpoints)

_MUTATING_FUNCTIONS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                 operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                                 operator.ior, operator.ixor, operator.ilshift, operator.irshift})


@dataclass(frozen=True)
class GraphCosts:
    """Per node (graph order): whether a segment may contain it, saved-for-backward bytes, forward cost; and
    per segment end i: the candidate segments [j..i] as (j, saved bytes inside, boundary input bytes, cost)."""

    nodes: tuple[fx.Node, ...]
    segmentable: tuple[bool, ...]
    saved: tuple[int, ...]
    cost: tuple[float, ...]
    transient: int
    spans: tuple[tuple[tuple[int, int, int, float], ...], ...]
    cost_source: str

    @property
    def baseline_peak(self) -> int:
        """The model's peak without any segment."""
        return sum(self.saved) + self.transient

    @property
    def forward_cost(self) -> float:
        return sum(self.cost)


@dataclass(frozen=True)
class Plan:
    """Chosen segments as inclusive node-index ranges, their estimated peak and recompute cost."""

    segments: tuple[tuple[int, int], ...]
    peak: int
    cost: float


class _CostRunner(FlopsPerNode, _Runner):
    """The liveness runner, also counting FLOPs per node."""

    def __init__(self, gm: fx.GraphModule, mode: Any) -> None:  # a FlopCounterMode
        super().__init__(gm)
        self.mode = mode
        self.flops = {}


def _mutates(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a node may write a tensor in place or update module state (recomputing it would do it again):
    such a node is never in a segment."""
    target = node.target
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return str(target).endswith("_") and not str(target).startswith("_")
    if node.op == "call_module":  # an in-place activation, or running statistics updated by each call
        module = gm.get_submodule(str(target))
        return getattr(module, "inplace", False) is True or getattr(module, "track_running_stats", False) is True
    if isinstance(target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
    name = getattr(target, "__name__", "")
    return target in _MUTATING_FUNCTIONS or (name.endswith("_") and not name.startswith("_"))


def _segmentable(gm: fx.GraphModule, node: fx.Node, value: Any) -> bool:
    """A computation a checkpoint can replay: returns a value, writes nothing, switches no global mode."""
    if node.op not in ("call_module", "call_function", "call_method") or value is None or _mutates(gm, node):
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}"
    return not any(k in name for k in ("grad_enabled", "autocast", "check_input_shapes", "_assert"))


def _attention_flops(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any]) -> int:
    """FLOPs of a scaled-dot-product attention node the counter saw as 0 (no formula for the CPU flash kernel, so
    the planner took the costliest op of a long sequence for free): Q K^T and P V, 4 x B x H x L x S x E, half
    that when causal."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if getattr(module, "fxforge_op", None) != "scaled_dot_product_attention":
            return 0
        causal = bool(getattr(module, "is_causal", False))
    elif node.target is torch.nn.functional.scaled_dot_product_attention:
        causal = bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
    else:
        return 0
    q, k = (env.get(a) if isinstance(a, fx.Node) else a for a in node.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return 0
    flops = 4 * q.numel() * k.shape[-2]  # q: (..., L, E), k: (..., S, E)
    return flops // 2 if causal else flops


class _KeptResults(KeptStorages):
    """The kept storages (the mode's kept_ops results) by the runner's current node: exactly what
    torch.utils.checkpoint's policy will hold, whichever kernels the node's layers call."""

    def __init__(self, runner: _Runner, selective: Selective) -> None:
        super().__init__(kept_ops(selective))
        self.runner = runner
        self.kept: dict[fx.Node, dict[int, int]] = {}

    def record(self, ptr: int, size: int) -> None:
        if self.runner.current is not None:
            self.kept.setdefault(self.runner.current, {})[ptr] = size


def graph_costs(gm: fx.GraphModule, flat: list[Any], selective: Selective = False) -> GraphCosts:
    """Run ``gm`` once in training mode with grad (RNG state restored after) and derive the planner's costs.

    ``selective``: the segments are selective regions (CheckpointRegion(selective=True)), which keep the
    results of their matrix multiplies and fused attention kernels (SAVED_OPS, recorded per node as the run
    calls them) and recompute only the rest: a segment's kept bytes add those results, its inside loses the
    saved tensors they are, and a node whose kernels are all kept costs nothing to recompute. ``"attention"``:
    the same with only the fused attention kernels' results kept (ATTENTION_OPS)."""
    from torch.utils.flop_counter import FlopCounterMode  # imports triton: only when a plan is made

    mode = FlopCounterMode(display=False)
    runner = _CostRunner(gm, mode)
    modes = [(m, m.training) for m in gm.modules()]
    buffers = [(b, b.clone()) for b in gm.buffers()]  # a training-mode run may update running statistics
    gm.train()
    kept = _KeptResults(runner, selective)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), mode, \
                torch.autograd.graph.saved_tensors_hooks(runner.pack, lambda t: t), \
                (kept if selective else contextlib.nullcontext()):
            runner.run(*flat)
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, before in buffers:
                if not torch.equal(b, before):  # untouched buffers keep their version counter
                    b.copy_(before)
    nodes = tuple(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    held = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers(),
                                                     *(v for v in flat if isinstance(v, torch.Tensor)))} | {0}
    seen: set[int] = set(held)
    saved = []
    saved_by: list[dict[int, int]] = []
    for node in nodes:  # each saved storage counted once, at the first node that saved it
        mine = {p: s for p, s in runner.saved.get(node, []) if p not in seen}
        seen.update(mine)
        saved.append(sum(mine.values()))
        saved_by.append(mine)
    produced = [{p: s for p, s in runner.storages.get(n, []) if p not in held} for n in nodes]
    segmentable = tuple(_segmentable(gm, n, runner.env.get(n)) for n in nodes)
    latency = [get_meta(n).software.get(ProfileRecord) if has_meta(n) else None for n in nodes]
    if all(r is not None for r, ok in zip(latency, segmentable) if ok) and any(latency):
        cost = tuple(float(r.latency_ms) if r is not None and ok else 0.0 for r, ok in zip(latency, segmentable))
        source = "profile latency"
    else:
        cost = tuple(float((runner.flops.get(n, 0) or _attention_flops(gm, n, runner.env))
                           + 4 * sum(produced[i].values())) if segmentable[i] else 0.0 for i, n in enumerate(nodes))
        source = "flops + 4 x result bytes"
    transient = 2 * max((sum(p.values()) for p in produced), default=0)
    inputs = [sorted({index[a] for a in n.all_input_nodes}) for n in nodes]
    rng = torch.get_rng_state().nbytes  # each region keeps the CPU RNG state to replay dropout (~5 KB)
    keeps = [{p: sz for p, sz in kept.kept.get(n, {}).items() if p not in held} for n in nodes]
    heavy = tuple(bool(keeps[i]) and segmentable[i] for i in range(len(nodes)))
    spans: list[tuple[tuple[int, int, int, float], ...]] = []
    for i in range(len(nodes)):
        out: list[tuple[int, int, int, float]] = []
        if segmentable[i]:
            refs: dict[int, int] = {}  # storage -> how many outside producers feeding the segment hold it
            members: set[int] = set()
            in_bytes = inside = keep = 0
            work = 0.0
            inside_at: dict[int, int] = {}  # selective: saved storages counted inside, by pointer
            kept_at: set[int] = set()  # selective: results of heavy members (kept by the region)
            for j in range(i, -1, -1):
                free = nodes[j].op == "get_attr"
                if not (segmentable[j] or free):
                    break
                if j in members:  # a producer inside the segment is no longer one of its inputs
                    members.discard(j)
                    for p, s in produced[j].items():
                        refs[p] -= 1
                        if refs[p] == 0:
                            del refs[p]
                            in_bytes -= s
                if not free and not selective:
                    inside += saved[j]
                    work += cost[j]
                elif not free:  # walking back: a heavy producer comes after its savers were counted inside
                    for p, sz in saved_by[j].items():
                        if p not in kept_at:
                            inside_at[p] = sz
                            inside += sz
                    for p, sz in keeps[j].items():
                        kept_at.add(p)
                        keep += sz
                        inside -= inside_at.pop(p, 0)
                    if not heavy[j]:  # a node whose kernels are kept is not recomputed (its views are free)
                        work += cost[j]
                if not free:
                    for a in inputs[j]:
                        if a not in members:
                            members.add(a)
                            for p, s in produced[a].items():
                                refs[p] = refs.get(p, 0) + 1
                                if refs[p] == 1:
                                    in_bytes += s
                    out.append((j, inside, in_bytes + rng + keep, work))
        spans.append(tuple(out))
    return GraphCosts(nodes, segmentable, tuple(saved), cost, transient, tuple(spans), source)


def _solve(c: GraphCosts, cap: int, lam: float) -> Plan:
    """The DP for one cap on a segment's internal bytes and one price per unit of recompute cost."""
    n = len(c.nodes)
    best = [0.0] * (n + 1)
    mem = [0] * (n + 1)
    work = [0.0] * (n + 1)
    top = [0] * (n + 1)
    back = [-1] * (n + 1)
    for i in range(n):
        best[i + 1], mem[i + 1], work[i + 1], top[i + 1] = best[i] + c.saved[i], mem[i] + c.saved[i], work[i], top[i]
        for j, inside, in_bytes, w in c.spans[i]:
            if inside > cap:
                break
            value = best[j] + in_bytes + lam * w
            if value < best[i + 1]:
                best[i + 1], mem[i + 1], work[i + 1] = value, mem[j] + in_bytes, work[j] + w
                top[i + 1], back[i + 1] = max(top[j], inside), j
    segments = []
    i = n
    while i > 0:
        if back[i] >= 0:
            segments.append((back[i], i - 1))
            i = back[i]
        else:
            i -= 1
    return plan_of(c, tuple(reversed(segments)))


def plan_of(c: GraphCosts, segments: tuple[tuple[int, int], ...]) -> Plan:
    """Any set of candidate segments (disjoint, in order, each an (first, last) pair spans offers) priced by the
    planner's memory model: backward runs in reverse and frees each node's saved tensors once past it, so
    segment k is recomputed while only what is kept up to its end is live. Peak = the transient + the larger of
    all kept bytes (backward's start) and, over segments, kept bytes up to the segment's end + its inside."""
    prefix = [0]
    for b in c.saved:
        prefix.append(prefix[-1] + b)
    dropped = boundary = top = 0  # saved bytes of earlier segments' nodes (not kept), their boundaries (kept)
    work = 0.0
    for a, b in segments:
        inside, in_bytes, w = next((i, s, w) for j, i, s, w in c.spans[b] if j == a)
        boundary += in_bytes  # a selective segment's kept results are here, not among its nodes' saved bytes
        top = max(top, prefix[a] - dropped + boundary + inside)  # this segment's inside is live while recomputed
        dropped += prefix[b + 1] - prefix[a]
        work += w
    kept = prefix[-1] - dropped + boundary
    return Plan(segments, max(kept, top) + c.transient, work)


def _caps(sizes: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Up to ``k`` indices into ``sizes`` (sorted) from ``lo`` to ``hi`` inclusive, evenly spread in log-space."""
    if hi - lo + 1 <= k:
        return list(range(lo, hi + 1))
    a, b = math.log(sizes[lo]), math.log(sizes[hi])
    return sorted({min(range(lo, hi + 1), key=lambda i: abs(math.log(sizes[i]) - (a + (b - a) * t / (k - 1))))
                   for t in range(k)})


def plan_checkpoints(c: GraphCosts, budget: int | None) -> tuple[Plan | None, int]:
    """The cheapest plan whose peak is within ``budget`` bytes (None if none is), and the smallest peak reached.

    Caps on a segment's inside bytes: 12 spread in log-space over the sizes that occur; when no plan on them fits
    the budget (or none is given), refined (_REFINE rounds) between the neighbours of the cap that reached the
    smallest peak: one layer's inside is one size among hundreds, and a cap a third off it splits every layer or
    merges two (MiniLM 8x128: 82.7 MB the smallest on the coarse grid, 56.2 MB refined). Where a coarse plan
    fits, refined caps are not searched: their plans priced cheaper ran slower (the zoo GPT at T=1024 and 0.49x
    its peak: 6 segments priced 0.687 of a forward took 1.14x the unmodified step, the coarse 3 priced 0.705
    took 0.88x, interleaved in one run): the cost model does not price a region's own overhead."""
    sizes = sorted({inside for span in c.spans for _, inside, _, _ in span if inside > 0})
    unit = max(sum(c.saved), 1) / max(c.forward_cost, 1e-12)
    prices = [unit * 10.0 ** (k / 2 - 3.5) for k in range(10)]
    plans = [Plan((), c.baseline_peak, 0.0)]
    smallest: dict[int, int] = {}  # cap index -> the smallest peak of its plans

    def sweep(cap: int) -> None:
        found = [_solve(c, sizes[cap], lam) for lam in prices]
        fit = [k for k, p in enumerate(found) if budget is not None and p.peak <= budget]
        if fit and fit[-1] + 1 < len(prices):  # bisect the price between the last plan that fits and the next
            lo, hi = math.log(prices[fit[-1]]), math.log(prices[fit[-1] + 1])
            for _ in range(5):
                plan = _solve(c, sizes[cap], math.exp((lo + hi) / 2))
                found.append(plan)
                lo, hi = ((lo + hi) / 2, hi) if plan.peak <= (budget or 0) else (lo, (lo + hi) / 2)
        plans.extend(found)
        smallest[cap] = min(p.peak for p in found)

    for cap in _caps(sizes, 0, len(sizes) - 1, 12) if sizes else []:
        sweep(cap)
    for _ in range(_REFINE):
        tried = sorted(smallest)
        if not tried or (budget is not None and min(smallest.values()) <= budget):  # a coarse plan fits: chosen
            break
        at = tried.index(min(tried, key=lambda i: (smallest[i], i)))
        new = [i for i in _caps(sizes, tried[max(at - 1, 0)], tried[min(at + 1, len(tried) - 1)], 7)
               if i not in smallest]
        if not new:
            break
        for cap in new:
            sweep(cap)
    least = min(p.peak for p in plans)
    fits = [p for p in plans if budget is not None and p.peak <= budget]
    if not fits or budget is None:
        return None, least
    return _trim(c, min(fits, key=lambda p: (p.cost, p.peak)), budget), least


def _trim(c: GraphCosts, plan: Plan, budget: int) -> Plan:
    """Drop segments the budget does not need, costliest first. A price on recomputation takes equally priced
    segments (a model's identical layers) all or none, so the swept plan may save more than the budget asks."""
    while plan.segments:
        fewer = [plan_of(c, plan.segments[:k] + plan.segments[k + 1:]) for k in range(len(plan.segments))]
        fitting = [p for p in fewer if p.peak <= budget]
        if not fitting:
            return plan
        plan = min(fitting, key=lambda p: (p.cost, p.peak))
    return plan
